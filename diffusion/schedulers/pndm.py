"""PNDM (pseudo numerical methods), as PyTorch diffusers' `PNDMScheduler`.

PyTorch's PNDM is a state machine driven by a call counter: Runge-Kutta (PRK) steps that each
take four model evaluations (unless `skip_prk_steps`), then linear multistep (PLMS) steps whose
first two redo one step (a Heun-like restart). Which evaluations it mixes, which sample it starts
from and which alphas it uses at each call depend only on the config and the step count, so
`set_timesteps` replays that machine on the host into tables by call; the device keeps three
stored outputs, PRK's running sum and a saved sample in fixed-size buffers, and looks up each
job's alphas from the timesteps its call and the fed timestep give (an image job's first call
comes part way through the schedule).
"""

from __future__ import annotations

import dataclasses

import flax
import jax
import jax.numpy as jnp
import numpy as np

from diffusion.schedulers.common import SchedulerConfig, check_timesteps, const, noised, steps_taken

# PLMS weights of the newest outputs by how many are stored (Adams-Bashforth orders 1 to 4).
_PLMS = {1: [1], 2: [3 / 2, -1 / 2], 3: [23 / 12, -16 / 12, 5 / 12], 4: [55 / 24, -59 / 24, 37 / 24, -9 / 24]}


@flax.struct.dataclass
class PNDMState:
    init_noise_sigma: jax.Array  # () float32
    timesteps: jax.Array  # (M,) float32; M = steps + 1 (PLMS) or steps + 9 (with PRK)
    # By call: PyTorch's machine counts a job's calls from its first step (image jobs: part way).
    mix: jax.Array  # (M, 5): weights of [model_output, *stored, running] in the output used
    accumulate: jax.Array  # (M, 2): running = a0 * running + a1 * model_output
    push: jax.Array  # (M,) int32: store model_output (newest first)
    save: jax.Array  # (M,) int32: save the sample
    from_saved: jax.Array  # (M,) int32: step from the saved sample instead of the current one
    prk_base: jax.Array  # (M,) int32: a PRK call's base timestep (-1 past the PRK calls)
    lift: jax.Array  # (M,) int32: the base timestep is the fed one plus this (PLMS's restart)
    drop: jax.Array  # (M,) int32: the previous timestep is the fed one minus this
    alphas_cumprod: jax.Array  # (num_train_timesteps,) float32
    final_alpha: jax.Array  # () float32: alpha_prev below timestep 0
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
    history = True

    def set_timesteps(self, steps: int, shape: tuple[int, ...]) -> PNDMState:
        """Replay PyTorch's counter-driven PRK/PLMS machine for `steps` into tables by call."""
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
        push, save, from_saved, lift = (np.zeros(m, np.int32) for _ in range(4))
        prk_base, drop = np.full(m, -1, np.int32), np.full(m, ratio, np.int32)
        stored = 0  # len(PyTorch's ets)
        for k in range(m):  # k: PyTorch's counter, the job's own call number
            if k < len(prk):  # step_prk: four evaluations a Runge-Kutta step, all from phase 0's sample
                phase = k % 4
                prk_base[k], drop[k] = prk[k - phase], 0 if k % 2 else ratio // 2
                mix[k] = [1 / 6, 0, 0, 0, 1] if phase == 3 else [1, 0, 0, 0, 0]
                # Phase 0 starts the sum afresh (PyTorch's is 0 there; a job begun part way
                # finds what the calls before its own left).
                accumulate[k] = (0, 0) if phase == 3 else (phase != 0, 1 / 6 if phase == 0 else 1 / 3)
                push[k] = save[k] = phase == 0
                from_saved[k] = phase != 0
                stored += phase == 0
            elif k == 1:  # step_plms's second call redoes the first step with the mean output
                lift[k], drop[k] = ratio, 0
                mix[k, :2] = 1 / 2
                from_saved[k] = 1
            else:
                stored = min(stored, 3) + 1
                mix[k, :stored] = _PLMS[stored]
                push[k], save[k] = 1, k == 0
        base = np.where(prk_base >= 0, prk_base, timesteps + lift)
        check_timesteps(np.concatenate([base, timesteps - drop]), n)

        alphas_cumprod = self.alphas_cumprod()
        return PNDMState(
            init_noise_sigma=const(1.0),
            timesteps=const(timesteps),
            mix=const(mix),
            accumulate=const(accumulate),
            push=jnp.asarray(push),
            save=jnp.asarray(save),
            from_saved=jnp.asarray(from_saved),
            prk_base=jnp.asarray(prk_base),
            lift=jnp.asarray(lift),
            drop=jnp.asarray(drop),
            alphas_cumprod=const(alphas_cumprod),
            final_alpha=const(1.0 if self.set_alpha_to_one else alphas_cumprod[0]),
            stored=jnp.zeros((3, *shape), jnp.float32),
            running=jnp.zeros(shape, jnp.float32),
            saved=jnp.zeros(shape, jnp.float32),
        )

    def add_noise(self, state: PNDMState, original: jax.Array, noise: jax.Array, start: jax.Array) -> jax.Array:
        """sqrt(alpha_t) x + sqrt(1 - alpha_t) noise at each job's first timestep."""
        alpha = state.alphas_cumprod[state.timesteps.astype(jnp.int32)]
        return noised(original, noise, start, jnp.sqrt(1 - alpha), jnp.sqrt(alpha))

    def scale_model_input(self, state: PNDMState, sample: jax.Array, i: jax.Array) -> jax.Array:
        """PNDM does not scale the model input."""
        return sample

    def step(self, state: PNDMState, model_output: jax.Array, i: jax.Array, sample: jax.Array,
             begin: jax.Array | int = 0) -> tuple[jax.Array, PNDMState]:
        """The update for model evaluation `i`, the job's call i - begin of PyTorch's machine;
        PNDM's formula (9) from the mixed output."""
        output = model_output.astype(jnp.float32)
        current = sample.astype(jnp.float32)
        call = steps_taken(i, begin, current.ndim)  # (B or 1, 1, ...)
        fed = state.timesteps[i].astype(jnp.int32)
        base = jnp.where(state.prk_base[call] >= 0, state.prk_base[call], fed + state.lift[call])
        prev_t = fed - state.drop[call]
        alpha = state.alphas_cumprod[base]
        alpha_prev = jnp.where(prev_t >= 0, state.alphas_cumprod[jnp.maximum(prev_t, 0)], state.final_alpha)
        beta, beta_prev = 1 - alpha, 1 - alpha_prev

        mix = state.mix[call]  # (B or 1, 1, ..., 5)
        terms = (output, *state.stored, state.running)
        mixed = mix[..., 0] * terms[0]
        for k in range(1, len(terms)):
            mixed = mixed + mix[..., k] * terms[k]
        start = jnp.where(state.from_saved[call] == 1, state.saved, current)
        if self.prediction_type == "v_prediction":
            mixed = jnp.sqrt(alpha) * mixed + jnp.sqrt(beta) * start
        denom = alpha * jnp.sqrt(beta_prev) + jnp.sqrt(alpha * beta * alpha_prev)
        prev = jnp.sqrt(alpha_prev / alpha) * start - (alpha_prev - alpha) * mixed / denom
        pushed = jnp.concatenate([output[None], state.stored[:-1]])
        accumulate = state.accumulate[call]
        state = state.replace(
            stored=jnp.where(state.push[call] == 1, pushed, state.stored),
            running=accumulate[..., 0] * state.running + accumulate[..., 1] * output,
            saved=jnp.where(state.save[call] == 1, current, state.saved),
        )
        return prev.astype(sample.dtype), state
