"""The README's promises, each held by a test that fails when the promise breaks:

- `renderfarm status CAMPAIGN` gives images/s and an ETA while the campaign runs;
- workers keep a campaign's index.html and preview.png fresh while it runs (the first stored
  batch at once, then at most every 30 s, and once more when the worker runs out of work);
- `--per-device-batch 2` renders batches of 16 on 8 devices that keep the reproducibility
  contract (within 2/255 of diffusers' PyTorch references and of per-device batch 1);
- a job without `--seed` gets a random seed, recorded in its sidecar, that reproduces it;
- `renderfarm worker --store-threads 3` stores on 3 threads.

(A schedule change reaching a running beat within 2 s is held by tests/test_schedules.py.)

Real parts: the session's farm (tests/conftest.py: a redis-server, two `renderfarm worker`
processes storing to the GCS emulator through a proxy, so that a test can stall storage to see
a campaign stand still mid-way, harness/fault_proxies.py), each test with its own campaign, and
`renderfarm render` as a user runs it.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from harness.farm import STEPS, enqueue, jobs, manifest_ids, wait_done, wait_for
from renderfarm.gallery import THUMB_SIZE, TILE_GAP, grid_shape
from renderfarm.layout import image_name, index_name, preview_name, sidecar_name
from renderfarm.storage import Storage
from harness.fault_proxies import GcsProxy, Rule
from tests.helpers import BATCHES, ORACLE, STORE_THREADS, TOLERANCE, Cli, Farm

GALLERY_INTERVAL = 30.0  # the README's "kept fresh": a running campaign's gallery, at most this stale


@contextlib.contextmanager
def storage_stalled(proxy: GcsProxy, campaign: str) -> Iterator[Rule]:
    """Every storage request of the campaign waits until the block ends: the workers can store
    (and so finish) nothing of it meanwhile, as when a bucket is slow."""
    rule = proxy.add(Rule(rf"^out/{re.escape(campaign)}/", hold=True))
    try:
        yield rule
    finally:
        proxy.remove(rule)  # and release what it held


def wait_until(deadline: float) -> None:
    """Let wall-clock time pass up to `deadline` (time.time()). Only for a duration a promise
    itself states (a refresh interval), never to guess how long something takes."""
    time.sleep(max(0.0, deadline - time.time()))


def max_diff(a: bytes | np.ndarray | Path, b: bytes | np.ndarray | Path) -> int:
    def pixels(x: bytes | np.ndarray | Path) -> np.ndarray:
        if isinstance(x, np.ndarray):
            return x.astype(np.int16)
        return np.asarray(Image.open(io.BytesIO(x) if isinstance(x, bytes) else x).convert("RGB"), np.int16)
    return int(np.abs(pixels(a) - pixels(b)).max())


# --------------------------------------------------------------------------- status


@pytest.mark.farm
def test_status_reports_images_per_second_and_eta_while_a_campaign_runs(farm: Farm, cli: Cli,
                                                                        tiny_sd: Path) -> None:
    """An operator follows a campaign with `renderfarm status`: mid-way, with jobs left, it
    must say how fast the farm goes and when it will be done, in --json and in the text."""
    campaign, n = "status-mid", 64
    enqueue(farm.app, farm.progress, jobs(tiny_sd, campaign, n))
    wait_for(lambda: farm.progress.status(campaign)["done"] >= 16, 180, "two batches stored", interval=0.05)
    with storage_stalled(farm.proxy, campaign):  # the campaign stands still mid-way
        code, out, err = cli("status", campaign, "--json", "--broker", farm.broker)
        assert code == 0, err
        report = json.loads(out)
        code, text, err = cli("status", campaign, "--broker", farm.broker)
        assert code == 0, err
    left = report["queued"] + report["running"]
    assert 16 <= report["done"] < n and left == n - report["done"] and report["failed"] == 0
    rate, eta = report["images_per_second"], report["eta_seconds"]
    assert rate is not None and rate > 0, report
    assert eta is not None and eta > 0, report
    assert eta == pytest.approx(left / rate)  # the ETA is the jobs left at the measured rate
    shown = re.search(r"rate\s+([\d.]+) images/s\n\s*ETA\s+(\d+:\d\d:\d\d)\n", text)
    assert shown and float(shown[1]) > 0, text
    status = wait_done(farm.progress, campaign, n)
    assert (status["done"], status["failed"]) == (n, 0)


# --------------------------------------------------------------------------- gallery


def gallery_total(storage: Storage, campaign: str) -> int | None:
    """The image count index.html states, None before the first refresh."""
    try:
        page = storage.get(index_name(campaign)).decode()
    except FileNotFoundError:
        return None
    found = re.search(r'<span id="total">([\d,]+) images</span>', page)
    assert found, page[:2000]
    return int(found[1].replace(",", ""))


def preview_tiles(storage: Storage, campaign: str) -> tuple[int, int]:
    """preview.png's (columns, rows) of thumbnails, from its size."""
    width, height = Image.open(io.BytesIO(storage.get(preview_name(campaign)))).size
    return (width - TILE_GAP) // (THUMB_SIZE + TILE_GAP), (height - TILE_GAP) // (THUMB_SIZE + TILE_GAP)


