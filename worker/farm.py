"""The farm worker: a Celery worker (solo pool, JAX in the main process) that consumes its
model's queue in batches of `devices x per_device_batch` jobs.

A job's life, in the order it happens (Processor, one method each), inside its batch
(worker.batches.JobBatch, whose state says which step it is at):
  receive   the message is a job, valid here (or it is failed for good and dead-lettered)
  gather    jobs wait for a full batch of their shape (Gatherer)             GATHERED
  admit     cancelled campaigns skipped, attempts counted, a job stored already not redone
  render    on the devices; the program is compiled off the consumer's thread
                                                                  COMPILING, RENDERING
  store     PNG, sidecar, manifest line, on the store threads (worker.output.BatchWriter)
                                                                             STORING
  end       succeeded, retried or failed (Outcomes: the one place for the retry policy),
            then acknowledged or put back on the queue; taken out of its batch first,
            which is SETTLED once it holds no job
Metrics, the fleet's hash, galleries and the rate log are hooks on the batches' state
changes (worker.hooks).
The message arrives already checked by the transport (worker.envelope): nothing in it can
make Celery or kombu raise. Whatever raises later is caught where the job's life ends, so a
worker never exits or wedges on input, and every job taken is acked or requeued.

Why not celery-batches: it sends no per-job task events (Flower would see nothing), its
`Task.retry` does not work, and after a broker reconnect it can stop flushing while holding
unacked messages. This module is the small part of it we need, on Celery's own consumer
API: a task Strategy that buffers requests and flushes them when a batch is full or
`max_wait` has passed, rebuilt cleanly on every reconnect, with Celery's own per-request
events and worker state, so Flower and `inspect` see every job.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import redis
from celery import Celery, Task, bootsteps, signals
from celery.worker.request import Request, create_request_cls
from celery.worker.state import task_accepted, task_ready, task_reserved
from kombu.utils.json import dumps

from renderfarm import deadletters
from renderfarm.jobs import JobError, JobSpec, parse_job
from renderfarm.layout import MANIFEST_BASENAME, sidecar_name
from renderfarm.progress import Progress
from renderfarm.queue import TASK_NAME
from renderfarm.settings import Settings
from renderfarm.storage import Storage
from worker.batches import BatchHook, Job, JobBatch, State
from worker.engine import Engine, Rendered, ShapeKey
from worker.metrics import WorkerMetrics
from worker.output import BatchWriter

log = logging.getLogger("renderfarm.worker")

# Seconds without an arriving job after which idle devices take a partial batch: while the
# queue has jobs, the worker's pop (worker.broker) brings them in far quicker than that.
QUEUE_QUIET = 0.05
# Slices of the main thread's wait for the devices: Python runs a signal's handler on the
# main thread between bytecodes only, so a wait that never returned would hold a stop off.
WAIT_SLICE = 0.005
WARM_STOPS = frozenset({signal.SIGTERM, signal.SIGINT})  # Celery's warm shutdown
# Of the drain window, what putting the held jobs back and Celery's own exit get.
SETTLE_SECONDS = 1.0
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


class Processor:
    """One job's life from delivery to acknowledgement (see the module docstring), across
    reconnections: the Gatherer of the current connection hands it batches (worker.batches),
    and it moves each on through its states; `hooks` do the rest of what a state change means."""

    def __init__(self, engine: Engine, storage: Storage, progress: Progress, app: Celery,
                 settings: Settings, store_threads: int | None = None, hooks: Sequence[BatchHook] = (),
                 metrics: WorkerMetrics | None = None) -> None:
        self.engine, self.storage, self.progress, self.hooks = engine, storage, progress, hooks
        self.outcomes = Outcomes(app, progress, settings.max_attempts, metrics)
        self.writer = BatchWriter(storage, engine.model, engine.devices, threads=store_threads)
        self.gatherer: Gatherer | None = None  # the current connection's; it holds the GATHERED batches
        self._batches: list[JobBatch] = []  # the batches handed over by a gatherer and not settled
        self._idle_since = time.monotonic()
        # New shapes compile on their own thread; their batches wait COMPILING meanwhile.
        self._compiler = ThreadPoolExecutor(1, thread_name_prefix="compile")
        self._compiling: dict[ShapeKey, Future[Any]] = {}
        self.drained = False  # set once a warm shutdown has settled every job it held

    def _held(self, *states: State) -> list[JobBatch]:
        """The batches past gathering that hold jobs still, oldest first (in `states`, if given)."""
        self._batches = [batch for batch in self._batches if batch.state is not State.SETTLED]
        return [batch for batch in self._batches if not states or batch.state in states]

    # -- receive ---------------------------------------------------------------------

    def receive(self, request: Request) -> Job | None:
        """The job of a delivered message, if it is one this worker can render; else it is
        failed for good with the field, value and rule, and dead-lettered."""
        spec = None
        try:
            if request.args:
                raise JobError("args", request.args, "a job has keyword fields only")
            spec = parse_job(request.kwargs, size_step=self.engine.model.size_step)
            key = self.engine.check(spec)
            self.engine.prefetch([spec], key)  # its init image is read while it waits for its batch
            return Job(request, spec, key)
        except JobError as err:
            reason = f"invalid job: {err}"
        except Exception as err:  # noqa: BLE001 - a bug here must not stop the worker either
            log.exception("job %s could not be read", request.id)
            reason = f"unreadable job: {type(err).__name__}: {err}"
        self.outcomes.invalid(request, reason, request.delivery_info.get("routing_key") or "?", spec)
        return None

    # -- admit -----------------------------------------------------------------------

    def process(self, batch: JobBatch) -> None:
        """Admit a gathered batch and start it on the devices, once its program is compiled."""
        self._admit(batch)
        if batch.state is State.SETTLED:
            return
        self._batches.append(batch)
        if self.engine.ready(batch.key):
            self._start(batch)
            return
        batch.compiling()
        if batch.key not in self._compiling:
            log.info("%s: compiling a new program (batches of it wait meanwhile)", batch.key)
            self._compiling[batch.key] = self._compiler.submit(self.engine.compiled, batch.key)

    def _admit(self, batch: JobBatch) -> None:
        """Skip cancelled campaigns' jobs; count attempts; a job whose sidecar is stored
        already (its worker died before the ack) is not rendered again."""
        try:
            cancelled = self.progress.cancelled_among({job.campaign for job in batch.jobs})
            attempts = self.progress.started(job.ident for job in batch.jobs if job.campaign not in cancelled)
        except BROKER_ERRORS as err:
            for job in batch.release_all():
                self.outcomes.retry(job, f"broker: {err}", counts=False)
            return
        counted = iter(attempts)
        for job in list(batch.jobs):
            if job.campaign in cancelled:
                self.outcomes.skipped(batch.release(job))
                continue
            job.attempt = next(counted)
            if job.attempt > 1:  # its last worker may have stored it and died before the ack
                try:
                    record = self._stored_sidecar(job)
                except Exception as err:  # noqa: BLE001 - storage away: try again later
                    self.outcomes.retry(batch.release(job), f"storage: {err!r}", counts=False)
                    continue
                if record is not None:
                    self.outcomes.succeeded([(batch.release(job), self._result(job, record, already_stored=True))])
                    continue
            task_accepted(job.request)
            job.request.send_event("task-started")

    def _stored_sidecar(self, job: Job) -> dict[str, Any] | None:
        """The sidecar of a job stored already, its manifest line written now unless the part
        the sidecar names holds it already; None if it is not stored. Raises what storage raises."""
        try:
            record = json.loads(self.storage.get(sidecar_name(job.campaign, job.spec.job_id)))
        except FileNotFoundError:
            return None
        manifest = self.writer.manifest
        if not manifest.holds(job.campaign, record.get("manifest_part", MANIFEST_BASENAME), job.spec.job_id):
            manifest.append(job.campaign, manifest.new_part(job.campaign), [(job.spec.job_id, json.dumps(record))])
        return record

    def _result(self, job: Job, record: dict[str, Any], **extra: Any) -> dict[str, Any]:
        """What a stored job's success says (Flower's event): where it is and what it cost."""
        return {"job_id": job.spec.job_id, "png_sha256": record.get("png_sha256"),
                "url": self.storage.url(sidecar_name(job.campaign, job.spec.job_id)),
                "device_seconds": record.get("device_seconds", 0.0),
                "nsfw": (record.get("scores") or {}).get("nsfw"),
                "gate_passed": (record.get("gate") or {}).get("passed"), **extra}

    # -- render ----------------------------------------------------------------------

    def _start(self, batch: JobBatch) -> None:
        """Start the batch on the devices and hand the one before, now rendered, to the
        writer: the devices work while the consumer gathers the next batch. A job whose init
        image cannot be read is taken out first; the rest render."""
        self._unreadable(batch)
        if batch.state is State.SETTLED:
            return
        before = self._held(State.RENDERING)
        try:
            started = self.engine.start([job.spec for job in batch.jobs], batch.key, list(range(len(batch.jobs))))
        except Exception:  # noqa: BLE001 - a poison job must not fail the others
            self._one_by_one(batch)
            return
        batch.rendering(started)
        for earlier in before:
            self._collect(earlier)

    def _unreadable(self, batch: JobBatch) -> None:
        """Image jobs whose source is not their image (missing, not an image, changed) fail for
        good, dead-lettered with the reason; those whose storage is away go back on the queue."""
        jobs = list(batch.jobs)
        for n, error in self.engine.init_images.unreadable([job.spec for job in jobs], batch.key.width,
                                                           batch.key.height).items():
            job = batch.release(jobs[n])
            if isinstance(error, JobError):
                queue = job.request.delivery_info.get("routing_key") or "?"
                self.outcomes.invalid(job.request, f"invalid job: {error}", queue, job.spec)
            else:
                self.outcomes.retry(job, f"storage: {type(error).__name__}: {error}", counts=False)

    def _collect(self, batch: JobBatch) -> None:
        """Wait for a batch on the devices, then hand it to the writer. The wait gives up
        once the worker is stopping: the main thread must get back to Celery's loop for
        the drain to start, and the drain takes the batch from there."""
        self._idle_since = time.monotonic()
        while not batch.inflight.ready():
            if self.writer.stopping.wait(WAIT_SLICE):
                return
        try:
            rendered = self.engine.collect(batch.inflight)
        except Exception:  # noqa: BLE001
            self._one_by_one(batch)
            return
        self._store(batch, rendered)

    def _one_by_one(self, batch: JobBatch) -> None:
        log.warning("batch of %d raised; rendering its jobs one by one", len(batch.jobs), exc_info=True)
        batch.rendering(None)
        rendered = []
        for job in list(batch.jobs):
            try:
                rendered += self.engine.render([job.spec])
            except Exception as err:  # noqa: BLE001
                self.outcomes.retry(batch.release(job), f"render: {type(err).__name__}: {err}")
        if batch.state is State.RENDERING:
            self._store(batch, rendered)

    # -- store -----------------------------------------------------------------------

    def _store(self, batch: JobBatch, rendered: list[Rendered]) -> None:
        batch.storing(rendered)
        self.writer.submit(rendered, functools.partial(self._stored, batch),  # stored and acked while
                           functools.partial(self._store_failed, batch))     # the next batch renders

    def _stored(self, batch: JobBatch, records: list[dict[str, Any]]) -> None:
        self.outcomes.succeeded([(job, self._result(job, record)) for job, record in batch.stored(records)])

    def _store_failed(self, batch: JobBatch, result: Rendered, error: Exception) -> None:
        job = batch.unstored(result)
        if job is not None:
            self.outcomes.retry(job, f"storage: {error!r}", counts=False)  # not the job's fault

    # -- the consumer's timer ----------------------------------------------------------

    def idle_seconds(self) -> float:
        """How long the devices have had no batch (0 while they have one)."""
        return 0.0 if self._held(State.RENDERING) else time.monotonic() - self._idle_since

    def poll(self) -> None:
        """Start batches whose program is now compiled, collect a finished batch, and
        settle what has been stored."""
        for key in [key for key, future in self._compiling.items() if future.done()]:
            error = self._compiling.pop(key).exception()
            for batch in self._held(State.COMPILING):
                if batch.key != key:
                    continue
                if error is None:
                    self._start(batch)
                else:
                    for job in batch.release_all():
                        self.outcomes.failed(job, f"compile: {error}")
        for batch in self._held(State.RENDERING):
            if batch.inflight is not None and batch.inflight.ready():
                self._collect(batch)
        self.writer.poll()
        busy = bool(self._held(State.RENDERING, State.STORING))
        for hook in self.hooks:
            hook.polled(busy)

    # -- stopping --------------------------------------------------------------------

    def drain(self, until: float) -> None:
        """Warm shutdown (SIGTERM; a spot VM's notice): store what can be stored by `until`
        (monotonic); `give_back` then puts every other job back on its queue."""
        self.writer.stopping.set()
        for batch in self._held(State.RENDERING):
            while not batch.inflight.ready() and time.monotonic() < until:
                time.sleep(0.05)
            if batch.inflight.ready():
                self._collect(batch)
        self.writer.finish(until=until)

    def give_back(self) -> None:
        """Put every job still held back on its queue now, not after the visibility timeout
        (a batch still on the devices included: its results are dropped); an unfinished
        attempt does not count."""
        self.writer.abandon()  # what is still storing goes back on the queue with the rest
        batches = (self.gatherer.take_all() if self.gatherer else []) + self._held()
        waiting = [job for batch in batches for job in batch.release_all()]
        self.outcomes.put_back(waiting, "the worker is stopping")
        self.drained = True
        log.info("drained: %d jobs put back on the queue", len(waiting))


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
        self.buffers: dict[ShapeKey, JobBatch] = {}
        self.deadlines: dict[ShapeKey, float] = {}
        self.since: dict[ShapeKey, int] = {}  # batches run when the key's first job came
        self.ran = 0

    def add(self, job: Job) -> None:
        self.last_arrival = time.monotonic()
        if job.key not in self.buffers:
            self.buffers[job.key], self.since[job.key] = JobBatch(job.key, self.processor.hooks), self.ran
            self.deadlines[job.key] = time.monotonic() + self.max_wait
        self.buffers[job.key].add(job)
        if len(self.buffers[job.key].jobs) >= self.batch_size:
            self.flush(job.key)

    def flush_due(self) -> None:
        now = time.monotonic()
        for key in [k for k, deadline in self.deadlines.items() if deadline <= now]:
            if key in self.buffers:
                self.flush(key)
        if self.buffers and min(self.processor.idle_seconds(), now - self.last_arrival) >= self.quiet:
            self.flush(min(self.deadlines, key=self.deadlines.__getitem__))

    def flush(self, key: ShapeKey) -> None:
        batch = self.buffers.pop(key)
        del self.deadlines[key], self.since[key]
        self.ran += 1
        started = time.monotonic()
        try:
            self.processor.process(batch)
        except Exception as err:  # noqa: BLE001 - the worker must keep serving; jobs go back
            log.exception("batch of %d failed outside any job; requeued", len(batch.jobs))
            for job in batch.release_all():
                self.processor.outcomes.retry(job, f"worker: {err!r}", counts=False)
        blocked = time.monotonic() - started
        for other in self.deadlines:
            self.deadlines[other] += blocked
        for other in [k for k, since in self.since.items() if self.ran - since >= self.patience]:
            if other in self.buffers:
                self.flush(other)

    def take_all(self) -> list[JobBatch]:
        """Every waiting batch, taken away (the worker is stopping)."""
        batches = list(self.buffers.values())
        self.buffers.clear()
        self.deadlines.clear()
        self.since.clear()
        return batches


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
        self.processor.gatherer = gatherer
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
            # worker.envelope has checked the message: Celery's Request takes it as it is.
            req = Req(message, on_ack=ack, on_reject=reject, app=app, hostname=consumer.hostname,
                      eventer=consumer.event_dispatcher, task=task,
                      connection_errors=consumer.connection_errors, body=message.body,
                      headers=message.headers, decoded=False, utc=True)
            req.send_event("task-received", name=req.name, args=req.argsrepr, kwargs=req.kwargsrepr,
                           root_id=req.root_id, parent_id=req.parent_id, retries=0, eta=None, expires=None)
            task_reserved(req)
            job = self.processor.receive(req)
            if job is not None:
                gatherer.add(job)

        return handler


class StopDeadline:
    """A warm shutdown's deadline, held whatever the main thread is doing. Python runs a
    signal's handler on the main thread, between bytecodes: while that thread waits on the
    devices (a dispatch can block until the batch before is done), a one-by-one render or
    a slow call, Celery does not even hear of the signal, and a batch can take longer than
    the whole drain window. The interpreter's C handler writes each signal to the wakeup
    fd at once; a thread of this class reads it there. The drain (main thread) stores what
    it can until SETTLE_SECONDS before the deadline (the signal + `drain_seconds`), then
    puts the rest back; if by then it has not, this thread does (a batch still on the
    devices included: its results are dropped) and ends the process at once, else it
    ends it at the deadline. One lock: whichever comes first settles."""

    def __init__(self, processor: Processor, drain_seconds: float) -> None:
        self.processor, self.drain_seconds = processor, drain_seconds
        self.deadline: float | None = None  # monotonic, from the first stop signal
        self.consumer: Any = None  # Celery's consumer: its event loop and channel send the acks
        self._settling = threading.Lock()
        self._signals: int | None = None  # the read end of the wakeup fd

    def watch(self, consumer: Any) -> None:
        """Hear stop signals from now on (on the main thread: the wakeup fd is set there)."""
        self.consumer = consumer
        if self._signals is not None:  # a reconnection: the same consumer, watched already
            return
        self._signals, write = os.pipe()
        os.set_blocking(write, False)
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, name="stop-deadline", daemon=True).start()

    def begin(self) -> None:
        """A stop signal came (the watching thread or Celery's handler, whichever runs
        first, notes it): the deadline is set, and every wait for the devices or the
        writer ends."""
        if self.deadline is None:
            self.deadline = time.monotonic() + self.drain_seconds
        self.processor.writer.stopping.set()

    def settle(self, wait: float = -1) -> bool:
        """Put back every job the processor still holds, unless the drain did, then send
        the acks and requeues waiting on Celery's event loop, which no longer turns.
        Whether it put jobs back (False too if another thread held the lock for `wait` s)."""
        if not self._settling.acquire(timeout=wait):
            return False
        try:
            gave_back = not self.processor.drained
            if gave_back:
                self.processor.give_back()
            c = self.consumer
            for settle in c.hub._pop_ready() if c.hub is not None else ():
                settle()
            channel = c.task_consumer.channel if c.task_consumer else None
            if channel is not None:
                channel.qos.flush_acks()
            return gave_back
        finally:
            self._settling.release()

    def _watch(self) -> None:
        while self.deadline is None:
            if WARM_STOPS & set(os.read(self._signals, 64)):
                self.begin()
        time.sleep(max(0.0, self.deadline - SETTLE_SECONDS - time.monotonic()))
        if self.settle(wait=SETTLE_SECONDS):  # the main thread is held up: nothing else will
            log.warning("drain deadline: every job held went back on its queue; the worker exits, "
                        "whatever the devices are doing")
        else:  # the drain settled: Celery's own exit gets until the deadline
            time.sleep(max(0.0, self.deadline - time.monotonic()))
        os._exit(0)


def drain_step(stop: StopDeadline) -> type[bootsteps.StartStopStep]:
    """A consumer bootstep that drains the processor on warm shutdown. It stops before the
    task consumer (it requires it), so the channel is still open to ack and requeue."""

    @signals.worker_shutting_down.connect(weak=False)
    def shutting_down(**_: Any) -> None:  # in the signal handler
        stop.begin()

    class Drain(bootsteps.StartStopStep):
        requires = ("celery.worker.consumer.tasks:Tasks",)

        def start(self, c: Any) -> None:
            stop.watch(c)

        def shutdown(self, c: Any) -> None:
            if stop.deadline is None:  # a reconnection, not a shutdown: nothing to drain
                return
            stop.processor.drain(stop.deadline - SETTLE_SECONDS)
            stop.settle()

    return Drain


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
