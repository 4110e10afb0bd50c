"""Flux LoRAs in diffusers' PEFT format and in kohya's, and what diffusers' FluxPipeline makes of them.

`write(data)` rebuilds `data/flux_lora/` (data = tests/data) from the tiny pipelines of
`data/flux/<variant>/model` (tests/oracle/flux.py), schnell and dev:

    flux_lora/<variant>/peft.safetensors    a LoRA saved by diffusers' own path: PEFT adapters on the
                                            transformer's Linears (the embedders, the final layer, one double
                                            and one single block: BLOCKS) and CLIP's attention and MLP
                                            projections, `get_peft_model_state_dict`, then FluxPipeline's
                                            `save_lora_weights` with each adapter's LoraConfig as the metadata
    flux_lora/<variant>/kohya.safetensors   the same LoRA in kohya's Flux format, written here by our own
                                            inverse mapping: the transformer's modules by Black Forest Labs'
                                            names (diffusion/bfl.py), a fused module's down the parts' downs
                                            stacked and its up theirs block-diagonal (the row ranges bfl.py
                                            gives), alpha the parts' alpha times their count; CLIP's as
                                            `lora_te1_text_model_...`
    flux_lora/<variant>/<i>.png             the first JOBS of tests/oracle/flux.py's of the variant
    flux_lora/jobs.json                     every job, once per format (both render the same images), with
                                            `lora` (relative to tests/data) and `lora_scale`

Each format is loaded into a fresh pipeline with `load_lora_weights` (the kohya file as diffusers'
`lora_state_dict` reads it, two slips of diffusers 0.42 undone: see `tiny_linear1_split`, `kohya_state`),
then `fuse_lora(components=["transformer", "text_encoder"], lora_scale=0.7)`: FluxPipeline's fuse_lora
fuses the transformer alone by default, leaving CLIP's adapters at scale 1, and the farm merges every
component at the LoRA's one scale. Checked here: diffusers loads the kohya file into exactly the weights
of the PEFT file (so the BFL names, splits and the final modulation's swapped halves are the ones
diffusers reads), both change every targeted weight and nothing else, and the images differ from the
model's without the LoRA.

Alphas differ from ranks, by powers of two (alpha / rank 0.5, 2 and 1), so that diffusers' kohya path,
which multiplies alpha / rank into the factors, gives the same float32 weights as PEFT's scaling. A single
block's linear1 parts have a rank and alpha of their own (one kohya module of rank 8). The final layer's
alpha is its rank: diffusers 0.42 leaves a kohya `final_layer_*` alpha unread (diffusion/lora.py
honours it).
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import re
import shutil
import types
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import PIL.Image
import torch
from diffusers.loaders import lora_conversion_utils
from diffusers.pipelines.flux.pipeline_flux import FluxPipeline
from peft import LoraConfig
from safetensors.torch import save_file

from diffusion.bfl import bfl_modules, diffusers_modules
from tests.oracle import flux, pipelines
from tests.oracle.lora import add_lora, alpha_of, check_targets, clip_name, drop_format_entry, to_kohya, weights_of

VARIANTS = ("schnell", "dev")
FORMATS = ("peft", "kohya")
COMPONENTS = ("transformer", "text_encoder")
LORA_SCALE = 0.7
JOBS = {"schnell": 2, "dev": 1}  # the first jobs of tests/oracle/flux.py's, at 64x64
SEED = {"schnell": 5000, "dev": 6000}
# (rank, alpha): the transformer's and CLIP's modules, a single block's linear1 parts; the final layer's alpha
# is the rank.
LINEAR = {"transformer": (1, 0.5), "text_encoder": (1, 2.0)}
LINEAR1 = (2, 4.0)
FINAL = ("proj_out", "norm_out.linear")
# The transformer blocks the LoRA adapts, one of each kind (kohya's trainer can train a few blocks too); the
# others stay as they are, and the data small.
BLOCKS = ("transformer_blocks.1.", "single_transformer_blocks.0.")
FLUX1_LINEAR1 = (3072, 3072, 3072, 12288)  # diffusers' split of a kohya linear1: FLUX.1's sizes


def bfl_config(transformer: torch.nn.Module) -> types.SimpleNamespace:
    """The sizes diffusion/bfl.py reads of a FluxConfig (diffusion.nn.flux needs flax, which this venv lacks)."""
    config = transformer.config
    return types.SimpleNamespace(
        patch_size=config.patch_size, in_channels=config.in_channels, out_channels=config.out_channels,
        num_layers=config.num_layers, num_single_layers=config.num_single_layers,
        guidance_embeds=config.guidance_embeds, inner_dim=config.num_attention_heads * config.attention_head_dim)


def _linear1_parts(config: types.SimpleNamespace) -> set[str]:
    return {module for i in range(config.num_single_layers)
            for module, _, _ in diffusers_modules(f"single_blocks.{i}.linear1", config)}


def lora_config(model: torch.nn.Module, component: str) -> LoraConfig:
    """The transformer's Linears outside the blocks and in BLOCKS (each Linear is part of one BFL module:
    checked), or CLIP's layers' ones."""
    rank, alpha = LINEAR[component]
    linears = sorted(name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear))
    targets = [name for name in linears if ".layers." in name]
    ranks, alphas = {}, {}
    if component == "transformer":
        config = bfl_config(model)
        covered = {module for bfl in bfl_modules(config) for module, _, _ in diffusers_modules(bfl, config)}
        if covered != set(linears):
            raise AssertionError(f"diffusion/bfl.py and the transformer's Linears differ: {covered ^ set(linears)}")
        blocks = ("transformer_blocks.", "single_transformer_blocks.")
        targets = [name for name in linears if not name.startswith(blocks) or name.startswith(BLOCKS)]
        linear1 = sorted(_linear1_parts(config) & set(targets))
        ranks = {f"^{name}": LINEAR1[0] for name in linear1}
        alphas = {f"^{name}": LINEAR1[1] for name in linear1} | {f"^{name}": rank for name in FINAL}
        # a regex of the whole names: a list's `proj_out` would adapt every single block's proj_out too
        targets = f"^(?:{'|'.join(re.escape(name) for name in targets)})$"
    return LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, rank_pattern=ranks, alpha_pattern=alphas,
                      init_lora_weights=True)


def transformer_to_kohya(state: dict[str, torch.Tensor], metadata: dict, config: types.SimpleNamespace) -> dict:
    """The transformer's PEFT state dict in kohya's Flux names: each adapted BFL module from its diffusers
    parts (`diffusers_modules`), down the parts' downs stacked, up the parts' ups placed on their row ranges
    and their ranks' columns (block-diagonal, which diffusers reads back part by part), alpha such that
    alpha / rank is the parts' own."""
    out = {}
    for bfl in bfl_modules(config):
        rows = diffusers_modules(bfl, config)
        parts = list(dict.fromkeys(module for module, _, _ in rows))
        adapted = [f"{part}.lora_A.weight" in state for part in parts]
        if not all(adapted):
            if any(adapted):
                raise AssertionError(f"{bfl}: only some of its parts {parts} are adapted: not one kohya module")
            continue
        downs = [state[f"{part}.lora_A.weight"] for part in parts]
        scalings = {alpha_of(metadata, part) / down.shape[0] for part, down in zip(parts, downs)}
        if len(scalings) != 1 or len({down.shape[0] for down in downs}) != 1:
            raise AssertionError(f"{bfl}: its parts {parts} differ in rank or alpha / rank: not one kohya module")
        down = torch.cat(downs)
        up = torch.zeros(max(end for _, _, end in rows), down.shape[0])
        taken = dict.fromkeys(parts, 0)  # each part's up rows placed so far
        for module, first, end in rows:
            column = parts.index(module) * downs[0].shape[0]
            part_up = state[f"{module}.lora_B.weight"]
            up[first:end, column:column + downs[0].shape[0]] = part_up[taken[module]:taken[module] + end - first]
            taken[module] += end - first
        name = "lora_unet_" + bfl.replace(".", "_")
        out[f"{name}.lora_down.weight"] = down.contiguous()
        out[f"{name}.lora_up.weight"] = up
        out[f"{name}.alpha"] = torch.tensor(scalings.pop() * down.shape[0])
    return out


