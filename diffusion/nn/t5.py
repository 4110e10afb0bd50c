"""The T5 v1.1 encoder, computing what transformers' PyTorch T5EncoderModel (5.x) does: Flux's
second text encoder, whose last hidden state is the transformer's context.

The parameter tree keeps the PyTorch names, list indices joined (`encoder/block_0/layer_0/
SelfAttention/q/kernel`; diffusion/convert.py's "t5" kind). T5 has no biases, no query scaling
(1/sqrt(d) is folded into its weights), an RMS norm without a mean or shift, a gated GELU
(tanh) feed-forward, and a learned bias per relative-position bucket, computed once by the
first layer and added to every layer's attention scores.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from diffusion.nn import read_config, refuse
from diffusion.nn.attention import attention
from diffusion.nn.layers import Dense, Dtype, Embed, RMSNorm


@dataclasses.dataclass(frozen=True)
class T5Config:
    """The fields of a T5Config config.json that change the encoder; defaults are transformers'."""

    vocab_size: int = 32128
    d_model: int = 512
    d_kv: int = 64
    d_ff: int = 2048
    num_layers: int = 6
    num_heads: int = 8
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    layer_norm_epsilon: float = 1e-6
    feed_forward_proj: str = "relu"
    model_type: str = "t5"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> T5Config:
        """From a transformers config.json dict (T5EncoderModel's)."""
        return read_config(cls, d, {})

    def __post_init__(self) -> None:
        if self.model_type != "t5":
            raise refuse("model_type", self.model_type, "only a T5 encoder's config ('t5')")
        if self.feed_forward_proj != "gated-gelu":
            raise refuse("feed_forward_proj", self.feed_forward_proj, "only T5 v1.1's 'gated-gelu' is implemented")


def relative_buckets(length: int, num_buckets: int, max_distance: int) -> np.ndarray:
    """(length, length) bucket of key position minus query position, bidirectional, as
    transformers' `_relative_position_bucket` computes it (float32 logs, truncated)."""
    relative = np.arange(length)[None, :] - np.arange(length)[:, None]
    half = num_buckets // 2
    buckets = (relative > 0) * half
    distance = np.abs(relative)
    exact = half // 2
    far = np.maximum(distance, exact).astype(np.float32)  # the nearer ones take the exact branch
    large = exact + (np.log(far / np.float32(exact)) / np.float32(math.log(max_distance / exact))
                     * np.float32(half - exact)).astype(np.int64)
    large = np.minimum(large, half - 1)
    return buckets + np.where(distance < exact, distance, large)


class T5Attention(nn.Module):
    """Self-attention with no scaling and the relative-position bias; the first layer's
    (`has_bias`) holds the bias table and returns the bias the others are given."""

    config: T5Config
    has_bias: bool = False
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, bias: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        cfg = self.config
        if self.has_bias:
            table = Embed(cfg.relative_attention_num_buckets, cfg.num_heads, dtype=self.dtype,
                             name="relative_attention_bias")
            buckets = relative_buckets(x.shape[1], cfg.relative_attention_num_buckets,
                                       cfg.relative_attention_max_distance)
            bias = table(jnp.asarray(buckets)).transpose(2, 0, 1)[None].astype(jnp.float32)
        inner = cfg.num_heads * cfg.d_kv
        dense = lambda features, name: Dense(features, use_bias=False, dtype=self.dtype, name=name)  # noqa: E731
        q, k, v = dense(inner, "q")(x), dense(inner, "k")(x), dense(inner, "v")(x)
        return dense(cfg.d_model, "o")(attention(q, k, v, cfg.num_heads, bias=bias.astype(q.dtype), scale=1.0)), bias


class T5SelfAttentionLayer(nn.Module):
    config: T5Config
    has_bias: bool = False
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, bias: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        h = RMSNorm(self.config.layer_norm_epsilon, self.dtype, name="layer_norm")(x)
        h, bias = T5Attention(self.config, self.has_bias, self.dtype, name="SelfAttention")(h, bias)
        return x + h, bias


class GatedGELU(nn.Module):
    """wo(gelu_tanh(wi_0 x) * wi_1 x): transformers' T5DenseGatedActDense with gelu_new."""

    config: T5Config
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        dense = lambda features, name: Dense(features, use_bias=False, dtype=self.dtype, name=name)  # noqa: E731
        h = jax.nn.gelu(dense(self.config.d_ff, "wi_0")(x), approximate=True) * dense(self.config.d_ff, "wi_1")(x)
        return dense(self.config.d_model, "wo")(h)


class T5FeedForwardLayer(nn.Module):
    config: T5Config
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = RMSNorm(self.config.layer_norm_epsilon, self.dtype, name="layer_norm")(x)
        return x + GatedGELU(self.config, self.dtype, name="DenseReluDense")(h)


class T5Block(nn.Module):
    config: T5Config
    has_bias: bool = False
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, bias: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        x, bias = T5SelfAttentionLayer(self.config, self.has_bias, self.dtype, name="layer_0")(x, bias)
        return T5FeedForwardLayer(self.config, self.dtype, name="layer_1")(x), bias


class T5Stack(nn.Module):
    config: T5Config
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg, bias = self.config, None
        for i in range(cfg.num_layers):
            x, bias = T5Block(cfg, i == 0, self.dtype, name=f"block_{i}")(x, bias)
        return RMSNorm(cfg.layer_norm_epsilon, self.dtype, name="final_layer_norm")(x)


class T5EncoderModel(nn.Module):
    """input_ids (B, T) int -> the last hidden state (B, T, d_model), after the final norm.
    No attention mask: diffusers' Flux pipeline gives none, so padding is attended to."""

    config: T5Config
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, input_ids: jax.Array) -> jax.Array:
        cfg = self.config
        x = Embed(cfg.vocab_size, cfg.d_model, dtype=self.dtype, name="shared")(input_ids)
        return T5Stack(cfg, self.dtype, name="encoder")(x)

    def init_params(self, rng: jax.Array) -> dict:
        """Parameters of the checkpoints' shapes (under `jax.eval_shape`, the shapes alone)."""
        return self.init(rng, jnp.zeros((1, 1), jnp.int32))["params"]
