"""Where a model's weights live on a host's devices. By default a whole copy on each, and
batches split over them (data parallel). A model whose weights do not fit one device is
split over a `model` axis of a (data, model) mesh as well: each weight's largest axis that
divides evenly is sharded over it (fully sharded data parallel: XLA gathers a weight where a
computation needs it whole), the others replicated; batches go over the `data` axis."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

DATA, MODEL = "data", "model"
WEIGHTS_SHARE = 0.5  # of a device's memory the weights may take; the rest is the programs' working memory


def make_mesh(devices: Sequence[jax.Device], model_parallel: int) -> Mesh:
    """The (data, model) mesh: `model_parallel` devices share each copy of the weights."""
    if model_parallel < 1 or len(devices) % model_parallel:
        raise ValueError(f"model_parallel={model_parallel}: must divide the {len(devices)} devices")
    return Mesh(np.array(devices).reshape(len(devices) // model_parallel, model_parallel), (DATA, MODEL))


def weight_spec(shape: Sequence[int], model_parallel: int) -> PartitionSpec:
    """The largest axis that `model_parallel` divides goes over the model axis (the first of
    equals); a weight with none (biases of odd sizes, scalars) is replicated."""
    if model_parallel == 1:
        return PartitionSpec()
    axes = [axis for axis, size in enumerate(shape) if size % model_parallel == 0]
    if not axes:
        return PartitionSpec()
    axis = max(axes, key=lambda a: (shape[a], -a))
    return PartitionSpec(*[MODEL if a == axis else None for a in range(len(shape))])


def weight_shardings(params: Any, mesh: Mesh) -> Any:
    """A NamedSharding per parameter of `params` (arrays or shapes) on `mesh`."""
    model_parallel = mesh.shape[MODEL]
    return jax.tree.map(lambda leaf: NamedSharding(mesh, weight_spec(np.shape(leaf), model_parallel)), params)


def choose_model_parallel(weight_bytes: int, device_bytes: int | None, devices: int) -> int:
    """The fewest devices per copy of the weights such that each holds at most WEIGHTS_SHARE of
    its memory in weights (1 where the backend reports no memory limit, as XLA's CPU one)."""
    if not device_bytes:
        return 1
    for n in (n for n in range(1, devices + 1) if devices % n == 0):
        if weight_bytes / n <= WEIGHTS_SHARE * device_bytes:
            return n
    raise ValueError(f"{weight_bytes / 1e9:.1f} GB of weights do not fit {devices} devices of "
                     f"{device_bytes / 1e9:.1f} GB (at most {WEIGHTS_SHARE:.0%} of each for weights)")
