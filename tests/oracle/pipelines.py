"""Tiny SD 1.x / 2.x / XL checkpoints and the images diffusers' PyTorch pipelines render from them.

`write(data)` rebuilds `data/oracle/` (data = tests/data):

    oracle/<name>/model/            diffusers folder (save_pretrained, safetensors, float32 weights;
                                    sd1 also `*.fp16.safetensors`, sdxl also `*.bf16.safetensors`)
    oracle/<name>/<scheduler>/<i>.png            reference images, float32 weights
    oracle/<name>/<scheduler>-64x128/<i>.png     the non-square set (width 64, height 128): sd1 and
                                                 sdxl (whose size ids see it), euler only
    oracle/<name>/<variant>/<scheduler>/<i>.png  reference images of the fp16/bf16 weights, upcast (one
                                                 scheduler: VARIANTS)
    oracle/<name>/jobs.json                      every job: its fields, model folder, variant, image
    oracle/sd1-sharded/model/       the sd1 float32 weights again, sharded (index json + shards);
                                    its jobs.json points at sd1's images (same weights, same pixels)

Each job is one call of the PyTorch pipeline loaded back from the saved folder (`from_pretrained`, so
the scheduler config carries `_use_default_values` exactly as for a real checkpoint), batch size 1,
with the contract's latents `jax.random.normal(PRNGKey(seed), (1, C, h // 8, w // 8))`, float32 on
the CPU, `output_type="np"`, and uint8 = round(image * 255).

Weights come from diffusers' / transformers' own initialisers under `torch.manual_seed`, then a few
deterministic adjustments (`_liven_*`) so that every parameter matters to the pixels (no zero biases,
no unit norm scales a loader could silently skip) and so that the prompt, the negative prompt and the
guidance scale visibly change the image while it stays neither flat grey nor saturated.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import tempfile
import warnings
from typing import Any

import diffusers
import jax
import jax.numpy as jnp
import numpy as np
import PIL.Image
import tokenizers
import torch
import transformers
from diffusers import (
    AutoencoderKL,
    StableDiffusionPipeline,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
)

from harness.tokenizer import bytes_to_unicode
from tests.oracle.noise import seeded_noise
from tests.oracle.schedulers import CLASSES

# The deterministic schedulers, each rendered for every family here (the stochastic ones, with the
# sampler options and few-step recipes, are tests/oracle/samplers.py's).
SCHEDULERS = {name: CLASSES[name] for name in ("pndm", "ddim", "lms", "euler", "dpm")}
STEPS = 4
NATIVE = (64, 64)  # (width, height): unet sample_size 8 x vae_scale_factor 8
NON_SQUARE = (64, 128)  # (width, height): another compiled shape; latents (1, 4, 16, 8)
MAX_LENGTH = 77
# The extra weight formats: sd1 in float16, sdxl in bfloat16, beside the float32 files.
# (variant, its dtype, the one scheduler its references render with) per family that has one
VARIANTS = {"sd1": ("fp16", torch.float16, "dpm"), "sdxl": ("bf16", torch.bfloat16, "euler")}
SHARD_SIZE = "50KB"  # sd1-sharded: the unet, vae and text encoder each in several shards

# One compiled batch on the farm: same model, scheduler, size and steps; everything else varies.
# negative_prompt None and "" are the same to StableDiffusionPipeline (None encodes "") but not to
# StableDiffusionXLPipeline with force_zeros_for_empty_prompt: None -> zero embeddings, "" -> encoded.
# guidance_scale <= 1 makes both pipelines skip classifier-free guidance (the negative is unused).
JOBS: tuple[dict[str, Any], ...] = (
    {"prompt": "a red fox in fresh snow", "negative_prompt": None, "seed": 0, "guidance_scale": 7.5},
    {"prompt": "a lighthouse on a cliff at dusk, oil painting", "negative_prompt": "blurry, low quality",
     "seed": 1, "guidance_scale": 3.0},
    {"prompt": "Portrait of an old sailor", "negative_prompt": "", "seed": 2, "guidance_scale": 12.0},
    {"prompt": "a bowl of ramen", "negative_prompt": None, "seed": 3, "guidance_scale": 1.0},
    {"prompt": "a city street in the rain", "negative_prompt": "cars", "seed": 4, "guidance_scale": 0.5},
    {"prompt": "café ☕ über die Straße, naïve 東京", "negative_prompt": "ugly", "seed": 2**32 - 1,
     "guidance_scale": 7.5},
    # 101 byte tokens: the pipeline keeps bos + the first 75 + eos (and logs the truncation).
    {"prompt": "an extremely detailed matte painting of a ruined castle on a mountain above a misty "
               "valley at sunrise, dramatic light, 8k",
     "negative_prompt": "", "seed": 2**31 + 5, "guidance_scale": 5.0},
    # "!" is tokenizer_2's (and SD 2's) pad token: in the text it is then matched as that special token
    # ("!!" -> 0, 0 instead of 0, 256 for "!" "!</w>").
    {"prompt": "A CAT!!  wearing   a tiny hat", "negative_prompt": None, "seed": 123456, "guidance_scale": 3.0},
)

_BETAS = {"beta_end": 0.012, "beta_schedule": "scaled_linear", "beta_start": 0.00085}
# The scheduler_config.json files of the real checkpoints, key for key (diffusers fills the missing
# keys with the class defaults and lists them in `_use_default_values`, which `from_config` honours).
SCHEDULER_CONFIGS = {
    # runwayml/stable-diffusion-v1-5
    "sd1": {"_class_name": "PNDMScheduler", "_diffusers_version": "0.6.0", **_BETAS, "num_train_timesteps": 1000,
            "set_alpha_to_one": False, "skip_prk_steps": True, "steps_offset": 1, "trained_betas": None,
            "clip_sample": False},
    # stabilityai/stable-diffusion-2-1
    "sd2": {"_class_name": "DDIMScheduler", "_diffusers_version": "0.8.0", **_BETAS, "clip_sample": False,
            "num_train_timesteps": 1000, "prediction_type": "v_prediction", "set_alpha_to_one": False,
            "skip_prk_steps": True, "steps_offset": 1, "trained_betas": None},
    # stabilityai/stable-diffusion-xl-base-1.0
    "sdxl": {"_class_name": "EulerDiscreteScheduler", "_diffusers_version": "0.19.0.dev0", **_BETAS,
             "clip_sample": False, "interpolation_type": "linear", "num_train_timesteps": 1000,
             "prediction_type": "epsilon", "sample_max_value": 1.0, "set_alpha_to_one": False,
             "skip_prk_steps": True, "steps_offset": 1, "timestep_spacing": "leading", "trained_betas": None,
             "use_karras_sigmas": False},
}


# --------------------------------------------------------------------------------------------- tokenizer

def _special(content: str, normalized: bool = True) -> dict[str, Any]:
    return {"content": content, "lstrip": False, "normalized": normalized, "rstrip": False, "single_word": False}


def tokenizer_files(pad_token: str) -> dict[str, str]:
    """A byte-level CLIP BPE without merges (every UTF-8 byte a token), as transformers 4.57 saves it.

    The same vocabulary as diffusion/tiny.py's `_tokenizer`: the 256 byte characters, their `</w>` forms,
    then <|startoftext|> (512) and <|endoftext|> (513). `pad_token` is "<|endoftext|>" (SD 1.x) or "!"
    (SD 2.x's tokenizer and SDXL's tokenizer_2, as in the real checkpoints).
    """
    chars = list(bytes_to_unicode().values())
    tokens = chars + [c + "</w>" for c in chars] + ["<|startoftext|>", "<|endoftext|>"]
    vocab = {token: i for i, token in enumerate(tokens)}
    added = {}
    if pad_token != "<|endoftext|>":
        added[str(vocab[pad_token])] = {**_special(pad_token, normalized=False), "special": True}
    added["512"] = {**_special("<|startoftext|>"), "special": True}
    added["513"] = {**_special("<|endoftext|>"), "special": True}
    config = {
        "added_tokens_decoder": added,
        "bos_token": "<|startoftext|>",
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|endoftext|>",
        "errors": "replace",
        "extra_special_tokens": {},
        "model_max_length": MAX_LENGTH,
        "pad_token": pad_token,
        "tokenizer_class": "CLIPTokenizer",
        "unk_token": "<|endoftext|>",
    }
    special_map = {
        "bos_token": _special("<|startoftext|>"),
        "eos_token": _special("<|endoftext|>"),
        "pad_token": pad_token,
        "unk_token": _special("<|endoftext|>"),
    }
    dump = lambda obj: json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    return {
        "vocab.json": dump(vocab),
        "merges.txt": "#version: 0.2\n",
        "tokenizer_config.json": dump(config),
        "special_tokens_map.json": dump(special_map),
    }


def _write_tokenizer(folder: pathlib.Path, pad_token: str) -> None:
    """Replace whatever save_pretrained wrote (transformers 5 writes tokenizer.json) by the four files."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for name, text in tokenizer_files(pad_token).items():
        (folder / name).write_text(text, encoding="utf-8")


