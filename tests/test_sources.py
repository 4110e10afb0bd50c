"""Init images read ahead (worker/sources.py): once per source and size, however many jobs
start from it; a source that is not the job's image is its error, for good."""

from __future__ import annotations

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
    assert np.array_equal(images.pixels(specs[2], 64, 64), expected) and expected.shape == (3, 64, 64)
    assert images.unreadable(specs, 64, 64) == {}


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
