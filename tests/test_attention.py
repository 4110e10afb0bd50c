"""The attention kernel rule (diffusion/nn/attention.py) for every farm shape per backend, and the
kernels that cannot run here checked another way: splash in Pallas' TPU interpret mode, the
chunked path with small chunks, cuDNN by the call it makes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from diffusion.nn import attention as attention_module
from diffusion.nn.attention import KERNELS, LAYOUTS, attention, choose, cudnn_accepts, cudnn_max_head_dim, use_kernel

# Per-device shapes at the farm's sizes, q (B, T, N, H) and k (B, S, N, H), B = 2 for guidance:
# SD 1.5 at 512x512 (heads 8 x 40 / 80 / 160), SDXL at 1024x1024 (heads of 64), SD 2's 64-token
# mid block (20 x 64), the VAE's mid block (one head of 512) at 512x512 and 1024x1024, CLIP.
# Columns: the kernel on cpu, cuda with bfloat16, cuda with float32 (also any dtype on rocm),
# tpu (any dtype).
FARM = [
    # site                      q                  S      causal  cpu      cuda bf16 cuda f32   tpu
    ("unet self 4096 sd15",     (2, 4096, 8, 40),  4096,  False, ("batch", "cudnn", "chunked", "splash")),
    ("unet cross 4096 sd15",    (2, 4096, 8, 40),  77,    False, ("batch", "cudnn", "heads", "splash")),
    ("unet self 4096 sdxl",     (2, 4096, 10, 64), 4096,  False, ("batch", "cudnn", "chunked", "splash")),
    ("unet cross 4096 sdxl",    (2, 4096, 10, 64), 77,    False, ("batch", "cudnn", "heads", "splash")),
    ("unet self 1024 sd15",     (2, 1024, 8, 80),  1024,  False, ("batch", "cudnn", "heads", "splash")),
    ("unet self 1024 sdxl",     (2, 1024, 20, 64), 1024,  False, ("batch", "cudnn", "chunked", "splash")),
    ("unet cross 1024 sdxl",    (2, 1024, 20, 64), 77,    False, ("batch", "cudnn", "heads", "splash")),
    ("unet self 256 sd15",      (2, 256, 8, 160),  256,   False, ("batch", "heads", "heads", "splash")),
    ("unet cross 256 sd15",     (2, 256, 8, 160),  77,    False, ("batch", "heads", "heads", "splash")),
    ("unet self 64 sd15 mid",   (2, 64, 8, 160),   64,    False, ("batch", "heads", "heads", "heads")),
    ("unet self 64 sd2 mid",    (2, 64, 20, 64),   64,    False, ("batch", "cudnn", "heads", "heads")),
    ("unet cross 64 sd2 mid",   (2, 64, 20, 64),   77,    False, ("batch", "cudnn", "heads", "heads")),
    ("vae mid 512px",           (1, 4096, 1, 512), 4096,  False, ("batch", "heads", "heads", "splash")),
    ("vae mid 1024px",          (1, 16384, 1, 512), 16384, False, ("batch", "chunked", "chunked", "splash")),
    ("clip-l causal 77",        (2, 77, 12, 64),   77,    True,  ("batch", "cudnn", "heads", "heads")),
    ("clip-bigg causal 77",     (2, 77, 20, 64),   77,    True,  ("batch", "cudnn", "heads", "heads")),
]


@pytest.mark.parametrize(("site", "q", "s", "causal", "want"), FARM, ids=[row[0] for row in FARM])
def test_choose_for_every_farm_shape(site: str, q: tuple[int, ...], s: int, causal: bool,
                                     want: tuple[str, str, str, str]) -> None:
    k = (q[0], s, q[2], q[3])
    cpu, cuda_half, cuda_float, tpu = want
    for dtype in (jnp.float32, jnp.bfloat16):
        assert choose("cpu", q, k, dtype, causal) == cpu
        assert choose("tpu", q, k, dtype, causal) == tpu
        assert choose("rocm", q, k, dtype, causal) == cuda_float  # no cuDNN there
    assert choose("cuda", q, k, jnp.bfloat16, causal) == cuda_half
    assert choose("cuda", q, k, jnp.float16, causal) == cuda_half
    assert choose("cuda", q, k, jnp.float32, causal) == cuda_float


def test_cudnn_accepts_what_jax_checks() -> None:
    q = (2, 256, 8, 64)
    assert cudnn_accepts(q, (2, 77, 8, 64), jnp.bfloat16, False)
    assert cudnn_accepts((2, 256, 8, 128), (2, 77, 8, 128), jnp.float16, False)
    assert not cudnn_accepts(q, (2, 77, 8, 64), jnp.float32, False)  # float16 / bfloat16 only
    assert not cudnn_accepts((2, 256, 8, 36), (2, 77, 8, 36), jnp.bfloat16, False)  # a multiple of 8
    assert not cudnn_accepts((2, 256, 8, 136), (2, 77, 8, 136), jnp.bfloat16, False)  # at most 128 here
    assert not cudnn_accepts(q, (2, 77, 8, 32), jnp.bfloat16, False)  # q and k head dims differ
    assert not cudnn_accepts(q, (1, 77, 8, 64), jnp.bfloat16, False)  # batches differ
    assert cudnn_accepts(q, q, jnp.bfloat16, True)
    assert not cudnn_accepts(q, (2, 77, 8, 64), jnp.bfloat16, True)  # causal self-attention only


def test_the_cudnn_head_dim_cap_is_jaxs_for_this_machines_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """jax's trace reads the local GPU's compute capability: 256 from Hopper on (SD 1.x's 160-wide
    heads on cuDNN on an H100 worker), 128 on older GPUs and with none (a GPU target planned here)."""
    assert [cudnn_max_head_dim(c) for c in (None, "8.0", "8.9", "9.0", "10.0")] == [128, 128, 128, 256, 256]
    sd15_heads = ((2, 256, 8, 160), (2, 77, 8, 160), jnp.bfloat16, False)
    monkeypatch.setattr(attention_module, "local_gpu_capability", lambda: "9.0")
    assert cudnn_accepts(*sd15_heads)
    assert not cudnn_accepts((2, 4096, 1, 512), (2, 4096, 1, 512), jnp.bfloat16, False)  # the VAE's head
    monkeypatch.setattr(attention_module, "local_gpu_capability", lambda: "8.0")
    assert not cudnn_accepts(*sd15_heads)


def _inputs(t: int, s: int, heads: int, dim: int, dtype: jnp.dtype = jnp.float32) -> list[jax.Array]:
    rng = np.random.default_rng(t * s + dim)
    return [jnp.asarray(rng.standard_normal((2, n, heads * dim)), dtype) for n in (t, s, s)]


def _run(kernel: str, q: jax.Array, k: jax.Array, v: jax.Array, heads: int, causal: bool) -> np.ndarray:
    with use_kernel(kernel):  # a fresh function: the kernel is read at trace time
        return np.asarray(jax.jit(lambda q, k, v: attention(q, k, v, heads, causal))(q, k, v), np.float32)


@pytest.mark.parametrize(("t", "s", "dim", "causal"), [
    (256, 77, 40, False),  # cross-attention: keys padded to 128 and masked, head dim to 128
    (256, 77, 64, True),
    (200, 200, 40, True),  # queries and keys padded, causal across the padding
    (200, 200, 64, False),
    (128, 128, 160, False),  # head dim padded to 256
])
def test_splash_matches_xla_in_interpret_mode(t: int, s: int, dim: int, causal: bool) -> None:
    q, k, v = _inputs(t, s, 2, dim)
    with pltpu.force_tpu_interpret_mode():
        got = _run("splash", q, k, v, 2, causal)
    np.testing.assert_allclose(got, _run("heads", q, k, v, 2, causal), rtol=1e-5, atol=1e-5)


def test_splash_in_bfloat16_and_chosen_on_tpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a TPU job traces without a forced kernel: q scaled in bfloat16 before the kernel."""
    monkeypatch.setattr(attention_module, "current_backend", lambda: "tpu")
    q, k, v = _inputs(256, 77, 2, 40, jnp.bfloat16)
    with pltpu.force_tpu_interpret_mode():
        got = np.asarray(jax.jit(lambda q, k, v: attention(q, k, v, 2))(q, k, v), np.float32)
    np.testing.assert_allclose(got, _run("heads", q, k, v, 2, False), rtol=0.02, atol=0.02)


