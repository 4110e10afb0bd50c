"""Single-file checkpoints (the CompVis / A1111 / SGM layout civitai serves) -> the tensors of
each pipeline component under diffusers' PyTorch names, without torch and without copying.

One `.safetensors` file holds the UNet (`model.diffusion_model.`), the VAE
(`first_stage_model.`) and the text encoder(s) (`cond_stage_model.` for SD 1.x and 2.x,
`conditioner.embedders.N.` for SDXL) in the original repositories' names. The renaming is
diffusers' `loaders/single_file_utils.py` (0.42.1), written as one rule per key, and every
renamed tensor stays a view of the file's bytes (worker.weights.TensorInfo): a 1x1 conv read
as a linear is the same bytes with another shape, OpenCLIP's fused q/k/v projection is three
contiguous thirds, and its text projection is read transposed. Nothing is read here but the
header; worker.weights checks every tensor against the network built from the base's configs.

A file that also holds EMA weights (`model_ema.*`) is read for its regular weights, as
`from_single_file` does by default. Every tensor is either placed or left out by a rule that
says why (the sampler's buffers, EMA copies, SD 2.x's last OpenCLIP layer, which diffusers
drops, ...); any other tensor stops the load, named. A UNet saved alone in diffusers' own names
(SDXL-Lightning's `*_unet.safetensors`) is a single file too: its other components come from
the base.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from worker.convert import WeightsError, count, few
from worker.weights import PICKLE_SUFFIXES, TensorInfo, read_header

FAMILIES = ("sd1", "sd2", "sdxl")
UNET, VAE = "model.diffusion_model.", "first_stage_model."
CLIP_PREFIXES = {  # the text encoders' prefixes in each family's files -> (component, kind)
    "cond_stage_model.transformer.": ("text_encoder", "clip"),  # SD 1.x: transformers' CLIP names
    "cond_stage_model.model.": ("text_encoder", "openclip"),  # SD 2.x: OpenCLIP ViT-H
    "conditioner.embedders.0.transformer.": ("text_encoder", "clip"),  # SDXL: CLIP ViT-L
    "conditioner.embedders.1.model.": ("text_encoder_2", "openclip"),  # SDXL: OpenCLIP ViT-bigG
}
# Tensors real files carry that no component takes: why each is left out.
IGNORED = (
    (re.compile(r"model_ema\."), "an EMA copy: the regular weights are used, as from_single_file does by default"),
    (re.compile(r"(betas|alphas_cumprod|alphas_cumprod_prev|sqrt_\w+|log_one_minus_alphas_cumprod"
                r"|posterior_\w+|logvar|lvlb_weights|model_ema_decay|denoiser\.\w+)$"),
     "the training sampler's buffer: the scheduler config says it"),
    (re.compile(r".*(logit_scale|position_ids)$"), "not a weight of the text encoder"),
    (re.compile(r"cond_stage_model\.model\.text_projection$"), "SD 2.x's text encoder has no projection"),
)
_UNET_RESNET = (("in_layers.0", "norm1"), ("in_layers.2", "conv1"), ("out_layers.0", "norm2"),
                ("out_layers.3", "conv2"), ("emb_layers.1", "time_emb_proj"), ("skip_connection", "conv_shortcut"))
_UNET_TOP = {"time_embed.0": "time_embedding.linear_1", "time_embed.2": "time_embedding.linear_2",
             "input_blocks.0.0": "conv_in", "out.0": "conv_norm_out", "out.2": "conv_out",
             "label_emb.0.0": "add_embedding.linear_1", "label_emb.0.2": "add_embedding.linear_2"}
_VAE_ATTENTION = {"norm": "group_norm", "q": "to_q", "k": "to_k", "v": "to_v", "proj_out": "to_out.0"}
_OPENCLIP_TOP = {"positional_embedding": "text_model.embeddings.position_embedding.weight",
                 "token_embedding.weight": "text_model.embeddings.token_embedding.weight",
                 "ln_final.weight": "text_model.final_layer_norm.weight",
                 "ln_final.bias": "text_model.final_layer_norm.bias"}
_OPENCLIP_LAYER = (("ln_1", "layer_norm1"), ("ln_2", "layer_norm2"), ("mlp.c_fc", "mlp.fc1"),
                   ("mlp.c_proj", "mlp.fc2"), ("attn.out_proj", "self_attn.out_proj"))


@dataclasses.dataclass(frozen=True)
class SingleFile:
    """A single-file checkpoint read: its family and each component's tensors (diffusers'
    PyTorch names -> views of the file); `ignored` says why each other tensor was left out."""

    path: Path
    family: str  # sd1, sd2 or sdxl
    components: dict[str, dict[str, TensorInfo]]
    ignored: dict[str, str]


def read_single_file(path: Path, configs: Mapping[str, Mapping[str, Any]] | None = None) -> SingleFile:
    """Read the header of a single-file checkpoint and place every tensor. `configs` are the
    base pipeline's component configs (`unet` gives the blocks' layout, the text encoders
    their depth); without them only the family is found (`components` is then empty)."""
    path = Path(path)
    if path.name.lower().endswith(PICKLE_SUFFIXES):
        raise WeightsError(path.parent, f"{path.name} is a pickle file, which is never loaded: unpickling runs code "
                                        "from the file. Convert it to .safetensors on a trusted machine")
    tensors = read_header(path)
    family = detect_family(path, tensors)
    if configs is None:
        return SingleFile(path, family, {}, {})
    if "conv_in.weight" in tensors:  # a diffusers UNet saved alone
        return SingleFile(path, family, {"unet": dict(tensors)}, {})
    components: dict[str, dict[str, TensorInfo]] = {}
    ignored: dict[str, str] = {}
    homeless = []
    layers = {component: int(config.get("num_hidden_layers", 0)) for component, config in configs.items()}
    per_block = int(configs["unet"]["layers_per_block"])
    vae_blocks = len(configs["vae"]["up_block_types"])
    for name, info in tensors.items():
        why = next((reason for pattern, reason in IGNORED if pattern.match(name)), None)
        if why is not None:
            ignored[name] = why
            continue
        placed = _place(name, info, per_block, vae_blocks, layers)
        if isinstance(placed, str):
            ignored[name] = placed
        elif placed is None:
            homeless.append(name)
        else:
            for component, key, view in placed:
                components.setdefault(component, {})[key] = view
    if homeless:
        raise WeightsError(path.parent, f"{path.name}: {count(len(homeless), 'tensor')} of no known "
                                        f"{family} component: {few(homeless)}")
    return SingleFile(path, family, components, ignored)


def detect_family(path: Path, names: Collection[str] | Mapping[str, TensorInfo]) -> str:
    """sd1, sd2 or sdxl, from the tensor names (and, for a diffusers UNet alone, the width of
    its text conditioning)."""
    if any(n.startswith("conditioner.embedders.1.model.") for n in names):
        return "sdxl"
    if any(n.startswith("cond_stage_model.model.") for n in names):
        return "sd2"
    if any(n.startswith("cond_stage_model.transformer.") for n in names):
        return "sd1"
    if "conv_in.weight" in names and "time_embedding.linear_1.weight" in names and isinstance(names, Mapping):
        if "add_embedding.linear_1.weight" in names:
            return "sdxl"
        context = [info.shape[1] for key, info in names.items() if key.endswith("attn2.to_k.weight")]
        return "sd2" if context and context[0] == 1024 else "sd1"
    raise WeightsError(path.parent, f"{path.name} is not a Stable Diffusion checkpoint that the farm can place: "
                                    "looked for the text encoders of SD 1.x (cond_stage_model.transformer.), "
                                    "SD 2.x (cond_stage_model.model.) or SDXL (conditioner.embedders.1.model.), "
                                    "or a diffusers UNet (conv_in.weight, time_embedding.linear_1.weight)")


def _place(name: str, info: TensorInfo, per_block: int, vae_blocks: int,
           layers: Mapping[str, int]) -> list[tuple[str, str, TensorInfo]] | str | None:
    """Where one tensor goes: [(component, diffusers name, view)], a reason to leave it out, or
    None for a tensor no rule knows."""
    if name.startswith(UNET):
        key = _unet_key(name.removeprefix(UNET), per_block)
        return None if key is None else [("unet", key, info)]
    if name.startswith(VAE):
        return _vae(name.removeprefix(VAE), info, vae_blocks)
    for prefix, (component, kind) in CLIP_PREFIXES.items():
        if name.startswith(prefix):
            rest = name.removeprefix(prefix)
            if kind == "clip":
                return [(component, rest, info)]
            return _openclip(component, rest, info, layers.get(component, 0))
    return None


def _unet_key(key: str, per_block: int) -> str | None:
    """An LDM UNet key in diffusers' names (convert_ldm_unet_checkpoint's rules)."""
    head, _, leaf = key.rpartition(".")
    if head in _UNET_TOP:
        return f"{_UNET_TOP[head]}.{leaf}"
    if match := re.match(r"middle_block\.(\d+)\.(.*)", key):
        i, rest = int(match[1]), match[2]
        return f"mid_block.attentions.0.{rest}" if i == 1 else f"mid_block.resnets.{max(i - 1, 0)}.{_resnet(rest)}"
    match = re.match(r"(input_blocks|output_blocks)\.(\d+)\.(\d+)\.(.*)", key)
    if not match:
        return None
    kind, i, j, rest = match[1], int(match[2]), int(match[3]), match[4]
    if kind == "input_blocks":
        block, layer = (i - 1) // (per_block + 1), (i - 1) % (per_block + 1)
        if j == 0 and rest.startswith("op."):
            return f"down_blocks.{block}.downsamplers.0.conv.{rest.removeprefix('op.')}"
        if j == 0:
            return f"down_blocks.{block}.resnets.{layer}.{_resnet(rest)}"
        return f"down_blocks.{block}.attentions.{layer}.{rest}" if j == 1 else None
    block, layer = i // (per_block + 1), i % (per_block + 1)
    if j == 0:
        return f"up_blocks.{block}.resnets.{layer}.{_resnet(rest)}"
    if rest.startswith("conv."):  # the upsampler: after the resnet, or after the attention
        return f"up_blocks.{block}.upsamplers.0.{rest}"
    return f"up_blocks.{block}.attentions.{layer}.{rest}" if j == 1 else None


def _resnet(rest: str) -> str:
    for old, new in _UNET_RESNET:
        rest = rest.replace(old, new)
    return rest


def _vae(key: str, info: TensorInfo, blocks: int) -> list[tuple[str, str, TensorInfo]] | None:
    """An LDM VAE key in diffusers' names (convert_ldm_vae_checkpoint's rules): the decoder's
    blocks are numbered from the bottom in LDM, from the top in diffusers; the mid-block
    attention's 1x1 convs become linears."""
    fixed = {"encoder.norm_out": "encoder.conv_norm_out", "decoder.norm_out": "decoder.conv_norm_out"}
    head, _, leaf = key.rpartition(".")
    if head in fixed or head in ("encoder.conv_in", "encoder.conv_out", "decoder.conv_in", "decoder.conv_out",
                                 "quant_conv", "post_quant_conv"):
        return [("vae", f"{fixed.get(head, head)}.{leaf}", info)]
    match = re.match(r"(encoder|decoder)\.(down|up)\.(\d+)\.(block\.(\d+)|downsample|upsample)\.(.*)", key)
    if match:
        side, _, i, part, j, rest = match.groups()
        group = "down_blocks" if side == "encoder" else "up_blocks"
        index = int(i) if side == "encoder" else blocks - 1 - int(i)
        where = f"resnets.{j}" if j is not None else ("downsamplers.0" if part == "downsample" else "upsamplers.0")
        return [("vae", f"{side}.{group}.{index}.{where}.{rest.replace('nin_shortcut', 'conv_shortcut')}", info)]
    match = re.match(r"(encoder|decoder)\.mid\.(block_(\d)|attn_1)\.(.*)", key)
    if not match:
        return None
    side, part, number, rest = match.groups()
    if number is not None:
        return [("vae", f"{side}.mid_block.resnets.{int(number) - 1}.{rest.replace('nin_shortcut', 'conv_shortcut')}",
                 info)]
    layer, _, leaf = rest.rpartition(".")
    if layer not in _VAE_ATTENTION:
        return None
    shape = info.shape[:2] if leaf == "weight" and layer != "norm" else info.shape  # a 1x1 conv as a linear
    return [("vae", f"{side}.mid_block.attentions.0.{_VAE_ATTENTION[layer]}.{leaf}", info._replace(shape=shape))]