def _tokenizer(pad_token: str) -> CLIPTokenizer:
    with tempfile.TemporaryDirectory() as tmp:
        _write_tokenizer(pathlib.Path(tmp, "tok"), pad_token)
        return CLIPTokenizer.from_pretrained(pathlib.Path(tmp, "tok"))


# ------------------------------------------------------------------------------------------------ models

def _text_config(tokenizer: CLIPTokenizer, hidden: int, intermediate: int, act: str, **extra: Any) -> CLIPTextConfig:
    return CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=MAX_LENGTH,
        hidden_act=act,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **extra,
    )


def _unet_config(family: str) -> dict[str, Any]:
    common = {
        "sample_size": 8,
        "in_channels": 4,
        "out_channels": 4,
        "block_out_channels": (8, 16),
        "norm_num_groups": 4,  # 2 and 4 channels a group: a group layout bug shows
        "layers_per_block": 1,
        "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D"),
        "up_block_types": ("CrossAttnUpBlock2D", "UpBlock2D"),
    }
    if family == "sd1":  # SD 1.x: one int head count, conv proj_in/proj_out
        return {**common, "attention_head_dim": 2, "cross_attention_dim": 32}
    if family == "sd2":  # SD 2.x: heads per block, linear proj_in/proj_out, upcast_attention as SD 2.1
        return {**common, "attention_head_dim": (2, 4), "cross_attention_dim": 32, "use_linear_projection": True,
                "upcast_attention": True}
    return {  # SDXL: both encoders' penultimate states concatenated; pooled text + 6 size ids
        **common,
        "attention_head_dim": (2, 4),
        "transformer_layers_per_block": (1, 2),
        "cross_attention_dim": 32 + 48,
        "use_linear_projection": True,
        "addition_embed_type": "text_time",
        "addition_time_embed_dim": 8,
        "projection_class_embeddings_input_dim": 40 + 6 * 8,
    }


