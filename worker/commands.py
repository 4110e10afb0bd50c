"""The worker side's commands: `renderfarm worker` (load and compile the model, then consume its
queue in batches), `render` (the same engine in this process, no broker) and `tiny-model`.
Handlers import JAX when they run, not before."""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from renderfarm.flags import broker_flag, job_defaults, job_flags, weights_flags
from renderfarm.jobs import SCHEDULERS, SPACINGS, JobError, parse_loras
from renderfarm.sources import READ_SECONDS, SourceRoots
from worker.plan import JOB_FIELDS

if TYPE_CHECKING:
    from diffusion.models import LoadedModel

SHAPE_RE = re.compile(r"(\d+)x(\d+)@(\d+)((?::[\w-]+)*)")
CFG_FREE = "cfg-free"  # a --precompile option: the program of jobs with guidance <= 1
KARRAS = "karras"  # a --precompile option: Karras sigmas
IMAGE_JOBS = {kind: fields for kind, fields in JOB_FIELDS.items() if fields}  # --precompile options
SHAPE_RULE = (f"must be WIDTHxHEIGHT@STEPS[:SCHEDULER][:SPACING][:{KARRAS}][:{CFG_FREE}][:img2img|:inpaint], "
              f"comma-separated (schedulers {', '.join(SCHEDULERS)}; spacings {', '.join(SPACINGS)})")


def parse_shapes(text: str) -> list[dict[str, Any]]:
    """`512x512@25,1024x1024@4:euler_a:trailing:cfg-free,512x512@25:inpaint` -> the job fields
    of each program to compile: width, height, steps, scheduler, timestep_spacing, karras, a
    guidance scale that picks the program with (7.5) or without (1.0) classifier-free guidance,
    and an image job's placeholder image fields."""
    shapes = []
    for part in filter(None, text.split(",")):
        match = SHAPE_RE.fullmatch(part.strip())
        options = match[4].split(":")[1:] if match else []
        schedulers = [o for o in options if o in SCHEDULERS]
        spacings = [o for o in options if o in SPACINGS]
        images = [o for o in options if o in IMAGE_JOBS]
        known = len(schedulers) + len(spacings) + len(images) + options.count(KARRAS) + options.count(CFG_FREE)
        if not match or known != len(options) or len(options) != len(set(options)) or len(schedulers) > 1 \
                or len(spacings) > 1 or len(images) > 1:
            raise JobError("precompile", part, SHAPE_RULE)
        shapes.append({"width": int(match[1]), "height": int(match[2]), "steps": int(match[3]),
                       "scheduler": schedulers[0] if schedulers else None,
                       "timestep_spacing": spacings[0] if spacings else None,
                       "karras": True if KARRAS in options else None,
                       "guidance_scale": 1.0 if CFG_FREE in options else 7.5,
                       **(IMAGE_JOBS[images[0]] if images else {})})
    return shapes


def load_named_model(args: argparse.Namespace) -> LoadedModel:
    """The model the command line names; gs:// references are read through the farm's storage layer."""
    from diffusion.models import load_model, set_bucket_opener
    from renderfarm.storage import open_storage

    set_bucket_opener(open_storage)
    return load_model(args.model, args.dtype, args.variant, args.base, parse_loras(args.loras),
                      model_parallel=args.model_parallel)


def cmd_worker(args: argparse.Namespace) -> int:
    from renderfarm.jobs import parse_job
    from renderfarm.settings import Settings
    from worker.engine import Engine, enable_compilation_cache
    from worker.executables import ExecutableStore
    from worker.farm import build_worker
    from worker.output import check_writable
    from worker.plan import engine_for
    from worker.sources import InitImages

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    shapes = parse_shapes(args.precompile or "")
    if args.per_device_batch is None and not shapes:  # a worker has no jobs yet to size its batches for
        raise JobError("per-device-batch", "auto", "sizes batches for the first --precompile shape: give one")
    if args.metrics_port is not None:
        from worker.metrics import check_port

        check_port(args.metrics_port)
    roots = SourceRoots.parse(args.source_root or [])
    check_writable(args.out)  # before minutes of loading and compiling
    settings = Settings.from_env(broker_url=args.broker)
    cache = enable_compilation_cache(args.compile_cache, max_bytes=args.compile_cache_max_gb * 2**30)
    started = time.perf_counter()
    model = load_named_model(args)
    log = logging.getLogger("renderfarm.worker")
    log.info("%s (%s) loaded in %.1fs", model.ref, model.dtype, time.perf_counter() - started)

    def key_of(engine: Engine, shape: dict[str, Any]) -> Any:
        """The shape key of a --precompile shape."""
        job = {"prompt": "-", "model": model.ref, "seed": 0, "dtype": args.dtype, "variant": args.variant,
               "base": model.base, "loras": model.loras, **shape}
        try:
            return engine.check(parse_job(job, size_step=model.size_step))
        except JobError as err:
            raise JobError("precompile", f"{shape['width']}x{shape['height']}@{shape['steps']}", str(err)) from None

    engine = engine_for(model, args.per_device_batch, lambda engine: key_of(engine, shapes[0]),
                        max_programs=args.max_programs, scorers=load_named_scorers(args),
                        executables=ExecutableStore(cache / "executables", max_bytes=args.compile_cache_max_gb * 2**30),
                        init_images=InitImages(roots, seconds=args.source_seconds))
    for shape in shapes:
        started = time.perf_counter()
        key = key_of(engine, shape)
        engine.compiled(key)
        log.info("%s ready in %.1fs", key, time.perf_counter() - started)
    worker, processor = build_worker(engine, settings, args.out, node=args.node_name,
                                     store_threads=args.store_threads, max_wait=args.max_wait,
                                     drain_seconds=args.drain_seconds, metrics_port=args.metrics_port)
    worker.start()
    if processor.drained:
        # Every job is acked or back on its queue. Threads still busy (a store that will not
        # finish, a compile) must not hold the exit past --drain-seconds: the interpreter
        # would join them first.
        logging.shutdown()
        os._exit(worker.exitcode or 0)
    return worker.exitcode or 0