@contextlib.contextmanager
def tiny_linear1_split(config: types.SimpleNamespace) -> Iterator[None]:
    """diffusers 0.42 splits a kohya single block's linear1 at FLUX.1's sizes, a constant (3072, 3072, 3072,
    12288) of `_convert_kohya_flux_lora_to_diffusers`'s inner function, and asserts they sum to the up's rows;
    while a kohya file loads, that constant is the tiny model's sizes. Nothing else of its code changes."""
    function = lora_conversion_utils._convert_kohya_flux_lora_to_diffusers
    original = function.__code__
    sizes = tuple(end - first for _, first, end in diffusers_modules("single_blocks.0.linear1", config))
    found = []

    def swapped(code: types.CodeType) -> types.CodeType:
        consts = []
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                const = swapped(const)
            elif const == FLUX1_LINEAR1:
                found.append(const)
                const = sizes
            consts.append(const)
        return code.replace(co_consts=tuple(consts))

    function.__code__ = swapped(original)
    if len(found) != 1:
        function.__code__ = original
        raise AssertionError(f"diffusers' kohya Flux conversion holds FLUX.1's linear1 sizes {len(found)} times, "
                             "not once")
    try:
        yield
    finally:
        function.__code__ = original


def kohya_state(path: pathlib.Path, config: types.SimpleNamespace) -> dict[str, torch.Tensor]:
    """diffusers' own reading of a kohya Flux file (`FluxPipeline.lora_state_dict`: its names, splits, alphas),
    with its linear1 split at the tiny model's sizes and the `transformer.` prefix it leaves off the embedders'
    and the final layer's keys (`x_embedder.lora_A.weight`, ...) put back: without it `load_lora_weights`
    drops those modules unread."""
    with tiny_linear1_split(config):
        state = FluxPipeline.lora_state_dict(path.parent, weight_name=path.name)
    return {key if key.startswith(tuple(f"{c}." for c in COMPONENTS)) else f"transformer.{key}": value
            for key, value in state.items()}


