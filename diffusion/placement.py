"""Where a model runs: the one decision of which devices hold which part of its weights, and
the programs that render a batch there (the text encoders', then the shape's). The loader
(diffusion/models.py) places the weights with it, the engine (worker/engine.py) compiles and
runs the programs with it, and a plan for a machine that is not here compiles the same
programs for a target's devices (a TPU topology's, from `jax.experimental.topologies`) with
shapes in place of weights.

The devices form a (data, model) mesh. With `model_parallel` 1 each device holds a whole
copy of the weights and runs the per-device program on its slice of the batch (`shard_map`,
as pmap would). Above 1, `model_parallel` devices share each copy, split as the family states
(diffusion/sharding.py: Megatron's tensor parallelism), and one `jax.jit` over the mesh runs
the batch over the data axis while XLA partitions each transformer block over the model axis;
attention constrains its heads to the model axis and runs custom kernels (splash, cuDNN)
inside a `shard_map` of their own (diffusion/nn/attention.py). Attention's kernel is chosen
for the devices' backend, not the process's (`for_backend`), so a TPU program traced on a CPU
machine takes splash as it would on the TPU.

The text encoders are not split by the model axis: whole on each device, or, where that does
not fit beside the rest (`text_split`: diffusion.sharding.split_text_encoders), spread over
every device, their program then one `jax.jit` over the mesh that gathers them as it needs them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from diffusion.errors import ModelError
from diffusion.family import Family, Networks
from diffusion.generate import Static
from diffusion.nn.attention import for_backend, recording
from diffusion.schedulers import Scheduler
from diffusion.sharding import DATA, MODEL, interleaved, spread, weight_specs

BATCH, WHOLE = PartitionSpec(DATA), PartitionSpec()


@dataclasses.dataclass(frozen=True)
class Placement:
    """A (data, model) mesh over some devices (this host's, or a target topology's)."""

    mesh: Mesh
    # the text encoders' weights spread over every device (diffusion.sharding.spread), not
    # whole on each: their program then runs over the mesh, gathering them where it needs them
    text_split: bool = False

    @property
    def model_parallel(self) -> int:
        """Devices that share one copy of the weights."""
        return int(self.mesh.shape[MODEL])

    @property
    def data_parallel(self) -> int:
        """Copies of the weights: each renders its own slice of a batch."""
        return int(self.mesh.shape[DATA])

    @property
    def devices(self) -> list[jax.Device]:
        return list(self.mesh.devices.flat)

    @property
    def backend(self) -> str:
        """The devices' backend as attention names it ("cpu", "tpu", "cuda", "rocm")."""
        device = self.devices[0]
        if device.platform != "gpu":
            return device.platform
        client = getattr(device, "client", None)
        return "rocm" if client is not None and "rocm" in client.platform_version else "cuda"

    @property
    def batch(self) -> NamedSharding:
        """A batch's inputs and outputs: their leading axis over the data axis."""
        return NamedSharding(self.mesh, BATCH)

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, WHOLE)

    def batch_size(self, per_device_batch: int) -> int:
        """Jobs in one batch: `per_device_batch` per copy of the weights."""
        return self.data_parallel * per_device_batch

    def weight_shardings(self, family: Family, params: Any) -> Any:
        """A NamedSharding per weight of `params` ({component: tree}, arrays or shapes)."""
        specs = weight_specs(dict(family.tensor_parallel), params, self.model_parallel)
        if self.text_split:
            specs = {name: spread(params[name], len(self.devices)) if name in family.text_encoders else tree
                     for name, tree in specs.items()}
        return jax.tree.map(lambda spec: NamedSharding(self.mesh, spec), specs,
                            is_leaf=lambda x: isinstance(x, PartitionSpec))

    def place(self, family: Family, params: Any) -> Any:
        """`params` (host arrays, in the checkpoint's layout) on the devices, each weight as
        `weight_shardings` says: a split weight goes shard by shard, so no device holds it
        whole, a packed one interleaved first (diffusion.sharding.interleave)."""
        rules = dict(family.tensor_parallel)
        return jax.device_put(interleaved(rules, params, self.model_parallel), self.weight_shardings(family, params))

    def abstract(self, family: Family, params: Any) -> Any:
        """`params` (arrays or shapes) as shapes placed as `place` would place them: what a
        program is compiled for where there are no weights (a target's devices)."""
        return jax.tree.map(lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
                            params, self.weight_shardings(family, params))


