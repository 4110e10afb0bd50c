"""diffusion.schedulers against PyTorch diffusers 0.42.1: the same configs, the same denoising loop and the
same fake UNet as tests/oracle/schedulers.py, which wrote tests/data/schedulers/ (no torch here)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffusion.choices import KARRAS_SCHEDULERS, SCHEDULERS
from diffusion.generate import Static, sample
from diffusion.schedulers import SCHEDULER_CLASSES, Scheduler, make
from diffusion.schedulers.common import SigmaScheduleConfig

DATA = Path(__file__).parent / "data" / "schedulers"
REFERENCE = json.loads((DATA / "cases.json").read_text(encoding="utf-8"))
TRAJECTORIES = np.load(DATA / "trajectories.npz")
NOISE = jnp.asarray(TRAJECTORIES["noise"])
CASES = {case["id"]: case for case in REFERENCE["cases"]}
# The longest run of each config (cases come in increasing step counts) goes through jit +
# fori_loop as diffusion.generate runs it; compiling every case would take half a minute, so the
# others make the same calls op by op, with the same int32 array index.
JITTED = set({(c["scheduler"], c["config"]): c["id"] for c in REFERENCE["cases"] if "error" not in c}.values())
# Differences are measured against the largest |sample| of the run (noise * init_noise_sigma
# included): float32 resolves that much, and DPM's x0 at sigma 14.6 amplifies its rounding 15-fold.
RTOL = 1e-5


def fake_model(x: jax.Array, t: jax.Array) -> jax.Array:
    """The oracle's stand-in for the UNet."""
    return 0.1 * jnp.sin(x) + 0.001 * t * x


def step(scheduler: Scheduler, state: Any, output: jax.Array, i: jax.Array, sample: jax.Array) -> tuple[jax.Array, Any]:
    """`scheduler.step`, with the stochastic ones' noise for step i as the oracle drew it:
    normal(fold_in(PRNGKey(0), i)), the whole sample as one job."""
    if scheduler.stochastic:
        noise = jax.random.normal(jax.random.fold_in(jax.random.PRNGKey(0), i), sample.shape)
        return scheduler.step(state, output, i, sample, noise)
    return scheduler.step(state, output, i, sample)


def scheduler_for(case: dict[str, Any]) -> Scheduler:
    return make(case["scheduler"], REFERENCE["configs"][case["config"]])


def denoise(scheduler: Scheduler, state: Any, noise: jax.Array, dtype: Any = jnp.float32) -> tuple[jax.Array, Any]:
    """The pipeline's loop as diffusion.generate runs it (fori_loop over the model evaluations), with
    the UNet's input and output in `dtype`; returns the sample after every evaluation and the state."""
    latents = noise * state.init_noise_sigma
    trajectory = jnp.zeros((state.timesteps.shape[0], *noise.shape), latents.dtype)

    def body(i: jax.Array, carry: tuple[jax.Array, Any, jax.Array]) -> tuple[jax.Array, Any, jax.Array]:
        latents, state, trajectory = carry
        model_input = scheduler.scale_model_input(state, latents, i).astype(dtype)
        output = fake_model(model_input, state.timesteps[i].astype(dtype))
        latents, state = step(scheduler, state, output, i, latents)
        return latents, state, trajectory.at[i].set(latents)

    _, state, trajectory = jax.lax.fori_loop(0, state.timesteps.shape[0], body, (latents, state, trajectory))
    return trajectory, state


def denoise_eagerly(scheduler: Scheduler, state: Any, noise: jax.Array) -> tuple[jax.Array, Any]:
    """`denoise` op by op: the same calls, a Python loop."""
    latents, trajectory = noise * state.init_noise_sigma, []
    for i in map(jnp.int32, range(state.timesteps.shape[0])):
        output = fake_model(scheduler.scale_model_input(state, latents, i), state.timesteps[i])
        latents, state = step(scheduler, state, output, i, latents)
        trajectory.append(latents)
    return jnp.stack(trajectory), state