def cmd_render(args: argparse.Namespace) -> int:
    from renderfarm.ingest import build_jobs, prompt_rows
    from renderfarm.storage import open_storage

    rows = prompt_rows(args.prompts_args, args.prompts)
    first = list(itertools.islice(rows, 1))
    if not first:
        raise JobError("prompts", None, "give at least one PROMPT or --prompts FILE")
    from worker.engine import enable_compilation_cache
    from worker.executables import ExecutableStore
    from worker.local import render_to_storage
    from worker.plan import engine_for

    cache = enable_compilation_cache(args.compile_cache)
    model = load_named_model(args)
    specs = list(build_jobs(itertools.chain(first, rows), job_defaults(args), args.seed, model.size_step))
    # --per-device-batch auto sizes batches for the first job's shape
    engine = engine_for(model, args.per_device_batch, lambda engine: engine.check(specs[0]),
                        executables=ExecutableStore(cache / "executables"), scorers=load_named_scorers(args))
    engine.plan(specs)  # the model's own rules (sampler, size) refuse a job before anything is written
    storage = open_storage(args.out, durable=False)  # nothing is acked on it
    report = render_to_storage(specs, engine, storage, progress=not args.quiet, store_threads=args.store_threads)
    for campaign in report.campaigns:
        print(f"wrote {sum(s.campaign == campaign for s in specs)} images to {storage.url(campaign)}/ "
              f"(manifest: {storage.url(campaign + '/manifest.jsonl')})")
    print(f"{report.images} images in {report.render_seconds:.2f}s after compile: "
          f"{report.images_per_second:.2f} images/s on {len(engine.devices)} "
          f"{engine.devices[0].device_kind} devices (batch {engine.batch_size}); "
          f"compile {report.compile_seconds:.1f}s ({report.programs} programs: {report.loaded} saved "
          f"executables loaded, {report.cache_hits} from the persistent cache)")
    return 0


def cmd_tiny_model(args: argparse.Namespace) -> int:
    from diffusion.families import FAMILIES
    from diffusion.tiny import build_tiny_model

    if args.kind not in FAMILIES:
        raise JobError("kind", args.kind, f"must be one of {', '.join(FAMILIES)}")
    path = build_tiny_model(args.dir, kind=args.kind, seed=args.seed)
    print(f"tiny {args.kind} model written to {path}")
    return 0


SCORE_MODELS = {  # a job's score -> the model flag that gives it, and what that model is
    "safety": "diffusers' safety checker folder (config.json, model.safetensors), as in a pipeline's "
              "safety_checker/: the safety score (nsfw and its concepts)",
    "clip": "a CLIP model folder (transformers' CLIPModel with its tokenizer; ViT-L/14 as openai/"
            "clip-vit-large-patch14): the clip score, and the embeds the aesthetic score reads",
    "aesthetic": "LAION's improved aesthetic predictor as one .safetensors file (needs --clip-model)",
}


def score_model_flags(parser: argparse.ArgumentParser) -> None:
    """The scoring models a worker loads at start-up (a folder, a hub id or gs://); a job's
    score whose model is not given is missing from its sidecar, with the reason."""
    for name, what in SCORE_MODELS.items():
        parser.add_argument(f"--{name}-model", metavar="REF", help=what)


def load_named_scorers(args: argparse.Namespace) -> Any:
    """The scorers the command line names (diffusion.scores.Scorers; phash needs none)."""
    from diffusion.models import resolve, resolve_file
    from diffusion.scores import load_scorers

    refs = {name: getattr(args, f"{name}_model") for name in SCORE_MODELS}
    paths = {name: None if ref is None else resolve_file(ref, f"{name}-model")[0] if name == "aesthetic"
             else resolve(ref)[0] for name, ref in refs.items()}
    return load_scorers(**paths)


def store_threads_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store-threads", type=int, metavar="N",
                        help="threads that PNG-encode and store finished images while the devices "
                             "render (default: one per core, 2 to 8)")


