"""FluxTransformer2DModel, computing what diffusers' PyTorch module (0.42) does.

The parameter tree keeps diffusers' names, list indices joined (`transformer_blocks_0/attn/
to_q/kernel`; diffusion/convert.py's "flux" kind). Text and image tokens attend jointly: the
double-stream blocks keep a weight set per stream, the single-stream blocks run on the joined
sequence (text first; diffusers joins and splits it again in every single block, the same
numbers). Every block is modulated by one embedding of the timestep, the pooled CLIP text
and, in guidance-distilled models (dev), the guidance scale. Positions enter as rotary
embeddings over three axes of ids (text tokens all zero; image tokens (0, row, column)),
whose tables are computed on the host in float64, as diffusers computes them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from diffusion.nn import read_config, refuse
from diffusion.nn.attention import attention
from diffusion.nn.layers import Dense, Dtype, FeedForward, LayerNorm, RMSNorm, TimestepEmbedding, timestep_embedding
from diffusion.sharding import DATA, concat_packed, constrain

EPS = 1e-6  # every norm of the transformer
THETA = 10000  # FluxPosEmbed's
TIME_CHANNELS = 256  # the sinusoidal embedding of the timestep and of the guidance


@dataclasses.dataclass(frozen=True)
class FluxConfig:
    """The fields of a FluxTransformer2DModel config.json; defaults are diffusers'."""

    patch_size: int = 1
    in_channels: int = 64
    out_channels: int | None = None
    num_layers: int = 19
    num_single_layers: int = 38
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 4096
    pooled_projection_dim: int = 768
    guidance_embeds: bool = False
    axes_dims_rope: tuple[int, ...] = (16, 56, 56)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FluxConfig:
        """From a diffusers config.json dict."""
        return read_config(cls, d, {"patch_size": 1})

    def __post_init__(self) -> None:
        if sum(self.axes_dims_rope) != self.attention_head_dim or any(a % 2 for a in self.axes_dims_rope):
            raise refuse("axes_dims_rope", self.axes_dims_rope,
                         f"even sizes that sum to attention_head_dim {self.attention_head_dim}")

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim


def rotary_tables(ids: np.ndarray, axes_dims: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """FluxPosEmbed: (S, 3) position ids -> cos and sin (S, head_dim) float32, each axis's
    frequencies repeated pairwise, computed in float64 like diffusers on the CPU."""
    cos, sin = [], []
    for axis, dim in enumerate(axes_dims):
        freqs = 1.0 / THETA ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
        phase = np.outer(ids[:, axis].astype(np.float32).astype(np.float64), freqs)
        cos.append(np.repeat(np.cos(phase), 2, axis=1))
        sin.append(np.repeat(np.sin(phase), 2, axis=1))
    return np.concatenate(cos, 1).astype(np.float32), np.concatenate(sin, 1).astype(np.float32)


def apply_rotary(x: jax.Array, cos: np.ndarray, sin: np.ndarray) -> jax.Array:
    """diffusers' apply_rotary_emb (use_real, unbind dim -1) on (B, S, heads, D), in float32."""
    pairs = x.reshape(*x.shape[:-1], -1, 2)
    rotated = jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(x.shape)
    out = x.astype(jnp.float32) * cos[None, :, None] + rotated.astype(jnp.float32) * sin[None, :, None]
    return out.astype(x.dtype)


class FluxAttention(nn.Module):
    """Joint attention: q/k RMS-normed per head, the context's own projections (double-stream
    blocks: `context` given) put first, rotary positions on q and k. Returns the image
    tokens' and the context's outputs, projected; single-stream (`pre_only`), the joined
    sequence's, unprojected."""

    heads: int
    head_dim: int
    pre_only: bool = False
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, context: jax.Array | None,
                 rope: tuple[np.ndarray, np.ndarray]) -> tuple[jax.Array, jax.Array | None]:
        inner = self.heads * self.head_dim
        dense = lambda features, name: Dense(features, dtype=self.dtype, name=name)  # noqa: E731
        heads = lambda t: t.reshape(*t.shape[:2], self.heads, self.head_dim)  # noqa: E731

        def qkv(h: jax.Array, names: tuple[str, str, str], norms: tuple[str, str]) -> list[jax.Array]:
            q, k, v = (heads(dense(inner, name)(h)) for name in names)
            return [RMSNorm(EPS, self.dtype, name=norms[0])(q), RMSNorm(EPS, self.dtype, name=norms[1])(k), v]

        q, k, v = qkv(x, ("to_q", "to_k", "to_v"), ("norm_q", "norm_k"))
        if context is not None:
            cq, ck, cv = qkv(context, ("add_q_proj", "add_k_proj", "add_v_proj"), ("norm_added_q", "norm_added_k"))
            q, k, v = (jnp.concatenate(pair, axis=1) for pair in ((cq, q), (ck, k), (cv, v)))
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        flat = lambda t: t.reshape(*t.shape[:2], inner)  # noqa: E731
        out = attention(flat(q), flat(k), flat(v), self.heads)
        if self.pre_only:
            return out, None
        text = context.shape[1]
        return dense(x.shape[-1], "to_out_0")(out[:, text:]), dense(x.shape[-1], "to_add_out")(out[:, :text])


