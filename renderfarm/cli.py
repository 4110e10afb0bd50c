"""The `renderfarm` command. Producer-side commands never import JAX; worker-side ones do,
lazily, inside their handlers."""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from collections.abc import Sequence
from typing import Any

from renderfarm.jobs import DTYPES, SCHEDULERS, JobError


def job_flags(parser: argparse.ArgumentParser) -> None:
    """The job fields every command that makes jobs accepts (render, submit)."""
    parser.add_argument("prompts_args", nargs="*", metavar="PROMPT", help="prompts, one job each")
    parser.add_argument("--prompts", metavar="FILE", help=".txt (a prompt a line) or .jsonl (a job a line)")
    parser.add_argument("--model", required=True, help="hub id[@revision], local folder or gs:// folder")
    parser.add_argument("--campaign", default="local", help="folder under --out (default: local)")
    parser.add_argument("--seed", type=int, help="base seed: job i gets SEED+i (default: random, recorded)")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--guidance", type=float, dest="guidance_scale")
    parser.add_argument("--negative", dest="negative_prompt")
    parser.add_argument("--width", type=int)
    parser.add_argument("--height", type=int)
    parser.add_argument("--scheduler", choices=SCHEDULERS, help="default: the model's own")
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--variant", help="the model's weights variant, e.g. fp16 (its *.fp16.safetensors files)")


def job_defaults(args: argparse.Namespace) -> dict[str, Any]:
    names = ("model", "campaign", "steps", "guidance_scale", "negative_prompt", "width", "height",
             "scheduler", "dtype", "variant")
    return {name: getattr(args, name) for name in names}


def cmd_tiny_model(args: argparse.Namespace) -> int:
    from worker.tiny import build_tiny_model

    path = build_tiny_model(args.dir, kind=args.kind, seed=args.seed)
    print(f"tiny {args.kind} model written to {path}")
    return 0


def cmd_render(args: argparse.Namespace) -> int:
    from producer.ingest import build_jobs, prompt_rows
    from renderfarm.storage import open_storage

    rows = prompt_rows(args.prompts_args, args.prompts)
    first = list(itertools.islice(rows, 1))
    if not first:
        raise JobError("prompts", None, "give at least one PROMPT or --prompts FILE")
    from worker.engine import Engine, enable_compilation_cache
    from worker.executables import ExecutableStore
    from worker.local import render_to_storage
    from worker.models import load_model

    cache = enable_compilation_cache(args.compile_cache)
    model = load_model(args.model, args.dtype, args.variant)
    specs = list(build_jobs(itertools.chain(first, rows), job_defaults(args), args.seed, model.size_step))
    storage = open_storage(args.out, durable=False)  # nothing is acked on it
    engine = Engine(model, per_device_batch=args.per_device_batch, executables=ExecutableStore(cache / "executables"))
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


def parser() -> argparse.ArgumentParser:
    # Each module registers its own commands; none imports JAX (or pyarrow, Flower,
    # Celery's worker) until its command runs.
    from producer import commands as producer_commands
    from producer import export, schedules
    from renderfarm import flower, gallery
    from worker import commands as worker_commands

    top = argparse.ArgumentParser(prog="renderfarm", description="Text-to-image render farm on JAX.")
    sub = top.add_subparsers(dest="command", required=True)

    tiny = sub.add_parser("tiny-model", help="build a tiny random-weight pipeline (tests, demos)")
    tiny.add_argument("dir")
    tiny.add_argument("--kind", choices=("sd", "sdxl"), default="sd")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(handler=cmd_tiny_model)

    render = sub.add_parser("render", help="render jobs in this process (no broker)")
    job_flags(render)
    render.add_argument("--out", required=True, help="local folder or gs://bucket/prefix")
    render.add_argument("--per-device-batch", type=int, default=1)
    worker_commands.store_threads_flag(render)
    render.add_argument("--compile-cache", default=os.environ.get("RENDERFARM_COMPILE_CACHE"),
                        help="JAX persistent compilation cache folder "
                             "(default: $RENDERFARM_COMPILE_CACHE or ~/.cache/renderfarm/jax)")
    render.add_argument("--quiet", action="store_true", help="no progress bar")
    render.set_defaults(handler=cmd_render)

    for module in (worker_commands, producer_commands, schedules, flower, export, gallery):
        module.register(sub)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.handler(args)
    except JobError as err:
        print(f"renderfarm: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
