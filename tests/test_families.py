"""The family seam is real: a family of the tests' own (tests/toy_family.py: another encoder
length, another latent shape, its own inputs), installed as any distribution would add one
(an entry point in `renderfarm.families`), is built by `renderfarm tiny-model`, rendered by
`renderfarm render` and by a real worker fed through Redis, with no change outside the tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from renderfarm.progress import Progress
from harness.farm import WorkerProcess, farm_app, wait_done
from harness.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["a red fox", "a lighthouse at dusk", "a bowl of ramen"]


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """PYTHONPATH with a site folder holding the toy family's distribution metadata."""
    site = tmp_path_factory.mktemp("site")
    dist = site / "toy_family-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-family\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[renderfarm.families]\ntoy = tests.toy_family:FAMILY\n")
    return {"PYTHONPATH": os.pathsep.join([str(site), str(ROOT), os.environ.get("PYTHONPATH", "")])}


def renderfarm(env: dict[str, str], *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "renderfarm_cli", *args], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def images(folder: Path) -> dict[str, np.ndarray]:
    """The jobs' images by content id (the gallery's preview.png is not one)."""
    return {png.stem: np.asarray(Image.open(png)) for png in sorted(folder.glob("*.png")) if png.stem != "preview"}


@pytest.mark.farm
def test_a_plugin_family_renders_locally_and_on_a_worker(plugin_env: dict[str, str], tmp_path: Path) -> None:
    model = tmp_path / "toy"
    assert "tiny toy model written" in renderfarm(plugin_env, "tiny-model", str(model), "--kind", "toy")
    assert json.loads((model / "model_index.json").read_text())["_class_name"] == "ToyPipeline"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")

    renderfarm(plugin_env, "render", "--model", str(model), "--prompts", str(prompts), "--out", str(tmp_path / "local"),
               "--campaign", "toy", "--seed", "3", "--steps", "3", "--quiet")
    local = images(tmp_path / "local" / "toy")
    assert len(local) == 3 and {image.shape for image in local.values()} == {(64, 64, 3)}  # the toy's native size
    assert len({image.tobytes() for image in local.values()}) == 3
    sidecars = [json.loads(path.read_text()) for path in (tmp_path / "local" / "toy").glob("*.json")]
    assert {(s["model"]["family"], s["width"], s["height"], s["spec"]["steps"]) for s in sidecars} == {("toy", 64, 64, 3)}
    # 16 tokens, a byte each (spaces split words, they are no tokens): BOS, 14 bytes, EOS; at
    # CLIP's 77 none of these would be cut
    assert {s["spec"]["prompt"]: s["truncated"] for s in sidecars} == {
        "a red fox": False, "a lighthouse at dusk": True, "a bowl of ramen": False}

    server = RedisServer()
    worker = WorkerProcess(model, str(tmp_path / "farm"), server.url, "toy", tmp_path, env=plugin_env,
                           precompile="64x64@3")
    try:
        worker.wait_ready(farm_app(server.url))
        renderfarm(plugin_env, "submit", "--broker", server.url, "--model", str(model), "--prompts", str(prompts),
                   "--campaign", "toy", "--seed", "3", "--steps", "3")
        status = wait_done(Progress.from_url(server.url), "toy", 3)
        assert status["done"] == 3 and not status["failed"], status
    finally:
        worker.stop()
        server.close()
    farm = images(tmp_path / "farm" / "toy")
    assert farm.keys() == local.keys()  # the same jobs, by content id
    for name, image in farm.items():
        assert np.array_equal(image, local[name])


def test_a_plugin_that_is_no_family_or_takes_a_taken_name_is_refused(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from diffusion.families import FAMILIES, _by_name, _installed

    dist = tmp_path / "broken_family-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-family\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[renderfarm.families]\nbroken = tests.toy_family:TOKENS\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TypeError, match=r"entry point broken = tests.toy_family:TOKENS .* is a int, not a "):
        _installed()
    with pytest.raises(ValueError, match="two model families are named 'sd'"):
        _by_name([FAMILIES["sd"], FAMILIES["sdxl"], FAMILIES["sd"]])


def test_a_job_naming_a_scheduler_its_family_does_not_run_is_refused(sd_engine) -> None:  # noqa: ANN001
    from renderfarm.jobs import JobError, JobSpec

    spec = JobSpec(prompt="a fox", seed=0, steps=4, width=64, height=64, scheduler="flow_euler",
                   model=sd_engine.model.ref)
    with pytest.raises(JobError, match=r"scheduler='flow_euler': a sd model runs pndm, ddim, lms, euler, dpm, euler_a, lcm"):
        sd_engine.check(spec)