def _vae(scaling_factor: float) -> AutoencoderKL:
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        block_out_channels=(4, 8, 8, 8),  # three downsamplings: vae_scale_factor 8
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=2,  # 2 and 4 channels a group
        sample_size=64,
        scaling_factor=scaling_factor,
    )


def _normal_(tensor: torch.Tensor, std: float, mean: float = 0.0) -> None:
    with torch.no_grad():
        tensor.copy_(torch.randn(tensor.shape) * std + mean)


def _liven_norms_and_biases(model: torch.nn.Module) -> None:
    """Norm scales 1 + N(0, 0.1^2) and shifts N(0, 0.05^2); zero-initialised biases N(0, 0.02^2).

    The libraries initialise norms to (1, 0) and many biases to 0: a loader that dropped those
    parameters would still reproduce the pixels. After this, every parameter changes them.
    """
    for module in model.modules():
        if isinstance(module, (torch.nn.GroupNorm, torch.nn.LayerNorm)) and module.weight is not None:
            _normal_(module.weight, 0.1, mean=1.0)
            _normal_(module.bias, 0.05)
        elif isinstance(getattr(module, "bias", None), torch.nn.Parameter) and not module.bias.detach().any():
            _normal_(module.bias, 0.02)


def _text_encoder(config: CLIPTextConfig, seed: int, with_projection: bool) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = (CLIPTextModelWithProjection if with_projection else CLIPTextModel)(config)
    _liven_norms_and_biases(model)
    # transformers 5's CLIPTextModel holds the embeddings itself (the checkpoint names keep text_model.)
    embeddings = getattr(model, "text_model", model).embeddings
    # transformers draws token and position embeddings with std 0.02: the residual stream (and so the
    # penultimate hidden states SDXL reads) would carry almost nothing of the prompt.
    _normal_(embeddings.token_embedding.weight, 1.0)
    _normal_(embeddings.position_embedding.weight, 0.3)
    return model.eval()