@pytest.mark.farm
def test_workers_keep_index_and_preview_fresh_while_a_campaign_runs(farm: Farm, bucket: Storage,
                                                                    tiny_sd: Path) -> None:
    """A campaign's gallery is how people watch it: the first stored batch shows at once, a
    running campaign's gallery is at most 30 s stale, and it is complete once the workers run
    out of work. The workers are kept busy throughout the 30 s (their stores held back), so the
    refresh seen mid-way is the periodic one, not the one a worker makes when it goes idle."""
    campaign, n = "gallery-live", 72
    enqueue(farm.app, farm.progress, jobs(tiny_sd, campaign, n, seed=5000))
    wait_for(lambda: gallery_total(bucket, campaign) is not None, 180, "the first gallery", interval=0.05)
    seen_at = time.time()  # the worker began that refresh before this
    # Both workers refresh: index.html and preview.png may be of two refreshes a moment apart.
    wait_for(lambda: preview_tiles(bucket, campaign) == grid_shape(gallery_total(bucket, campaign)), 10,
             "index.html and preview.png of one refresh", interval=0.05)
    with storage_stalled(farm.proxy, campaign):
        first = gallery_total(bucket, campaign)
        assert first is not None and 0 < first < n, "the first batch should show at once, mid-campaign"
        wait_until(seen_at + GALLERY_INTERVAL + 0.5)  # the refresh interval the worker promises
        assert farm.progress.status(campaign)["done"] < n
    # A refresh that began before the block lands as it ends, after the other worker's newer
    # one: it must not set the page back (renderfarm.gallery.publish).
    wait_for(lambda: gallery_total(bucket, campaign) != first, 60, "a refresh after 30 s", interval=0.05)
    second = gallery_total(bucket, campaign)
    assert second is not None and first < second < n, \
        f"a running campaign's gallery should grow: {first}, then {second} of {n}"
    wait_done(farm.progress, campaign, n)
    wait_for(lambda: gallery_total(bucket, campaign) == n, 30, "the gallery of the whole campaign")
    assert preview_tiles(bucket, campaign) == grid_shape(64)  # the newest 64 thumbnails


# --------------------------------------------------------------------------- store threads


def thread_names(pid: int) -> list[str]:
    names = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):
            names.append((task / "comm").read_text().strip())
    return names


@pytest.mark.farm
def test_worker_stores_on_the_store_threads_it_is_given(farm: Farm, bucket: Storage, tiny_sd: Path,
                                                        sd_engine) -> None:
    """`--store-threads` is how an operator gives a host's cores to PNG encoding and uploads:
    a worker must store on that many threads (this machine's default would be 2), and
    what it stores must be right."""
    campaign, n = "threads", 16
    specs = enqueue(farm.app, farm.progress, jobs(tiny_sd, campaign, n, seed=7000))
    status = wait_done(farm.progress, campaign, n)
    assert (status["done"], status["failed"]) == (n, 0)
    assert sorted(manifest_ids(bucket, campaign)) == sorted(s.job_id for s in specs)
    pids = {json.loads(bucket.get(sidecar_name(campaign, s.job_id)))["worker"]["pid"] for s in specs}
    for pid in pids:  # each worker that stored the campaign
        stores = sorted(name for name in thread_names(pid) if name.startswith("store_"))
        assert stores == [f"store_{i}" for i in range(STORE_THREADS)], thread_names(pid)
    for spec, local in zip(specs, sd_engine.render(specs)):
        assert max_diff(bucket.get(image_name(campaign, spec.job_id)), local.image) <= TOLERANCE


# --------------------------------------------------------------------------- per-device batch 2


