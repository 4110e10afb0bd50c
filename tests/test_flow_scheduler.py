"""flow_euler (diffusion/schedulers/flow_euler.py) against diffusers' FlowMatchEulerDiscreteScheduler
as FluxPipeline drives it (tests/data/flux/scheduler.json, written by tests/oracle/flux.py), and
the rule that a family runs only its own schedulers."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffusion.families import FAMILIES
from diffusion.models import LoadedModel
from diffusion.schedulers import CLASS_NAMES, make
from renderfarm.jobs import JobError, parse_job

CASES = json.loads((Path(__file__).parent / "data" / "flux" / "scheduler.json").read_text())


def _id(case: dict[str, Any]) -> str:
    return f"{case['config']}-{case['steps']}steps-{case['image_seq_len']}tokens"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_schedule_and_steps_match_diffusers(case: dict[str, Any]) -> None:
    scheduler = make("flow_euler", case["scheduler_config"])
    sample = np.array(case["sample"], np.float32)
    state = scheduler.set_timesteps(case["steps"], (1, case["image_seq_len"], 64))
    np.testing.assert_array_equal(np.asarray(state.sigmas), np.array(case["sigmas"], np.float32))
    np.testing.assert_array_equal(np.asarray(state.timesteps), np.array(case["timesteps"], np.float32))
    assert float(state.init_noise_sigma) == 1.0
    output = jnp.asarray(case["model_output"], jnp.float32)
    step = jax.jit(scheduler.step)
    x = jnp.asarray(sample)
    for i, expected in enumerate(case["trajectory"]):
        assert np.array_equal(np.asarray(scheduler.scale_model_input(state, x, jnp.int32(i))), np.asarray(x))
        x, state = step(state, output, jnp.int32(i), x)
        # XLA may fuse x + dt * v into one rounding (FMA): an ulp from PyTorch's two.
        np.testing.assert_allclose(np.asarray(x), np.array(expected, np.float32), rtol=0, atol=2e-7 * (i + 1))


def test_dynamic_shift_depends_on_the_image_size() -> None:
    """dev's schedule moves with the token count (mu), schnell's does not."""
    dev = next(c for c in CASES if c["config"] == "dev")["scheduler_config"]
    schnell = next(c for c in CASES if c["config"] == "schnell")["scheduler_config"]
    sigmas = lambda config, tokens: np.asarray(make("flow_euler", config).set_timesteps(4, (1, tokens, 64)).sigmas)  # noqa: E731
    assert not np.array_equal(sigmas(dev, 16), sigmas(dev, 4096))
    np.testing.assert_array_equal(sigmas(schnell, 16), sigmas(schnell, 4096))
    assert make("flow_euler", dev).mu(4096) == pytest.approx(1.15) and make("flow_euler", dev).mu(256) == pytest.approx(0.5)


def test_options_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="use_karras_sigmas=True"):
        make("flow_euler", {"use_karras_sigmas": True})
    with pytest.raises(ValueError, match="time_shift_type='linear'"):
        make("flow_euler", {"time_shift_type": "linear"})
    with pytest.raises(JobError, match="timestep_spacing"):
        make("flow_euler", {}, timestep_spacing="leading")


def test_a_flux_model_folder_names_it() -> None:
    assert CLASS_NAMES["FlowMatchEulerDiscreteScheduler"] == "flow_euler"
    assert parse_job({"prompt": "x", "model": "m", "seed": 0, "scheduler": "flow_euler"}).scheduler == "flow_euler"


class _Model:
    """What Engine.check reads of a loaded model."""

    guidance_scale = LoadedModel.guidance_scale  # the job's, or its family's default

    def __init__(self, family: str, default: str) -> None:
        self.ref, self.dtype, self.variant, self.base, self.loras = "m", "float32", None, None, None
        self.family, self.native_size, self.default_scheduler = FAMILIES[family], 64, default
        self.inpainting_unet = False  # a UNet that takes a mask and a masked image (9 input channels)


@pytest.mark.parametrize("family, default, named", [("sd", "pndm", "flow_euler"), ("sdxl", "euler", "flow_euler")])
def test_a_family_runs_only_its_schedulers(family: str, default: str, named: str) -> None:
    from worker.engine import Engine

    engine = Engine.__new__(Engine)  # check() needs the model alone
    engine.model = _Model(family, default)
    spec = parse_job({"prompt": "x", "model": "m", "seed": 0, "scheduler": named})
    with pytest.raises(JobError, match=rf"scheduler='{named}': a {family} model runs pndm, ddim"):
        engine.check(spec)
    assert engine.check(dataclasses.replace(spec, scheduler=None)).scheduler == default
