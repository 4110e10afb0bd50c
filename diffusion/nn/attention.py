"""Attention: the one place the model layer computes softmax(q k^T / sqrt(H)) v.

Every attention in diffusion/nn (the UNet's self- and cross-attention, the VAE's mid-block
attention, CLIP's causal self-attention) projects q, k and v itself and calls `attention`
here, so the kernel is chosen once for all of them, per backend and shape, by `choose`.
Softmax runs in float32 whatever the compute dtype, as PyTorch's `upcast_attention` /
`upcast_softmax` and transformers' CLIP do (cuDNN and splash do so inside their kernels).

Kernels (`KERNELS`):
- the XLA head layouts (`LAYOUTS`), numerically the same (float32 sums in another order):
  "heads": `jax.nn.dot_product_attention(implementation="xla")` on (B, T, N, H); "batch":
  heads folded into the batch, (B*N, T, H), two batched matmuls, as diffusers' Flax attention
  does by default; "split": diffusers' `split_head_dim` variant, einsums on (B, T, N, H);
- "chunked": query chunks one after another (`lax.map`), each against all keys, so the
  whole (N, T, S) score matrix of an image never exists at once;
- "cudnn": cuDNN flash attention, `jax.nn.dot_product_attention(implementation="cudnn")`
  (CUDA GPUs, float16 / bfloat16 only);
- "splash": the Pallas TPU splash-attention kernel, on (B, N, T, H) padded to its blocks.

The rule (`choose`), GPU and TPU figures unmeasured (no device where it was written):
- CPU: "batch" everywhere. ms per UNet call (tiny SD / SDXL, batch 16,
  32x32 latents, 2-core CPU): heads 177 / 183, batch 163 / 164, split 296 / 277, diffusers'
  Flax UNet 177 / 173 ("heads" copies the (T, S) scores to transpose them on XLA:CPU).
  The CPU pixels in tests/test_reference.py are this path's.
- CUDA: "cudnn" wherever `cudnn_accepts` (the checks of jax/_src/cudnn/
  fused_attention_stablehlo.py, whose head-dim cap reads this machine's GPU: 256 on Hopper
  and later, else 128): every UNet and CLIP attention of a float16 / bfloat16 job, but for
  SD 1.x's 160-wide heads where the GPU is older than Hopper or absent (a plan compiled
  for a GPU target on a machine without one).
- TPU: "splash" for 128 queries or more (`SPLASH_MIN_QUERIES`): every UNet self- and
  cross-attention down to 256 tokens, and the VAE's. Its blocks are 128-multiples, so the
  77 text keys are padded to 128 and masked (segment ids), head dims padded with zeros to a
  multiple of 128 (q scaled by the true 1/sqrt(H) first), and queries to a block multiple;
  below 128 queries (the 64-token UNet level, CLIP's 77) padding would at least double the
  work of a few tiles, and XLA keeps them.
- Elsewhere (float32 on a GPU, heads wider than cuDNN takes, the VAE's one 512-wide head
  on a GPU, TPU sequences under 128 queries, other backends): "heads" while one image's
  scores, N*T*S float32, fit in `CHUNK_SCORES` (2**24, 64 MiB), where one matmul beats a
  loop; "chunked" beyond, in chunks of that size: SD's VAE at 1024x1024 (16,384 tokens)
  would hold 1 GiB of scores per image, a float32 4096-token UNet self-attention 512 MiB.
  Whether "batch" beats "heads" off the CPU too is for a device to say (time the two with `use_kernel`).

In a program partitioned over a (data, model) mesh (diffusion/placement.py), q, k and v are
constrained to the batch over `data` and, in the network a family splits (the denoiser,
`diffusion.sharding.tensor_parallel`), the heads over `model`; the custom kernels (cuDNN,
splash) run inside a `shard_map` on each device's part, since XLA cannot partition a custom
call ("Mosaic kernels cannot be automatically partitioned").

`with use_kernel(name): jax.jit(f)(...)` forces a kernel (benchmarks, tests), and
`with for_backend("tpu"): ...` chooses as on that backend (a program compiled here for a
target's devices, diffusion/placement.py); both are read when a function is traced, so use a
fresh `f` per choice (jit caches traces per function).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from functools import partial

import jax
import jax.extend.backend
import jax.numpy as jnp

from diffusion.sharding import DATA, heads_axis, partition

LAYOUTS = ("heads", "batch", "split")  # the XLA paths, which run on every backend
CUSTOM_KERNELS = ("cudnn", "splash")  # custom calls, which XLA cannot partition
KERNELS = (*LAYOUTS, "chunked", *CUSTOM_KERNELS)
CHUNK_SCORES = 2 ** 24  # float32 scores per image (64 MiB) beyond which "chunked" replaces "heads"
SPLASH_MIN_QUERIES = 128  # splash's smallest block
SPLASH_BLOCK = 512  # splash's query and key blocks where the sequences are that long

_kernel: contextvars.ContextVar[str | None] = contextvars.ContextVar("attention_kernel", default=None)


@dataclasses.dataclass(frozen=True)
class Call:
    """One attention as traced: the kernel it took, for T queries over S keys in N heads of H."""

    kernel: str
    queries: int
    keys: int
    heads: int
    head_dim: int


_calls: contextvars.ContextVar[list[Call] | None] = contextvars.ContextVar("attention_calls", default=None)
_backend: contextvars.ContextVar[str | None] = contextvars.ContextVar("attention_backend", default=None)


def traced_as() -> tuple[str | None, str]:
    """What attention here is traced as: the kernel `use_kernel` forces (None: `choose`'s), and
    the backend (`current_backend`). A count kept from one trace holds where these are the same."""
    return _kernel.get(), current_backend()


def current_backend() -> str:
    """The backend attention is traced for: "cpu", "tpu", "cuda", "rocm", ... (cuDNN is CUDA's):
    the one `for_backend` names, else this process's default."""
    target = _backend.get()
    if target is not None:
        return target
    backend = jax.default_backend()
    if backend == "gpu":
        return "rocm" if "rocm" in jax.extend.backend.get_backend().platform_version else "cuda"
    return backend


def cudnn_max_head_dim(capability: str | None) -> int:
    """jax's cap on cuDNN flash attention's head dim for a GPU of compute `capability` ("9.0";
    None: no GPU): 256 from Hopper (9.0) on, else 128."""
    return 256 if capability is not None and int(capability.split(".")[0]) >= 9 else 128


@functools.cache
def local_gpu_capability() -> str | None:
    """This machine's first CUDA GPU's compute capability, None without one: what jax's
    check reads when it traces cuDNN attention, whatever devices the program is for."""
    try:
        device = jax.devices("cuda")[0]
    except RuntimeError:  # no CUDA backend in this process
        return None
    return getattr(device, "compute_capability", None)


def cudnn_accepts(q_shape: Sequence[int], k_shape: Sequence[int], dtype: jnp.dtype, causal: bool) -> bool:
    """Whether cuDNN flash attention takes q (B, T, N, H) over k, v (B, S, N, H): jax's checks
    (float16 / bfloat16, same batch and head dim, head dim a multiple of 8 and at most
    `cudnn_max_head_dim` of this machine's GPU), and causal only for self-attention (its
    diagonal then needs no convention)."""
    (b, t, _, h), (bk, s, _, hk) = q_shape, k_shape
    return (jnp.dtype(dtype) in (jnp.float16, jnp.bfloat16) and b == bk and h == hk
            and h % 8 == 0 and h <= cudnn_max_head_dim(local_gpu_capability()) and (not causal or t == s))


def choose(backend: str, q_shape: Sequence[int], k_shape: Sequence[int], dtype: jnp.dtype, causal: bool) -> str:
    """The kernel (one of `KERNELS`) for q (B, T, N, H) over k, v (B, S, N, H) on `backend`
    (as `current_backend` names it); the rule is in the module docstring."""
    if backend == "cpu":
        return "batch"
    if backend == "cuda" and cudnn_accepts(q_shape, k_shape, dtype, causal):
        return "cudnn"
    _, t, n, _ = q_shape
    if backend == "tpu" and t >= SPLASH_MIN_QUERIES:
        return "splash"
    return "chunked" if n * t * k_shape[1] > CHUNK_SCORES else "heads"


def default_layout() -> str:
    """The XLA layout `choose` takes on this backend where no kernel applies."""
    return "batch" if current_backend() == "cpu" else "heads"


@contextlib.contextmanager
def use_kernel(name: str) -> Iterator[None]:
    """Trace attention with kernel `name` inside the block, whatever `choose` says."""
    if name not in KERNELS:
        raise ValueError(f"attention kernel {name!r}: must be one of {KERNELS}")
    token = _kernel.set(name)
    try:
        yield
    finally:
        _kernel.reset(token)


@contextlib.contextmanager
def for_backend(name: str) -> Iterator[None]:
    """Trace attention inside the block as for devices of backend `name` (as `current_backend`
    names them): a program compiled here for a target's devices (a TPU topology on a CPU
    machine) takes the kernels it would take there."""
    token = _backend.set(name)
    try:
        yield
    finally:
        _backend.reset(token)


use_layout = use_kernel  # its name when it chose among LAYOUTS only (tests)


@contextlib.contextmanager
def recording() -> Iterator[list[Call]]:
    """The attentions traced inside the block, in order, each with the kernel it took
    (`renderfarm plan` reports them; a loop's body is traced once, so a call site counts once)."""
    calls: list[Call] = []
    token = _calls.set(calls)
    try:
        yield calls
    finally:
        _calls.reset(token)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, heads: int, causal: bool = False,
              bias: jax.Array | None = None, scale: float | None = None) -> jax.Array:
    """Multi-head attention of q (B, T, heads*H) over k, v (B, S, heads*H) -> (B, T, heads*H),
    scaled by `scale` (default 1/sqrt(H)); `causal` lets position t see positions <= t only
    (CLIP). A `bias` (broadcast to (B, heads, T, S)) is added to the scores before the softmax
    (T5's relative positions): only jax's XLA attention takes one, so it runs that."""
    b, t, inner = q.shape
    split = lambda x: x.reshape(x.shape[0], x.shape[1], heads, inner // heads)  # noqa: E731
    q, k, v = split(q), split(k), split(v)
    if bias is not None or scale is not None:
        _record("heads", q.shape, k.shape)
        out = jax.nn.dot_product_attention(q, k, v, bias=bias, scale=scale, is_causal=causal, implementation="xla")
        return out.reshape(b, t, inner)
    kernel = _kernel.get() or choose(current_backend(), q.shape, k.shape, q.dtype, causal)
    _record(kernel, q.shape, k.shape)
    spec = partition(q.shape, (DATA, None, heads_axis(), None))
    if spec is None:
        return _IMPLEMENTATIONS[kernel](q, k, v, causal).reshape(b, t, inner)
    q, k, v = (jax.lax.with_sharding_constraint(x, spec) for x in (q, k, v))
    run = partial(_IMPLEMENTATIONS[kernel], causal=causal)
    if kernel in CUSTOM_KERNELS:  # XLA cannot partition a custom call: each device runs its own part
        run = jax.shard_map(run, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False)
    return jax.lax.with_sharding_constraint(run(q, k, v), spec).reshape(b, t, inner)


def _record(kernel: str, q_shape: Sequence[int], k_shape: Sequence[int]) -> None:
    """Note the kernel an attention took, inside a `recording` block."""
    calls = _calls.get()
    if calls is not None:
        calls.append(Call(kernel, q_shape[1], k_shape[1], q_shape[2], q_shape[3]))


def _scores_softmax(scores: jax.Array, scale: float, causal: bool, dtype: jnp.dtype) -> jax.Array:
    """softmax(scale * scores) over the last axis of float32 scores, keys after the query
    masked if causal; the probabilities in `dtype`."""
    scores = scores * scale
    if causal:
        t, s = scores.shape[-2:]
        scores = jnp.where(jnp.tril(jnp.ones((t, s), bool)), scores, jnp.finfo(jnp.float32).min)
    return jax.nn.softmax(scores, axis=-1).astype(dtype)


def _xla_attention(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool) -> jax.Array:
    """jax's reference attention on (B, T, N, H), float32 scores and softmax."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")


def _folded_attention(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool) -> jax.Array:
    """diffusers' default: heads folded into the batch, (B*N, T, H), two batched matmuls."""
    b, t, n, h = q.shape
    fold = lambda x: x.transpose(0, 2, 1, 3).reshape(b * n, x.shape[1], h)  # noqa: E731
    q, k, v = fold(q), fold(k), fold(v)
    probs = _scores_softmax(jnp.einsum("bth,bsh->bts", q, k, preferred_element_type=jnp.float32),
                            h ** -0.5, causal, v.dtype)
    return jnp.einsum("bts,bsh->bth", probs, v).reshape(b, n, t, h).transpose(0, 2, 1, 3)


def _split_attention(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool) -> jax.Array:
    """diffusers' split_head_dim variant: einsums on (B, T, N, H) as they are."""
    scores = jnp.einsum("btnh,bsnh->bnts", q, k, preferred_element_type=jnp.float32)
    probs = _scores_softmax(scores, q.shape[-1] ** -0.5, causal, v.dtype)
    return jnp.einsum("bnts,bsnh->btnh", probs, v)


def _chunked_attention(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool) -> jax.Array:
    """Queries in chunks of at most CHUNK_SCORES / (N*S), one chunk after another, each
    against all keys: the memory of one chunk's scores instead of all of them."""
    _, t, n, h = q.shape
    s = k.shape[1]

    def one_query(query: tuple[jax.Array, jax.Array]) -> jax.Array:
        q_t, position = query  # (B, N, H) and its index; lax.map vmaps this over a chunk
        scores = jnp.einsum("bnh,bsnh->bns", q_t, k, preferred_element_type=jnp.float32)
        if causal:
            scores = jnp.where(jnp.arange(s) <= position, scores, -jnp.inf)
        return jnp.einsum("bns,bsnh->bnh", _scores_softmax(scores, h ** -0.5, False, v.dtype), v)

    out = jax.lax.map(one_query, (q.transpose(1, 0, 2, 3), jnp.arange(t)),
                      batch_size=max(1, CHUNK_SCORES // (n * s)))
    return out.transpose(1, 0, 2, 3)


def _cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool) -> jax.Array:
    """cuDNN flash attention on (B, T, N, H) (raises where cuDNN is missing)."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool) -> jax.Array:
    """Splash attention with the batch folded into the heads, (B*N, T, H): one kernel call,
    no vmap (which this jax's TPU interpret mode cannot run). Padded to its blocks: queries and keys to a block multiple (padded keys in
    segment 0, masked; every query in segment 1, so no row is all masked), head dims to a
    multiple of 128 with zeros, which change no dot product. The kernel does not scale, so
    q is scaled by the true 1/sqrt(H) before padding. Pallas's TPU code is imported here, where
    a program takes the kernel: every process that imports the networks would pay a tenth of
    a second for it otherwise."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

    b, t, n, h = q.shape
    s = k.shape[1]
    block_q = min(SPLASH_BLOCK, _round_up(t, 128))
    block_kv = min(SPLASH_BLOCK, _round_up(s, 128))
    t_pad, s_pad, h_pad = _round_up(t, block_q), _round_up(s, block_kv), _round_up(h, 128)

    def fold(x: jax.Array, length: int) -> jax.Array:  # (B, L, N, H) -> (B*N, length, h_pad)
        x = x.transpose(0, 2, 1, 3).reshape(b * n, x.shape[1], h)
        return jnp.pad(x, ((0, 0), (0, length - x.shape[1]), (0, h_pad - h)))

    mask = splash_mask.CausalMask((t_pad, s_pad)) if causal else splash_mask.FullMask((t_pad, s_pad))
    kernel = splash.make_splash_mha(
        splash_mask.MultiHeadMask([mask] * (b * n)), head_shards=1, q_seq_shards=1,
        block_sizes=splash.BlockSizes(block_q=block_q, block_kv=block_kv, block_kv_compute=block_kv))
    segments = splash.SegmentIds(q=jnp.ones(t_pad, jnp.int32), kv=(jnp.arange(s_pad) < s).astype(jnp.int32))
    out = kernel(fold(q * jnp.asarray(h ** -0.5, q.dtype), t_pad), fold(k, s_pad), fold(v, s_pad), segments)
    return out[:, :t, :h].reshape(b, n, t, h).transpose(0, 2, 1, 3)


_IMPLEMENTATIONS: dict[str, Callable[[jax.Array, jax.Array, jax.Array, bool], jax.Array]] = {
    "heads": _xla_attention, "batch": _folded_attention, "split": _split_attention,
    "chunked": _chunked_attention, "cudnn": _cudnn_attention, "splash": _splash_attention,
}
