"""The farm worker: a Celery worker (solo pool, JAX in the main process) that consumes its
model's queue in batches of `devices x per_device_batch` jobs.

Why not celery-batches: it sends no per-job task events (Flower would see nothing), its
`Task.retry` does not work, and after a broker reconnect it can stop flushing while holding
unacked messages. This module is the small part of it we need, on Celery's own consumer
API: a task Strategy that buffers requests and flushes them when a batch is full or
`max_wait` has passed, rebuilt cleanly on every reconnect, with Celery's own per-request
events and worker state, so Flower and `inspect` see every job.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from celery import Celery, Task
from celery.exceptions import InvalidTaskError
from celery.worker.request import Request, create_request_cls
from celery.worker.state import task_accepted, task_ready, task_reserved

from renderfarm.gallery import Refresher
from renderfarm.jobs import JobError, JobSpec, parse_job
from renderfarm.progress import Progress
from renderfarm.queue import TASK_NAME
from renderfarm.settings import Settings
from renderfarm.storage import Storage, manifest_name, sidecar_name
from worker.engine import Engine, InFlight, Rendered, ShapeKey
from worker.flops import describe_rate
from worker.output import BatchWriter

log = logging.getLogger("renderfarm.worker")


GALLERY_QUIET = 2.0  # seconds without a stored batch before galleries are brought up to date
# Seconds without an arriving job after which idle devices take a partial batch: while the
# queue has jobs, the worker's pop (worker.broker) brings them in far quicker than that.
QUEUE_QUIET = 0.05


class JobFailed(Exception):
    """What the result backend and Flower show for a job that failed for good."""


class Job:
    """One request of a batch and what the worker learned about it."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self.spec: JobSpec | None = None
        self.invalid = ""  # why the job is not valid here, if it is not
        self.attempt = 0
        self.started = time.time()

    @property
    def campaign(self) -> str:
        """Only asked once the job is validated."""
        assert self.spec is not None
        return self.spec.campaign


