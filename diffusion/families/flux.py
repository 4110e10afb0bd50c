"""Flux.1 (schnell and dev): CLIP-L's pooled output and T5's hidden states condition a
transformer that predicts the flow's velocity on packed latents, as diffusers' FluxPipeline.

The contract's latents are drawn as for every family, (1, 16, h/8, w/8) from PRNGKey(seed),
then packed: each 2x2 patch of the latent image becomes one token of 64 channels (diffusers'
`_pack_latents`), with (0, row, column) as its position id. One transformer call a step, no
classifier-free pass ever: dev is guidance-distilled (the job's guidance scale goes into the
transformer's guidance embedding), schnell takes no guidance at all. A job's negative prompt
is not used, as in FluxPipeline without `true_cfg_scale`. The latents are unpacked and decoded
as latents / scaling_factor + shift_factor.

T5's sequence length is BFL's choice (their reference code and model cards): 256 tokens for
schnell (no guidance embedding), 512 for dev (diffusers' default); `max_sequence_length`.

LoRAs change the transformer and CLIP, as diffusers' FluxLoraLoaderMixin (T5 has none); kohya's
files name the transformer's modules as BFL's code does (diffusion/bfl.py).
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from diffusion import bfl
from diffusion.family import Component, Family, Geometry, Networks, Tokenizer
from diffusion.flops import counted_once, program_flops
from diffusion.generate import Output, Static, decode, initial_latents, sample
from diffusion.lora import LoraTargets
from diffusion.nn.clip import CLIPTextConfig, CLIPTextModel
from diffusion.nn.flux import FluxConfig, FluxTransformer2DModel
from diffusion.nn.t5 import T5Config, T5EncoderModel
from diffusion.nn.vae import AutoencoderKL, VAEConfig
from diffusion.schedulers import Scheduler
from diffusion.sharding import TensorParallel
from diffusion.tiny_parts import EOS, clip_tokenizer_files, t5_tokenizer_files, text_config, write_pipeline
from diffusion.tokenizer import CLIPTokenizer, T5Tokenizer, TokenizerError

PATCH = 2  # latent pixels per token, each way
# The transformer's blocks split as Megatron splits one: q/k/v, the MLPs' first layers and the
# modulation linears by columns, the attention outputs and the MLPs' second layers by rows.
TRANSFORMER_TENSOR_PARALLEL = TensorParallel(
    columns=(r"(single_)?transformer_blocks_\d+/attn/(to_[qkv]|add_[qkv]_proj)",
             r"transformer_blocks_\d+/(ff|ff_context)/net_0/proj", r"transformer_blocks_\d+/(norm1|norm1_context)/linear",
             r"single_transformer_blocks_\d+/(norm/linear|proj_mlp)"),
    rows=(r"transformer_blocks_\d+/attn/(to_out_0|to_add_out)", r"transformer_blocks_\d+/(ff|ff_context)/net_2",
          r"single_transformer_blocks_\d+/proj_out"),
    packed=((r"single_transformer_blocks_\d+/proj_out", (1, 4)),))  # rows: attention's, the MLP's (4x wide)


class FluxInputs(NamedTuple):
    """One padded batch. Leading axis B everywhere; sharded over devices."""

    clip_ids: jax.Array  # (B, 77) int32
    t5_ids: jax.Array  # (B, max_sequence_length) int32
    keys: jax.Array  # (B, 2) uint32: jax.random.PRNGKey(seed) of each job
    guidance: jax.Array  # (B,) float32: dev's guidance embedding (schnell ignores it)


def max_sequence_length(config: FluxConfig) -> int:
    """T5 tokens per prompt: 256 for schnell (no guidance embedding), 512 for dev."""
    return 512 if config.guidance_embeds else 256


def t5_tokenizer(folder: pathlib.Path) -> T5Tokenizer:
    """tokenizer_2/, cut and padded to the length its pipeline's transformer was trained with."""
    path = folder.parent / "transformer" / "config.json"
    try:
        config = FluxConfig.from_dict(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError) as err:
        raise TokenizerError(f"{path}: needed for T5's sequence length, unreadable ({err})") from err
    return T5Tokenizer.from_folder(folder, max_sequence_length(config))


def inputs(tokenizers: Sequence[Tokenizer], prompts: Sequence[str], negatives: Sequence[str],
           seeds: Sequence[int], guidance: Sequence[float]) -> tuple[FluxInputs, list[bool]]:
    """A batch's inputs, a job per position (negative prompts are not used); a prompt is cut
    if either tokenizer cut it."""
    (clip_ids, clip_cut), (t5_ids, t5_cut) = (tokenizer(list(prompts)) for tokenizer in tokenizers)
    return FluxInputs(clip_ids, t5_ids, np.array([[0, seed] for seed in seeds], dtype=np.uint32),
                      np.array(guidance, dtype=np.float32)), [a or b for a, b in zip(clip_cut, t5_cut)]


