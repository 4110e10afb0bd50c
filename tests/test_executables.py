"""Saved executables (worker.executables): a new engine loads instead of compiling, renders
the same pixels, and never takes a program made for another model, shape or batch."""

from __future__ import annotations

import dataclasses
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from diffusion.models import LoadedModel
from harness.farm import STEPS
from renderfarm.jobs import JobError, JobSpec
from tests.helpers import engine as session_engine
from worker.engine import Engine, ShapeKey
from worker.executables import ExecutableStore


# Three devices, which no other test renders on: the store's programs are compiled here, not
# found in the session's persistent cache (a program taken from it is not saved).
DEVICES = jax.local_devices()[:3]


def spec(model: LoadedModel, **fields: object) -> JobSpec:
    # A shape no other test compiles, so the store fixture's first compile is its own.
    return JobSpec(**{"prompt": "a lighthouse at dusk", "model": model.ref, "seed": 7, "steps": STEPS,
                      "width": 48, "height": 48, **fields})


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory, sd_model: LoadedModel) -> Engine:
    """An engine that compiled the default shape's programs and saved them in a store of its own."""
    engine = Engine(sd_model, executables=ExecutableStore(tmp_path_factory.mktemp("executables")), devices=DEVICES)
    engine.compiled(engine.check(spec(sd_model)))
    assert engine.executables.loaded == 0 and engine.compiles == 2
    assert len(list(engine.executables.folder.iterdir())) == 2  # the text encoders' and the shape's
    return engine


@pytest.fixture(scope="module")
def store(first: Engine) -> ExecutableStore:
    """A store holding the executables of the default shape, saved by a first engine."""
    return first.executables


def test_a_new_engine_loads_the_saved_program_and_renders_the_same(
        store: ExecutableStore, first: Engine, sd_model: LoadedModel) -> None:
    loaded_before = store.loaded
    second = Engine(sd_model, executables=store, devices=DEVICES)
    jobs = [spec(sd_model, seed=s, guidance_scale=2.0 + s) for s in range(3)]
    images = [r.image for r in second.render(jobs)]
    assert store.loaded == loaded_before + 2 and second.compile_seconds == 0
    for image, reference in zip(images, (r.image for r in first.render(jobs))):
        np.testing.assert_array_equal(image, reference)
    per_job = [engine.flops(engine.check(jobs[0])) / engine.batch_size for engine in (second, first)]
    assert per_job[0] == pytest.approx(per_job[1], rel=1e-6)  # the saved count, as XLA counted it


def test_program_names_change_with_everything_the_program_depends_on(sd_model: LoadedModel,
                                                                     tmp_path: Path) -> None:
    engine = Engine(sd_model)
    key = engine.check(spec(sd_model))
    name = engine._program_name(key)  # noqa: SLF001
    assert engine._program_name(dataclasses.replace(key)) == name  # noqa: SLF001 - stable
    for other in (dataclasses.replace(key, steps=key.steps + 1), dataclasses.replace(key, width=key.width + 16),
                  dataclasses.replace(key, scheduler="ddim")):
        assert engine._program_name(other) != name  # noqa: SLF001
    assert Engine(sd_model, per_device_batch=2)._program_name(key) != name  # noqa: SLF001
    assert Engine(sd_model, devices=engine.devices[:4])._program_name(key) != name  # noqa: SLF001
    # Another architecture (here: another scheduler config) is another program ...
    other_config = {**sd_model.configs["scheduler"], "beta_end": 0.02}
    changed = dataclasses.replace(sd_model, configs={**sd_model.configs, "scheduler": other_config})
    assert Engine(changed)._program_name(key) != name  # noqa: SLF001
    # ... but other weights of the same architecture are only other inputs.
    reweighted = dataclasses.replace(sd_model, params={**sd_model.params,
                                                       "unet": jax.tree.map(lambda w: w * 2, sd_model.params["unet"])})
    assert Engine(reweighted)._program_name(key) == name  # noqa: SLF001


def test_program_names_cover_the_device_side_code() -> None:
    """A change to any code the traced program runs (the engine, the model layer's loop,
    networks, schedulers and families) names other programs, so no stale one is loaded."""
    from worker.executables import _environment

    code = _environment()["code"]
    for path in ("worker/engine.py", "diffusion/generate.py", "diffusion/nn/unet.py", "diffusion/nn/flux.py",
                 "diffusion/schedulers/ddim.py", "diffusion/families/sdxl.py", "diffusion/sharding.py"):
        assert path in code, path
    assert not any(path.startswith(("worker/broker", "renderfarm/", "producer/")) for path in code)


