"""LoRA files -> weight deltas keyed by diffusers' PyTorch tensor names, without torch and without unpickling.

A LoRA changes a Linear or Conv2d weight W of the denoiser (a UNet, a Flux transformer) or a CLIP text encoder
by `scale * s * up @ down`, with
s = alpha / rank (PEFT's `lora_alpha / r`; alpha / sqrt(rank) for rsLoRA) and `scale` the user's weight of
the LoRA (diffusers' `fuse_lora(lora_scale=...)`). A conv LoRA (kohya's LoCon, PEFT's Conv2d) has down
(rank, in, kh, kw) and up (out, rank, 1, 1) and changes the (out, in, kh, kw) kernel; a linear LoRA on a
1x1 conv changes its (out, in, 1, 1) kernel. The loader merges `W + delta` at load, so rendering costs
nothing more. Two safetensors layouts are in use:

- diffusers / PEFT: `<component>.<module>.lora_A.weight` (down) and `.lora_B.weight` (up), component `unet`,
  `transformer` (Flux), `text_encoder` or `text_encoder_2`; older diffusers files spell the pair
  `.lora.down.weight` / `.lora.up.weight` or `.lora_linear_layer.down.weight` / `.up.weight`, or, for attention
  processors, `<attention>.processor.to_q_lora.down.weight` (`to_q` in the UNet, `q_proj` in CLIP; `to_out` is `to_out.0`
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
  joined the same way. `lora_unet_` names the denoiser whatever it is: Flux files name the transformer's
  modules as Black Forest Labs' code does (`double_blocks_0_img_attn_qkv`, `single_blocks_3_linear1`,
  `final_layer_adaLN_modulation_1`), and a fused module's delta splits by rows over diffusers' modules (qkv
  over to_q, to_k and to_v; a single block's linear1 over to_q, to_k, to_v and proj_mlp; the final
  modulation's (shift, scale) is diffusers' (scale, shift)) as diffusion/bfl.py says.

Which components a family's LoRAs may change, and how kohya names its denoiser's modules, is the family's
(`LoraTargets`, diffusion/family.py); `LoraFile.fit` is given it with the model's tensor shapes.

Where diffusers 0.42 departs from the files' own meaning, the files win: a kohya module's alpha counts even
when it differs from the file's most common alpha (diffusers loses such alphas of attention projections,
and of every module of transformers 5's CLIPTextModel, to names no module matches, such as
`...to_q_lora.down.weight.alpha`, and uses the common one; kohya's trainer, ComfyUI and A1111 use the
module's), a Flux kohya file's alphas of `final_layer_*` count (diffusers leaves them unread: "TODO: alphas"),
and a diffusers file's `.alpha` tensors count (diffusers refuses the file).

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
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from diffusion.convert import WeightsError, count, few
from diffusion.errors import ModelError, shown
from diffusion.weights import FLOAT_DTYPES, PICKLE_SUFFIXES, ST_DTYPES, TensorInfo, read_header, read_tensor

Shape = tuple[int, ...]
Rows = Sequence[tuple[str, int, int]]  # (diffusers module, first row, end row) of a fused module's output
Spans = tuple[tuple[int, int], ...]  # (first row, end row) ranges of a fused module's output, in order

CLIP_PREFIX = "text_model."
KOHYA_PREFIXES = {"lora_unet_": "unet", "lora_te_": "text_encoder", "lora_te1_": "text_encoder",
                  "lora_te2_": "text_encoder_2"}
KOHYA_DENOISER = KOHYA_PREFIXES["lora_unet_"]  # kohya's name of every denoiser, a Flux transformer too
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
class LoraTargets:
    """What a family's LoRAs may change, by component name: its denoiser (which kohya files call `lora_unet_`
    whatever it is) and its CLIP text encoders; and, where kohya files name the denoiser's modules otherwise
    than diffusers' names joined with `_` (Flux: Black Forest Labs' names, whose fused layers split over
    several diffusers modules), those names: (the denoiser's config) -> module, dotted -> where its output
    rows go."""

    denoiser: str = "unet"
    text_encoders: tuple[str, ...] = ("text_encoder", "text_encoder_2")
    kohya_modules: Callable[[Any], Mapping[str, Rows]] | None = None

    @property
    def components(self) -> tuple[str, ...]:
        return (self.denoiser, *self.text_encoders)


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

    def fits(self, shape: Shape, rows: Spans | None = None) -> bool:
        """Whether the delta (its output `rows` only, if given) can change a weight of `shape`: the same, or a
        linear LoRA on a 1x1 conv."""
        shape = tuple(shape)
        want = self.shape if rows is None else (sum(end - first for first, end in rows), *self.shape[1:])
        return shape == want or (len(want) == 2 and shape == (*want, 1, 1))

    def delta(self, shape: Shape, scale: float, rows: Spans | None = None) -> np.ndarray:
        """`scale * scaling * up @ down` (of up's `rows` only, in their order, if given) as a float32 array of the
        target weight's `shape`."""
        up = self.up.reshape(self.up.shape[0], self.rank)
        if rows is not None:
            up = np.concatenate([up[first:end] for first, end in rows])
        down = self.down.reshape(self.rank, -1)
        return (up @ down * np.float32(scale * self.scaling)).reshape(shape)


class Patch(NamedTuple):
    """A LoRA module placed on the model: the weight it changes, that weight's shape and, where the module is
    a fused one split over several weights, which of its output rows make this one."""

    module: LoraModule
    target: str  # the weight's diffusers PyTorch name, e.g. `down_blocks.1.attentions.0.proj_in.weight`
    shape: Shape
    rows: Spans | None = None  # None: all

    def delta(self, scale: float) -> np.ndarray:
        return self.module.delta(self.shape, _checked_scale(scale), self.rows)


class _Fused(NamedTuple):
    """A fused module of kohya's names: its name, its output rows' total, and each diffusers module's rows."""

    name: str  # dotted, e.g. `double_blocks.0.img_attn.qkv`
    rows: int
    parts: dict[str, Spans]


def _fused(table: Mapping[str, Rows]) -> dict[str, _Fused]:
    """kohya's joined name (`double_blocks_0_img_attn_qkv`) -> the fused module; a diffusers module named more
    than once takes its row ranges in the order listed."""
    fused = {}
    for name, rows in table.items():
        parts: dict[str, Spans] = {}
        for module, first, end in rows:
            parts[module] = (*parts.get(module, ()), (first, end))
        fused[name.replace(".", "_")] = _Fused(name, max(end for _, _, end in rows), parts)
    return fused


@dataclasses.dataclass(frozen=True)
class LoraFile:
    """A LoRA file read and checked on its own; `fit` / `deltas` place it on a model."""

    path: Path
    format: str  # "diffusers" or "kohya"
    modules: tuple[LoraModule, ...]

    @property
    def components(self) -> frozenset[str]:
        return frozenset(module.component for module in self.modules)

    def _home(self, module: LoraModule, targets: LoraTargets) -> str:
        """The model component a module changes: kohya's `unet` is the family's denoiser."""
        return targets.denoiser if self.format == "kohya" and module.component == KOHYA_DENOISER else module.component

    def fit(self, components: Mapping[str, Mapping[str, Shape]], targets: LoraTargets = LoraTargets(),
            denoiser_config: Any = None) -> dict[str, dict[str, Patch]]:
        """Each module on its weight(s): component -> weight name -> Patch, from each component's diffusers
        PyTorch tensor names -> shapes (of the components `targets` names; the others are not the LoRA's to
        change). `denoiser_config` is the denoiser's config, read where kohya names its modules otherwise
        (`targets.kohya_modules`). Refuses (WeightsError naming the file and the keys) a LoRA with a module the
        model does not have, or one whose delta has another shape: a LoRA of another model."""
        offered = {name: components[name] for name in targets.components if name in components}
        homes = {module.key: self._home(module, targets) for module in self.modules}
        touched = sorted(set(homes.values()) & set(offered))
        fused = {}
        if self.format == "kohya" and targets.kohya_modules is not None and targets.denoiser in touched:
            fused = _fused(targets.kohya_modules(denoiser_config))
        indexes = {name: _index(name, offered[name], self.format == "kohya", name in targets.text_encoders)
                   for name in touched if not (fused and name == targets.denoiser)}
        placed: dict[str, dict[str, Patch]] = {name: {} for name in touched}
        problems = []
        for component in sorted(set(homes.values()) - set(offered)):
            keys = [key for key, home in homes.items() if home == component]
            problems.append(f"{count(len(keys), 'module')} for {component} ({few(keys)}), which is not a component "
                            f"the model has and a LoRA may change (those are {', '.join(offered)})")
        misfits = []
        for module in (module for module in self.modules if homes[module.key] in offered):
            component = homes[module.key]
            shapes = offered[component]
            if fused and component == targets.denoiser:
                parts, reason = self._fused_parts(module, component, fused)
            else:
                parts, reason = self._parts(module, component, indexes[component])
            if reason:
                misfits.append(f"{module.key} ({reason})")
            for name, rows in parts.items():
                target = f"{name}.weight"
                shape = tuple(shapes[target]) if target in shapes else None
                if shape is None:
                    misfits.append(f"{module.key} (no {target} in the model's {component})")
                elif target in placed[component]:
                    other = placed[component][target].module.key
                    misfits.append(f"{module.key} ({target} is already changed by {other})")
                elif not module.fits(shape, rows):
                    part = "" if rows is None else f" (its rows {', '.join(f'{a}:{b}' for a, b in rows)})"
                    misfits.append(f"{module.key} (makes a {list(module.shape)} delta{part}, but "
                                   f"{component} {target} is {list(shape)})")
                else:
                    placed[component][target] = Patch(module, target, shape, rows)
        if misfits:
            problems.append(f"{count(len(misfits), 'module')} that do not fit: {few(misfits)}")
        if fused and any(homes[m.key] == targets.denoiser and m.names[0] not in fused for m in self.modules):
            problems.append(f"kohya's names of the model's {targets.denoiser} modules are {few(list(fused))}")
        if problems:
            raise WeightsError(self.path, f"does not fit the model: {'; '.join(problems)} (is the LoRA for another "
                                          "model family?)")
        return placed

    @staticmethod
    def _parts(module: LoraModule, component: str, index: Mapping[str, str | None],
               ) -> tuple[dict[str, Spans | None], str | None]:
        """The one model module a module names, or why none."""
        found = {index[name] for name in module.names if name in index}
        if len(found) != 1 or None in found:
            return {}, f"{'no such module' if not found else 'names several modules'} in the model's {component}"
        return {found.pop(): None}, None

    @staticmethod
    def _fused_parts(module: LoraModule, component: str, fused: Mapping[str, _Fused],
                     ) -> tuple[dict[str, Spans | None], str | None]:
        """The diffusers modules a fused module of kohya's names splits over, with each one's rows, or why none."""
        if module.names[0] not in fused:
            return {}, f"no such module in the model's {component}"
        where = fused[module.names[0]]
        if module.shape[0] != where.rows:
            return {}, (f"makes a {list(module.shape)} delta, but {component} {where.name} has {where.rows} output "
                        f"rows ({', '.join(where.parts)})")
        return dict(where.parts), None

    def deltas(self, components: Mapping[str, Mapping[str, Shape]], scale: float, targets: LoraTargets = LoraTargets(),
               denoiser_config: Any = None) -> dict[str, dict[str, np.ndarray]]:
        """component -> weight name -> float32 delta, to add to the weight: `scale * (alpha / rank) * up @ down`.
        Everything is checked (`fit`) before any delta is computed."""
        scale = _checked_scale(scale)
        return {component: {target: patch.delta(scale) for target, patch in patches.items()}
                for component, patches in self.fit(components, targets, denoiser_config).items()}


def _checked_scale(scale: Any) -> float:
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale):
        raise ModelError("lora_scale", scale, "must be a finite number")
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

def _index(component: str, shapes: Mapping[str, Shape], kohya: bool, clip: bool) -> dict[str, str | None]:
    """Every name a LoRA may give an adaptable module (a `.weight` of 2 or 4 dimensions) of `component` ->
    the module; None where a name fits several. kohya names are joined with `_` and, in the UNet, may be
    the SGM UNet's; a CLIP text encoder's (`clip`) may have `text_model.` or not."""
    modules = [name.removesuffix(".weight") for name, shape in shapes.items()
               if name.endswith(".weight") and len(shape) in (2, 4)]
    sgm = _sgm_names(modules) if component == "unet" and kohya else {}
    index: dict[str, str | None] = {}
    for module in modules:
        names = {module}
        if clip:
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
