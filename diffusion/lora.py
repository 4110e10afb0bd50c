"""LoRA files -> weight deltas keyed by diffusers' PyTorch tensor names, without torch and without unpickling.

A LoRA changes a Linear or Conv2d weight W of the UNet or a text encoder by `scale * s * up @ down`, with
s = alpha / rank (PEFT's `lora_alpha / r`; alpha / sqrt(rank) for rsLoRA) and `scale` the user's weight of
the LoRA (diffusers' `fuse_lora(lora_scale=...)`). A conv LoRA (kohya's LoCon, PEFT's Conv2d) has down
(rank, in, kh, kw) and up (out, rank, 1, 1) and changes the (out, in, kh, kw) kernel; a linear LoRA on a
1x1 conv changes its (out, in, 1, 1) kernel. The loader merges `W + delta` at load, so rendering costs
nothing more. Two safetensors layouts are in use:

- diffusers / PEFT: `<component>.<module>.lora_A.weight` (down) and `.lora_B.weight` (up), component `unet`,
  `text_encoder` or `text_encoder_2`; older diffusers files spell the pair `.lora.down.weight` /
  `.lora.up.weight` or `.lora_linear_layer.down.weight` / `.up.weight`, or, for attention processors,
  `<attention>.processor.to_q_lora.down.weight` (`to_q` in the UNet, `q_proj` in CLIP; `to_out` is `to_out.0`
  / `out_proj`). Alpha is the LoraConfig diffusers saves in the header's `lora_adapter_metadata`
  (`lora_alpha`, `alpha_pattern`, `use_rslora`, as PEFT reads them), else a `<component>.<module>.alpha`
  tensor (as ComfyUI reads it), else the rank, as diffusers does. The rank is always the factors' own
  (a config's r and rank_pattern only repeat it).
- kohya: `lora_unet_<module>`, `lora_te_<module>` / `lora_te1_<module>` (text_encoder), `lora_te2_<module>`
  (text_encoder_2), each with `.lora_down.weight`, `.lora_up.weight` and `.alpha` (the rank if absent), the
  module's dots made underscores. SD 1.x files name diffusers' UNet modules; SDXL files name the original
  SGM UNet's (`input_blocks_4_1_transformer_blocks_0_attn1_to_q`, `middle_block_1_...`, `output_blocks_...`,
  `label_emb_0_0`, `time_embed_0`, `out_2`), mapped to diffusers' names from the block layout the model's own
  names show (diffusers' `_maybe_map_sgm_blocks_to_diffusers` does it from the UNet config). An underscore
  name cannot be split back (`to_q`, `down_blocks`), so it is matched against the model's module names
  joined the same way.

Where diffusers 0.42 departs from the files' own meaning, the files win: a kohya module's alpha counts even
when it differs from the file's most common alpha (diffusers loses such alphas of attention projections,
and of every module of transformers 5's CLIPTextModel, to names no module matches, such as
`...to_q_lora.down.weight.alpha`, and uses the common one; kohya's trainer, ComfyUI and A1111 use the
module's), and a diffusers file's `.alpha` tensors count (diffusers refuses the file).

CLIP modules match with or without the `text_model.` prefix (transformers 5 dropped it from CLIPTextModel,
so diffusers' LoRAs of today lack it and older ones and kohya's have it). Nothing is trusted before it
fits: the header is checked by diffusion.weights.read_header; every key must be understood, every down have
its up of the same rank, every alpha be one finite non-zero number of any integer or float dtype
(diffusers' `convert_state_dict_to_kohya` writes int64 ones); then `LoraFile.fit` places each module on a
weight of the model with its shape, or refuses naming the keys that do not fit. Pickle files (.ckpt,
.pt, .bin, .pth) are refused by name, never opened.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import mmap
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from diffusion.convert import WeightsError, count, few
from diffusion.weights import FLOAT_DTYPES, PICKLE_SUFFIXES, ST_DTYPES, TensorInfo, read_header, read_tensor
from renderfarm.jobs import JobError, shown

Shape = tuple[int, ...]

TEXT_ENCODERS = ("text_encoder", "text_encoder_2")
CLIP_PREFIX = "text_model."
KOHYA_PREFIXES = {"lora_unet_": "unet", "lora_te_": "text_encoder", "lora_te1_": "text_encoder",
                  "lora_te2_": "text_encoder_2"}
_KOHYA_ROLES = {"lora_down.weight": "down", "lora_up.weight": "up", "alpha": "alpha"}
_PEFT_ROLES = (  # key suffix -> role; `_lora.` is the attention-processor form (`to_q_lora.down.weight`)
    (".lora_A.weight", "down"), (".lora_B.weight", "up"),
    (".lora.down.weight", "down"), (".lora.up.weight", "up"),
    (".lora_linear_layer.down.weight", "down"), (".lora_linear_layer.up.weight", "up"),
    ("_lora.down.weight", "down"), ("_lora.up.weight", "up"),
    (".alpha", "alpha"),
)
# The attention-processor form's projections: the UNet's name, then CLIP's.
_PROCESSOR_NAMES = {"to_q": ("to_q", "q_proj"), "to_k": ("to_k", "k_proj"), "to_v": ("to_v", "v_proj"),
                    "to_out": ("to_out.0", "out_proj")}
METADATA_KEY = "lora_adapter_metadata"  # diffusers' LoraConfig per component, JSON in the header
PEFT_DEFAULT_ALPHA = 8  # LoraConfig's lora_alpha when a saved config leaves it out
# LoraConfig options that change what merging means; refused when on.
_UNSUPPORTED_OPTIONS = ("use_dora", "lora_bias", "fan_in_fan_out", "layer_replication")
_PATTERN = re.compile(r"\^?[A-Za-z0-9_.]+")  # alpha_pattern keys evaluated: module names, optionally anchored
# An alpha tensor's dtypes: the factors' floats, and every integer one (diffusers writes kohya alphas as int64).
_ALPHA_DTYPES = {**{name: d.numpy for name, d in ST_DTYPES.items() if d.numpy is not None},
                 **{f"{kind}{bits}": np.dtype(f"<{kind.lower()}{bits // 8}")
                    for kind in "IU" for bits in (8, 16, 32, 64)}}

# The original SGM UNet's names of diffusers' adaptable modules outside the down/up blocks, of the middle
# block's parts, and of the ResNets' layers (diffusers' `_convert_unet_lora_key`, read backwards).
_SGM_TOP = {"conv_in": "input_blocks.0.0", "time_embedding.linear_1": "time_embed.0",
            "time_embedding.linear_2": "time_embed.2", "add_embedding.linear_1": "label_emb.0.0",
            "add_embedding.linear_2": "label_emb.0.2", "conv_out": "out.2",
            "mid_block.resnets.0": "middle_block.0", "mid_block.attentions.0": "middle_block.1",
            "mid_block.resnets.1": "middle_block.2"}
_SGM_RESNET = {"conv1": "in_layers.2", "time_emb_proj": "emb_layers.1", "conv2": "out_layers.3",
               "conv_shortcut": "skip_connection"}


@dataclasses.dataclass(frozen=True)
class LoraModule:
    """One adapted layer as the file has it: its factors (float32) and what scales them."""

    component: str
    names: tuple[str, ...]  # the module as the file may mean it: dotted names (diffusers) or one kohya name
    key: str  # the file's key of the down factor, for messages
    down: np.ndarray  # (rank, in) or (rank, in, kh, kw)
    up: np.ndarray  # (out, rank) or (out, rank, 1, 1)
    alpha: float | None  # None: the rank
    rslora: bool  # alpha / sqrt(rank) instead of alpha / rank

    @property
    def rank(self) -> int:
        return self.down.shape[0]

    @property
    def shape(self) -> Shape:
        """The shape of up @ down: (out, in) or (out, in, kh, kw)."""
        return (self.up.shape[0], *self.down.shape[1:])

    @property
    def scaling(self) -> float:
        """alpha / rank (or / sqrt(rank)); 1 without an alpha, which is then the rank."""
        if self.alpha is None:
            return 1.0
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    def fits(self, shape: Shape) -> bool:
        """Whether the delta can change a weight of `shape`: the same, or a linear LoRA on a 1x1 conv."""
        shape = tuple(shape)
        return shape == self.shape or (len(self.shape) == 2 and shape == (*self.shape, 1, 1))

    def delta(self, shape: Shape, scale: float) -> np.ndarray:
        """`scale * scaling * up @ down` as a float32 array of the target weight's `shape`."""
        up = self.up.reshape(self.up.shape[0], self.rank)
        down = self.down.reshape(self.rank, -1)
        return (up @ down * np.float32(scale * self.scaling)).reshape(shape)


