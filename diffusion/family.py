"""What a model family is: the components a pipeline folder holds, its tokenizers, the pipeline
classes it answers to, how it generates, the image sizes it renders and what a denoiser call
costs. The families themselves are diffusion/families."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn


@dataclasses.dataclass(frozen=True)
class Component:
    """A network of a pipeline folder: its class, its config class (`from_dict`) and how its
    checkpoints name their tensors (a diffusion.convert kind)."""

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
class Geometry:
    """The image sizes a model renders: its native size, and the step of widths and heights
    (the job contract checks sizes against it)."""

    native_size: int
    size_step: int


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    pipelines: tuple[str, ...]  # model_index.json `_class_name`s (PyTorch and Flax)
    components: Mapping[str, Component]
    tokenizers: tuple[str, ...]  # tokenizer folders, one per text encoder, in order
    generate: Callable[..., Any]  # (networks, scheduler, static, params, inputs) -> Output
    geometry: Callable[[Networks], Geometry]
    # (networks, params, rows, height, width) -> FLOPs of one denoiser call on `rows` inputs (2 per
    # image with classifier-free guidance), None where the backend counts none; `params` may be abstract
    denoiser_flops: Callable[[Networks, Any, int, int, int], float | None]