@pytest.mark.oracle
def test_per_device_batch_2_keeps_the_reproducibility_contract(cli: Cli, tmp_path: Path) -> None:
    """`--per-device-batch 2` is how a host with memory to spare renders more at once: its
    batches of 16 on 8 devices must give the images diffusers' PyTorch pipeline gives, and
    those of per-device batch 1. The oracle's eight DPM jobs, each twice (in two
    campaigns), go in batches of 16 (one of the guided jobs, one of the cfg-free ones):
    each job in two positions. (Per-device batch 1 runs the programs tests/test_engine.py
    compiles for the same jobs, from the session's compile cache.)"""
    model = ORACLE / "sd1" / "model"
    reference = BATCHES[("sd1/model", None, "dpm", 64, 64)]  # SD 1.x: every job is representable
    lines = tmp_path / "jobs.jsonl"
    lines.write_text("".join(
        json.dumps({"prompt": job["prompt"], "negative_prompt": job["negative_prompt"] or "", "seed": job["seed"],
                    "steps": job["steps"], "guidance_scale": job["guidance_scale"], "width": job["width"],
                    "height": job["height"], "scheduler": job["scheduler"], "campaign": campaign}) + "\n"
        for campaign in ("first", "second") for job in reference))
    results = {}
    for per_device in (2, 1):
        out = tmp_path / f"pdb{per_device}"
        code, printed, err = cli("render", "--prompts", lines, "--model", model, "--out", out,
                                 "--per-device-batch", per_device, "--quiet")
        assert code == 0, err
        assert f"(batch {8 * per_device})" in printed
        results[per_device] = {c: [json.loads(line) for line in (out / c / "manifest.jsonl").read_text().splitlines()]
                               for c in ("first", "second")}
    for campaign in ("first", "second"):
        records = {r["spec"]["seed"]: r for r in results[2][campaign]}
        singles = {r["spec"]["seed"]: r for r in results[1][campaign]}
        assert len(records) == len(reference)
        for job in reference:
            record = records[job["seed"]]
            # guided jobs and cfg-free ones (guidance <= 1) run in programs, so batches, apart
            kind = [j for j in reference if (j["guidance_scale"] > 1) == (job["guidance_scale"] > 1)]
            assert (record["batch"]["jobs"], record["batch"]["slots"]) == (2 * len(kind), 16)
            assert singles[job["seed"]]["batch"]["slots"] == 8
            png = tmp_path / "pdb2" / campaign / f"{record['job_id']}.png"
            assert max_diff(png, tmp_path / "pdb1" / campaign / f"{record['job_id']}.png") <= TOLERANCE
            assert max_diff(png, ORACLE / job["image"]) <= TOLERANCE, (campaign, job["id"])


# --------------------------------------------------------------------------- random seeds


def test_a_random_seed_is_recorded_and_reproduces_the_image(cli: Cli, tiny_sd: Path, tmp_path: Path) -> None:
    """Without --seed each job draws a seed; the sidecar must record the one it was rendered
    with, so that rendering it again with that seed gives the same PNG, byte for byte."""
    prompts = ["a red fox in snow", "a lighthouse at dawn", "a lighthouse at dawn"]
    first = tmp_path / "first"
    code, _, err = cli("render", *prompts, "--model", tiny_sd, "--out", first, "--campaign", "seedless",
                       "--steps", STEPS, "--quiet")
    assert code == 0, err
    records = [json.loads(line) for line in (first / "seedless" / "manifest.jsonl").read_text().splitlines()]
    assert [r["spec"]["prompt"] for r in records] == prompts
    seeds = [r["spec"]["seed"] for r in records]
    assert all(isinstance(s, int) and 0 <= s < 2**32 for s in seeds)
    assert len(set(seeds)) == 3  # drawn per job: the same prompt twice is two images
    for record in records:
        sidecar = json.loads((first / "seedless" / f"{record['job_id']}.json").read_text())
        assert sidecar["spec"]["seed"] == record["spec"]["seed"]
    again = tmp_path / "again"
    for record in records:
        code, _, err = cli("render", record["spec"]["prompt"], "--seed", record["spec"]["seed"], "--model", tiny_sd,
                           "--out", again, "--campaign", "seedless", "--steps", STEPS, "--quiet")
        assert code == 0, err
    for record in records:
        name = f"seedless/{record['job_id']}.png"
        assert (again / name).read_bytes() == (first / name).read_bytes(), record["spec"]