class Patch(NamedTuple):
    """A LoRA module placed on the model: the weight it changes and that weight's shape."""

    module: LoraModule
    target: str  # the weight's diffusers PyTorch name, e.g. `down_blocks.1.attentions.0.proj_in.weight`
    shape: Shape

    def delta(self, scale: float) -> np.ndarray:
        return self.module.delta(self.shape, _checked_scale(scale))


@dataclasses.dataclass(frozen=True)
class LoraFile:
    """A LoRA file read and checked on its own; `fit` / `deltas` place it on a model."""

    path: Path
    format: str  # "diffusers" or "kohya"
    modules: tuple[LoraModule, ...]

    @property
    def components(self) -> frozenset[str]:
        return frozenset(module.component for module in self.modules)

    def fit(self, components: Mapping[str, Mapping[str, Shape]]) -> dict[str, dict[str, Patch]]:
        """Each module on its weight: component -> weight name -> Patch, from each component's diffusers
        PyTorch tensor names -> shapes. Refuses (WeightsError naming the file and the keys) a LoRA with a
        module the model does not have, or one whose delta has another shape: a LoRA of another model."""
        touched = sorted(self.components & set(components))
        indexes = {name: _index(name, components[name], self.format == "kohya") for name in touched}
        placed: dict[str, dict[str, Patch]] = {name: {} for name in touched}
        problems = []
        for component in sorted(self.components - set(components)):
            keys = [module.key for module in self.modules if module.component == component]
            problems.append(f"{count(len(keys), 'module')} for {component} ({few(keys)}), which the model does "
                            f"not have (it has {', '.join(components)})")
        misfits = []
        for module in (module for module in self.modules if module.component in components):
            index, shapes = indexes[module.component], components[module.component]
            found = {index[name] for name in module.names if name in index}
            if len(found) != 1 or None in found:
                reason = "no such module" if not found else "names several modules"
                misfits.append(f"{module.key} ({reason} in the model's {module.component})")
                continue
            target = f"{found.pop()}.weight"
            shape = tuple(shapes[target])
            if target in placed[module.component]:
                other = placed[module.component][target].module.key
                misfits.append(f"{module.key} ({target} is already changed by {other})")
            elif not module.fits(shape):
                misfits.append(f"{module.key} (makes a {list(module.shape)} delta, but "
                               f"{module.component} {target} is {list(shape)})")
            else:
                placed[module.component][target] = Patch(module, target, shape)
        if misfits:
            problems.append(f"{count(len(misfits), 'module')} that do not fit: {few(misfits)}")
        if problems:
            raise WeightsError(self.path, f"does not fit the model: {'; '.join(problems)} (is the LoRA for another "
                                          "model family?)")
        return placed

    def deltas(self, components: Mapping[str, Mapping[str, Shape]], scale: float) -> dict[str, dict[str, np.ndarray]]:
        """component -> weight name -> float32 delta, to add to the weight: `scale * (alpha / rank) * up @ down`.
        Everything is checked (`fit`) before any delta is computed."""
        scale = _checked_scale(scale)
        return {component: {target: patch.delta(scale) for target, patch in patches.items()}
                for component, patches in self.fit(components).items()}


