"""Stable Diffusion 1.x and 2.x: one CLIP text encoder, its last hidden state (after the
final layer norm) as the UNet's context; an empty negative prompt is encoded like any other."""

from __future__ import annotations

from typing import Any

import jax

from diffusion.families import latent_unet
from diffusion.family import Component, Family, Networks
from diffusion.generate import (
    ImageInputs,
    Inputs,
    Output,
    Static,
    denoise_and_decode,
    guided_rows,
)
from diffusion.nn.clip import CLIPTextConfig, CLIPTextModel
from diffusion.nn.unet import UNet2DConditionModel, UNetConfig
from diffusion.nn.vae import AutoencoderKL, VAEConfig
from diffusion.schedulers import Scheduler
from diffusion.tokenizer import CLIPTokenizer


def encode(nets: Networks, params: Any, inputs: Inputs, guided: bool) -> dict[str, jax.Array]:
    """The prompts' hidden states, and guided the negative prompts' too."""
    encoder = nets["text_encoder"]

    def run(ids: jax.Array) -> jax.Array:
        return encoder.apply({"params": params["text_encoder"]}, ids[:, 0]).last_hidden_state

    return {"context": run(inputs.prompt_ids), **({"negative": run(inputs.negative_ids)} if guided else {})}


def generate(nets: Networks, scheduler: Scheduler, static: Static, params: Any, inputs: Inputs | ImageInputs,
             encoded: dict[str, jax.Array]) -> Output:
    context = encoded["context"]
    if static.guided:
        context = guided_rows(encoded["negative"], context)
    return denoise_and_decode(nets, scheduler, static, params, inputs, context, None)


FAMILY = Family(
    name="sd",
    pipelines=("StableDiffusionPipeline", "FlaxStableDiffusionPipeline", "StableDiffusionInpaintPipeline"),
    components={"text_encoder": Component(CLIPTextModel, CLIPTextConfig, "clip"),
                "unet": Component(UNet2DConditionModel, UNetConfig, "unet"),
                "vae": Component(AutoencoderKL, VAEConfig, "vae")},
    tokenizers={"tokenizer": CLIPTokenizer.from_folder},
    text_encoders=("text_encoder",),
    encode=encode,
    inputs=latent_unet.inputs,
    abstract_inputs=latent_unet.abstract_inputs,
    generate=generate,
    geometry=latent_unet.geometry,
    denoiser_flops=latent_unet.denoiser_flops,
    tiny=latent_unet.tiny,
    tensor_parallel={"unet": latent_unet.UNET_TENSOR_PARALLEL},
    image_to_image=True,
    inpainting=True,
)
