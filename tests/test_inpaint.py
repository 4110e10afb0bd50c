"""Inpainting jobs against their reference, diffusers' StableDiffusionInpaintPipeline
(StableDiffusionXLInpaintPipeline for SDXL).

`make oracle` (tests/oracle/inpaint.py) rendered each job of tests/data/inpaint/jobs.json from the
tiny SD 1.x, 2.x and XL checkpoints (4-channel UNets: masked latent blending) and tiny 9-channel
SD 1.x and XL inpainting UNets (latents, mask and masked image's latents in), an init image, a soft-edged mask
and a strength (the contract's default 1.0 among them), with the contract's noises. Here the farm
renders each set as one batch, strengths mixed, in one program: within 2/255 of PyTorch's. And the
contract's rules: the id follows the mask's content, a mask that does not fit its image and a
model that cannot inpaint are refused naming the field (bad mask fields: tests/test_img2img.py).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections import defaultdict
from pathlib import Path

import numpy as np
import PIL.Image
import pytest

from diffusion.models import LoadedModel
from renderfarm.images import check_init_image, mask_pixels
from renderfarm.jobs import JobError, JobSpec, parse_job
from tests.helpers import DATA, TOLERANCE, loaded, one_program_matches, render_command, worst
from worker.engine import Engine

JOBS = json.loads((DATA / "inpaint" / "jobs.json").read_text())["jobs"]
BATCHES: dict[str, list[dict]] = defaultdict(list)
for _job in JOBS:
    BATCHES[_job["batch"]].append(_job)
IMAGE, MASK = DATA / "img2img" / "init.png", DATA / "inpaint" / "mask.png"
TURNED, SMALL_MASK = DATA / "img2img" / "init-exif.png", DATA / "inpaint" / "mask-small.png"
INPAINTING = "inpaint/sd1-inpainting/model"


def model_of(job: dict) -> tuple[LoadedModel, Engine]:
    """A reference job's checkpoint: sd1's and sd2's are the session's oracle models (shared with
    the other reference tests), the inpainting one lies under tests/data/inpaint."""
    folder = job["model"]
    return loaded(folder.removeprefix("oracle/") if folder.startswith("oracle/") else str(DATA / folder), None)


@pytest.mark.oracle
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_inpainting_jobs_match_diffusers_pytorch(batch: str) -> None:
    jobs = BATCHES[batch]
    assert len({job["strength"] for job in jobs}) >= 4 and None in {job["strength"] for job in jobs}
    assert len({job["mask_image"] for job in jobs}) == 2
    model, engine = model_of(jobs[0])
    assert model.inpainting_unet == (jobs[0]["in_channels"] == 9)
    one_program_matches(engine, model, jobs, batch)


@pytest.mark.oracle
def test_render_command_inpaints_as_diffusers(tmp_path: Path) -> None:
    """`renderfarm render --init-image IMAGE --mask-image MASK` on the inpainting checkpoint: the
    producer reads both, the strength is inpainting's default (1.0), the pixels are PyTorch's."""
    jobs = [job for job in BATCHES["inpaint/sd1-inpainting/euler"] if job["mask_image"] == "inpaint/mask.png"
            and job["strength"] in (None, 1.0)]
    assert jobs
    by_seed = render_command(jobs, tmp_path, "--model", str(DATA / INPAINTING), "--scheduler", "euler",
                             "--init-image", str(IMAGE), "--mask-image", str(MASK))
    assert worst([by_seed[job["seed"]] for job in jobs], [DATA / job["image"] for job in jobs]) <= TOLERANCE


@pytest.mark.oracle
def test_the_worker_refuses_what_its_model_cannot_inpaint(tmp_path: Path) -> None:
    """A mask on a family that cannot inpaint (Flux); a text or image-to-image job on an inpainting UNet;
    a mask the producer never saw that does not fit its image, or that changed since (found by its read): each
    named."""
    sd1, engine = loaded("sd1/model", None)
    job = parse_job({"prompt": "a fox", "model": sd1.ref, "seed": 1, "scheduler": "euler", "width": 64, "height": 64,
                     "init_image": str(IMAGE), "mask_image": str(MASK)})
    assert engine.check(job).mask
    flux, flux_engine = loaded(str(DATA / "flux" / "schnell" / "model"), None)
    with pytest.raises(JobError, match="a flux model cannot inpaint") as err:
        flux_engine.check(dataclasses.replace(job, model=flux.ref, scheduler="flow_euler"))
    assert (err.value.field, err.value.value) == ("mask_image", str(MASK))
    inpainting, inpainting_engine = loaded(str(DATA / INPAINTING), None)
    for kind in ({"init_image": None, "mask_image": None, "strength": None}, {"mask_image": None}):
        with pytest.raises(JobError, match="jobs need an init_image and a mask_image") as err:
            inpainting_engine.check(dataclasses.replace(job, model=inpainting.ref, **kind))
        assert err.value.field == "mask_image"
    # Read ahead as the job arrives (worker/sources.py): what its read found is its failure.
    misfit = dataclasses.replace(job, init_image=str(TURNED))  # 72x96 under a 64x64 mask
    mask = tmp_path / "mask.png"
    shutil.copy(MASK, mask)
    made = check_init_image(dataclasses.replace(job, mask_image=str(mask)), 64)
    mask.write_bytes(SMALL_MASK.read_bytes())
    failed = engine.init_images.unreadable([job, misfit, made], 64, 64)
    assert sorted(failed) == [1, 2] and all(isinstance(e, JobError) and e.field == "mask_image" for e in failed.values())
    assert "must have its init image's shape" in str(failed[1])
    assert "is not the image the job was made with" in str(failed[2])


def test_an_inpainting_job_defaults_to_strength_1_and_its_id_follows_the_mask(tmp_path: Path) -> None:
    fields = {"prompt": "a fox", "model": "m", "seed": 1, "steps": 4, "scheduler": "ddim", "init_image": str(TURNED)}
    image_job = check_init_image(parse_job(fields), 64)
    assert image_job.strength == 0.8 and image_job.mask_image_sha256 is None
    copy = tmp_path / "elsewhere.png"
    shutil.copy(SMALL_MASK, copy)
    here, there = (check_init_image(parse_job({**fields, "mask_image": str(p)}), 64) for p in (SMALL_MASK, copy))
    assert here.strength == 1.0 and here.mask_image_sha256 == there.mask_image_sha256 and here.job_id == there.job_id
    assert here.job_id != image_job.job_id and (here.width, here.height) == (64, 64)
    PIL.Image.open(SMALL_MASK).transpose(PIL.Image.Transpose.FLIP_LEFT_RIGHT).save(copy)
    assert check_init_image(parse_job({**fields, "mask_image": str(copy)}), 64).job_id != here.job_id
    half = check_init_image(parse_job({**fields, "mask_image": str(SMALL_MASK), "strength": 0.5}), 64)
    assert half.strength == 0.5 and half.job_id != here.job_id


def test_a_missing_misshapen_or_non_image_mask_is_refused_at_the_producer(tmp_path: Path) -> None:
    (tmp_path / "notes.png").write_text("not a mask")
    PIL.Image.new("L", (64, 48), 255).save(tmp_path / "wide.png")
    PIL.Image.new("L", (32, 32), 255).save(tmp_path / "half.png")
    for name, rule in (("absent.png", r"readable regular file or object \(FileNotFoundError\)"),
                       ("notes.png", "an image PIL can read"),
                       ("wide.png", r"is 64x48: it must have its init image's shape, 64x64")):
        job = parse_job({"prompt": "a fox", "model": "m", "seed": 1, "init_image": str(IMAGE),
                         "mask_image": str(tmp_path / name)})
        with pytest.raises(JobError, match=rule) as err:
            check_init_image(job, 64)
        assert (err.value.field, err.value.value) == ("mask_image", str(tmp_path / name))
    scaled = parse_job({"prompt": "a fox", "model": "m", "seed": 1, "init_image": str(IMAGE),
                        "mask_image": str(tmp_path / "half.png")})
    assert check_init_image(scaled, 64).mask_image_sha256  # half the image's size: it fits


def test_the_mask_is_binarized_after_its_resize_and_grayscale() -> None:
    """As the inpaint pipelines' mask processor: resized in RGB (lanczos), then grayscale, then
    1 from 0.5 up: a grey of 127 keeps, 128 repaints, and a green of 255 (luma 150) repaints."""
    grey = PIL.Image.fromarray(np.array([[[127] * 3, [128] * 3], [[0, 255, 0], [255, 0, 0]]], np.uint8))
    assert mask_pixels(grey, 2, 2).tolist() == [[[0.0, 1.0], [1.0, 0.0]]]
    soft = PIL.Image.open(MASK).convert("RGB")
    values = mask_pixels(soft, 64, 64)
    assert values.shape == (1, 64, 64) and set(np.unique(values)) == {0.0, 1.0}
    assert 0.2 < values.mean() < 0.5  # the disc of radius 20 (and its soft edge cut at half)


def test_job_spec_round_trips_its_mask() -> None:
    job = parse_job({"prompt": "a fox", "model": "m", "seed": 1, "init_image": "x.png", "mask_image": "m.png"})
    assert parse_job(job.to_dict()) == job and isinstance(job, JobSpec)
