"""DDIM with eta = 0 (what the pipelines use), as PyTorch diffusers' `DDIMScheduler`.

Each step needs four alpha-derived scalars, which depend only on the config and the step count:
`set_timesteps` computes them in float32 like PyTorch, and `step` is one fused update. As in
PyTorch, the previous timestep is always `t - num_train_timesteps // steps`, even with linspace
spacing where that is not the next timestep of the schedule.
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
    check_timesteps,
    const,
    noised,
    threshold,
)


@flax.struct.dataclass
class DDIMState:
    init_noise_sigma: jax.Array  # () float32
    timesteps: jax.Array  # (steps,) float32, integer-valued
    sqrt_alpha: jax.Array  # (steps,) alphas_cumprod[t] ** 0.5
    sqrt_beta: jax.Array  # (steps,) (1 - alphas_cumprod[t]) ** 0.5
    sqrt_alpha_prev: jax.Array  # (steps,) alphas_cumprod[t_prev] ** 0.5
    direction: jax.Array  # (steps,) (1 - alphas_cumprod[t_prev]) ** 0.5, the weight of epsilon


@dataclasses.dataclass(frozen=True, kw_only=True)
class DDIMScheduler(SchedulerConfig):
    """Options and defaults of PyTorch's `DDIMScheduler`."""

    clip_sample: bool = True
    set_alpha_to_one: bool = True
    thresholding: bool = False
    dynamic_thresholding_ratio: float = 0.995
    clip_sample_range: float = 1.0
    sample_max_value: float = 1.0
    timestep_spacing: str = "leading"
    rescale_betas_zero_snr: bool = False

    name = "ddim"
    diffusers_class = "DDIMScheduler"

    def set_timesteps(self, steps: int, shape: tuple[int, ...]) -> DDIMState:
        """Timesteps and per-step coefficients for `steps`; DDIM keeps no history, so no buffers."""
        del shape
        n = self.num_train_timesteps
        if steps > n:
            raise ValueError(f"ddim scheduler: {steps} steps exceed num_train_timesteps={n}")
        timesteps = self.spaced_timesteps(steps).round().astype(np.int64)
        check_timesteps(timesteps, n)
        prev = timesteps - n // steps
        alphas_cumprod = self.alphas_cumprod(self.rescale_betas_zero_snr)
        final = F32(1) if self.set_alpha_to_one else alphas_cumprod[0]
        alpha = alphas_cumprod[timesteps]
        alpha_prev = np.where(prev >= 0, alphas_cumprod[np.maximum(prev, 0)], final)
        return DDIMState(
            init_noise_sigma=const(1.0),
            timesteps=const(timesteps),
            sqrt_alpha=const(np.sqrt(alpha)),
            sqrt_beta=const(np.sqrt(F32(1) - alpha)),
            sqrt_alpha_prev=const(np.sqrt(alpha_prev)),
            direction=const(np.sqrt(F32(1) - alpha_prev)),
        )

    def add_noise(self, state: DDIMState, original: jax.Array, noise: jax.Array, start: jax.Array) -> jax.Array:
        """sqrt(alpha_t) x + sqrt(1 - alpha_t) noise at each job's first timestep."""
        return noised(original, noise, start, state.sqrt_beta, state.sqrt_alpha)

    def scale_model_input(self, state: DDIMState, sample: jax.Array, i: jax.Array) -> jax.Array:
        """DDIM does not scale the model input."""
        return sample

    def step(self, state: DDIMState, model_output: jax.Array, i: jax.Array,
             sample: jax.Array) -> tuple[jax.Array, DDIMState]:
        """Formula (12) of the DDIM paper with sigma_t = 0."""
        output, x = model_output.astype(jnp.float32), sample.astype(jnp.float32)
        sqrt_alpha, sqrt_beta = state.sqrt_alpha[i], state.sqrt_beta[i]
        if self.prediction_type == "epsilon":
            x0, eps = (x - sqrt_beta * output) / sqrt_alpha, output
        elif self.prediction_type == "sample":
            x0, eps = output, (x - sqrt_alpha * output) / sqrt_beta
        else:  # v_prediction
            x0, eps = sqrt_alpha * x - sqrt_beta * output, sqrt_alpha * output + sqrt_beta * x
        if self.thresholding:
            x0 = threshold(x0, self.dynamic_thresholding_ratio, self.sample_max_value)
        elif self.clip_sample:
            x0 = jnp.clip(x0, -self.clip_sample_range, self.clip_sample_range)
        prev = state.sqrt_alpha_prev[i] * x0 + state.direction[i] * eps
        return prev.astype(sample.dtype), state
