"""LoRA files in diffusers' PEFT format and in kohya's, and what diffusers' PyTorch pipelines make of them.

`write(data)` rebuilds `data/lora/` (data = tests/data) from the tiny sd1 and sdxl pipelines of
`data/oracle/<family>/model` (tests/oracle/pipelines.py):

    lora/<family>/peft.safetensors     a LoRA saved by diffusers' own path: PEFT adapters on the UNet and
                                       the text encoder(s), `get_peft_model_state_dict`, then the pipeline's
                                       `save_lora_weights` with each adapter's LoraConfig as the metadata
                                       (`lora_adapter_metadata`: rank, lora_alpha, rank_pattern, alpha_pattern;
                                       its `format: pt` entry dropped, see `drop_format_entry`)
    lora/<family>/kohya.safetensors    the same LoRA in kohya's format, written here by our own inverse
                                       mapping: `lora_unet_<module with _>`, `lora_te_` (sd1) or `lora_te1_` /
                                       `lora_te2_` (sdxl), `.lora_down.weight`, `.lora_up.weight`, `.alpha`;
                                       sdxl's UNet modules by their original SGM names (`input_blocks_3_1_...`)
    lora/<family>-deltas.safetensors   fused minus base weight, float32, of one tensor of each kind the LoRA
                                       changes (`_sample`), named `<component>.<tensor name in the model folder>`
    lora/<family>/<format>/<i>.png     the jobs of tests/oracle/pipelines.py's JOBS, euler, 4 steps, 64x64
    lora/sdxl/peft-<scheduler>/<i>.png the PEFT LoRA on sdxl under every other deterministic scheduler (pndm,
                                       ddim, lms, dpm): JOBS and SCHEDULER_JOBS, 4 steps, 64x64
    lora/jobs.json                     every job, with `lora` (relative to tests/data) and `lora_scale`

Each format is loaded into a fresh pipeline with `load_lora_weights`, then `fuse_lora(lora_scale=0.7)`,
then rendered. Checked here: diffusers loads the kohya file into exactly the weights of the PEFT file
(so the kohya names, SGM blocks included, are the ones diffusers reads), both change every targeted
weight and nothing else, and both render the same pixels, unlike the model without the LoRA.

The LoRA targets every Linear and Conv2d of the UNet (attention, feed-forward, proj_in/out, the ResNets'
convs, time projections and shortcuts, down/up samplers, conv_in/out, the time and added embeddings) and
every attention and MLP projection of the text encoders; the UNet's convs are LoCon modules (down
(r, in, kh, kw), up (out, r, 1, 1)). Alphas differ from the ranks, and the UNet's convs have a rank and
an alpha of their own: (alpha / rank) is per module. Within the text encoders and the UNet's linear
layers alpha is uniform, because diffusers 0.42 ignores a kohya attention projection's alpha, or a
CLIPTextModel module's, that differs from the file's most common one (`_get_alpha_name` keys it
`...to_q_lora.down.weight.alpha`, an alpha_pattern no module matches; PEFT warns and uses lora_alpha).
diffusion/lora.py honours it.
"""

from __future__ import annotations

import functools
import json
import pathlib
import re
import shutil
from collections.abc import Callable
from typing import Any

import numpy as np
import PIL.Image
import torch
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict
from safetensors import safe_open
from safetensors.torch import save_file

from tests.oracle.pipelines import (
    JOBS,
    NATIVE,
    SCHEDULERS,
    STEPS,
    _save_png,
    job_record,
    load,
    quiet_and_deterministic,
    render,
    versions,
)

