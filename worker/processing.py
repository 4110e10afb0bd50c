"""A job's life between its bundle being gathered and its outcome: admitted (cancelled campaigns
skipped, attempts counted, a job stored already not redone, one its campaign never sent
refused), its sources read (off the consumer's thread, each read with a deadline), rendered on
the devices (a new shape compiled off the consumer's thread), stored on the writer's threads,
then handed to worker.outcomes, which decides what each failure means. Each bundle's state
(worker.bundles) says which step it is at."""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from celery import Celery
from celery.worker.request import Request
from celery.worker.state import task_accepted

from renderfarm.jobs import JobError, parse_job
from renderfarm.layout import MANIFEST_BASENAME, sidecar_name
from renderfarm.progress import NOT_OPEN, NOT_SUBMITTED, Progress
from renderfarm.settings import Settings
from renderfarm.sources import check_queued
from renderfarm.storage import Storage
from worker.bundles import Bundle, BundleHook, Job, State
from worker.engine import Engine, Rendered, ShapeKey
from worker.metrics import WorkerMetrics
from worker.outcomes import BROKER_ERRORS, Outcomes
from worker.output import ResultWriter

log = logging.getLogger("renderfarm.worker")

# Slices of the main thread's wait for the devices: Python runs a signal's handler on the
# main thread between bytecodes only, so a wait that never returned would hold a stop off.
WAIT_SLICE = 0.005