def test_an_unreadable_saved_program_is_compiled_again(first: Engine, sd_model: LoadedModel, tmp_path: Path) -> None:
    broken = ExecutableStore(tmp_path / "broken")
    engine = Engine(sd_model, executables=broken, devices=DEVICES)
    key: ShapeKey = engine.check(spec(sd_model))
    (broken.folder / f"{engine._program_name(key)}.xla").write_bytes(b"not an executable")  # noqa: SLF001
    image = engine.render([spec(sd_model)])[0].image
    assert broken.loaded == 0
    np.testing.assert_array_equal(image, first.render([spec(sd_model)])[0].image)
    assert not any(broken.folder.iterdir())  # the broken entry is gone, not tried again


def test_weights_that_do_not_match_their_config_are_refused_by_name(store: ExecutableStore,
                                                                    sd_model: LoadedModel) -> None:
    """The loader checks a checkpoint's shapes (tests/test_weights.py); weights put together
    by other means fit no saved program and fail to compile, by name."""
    unet = {**sd_model.params["unet"], "conv_in": {**sd_model.params["unet"]["conv_in"]}}
    unet["conv_in"]["bias"] = np.zeros(unet["conv_in"]["bias"].shape[0] + 1, np.float32)
    broken = dataclasses.replace(sd_model, params={**sd_model.params, "unet": unet})
    loaded_before = store.loaded
    engine = Engine(broken, executables=store, devices=DEVICES)
    with pytest.raises(JobError) as err:
        engine.compiled(engine.check(spec(sd_model)))
    assert err.value.field == "model" and "conv_in" in err.value.rule and "bias" in err.value.rule
    assert store.loaded == loaded_before + 2  # the text encoders' taken, the shape's read and then not used


def test_programs_beyond_max_programs_are_evicted_least_recently_used_first(sd_model: LoadedModel) -> None:
    """What is kept in memory is at most two programs. They are shapes other tests render on every
    device (tests/test_flops.py), saved in the session's compile cache: loading them is cheap."""
    engine = session_engine(sd_model, max_programs=2)
    keys = [ShapeKey(64, 64, STEPS, "pndm"), ShapeKey(64, 64, STEPS, "pndm", guided=False),
            ShapeKey(64, 64, 2 * STEPS, "pndm")]
    engine.compiled(keys[0])
    engine.compiled(keys[1])
    engine.compiled(keys[0])  # used again: keys[1] is now the least recently used
    engine.compiled(keys[2])
    assert [engine.ready(key) for key in keys] == [True, False, True]
    with pytest.raises(JobError, match="max_programs=0: must be at least 1"):
        Engine(sd_model, max_programs=0)


def test_saved_executables_stay_within_their_cap(tmp_path: Path, store: ExecutableStore) -> None:
    capped = ExecutableStore(tmp_path / "capped", max_bytes=3000)
    for n, age in enumerate((300, 200, 100)):  # oldest first
        path = capped.folder / f"old{n}.xla"
        path.write_bytes(b"x" * 1000)
        os.utime(path, (time.time() - age, time.time() - age))
    capped._evict()
    assert sorted(p.name for p in capped.folder.iterdir()) == ["old0.xla", "old1.xla", "old2.xla"]
    (capped.folder / "new.xla").write_bytes(b"x" * 1000)
    capped._evict()
    assert sorted(p.name for p in capped.folder.iterdir()) == ["new.xla", "old1.xla", "old2.xla"]


def test_jaxs_cache_is_cut_to_its_cap_when_a_process_turns_it_on(tmp_path: Path) -> None:
    """Least recently used entries first; what is not an entry stays; and JAX keeps no cap of
    its own, whose bookkeeping locks every read and lists the folder at every write."""
    folder = tmp_path / "jax"
    folder.mkdir(mode=0o700)
    for n, age in enumerate((300, 200, 100)):  # oldest first
        path = folder / f"old{n}-cache"
        path.write_bytes(b"x" * 1000)
        os.utime(path, (time.time() - age, time.time() - age))
    (folder / "notes.txt").write_bytes(b"x" * 5000)
    code = ("import sys, jax; from worker.engine import enable_compilation_cache; "
            "enable_compilation_cache(sys.argv[1], max_bytes=2500); print(jax.config.jax_compilation_cache_max_size)")
    done = subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["-1"]
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt", "old1-cache", "old2-cache"]


def test_a_cache_folder_others_can_write_to_is_refused(tmp_path: Path) -> None:
    from worker.engine import enable_compilation_cache

    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(JobError, match=r"compile_cache=.*shared.*must not be writable by group or others \(mode 777"):
        ExecutableStore(shared)
    with pytest.raises(JobError, match="must not be writable by group or others"):
        enable_compilation_cache(shared)
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o700)
    os.chown(foreign, 65534, 65534)  # nobody's
    with pytest.raises(JobError, match="must belong to the worker's user"):
        ExecutableStore(foreign)
    fresh = ExecutableStore(tmp_path / "new" / "folder")
    assert stat.S_IMODE(fresh.folder.stat().st_mode) == 0o700
