"""The distributed farm with real parts: redis-server, `renderfarm worker` processes with a
tiny model on 8 CPU devices (the session's farm, tests/conftest.py, and a worker of a test's
own where it needs other flags), the google-cloud-storage client against the emulator."""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import io
import json
import re
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from celery.result import AsyncResult
from PIL import Image

from harness.farm import (
    STEPS,
    WorkerProcess,
    enqueue,
    jobs,
    manifest_ids,
    manifest_records,
    wait_done,
    wait_for,
)
from producer.submit import submit
from renderfarm import deadletters
from renderfarm.images import check_init_image
from renderfarm.sources import SourceRoots
from renderfarm.jobs import JobSpec
from renderfarm.layout import (
    image_name,
    index_name,
    preview_name,
    sidecar_name,
    thumbnail_name,
)
from renderfarm.queue import TASK_NAME, priority_lists, queue_name
from renderfarm.storage import Storage
from tests.flower_process import poll, run_flower
from harness.gcs_emulator import GcsEmulator
from tests.helpers import DATA, FARM_OUT, ORACLE, Farm

pytestmark = pytest.mark.farm


def assert_landed_once(storage: Storage, specs: list[JobSpec]) -> None:
    campaign = specs[0].campaign
    names = set(storage.list(f"{campaign}/"))
    results = {name(campaign, s.job_id) for s in specs for name in (image_name, sidecar_name, thumbnail_name)}
    gallery = {index_name(campaign), preview_name(campaign)}  # rebuilt now and then: may lag
    gallery |= {name for name in names if name.startswith(f"{campaign}/thumbs/source-")}  # image jobs' sources
    assert results <= names
    assert all(name.startswith(f"{campaign}/manifest/") for name in names - results - gallery)
    ids = manifest_ids(storage, campaign)
    assert sorted(ids) == sorted(s.job_id for s in specs)  # each exactly once


@pytest.fixture(scope="module")
def c72(farm: Farm, tiny_sd: Path) -> tuple[list[JobSpec], dict]:
    """A finished campaign of 72 jobs over both workers (more than the 64 one worker may hold
    unacknowledged, so both render some), for the tests that look at one or
    submit it again (whichever of them runs first renders it): its jobs and the status
    when it finished."""
    specs = [dataclasses.replace(spec, negative_prompt="blurry") if i % 3 == 0 else spec
             for i, spec in enumerate(jobs(tiny_sd, "c72", 72))]
    return enqueue(farm.app, farm.progress, specs), wait_done(farm.progress, "c72", 72)


def test_72_jobs_over_2_workers_match_local_render(farm: Farm, bucket: Storage, c72: tuple[list[JobSpec], dict],
                                                   sd_engine) -> None:  # noqa: ANN001
    specs, status = c72
    assert (status["done"], status["failed"], status["queued"], status["running"]) == (72, 0, 0, 0)
    assert_landed_once(bucket, specs)
    assert len(manifest_ids(bucket, "c72")) == 72
    local = sd_engine.render(specs)
    pids = set()
    for spec, expected in zip(specs, local):
        png = Image.open(io.BytesIO(bucket.get(f"c72/{spec.job_id}.png")))
        diff = np.abs(np.asarray(png, np.int16) - expected.image.astype(np.int16)).max()
        assert diff <= 2, f"job {spec.job_id} differs from the local render by {diff}/255"
        pids.add(json.loads(bucket.get(f"c72/{spec.job_id}.json"))["worker"]["pid"])
    assert len(pids) == 2, "both workers should have rendered"
    # what the campaign cost the devices: the sum of what its images cost, each counted once
    shares = [json.loads(bucket.get(f"c72/{s.job_id}.json"))["device_seconds"] for s in specs]
    assert min(shares) > 0 and status["device_seconds"] == pytest.approx(sum(shares), rel=1e-6)


