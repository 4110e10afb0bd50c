"""What the SD-style families share on the host: CLIP tokenizers whose id rows, one per text
encoder, are the batch's inputs (diffusion.generate.Inputs), and a UNet denoising VAE
latents with those encoders' hidden states as its context. Their image sizes follow from the
VAE's scale factor and the UNet's downsamplings, and a denoiser call's FLOPs from the UNet
lowered on those shapes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from diffusion.family import Geometry, Networks, Tokenizer
from diffusion.flops import unet_flops
from diffusion.generate import Inputs
from diffusion.sharding import TensorParallel

# The UNet's transformer blocks split as Megatron splits one (the ResNets and convolutions stay whole).
UNET_TENSOR_PARALLEL = TensorParallel(columns=(r".*/attn[12]/to_[qkv]", r".*/ff/net_0/proj"),
                                      rows=(r".*/attn[12]/to_out_0", r".*/ff/net_2"),
                                      packed=((r".*/ff/net_0/proj", (1, 1)),))  # GEGLU: hidden, gate


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
