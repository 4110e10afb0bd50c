"""Image jobs' sources: what may be read (renderfarm/sources.py: regular files and objects, a
size cap, a farm worker's source roots, refusals that never tell whether a path exists) and
their read ahead (worker/sources.py: once per source and size, however many jobs start from
it, each wait with a deadline, kept reads bounded by bytes); a source that is not the job's
image is its error, for good."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from harness.fault_proxies import GcsProxy, Rule
from harness.gcs_emulator import GcsEmulator
from renderfarm.images import check_init_image, init_pixels
from renderfarm.jobs import JobError, JobSpec, parse_job
from renderfarm.sources import MAX_SOURCE_BYTES, SourceRoots, check_queued, read_source
from worker.sources import InitImages, SourceTimeout


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
    assert "must be a readable regular file or object (FileNotFoundError)" in str(failed[0])
    assert "is not the image the job was made with" in str(failed[2])


# --------------------------------------------------------------------------- what may be read


def photo(path: Path, size: tuple[int, int] = (64, 64)) -> Path:
    Image.new("RGB", size, (10, 200, 30)).save(path)
    return path


def test_only_regular_files_are_read_never_a_device_a_pipe_or_a_folder(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)  # no writer: a blocking open or read would wait for ever
    started = time.monotonic()
    for ref in (str(fifo), "/dev/zero", str(tmp_path)):
        with pytest.raises(JobError, match=r"init_image=.*: must be a readable regular file or object \(not a regular file\)"):
            read_source(ref, "init_image")
    assert time.monotonic() - started < 5
    assert read_source(str(photo(tmp_path / "a.png")), "init_image") == (tmp_path / "a.png").read_bytes()


def test_a_source_over_the_cap_is_refused_naming_its_size_and_the_cap(tmp_path: Path) -> None:
    big = tmp_path / "big.png"
    big.write_bytes(b"\0" * 1001)
    with pytest.raises(JobError, match=r"mask_image=.*big.png': is 1001 bytes: a source may be at most 1000 bytes"):
        read_source(str(big), "mask_image", max_bytes=1000)
    assert len(read_source(str(big), "mask_image", max_bytes=1001)) == 1001
    assert MAX_SOURCE_BYTES == 64 * 2**20


def test_a_file_whose_size_the_kernel_does_not_know_is_cut_at_the_cap() -> None:
    # /proc files say 0 bytes and give more: the read stops one byte past the cap.
    with pytest.raises(JobError, match=r"is over 16 bytes: a source may be at most 16 bytes"):
        read_source("/proc/self/status", "init_image", max_bytes=16)


def test_a_worker_reads_only_under_its_roots_and_refuses_missing_and_forbidden_alike(tmp_path: Path) -> None:
    root, outside = tmp_path / "sources", tmp_path / "private"
    root.mkdir(), outside.mkdir()
    inside, secret = photo(root / "in.png"), photo(outside / "secret.png")
    (root / "link.png").symlink_to(secret)  # a link out of the root is followed, then refused
    (root / "linked-in.png").symlink_to(inside)  # one that stays inside is read
    roots = SourceRoots.parse([str(root), "gs://shared-sources/campaigns"])
    assert read_source(str(inside), "init_image", roots) == inside.read_bytes()
    assert read_source(f"file://{root}/linked-in.png", "init_image", roots) == inside.read_bytes()
    reasons = set()
    for ref in (str(secret), str(root / "link.png"), str(root / "missing.png"), str(outside / "missing.png"),
                str(root / "no-such-folder" / "x.png"), str(outside / "no-such-folder" / "x.png"),
                f"{root}/../private/secret.png", "/etc/passwd", "gs://other-bucket/x.png",
                "gs://shared-sources/elsewhere/x.png"):
        with pytest.raises(JobError) as refused:
            read_source(ref, "init_image", roots)
        reasons.add(str(refused.value).split(": ", 1)[1])
    assert reasons == {f"must be a regular file or object under this worker's source roots "
                       f"({root}, gs://shared-sources/campaigns/) that it can read"}
    # a read makes nothing: no folder of a path that was not there
    assert sorted(os.listdir(tmp_path)) == ["private", "sources"] and sorted(os.listdir(root)) == [
        "in.png", "link.png", "linked-in.png"] and os.listdir(outside) == ["secret.png"]


def test_source_roots_are_checked_at_start_up(tmp_path: Path) -> None:
    with pytest.raises(JobError, match="source-root=.*nowhere': must be an existing folder"):
        SourceRoots.parse([str(tmp_path / "nowhere")])
    with pytest.raises(JobError, match="source-root='s3://b': must be a local folder"):
        SourceRoots.parse(["s3://b"])
    with pytest.raises(JobError, match="source-root='gs://B_ad'"):
        SourceRoots.parse(["gs://B_ad"])
    assert not SourceRoots.parse([]) and SourceRoots.parse(["gs://bucket"]).allows_object("bucket", "a/b.png")


def test_a_queued_image_job_needs_source_roots_and_its_sources_digests(tmp_path: Path) -> None:
    job = image_jobs([photo(tmp_path / "a.png")], [0.5])[0]
    with pytest.raises(JobError, match="this worker takes no image jobs: it reads sources only under its "
                                       "--source-root folders and buckets, and has none"):
        check_queued(job, SourceRoots())
    roots = SourceRoots.parse([str(tmp_path)])
    check_queued(job, roots)
    with pytest.raises(JobError, match="init_image_sha256=None: is required on a queued job with a init_image"):
        check_queued(dataclasses.replace(job, init_image_sha256=None), roots)


def test_objects_are_read_with_a_ranged_download_and_capped(gcs: GcsEmulator, tmp_path: Path) -> None:
    from renderfarm.storage import open_storage

    gcs.create_bucket("sources-capped")
    storage = open_storage("gs://sources-capped")
    storage.put("in/a.png", b"x" * 100)
    roots = SourceRoots.parse(["gs://sources-capped/in"])
    assert read_source("gs://sources-capped/in/a.png", "init_image", roots, max_bytes=100) == b"x" * 100
    with pytest.raises(JobError, match="is 100 bytes: a source may be at most 99 bytes"):
        read_source("gs://sources-capped/in/a.png", "init_image", roots, max_bytes=99)
    with pytest.raises(JobError, match="under this worker's source roots"):
        read_source("gs://sources-capped/in/missing.png", "init_image", roots)


def test_every_wait_for_a_read_has_a_deadline_and_a_stalled_read_is_started_again(
        gcs: GcsEmulator, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read that storage holds (its answer never comes) fails its job with SourceTimeout at
    its deadline; the wait returns then, and the next fetch starts the read again."""
    from renderfarm.sources import _bucket
    from renderfarm.storage import open_storage

    gcs.create_bucket("sources-held")
    data = (Path(__file__).parent / "data" / "img2img" / "init.png").read_bytes()
    open_storage("gs://sources-held").put("a.png", data)
    proxy = GcsProxy(gcs.url)
    held = proxy.add(Rule(r"^a.png$", hold=True, method="GET"))
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
    _bucket.cache_clear()
    try:
        spec = parse_job({"prompt": "p", "model": "m", "seed": 0, "steps": 10, "width": 64, "height": 64,
                          "init_image": "gs://sources-held/a.png", "init_image_sha256": hashlib.sha256(data).hexdigest()})
        images = InitImages(SourceRoots.parse(["gs://sources-held"]), seconds=1.0, threads=2)
        first = images.fetch(spec, 64, 64)
        assert held.held.wait(30)
        assert not images.ready([spec], 64, 64)
        started = time.monotonic()
        failed = images.unreadable([spec], 64, 64)
        assert 0.3 < time.monotonic() - started < 1.5 and isinstance(failed[0], SourceTimeout)
        assert "not read within 1 s" in str(failed[0]) and images.ready([spec], 64, 64)
        with pytest.raises(SourceTimeout):
            images.pixels(spec, 64, 64)
        proxy.remove(held)
        held.release()
        again = images.fetch(spec, 64, 64)
        assert again is not first and images.unreadable([spec], 64, 64) == {}
    finally:
        held.release()
        proxy.close()
        _bucket.cache_clear()


def test_kept_reads_are_bounded_by_their_bytes(tmp_path: Path) -> None:
    specs = image_jobs([photo(tmp_path / f"{n}.png") for n in range(4)], [0.5] * 4)
    one = 3 * 64 * 64 * 4  # a 64x64 read's float32 pixels
    images = InitImages(threads=1, kept_bytes=2 * one)
    futures = []
    for spec in specs:
        futures.append(images.fetch(spec, 64, 64))
        images.pixels(spec, 64, 64)
    # The two newest are kept read; the two oldest were dropped, and are read again when asked for.
    assert [images.fetch(specs[n], 64, 64) is futures[n] for n in (3, 2, 1, 0)] == [True, True, False, False]
