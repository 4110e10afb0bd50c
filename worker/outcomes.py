"""How a job's life ends, in one place: succeeded, failed for good (dead-lettered, with the
reason), skipped (its campaign cancelled), retried or put back, then acknowledged or requeued.
The retry policy lives here and nowhere else, and so does what kind of failure an error is.

Every failure is classified once (`classify`):
  invalid    the job is not one this worker can render (the contract, its model or its source
             refuses it): failed at once and dead-lettered;
  permanent  trying again the same way fails again (storage forbids the write or has no such
             bucket, a disk fails, memory runs out, a render raises): the attempt counts, and
             after `max_attempts` the job fails for good and is dead-lettered, from where an
             operator requeues it once the cause is fixed;
  transient  storage or the broker away for a while (timeouts, dropped connections, 429 and
             5xx answers, a source not read in time): the attempt is refunded and the job goes
             back on its queue after an exponential backoff, at most `max_refunds` times a job;
             past that its attempts count, so a failure taken for transient that never ends
             does not send a job round for ever.
"""

from __future__ import annotations

import enum
import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
from celery import Celery
from celery.worker.request import Request
from celery.worker.state import task_ready
from kombu.utils.json import dumps

from renderfarm import deadletters
from renderfarm.jobs import JobError, JobSpec
from renderfarm.progress import Progress
from renderfarm.retry import is_transient_error
from renderfarm.settings import Settings
from worker.bundles import Job
from worker.metrics import WorkerMetrics

log = logging.getLogger("renderfarm.worker")

BROKER_ERRORS = (redis.RedisError, OSError)  # what Redis being away raises in an outcome
BACKOFF_SECONDS = 1.0  # before a job's first retry after a transient failure; doubling each time
MAX_BACKOFF_SECONDS = 60.0


class Failure(enum.Enum):
    INVALID = "invalid"
    PERMANENT = "permanent"
    TRANSIENT = "transient"


def classify(error: BaseException) -> Failure:
    """What kind of failure `error` is (the module docstring says what each kind means)."""
    if isinstance(error, JobError):
        return Failure.INVALID
    if isinstance(error, redis.RedisError) or is_transient_error(error, local=False):
        return Failure.TRANSIENT
    return Failure.PERMANENT


def backoff(refunds: int) -> float:
    """Seconds before a job's retry after its `refunds`-th transient failure: doubling from
    BACKOFF_SECONDS up to MAX_BACKOFF_SECONDS, jittered so that a farm's jobs do not all come
    back at once."""
    return min(MAX_BACKOFF_SECONDS, BACKOFF_SECONDS * 2 ** max(0, refunds - 1)) * (0.5 + random.random() / 2)


class JobFailed(Exception):
    """What the result backend and Flower show for a job that failed for good."""


