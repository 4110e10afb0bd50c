"""Euler ancestral, as PyTorch diffusers' `EulerAncestralDiscreteScheduler` (SDXL-Turbo's sampler).

Each step goes deterministically down to sigma_down and adds fresh noise of scale sigma_up, so
that the sample reaches sigmas[i + 1]. Both scales depend only on the schedule and are computed
on the host in float32 as PyTorch computes them; the noise is the step's own draw from the job's
key (diffusion/generate.py), where PyTorch draws from its generator.
"""

from __future__ import annotations

import dataclasses

import flax
import jax
import jax.numpy as jnp
import numpy as np

from diffusion.schedulers.common import (
    F32,
    SchedulerConfig,
    check_first_timestep,
    const,
    denoised,
    init_noise_sigma,
    interp_sigmas,
    noised,
    scale_by_sigma,
    train_sigmas,
)


@flax.struct.dataclass
class EulerAncestralState:
    init_noise_sigma: jax.Array  # () float32
    timesteps: jax.Array  # (steps,) float32
    sigmas: jax.Array  # (steps + 1,) float32, the last 0
    dt: jax.Array  # (steps,) sigma_down - sigma: the deterministic part's step
    sigma_up: jax.Array  # (steps,) the scale of the step's fresh noise


@dataclasses.dataclass(frozen=True, kw_only=True)
class EulerAncestralScheduler(SchedulerConfig):
    """Options and defaults of PyTorch's `EulerAncestralDiscreteScheduler`."""

    rescale_betas_zero_snr: bool = False

    name = "euler_a"
    diffusers_class = "EulerAncestralDiscreteScheduler"
    prediction_types = ("epsilon", "v_prediction")  # PyTorch raises NotImplementedError for "sample"
    stochastic = True

    def set_timesteps(self, steps: int, shape: tuple[int, ...]) -> EulerAncestralState:
        """Timesteps, sigmas and each step's split into a deterministic and a noise part."""
        del shape
        alphas_cumprod = self.alphas_cumprod(self.rescale_betas_zero_snr)
        if self.rescale_betas_zero_snr:
            alphas_cumprod[-1] = 2**-24  # as PyTorch: keeps the first sigma finite
        timesteps = self.spaced_timesteps(steps).astype(F32)
        sigmas = np.append(interp_sigmas(timesteps, train_sigmas(alphas_cumprod)), 0.0).astype(F32)
        check_first_timestep(timesteps)
        sigma_from, sigma_to = sigmas[:-1], sigmas[1:]
        sigma_up = np.sqrt(sigma_to**2 * (sigma_from**2 - sigma_to**2) / sigma_from**2)
        sigma_down = np.sqrt(sigma_to**2 - sigma_up**2)
        return EulerAncestralState(
            init_noise_sigma=init_noise_sigma(sigmas, self.timestep_spacing),
            timesteps=const(timesteps),
            sigmas=const(sigmas),
            dt=const(sigma_down - sigma_from),
            sigma_up=const(sigma_up),
        )

    def add_noise(self, state: EulerAncestralState, original: jax.Array, noise: jax.Array,
                  start: jax.Array) -> jax.Array:
        """x + sigma noise at each job's begin index."""
        return noised(original, noise, start, state.sigmas)

    def scale_model_input(self, state: EulerAncestralState, sample: jax.Array, i: jax.Array) -> jax.Array:
        """Divide by sqrt(sigma^2 + 1)."""
        return scale_by_sigma(sample, state.sigmas[i])

    def step(self, state: EulerAncestralState, model_output: jax.Array, i: jax.Array, sample: jax.Array,
             noise: jax.Array) -> tuple[jax.Array, EulerAncestralState]:
        """An Euler step down to sigma_down, then `noise` (standard normal) times sigma_up."""
        x = sample.astype(jnp.float32)
        sigma = state.sigmas[i]
        derivative = (x - denoised(self.prediction_type, x, model_output.astype(jnp.float32), sigma)) / sigma
        prev = x + derivative * state.dt[i] + noise * state.sigma_up[i]
        return prev.astype(sample.dtype), state
