"""PyTorch checkpoint names -> our Flax parameter tree, by explicit rules.

Real checkpoints are saved by diffusers' and transformers' PyTorch classes, while our modules
(diffusion/nn) keep the parameter trees of diffusers 0.39's Flax UNet/VAE and transformers 4.57's
Flax CLIP, so that today's Flax msgpack checkpoints load unchanged. The two naming schemes differ
in a few regular ways, written out below instead of found by matching against a random tree:

- a PyTorch list index joins its list name in diffusers' Flax modules (`down_blocks.0` ->
  `down_blocks_0`, `to_out.0` -> `to_out_0`) and stays a separate path entry in transformers'
  (`layers.0` -> `layers/0`);
- the leaf follows the layer: a norm's `weight` is `scale`, an embedding's `weight` is
  `embedding`, a conv's `weight` (O, I, H, W) is `kernel` (H, W, I, O), a linear's `weight`
  (out, in) is `kernel` (in, out); `bias` stays `bias`;
- T5's embedding tables are named `shared` and `relative_attention_bias` (its `_Rules.tables`);
- a few layers have other names (table `_KINDS`): the Flax VAE's mid-block attention calls
  `to_q/to_k/to_v/to_out.0` `query/key/value/proj_attn` (old PyTorch VAE checkpoints used those
  names too, so they map to themselves); CLIP's `position_ids` buffer is not a parameter.

Then the whole checkpoint must fit: every tensor lands on a parameter of the expected tree with
that parameter's shape, and every parameter is filled; `fit` refuses anything else, naming the
tensors without a home and the parameters left missing.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import NamedTuple

from diffusion.errors import ModelError

FlaxPath = tuple[str, ...]
Shape = tuple[int, ...]

_INDEX = re.compile(r"\d+")
_SHOWN = 5  # names listed in a misfit error; the rest are counted
_LONGEST = 300  # characters shown of each


@dataclasses.dataclass(frozen=True)
class _Rules:
    join_index: bool  # `blocks.0` -> `blocks_0` (diffusers Flax) or `blocks/0` (transformers Flax)
    renames: Mapping[str, str] = dataclasses.field(default_factory=dict)  # layer name -> Flax layer name
    dropped: frozenset[str] = frozenset()  # buffers, not parameters
    prefix: str = ""  # put before every name whose first part is not one of `top_level`
    top_level: frozenset[str] = frozenset()
    tables: frozenset[str] = frozenset()  # layers besides `*embedding` whose weight is an embedding table
    # Wrappers of a model of the same name (`vision_model.vision_model.`): transformers 5 saves
    # them without the inner level, every earlier version with it. Both load.
    wrappers: frozenset[str] = frozenset()


_CLIP = _Rules(
    join_index=False,
    dropped=frozenset({"text_model.embeddings.position_ids"}),
    # transformers 5 saves CLIPTextModel's names without `text_model.`; every earlier version
    # (and so every SD text_encoder) has it. Both load, as in transformers 5.
    prefix="text_model.",
    top_level=frozenset({"text_model", "text_projection"}),
)
_KINDS = {
    "unet": _Rules(join_index=True),
    "vae": _Rules(
        join_index=True,
        renames={"to_q": "query", "to_k": "key", "to_v": "value", "to_out_0": "proj_attn"},
    ),
    "clip": _CLIP,
    "clip_projection": _CLIP,
    # transformers' CLIPModel (the CLIP score's and the aesthetic predictor's towers): both towers
    # and their projections; `logit_scale`, the contrastive loss's temperature, scores nothing.
    "clip_model": _Rules(join_index=False, dropped=frozenset({
        "text_model.embeddings.position_ids", "vision_model.embeddings.position_ids", "logit_scale"})),
    # diffusers' StableDiffusionSafetyChecker: a CLIPVisionModel under `vision_model.`, its
    # `visual_projection`, the concept embeddings and their thresholds (plain tensors).
    "safety_checker": _Rules(join_index=False, wrappers=frozenset({"vision_model"}),
                             dropped=frozenset({"vision_model.vision_model.embeddings.position_ids"})),
    # LAION's aesthetic predictor: the Linear layers of a torch Sequential `layers`, by index.
    "aesthetic": _Rules(join_index=False),
    # diffusers' FluxTransformer2DModel: the names as they are (indices joined, as in the UNet).
    "flux": _Rules(join_index=True),
    # transformers' T5EncoderModel: its token table `shared` (saved once, though the encoder
    # ties `encoder.embed_tokens` to it) and the relative position buckets are embeddings.
    "t5": _Rules(join_index=True, dropped=frozenset({"encoder.embed_tokens.weight"}),
                 tables=frozenset({"shared", "relative_attention_bias"})),
}
KINDS = tuple(_KINDS)


class WeightsError(ModelError):
    """A checkpoint that cannot be loaded: `model=<component folder>: <file>: <why>`."""

    def __init__(self, where: object, rule: str) -> None:
        super().__init__("model", str(where), rule)


class Target(NamedTuple):
    """Where one PyTorch tensor goes: the Flax path, and the axes permutation on the way."""

    path: FlaxPath
    axes: tuple[int, ...] | None  # numpy.transpose axes; None keeps the layout

    def shape(self, shape: Shape) -> Shape:
        return tuple(shape[a] for a in self.axes) if self.axes else tuple(shape)


def target(kind: str, name: str, ndim: int) -> Target | None:
    """The Flax place of PyTorch tensor `name` with `ndim` dimensions; None for a dropped buffer.

    A name no rule covers still gets a target (its path as the rules spell it): `fit` then
    reports it as a tensor without a home, next to the parameters left missing.
    """
    rules = _KINDS[kind]
    if rules.prefix and name.split(".", 1)[0] not in rules.top_level:
        name = rules.prefix + name
    first, _, rest = name.partition(".")
    if first in rules.wrappers and not rest.startswith(f"{first}."):
        name = f"{first}.{name}"
    if name in rules.dropped:
        return None
    path: list[str] = []
    for part in name.split("."):
        if rules.join_index and path and _INDEX.fullmatch(part):
            path[-1] = f"{path[-1]}_{part}"
        else:
            path.append(part)
    *layers, leaf = path
    layers = [rules.renames.get(layer, layer) for layer in layers]
    layer = layers[-1] if layers else ""
    if leaf != "weight":
        return Target((*layers, leaf), None)
    if "norm" in layer:  # GroupNorm / LayerNorm: norm1, conv_norm_out, group_norm, layer_norm1, ...
        return Target((*layers, "scale"), None)
    if (layer.endswith("embedding") or layer in rules.tables) and ndim == 2:  # token_embedding, position_embedding
        return Target((*layers, "embedding"), None)
    if ndim == 4:  # Conv2d (O, I, H, W) -> (H, W, I, O)
        return Target((*layers, "kernel"), (2, 3, 1, 0))
    if ndim == 2:  # Linear (out, in) -> (in, out)
        return Target((*layers, "kernel"), (1, 0))
    return Target((*layers, leaf), None)


# Stems whose `_N` is part of the PyTorch name (`linear_1`, T5's `wi_0`), not a joined list index.
_NAMES_WITH_INDEX = frozenset({"linear", "wi"})
_FLAX_LEAVES = frozenset({"kernel", "scale", "embedding"})  # each is PyTorch's `weight`


def torch_name(kind: str, path: FlaxPath) -> str:
    """The PyTorch name of our Flax parameter `path`: the inverse of `target`, so a folder written
    under these names loads in diffusers and transformers (harness/torch_pipeline.py writes one)
    and back here. tests/test_torch_pipeline.py checks it against `target` for every family and
    against checkpoints diffusers saved."""
    rules = _KINDS[kind]
    *layers, leaf = path
    inverse = {flax: torch for torch, flax in rules.renames.items()}
    names = []
    for layer in layers:
        layer = inverse.get(layer, layer)
        stem, _, index = layer.rpartition("_")
        joined = rules.join_index and index.isdigit() and stem and stem not in _NAMES_WITH_INDEX
        names.append(f"{stem}.{index}" if joined else layer)
    return ".".join([*names, "weight" if leaf in _FLAX_LEAVES else leaf])


def torch_shape(leaf: str, shape: Shape) -> Shape:
    """PyTorch's shape of a Flax parameter: kernels (H, W, I, O) -> (O, I, H, W) and (in, out) -> (out, in)."""
    if leaf == "kernel" and len(shape) == 4:
        return (shape[3], shape[2], shape[0], shape[1])
    if leaf == "kernel" and len(shape) == 2:
        return (shape[1], shape[0])
    return tuple(shape)


