"""UNet2DConditionModel for SD 1.x, 2.x and XL, computing what diffusers' PyTorch module does.

The parameter tree is that of diffusers 0.39's `FlaxUNet2DConditionModel.init_weights`
(same paths, same shapes), so existing Flax checkpoints load unchanged. Activations are
NHWC inside (Flax convolutions) and NCHW at the boundary, as in diffusers.

The ResNet block, the down/upsamplers and the down/up block skeletons here are the VAE's
too (vae.py): its encoder and decoder blocks are these blocks without time embedding,
attention or skip connections. The layers other networks share too are layers.py's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from diffusion.nn import read_config, refuse
from diffusion.nn.attention import attention
from diffusion.nn.layers import (
    Dense,
    Dtype,
    FeedForward,
    GroupNorm,
    LayerNorm,
    TimestepEmbedding,
    conv,
    timestep_embedding,
)
from diffusion.sharding import DATA, constrain


@dataclasses.dataclass(frozen=True)
class UNetConfig:
    """The fields of a UNet2DConditionModel config.json that SD 1.x/2.x/XL use; defaults
    are PyTorch diffusers' (0.42)."""

    sample_size: int | tuple[int, int] | None = None  # native latent size; no effect on the computation
    in_channels: int = 4
    out_channels: int = 4
    down_block_types: tuple[str, ...] = ("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",)
    up_block_types: tuple[str, ...] = ("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3
    block_out_channels: tuple[int, ...] = (320, 640, 1280, 1280)
    layers_per_block: int = 2
    attention_head_dim: int | tuple[int, ...] = 8  # the number of heads (diffusers' naming)
    cross_attention_dim: int = 1280
    transformer_layers_per_block: int | tuple[int, ...] = 1
    use_linear_projection: bool = False
    upcast_attention: bool = False  # always so here: softmax runs in float32 (attention.py)
    only_cross_attention: bool | tuple[bool, ...] = False
    flip_sin_to_cos: bool = True
    freq_shift: float = 0
    norm_num_groups: int = 32
    norm_eps: float = 1e-5
    addition_embed_type: str | None = None
    addition_time_embed_dim: int | None = None
    projection_class_embeddings_input_dim: int | None = None

    # Keys that would change the computation; only these values are implemented.
    FIXED: ClassVar[Mapping[str, Any]] = {
        "act_fn": "silu", "center_input_sample": False, "mid_block_type": "UNetMidBlock2DCrossAttn",
        "mid_block_scale_factor": 1, "downsample_padding": 1, "resnet_time_scale_shift": "default",
        "num_attention_heads": None, "dual_cross_attention": False, "class_embed_type": None,
        "num_class_embeds": None, "class_embeddings_concat": False, "encoder_hid_dim": None,
        "encoder_hid_dim_type": None, "time_embedding_type": "positional", "time_embedding_dim": None,
        "time_embedding_act_fn": None, "timestep_post_act": None, "time_cond_proj_dim": None,
        "conv_in_kernel": 3, "conv_out_kernel": 3, "attention_type": "default",
        "reverse_transformer_layers_per_block": None,
    }
    DOWN_BLOCKS: ClassVar[tuple[str, ...]] = ("CrossAttnDownBlock2D", "DownBlock2D")
    UP_BLOCKS: ClassVar[tuple[str, ...]] = ("CrossAttnUpBlock2D", "UpBlock2D")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> UNetConfig:
        """From a diffusers config.json dict (PyTorch or Flax); see `diffusion.nn.read_config`."""
        return read_config(cls, d, cls.FIXED)

    def __post_init__(self) -> None:
        n = len(self.block_out_channels)
        for key, kinds, known in (("down_block_types", self.down_block_types, self.DOWN_BLOCKS),
                                  ("up_block_types", self.up_block_types, self.UP_BLOCKS)):
            if len(kinds) != n or any(kind not in known for kind in kinds):
                raise refuse(key, kinds, f"{n} blocks (one per block_out_channels) of {known}")
        for key in ("layers_per_block", "cross_attention_dim", "norm_num_groups"):
            if not isinstance(getattr(self, key), int):
                raise refuse(key, getattr(self, key), "only a single int is implemented")
        for key in ("attention_head_dim", "transformer_layers_per_block"):
            value = getattr(self, key)
            if not isinstance(value, int) and (len(value) != n or not all(isinstance(v, int) for v in value)):
                raise refuse(key, value, f"an int or {n} ints (one per block)")
        if any(np.atleast_1d(self.only_cross_attention)):
            raise refuse("only_cross_attention", self.only_cross_attention, "only False is implemented")
        if self.addition_embed_type not in (None, "text_time"):
            raise refuse("addition_embed_type", self.addition_embed_type, "only None and 'text_time' are implemented")
        if self.addition_embed_type and None in (self.addition_time_embed_dim,
                                                 self.projection_class_embeddings_input_dim):
            raise refuse("addition_embed_type", self.addition_embed_type,
                         "needs addition_time_embed_dim and projection_class_embeddings_input_dim")
        for channels, heads in zip(self.block_out_channels, self.heads):
            if channels % heads:
                raise refuse("attention_head_dim", self.attention_head_dim,
                             f"{heads} heads do not divide {channels} channels")

    @property
    def heads(self) -> tuple[int, ...]:
        """Attention heads per block (`num_attention_heads = attention_head_dim` in diffusers)."""
        return _per_block(self.attention_head_dim, len(self.block_out_channels))

    @property
    def depths(self) -> tuple[int, ...]:
        """Transformer blocks per attention, per block."""
        return _per_block(self.transformer_layers_per_block, len(self.block_out_channels))


def _per_block(value: int | Sequence[int], n: int) -> tuple[int, ...]:
    return (value,) * n if isinstance(value, int) else tuple(value)


# -------------------------------------------------------------------------- ResNets, resampling

class ResnetBlock2D(nn.Module):
    """diffusers' ResnetBlock2D ("default" time embedding, output scale 1); no `temb` in the VAE."""

    out_channels: int
    groups: int
    eps: float
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, temb: jax.Array | None = None) -> jax.Array:
        h = nn.silu(GroupNorm(self.groups, self.eps, self.dtype, name="norm1")(x))
        h = conv(self.out_channels, 3, "conv1", self.dtype)(h)
        if temb is not None:
            h = h + Dense(self.out_channels, dtype=self.dtype, name="time_emb_proj")(nn.silu(temb))[:, None, None]
        h = nn.silu(GroupNorm(self.groups, self.eps, self.dtype, name="norm2")(h))
        h = conv(self.out_channels, 3, "conv2", self.dtype)(h)
        if x.shape[-1] != self.out_channels:
            x = conv(self.out_channels, 1, "conv_shortcut", self.dtype)(x)
        return x + h


