"""Prometheus metrics from a real worker (`--metrics-port`), read over HTTP: images and
device-seconds per campaign, batches and their fill, render and store seconds, queue waits
from the producer's enqueue time, compiles, and a hostile message counted as invalid."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import urllib.request
from pathlib import Path

import pytest
import redis
from prometheus_client import generate_latest

from diffusion.flops import PEAK_ENV
from producer.submit import submit
from renderfarm.progress import Progress
from renderfarm.queue import TASK_NAME, job_message, priority_list, queue_name
from tests.conftest import STEPS
from tests.farm import WorkerProcess, farm_app, jobs, wait_done, wait_for
from tests.redis_server import RedisServer, free_port
from worker.metrics import WorkerMetrics


def scrape(port: int) -> dict[str, float]:
    """/metrics as {sample with labels: value}."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def test_a_worker_reports_what_it_did(redis_server: RedisServer, tiny_sd: Path, tmp_path: Path) -> None:
    model = tmp_path / "tiny-sd-metrics"  # a queue of its own
    shutil.copytree(tiny_sd, model)
    out, port = tmp_path / "out", free_port()
    r, app = redis_server.client(), farm_app(redis_server.url)
    # one job that breaks the job contract (steps 0): counted as invalid
    bad = dataclasses.replace(jobs(model, "metrics", 1, seed=99)[0], steps=0)
    app.send_task(TASK_NAME, **job_message(bad))
    worker = WorkerProcess(model, str(out), redis_server.url, "metrics", tmp_path,
                           extra=("--metrics-port", str(port), "--compile-cache", str(tmp_path / "cold")))
    try:
        worker.wait_ready(app)
        assert scrape(port)["renderfarm_compiles_total"] == 1  # --precompile, with a cold cache
        submit([f"a lighthouse {i}" for i in range(10)], model=str(model), campaign="metrics", seed=0, steps=STEPS,
               width=64, height=64, broker=redis_server.url, progress=False)
        status = wait_done(Progress(r), "metrics", 10)
        wait_for(lambda: scrape(port).get('renderfarm_images_failed_total{reason="invalid"}', 0) >= 1, 30,
                 "the invalid message counted")
        samples = scrape(port)
    finally:
        worker.stop()
    assert (status["done"], status["failed"]) == (10, 0)
    assert samples['renderfarm_images_rendered_total{campaign="metrics"}'] == 10
    batches = samples["renderfarm_batches_total"]
    assert batches >= 2  # 10 jobs in batches of 8
    assert samples["renderfarm_batch_fill_count"] == batches
    assert 10 / (8 * batches) - 1e-9 <= samples["renderfarm_batch_fill_sum"] / batches <= 1
    assert samples["renderfarm_render_seconds_count"] == batches and samples["renderfarm_render_seconds_sum"] > 0
    assert samples["renderfarm_store_seconds_count"] == batches
    assert samples["renderfarm_queue_wait_seconds_count"] == 10  # the producer's enqueue time, per job
    assert 0 < samples["renderfarm_queue_wait_seconds_sum"] < 10 * 600
    assert samples['renderfarm_device_seconds_total{campaign="metrics"}'] > 0
    assert samples['renderfarm_images_failed_total{reason="invalid"}'] == 1
    assert samples["renderfarm_flops_per_second"] > 0
    assert samples[f'renderfarm_queue_depth{{queue="{queue_name(str(model), "float32")}"}}'] == 0  # all taken
    assert "renderfarm_peak_fraction" in samples and samples["renderfarm_peak_fraction"] == 0  # CPU: no peak


def test_a_taken_port_is_refused_clearly(redis_server: RedisServer, tiny_sd: Path, tmp_path: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        worker = WorkerProcess(tiny_sd, str(tmp_path / "out"), redis_server.url, "taken", tmp_path,
                               extra=("--metrics-port", str(port)))
        assert worker.proc.wait(120) == 2
    assert re.search(rf"metrics-port={port}: cannot be served .*its own port", worker.log.read_text())


def test_peak_flops_and_the_fraction_of_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fraction of peak comes from diffusion.flops' one table (GPUs too) or $RENDERFARM_PEAK_TFLOPS,
    as the worker's log line does; a CPU has none."""
    assert WorkerMetrics("cpu", 8).peak is None
    assert WorkerMetrics("NVIDIA H100 80GB HBM3", 1).peak == pytest.approx(989e12)
    monkeypatch.setenv(PEAK_ENV, "100")
    assert WorkerMetrics("NVIDIA H100 80GB HBM3", 2).peak == pytest.approx(200e12)
    monkeypatch.delenv(PEAK_ENV)
    metrics = WorkerMetrics("TPU v4", 8)
    metrics.rendered(jobs=8, slots=8, seconds=2.0, flops=8 * 275e12)  # half of 8 chips' peak for 2 s
    assert metrics.peak_fraction._value.get() == pytest.approx(0.5)
    metrics.admitted([None, "soon", float("nan"), True, 1e20])  # anything may arrive: none counted
    assert metrics.queue_wait._sum.get() == 0


def test_the_queue_depth_counts_every_priority_list(broker: str) -> None:
    """What KEDA and celery-exporter miss when they read one list: jobs of every priority."""
    client = redis.Redis.from_url(broker)
    queue = queue_name("org/m", "float32")
    for step, count in ((0, 2), (3, 4), (9, 1)):
        client.rpush(priority_list(queue, step), *[b"job"] * count)
    client.rpush(priority_list(queue_name("org/other", "float32"), 0), b"job")  # another queue: not counted
    metrics = WorkerMetrics("cpu", 8)
    metrics.watch_queue(client, queue)
    text = generate_latest(metrics.registry).decode()
    assert f'renderfarm_queue_depth{{queue="{queue}"}} 7.0' in text
    client.lpop(priority_list(queue, 3))
    assert f'renderfarm_queue_depth{{queue="{queue}"}} 6.0' in generate_latest(metrics.registry).decode()


def test_the_dashboard_shows_only_metrics_workers_export() -> None:
    dashboard = json.loads((Path(__file__).parent.parent / "infra" / "grafana" / "renderfarm.json").read_text())
    exported = {metric.name for metric in WorkerMetrics("cpu", 1).registry.collect()}
    used = {re.sub(r"_(total|sum|count|bucket)$", "", name)
            for panel in dashboard["panels"] for target in panel["targets"]
            for name in re.findall(r"renderfarm_\w+", target["expr"])}
    assert used == exported, (used ^ exported)
