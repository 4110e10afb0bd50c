"""Weights split over a model axis (diffusion/sharding.py): the same images whatever the
mesh, on 8 CPU devices, and the split chosen from the devices' memory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from diffusion.models import load_model
from diffusion.sharding import MODEL, choose_model_parallel, make_mesh, weight_shardings, weight_spec
from renderfarm.jobs import JobError, JobSpec
from worker.engine import Engine

PROMPTS = ["a red fox in snow", "a lighthouse at dusk", "a bowl of ramen", "", "a fox", "snow", "dusk", "ramen"]


def test_each_weight_is_split_on_its_largest_axis_that_divides() -> None:
    assert weight_spec((320, 4, 3, 3), 8) == PartitionSpec(MODEL, None, None, None)
    assert weight_spec((3, 3, 4, 320), 4) == PartitionSpec(None, None, None, MODEL)
    assert weight_spec((64, 64), 2) == PartitionSpec(MODEL, None)  # the first of equals
    assert weight_spec((77, 5), 4) == PartitionSpec()  # nothing divides: replicated
    assert weight_spec((), 8) == PartitionSpec()
    assert weight_spec((320, 4), 1) == PartitionSpec()


def test_the_split_is_the_fewest_devices_whose_memory_holds_the_weights() -> None:
    gb = 10**9
    assert choose_model_parallel(24 * gb, 16 * gb, 8) == 4  # Flux's transformer in bf16 on v5e chips
    assert choose_model_parallel(2 * gb, 80 * gb, 8) == 1  # SD 1.5 on H100s: whole copies
    assert choose_model_parallel(100 * gb, None, 8) == 1  # no memory limit reported (CPU)
    assert choose_model_parallel(25 * gb, 16 * gb, 6) == 6  # divisors of 6: 1, 2, 3 (8.3 GB each: too many), 6
    with pytest.raises(ValueError, match="do not fit 8 devices of 16.0 GB"):
        choose_model_parallel(200 * gb, 16 * gb, 8)
    with pytest.raises(ValueError, match="must divide the 8 devices"):
        make_mesh(jax.devices(), 3)


@pytest.fixture(scope="module")
def images_by_mesh(tiny_sd: Path) -> dict[int, np.ndarray]:
    """The same 8 jobs rendered with the weights whole on each device (8x1), split over 4
    (2x4) and over all 8 (1x8)."""
    out = {}
    for model_parallel in (1, 4, 8):
        model = load_model(str(tiny_sd), model_parallel=model_parallel)
        engine = Engine(model)
        specs = [JobSpec(prompt=p, seed=n, steps=3, guidance_scale=7.5, width=64, height=64, model=str(tiny_sd))
                 for n, p in enumerate(PROMPTS)]
        out[model_parallel] = np.stack([r.image for r in engine.render(specs)])
        assert engine.batch_size == 8 // model_parallel
    return out


def test_split_weights_live_in_shards(tiny_sd: Path) -> None:
    model = load_model(str(tiny_sd), model_parallel=4)
    assert model.model_parallel == 4
    kernel = model.params["unet"]["conv_in"]["kernel"]  # (3, 3, 4, 32): split over its 32 channels
    assert {shard.data.shape for shard in kernel.addressable_shards} == {(3, 3, 4, 8)}
    expected = weight_shardings(model.params, make_mesh(jax.devices(), 4))
    assert jax.tree.all(jax.tree.map(lambda a, s: a.sharding.is_equivalent_to(s, a.ndim), model.params, expected))


def test_every_mesh_renders_the_same_images(images_by_mesh: dict[int, np.ndarray]) -> None:
    whole = images_by_mesh[1].astype(int)
    assert len({image.tobytes() for image in images_by_mesh[1]}) == len(PROMPTS)
    for model_parallel in (4, 8):
        assert np.abs(images_by_mesh[model_parallel].astype(int) - whole).max() <= 1, model_parallel


def test_a_split_that_does_not_divide_the_devices_is_refused(tiny_sd: Path) -> None:
    with pytest.raises(JobError, match=r"model_parallel=3: must divide the 8 devices"):
        load_model(str(tiny_sd), model_parallel=3)


def test_render_splits_the_weights_when_told(tiny_sd: Path, tmp_path: Path,
                                             images_by_mesh: dict[int, np.ndarray]) -> None:
    from PIL import Image

    done = subprocess.run([sys.executable, "-m", "renderfarm_cli", "render", "--model", str(tiny_sd), "--out",
                           str(tmp_path), "--campaign", "split", "--seed", "0", "--steps", "3", "--width", "64",
                           "--height", "64", "--model-parallel", "4", "--quiet", "a red fox in snow"],
                          capture_output=True, text=True, env=os.environ, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "on 8 cpu devices (batch 2)" in done.stdout  # two copies of the weights, a job each
    [png] = [p for p in (tmp_path / "split").glob("*.png") if p.stem != "preview"]
    assert np.abs(np.asarray(Image.open(png)).astype(int) - images_by_mesh[1][0].astype(int)).max() <= 1