class Downsample2D(nn.Module):
    """Stride-2 3x3 convolution. `padding` 1 pads each side (UNet); 0 pads only the bottom
    and right by one (the VAE encoder's `downsample_padding=0`)."""

    channels: int
    padding: int
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return conv(self.channels, 3, "conv", self.dtype, stride=2, padding=(self.padding, 1))(x)


class Upsample2D(nn.Module):
    """Nearest-neighbour 2x upsampling, then a 3x3 convolution."""

    channels: int
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        b, h, w, c = x.shape
        x = jnp.broadcast_to(x[:, :, None, :, None], (b, h, 2, w, 2, c)).reshape(b, 2 * h, 2 * w, c)
        return conv(self.channels, 3, "conv", self.dtype)(x)


# ------------------------------------------------------------------------------ transformer

class CrossAttention(nn.Module):
    """diffusers' `Attention` as the UNet uses it: bias-free q/k/v, biased output projection."""

    heads: int
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, context: jax.Array | None = None) -> jax.Array:
        context = x if context is None else context
        dim = x.shape[-1]
        q = Dense(dim, use_bias=False, dtype=self.dtype, name="to_q")(x)
        k = Dense(dim, use_bias=False, dtype=self.dtype, name="to_k")(context)
        v = Dense(dim, use_bias=False, dtype=self.dtype, name="to_v")(context)
        return Dense(dim, dtype=self.dtype, name="to_out_0")(attention(q, k, v, self.heads))


class BasicTransformerBlock(nn.Module):
    """Self-attention, cross-attention to the text, GEGLU feed-forward; pre-LayerNorm residuals."""

    heads: int
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, context: jax.Array) -> jax.Array:
        norm = lambda name: LayerNorm(1e-5, self.dtype, name=name)  # noqa: E731
        # Each sublayer's output whole on the model axis (reduced there when the block is split).
        x = constrain(x + CrossAttention(self.heads, self.dtype, name="attn1")(norm("norm1")(x)), DATA)
        x = constrain(x + CrossAttention(self.heads, self.dtype, name="attn2")(norm("norm2")(x), context), DATA)
        return constrain(x + FeedForward(self.dtype, name="ff")(norm("norm3")(x)), DATA)


