"""`renderfarm render`, the main job, as a user runs it: layout, sidecars, seeds, bad input."""

from __future__ import annotations

import hashlib
import io
import json
import re
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from harness.farm import STEPS, manifest_records
from renderfarm.jobs import JobError
from renderfarm.storage import open_storage
from renderfarm_cli import main
from harness.gcs_emulator import GcsEmulator
from worker.commands import parse_shapes

SIDECAR_FIELDS = {"job_id", "spec", "width", "height", "scheduler", "classifier_free_guidance", "truncated",
                  "model", "dtype", "png_sha256", "worker", "batch", "device_seconds", "timings", "versions"}


def render(*args: str) -> int:
    return main(["render", "--steps", str(STEPS), "--quiet", *args])


def manifest(root: Path, campaign: str) -> list[dict]:
    return [json.loads(line) for line in (root / campaign / "manifest.jsonl").read_text().splitlines()]


def test_layout_sidecars_and_seeds(tiny_sd: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a lighthouse\n\na red fox\na bowl of ramen\n")
    out = tmp_path / "out"
    assert render("an astronaut", "--prompts", str(prompts), "--model", str(tiny_sd),
                  "--out", str(out), "--campaign", "c1", "--seed", "10", "--negative", "blurry",
                  "--store-threads", "3") == 0
    printed = capsys.readouterr().out
    assert f"wrote 4 images to {out / 'c1'}" in printed and "images/s" in printed and "compile" in printed

    records = manifest(out, "c1")
    assert [r["spec"]["prompt"] for r in records] == ["an astronaut", "a lighthouse", "a red fox", "a bowl of ramen"]
    assert [r["spec"]["seed"] for r in records] == [10, 11, 12, 13]
    assert len({r["job_id"] for r in records}) == 4
    for record in records:
        assert set(record) >= SIDECAR_FIELDS
        png = (out / "c1" / f"{record['job_id']}.png").read_bytes()
        assert json.loads((out / "c1" / f"{record['job_id']}.json").read_text()) == record
        assert hashlib.sha256(png).hexdigest() == record["png_sha256"]
        assert Image.open(io.BytesIO(png)).size == (64, 64)
        assert record["spec"]["negative_prompt"] == "blurry" and record["spec"]["campaign"] == "c1"
        model = record["model"]
        assert {k: model[k] for k in ("ref", "revision", "variant", "family", "base", "loras")} == \
            {"ref": str(tiny_sd), "revision": None, "variant": None, "family": "sd", "base": None, "loras": []}
        # the sha256 of every weights file the image came from
        assert {w["role"] for w in model["weights"]} == {"pipeline"}
        assert {w["file"].split("/")[0] for w in model["weights"]} == {"unet", "vae", "text_encoder"}
        for weights in model["weights"]:
            assert weights["sha256"] == hashlib.sha256((tiny_sd / weights["file"]).read_bytes()).hexdigest()
        assert record["worker"]["device_count"] == 8 and record["batch"]["slots"] == 8
        assert (record["width"], record["height"], record["scheduler"]) == (64, 64, "pndm")
        assert record["classifier_free_guidance"] is True  # the default scale, 7.5
        # its share of its batch's time on the 8 devices: at most the batch's wall time x 8 / jobs
        assert 0 < record["device_seconds"] <= record["timings"]["batch_seconds"] * 8 / record["batch"]["jobs"] + 1e-3
        assert "diffusers" not in record["versions"] and record["versions"]["flax"] != "unknown"


def test_jsonl_jobs_and_gcs_output(tiny_sd: Path, tmp_path: Path, gcs: GcsEmulator) -> None:
    gcs.create_bucket("renders")
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text('{"prompt": "a fox", "seed": 3, "guidance_scale": 2.0}\n'
                    '{"prompt": "a dog", "scheduler": "ddim", "campaign": "dogs", "guidance_scale": 1.0}\n')
    assert render("--prompts", str(jobs), "--model", str(tiny_sd), "--out", "gs://renders/run1",
                  "--seed", "100") == 0
    bucket = open_storage("gs://renders/run1")
    (fox,), (dog,) = (manifest_records(bucket, campaign) for campaign in ("local", "dogs"))
    assert (fox["spec"]["seed"], fox["spec"]["guidance_scale"], fox["classifier_free_guidance"]) == (3, 2.0, True)
    assert (dog["spec"]["seed"], dog["scheduler"], dog["classifier_free_guidance"]) == (101, "ddim", False)
    assert bucket.exists(f"dogs/{dog['job_id']}.png") and bucket.exists(f"local/{fox['job_id']}.json")


@pytest.mark.parametrize(("args", "lines", "message"), [
    (["   "], None, "prompt='   ': must not be empty"),
    (["a fox", "--width", "72"], None, "width=72: must be a multiple of 16 (the model's size step)"),
    (["a fox", "--steps", "0"], None, "steps=0: must be in 1..500"),
    (["a fox", "--guidance", "nan"], None, "guidance_scale=nan: must be finite and in 0..50"),
    ([], '{"prompt": "a"}\n{"prompt": "b", "scheduler": "heun"}\n',
     "line 2: scheduler='heun': must be one of pndm, ddim, lms, euler, dpm, euler_a, lcm"),
    ([], '{"prompt": "a"}\n{"prompt": "b",\n', "line 2: line="),
    # the model's own scheduler (pndm) has no Karras sigmas
    (["a fox", "--karras"], None, "karras=True: needs a scheduler with Karras sigmas (lms, euler, dpm), not pndm"),
])
def test_bad_input_stops_before_rendering(tiny_sd: Path, tmp_path: Path, capsys: pytest.CaptureFixture,
                                          args: list[str], lines: str | None, message: str) -> None:
    if lines is not None:
        (tmp_path / "jobs.jsonl").write_text(lines)
        args = [*args, "--prompts", str(tmp_path / "jobs.jsonl")]
    out = tmp_path / "out"
    assert render(*args, "--model", str(tiny_sd), "--out", str(out)) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_sampler_flags_reach_the_job_and_its_sidecar(tiny_sd: Path, tmp_path: Path) -> None:
    """SDXL-Turbo's settings from the command line: euler_a, trailing spacing, no guidance."""
    out = tmp_path / "out"
    assert render("a fox", "a dog", "--model", str(tiny_sd), "--out", str(out), "--scheduler", "euler_a",
                  "--timestep-spacing", "trailing", "--guidance", "0", "--seed", "5") == 0
    records = manifest(out, "local")
    for record in records:
        assert (record["spec"]["scheduler"], record["spec"]["timestep_spacing"], record["spec"]["karras"]) == \
            ("euler_a", "trailing", None)
        assert record["scheduler"] == "euler_a" and record["classifier_free_guidance"] is False
    again = tmp_path / "again"
    assert render("a fox", "--model", str(tiny_sd), "--out", str(again), "--scheduler", "euler_a",
                  "--timestep-spacing", "trailing", "--guidance", "0", "--seed", "5") == 0
    # a stochastic scheduler draws its noise from the job's seed: the same job, the same bytes
    assert (again / "local" / f"{records[0]['job_id']}.png").read_bytes() == \
        (out / "local" / f"{records[0]['job_id']}.png").read_bytes()


def test_unknown_scheduler_flag_and_bad_model_folder(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        render("a fox", "--model", str(tmp_path), "--out", str(tmp_path / "o"), "--scheduler", "heun")
    assert "--scheduler: invalid choice: 'heun'" in capsys.readouterr().err
    assert render("a fox", "--model", str(tmp_path), "--out", str(tmp_path / "o")) == 2
    assert "must be a diffusers pipeline folder (no model_index.json found)" in capsys.readouterr().err


def test_precompile_shapes_name_their_sampler_and_guidance() -> None:
    def shape(width: int, height: int, steps: int, scheduler: str | None = None, spacing: str | None = None,
              karras: bool | None = None, guidance: float = 7.5) -> dict[str, Any]:
        return {"width": width, "height": height, "steps": steps, "scheduler": scheduler,
                "timestep_spacing": spacing, "karras": karras, "guidance_scale": guidance}

    assert parse_shapes("512x512@25,768x512@30:dpm:karras,1024x1024@4:euler_a:trailing:cfg-free,64x64@2:cfg-free") == [
        shape(512, 512, 25), shape(768, 512, 30, "dpm", karras=True),
        shape(1024, 1024, 4, "euler_a", "trailing", guidance=1.0), shape(64, 64, 2, guidance=1.0)]
    # image jobs' programs, picked by placeholder image fields (their shapes are the job's size)
    assert parse_shapes("64x64@4:img2img,64x64@4:dpm:inpaint") == [
        {**shape(64, 64, 4), "init_image": "-", "strength": 1.0},
        {**shape(64, 64, 4, "dpm"), "init_image": "-", "mask_image": "-"}]
    for bad in ("64x64", "64x64@2:heun", "64x64@2:dpm:ddim", "64x64@2:cfg-free:cfg-free", "64x64@2:cfg",
                "64x64@2:trailing:leading", "64x64@2:karras:karras", "64x64@2:img2img:inpaint"):
        with pytest.raises(JobError, match=re.escape(f"precompile={bad!r}: must be WIDTHxHEIGHT@STEPS")):
            parse_shapes(bad)