class Processor:
    """One job's life from delivery to acknowledgement (see the module docstring), across
    reconnections: the Gatherer of the current connection hands it bundles (worker.bundles),
    and it moves each on through its states; `hooks` do the rest of what a state change means."""

    def __init__(self, engine: Engine, storage: Storage, progress: Progress, app: Celery,
                 settings: Settings, queue: str, store_threads: int | None = None,
                 hooks: Sequence[BundleHook] = (), metrics: WorkerMetrics | None = None) -> None:
        self.engine, self.storage, self.progress, self.hooks = engine, storage, progress, hooks
        self.outcomes = Outcomes(app, progress, settings, queue, metrics)
        self.writer = ResultWriter(storage, engine.model, engine.devices, threads=store_threads)
        # Takes the GATHERED bundles away from the current connection's gatherer (worker.intake).
        self.take_waiting: Callable[[], list[Bundle]] = lambda: []
        self._bundles: list[Bundle] = []  # the bundles handed over by a gatherer and not settled
        self._idle_since = time.monotonic()
        # New shapes compile on their own thread; their bundles wait COMPILING meanwhile.
        self._compiler = ThreadPoolExecutor(1, thread_name_prefix="compile")
        self._compiling: dict[ShapeKey, Future[Any]] = {}
        self.drained = False  # set once a warm shutdown has settled every job it held

    def _held(self, *states: State) -> list[Bundle]:
        """The bundles past gathering that hold jobs still, oldest first (in `states`, if given)."""
        self._bundles = [bundle for bundle in self._bundles if bundle.state is not State.SETTLED]
        return [bundle for bundle in self._bundles if not states or bundle.state in states]

    # -- receive ---------------------------------------------------------------------

    def receive(self, request: Request) -> Job | None:
        """The job of a delivered message, if it is one this worker can render; else it is
        failed for good with the field, value and rule, and dead-lettered."""
        self.outcomes.took(request)
        spec = None
        try:
            if request.args:
                raise JobError("args", request.args, "a job has keyword fields only")
            spec = parse_job(request.kwargs, size_step=self.engine.model.size_step)
            key = self.engine.check(spec)
            check_queued(spec, self.engine.init_images.roots)  # source roots, and the sources' sha256
            self.engine.prefetch([spec], key)  # its init image is read while its bundle gathers
            return Job(request, spec, key)
        except JobError as err:
            reason = f"invalid job: {err}"
        except Exception as err:  # noqa: BLE001 - a bug here must not stop the worker either
            log.exception("job %s could not be read", request.id)
            reason = f"unreadable job: {type(err).__name__}: {err}"
        self.outcomes.invalid(request, reason, spec)
        return None

    # -- admit -----------------------------------------------------------------------

    def process(self, bundle: Bundle) -> None:
        """Admit a gathered bundle and start it on the devices, once its program is compiled."""
        self._admit(bundle)
        if bundle.state is State.SETTLED:
            return
        self._bundles.append(bundle)
        if self.engine.ready(bundle.key):
            self._start(bundle)
            return
        bundle.compiling()
        if bundle.key not in self._compiling:
            log.info("%s: compiling a new program (batches of it wait meanwhile)", bundle.key)
            self._compiling[bundle.key] = self._compiler.submit(self.engine.compiled, bundle.key)

    def _admit(self, bundle: Bundle) -> None:
        """Skip cancelled campaigns' jobs; count attempts; a job whose sidecar is stored
        already (its worker died before the ack, or put it back unsure whether its store had
        landed) is not rendered again."""
        try:
            cancelled = self.progress.cancelled_among({job.campaign for job in bundle.jobs})
            attempts = self.progress.started(job.ident for job in bundle.jobs if job.campaign not in cancelled)
        except BROKER_ERRORS as err:
            self.outcomes.put_back(bundle.release_all(), f"broker: {err}")
            return
        counted = iter(attempts)
        for job in list(bundle.jobs):
            if job.campaign in cancelled:
                self.outcomes.skipped(bundle.release(job))
                continue
            job.attempt = next(counted)
            if job.attempt == NOT_SUBMITTED:
                self.outcomes.invalid(bundle.release(job).request, f"invalid job: campaign={job.campaign!r}: never sent "
                                                           "this job (its campaign's books do not have it)", job.spec)
                continue
            if job.attempt == NOT_OPEN or job.attempt > 1 or job.redelivered:  # its last worker may have stored it
                try:
                    record = self._stored_sidecar(job)
                except Exception as err:  # noqa: BLE001 - classified: storage away, or forbidding the read
                    self.outcomes.errored(bundle.release(job), "storage", err)
                    continue
                if record is not None:
                    self.outcomes.succeeded([(bundle.release(job), self._result(job, record, already_stored=True))])
                    continue
                if job.attempt == NOT_OPEN:
                    self.outcomes.closed(bundle.release(job).request, f"invalid job: campaign={job.campaign!r}: the job is "
                                         "not open in this windowed campaign (failed for good, or never sent) and "
                                         "not stored", job.spec)
                    continue
            task_accepted(job.request)
            job.request.send_event("task-started")

    def _stored_sidecar(self, job: Job) -> dict[str, Any] | None:
        """The sidecar of a job stored already, its manifest line written now unless the part
        the sidecar names holds it already; None if it is not stored. Raises what storage raises.
        A line written now goes to a new part, which the sidecar is made to name first: a later
        delivery of the job looks there, and does not write the line again."""
        name = sidecar_name(job.campaign, job.spec.job_id)
        try:
            record = json.loads(self.storage.get(name))
        except FileNotFoundError:
            return None
        manifest = self.writer.manifest
        if not manifest.holds(job.campaign, record.get("manifest_part", MANIFEST_BASENAME), job.spec.job_id):
            part = manifest.new_part(job.campaign)
            if part != record.get("manifest_part"):
                record["manifest_part"] = part
                self.storage.put(name, json.dumps(record).encode(), "application/json")
            manifest.append(job.campaign, part, [(job.spec.job_id, json.dumps(record))])
        return record

    def _result(self, job: Job, record: dict[str, Any], **extra: Any) -> dict[str, Any]:
        """What a stored job's success says (Flower's event): where it is and what it cost."""
        return {"job_id": job.spec.job_id, "png_sha256": record.get("png_sha256"),
                "url": self.storage.url(sidecar_name(job.campaign, job.spec.job_id)),
                "device_seconds": record.get("device_seconds", 0.0),
                "nsfw": (record.get("scores") or {}).get("nsfw"),
                "gate_passed": (record.get("gate") or {}).get("passed"), **extra}

    # -- render ----------------------------------------------------------------------

    def _start(self, bundle: Bundle) -> None:
        """Start the bundle on the devices and hand the one before, now rendered, to the
        writer: the devices work while the consumer gathers the next bundle. A bundle whose
        sources are still being read waits READING (the consumer's timer starts it once they
        are read or past their deadline); a job whose source cannot be read is taken out; the
        rest render."""
        specs, key = [job.spec for job in bundle.jobs], bundle.key
        if key.image and not self.engine.init_images.ready(specs, key.width, key.height):
            bundle.reading()
            return
        self._unreadable(bundle)
        if bundle.state is State.SETTLED:
            return
        before = self._held(State.RENDERING)
        try:
            started = self.engine.start([job.spec for job in bundle.jobs], bundle.key, list(range(len(bundle.jobs))))
        except Exception:  # noqa: BLE001 - a poison job must not fail the others
            self._one_by_one(bundle)
            return
        bundle.rendering(started)
        for earlier in before:
            self._collect(earlier)

    def _unreadable(self, bundle: Bundle) -> None:
        """Image jobs whose source cannot be read are taken out, each failure classified
        (worker.outcomes): one that is not their image (missing, not allowed, not an image,
        changed) fails for good; a read that storage failed or that ran out of time is retried."""
        jobs = list(bundle.jobs)
        for n, error in self.engine.init_images.unreadable([job.spec for job in jobs], bundle.key.width,
                                                           bundle.key.height).items():
            self.outcomes.errored(bundle.release(jobs[n]), "source", error)

    def _collect(self, bundle: Bundle) -> None:
        """Wait for a bundle's batch on the devices, then hand it to the writer. The wait gives up
        once the worker is stopping: the main thread must get back to Celery's loop for
        the drain to start, and the drain takes the bundle from there."""
        self._idle_since = time.monotonic()
        while not bundle.inflight.ready():
            if self.writer.stopping.wait(WAIT_SLICE):
                return
        try:
            rendered = self.engine.collect(bundle.inflight)
        except Exception:  # noqa: BLE001
            self._one_by_one(bundle)
            return
        self._store(bundle, rendered)

    def _one_by_one(self, bundle: Bundle) -> None:
        log.warning("batch of %d raised; rendering its jobs one by one", len(bundle.jobs), exc_info=True)
        bundle.rendering(None)
        rendered = []
        for job in list(bundle.jobs):
            try:
                rendered += self.engine.render([job.spec])
            except Exception as err:  # noqa: BLE001
                self.outcomes.errored(bundle.release(job), "render", err)
        if bundle.state is State.RENDERING:
            self._store(bundle, rendered)

    # -- store -----------------------------------------------------------------------

    def _store(self, bundle: Bundle, rendered: list[Rendered]) -> None:
        bundle.storing(rendered)
        self.writer.submit(rendered, functools.partial(self._stored, bundle),  # stored and acked while
                           functools.partial(self._store_failed, bundle))     # the next bundle renders

    def _stored(self, bundle: Bundle, records: list[dict[str, Any]]) -> None:
        self.outcomes.succeeded([(job, self._result(job, record)) for job, record in bundle.stored(records)])

    def _store_failed(self, bundle: Bundle, result: Rendered, error: Exception) -> None:
        job = bundle.unstored(result)
        if job is not None:
            self.outcomes.errored(job, "storage", error)

    # -- the consumer's timer ----------------------------------------------------------

    def idle_seconds(self) -> float:
        """How long the devices have had no batch (0 while they have one)."""
        return 0.0 if self._held(State.RENDERING) else time.monotonic() - self._idle_since

    def poll(self) -> None:
        """Start bundles whose program is now compiled or whose sources are now read, collect a
        finished batch, settle what has been stored, and put back jobs whose backoff is over."""
        for key in [key for key, future in self._compiling.items() if future.done()]:
            error = self._compiling.pop(key).exception()
            for bundle in self._held(State.COMPILING):
                if bundle.key != key:
                    continue
                if error is None:
                    self._start(bundle)
                else:
                    for job in bundle.release_all():
                        self.outcomes.failed(job, f"compile: {error}")
        for bundle in self._held(State.READING):
            self._start(bundle)  # it waits on while its sources are being read
        for bundle in self._held(State.RENDERING):
            if bundle.inflight is not None and bundle.inflight.ready():
                self._collect(bundle)
        self.writer.poll()
        self.outcomes.requeue_due()
        busy = bool(self._held(State.RENDERING, State.STORING))
        for hook in self.hooks:
            hook.polled(busy)

    # -- stopping --------------------------------------------------------------------

    def drain(self, until: float) -> None:
        """Warm shutdown (SIGTERM; a spot VM's notice): store what can be stored by `until`
        (monotonic); `give_back` then puts every other job back on its queue."""
        self.writer.stopping.set()
        for bundle in self._held(State.RENDERING):
            while not bundle.inflight.ready() and time.monotonic() < until:
                time.sleep(0.05)
            if bundle.inflight.ready():
                self._collect(bundle)
        self.writer.finish(until=until)

    def give_back(self) -> None:
        """Put every job still held back on its queue now, not after the visibility timeout
        (a bundle still on the devices included: its results are dropped); an unfinished
        attempt does not count."""
        self.writer.abandon()  # what is still storing goes back on the queue with the rest
        bundles = self.take_waiting() + self._held()
        waiting = [job for bundle in bundles for job in bundle.release_all()]
        self.outcomes.put_back(waiting, "the worker is stopping")
        backing_off = self.outcomes.requeue_waiting()
        self.drained = True
        log.info("drained: %d jobs put back on the queue", len(waiting) + backing_off)