def _checked_scale(scale: Any) -> float:
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale):
        raise JobError("lora_scale", scale, "must be a finite number")
    return float(scale)


# ---------------------------------------------------------------------------------------------- reading

def read_lora(path: Path) -> LoraFile:
    """Read and check a LoRA safetensors file (diffusers/PEFT or kohya layout, see the module docstring).
    Raises WeightsError naming the file and the keys for anything else: a pickle, a file that is not a
    LoRA, keys this reader does not know (LyCORIS' LoHa/LoKr, DoRA), a down without its up, ranks that
    disagree, an alpha that is not a finite non-zero number."""
    path = Path(path)
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise WeightsError(path, f"is a pickle file ({path.suffix}), which is never loaded: unpickling runs code "
                                 "from the file. Convert it on a trusted machine with torch and safetensors: "
                                 "`save_file(torch.load(path, weights_only=True), 'lora.safetensors')`")
    try:
        tensors = read_header(path)
        configs = _configs(path)
    except OSError as err:
        raise WeightsError(path, f"cannot be read ({err.strerror or err})") from None
    if not tensors:
        raise WeightsError(path, "holds no tensors: not a LoRA")
    kohya = [name for name in tensors if name.startswith(tuple(KOHYA_PREFIXES))]
    if kohya and len(kohya) != len(tensors):
        other = sorted(set(tensors) - set(kohya))
        raise WeightsError(path, f"mixes kohya keys ({shown(kohya[0])}) with others ({few(other)}): not one "
                                 "LoRA format")
    fmt = "kohya" if kohya else "diffusers"
    groups: dict[tuple[str, str], dict[str, str]] = collections.defaultdict(dict)
    unknown = []
    for name in tensors:
        parsed = _parse_kohya(name) if kohya else _parse_diffusers(name)
        if parsed is None:
            unknown.append(name)
        else:
            component, module, role = parsed
            if role in groups[component, module]:
                raise WeightsError(path, f"{shown(name)} and {shown(groups[component, module][role])} are both the "
                                         f"{role} of one module")
            groups[component, module][role] = name
    if unknown:
        known = "lora_down/lora_up/alpha" if kohya else "lora_A/lora_B, lora.down/lora.up, lora_linear_layer, alpha"
        what = "is not a LoRA" if len(unknown) == len(tensors) else "has keys this LoRA reader does not know"
        raise WeightsError(path, f"{what}: {count(len(unknown), 'key')} like {few(unknown)} (known: {fmt} "
                                 f"{known}; LyCORIS LoHa/LoKr and DoRA are not supported)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        modules = [_module(path, data, tensors, component, module, roles, configs.get(component), fmt)
                   for (component, module), roles in sorted(groups.items())]
    return LoraFile(path, fmt, tuple(modules))