def difference(case: dict[str, Any], trajectory: jax.Array) -> float:
    """max |ours - PyTorch's| over the run, relative to the run's largest |sample|."""
    expected = TRAJECTORIES[case["id"]]
    assert trajectory.shape == expected.shape
    scale = max(np.abs(expected).max(), np.abs(NOISE).max() * case["init_noise_sigma"])
    return float(np.abs(np.asarray(trajectory) - expected).max() / scale)


@pytest.mark.parametrize("case_id", list(CASES), ids=list(CASES))
def test_matches_pytorch_diffusers(case_id: str) -> None:
    case = CASES[case_id]
    if "error" in case:  # PyTorch fails on this config and step count; we refuse it
        with pytest.raises(ValueError):
            scheduler_for(case).set_timesteps(case["steps"], NOISE.shape)
        return
    scheduler = scheduler_for(case)
    state = scheduler.set_timesteps(case["steps"], NOISE.shape)

    # Fractional timesteps may differ in the last bits: torch's float32 sqrt, log and exp are not
    # correctly rounded, and differ with the CPU's vector unit (up to 6.3e-7 measured).
    np.testing.assert_allclose(state.timesteps, case["timesteps"], rtol=1e-6)
    assert state.timesteps.dtype == jnp.float32
    np.testing.assert_allclose(state.init_noise_sigma, case["init_noise_sigma"], rtol=1e-6)
    run = jax.jit(denoise, static_argnums=0) if case_id in JITTED else denoise_eagerly
    trajectory, _ = run(scheduler, state, NOISE)
    assert difference(case, trajectory) <= RTOL


# One run per scheduler with history buffers in use (PRK, order-4 LMS, order-3 DPM) and the stochastic ones.
HISTORY_CASES = ["pndm/sd15-skip_prk_steps=False/7", "ddim/sd21/7", "lms/sd15/7", "euler/sdxl/7",
                 "dpm/sd15-solver_order=3-lower_order_final=False/7", "euler_a/sdxl/7", "lcm/sd15/8"]


@pytest.mark.parametrize("case_id", HISTORY_CASES)
def test_state_shapes_fixed_and_one_trace(case_id: str) -> None:
    case = CASES[case_id]
    scheduler = scheduler_for(case)
    state = scheduler.set_timesteps(case["steps"], NOISE.shape)
    traces = []

    @jax.jit
    def one_step(state: Any, sample: jax.Array, i: jax.Array) -> tuple[jax.Array, Any]:
        traces.append(None)
        output = fake_model(scheduler.scale_model_input(state, sample, i), state.timesteps[i])
        return step(scheduler, state, output, i, sample)

    def layout(tree: Any) -> Any:
        return jax.tree.map(lambda x: (x.shape, x.dtype), tree)

    before, sample, trajectory = layout(state), NOISE * state.init_noise_sigma, []
    for i in range(state.timesteps.shape[0]):  # every phase (warm-up, PRK, final orders) in one program
        sample, state = one_step(state, sample, jnp.int32(i))
        assert layout(state) == before
        trajectory.append(sample)
    assert len(traces) == 1
    assert difference(case, jnp.stack(trajectory)) <= RTOL


@pytest.mark.parametrize("case_id", HISTORY_CASES)
def test_bfloat16_model_keeps_float32_state(case_id: str) -> None:
    case = CASES[case_id]
    scheduler = scheduler_for(case)
    state = scheduler.set_timesteps(case["steps"], NOISE.shape)
    trajectory, state = jax.jit(denoise, static_argnums=(0, 3))(scheduler, state, NOISE, jnp.bfloat16)
    assert trajectory.dtype == jnp.float32
    assert all(x.dtype in (jnp.float32, jnp.int32) for x in jax.tree.leaves(state))
    # The UNet's rounding to bfloat16 (8 bits) moves the run by less than a bfloat16 ulp (2^-7).
    assert difference(case, trajectory) < 1e-2


IMAGE_CASES = {case["id"]: case for case in REFERENCE["image_cases"]}


