"""`renderfarm worker`: load and compile the model, then consume its queue in batches."""

from __future__ import annotations

import argparse
import logging
import os
import re
import time

from renderfarm.jobs import DTYPES, SCHEDULERS, JobError

SHAPE_RE = re.compile(r"(\d+)x(\d+)@(\d+)(?::(\w+))?")


def parse_shapes(text: str) -> list[tuple[int, int, int, str | None]]:
    """`512x512@25,768x512@30:dpm` -> [(512, 512, 25, None), (768, 512, 30, "dpm")]."""
    shapes = []
    for part in filter(None, text.split(",")):
        match = SHAPE_RE.fullmatch(part.strip())
        if not match or (match[4] and match[4] not in SCHEDULERS):
            raise JobError("precompile", part, "must be WIDTHxHEIGHT@STEPS[:SCHEDULER], comma-separated")
        shapes.append((int(match[1]), int(match[2]), int(match[3]), match[4]))
    return shapes


def cmd_worker(args: argparse.Namespace) -> int:
    from celery.apps.worker import Worker

    from renderfarm.jobs import JobSpec
    from renderfarm.progress import Progress
    from renderfarm.queue import make_app, queue_name
    from renderfarm.settings import Settings
    from renderfarm.storage import RetryPolicy, open_storage
    from worker.broker import transport_for
    from worker.engine import Engine, StandInEngine, enable_compilation_cache
    from worker.executables import ExecutableStore
    from worker.farm import Batcher, Processor, drain_step, node_name, render_task
    from worker.models import load_model

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    shapes = parse_shapes(args.precompile or "")
    settings = Settings.from_env(broker_url=args.broker)
    cache = enable_compilation_cache(args.compile_cache, max_bytes=args.compile_cache_max_gb * 2**30)
    started = time.perf_counter()
    model = load_model(args.model, args.dtype, args.variant)
    log = logging.getLogger("renderfarm.worker")
    log.info("%s (%s) loaded in %.1fs", model.ref, model.dtype, time.perf_counter() - started)
    engine = (Engine(model, per_device_batch=args.per_device_batch, max_programs=args.max_programs,
                     executables=ExecutableStore(cache / "executables", max_bytes=args.compile_cache_max_gb * 2**30))
              if args.stand_in is None
              else StandInEngine(model, args.stand_in, per_device_batch=args.per_device_batch))
    for width, height, steps, scheduler in shapes:
        started = time.perf_counter()
        key = engine.check(JobSpec(prompt="-", model=model.ref, seed=0, steps=steps, width=width,
                                   height=height, scheduler=scheduler, dtype=args.dtype, variant=args.variant))
        engine.compiled(key)
        log.info("%s ready in %.1fs", key, time.perf_counter() - started)
    # Outages longer than the default retry window must not fail jobs: keep trying ~5 min.
    storage = open_storage(args.out, retry=RetryPolicy(attempts=14, base_delay=0.5, max_delay=30.0))
    app = make_app(settings)
    app.conf.broker_transport = transport_for(settings.broker_url)
    # Unacked: the batches being gathered (one per shape key on the queue), the one
    # rendering, those being stored (BatchWriter keeps at most 2), and the next ones.
    app.conf.worker_prefetch_multiplier = 8 * engine.batch_size
    processor = Processor(engine, storage, Progress.from_url(settings.broker_url), app, settings,
                          store_threads=args.store_threads)
    app.register_task(render_task(Batcher(processor, engine.batch_size, args.max_wait)))
    app.steps["consumer"].add(drain_step(processor, args.drain_seconds))
    queue = queue_name(model.ref, model.dtype, model.variant)
    log.info(
        "serving %s (%s) from queue %r in batches of %d on %d %s devices, storing to %s",
        model.ref, model.dtype, queue, engine.batch_size, len(engine.devices),
        engine.devices[0].device_kind, storage.describe())
    worker = Worker(app=app, hostname=args.node_name or node_name(), pool_cls="solo", concurrency=1,
                    queues=[queue], loglevel="INFO", without_mingle=True, without_gossip=True,
                    task_events=True, redirect_stdouts=False)
    worker.start()
    if processor.drained:
        # Every job is acked or back on its queue. Threads still busy (a store that will not
        # finish, a compile) must not hold the exit past --drain-seconds: the interpreter
        # would join them first.
        logging.shutdown()
        os._exit(worker.exitcode or 0)
    return worker.exitcode or 0


def store_threads_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store-threads", type=int, metavar="N",
                        help="threads that PNG-encode and store finished images while the devices "
                             "render (default: one per core, 2 to 8)")


def register(sub: argparse._SubParsersAction) -> None:
    worker = sub.add_parser("worker", help="serve a model's queue: render jobs in batches, store them")
    worker.add_argument("--model", required=True, help="hub id[@revision], local folder or gs:// folder")
    worker.add_argument("--out", required=True, help="local folder or gs://bucket/prefix")
    worker.add_argument("--dtype", choices=DTYPES, default="float32")
    worker.add_argument("--variant", help="the model's weights variant, e.g. fp16 (its *.fp16.safetensors files); "
                                          "jobs name it too")
    worker.add_argument("--per-device-batch", type=int, default=1)
    worker.add_argument("--max-wait", type=float, default=2.0,
                        help="seconds a partial batch waits for more jobs while the devices are busy "
                             "(idle devices take it once no job has come for 50 ms)")
    store_threads_flag(worker)
    worker.add_argument("--broker", help="default: $RENDERFARM_BROKER_URL or redis://localhost:6379/0")
    worker.add_argument("--precompile", metavar="WxH@STEPS[:SCHED],...",
                        help="shapes to compile before consuming anything")
    worker.add_argument("--node-name", help="Celery node name (default: renderfarm-PID@HOST)")
    worker.add_argument("--compile-cache", default=os.environ.get("RENDERFARM_COMPILE_CACHE"),
                        help="compiled programs' folder (default: $RENDERFARM_COMPILE_CACHE or "
                             "~/.cache/renderfarm/jax); it must be the worker user's alone")
    worker.add_argument("--compile-cache-max-gb", type=float,
                        default=float(os.environ.get("RENDERFARM_COMPILE_CACHE_MAX_GB", 10)),
                        help="size cap of JAX's cache and of the saved executables, each; least "
                             "recently used entries go first (default 10)")
    worker.add_argument("--max-programs", type=int, metavar="N",
                        help="compiled shapes kept in memory, least recently used evicted (default: "
                             "sized for device memory; 16 where the backend reports none)")
    worker.add_argument("--drain-seconds", type=float, default=25.0,
                        help="on SIGTERM, seconds to finish and store what is rendering before the "
                             "rest goes back on the queue (default 25: inside a spot VM's 30 s notice)")
    worker.add_argument("--stand-in", type=float, metavar="SECONDS",
                        help="benchmark the control plane: no rendering, each batch sleeps SECONDS "
                             "and stores blank images")
    worker.set_defaults(handler=cmd_worker)
