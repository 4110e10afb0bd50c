"""What the worker does on a bundle's state changes besides settling its jobs, one concern
per hook (worker.bundles.BundleHook): the fleet's hash, galleries, Prometheus metrics and the
rate log line. `renderfarm worker` picks them (worker.commands)."""

from __future__ import annotations

import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import redis

from diffusion.flops import describe_rate
from renderfarm.fleet import record_stored
from renderfarm.gallery import Refresher
from renderfarm.sources import SourceRoots
from renderfarm.queue import ENQUEUED_HEADER
from renderfarm.storage import Storage
from worker.bundles import Bundle, BundleHook, State
from worker.engine import Engine, ShapeKey
from worker.metrics import WorkerMetrics

log = logging.getLogger("renderfarm.worker")

GALLERY_QUIET = 2.0  # seconds without a stored bundle before galleries are brought up to date


class FleetHook(BundleHook):
    """Each stored bundle adds to this worker's totals in Redis (renderfarm/fleet.py)."""

    def __init__(self, client: redis.Redis, node: str, queue: str) -> None:
        self.client, self.node, self.queue = client, node, queue

    def settled(self, bundle: Bundle) -> None:
        with contextlib.suppress(redis.RedisError):  # the fleet's view is no reason to fail a job
            record_stored(self.client, self.node, self.queue, bundle.records)


class GalleryHook(BundleHook):
    """Galleries rebuilt on their own thread: throttled while a campaign runs (the
    Refresher), and once more when the worker has had nothing to do for `quiet` seconds."""

    def __init__(self, storage: Storage, roots: SourceRoots | None, quiet: float = GALLERY_QUIET) -> None:
        self.refresher, self.quiet = Refresher(storage, roots=roots), quiet
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="gallery")  # refreshes never hold up the consumer
        self._stale, self._last_stored = False, time.monotonic()

    def settled(self, bundle: Bundle) -> None:
        if bundle.records:
            self.thread.submit(self.refresher.stored, {record["spec"]["campaign"] for record in bundle.records})
            self._stale, self._last_stored = True, time.monotonic()

    def polled(self, busy: bool) -> None:
        if self._stale and not busy and time.monotonic() - self._last_stored > self.quiet:
            self._stale = False
            self.thread.submit(self.refresher.flush)


class MetricsHook(BundleHook):
    """The Prometheus metrics of bundles and their batches (worker.metrics): queue waits, renders, stores, compiles."""

    def __init__(self, metrics: WorkerMetrics, engine: Engine) -> None:
        self.metrics, self.engine = metrics, engine

    def admitted(self, bundle: Bundle) -> None:
        self.metrics.admitted(job.request.request_dict.get(ENQUEUED_HEADER) for job in bundle.jobs)

    def rendered(self, bundle: Bundle) -> None:
        for batch in bundle.batches:
            self.metrics.rendered(batch.jobs, batch.slots, batch.seconds, self.engine.flops(bundle.key))
        self.metrics.compiled(self.engine.compiles, self.engine.compile_seconds)

    def settled(self, bundle: Bundle) -> None:
        if bundle.records:
            self.metrics.stored(bundle.records, bundle.entered[State.SETTLED] - bundle.entered[State.STORING])


class RateLog(BundleHook):
    """Every `interval` seconds, one log line of what the devices achieved: images/s and
    FLOP/s with its fraction of the devices' peak, so an operator on real hardware sees
    how far from the ceiling the worker runs (docs/performance.md)."""

    def __init__(self, engine: Engine, interval: float = 30.0) -> None:
        self.engine, self.interval = engine, interval
        self._since, self._images, self._flops = time.monotonic(), 0, 0.0

    def rendered(self, bundle: Bundle) -> None:
        for batch in bundle.batches:
            self._add(bundle.key, batch.jobs)

    def _add(self, key: ShapeKey, images: int) -> None:
        flops = self.engine.flops(key)
        self._images += images
        self._flops = self._flops + flops if flops is not None and self._flops is not None else None
        seconds = time.monotonic() - self._since
        if seconds >= self.interval:
            devices = self.engine.devices
            log.info("%d images in %.0fs: %.2f images/s, %s", self._images, seconds, self._images / seconds,
                     describe_rate(self._flops, seconds, devices[0].device_kind, len(devices)))
            self._since, self._images, self._flops = time.monotonic(), 0, 0.0