class AdaNorm(nn.Module):
    """AdaLayerNormZero (`chunks` 6), AdaLayerNormZeroSingle (3) and AdaLayerNormContinuous
    (2, scale before shift): a linear of silu(temb) in chunks, the first modulating a
    parameter-free LayerNorm of x; returns it and the remaining chunks."""

    chunks: int
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, temb: jax.Array) -> tuple[jax.Array, list[jax.Array]]:
        emb = Dense(self.chunks * x.shape[-1], dtype=self.dtype, name="linear")(nn.silu(temb))
        emb = jnp.split(constrain(emb, DATA), self.chunks, axis=-1)  # whole: each chunk modulates all of x
        shift, scale = (emb[1], emb[0]) if self.chunks == 2 else (emb[0], emb[1])
        return modulate(x, shift, scale, self.dtype), emb[2:]


def modulate(x: jax.Array, shift: jax.Array, scale: jax.Array, dtype: Dtype) -> jax.Array:
    """LayerNorm(x) (no parameters, eps 1e-6) * (1 + scale) + shift, per image."""
    return LayerNorm(EPS, dtype, affine=False)(x) * (1 + scale[:, None]) + shift[:, None]


class FluxTransformerBlock(nn.Module):
    """Double-stream: each stream its own modulation, projections and feed-forward."""

    heads: int
    head_dim: int
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, context: jax.Array, temb: jax.Array,
                 rope: tuple[np.ndarray, np.ndarray]) -> tuple[jax.Array, jax.Array]:
        nx, (gate, shift_mlp, scale_mlp, gate_mlp) = AdaNorm(6, self.dtype, name="norm1")(x, temb)
        nc, (c_gate, c_shift_mlp, c_scale_mlp, c_gate_mlp) = AdaNorm(6, self.dtype, name="norm1_context")(context, temb)
        out, context_out = FluxAttention(self.heads, self.head_dim, dtype=self.dtype, name="attn")(nx, nc, rope)
        x = constrain(x + gate[:, None] * out, DATA)
        ff = FeedForward(self.dtype, gelu_tanh=True, name="ff")(modulate(x, shift_mlp, scale_mlp, self.dtype))
        x = constrain(x + gate_mlp[:, None] * ff, DATA)
        context = constrain(context + c_gate[:, None] * context_out, DATA)
        ff = FeedForward(self.dtype, gelu_tanh=True, name="ff_context")(modulate(context, c_shift_mlp, c_scale_mlp, self.dtype))
        return x, constrain(context + c_gate_mlp[:, None] * ff, DATA)


