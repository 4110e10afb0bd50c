"""What the SD-style families share on the host: CLIP tokenizers whose id rows, one per text
encoder, are the batch's inputs (diffusion.generate.Inputs), and a UNet denoising VAE
latents with those encoders' hidden states as its context. Their image sizes follow from the
VAE's scale factor and the UNet's downsamplings, a denoiser call's FLOPs from the UNet
lowered on those shapes, and their tiny models from one recipe."""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from diffusion.family import Family, Geometry, Networks, Tokenizer
from diffusion.flops import counted_once, program_flops
from diffusion.generate import Inputs
from diffusion.sharding import TensorParallel
from diffusion.tiny_parts import EOS, TEXT_HIDDEN, clip_tokenizer_files, text_config, write_pipeline

# The UNet's transformer blocks split as Megatron splits one (the ResNets and convolutions stay whole).
UNET_TENSOR_PARALLEL = TensorParallel(columns=(r".*/attn[12]/to_[qkv]", r".*/ff/net_0/proj"),
                                      rows=(r".*/attn[12]/to_out_0", r".*/ff/net_2"),
                                      packed=((r".*/ff/net_0/proj", (1, 1)),))  # GEGLU: hidden, gate
_TIME_EMBED_DIM = 8  # the tiny SDXL's addition_time_embed_dim (256 in the real model)
_SD_BETAS = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear", "num_train_timesteps": 1000}


def tokenize(tokenizers: Sequence[Tokenizer], texts: list[str]) -> tuple[np.ndarray, list[bool]]:
    """Token ids (N, tokenizers, max_length) as the pipelines get them (BOS, tokens, EOS,
    padded or cut), each distinct text once per tokenizer call; and which texts were cut."""
    row_of = {text: row for row, text in enumerate(dict.fromkeys(texts))}  # batches repeat texts
    encoded = [tokenizer(list(row_of)) for tokenizer in tokenizers]
    ids = np.stack([rows for rows, _ in encoded], axis=1)
    cut = np.any([flags for _, flags in encoded], axis=0)
    rows = [row_of[text] for text in texts]
    return ids[rows], [bool(cut[r]) for r in rows]


def inputs(tokenizers: Sequence[Tokenizer], prompts: Sequence[str], negatives: Sequence[str],
           seeds: Sequence[int], guidance: Sequence[float]) -> tuple[Inputs, list[bool]]:
    """A batch's inputs, a job per position: prompt and negative ids, whether a negative
    prompt was given (SDXL zeroes an empty one), the jobs' keys and guidance scales."""
    prompt_ids, truncated = tokenize(tokenizers, list(prompts))
    negative_ids, _ = tokenize(tokenizers, list(negatives))
    return Inputs(prompt_ids=prompt_ids, negative_ids=negative_ids,
                  has_negative=np.array([text != "" for text in negatives]),
                  keys=np.array([[0, seed] for seed in seeds], dtype=np.uint32),  # == PRNGKey(seed)
                  guidance=np.array(guidance, dtype=np.float32)), truncated


def abstract_inputs(tokenizers: Sequence[Tokenizer], batch: int) -> Inputs:
    ids = jax.ShapeDtypeStruct((batch, len(tokenizers), tokenizers[0].max_length), jnp.int32)
    return Inputs(ids, ids, jax.ShapeDtypeStruct((batch,), jnp.bool_), jax.ShapeDtypeStruct((batch, 2), jnp.uint32),
                  jax.ShapeDtypeStruct((batch,), jnp.float32))


def geometry(nets: Networks) -> Geometry:
    """Native size: the UNet's sample size in pixels; size step: VAE factor x UNet downsampling."""
    unet, factor = nets["unet"].config, nets["vae"].config.scale_factor
    return Geometry(native_size=int(unet.sample_size) * factor,
                    size_step=factor * 2 ** (len(unet.block_out_channels) - 1))