class Transformer2DModel(nn.Module):
    """GroupNorm (eps 1e-6, as PyTorch), projection in, transformer blocks, projection out, residual."""

    heads: int
    depth: int
    linear_projection: bool
    groups: int
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, context: jax.Array) -> jax.Array:
        b, height, width, c = x.shape
        h = GroupNorm(self.groups, 1e-6, self.dtype, name="norm")(x)
        if self.linear_projection:
            h = Dense(c, dtype=self.dtype, name="proj_in")(h.reshape(b, height * width, c))
        else:
            h = conv(c, 1, "proj_in", self.dtype)(h).reshape(b, height * width, c)
        for i in range(self.depth):
            h = BasicTransformerBlock(self.heads, self.dtype, name=f"transformer_blocks_{i}")(h, context)
        if self.linear_projection:
            h = Dense(c, dtype=self.dtype, name="proj_out")(h).reshape(b, height, width, c)
        else:
            h = conv(c, 1, "proj_out", self.dtype)(h.reshape(b, height, width, c))
        return h + x


# ----------------------------------------------------------------------------------- blocks

class DownBlock2D(nn.Module):
    """A UNet down block (CrossAttnDownBlock2D when `heads` is set, else DownBlock2D) or,
    called without `temb`, the VAE's DownEncoderBlock2D. Returns the output and the states
    the up blocks take as skip connections."""

    out_channels: int
    num_layers: int
    groups: int
    eps: float
    add_downsample: bool
    heads: int | None = None
    depth: int = 1
    linear_projection: bool = False
    downsample_padding: int = 1
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, temb: jax.Array | None = None,
                 context: jax.Array | None = None) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        skips = []
        for i in range(self.num_layers):
            x = ResnetBlock2D(self.out_channels, self.groups, self.eps, self.dtype, name=f"resnets_{i}")(x, temb)
            if self.heads:
                x = Transformer2DModel(self.heads, self.depth, self.linear_projection, self.groups, self.dtype,
                                       name=f"attentions_{i}")(x, context)
            skips.append(x)
        if self.add_downsample:
            x = Downsample2D(self.out_channels, self.downsample_padding, self.dtype, name="downsamplers_0")(x)
            skips.append(x)
        return x, tuple(skips)


class UpBlock2D(nn.Module):
    """A UNet up block (CrossAttnUpBlock2D when `heads` is set, else UpBlock2D), each ResNet
    taking the next skip connection (the newest first); without skips and `temb`, the VAE's
    UpDecoderBlock2D."""

    out_channels: int
    num_layers: int
    groups: int
    eps: float
    add_upsample: bool
    heads: int | None = None
    depth: int = 1
    linear_projection: bool = False
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, skips: tuple[jax.Array, ...] = (), temb: jax.Array | None = None,
                 context: jax.Array | None = None) -> jax.Array:
        for i in range(self.num_layers):
            if skips:
                x = jnp.concatenate([x, skips[-1 - i]], axis=-1)
            x = ResnetBlock2D(self.out_channels, self.groups, self.eps, self.dtype, name=f"resnets_{i}")(x, temb)
            if self.heads:
                x = Transformer2DModel(self.heads, self.depth, self.linear_projection, self.groups, self.dtype,
                                       name=f"attentions_{i}")(x, context)
        if self.add_upsample:
            x = Upsample2D(self.out_channels, self.dtype, name="upsamplers_0")(x)
        return x


class UNetMidBlock2DCrossAttn(nn.Module):
    """ResNet, transformer, ResNet at the lowest resolution."""

    groups: int
    eps: float
    heads: int
    depth: int
    linear_projection: bool
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, temb: jax.Array, context: jax.Array) -> jax.Array:
        c = x.shape[-1]
        x = ResnetBlock2D(c, self.groups, self.eps, self.dtype, name="resnets_0")(x, temb)
        x = Transformer2DModel(self.heads, self.depth, self.linear_projection, self.groups, self.dtype,
                               name="attentions_0")(x, context)
        return ResnetBlock2D(c, self.groups, self.eps, self.dtype, name="resnets_1")(x, temb)


# --------------------------------------------------------------------------------- the UNet