@pytest.mark.parametrize("mode", ["img2img", "inpaint"])
@pytest.mark.parametrize("case_id", list(IMAGE_CASES))
def test_image_jobs_begun_part_way_match_pytorch_diffusers(case_id: str, mode: str) -> None:
    """Jobs of one batch, each begun at its own loop index (an image job's strength), as the
    generate loop runs them, against PyTorch's img2img and inpaint loops run job by job with
    the scheduler's begin index: each job's history (pndm's calls, lms's derivatives, dpm's
    orders) starts at its own first step."""
    case = IMAGE_CASES[case_id]
    scheduler = make(case["scheduler"], REFERENCE["configs"][case["config"]])
    starts = jnp.asarray(case["starts"], jnp.int32)
    jobs = len(case["starts"])
    latents = jnp.asarray(TRAJECTORIES["image/latents"][:jobs, 0])
    blend = jnp.asarray(TRAJECTORIES["image/mask"][:jobs, 0]) if mode == "inpaint" else None
    inputs = SimpleNamespace(keys=jax.vmap(jax.random.PRNGKey)(jnp.arange(jobs)), guidance=jnp.ones(jobs))
    static = Static(height=0, width=0, steps=case["steps"], guided=False, image=True, mask=mode == "inpaint")

    def predict(x: jax.Array, t: jax.Array) -> jax.Array:
        return fake_model(x, t.reshape(-1, 1, 1, 1))

    ours = jax.jit(lambda latents, blend: sample(predict, scheduler, static, latents, inputs, starts, blend))(
        latents, blend)
    expected = TRAJECTORIES[f"image/{case_id}/{mode}"][:, 0]
    assert np.abs(np.asarray(ours) - expected).max() <= RTOL * np.abs(expected).max()


@pytest.mark.parametrize(("name", "option", "value"), [
    ("pndm", "prediction_type", "sample"),
    ("ddim", "beta_schedule", "sigmoid"),
    ("ddim", "timestep_spacing", "karras"),
    ("lms", "use_beta_sigmas", True),
    ("euler", "interpolation_type", "cubic"),
    ("euler", "timestep_type", "edm"),
    ("euler", "final_sigmas_type", "sigma_max"),
    ("dpm", "algorithm_type", "sde-dpmsolver++"),
    ("dpm", "algorithm_type", "dpmsolver"),
    ("dpm", "solver_order", 4),
    ("dpm", "solver_type", "bh3"),
    ("dpm", "use_flow_sigmas", True),
    ("dpm", "variance_type", "learned_range"),
])
def test_refuses_unsupported_options(name: str, option: str, value: Any) -> None:
    with pytest.raises(ValueError, match=re.escape(f"{option}={value!r} is not supported")):
        make(name, {option: value})


def test_refuses_what_pytorch_fails_on() -> None:
    with pytest.raises(ValueError, match="use_karras_sigmas=True and use_exponential_sigmas=True"):
        make("euler", {"use_karras_sigmas": True, "use_exponential_sigmas": True})
    with pytest.raises(ValueError, match="algorithm_type='deis' needs final_sigmas_type='sigma_min'"):
        make("dpm", {"algorithm_type": "deis"})
    with pytest.raises(ValueError, match="skip_prk_steps=False needs at least 4 steps, not 3"):
        make("pndm", {}).set_timesteps(3, (1,))
    with pytest.raises(ValueError, match="past the 1000 training timesteps"):  # leading: 999 * 1 + 1
        make("ddim", {"steps_offset": 1}).set_timesteps(1000, (1,))
    with pytest.raises(ValueError, match="unknown scheduler 'heun'"):
        make("heun", {})


@pytest.mark.parametrize("schedule", REFERENCE["schedules"])
def test_training_schedule_matches_torch(schedule: str) -> None:
    """Bit for bit (torch.linspace's rounding, a float64 cumprod), except that zero-SNR rescaling
    takes square roots, which torch rounds differently in the last bits, by CPU (up to 3.8e-6
    measured: the rescaled alphas_cumprod near 0 keep few significant bits)."""
    ddim = make("ddim", REFERENCE["schedules"][schedule])
    expected = TRAJECTORIES[f"alphas_cumprod/{schedule}"]
    np.testing.assert_allclose(ddim.alphas_cumprod(ddim.rescale_betas_zero_snr), expected,
                               rtol=1e-5 if ddim.rescale_betas_zero_snr else 0)


