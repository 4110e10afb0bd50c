"""The layers every network is made of, each computing what its PyTorch module does: the
parameters (`param`), the linear layer, the convolution with PyTorch's padding and the
embedding table (every network), the norms (GroupNorm: UNet, VAE; LayerNorm: UNet, CLIP, Flux;
RMSNorm: T5, Flux), the feed-forward (UNet, Flux) and the timestep embedding (UNet, Flux).

Dense, Conv and Embed compute what flax's layers of those names compute, with the same
parameter names, so checkpoints in the Flax classes' trees load unchanged; they take their
parameters through `param`, not flax's `Module.param`."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.errors import ScopeParamShapeError

from diffusion.sharding import split_packed

Dtype = Any  # a jnp dtype: the compute dtype of every module (parameters stay as given)


def param(module: nn.Module, name: str, shape: Sequence[int],
          init: Callable[[tuple[int, ...], Any], jax.Array] = jnp.zeros) -> jax.Array:
    """`module`'s parameter `name` of `shape`: the model's own where it is applied (a flax
    error if it is missing or shaped otherwise), `init(shape, float32)` where it is initialised,
    which only ever gives a network's shapes (diffusion.nn.parameter_shapes; weights come from
    checkpoints or diffusion.tiny_parts' seeded values).

    flax's `Module.param` draws a key for every parameter at init and traces its initialiser
    again at every apply to check the shape: a fifth of the time it takes to trace the tiny
    models, which the test suite traces hundreds of times. Here the shape is compared as given."""
    shape = tuple(shape)
    if module.has_variable("params", name):
        value = module.get_variable("params", name)
        if jnp.shape(value) != shape:
            raise ScopeParamShapeError(name, module.scope.path_text, jnp.shape(value), shape)
        return value
    if not module.is_mutable_collection("params"):
        return module.param(name, init)  # raises flax's error naming the missing parameter
    module.scope.reserve(name, "params")
    value = init(shape, jnp.float32)
    module.put_variable("params", name, value)
    return value


def _cast(dtype: Dtype, *arrays: jax.Array | None) -> list[jax.Array | None]:
    return [None if a is None else jnp.asarray(a, dtype) for a in arrays]


class Dense(nn.Module):
    """torch.nn.Linear on the last axis: `kernel` (in, out) and `bias`, inputs and parameters
    cast to `dtype`, as flax's Dense."""

    features: int
    use_bias: bool = True
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = param(self, "kernel", (x.shape[-1], self.features))
        bias = param(self, "bias", (self.features,)) if self.use_bias else None
        x, kernel, bias = _cast(self.dtype, x, kernel, bias)
        y = jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))
        if bias is not None:
            y += jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
        return y


class Conv(nn.Module):
    """A 2-D convolution on NHWC: `kernel` (HWIO) and `bias`, as flax's Conv; `padding` "VALID"
    or (before, after) for each spatial axis."""

    features: int
    kernel_size: int
    stride: int = 1
    padding: str | tuple[tuple[int, int], tuple[int, int]] = "VALID"
    use_bias: bool = True
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        size = self.kernel_size
        kernel = param(self, "kernel", (size, size, x.shape[-1], self.features))
        bias = param(self, "bias", (self.features,)) if self.use_bias else None
        x, kernel, bias = _cast(self.dtype, x, kernel, bias)
        y = jax.lax.conv_general_dilated(x, kernel, (self.stride, self.stride),
                                         self.padding if isinstance(self.padding, str) else list(self.padding),
                                         lhs_dilation=(1, 1), rhs_dilation=(1, 1),
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
        if bias is not None:
            y += bias.reshape((1, 1, 1, self.features))
        return y


class Embed(nn.Module):
    """An embedding table (`embedding`, rows by id), cast to `dtype`, as flax's Embed."""

    num_embeddings: int
    features: int
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, ids: jax.Array) -> jax.Array:
        table = jnp.asarray(param(self, "embedding", (self.num_embeddings, self.features)), self.dtype)
        return jnp.take(table, ids, axis=0)