class Outcomes:
    """How a job's life ends, and the retry policy, in one place. Each outcome records what
    happened (campaign progress, the result backend, Flower's events, dead letters), then
    acknowledges the message or puts it back on the queue. If the broker is away, that is
    logged: the message, still unacknowledged, comes back after the visibility timeout and
    its next delivery finds what was stored."""

    def __init__(self, app: Celery, progress: Progress, settings: Settings, queue: str,
                 metrics: WorkerMetrics | None) -> None:
        self.app, self.progress, self.metrics = app, progress, metrics
        self.max_attempts, self.max_refunds = settings.max_attempts, settings.max_refunds
        self.queue = queue  # the queue the worker pops from: its dead letters are kept there
        self._waiting: list[tuple[float, Job]] = []  # jobs backing off, each until its time (monotonic)
        self._held: set[str] = set()  # the delivery tags of the messages taken and not settled
        self._lock = threading.Lock()  # the transport's keeper thread reads them

    def succeeded(self, done: list[tuple[Job, dict[str, Any]]]) -> None:
        ids = [job.ident for job, _ in done]
        seconds = [result.get("device_seconds", 0.0) for _, result in done]  # what each image cost
        verdicts = [(result.get("nsfw"), result.get("gate_passed")) for _, result in done]
        if not self._recorded(lambda: self.progress.finished(ids, seconds, verdicts), "finished",
                              [job.request for job, _ in done]):
            return
        for job, result in done:  # successes live in storage and Progress, not the result backend
            job.request.send_event("task-succeeded", result=repr(result), runtime=time.time() - job.started)
            self._end(job.request, requeue=False, successful=True)

    def invalid(self, request: Request, reason: str, spec: JobSpec | None) -> None:
        """Not a job this worker can render: failed for good at once."""
        self._count("invalid")
        self._fail(request, reason, spec)

    def closed(self, request: Request, reason: str, spec: JobSpec) -> None:
        """A delivery of a job its windowed campaign has closed (failed for good or cancelled,
        and delivered again; or never admitted): dead-lettered with the reason, and nothing
        written to the campaign's books, which hold its outcome already (a failure's reason
        stays the one it failed with)."""
        self._count("invalid")
        self._fail(request, reason, spec, books=False)

    def failed(self, job: Job, reason: str) -> None:
        """Failed for good after its attempts (or its program would not compile)."""
        self._fail(job.request, reason, job.spec)

    def _fail(self, request: Request, reason: str, spec: JobSpec | None, books: bool = True) -> None:
        """Recorded failed (campaign progress unless not `books`, the result backend, Flower)
        and kept with its reason in the dead letters of the queue it was popped from, from
        where an operator can requeue it once the cause is fixed."""
        log.warning("job %s failed: %s", request.id, reason)

        def record() -> None:
            pipe = self.progress.r.pipeline()
            deadletters.add(pipe, self.queue, reason, dumps(request._message._raw).encode(),
                            spec.job_id if spec else None)
            pipe.execute()
            if spec is not None and books:
                self.progress.failed(spec.campaign, spec.job_id, reason)
            self.app.backend.mark_as_failure(request.id, JobFailed(reason))

        if self._recorded(record, "failed", [request]):
            request.send_event("task-failed", exception=reason, traceback="")
            self._end(request, requeue=False)

    def skipped(self, job: Job) -> None:
        """Its campaign was cancelled: acknowledged without rendering. If a run lifted the
        cancel since the worker looked, the job goes back on its queue instead (no attempt
        was counted for it)."""
        lifted = []

        def record() -> None:
            if not self.progress.skipped(job.campaign, job.spec.job_id):
                lifted.append(True)
                return
            self.app.backend.mark_as_revoked(job.request.id, "campaign cancelled")

        if not self._recorded(record, "skipped", [job.request]):
            return
        if lifted:
            log.info("job %s: its campaign's cancel was lifted; queued again", job.request.id)
            self._end(job.request, requeue=True)
            return
        job.request.send_event("task-revoked", terminated=False, signum=None, expired=False)
        self._end(job.request, requeue=False)

    def errored(self, job: Job, stage: str, error: BaseException) -> None:
        """The job's attempt ended in `error` at `stage` (source, render, storage): the policy
        for its kind of failure (`classify`)."""
        kind = classify(error)
        if kind is Failure.INVALID:
            self.invalid(job.request, f"invalid job: {error}", job.spec)
        elif kind is Failure.TRANSIENT:
            self._transient(job, f"{stage}: {type(error).__name__}: {error}")
        else:
            self.retry(job, f"{stage}: {type(error).__name__}: {error}")

    def retry(self, job: Job, reason: str) -> None:
        """A failure that is the job's counts as an attempt, and at `max_attempts` the job
        fails for good; until then it goes back on the queue at once."""
        if job.attempt >= self.max_attempts:
            self._count("attempts")
            self.failed(job, f"{reason} (after {job.attempt} attempts)")
            return
        self._count("render")
        log.warning("job %s attempt %d failed, queued again: %s", job.request.id, job.attempt, reason)
        if self._recorded(lambda: self.progress.released([job.ident], "count"), "released", [job.request]):
            self._end(job.request, requeue=True)

    def _transient(self, job: Job, reason: str) -> None:
        """Storage or the broker away: the attempt refunded and the job back on its queue after
        its backoff, within the bound of refunds; past it, the attempt counts."""
        refunds = [self.max_refunds]

        def record() -> None:
            refunds[:] = self.progress.released([job.ident], "bounded", self.max_refunds)

        if not self._recorded(record, "released", [job.request]):
            return  # the broker is away: the message comes back after the visibility timeout
        self._count("storage")
        if refunds[0] > self.max_refunds:
            if job.attempt >= self.max_attempts:
                self._count("attempts")
                self.failed(job, f"{reason} (after {job.attempt} attempts and {self.max_refunds} retries "
                                 "not counted)")
                return
            reason += f" (counted: {self.max_refunds} retries were not)"
        delay = backoff(refunds[0])
        log.warning("job %s attempt %d did not finish, queued again in %.1fs: %s", job.request.id, job.attempt,
                    delay, reason)
        self._waiting.append((time.monotonic() + delay, job))

    def requeue_due(self, now: float | None = None) -> None:
        """Put back on their queues the jobs whose backoff is over (the consumer's timer)."""
        now = time.monotonic() if now is None else now
        due = [job for at, job in self._waiting if at <= now]
        self._waiting = [(at, job) for at, job in self._waiting if at > now]
        for job in due:
            self._end(job.request, requeue=True)

    def requeue_waiting(self) -> int:
        """Every job still backing off back on its queue now (the worker is stopping)."""
        waiting = len(self._waiting)
        self.requeue_due(float("inf"))
        return waiting

    def put_back(self, jobs: list[Job], reason: str) -> None:
        """Jobs back on the queue at once, the attempts of those started refunded (the worker
        stopping, the connection lost, the broker away), recorded in one round trip: a stopping
        worker puts back all it holds in the last second of its window. A job never started
        (still gathering: attempt 0) has no attempt to refund, and nothing is recorded of it."""
        for job in jobs:
            log.warning("job %s attempt %d did not finish, queued again: %s", job.request.id, job.attempt, reason)
        started = [job for job in jobs if job.attempt >= 1]
        if started:
            self._recorded(lambda: self.progress.released([job.ident for job in started], "refund"), "released",
                           [job.request for job in started])
        for job in jobs:
            self._end(job.request, requeue=True)

    def _count(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.failed.labels(reason).inc()

    def _recorded(self, record: Callable[[], object], what: str, requests: list[Request]) -> bool:
        """Run `record`; if the broker is away, the messages are let go unsettled (no longer
        kept fresh), so they come back after the visibility timeout and their next delivery
        finds what was stored."""
        try:
            record()
        except BROKER_ERRORS as err:
            log.warning("could not record %d jobs %s (%s); they come back after the visibility timeout",
                        len(requests), what, err)
            with self._lock:
                self._held.difference_update(request.message.delivery_tag for request in requests)
            return False
        return True

    def took(self, request: Request) -> None:
        """A message delivered to the worker: held until its outcome settles it (`held_tags`)."""
        with self._lock:
            self._held.add(request.message.delivery_tag)

    def held_tags(self) -> list[str]:
        """The delivery tags of every message the worker took and has not settled, on whichever
        connection it came: worker.broker.HeldKeeper keeps them fresh, so a lost connection does
        not send a job the worker is rendering to another worker."""
        with self._lock:
            return list(self._held)

    def _end(self, request: Request, requeue: bool, successful: bool = False) -> None:
        with self._lock:
            self._held.discard(request.message.delivery_tag)
        task_ready(request, successful=successful)
        try:
            if requeue:
                request.reject(requeue=True)
            else:
                request.acknowledge()
        except Exception as err:  # noqa: BLE001 - a channel closed by a reconnect: redelivered later
            log.warning("message of job %s not settled (%s); it comes back after the visibility timeout",
                        request.id, err)