@pytest.mark.parametrize("causal", [False, True])
def test_chunked_matches_xla(monkeypatch: pytest.MonkeyPatch, causal: bool) -> None:
    """Chunks of 3 of 10 queries: three scanned chunks and a remainder of one."""
    heads, s = 3, 7
    monkeypatch.setattr(attention_module, "CHUNK_SCORES", 3 * heads * s)
    q, k, v = _inputs(10, s, heads, 8)
    with use_kernel("chunked"):
        assert "scan" in str(jax.make_jaxpr(lambda q, k, v: attention(q, k, v, heads, causal))(q, k, v))
    np.testing.assert_allclose(_run("chunked", q, k, v, heads, causal), _run("heads", q, k, v, heads, causal),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("causal", [False, True])
def test_cudnn_kernel_asks_jax_for_cudnn(monkeypatch: pytest.MonkeyPatch, causal: bool) -> None:
    """cuDNN cannot run here: a CUDA bfloat16 job must reach jax.nn.dot_product_attention with
    implementation="cudnn" and its causal flag (run here by XLA instead)."""
    calls = []
    xla = jax.nn.dot_product_attention

    def recorded(q: jax.Array, k: jax.Array, v: jax.Array, **kwargs: object) -> jax.Array:
        calls.append(kwargs)
        return xla(q, k, v, is_causal=kwargs["is_causal"], implementation="xla")

    monkeypatch.setattr(jax.nn, "dot_product_attention", recorded)
    monkeypatch.setattr(attention_module, "current_backend", lambda: "cuda")
    q, k, v = _inputs(16, 16, 2, 8, jnp.bfloat16)
    got = np.asarray(jax.jit(lambda q, k, v: attention(q, k, v, 2, causal))(q, k, v), np.float32)
    assert calls == [{"is_causal": causal, "implementation": "cudnn"}]
    np.testing.assert_allclose(got, _run("batch", q, k, v, 2, causal), rtol=0.02, atol=0.02)


def test_cpu_default_is_the_batch_layout() -> None:
    """The CPU pixels (tests/test_reference.py) stay the "batch" layout's, bit for bit."""
    assert attention_module.current_backend() == "cpu"
    q, k, v = _inputs(64, 77, 4, 8)
    got = np.asarray(jax.jit(lambda q, k, v: attention(q, k, v, 4))(q, k, v))
    np.testing.assert_array_equal(got, _run("batch", q, k, v, 4, False))


def test_use_kernel_names() -> None:
    assert set(LAYOUTS) < set(KERNELS)
    with pytest.raises(ValueError, match="must be one of"):
        with use_kernel("flash"):
            pass