def _openclip(component: str, key: str, info: TensorInfo,
              layers: int) -> list[tuple[str, str, TensorInfo]] | str | None:
    """An OpenCLIP text tower key in transformers' CLIP names (convert_open_clip_checkpoint's
    rules): the fused in_proj splits into q, k and v; the projection is read transposed."""
    if key in _OPENCLIP_TOP:
        return [(component, _OPENCLIP_TOP[key], info)]
    if key == "text_projection":
        return [(component, "text_projection.weight", info._replace(shape=info.shape[::-1], transposed=True))]
    match = re.match(r"transformer\.resblocks\.(\d+)\.(.*)", key)
    if not match:
        return None
    index, rest = int(match[1]), match[2]
    if index >= layers:
        return f"layer {index} of the OpenCLIP text tower: the base's {component} has {layers} layers (diffusers " \
               "drops the last one too)"
    prefix = f"text_model.encoder.layers.{index}"
    if rest in ("attn.in_proj_weight", "attn.in_proj_bias"):
        leaf = "weight" if rest.endswith("weight") else "bias"
        third = info.nbytes // 3
        shape = (info.shape[0] // 3, *info.shape[1:])
        return [(component, f"{prefix}.self_attn.{name}_proj.{leaf}",
                 info._replace(shape=shape, start=info.start + k * third, nbytes=third))
                for k, name in enumerate("qkv")]
    layer, _, leaf = rest.rpartition(".")
    for old, new in _OPENCLIP_LAYER:
        if layer == old:
            return [(component, f"{prefix}.{new}.{leaf}", info)]
    return None


def check_family(single: SingleFile, family: str, where: str) -> None:
    """Refuse a base of another family than the file's (its configs would not fit)."""
    expected = "sdxl" if single.family == "sdxl" else "sd"
    if family != expected:
        raise WeightsError(single.path.parent, f"{single.path.name} holds {single.family} weights, but the base "
                                               f"{where} is a {family} pipeline")