class Processor:
    """Runs one batch: validate, skip what is cancelled or already stored, render (job by
    job if the batch raises), then hand it to the BatchWriter, which stores it while the
    next batch renders; jobs are marked done and acked only once their PNG and sidecar are
    stored (`poll`, on the consumer's timer, and every later batch)."""

    def __init__(self, engine: Engine, storage: Storage, progress: Progress, app: Celery,
                 settings: Settings, store_threads: int | None = None) -> None:
        self.engine, self.storage, self.progress, self.app = engine, storage, progress, app
        self.max_attempts = settings.max_attempts
        self.writer = BatchWriter(storage, engine.model, engine.devices, threads=store_threads,
                                  on_stored=self._stored, on_failed=self._store_failed)
        self._jobs: dict[str, list[Job]] = {}  # job id -> its requests being stored
        self._inflight: tuple[InFlight, list[Job]] | None = None
        self._idle_since = time.monotonic()
        # Galleries are rebuilt on their own thread (a refresh reads the whole manifest):
        # throttled while a campaign runs, and once more when the worker has had nothing
        # to do for GALLERY_QUIET seconds.
        self.gallery = Refresher(storage)
        self._gallery_thread = ThreadPoolExecutor(1, thread_name_prefix="gallery")
        self._gallery_stale = False
        self._last_stored = time.monotonic()
        self._rate = RateLog(engine)

    # -- outcomes ------------------------------------------------------------------

    def _succeed(self, done: list[tuple[Job, dict[str, Any]]]) -> None:
        self.progress.finished((job.campaign, result["job_id"]) for job, result in done)
        for job, result in done:  # successes live in storage and Progress, not the result backend
            job.request.send_event("task-succeeded", result=repr(result), runtime=time.time() - job.started)
            task_ready(job.request, successful=True)
            job.request.acknowledge()

    def _fail(self, job: Job, reason: str) -> None:
        """Failed for good: recorded with its reason, acked so it is not delivered again."""
        log.warning("job %s failed: %s", job.request.id, reason)
        if job.spec is not None:
            self.progress.failed(job.campaign, job.spec.job_id, reason)
        self.app.backend.mark_as_failure(job.request.id, JobFailed(reason))
        job.request.send_event("task-failed", exception=reason, traceback="")
        task_ready(job.request)
        job.request.acknowledge()

    def _retry_later(self, job: Job, reason: str) -> None:
        if job.attempt >= self.max_attempts:
            self._fail(job, f"{reason} (after {job.attempt} attempts)")
            return
        log.warning("job %s attempt %d failed, queued again: %s", job.request.id, job.attempt, reason)
        assert job.spec is not None
        self.progress.released(job.campaign, job.spec.job_id)
        task_ready(job.request)
        job.request.reject(requeue=True)

    def _stored(self, records: list[dict[str, Any]]) -> None:
        self._gallery_thread.submit(self.gallery.stored, {record["spec"]["campaign"] for record in records})
        self._gallery_stale, self._last_stored = True, time.monotonic()
        done = []
        for record in records:
            job = self._take(record["job_id"])
            done.append((job, {"job_id": record["job_id"], "png_sha256": record["png_sha256"],
                               "url": self.storage.url(sidecar_name(job.campaign, record["job_id"]))}))
        self._succeed(done)

    def _take(self, job_id: str) -> Job:
        waiting = self._jobs[job_id]
        job = waiting.pop(0)
        if not waiting:
            del self._jobs[job_id]
        return job

    def _store_failed(self, result: Rendered, error: Exception) -> None:
        job = self._take(result.spec.job_id)
        job.attempt -= 1  # storage outages are not the job's fault
        self.progress.refund_attempt(result.spec.job_id)
        self._retry_later(job, f"storage: {error!r}")

    # -- the batch -----------------------------------------------------------------

    def classify(self, job: Job) -> ShapeKey | None:
        """Validate a job as it arrives; its shape key is the batch it can join (None: not
        valid here, failed with the reason when its batch runs)."""
        try:
            if job.request.args:
                raise JobError("args", job.request.args, "a job has keyword fields only")
            job.spec = parse_job(job.request.kwargs, size_step=self.engine.model.size_step)
            return self.engine.check(job.spec)
        except JobError as err:
            job.spec, job.invalid = None, f"invalid job: {err}"
            return None

    def _admit(self, jobs: list[Job]) -> list[Job]:
        """Fail the invalid jobs, skip cancelled ones; mark the rest started."""
        admitted, cancelled = [], self.progress.cancelled_among({j.campaign for j in jobs if j.spec})
        for job in jobs:
            if job.spec is None:
                self._fail(job, job.invalid)
                continue
            if job.campaign in cancelled:
                self.progress.skipped(job.campaign, job.spec.job_id)
                self.app.backend.mark_as_revoked(job.request.id, "campaign cancelled")
                job.request.send_event("task-revoked", terminated=False, signum=None, expired=False)
                task_ready(job.request)
                job.request.acknowledge()
                continue
            admitted.append(job)
        attempts = self.progress.started((j.campaign, j.spec.job_id) for j in admitted)  # type: ignore[union-attr]
        fresh = []
        for job, attempt in zip(admitted, attempts):
            job.attempt = attempt
            assert job.spec is not None
            if attempt > 1 and self.storage.exists(sidecar_name(job.campaign, job.spec.job_id)):
                self._already_stored(job)
                continue
            task_accepted(job.request)
            job.request.send_event("task-started")
            fresh.append(job)
        return fresh

    def _already_stored(self, job: Job) -> None:
        """A redelivered job whose result landed before its worker died: not rendered again;
        its manifest line is written if its first worker did not get that far."""
        assert job.spec is not None
        name = sidecar_name(job.campaign, job.spec.job_id)
        record = json.loads(self.storage.get(name))
        if not self.progress.done_among(job.campaign, [job.spec.job_id])[0]:
            self.storage.append_lines(manifest_name(job.campaign), [json.dumps(record)])
        self._succeed([(job, {"job_id": job.spec.job_id, "png_sha256": record["png_sha256"],
                              "url": self.storage.url(name), "already_stored": True})])

    def process(self, jobs: list[Job]) -> None:
        """Start the batch on the devices and hand the previous one, now rendered, to the
        writer: the devices work while the consumer gathers the next batch."""
        jobs = self._admit(jobs)
        if not jobs:
            return
        specs = [j.spec for j in jobs if j.spec is not None]
        for key, idx in self.engine.plan(specs):  # one key when the Batcher grouped them
            batch = [jobs[i] for i in idx]
            try:
                started = self.engine.start(specs, key, idx)
            except Exception:  # noqa: BLE001 - a poison job must not fail the others
                self._one_by_one(batch)
                continue
            self._finish_inflight()
            self._inflight = (started, batch)

    def _finish_inflight(self) -> None:
        if self._inflight is None:
            return
        started, batch = self._inflight
        self._inflight, self._idle_since = None, time.monotonic()
        try:
            rendered = self.engine.collect(started)
        except Exception:  # noqa: BLE001
            self._one_by_one(batch)
            return
        self._rate.add(started.key, len(rendered))
        self._hand_over(rendered, batch)

    def _one_by_one(self, jobs: list[Job]) -> None:
        log.warning("batch of %d raised; rendering its jobs one by one", len(jobs), exc_info=True)
        for job in jobs:
            try:
                rendered = self.engine.render([job.spec])  # type: ignore[list-item]
            except Exception as err:  # noqa: BLE001
                self._retry_later(job, f"render: {type(err).__name__}: {err}")
            else:
                self._hand_over(rendered, [job])

    def _hand_over(self, rendered: list[Rendered], jobs: list[Job]) -> None:
        for job in jobs:
            self._jobs.setdefault(job.spec.job_id, []).append(job)  # type: ignore[union-attr]
        self.writer.submit(rendered)  # stored and acked while the next batch renders

    def idle_seconds(self) -> float:
        """How long the devices have had no batch (0 while they have one)."""
        return 0.0 if self._inflight is not None else time.monotonic() - self._idle_since

    def poll(self) -> None:
        """Collect a finished batch and ack what has been stored (on the consumer's timer)."""
        if self._inflight is not None and self._inflight[0].ready():
            self._finish_inflight()
        self.writer.poll()
        if (self._gallery_stale and self._inflight is None and self.writer.idle
                and time.monotonic() - self._last_stored > GALLERY_QUIET):
            self._gallery_stale = False
            self._gallery_thread.submit(self.gallery.flush)


