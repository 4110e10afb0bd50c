"""The tensor names and shapes real PyTorch checkpoints have, for diffusion/convert.py's tests.

`write(data)` runs in the oracle venv (diffusers 0.42.1, transformers 5.23, torch) and writes
`data/weights/<name>.json`, one per tiny model: its constructor arguments and every tensor name -> shape
of the safetensors file its `save_pretrained` writes. The tests (no torch) build state dicts with
exactly those names and shapes, write them as safetensors and load them into the diffusers 0.39 /
transformers 4.57 Flax trees, so the name mapping is held to the names the libraries really save,
not to the mapping's own inverse.

Two lists are other names the libraries read rather than write, and each is checked here by
loading a file with those names back through the library's own `from_pretrained` and comparing
every tensor: `vae_old_attention` (the VAE mid-block attention as diffusers < 0.14 saved it,
`query/key/value/proj_attn`; diffusers renames them on load) and `clip_text_model` (CLIPTextModel
with the `text_model.` prefix every SD text_encoder has; transformers 5 saves the names without it).
"""

from __future__ import annotations

import json
import pathlib
import re
import tempfile
import warnings
from typing import Any

import diffusers
import torch
import transformers
from diffusers import AutoencoderKL, UNet2DConditionModel
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

_UNET = {
    "sample_size": 8,
    "in_channels": 4,
    "out_channels": 4,
    "block_out_channels": (32, 64),
    "norm_num_groups": 32,
    "layers_per_block": 1,
}
UNETS = {
    # SD 1.x: attention in the outer level as in the real model, conv proj_in/proj_out
    "unet_sd1": {**_UNET, "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"),
                 "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D"), "attention_head_dim": 8,
                 "cross_attention_dim": 32},
    # SD 2.x: linear proj_in/proj_out, heads per block
    "unet_sd2": {**_UNET, "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D"),
                 "up_block_types": ("CrossAttnUpBlock2D", "UpBlock2D"), "attention_head_dim": (2, 4),
                 "cross_attention_dim": 32, "use_linear_projection": True, "upcast_attention": True},
    # SDXL: several transformer blocks per attention, pooled-text + size conditioning (add_embedding)
    "unet_sdxl": {**_UNET, "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D"),
                  "up_block_types": ("CrossAttnUpBlock2D", "UpBlock2D"), "attention_head_dim": (2, 4),
                  "transformer_layers_per_block": (1, 2), "cross_attention_dim": 80,
                  "use_linear_projection": True, "addition_embed_type": "text_time",
                  "addition_time_embed_dim": 8, "projection_class_embeddings_input_dim": 40 + 6 * 8},
}
VAE = {
    "in_channels": 3,
    "out_channels": 3,
    "block_out_channels": (8, 8, 16, 16),
    "down_block_types": ("DownEncoderBlock2D",) * 4,
    "up_block_types": ("UpDecoderBlock2D",) * 4,
    "layers_per_block": 1,
    "latent_channels": 4,
    "norm_num_groups": 8,
    "sample_size": 64,
}
CLIP = {  # transformers' CLIPTextConfig arguments, the same for transformers 4.57 and 5.23
    "vocab_size": 514,
    "hidden_size": 32,
    "intermediate_size": 37,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 77,
    "bos_token_id": 512,
    "eos_token_id": 513,
    "pad_token_id": 513,
}
CLIP_PROJECTION = {**CLIP, "projection_dim": 40}
_OLD_ATTENTION = {"to_q": "query", "to_k": "key", "to_v": "value", "to_out.0": "proj_attn"}


def _saved(model: Any) -> dict[str, torch.Tensor]:
    """The tensors `save_pretrained(safe_serialization=True)` writes, by name."""
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        (file,) = pathlib.Path(tmp).glob("*.safetensors")
        with safe_open(file, "pt") as f:
            return {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (safe_open is no dict)


def _reloads_as(model: Any, tensors: dict[str, torch.Tensor], file_name: str) -> None:
    """Check that the library's own from_pretrained reads `tensors` (other names) back into `model`."""
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        for old in pathlib.Path(tmp).glob("*.safetensors"):
            old.unlink()
        save_file(tensors, pathlib.Path(tmp, file_name), metadata={"format": "pt"})
        loaded = type(model).from_pretrained(tmp).state_dict()
    original = model.state_dict()
    assert loaded.keys() == original.keys(), sorted(loaded.keys() ^ original.keys())
    for key, value in original.items():
        assert torch.equal(loaded[key], value), key


def _old_attention(name: str) -> str:
    for new, old in _OLD_ATTENTION.items():
        name = name.replace(f".attentions.0.{new}.", f".attentions.0.{old}.")
    return name


def _entry(kind: str, cls: type, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    return {
        "kind": kind,
        "class": cls.__name__,
        "versions": {"diffusers": diffusers.__version__, "transformers": transformers.__version__},
        "config": config,
        "tensors": {name: list(tensor.shape) for name, tensor in sorted(tensors.items())},
    }


def models() -> dict[str, dict[str, Any]]:
    """Every model's entry, name -> {kind, class, versions, config, tensors}."""
    out = {}
    torch.manual_seed(0)
    for name, config in UNETS.items():
        model = UNet2DConditionModel(**config)
        out[name] = _entry("unet", UNet2DConditionModel, config, _saved(model))
    vae = AutoencoderKL(**VAE)
    tensors = _saved(vae)
    out["vae"] = _entry("vae", AutoencoderKL, VAE, tensors)
    old = {_old_attention(key): value for key, value in tensors.items()}
    assert old.keys() != tensors.keys()
    _reloads_as(vae, old, "diffusion_pytorch_model.safetensors")
    out["vae_old_attention"] = _entry("vae", AutoencoderKL, VAE, old)

    clip = CLIPTextModel(CLIPTextConfig(**CLIP))
    tensors = _saved(clip)
    out["clip"] = _entry("clip", CLIPTextModel, CLIP, tensors)
    prefixed = {key if key.startswith("text_model.") else f"text_model.{key}": v for key, v in tensors.items()}
    _reloads_as(clip, prefixed, "model.safetensors")
    out["clip_text_model"] = _entry("clip", CLIPTextModel, CLIP, prefixed)
    projection = CLIPTextModelWithProjection(CLIPTextConfig(**CLIP_PROJECTION))
    out["clip_projection"] = _entry("clip_projection", CLIPTextModelWithProjection, CLIP_PROJECTION,
                                    _saved(projection))
    return out


def write(data: pathlib.Path) -> None:
    folder = data / "weights"
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.json"):
        old.unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        entries = models()
    for name, entry in entries.items():
        text = json.dumps(entry, indent=1, sort_keys=True, default=list)
        text = re.sub(r"\[\s+([-\d,\s]+?)\s+\]", lambda m: f"[{' '.join(m[1].split())}]", text) + "\n"
        (folder / f"{name}.json").write_text(text, encoding="utf-8")
