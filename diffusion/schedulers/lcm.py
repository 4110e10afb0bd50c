"""Latent consistency sampling, as PyTorch diffusers' `LCMScheduler` (LCM-LoRA's sampler).

LCM places its own timesteps: `steps` of them, evenly by index, from the `original_inference_steps`
schedule the model was distilled on (`timestep_spacing` does not apply). Each step maps the sample
straight to a consistency estimate of x0 (the boundary-condition scalings c_skip and c_out), then,
except at the last step, noises it back to the next timestep with the step's own noise, drawn from
the job's key (diffusion/generate.py) where PyTorch draws from its generator.
"""

from __future__ import annotations

import dataclasses

import flax
import jax
import jax.numpy as jnp
import numpy as np

from diffusion.schedulers.common import F32, SchedulerConfig, const, data_prediction, noised, threshold

SIGMA_DATA = 0.5  # PyTorch's constant in the boundary-condition scalings


@flax.struct.dataclass
class LCMState:
    init_noise_sigma: jax.Array  # () float32
    timesteps: jax.Array  # (steps,) float32, integer-valued
    sqrt_alpha: jax.Array  # (steps,) alphas_cumprod[t] ** 0.5
    sqrt_beta: jax.Array  # (steps,) (1 - alphas_cumprod[t]) ** 0.5
    c_skip: jax.Array  # (steps,) the sample's weight in the estimate
    c_out: jax.Array  # (steps,) x0's weight in the estimate
    sqrt_alpha_prev: jax.Array  # (steps,) the estimate's weight at the next timestep (1 at the last step)
    sqrt_beta_prev: jax.Array  # (steps,) the noise's weight there (0 at the last step: no noise)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LCMScheduler(SchedulerConfig):
    """Options and defaults of PyTorch's `LCMScheduler` (timestep_spacing, steps_offset and
    set_alpha_to_one are among them, and unused by its sampling, as in PyTorch)."""

    beta_start: float = 0.00085
    beta_end: float = 0.012
    beta_schedule: str = "scaled_linear"
    original_inference_steps: int = 50
    clip_sample: bool = False
    clip_sample_range: float = 1.0
    set_alpha_to_one: bool = True
    thresholding: bool = False
    dynamic_thresholding_ratio: float = 0.995
    sample_max_value: float = 1.0
    timestep_spacing: str = "leading"
    timestep_scaling: float = 10.0
    rescale_betas_zero_snr: bool = False

    name = "lcm"
    diffusers_class = "LCMScheduler"
    stochastic = True

    def set_timesteps(self, steps: int, shape: tuple[int, ...]) -> LCMState:
        """LCM's timesteps for `steps` and every per-step scalar, in float32 like PyTorch."""
        del shape
        n, original = self.num_train_timesteps, self.original_inference_steps
        if original > n:
            raise ValueError(f"lcm scheduler: original_inference_steps={original} exceeds num_train_timesteps={n}")
        if steps > original:
            raise ValueError(f"lcm scheduler: {steps} steps exceed original_inference_steps={original}, "
                             "the schedule LCM takes its timesteps from")
        origin = (np.arange(1, original + 1) * (n // original) - 1)[::-1]
        timesteps = origin[np.floor(np.linspace(0, len(origin), num=steps, endpoint=False)).astype(np.int64)]
        alphas_cumprod = self.alphas_cumprod(self.rescale_betas_zero_snr)
        alpha = alphas_cumprod[timesteps]
        # Every step but the last goes on to the next timestep (always >= 0, so set_alpha_to_one
        # never applies); the last returns its estimate: weights 1 and 0 make the update exactly that.
        alpha_prev = np.append(alphas_cumprod[timesteps[1:]], F32(1))
        scaled = timesteps.astype(F32) * F32(self.timestep_scaling)
        sigma_data2 = F32(SIGMA_DATA**2)
        return LCMState(
            init_noise_sigma=const(1.0),
            timesteps=const(timesteps),
            sqrt_alpha=const(np.sqrt(alpha)),
            sqrt_beta=const(np.sqrt(F32(1) - alpha)),
            c_skip=const(sigma_data2 / (scaled * scaled + sigma_data2)),
            c_out=const(scaled / np.sqrt(scaled * scaled + sigma_data2)),
            sqrt_alpha_prev=const(np.sqrt(alpha_prev)),
            sqrt_beta_prev=const(np.sqrt(F32(1) - alpha_prev)),
        )

    def add_noise(self, state: LCMState, original: jax.Array, noise: jax.Array, start: jax.Array) -> jax.Array:
        """sqrt(alpha_t) x + sqrt(1 - alpha_t) noise at each job's first timestep."""
        return noised(original, noise, start, state.sqrt_beta, state.sqrt_alpha)

    def scale_model_input(self, state: LCMState, sample: jax.Array, i: jax.Array) -> jax.Array:
        """LCM does not scale the model input."""
        return sample

    def step(self, state: LCMState, model_output: jax.Array, i: jax.Array, sample: jax.Array,
             noise: jax.Array) -> tuple[jax.Array, LCMState]:
        """The consistency estimate, then (but at the last step) back to the next timestep."""
        x = sample.astype(jnp.float32)
        x0 = data_prediction(self.prediction_type, x, model_output.astype(jnp.float32), state.sqrt_alpha[i],
                             state.sqrt_beta[i])
        if self.thresholding:
            x0 = threshold(x0, self.dynamic_thresholding_ratio, self.sample_max_value)
        elif self.clip_sample:
            x0 = jnp.clip(x0, -self.clip_sample_range, self.clip_sample_range)
        estimate = state.c_out[i] * x0 + state.c_skip[i] * x
        prev = state.sqrt_alpha_prev[i] * estimate + state.sqrt_beta_prev[i] * noise
        return prev.astype(sample.dtype), state
