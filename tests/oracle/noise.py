"""The contract's per-step noise inside diffusers' PyTorch schedulers.

diffusers' stochastic schedulers (EulerAncestralDiscreteScheduler, LCMScheduler) draw each step's
noise with `randn_tensor(shape, generator=..., ...)`, imported into their own modules. The farm
draws step i of a job from `fold_in(PRNGKey(seed), i)` instead. `contract_noise` replaces the
`randn_tensor` those modules call, for one scheduler object, with a function of the scheduler's
`step_index` at the moment of the draw (the step being taken; it advances after the draw), so the
PyTorch reference adds exactly the noise the farm adds, and nothing else in diffusers changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from diffusers.schedulers import scheduling_euler_ancestral_discrete, scheduling_lcm

MODULES = (scheduling_euler_ancestral_discrete, scheduling_lcm)


@contextlib.contextmanager
def contract_noise(scheduler: Any, noise: Callable[[int, tuple[int, ...]], torch.Tensor]) -> Iterator[None]:
    """While open, `scheduler`'s draws are `noise(step_index, shape)` (cast to the dtype asked)."""
    originals = [module.randn_tensor for module in MODULES]

    def draw(shape: Any, generator: Any = None, device: Any = None, dtype: Any = None, **_: Any) -> torch.Tensor:
        return noise(scheduler.step_index, tuple(shape)).to(dtype=dtype)

    for module in MODULES:
        module.randn_tensor = draw
    try:
        yield
    finally:
        for module, original in zip(MODULES, originals):
            module.randn_tensor = original


def seeded_noise(scheduler: Any, seed: int) -> contextlib.AbstractContextManager[None]:
    """`contract_noise` by the contract's rule for the job of `seed`: the step being taken, i,
    draws normal(fold_in(PRNGKey(seed), i)) (diffusion/generate.py's `step_noise`)."""
    key = jax.random.PRNGKey(seed)

    def draw(step: int, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.from_numpy(np.array(jax.random.normal(jax.random.fold_in(key, step), shape, jnp.float32)))

    return contract_noise(scheduler, draw)
