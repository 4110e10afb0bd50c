"""Mixed shapes: one worker, a queue of jobs of three shapes interleaved; prints how full
the device batches ran and how long each shape waited (issue 5, item 3). Not a test.

Every sidecar names the batch its job ran in (`batch.seq`, `batch.jobs`, `batch.slots`),
so the figures come from what the worker stored:
  fill      = real jobs / batch slots, over every batch the worker ran (target >= 0.9);
  max wait  = for each shape, the most batches of other shapes run between two of its own
              batches while it still had jobs queued (bounded: a shape never starves).

Usage: PYTHONPATH=. python bench/shapes.py [--jobs 300] [--steps 4]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from harness.farm import WorkerProcess, farm_app, manifest_ids, manifest_records, wait_for  # noqa: E402
from harness.redis_server import RedisServer  # noqa: E402
from producer.submit import submit_jobs  # noqa: E402
from renderfarm.jobs import JobSpec  # noqa: E402
from renderfarm.progress import Progress  # noqa: E402
from renderfarm.settings import Settings  # noqa: E402
from renderfarm.storage import open_storage  # noqa: E402

SHAPES = ((64, 64), (96, 64), (64, 96))  # the tiny model's size step is 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=300)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    from diffusion.tiny import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="rf-bench-") as tmp:
        model = build_tiny_model(Path(tmp) / "tiny-sd")
        server = RedisServer(appendonly=False)
        out = Path(tmp) / "out"
        precompile = ",".join(f"{w}x{h}@{args.steps}" for w, h in SHAPES)
        worker = WorkerProcess(model, str(out), server.url, "shapes", Path(tmp), precompile=precompile,
                               extra=("--max-wait", "2"))  # the worker's default
        try:
            worker.wait_ready(farm_app(server.url), timeout=600)
            specs = [JobSpec(prompt=f"a lighthouse, variation {i}", model=str(model), seed=i, steps=args.steps,
                             width=SHAPES[i % 3][0], height=SHAPES[i % 3][1], campaign="shapes")
                     for i in range(args.jobs)]  # interleaved: shape 0, 1, 2, 0, 1, 2, ...
            submit_jobs(lambda: specs, Settings(broker_url=server.url))
            progress = Progress(server.client())
            wait_for(lambda: progress.status("shapes")["done"] >= args.jobs, 900, f"{args.jobs} jobs")
        finally:
            worker.stop()
            server.close()
        storage = open_storage(str(out))
        assert len(set(manifest_ids(storage, "shapes"))) == args.jobs
        batches: dict[int, dict] = {}
        for record in manifest_records(storage, "shapes"):
            batches[record["batch"]["seq"]] = {**record["batch"], "shape": (record["width"], record["height"])}
    report(batches)


def report(batches: dict[int, dict]) -> None:
    jobs = sum(b["jobs"] for b in batches.values())
    slots = sum(b["slots"] for b in batches.values())
    order = [batches[seq]["shape"] for seq in sorted(batches)]
    runs: dict[tuple[int, int], list[int]] = defaultdict(list)
    for position, shape in enumerate(order):
        runs[shape].append(position)
    print(f"{jobs} jobs of {len(runs)} shapes, interleaved on one queue, in {len(batches)} batches "
          f"of {slots // len(batches)} slots")
    print(f"fill: {jobs} jobs / {slots} slots = {jobs / slots:.3f} (target >= 0.9)")
    for shape, positions in sorted(runs.items()):
        gaps = [b - a - 1 for a, b in zip(positions, positions[1:])]
        print(f"  {shape[0]}x{shape[1]}: {len(positions)} batches, last at {positions[-1] + 1} of {len(order)}, "
              f"max other batches between two of its own: {max(gaps, default=0)}")
    print("batch order:", " ".join("ABC"[sorted(runs).index(s)] for s in order))


if __name__ == "__main__":
    main()
