"""AutoencoderKL (encoder and decoder), computing what diffusers' PyTorch module does.

The parameter tree is that of diffusers 0.39's `FlaxAutoencoderKL.init_weights`. The
ResNet blocks and down/up blocks are the UNet's (unet.py) without time embedding; the VAE's
own parts are its single-head mid-block attention and the encoder/decoder skeletons.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from diffusion.nn import read_config, refuse
from diffusion.nn.attention import attention
from diffusion.nn.layers import Dense, Dtype, GroupNorm, conv
from diffusion.nn.unet import DownBlock2D, ResnetBlock2D, UpBlock2D

EPS = 1e-6  # every GroupNorm of diffusers' VAE


@dataclasses.dataclass(frozen=True)
class VAEConfig:
    """The fields of an AutoencoderKL config.json; defaults are PyTorch diffusers' (0.42).
    `scaling_factor`, `shift_factor`, `latents_mean` and `latents_std` are for the pipeline
    (the module does not use them); `force_upcast` is ignored."""

    in_channels: int = 3
    out_channels: int = 3
    down_block_types: tuple[str, ...] = ("DownEncoderBlock2D",)
    up_block_types: tuple[str, ...] = ("UpDecoderBlock2D",)
    block_out_channels: tuple[int, ...] = (64,)
    layers_per_block: int = 1
    latent_channels: int = 4
    norm_num_groups: int = 32
    sample_size: int | tuple[int, int] = 32
    scaling_factor: float = 0.18215
    shift_factor: float | None = None
    latents_mean: tuple[float, ...] | None = None
    latents_std: tuple[float, ...] | None = None
    use_quant_conv: bool = True  # False in Flux's 16-channel VAE: no 1x1 conv after the encoder
    use_post_quant_conv: bool = True  # nor before the decoder

    FIXED: ClassVar[Mapping[str, Any]] = {"act_fn": "silu", "mid_block_add_attention": True}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> VAEConfig:
        """From a diffusers config.json dict (PyTorch or Flax); see `diffusion.nn.read_config`."""
        return read_config(cls, d, cls.FIXED)

    def __post_init__(self) -> None:
        n = len(self.block_out_channels)
        for key, kinds, kind in (("down_block_types", self.down_block_types, "DownEncoderBlock2D"),
                                 ("up_block_types", self.up_block_types, "UpDecoderBlock2D")):
            if len(kinds) != n or any(k != kind for k in kinds):
                raise refuse(key, kinds, f"{n} blocks (one per block_out_channels), all {kind!r}")
        if not isinstance(self.layers_per_block, int):
            raise refuse("layers_per_block", self.layers_per_block, "only a single int is implemented")

    @property
    def scale_factor(self) -> int:
        """Pixels per latent, each way."""
        return 2 ** (len(self.block_out_channels) - 1)


class AttentionBlock(nn.Module):
    """The mid block's single-head self-attention over all positions, with a residual."""

    groups: int
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        b, height, width, c = x.shape
        h = GroupNorm(self.groups, EPS, self.dtype, name="group_norm")(x).reshape(b, height * width, c)
        q, k, v = (Dense(c, dtype=self.dtype, name=name)(h) for name in ("query", "key", "value"))
        h = Dense(c, dtype=self.dtype, name="proj_attn")(attention(q, k, v, heads=1))
        return x + h.reshape(b, height, width, c)


class MidBlock(nn.Module):
    """ResNet, attention, ResNet."""

    groups: int
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = x.shape[-1]
        x = ResnetBlock2D(c, self.groups, EPS, self.dtype, name="resnets_0")(x)
        x = AttentionBlock(self.groups, self.dtype, name="attentions_0")(x)
        return ResnetBlock2D(c, self.groups, EPS, self.dtype, name="resnets_1")(x)


class Encoder(nn.Module):
    """Pixels (NHWC) -> latent moments (mean and log-variance channels), before quant_conv."""

    config: VAEConfig
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        channels, groups, n = cfg.block_out_channels, cfg.norm_num_groups, len(cfg.block_out_channels)
        x = conv(channels[0], 3, "conv_in", self.dtype)(x)
        for i in range(n):
            x, _ = DownBlock2D(channels[i], cfg.layers_per_block, groups, EPS, add_downsample=i < n - 1,
                               downsample_padding=0, dtype=self.dtype, name=f"down_blocks_{i}")(x)
        x = MidBlock(groups, self.dtype, name="mid_block")(x)
        x = nn.silu(GroupNorm(groups, EPS, self.dtype, name="conv_norm_out")(x))
        return conv(2 * cfg.latent_channels, 3, "conv_out", self.dtype)(x)


class Decoder(nn.Module):
    """Latents (NHWC, after post_quant_conv) -> pixels."""

    config: VAEConfig
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        channels, groups, n = cfg.block_out_channels, cfg.norm_num_groups, len(cfg.block_out_channels)
        x = conv(channels[-1], 3, "conv_in", self.dtype)(x)
        x = MidBlock(groups, self.dtype, name="mid_block")(x)
        for i in range(n):
            x = UpBlock2D(channels[n - 1 - i], cfg.layers_per_block + 1, groups, EPS, add_upsample=i < n - 1,
                          dtype=self.dtype, name=f"up_blocks_{i}")(x)
        x = nn.silu(GroupNorm(groups, EPS, self.dtype, name="conv_norm_out")(x))
        return conv(cfg.out_channels, 3, "conv_out", self.dtype)(x)


class AutoencoderKL(nn.Module):
    """`encode` (image to image) and `decode` (every render); NCHW at both ends."""

    config: VAEConfig
    dtype: Dtype = jnp.float32

    def setup(self) -> None:
        latent = self.config.latent_channels
        self.encoder = Encoder(self.config, self.dtype)
        self.decoder = Decoder(self.config, self.dtype)
        identity = lambda x: x  # noqa: E731
        self.quant_conv = conv(2 * latent, 1, "quant_conv", self.dtype) if self.config.use_quant_conv else identity
        self.post_quant_conv = (conv(latent, 1, "post_quant_conv", self.dtype) if self.config.use_post_quant_conv
                                else identity)

    def encode(self, pixels: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(B, C, H, W) pixels in [-1, 1] -> the latent distribution's (mean, logvar), each
        (B, latent_channels, H / f, W / f); logvar clipped to [-30, 20] as PyTorch's
        DiagonalGaussianDistribution holds it."""
        moments = self.quant_conv(self.encoder(pixels.transpose(0, 2, 3, 1).astype(self.dtype)))
        mean, logvar = jnp.split(moments.transpose(0, 3, 1, 2), 2, axis=1)
        return mean, jnp.clip(logvar, -30.0, 20.0)

    def decode(self, latents: jax.Array) -> jax.Array:
        """(B, latent_channels, h, w) latents (already divided by scaling_factor) -> (B, C, h*f, w*f)."""
        h = self.post_quant_conv(latents.transpose(0, 2, 3, 1).astype(self.dtype))
        return self.decoder(h).transpose(0, 3, 1, 2)

    def __call__(self, pixels: jax.Array) -> jax.Array:
        """decode(mean of encode(pixels)): touches every parameter, so `init` creates them all."""
        return self.decode(self.encode(pixels)[0])

    def init_params(self, rng: jax.Array) -> dict:
        """Parameters of the checkpoints' shapes (under `jax.eval_shape`, the shapes alone)."""
        size = self.config.scale_factor
        return self.init(rng, jnp.zeros((1, self.config.in_channels, size, size)))["params"]
