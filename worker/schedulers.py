"""A K-LMS scheduler that runs inside `jax.jit` and `jax.lax.fori_loop`.

diffusers' `FlaxLMSDiscreteScheduler` (0.39) cannot: its `step` branches on the traced
timestep, indexes sigmas by timestep value instead of step index, integrates with scipy on
traced values and grows its derivatives array every step. This one follows PyTorch
diffusers' `LMSDiscreteScheduler` (order 4, no Karras/exponential/beta sigmas) instead.
Everything that depends only on the config and the static step count (timesteps, sigmas,
LMS coefficients) is computed on the host in `set_timesteps` and becomes a constant; the
state carries a fixed-size derivatives buffer and a step counter, so shapes never change.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import flax
import jax
import jax.numpy as jnp
import numpy as np

ORDER = 4
# Two Gauss-Legendre nodes integrate cubics (the order-4 Lagrange basis) exactly.
_GL_NODES, _GL_WEIGHTS = np.polynomial.legendre.leggauss(2)


@flax.struct.dataclass
class LMSState:
    init_noise_sigma: jax.Array  # () float32
    timesteps: jax.Array  # (N,) float32, as PyTorch diffusers (may be fractional)
    sigmas: jax.Array  # (N + 1,) float32, ending in 0
    coeffs: jax.Array  # (N, ORDER): weight of the k-th newest derivative at each step, zero-padded
    derivatives: jax.Array  # (ORDER, *shape) float32, newest first
    step_index: jax.Array  # () int32: steps taken so far


class LMSOutput(NamedTuple):
    prev_sample: jax.Array
    state: LMSState

    def to_tuple(self) -> tuple[jax.Array, LMSState]:
        return self.prev_sample, self.state


@dataclasses.dataclass(frozen=True)
class LMSScheduler:
    """Defaults are those of PyTorch diffusers' `LMSDiscreteScheduler`."""

    num_train_timesteps: int = 1000
    beta_start: float = 0.0001
    beta_end: float = 0.02
    beta_schedule: str = "linear"
    trained_betas: Sequence[float] | None = None
    prediction_type: str = "epsilon"
    timestep_spacing: str = "linspace"
    steps_offset: int = 0

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> LMSScheduler:
        """Like diffusers' `from_config`: known keys only, and keys the source class merely
        defaulted (`_use_default_values`) fall back to this class's defaults."""
        defaulted = set(config.get("_use_default_values", ()))
        given = {k: v for k, v in config.items() if k not in defaulted}
        if any(given.get(k) for k in ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas")):
            raise NotImplementedError("LMSScheduler supports only the default sigma schedule")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in given.items() if k in names})

    def create_state(self) -> LMSState:
        """The state PyTorch's constructor leaves, a schedule of `num_train_timesteps` steps.
        Only its init_noise_sigma is meant to be used before `set_timesteps`."""
        # With "leading" spacing and steps_offset 1, t=1000 clamps onto t=999's sigma, so
        # two nodes coincide and some coefficients are non-finite (PyTorch would agree).
        with np.errstate(divide="ignore", invalid="ignore"):
            return self._state(self.num_train_timesteps, ())

    def set_timesteps(self, state: LMSState, num_inference_steps: int,
                      shape: tuple[int, ...] = ()) -> LMSState:
        """A fresh state for `num_inference_steps` (static) on samples of `shape` (static)."""
        del state  # everything derives from the config
        return self._state(num_inference_steps, shape)

    def scale_model_input(self, state: LMSState, sample: jax.Array, timestep: jax.Array) -> jax.Array:
        """Divide by sqrt(sigma^2 + 1); `timestep` is unused, the state knows the step."""
        sigma = state.sigmas[state.step_index]
        return sample / jnp.sqrt(sigma**2 + 1)

    def step(self, state: LMSState, model_output: jax.Array, timestep: jax.Array,
             sample: jax.Array) -> LMSOutput:
        """One linear multistep update; `timestep` is unused, the state knows the step."""
        sigma = state.sigmas[state.step_index]
        if self.prediction_type == "epsilon":
            denoised = sample - sigma * model_output
        elif self.prediction_type == "v_prediction":
            denoised = model_output * (-sigma / jnp.sqrt(sigma**2 + 1)) + sample / (sigma**2 + 1)
        elif self.prediction_type == "sample":
            denoised = model_output
        else:
            raise ValueError(f"unknown prediction_type {self.prediction_type!r}")
        derivative = (sample - denoised) / sigma
        derivatives = jnp.concatenate(
            [derivative[None].astype(state.derivatives.dtype), state.derivatives[:-1]])
        update = jnp.tensordot(state.coeffs[state.step_index], derivatives, axes=1)
        prev_sample = (sample + update).astype(sample.dtype)
        state = state.replace(derivatives=derivatives, step_index=state.step_index + 1)
        return LMSOutput(prev_sample, state)

    def _state(self, num_steps: int, shape: tuple[int, ...]) -> LMSState:
        timesteps, sigmas = self._schedule(num_steps)
        # As PyTorch: sigma_max for linspace/trailing, sqrt(sigma_max^2 + 1) for leading.
        max_sigma = float(sigmas.max())
        leading = self.timestep_spacing == "leading"
        init_noise_sigma = (max_sigma**2 + 1) ** 0.5 if leading else max_sigma
        return LMSState(
            init_noise_sigma=jnp.float32(init_noise_sigma),
            timesteps=jnp.asarray(timesteps),
            sigmas=jnp.asarray(sigmas),
            coeffs=jnp.asarray(_lms_coefficients(sigmas.astype(np.float64)), dtype=jnp.float32),
            derivatives=jnp.zeros((ORDER, *shape), jnp.float32),
            step_index=jnp.int32(0),
        )

    def _schedule(self, num_steps: int) -> tuple[np.ndarray, np.ndarray]:
        """Host-side timesteps and sigmas, float32 like PyTorch diffusers."""
        n = self.num_train_timesteps
        if self.trained_betas is not None:
            betas = np.asarray(self.trained_betas, np.float32)
        elif self.beta_schedule == "linear":
            betas = np.linspace(self.beta_start, self.beta_end, n, dtype=np.float32)
        elif self.beta_schedule == "scaled_linear":
            betas = np.linspace(self.beta_start**0.5, self.beta_end**0.5, n, dtype=np.float32) ** 2
        else:
            raise NotImplementedError(f"beta_schedule {self.beta_schedule!r}")
        alphas_cumprod = np.cumprod(1 - betas)
        train_sigmas = np.sqrt((1 - alphas_cumprod) / alphas_cumprod)

        if self.timestep_spacing == "linspace":
            timesteps = np.linspace(0, n - 1, num_steps, dtype=np.float32)[::-1]
        elif self.timestep_spacing == "leading":
            ratio = n // num_steps
            timesteps = (np.arange(num_steps) * ratio).round()[::-1].astype(np.float32) + self.steps_offset
        elif self.timestep_spacing == "trailing":
            timesteps = np.arange(n, 0, -n / num_steps).round().astype(np.float32) - 1
        else:
            raise ValueError(f"unknown timestep_spacing {self.timestep_spacing!r}")
        sigmas = np.interp(timesteps, np.arange(n), train_sigmas)
        return timesteps, np.append(sigmas, 0.0).astype(np.float32)


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
