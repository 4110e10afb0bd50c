"""The tiny random-weight pipelines load and render through the real diffusers Flax pipeline classes."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import pathlib

import jax
import numpy as np
import pytest
import transformers
from diffusers import FlaxStableDiffusionPipeline, FlaxStableDiffusionXLPipeline
from diffusers.utils import logging as diffusers_logging
from transformers import FlaxCLIPTextModelWithProjection

from worker.tiny import build_tiny_model


def _load(path: pathlib.Path, kind: str):
    if kind == "sd":
        return FlaxStableDiffusionPipeline.from_pretrained(path, safety_checker=None, feature_extractor=None)
    return FlaxStableDiffusionXLPipeline.from_pretrained(path)


def _files(path: pathlib.Path) -> dict[str, bytes]:
    return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()}


@pytest.mark.parametrize("kind", ["sd", "sdxl"])
def test_builds_loads_and_renders(tmp_path, kind):
    pipeline, params = _load(build_tiny_model(tmp_path / kind, kind=kind, seed=0), kind)

    assert pipeline.vae_scale_factor == 8
    assert pipeline.unet.config.sample_size * pipeline.vae_scale_factor == 64
    if kind == "sdxl":
        assert isinstance(pipeline.text_encoder_2, FlaxCLIPTextModelWithProjection)
    prompt_ids = pipeline.prepare_inputs(["Ünïcödé prompt: 猫 🐈, \x00 tab\tand a very long tail " * 5])
    assert prompt_ids.shape[-1] == 77

    images = pipeline(prompt_ids, params, jax.random.PRNGKey(0), num_inference_steps=2, height=64, width=64).images
    images = np.asarray(images)
    assert images.shape == (1, 64, 64, 3)
    assert np.isfinite(images).all()


@pytest.mark.parametrize("kind", ["sd", "sdxl"])
def test_weights_depend_only_on_seed(tmp_path, kind):
    first = _files(build_tiny_model(tmp_path / "a", kind=kind, seed=0))
    again = _files(build_tiny_model(tmp_path / "b", kind=kind, seed=0))
    other = _files(build_tiny_model(tmp_path / "c", kind=kind, seed=1))

    assert first == again
    assert first.keys() == other.keys()
    weights = [name for name in first if name.endswith(".msgpack")]
    assert len(weights) == (3 if kind == "sd" else 4)
    assert all(first[name] != other[name] for name in weights)


def test_build_is_silent_and_restores_log_levels(tmp_path, capfd):
    jax.devices()  # backend start-up messages, if any, are not the builder's
    capfd.readouterr()
    before = diffusers_logging.get_verbosity(), transformers.logging.get_verbosity()

    build_tiny_model(tmp_path / "sd", kind="sd")

    assert capfd.readouterr() == ("", "")
    assert (diffusers_logging.get_verbosity(), transformers.logging.get_verbosity()) == before


def test_rejects_unknown_kind(tmp_path):
    with pytest.raises(ValueError, match="kind"):
        build_tiny_model(tmp_path, kind="sd3")