class FluxSingleTransformerBlock(nn.Module):
    """Single-stream, on the joined sequence: attention and a tanh-GELU MLP side by side."""

    heads: int
    head_dim: int
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, h: jax.Array, temb: jax.Array, rope: tuple[np.ndarray, np.ndarray]) -> jax.Array:
        normed, (gate,) = AdaNorm(3, self.dtype, name="norm")(h, temb)
        mlp = jax.nn.gelu(Dense(4 * h.shape[-1], dtype=self.dtype, name="proj_mlp")(normed), approximate=True)
        out, _ = FluxAttention(self.heads, self.head_dim, pre_only=True, dtype=self.dtype, name="attn")(
            normed, None, rope)
        # proj_out's rows: attention's then the MLP's, packed (interleaved where split: diffusion.sharding)
        out = Dense(h.shape[-1], dtype=self.dtype, name="proj_out")(concat_packed([out, mlp]))
        return constrain(h + gate[:, None] * out, DATA)


class TimeTextEmbedding(nn.Module):
    """CombinedTimestep(Guidance)TextProjEmbeddings: timestep (and guidance), each x 1000
    already, sinusoidal then MLP, plus an MLP of the pooled text."""

    features: int
    guidance_embeds: bool
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, t: jax.Array, guidance: jax.Array | None, pooled: jax.Array) -> jax.Array:
        embed = lambda v, name: TimestepEmbedding(self.features, self.dtype, name=name)(  # noqa: E731
            timestep_embedding(v, TIME_CHANNELS, True, 0).astype(self.dtype))
        emb = embed(t, "timestep_embedder")
        if self.guidance_embeds:
            emb = emb + embed(guidance, "guidance_embedder")
        return emb + TimestepEmbedding(self.features, self.dtype, name="text_embedder")(pooled)


class FluxTransformer2DModel(nn.Module):
    """Packed latents (B, S, in_channels), the timestep / 1000 (B,), the T5 context (B, T,
    joint_attention_dim), pooled CLIP (B, pooled_projection_dim), guidance (B,) (ignored
    without guidance_embeds) and the host's (S, 3) image and (T, 3) text position ids ->
    the prediction (B, S, out_channels)."""

    config: FluxConfig
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, latents: jax.Array, timestep: jax.Array, context: jax.Array, pooled: jax.Array,
                 guidance: jax.Array | None, img_ids: np.ndarray, txt_ids: np.ndarray) -> jax.Array:
        cfg = self.config
        inner, dtype = cfg.inner_dim, self.dtype
        rope = rotary_tables(np.concatenate([txt_ids, img_ids]), cfg.axes_dims_rope)
        x = Dense(inner, dtype=dtype, name="x_embedder")(latents.astype(dtype))
        thousand = lambda v: v.astype(jnp.float32) * 1000  # noqa: E731  (diffusers: in the latents' dtype)
        temb = TimeTextEmbedding(inner, cfg.guidance_embeds, dtype, name="time_text_embed")(
            thousand(timestep), None if guidance is None else thousand(guidance), pooled.astype(dtype))
        context = Dense(inner, dtype=dtype, name="context_embedder")(context.astype(dtype))
        for i in range(cfg.num_layers):
            x, context = FluxTransformerBlock(cfg.num_attention_heads, cfg.attention_head_dim, dtype,
                                              name=f"transformer_blocks_{i}")(x, context, temb, rope)
        h = jnp.concatenate([context, x], axis=1)
        for i in range(cfg.num_single_layers):
            h = FluxSingleTransformerBlock(cfg.num_attention_heads, cfg.attention_head_dim, dtype,
                                           name=f"single_transformer_blocks_{i}")(h, temb, rope)
        x, _ = AdaNorm(2, dtype, name="norm_out")(h[:, context.shape[1]:], temb)
        return Dense(cfg.out_channels or cfg.in_channels, dtype=dtype, name="proj_out")(x)

    def init_params(self, rng: jax.Array) -> dict:
        """Parameters of the checkpoints' shapes (under `jax.eval_shape`, the shapes alone)."""
        cfg = self.config
        one = jnp.ones((1,), jnp.float32)
        return self.init(rng, jnp.zeros((1, 1, cfg.in_channels)), one, jnp.zeros((1, 1, cfg.joint_attention_dim)),
                         jnp.zeros((1, cfg.pooled_projection_dim)), one, np.zeros((1, 3)), np.zeros((1, 3)))["params"]
