"""Messages in: the render task's Celery strategy turns each delivered request into a Job
(worker.processing.Processor.receive checks it) and gathers jobs by shape into bundles, each
the jobs of one batch (worker.bundles).

Why not celery-batches: it sends no per-job task events (Flower would see nothing), its
`Task.retry` does not work, and after a broker reconnect it can stop flushing while holding
unacked messages. This module is the small part of it we need, on Celery's own consumer
API: a task Strategy that buffers requests and flushes them when a bundle is full or
`max_wait` has passed, rebuilt cleanly on every reconnect, with Celery's own per-request
events and worker state, so Flower and `inspect` see every job."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from celery import Celery, Task
from celery.worker.request import Request, create_request_cls
from celery.worker.state import task_reserved

from renderfarm.queue import TASK_NAME
from worker.bundles import Bundle, Job
from worker.engine import ShapeKey
from worker.processing import Processor

log = logging.getLogger("renderfarm.worker")

# Seconds without an arriving job after which idle devices take a partial bundle: while the
# queue has jobs, the worker's pop (worker.broker) brings them in far quicker than that.
QUEUE_QUIET = 0.05


class Gatherer:
    """Jobs waiting in their bundle, by shape key, so batches run full even when shapes
    interleave on the queue. A key's bundle runs when it holds `batch_size` jobs, when its
    first job has waited `max_wait` seconds of the worker's free time (time spent waiting
    for the devices does not count: no message can arrive then), or when `patience`
    bundles of other keys have run since that job came, so no shape starves behind busier
    ones. And when for `quiet` seconds the devices have been idle and no job has come, the
    oldest partial bundle runs at once: waiting would only delay it, since while the
    devices are busy the next jobs gather anyway (a lone job is rendered without
    `max_wait`). Both clocks count, because a consumer starved by a rendering batch
    receives nothing until the devices are done, though the queue may hold plenty."""

    def __init__(self, processor: Processor, batch_size: int, max_wait: float, patience: int,
                 quiet: float = QUEUE_QUIET) -> None:
        self.processor, self.batch_size, self.max_wait, self.patience = processor, batch_size, max_wait, patience
        self.quiet, self.last_arrival = quiet, time.monotonic()
        self.buffers: dict[ShapeKey, Bundle] = {}
        self.deadlines: dict[ShapeKey, float] = {}
        self.since: dict[ShapeKey, int] = {}  # bundles run when the key's first job came
        self.ran = 0

    def add(self, job: Job) -> None:
        self.last_arrival = time.monotonic()
        if job.key not in self.buffers:
            self.buffers[job.key], self.since[job.key] = Bundle(job.key, self.processor.hooks), self.ran
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
        bundle = self.buffers.pop(key)
        del self.deadlines[key], self.since[key]
        self.ran += 1
        started = time.monotonic()
        try:
            self.processor.process(bundle)
        except Exception as err:  # noqa: BLE001 - the worker must keep serving; jobs go back
            log.exception("batch of %d failed outside any job; requeued", len(bundle.jobs))
            for job in bundle.release_all():
                self.processor.outcomes.errored(job, "worker", err)
        blocked = time.monotonic() - started
        for other in self.deadlines:
            self.deadlines[other] += blocked
        for other in [k for k, since in self.since.items() if self.ran - since >= self.patience]:
            if other in self.buffers:
                self.flush(other)

    def take_all(self) -> list[Bundle]:
        """Every waiting bundle, taken away (the worker is stopping)."""
        bundles = list(self.buffers.values())
        self.buffers.clear()
        self.deadlines.clear()
        self.since.clear()
        return bundles


class RenderStrategy:
    """The Celery strategy of the render task: each request becomes a Job in a Gatherer."""

    def __init__(self, processor: Processor, batch_size: int, max_wait: float, patience: int = 4) -> None:
        self.processor, self.batch_size, self.max_wait = processor, batch_size, max_wait
        self.patience = patience
        self.gatherer: Gatherer | None = None  # the current connection's

    def __call__(self, task: Task, app: Celery, consumer: Any) -> Callable[..., None]:
        # Built anew on every (re)connection: nothing of the old connection's buffers
        # survives, so a reconnect can never leave a flush that will not come. The jobs
        # buffered then go back on their queue at once (the transport no longer puts back
        # a lost connection's messages: worker.broker).
        Req = create_request_cls(Request, task, consumer.pool, consumer.hostname,
                                 consumer.event_dispatcher, app=app)
        if self.gatherer is not None:
            waiting = [job for bundle in self.gatherer.take_all() for job in bundle.release_all()]
            self.processor.outcomes.put_back(waiting, "the connection to the broker was lost")
        self.gatherer = gatherer = Gatherer(self.processor, self.batch_size, self.max_wait, self.patience)
        self.processor.take_waiting = gatherer.take_all
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


def render_task(strategy: RenderStrategy) -> Task:
    class RenderTask(Task):
        """One job per message; the worker renders them in batches (see RenderStrategy)."""

        name = TASK_NAME
        acks_late = True
        typing = False

        def run(self, **job: Any) -> None:
            raise RuntimeError("render jobs run in batches inside `renderfarm worker`")

        def Strategy(self, task: Task, app: Celery, consumer: Any) -> Callable[..., None]:  # noqa: N802
            return strategy(task, app, consumer)

    return RenderTask()
