"""Model families: what the engine knows of a kind of model, one module each.

A family says which components a pipeline folder holds (their networks, config classes and
checkpoint naming), which tokenizers, which pipeline classes it answers to in
`model_index.json`, and how it generates: encode the prompts, denoise, decode (its
`generate`, device-side, jitted by the engine). The engine and the loader use nothing else
of it, so the next family (Flux, with its transformer and T5 encoder) is one new module here
plus what its checkpoints need in worker/convert.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn

from renderfarm.jobs import JobError


@dataclasses.dataclass(frozen=True)
class Component:
    """A network of a pipeline folder: its class, its config class (`from_dict`) and how its
    checkpoints name their tensors (a worker.convert kind)."""

    module: type[nn.Module]
    config: Any
    kind: str


@dataclasses.dataclass(frozen=True)
class Networks:
    """A model's networks and pipeline options: everything of it a compiled program is
    specialised on besides the weights (hashable, so the engine can bind it statically)."""

    modules: tuple[tuple[str, nn.Module], ...]
    force_zeros_for_empty_prompt: bool = True

    def __getitem__(self, name: str) -> nn.Module:
        return dict(self.modules)[name]


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    pipelines: tuple[str, ...]  # model_index.json `_class_name`s (PyTorch and Flax)
    components: Mapping[str, Component]
    tokenizers: tuple[str, ...]  # tokenizer folders, one per text encoder, in order
    generate: Callable[..., Any]  # (networks, scheduler, static, params, inputs) -> Output


def families() -> dict[str, Family]:
    from worker.families import sd, sdxl

    return {family.name: family for family in (sd.FAMILY, sdxl.FAMILY)}


def detect(ref: str, model_index: Mapping[str, Any]) -> Family:
    """The family of a pipeline folder, from its model_index.json's `_class_name`."""
    name = model_index.get("_class_name")
    for family in families().values():
        if name in family.pipelines:
            return family
    known = sorted(p for family in families().values() for p in family.pipelines)
    raise JobError("model", ref, f"is a {name!r} pipeline; the farm renders {', '.join(known)}")