def unet(family: str, seed: int, in_channels: int = 4) -> UNet2DConditionModel:
    """The tiny UNet of `family`; an inpainting one takes 9 channels (latents, mask, masked image's latents)."""
    torch.manual_seed(seed)
    model = UNet2DConditionModel(**{**_unet_config(family), "in_channels": in_channels})
    _liven_norms_and_biases(model)
    with torch.no_grad():
        for name, module in model.named_modules():
            # Sharper cross-attention: PyTorch's default init leaves it nearly uniform over the 77
            # tokens, mostly padding, so the prompt would barely matter.
            if name.endswith("attn2"):
                module.to_k.weight.mul_(4.0)
            # The timestep's say in each ResNet: with PyTorch's init the output hardly changes with t,
            # and the multistep schedulers (pndm, lms, dpm) would differ little from one another.
            if name.endswith("time_emb_proj"):
                module.weight.mul_(3.0)
                module.bias.mul_(3.0)
        # A noise (or v) prediction of about unit variance, as a trained UNet's.
        model.conv_out.weight.mul_(3.0)
        model.conv_out.bias.mul_(3.0)
    return model.eval()


def _vae_model(scaling_factor: float, seed: int) -> AutoencoderKL:
    torch.manual_seed(seed)
    model = _vae(scaling_factor)
    _liven_norms_and_biases(model)
    return model.eval()


def build(family: str) -> StableDiffusionPipeline | StableDiffusionXLPipeline:
    """The tiny pipeline of `family` ("sd1", "sd2", "sdxl"), weights fixed by the seeds below."""
    seed = {"sd1": 100, "sd2": 200, "sdxl": 300}[family]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if family in ("sd1", "sd2"):
            tokenizer = _tokenizer("<|endoftext|>" if family == "sd1" else "!")
            act = "quick_gelu" if family == "sd1" else "gelu"
            text_encoder = _text_encoder(_text_config(tokenizer, 32, 37, act), seed + 1, with_projection=False)
            return StableDiffusionPipeline(
                vae=_vae_model(0.18215, seed + 3),
                text_encoder=text_encoder,
                tokenizer=tokenizer,
                unet=unet(family, seed + 2),
                scheduler=_scheduler_from_real_config(family),
                safety_checker=None,
                feature_extractor=None,
                requires_safety_checker=False,
            )
        tokenizer = _tokenizer("<|endoftext|>")
        tokenizer_2 = _tokenizer("!")
        return StableDiffusionXLPipeline(
            vae=_vae_model(0.13025, seed + 3),
            text_encoder=_text_encoder(_text_config(tokenizer, 32, 37, "quick_gelu"), seed + 1, with_projection=False),
            text_encoder_2=_text_encoder(
                _text_config(tokenizer_2, 48, 53, "gelu", projection_dim=40), seed + 4, with_projection=True
            ),
            tokenizer=tokenizer,
            tokenizer_2=tokenizer_2,
            unet=unet(family, seed + 2),
            scheduler=_scheduler_from_real_config(family),
            force_zeros_for_empty_prompt=True,
            add_watermarker=False,
        )


