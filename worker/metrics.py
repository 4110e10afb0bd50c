"""Prometheus metrics of one worker process (`renderfarm worker --metrics-port P`).

Each worker has a registry of its own (several workers on one host each serve their own port),
updated on a bundle's state changes (worker.hooks.MetricsHook): admitted (queue wait), each
batch rendered (render seconds, fill, FLOP/s), bundle stored (images and device-seconds per campaign,
store seconds), compiled; and as a job's life ends (worker.outcomes.Outcomes): failed (by reason). infra/grafana/renderfarm.json is a dashboard of them.
"""

from __future__ import annotations

import math
import socket
import time
from collections.abc import Iterable
from typing import Any

import redis
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from diffusion.flops import peak_flops
from renderfarm.errors import JobError
from renderfarm.queue import priority_lists

FAILURE_REASONS = ("invalid", "render", "storage", "attempts")
SECONDS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
WAITS = (1, 5, 15, 60, 300, 900, 3600, 4 * 3600, 24 * 3600)


def check_port(port: int) -> None:
    """Refuse a port already taken before a worker spends minutes loading and compiling."""
    with socket.socket() as probe:
        try:
            probe.bind(("0.0.0.0", port))
        except OSError as err:
            raise _port_taken(port, err) from None


def _port_taken(port: int, err: OSError) -> JobError:
    return JobError("metrics-port", port, f"cannot be served ({err}); give each worker on a host its own port")

class WorkerMetrics:
    """The metrics, in their own registry."""

    def __init__(self, device_kind: str, devices: int) -> None:
        self.registry = r = CollectorRegistry()
        # One peak for the log and Prometheus (diffusion.flops: the table or $RENDERFARM_PEAK_TFLOPS);
        # a device kind it does not know (CPU) exports no fraction of peak.
        peak = peak_flops(device_kind)
        self.peak = None if peak is None else peak * devices
        self.images = Counter("renderfarm_images_rendered", "Images stored", ["campaign"], registry=r)
        # the safety pass rate of a campaign: 1 - nsfw / safety-checked
        self.safety_checked = Counter("renderfarm_images_safety_checked", "Images stored with a safety score",
                                      ["campaign"], registry=r)
        self.nsfw = Counter("renderfarm_images_nsfw", "Images stored that the safety checker flagged",
                            ["campaign"], registry=r)
        # the gate pass rate of a campaign: passed / gated
        self.gated = Counter("renderfarm_images_gated", "Images stored of jobs with a gate", ["campaign"], registry=r)
        self.gate_passed = Counter("renderfarm_images_gate_passed", "Images stored that passed their job's gate",
                                   ["campaign"], registry=r)
        self.failed = Counter("renderfarm_images_failed", "Jobs failed or retried, by reason", ["reason"],
                              registry=r)
        self.batches = Counter("renderfarm_batches", "Batches rendered", registry=r)
        self.fill = Histogram("renderfarm_batch_fill", "Jobs over slots of each batch",
                              buckets=(0.125, 0.25, 0.5, 0.75, 0.99, 1.0), registry=r)
        self.queue_wait = Histogram("renderfarm_queue_wait_seconds", "Enqueue to start of rendering",
                                    buckets=WAITS, registry=r)
        self.render_seconds = Histogram("renderfarm_render_seconds", "A batch's start to its collection",
                                        buckets=SECONDS, registry=r)
        self.store_seconds = Histogram("renderfarm_store_seconds", "A batch's hand-over to its last stored image",
                                       buckets=SECONDS, registry=r)
        self.compiles = Counter("renderfarm_compiles", "Programs compiled", registry=r)
        self.compile_seconds = Counter("renderfarm_compile_seconds", "Seconds spent compiling", registry=r)
        self.device_seconds = Counter("renderfarm_device_seconds", "Device-seconds of stored images",
                                      ["campaign"], registry=r)
        self.flops = Gauge("renderfarm_flops_per_second", "FLOP/s of the last batch, all devices", registry=r)
        self.peak_fraction = Gauge("renderfarm_peak_fraction", "Achieved over peak FLOP/s (known devices)",
                                   registry=r)
        self.queue_depth = Gauge("renderfarm_queue_depth", "Jobs waiting in the queue, over all its priority lists",
                                 ["queue"], registry=r)
        self._compiles_seen = (0, 0.0)

    def watch_queue(self, client: redis.Redis, queue: str) -> None:
        """Export `queue`'s depth, read when scraped: kombu keeps one Redis list per priority
        step, and an autoscaler that reads the queue's own list alone misses the others."""
        lists = priority_lists(queue)

        def depth() -> float:
            pipe = client.pipeline(transaction=False)
            for name in lists:
                pipe.llen(name)
            return float(sum(pipe.execute()))

        self.queue_depth.labels(queue).set_function(depth)

    def serve(self, port: int) -> None:
        """Serve /metrics on `port` (taken: a JobError naming it; each worker needs its own)."""
        try:
            start_http_server(port, registry=self.registry)
        except OSError as err:
            raise _port_taken(port, err) from None

    def admitted(self, enqueued: Iterable[Any], now: float | None = None) -> None:
        """Queue waits of jobs starting to render; a missing or implausible time is skipped
        (anything may arrive on a queue)."""
        now = time.time() if now is None else now
        for sent in enqueued:
            if isinstance(sent, (int, float)) and not isinstance(sent, bool) and math.isfinite(sent) \
                    and 0 <= now - sent < 30 * 24 * 3600:
                self.queue_wait.observe(now - sent)

    def rendered(self, jobs: int, slots: int, seconds: float, flops: float | None) -> None:
        self.batches.inc()
        self.fill.observe(jobs / slots)
        self.render_seconds.observe(seconds)
        if flops and seconds > 0:
            self.flops.set(flops / seconds)
            if self.peak:
                self.peak_fraction.set(flops / seconds / self.peak)

    def stored(self, records: Iterable[dict[str, Any]], seconds: float) -> None:
        self.store_seconds.observe(seconds)
        for record in records:
            campaign = record["spec"]["campaign"]
            self.images.labels(campaign).inc()
            self.device_seconds.labels(campaign).inc(record["device_seconds"])
            nsfw = (record.get("scores") or {}).get("nsfw")
            if nsfw is not None:
                self.safety_checked.labels(campaign).inc()
                self.nsfw.labels(campaign).inc(nsfw)
            passed = (record.get("gate") or {}).get("passed")
            if passed is not None:
                self.gated.labels(campaign).inc()
                self.gate_passed.labels(campaign).inc(passed)

    def compiled(self, count: int, seconds: float) -> None:
        """The engine's totals so far (compiles run on their own thread; counted as seen)."""
        self.compiles.inc(count - self._compiles_seen[0])
        self.compile_seconds.inc(seconds - self._compiles_seen[1])
        self._compiles_seen = (count, seconds)
