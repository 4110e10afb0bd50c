"""Single-file checkpoints (the original CompVis / SGM layout civitai serves) of the tiny SD 1.x, SD 2.x
and SDXL pipelines.

`write(data)` rebuilds `data/single_file/` from the folders pipelines.py wrote (never rebuilt here):

    sd1.safetensors    data/oracle/sd1/model in one file (CLIP ViT-L under cond_stage_model.transformer.),
                       with what real SD 1.x files carry beside the weights: EMA copies of the UNet
                       (`model_ema.<name without dots>`, other values: a loader that took them would
                       render other pixels), `model_ema.decay` / `num_updates`, the training sampler's
                       buffers (betas, alphas_cumprod) and CLIP's position_ids buffer
    sd2.safetensors    data/oracle/sd2/model in one file, its text encoder in OpenCLIP's layout
                       (cond_stage_model.model.: fused q/k/v), with one OpenCLIP layer more than the
                       folder's text encoder (as SD 2.x files hold ViT-H's 24 layers for diffusers' 23),
                       the text projection and logit_scale SD 2.x does not use
    sdxl.safetensors   data/oracle/sdxl/model in one file: CLIP ViT-L under
                       conditioner.embedders.0.transformer. (with position_ids), OpenCLIP bigG under
                       conditioner.embedders.1.model. (its text_projection the transpose of the folder's
                       text_projection.weight, and logit_scale)
    README.md          this list

Each file is written by this module's own inverse of diffusers' single-file mapping, then checked:
`from_single_file(file, config=folder)` must load every component back to exactly the tensors of the
folder's own safetensors, name for name (`torch.equal`); for sd1, the UNet loaded with
`extract_ema=True` must differ from the folder's in every tensor (so the EMA copies are where
diffusers looks for them, and the regular weights are the ones taken by default). So the farm's
reading of these files is held to diffusers' own, and the folders' reference images are the files' too.
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import warnings

import numpy as np
import torch
from diffusers import (
    StableDiffusionPipeline,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)
from safetensors.numpy import save_file
from safetensors.torch import load_file

from tests.oracle.pipelines import quiet_and_deterministic

_RESNET = {"norm1": "in_layers.0", "conv1": "in_layers.2", "norm2": "out_layers.0", "conv2": "out_layers.3",
           "time_emb_proj": "emb_layers.1", "conv_shortcut": "skip_connection"}
_UNET_TOP = {"time_embedding.linear_1": "time_embed.0", "time_embedding.linear_2": "time_embed.2",
             "conv_in": "input_blocks.0.0", "conv_norm_out": "out.0", "conv_out": "out.2",
             "add_embedding.linear_1": "label_emb.0.0", "add_embedding.linear_2": "label_emb.0.2"}
_VAE_ATTENTION = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}
_OPENCLIP = {"layer_norm1": "ln_1", "layer_norm2": "ln_2", "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj",
             "self_attn.out_proj": "attn.out_proj"}
FAMILIES = {"sd1": StableDiffusionPipeline, "sd2": StableDiffusionPipeline, "sdxl": StableDiffusionXLPipeline}


def _resnet(rest: str) -> str:
    layer, _, leaf = rest.partition(".")
    return f"{_RESNET.get(layer, layer)}.{leaf}"


def unet_to_ldm(name: str, config: dict) -> str:
    """A diffusers UNet tensor name in the LDM layout (`model.diffusion_model.` added by the caller)."""
    per = config["layers_per_block"] + 1
    head, _, leaf = name.rpartition(".")
    if head in _UNET_TOP:
        return f"{_UNET_TOP[head]}.{leaf}"
    if m := re.match(r"down_blocks\.(\d+)\.(resnets|attentions|downsamplers)\.(\d+)\.(.*)", name):
        block, kind, layer, rest = int(m[1]), m[2], int(m[3]), m[4]
        if kind == "downsamplers":
            return f"input_blocks.{1 + block * per + per - 1}.0.op.{rest.removeprefix('conv.')}"
        index = 1 + block * per + layer
        return f"input_blocks.{index}.0.{_resnet(rest)}" if kind == "resnets" else f"input_blocks.{index}.1.{rest}"
    if m := re.match(r"mid_block\.(resnets|attentions)\.(\d+)\.(.*)", name):
        return f"middle_block.{2 * int(m[2])}.{_resnet(m[3])}" if m[1] == "resnets" else f"middle_block.1.{m[3]}"
    m = re.match(r"up_blocks\.(\d+)\.(resnets|attentions|upsamplers)\.(\d+)\.(.*)", name)
    block, kind, layer, rest = int(m[1]), m[2], int(m[3]), m[4]
    if kind == "upsamplers":
        attention = config["up_block_types"][block].startswith("CrossAttn")
        return f"output_blocks.{block * per + per - 1}.{2 if attention else 1}.{rest}"
    index = block * per + layer
    return f"output_blocks.{index}.0.{_resnet(rest)}" if kind == "resnets" else f"output_blocks.{index}.1.{rest}"


def vae_to_ldm(name: str, value: np.ndarray, config: dict) -> tuple[str, np.ndarray]:
    """A diffusers VAE tensor in the LDM layout (the mid-block attention's linears as 1x1 convs)."""
    blocks = len(config["up_block_types"])
    name = name.replace("conv_norm_out", "norm_out").replace("conv_shortcut", "nin_shortcut")
    if m := re.match(r"(encoder|decoder)\.mid_block\.attentions\.0\.(group_norm|to_q|to_k|to_v|to_out\.0)\.(.*)", name):
        if m[3] == "weight" and m[2] != "group_norm":
            value = value[:, :, None, None]
        return f"{m[1]}.mid.attn_1.{_VAE_ATTENTION[m[2]]}.{m[3]}", value
    if m := re.match(r"(encoder|decoder)\.mid_block\.resnets\.(\d)\.(.*)", name):
        return f"{m[1]}.mid.block_{int(m[2]) + 1}.{m[3]}", value
    if m := re.match(r"encoder\.down_blocks\.(\d+)\.(resnets\.(\d+)|downsamplers\.0)\.(.*)", name):
        part = f"block.{m[3]}" if m[3] is not None else "downsample"
        return f"encoder.down.{m[1]}.{part}.{m[4]}", value
    if m := re.match(r"decoder\.up_blocks\.(\d+)\.(resnets\.(\d+)|upsamplers\.0)\.(.*)", name):
        part = f"block.{m[3]}" if m[3] is not None else "upsample"
        return f"decoder.up.{blocks - 1 - int(m[1])}.{part}.{m[4]}", value
    return name, value


def openclip_to_ldm(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """transformers' CLIP names of an OpenCLIP text tower back in OpenCLIP's (q, k, v fused)."""
    out = {}
    for name, value in tensors.items():
        name = name.removeprefix("text_model.")
        if name == "embeddings.position_embedding.weight":
            out["positional_embedding"] = value
        elif name == "embeddings.token_embedding.weight":
            out["token_embedding.weight"] = value
        elif name.startswith("final_layer_norm."):
            out[name.replace("final_layer_norm", "ln_final")] = value
        elif name == "text_projection.weight":
            out["text_projection"] = np.ascontiguousarray(value.T)
        elif m := re.match(r"encoder\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)", name):
            if m[2] == "q":
                parts = [tensors[f"text_model.encoder.layers.{m[1]}.self_attn.{x}_proj.{m[3]}"] for x in "qkv"]
                out[f"transformer.resblocks.{m[1]}.attn.in_proj_{m[3]}"] = np.concatenate(parts)
        else:
            m = re.match(r"encoder\.layers\.(\d+)\.(.*)\.(weight|bias)", name)
            out[f"transformer.resblocks.{m[1]}.{_OPENCLIP[m[2]]}.{m[3]}"] = value
    return out


def _weights_file(folder: pathlib.Path, component: str) -> pathlib.Path:
    """The component's own float32 weights (not a variant's)."""
    files = sorted((folder / component).glob("*model.safetensors"))
    if len(files) != 1:
        raise AssertionError(f"{folder / component}: expected one *model.safetensors, found {files}")
    return files[0]


def _folder_tensors(folder: pathlib.Path, component: str) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in load_file(str(_weights_file(folder, component))).items()}


def _components(folder: pathlib.Path) -> list[str]:
    return sorted(p.parent.name for p in folder.glob("*/config.json") if p.parent.name != "scheduler")


def _position_ids(folder: pathlib.Path, component: str) -> np.ndarray:
    config = json.loads((folder / component / "config.json").read_text())
    return np.arange(config["max_position_embeddings"], dtype=np.int64)[None]


def single_file(folder: pathlib.Path, family: str) -> dict[str, np.ndarray]:
    """The folder's weights as one original-layout state dict, with what real files of the family
    carry beside them (see the module docstring)."""
    rng = np.random.default_rng(11)
    unet_config = json.loads((folder / "unet" / "config.json").read_text())
    vae_config = json.loads((folder / "vae" / "config.json").read_text())
    out = {f"model.diffusion_model.{unet_to_ldm(k, unet_config)}": v
           for k, v in _folder_tensors(folder, "unet").items()}
    for name, value in _folder_tensors(folder, "vae").items():
        key, value = vae_to_ldm(name, value, vae_config)
        out[f"first_stage_model.{key}"] = value
    if family == "sd2":
        tower = openclip_to_ldm(_folder_tensors(folder, "text_encoder"))
        layers = json.loads((folder / "text_encoder" / "config.json").read_text())["num_hidden_layers"]
        last = f"transformer.resblocks.{layers - 1}."
        extra = {name.replace(last, f"transformer.resblocks.{layers}."): rng.normal(0, 0.02, value.shape).astype(value.dtype)
                 for name, value in tower.items() if name.startswith(last)}
        hidden = tower["token_embedding.weight"].shape[1]
        tower |= extra | {"text_projection": rng.normal(0, 0.02, (hidden, hidden)).astype(np.float32),
                          "logit_scale": np.array(4.6052, np.float32)}
        return out | {f"cond_stage_model.model.{k}": v for k, v in tower.items()}
    clip = "cond_stage_model.transformer." if family == "sd1" else "conditioner.embedders.0.transformer."
    out |= {clip + k: v for k, v in _folder_tensors(folder, "text_encoder").items()}
    out[f"{clip}text_model.embeddings.position_ids"] = _position_ids(folder, "text_encoder")
    if family == "sdxl":
        tower = openclip_to_ldm(_folder_tensors(folder, "text_encoder_2"))
        out |= {f"conditioner.embedders.1.model.{k}": v for k, v in tower.items()}
        out["conditioner.embedders.1.model.logit_scale"] = np.array(4.6052, np.float32)
    return out


def _with_ema_and_buffers(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What real SD 1.x files hold beside the weights: the UNet's EMA copy under LDM's flattened names
    (other values), and the training sampler's buffers."""
    rng = np.random.default_rng(7)
    out = dict(tensors)
    for name, value in tensors.items():
        if name.startswith("model.diffusion_model."):
            flat = "model_ema." + "".join(name.split(".")[1:])
            out[flat] = (value + rng.normal(0, 0.05, value.shape)).astype(value.dtype)
    out["model_ema.decay"] = np.array(0.9999, np.float32)
    out["model_ema.num_updates"] = np.array(1000, np.int32)
    betas = np.linspace(0.00085**0.5, 0.012**0.5, 1000, dtype=np.float32) ** 2
    out["betas"] = betas
    out["alphas_cumprod"] = np.cumprod(1 - betas).astype(np.float32)
    return out


def _check_loads_the_folder(module: torch.nn.Module, folder: pathlib.Path, component: str, what: str,
                            equal: bool = True) -> None:
    """The module holds exactly the folder's tensors of that component, name for name (or, with
    equal=False, the same names and not one tensor equal)."""
    # transformers >= 5.6 holds CLIPTextModel's weights without `text_model.`, and saves them with it
    got, want = ({k.removeprefix("text_model."): v for k, v in tensors.items()}
                 for tensors in (module.state_dict(), load_file(str(_weights_file(folder, component)))))
    if got.keys() != want.keys():
        raise AssertionError(f"{what} {component}: names differ from the folder's: {sorted(got.keys() ^ want.keys())[:5]}")
    same = [key for key in want if torch.equal(got[key], want[key])]
    if equal and len(same) != len(want):
        raise AssertionError(f"{what} {component}: {len(want) - len(same)} tensors differ from the folder's, "
                             f"e.g. {sorted(set(want) - set(same))[:3]}")
    if not equal and same:
        raise AssertionError(f"{what} {component}: {len(same)} tensors equal the folder's, e.g. {same[:3]}")


def _readme(counts: dict[str, int]) -> str:
    doc = __doc__.split("\n\n")[2]  # the list of files
    return ("# Single-file checkpoints of the tiny oracle pipelines\n\n"
            "Written by `tests/oracle/single_file.py` (`python -m tests.oracle single_file` in build/oracle-venv); "
            "do not edit.\n\n```\n" + "\n".join(line.removeprefix("    ") for line in doc.splitlines()) + "\n```\n\n"
            + "".join(f"- `{family}.safetensors`: {n} tensors\n" for family, n in counts.items())
            + "\nEach file was checked when written: diffusers' `from_single_file(file, config=folder)` loads every "
              "component to exactly the folder's tensors (and sd1's UNet with `extract_ema=True` to other values).\n")


def write(data: pathlib.Path) -> None:
    """Rebuild data/single_file (see the module docstring)."""
    quiet_and_deterministic()
    root = data / "single_file"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    counts = {}
    for family, cls in FAMILIES.items():
        folder = data / "oracle" / family / "model"
        tensors = single_file(folder, family)
        if family == "sd1":
            tensors = _with_ema_and_buffers(tensors)
        path = root / f"{family}.safetensors"
        save_file(tensors, str(path))
        counts[family] = len(tensors)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pipe = cls.from_single_file(str(path), config=str(folder), torch_dtype=torch.float32)
        modules = sorted(name for name, c in pipe.components.items() if isinstance(c, torch.nn.Module))
        if modules != _components(folder):
            raise AssertionError(f"{family} single file: components {modules}, the folder has {_components(folder)}")
        for component in modules:
            _check_loads_the_folder(getattr(pipe, component), folder, component, f"{family} single file")
        if family == "sd1":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ema = UNet2DConditionModel.from_single_file(str(path), config=str(folder), subfolder="unet",
                                                            extract_ema=True, torch_dtype=torch.float32)
            _check_loads_the_folder(ema, folder, "unet", "sd1 single file's EMA", equal=False)
        print(f"oracle: single_file {family} ({len(tensors)} tensors; from_single_file loads the folder's weights)",
              flush=True)
    (root / "README.md").write_text(_readme(counts))
