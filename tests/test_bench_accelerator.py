"""bench/accelerator.py: the torch-free PyTorch-format writer names tensors as diffusers and
transformers do, its --smoke run prints sane figures, and the engine reports peak device memory."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import jax
import pytest
from flax.traverse_util import flatten_dict
from safetensors import safe_open

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "accelerator.py"
ORACLE = ROOT / "tests" / "data" / "oracle"
FIGURES = ("load:", "compile: cold", "warm start:", "steady state:", "FLOPs per image:", "peak device memory:")


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_accelerator", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


@pytest.mark.parametrize("name", ["sd1", "sd2", "sdxl"])
def test_torch_names_and_shapes_are_diffusers_own(name: str) -> None:
    """The writer's names and shapes for our parameters are exactly those of the oracle's
    checkpoints, which diffusers' and transformers' save_pretrained wrote."""
    from diffusion.families import detect

    bench, folder = _bench(), ORACLE / name / "model"
    family = detect(str(folder), json.loads((folder / "model_index.json").read_text()))
    for component, spec in family.components.items():
        module = spec.module(spec.config.from_dict(json.loads((folder / component / "config.json").read_text())))
        shapes = flatten_dict(jax.eval_shape(module.init_params, jax.random.PRNGKey(0)))
        ours = {bench._torch_name(spec.kind, path): bench._torch_shape(path[-1], tuple(leaf.shape))
                for path, leaf in shapes.items()}
        file = "model.safetensors" if spec.kind.startswith("clip") else "diffusion_pytorch_model.safetensors"
        with safe_open(str(folder / component / file), "np") as saved:
            theirs = {key: tuple(saved.get_slice(key).get_shape()) for key in saved.keys()}  # noqa: SIM118
        theirs.pop("text_model.embeddings.position_ids", None)  # a buffer, not a parameter
        assert ours == theirs, f"{name}/{component}"


def _smoke(tmp_path: Path, *extra: str) -> tuple[str, dict[str, Any]]:
    out = tmp_path / "figures.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("RENDERFARM_PEAK_TFLOPS", None)
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--json", str(out), "--workdir",
                           str(tmp_path / "work"), *extra], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout, json.loads(out.read_text())


def _check_ours(stdout: str, figures: dict[str, Any]) -> None:
    assert set(figures["models"]) == {"sd15", "sdxl"}
    for label in ("SD 1.5 64x64", "SDXL 64x64"):
        assert label in stdout
    for line in FIGURES:
        assert stdout.count(line) == 2, line
    assert stdout.count("peak device memory: not reported (the cpu backend gives no memory_stats)") == 2
    for name, model in figures["models"].items():
        cold, warm = model["cold"], model["warm"]
        for key in ("load_seconds", "compile_seconds", "program_seconds", "first_batch_seconds",
                    "images_per_second", "flops_per_image", "xla_temp_bytes"):
            assert cold[key] > 0, (name, key, cold[key])
        assert model["folder"]["bytes"] > 0
        assert cold["steady_images"] == 2 * cold["batch"]
        assert cold["compile_seconds"] > 0 and not cold["saved_executable_loaded"]
        # the warm process served its first batch from the saved executable, compiling nothing
        assert warm["saved_executable_loaded"] and warm["program_seconds"] > 0
        assert warm["program_seconds"] < cold["compile_seconds"]
        assert cold["peak_bytes"] is None and "fraction_of_peak" not in cold  # no peak known for a CPU
        assert cold["platform"] == "cpu" and cold["devices"] == 1


def test_smoke_prints_sane_figures(tmp_path: Path) -> None:
    stdout, figures = _smoke(tmp_path)
    _check_ours(stdout, figures)
    assert "ours / theirs" not in stdout


@pytest.mark.skipif(importlib.util.find_spec("torch") is None or importlib.util.find_spec("diffusers") is None,
                    reason="the peer needs torch and diffusers, which the worker's venv does not have")
def test_smoke_with_the_peer(tmp_path: Path) -> None:
    stdout, figures = _smoke(tmp_path, "--peer")
    _check_ours(stdout, figures)
    assert stdout.count("ours / theirs (images/s per device):") == 2
    for model in figures["models"].values():
        assert model["peer"]["images_per_second"] > 0 and model["peer"]["load_seconds"] > 0
        assert model["ratio"] > 0


class _Device:
    platform, device_kind = "gpu", "stand-in"

    def __init__(self, peak: int | None) -> None:
        self.peak = peak

    def memory_stats(self) -> dict[str, int] | None:
        return None if self.peak is None else {"peak_bytes_in_use": self.peak, "bytes_limit": 80 * 10**9}


def test_engine_reports_peak_device_memory_once_per_shape(sd_model: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Read after a shape's first batch: the largest of the devices' peaks; None where the
    backend gives no memory statistics (the CPU's)."""
    from renderfarm.jobs import JobSpec
    from worker.engine import Engine

    engine = Engine(sd_model)
    key = engine.check(JobSpec(prompt="p", model=sd_model.ref, seed=0, steps=2))
    assert engine.peak_memory(key) is None
    with caplog.at_level(logging.INFO, logger="worker.engine"):
        engine._record_peak_memory(key)  # the CPU's devices: no statistics
        assert engine.peak_memory(key) is None and "peak device memory not reported (the cpu backend" in caplog.text
        other = engine.check(JobSpec(prompt="p", model=sd_model.ref, seed=0, steps=3))
        engine.devices = [_Device(5 * 10**9), _Device(7 * 10**9)]
        engine._record_peak_memory(other)
        assert engine.peak_memory(other) == 7 * 10**9
        assert "peak device memory 7.00 GB after its first batch (of 80.00 GB)" in caplog.text
        engine.devices = [_Device(9 * 10**9)]
        engine._record_peak_memory(other)  # once per shape: the first batch's figure stays
        assert engine.peak_memory(other) == 7 * 10**9