def denoiser_flops(nets: Networks, params: Any, rows: int, height: int, width: int) -> float | None:
    """One UNet call on `rows` latents of a `height` x `width` image, its context as long as
    the text encoder's positions."""
    factor = nets["vae"].config.scale_factor
    tokens = nets["text_encoder"].config.max_position_embeddings
    return unet_flops(nets["unet"], params["unet"], rows, height // factor, width // factor, tokens)


@counted_once
def unet_flops(unet: Any, params: Any, batch: int, latent_height: int, latent_width: int,
               context_tokens: int) -> float | None:
    """FLOPs of one call of a UNet (diffusion.nn.unet) on `batch` latents (2 per image with
    classifier-free guidance) and a context of `context_tokens` positions. Lowered, not
    compiled: seconds even for SDXL, once per shapes in a process. `params` may be abstract
    (`jax.eval_shape(unet.init_params, key)`)."""
    config = unet.config
    f32 = jnp.float32
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype), params)  # no transfers
    sample = jax.ShapeDtypeStruct((batch, config.in_channels, latent_height, latent_width), f32)
    context = jax.ShapeDtypeStruct((batch, context_tokens, config.cross_attention_dim), f32)
    added = None
    if config.addition_embed_type == "text_time":  # SDXL: pooled text + 6 size conditions
        time_ids = 6
        pooled = config.projection_class_embeddings_input_dim - time_ids * config.addition_time_embed_dim
        added = {"text_embeds": jax.ShapeDtypeStruct((batch, pooled), f32),
                 "time_ids": jax.ShapeDtypeStruct((batch, time_ids), f32)}

    def call(params: Any, sample: jax.Array, context: jax.Array, added: Any) -> jax.Array:
        timestep = jnp.full((sample.shape[0],), 999.0, jnp.float32)
        return unet.apply({"params": params}, sample, timestep, context, added)

    return program_flops(jax.jit(call).lower(params, sample, context, added))


def unet_config(kind: str) -> dict[str, Any]:
    """Two UNet levels (one downsampling) on 8x8 latents; SDXL adds the pooled-text + size conditioning."""
    config = {"sample_size": 8, "in_channels": 4, "out_channels": 4, "block_out_channels": [32, 64],
              "layers_per_block": 1, "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
              "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"], "attention_head_dim": [2, 4]}
    if kind == "sd":
        return {**config, "cross_attention_dim": TEXT_HIDDEN}
    return {**config, "cross_attention_dim": 2 * TEXT_HIDDEN,  # both encoders' hidden states, side by side
            "use_linear_projection": True, "addition_embed_type": "text_time",
            "addition_time_embed_dim": _TIME_EMBED_DIM,
            # pooled text_embeds (text_encoder_2's projection_dim) + 6 micro-conditions (sizes and crop)
            "projection_class_embeddings_input_dim": TEXT_HIDDEN + 6 * _TIME_EMBED_DIM}


def vae_config(kind: str) -> dict[str, Any]:
    """Four blocks, i.e. three downsamplings: vae_scale_factor 8 as in the real SD family."""
    return {"block_out_channels": [8, 8, 16, 16], "down_block_types": ["DownEncoderBlock2D"] * 4,
            "up_block_types": ["UpDecoderBlock2D"] * 4, "layers_per_block": 1, "latent_channels": 4,
            "norm_num_groups": 8, "sample_size": 64, "scaling_factor": 0.18215 if kind == "sd" else 0.13025}


def tiny(family: Family, out: pathlib.Path, seed: int) -> None:
    """The SD families' recipe: CLIP tokenizers and text encoders, a two-level UNet on 8x8
    latents and a four-block VAE (64x64 native size, VAE scale factor 8)."""
    kind = family.name
    vocab = clip_tokenizer_files(out / "tokenizer", pad=EOS)
    configs = {"text_encoder": text_config(vocab), "unet": unet_config(kind), "vae": vae_config(kind)}
    scheduler = ({"_class_name": "PNDMScheduler", **_SD_BETAS, "skip_prk_steps": True, "set_alpha_to_one": False,
                  "steps_offset": 1, "prediction_type": "epsilon"} if kind == "sd" else
                 # SDXL's own scheduler: Euler, "leading" spacing, steps_offset 1.
                 {"_class_name": "EulerDiscreteScheduler", **_SD_BETAS, "timestep_spacing": "leading",
                  "steps_offset": 1, "prediction_type": "epsilon"})
    if kind == "sdxl":
        clip_tokenizer_files(out / "tokenizer_2", pad="!")
        configs["text_encoder_2"] = text_config(vocab, hidden_act="gelu")
    write_pipeline(out, family, configs, scheduler, seed,
                   {name: ["transformers", "CLIPTokenizer"] for name in family.tokenizers})
