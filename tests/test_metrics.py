"""Prometheus metrics from real workers (`--metrics-port`: the session's farm), read over HTTP:
images and device-seconds per campaign, batches and their fill, render and store seconds, queue
waits from the producer's enqueue time, compiles, and a hostile message counted as invalid."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import redis
from prometheus_client import generate_latest

from diffusion.flops import PEAK_ENV
from harness.farm import STEPS, WorkerProcess, jobs, wait_done, wait_for
from harness.redis_server import RedisServer
from producer.submit import submit
from renderfarm.queue import TASK_NAME, job_message, priority_list, queue_name
from tests.helpers import Farm, scrape
from worker.metrics import WorkerMetrics


def summed(scrapes: list[dict[str, float]]) -> dict[str, float]:
    """Several workers' /metrics, sample by sample."""
    total: dict[str, float] = {}
    for samples in scrapes:
        for name, value in samples.items():
            total[name] = total.get(name, 0.0) + value
    return total


@pytest.mark.farm
def test_workers_report_what_they_did(farm: Farm, tiny_sd: Path) -> None:
    """What the farm's workers did for this test's campaign: how their counters grew while it
    ran (the farm serves other tests' campaigns too)."""
    # the first worker started with a cold compile cache: --precompile compiled its shape's
    # program and the text encoders'
    assert farm.started[0]["renderfarm_compiles_total"] == 2
    before = [scrape(port) for port in farm.metrics_ports]
    # one job that breaks the job contract (steps 0): counted as invalid
    bad = dataclasses.replace(jobs(tiny_sd, "metrics", 1, seed=99)[0], steps=0)
    farm.app.send_task(TASK_NAME, **job_message(bad))
    submit([f"a lighthouse {i}" for i in range(10)], model=str(tiny_sd), campaign="metrics", seed=0, steps=STEPS,
           width=64, height=64, broker=farm.broker, progress=False)
    status = wait_done(farm.progress, "metrics", 10)
    invalid = 'renderfarm_images_failed_total{reason="invalid"}'
    counted = summed(before).get(invalid, 0) + 1
    wait_for(lambda: summed([scrape(port) for port in farm.metrics_ports]).get(invalid, 0) >= counted, 30,
             "the invalid message counted")
    after = [scrape(port) for port in farm.metrics_ports]
    samples = {name: value - summed(before).get(name, 0.0) for name, value in summed(after).items()}
    assert (status["done"], status["failed"]) == (10, 0)
    rendered = 'renderfarm_images_rendered_total{campaign="metrics"}'
    assert samples[rendered] == 10
    batches = samples["renderfarm_batches_total"]
    assert batches >= 2  # 10 jobs in batches of 8
    assert samples["renderfarm_batch_fill_count"] == batches
    assert 10 / (8 * batches) - 1e-9 <= samples["renderfarm_batch_fill_sum"] / batches <= 1
    assert samples["renderfarm_render_seconds_count"] == batches and samples["renderfarm_render_seconds_sum"] > 0
    assert samples["renderfarm_store_seconds_count"] == batches
    assert samples["renderfarm_queue_wait_seconds_count"] == 10  # the producer's enqueue time, per job
    assert 0 < samples["renderfarm_queue_wait_seconds_sum"] < 10 * 600
    assert samples['renderfarm_device_seconds_total{campaign="metrics"}'] > 0
    assert samples[invalid] == 1
    queue = f'renderfarm_queue_depth{{queue="{queue_name(str(tiny_sd), "float32")}"}}'
    for gauges in after:  # each worker's own
        assert gauges[queue] == 0  # all taken
        assert "renderfarm_peak_fraction" in gauges and gauges["renderfarm_peak_fraction"] == 0  # CPU: no peak
        if gauges.get(rendered):
            assert gauges["renderfarm_flops_per_second"] > 0


@pytest.mark.farm
def test_a_taken_port_is_refused_clearly(redis_server: RedisServer, tiny_sd: Path, tmp_path: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        worker = WorkerProcess(tiny_sd, str(tmp_path / "out"), redis_server.url, "taken", tmp_path,
                               extra=("--metrics-port", str(port)))
        assert worker.proc.wait(120) == 2
    log = worker.log.read_text()
    assert re.search(rf"metrics-port={port}: cannot be served .*its own port", log)
    assert "loaded in" not in log  # refused before the model is loaded and its programs compiled


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
