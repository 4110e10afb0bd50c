"""Single-file checkpoints (the CompVis / A1111 / SGM layout civitai serves) -> the tensors of
each pipeline component under diffusers' PyTorch names, without torch and without copying.

One `.safetensors` file holds the UNet (`model.diffusion_model.`), the VAE
(`first_stage_model.`) and the text encoder(s) (`cond_stage_model.` for SD 1.x and 2.x,
`conditioner.embedders.N.` for SDXL) in the original repositories' names. The renaming is
diffusers' `loaders/single_file_utils.py` (0.42.1: convert_ldm_unet_checkpoint,
convert_ldm_vae_checkpoint, convert_ldm_clip_checkpoint, convert_open_clip_checkpoint), written
as one rule per key, and every renamed tensor stays a view of the file's bytes
(diffusion.weights.TensorInfo): a 1x1 conv read as a linear is the same bytes with another shape,
OpenCLIP's fused q/k/v projection is three contiguous thirds, and its text projection is read
transposed. Nothing is read here but the header; diffusion.weights checks every tensor against the
network built from the base's configs (a tensor the model needs and the file lacks is reported
there, by convert.fit).

A file that also holds EMA weights (`model_ema.*`) is read for its regular weights, as
`from_single_file` does by default (convert_ldm_unet_checkpoint's `extract_ema=False`). Every
tensor is either placed or left out by a rule that says why (EMA copies, the training sampler's
buffers, SD 2.x's last OpenCLIP layer, which diffusers drops, ...); any other tensor, or two
tensors placed on one name, stops the load, named. Where diffusers silently drops a tensor no
rule of its own takes, we refuse it: a file that does not match its lineage's layout is more
likely a misnamed or broken file than a model.

A UNet saved alone in diffusers' own names (SDXL-Lightning's `*_unet.safetensors`) is a single
file too: its other components come from the base.

So is a Flux transformer in Black Forest Labs' names (`flux1-schnell.safetensors`,
`flux1-dev.safetensors`; bare, or under ComfyUI's `model.diffusion_model.`): the transformer
alone, placed by diffusion/bfl.py's row ranges. A fused projection's parts are contiguous rows,
so views again; the final modulation's two halves are swapped (TensorInfo.rolled). A guidance
embedding makes it dev (diffusers' infer_diffusers_model_type's "flux-dev"), else schnell;
every tensor must be one of the base transformer's, or the load stops naming it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from diffusion import bfl
from diffusion.convert import WeightsError, count, few
from diffusion.errors import shown
from diffusion.nn.flux import FluxConfig
from diffusion.weights import PICKLE_SUFFIXES, TensorInfo, read_header

UNET, VAE = "model.diffusion_model.", "first_stage_model."
# The text encoders' prefixes in each lineage's files -> (component, layout). "clip": already
# transformers' CLIP names (convert_ldm_clip_checkpoint strips the prefix); "openclip": OpenCLIP's.
TEXT_ENCODERS = {
    "cond_stage_model.transformer.": ("text_encoder", "clip"),  # SD 1.x: CLIP ViT-L
    "cond_stage_model.model.": ("text_encoder", "openclip"),  # SD 2.x: OpenCLIP ViT-H
    "conditioner.embedders.0.transformer.": ("text_encoder", "clip"),  # SDXL: CLIP ViT-L
    "conditioner.embedders.1.model.": ("text_encoder_2", "openclip"),  # SDXL: OpenCLIP ViT-bigG
}
# What marks each lineage's file: the prefix of its (second) text encoder; a file has one of them.
LINEAGE_MARKERS = (("sdxl", "conditioner.embedders.1.model."), ("sd2", "cond_stage_model.model."),
                  ("sd1", "cond_stage_model.transformer."))
# What marks a Flux transformer in BFL's names, and BFL's dev (its guidance embedding); ComfyUI
# files hold it under the UNet's prefix.
BFL_MARKER, BFL_GUIDANCE = "double_blocks.0.img_attn.qkv.weight", "guidance_in.in_layer.weight"
# A file's lineage -> the family (diffusion/families) of the pipelines that can be its base.
PIPELINE_FAMILIES = {"sd1": "sd", "sd2": "sd", "sdxl": "sdxl", "flux-schnell": "flux", "flux-dev": "flux"}
_TEXT = r"(cond_stage_model|conditioner\.embedders\.\d+)\."
# Tensors real files carry that no component takes, and why each is left out.
IGNORED = (
    (re.compile(r"model_ema\..*"), "an EMA copy: the regular weights are used, as from_single_file does by default"),
    (re.compile(r"(betas|alphas_cumprod|alphas_cumprod_prev|sqrt_alphas_cumprod|sqrt_one_minus_alphas_cumprod"
                r"|log_one_minus_alphas_cumprod|sqrt_recip_alphas_cumprod|sqrt_recipm1_alphas_cumprod"
                r"|posterior_variance|posterior_log_variance_clipped|posterior_mean_coef[12]|logvar|lvlb_weights"
                r"|denoiser\.(sigmas|log_sigmas))"),
     "a buffer of the training sampler: the base's scheduler config says it"),
    (re.compile(_TEXT + r".*\.position_ids"), "CLIP's position ids: a buffer (0..76), not a weight"),
    (re.compile(_TEXT + r"(.*\.)?logit_scale"), "CLIP's contrastive-loss temperature: not used to encode text"),
    (re.compile(r"cond_stage_model\.model\.text_projection"),
     "SD 2.x's text encoder has no projection (diffusers ignores it too)"),
)
_UNET_RESNET = (("in_layers.0", "norm1"), ("in_layers.2", "conv1"), ("out_layers.0", "norm2"),
                ("out_layers.3", "conv2"), ("emb_layers.1", "time_emb_proj"), ("skip_connection", "conv_shortcut"))
_UNET_TOP = {"time_embed.0": "time_embedding.linear_1", "time_embed.2": "time_embedding.linear_2",
             "input_blocks.0.0": "conv_in", "out.0": "conv_norm_out", "out.2": "conv_out"}
_VAE_TOP = {"encoder.norm_out": "encoder.conv_norm_out", "decoder.norm_out": "decoder.conv_norm_out",
            **{name: name for name in ("encoder.conv_in", "encoder.conv_out", "decoder.conv_in", "decoder.conv_out",
                                       "quant_conv", "post_quant_conv")}}
_VAE_ATTENTION = {"norm": "group_norm", "q": "to_q", "k": "to_k", "v": "to_v", "proj_out": "to_out.0"}
_OPENCLIP_TOP = {"positional_embedding": "text_model.embeddings.position_embedding.weight",
                 "token_embedding.weight": "text_model.embeddings.token_embedding.weight",
                 "ln_final.weight": "text_model.final_layer_norm.weight",
                 "ln_final.bias": "text_model.final_layer_norm.bias"}
_OPENCLIP_LAYER = {"ln_1": "layer_norm1", "ln_2": "layer_norm2", "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2",
                   "attn.out_proj": "self_attn.out_proj"}
_LEAVES = ("weight", "bias")

Placed = list[tuple[str, str, TensorInfo]]  # (component, diffusers name, view of the file's bytes)


@dataclasses.dataclass(frozen=True)
class SingleFile:
    """A single-file checkpoint read: its lineage and each component's tensors (diffusers'
    PyTorch names, as `save_pretrained` writes them -> views of the file); `ignored` says why
    each other tensor of the file was left out."""

    path: Path
    # the released model it descends from: sd1, sd2, sdxl, flux-schnell or flux-dev (not a
    # diffusion.family.Family's name: PIPELINE_FAMILIES maps one to the other)
    lineage: str
    components: dict[str, dict[str, TensorInfo]]  # unet, vae, text_encoder[, text_encoder_2]; or transformer
    ignored: dict[str, str]  # the file's tensor name -> why it was left out


def read_single_file(path: Path, configs: Mapping[str, Mapping[str, Any]] | None = None) -> SingleFile:
    """Read the header of a single-file checkpoint and place every tensor. `configs` are the
    base pipeline's component configs, as in its `<component>/config.json`: the placing
    depends on them (`unet`: layers_per_block and its embeddings; `vae`: its block counts;
    each OpenCLIP text encoder: num_hidden_layers; Flux's `transformer`: its sizes). Without
    them only the lineage is found (`components` and `ignored` are then empty), which is what
    choosing the base needs.
    Raises WeightsError for a pickle file (never opened), a lineage it cannot tell, a tensor
    no rule places or ignores, or two tensors placed on one name."""
    path = Path(path)
    if path.name.lower().endswith(PICKLE_SUFFIXES):
        raise WeightsError(path.parent, f"{path.name} is a pickle file, which is never loaded: unpickling runs code "
                                        "from the file. Convert it to .safetensors on a trusted machine")
    tensors = read_header(path)
    lineage = detect_lineage(path, tensors)
    if configs is None:
        return SingleFile(path, lineage, {}, {})
    if "conv_in.weight" in tensors:  # a diffusers UNet saved alone: already diffusers' names
        return SingleFile(path, lineage, {"unet": dict(tensors)}, {})
    if lineage.startswith("flux"):
        return SingleFile(path, lineage, {"transformer": _bfl_transformer(path, lineage, tensors, configs)}, {})
    rules = _Rules.of(path, lineage, configs)
    components: dict[str, dict[str, TensorInfo]] = {}
    sources: dict[tuple[str, str], str] = {}
    ignored: dict[str, str] = {}
    homeless = []
    for name, info in tensors.items():
        why = next((reason for pattern, reason in IGNORED if pattern.fullmatch(name)), None)
        placed = _place(rules, name, info) if why is None else why
        if isinstance(placed, str):
            ignored[name] = placed
            continue
        if placed is None:
            homeless.append(name)
            continue
        for component, key, view in placed:
            if (component, key) in sources:
                raise WeightsError(path.parent, f"{path.name}: tensors {shown(sources[component, key])} and "
                                                f"{shown(name)} are both {component}'s {key}: one of them is misnamed")
            sources[component, key] = name
            components.setdefault(component, {})[key] = view
    if homeless:
        raise WeightsError(path.parent, f"{path.name}: {count(len(homeless), 'tensor')} that no rule of a {lineage} "
                                        f"checkpoint places or ignores: {few(homeless)}")
    return SingleFile(path, lineage, components, ignored)


def detect_lineage(path: Path, names: Collection[str] | Mapping[str, TensorInfo]) -> str:
    """sd1, sd2 or sdxl, from the prefix of the text encoder(s) the file holds (or, for a
    diffusers UNet alone, its added embedding and the width of its text conditioning, as
    diffusers' infer_diffusers_model_type tells SD 2.x by attn2.to_k's 1024 columns); or
    flux-dev or flux-schnell, a Flux transformer in BFL's names with a guidance embedding or not."""
    found = [(lineage, f"{prefix}*") for lineage, prefix in LINEAGE_MARKERS if any(n.startswith(prefix) for n in names)]
    bare = {name.removeprefix(UNET) for name in names if name.endswith((BFL_MARKER, BFL_GUIDANCE))}
    if BFL_MARKER in bare:
        found.append(("flux-dev" if BFL_GUIDANCE in bare else "flux-schnell", BFL_MARKER))
    if len(found) > 1:
        raise WeightsError(path.parent, f"{path.name} holds the text encoders or transformers of several lineages: "
                                        + ", ".join(f"{lineage} ({marker})" for lineage, marker in found))
    if found:
        return found[0][0]
    if "conv_in.weight" in names and "time_embedding.linear_1.weight" in names and isinstance(names, Mapping):
        if "add_embedding.linear_1.weight" in names:
            return "sdxl"
        context = [info.shape[-1] for key, info in names.items() if key.endswith("attn2.to_k.weight")]
        return "sd2" if context and context[0] == 1024 else "sd1"
    raise WeightsError(path.parent, f"{path.name} is not a Stable Diffusion or Flux checkpoint whose lineage could "
                                    "be detected: looked for the text encoders of SDXL "
                                    "(conditioner.embedders.1.model.*), SD 2.x (cond_stage_model.model.*) or SD 1.x "
                                    "(cond_stage_model.transformer.*), "
                                    "or a diffusers UNet (conv_in.weight, time_embedding.linear_1.weight), "
                                    f"or a Flux transformer in Black Forest Labs' names ({BFL_MARKER}, bare or under "
                                    f"{UNET})")


def check_family(single: SingleFile, family: str, where: str) -> None:
    """Refuse a base of another family than the file's lineage's (its configs would not fit)."""
    expected = PIPELINE_FAMILIES[single.lineage]
    if family != expected:
        raise WeightsError(single.path.parent, f"{single.path.name} holds {single.lineage} weights, but the base "
                                               f"{where} is a {family} pipeline")


# ------------------------------------------------------------------------------------------- placing

@dataclasses.dataclass(frozen=True)
class _Rules:
    """What the placing takes from the base's configs."""

    path: Path
    per_block: int  # the UNet's layers_per_block: LDM numbers its blocks' layers in one row
    add_embedding: bool  # label_emb.0.* is SDXL's added (text_time) embedding
    encoder_blocks: int  # the VAE's down blocks
    decoder_blocks: int  # its up blocks: LDM numbers them from the bottom, diffusers from the top
    layers: Mapping[str, int]  # each OpenCLIP text encoder's depth: layers past it are left out

    @classmethod
    def of(cls, path: Path, lineage: str, configs: Mapping[str, Mapping[str, Any]]) -> _Rules:
        def get(component: str, key: str) -> Any:
            value = configs.get(component, {}).get(key)
            if value is None:
                raise WeightsError(path.parent, f"{path.name} holds {lineage} weights, but the base has no "
                                                f"{component}/config.json with {key} (is the base a {lineage} pipeline?)")
            return value

        add = configs.get("unet", {}).get("addition_embed_type") == "text_time"
        openclip = {"sdxl": ("text_encoder_2",), "sd2": ("text_encoder",)}.get(lineage, ())
        return cls(path, int(get("unet", "layers_per_block")), add, len(get("vae", "down_block_types")),
                   len(get("vae", "up_block_types")), {c: int(get(c, "num_hidden_layers")) for c in openclip})


def _place(rules: _Rules, name: str, info: TensorInfo) -> Placed | str | None:
    """Where one tensor goes: [(component, diffusers name, view)], a reason to leave it out, or
    None for a tensor no rule knows."""
    if name.startswith(UNET):
        key = _unet(rules, name.removeprefix(UNET))
        return None if key is None else [("unet", key, info)]
    if name.startswith(VAE):
        return _vae(rules, name, info)
    for prefix, (component, layout) in TEXT_ENCODERS.items():
        if name.startswith(prefix):
            if layout == "clip":
                return [(component, name.removeprefix(prefix), info)]
            if component not in rules.layers:  # an SD 2.x tower in an SDXL file, or the reverse
                return None
            return _openclip(rules, component, name, prefix, info)
    return None


def _resnet(rest: str) -> str:
    for old, new in _UNET_RESNET:
        rest = rest.replace(old, new)
    return rest


def _unet(rules: _Rules, key: str) -> str | None:
    """An LDM UNet key in diffusers' names (convert_ldm_unet_checkpoint's rules)."""
    head, _, leaf = key.rpartition(".")
    if head in _UNET_TOP and leaf in _LEAVES:
        return f"{_UNET_TOP[head]}.{leaf}"
    if head in ("label_emb.0.0", "label_emb.0.2") and leaf in _LEAVES and rules.add_embedding:
        return f"add_embedding.linear_{1 if head.endswith('0.0') else 2}.{leaf}"
    if match := re.fullmatch(r"middle_block\.(\d+)\.(.+)", key):  # resnet, attention, resnet
        i, rest = int(match[1]), match[2]
        return f"mid_block.resnets.{max(i - 1, 0)}.{_resnet(rest)}" if i % 2 == 0 else \
            f"mid_block.attentions.{i - 1}.{rest}"
    match = re.fullmatch(r"(input|output)_blocks\.(\d+)\.(\d+)\.(.+)", key)
    if not match:
        return None
    side, i, j, rest = match[1], int(match[2]), int(match[3]), match[4]
    if side == "input":  # input_blocks.0 is conv_in; then per_block (resnet [+ attention]), a downsampler
        if i == 0:
            return None
        block, layer = (i - 1) // (rules.per_block + 1), (i - 1) % (rules.per_block + 1)
        if j == 0 and rest in ("op.weight", "op.bias"):
            return f"down_blocks.{block}.downsamplers.0.conv.{rest.removeprefix('op.')}"
        if j == 0 and not rest.startswith("op"):
            return f"down_blocks.{block}.resnets.{layer}.{_resnet(rest)}"
        return f"down_blocks.{block}.attentions.{layer}.{rest}" if j == 1 else None
    block, layer = i // (rules.per_block + 1), i % (rules.per_block + 1)
    if j == 0 and not rest.startswith("op"):
        return f"up_blocks.{block}.resnets.{layer}.{_resnet(rest)}"
    if j in (1, 2) and rest in ("conv.weight", "conv.bias"):  # the upsampler: after the resnet, or the attention
        return f"up_blocks.{block}.upsamplers.0.{rest}"
    if j == 1 and not rest.startswith("conv"):
        return f"up_blocks.{block}.attentions.{layer}.{rest}"
    return None


def _vae(rules: _Rules, name: str, info: TensorInfo) -> Placed | None:
    """An LDM VAE key in diffusers' names (convert_ldm_vae_checkpoint's rules); the mid-block
    attention's 1x1 convs become linears."""
    key = name.removeprefix(VAE)
    head, _, leaf = key.rpartition(".")
    if head in _VAE_TOP and leaf in _LEAVES:
        return [("vae", f"{_VAE_TOP[head]}.{leaf}", info)]
    if match := re.fullmatch(r"encoder\.down\.(\d+)\.(block\.\d+\.(.+)|downsample\.conv\.(weight|bias))", key):
        i = int(match[1])
        if i >= rules.encoder_blocks:
            return None
        where = f"downsamplers.0.conv.{match[4]}" if match[4] else f"resnets.{match[2].removeprefix('block.')}"
        return [("vae", f"encoder.down_blocks.{i}.{where.replace('nin_shortcut', 'conv_shortcut')}", info)]
    if match := re.fullmatch(r"decoder\.up\.(\d+)\.(block\.\d+\.(.+)|upsample\.conv\.(weight|bias))", key):
        i = int(match[1])
        if i >= rules.decoder_blocks:
            return None
        where = f"upsamplers.0.conv.{match[4]}" if match[4] else f"resnets.{match[2].removeprefix('block.')}"
        index = rules.decoder_blocks - 1 - i
        return [("vae", f"decoder.up_blocks.{index}.{where.replace('nin_shortcut', 'conv_shortcut')}", info)]
    if match := re.fullmatch(r"(encoder|decoder)\.mid\.block_([12])\.(.+)", key):
        rest = match[3].replace("nin_shortcut", "conv_shortcut")
        return [("vae", f"{match[1]}.mid_block.resnets.{int(match[2]) - 1}.{rest}", info)]
    match = re.fullmatch(r"(encoder|decoder)\.mid\.attn_1\.(norm|q|k|v|proj_out)\.(weight|bias)", key)
    if not match:
        return None
    side, layer, leaf = match.groups()
    shape = info.shape
    if layer != "norm" and leaf == "weight" and len(shape) in (3, 4):  # a 1x1 conv, read as a linear
        if any(size != 1 for size in shape[2:]):
            raise WeightsError(rules.path.parent, f"{rules.path.name}: tensor {shown(name)} has shape {list(shape)}: "
                                                  "the VAE's attention takes 1x1 convs or linears")
        shape = shape[:2]
    return [("vae", f"{side}.mid_block.attentions.0.{_VAE_ATTENTION[layer]}.{leaf}", info._replace(shape=shape))]


def _openclip(rules: _Rules, component: str, name: str, prefix: str, info: TensorInfo) -> Placed | str | None:
    """An OpenCLIP text tower key in transformers' CLIP names (convert_open_clip_checkpoint's
    rules): the fused in_proj splits into q, k and v; the projection is read transposed."""
    key = name.removeprefix(prefix)
    if key in _OPENCLIP_TOP:
        return [(component, _OPENCLIP_TOP[key], info)]
    if key == "text_projection" and len(info.shape) == 2:  # used as x @ P; diffusers' Linear holds P.T
        return [(component, "text_projection.weight", info._replace(shape=info.shape[::-1], transposed=True))]
    match = re.fullmatch(r"transformer\.resblocks\.(\d+)\.(.+)", key)
    if not match:
        return None
    index, rest = int(match[1]), match[2]
    if index >= rules.layers[component]:
        return (f"layer {index} of the OpenCLIP text tower, past the base's {component} "
                f"({rules.layers[component]} layers): diffusers drops SD 2.x's last layer too")
    at = f"text_model.encoder.layers.{index}"
    layer, _, leaf = rest.rpartition(".")
    if layer in _OPENCLIP_LAYER and leaf in _LEAVES:
        return [(component, f"{at}.{_OPENCLIP_LAYER[layer]}.{leaf}", info)]
    if rest not in ("attn.in_proj_weight", "attn.in_proj_bias"):
        return None
    leaf = rest.removeprefix("attn.in_proj_")
    if not info.shape or info.shape[0] % 3:
        raise WeightsError(rules.path.parent, f"{rules.path.name}: tensor {shown(name)} has shape {list(info.shape)}: "
                                              "a fused q/k/v projection has 3 x width rows")
    third = info.nbytes // 3
    shape = (info.shape[0] // 3, *info.shape[1:])
    return [(component, f"{at}.self_attn.{part}_proj.{leaf}",
             info._replace(shape=shape, start=info.start + k * third, nbytes=third)) for k, part in enumerate("qkv")]


def _bfl_transformer(path: Path, lineage: str, tensors: Mapping[str, TensorInfo],
                     configs: Mapping[str, Mapping[str, Any]]) -> dict[str, TensorInfo]:
    """A Flux transformer in BFL's names -> its tensors in diffusers' names, as views of the file's
    rows (diffusion/bfl.py). Refuses a tensor the base's transformer has no place for, a tensor
    of the wrong height, one placed twice and one missing, each named as the file names it."""
    if "transformer" not in configs:
        raise WeightsError(path.parent, f"{path.name} holds {lineage} weights, but the base has no "
                                        "transformer/config.json (is the base a Flux pipeline?)")
    try:
        config = FluxConfig.from_dict(configs["transformer"])
    except (ValueError, TypeError) as err:
        raise WeightsError(path.parent, f"the base's transformer/config.json: {err}") from None
    dev = lineage == "flux-dev"
    if dev != config.guidance_embeds:
        raise WeightsError(path.parent, f"{path.name} holds {lineage} weights ({'a' if dev else 'no'} guidance "
                                        f"embedding, {BFL_GUIDANCE}), but the base's transformer has guidance_embeds="
                                        f"{str(config.guidance_embeds).lower()}: use a FLUX.1-{lineage[5:]} base")
    placed: dict[str, TensorInfo] = {}
    sources: dict[str, str] = {}
    homeless, why = [], ""
    for name, info in tensors.items():
        bare = name.removeprefix(UNET)
        try:
            rows = bfl.diffusers_tensors(bare, config)
        except KeyError as err:
            homeless.append(name)
            why = why or err.args[0]
            continue
        height = sum(end - first for _, first, end in rows)
        if not info.shape or info.shape[0] != height:
            raise WeightsError(path.parent, f"{path.name}: tensor {shown(name)} has shape {list(info.shape)}: the "
                                            f"base's transformer takes {height} rows of it")
        if bare in sources:
            raise WeightsError(path.parent, f"{path.name}: tensors {shown(sources[bare])} and {shown(name)} are "
                                            f"both the transformer's {bare}: one of them is misnamed")
        sources[bare] = name
        for key in dict.fromkeys(key for key, _, _ in rows):
            placed[key] = _rows(info, [(first, end) for k, first, end in rows if k == key])
    if homeless:
        raise WeightsError(path.parent, f"{path.name}: {count(len(homeless), 'tensor')} with no place in the base's "
                                        f"transformer: {few(homeless)} (e.g. {why})")
    missing = [name for name in bfl.bfl_tensors(config) if name not in sources]
    if missing:
        raise WeightsError(path.parent, f"{path.name}: {count(len(missing), 'tensor')} of the base's transformer "
                                        f"missing, in Black Forest Labs' names: {few(missing)}")
    return placed


def _rows(info: TensorInfo, ranges: list[tuple[int, int]]) -> TensorInfo:
    """Rows [first, end) of a tensor, the ranges in order, as one view: consecutive rows, rolled
    when the ranges come rotated (the final modulation's halves, swapped)."""
    row = info.nbytes // info.shape[0]
    low, high = min(first for first, _ in ranges), max(end for _, end in ranges)
    return info._replace(shape=(high - low, *info.shape[1:]), start=info.start + low * row,
                         nbytes=(high - low) * row, rolled=ranges[0][0] - low)