def compile_cache_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--compile-cache", default=os.environ.get("RENDERFARM_COMPILE_CACHE"), metavar="DIR",
                        help="compiled programs' folder (default: $RENDERFARM_COMPILE_CACHE or "
                             "~/.cache/renderfarm/jax); it must be the worker user's alone")


def devices_flags(parser: argparse.ArgumentParser) -> None:
    """How the model uses the host's devices: copies of its weights, and jobs per batch."""
    parser.add_argument("--model-parallel", type=_model_parallel, default=None, metavar="N|auto",
                        help="devices that share one copy of the weights, split over them (diffusion/sharding.py); "
                             "auto: the fewest whose memory holds them, 1 where they fit one device (default auto)")
    parser.add_argument("--per-device-batch", type=_per_device_batch, default=1, metavar="N|auto",
                        help="jobs per copy of the weights in a batch (a batch is devices / model-parallel x N jobs); "
                             "auto: the most the device's memory holds, from the program compiled at 1 "
                             "(default 1)")


def _count_or_auto(what: str) -> Callable[[str], int | None]:
    """A flag's parser of a count of `what` (1 or more) or `auto` (None)."""
    def parse(text: str) -> int | None:
        if text == "auto":
            return None
        if not text.isdigit() or int(text) < 1:
            raise argparse.ArgumentTypeError(f"{text!r}: a number of {what} (1 or more) or auto")
        return int(text)
    return parse


_model_parallel, _per_device_batch = _count_or_auto("devices"), _count_or_auto("jobs")


def register(sub: argparse._SubParsersAction) -> None:
    from worker import plan

    tiny = sub.add_parser("tiny-model", help="build a tiny random-weight pipeline (tests, demos)")
    tiny.add_argument("dir", help="the folder to write it to")
    tiny.add_argument("--kind", default="sd", help="the model family, as diffusion/families names it (default sd)")
    tiny.add_argument("--seed", type=int, default=0, help="the weights' seed: the same seed, the same files (default 0)")
    tiny.set_defaults(handler=cmd_tiny_model)

    render = sub.add_parser("render", help="render jobs in this process (no broker)")
    job_flags(render)
    render.add_argument("--out", required=True, help="local folder or gs://bucket/prefix")
    devices_flags(render)
    store_threads_flag(render)
    score_model_flags(render)
    compile_cache_flag(render)
    render.add_argument("--quiet", action="store_true", help="no progress bar")
    render.set_defaults(handler=cmd_render)

    worker = sub.add_parser("worker", help="serve a model's queue: render jobs in batches, store them")
    worker.add_argument("--model", required=True,
                        help="hub id[@revision], local folder or gs:// folder, or one .safetensors file")
    worker.add_argument("--out", required=True, help="local folder or gs://bucket/prefix")
    weights_flags(worker)
    devices_flags(worker)
    worker.add_argument("--max-wait", type=float, default=2.0, metavar="SECONDS",
                        help="seconds a partial batch waits for more jobs while the devices are busy "
                             "(default 2; idle devices take it once no job has come for 50 ms)")
    store_threads_flag(worker)
    score_model_flags(worker)
    broker_flag(worker)
    worker.add_argument("--precompile", metavar=f"WxH@STEPS[:SCHED][:SPACING][:{KARRAS}][:{CFG_FREE}],...",
                        help="shapes to compile before consuming anything (default: none; others compile "
                             f"when their first jobs come); :{CFG_FREE} is the program of jobs with "
                             "guidance <= 1")
    worker.add_argument("--source-root", action="append", metavar="FOLDER|gs://BUCKET[/PREFIX]",
                        help="where image jobs' sources (init_image, mask_image) may be read from; repeatable. "
                             "A worker without one takes no image jobs (default: none)")
    worker.add_argument("--source-seconds", type=float, default=READ_SECONDS, metavar="SECONDS",
                        help=f"how long a source read may take before its job is retried (default {READ_SECONDS:g})")
    worker.add_argument("--node-name", metavar="NAME", help="Celery node name (default: renderfarm-PID@HOST)")
    worker.add_argument("--metrics-port", type=int, metavar="PORT",
                        help="serve Prometheus metrics on this port at /metrics (default: off; each worker "
                             "on a host needs its own port)")
    compile_cache_flag(worker)
    worker.add_argument("--compile-cache-max-gb", type=float, metavar="GB",
                        default=float(os.environ.get("RENDERFARM_COMPILE_CACHE_MAX_GB", 10)),
                        help="size cap of JAX's cache and of the saved executables, each; least "
                             "recently used entries go first (default 10)")
    worker.add_argument("--max-programs", type=int, metavar="N",
                        help="compiled shapes kept in memory, least recently used evicted (default: "
                             "sized for device memory; 16 where the backend reports none)")
    worker.add_argument("--drain-seconds", type=float, default=25.0, metavar="SECONDS",
                        help="on SIGTERM, seconds to finish and store what is rendering before the "
                             "rest goes back on the queue (default 25: inside a spot VM's 30 s notice)")
    worker.set_defaults(handler=cmd_worker)

    plan.register(sub, _model_parallel)