FAMILIES = ("sd1", "sdxl")
FORMATS = ("peft", "kohya")
LORA_SCALE = 0.7
SCHEDULER = "euler"
# (rank, alpha) of each component's linear layers, and of the UNet's convs.
LINEAR = {"unet": (4, 3.0), "text_encoder": (3, 5.0), "text_encoder_2": (4, 2.0)}
CONV = (2, 1.0)
TEXT_ENCODERS = {"sd1": ("text_encoder",), "sdxl": ("text_encoder", "text_encoder_2")}
KOHYA_PREFIX = {"sd1": {"unet": "lora_unet_", "text_encoder": "lora_te_"},
                "sdxl": {"unet": "lora_unet_", "text_encoder": "lora_te1_", "text_encoder_2": "lora_te2_"}}
SEED = {"sd1": 1000, "sdxl": 3000}
# The LoRA under every deterministic scheduler (sdxl: its text encoders feed both the embeddings and the
# pooled projection, and ddim clips nothing only where the config says so), with two more jobs: a prompt
# with and without a negative one at a middling guidance.
SCHEDULER_FAMILIES = ("sdxl",)
SCHEDULER_JOBS: tuple[dict[str, Any], ...] = (
    {"prompt": "a red fox in snow", "negative_prompt": None, "seed": 12, "guidance_scale": 5.0},
    {"prompt": "a red fox in snow", "negative_prompt": "blurry", "seed": 12, "guidance_scale": 5.0},
)


# --------------------------------------------------------------------------------------------- the LoRA

def _targets(model: torch.nn.Module, component: str) -> dict[str, torch.nn.Module]:
    """The modules the LoRA adapts: every Linear and Conv2d of the UNet; the text encoders' attention and MLP
    projections (not text_projection, which diffusers' kohya conversion does not map)."""
    kinds = (torch.nn.Linear, torch.nn.Conv2d) if component == "unet" else (torch.nn.Linear,)
    found = {name: module for name, module in model.named_modules() if isinstance(module, kinds)}
    if component != "unet":
        found = {name: module for name, module in found.items() if ".layers." in name}
    return dict(sorted(found.items()))


def _config(model: torch.nn.Module, component: str) -> LoraConfig:
    rank, alpha = LINEAR[component]
    targets = _targets(model, component)
    convs = [name for name, module in targets.items() if isinstance(module, torch.nn.Conv2d)]
    return LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(targets),
        rank_pattern={f"^{name}": CONV[0] for name in convs},
        alpha_pattern={f"^{name}": CONV[1] for name in convs},
        init_lora_weights=True,
    )


def add_lora(model: torch.nn.Module, config: LoraConfig, generator: torch.Generator) -> tuple[dict, dict]:
    """Adapters with deterministic random weights (both factors non-zero): the PEFT state dict and config."""
    model.add_adapter(config)
    with torch.no_grad():
        for _, module in sorted(model.named_modules()):
            if hasattr(module, "lora_A") and "default" in module.lora_A:
                down, up = module.lora_A["default"].weight, module.lora_B["default"].weight
                fan_in = down[0].numel()
                down.copy_(torch.randn(down.shape, generator=generator) / fan_in**0.5)
                up.copy_(torch.randn(up.shape, generator=generator) * 0.3 / down.shape[0] ** 0.5)
    state = {key: value.detach().clone().contiguous() for key, value in get_peft_model_state_dict(model).items()}
    metadata = config.to_dict()
    metadata["base_model_name_or_path"] = None  # a local path otherwise
    if not isinstance(metadata["target_modules"], str):  # a regex, or a set: in hash order otherwise
        metadata["target_modules"] = sorted(metadata["target_modules"])
    return state, metadata


def drop_format_entry(path: pathlib.Path) -> None:
    """Rewrite diffusers' file without its `format: pt` header entry, tensors and LoRA config unchanged:
    safetensors writes a header's metadata in hash order, so with two entries the bytes change from run to
    run. Nothing reads the entry."""
    with safe_open(path, "pt") as f:
        metadata = f.metadata()
        tensors = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (a safe_open handle)
    save_file(tensors, path, metadata={"lora_adapter_metadata": metadata["lora_adapter_metadata"]})


