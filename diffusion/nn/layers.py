"""The layers several of the networks share, each computing what its PyTorch module does:
PyTorch's convolution padding (UNet, VAE), the norms (GroupNorm: UNet, VAE; LayerNorm: UNet,
CLIP, Flux; RMSNorm: T5, Flux), the feed-forward (UNet, Flux) and the timestep embedding (UNet,
Flux)."""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from diffusion.sharding import split_packed

Dtype = Any  # a jnp dtype: the compute dtype of every module (parameters stay as given)


def conv(features: int, kernel: int, name: str, dtype: Dtype, stride: int = 1,
         padding: tuple[int, int] | None = None) -> nn.Conv:
    """PyTorch's Conv2d: `padding` (before, after) each spatial side, default kernel // 2 both."""
    pad = (kernel // 2, kernel // 2) if padding is None else padding
    return nn.Conv(features, (kernel, kernel), strides=(stride, stride), padding=(pad, pad), dtype=dtype, name=name)


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
        scale = self.param("scale", nn.initializers.ones, (c,))
        bias = self.param("bias", nn.initializers.zeros, (c,))
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
            y = y * self.param("scale", nn.initializers.ones, (c,)) + self.param("bias", nn.initializers.zeros, (c,))
        return y.astype(self.dtype)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * scale over the last axis, statistics in float32: T5's
    layer norm and torch.nn.RMSNorm (Flux's query and key norms)."""

    eps: float
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        x = x.astype(jnp.float32)
        return (x * jax.lax.rsqrt(jnp.square(x).mean(-1, keepdims=True) + self.eps) * scale).astype(self.dtype)


class GEGLU(nn.Module):
    """Gated GELU: the exact (erf) GELU, as PyTorch's GEGLU."""

    features: int
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        # hidden and gate columns, packed (interleaved where the layer is split: diffusion.sharding)
        h, gate = split_packed(nn.Dense(2 * self.features, dtype=self.dtype, name="proj")(x), (self.features,) * 2)
        return h * jax.nn.gelu(gate, approximate=False)


class TanhGELU(nn.Module):
    """diffusers' GELU(approximate="tanh"): a projection, then the tanh GELU."""

    features: int
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.nn.gelu(nn.Dense(self.features, dtype=self.dtype, name="proj")(x), approximate=True)


class FeedForward(nn.Module):
    """GEGLU (or, `gelu_tanh`, diffusers' "gelu-approximate": Flux) to 4x the width and back
    (diffusers' `FeedForward`, names net_0 and net_2)."""

    dtype: Dtype = jnp.float32
    gelu_tanh: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = (TanhGELU if self.gelu_tanh else GEGLU)(4 * x.shape[-1], self.dtype, name="net_0")(x)
        return nn.Dense(x.shape[-1], dtype=self.dtype, name="net_2")(h)


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
        x = nn.silu(nn.Dense(self.features, dtype=self.dtype, name="linear_1")(x))
        return nn.Dense(self.features, dtype=self.dtype, name="linear_2")(x)