def _fused(folder: pathlib.Path, lora: pathlib.Path, fmt: str, config: types.SimpleNamespace) -> FluxPipeline:
    pipe = flux.load(folder)
    with warnings.catch_warnings():
        # PEFT matches target module names as suffixes (`proj_out` is every single block's too) and warns that
        # the file has no factors for single_transformer_blocks.1.proj_out: it is left as it is (checked).
        warnings.filterwarnings("ignore", "While injecting the PEFT adapters", RuntimeWarning)
        if fmt == "kohya":
            pipe.load_lora_weights(kohya_state(lora, config))
        else:
            pipe.load_lora_weights(lora.parent, weight_name=lora.name)
    pipe.fuse_lora(components=list(COMPONENTS), lora_scale=LORA_SCALE)
    return pipe


def write_variant(data: pathlib.Path, variant: str) -> list[dict[str, Any]]:
    folder = data / "flux" / variant / "model"
    root = data / "flux_lora" / variant
    pipe = flux.load(folder)
    config = bfl_config(pipe.transformer)
    base = weights_of(pipe, COMPONENTS)
    generator = torch.Generator().manual_seed(SEED[variant])
    layers, metadata = {}, {}
    for component in COMPONENTS:
        model = getattr(pipe, component)
        layers[component], metadata[component] = add_lora(model, lora_config(model, component), generator)
    FluxPipeline.save_lora_weights(
        root, weight_name="peft.safetensors",
        **{f"{component}_lora_layers": layers[component] for component in COMPONENTS},
        **{f"{component}_lora_adapter_metadata": metadata[component] for component in COMPONENTS},
    )
    drop_format_entry(root / "peft.safetensors")
    kohya = {**transformer_to_kohya(layers["transformer"], metadata["transformer"], config),
             **to_kohya("lora_te1_", layers["text_encoder"], metadata["text_encoder"], clip_name)}
    save_file(kohya, root / "kohya.safetensors", metadata={"ss_network_module": "networks.lora_flux"})
    del pipe

    jobs = flux.jobs(variant)[:JOBS[variant]]
    fused, images = {}, []
    for fmt in FORMATS:
        pipe = _fused(folder, root / f"{fmt}.safetensors", fmt, config)
        if fmt == "peft":
            images = [flux.render(pipe, variant, job) for job in jobs]
        pipe.unload_lora_weights()  # the fused weights stay
        fused[fmt] = weights_of(pipe, COMPONENTS)
    check_targets(variant, base, fused, layers, COMPONENTS)
    differ = [key for key in base if not torch.equal(fused["peft"][key], fused["kohya"][key])]
    if differ:
        raise AssertionError(f"{variant}: diffusers loads the kohya file differently at {differ[:5]}")
    records = []
    for index, (job, pixels) in enumerate(zip(jobs, images, strict=True)):
        plain = np.asarray(PIL.Image.open(data / "flux" / variant / f"{index}.png"))
        if np.array_equal(pixels, plain):
            raise AssertionError(f"{variant} job {index}: the LoRA changes nothing")
        pipelines._save_png(root / f"{index}.png", pixels)
        records += [{**job, "model": f"flux/{variant}/model", "lora": f"flux_lora/{variant}/{fmt}.safetensors",
                     "lora_scale": LORA_SCALE, "format": fmt, "image": f"flux_lora/{variant}/{index}.png"}
                    for fmt in FORMATS]
    return records


def write(data: pathlib.Path) -> None:
    """Rebuild data/flux_lora (see the module docstring)."""
    pipelines.quiet_and_deterministic()
    data = pathlib.Path(data)
    root = data / "flux_lora"
    shutil.rmtree(root, ignore_errors=True)
    records = []
    for variant in VARIANTS:
        records += write_variant(data, variant)
        print(f"oracle: flux_lora {variant}", flush=True)
    doc = {
        "about": (
            "Reference images of diffusers' FluxPipeline (float32, CPU) with a LoRA: the pipeline is loaded from "
            "`model`, then `load_lora_weights(lora)` (a kohya file as `lora_state_dict` reads it, split at the tiny "
            "model's sizes, its embedders' and final layer's keys given back their `transformer.` prefix) and "
            "`fuse_lora(components=['transformer', 'text_encoder'], lora_scale=lora_scale)`; paths are relative "
            "to tests/data. Each job is rendered as tests/data/flux/jobs.json says. Both formats of a variant hold "
            "the same LoRA, which diffusers loads into the same weights: one image serves both."
        ),
        "lora_scale": LORA_SCALE,
        "versions": pipelines.versions(),
        "jobs": records,
    }
    (root / "jobs.json").write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
