"""PNDM (pseudo numerical methods), as PyTorch diffusers' `PNDMScheduler`.

PyTorch's PNDM is a state machine driven by a call counter: Runge-Kutta (PRK) steps that each
take four model evaluations (unless `skip_prk_steps`), then linear multistep (PLMS) steps whose
first two redo one step (a Heun-like restart). Which evaluations it mixes, which sample it starts
from and which alphas it uses at each call depend only on the config and the step count, so
`set_timesteps` replays that machine on the host into per-evaluation tables; the device keeps
three stored outputs, PRK's running sum and a saved sample in fixed-size buffers.
"""

from __future__ import annotations

import dataclasses

import flax
import jax
import jax.numpy as jnp
import numpy as np

from diffusion.schedulers.common import F32, SchedulerConfig, check_timesteps, const

# PLMS weights of the newest outputs by how many are stored (Adams-Bashforth orders 1 to 4).
_PLMS = {1: [1], 2: [3 / 2, -1 / 2], 3: [23 / 12, -16 / 12, 5 / 12], 4: [55 / 24, -59 / 24, 37 / 24, -9 / 24]}


@flax.struct.dataclass
class PNDMState:
    init_noise_sigma: jax.Array  # () float32
    timesteps: jax.Array  # (M,) float32; M = steps + 1 (PLMS) or steps + 9 (with PRK)
    mix: jax.Array  # (M, 5): weights of [model_output, *stored, running] in the output used
    accumulate: jax.Array  # (M, 2): running = a0 * running + a1 * model_output
    push: jax.Array  # (M,) int32: store model_output (newest first)
    save: jax.Array  # (M,) int32: save the sample
    from_saved: jax.Array  # (M,) int32: step from the saved sample instead of the current one
    sample_coeff: jax.Array  # (M,) (alpha_prev / alpha) ** 0.5
    alpha_diff: jax.Array  # (M,) alpha_prev - alpha
    denom: jax.Array  # (M,) PNDM's model-output denominator
    sqrt_alpha: jax.Array  # (M,) for v_prediction
    sqrt_beta: jax.Array  # (M,)
    stored: jax.Array  # (3, *shape) float32
    running: jax.Array  # (*shape) float32
    saved: jax.Array  # (*shape) float32


@dataclasses.dataclass(frozen=True, kw_only=True)
class PNDMScheduler(SchedulerConfig):
    """Options and defaults of PyTorch's `PNDMScheduler`."""

    skip_prk_steps: bool = False
    set_alpha_to_one: bool = False
    timestep_spacing: str = "leading"

    name = "pndm"
    diffusers_class = "PNDMScheduler"
    prediction_types = ("epsilon", "v_prediction")

    def set_timesteps(self, steps: int, shape: tuple[int, ...]) -> PNDMState:
        """Replay PyTorch's counter-driven PRK/PLMS machine for `steps` into tables."""
        n, ratio = self.num_train_timesteps, self.num_train_timesteps // steps
        ascending = self.spaced_timesteps(steps)[::-1].round().astype(np.int64)
        if self.skip_prk_steps:
            prk = np.zeros(0, np.int64)
            plms = np.concatenate([ascending[:-1], ascending[-2:-1], ascending[-1:]])[::-1]
        elif steps < 4:
            raise ValueError(f"pndm scheduler: skip_prk_steps=False needs at least 4 steps, not {steps} "
                             "(PyTorch diffusers fails too)")
        else:
            prk = (ascending[-4:].repeat(2) + np.tile([0, ratio // 2], 4))[:-1].repeat(2)[1:-1][::-1]
            plms = ascending[:-3][::-1]
        timesteps = np.concatenate([prk, plms])
        m = len(timesteps)
        mix, accumulate = np.zeros((m, 5)), np.zeros((m, 2))
        push, save, from_saved = (np.zeros(m, np.int32) for _ in range(3))
        base, prev = timesteps.copy(), timesteps - ratio
        stored = 0  # len(PyTorch's ets)
        for k, t in enumerate(timesteps):
            if k < len(prk):  # step_prk: four evaluations a Runge-Kutta step, all from phase 0's sample
                phase = k % 4
                base[k], prev[k] = prk[k - phase], t - (0 if k % 2 else ratio // 2)
                mix[k] = [1 / 6, 0, 0, 0, 1] if phase == 3 else [1, 0, 0, 0, 0]
                accumulate[k] = (0, 0) if phase == 3 else (1, 1 / 6 if phase == 0 else 1 / 3)
                push[k] = save[k] = phase == 0
                from_saved[k] = phase != 0
                stored += phase == 0
            elif k == 1:  # step_plms's second call redoes the first step with the mean output
                base[k], prev[k] = t + ratio, t
                mix[k, :2] = 1 / 2
                from_saved[k] = 1
            else:
                stored = min(stored, 3) + 1
                mix[k, :stored] = _PLMS[stored]
                push[k], save[k] = 1, k == 0
        check_timesteps(np.concatenate([base, prev]), n)

        alphas_cumprod = self.alphas_cumprod()
        final = F32(1) if self.set_alpha_to_one else alphas_cumprod[0]
        alpha = alphas_cumprod[base]
        alpha_prev = np.where(prev >= 0, alphas_cumprod[np.maximum(prev, 0)], final)
        beta, beta_prev = F32(1) - alpha, F32(1) - alpha_prev
        return PNDMState(
            init_noise_sigma=const(1.0),
            timesteps=const(timesteps),
            mix=const(mix),
            accumulate=const(accumulate),
            push=jnp.asarray(push),
            save=jnp.asarray(save),
            from_saved=jnp.asarray(from_saved),
            sample_coeff=const(np.sqrt(alpha_prev / alpha)),
            alpha_diff=const(alpha_prev - alpha),
            denom=const(alpha * np.sqrt(beta_prev) + np.sqrt(alpha * beta * alpha_prev)),
            sqrt_alpha=const(np.sqrt(alpha)),
            sqrt_beta=const(np.sqrt(beta)),
            stored=jnp.zeros((3, *shape), jnp.float32),
            running=jnp.zeros(shape, jnp.float32),
            saved=jnp.zeros(shape, jnp.float32),
        )

    def scale_model_input(self, state: PNDMState, sample: jax.Array, i: jax.Array) -> jax.Array:
        """PNDM does not scale the model input."""
        return sample

    def step(self, state: PNDMState, model_output: jax.Array, i: jax.Array,
             sample: jax.Array) -> tuple[jax.Array, PNDMState]:
        """The update for model evaluation `i`; PNDM's formula (9) from the mixed output."""
        output = model_output.astype(jnp.float32)
        current = sample.astype(jnp.float32)
        mixed = jnp.tensordot(state.mix[i], jnp.stack([output, *state.stored, state.running]), axes=1)
        start = jnp.where(state.from_saved[i] == 1, state.saved, current)
        if self.prediction_type == "v_prediction":
            mixed = state.sqrt_alpha[i] * mixed + state.sqrt_beta[i] * start
        prev = state.sample_coeff[i] * start - state.alpha_diff[i] * mixed / state.denom[i]
        pushed = jnp.concatenate([output[None], state.stored[:-1]])
        state = state.replace(
            stored=jnp.where(state.push[i] == 1, pushed, state.stored),
            running=state.accumulate[i, 0] * state.running + state.accumulate[i, 1] * output,
            saved=jnp.where(state.save[i] == 1, current, state.saved),
        )
        return prev.astype(sample.dtype), state
