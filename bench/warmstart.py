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
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from renderfarm.jobs import JobSpec  # noqa: E402
from renderfarm.progress import Progress  # noqa: E402
from renderfarm.storage import open_storage, sidecar_name  # noqa: E402
from tests.farm import WorkerProcess, enqueue, farm_app, wait_for  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

SHAPES = "64x64@25,128x128@25"


def first_image_seconds(model: Path, tmp: Path, cache: Path, run: str) -> float:
    """A fresh worker against a queue that already holds one job; seconds until it is stored."""
    server = RedisServer(appendonly=False)
    out = tmp / f"out-{run}"
    spec = JobSpec(prompt=f"a lighthouse at dusk ({run})", model=str(model), seed=1, campaign="warm")
    enqueue(farm_app(server.url), Progress(server.client()), [spec])
    started = time.perf_counter()
    worker = WorkerProcess(model, str(out), server.url, f"warm-{run}", tmp, precompile=SHAPES,
                           env={"RENDERFARM_COMPILE_CACHE": str(cache)})
    try:
        storage = open_storage(str(out))
        wait_for(lambda: storage.exists(sidecar_name("warm", spec.job_id)), 600, "the first image")
        return time.perf_counter() - started
    finally:
        worker.stop()
        server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    from worker.tiny import build_tiny_model

    colds, warms = [], []
    with tempfile.TemporaryDirectory(prefix="rf-bench-") as tmp:
        model = build_tiny_model(Path(tmp) / "tiny-sd")
        for r in range(args.rounds):
            cache = Path(tmp) / f"cache-{r}"
            colds.append(first_image_seconds(model, Path(tmp), cache, f"cold{r}"))
            warms.append(first_image_seconds(model, Path(tmp), cache, f"warm{r}"))
            print(f"round {r + 1}: cold {colds[-1]:.1f} s, warm {warms[-1]:.1f} s")
    cold, warm = statistics.median(colds), statistics.median(warms)
    print(f"start to first stored image, tiny SD, shapes {SHAPES}: cold {cold:.1f} s, warm {warm:.1f} s, "
          f"warm/cold {warm / cold:.2f} (target <= 0.3)")


if __name__ == "__main__":
    main()
