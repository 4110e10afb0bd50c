"""The farm worker: a Celery worker (solo pool, JAX in the main process) that consumes its
model's queue in batches of `devices x per_device_batch` jobs.

A job's life, in the order it happens (Processor, one method each), inside its bundle
(worker.bundles.Bundle: the jobs gathered for one batch, whose state says which step it is at):
  receive   the message is a job, valid here (or it is failed for good and dead-lettered)
  gather    jobs wait for a full bundle of their shape (intake)             GATHERED
  admit     cancelled campaigns skipped, attempts counted, a job stored already not redone
  render    on the devices; the program is compiled off the consumer's thread
                                                                  COMPILING, RENDERING
  store     PNG, sidecar, manifest line, on the store threads (worker.output.ResultWriter)
                                                                             STORING
  end       succeeded, retried or failed (worker.outcomes: the one place for the retry policy),
            then acknowledged or put back on the queue; taken out of its bundle first,
            which is SETTLED once it holds no job
Metrics, the fleet's hash, galleries and the rate log are hooks on the bundles' state
changes (worker.hooks).
The message arrives already checked by the transport (worker.envelope): nothing in it can
make Celery or kombu raise. Whatever raises later is caught where the job's life ends, so a
worker never exits or wedges on input, and every job taken is acked or requeued.

Where each part lives: intake (the task's strategy, gathering) in worker.intake, the steps
from admit to store in worker.processing, the outcomes in worker.outcomes, warm shutdown in
worker.stopping; `build_worker` below wires them into one Celery worker.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import TYPE_CHECKING

from renderfarm.progress import Progress
from renderfarm.queue import make_app, queue_name
from renderfarm.retry import RetryPolicy
from renderfarm.settings import Settings
from renderfarm.storage import open_storage
from worker.broker import HELD_OPTION, HeldKeeper, transport_for
from worker.engine import Engine
from worker.hooks import FleetHook, GalleryHook, MetricsHook, RateLog
from worker.intake import RenderStrategy, render_task
from worker.processing import Processor
from worker.stopping import StopDeadline, drain_step

if TYPE_CHECKING:
    from celery.apps.worker import Worker

log = logging.getLogger("renderfarm.worker")


def build_worker(engine: Engine, settings: Settings, out: str, *, node: str | None = None,
                 store_threads: int | None, max_wait: float, drain_seconds: float,
                 metrics_port: int | None) -> tuple[Worker, Processor]:
    """A Celery worker (solo pool) consuming the queue of the engine's model into `out`, with
    everything a job's life needs wired in; and its processor, which says after the worker
    stopped whether it drained."""
    from celery.apps.worker import Worker

    model = engine.model
    # Outages longer than the default retry window must not fail jobs: keep trying ~5 min.
    storage = open_storage(out, retry=RetryPolicy(attempts=14, base_delay=0.5, max_delay=30.0))
    app = make_app(settings)
    app.conf.broker_transport = transport_for(settings.broker_url)
    # Unacked: the bundles being gathered (one per shape key on the queue), the one
    # rendering, those being stored (ResultWriter keeps at most 2), and the next ones.
    app.conf.worker_prefetch_multiplier = 8 * engine.batch_size
    queue = queue_name(model.ref, model.dtype, model.variant, model.base, model.loras)
    node = node or node_name()
    progress = Progress.from_url(settings.broker_url)
    metrics = None
    if metrics_port is not None:
        from worker.metrics import WorkerMetrics

        metrics = WorkerMetrics(engine.devices[0].device_kind, len(engine.devices))
        metrics.compiled(engine.compiles, engine.compile_seconds)  # --precompile's
        metrics.watch_queue(progress.r, queue)
        metrics.serve(metrics_port)
        log.info("metrics on http://0.0.0.0:%d/metrics", metrics_port)
    hooks = [FleetHook(progress.r, node, queue), GalleryHook(storage, engine.init_images.roots), RateLog(engine)]
    if metrics is not None:
        hooks.append(MetricsHook(metrics, engine))
    processor = Processor(engine, storage, progress, app, settings, queue, store_threads=store_threads,
                          hooks=hooks, metrics=metrics)
    # The messages the worker holds stay its own across reconnections (worker.broker).
    HeldKeeper(progress.r, processor.outcomes.held_tags, settings.visibility_timeout)
    app.conf.broker_transport_options = {**app.conf.broker_transport_options,
                                         HELD_OPTION: processor.outcomes.held_tags}
    app.register_task(render_task(RenderStrategy(processor, engine.batch_size, max_wait)))
    app.steps["consumer"].add(drain_step(StopDeadline(processor, drain_seconds)))
    log.info("serving %s (%s) from queue %r in batches of %d on %d %s devices, storing to %s",
             model.ref, model.dtype, queue, engine.batch_size, len(engine.devices),
             engine.devices[0].device_kind, storage.describe())
    roots = engine.init_images.roots
    if roots:
        log.info("image jobs' sources are read from %s only", roots)
    else:
        log.info("this worker takes no image jobs: it was started without --source-root")
    worker = Worker(app=app, hostname=node, pool_cls="solo", concurrency=1, queues=[queue], loglevel="INFO",
                    without_mingle=True, without_gossip=True, task_events=True, redirect_stdouts=False)
    return worker, processor


def node_name() -> str:
    """Unique per process, so several workers run side by side on one host."""
    return f"renderfarm-{os.getpid()}@{socket.gethostname()}"
