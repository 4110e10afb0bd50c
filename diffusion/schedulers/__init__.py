"""Diffusion schedulers that run inside `jax.jit` and `jax.lax.fori_loop`, numerically equal to
PyTorch diffusers' (0.42.1), the reference our images are held to.

diffusers' Flax schedulers are not that reference and do not all trace: Flax LMS cannot run under
jit at all, and Flax Euler picks every step's sigma by comparing float timesteps with integer ones.
Each module here ports one PyTorch class. Everything that depends only on the config and the step
count (timesteps, sigmas, per-step coefficients, which multistep order each step uses) is computed
on the host by `set_timesteps` and becomes constants; the state carries fixed-size history buffers,
and `scale_model_input` and `step` take the traced loop index, so one compiled loop runs them all.

One is for flow-matching models (flow_euler: Flux), whose sample moves along the predicted
velocity; the others are for the DDPM training schedule of the UNet models.

Two are stochastic (euler_a, lcm): each step adds fresh noise. PyTorch draws it from the pipeline's
generator, one stream for the whole batch; here each job's step i draws
`normal(fold_in(PRNGKey(seed), i))` (diffusion/generate.py), so a job's pixels stay its own in any
batch, position or device count.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import jax

from diffusion.choices import KARRAS_SCHEDULERS, check_sampler
from diffusion.schedulers.ddim import DDIMScheduler, DDIMState
from diffusion.schedulers.dpm import DPMScheduler, DPMState
from diffusion.schedulers.euler import EulerScheduler, EulerState
from diffusion.schedulers.euler_a import EulerAncestralScheduler, EulerAncestralState
from diffusion.schedulers.flow_euler import FlowMatchEulerScheduler, FlowState
from diffusion.schedulers.lcm import LCMScheduler, LCMState
from diffusion.schedulers.lms import LMSScheduler, LMSState
from diffusion.schedulers.pndm import PNDMScheduler, PNDMState

__all__ = [
    "CLASS_NAMES",
    "SCHEDULER_CLASSES",
    "DDIMScheduler",
    "DDIMState",
    "DPMScheduler",
    "DPMState",
    "EulerAncestralScheduler",
    "EulerAncestralState",
    "EulerScheduler",
    "EulerState",
    "FlowMatchEulerScheduler",
    "FlowState",
    "LCMScheduler",
    "LCMState",
    "LMSScheduler",
    "LMSState",
    "PNDMScheduler",
    "PNDMState",
    "Scheduler",
    "make",
]

# The model layer's scheduler names (diffusion.choices.SCHEDULERS, in its order), each the port of a
# PyTorch class.
SCHEDULER_CLASSES = {cls.name: cls for cls in (PNDMScheduler, DDIMScheduler, LMSScheduler, EulerScheduler, DPMScheduler,
                                         EulerAncestralScheduler, LCMScheduler, FlowMatchEulerScheduler)}
# Scheduler classes model folders name (PyTorch's and diffusers' Flax twins) -> their names.
CLASS_NAMES = {prefix + cls.diffusers_class: cls.name for cls in SCHEDULER_CLASSES.values() for prefix in ("", "Flax")}


class Scheduler(Protocol):
    """What the generate loop uses. States are flax struct dataclasses of float32/int32 arrays
    with at least `timesteps` ((M,) float32, what the UNet is fed at loop index i; M is the
    number of model evaluations) and `init_noise_sigma` (() float32, what the latents are
    multiplied by after set_timesteps). A scheduler with `stochastic` True takes a fifth
    argument in `step`: that step's standard-normal noise, shaped like the sample. One with
    `history` (a multistep one) takes `begin` in `step`: each job's first loop index ((B,)
    int32; image jobs), before which the job has no history."""

    stochastic: bool
    history: bool

    def set_timesteps(self, steps: int, shape: tuple[int, ...]) -> Any:
        """The state for `steps` (static) on samples of `shape` (static); host side."""

    def scale_model_input(self, state: Any, sample: jax.Array, i: jax.Array) -> jax.Array:
        """The UNet's input at loop index `i` (traced int32)."""

    def add_noise(self, state: Any, original: jax.Array, noise: jax.Array, start: jax.Array) -> jax.Array:
        """Image jobs (the UNet families' schedulers): `original` noised to the level of each
        job's loop index `start` ((B,)), as PyTorch's `add_noise` at the pipeline's first timestep."""

    def step(self, state: Any, model_output: jax.Array, i: jax.Array,
             sample: jax.Array) -> tuple[jax.Array, Any]:
        """The sample after model evaluation `i`, in the sample's dtype, and the new state."""


def make(name: str, config: Mapping[str, Any], timestep_spacing: str | None = None,
         karras: bool | None = None) -> Scheduler:
    """Scheduler `name` from a model's scheduler config, with diffusers' `from_config`
    semantics, and the job's sampler fields (None: the config's) set over it; unsupported
    options raise ValueError naming option and value."""
    if name not in SCHEDULER_CLASSES:
        raise ValueError(f"unknown scheduler {name!r} (known: {', '.join(SCHEDULER_CLASSES)})")
    check_sampler(name, timestep_spacing, karras)
    overrides: dict[str, Any] = {}
    if timestep_spacing is not None:
        overrides["timestep_spacing"] = timestep_spacing
    if karras is not None and name in KARRAS_SCHEDULERS:
        overrides["use_karras_sigmas"] = karras
    return SCHEDULER_CLASSES[name].from_config(config, **overrides)
