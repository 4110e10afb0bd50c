"""K-LMS, as PyTorch diffusers' `LMSDiscreteScheduler` (order 4).

diffusers' `FlaxLMSDiscreteScheduler` cannot run under jit: its `step` branches on the traced
timestep, indexes sigmas by timestep value instead of step index, integrates with scipy on
traced values and grows its derivatives array every step. Here the LMS coefficients, which
depend only on the sigmas, are integrated on the host (exactly: two Gauss-Legendre nodes
integrate the cubic Lagrange basis; PyTorch runs scipy's quad on it), and the state carries a
fixed-size derivatives buffer.
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
    steps_taken,
    train_sigmas,
)

ORDER = 4
_GL_NODES, _GL_WEIGHTS = np.polynomial.legendre.leggauss(2)


@flax.struct.dataclass
class LMSState:
    init_noise_sigma: jax.Array  # () float32
    timesteps: jax.Array  # (steps,) float32, fractional for linspace spacing and Karras sigmas
    sigmas: jax.Array  # (steps + 1,) float32, ending in 0
    coeffs: jax.Array  # (steps, ORDER): weight of the k-th newest derivative at each step
    derivatives: jax.Array  # (ORDER, *shape) float32, newest first


@dataclasses.dataclass(frozen=True, kw_only=True)
class LMSScheduler(SigmaScheduleConfig):
    """Options and defaults of PyTorch's `LMSDiscreteScheduler`."""

    name = "lms"
    diffusers_class = "LMSDiscreteScheduler"
    history = True

    def set_timesteps(self, steps: int, shape: tuple[int, ...]) -> LMSState:
        """Timesteps, sigmas and LMS coefficients for `steps` on samples of `shape`."""
        sigmas_train = train_sigmas(self.alphas_cumprod())
        timesteps = self.spaced_timesteps(steps).astype(F32)
        sigmas = interp_sigmas(timesteps, sigmas_train)
        resampled = self.resampled_sigmas(sigmas, steps, karras_bounds=False)
        if resampled is not None:
            sigmas, timesteps = resampled, sigma_to_t(resampled, np.log(sigmas_train))
        timesteps = timesteps.astype(F32)
        check_first_timestep(timesteps)
        sigmas = np.append(sigmas, 0.0).astype(F32)
        return LMSState(
            init_noise_sigma=init_noise_sigma(sigmas, self.timestep_spacing),
            timesteps=const(timesteps),
            sigmas=const(sigmas),
            coeffs=const(_lms_coefficients(sigmas.astype(np.float64))),
            derivatives=jnp.zeros((ORDER, *shape), jnp.float32),
        )

    def add_noise(self, state: LMSState, original: jax.Array, noise: jax.Array, start: jax.Array) -> jax.Array:
        """x + sigma noise at each job's begin index."""
        return noised(original, noise, start, state.sigmas)

    def scale_model_input(self, state: LMSState, sample: jax.Array, i: jax.Array) -> jax.Array:
        """Divide by sqrt(sigma^2 + 1)."""
        return scale_by_sigma(sample, state.sigmas[i])

    def step(self, state: LMSState, model_output: jax.Array, i: jax.Array, sample: jax.Array,
             begin: jax.Array | int = 0) -> tuple[jax.Array, LMSState]:
        """One linear multistep update over the newest derivatives, those of the job's own
        steps: PyTorch takes step i's coefficients of order min(i + 1, 4) and zips them with
        the derivatives it holds, fewer for a job begun at step `begin`."""
        x = sample.astype(jnp.float32)
        sigma = state.sigmas[i]
        derivative = (x - denoised(self.prediction_type, x, model_output.astype(jnp.float32), sigma)) / sigma
        derivatives = jnp.concatenate([derivative[None], state.derivatives[:-1]])
        held = steps_taken(i, begin, x.ndim)
        total = state.coeffs[i, 0] * derivatives[0]
        for k in range(1, ORDER):
            total = total + jnp.where(held >= k, state.coeffs[i, k] * derivatives[k], 0)
        return (x + total).astype(sample.dtype), state.replace(derivatives=derivatives)


def _lms_coefficients(sigmas: np.ndarray) -> np.ndarray:
    """coeffs[i, j] = integral from sigmas[i] to sigmas[i + 1] of the Lagrange basis polynomial
    of node sigmas[i - j] over nodes sigmas[i], ..., sigmas[i - order + 1], where
    order = min(i + 1, ORDER) as in PyTorch; entries j >= order stay zero."""
    num_steps = len(sigmas) - 1
    coeffs = np.zeros((num_steps, ORDER))
    for i in range(num_steps):
        nodes = sigmas[i - np.arange(min(i + 1, ORDER))]
        half = (sigmas[i + 1] - sigmas[i]) / 2
        taus = sigmas[i] + half * (_GL_NODES + 1)
        for j, node in enumerate(nodes):
            others = np.delete(nodes, j)
            basis = np.prod((taus[:, None] - others) / (node - others), axis=1)
            coeffs[i, j] = half * _GL_WEIGHTS @ basis
    return coeffs
