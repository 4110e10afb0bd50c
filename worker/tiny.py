"""Tiny random-weight Stable Diffusion pipelines for tests, demos and benchmarks.

The real checkpoints are gigabytes and need network access; these folders are a few megabytes, are built
offline in seconds, and load through exactly the same diffusers Flax code path as the real ones (same
model_index.json layout, same component classes, 64x64 native size, vae_scale_factor 8).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import tempfile
import warnings
from collections.abc import Callable, Iterator

import jax
import numpy as np
import transformers
from diffusers.utils import logging as diffusers_logging
from flax.traverse_util import flatten_dict, unflatten_dict
from transformers import (
    CLIPTextConfig,
    CLIPTokenizer,
    FlaxCLIPTextModel,
    FlaxCLIPTextModelWithProjection,
)
from transformers.models.clip.tokenization_clip import bytes_to_unicode


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence the diffusers/transformers deprecation and safety-checker chatter, then restore the levels."""
    diffusers_level = diffusers_logging.get_verbosity()
    transformers_level = transformers.logging.get_verbosity()
    diffusers_logging.set_verbosity_error()
    transformers.logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        diffusers_logging.set_verbosity(diffusers_level)
        transformers.logging.set_verbosity(transformers_level)


with _quiet():  # importing the Flax UNet logs "Flax classes are deprecated" twice (diffusers.models.embeddings_flax)
    from diffusers import (
        FlaxAutoencoderKL,
        FlaxEulerDiscreteScheduler,
        FlaxPNDMScheduler,
        FlaxStableDiffusionPipeline,
        FlaxStableDiffusionXLPipeline,
        FlaxUNet2DConditionModel,
    )

KINDS = ("sd", "sdxl")

_MAX_LENGTH = 77  # CLIP context length; every real SD tokenizer pads to it.
_TEXT_HIDDEN = 32  # hidden size (and SDXL projection_dim) of each tiny CLIP text encoder
_TIME_EMBED_DIM = 8  # SDXL addition_time_embed_dim (256 in the real model)
_SD_BETAS = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear"}


def _tokenizer(pad_token: str) -> CLIPTokenizer:
    """A byte-level CLIP BPE tokenizer without merges: every UTF-8 byte is a token, so any text encodes."""
    byte_chars = list(bytes_to_unicode().values())
    tokens = byte_chars + [c + "</w>" for c in byte_chars] + ["<|startoftext|>", "<|endoftext|>"]
    with tempfile.TemporaryDirectory() as tmp:
        vocab_file = pathlib.Path(tmp, "vocab.json")
        merges_file = pathlib.Path(tmp, "merges.txt")
        vocab_file.write_text(json.dumps({token: i for i, token in enumerate(tokens)}), encoding="utf-8")
        merges_file.write_text("#version: 0.2\n", encoding="utf-8")
        return CLIPTokenizer(str(vocab_file), str(merges_file), pad_token=pad_token, model_max_length=_MAX_LENGTH)


def _text_config(tokenizer: CLIPTokenizer, **extra: int) -> CLIPTextConfig:
    return CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=_TEXT_HIDDEN,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=_MAX_LENGTH,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **extra,
    )


def _unet(kind: str) -> FlaxUNet2DConditionModel:
    """Two UNet levels (one downsampling) on 8x8 latents; SDXL adds the pooled-text + size conditioning."""
    config = {
        "sample_size": 8,
        "block_out_channels": (32, 64),  # multiples of 32: the Flax ResNet GroupNorm hard-codes 32 groups
        "layers_per_block": 1,
        "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D"),
        "up_block_types": ("CrossAttnUpBlock2D", "UpBlock2D"),
        "attention_head_dim": (2, 4),  # the Flax UNet reads this as the number of heads
    }
    if kind == "sd":
        return FlaxUNet2DConditionModel(**config, cross_attention_dim=_TEXT_HIDDEN)
    return FlaxUNet2DConditionModel(
        **config,
        cross_attention_dim=2 * _TEXT_HIDDEN,  # both encoders' hidden states, concatenated
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=_TIME_EMBED_DIM,
        # pooled text_embeds (text_encoder_2's projection_dim) + 6 micro-conditions (sizes and crop)
        projection_class_embeddings_input_dim=_TEXT_HIDDEN + 6 * _TIME_EMBED_DIM,
    )