# ----------------------------------------------------------------------------------------- kohya names

_RESNET_SGM = {"conv1": "in_layers.2", "conv2": "out_layers.3", "time_emb_proj": "emb_layers.1",
               "conv_shortcut": "skip_connection"}
_TOP_SGM = {"conv_in": "input_blocks.0.0", "conv_out": "out.2", "time_embedding.linear_1": "time_embed.0",
            "time_embedding.linear_2": "time_embed.2", "add_embedding.linear_1": "label_emb.0.0",
            "add_embedding.linear_2": "label_emb.0.2"}
_MID_SGM = {"resnets.0": 0, "attentions.0": 1, "resnets.1": 2}


def sgm_name(module: str, config: Any) -> str:
    """A diffusers UNet module's name in the original SGM / LDM UNet (kohya trains SDXL on that one),
    from the UNet config as diffusers' `_maybe_map_sgm_blocks_to_diffusers` reads it backwards."""
    if module in _TOP_SGM:
        return _TOP_SGM[module]
    layers = config.layers_per_block
    parts = module.split(".")
    if parts[0] == "mid_block":
        kind, rest = parts[1], parts[3:]
        head = f"middle_block.{_MID_SGM['.'.join(parts[1:3])]}"
    else:
        block, kind, layer, rest = int(parts[1]), parts[2], int(parts[3]), parts[4:]
        if parts[0] == "down_blocks":
            if kind == "downsamplers":
                return f"input_blocks.{1 + block * (layers + 1) + layers}.0.op"
            head = f"input_blocks.{1 + block * (layers + 1) + layer}.{0 if kind == 'resnets' else 1}"
        else:
            if kind == "upsamplers":
                with_attention = config.up_block_types[block].startswith("CrossAttn")
                return f"output_blocks.{block * (layers + 1) + layers}.{2 if with_attention else 1}.conv"
            head = f"output_blocks.{block * (layers + 1) + layer}.{0 if kind == 'resnets' else 1}"
    if kind == "resnets":
        rest = [_RESNET_SGM.get(rest[0], rest[0]), *rest[1:]]
    return ".".join([head, *rest])


def alpha_of(metadata: dict, module: str) -> float:
    """A module's alpha in a LoraConfig made here: its `^<module>` alpha_pattern, else lora_alpha."""
    return next((value for pattern, value in metadata["alpha_pattern"].items() if pattern == f"^{module}"),
                metadata["lora_alpha"])


def clip_name(module: str) -> str:
    """A CLIP module with the `text_model.` prefix kohya's names have (transformers 5 dropped it)."""
    return module if module.startswith("text_model.") else f"text_model.{module}"


def to_kohya(prefix: str, state: dict[str, torch.Tensor], metadata: dict, name: Callable[[str], str]) -> dict:
    """The PEFT state dict of one component in kohya's names (`prefix` + `name(module)` with `_`), with each
    module's alpha as a tensor."""
    out = {}
    for key, down in state.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key.removesuffix(".lora_A.weight")
        lora_name = prefix + name(module).replace(".", "_")
        out[f"{lora_name}.lora_down.weight"] = down
        out[f"{lora_name}.lora_up.weight"] = state[f"{module}.lora_B.weight"]
        out[f"{lora_name}.alpha"] = torch.tensor(float(alpha_of(metadata, module)))
    return out


# ------------------------------------------------------------------------------------------ the oracle

def weights_of(pipe, components: tuple[str, ...]) -> dict[str, torch.Tensor]:
    return {f"{component}.{key}": value.detach().clone()
            for component in components for key, value in getattr(pipe, component).state_dict().items()}


def _folder_name(folder: pathlib.Path, key: str) -> str:
    """`<component>.<tensor>` as the model folder's file names the tensor (transformers 5's CLIPTextModel
    drops the `text_model.` prefix every SD text_encoder checkpoint has)."""
    component, name = key.split(".", 1)
    files = sorted((folder / component).glob("*model.safetensors"))
    with safe_open(files[0], "pt") as f:
        names = set(f.keys())
    return key if name in names else f"{component}.text_model.{name}"


