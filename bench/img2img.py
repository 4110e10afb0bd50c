"""What one image-to-image program for every strength costs, against a program per strength.

The start step is an input (diffusion/generate.py), so a batch runs from its earliest start:
its steps are those of its strongest job. A batch of one strength runs exactly its own steps;
a mixed batch runs the weaker jobs' extra steps masked. On the tiny SD 1.x oracle checkpoint
(64x64, one job a device, 8 CPU devices) this times, after compiling once:

- text to image at STEPS steps, the reference for a full schedule;
- image batches of one strength (1.0, 0.8, 0.3): what a program per strength would run;
- a batch of half 0.3 and half 0.8 jobs: what the shared program runs for them.

    PYTHONPATH=. python bench/img2img.py [--steps 20] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

from diffusion.models import load_model  # noqa: E402
from renderfarm.jobs import JobSpec  # noqa: E402
from worker.engine import Engine  # noqa: E402

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"  # the oracle's tiny checkpoints and images
ORACLE = DATA / "oracle"


def seconds(engine: Engine, specs: list[JobSpec], repeats: int) -> float:
    """Median seconds of one batch of `specs` (compiled first, outside the timing)."""
    key = engine.check(specs[0])
    engine.compiled(key)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        jax.block_until_ready(engine.dispatch(key, specs)[0])
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    model = load_model(str(ORACLE / "sd1" / "model"))
    engine = Engine(model)
    n = engine.batch_size

    def jobs(strengths: list[float | None]) -> list[JobSpec]:
        return [JobSpec(prompt=f"a harbour {i}", model=model.ref, seed=i, steps=args.steps, scheduler="euler",
                        width=64, height=64, strength=s,
                        init_image=None if s is None else str(DATA / "img2img" / "init.png"))
                for i, s in enumerate(strengths)]

    text = seconds(engine, jobs([None] * n), args.repeats)
    print(f"text to image, {args.steps} steps: {text * 1e3:.0f} ms a batch of {n}")
    for label, strengths in (("1.0", [1.0] * n), ("0.8", [0.8] * n), ("0.3", [0.3] * n),
                             ("0.3 and 0.8 mixed", [0.3, 0.8] * (n // 2))):
        t = seconds(engine, jobs(strengths), args.repeats)
        print(f"image to image, strength {label}: {t * 1e3:.0f} ms a batch ({t / text:.2f} of text to image)")
    print(f"programs compiled: {engine.compiles} (one text to image, one image to image)")


if __name__ == "__main__":
    main()
