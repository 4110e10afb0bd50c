"""Reference outputs of diffusers' / transformers' PyTorch modules for diffusion/nn.

`write(data)` runs in the oracle venv and rebuilds `data/nn/`: one `<name>.npz` per tiny model,

    config      the model's config.json (a JSON string), as `from_dict` reads it
    params      its weights, all in one float16 vector (exactly the values the PyTorch module ran
                with), converted to the Flax names and layouts diffusion/nn uses
    index       [["/"-joined Flax path, shape], ...] (a JSON string): how `params` splits, in order
    in/...      the inputs it was run on
    out/...     what the PyTorch module returned (float32, CPU)

The configs are the ones diffusers' Flax classes cannot run or run differently: GroupNorm groups
other than 32 (4 and 8, so a wrong grouping shows), a non-default norm_eps, freq_shift and
flip_sin_to_cos, fractional timesteps, GEGLU's exact GELU, the transformer GroupNorm's eps 1e-6,
and both of transformers 5's end-of-text pooling rules. Weights are the libraries' initialisers
under fixed seeds, then norm scales 1 + N(0, 0.1^2), norm shifts and zero biases N(0, 0.05^2), so
that a parameter a loader or a module forgot would change the outputs, then rounded to float16.
Deterministic: running it twice writes the same bytes.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import warnings
from typing import Any

import numpy as np
import torch
from diffusers import AutoencoderKL, UNet2DConditionModel
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

_COMMON = {"in_channels": 4, "out_channels": 4, "sample_size": 16}
UNETS: dict[str, dict[str, Any]] = {
    # SD 1.x layout: one head count, conv projections; two ResNets a block (skip bookkeeping);
    # old-style time embedding (sin first, shift 1).
    "sd1": {**_COMMON, "block_out_channels": [8, 16], "layers_per_block": 2, "norm_num_groups": 4,
            "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
            "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"],
            "attention_head_dim": 2, "cross_attention_dim": 24, "flip_sin_to_cos": False, "freq_shift": 1},
    # SD 2.x layout: heads per block, linear projections, upcast_attention; a large norm_eps.
    "sd2": {**_COMMON, "block_out_channels": [8, 16], "layers_per_block": 1, "norm_num_groups": 4,
            "norm_eps": 1e-3, "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
            "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"],
            "attention_head_dim": [2, 4], "cross_attention_dim": 32, "use_linear_projection": True,
            "upcast_attention": True},
    # SDXL layout: transformer depth per block, pooled text + 6 micro-conditions added to the time.
    "sdxl": {**_COMMON, "block_out_channels": [8, 16], "layers_per_block": 1, "norm_num_groups": 8,
             "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
             "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"],
             "attention_head_dim": [2, 4], "transformer_layers_per_block": [1, 2],
             "cross_attention_dim": 40, "use_linear_projection": True, "addition_embed_type": "text_time",
             "addition_time_embed_dim": 8, "projection_class_embeddings_input_dim": 24 + 6 * 8},
}
VAE = {"in_channels": 3, "out_channels": 3, "block_out_channels": [4, 8, 8], "layers_per_block": 2,
       "down_block_types": ["DownEncoderBlock2D"] * 3, "up_block_types": ["UpDecoderBlock2D"] * 3,
       "latent_channels": 4, "norm_num_groups": 2, "sample_size": 32}
_TEXT = {"vocab_size": 100, "num_hidden_layers": 3, "num_attention_heads": 4, "max_position_embeddings": 77,
         "bos_token_id": 98, "pad_token_id": 0}
TEXT_ENCODERS: dict[str, dict[str, Any]] = {
    # OpenAI CLIP-L style: quick_gelu, the legacy eos_token_id 2 (pool at the largest id).
    "clip_l": {**_TEXT, "hidden_size": 32, "intermediate_size": 37, "hidden_act": "quick_gelu", "eos_token_id": 2},
    # OpenCLIP bigG style with projection: gelu, pool at the first eos_token_id (not the largest id).
    "clip_bigg": {**_TEXT, "hidden_size": 48, "intermediate_size": 53, "hidden_act": "gelu", "eos_token_id": 97,
                  "projection_dim": 40},
}
TIMESTEPS = [799.2, 13.0]  # fractional, as Euler/LMS feed them


def _liven(model: torch.nn.Module) -> None:
    """Norm scales 1 + N(0, 0.1^2), shifts N(0, 0.05^2), zero biases N(0, 0.05^2); then every
    weight rounded to float16, so the files hold the exact weights at half the size."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (torch.nn.GroupNorm, torch.nn.LayerNorm)):
                module.weight.copy_(1 + 0.1 * torch.randn_like(module.weight))
                module.bias.copy_(0.05 * torch.randn_like(module.bias))
            elif isinstance(getattr(module, "bias", None), torch.nn.Parameter) and not module.bias.any():
                module.bias.copy_(0.05 * torch.randn_like(module.bias))
        for param in model.parameters():
            param.copy_(param.half().float())


# The Flax names of the VAE attention's projections (PyTorch: to_q, to_k, to_v, to_out.0).
_VAE_ATTENTION = {"to_q": "query", "to_k": "key", "to_v": "value", "to_out_0": "proj_attn"}