def plan(kind: str, shapes: Mapping[str, Shape], expected: Mapping[FlaxPath, Shape],
         where: str) -> dict[str, Target]:
    """Each PyTorch tensor's target; refuses (WeightsError naming `where`) a checkpoint that does
    not fill `expected` (flat Flax path -> shape) exactly. Needs only names and shapes, so it
    runs before any tensor data is read."""
    targets = {}
    for name, shape in shapes.items():
        found = target(kind, name, len(shape))
        if found is not None:
            targets[name] = found
    fit({name: (t.path, t.shape(shapes[name])) for name, t in targets.items()}, expected, where)
    return targets


def fit(placed: Mapping[str, tuple[FlaxPath, Shape]], expected: Mapping[FlaxPath, Shape], where: str) -> None:
    """Refuse unless the tensors (name -> (Flax path, converted shape)) fill `expected` exactly:
    one tensor per parameter, each with the parameter's shape."""
    homeless, misfits, taken = [], {}, {}
    for name, (path, shape) in placed.items():
        want = expected.get(path)
        if want is None:
            homeless.append(f"{name} (no parameter {'/'.join(path)})")
        elif path in taken:
            homeless.append(f"{name} ({'/'.join(path)} is already filled by {taken[path]})")
        elif tuple(want) != tuple(shape):
            misfits[path] = f"{name} (as {'/'.join(path)} {list(shape)}, the model's is {list(want)})"
        else:
            taken[path] = name
    missing = [f"{'/'.join(path)} {list(shape)}" for path, shape in expected.items()
               if path not in taken and path not in misfits]
    parts = [f"{count(len(items), noun)} {verb}: {few(items)}" for items, noun, verb in (
        (list(misfits.values()), "tensor", "with the wrong shape"),
        (homeless, "tensor", "with no home in the model"),
        (missing, "parameter", "left missing"),
    ) if items]
    if parts:
        raise WeightsError(where, "; ".join(parts) + " (do the weights belong to this model's config?)")


def count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' * (n != 1)}"


def few(items: list[str]) -> str:
    """The first few items (each cut to a sane length: names come from the file), then a count."""
    few = ", ".join(item if len(item) <= _LONGEST else f"{item[:_LONGEST]}..." for item in sorted(items)[:_SHOWN])
    return few if len(items) <= _SHOWN else f"{few} and {len(items) - _SHOWN} more"