def test_flower_sees_workers_and_every_job(farm: Farm, tiny_sd: Path) -> None:
    with run_flower(farm.broker, auth="ops:s3cret") as flower:
        flower.wait_for_workers([w.name for w in farm.workers])
        specs = enqueue(farm.app, farm.progress, jobs(tiny_sd, "flowered", 16, seed=1000))
        wait_done(farm.progress, "flowered", 16)

        def all_succeeded() -> dict | None:
            tasks = flower.tasks(f"taskname={TASK_NAME}")
            return tasks if all(tasks.get(s.job_id, {}).get("state") == "SUCCESS" for s in specs) else None

        tasks = poll(all_succeeded, "every job SUCCESS in Flower", timeout=30)
        for spec in specs:
            shown = ast.literal_eval(tasks[spec.job_id]["kwargs"])
            assert (shown["campaign"], shown["prompt"], shown["seed"]) == (spec.campaign, spec.prompt, spec.seed)
        assert flower.get("/api/tasks", credentials=False).status == 401


def test_resubmitting_a_finished_campaign_renders_nothing(farm: Farm, bucket: Storage, tiny_sd: Path,
                                                          c72: tuple[list[JobSpec], dict]) -> None:
    specs = c72[0]
    before = {s.job_id: bucket.get(f"c72/{s.job_id}.json") for s in specs}
    enqueue(farm.app, farm.progress, specs)
    redis = farm.progress.r
    wait_for(lambda: redis.llen(queue_name(str(tiny_sd), "float32")) == 0
             and farm.progress.status("c72")["running"] == 0, 60, "the queue to drain")
    wait_for(lambda: all(int(redis.hget("rf:c:c72:attempts", s.job_id)) >= 2 for s in specs), 60, "redelivery")
    assert {s.job_id: bucket.get(f"c72/{s.job_id}.json") for s in specs} == before  # not rendered again
    assert farm.progress.status("c72")["device_seconds"] == pytest.approx(c72[1]["device_seconds"])  # nor counted
    assert len(manifest_ids(bucket, "c72")) == 72


def test_cancelled_campaign_is_skipped_not_rendered(farm: Farm, bucket: Storage, tiny_sd: Path) -> None:
    farm.progress.cancel("cancelled")
    enqueue(farm.app, farm.progress, jobs(tiny_sd, "cancelled", 12, seed=1200))
    wait_for(lambda: farm.progress.status("cancelled")["cancelled"] == 12, 60, "12 cancelled jobs")
    status = farm.progress.status("cancelled")
    assert (status["done"], status["queued"], status["running"]) == (0, 0, 0)
    assert list(bucket.list("cancelled/")) == []


def test_poison_job_in_a_batch(farm: Farm, bucket: Storage, tiny_sd: Path) -> None:
    good = enqueue(farm.app, farm.progress, jobs(tiny_sd, "poison", 7))
    poison = {**jobs(tiny_sd, "poison", 8, seed=100)[7].to_dict(), "steps": 0}
    farm.app.send_task(TASK_NAME, task_id="poison-job", kwargs=poison,
                          queue=queue_name(str(tiny_sd), "float32"))
    wait_done(farm.progress, "poison", 7)
    assert_landed_once(bucket, good)
    result = AsyncResult("poison-job", app=farm.app)
    wait_for(lambda: result.state == "FAILURE", 30, "the poison job to fail")
    assert "steps=0: must be in 1..500" in str(result.result)


def test_storage_outage_is_retried(farm: Farm, bucket: Storage, tiny_sd: Path, gcs: GcsEmulator) -> None:
    gcs.stop()
    try:
        specs = enqueue(farm.app, farm.progress, jobs(tiny_sd, "outage", 8, seed=900))
        wait_for(lambda: any(re.search(r"storage: \S+ gs://\S+/outage/\S* transient error", w.log.read_text())
                             for w in farm.workers), 120, "a worker to retry a store of the campaign")
        assert farm.progress.status("outage")["done"] == 0
    finally:
        gcs.start()
    status = wait_done(farm.progress, "outage", 8)
    assert (status["done"], status["failed"]) == (8, 0)
    assert_landed_once(bucket, specs)


