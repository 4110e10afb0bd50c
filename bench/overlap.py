"""Host work never stalls the devices (issue 5, item 1): one farm worker on the tiny model at
256x256 with 8 devices, against the same compiled function called back to back on inputs
already on the devices, with no host work at all. Not a test. Target: ratio >= 0.95.

The farm's figure includes everything a worker does per batch: Celery delivery, validation,
tokenizing, PNG encoding, thumbnails, storing, manifest lines, acks and events; the
engine overlaps them with the next batch on the devices.

Usage: PYTHONPATH=. python bench/overlap.py [--jobs 128] [--steps 4]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

from bench.farm import farm_rate  # noqa: E402
from renderfarm.jobs import JobSpec  # noqa: E402

SIZE = 256


def bare_rate(model: Path, n: int, steps: int) -> tuple[float, float]:
    """Images/s of the compiled function alone (same inputs, dispatched back to back), and
    the CPU milliseconds per image it takes (XLA's threads: on a CPU, the devices)."""
    from worker.engine import Engine
    from worker.models import load_model

    engine = Engine(load_model(str(model)))
    specs = [JobSpec(prompt=f"a lighthouse, variation {i}", model=str(model), seed=i, steps=steps,
                     width=SIZE, height=SIZE) for i in range(engine.batch_size)]
    key = engine.check(specs[0])
    program = engine.compiled(key)
    _, state = engine._scheduler(key.scheduler)  # noqa: SLF001 - the bare call, on purpose
    inputs, _ = engine._inputs(specs)  # noqa: SLF001
    program(engine._params, state, inputs).block_until_ready()  # noqa: SLF001 - warm
    batches = n // engine.batch_size
    start, cpu = time.perf_counter(), time.process_time()
    out = [program(engine._params, state, inputs) for _ in range(batches)]  # noqa: SLF001
    jax.block_until_ready(out)
    images = batches * engine.batch_size
    return images / (time.perf_counter() - start), 1000 * (time.process_time() - cpu) / images


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=128)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    from worker.tiny import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="rf-bench-") as tmp:
        model = build_tiny_model(Path(tmp) / "tiny-sd")
        # The bare rate before and after the farm, so a drift of the machine shows and averages out.
        before, cpu_before = bare_rate(model, args.jobs, args.steps)
        farm, cpu_ms = farm_rate(model, Path(tmp), args.jobs, args.steps, stand_in=None, size=SIZE)
        after, cpu_after = bare_rate(model, args.jobs, args.steps)
    bare, bare_cpu = (before + after) / 2, (cpu_before + cpu_after) / 2
    print(f"tiny SD {SIZE}x{SIZE} {args.steps} steps, {args.jobs} images, 8 devices: farm {farm:.2f} images/s, "
          f"compiled function back to back {bare:.2f} images/s ({before:.2f} before, {after:.2f} after), "
          f"ratio {farm / bare:.3f} (target >= 0.95)")
    print(f"  CPU per image: farm worker {cpu_ms:.1f} ms, compiled function alone {bare_cpu:.1f} ms: host work "
          f"{cpu_ms - bare_cpu:.1f} ms per image, on the cores the CPU devices compute on")


if __name__ == "__main__":
    main()
