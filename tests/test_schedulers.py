"""worker.schedulers.LMSScheduler: PyTorch diffusers' K-LMS numerics, under jit + fori_loop."""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from worker.schedulers import LMSScheduler, LMSState  # noqa: E402

# Written by tests/data/make_lms_reference.py (PyTorch diffusers 0.39 LMSDiscreteScheduler).
REFERENCE = json.loads((Path(__file__).parent / "data" / "lms_reference.json").read_text())


def fake_model(x: jax.Array, t: jax.Array) -> jax.Array:
    """The reference script's stand-in for the UNet."""
    return 0.1 * jnp.sin(x) + 0.001 * t * x


def denoise(scheduler: LMSScheduler, steps: int, noise: jax.Array) -> tuple[jax.Array, LMSState]:
    """worker.generate._denoise's use of the scheduler, with fake_model as the UNet."""
    state = scheduler.set_timesteps(scheduler.create_state(), num_inference_steps=steps, shape=noise.shape)
    latents = noise * state.init_noise_sigma

    def body(step: int, carry: tuple[jax.Array, LMSState]) -> tuple[jax.Array, LMSState]:
        latents, state = carry
        t = jnp.array(state.timesteps, dtype=jnp.int32)[step]
        model_input = scheduler.scale_model_input(state, latents, t)
        # PyTorch feeds the model the float timestep (fractional for linspace spacing).
        noise_pred = fake_model(model_input, state.timesteps[step])
        return scheduler.step(state, noise_pred, t, latents).to_tuple()

    return jax.lax.fori_loop(0, steps, body, (latents, state))


@pytest.mark.parametrize("steps", [3, 6])
def test_matches_pytorch_diffusers(steps: int) -> None:
    expected = REFERENCE["runs"][str(steps)]
    scheduler = LMSScheduler.from_config(REFERENCE["config"])
    noise = jnp.asarray(REFERENCE["noise"], jnp.float32).reshape(REFERENCE["shape"])

    sample, state = jax.jit(denoise, static_argnums=(0, 1))(scheduler, steps, noise)

    np.testing.assert_array_equal(state.timesteps, expected["timesteps"])
    np.testing.assert_allclose(state.sigmas, expected["sigmas"], rtol=1e-5)
    np.testing.assert_allclose(state.init_noise_sigma, expected["init_noise_sigma"], rtol=1e-5)
    # The SD pipeline reads init_noise_sigma before set_timesteps: same value for linspace.
    np.testing.assert_allclose(
        scheduler.create_state().init_noise_sigma, expected["init_noise_sigma"], rtol=1e-5)
    np.testing.assert_allclose(sample.ravel(), expected["sample"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("steps", [3, 6])
def test_state_shapes_fixed_and_one_trace(steps: int) -> None:
    scheduler = LMSScheduler.from_config(REFERENCE["config"])
    shape = (2, 4, 8, 8)
    state = scheduler.set_timesteps(scheduler.create_state(), num_inference_steps=steps, shape=shape)
    traces = []

    @jax.jit
    def step(state: LMSState, sample: jax.Array) -> tuple[jax.Array, LMSState]:
        traces.append(None)
        return scheduler.step(state, fake_model(sample, 500.0), jnp.int32(0), sample).to_tuple()

    sample = jnp.ones(shape, jnp.float32)
    before = jax.tree.map(lambda x: (x.shape, x.dtype), state)
    for _ in range(steps):  # order 1, 2, 3, 4, 4, ... all through one compiled program
        sample, state = step(state, sample)
        assert jax.tree.map(lambda x: (x.shape, x.dtype), state) == before
    assert len(traces) == 1
    assert int(state.step_index) == steps
    assert bool(jnp.isfinite(sample).all())


def test_from_config_follows_diffusers_semantics() -> None:
    # A PyTorch PNDM config lists its own defaults (timestep_spacing "leading") as
    # _use_default_values; diffusers then applies LMS's default ("linspace") instead.
    config = {**REFERENCE["config"], "timestep_spacing": "leading",
              "_use_default_values": ["timestep_spacing"]}
    assert LMSScheduler.from_config(config).timestep_spacing == "linspace"
    with pytest.raises(NotImplementedError):
        LMSScheduler.from_config({**REFERENCE["config"], "use_karras_sigmas": True})