def _scheduler_from_real_config(family: str):
    config = SCHEDULER_CONFIGS[family]
    return getattr(diffusers, config["_class_name"]).from_config(config)


def _prefix_text_model(component: pathlib.Path) -> None:
    """Give CLIPTextModel's tensors their usual checkpoint names: `text_model.embeddings...`.

    transformers 5 flattened CLIPTextModel (no `text_model` submodule) and saves the flat names; it
    still loads the prefixed ones (a PrefixChange conversion), which every real SD text_encoder has.
    CLIPTextModelWithProjection keeps `text_model.` + `text_projection.weight` by itself.
    """
    rename = lambda key: key if key.startswith("text_model.") else f"text_model.{key}"
    for path in sorted(component.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            metadata = f.metadata()
            tensors = {rename(key): f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (a safe_open handle)
        save_file(tensors, path, metadata=metadata)
    for path in sorted(component.glob("*.safetensors.index.json")):
        index = json.loads(path.read_text(encoding="utf-8"))
        index["weight_map"] = {rename(k): v for k, v in sorted(index["weight_map"].items())}
        path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def save(pipe, folder: pathlib.Path, family: str, **kwargs: Any) -> None:
    """save_pretrained, then the tokenizer folders, scheduler config and text_encoder tensor names exactly
    as in the real checkpoints."""
    pipe.save_pretrained(folder, safe_serialization=True, **kwargs)
    _prefix_text_model(folder / "text_encoder")
    _write_tokenizer(folder / "tokenizer", "<|endoftext|>" if family in ("sd1", "sdxl") else "!")
    if family == "sdxl":
        _write_tokenizer(folder / "tokenizer_2", "!")
    (folder / "scheduler" / "scheduler_config.json").write_text(
        json.dumps(SCHEDULER_CONFIGS[family], indent=2, sort_keys=True) + "\n", encoding="utf-8"
    )


def save_variant(pipe, folder: pathlib.Path, family: str, variant: str, dtype: torch.dtype) -> None:
    """Add `*.<variant>.safetensors` beside the float32 files; the config files stay the float32 ones."""
    with tempfile.TemporaryDirectory() as tmp:
        pipe.to(dtype).save_pretrained(tmp, safe_serialization=True, variant=variant)
        pipe.to(torch.float32)
        for path in sorted(pathlib.Path(tmp).glob(f"*/*.{variant}.safetensors")):
            shutil.copyfile(path, folder / path.parent.name / path.name)
    _prefix_text_model(folder / "text_encoder")


def load(folder: pathlib.Path, family: str, variant: str | None = None):
    cls = StableDiffusionXLPipeline if family == "sdxl" else StableDiffusionPipeline
    extra = {"add_watermarker": False} if family == "sdxl" else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = cls.from_pretrained(folder, torch_dtype=torch.float32, variant=variant, **extra)
    pipe.set_progress_bar_config(disable=True)
    pipe.oracle_scheduler_config = pipe.scheduler.config
    return pipe


# --------------------------------------------------------------------------------------------- rendering

def contract_latents(seed: int, channels: int, width: int, height: int, factor: int) -> torch.Tensor:
    noise = jax.random.normal(jax.random.PRNGKey(seed), (1, channels, height // factor, width // factor), jnp.float32)
    return torch.from_numpy(np.array(noise))


def render(pipe, scheduler: str, job: dict[str, Any], width: int, height: int, steps: int = STEPS,
           **overrides: Any) -> np.ndarray:
    """One job through the PyTorch pipeline: (height, width, 3) uint8.

    The scheduler is made afresh for every job from the model's own scheduler config (the one
    `from_pretrained` loaded, kept in `pipe.oracle_scheduler_config` by `load`), never from the config
    of a scheduler swapped in before, whose explicit keys would leak into the next class; `overrides`
    are from_config's (timestep_spacing, use_karras_sigmas). A stochastic scheduler's step noise is the
    contract's, `normal(fold_in(PRNGKey(seed), step))` (tests/oracle/noise.py).
    """
    pipe.scheduler = CLASSES[scheduler].from_config(pipe.oracle_scheduler_config, **overrides)
    factor = pipe.vae_scale_factor
    latents = contract_latents(job["seed"], pipe.unet.config.in_channels, width, height, factor)
    with torch.no_grad(), seeded_noise(pipe.scheduler, job["seed"]):
        image = pipe(
            job["prompt"],
            negative_prompt=job["negative_prompt"],
            num_inference_steps=steps,
            guidance_scale=job["guidance_scale"],
            height=height,
            width=width,
            latents=latents,
            output_type="np",
        ).images[0]
    return (image * 255).round().astype(np.uint8)


def _save_png(path: pathlib.Path, pixels: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    PIL.Image.fromarray(pixels).save(path, optimize=True)


def versions() -> dict[str, str]:
    return {"torch": torch.__version__, "diffusers": diffusers.__version__,
            "transformers": transformers.__version__, "tokenizers": tokenizers.__version__, "jax": jax.__version__,
            "numpy": np.__version__}


def _job_sets(family: str) -> list[tuple[str | None, str, tuple[int, int]]]:
    """(variant, scheduler, (width, height)) of every job set rendered for `family`."""
    sets = [(None, name, NATIVE) for name in SCHEDULERS]
    if family in ("sd1", "sdxl"):
        sets.append((None, "euler", NON_SQUARE))
        # A variant changes the weights the loader reads, not the loop: one scheduler each (the
        # schedulers' arithmetic is held to PyTorch's by tests/test_schedulers.py).
        variant, _, scheduler = VARIANTS[family]
        sets.append((variant, scheduler, NATIVE))
    return sets


def _set_dir(variant: str | None, scheduler: str, size: tuple[int, int]) -> str:
    name = scheduler if size == NATIVE else f"{scheduler}-{size[0]}x{size[1]}"
    return name if variant is None else f"{variant}/{name}"


def job_record(batch: str, index: int, model: str, variant: str | None, scheduler: str, job: dict[str, Any],
               steps: int, size: tuple[int, int], image: str, **extra: Any) -> dict[str, Any]:
    """One reference job as the jobs.json files list it (`extra`: a part's own fields, last)."""
    width, height = size
    return {
        "id": f"{batch}/{index}",
        "batch": batch,
        "model": model,
        "variant": variant,
        "scheduler": scheduler,
        "prompt": job["prompt"],
        "negative_prompt": job["negative_prompt"],
        "seed": job["seed"],
        "steps": steps,
        "guidance_scale": job["guidance_scale"],
        "classifier_free_guidance": job["guidance_scale"] > 1,
        "width": width,
        "height": height,
        "image": image,
        **extra,
    }


def _job_record(model: str, variant: str | None, scheduler: str, size: tuple[int, int], index: int,
                job: dict[str, Any], image: str) -> dict[str, Any]:
    batch = f"{model.split('/')[0]}/{_set_dir(variant, scheduler, size)}"
    return job_record(batch, index, model, variant, scheduler, job, STEPS, size, image)


def _write_jobs(path: pathlib.Path, family: str, pipeline: str, records: list[dict[str, Any]], note: str = "") -> None:
    doc = {
        "about": (
            "Reference images of diffusers' PyTorch pipelines (float32, CPU) on the tiny checkpoint in "
            "`model`; paths are relative to tests/data/oracle. Each job is one pipeline call, batch size 1, "
            "latents = jax.random.normal(jax.random.PRNGKey(seed), (1, C, height // 8, width // 8), float32); "
            "image = round(output_type='np' image * 255) as uint8 RGB. negative_prompt null means the "
            "argument was not passed (None). The scheduler is <Class>.from_config(pipe.scheduler.config) "
            "of the model's scheduler_config.json. Jobs sharing `batch` share model, variant, scheduler, "
            "size and steps. Variant images are rendered in float32 from the variant's weights upcast."
            + note
        ),
        "family": family,
        "pipeline": pipeline,
        "schedulers": {name: cls.__name__ for name, cls in SCHEDULERS.items()},
        "versions": versions(),
        "jobs": records,
    }
    path.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def _state(pipe) -> dict[str, torch.Tensor]:
    return {
        f"{name}.{key}": value.detach().clone()
        for name, component in pipe.components.items()
        if isinstance(component, torch.nn.Module)
        for key, value in component.state_dict().items()
    }


def _check_same_weights(pipe, expected: dict[str, torch.Tensor], what: str) -> None:
    """The pipeline loaded back holds exactly the weights built (a misnamed tensor would be re-initialised)."""
    got = _state(pipe)
    if got.keys() != expected.keys():
        raise AssertionError(f"{what}: parameter names differ: {sorted(got.keys() ^ expected.keys())[:5]}")
    differ = [key for key in expected if not torch.equal(got[key], expected[key])]
    if differ:
        raise AssertionError(f"{what}: {len(differ)} tensors differ after loading, e.g. {differ[:3]}")


def write_family(root: pathlib.Path, family: str, log=print) -> None:
    folder = root / family / "model"
    pipe = build(family)
    save(pipe, folder, family)
    expected = {None: _state(pipe)}
    if family in VARIANTS:
        variant, dtype, _ = VARIANTS[family]
        save_variant(pipe, folder, family, variant, dtype)
        expected[variant] = {
            key: value.to(dtype).to(torch.float32) if value.is_floating_point() else value
            for key, value in expected[None].items()
        }
    del pipe
    records = []
    loaded: dict[str | None, Any] = {}
    for variant_name, scheduler, size in _job_sets(family):
        if variant_name not in loaded:
            loaded[variant_name] = load(folder, family, variant_name)
            _check_same_weights(loaded[variant_name], expected[variant_name], f"{family} variant {variant_name}")
        pipe = loaded[variant_name]
        set_dir = _set_dir(variant_name, scheduler, size)
        for index, job in enumerate(JOBS):
            image = f"{family}/{set_dir}/{index}.png"
            _save_png(root / image, render(pipe, scheduler, job, *size))
            records.append(_job_record(f"{family}/model", variant_name, scheduler, size, index, job, image))
        log(f"oracle: {family} {set_dir}")
    _write_jobs(root / family / "jobs.json", family, type(loaded[None]).__name__, records)

    if family == "sd1":  # the same float32 weights, sharded: must render the same pixels
        sharded = root / "sd1-sharded" / "model"
        save(build(family), sharded, family, max_shard_size=SHARD_SIZE)  # rebuilt: no _name_or_path
        pipe = load(sharded, family)
        _check_same_weights(pipe, expected[None], "sd1-sharded")
        records = []
        for index, job in enumerate(JOBS):
            image = f"sd1/euler/{index}.png"
            pixels = render(pipe, "euler", job, *NATIVE)
            if not np.array_equal(pixels, np.asarray(PIL.Image.open(root / image))):
                raise AssertionError(f"the sharded sd1 copy renders job {index} differently")
            records.append(_job_record("sd1-sharded/model", None, "euler", NATIVE, index, job, image))
        note = (" This folder holds sd1's float32 weights again, sharded; its images are sd1's own "
                "(checked here: the sharded copy renders them bit for bit).")
        _write_jobs(root / "sd1-sharded" / "jobs.json", family, type(pipe).__name__, records, note)
        log("oracle: sd1-sharded (renders sd1's euler images)")


def quiet_and_deterministic() -> None:
    """One thread, deterministic kernels, and no progress bars or truncation notices."""
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def write(data: pathlib.Path) -> None:
    """Rebuild data/oracle: the three tiny checkpoints, their variants and the reference images."""
    quiet_and_deterministic()
    root = pathlib.Path(data) / "oracle"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    for family in ("sd1", "sd2", "sdxl"):
        write_family(root, family)
