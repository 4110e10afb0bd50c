"""What a model family is: the components a pipeline folder holds, its tokenizers and the
inputs it makes of a batch's jobs, the pipeline classes it answers to, how it encodes a batch's
texts and how it generates from them, the
image sizes it renders, what a denoiser call costs, what its LoRAs may change, how its weights
split over devices, and how a tiny random model of it is built. The loader, the engine and the
device program use nothing else of a family: they pass its inputs along without looking
inside. The families themselves are diffusion/families."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import flax.linen as nn
import numpy as np

from diffusion.choices import SCHEDULERS
from diffusion.lora import LoraTargets
from diffusion.sharding import TensorParallel

# The samplers of the DDPM training schedule (the UNet models'): all but flow_euler.
DDPM_SCHEDULERS = tuple(name for name in SCHEDULERS if name != "flow_euler")


class Tokenizer(Protocol):
    """Texts to fixed-length id rows, and whether each text was cut (diffusion.tokenizer)."""

    max_length: int

    def __call__(self, texts: list[str]) -> tuple[np.ndarray, list[bool]]: ...


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
    options: tuple[tuple[str, Any], ...] = ()  # the family's `options`, as model_index.json sets them

    def __getitem__(self, name: str) -> nn.Module:
        return dict(self.modules)[name]

    def option(self, name: str) -> Any:
        return dict(self.options)[name]


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
    tokenizers: Mapping[str, Callable[[Path], Tokenizer]]  # folder -> its loader, one per text encoder, in order
    text_encoders: tuple[str, ...]  # the components `encode` runs (and nothing else does)
    # (networks, the text encoders' params, the batch's text inputs, guided) -> what they encode, a
    # pytree whose leading axis is the batch: a program of its own, run once a batch, so the text
    # encoders are compiled once for every shape (diffusion.placement.lower_encode)
    encode: Callable[[Networks, Any, Any, bool], Any]
    # (networks, scheduler, static, the other components' params, inputs, encoded) -> Output
    generate: Callable[..., Any]
    # (tokenizers, prompts, negative prompts, seeds, guidance scales) -> (the batch's inputs of
    # `generate`: a pytree of numpy arrays, leading axis the batch; which prompts were cut)
    inputs: Callable[[Sequence[Tokenizer], Sequence[str], Sequence[str], Sequence[int], Sequence[float]],
                     tuple[Any, list[bool]]]
    abstract_inputs: Callable[[Sequence[Tokenizer], int], Any]  # (tokenizers, batch) -> inputs' shapes and dtypes
    geometry: Callable[[Networks], Geometry]
    # (networks, params, rows, height, width) -> FLOPs of one denoiser call on `rows` inputs (2 per
    # image with classifier-free guidance), None where the backend counts none; `params` may be abstract
    denoiser_flops: Callable[[Networks, Any, int, int, int], float | None]
    # (this family, folder, seed): write a tiny random-weight pipeline folder (tests, demos)
    tiny: Callable[[Family, Path, int], None]
    # pipeline options its `generate` reads from model_index.json, with their defaults
    options: tuple[tuple[str, Any], ...] = ()
    # the schedulers its models run (a job naming another is refused)
    schedulers: tuple[str, ...] = DDPM_SCHEDULERS
    # the guidance scale of a job that names none: its diffusers pipeline's default (7.5 for
    # Stable Diffusion's pipelines), so a job renders as that pipeline called without one
    default_guidance: float = 7.5
    # whether a job's guidance scale > 1 means classifier-free guidance (an unconditional pass
    # beside the conditional one each step: its own programs, twice the denoiser's work); False
    # for guidance-distilled models, which take the scale as an input of their one pass
    classifier_free: bool = True
    # the components a LoRA may change (the UNet and CLIP text encoders by default) and how kohya files
    # name the denoiser's modules (diffusion/lora.py)
    loras: LoraTargets = LoraTargets()
    # component -> how its weights split over a mesh's model axis (diffusion.sharding); the
    # components not named (VAE, text encoders) stay whole on every device
    tensor_parallel: Mapping[str, TensorParallel] = dataclasses.field(default_factory=dict)
    # whether its `generate` takes image-to-image batches (Static.image, generate.ImageInputs)
    image_to_image: bool = False
    # whether it takes inpainting batches too (Static.mask, ImageInputs.mask)
    inpainting: bool = False