def flax_params(state: dict[str, torch.Tensor], kind: str) -> dict[str, np.ndarray]:
    """A PyTorch state dict of `kind` ("unet", "vae", "clip") in the Flax checkpoints' names
    ("/"-joined) and layouts.

    diffusers: a list index joins its list's name (down_blocks.0 -> down_blocks_0). transformers'
    CLIP keeps indices as names of their own (encoder/layers/0) and gets its `text_model` prefix
    back (transformers 5 saves CLIPTextModel without it)."""
    out = {}
    for key, tensor in state.items():
        parts = key.split(".")
        if kind == "clip":
            parts = parts if parts[0] in ("text_model", "text_projection") else ["text_model", *parts]
        else:
            merged: list[str] = []
            for part in parts:
                if part.isdigit():
                    merged[-1] += f"_{part}"
                else:
                    merged.append(part)
            parts = merged
            if kind == "vae":
                parts[-2] = _VAE_ATTENTION.get(parts[-2], parts[-2])
        value = tensor.detach().numpy().astype(np.float16)  # exact: _liven rounded them
        if parts[-1] == "weight":
            if kind == "clip" and parts[-2].endswith("_embedding"):
                parts[-1] = "embedding"
            elif value.ndim == 1:
                parts[-1] = "scale"
            else:  # Linear (out, in) -> (in, out); Conv2d (out, in, kh, kw) -> (kh, kw, in, out)
                parts[-1] = "kernel"
                value = value.T if value.ndim == 2 else value.transpose(2, 3, 1, 0)
        out["/".join(parts)] = np.ascontiguousarray(value)
    return out


def _save(path: pathlib.Path, config: dict[str, Any], params: dict[str, np.ndarray],
          inputs: dict[str, np.ndarray], outputs: dict[str, torch.Tensor]) -> None:
    names = sorted(params)
    arrays = {
        "config": np.array(json.dumps(config, sort_keys=True)),
        "params": np.concatenate([params[name].ravel() for name in names]),
        "index": np.array(json.dumps([[name, list(params[name].shape)] for name in names])),
    }
    arrays.update({f"in/{k}": np.asarray(v) for k, v in inputs.items()})
    arrays.update({f"out/{k}": v.detach().numpy().astype(np.float32) for k, v in outputs.items()})
    np.savez_compressed(path, **arrays)


def write_unet(folder: pathlib.Path, name: str, seed: int) -> None:
    config = UNETS[name]
    torch.manual_seed(seed)
    model = UNet2DConditionModel(**config).eval()
    _liven(model)
    inputs = {
        "sample": torch.randn(2, 4, 16, 16),
        "timesteps": torch.tensor(TIMESTEPS),
        "encoder_hidden_states": torch.randn(2, 7, config["cross_attention_dim"]),
    }
    added = None
    if config.get("addition_embed_type") == "text_time":
        added = {"text_embeds": torch.randn(2, 24),
                 "time_ids": torch.tensor([[64.0, 64, 0, 0, 64, 64], [128, 96, 8, 4, 128, 96]])}
        inputs.update(added)
    with torch.no_grad():
        sample = model(inputs["sample"], inputs["timesteps"], inputs["encoder_hidden_states"],
                       added_cond_kwargs=added).sample
    _save(folder / f"{name}.npz", config, flax_params(model.state_dict(), "unet"),
          {k: v.numpy() for k, v in inputs.items()}, {"sample": sample})


def write_vae(folder: pathlib.Path, seed: int) -> None:
    torch.manual_seed(seed)
    model = AutoencoderKL(**VAE).eval()
    _liven(model)
    pixels = torch.rand(2, 3, 32, 32) * 2 - 1
    latents = torch.randn(2, 4, 8, 8)
    with torch.no_grad():
        posterior = model.encode(pixels).latent_dist
        decoded = model.decode(latents).sample
    _save(folder / "vae.npz", VAE, flax_params(model.state_dict(), "vae"),
          {"pixels": pixels.numpy(), "latents": latents.numpy()},
          {"mean": posterior.mean, "logvar": posterior.logvar, "decoded": decoded})


def _ids(config: dict[str, Any], rng: np.random.Generator) -> np.ndarray:
    """Two rows of 77: bos, words, end-of-text, then padding (eos, as SD 1.x pads, or 0). With the
    legacy eos_token_id 2 the end-of-text is the largest id and the words hold a 2; otherwise the
    words hold ids above it. Either way the other pooling rule would pick another position."""
    legacy = config["eos_token_id"] == 2
    eos = config["vocab_size"] - 1 if legacy else config["eos_token_id"]
    rows = []
    for length, pad in ((5, eos), (75, 0)):
        words = rng.integers(3, 97, length)
        words[1::4] = 2 if legacy else 99
        rows.append([98, *words, eos] + [pad] * (75 - length))
    return np.array(rows, np.int64)


def write_text_encoder(folder: pathlib.Path, name: str, seed: int) -> None:
    config = TEXT_ENCODERS[name]
    torch.manual_seed(seed)
    projection = "projection_dim" in config
    model = (CLIPTextModelWithProjection if projection else CLIPTextModel)(CLIPTextConfig(**config)).eval()
    with torch.no_grad():  # token embeddings of unit scale: the text, not the positions, dominates
        model.get_input_embeddings().weight.normal_(0, 1)
    _liven(model)
    ids = _ids(config, np.random.default_rng(seed))
    with torch.no_grad():
        out = model(torch.from_numpy(ids), output_hidden_states=True)
    outputs = {"last_hidden_state": out.last_hidden_state, "penultimate": out.hidden_states[-2]}
    if projection:
        outputs["text_embeds"] = out.text_embeds
    else:
        outputs["pooled"] = out.pooler_output
    _save(folder / f"{name}.npz", {**config, "model_type": "clip_text_model"},
          flax_params(model.state_dict(), "clip"), {"input_ids": ids}, outputs)


def write(data: pathlib.Path) -> None:
    """Rebuild data/nn (about 0.7 MB)."""
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    folder = pathlib.Path(data) / "nn"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for seed, name in enumerate(UNETS):
            write_unet(folder, name, seed)
        write_vae(folder, 10)
        for seed, name in enumerate(TEXT_ENCODERS, start=20):
            write_text_encoder(folder, name, seed)
