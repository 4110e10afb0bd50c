"""The engine against the reproducibility contract (DESIGN.md) and its compile-once promise."""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from renderfarm.jobs import JobSpec
from tests.conftest import STEPS
from worker.engine import Engine, scheduler_classes
from worker.models import LoadedModel
from worker.png import encode_png, paeth_filter

TOLERANCE = 2  # out of 255, per channel (the contract)


def job(model: LoadedModel, i: int, **fields: object) -> JobSpec:
    base = dict(prompt=f"a lighthouse number {i}, oil painting", model=model.ref, seed=1000 + i,
                steps=STEPS, negative_prompt="blurry" if i % 2 else "", guidance_scale=1.5 + i)
    return JobSpec(**{**base, **fields})


def reference(model: LoadedModel, spec: JobSpec, scheduler: str | None = None) -> np.ndarray:
    """What plain diffusers returns for one prompt, unjitted, given the contract's latents."""
    pipe, params = model.pipe, dict(model.params)
    if scheduler is not None:
        sched = scheduler_classes()[scheduler].from_config(pipe.scheduler.config)
        pipe = type(pipe)(**{**pipe.components, "scheduler": sched}, dtype=pipe.dtype)
        params["scheduler"] = sched.create_state()
    size = model.native_size
    f = pipe.vae_scale_factor
    latents = jax.random.normal(jax.random.PRNGKey(spec.seed),
                                (1, pipe.unet.config.in_channels, size // f, size // f), jnp.float32)
    prompt_ids = pipe.prepare_inputs([spec.prompt])
    negative_ids = pipe.prepare_inputs([spec.negative_prompt]) if spec.negative_prompt else None
    images = pipe(prompt_ids, params, jax.random.PRNGKey(0), num_inference_steps=spec.steps,
                  height=size, width=size, guidance_scale=spec.guidance_scale, latents=latents,
                  neg_prompt_ids=negative_ids, jit=False).images
    return np.asarray((np.asarray(images[0], np.float32) * 255).round(), np.uint8)


def max_diff(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max())


@pytest.mark.parametrize("family", ["sd", "sdxl"])
def test_reproducibility_contract(family: str, request: pytest.FixtureRequest) -> None:
    model: LoadedModel = request.getfixturevalue(f"{family}_model")
    engine: Engine = request.getfixturevalue(f"{family}_engine")
    assert engine.batch_size == 8 == len(jax.devices())
    batch = [job(model, i) for i in range(8)]
    # Job 3 has a negative prompt, job 4 an empty one (SDXL treats those differently).
    for target in (batch[3], batch[4]):
        expected = reference(model, target)
        alone = engine.render([target])[0].image
        full = engine.render(batch)[batch.index(target)].image
        moved = engine.render(batch[::-1])[7 - batch.index(target)].image
        one_device = Engine(model, devices=jax.devices()[:1]).render([target])[0].image
        for name, got in (("alone", alone), ("in a full batch", full),
                          ("at another position", moved), ("on one device", one_device)):
            assert got.shape == (model.native_size, model.native_size, 3)
            assert max_diff(got, expected) <= TOLERANCE, f"{family} job {name} differs from diffusers"
        assert max_diff(alone, full) <= 1 and max_diff(full, moved) <= 1
    # Different jobs in one batch really are different images.
    images = [r.image for r in engine.render(batch)]
    assert max_diff(images[0], images[1]) > 10


@pytest.mark.parametrize("family", ["sd", "sdxl"])
def test_the_devices_filter_png_scanlines_as_the_host_would(family: str, request: pytest.FixtureRequest) -> None:
    model: LoadedModel = request.getfixturevalue(f"{family}_model")
    engine: Engine = request.getfixturevalue(f"{family}_engine")
    for rendered in engine.render([job(model, i) for i in range(3)]):
        height, width, _ = rendered.image.shape
        rows = rendered.image.reshape(height, width * 3)
        assert rendered.scanlines is not None
        assert np.array_equal(rendered.scanlines, paeth_filter(rows, 3))
        assert encode_png(rendered.image, scanlines=rendered.scanlines) == encode_png(rendered.image)


def test_each_scheduler_matches_diffusers(sd_model: LoadedModel, sd_engine: Engine) -> None:
    spec = job(sd_model, 5)
    for name in ("ddim", "lms", "euler", "dpm"):
        got = sd_engine.render([JobSpec(**{**spec.to_dict(), "scheduler": name})])[0]
        assert got.key.scheduler == name
        assert max_diff(got.image, reference(sd_model, spec, name)) <= TOLERANCE, name


def test_no_recompilation_across_batches(sd_model: LoadedModel, sd_engine: Engine) -> None:
    sd_engine.render([job(sd_model, 0)])  # compiled (or already compiled) here
    events: list[str] = []

    def listen(event: str, *args: object, **kwargs: object) -> None:
        if event.startswith(("/jax/core/compile", "/jax/compilation_cache")):
            events.append(event)

    jax.monitoring.register_event_listener(listen)
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        for b in range(3):
            batch = [job(sd_model, 10 * b + i, seed=7 * b + i, guidance_scale=0.5 * i + b,
                         negative_prompt=f"neg {b} {i}" * (i % 3)) for i in range(8)]
            assert len(sd_engine.render(batch)) == 8
    finally:
        jax.monitoring.unregister_event_listener(listen)
        jax.monitoring.unregister_event_duration_listener(listen)
    assert events == [], f"recompiled: {events}"


def test_truncated_prompt_is_recorded(sd_model: LoadedModel, sd_engine: Engine) -> None:
    long_prompt = " ".join(["lighthouse"] * 200)
    results = sd_engine.render([job(sd_model, 0, prompt=long_prompt), job(sd_model, 1)])
    assert [r.truncated for r in results] == [True, False]


def test_a_second_process_starts_warm(tiny_sd, tmp_path) -> None:  # noqa: ANN001
    """A second process loads the first one's saved executable; without it, it still finds
    XLA's compile in JAX's persistent cache. Both live in the private cache folder."""
    cache = tmp_path / "cache"
    command = [sys.executable, "-m", "renderfarm.cli", "render", "a red fox", "--model", str(tiny_sd),
               "--out", str(tmp_path / "out"), "--seed", "1", "--steps", "2",
               "--compile-cache", str(cache), "--quiet"]

    def run() -> str:
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        return done.stdout + done.stderr

    assert "(1 programs: 0 saved executables loaded, 0 from the persistent cache)" in run()
    assert "(1 programs: 1 saved executables loaded, 0 from the persistent cache)" in run()
    for saved in (cache / "executables").iterdir():
        saved.unlink()
    assert "(1 programs: 0 saved executables loaded, 1 from the persistent cache)" in run()
    assert oct(cache.stat().st_mode & 0o777) == oct(0o700)
    assert oct((cache / "executables").stat().st_mode & 0o777) == oct(0o700)


@pytest.mark.parametrize("family", ["sd", "sdxl"])
def test_tokenize_matches_prepare_inputs(family: str, request: pytest.FixtureRequest) -> None:
    model: LoadedModel = request.getfixturevalue(f"{family}_model")
    engine: Engine = request.getfixturevalue(f"{family}_engine")
    texts = ["", "a fox", "émoji 🦊 and\ttabs", "lighthouse " * 40]
    ids, truncated = engine.tokenize(texts)
    assert np.array_equal(ids, np.asarray(model.pipe.prepare_inputs(texts)))
    assert truncated == [False, False, False, True]
