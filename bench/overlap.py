"""Host work never stalls the devices (issue 5, item 1): one farm worker on the tiny model at
256x256 with 8 devices, against the same compiled function called back to back on inputs
already on the devices, with no host work at all. Not a test. Target: ratio >= 0.95.

The farm's figure includes everything a worker does per batch: Celery delivery, validation,
tokenizing, PNG encoding, thumbnails, storing, manifest lines, acks and events; the
engine overlaps them with the next batch on the devices.

One worker serves every round, all of one campaign (a campaign's first stored batch also
builds its gallery, once: a one-off that a warm-up batch takes out of the rounds, as a real
campaign of thousands of images spreads it thin). Each round measures the bare function (in
this process, while the worker idles) and then the farm, so both see the same machine, and
the figure is the median of the rounds' ratios. On a CPU the devices are the host's own
cores, so the benchmark also prints where the worker's CPU went: XLA's threads (the
devices) and the Python threads (the host work that competes with them).

Usage: PYTHONPATH=. python bench/overlap.py [--jobs 128] [--steps 4] [--rounds 5]
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

from bench.farm import farm_worker, measure_farm  # noqa: E402
from renderfarm.jobs import JobSpec  # noqa: E402

SIZE = 256
XLA_THREADS = "tf_XLAEigen"  # the name XLA:CPU gives the threads that run the devices' work


def thread_cpu(pid: int) -> collections.Counter[str]:
    """CPU seconds so far of a process's threads, by kind: XLA's device threads, or the
    host's (Python's threads, Celery's, the store threads)."""
    seconds: collections.Counter[str] = collections.Counter()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:  # the thread ended
            continue
        name, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat.rsplit(")", 1)[1].split()
        kind = "devices" if name.startswith(XLA_THREADS) else "host"
        seconds[kind] += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return seconds


class Bare:
    """The worker's compiled function for the benchmark's shape, in this process."""

    def __init__(self, model: Path, steps: int) -> None:
        from diffusion.models import load_model
        from worker.engine import Engine

        engine = Engine(load_model(str(model)))
        specs = [JobSpec(prompt=f"a lighthouse, variation {i}", model=str(model), seed=i, steps=steps,
                         width=SIZE, height=SIZE) for i in range(engine.batch_size)]
        key = engine.check(specs[0])
        self.program, self.batch_size = engine.compiled(key), engine.batch_size
        inputs, _ = engine._inputs(key, specs)  # noqa: SLF001 - the bare call, on purpose
        self.args = (engine._params, inputs)  # noqa: SLF001
        jax.block_until_ready(self.program(*self.args))  # warm

    def rate(self, n: int) -> tuple[float, collections.Counter[str]]:
        """Images/s called back to back, and this process's CPU seconds per image by kind."""
        batches = n // self.batch_size
        start, cpu = time.perf_counter(), thread_cpu(os.getpid())
        jax.block_until_ready([self.program(*self.args) for _ in range(batches)])
        seconds, images = time.perf_counter() - start, batches * self.batch_size
        return images / seconds, per_image(thread_cpu(os.getpid()) - cpu, images)


def per_image(cpu: collections.Counter[str], images: int) -> collections.Counter[str]:
    return collections.Counter({kind: seconds / images for kind, seconds in cpu.items()})


def ms(cpu: collections.Counter[str]) -> str:
    return f"devices {1000 * cpu['devices']:.1f}, host {1000 * cpu['host']:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=128)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    from diffusion.tiny import build_tiny_model

    ratios = []
    with tempfile.TemporaryDirectory(prefix="rf-bench-") as tmp:
        model = build_tiny_model(Path(tmp) / "tiny-sd")
        bare = Bare(model, args.steps)
        with farm_worker(model, Path(tmp), args.steps, stand_in=None, size=SIZE) as (server, worker):
            measure_farm(server, model, "overlap", bare.batch_size, args.steps, SIZE, seed=0)  # warm-up
            for r in range(1, args.rounds + 1):
                bare_rate, bare_cpu = bare.rate(args.jobs)
                farm, jobs, cpu, cpu_end = measure_farm(server, model, "overlap", args.jobs, args.steps, SIZE,
                                                        seed=r * args.jobs,
                                                        measure=lambda: thread_cpu(worker.proc.pid))
                ratios.append(farm / bare_rate)
                print(f"round {r}: farm {farm:.2f} images/s, compiled function back to back {bare_rate:.2f} "
                      f"images/s, ratio {farm / bare_rate:.3f}; CPU ms per image: farm worker "
                      f"{ms(per_image(cpu_end - cpu, jobs))}; compiled function alone {ms(bare_cpu)}")
    print(f"tiny SD {SIZE}x{SIZE} {args.steps} steps, {args.jobs} images per round, 8 devices: farm / compiled "
          f"function back to back, median of {args.rounds} rounds: {statistics.median(ratios):.3f} "
          f"(target >= 0.95)")


if __name__ == "__main__":
    main()