def conv(features: int, kernel: int, name: str, dtype: Dtype, stride: int = 1,
         padding: tuple[int, int] | None = None) -> Conv:
    """PyTorch's Conv2d: `padding` (before, after) each spatial side, default kernel // 2 both."""
    pad = (kernel // 2, kernel // 2) if padding is None else padding
    return Conv(features, kernel, stride, (pad, pad), dtype=dtype, name=name)


class GroupNorm(nn.Module):
    """torch.nn.GroupNorm on NHWC: float32 statistics over each group's channels and all
    positions, the variance from the centred values (two passes, as torch; E[x^2] - E[x]^2
    loses it on activations far from zero mean). Parameters `scale` and `bias` as flax's
    GroupNorm, whose use_fast_variance=False is the same but up to 4x slower on XLA:CPU:
    here every pass reduces over the positions with the channels innermost."""

    groups: int
    eps: float
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        b, c = x.shape[0], x.shape[-1]
        scale, bias = param(self, "scale", (c,), jnp.ones), param(self, "bias", (c,))
        positions = tuple(range(1, x.ndim - 1))
        per_channel = (b,) + (1,) * len(positions) + (c,)

        def group_mean(values: jax.Array) -> jax.Array:  # (b, c) -> each channel's group mean, (b, 1.., c)
            means = values.reshape(b, self.groups, c // self.groups).mean(-1, keepdims=True)
            return jnp.broadcast_to(means, (b, self.groups, c // self.groups)).reshape(per_channel)

        x = x.astype(jnp.float32)
        mean = group_mean(x.mean(positions))
        multiplier = jax.lax.rsqrt(group_mean(jnp.square(x - mean).mean(positions)) + self.eps) * scale
        return (x * multiplier + (bias - mean * multiplier)).astype(self.dtype)


class LayerNorm(nn.Module):
    """torch.nn.LayerNorm over the last axis (two-pass float32 statistics); parameters as
    flax's LayerNorm."""

    eps: float
    dtype: Dtype = jnp.float32
    affine: bool = True  # False: no scale and bias (elementwise_affine=False)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.astype(jnp.float32)
        centred = x - x.mean(-1, keepdims=True)
        y = centred * jax.lax.rsqrt(jnp.square(centred).mean(-1, keepdims=True) + self.eps)
        if self.affine:
            c = x.shape[-1]
            y = y * param(self, "scale", (c,), jnp.ones) + param(self, "bias", (c,))
        return y.astype(self.dtype)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * scale over the last axis, statistics in float32: T5's
    layer norm and torch.nn.RMSNorm (Flux's query and key norms)."""

    eps: float
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = param(self, "scale", (x.shape[-1],), jnp.ones)
        x = x.astype(jnp.float32)
        return (x * jax.lax.rsqrt(jnp.square(x).mean(-1, keepdims=True) + self.eps) * scale).astype(self.dtype)


class GEGLU(nn.Module):
    """Gated GELU: the exact (erf) GELU, as PyTorch's GEGLU."""

    features: int
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        # hidden and gate columns, packed (interleaved where the layer is split: diffusion.sharding)
        h, gate = split_packed(Dense(2 * self.features, dtype=self.dtype, name="proj")(x), (self.features,) * 2)
        return h * jax.nn.gelu(gate, approximate=False)


class TanhGELU(nn.Module):
    """diffusers' GELU(approximate="tanh"): a projection, then the tanh GELU."""

    features: int
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.nn.gelu(Dense(self.features, dtype=self.dtype, name="proj")(x), approximate=True)


class FeedForward(nn.Module):
    """GEGLU (or, `gelu_tanh`, diffusers' "gelu-approximate": Flux) to 4x the width and back
    (diffusers' `FeedForward`, names net_0 and net_2)."""

    dtype: Dtype = jnp.float32
    gelu_tanh: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = (TanhGELU if self.gelu_tanh else GEGLU)(4 * x.shape[-1], self.dtype, name="net_0")(x)
        return Dense(x.shape[-1], dtype=self.dtype, name="net_2")(h)


def timestep_embedding(t: jax.Array, dim: int, flip_sin_to_cos: bool, shift: float) -> jax.Array:
    """diffusers' `get_timestep_embedding` in float32, (N,) -> (N, dim), for float timesteps.

    The frequencies are a host constant computed with PyTorch's float32 steps
    (-ln(10000) * i, then / (dim/2 - shift)), exponentiated in float64 and rounded once. At
    t ~ 1000 an ulp of frequency moves the phase by ~6e-5; rounded so, 2 of SD's 160
    frequencies differ from torch.exp's float32 ones, against 16 with XLA's float32 exp."""
    half = dim // 2
    exponent = np.float32(-math.log(10000)) * np.arange(half, dtype=np.float32)
    exponent = exponent / np.float32(half - shift)
    freqs = np.exp(exponent.astype(np.float64)).astype(np.float32)
    phase = t.astype(jnp.float32)[:, None] * freqs[None]
    emb = jnp.concatenate([jnp.cos(phase), jnp.sin(phase)] if flip_sin_to_cos else [jnp.sin(phase), jnp.cos(phase)],
                          axis=-1)
    return jnp.pad(emb, ((0, 0), (0, dim % 2)))


class TimestepEmbedding(nn.Module):
    """Linear, SiLU, linear."""

    features: int
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.silu(Dense(self.features, dtype=self.dtype, name="linear_1")(x))
        return Dense(self.features, dtype=self.dtype, name="linear_2")(x)
