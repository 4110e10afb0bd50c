"""Attention: the one place the model layer computes softmax(q k^T / sqrt(H)) v.

Every attention in worker/nn (the UNet's self- and cross-attention, the VAE's mid-block
attention, CLIP's causal self-attention) projects q, k and v itself and calls `attention`
here, so the head layout and the kernel are chosen once for all of them. Softmax runs in
float32 whatever the compute dtype, as PyTorch's `upcast_attention` / `upcast_softmax` and
transformers' CLIP do.

Head layouts (`LAYOUTS`), numerically the same (float32 sums in another order):
- "heads": q, k, v reshaped to (B, T, N, H) and handed to `jax.nn.dot_product_attention`;
- "batch": heads folded into the batch, (B*N, T, H), and two batched matmuls, as diffusers'
  Flax attention does by default;
- "split": diffusers' `split_head_dim` variant, einsums on (B, T, N, H) as they are.
On accelerators attention goes through `jax.nn.dot_product_attention` ("heads"), the entry
point where XLA's and vendors' fused kernels are chosen (cuDNN flash attention on GPUs). On
XLA:CPU it copies the (T, S) score matrix to transpose it, and "batch" is faster there:
bench/modules.py, ms per UNet call (tiny SD / SDXL, batch 16, 32x32 latents, 2-core CPU):
heads 177 / 183, batch 163 / 164, split 296 / 277, diffusers' Flax UNet 177 / 173; handing it
the folded heads as (B*N, T, 1, H) does not help (26 ms against 7 ms for "batch" at 16 x 4
heads x 256 tokens). So the default is "batch" on a CPU and "heads" elsewhere
(`default_layout`); run the benchmark on a new backend and change that one function if the
figures say so.
The layout is read when a function is traced: `with use_layout("heads"): jax.jit(f)(...)`
with a fresh `f` per layout (jit caches traces per function, not per layout).

TPU: `jax.nn.dot_product_attention(..., implementation=None)` lowers to plain XLA there
(its "cudnn" implementation is GPU only). A Pallas flash-attention kernel,
`jax.experimental.pallas.ops.tpu.flash_attention.flash_attention(q, k, v, causal=...,
sm_scale=H ** -0.5)` on (B, N, T, H) arrays, would plug in here as one more layout,
transposing from the (B, T, N, H) split; its blocks want sequence lengths in multiples of
128, so the 77-token cross-attention would pad k, v and mask the padding (segment_ids).
Nothing outside this file would change.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax
import jax.numpy as jnp

LAYOUTS = ("heads", "batch", "split")
_layout: contextvars.ContextVar[str | None] = contextvars.ContextVar("attention_layout", default=None)


def default_layout() -> str:
    """The fastest measured layout on the backend attention is traced for (see above)."""
    return "batch" if jax.default_backend() == "cpu" else "heads"


@contextlib.contextmanager
def use_layout(name: str) -> Iterator[None]:
    """Trace attention with head layout `name` inside the block (benchmarks, tests)."""
    if name not in LAYOUTS:
        raise ValueError(f"attention layout {name!r}: must be one of {LAYOUTS}")
    token = _layout.set(name)
    try:
        yield
    finally:
        _layout.reset(token)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, heads: int, causal: bool = False) -> jax.Array:
    """Multi-head attention of q (B, T, heads*H) over k, v (B, S, heads*H) -> (B, T, heads*H),
    scaled by 1/sqrt(H); `causal` lets position t see positions <= t only (CLIP)."""
    b, t, inner = q.shape
    split = lambda x: x.reshape(x.shape[0], x.shape[1], heads, inner // heads)  # noqa: E731
    q, k, v = split(q), split(k), split(v)
    layout = _layout.get() or default_layout()
    if layout == "heads":
        out = jax.nn.dot_product_attention(q, k, v, is_causal=causal)
    elif layout == "batch":
        out = _folded_attention(q, k, v, causal)
    else:
        out = _split_attention(q, k, v, causal)
    return out.reshape(b, t, inner)


def _scores_softmax(scores: jax.Array, scale: float, causal: bool, dtype: jnp.dtype) -> jax.Array:
    """softmax(scale * scores) over the last axis of float32 scores, keys after the query
    masked if causal; the probabilities in `dtype`."""
    scores = scores * scale
    if causal:
        t, s = scores.shape[-2:]
        scores = jnp.where(jnp.tril(jnp.ones((t, s), bool)), scores, jnp.finfo(jnp.float32).min)
    return jax.nn.softmax(scores, axis=-1).astype(dtype)


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