class RateLog:
    """Every `interval` seconds, one log line of what the devices achieved: images/s and
    FLOP/s with its fraction of the devices' peak, so an operator on real hardware sees
    how far from the ceiling the worker runs (docs/performance.md)."""

    def __init__(self, engine: Engine, interval: float = 30.0) -> None:
        self.engine, self.interval = engine, interval
        self._since, self._images, self._flops = time.monotonic(), 0, 0.0

    def add(self, key: ShapeKey, images: int) -> None:
        flops = self.engine.flops(key)
        self._images += images
        self._flops = self._flops + flops if flops is not None and self._flops is not None else None
        seconds = time.monotonic() - self._since
        if seconds >= self.interval:
            devices = self.engine.devices
            log.info("%d images in %.0fs: %.2f images/s, %s", self._images, seconds, self._images / seconds,
                     describe_rate(self._flops, seconds, devices[0].device_kind, len(devices)))
            self._since, self._images, self._flops = time.monotonic(), 0, 0.0


class Gatherer:
    """Jobs waiting for their batch, by shape key, so batches run full even when shapes
    interleave on the queue. A key's batch runs when it is full, when its first job has
    waited `max_wait` seconds of the worker's free time (time spent waiting for the
    devices does not count: no message can arrive then), or when `patience` batches of
    other keys have run since that job came, so no shape starves behind busier ones.
    And when for `quiet` seconds the devices have been idle and no job has come, the
    oldest partial batch runs at once: waiting would only delay it, since while the
    devices are busy the next jobs gather anyway (a lone job is rendered without
    `max_wait`). Both clocks count, because a consumer starved by a rendering batch
    receives nothing until the devices are done, though the queue may hold plenty."""

    def __init__(self, processor: Processor, batch_size: int, max_wait: float, patience: int,
                 quiet: float = QUEUE_QUIET) -> None:
        self.processor, self.batch_size, self.max_wait, self.patience = processor, batch_size, max_wait, patience
        self.quiet, self.last_arrival = quiet, time.monotonic()
        self.buffers: dict[ShapeKey | None, list[Job]] = {}
        self.deadlines: dict[ShapeKey | None, float] = {}
        self.since: dict[ShapeKey | None, int] = {}  # batches run when the key's first job came
        self.ran = 0

    def add(self, job: Job) -> None:
        self.last_arrival = time.monotonic()
        key = self.processor.classify(job)
        if key not in self.buffers:
            self.buffers[key], self.since[key] = [], self.ran
            self.deadlines[key] = time.monotonic() + self.max_wait
        self.buffers[key].append(job)
        if key is None or len(self.buffers[key]) >= self.batch_size:
            self.flush(key)  # an invalid job is failed at once, on its own

    def flush_due(self) -> None:
        now = time.monotonic()
        for key in [k for k, deadline in self.deadlines.items() if deadline <= now]:
            if key in self.buffers:
                self.flush(key)
        if self.buffers and min(self.processor.idle_seconds(), now - self.last_arrival) >= self.quiet:
            self.flush(min(self.deadlines, key=self.deadlines.__getitem__))

    def flush(self, key: ShapeKey | None) -> None:
        batch = self.buffers.pop(key)
        del self.deadlines[key], self.since[key]
        self.ran += 1
        started = time.monotonic()
        try:
            self.processor.process(batch)
        except Exception:  # noqa: BLE001 - the worker must keep serving; jobs go back
            log.exception("batch of %d failed outside any job; requeued", len(batch))
            for job in batch:
                if not job.request.acknowledged:
                    task_ready(job.request)
                    job.request.reject(requeue=True)
        blocked = time.monotonic() - started
        for other in self.deadlines:
            self.deadlines[other] += blocked
        for other in [k for k, since in self.since.items() if self.ran - since >= self.patience]:
            if other in self.buffers:
                self.flush(other)