def _parse_kohya(name: str) -> tuple[str, str, str] | None:
    """`lora_unet_<module>.lora_down.weight` -> ("unet", "<module>", "down")."""
    lora_name, _, suffix = name.partition(".")
    prefix = next((p for p in KOHYA_PREFIXES if lora_name.startswith(p)), None)
    if prefix is None or suffix not in _KOHYA_ROLES or len(lora_name) == len(prefix):
        return None
    return KOHYA_PREFIXES[prefix], lora_name[len(prefix):], _KOHYA_ROLES[suffix]


def _parse_diffusers(name: str) -> tuple[str, str, str] | None:
    """`unet.<module>.lora_A.weight` -> ("unet", "<module>", "down"); the processor form keeps its `to_q`."""
    component, _, rest = name.partition(".")
    for suffix, role in _PEFT_ROLES:
        if rest.endswith(suffix) and len(rest) > len(suffix):
            return component, rest[: -len(suffix)], role
    return None


def _configs(path: Path) -> dict[str, dict[str, Any]]:
    """diffusers' LoraConfig per component from the header's `lora_adapter_metadata` (`unet.lora_alpha`, ...).
    read_header has checked the header already; this only reads its metadata."""
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        metadata = json.loads(f.read(length)).get("__metadata__", {})
    raw = metadata.get(METADATA_KEY)
    if raw is None:
        return {}
    try:
        flat = json.loads(raw) if isinstance(raw, str) else None
    except ValueError:
        flat = None
    if not isinstance(flat, dict):
        raise WeightsError(path, f"{METADATA_KEY} in the header is not a JSON object as a string: {shown(raw)}")
    configs: dict[str, dict[str, Any]] = collections.defaultdict(dict)
    for key, value in flat.items():
        component, _, field = key.partition(".")
        configs[component][field] = value
    for component, config in configs.items():
        for option in _UNSUPPORTED_OPTIONS:
            if config.get(option):
                raise WeightsError(path, f"{METADATA_KEY}: {component}.{option}={shown(config[option])}: LoRAs with "
                                         f"{option} are not supported")
        patterns = config.get("alpha_pattern") or {}
        if not isinstance(patterns, dict):
            raise WeightsError(path, f"{METADATA_KEY}: {component}.alpha_pattern={shown(patterns)}: must be an object")
        for pattern in patterns:
            if not _PATTERN.fullmatch(pattern):
                raise WeightsError(path, f"{METADATA_KEY}: {component}.alpha_pattern key {shown(pattern)}: only "
                                         "module names (letters, digits, _ and ., optionally a leading ^) are read")
    return configs


