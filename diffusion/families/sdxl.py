"""Stable Diffusion XL: two CLIP text encoders whose penultimate hidden states, side by
side, are the UNet's context; the second one's projected pooled output and the image size
(original size, crop, target size: height first) are its added conditions. An empty negative
prompt is zeros (`force_zeros_for_empty_prompt`, on unless model_index.json says otherwise),
as diffusers' pipeline does for a negative prompt it is not given."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from diffusion.families import latent_unet
from diffusion.family import Component, Family, Networks
from diffusion.generate import ImageInputs, Inputs, Output, Static, denoise_and_decode, guided_rows
from diffusion.nn.clip import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection
from diffusion.nn.unet import UNet2DConditionModel, UNetConfig
from diffusion.nn.vae import AutoencoderKL, VAEConfig
from diffusion.schedulers import Scheduler
from diffusion.tokenizer import CLIPTokenizer


FORCE_ZEROS = "force_zeros_for_empty_prompt"


def generate(nets: Networks, scheduler: Scheduler, static: Static, params: Any, inputs: Inputs | ImageInputs) -> Output:
    first, second = nets["text_encoder"], nets["text_encoder_2"]
    text = inputs.text if static.image else inputs

    def encode(ids: jax.Array) -> tuple[jax.Array, jax.Array]:
        one = first.apply({"params": params["text_encoder"]}, ids[:, 0])
        two = second.apply({"params": params["text_encoder_2"]}, ids[:, 1])
        return jnp.concatenate([one.penultimate, two.penultimate], axis=-1), two.text_embeds

    context, pooled = encode(text.prompt_ids)
    size = (static.height, static.width)
    time_ids = jnp.broadcast_to(jnp.array([*size, 0, 0, *size], jnp.float32), (context.shape[0], 6))
    if static.guided:
        negative, negative_pooled = encode(text.negative_ids)
        if nets.option(FORCE_ZEROS):
            keep = text.has_negative
            negative = jnp.where(keep[:, None, None], negative, 0)
            negative_pooled = jnp.where(keep[:, None], negative_pooled, 0)
        context = guided_rows(negative, context)
        pooled = guided_rows(negative_pooled, pooled)
        time_ids = guided_rows(time_ids, time_ids)
    added = {"text_embeds": pooled, "time_ids": time_ids}
    return denoise_and_decode(nets, scheduler, static, params, inputs, context, added)


FAMILY = Family(
    name="sdxl",
    pipelines=("StableDiffusionXLPipeline", "FlaxStableDiffusionXLPipeline", "StableDiffusionXLInpaintPipeline"),
    components={"text_encoder": Component(CLIPTextModel, CLIPTextConfig, "clip"),
                "text_encoder_2": Component(CLIPTextModelWithProjection, CLIPTextConfig, "clip_projection"),
                "unet": Component(UNet2DConditionModel, UNetConfig, "unet"),
                "vae": Component(AutoencoderKL, VAEConfig, "vae")},
    tokenizers={"tokenizer": CLIPTokenizer.from_folder, "tokenizer_2": CLIPTokenizer.from_folder},
    inputs=latent_unet.inputs,
    abstract_inputs=latent_unet.abstract_inputs,
    generate=generate,
    geometry=latent_unet.geometry,
    denoiser_flops=latent_unet.denoiser_flops,
    tiny=latent_unet.tiny,
    tensor_parallel={"unet": latent_unet.UNET_TENSOR_PARALLEL},
    options=((FORCE_ZEROS, True),),
    image_to_image=True,
    inpainting=True,
)