class Batcher:
    """The Celery strategy of the render task: each request becomes a Job in a Gatherer."""

    def __init__(self, processor: Processor, batch_size: int, max_wait: float, patience: int = 4) -> None:
        self.processor, self.batch_size, self.max_wait = processor, batch_size, max_wait
        self.patience = patience

    def __call__(self, task: Task, app: Celery, consumer: Any) -> Callable[..., None]:
        # Built anew on every (re)connection: nothing of the old connection's buffers
        # survives, so a reconnect can never leave a flush that will not come. Messages
        # buffered then are unacked and come back after the visibility timeout.
        Req = create_request_cls(Request, task, consumer.pool, consumer.hostname,
                                 consumer.event_dispatcher, app=app)
        gatherer = Gatherer(self.processor, self.batch_size, self.max_wait, self.patience)
        # Celery publishes buffered task events on the next loop tick, which is one message
        # per received job; here they go out together, once per poll.
        events, buffered = consumer.event_dispatcher, []
        events.on_send_buffered = lambda: buffered.append(True)

        def poll() -> None:
            self.processor.poll()
            gatherer.flush_due()
            if buffered:
                buffered.clear()
                events.flush()

        consumer.timer.call_repeatedly(0.05, poll)

        def handler(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any, **_: Any) -> None:
            try:
                req = Req(message, on_ack=ack, on_reject=reject, app=app, hostname=consumer.hostname,
                          eventer=consumer.event_dispatcher, task=task,
                          connection_errors=consumer.connection_errors, body=message.body,
                          headers=message.headers, decoded=False, utc=True)
            except (ValueError, TypeError, KeyError) as err:  # Celery rejects and logs these
                raise InvalidTaskError(f"not a job message: {err!r}") from err
            req.send_event("task-received", name=req.name, args=req.argsrepr, kwargs=req.kwargsrepr,
                           root_id=req.root_id, parent_id=req.parent_id, retries=0, eta=None, expires=None)
            task_reserved(req)
            gatherer.add(Job(req))

        return handler


def render_task(batcher: Batcher) -> Task:
    class RenderTask(Task):
        """One job per message; the worker renders them in batches (see Batcher)."""

        name = TASK_NAME
        acks_late = True
        typing = False

        def run(self, **job: Any) -> None:
            raise RuntimeError("render jobs run in batches inside `renderfarm worker`")

        def Strategy(self, task: Task, app: Celery, consumer: Any) -> Callable[..., None]:  # noqa: N802
            return batcher(task, app, consumer)

    return RenderTask()


def node_name() -> str:
    """Unique per process, so several workers run side by side on one host."""
    return f"renderfarm-{os.getpid()}@{socket.gethostname()}"
