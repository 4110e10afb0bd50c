"""How a job's life ends, in one place: succeeded, failed for good (dead-lettered if it was
never a job this worker can render), skipped (its campaign cancelled), retried or put back,
then acknowledged or requeued. The retry policy lives here and nowhere else."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import redis
from celery import Celery
from celery.worker.request import Request
from celery.worker.state import task_ready
from kombu.utils.json import dumps

from renderfarm import deadletters
from renderfarm.jobs import JobSpec
from renderfarm.progress import Progress
from worker.bundles import Job
from worker.metrics import WorkerMetrics

log = logging.getLogger("renderfarm.worker")

BROKER_ERRORS = (redis.RedisError, OSError)  # what Redis being away raises in an outcome


class JobFailed(Exception):
    """What the result backend and Flower show for a job that failed for good."""


class Outcomes:
    """How a job's life ends, and the retry policy, in one place. Each outcome records what
    happened (campaign progress, the result backend, Flower's events, dead letters), then
    acknowledges the message or puts it back on the queue. If the broker is away, that is
    logged: the message, still unacknowledged, comes back after the visibility timeout and
    its next delivery finds what was stored."""

    def __init__(self, app: Celery, progress: Progress, max_attempts: int, metrics: WorkerMetrics | None) -> None:
        self.app, self.progress, self.max_attempts, self.metrics = app, progress, max_attempts, metrics

    def succeeded(self, done: list[tuple[Job, dict[str, Any]]]) -> None:
        ids = [job.ident for job, _ in done]
        seconds = [result.get("device_seconds", 0.0) for _, result in done]  # what each image cost
        verdicts = [(result.get("nsfw"), result.get("gate_passed")) for _, result in done]
        if not self._recorded(lambda: self.progress.finished(ids, seconds, verdicts), "finished", len(done)):
            return
        for job, result in done:  # successes live in storage and Progress, not the result backend
            job.request.send_event("task-succeeded", result=repr(result), runtime=time.time() - job.started)
            self._end(job.request, requeue=False, successful=True)

    def invalid(self, request: Request, reason: str, queue: str, spec: JobSpec | None) -> None:
        """Not a job this worker can render: failed for good, and kept with its reason in the
        queue's dead letters, from where an operator can requeue it once the cause is fixed."""
        log.warning("job %s failed: %s", request.id, reason)
        self._count("invalid")

        def record() -> None:
            pipe = self.progress.r.pipeline()
            deadletters.add(pipe, queue, reason, dumps(request._message._raw).encode(),
                            spec.job_id if spec else None)
            pipe.execute()
            if spec is not None:
                self.progress.failed(spec.campaign, spec.job_id, reason)
            self.app.backend.mark_as_failure(request.id, JobFailed(reason))

        if self._recorded(record, "invalid", 1):
            request.send_event("task-failed", exception=reason, traceback="")
            self._end(request, requeue=False)

    def failed(self, job: Job, reason: str) -> None:
        log.warning("job %s failed: %s", job.request.id, reason)

        def record() -> None:
            self.progress.failed(job.campaign, job.spec.job_id, reason)
            self.app.backend.mark_as_failure(job.request.id, JobFailed(reason))

        if self._recorded(record, "failed", 1):
            job.request.send_event("task-failed", exception=reason, traceback="")
            self._end(job.request, requeue=False)

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

        if not self._recorded(record, "skipped", 1):
            return
        if lifted:
            log.info("job %s: its campaign's cancel was lifted; queued again", job.request.id)
            self._end(job.request, requeue=True)
            return
        job.request.send_event("task-revoked", terminated=False, signum=None, expired=False)
        self._end(job.request, requeue=False)

    def retry(self, job: Job, reason: str, counts: bool = True) -> None:
        """The policy: a failure that is the job's counts as an attempt, and at
        `max_attempts` the job fails for good; one that is not (storage or the broker
        away, the worker stopping) does not count. Either way the job goes back on the
        queue at once."""
        if counts and job.attempt >= self.max_attempts:
            self._count("attempts")
            self.failed(job, f"{reason} (after {job.attempt} attempts)")
            return
        self.put_back([job], reason, counts)

    def put_back(self, jobs: list[Job], reason: str, counts: bool = False) -> None:
        """Jobs back on the queue at once, recorded in one round trip (a stopping worker puts
        back all it holds in the last second of its window); `counts`: whether the attempt
        counts (the retry policy's to say)."""
        for job in jobs:
            log.warning("job %s attempt %d did not finish, queued again: %s", job.request.id, job.attempt, reason)
            self._count("storage" if reason.startswith(("storage", "broker")) else "render")
        self._recorded(lambda: self.progress.released([job.ident for job in jobs], refund=not counts),
                       "released", len(jobs))
        for job in jobs:
            self._end(job.request, requeue=True)

    def _count(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.failed.labels(reason).inc()

    def _recorded(self, record: Callable[[], object], what: str, jobs: int) -> bool:
        try:
            record()
        except BROKER_ERRORS as err:
            log.warning("could not record %d jobs %s (%s); they come back after the visibility timeout",
                        jobs, what, err)
            return False
        return True

    @staticmethod
    def _end(request: Request, requeue: bool, successful: bool = False) -> None:
        task_ready(request, successful=successful)
        try:
            if requeue:
                request.reject(requeue=True)
            else:
                request.acknowledge()
        except Exception as err:  # noqa: BLE001 - a channel closed by a reconnect: redelivered later
            log.warning("message of job %s not settled (%s); it comes back after the visibility timeout",
                        request.id, err)