def _sample(keys: set[str]) -> list[str]:
    """One tensor of each kind (`attn2.to_k`, `resnets.N.conv_shortcut`, `downsamplers.N.conv`, `mlp.fc1`, ...),
    wherever in the network: enough to check the arithmetic of every kind of module and alpha, and small."""
    kinds: dict[str, str] = {}
    for key in sorted(keys):
        kind = re.sub(r"\.\d+\.", ".N.", re.sub(r"(down_blocks|mid_block|up_blocks)(\.\d+)?\.", "", key))
        kinds.setdefault(kind, key)
    return sorted(kinds.values())


def _render_format(folder: pathlib.Path, family: str, lora: pathlib.Path, components: tuple[str, ...],
                   root: pathlib.Path, fmt: str) -> tuple[dict[str, torch.Tensor], list[np.ndarray]]:
    pipe = load(folder, family)
    pipe.load_lora_weights(lora.parent, weight_name=lora.name)
    pipe.fuse_lora(lora_scale=LORA_SCALE)
    images = []
    for index, job in enumerate(JOBS):
        pixels = render(pipe, SCHEDULER, job, *NATIVE)
        _save_png(root / family / fmt / f"{index}.png", pixels)
        images.append(pixels)
    pipe.unload_lora_weights()  # the fused weights stay
    return weights_of(pipe, components), images


def _render_schedulers(folder: pathlib.Path, family: str, lora: pathlib.Path, root: pathlib.Path) -> list[dict]:
    """The PEFT file fused at LORA_SCALE under every deterministic scheduler but SCHEDULER (rendered above)."""
    pipe = load(folder, family)
    pipe.load_lora_weights(lora.parent, weight_name=lora.name)
    pipe.fuse_lora(lora_scale=LORA_SCALE)
    records = []
    for scheduler in (name for name in SCHEDULERS if name != SCHEDULER):
        batch = f"lora/{family}/peft-{scheduler}"
        for index, job in enumerate(JOBS + SCHEDULER_JOBS):
            _save_png(root.parent / batch / f"{index}.png", render(pipe, scheduler, job, *NATIVE))
            records.append(job_record(batch, index, f"oracle/{family}/model", None, scheduler, job, STEPS, NATIVE,
                                      f"{batch}/{index}.png", lora=f"lora/{family}/peft.safetensors",
                                      lora_scale=LORA_SCALE))
    return records