def test_interleaved_shapes_run_in_full_batches(farm: Farm, bucket: Storage, tiny_sd: Path,
                                                tmp_path: Path) -> None:
    """Two shapes alternating on the queue: the worker groups them by shape key, so each
    batch runs full instead of half padding (`bench/engine.py shapes` measures the fill)."""
    model = tmp_path / "tiny-sd-shapes"  # its own queue, served by this worker alone
    shutil.copytree(tiny_sd, model)
    specs = [dataclasses.replace(spec, width=(64, 80)[i % 2])
             for i, spec in enumerate(jobs(model, "shapes", 32, seed=900))]
    enqueue(farm.app, farm.progress, specs)
    # A long --max-wait: on a CPU the devices' threads starve the consumer while a batch
    # renders, so here only a full batch (or the end of the queue) may flush one.
    worker = WorkerProcess(model, FARM_OUT, farm.broker, "shapes", farm.logs, farm.env,
                           precompile=f"64x64@{STEPS},80x64@{STEPS}", extra=("--max-wait", "10"))
    try:
        status = wait_done(farm.progress, "shapes", 32)
    finally:
        worker.stop()
    assert (status["done"], status["failed"]) == (32, 0)
    assert_landed_once(bucket, specs)
    batches = {}
    for record in manifest_records(bucket, "shapes"):
        batches.setdefault(record["batch"]["seq"], set()).add((record["width"], record["batch"]["jobs"]))
    assert len(batches) == 4 and all(len(shapes) == 1 and next(iter(shapes))[1] == 8 for shapes in batches.values())


def test_redis_restarted_three_times_mid_campaign(farm: Farm, bucket: Storage, tiny_sd: Path) -> None:
    """Redis stopped (SIGKILL) and started again three times while 48 jobs render: every
    job lands, with one manifest line each, wherever the restarts strike."""
    specs = enqueue(farm.app, farm.progress, jobs(tiny_sd, "restart", 48, seed=700))
    for done in (4, 16, 28):
        wait_for(lambda d=done: farm.progress.status("restart")["done"] >= d, 180, f"{done} jobs")
        farm.redis.stop()
        time.sleep(1)
        farm.redis.start()
    status = wait_done(farm.progress, "restart", 48, timeout=300)
    assert (status["done"], status["failed"]) == (48, 0)
    assert_landed_once(bucket, specs)
    assert all(w.proc.poll() is None for w in farm.workers)


def test_a_lone_job_on_an_idle_worker_does_not_wait_max_wait(farm: Farm, bucket: Storage, tiny_sd: Path,
                                                             tmp_path: Path) -> None:
    """Idle devices take a partial batch once the queue is quiet; --max-wait only bounds
    how long jobs gather while the devices are busy."""
    model = tmp_path / "tiny-sd-lone"  # its own queue, served by this worker alone
    shutil.copytree(tiny_sd, model)
    worker = WorkerProcess(model, FARM_OUT, farm.broker, "lone", farm.logs, farm.env,
                           extra=("--max-wait", "600"))
    try:
        worker.wait_ready(farm.app)
        (spec,) = enqueue(farm.app, farm.progress, jobs(model, "lone", 1, seed=1100))
        status = wait_done(farm.progress, "lone", 1, timeout=120)  # far less than --max-wait
    finally:
        worker.stop()
    assert (status["done"], status["failed"]) == (1, 0)
    assert_landed_once(bucket, [spec])
    assert json.loads(bucket.get(sidecar_name("lone", spec.job_id)))["batch"]["jobs"] == 1


