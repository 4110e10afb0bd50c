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


def encode(nets: Networks, params: Any, inputs: Inputs, guided: bool) -> dict[str, jax.Array]:
    """Both encoders' penultimate hidden states side by side and the second's pooled
    projection, for the prompts and, guided, for the negative prompts (zeros for an empty one
    where FORCE_ZEROS is on)."""
    first, second = nets["text_encoder"], nets["text_encoder_2"]

    def run(ids: jax.Array) -> tuple[jax.Array, jax.Array]:
        one = first.apply({"params": params["text_encoder"]}, ids[:, 0])
        two = second.apply({"params": params["text_encoder_2"]}, ids[:, 1])
        return jnp.concatenate([one.penultimate, two.penultimate], axis=-1), two.text_embeds

    context, pooled = run(inputs.prompt_ids)
    if not guided:
        return {"context": context, "pooled": pooled}
    negative, negative_pooled = run(inputs.negative_ids)
    if nets.option(FORCE_ZEROS):
        keep = inputs.has_negative
        negative = jnp.where(keep[:, None, None], negative, 0)
        negative_pooled = jnp.where(keep[:, None], negative_pooled, 0)
    return {"context": context, "pooled": pooled, "negative": negative, "negative_pooled": negative_pooled}


def generate(nets: Networks, scheduler: Scheduler, static: Static, params: Any, inputs: Inputs | ImageInputs,
             encoded: dict[str, jax.Array]) -> Output:
    context, pooled = encoded["context"], encoded["pooled"]
    size = (static.height, static.width)
    time_ids = jnp.broadcast_to(jnp.array([*size, 0, 0, *size], jnp.float32), (context.shape[0], 6))
    if static.guided:
        context = guided_rows(encoded["negative"], context)
        pooled = guided_rows(encoded["negative_pooled"], pooled)
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
    text_encoders=("text_encoder", "text_encoder_2"),
    encode=encode,
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