def write_family(data: pathlib.Path, family: str) -> tuple[list[dict[str, Any]], str]:
    folder = data / "oracle" / family / "model"
    root = data / "lora"
    components = ("unet", *TEXT_ENCODERS[family])
    pipe = load(folder, family)
    base = weights_of(pipe, components)
    generator = torch.Generator().manual_seed(SEED[family])
    layers, metadata, kohya = {}, {}, {}
    for component in components:
        model = getattr(pipe, component)
        layers[component], metadata[component] = add_lora(model, _config(model, component), generator)
        if component != "unet":
            name = clip_name
        elif family == "sdxl":
            name = functools.partial(sgm_name, config=pipe.unet.config)
        else:
            name = str
        kohya.update(to_kohya(KOHYA_PREFIX[family][component], layers[component], metadata[component], name))
    (root / family).mkdir(parents=True, exist_ok=True)
    type(pipe).save_lora_weights(
        root / family, weight_name="peft.safetensors",
        **{f"{component}_lora_layers": layers[component] for component in components},
        **{f"{component}_lora_adapter_metadata": metadata[component] for component in components},
    )
    drop_format_entry(root / family / "peft.safetensors")
    save_file(kohya, root / family / "kohya.safetensors", metadata={"ss_network_module": "networks.lora"})
    del pipe

    fused, images = {}, {}
    for fmt in FORMATS:
        fused[fmt], images[fmt] = _render_format(folder, family, root / family / f"{fmt}.safetensors",
                                                 components, root, fmt)
    targets = check_targets(family, base, fused, layers, components)
    for key in base:
        if not torch.allclose(fused["peft"][key], fused["kohya"][key], rtol=0, atol=1e-7):
            raise AssertionError(f"{family}: diffusers loads the kohya file differently at {key}")
    for index, (peft, kohya_pixels) in enumerate(zip(images["peft"], images["kohya"], strict=True)):
        plain = np.asarray(PIL.Image.open(data / "oracle" / family / SCHEDULER / f"{index}.png"))
        if not np.array_equal(peft, kohya_pixels) or np.array_equal(peft, plain):
            raise AssertionError(f"{family} job {index}: the formats differ, or the LoRA changes nothing")
    deltas = {_folder_name(folder, key): (fused["peft"][key] - base[key]).contiguous() for key in _sample(targets)}
    save_file(deltas, root / f"{family}-deltas.safetensors", metadata={"lora_scale": str(LORA_SCALE)})

    records = [job_record(f"lora/{family}/{fmt}", index, f"oracle/{family}/model", None, SCHEDULER, job, STEPS, NATIVE,
                          f"lora/{family}/{fmt}/{index}.png", lora=f"lora/{family}/{fmt}.safetensors",
                          lora_scale=LORA_SCALE)
               for fmt in FORMATS for index, job in enumerate(JOBS)]
    if family in SCHEDULER_FAMILIES:
        records += _render_schedulers(folder, family, root / family / "peft.safetensors", root)
    return records, f"lora/{family}-deltas.safetensors"


def write(data: pathlib.Path) -> None:
    """Rebuild data/lora: the LoRA files of sd1 and sdxl in both formats, their fused deltas and images."""
    quiet_and_deterministic()
    data = pathlib.Path(data)
    root = data / "lora"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    records, deltas = [], {}
    for family in FAMILIES:
        family_records, deltas[family] = write_family(data, family)
        records += family_records
        print(f"oracle: lora {family}", flush=True)
    doc = {
        "about": (
            "Reference images of diffusers' PyTorch pipelines (float32, CPU) with a LoRA: the pipeline is "
            "loaded from `model`, then `load_lora_weights(lora)` and `fuse_lora(lora_scale=lora_scale)`; "
            "paths are relative to tests/data. Each job is one pipeline call, batch size 1, latents = "
            "jax.random.normal(jax.random.PRNGKey(seed), (1, C, height // 8, width // 8), float32); image = "
            "round(output_type='np' image * 255) as uint8 RGB; negative_prompt null means None; the scheduler "
            "is <Class>.from_config(pipe.scheduler.config). Both formats of a family hold the same LoRA and "
            "render the same pixels. `deltas` holds, per family, fused minus base (float32, lora_scale "
            "applied) of one tensor of each kind the LoRA changes, named <component>.<tensor name in the model folder>."
        ),
        "lora_scale": LORA_SCALE,
        "deltas": deltas,
        "versions": versions(),
        "jobs": records,
    }
    (root / "jobs.json").write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def check_targets(label: str, base: dict[str, torch.Tensor], fused: dict[str, dict[str, torch.Tensor]],
                  layers: dict[str, Any], components: Any) -> set[str]:
    """Each format's fused weights differ from `base` at exactly the weights of the modules the LoRA
    targets; returns those weights' names."""
    targets = {f"{component}.{module}.weight" for component in components
               for module in {key.split(".lora_")[0] for key in layers[component]}}
    for fmt, weights in fused.items():
        changed = {key for key in base if not torch.equal(base[key], weights[key])}
        if changed != targets:
            raise AssertionError(f"{label} {fmt}: the LoRA changed {sorted(changed ^ targets)[:5]} unexpectedly")
    return targets