def _vae(kind: str) -> FlaxAutoencoderKL:
    """Four blocks, i.e. three downsamplings: vae_scale_factor 8 as in the real SD family."""
    return FlaxAutoencoderKL(
        block_out_channels=(8, 8, 16, 16),
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=8,
        sample_size=64,
        scaling_factor=0.18215 if kind == "sd" else 0.13025,
    )


def _random_params(init_weights: Callable[[jax.Array], dict], seed: int, stream: int) -> dict:
    """Parameters shaped by the module's own `init_weights`, filled with seeded NumPy values.

    Only the shapes come from JAX (`eval_shape`, no compilation): actually running `init_weights` compiles
    ~200 random initialisers and takes about a minute on a 2-core CPU. The values follow Flax's defaults
    (LeCun-normal kernels and embeddings, zero biases, unit norm scales) without the truncation.
    """
    rng = np.random.default_rng([seed, stream])
    shapes = flatten_dict(jax.eval_shape(init_weights, jax.random.PRNGKey(0)))
    params = {}
    for path, leaf in sorted(shapes.items()):
        if path[-1] == "bias":
            value = np.zeros(leaf.shape)
        elif path[-1] == "scale":
            value = np.ones(leaf.shape)
        else:  # "kernel" (Dense, Conv) or "embedding"
            value = rng.standard_normal(leaf.shape) / np.sqrt(np.prod(leaf.shape[:-1]))
        params[path] = value.astype(leaf.dtype)
    return unflatten_dict(params)


def build_tiny_model(out_dir: str | os.PathLike, kind: str = "sd", seed: int = 0) -> pathlib.Path:
    """Build a tiny random-weight text-to-image pipeline of `kind` ("sd" or "sdxl") and save it to `out_dir`.

    Real checkpoints are too big and need the network; this folder loads through the same code path, with
    `FlaxStableDiffusionPipeline.from_pretrained(out_dir, safety_checker=None, feature_extractor=None)` or
    `FlaxStableDiffusionXLPipeline.from_pretrained(out_dir)`, and, once compiled, renders a batch of 64x64
    images in tens of milliseconds on a CPU, so the whole farm can be exercised offline. The weights depend only on `seed`: two builds with the
    same seed write identical files. Returns the folder's path.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    out = pathlib.Path(out_dir)
    with _quiet():
        unet, vae = _unet(kind), _vae(kind)
        tokenizer = _tokenizer(pad_token="<|endoftext|>")
        text_encoder = FlaxCLIPTextModel(_text_config(tokenizer), _do_init=False)
        params = {
            "text_encoder": _random_params(lambda key: text_encoder.init_weights(key, (1, _MAX_LENGTH)), seed, 0),
            "unet": _random_params(unet.init_weights, seed, 1),
            "vae": _random_params(vae.init_weights, seed, 2),
        }
        if kind == "sd":
            pipeline = FlaxStableDiffusionPipeline(
                vae=vae,
                text_encoder=text_encoder,
                tokenizer=tokenizer,
                unet=unet,
                scheduler=FlaxPNDMScheduler(
                    **_SD_BETAS, skip_prk_steps=True, set_alpha_to_one=False, steps_offset=1
                ),
                safety_checker=None,
                feature_extractor=None,
            )
        else:
            tokenizer_2 = _tokenizer(pad_token="!")
            text_encoder_2 = FlaxCLIPTextModelWithProjection(
                _text_config(tokenizer_2, projection_dim=_TEXT_HIDDEN), _do_init=False
            )
            params["text_encoder_2"] = _random_params(
                lambda key: text_encoder_2.init_weights(key, (1, _MAX_LENGTH)), seed, 3
            )
            pipeline = FlaxStableDiffusionXLPipeline(
                text_encoder=text_encoder,
                text_encoder_2=text_encoder_2,
                vae=vae,
                tokenizer=tokenizer,
                tokenizer_2=tokenizer_2,
                unet=unet,
                # SDXL's own scheduler; for "leading" spacing Flax hard-codes SDXL's steps_offset of 1.
                scheduler=FlaxEulerDiscreteScheduler(**_SD_BETAS, timestep_spacing="leading"),
            )
        pipeline.save_pretrained(out, params=params)
    return out
