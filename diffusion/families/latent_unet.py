"""What the SD-style families share on the host: a UNet denoising VAE latents, with CLIP
hidden states as its context. Their image sizes follow from the VAE's scale factor and the
UNet's downsamplings, and a denoiser call's FLOPs from the UNet lowered on those shapes."""

from __future__ import annotations

from typing import Any

from diffusion.family import Geometry, Networks
from diffusion.flops import unet_flops


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
