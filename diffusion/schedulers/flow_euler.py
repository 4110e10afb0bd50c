"""Flow-matching Euler, as PyTorch diffusers' `FlowMatchEulerDiscreteScheduler` runs in
FluxPipeline: sigmas linspace(1, 1/steps), shifted by `shift` or, with dynamic shifting (dev),
by mu = calculate_shift(the image's token count), then x += (sigma_next - sigma) * velocity.

The token count is the packed latents' (B, tokens, channels) middle axis: `set_timesteps` reads
it from the sample shape, so the program of every image size gets its own schedule, as the
pipeline computes it. The sigmas are float32 as diffusers computes them (its numpy float32
arithmetic with Python-float constants); the transformer is fed sigma * 1000 (timesteps).
"""

from __future__ import annotations

import dataclasses
import math

import flax
import jax
import jax.numpy as jnp
import numpy as np

from diffusion.schedulers.common import F32, Configured, const


@flax.struct.dataclass
class FlowState:
    init_noise_sigma: jax.Array  # () float32: 1, the latents are the noise
    timesteps: jax.Array  # (steps,) float32: sigma * num_train_timesteps
    sigmas: jax.Array  # (steps + 1,) float32, the last 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class FlowMatchEulerScheduler(Configured):
    """Options and defaults of PyTorch's `FlowMatchEulerDiscreteScheduler`; those Flux's
    checkpoints leave at their defaults are refused otherwise."""

    num_train_timesteps: int = 1000
    shift: float = 1.0
    use_dynamic_shifting: bool = False
    base_shift: float | None = 0.5
    max_shift: float | None = 1.15
    base_image_seq_len: int = 256
    max_image_seq_len: int = 4096
    invert_sigmas: bool = False
    shift_terminal: float | None = None
    use_karras_sigmas: bool = False
    use_exponential_sigmas: bool = False
    use_beta_sigmas: bool = False
    time_shift_type: str = "exponential"
    stochastic_sampling: bool = False

    name = "flow_euler"
    diffusers_class = "FlowMatchEulerDiscreteScheduler"

    def __post_init__(self) -> None:
        for option in ("invert_sigmas", "shift_terminal", "use_karras_sigmas", "use_exponential_sigmas",
                       "use_beta_sigmas", "stochastic_sampling"):
            self.require(option, (None, False))
        self.require("time_shift_type", ("exponential",))

    def mu(self, image_seq_len: int) -> float:
        """FluxPipeline's `calculate_shift`, in Python floats as there."""
        slope = (self.max_shift - self.base_shift) / (self.max_image_seq_len - self.base_image_seq_len)
        return image_seq_len * slope + (self.base_shift - slope * self.base_image_seq_len)

    def sigmas(self, steps: int, image_seq_len: int) -> np.ndarray:
        """The (steps,) float32 sigmas after set_timesteps' shifting (without the final 0)."""
        sigmas = np.linspace(1.0, 1 / steps, steps).astype(F32)
        if self.use_dynamic_shifting:
            exp_mu = math.exp(self.mu(image_seq_len))
            return exp_mu / (exp_mu + (1 / sigmas - 1) ** 1.0)
        return self.shift * sigmas / (1 + (self.shift - 1) * sigmas)

    def set_timesteps(self, steps: int, shape: tuple[int, ...]) -> FlowState:
        """The schedule of `steps` for packed latents of `shape` (B, tokens, channels)."""
        sigmas = self.sigmas(steps, shape[1]).astype(F32)
        timesteps = sigmas * F32(self.num_train_timesteps)
        return FlowState(init_noise_sigma=const(F32(1.0)), timesteps=const(timesteps),
                         sigmas=const(np.append(sigmas, F32(0))))

    def scale_model_input(self, state: FlowState, sample: jax.Array, i: jax.Array) -> jax.Array:
        """The flow models take the sample as it is."""
        del state, i
        return sample

    def step(self, state: FlowState, model_output: jax.Array, i: jax.Array,
             sample: jax.Array) -> tuple[jax.Array, FlowState]:
        """One Euler step of the flow from sigmas[i] to sigmas[i + 1], in float32."""
        dt = state.sigmas[i + 1] - state.sigmas[i]
        prev = sample.astype(jnp.float32) + dt * model_output.astype(jnp.float32)
        return prev.astype(sample.dtype), state