def abstract_inputs(tokenizers: Sequence[Tokenizer], batch: int) -> FluxInputs:
    clip, t5 = tokenizers
    return FluxInputs(jax.ShapeDtypeStruct((batch, clip.max_length), jnp.int32),
                      jax.ShapeDtypeStruct((batch, t5.max_length), jnp.int32),
                      jax.ShapeDtypeStruct((batch, 2), jnp.uint32), jax.ShapeDtypeStruct((batch,), jnp.float32))


def pack(latents: jax.Array) -> jax.Array:
    """(B, C, h, w) -> (B, h/2 * w/2, C * 4): diffusers' `_pack_latents`, row-major patches."""
    b, c, h, w = latents.shape
    patches = latents.reshape(b, c, h // PATCH, PATCH, w // PATCH, PATCH).transpose(0, 2, 4, 1, 3, 5)
    return patches.reshape(b, (h // PATCH) * (w // PATCH), c * PATCH * PATCH)


def unpack(latents: jax.Array, h: int, w: int) -> jax.Array:
    """The inverse of `pack` for an h x w latent image (diffusers' `_unpack_latents`)."""
    b, _, channels = latents.shape
    c = channels // (PATCH * PATCH)
    patches = latents.reshape(b, h // PATCH, w // PATCH, c, PATCH, PATCH).transpose(0, 3, 1, 4, 2, 5)
    return patches.reshape(b, c, h, w)


def image_ids(rows: int, columns: int) -> np.ndarray:
    """(rows * columns, 3) position ids of the packed tokens: (0, row, column), row-major."""
    grid = np.zeros((rows, columns, 3), np.float32)
    grid[..., 1] = np.arange(rows)[:, None]
    grid[..., 2] = np.arange(columns)[None, :]
    return grid.reshape(rows * columns, 3)


def _latent_size(nets: Networks, height: int, width: int) -> tuple[int, int]:
    f = nets["vae"].config.scale_factor
    return height // f, width // f


def encode(nets: Networks, params: Any, inputs: FluxInputs, guided: bool) -> dict[str, jax.Array]:
    """CLIP's pooled output and T5's hidden states of the prompts (never a negative: `guided` is
    always False, the family has no classifier-free pass)."""
    return {"pooled": nets["text_encoder"].apply({"params": params["text_encoder"]}, inputs.clip_ids).pooled,
            "context": nets["text_encoder_2"].apply({"params": params["text_encoder_2"]}, inputs.t5_ids)}


def generate(nets: Networks, scheduler: Scheduler, static: Static, params: Any, inputs: FluxInputs,
             encoded: dict[str, jax.Array]) -> Output:
    transformer, vae = nets["transformer"], nets["vae"]
    pooled, context = encoded["pooled"], encoded["context"]
    h, w = _latent_size(nets, static.height, static.width)
    latents = pack(initial_latents(inputs.keys, (transformer.config.in_channels // 4, h, w)))
    img_ids, txt_ids = image_ids(h // PATCH, w // PATCH), np.zeros((context.shape[1], 3), np.float32)
    guidance = inputs.guidance if transformer.config.guidance_embeds else None

    def predict(x: jax.Array, t: jax.Array) -> jax.Array:  # the pipeline feeds timestep / 1000
        return transformer.apply({"params": params["transformer"]}, x, t / 1000, context, pooled, guidance,
                                 img_ids, txt_ids)

    latents = sample(predict, scheduler, static._replace(guided=False), latents, inputs)
    return decode(vae, params["vae"], unpack(latents, h, w), shift=vae.config.shift_factor or 0.0)


def geometry(nets: Networks) -> Geometry:
    """Native size: the VAE's sample size; size step: VAE factor x the 2x2 packing."""
    return Geometry(native_size=int(nets["vae"].config.sample_size), size_step=nets["vae"].config.scale_factor * PATCH)


def denoiser_flops(nets: Networks, params: Any, rows: int, height: int, width: int) -> float | None:
    """One transformer call on `rows` packed latents of a `height` x `width` image and
    max_sequence_length T5 tokens, lowered (shapes only)."""
    return transformer_flops(nets["transformer"], params["transformer"], rows, *_latent_size(nets, height, width))


@counted_once
def transformer_flops(transformer: FluxTransformer2DModel, params: Any, rows: int, h: int, w: int) -> float | None:
    """One transformer call on `rows` packed latents of `h` x `w`, once per shapes in a process."""
    cfg = transformer.config
    tokens, text = (h // PATCH) * (w // PATCH), max_sequence_length(cfg)
    f32 = jnp.float32
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype), params)

    def call(weights: Any, latents: jax.Array, context: jax.Array, pooled: jax.Array) -> jax.Array:
        t = jnp.ones((rows,), f32)
        return transformer.apply({"params": weights}, latents, t, context, pooled, t,
                                 image_ids(h // PATCH, w // PATCH), np.zeros((text, 3), np.float32))

    return program_flops(jax.jit(call).lower(
        shapes, jax.ShapeDtypeStruct((rows, tokens, cfg.in_channels), f32),
        jax.ShapeDtypeStruct((rows, text, cfg.joint_attention_dim), f32),
        jax.ShapeDtypeStruct((rows, cfg.pooled_projection_dim), f32)))


def kohya_modules(config: FluxConfig) -> dict[str, list[tuple[str, int, int]]]:
    """The transformer's linear layers in kohya's (BFL's) names -> where each one's output rows go."""
    return {module: bfl.diffusers_modules(module, config) for module in bfl.bfl_modules(config)}


def tiny_configs(clip_vocab: int, t5_vocab: int) -> dict[str, dict[str, Any]]:
    """The tiny dev's component configs (one block of each kind, a two-layer T5 and CLIP, a
    four-block 16-channel VAE: 64x64 native, factor 8) for tokenizers of these sizes."""
    t5 = {"model_type": "t5", "vocab_size": t5_vocab, "d_model": 32, "d_kv": 8, "d_ff": 48, "num_layers": 2,
          "num_heads": 4, "relative_attention_num_buckets": 8, "relative_attention_max_distance": 32,
          "feed_forward_proj": "gated-gelu"}
    transformer = {"in_channels": 64, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16,
                   "num_attention_heads": 2, "joint_attention_dim": 32, "pooled_projection_dim": 32,
                   "guidance_embeds": True, "axes_dims_rope": [4, 6, 6]}
    vae = {"block_out_channels": [8, 8, 16, 16], "down_block_types": ["DownEncoderBlock2D"] * 4,
           "up_block_types": ["UpDecoderBlock2D"] * 4, "layers_per_block": 1, "latent_channels": 16,
           "norm_num_groups": 8, "sample_size": 64, "scaling_factor": 0.3611, "shift_factor": 0.1159,
           "use_quant_conv": False, "use_post_quant_conv": False}
    return {"text_encoder": text_config(clip_vocab), "text_encoder_2": t5, "transformer": transformer, "vae": vae}


def tiny(family: Family, out: pathlib.Path, seed: int) -> None:
    """A tiny random dev (guidance embedding, dynamic shift): `tiny_configs`' networks."""
    vocab = clip_tokenizer_files(out / "tokenizer", pad=EOS)
    t5_vocab = t5_tokenizer_files(out / "tokenizer_2")
    scheduler = {"_class_name": "FlowMatchEulerDiscreteScheduler", "base_image_seq_len": 256, "base_shift": 0.5,
                 "max_image_seq_len": 4096, "max_shift": 1.15, "num_train_timesteps": 1000, "shift": 3.0,
                 "use_dynamic_shifting": True}  # FLUX.1-dev's
    write_pipeline(out, family, tiny_configs(vocab, t5_vocab), scheduler, seed,
                   {"tokenizer": ["transformers", "CLIPTokenizer"], "tokenizer_2": ["transformers", "T5TokenizerFast"]})


FAMILY = Family(
    name="flux",
    pipelines=("FluxPipeline",),
    components={"text_encoder": Component(CLIPTextModel, CLIPTextConfig, "clip"),
                "text_encoder_2": Component(T5EncoderModel, T5Config, "t5"),
                "transformer": Component(FluxTransformer2DModel, FluxConfig, "flux"),
                "vae": Component(AutoencoderKL, VAEConfig, "vae")},
    tokenizers={"tokenizer": CLIPTokenizer.from_folder, "tokenizer_2": t5_tokenizer},
    text_encoders=("text_encoder", "text_encoder_2"),
    encode=encode,
    inputs=inputs,
    abstract_inputs=abstract_inputs,
    generate=generate,
    geometry=geometry,
    denoiser_flops=denoiser_flops,
    tiny=tiny,
    schedulers=("flow_euler",),
    default_guidance=3.5,  # FluxPipeline's (dev's guidance embedding; schnell has none)
    classifier_free=False,
    loras=LoraTargets("transformer", ("text_encoder",), kohya_modules),
    tensor_parallel={"transformer": TRANSFORMER_TENSOR_PARALLEL},
)
