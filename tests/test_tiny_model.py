"""The tiny random-weight pipelines: built offline in seconds, the same files for the same
seed, loaded by the same code as real models, and a batch renders in any position alike."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from diffusion.families import latent_unet
from diffusion.family import Geometry
from diffusion.models import load_model
from diffusion.tiny import build_tiny_model
from renderfarm.jobs import JobSpec
from worker.engine import Engine


def _files(path: pathlib.Path) -> dict[str, bytes]:
    return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()}


@pytest.mark.parametrize("kind", ["sd", "sdxl"])
def test_builds_deterministically_and_loads_as_real_models_do(tmp_path: pathlib.Path, kind: str) -> None:
    first = build_tiny_model(tmp_path / "a", kind=kind, seed=0)
    assert _files(first) == _files(build_tiny_model(tmp_path / "b", kind=kind, seed=0))
    assert _files(first) != _files(build_tiny_model(tmp_path / "c", kind=kind, seed=1))
    assert not list(first.rglob("*.safetensors")) and list(first.rglob("*.msgpack"))  # Flax's format
    model = load_model(str(first))
    assert (model.family.name, model.native_size, model.size_step) == (kind, 64, 16)
    assert model.family.geometry(model.networks) == Geometry(native_size=64, size_step=16)
    assert len(model.tokenizers) == (2 if kind == "sdxl" else 1)
    ids, cut = latent_unet.tokenize(model.tokenizers, ["Ünïcödé prompt: 猫 🐈, \x00 tab\tand a very long tail " * 5, "a fox"])
    assert ids.shape == (2, len(model.tokenizers), 77) and cut == [True, False]


def test_a_job_renders_the_same_alone_and_in_a_batch(sd_engine: Engine) -> None:
    model = sd_engine.model
    specs = [JobSpec(prompt=f"a lighthouse {i}", model=model.ref, seed=i, steps=3) for i in range(8)]
    batch = sd_engine.render(specs)
    alone = sd_engine.render([specs[5]])[0]
    assert np.abs(batch[5].image.astype(int) - alone.image.astype(int)).max() <= 1
    assert len({r.image.tobytes() for r in batch}) == 8