class UNet2DConditionModel(nn.Module):
    """The noise (or v) prediction of SD 1.x, 2.x and XL UNets; see `__call__`."""

    config: UNetConfig
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, sample: jax.Array, timesteps: jax.Array, encoder_hidden_states: jax.Array,
                 added_cond_kwargs: Mapping[str, jax.Array] | None = None) -> jax.Array:
        """sample (B, C, H, W); timesteps (B,) or () float, fractional allowed; encoder_hidden_states
        (B, T, D); for SDXL added_cond_kwargs {"text_embeds": (B, P), "time_ids": (B, 6)}.
        Returns (B, out_channels, H, W) in the compute dtype."""
        cfg, dtype = self.config, self.dtype
        n = len(cfg.block_out_channels)
        if sample.shape[2] % 2 ** (n - 1) or sample.shape[3] % 2 ** (n - 1):
            raise ValueError(f"sample {sample.shape[2]}x{sample.shape[3]}: height and width must be "
                             f"multiples of {2 ** (n - 1)}")
        groups, eps, heads, depths = cfg.norm_num_groups, cfg.norm_eps, cfg.heads, cfg.depths
        linear, width = cfg.use_linear_projection, cfg.block_out_channels[0]

        t = jnp.broadcast_to(jnp.asarray(timesteps, jnp.float32), sample.shape[:1])
        emb = timestep_embedding(t, width, cfg.flip_sin_to_cos, cfg.freq_shift).astype(dtype)
        emb = TimestepEmbedding(4 * width, dtype, name="time_embedding")(emb)
        if cfg.addition_embed_type == "text_time":
            if added_cond_kwargs is None:
                raise ValueError("addition_embed_type 'text_time' needs added_cond_kwargs text_embeds and time_ids")
            text_embeds, time_ids = added_cond_kwargs["text_embeds"], added_cond_kwargs["time_ids"]
            time_embeds = timestep_embedding(time_ids.reshape(-1), cfg.addition_time_embed_dim,
                                             cfg.flip_sin_to_cos, cfg.freq_shift)
            added = jnp.concatenate([text_embeds.astype(jnp.float32),
                                     time_embeds.reshape(text_embeds.shape[0], -1)], axis=-1)
            emb = emb + TimestepEmbedding(4 * width, dtype, name="add_embedding")(added.astype(dtype))

        x = conv(width, 3, "conv_in", dtype)(sample.transpose(0, 2, 3, 1).astype(dtype))
        skips = [x]
        for i, kind in enumerate(cfg.down_block_types):
            x, states = DownBlock2D(
                cfg.block_out_channels[i], cfg.layers_per_block, groups, eps, add_downsample=i < n - 1,
                heads=heads[i] if kind == "CrossAttnDownBlock2D" else None, depth=depths[i],
                linear_projection=linear, dtype=dtype, name=f"down_blocks_{i}",
            )(x, emb, encoder_hidden_states)
            skips.extend(states)
        x = UNetMidBlock2DCrossAttn(groups, eps, heads[-1], depths[-1], linear, dtype,
                                    name="mid_block")(x, emb, encoder_hidden_states)
        for i, kind in enumerate(cfg.up_block_types):
            level, k = n - 1 - i, cfg.layers_per_block + 1
            x = UpBlock2D(
                cfg.block_out_channels[level], k, groups, eps, add_upsample=i < n - 1,
                heads=heads[level] if kind == "CrossAttnUpBlock2D" else None, depth=depths[level],
                linear_projection=linear, dtype=dtype, name=f"up_blocks_{i}",
            )(x, tuple(skips[-k:]), emb, encoder_hidden_states)
            del skips[-k:]
        x = nn.silu(GroupNorm(groups, eps, dtype, name="conv_norm_out")(x))
        return conv(cfg.out_channels, 3, "conv_out", dtype)(x).transpose(0, 3, 1, 2)

    def init_params(self, rng: jax.Array) -> dict:
        """Parameters of the checkpoints' shapes (under `jax.eval_shape`, the shapes alone)."""
        cfg = self.config
        size = 2 ** (len(cfg.block_out_channels) - 1)
        args = [jnp.zeros((1, cfg.in_channels, size, size)), jnp.ones((1,)), jnp.zeros((1, 1, cfg.cross_attention_dim))]
        if cfg.addition_embed_type == "text_time":
            # As diffusers' init_weights: 5 micro-conditions for a refiner, 6 for a base model.
            total, each = cfg.projection_class_embeddings_input_dim, cfg.addition_time_embed_dim
            conditions = 5 if 5 * each + cfg.cross_attention_dim == total else 6
            text = total - conditions * each
            args.append({"text_embeds": jnp.zeros((1, text)), "time_ids": jnp.zeros((1, conditions))})
        return self.init(rng, *args)["params"]