def test_a_worker_serves_one_lora_set_and_no_other(farm: Farm, bucket: Storage, cli: Any) -> None:
    """A model reference is base + LoRAs + scales: a worker started with a LoRA consumes that
    set's queue alone, so jobs for the plain model wait for a worker of their own (status warns
    of it), and the LoRA jobs' sidecars name the LoRA file, its scale and its sha256."""
    model, lora = ORACLE / "sd1" / "model", DATA / "lora" / "sd1" / "kohya.safetensors"
    worker = WorkerProcess(model, FARM_OUT, farm.broker, "lora", farm.logs, farm.env,
                           extra=("--lora", f"{lora}:0.7"))
    plain_queue = queue_name(str(model), "float32")
    try:
        worker.wait_ready(farm.app)
        styled = enqueue(farm.app, farm.progress, jobs(model, "lora-set", 4, seed=1200, loras=((str(lora), 0.7),)))
        submit(["a plain lighthouse", "a plain fox"], model=str(model), campaign="plain-set", seed=0, steps=STEPS,
               broker=farm.broker, progress=False)  # as a producer does: status knows its queue
        status = wait_done(farm.progress, "lora-set", 4)
        time.sleep(2)  # the window in which a worker of another set must NOT take the plain jobs
        assert farm.progress.status("plain-set")["done"] == 0
        code, out, _ = cli("status", "plain-set", "--json", "--broker", farm.broker)
        assert code == 0
        report = json.loads(out)
        assert f"queue {plain_queue} has 2 jobs and no worker consumes it" in report["warnings"]
        # the fleet: what this worker did, for the queue of its set
        (mine,) = [w for w in report["workers"] if w["node"] == worker.name]
        assert mine["images"] == 4 and mine["queue"] == queue_name(str(model), "float32", loras=((str(lora), 0.7),))
        assert 0 < mine["batch_fill"] <= 1 and not mine["stalled"]
    finally:
        worker.stop()
        farm.redis.client().delete(*priority_lists(plain_queue))
    assert (status["done"], status["failed"]) == (4, 0)
    digest = hashlib.sha256(lora.read_bytes()).hexdigest()
    for spec in styled:
        record = json.loads(bucket.get(sidecar_name("lora-set", spec.job_id)))
        assert record["model"]["loras"] == [[str(lora), 0.7]]
        assert {"role": "lora", "file": str(lora), "scale": 0.7, "sha256": digest} in record["model"]["weights"]


def test_an_image_job_whose_source_is_gone_fails_and_the_rest_of_its_batch_renders(
        farm: Farm, bucket: Storage, tiny_sd: Path, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Sources are read ahead, as a job arrives; one that is gone by then fails its jobs for good
    (dead-lettered with the reason), and the rest of the batch, image jobs from the same
    photo at other strengths among them, renders."""
    photos = [tmp_path / "kept.png", tmp_path / "gone.png"]
    for path, colour in zip(photos, [(250, 120, 0), (0, 90, 250)]):
        Image.new("RGB", (64, 64), colour).save(path)
    specs = [check_init_image(dataclasses.replace(spec, init_image=str(photos[i % 2]), strength=0.5 + 0.1 * (i // 2),
                                                  scheduler="euler"), 64)
             for i, spec in enumerate(jobs(tiny_sd, "sources", 6, seed=40))]
    photos[1].unlink()  # after the producer read it
    enqueue(farm.app, farm.progress, specs)
    status = wait_done(farm.progress, "sources", 6)
    assert (status["done"], status["failed"]) == (3, 3)
    assert_landed_once(bucket, specs[0::2])
    roots = SourceRoots.parse([str(tmp_path_factory.getbasetemp())])
    assert {str(reason) for reason in status["failures"].values()} == {f"invalid job: init_image='{photos[1]}': {roots.rule}"}
    letters = deadletters.DeadLetters(farm.progress.r)
    queue = queue_name(str(tiny_sd), "float32")
    reasons = [entry["reason"] for entry in letters.entries(queue, limit=1000) if "gone.png" in entry["reason"]]
    assert len(reasons) == 3
