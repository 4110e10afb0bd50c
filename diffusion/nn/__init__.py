"""The model layer's networks (Stable Diffusion's and Flux's) in plain Flax linen, held to PyTorch.

diffusers' and transformers' Flax classes are deprecated and differ numerically from the
PyTorch modules that define the reference images (docs/design.md's reproducibility
contract). These modules
keep the Flax classes' parameter trees, so today's msgpack checkpoints load unchanged, and
compute what the PyTorch modules compute:

- `unet.py`: UNet2DConditionModel (SD 1.x, 2.x, XL), with the ResNet, down/up-sampling and
  block code the VAE shares;
- `vae.py`: AutoencoderKL (encoder and decoder);
- `clip.py`: CLIPTextModel and CLIPTextModelWithProjection (and the vision tower the
  scores use);
- `t5.py`: T5EncoderModel (Flux's second text encoder);
- `flux.py`: FluxTransformer2DModel (double- and single-stream blocks);
- `attention.py`: the one place attention is computed (head layout, kernel choice);
- `layers.py`: the layers they are made of (parameters, linear, convolution and embedding
  layers, norms, feed-forward, timestep embedding).

Where diffusers' Flax classes (0.39) differ from PyTorch (0.42), these follow PyTorch:
GroupNorm groups from `norm_num_groups` (Flax's UNet hard-codes 32) and eps from
`norm_eps`; the transformer blocks' GroupNorm eps 1e-6 (Flax 1e-5); GEGLU with the exact
GELU (Flax uses the tanh approximation); timestep embeddings from float timesteps with
PyTorch's order of float32 operations; two-pass (not E[x^2] - E[x]^2) norm variances.
transformers' Flax CLIP already computes what its PyTorch CLIP does.

Each config class reads a diffusers/transformers config.json dict with `from_dict`: keys
that change nothing here are ignored, values these modules do not implement are refused
with a ValueError naming the key and the value.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, TypeVar

import flax.linen as nn
import jax

C = TypeVar("C")


@functools.lru_cache(maxsize=64)
def parameter_shapes(module: nn.Module) -> Any:
    """A network's parameter tree as shapes and dtypes (`jax.eval_shape` of its initialiser), traced
    once per architecture and dtype: seconds for a UNet, needed by every load of a model. Shared
    between callers, so read only."""
    return jax.eval_shape(module.init_params, jax.random.PRNGKey(0))


def read_config(cls: type[C], d: Mapping[str, Any], fixed: Mapping[str, Any]) -> C:
    """`cls` (a dataclass) from a config.json dict, as the libraries read it: missing keys
    take the library's defaults (the dataclass defaults), unknown keys are ignored. Keys in
    `fixed` change the computation but only their default value is implemented here."""
    for key, default in fixed.items():
        if key in d and _plain(d[key]) != _plain(default):
            raise refuse(key, d[key], f"only {default!r} is implemented")
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    return cls(**{k: _plain(v) for k, v in d.items() if k in names})


def refuse(key: str, value: Any, why: str) -> ValueError:
    """The error every config check raises: the key, its value as config.json has it, the rule."""
    return ValueError(f"{key}={_listed(value)!r}: {why}")


def _plain(value: Any) -> Any:
    """JSON lists as tuples, so configs are hashable (flax modules hash their fields)."""
    return tuple(_plain(v) for v in value) if isinstance(value, (list, tuple)) else value


def _listed(value: Any) -> Any:
    return [_listed(v) for v in value] if isinstance(value, (list, tuple)) else value
