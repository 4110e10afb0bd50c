"""Flux checkpoint files of the tiny schnell transformer (data/flux/schnell/model, written by the
flux part and never rebuilt here): Black Forest Labs' own layout, and float8.

`write(data)` rebuilds `data/flux_files/`:

    bfl.safetensors        the folder's transformer in BFL's names and layout (the layout of
                           `flux1-schnell.safetensors`), float16 as the folder's: written by inverting
                           diffusion/bfl.py's row ranges, then checked: diffusers' own
                           convert_flux_transformer_checkpoint_to_diffusers maps it, bare and under
                           ComfyUI's `model.diffusion_model.`, to exactly the folder's tensors, name for
                           name, taking every tensor of the file
    float8.safetensors     the folder's transformer `.to(torch.float8_e4m3fn)`, in diffusers' names
                           (safetensors dtype F8_E4M3)
    float8/<i>.png         the images FluxPipeline renders of the schnell jobs (data/flux's) with
                           that file's transformer upcast to float32 (`.float()`)
    float8_values.npz      torch's float32 of every float8_e4m3fn and float8_e5m2 value: the 256
                           bytes as each dtype, `.float()` (keys F8_E4M3, F8_E5M2, as safetensors names them)
    jobs.json              the float8 jobs: their fields, model and image

Deterministic: running it twice writes the same bytes.
"""

from __future__ import annotations

import inspect
import json
import pathlib
import shutil
import types
from typing import Any

import numpy as np
import torch
from diffusers.loaders import single_file_utils
from safetensors.torch import load_file, save_file

from diffusion import bfl
from tests.oracle import flux, pipelines

PREFIX = "model.diffusion_model."  # ComfyUI's
FLOAT8 = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def _config(model: torch.nn.Module) -> types.SimpleNamespace:
    """The transformer's sizes as diffusion.bfl reads them (FluxConfig's fields; FluxConfig itself
    needs flax, which this venv has not)."""
    return types.SimpleNamespace(**model.config, inner_dim=model.inner_dim)


def to_bfl(tensors: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """diffusers' names -> BFL's: each BFL tensor's rows gathered from where diffusion/bfl.py
    sends them (a diffusers tensor named twice takes its ranges in the order listed)."""
    out = {}
    for name in bfl.bfl_tensors(config):
        taken: dict[str, int] = {}
        parts = []
        for key, first, end in bfl.diffusers_tensors(name, config):
            at = taken.get(key, 0)
            parts.append((first, tensors[key][at:at + end - first]))
            taken[key] = at + end - first
        out[name] = torch.cat([part for _, part in sorted(parts, key=lambda p: p[0])]).contiguous()
    return out


def diffusers_conversion(checkpoint: dict[str, torch.Tensor], inner_dim: int) -> dict[str, torch.Tensor]:
    """diffusers' convert_flux_transformer_checkpoint_to_diffusers (0.42.1) with its one
    hard-coded size, the real model's inner_dim (3072, for splitting linear1), set to the tiny
    model's; every other line is diffusers' own. Pops what it takes from `checkpoint`."""
    source = inspect.getsource(single_file_utils.convert_flux_transformer_checkpoint_to_diffusers)
    if source.count("inner_dim = 3072") != 1:
        raise AssertionError("diffusers' convert_flux_transformer_checkpoint_to_diffusers no longer sets inner_dim "
                             "= 3072: check how it splits linear1 now")
    namespace = dict(vars(single_file_utils))
    exec(source.replace("inner_dim = 3072", f"inner_dim = {inner_dim}"), namespace)  # noqa: S102
    return namespace["convert_flux_transformer_checkpoint_to_diffusers"](checkpoint)


def check_bfl(file: pathlib.Path, want: dict[str, torch.Tensor], inner_dim: int) -> None:
    """diffusers maps the file (bare and prefixed) to exactly `want`, leaving nothing of it."""
    for prefix in ("", PREFIX):
        checkpoint = {prefix + name: tensor for name, tensor in load_file(str(file)).items()}
        got = diffusers_conversion(checkpoint, inner_dim)
        if checkpoint:
            raise AssertionError(f"{file.name} ({prefix!r}): diffusers left {sorted(checkpoint)[:5]}")
        if got.keys() != want.keys():
            raise AssertionError(f"{file.name} ({prefix!r}): names differ: {sorted(got.keys() ^ want.keys())[:5]}")
        differ = [key for key in want if not torch.equal(got[key], want[key])]
        if differ:
            raise AssertionError(f"{file.name} ({prefix!r}): {len(differ)} tensors differ, e.g. {differ[:3]}")


def write(data: pathlib.Path) -> None:
    """Rebuild data/flux_files (see the module docstring)."""
    pipelines.quiet_and_deterministic()
    root = data / "flux_files"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    folder = data / "flux" / "schnell" / "model"
    tensors = load_file(str(folder / "transformer" / "diffusion_pytorch_model.safetensors"))
    pipe = flux.load(folder)
    config = _config(pipe.transformer)
    save_file(to_bfl(tensors, config), str(root / "bfl.safetensors"))
    check_bfl(root / "bfl.safetensors", tensors, config.inner_dim)
    print(f"oracle: flux_files bfl.safetensors ({len(bfl.bfl_tensors(config))} tensors; diffusers' conversion "
          "maps it back to the folder's)", flush=True)

    save_file({name: tensor.to(torch.float8_e4m3fn) for name, tensor in tensors.items()},
              str(root / "float8.safetensors"))
    upcast = {name: tensor.float() for name, tensor in load_file(str(root / "float8.safetensors")).items()}
    pipe.transformer.load_state_dict(upcast, strict=True)
    records = []
    for i, job in enumerate(flux.jobs("schnell")):
        pipelines._save_png(root / "float8" / f"{i}.png", flux.render(pipe, "schnell", job))
        records.append({**job, "model": "float8.safetensors", "image": f"float8/{i}.png"})
    (root / "jobs.json").write_text(json.dumps({"versions": pipelines.versions(), "jobs": records}, indent=1) + "\n",
                                    encoding="utf-8")
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    np.savez_compressed(root / "float8_values.npz",
                        **{name: every.view(dtype).float().numpy() for name, dtype in FLOAT8.items()})
