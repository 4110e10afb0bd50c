"""The ceiling: FLOPs per image of the real SD 1.5 (512x512) and SDXL (1024x1024) pipelines,
counted by XLA's cost analysis of the lowered calls (shapes only: no weights, no network),
and the images/s a worker should reach at 50% of an accelerator's peak, next to the
published figures.

Per image: the UNet once per step on a batch of 2 (classifier-free guidance), the text
encoder(s) on 2 prompts (prompt and negative), the VAE decoder once. The configs are the
published ones (runwayml/stable-diffusion-v1-5 and stabilityai/stable-diffusion-xl-base-1.0,
each component's config.json), keeping the fields the Flax classes read.

Usage: PYTHONPATH=. python bench/flops.py
"""

from __future__ import annotations

import os
import time
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from diffusion.flops import program_flops, unet_flops  # noqa: E402
from diffusion.nn.clip import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection  # noqa: E402
from diffusion.nn.unet import UNet2DConditionModel, UNetConfig  # noqa: E402
from diffusion.nn.vae import AutoencoderKL, VAEConfig  # noqa: E402

SD15_UNET = {
    "sample_size": 64, "in_channels": 4, "out_channels": 4, "layers_per_block": 2,
    "block_out_channels": [320, 640, 1280, 1280], "attention_head_dim": 8, "cross_attention_dim": 768,
    "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
    "flip_sin_to_cos": True, "freq_shift": 0,
}
SDXL_UNET = {
    "sample_size": 128, "in_channels": 4, "out_channels": 4, "layers_per_block": 2,
    "block_out_channels": [320, 640, 1280], "attention_head_dim": [5, 10, 20], "cross_attention_dim": 2048,
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    "transformer_layers_per_block": [1, 2, 10], "use_linear_projection": True,
    "addition_embed_type": "text_time", "addition_time_embed_dim": 256,
    "addition_embed_type_num_heads": 64, "projection_class_embeddings_input_dim": 2816,
    "flip_sin_to_cos": True, "freq_shift": 0,
}
VAE = {  # the same autoencoder shape for SD 1.5 and SDXL (sample_size and scaling differ)
    "in_channels": 3, "out_channels": 3, "latent_channels": 4, "layers_per_block": 2, "norm_num_groups": 32,
    "block_out_channels": [128, 256, 512, 512], "act_fn": "silu",
    "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
}
CLIP_L = {  # openai/clip-vit-large-patch14's text tower: SD 1.5's encoder, SDXL's first
    "vocab_size": 49408, "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
    "num_attention_heads": 12, "max_position_embeddings": 77, "hidden_act": "quick_gelu", "projection_dim": 768,
}
CLIP_BIGG = {  # SDXL's text_encoder_2 (OpenCLIP ViT-bigG/14, with projection)
    "vocab_size": 49408, "hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32,
    "num_attention_heads": 20, "max_position_embeddings": 77, "hidden_act": "gelu", "projection_dim": 1280,
}

# name: unet config, text encoders (config, with projection), image size, published figure
MODELS = {
    "SD 1.5": (SD15_UNET, [(CLIP_L, False)], 512,
               ("SD 1.4 on a TPU v2-8 (stable_diffusion_jax_blog.md)", 8, 50, 7.0, 4 * 45e12)),
    "SDXL": (SDXL_UNET, [(CLIP_L, False), (CLIP_BIGG, True)], 1024,
             ("SDXL on a TPU v5e-4 (HF: SDXL in JAX on Cloud TPU v5e)", 4, 20, 2.3, 4 * 197e12)),
}
# name: (chips, dense bf16 peak per chip in FLOP/s)
HARDWARE = {
    "TPU v5e chip": (1, 197e12), "TPU v5e-8 host": (8, 197e12),
    "TPU v6e chip": (1, 918e12), "TPU v6e-8 host": (8, 918e12),
    "H100 SXM": (1, 989e12), "8x H100 host": (8, 989e12),
}
UTILISATION = 0.5
CLIP_TOKENS = 77  # every SD text encoder's positions: the UNet's context length
KEY = jax.random.PRNGKey(0)


def unet_step(config: dict[str, Any], size: int) -> float:
    unet = UNet2DConditionModel(UNetConfig.from_dict(config))
    flops = unet_flops(unet, jax.eval_shape(unet.init_params, KEY), 2, size // 8, size // 8, CLIP_TOKENS)
    assert flops is not None
    return flops


def text_encoders(encoders: list[tuple[dict[str, Any], bool]]) -> float:
    """Prompt and negative prompt through each encoder, as the engine runs them."""
    total = 0.0
    for config, projection in encoders:
        cls = CLIPTextModelWithProjection if projection else CLIPTextModel
        model = cls(CLIPTextConfig.from_dict(config))
        params = jax.eval_shape(model.init_params, KEY)
        ids = jax.ShapeDtypeStruct((2, CLIP_TOKENS), jnp.int32)
        flops = program_flops(jax.jit(lambda p, i: model.apply({"params": p}, i)).lower(params, ids))  # noqa: B023
        assert flops is not None
        total += flops
    return total


def vae_decode(size: int, config: dict[str, Any] = VAE) -> float:
    vae = AutoencoderKL(VAEConfig.from_dict({**config, "sample_size": size}))
    params = jax.eval_shape(vae.init_params, KEY)
    latents = jax.ShapeDtypeStruct((1, vae.config.latent_channels, size // 8, size // 8), jnp.float32)
    flops = program_flops(jax.jit(lambda p, z: vae.apply({"params": p}, z, method=vae.decode))
                          .lower(params, latents))
    assert flops is not None
    return flops


def main() -> None:
    print(f"FLOPs from XLA's cost analysis of the lowered calls (jax {jax.__version__}); "
          f"1 TFLOP = 1e12 FLOP; images/s at {UTILISATION:.0%} of dense bf16 peak\n")
    for name, (unet_config, encoders, size, published) in MODELS.items():
        started = time.perf_counter()
        step, text, vae = unet_step(unet_config, size), text_encoders(encoders), vae_decode(size)
        print(f"{name} {size}x{size} (counted in {time.perf_counter() - started:.0f} s):")
        print(f"  UNet, batch 2 (guidance), per image per step {step / 1e12:8.3f} TFLOP")
        print(f"  text encoder(s), prompt + negative, per image {text / 1e12:8.3f} TFLOP")
        print(f"  VAE decode, per image                         {vae / 1e12:8.3f} TFLOP")
        label, images, steps, seconds, peak = published
        for n in sorted({steps, 25}):
            per_image = n * step + text + vae
            row = "  ".join(f"{hw} {UTILISATION * chips * chip_peak / per_image:7.2f}"
                            for hw, (chips, chip_peak) in HARDWARE.items())
            print(f"  {n:2d} steps: {per_image / 1e12:6.1f} TFLOP/image (UNet {n * step / per_image:.0%}); "
                  f"images/s: {row}")
        per_image = steps * step + text + vae
        achieved = images * per_image / seconds
        print(f"  published: {label}: {images} images at {steps} steps in ~{seconds} s = "
              f"{images / seconds:.2f} images/s = {achieved / 1e12:.0f} TFLOP/s, "
              f"{achieved / peak:.0%} of its {peak / 1e12:.0f} TFLOP/s peak; at 50% it would be "
              f"{UTILISATION * peak / per_image:.2f} images/s\n")


if __name__ == "__main__":
    main()
