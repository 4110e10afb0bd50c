"""Warm start: seconds from `renderfarm worker` starting to its first stored image, with an
empty compilation cache and then a warm one, for one model and two precompiled shapes
(issue 5, item 2). Not a test. Target: warm <= 0.3 x cold.

Each start is a new process (imports, model load, the two shapes, Celery, the first job of
the first shape already waiting on the queue); the warm one finds JAX's persistent cache
and the saved executables (worker.executables) from the cold one.

Usage: PYTHONPATH=. python bench/warmstart.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from harness.farm import WorkerProcess, enqueue, farm_app, wait_for  # noqa: E402
from harness.redis_server import RedisServer  # noqa: E402
from renderfarm.jobs import JobSpec  # noqa: E402
from renderfarm.layout import sidecar_name  # noqa: E402
from renderfarm.progress import Progress  # noqa: E402
from renderfarm.storage import open_storage  # noqa: E402

SHAPES = "64x64@25,128x128@25"


# The worker's log lines that end a phase of its start, and what the phase is called.
PHASES = {"loaded in": "imports and model", "ready in": "shapes", "ready.": "Celery"}
LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO \S+: (.*)$")


def phases(log: Path, started: float, stored: float) -> str:
    """Seconds each phase of the start took, from the worker's log timestamps (wall clock,
    millisecond grain): imports and model load, the precompiled shapes, Celery, and from
    consuming to the first stored image (the job's batch, its first run, storing)."""
    ends = {"first image": stored}
    for line in log.read_text().splitlines():
        match = LOG_LINE.match(line)
        for marker, phase in PHASES.items() if match else ():
            if marker in match[2]:  # type: ignore[index]
                # a phase ends at its last such line
                ends[phase] = datetime.datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()  # type: ignore[index]
    previous, parts = started, []
    for phase in [*PHASES.values(), "first image"]:
        end = ends.get(phase, previous)
        parts.append(f"{phase} {end - previous:.1f}")
        previous = end
    return ", ".join(parts)


def first_image_seconds(model: Path, tmp: Path, cache: Path, run: str) -> tuple[float, str]:
    """A fresh worker against a queue that already holds one job; seconds until it is
    stored, and how they were spent."""
    server = RedisServer(appendonly=False)
    out = tmp / f"out-{run}"
    spec = JobSpec(prompt=f"a lighthouse at dusk ({run})", model=str(model), seed=1, campaign="warm")
    enqueue(farm_app(server.url), Progress(server.client()), [spec])
    started, wall = time.perf_counter(), time.time()
    worker = WorkerProcess(model, str(out), server.url, f"warm-{run}", tmp, precompile=SHAPES,
                           env={"RENDERFARM_COMPILE_CACHE": str(cache)})
    try:
        storage = open_storage(str(out))
        # every 10 ms: the figure's grain
        wait_for(lambda: storage.exists(sidecar_name("warm", spec.job_id)), 600, "the first image", interval=0.01)
        seconds = time.perf_counter() - started
        return seconds, phases(worker.log, wall, wall + seconds)
    finally:
        worker.stop()
        server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    from diffusion.tiny import build_tiny_model

    colds, warms = [], []
    with tempfile.TemporaryDirectory(prefix="rf-bench-") as tmp:
        model = build_tiny_model(Path(tmp) / "tiny-sd")
        for r in range(args.rounds):
            cache = Path(tmp) / f"cache-{r}"
            for name, runs in (("cold", colds), ("warm", warms)):
                seconds, spent = first_image_seconds(model, Path(tmp), cache, f"{name}{r}")
                runs.append(seconds)
                print(f"round {r + 1}: {name} {seconds:.1f} s ({spent})")
    cold, warm = statistics.median(colds), statistics.median(warms)
    print(f"start to first stored image, tiny SD, shapes {SHAPES}: cold {cold:.1f} s, warm {warm:.1f} s, "
          f"warm/cold {warm / cold:.2f} (target <= 0.3)")


if __name__ == "__main__":
    main()