def _alpha(path: Path, where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value == 0:
        raise WeightsError(path, f"{where}={shown(value)}: alpha must be a finite non-zero number (kohya's trainer "
                                 "reads 0 as the rank and diffusers as 0)")
    return float(value)


def _alpha_tensor(path: Path, data: mmap.mmap, key: str, info: TensorInfo) -> float:
    """A `.alpha` tensor's one number, read here: read_tensor reads float weights only, and an alpha may be an
    integer."""
    if info.dtype not in _ALPHA_DTYPES:
        raise WeightsError(path, f"tensor {shown(key)} has dtype {info.dtype}; an alpha must be an integer or float "
                                 f"number ({', '.join(_ALPHA_DTYPES)})")
    if math.prod(info.shape) != 1:
        raise WeightsError(path, f"{shown(key)} has shape {list(info.shape)}, not a single number")
    return _alpha(path, shown(key), np.frombuffer(data, _ALPHA_DTYPES[info.dtype], 1, info.start)[0].item())


def _config_alpha(path: Path, component: str, module: str, config: Mapping[str, Any]) -> float:
    """PEFT's alpha of `module`: the first alpha_pattern key that names it (as `(.*\\.)?(key)$`), else
    lora_alpha."""
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.fullmatch(rf"(.*\.)?({pattern})", module):
            return _alpha(path, f"{METADATA_KEY} {component}.alpha_pattern[{pattern!r}]", value)
    return _alpha(path, f"{METADATA_KEY} {component}.lora_alpha", config.get("lora_alpha", PEFT_DEFAULT_ALPHA))


def _module(path: Path, data: mmap.mmap, tensors: Mapping[str, TensorInfo], component: str, module: str,
            roles: Mapping[str, str], config: Mapping[str, Any] | None, fmt: str) -> LoraModule:
    """One module's factors and alpha, checked against each other."""
    missing = [role for role in ("down", "up") if role not in roles]
    if missing:
        raise WeightsError(path, f"{shown(next(iter(roles.values())))} has no {' or '.join(missing)} factor")
    for key in (roles[role] for role in ("down", "up")):
        if ST_DTYPES[tensors[key].dtype].numpy is None:
            raise WeightsError(path, f"tensor {shown(key)} has dtype {tensors[key].dtype}; LoRA factors must be "
                                     f"one of {FLOAT_DTYPES}")
    down, up = (read_tensor(data, tensors[roles[role]], None, np.dtype(np.float32)) for role in ("down", "up"))
    key = roles["down"]
    if not (down.ndim == up.ndim and down.ndim in (2, 4) and up.shape[1:2] == down.shape[:1] and down.shape[0] > 0
            and up.shape[2:] in ((), (1, 1))):
        raise WeightsError(path, f"{shown(key)} {list(down.shape)} and its up factor {list(up.shape)} are not a "
                                 "LoRA pair: down (rank, in[, kh, kw]), up (out, rank[, 1, 1])")
    alpha = None
    if "alpha" in roles:
        alpha = _alpha_tensor(path, data, roles["alpha"], tensors[roles["alpha"]])
    dotted = ".".join(part for part in module.split(".") if part != "processor")
    if fmt == "kohya":
        names: tuple[str, ...] = (module,)
    elif key.endswith("_lora.down.weight"):  # the attention-processor form
        head, _, projection = dotted.rpartition(".")
        if projection not in _PROCESSOR_NAMES:
            raise WeightsError(path, f"{shown(key)}: {projection}_lora is not one of "
                                     f"{', '.join(p + '_lora' for p in _PROCESSOR_NAMES)}")
        names = tuple(f"{head}.{name}" for name in _PROCESSOR_NAMES[projection])
    else:
        names = (dotted,)
    if alpha is None and config is not None:
        alpha = _config_alpha(path, component, dotted, config)
    return LoraModule(component, names, key, down, up, alpha, bool(config and config.get("use_rslora")))


# ------------------------------------------------------------------------------------- the model's names

def _index(component: str, shapes: Mapping[str, Shape], kohya: bool) -> dict[str, str | None]:
    """Every name a LoRA may give an adaptable module (a `.weight` of 2 or 4 dimensions) of `component` ->
    the module; None where a name fits several. kohya names are joined with `_` and, in the UNet, may be
    the SGM UNet's."""
    modules = [name.removesuffix(".weight") for name, shape in shapes.items()
               if name.endswith(".weight") and len(shape) in (2, 4)]
    sgm = _sgm_names(modules) if component == "unet" and kohya else {}
    index: dict[str, str | None] = {}
    for module in modules:
        names = {module}
        if component in TEXT_ENCODERS:
            bare = module.removeprefix(CLIP_PREFIX)
            names |= {bare, CLIP_PREFIX + bare}
        if module in sgm:
            names.add(sgm[module])
        for name in {n.replace(".", "_") for n in names} if kohya else names:
            index[name] = module if index.get(name, module) == module else None
    return index


def _sgm_names(modules: Iterable[str]) -> dict[str, str]:
    """diffusers UNet module -> its name in the original SGM UNet, from the block layout the names show.

    SGM numbers the down path's layers `input_blocks.<i>` (0 is conv_in; each ResNet `.0`, with its
    attention `.1`; each downsampler its own `<i>.0.op`) and the up path's `output_blocks.<i>` (a ResNet
    `.0`, its attention `.1`, the block's upsampler after them, `.2` or `.1`, in the block's last layer).
    """
    modules = list(modules)
    layout: dict[tuple[str, int], dict[str, set[int]]] = collections.defaultdict(lambda: collections.defaultdict(set))
    for module in modules:
        parts = module.split(".")
        if parts[0] in ("down_blocks", "up_blocks") and len(parts) > 3 and parts[1].isdigit() and parts[3].isdigit():
            layout[parts[0], int(parts[1])][parts[2]].add(int(parts[3]))
    prefixes = dict(_SGM_TOP)
    counter = {"down_blocks": 1, "up_blocks": 0}
    for (side, block), parts in sorted(layout.items()):
        sgm = "input_blocks" if side == "down_blocks" else "output_blocks"
        for layer in sorted(parts["resnets"]):
            prefixes[f"{side}.{block}.resnets.{layer}"] = f"{sgm}.{counter[side]}.0"
            prefixes[f"{side}.{block}.attentions.{layer}"] = f"{sgm}.{counter[side]}.1"
            counter[side] += 1
        if parts["downsamplers"]:
            prefixes[f"{side}.{block}.downsamplers.0.conv"] = f"input_blocks.{counter[side]}.0.op"
            counter[side] += 1
        if parts["upsamplers"]:  # in the block's last layer, after its ResNet (and attention)
            after = 2 if parts["attentions"] else 1
            prefixes[f"{side}.{block}.upsamplers.0"] = f"output_blocks.{counter[side] - 1}.{after}"
    names = {}
    for module in modules:
        parts = module.split(".")
        for cut in range(len(parts), 0, -1):
            head = ".".join(parts[:cut])
            if head in prefixes:
                rest = parts[cut:]
                if parts[cut - 2: cut - 1] == ["resnets"] and rest:
                    rest = [_SGM_RESNET.get(rest[0], rest[0]), *rest[1:]]
                names[module] = ".".join([prefixes[head], *rest])
                break
    return names
