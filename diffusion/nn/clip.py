"""CLIP's towers, computing what transformers' PyTorch CLIPTextModel,
CLIPTextModelWithProjection, CLIPVisionModelWithProjection and CLIPModel (5.x) do.

The parameter trees are those of transformers 4.57's Flax classes (`text_model/...`,
`text_projection`, `vision_model/...`, `visual_projection`), which are the PyTorch
checkpoints' names. Besides the final hidden states, the text output carries what the SD
pipelines read: `penultimate`, the input of the last layer without the final LayerNorm
(transformers' `hidden_states[-2]`, which SDXL uses), and `pooled`, the final state at the
end-of-text token, found as transformers 5 finds it (see `CLIPTextTransformer`).

The vision tower (ViT: patch embedding conv, class token, position embeddings, the
`pre_layrnorm` as transformers spells it, the text tower's encoder layers without the causal
mask, `post_layernorm` on the class token) serves the scores of diffusion/scores.py: the safety
checker, the CLIP score and the aesthetic predictor. It reads pixels NHWC, already
preprocessed (diffusion/scores.py's `preprocess`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from diffusion.nn import read_config, refuse
from diffusion.nn.attention import attention
from diffusion.nn.layers import Conv, Dense, Dtype, Embed, LayerNorm, param

ACTIVATIONS = {
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),  # OpenAI CLIP (SD 1.x, SDXL's first encoder)
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),  # OpenCLIP (SD 2.x, SDXL's bigG)
}


@dataclasses.dataclass(frozen=True)
class CLIPTextConfig:
    """The fields of a CLIPTextConfig config.json that change the computation; defaults are
    transformers' (5.x)."""

    vocab_size: int = 49408
    hidden_size: int = 512
    intermediate_size: int = 2048
    projection_dim: int = 512
    num_hidden_layers: int = 12
    num_attention_heads: int = 8
    max_position_embeddings: int = 77
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    eos_token_id: int = 49407
    model_type: str = "clip_text_model"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CLIPTextConfig:
        """From a transformers config.json dict (a text encoder's, not a whole CLIPConfig)."""
        return read_config(cls, d, {})

    def __post_init__(self) -> None:
        if self.model_type != "clip_text_model":
            raise refuse("model_type", self.model_type, "only a CLIP text model's config ('clip_text_model')")
        if self.hidden_act not in ACTIVATIONS:
            raise refuse("hidden_act", self.hidden_act, f"only {sorted(ACTIVATIONS)} are implemented")
        if not isinstance(self.eos_token_id, int):
            raise refuse("eos_token_id", self.eos_token_id, "only a single int is implemented")
        if self.hidden_size % self.num_attention_heads:
            raise refuse("num_attention_heads", self.num_attention_heads, f"must divide hidden_size {self.hidden_size}")


class CLIPTextOutput(NamedTuple):
    last_hidden_state: jax.Array  # (B, T, D), after the final LayerNorm
    penultimate: jax.Array  # (B, T, D): hidden_states[-2], no final LayerNorm
    pooled: jax.Array  # (B, D): last_hidden_state at the end-of-text token
    text_embeds: jax.Array | None = None  # (B, P): projection of `pooled` (CLIPTextModelWithProjection)