@pytest.mark.parametrize("name", SCHEDULER_CLASSES)
def test_options_and_defaults_are_diffusers(name: str) -> None:
    """Each class knows exactly its PyTorch class's options, with its defaults, plus (lms, dpm)
    the sigma bounds diffusers registers from another class's config."""
    ours = {f.name: getattr(make(name, {}), f.name) for f in dataclasses.fields(SCHEDULER_CLASSES[name])}
    theirs = dict(REFERENCE["classes"][name])
    if name in ("lms", "dpm"):
        theirs |= {"sigma_min": None, "sigma_max": None}
    assert ours.keys() == theirs.keys()
    for option, default in theirs.items():
        assert ours[option] == default, option


def test_from_config_semantics() -> None:
    sd15 = REFERENCE["configs"]["sd15"]  # PNDMScheduler's config as an SD 1.5 pipeline holds it
    assert sd15["timestep_spacing"] == "leading" and "timestep_spacing" in sd15["_use_default_values"]
    # PNDM merely defaulted "leading", so Euler takes its own default; SDXL's file says "leading".
    assert make("euler", sd15).timestep_spacing == "linspace"
    assert make("dpm", REFERENCE["configs"]["sdxl"]).timestep_spacing == "leading"
    # Keys the class does not know (clip_sample for Euler, _class_name, anything) are ignored;
    # keys it knows are taken even from another class's config (clip_sample for DDIM).
    euler = make("euler", {**sd15, "clip_sample": True, "made_up": 1, "_class_name": "Nope"})
    assert euler == make("euler", sd15)
    assert make("ddim", sd15).clip_sample is False
    assert make("ddim", {k: v for k, v in sd15.items() if k != "clip_sample"}).clip_sample is True
    # trained_betas (a JSON list) becomes a tuple: schedulers are hashable, static jit arguments.
    hash(make("ddim", REFERENCE["configs"]["trained"]))


def test_every_scheduler_name_is_a_port() -> None:
    """The model layer's scheduler names (diffusion.choices) are the ports' names, in order, and
    the Karras ones are the ports with a sigma schedule."""
    assert tuple(SCHEDULER_CLASSES) == SCHEDULERS
    assert KARRAS_SCHEDULERS == tuple(n for n, c in SCHEDULER_CLASSES.items() if issubclass(c, SigmaScheduleConfig))


def test_job_sampler_fields_override_the_model_config() -> None:
    """A job's timestep_spacing and karras win over the model's scheduler config, even where the
    config lists them as merely defaulted; None keeps the config's; karras=True needs Karras
    sigmas and timestep_spacing does not apply to lcm (diffusion.choices.check_sampler)."""
    sdxl, sd15 = REFERENCE["configs"]["sdxl"], REFERENCE["configs"]["sd15"]
    assert make("euler_a", sdxl, timestep_spacing="trailing").timestep_spacing == "trailing"
    assert make("euler_a", sdxl).timestep_spacing == "leading"
    assert make("euler", sd15, timestep_spacing="leading").timestep_spacing == "leading"  # listed as defaulted
    dpm = make("dpm", sdxl, karras=True)
    assert dpm.use_karras_sigmas and (dpm.solver_order, dpm.algorithm_type) == (2, "dpmsolver++")  # DPM++ 2M Karras
    assert not make("euler", {**sdxl, "use_karras_sigmas": True}, karras=False).use_karras_sigmas
    assert make("ddim", sd15, karras=False) == make("ddim", sd15)
    with pytest.raises(ValueError, match=r"karras=True: needs a scheduler with Karras sigmas \(lms, euler, dpm\), not euler_a"):
        make("euler_a", sdxl, karras=True)
    with pytest.raises(ValueError, match="timestep_spacing='trailing': does not apply to lcm"):
        make("lcm", sd15, timestep_spacing="trailing")
