"""Image-to-image jobs against their reference, diffusers' StableDiffusionImg2ImgPipeline
(StableDiffusionXLImg2ImgPipeline for SDXL).

`make oracle` (tests/oracle/img2img.py) rendered each job of tests/data/img2img/jobs.json from
the tiny SD 1.x, 2.x and XL checkpoints, an init image (one stored sideways with an EXIF
orientation) and a strength, with the contract's two noises. Here the farm renders each set as
one batch, strengths mixed, in one program: within 2/255 of PyTorch's. And the contract's
rules: the id follows the image's content, a bad strength, image or mask field is refused naming it.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections import defaultdict
from pathlib import Path

import pytest

from renderfarm.images import check_init_image, load_init_image
from renderfarm.ingest import build_jobs
from renderfarm.jobs import JobError, parse_job
from tests.helpers import (
    DATA,
    ORACLE,
    TOLERANCE,
    loaded,
    one_program_matches,
    render_command,
    worst,
)

JOBS = json.loads((DATA / "img2img" / "jobs.json").read_text())["jobs"]
BATCHES: dict[str, list[dict]] = defaultdict(list)
for _job in JOBS:
    BATCHES[_job["batch"]].append(_job)
EXIF = DATA / "img2img" / "init-exif.png"


@pytest.mark.oracle
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_image_jobs_match_diffusers_pytorch(batch: str) -> None:
    jobs = BATCHES[batch]
    assert len({job["strength"] for job in jobs}) >= 3 and len({job["init_image"] for job in jobs}) == 2
    model, engine = loaded(jobs[0]["model"].removeprefix("oracle/"), None)
    one_program_matches(engine, model, jobs, batch)


@pytest.mark.oracle
def test_render_command_reads_the_image_and_renders_diffusers_images(tmp_path: Path) -> None:
    """`renderfarm render --init-image IMAGE --strength S`: the producer reads the image, the
    worker resizes it to the job's size and renders with the model's own scheduler (pndm, a
    multistep one), and the pixels are PyTorch's."""
    jobs = [job for job in BATCHES["img2img/sd1/pndm"]
            if job["init_image"] == "img2img/init-exif.png" and job["negative_prompt"] is None and job["strength"] == 0.8]
    by_seed = render_command(jobs, tmp_path, "--model", str(ORACLE / "sd1" / "model"),
                             "--init-image", str(EXIF), "--strength", "0.8")
    assert worst([by_seed[job["seed"]] for job in jobs], [DATA / job["image"] for job in jobs]) <= TOLERANCE


@pytest.mark.oracle
def test_the_worker_refuses_an_image_job_its_model_cannot_render() -> None:
    sd1, engine = loaded("sd1/model", None)
    job = parse_job({"prompt": "a fox", "model": sd1.ref, "seed": 1, "init_image": str(EXIF), "width": 64, "height": 64})
    assert engine.check(job).scheduler == "pndm"  # the model's own, a multistep one
    flux, flux_engine = loaded(str(DATA / "flux" / "schnell" / "model"), None)
    with pytest.raises(JobError, match="renders text to image only") as err:
        flux_engine.check(dataclasses.replace(job, model=flux.ref, scheduler="flow_euler"))
    assert err.value.field == "init_image"


def test_a_text_jobs_id_is_unchanged_and_an_image_jobs_follows_its_pixels(tmp_path: Path) -> None:
    text = {"prompt": "a fox", "model": "m", "seed": 1, "steps": 4, "scheduler": "ddim"}
    assert parse_job(text).job_id == "ff452d6874482b5d167dee3938f55441"  # its id before image jobs existed
    copy = tmp_path / "elsewhere.png"
    shutil.copy(EXIF, copy)
    here, there = (next(build_jobs([(None, {**text, "init_image": str(p)})], {})) for p in (EXIF, copy))
    assert here.init_image_sha256 == there.init_image_sha256 and here.job_id == there.job_id
    # 72x96 once turned, rounded down at the producer to the coarsest size step, which every family renders
    assert here.strength == 0.8 and (here.width, here.height) == (64, 64)
    turned = check_init_image(parse_job({**text, "init_image": str(EXIF)}), 32)
    assert (turned.width, turned.height) == (64, 96)  # at a 32-pixel size step
    assert here.job_id != parse_job(text).job_id
    assert check_init_image(parse_job({**text, "init_image": str(copy), "strength": 0.5}), 64).job_id != here.job_id
    copy.write_bytes((DATA / "img2img" / "init.png").read_bytes())
    assert check_init_image(parse_job({**text, "init_image": str(copy)}), 64).job_id != here.job_id


@pytest.mark.parametrize(("fields", "field", "rule"), [
    ({"strength": 0.5}, "strength", "needs an init_image"),
    ({"init_image": "x.png", "strength": 0}, "strength", r"\(0, 1\]"),
    ({"init_image": "x.png", "strength": 1.5}, "strength", r"0\.\.1"),
    ({"init_image": "x.png", "strength": 0.2, "steps": 4}, "strength", r"int\(steps \* strength\)"),
    ({"init_image": "x.png", "init_image_sha256": "abc"}, "init_image_sha256", "64 lowercase hex"),
    # inpainting's mask
    ({"mask_image": "m.png"}, "mask_image", "needs an init_image"),
    ({"init_image": "x.png", "mask_image_sha256": "0" * 64}, "mask_image_sha256", "needs a mask_image"),
    ({"init_image": "x.png", "mask_image": "m.png", "mask_image_sha256": "ABC"}, "mask_image_sha256",
     "64 lowercase hex"),
    ({"init_image": "x.png", "mask_image": " "}, "mask_image", "must not be empty"),
    ({"init_image": "x.png", "mask_image": "m.png", "strength": 1.5}, "strength", r"0\.\.1"),
    ({"init_image": "x.png", "mask_image": "m.png", "strength": 0}, "strength", r"\(0, 1\]"),
])
def test_bad_image_and_mask_fields_are_refused_naming_field_and_rule(fields: dict, field: str, rule: str) -> None:
    with pytest.raises(JobError, match=rule) as err:
        parse_job({"prompt": "a fox", "model": "m", "seed": 1, **fields})
    assert err.value.field == field


def test_a_missing_or_non_image_file_is_refused_at_the_producer(tmp_path: Path) -> None:
    (tmp_path / "notes.png").write_text("not an image")
    for name, rule in (("absent.png", r"readable regular file or object \(FileNotFoundError\)"),
                       ("notes.png", "an image PIL can read")):
        job = parse_job({"prompt": "a fox", "model": "m", "seed": 1, "init_image": str(tmp_path / name)})
        with pytest.raises(JobError, match=rule) as err:
            check_init_image(job, 64)
        assert err.value.field == "init_image"


def test_an_image_that_changed_since_the_job_was_made_is_refused(tmp_path: Path) -> None:
    image = tmp_path / "photo.png"
    shutil.copy(EXIF, image)
    job = check_init_image(parse_job({"prompt": "a fox", "model": "m", "seed": 1, "init_image": str(image)}), 64)
    image.write_bytes((DATA / "img2img" / "init.png").read_bytes())
    with pytest.raises(JobError, match="is not the image the job was made with") as err:
        load_init_image(job)
    assert err.value.field == "init_image"
