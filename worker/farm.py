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
from typing import Any

from celery import Celery, Task
from celery.exceptions import InvalidTaskError
from celery.worker.request import Request, create_request_cls
from celery.worker.state import task_accepted, task_ready, task_reserved

from renderfarm.jobs import JobError, JobSpec, parse_job
from renderfarm.progress import Progress
from renderfarm.queue import TASK_NAME
from renderfarm.settings import Settings
from renderfarm.storage import Storage, manifest_name, sidecar_name
from worker.engine import Engine, InFlight, Rendered
from worker.output import BatchWriter

log = logging.getLogger("renderfarm.worker")


class JobFailed(Exception):
    """What the result backend and Flower show for a job that failed for good."""


class Job:
    """One request of a batch and what the worker learned about it."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self.spec: JobSpec | None = None
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
                 settings: Settings) -> None:
        self.engine, self.storage, self.progress, self.app = engine, storage, progress, app
        self.max_attempts = settings.max_attempts
        self.writer = BatchWriter(storage, engine.model, engine.devices,
                                  on_stored=self._stored, on_failed=self._store_failed)
        self._jobs: dict[str, list[Job]] = {}  # job id -> its requests being stored
        self._inflight: tuple[InFlight, list[Job]] | None = None

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

    def _admit(self, jobs: list[Job]) -> list[Job]:
        """Validate each job; fail the bad ones, skip cancelled ones; mark the rest started."""
        admitted, cancelled = [], self.progress.cancelled_among({j.request.kwargs.get("campaign", "")
                                                                  for j in jobs if isinstance(j.request.kwargs, dict)})
        for job in jobs:
            try:
                job.spec = parse_job(job.request.kwargs, size_step=self.engine.model.size_step)
                if job.request.args:
                    raise JobError("args", job.request.args, "a job has keyword fields only")
                self.engine.check(job.spec)
            except JobError as err:
                self._fail(job, f"invalid job: {err}")
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

    def process(self, requests: list[Request]) -> None:
        """Start the batch on the devices and hand the previous one, now rendered, to the
        writer: the devices work while the consumer gathers the next batch."""
        jobs = self._admit([Job(r) for r in requests])
        if not jobs:
            return
        specs = [j.spec for j in jobs if j.spec is not None]
        for key, idx in self.engine.plan(specs):  # every job passed engine.check in _admit
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
        self._inflight = None
        try:
            rendered = self.engine.collect(started)
        except Exception:  # noqa: BLE001
            self._one_by_one(batch)
            return
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

    def poll(self) -> None:
        """Collect a finished batch and ack what has been stored (on the consumer's timer)."""
        if self._inflight is not None and self._inflight[0].ready():
            self._finish_inflight()
        self.writer.poll()


class Batcher:
    """The Celery strategy of the render task: buffer requests, flush full or late batches."""

    def __init__(self, processor: Processor, batch_size: int, max_wait: float) -> None:
        self.processor, self.batch_size, self.max_wait = processor, batch_size, max_wait

    def __call__(self, task: Task, app: Celery, consumer: Any) -> Callable[..., None]:
        # Built anew on every (re)connection: nothing of the old connection's buffer or timer
        # survives, so a reconnect can never leave a flush that will not come. Messages that
        # were buffered then are unacked and come back after the visibility timeout.
        Req = create_request_cls(Request, task, consumer.pool, consumer.hostname,
                                 consumer.event_dispatcher, app=app)
        buffer: list[Request] = []
        timer: list[Any] = []
        consumer.timer.call_repeatedly(0.05, self.processor.poll)

        def flush() -> None:
            for entry in timer:
                entry.cancel()
            timer.clear()
            batch = buffer[:]
            buffer.clear()
            if not batch:
                return
            try:
                self.processor.process(batch)
            except Exception:  # noqa: BLE001 - the worker must keep serving; jobs go back
                log.exception("batch of %d failed outside any job; requeued", len(batch))
                for req in batch:
                    if not req.acknowledged:
                        task_ready(req)
                        req.reject(requeue=True)

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
            buffer.append(req)
            if len(buffer) >= self.batch_size:
                flush()
            elif not timer:
                timer.append(consumer.timer.call_after(self.max_wait, flush))

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
