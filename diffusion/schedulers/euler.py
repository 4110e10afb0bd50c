"""Euler, as PyTorch diffusers' `EulerDiscreteScheduler` (deterministic: s_churn = 0).

diffusers' `FlaxEulerDiscreteScheduler` finds the step by comparing the float timestep with
integer ones, so with linspace spacing every step uses the first sigma. PyTorch steps by index,
and so does this: the loop index picks the sigma. Unlike PyTorch, which casts the new sample to
the model output's dtype, the sample keeps its own dtype (float32 with a bfloat16 UNet).
"""

from __future__ import annotations

import dataclasses

import flax
import jax
import jax.numpy as jnp
import numpy as np

from diffusion.schedulers.common import (
    F32,
    SigmaScheduleConfig,
    check_first_timestep,
    const,
    denoised,
    init_noise_sigma,
    interp_sigmas,
    noised,
    scale_by_sigma,
    sigma_to_t,
    torch_linspace,
    train_sigmas,
)


@flax.struct.dataclass
class EulerState:
    init_noise_sigma: jax.Array  # () float32
    timesteps: jax.Array  # (M,) float32; M = steps (steps + 1 for continuous log_linear)
    sigmas: jax.Array  # (steps + 1,) float32 (steps + 2 with log_linear interpolation)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EulerScheduler(SigmaScheduleConfig):
    """Options and defaults of PyTorch's `EulerDiscreteScheduler`."""

    interpolation_type: str = "linear"
    timestep_type: str = "discrete"
    rescale_betas_zero_snr: bool = False
    final_sigmas_type: str = "zero"

    name = "euler"
    diffusers_class = "EulerDiscreteScheduler"
    prediction_types = ("epsilon", "v_prediction", "sample", "original_sample")

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require("interpolation_type", ("linear", "log_linear"))
        self.require("timestep_type", ("discrete", "continuous"))
        self.require("final_sigmas_type", ("zero", "sigma_min"))

    def set_timesteps(self, steps: int, shape: tuple[int, ...]) -> EulerState:
        """Timesteps and sigmas for `steps`; Euler keeps no history, so no buffers."""
        del shape
        alphas_cumprod = self.alphas_cumprod(self.rescale_betas_zero_snr)
        if self.rescale_betas_zero_snr:
            alphas_cumprod[-1] = 2**-24  # as PyTorch: keeps the first sigma finite
        sigmas_train = train_sigmas(alphas_cumprod)
        timesteps = self.spaced_timesteps(steps).astype(F32)
        if self.interpolation_type == "linear":
            sigmas = interp_sigmas(timesteps, sigmas_train)
        else:  # log_linear: steps + 1 sigmas, whatever the timesteps
            sigmas = np.exp(torch_linspace(np.log(sigmas_train[-1]), np.log(sigmas_train[0]), steps + 1))
        resampled = self.resampled_sigmas(sigmas, steps)
        if resampled is not None:
            sigmas, timesteps = resampled, sigma_to_t(resampled, np.log(sigmas_train))
        final = sigmas_train[0] if self.final_sigmas_type == "sigma_min" else 0.0
        sigmas = np.append(sigmas, final).astype(F32)
        if self.timestep_type == "continuous" and self.prediction_type == "v_prediction":
            timesteps = F32(0.25) * np.log(sigmas[:-1])
        timesteps = timesteps.astype(F32)
        check_first_timestep(timesteps)
        return EulerState(
            init_noise_sigma=init_noise_sigma(sigmas, self.timestep_spacing),
            timesteps=const(timesteps),
            sigmas=const(sigmas),
        )

    def add_noise(self, state: EulerState, original: jax.Array, noise: jax.Array, start: jax.Array) -> jax.Array:
        """x + sigma noise at each job's begin index."""
        return noised(original, noise, start, state.sigmas)

    def scale_model_input(self, state: EulerState, sample: jax.Array, i: jax.Array) -> jax.Array:
        """Divide by sqrt(sigma^2 + 1)."""
        return scale_by_sigma(sample, state.sigmas[i])

    def step(self, state: EulerState, model_output: jax.Array, i: jax.Array,
             sample: jax.Array) -> tuple[jax.Array, EulerState]:
        """One Euler step of the probability-flow ODE from sigmas[i] to sigmas[i + 1]."""
        x = sample.astype(jnp.float32)
        sigma = state.sigmas[i]
        prediction = "sample" if self.prediction_type == "original_sample" else self.prediction_type
        derivative = (x - denoised(prediction, x, model_output.astype(jnp.float32), sigma)) / sigma
        prev = x + derivative * (state.sigmas[i + 1] - sigma)
        return prev.astype(sample.dtype), state
