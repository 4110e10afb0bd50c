"""One loader for every model reference: local folder, gs:// folder, hub id@revision (offline)."""

from __future__ import annotations

import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from renderfarm.jobs import JobError
from renderfarm.storage import open_storage
from tests.gcs_emulator import GcsEmulator
from worker.models import LoadedModel, load_model


def same_params(a: LoadedModel, b: LoadedModel) -> bool:
    leaves_a, leaves_b = jax.tree.leaves(a.params["unet"]), jax.tree.leaves(b.params["unet"])
    return len(leaves_a) == len(leaves_b) and all(
        np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(leaves_a, leaves_b))


def test_local_folder(sd_model: LoadedModel, sdxl_model: LoadedModel) -> None:
    assert (sd_model.family, sdxl_model.family) == ("sd", "sdxl")
    assert sd_model.native_size == 64 and sd_model.revision is None
    assert type(sdxl_model.pipe).__name__ == "FlaxStableDiffusionXLPipeline"


def test_gcs_folder_copied_once(tiny_sd: Path, sd_model: LoadedModel, gcs: GcsEmulator) -> None:
    gcs.create_bucket("models")
    bucket = open_storage("gs://models/tiny-sd")
    for path in tiny_sd.rglob("*"):
        if path.is_file():
            bucket.put(path.relative_to(tiny_sd).as_posix(), path.read_bytes())
    loaded = load_model("gs://models/tiny-sd")
    assert loaded.family == "sd" and same_params(loaded, sd_model)
    gcs.stop()  # a second load needs no bucket: it is served from the local cache
    try:
        assert same_params(load_model("gs://models/tiny-sd"), sd_model)
    finally:
        gcs.start()


def test_hub_id_with_revision_offline(tiny_sd: Path, sd_model: LoadedModel) -> None:
    """Lay out a hub cache as huggingface_hub does, then load `org/name@revision` offline."""
    from huggingface_hub import constants

    assert constants.HF_HUB_OFFLINE
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = Path(constants.HF_HUB_CACHE) / "models--acme--tiny-sd"
    shutil.copytree(tiny_sd, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "v1").write_text(commit)
    loaded = load_model("acme/tiny-sd@v1")
    assert (loaded.ref, loaded.revision, loaded.family) == ("acme/tiny-sd@v1", commit, "sd")
    assert same_params(loaded, sd_model)
    with pytest.raises(JobError, match="model='acme/tiny-sd@v2'"):
        load_model("acme/tiny-sd@v2")


def test_not_a_pipeline_folder(tmp_path: Path) -> None:
    (tmp_path / "weights").mkdir()
    with pytest.raises(JobError) as err:
        load_model(str(tmp_path / "weights"))
    assert err.value.field == "model" and "model_index.json" in err.value.rule


def test_bfloat16_keeps_scheduler_float32(tiny_sd: Path) -> None:
    model = load_model(str(tiny_sd), dtype="bfloat16")
    assert {x.dtype for x in jax.tree.leaves(model.params["unet"])} == {jnp.dtype(jnp.bfloat16)}
    floats = [x for x in jax.tree.leaves(model.params["scheduler"]) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert floats and {x.dtype for x in floats} == {jnp.dtype(jnp.float32)}