def make_placement(devices: Sequence[jax.Device], model_parallel: int, text_split: bool = False) -> Placement:
    """The mesh of `devices` with `model_parallel` devices per copy of the weights (and, with
    `text_split`, the text encoders' spread over them all)."""
    if model_parallel < 1 or len(devices) % model_parallel:
        raise ModelError("model_parallel", model_parallel, f"must divide the {len(devices)} devices")
    grid = np.array(list(devices), dtype=object).reshape(len(devices) // model_parallel, model_parallel)
    return Placement(Mesh(grid, (DATA, MODEL)), text_split)


def by_program(family: Family, params: Any) -> tuple[Any, Any]:
    """`params` ({component: tree}) as the two programs take them: the text encoders' (the
    encode program's), and the other components' (the generate program's)."""
    text = set(family.text_encoders)
    return ({name: tree for name, tree in params.items() if name in text},
            {name: tree for name, tree in params.items() if name not in text})


def lower_encode(family: Family, networks: Networks, guided: bool, placement: Placement, params: Any,
                 inputs: Any) -> jax.stages.Lowered:
    """The family's text encoders on a batch, lowered for the placement's devices: `params` the
    text encoders' weights (`by_program`), placed or their `abstract` shapes, `inputs` the batch's
    text inputs (generate.text_inputs). One program for every shape of a guidance kind."""
    return _lower(partial(_encode, family, networks, guided), placement, params, inputs,
                  per_device=not placement.text_split)


def encoded_shapes(family: Family, networks: Networks, guided: bool, placement: Placement, params: Any,
                   inputs: Any) -> Any:
    """What `lower_encode`'s program returns, as shapes sharded as `placement.batch`: the
    generate program's last argument where none is encoded yet."""
    with recording():  # traced for shapes only: its attentions are the encode program's, not the caller's
        shapes = jax.eval_shape(partial(_encode, family, networks, guided), params, inputs)
    return jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=placement.batch), shapes)


def lower_generate(family: Family, networks: Networks, scheduler: Scheduler, static: Static,
                   placement: Placement, params: Any, inputs: Any, encoded: Any) -> jax.stages.Lowered:
    """The family's generate program for one shape, lowered for the placement's devices:
    `params` the other components' weights (`by_program`), placed or their `abstract` shapes,
    `inputs` the batch's shapes and `encoded` the encode program's outputs or their shapes
    (`encoded_shapes`). Compile it with `.compile()`."""
    return _lower(partial(family.generate, networks, scheduler, static), placement, params, inputs, encoded,
                  per_device=True)


def _encode(family: Family, networks: Networks, guided: bool, params: Any, inputs: Any) -> Any:
    return family.encode(networks, params, inputs, guided)


def _lower(fn: Any, placement: Placement, params: Any, *batch: Any, per_device: bool) -> jax.stages.Lowered:
    """`fn(params, *batch)` jitted for the placement: the batch's arguments and the outputs
    over the data axis; a per-device program where `per_device` and the placement has whole
    copies of the weights, else one partitioned over the mesh."""
    if per_device and placement.model_parallel == 1:
        # Each device runs the per-device program on its slice of the batch, as pmap would;
        # check_vma=False because the scheduler's state starts out unvarying.
        fn = jax.shard_map(fn, mesh=placement.mesh, in_specs=(WHOLE, *[BATCH] * len(batch)), out_specs=BATCH,
                           check_vma=False)
    with for_backend(placement.backend), jax.set_mesh(placement.mesh):
        return jax.jit(fn, out_shardings=placement.batch).lower(params, *batch)
