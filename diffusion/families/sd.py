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


def generate(nets: Networks, scheduler: Scheduler, static: Static, params: Any, inputs: Inputs | ImageInputs) -> Output:
    encoder = nets["text_encoder"]
    text = inputs.text if static.image else inputs

    def encode(ids: jax.Array) -> jax.Array:
        return encoder.apply({"params": params["text_encoder"]}, ids[:, 0]).last_hidden_state

    context = encode(text.prompt_ids)
    if static.guided:
        context = guided_rows(encode(text.negative_ids), context)
    return denoise_and_decode(nets, scheduler, static, params, inputs, context, None)


FAMILY = Family(
    name="sd",
    pipelines=("StableDiffusionPipeline", "FlaxStableDiffusionPipeline", "StableDiffusionInpaintPipeline"),
    components={"text_encoder": Component(CLIPTextModel, CLIPTextConfig, "clip"),
                "unet": Component(UNet2DConditionModel, UNetConfig, "unet"),
                "vae": Component(AutoencoderKL, VAEConfig, "vae")},
    tokenizers={"tokenizer": CLIPTokenizer.from_folder},
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