@dataclasses.dataclass(frozen=True)
class CLIPVisionConfig:
    """The fields of a CLIPVisionConfig (a whole config.json of a vision model, or the
    `vision_config` of a CLIPConfig) that change the computation; defaults are transformers' (5.x)."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    projection_dim: int = 512
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 32
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    model_type: str = "clip_vision_model"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CLIPVisionConfig:
        """From a transformers config.json dict (a vision model's, or a CLIPConfig's `vision_config`)."""
        return read_config(cls, d, {})

    def __post_init__(self) -> None:
        if self.model_type != "clip_vision_model":
            raise refuse("model_type", self.model_type, "only a CLIP vision model's config ('clip_vision_model')")
        if self.hidden_act not in ACTIVATIONS:
            raise refuse("hidden_act", self.hidden_act, f"only {sorted(ACTIVATIONS)} are implemented")
        if self.hidden_size % self.num_attention_heads:
            raise refuse("num_attention_heads", self.num_attention_heads, f"must divide hidden_size {self.hidden_size}")
        if self.image_size % self.patch_size:
            raise refuse("patch_size", self.patch_size, f"must divide image_size {self.image_size}")


@dataclasses.dataclass(frozen=True)
class CLIPConfig:
    """A CLIPConfig config.json (CLIPModel; diffusers' safety checker keeps one too): both
    towers' configs and the shared `projection_dim` of their projections."""

    text_config: CLIPTextConfig = CLIPTextConfig()
    vision_config: CLIPVisionConfig = CLIPVisionConfig()
    projection_dim: int = 512

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CLIPConfig:
        """From a transformers CLIPConfig dict; missing sub-configs take transformers' defaults.
        A `*_config_dict`, which configs saved by transformers 4.2x carry (the hub's CLIP and
        safety checker among them), replaces its sub-config whole, defaults and all, as
        transformers reads it."""
        if d.get("model_type", "clip") != "clip":
            raise refuse("model_type", d["model_type"], "only a CLIPConfig ('clip')")
        sub = lambda name: d[f"{name}_dict"] if d.get(f"{name}_dict") is not None else d.get(name) or {}  # noqa: E731
        return cls(CLIPTextConfig.from_dict(sub("text_config")), CLIPVisionConfig.from_dict(sub("vision_config")),
                   int(d.get("projection_dim", 512)))


TowerConfig = CLIPTextConfig | CLIPVisionConfig  # what the encoder layers read from either


class CLIPAttention(nn.Module):
    config: TowerConfig
    dtype: Dtype = jnp.float32
    causal: bool = True  # the text tower's mask; the vision tower's attention sees every patch

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        dense = lambda name: Dense(self.config.hidden_size, dtype=self.dtype, name=name)  # noqa: E731
        q, k, v = dense("q_proj")(x), dense("k_proj")(x), dense("v_proj")(x)
        return dense("out_proj")(attention(q, k, v, self.config.num_attention_heads, causal=self.causal))


class CLIPMLP(nn.Module):
    config: TowerConfig
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = Dense(self.config.intermediate_size, dtype=self.dtype, name="fc1")(x)
        x = ACTIVATIONS[self.config.hidden_act](x)
        return Dense(self.config.hidden_size, dtype=self.dtype, name="fc2")(x)


class CLIPEncoderLayer(nn.Module):
    config: TowerConfig
    dtype: Dtype = jnp.float32
    causal: bool = True

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        norm = lambda name: LayerNorm(self.config.layer_norm_eps, self.dtype, name=name)  # noqa: E731
        x = x + CLIPAttention(self.config, self.dtype, self.causal, name="self_attn")(norm("layer_norm1")(x))
        return x + CLIPMLP(self.config, self.dtype, name="mlp")(norm("layer_norm2")(x))


class CLIPLayers(nn.Module):
    """The layers in order, named "0", "1", ...; returns every hidden state, the input first."""

    config: TowerConfig
    dtype: Dtype = jnp.float32
    causal: bool = True

    @nn.compact
    def __call__(self, x: jax.Array) -> list[jax.Array]:
        states = [x]
        for i in range(self.config.num_hidden_layers):
            states.append(CLIPEncoderLayer(self.config, self.dtype, self.causal, name=str(i))(states[-1]))
        return states


class CLIPEncoder(nn.Module):
    """Only a level of names: the checkpoints hold the layers as encoder/layers/<i>."""

    config: TowerConfig
    dtype: Dtype = jnp.float32
    causal: bool = True

    @nn.compact
    def __call__(self, x: jax.Array) -> list[jax.Array]:
        return CLIPLayers(self.config, self.dtype, self.causal, name="layers")(x)


class CLIPTextEmbeddings(nn.Module):
    config: CLIPTextConfig
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, input_ids: jax.Array) -> jax.Array:
        cfg = self.config
        tokens = Embed(cfg.vocab_size, cfg.hidden_size, dtype=self.dtype, name="token_embedding")(input_ids)
        positions = Embed(cfg.max_position_embeddings, cfg.hidden_size, dtype=self.dtype,
                             name="position_embedding")(jnp.arange(input_ids.shape[1]))
        return tokens + positions[None]


class CLIPTextTransformer(nn.Module):
    """Embeddings, causal encoder layers, final LayerNorm, pooling at the end-of-text token."""

    config: CLIPTextConfig
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, input_ids: jax.Array) -> CLIPTextOutput:
        cfg = self.config
        if input_ids.shape[1] > cfg.max_position_embeddings:
            raise ValueError(f"{input_ids.shape[1]} tokens: more than max_position_embeddings "
                             f"{cfg.max_position_embeddings}")
        states = CLIPEncoder(cfg, self.dtype, name="encoder")(
            CLIPTextEmbeddings(cfg, self.dtype, name="embeddings")(input_ids))
        last = LayerNorm(cfg.layer_norm_eps, self.dtype, name="final_layer_norm")(states[-1])
        # transformers 5: a config with the legacy eos_token_id 2 pools at the largest id (the
        # original vocabulary's end-of-text is its last token); any other, at its first occurrence.
        eos = input_ids.argmax(-1) if cfg.eos_token_id == 2 else (input_ids == cfg.eos_token_id).argmax(-1)
        return CLIPTextOutput(last, states[-2], last[jnp.arange(last.shape[0]), eos])


class CLIPTextModel(nn.Module):
    """input_ids (B, T) int -> CLIPTextOutput (text_embeds None)."""

    config: CLIPTextConfig
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, input_ids: jax.Array) -> CLIPTextOutput:
        return CLIPTextTransformer(self.config, self.dtype, name="text_model")(input_ids)

    def init_params(self, rng: jax.Array) -> dict:
        """Parameters of the checkpoints' shapes (under `jax.eval_shape`, the shapes alone)."""
        return self.init(rng, jnp.zeros((1, 1), jnp.int32))["params"]


