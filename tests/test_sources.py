"""Init images read ahead (worker/sources.py): once per source and size, however many jobs
start from it; a source that is not the job's image is its error, for good."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
from PIL import Image

from renderfarm.images import check_init_image, init_pixels
from renderfarm.jobs import JobError, JobSpec, parse_job
from worker.sources import InitImages


def image_jobs(paths: list[Path], strengths: list[float]) -> list[JobSpec]:
    return [check_init_image(parse_job({"prompt": "p", "model": "m", "seed": n, "steps": 10, "init_image": str(path),
                                        "strength": strength, "width": 64, "height": 64}), 64)
            for n, (path, strength) in enumerate(zip(paths, strengths))]


def test_a_source_is_read_once_for_every_job_and_size_and_gives_the_resized_pixels(tmp_path: Path) -> None:
    photo = tmp_path / "photo.png"
    Image.new("RGB", (96, 80), (200, 40, 10)).save(photo)
    specs = image_jobs([photo] * 3, [0.3, 0.5, 0.7])
    images = InitImages(threads=2)
    futures = [images.fetch(spec, 64, 64) for spec in specs]
    assert futures[0] is futures[1] is futures[2] and images.fetch(specs[0], 128, 64) is not futures[0]
    expected = init_pixels(Image.open(photo).convert("RGB"), 64, 64)
    pixels, mask = images.pixels(specs[2], 64, 64)
    assert np.array_equal(pixels, expected) and expected.shape == (3, 64, 64) and mask is None
    assert images.unreadable(specs, 64, 64) == {}


def test_an_inpainting_jobs_mask_is_read_with_its_image_and_held_to_it(tmp_path: Path) -> None:
    photo, mask, narrow = tmp_path / "photo.png", tmp_path / "mask.png", tmp_path / "narrow.png"
    Image.new("RGB", (96, 96), (200, 40, 10)).save(photo)
    white_left = Image.new("RGB", (48, 48), (0, 0, 0))
    white_left.paste((255, 255, 255), (0, 0, 24, 48))
    white_left.save(mask)
    Image.new("RGB", (48, 24), (255, 255, 255)).save(narrow)
    fits, misfit = [check_init_image(parse_job({"prompt": "p", "model": "m", "seed": 0, "steps": 10, "width": 64,
                                                "height": 64, "init_image": str(photo), "mask_image": str(m)}), 64)
                    for m in (mask, mask)]
    misfit = dataclasses.replace(misfit, mask_image=str(narrow), mask_image_sha256=None)
    images = InitImages(threads=2)
    _, read = images.pixels(fits, 64, 64)
    assert read.shape == (1, 64, 64) and read[0, :, :30].min() == 1 and read[0, :, 34:].max() == 0
    failed = images.unreadable([fits, misfit], 64, 64)
    assert list(failed) == [1] and "mask_image=" in str(failed[1]) and "must have its init image's shape" in str(failed[1])


def test_unreadable_sources_are_named_with_their_reason_and_the_rest_read(tmp_path: Path) -> None:
    paths = [tmp_path / "a.png", tmp_path / "b.png", tmp_path / "c.png"]
    for path in paths:
        Image.new("RGB", (64, 64), (1, 2, 3)).save(path)
    specs = image_jobs(paths, [0.5] * 3)
    paths[0].unlink()
    paths[2].write_bytes(b"edited since the job was made")
    failed = InitImages(threads=2).unreadable(specs, 64, 64)
    assert sorted(failed) == [0, 2] and all(isinstance(error, JobError) for error in failed.values())
    assert "must be a readable image file (FileNotFoundError)" in str(failed[0])
    assert "is not the image the job was made with" in str(failed[2])
