"""A model family of the tests' own, installed as a plugin would be (an entry point in the
group `renderfarm.families`, tests/test_families.py): another text encoder length (16
tokens), another latent shape (2 channels at a quarter of the image size), its own inputs
pytree (no negative prompts: it never runs classifier-free guidance) and its own tiny recipe.
Nothing outside this file and its test knows of it."""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from diffusion.families import latent_unet
from diffusion.family import Component, Family, Networks, Tokenizer
from diffusion.generate import Output, Static, decode, denoise
from diffusion.nn.clip import CLIPTextConfig, CLIPTextModel
from diffusion.nn.unet import UNet2DConditionModel, UNetConfig
from diffusion.nn.vae import AutoencoderKL, VAEConfig
from diffusion.schedulers import Scheduler
from diffusion.tiny_parts import EOS, clip_tokenizer_files, text_config, write_pipeline
from diffusion.tokenizer import CLIPTokenizer

TOKENS = 16
LATENT_CHANNELS = 2


class ToyInputs(NamedTuple):
    ids: jax.Array  # (B, 16) int32: one tokenizer
    keys: jax.Array  # (B, 2) uint32
    guidance: jax.Array  # (B,) float32, read by the shared loop; always unguided here


def inputs(tokenizers: Sequence[Tokenizer], prompts: Sequence[str], negatives: Sequence[str],
           seeds: Sequence[int], guidance: Sequence[float]) -> tuple[ToyInputs, list[bool]]:
    ids, cut = tokenizers[0](list(prompts))
    return ToyInputs(ids, np.array([[0, s] for s in seeds], np.uint32), np.ones(len(seeds), np.float32)), cut


def abstract_inputs(tokenizers: Sequence[Tokenizer], batch: int) -> ToyInputs:
    return ToyInputs(jax.ShapeDtypeStruct((batch, tokenizers[0].max_length), jnp.int32),
                     jax.ShapeDtypeStruct((batch, 2), jnp.uint32), jax.ShapeDtypeStruct((batch,), jnp.float32))


def encode(nets: Networks, params: Any, inputs: ToyInputs, guided: bool) -> jax.Array:
    return nets["text_encoder"].apply({"params": params["text_encoder"]}, inputs.ids).last_hidden_state


def generate(nets: Networks, scheduler: Scheduler, static: Static, params: Any, inputs: ToyInputs,
             context: jax.Array) -> Output:
    f = nets["vae"].config.scale_factor
    unguided = static._replace(guided=False)
    latents = denoise(nets["unet"], params["unet"], scheduler, unguided,
                      (LATENT_CHANNELS, static.height // f, static.width // f), inputs, context, None)
    return decode(nets["vae"], params["vae"], latents)


def tiny(family: Family, out: pathlib.Path, seed: int) -> None:
    vocab = clip_tokenizer_files(out / "tokenizer", pad=EOS, max_length=TOKENS)
    configs = {
        "text_encoder": text_config(vocab, max_position_embeddings=TOKENS),
        "unet": {"sample_size": 16, "in_channels": LATENT_CHANNELS, "out_channels": LATENT_CHANNELS,
                 "block_out_channels": [16, 32], "layers_per_block": 1,
                 "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
                 "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"], "attention_head_dim": [2, 4],
                 "cross_attention_dim": 32, "norm_num_groups": 8},
        "vae": {"block_out_channels": [8, 8, 16], "down_block_types": ["DownEncoderBlock2D"] * 3,
                "up_block_types": ["UpDecoderBlock2D"] * 3, "layers_per_block": 1,
                "latent_channels": LATENT_CHANNELS, "norm_num_groups": 8, "sample_size": 64, "scaling_factor": 0.5},
    }
    scheduler = {"_class_name": "EulerDiscreteScheduler", "beta_start": 0.00085, "beta_end": 0.012,
                 "beta_schedule": "scaled_linear", "num_train_timesteps": 1000, "timestep_spacing": "trailing"}
    write_pipeline(out, family, configs, scheduler, seed, {"tokenizer": ["transformers", "CLIPTokenizer"]})


FAMILY = Family(
    name="toy",
    pipelines=("ToyPipeline",),
    components={"text_encoder": Component(CLIPTextModel, CLIPTextConfig, "clip"),
                "unet": Component(UNet2DConditionModel, UNetConfig, "unet"),
                "vae": Component(AutoencoderKL, VAEConfig, "vae")},
    tokenizers={"tokenizer": CLIPTokenizer.from_folder},
    text_encoders=("text_encoder",),
    encode=encode,
    inputs=inputs,
    abstract_inputs=abstract_inputs,
    generate=generate,
    geometry=latent_unet.geometry,
    denoiser_flops=latent_unet.denoiser_flops,
    tiny=tiny,
)
