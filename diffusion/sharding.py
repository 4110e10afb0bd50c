"""How a model's weights split over the `model` axis of a (data, model) device mesh: tensor
parallelism as Megatron-LM splits a transformer. A family names, per network, the linears
split by output columns (q, k, v, an MLP's first layer, the modulation linears: the kernel's
last axis and the bias over `model`) and those split by input rows (the attention output and
an MLP's second layer: the kernel's first input axis; the bias whole, added once after the
partial sums are reduced). Every other weight (norms, embeddings, convolutions, the VAE,
the text encoders) stays whole on each device, but for the text encoders of a model too large
for that, which are spread over every device instead (`split_text_encoders`, `spread`). So a
transformer block needs one all-reduce after its attention and one after its MLP, and no
weight moves while the denoiser runs.

While a split network is traced (`tensor_parallel`), its activations are constrained as
Megatron keeps them (`constrain`): each block's input and output whole on every device of the
model axis, attention's heads over it (diffusion/nn/attention.py), the batch over `data`.

Which devices and which program use these specs is diffusion/placement.py's.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import re
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

DATA, MODEL = "data", "model"
_split: contextvars.ContextVar[bool] = contextvars.ContextVar("tensor_parallel", default=False)
# Of the memory JAX may use on a device (its `bytes_limit`, on a GPU already 75% of the GPU's; on
# a TPU less the runtime's 10%: diffusion.targets.usable_share), the share weights may take; the
# rest is the programs' working memory.
WEIGHTS_SHARE = 0.75


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """A network's Megatron split: regular expressions over its layers' paths (the parameter's
    path without its leaf, '/'-joined: `transformer_blocks_0/attn/to_q`), matched whole.

    A packed layer holds chunks side by side along its split axis (a GEGLU's hidden and gate
    columns; Flux's single-block `proj_out` rows, attention's then the MLP's): placed split,
    its chunks are interleaved (`interleave`) so that each device holds its slice of every
    chunk, and the network splits or joins those activations in the same order
    (`split_packed`, `concat_packed`); diffusers calls this PackedRowwiseParallel. A network
    with a packed layer must name it here, or its split activations and weights disagree."""

    columns: tuple[str, ...] = ()  # split by output columns
    rows: tuple[str, ...] = ()  # split by input rows
    packed: tuple[tuple[str, tuple[int, ...]], ...] = ()  # (layer, its chunks' proportions along the split axis)

    def split(self, path: Sequence[str], shape: Sequence[int], model_parallel: int,
              ) -> tuple[int, tuple[int, ...]] | None:
        """The weight at `path` (layer path then leaf, `kernel` or `bias`) of `shape`: its split
        axis and the sizes of the chunks packed along it (one chunk unless packed); None where
        it stays whole (no rule names it, or `model_parallel` does not divide every chunk)."""
        layer, leaf = "/".join(path[:-1]), path[-1]
        if model_parallel == 1 or not shape:
            return None
        if any(re.fullmatch(pattern, layer) for pattern in self.columns):
            axis = len(shape) - 1  # a kernel's output axis, a bias's only one
        elif leaf == "kernel" and any(re.fullmatch(pattern, layer) for pattern in self.rows):
            axis = len(shape) - 2  # the input axis of a dense (in, out) or conv (..., in, out) kernel
        else:
            return None
        proportions = next((parts for pattern, parts in self.packed if re.fullmatch(pattern, layer)), (1,))
        unit, left = divmod(shape[axis], sum(proportions))
        sizes = tuple(part * unit for part in proportions)
        return None if left or any(size % model_parallel for size in sizes) else (axis, sizes)

    def spec(self, path: Sequence[str], shape: Sequence[int], model_parallel: int) -> PartitionSpec:
        """The weight's PartitionSpec: its split axis over `model` (`split`), else whole."""
        split = self.split(path, shape, model_parallel)
        return PartitionSpec() if split is None else PartitionSpec(
            *[MODEL if a == split[0] else None for a in range(len(shape))])


def interleave(x: np.ndarray, axis: int, sizes: Sequence[int], shards: int) -> np.ndarray:
    """A packed weight (chunks of `sizes` side by side along `axis`) reordered so that each of
    `shards` equal contiguous parts holds its slice of every chunk, in chunk order."""
    chunks = np.split(np.asarray(x), np.cumsum(sizes)[:-1], axis)
    slices = [np.split(chunk, shards, axis) for chunk in chunks]
    return np.concatenate([part[shard] for shard in range(shards) for part in slices], axis)


def _rules_of(rules: dict[str, TensorParallel], path: tuple[Any, ...]) -> tuple[TensorParallel | None, list[str]]:
    """The rules of a parameter's component ({component: tree} key path) and its path inside it."""
    names = [str(getattr(key, "key", getattr(key, "idx", key))) for key in path]
    return rules.get(names[0]), names[1:]


def weight_specs(rules: dict[str, TensorParallel], params: Any, model_parallel: int) -> Any:
    """A PartitionSpec per weight of `params` ({component: tree}, arrays or shapes); components
    without rules stay whole."""
    def spec(path: tuple[Any, ...], leaf: Any) -> PartitionSpec:
        component, names = _rules_of(rules, path)
        return PartitionSpec() if component is None else component.spec(names, leaf.shape, model_parallel)

    return jax.tree_util.tree_map_with_path(spec, params)


def interleaved(rules: dict[str, TensorParallel], params: Any, model_parallel: int) -> Any:
    """`params` ({component: tree} of host arrays) with every packed weight that splits
    `interleave`d for `model_parallel` devices (the layout `split_packed` reads)."""
    def layout(path: tuple[Any, ...], leaf: Any) -> Any:
        component, names = _rules_of(rules, path)
        split = None if component is None else component.split(names, leaf.shape, model_parallel)
        return leaf if split is None or len(split[1]) == 1 else interleave(leaf, split[0], split[1], model_parallel)

    return jax.tree_util.tree_map_with_path(layout, params)


@contextlib.contextmanager
def tensor_parallel() -> Iterator[None]:
    """Trace the block as a network whose weights its family splits (the denoiser): attention
    puts its heads over the model axis."""
    token = _split.set(True)
    try:
        yield
    finally:
        _split.reset(token)


def heads_axis() -> str | None:
    """The mesh axis attention's heads go over: `model` inside `tensor_parallel`, else none."""
    return MODEL if _split.get() else None


def _packed_shards(sizes: Sequence[int]) -> int:
    """How many parts a packed layer's chunks are interleaved in while this is traced: the
    model axis's size inside `tensor_parallel` in a partitioned program where it divides every
    chunk (as `TensorParallel.split` decides for the weights), else 1."""
    mesh = jax.sharding.get_abstract_mesh()
    if not _split.get() or mesh.empty or MODEL not in mesh.auto_axes:
        return 1
    shards = mesh.shape[MODEL]
    return 1 if any(size % shards for size in sizes) else shards


def split_packed(x: jax.Array, sizes: Sequence[int]) -> list[jax.Array]:
    """The chunks of `sizes` packed along x's last axis (a packed layer's output), each as
    (..., size), whatever their interleaving (`interleave`)."""
    shards = _packed_shards(sizes)
    parts = x.reshape(*x.shape[:-1], shards, x.shape[-1] // shards)
    cuts = np.cumsum([size // shards for size in sizes])[:-1]
    return [part.reshape(*x.shape[:-1], size) for part, size in zip(jnp.split(parts, cuts, axis=-1), sizes)]


def concat_packed(chunks: Sequence[jax.Array]) -> jax.Array:
    """`chunks` joined along their last axis in a packed layer's input order (`interleave`)."""
    sizes = [chunk.shape[-1] for chunk in chunks]
    shards = _packed_shards(sizes)
    lead = chunks[0].shape[:-1]
    parts = [chunk.reshape(*lead, shards, size // shards) for chunk, size in zip(chunks, sizes)]
    return jnp.concatenate(parts, axis=-1).reshape(*lead, sum(sizes))


def partition(shape: Sequence[int], axes: Sequence[str | None]) -> PartitionSpec | None:
    """The spec putting each axis of `shape` over the mesh axis named for it (None: whole),
    in a program partitioned over a mesh (diffusion/placement.py); an axis the mesh's does not
    divide stays whole. None outside such a program (a per-device program under shard_map, or
    no mesh), where nothing is constrained."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not mesh.auto_axes:
        return None
    return PartitionSpec(*[name if name in mesh.auto_axes and size % mesh.shape[name] == 0 else None
                           for name, size in zip(axes, shape, strict=False)])


def constrain(x: jax.Array, *axes: str | None) -> jax.Array:
    """`x` with its leading axes over the named mesh axes and the rest whole (`partition`);
    `x` as it is outside a partitioned program."""
    spec = partition(x.shape, axes)
    return x if spec is None else jax.lax.with_sharding_constraint(x, spec)


def choose_model_parallel(weight_bytes: int, device_bytes: int | None, devices: int, text_bytes: int = 0) -> int:
    """The fewest devices per copy of the weights such that each holds at most WEIGHTS_SHARE
    of `device_bytes`, the memory JAX may use there, in weights (1 where the backend reports
    no memory limit, as XLA's CPU one). Of `weight_bytes`, the text encoders' `text_bytes`
    are not split by the model axis: whole on each device, or, where that does not fit,
    spread over every device (`split_text_encoders`)."""
    if not device_bytes:
        return 1
    for n in (n for n in range(1, devices + 1) if devices % n == 0):
        if weights_per_device(weight_bytes, text_bytes, n, devices, text_split=True) <= WEIGHTS_SHARE * device_bytes:
            return n
    raise ValueError(f"{weight_bytes / 1e9:.1f} GB of weights do not fit {devices} devices of "
                     f"{device_bytes / 1e9:.1f} GB (at most {WEIGHTS_SHARE:.0%} of each for weights)")


def split_text_encoders(weight_bytes: int, text_bytes: int, device_bytes: int | None, model_parallel: int,
                        devices: int) -> bool:
    """Whether the text encoders' weights go spread over all `devices` (each holds a slice of
    each, gathered while their program runs once a batch) rather than whole on each: where
    whole they would take a device past WEIGHTS_SHARE of `device_bytes` at `model_parallel`
    and spread they take less."""
    if not device_bytes or not text_bytes or devices == 1:
        return False
    return weights_per_device(weight_bytes, text_bytes, model_parallel, devices) > WEIGHTS_SHARE * device_bytes


def weights_per_device(weight_bytes: int, text_bytes: int, model_parallel: int, devices: int,
                       text_split: bool = False) -> float:
    """A device's share of the weights: the rest split `model_parallel` ways, the text encoders
    whole (or, `text_split`, spread over every device)."""
    text = text_bytes / devices if text_split else text_bytes
    return (weight_bytes - text_bytes) / model_parallel + text


def spread(params: Any, devices: int) -> Any:
    """A PartitionSpec per weight of `params` (a tree of arrays or shapes) spreading it over
    every device of the mesh (both axes): its largest axis that `devices` divides, else whole.
    For weights only read once a batch (the text encoders'), gathered where their program
    needs them."""
    def spec(leaf: Any) -> PartitionSpec:
        shape = tuple(leaf.shape)
        axis = max((a for a in range(len(shape)) if shape[a] % devices == 0), key=lambda a: shape[a], default=None)
        return PartitionSpec(*[(DATA, MODEL) if a == axis else None for a in range(len(shape))])

    return jax.tree.map(spec, params)
