"""Reference checks that compile each network once, not one program per scheduler.

The engine fuses a family's `generate` (the denoising loop and the VAE) into one program per
shape key, so each (model, scheduler, size, guidance) a reference set covers costs a full
compile: about 8 s each for the tiny models, most of the suite's time. Here the same `encode`
and `generate` run with JAX's jit disabled, so the loop is a Python loop and the schedulers'
arithmetic runs op by op (cheap, and shared by every scheduler), while each network a pipeline
calls (`apply` on a text encoder, the denoiser, the VAE's encode and decode) is intercepted and
runs as a program of its own, compiled once per model and input shapes. Every scheduler of a
model then reuses the same compiled denoiser.

What this leaves out is the fused program itself; tests/test_engine.py and the render commands'
tests (tests/test_promises.py's per-device batch 2 among them) hold that to the same references
end to end.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from diffusion.generate import Static, text_inputs
from diffusion.placement import by_program
from renderfarm.jobs import JobSpec
from worker.engine import Engine, ShapeKey

NETWORK_METHODS = ("__call__", "encode", "decode")  # what a pipeline calls on a network


def render_stepwise(engine: Engine, specs: Sequence[JobSpec]) -> list[tuple[ShapeKey, np.ndarray]]:
    """Each job's shape key and image, in job order, batched as the engine batches them (the same
    padded inputs), on one device."""
    model = engine.model
    params = jax.device_put(model.params, jax.devices()[0])  # on all eight, each call would run on all eight
    rendered: dict[int, tuple[ShapeKey, np.ndarray]] = {}
    for key, idx in engine.plan(specs):
        inputs, _ = engine.inputs(key, [specs[i] for i in idx])
        inputs = jax.device_put(inputs, jax.devices()[0])
        static = Static(key.height, key.width, key.steps, key.guided, key.image, key.mask)
        text, weights = by_program(model.family, params)
        with jax.disable_jit(), nn.intercept_methods(_each_network_compiled):
            encoded = model.family.encode(model.networks, text, text_inputs(inputs), key.guided)
            output = model.family.generate(model.networks, engine.scheduler(key), static, weights, inputs, encoded)
        images = np.asarray(output.images)
        rendered.update((i, (key, images[n])) for n, i in enumerate(idx))
    return [rendered[i] for i in range(len(specs))]


_calling = [False]  # inside a network's own program: its submodules are traced as usual


def _each_network_compiled(call: Any, args: tuple, kwargs: dict, context: Any) -> Any:
    """flax's method interceptor: a top-level network's call runs as its own compiled program."""
    module = context.module
    if _calling[0] or context.method_name not in NETWORK_METHODS or module.scope is None or module.scope.parent is not None:
        return call(*args, **kwargs)
    unbound, variables = module.unbind()
    leaves, tree = jax.tree.flatten((args, kwargs))
    arrays = tuple(i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array))
    constants = tuple((i, _Constant(leaf) if isinstance(leaf, np.ndarray) else leaf)
                      for i, leaf in enumerate(leaves) if i not in arrays)
    _calling[0] = True
    try:
        with jax.disable_jit(False):
            return _program(unbound, context.method_name, tree, arrays, constants)(variables, [leaves[i] for i in arrays])
    finally:
        _calling[0] = False


@functools.cache
def _program(module: nn.Module, method: str, tree: Any, arrays: tuple[int, ...],
             constants: tuple[tuple[int, Any], ...]) -> Any:
    """One network call, jitted: compiled once per module, method, argument structure and shapes."""

    def run(variables: Any, values: list[Any]) -> Any:
        leaves = dict(zip(arrays, values)) | {i: getattr(c, "array", c) for i, c in constants}
        args, kwargs = jax.tree.unflatten(tree, [leaves[i] for i in range(len(leaves))])
        return module.apply(variables, *args, method=method, **kwargs)

    return jax.jit(run)


class _Constant:
    """A host array a network takes as a constant (Flux's position ids), hashable by its bytes."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self._key = (array.shape, array.dtype.str, array.tobytes())

    def __hash__(self) -> int:
        return hash(self._key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Constant) and self._key == other._key
