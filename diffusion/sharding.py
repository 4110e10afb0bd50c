"""How a model's weights split over the `model` axis of a (data, model) device mesh: tensor
parallelism as Megatron-LM splits a transformer. A family names, per network, the linears
split by output columns (q, k, v, an MLP's first layer, the modulation linears: the kernel's
last axis and the bias over `model`) and those split by input rows (the attention output and
an MLP's second layer: the kernel's first input axis; the bias whole, added once after the
partial sums are reduced). Every other weight (norms, embeddings, convolutions, the VAE,
the text encoders) stays whole on each device. So a transformer block needs one all-reduce
after its attention and one after its MLP, and no weight moves while the model runs.

Which devices and which program use these specs is diffusion/placement.py's.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec

DATA, MODEL = "data", "model"
WEIGHTS_SHARE = 0.5  # of a device's memory the weights may take; the rest is the programs' working memory


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """A network's Megatron split: regular expressions over its layers' paths (the parameter's
    path without its leaf, '/'-joined: `transformer_blocks_0/attn/to_q`), matched whole."""

    columns: tuple[str, ...] = ()  # split by output columns
    rows: tuple[str, ...] = ()  # split by input rows

    def spec(self, path: Sequence[str], shape: Sequence[int], model_parallel: int) -> PartitionSpec:
        """The weight at `path` (layer path then leaf, `kernel` or `bias`) of `shape`: its split
        axis over `model`, whole where the rules name no split or `model_parallel` does not
        divide that axis."""
        layer, leaf = "/".join(path[:-1]), path[-1]
        if model_parallel == 1 or not shape:
            return PartitionSpec()
        if any(re.fullmatch(pattern, layer) for pattern in self.columns):
            axis = len(shape) - 1  # a kernel's output axis, a bias's only one
        elif leaf == "kernel" and any(re.fullmatch(pattern, layer) for pattern in self.rows):
            axis = len(shape) - 2  # the input axis of a dense (in, out) or conv (..., in, out) kernel
        else:
            return PartitionSpec()
        if shape[axis] % model_parallel:
            return PartitionSpec()
        return PartitionSpec(*[MODEL if a == axis else None for a in range(len(shape))])


def weight_specs(rules: dict[str, TensorParallel], params: Any, model_parallel: int) -> Any:
    """A PartitionSpec per weight of `params` ({component: tree}, arrays or shapes); components
    without rules stay whole."""
    def spec(path: tuple[Any, ...], leaf: Any) -> PartitionSpec:
        names = [str(getattr(key, "key", getattr(key, "idx", key))) for key in path]
        component = rules.get(names[0])
        return PartitionSpec() if component is None else component.spec(names[1:], leaf.shape, model_parallel)

    return jax.tree_util.tree_map_with_path(spec, params)


def choose_model_parallel(weight_bytes: int, device_bytes: int | None, devices: int) -> int:
    """The fewest devices per copy of the weights such that each holds at most WEIGHTS_SHARE
    of its memory in weights (1 where the backend reports no memory limit, as XLA's CPU one)."""
    if not device_bytes:
        return 1
    for n in (n for n in range(1, devices + 1) if devices % n == 0):
        if weight_bytes / n <= WEIGHTS_SHARE * device_bytes:
            return n
    raise ValueError(f"{weight_bytes / 1e9:.1f} GB of weights do not fit {devices} devices of "
                     f"{device_bytes / 1e9:.1f} GB (at most {WEIGHTS_SHARE:.0%} of each for weights)")