class CLIPTextModelWithProjection(CLIPTextModel):
    """CLIPTextModel plus text_embeds, the bias-free projection of the pooled state."""

    @nn.compact
    def __call__(self, input_ids: jax.Array) -> CLIPTextOutput:
        out = CLIPTextTransformer(self.config, self.dtype, name="text_model")(input_ids)
        projection = Dense(self.config.projection_dim, use_bias=False, dtype=self.dtype, name="text_projection")
        return out._replace(text_embeds=projection(out.pooled))


class CLIPVisionEmbeddings(nn.Module):
    """Patches (a stride-`patch_size` conv without bias), the class token first, plus positions."""

    config: CLIPVisionConfig
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, pixels: jax.Array) -> jax.Array:
        cfg = self.config
        if pixels.shape[1:] != (cfg.image_size, cfg.image_size, cfg.num_channels):
            raise ValueError(f"pixels {pixels.shape[1:]}: the model takes "
                             f"{(cfg.image_size, cfg.image_size, cfg.num_channels)} (B, H, W, C)")
        patches = Conv(cfg.hidden_size, cfg.patch_size, cfg.patch_size, use_bias=False, dtype=self.dtype,
                       name="patch_embedding")(pixels)
        patches = patches.reshape(patches.shape[0], -1, cfg.hidden_size)
        token = param(self, "class_embedding", (cfg.hidden_size,))
        tokens = jnp.concatenate([jnp.broadcast_to(token.astype(patches.dtype), (patches.shape[0], 1, cfg.hidden_size)),
                                  patches], axis=1)
        positions = Embed((cfg.image_size // cfg.patch_size) ** 2 + 1, cfg.hidden_size, dtype=self.dtype,
                             name="position_embedding")(jnp.arange(tokens.shape[1]))
        return tokens + positions[None]


class CLIPVisionTransformer(nn.Module):
    """pixels (B, H, W, C), preprocessed -> pooled (B, D): post_layernorm of the class token's
    final state (transformers' `pooler_output`)."""

    config: CLIPVisionConfig
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, pixels: jax.Array) -> jax.Array:
        cfg = self.config
        x = CLIPVisionEmbeddings(cfg, self.dtype, name="embeddings")(pixels.astype(self.dtype))
        x = LayerNorm(cfg.layer_norm_eps, self.dtype, name="pre_layrnorm")(x)
        last = CLIPEncoder(cfg, self.dtype, causal=False, name="encoder")(x)[-1]
        return LayerNorm(cfg.layer_norm_eps, self.dtype, name="post_layernorm")(last[:, 0])


class CLIPVisionModel(nn.Module):
    """pixels (B, H, W, C) -> pooled (B, D): transformers' CLIPVisionModel, one level of names
    (`vision_model/`) around the transformer, as diffusers' safety checker holds it."""

    config: CLIPVisionConfig
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, pixels: jax.Array) -> jax.Array:
        return CLIPVisionTransformer(self.config, self.dtype, name="vision_model")(pixels)


class CLIPModel(nn.Module):
    """transformers' CLIPModel without its logit_scale: `image_embeds(pixels)` and
    `text_embeds(input_ids)`, each projected to `projection_dim` (not normalised)."""

    config: CLIPConfig
    dtype: Dtype = jnp.float32

    def setup(self) -> None:
        cfg = self.config
        self.vision_model = CLIPVisionTransformer(cfg.vision_config, self.dtype)
        self.visual_projection = Dense(cfg.projection_dim, use_bias=False, dtype=self.dtype)
        self.text_model = CLIPTextTransformer(cfg.text_config, self.dtype)
        self.text_projection = Dense(cfg.projection_dim, use_bias=False, dtype=self.dtype)

    def image_embeds(self, pixels: jax.Array) -> jax.Array:
        """pixels (B, H, W, C), preprocessed -> (B, P): CLIPModel.get_image_features."""
        return self.visual_projection(self.vision_model(pixels))

    def text_embeds(self, input_ids: jax.Array) -> jax.Array:
        """input_ids (B, T) -> (B, P): CLIPModel.get_text_features."""
        return self.text_projection(self.text_model(input_ids).pooled)

    def __call__(self, pixels: jax.Array, input_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
        return self.image_embeds(pixels), self.text_embeds(input_ids)

    def init_params(self, rng: jax.Array) -> dict:
        """Parameters of the checkpoints' shapes (under `jax.eval_shape`, the shapes alone)."""
        vision = self.config.vision_config
        pixels = jnp.zeros((1, vision.image_size, vision.image_size, vision.num_channels), self.dtype)
        return self.init(rng, pixels, jnp.zeros((1, 1), jnp.int32))["params"]
