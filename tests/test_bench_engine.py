"""bench/engine.py's device part: its --smoke run (SD 1.5, SDXL and Flux schnell, tiny) prints sane
figures, with diffusers' pipelines beside it where torch is installed, and the engine reports
peak device memory."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "engine.py"
MODELS = {"sd15": "SD 1.5 64x64", "sdxl": "SDXL 64x64", "flux-schnell": "Flux.1 schnell 64x64"}
FIGURES = ("load:", "compile: cold", "warm start:", "steady state:", "FLOPs per image:", "peak device memory:")


def _smoke(tmp_path: Path, *extra: str) -> tuple[str, dict[str, Any]]:
    out = tmp_path / "figures.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("RENDERFARM_PEAK_TFLOPS", None)
    proc = subprocess.run([sys.executable, str(SCRIPT), "device", "--smoke", "--json", str(out), "--workdir",
                           str(tmp_path / "work"), *extra], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout, json.loads(out.read_text())


def _check_ours(stdout: str, figures: dict[str, Any]) -> None:
    assert set(figures["models"]) == set(MODELS)
    for label in MODELS.values():
        assert label in stdout
    for line in FIGURES:
        assert stdout.count(line) == len(MODELS), line
    assert stdout.count("peak device memory: not reported (the cpu backend gives no memory_stats)") == len(MODELS)
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


# The peer's torch and diffusers: this venv's, else the oracle's (`make oracle`), run as a separate interpreter.
ORACLE_PYTHON = ROOT / "build" / "oracle-venv" / "bin" / "python"
PEER_PYTHON = (sys.executable if importlib.util.find_spec("torch") and importlib.util.find_spec("diffusers")
               else str(ORACLE_PYTHON) if ORACLE_PYTHON.is_file() else None)


@pytest.mark.bench  # three families compiled and timed, with diffusers beside them: left out of make check
def test_smoke_prints_sane_figures(tmp_path: Path) -> None:
    """Ours for the three families, and diffusers' pipelines on the same folders beside them
    where torch is installed (one run: the smoke is the slow part)."""
    peer = ("--peer", "--peer-python", PEER_PYTHON) if PEER_PYTHON else ()
    stdout, figures = _smoke(tmp_path, *peer)
    _check_ours(stdout, figures)
    if not PEER_PYTHON:
        assert "ours / theirs" not in stdout
        return
    assert stdout.count("ours / theirs (images/s per device):") == len(MODELS)
    for name, model in figures["models"].items():
        assert model["peer"]["images_per_second"] > 0 and model["peer"]["load_seconds"] > 0, name
        assert model["ratio"] > 0
    assert figures["models"]["flux-schnell"]["peer"]["dtype"] == "bfloat16"
    assert "FluxPipeline" in stdout


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
