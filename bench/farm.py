"""Farm benchmarks: each part prints its figures (they are not tests).

(a) submit: the real producer path (`producer.submit`: a validating pass over the file, then
    chunked, pipelined enqueue of real Celery messages) of an N-line prompt file into a fresh
    redis-server; jobs/s and the process's peak RSS (flat in the file's size).

(b) control plane: one `renderfarm worker` whose renderer is a stand-in that answers at
    once (`python -m bench.standin 0 worker ...`): jobs/s through broker, batching, events, results and storage.
(c) end to end: one worker with the tiny model against `renderfarm render` of the same jobs
    (default job parameters, both after compile); farm images/s divided by local images/s.

Usage: PYTHONPATH=. python bench/farm.py [--parts abc]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import redis  # noqa: E402

from harness.farm import WorkerProcess, farm_app, wait_for  # noqa: E402
from harness.redis_server import RedisServer  # noqa: E402
from producer import submit  # noqa: E402
from renderfarm.progress import key  # noqa: E402

SUBMIT_TARGET = 2000  # jobs/s
# (b) measures the control plane, not this machine's disk: where there is a RAM-backed
# folder its output goes there (a worker's fsyncs cost about 1 ms each on this disk).
SHM = Path("/dev/shm") if Path("/dev/shm").is_dir() else None


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def bench_submit(n: int = 100_000) -> float:
    """Jobs/s of `producer.submit` for an n-line .txt file, checked against the queue length."""
    server = RedisServer(appendonly=False)
    try:
        with tempfile.TemporaryDirectory(prefix="rf-bench-") as tmp:
            path = Path(tmp, "prompts.txt")
            with path.open("w") as f:
                for i in range(n):
                    f.write(f"a lighthouse on a cliff at dusk, oil painting, variation {i}\n")
            started = time.perf_counter()
            submission = submit(prompts_file=path, model="bench/model", campaign="bench", seed=0,
                                broker=server.url)
            seconds = time.perf_counter() - started
        (queue,) = submission.queues
        queued = sum(server.client().llen(name) for name in server.client().scan_iter(f"{queue}*"))
        if submission.enqueued != n or queued != n:
            raise RuntimeError(f"enqueued {submission.enqueued}, queued {queued}, expected {n}")
        return n / seconds
    finally:
        server.close()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def done_at_least(client: redis.Redis, campaign: str, n: int, timeout: float) -> tuple[float, int]:
    """When the campaign first had n jobs done, and how many: polled every 10 ms (one
    SCARD: cheap beside the worker), so the figures' grain is small beside a run."""
    done_key = key(campaign, "done")
    wait_for(lambda: client.scard(done_key) >= n, timeout, f"{n} jobs", interval=0.01)
    return time.perf_counter(), client.scard(done_key)


@contextlib.contextmanager
def farm_worker(model: Path, tmp: Path, steps: int, stand_in: float | None, out: Path | None = None,
                size: int = 64) -> Iterator[tuple[RedisServer, WorkerProcess]]:
    """A redis-server and one ready `renderfarm worker` with the shape precompiled."""
    server = RedisServer(appendonly=False)
    entry = ("-m", "renderfarm_cli") if stand_in is None else ("-m", "bench.standin", str(stand_in))
    run = time.monotonic_ns()
    worker = WorkerProcess(model, str((out or tmp) / f"farm-out-{run}"), server.url, f"bench-{run}", tmp,
                           precompile=f"{size}x{size}@{steps}", entry=entry)
    try:
        worker.wait_ready(farm_app(server.url), timeout=600)
        yield server, worker
    finally:
        worker.stop()
        server.close()


def measure_farm(server: RedisServer, model: Path, campaign: str, n: int, steps: int, size: int = 64,
                 seed: int = 0, measure: Callable[[], Any] = lambda: None) -> tuple[float, int, Any, Any]:
    """Submit n jobs (seeds from `seed`) to the ready worker; its jobs/s from the first of
    them stored to the last (compile excluded), how many jobs that span holds, and
    `measure()` at both its ends. The campaign may hold jobs done before."""
    client = server.client()
    before_run = client.scard(key(campaign, "done"))
    submit([f"a lighthouse, variation {i}" for i in range(n)], model=str(model), campaign=campaign,
           seed=seed, steps=steps, width=size, height=size, broker=server.url, progress=False)
    start, first = done_at_least(client, campaign, before_run + 1, 300)
    before = measure()
    end, _ = done_at_least(client, campaign, before_run + n, 600)
    jobs = before_run + n - first
    return jobs / (end - start), jobs, before, measure()


def farm_rate(model: Path, tmp: Path, n: int, steps: int, stand_in: float | None,
              out: Path | None = None, size: int = 64) -> tuple[float, float]:
    """Jobs/s of one new worker, and its CPU milliseconds per job over the same span: on a
    shared machine the rate drifts with the neighbours, the CPU per job much less."""
    with farm_worker(model, tmp, steps, stand_in, out, size) as (server, worker):
        rate, jobs, cpu, cpu_end = measure_farm(server, model, "bench", n, steps, size,
                                                measure=lambda: cpu_seconds(worker.proc.pid))
    return rate, 1000 * (cpu_end - cpu) / jobs


def local_rate(model: Path, tmp: Path, n: int, steps: int) -> float:
    from diffusion.models import load_model
    from renderfarm.jobs import JobSpec
    from renderfarm.storage import open_storage
    from worker.engine import Engine
    from worker.local import render_to_storage

    loaded = load_model(str(model))
    specs = [JobSpec(prompt=f"a lighthouse, variation {i}", model=str(model), seed=i, steps=steps, campaign="bench")
             for i in range(n)]
    engine = Engine(loaded)
    render_to_storage(specs[:engine.batch_size], engine, open_storage(str(tmp / "warm"), durable=False),
                      progress=False)
    out = open_storage(str(tmp / f"local-out-{time.monotonic_ns()}"), durable=False)
    return render_to_storage(specs, engine, out, progress=False).images_per_second


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="abc")
    args = parser.parse_args()
    if "a" in args.parts:
        n = 100_000
        rate = bench_submit(n)
        print(f"(a) submit: {n} jobs in {n / rate:.1f} s = {rate:,.0f} jobs/s (target >= {SUBMIT_TARGET})")
        print(f"    peak RSS of this process: {peak_rss_mib():.0f} MiB")
    with tempfile.TemporaryDirectory(prefix="rf-bench-") as tmp:
        from diffusion.tiny import build_tiny_model

        model = build_tiny_model(Path(tmp) / "tiny-sd")
        if "b" in args.parts:
            n = 4000
            (Path(tmp) / "b").mkdir()
            rate, cpu_ms = farm_rate(model, Path(tmp) / "b", n, steps=1, stand_in=0.0, out=SHM)
            print(f"(b) control plane, 1 worker, stand-in renderer, batch 8: {rate:,.0f} jobs/s (target >= 500); "
                  f"worker CPU {cpu_ms:.2f} ms per job")
        if "c" in args.parts:
            # The default job (25 steps) at the tiny model's native 64x64: per image a small
            # fraction of a real model's compute, so the farm's per-job cost shows plainly.
            n, steps = 256, 25
            (Path(tmp) / "c").mkdir()
            # Local before and after the farm, so a drift of the machine shows and averages out.
            before = local_rate(model, Path(tmp) / "c", n, steps)
            farm, _ = farm_rate(model, Path(tmp) / "c", n, steps, stand_in=None)
            after = local_rate(model, Path(tmp) / "c", n, steps)
            local = (before + after) / 2
            print(f"(c) tiny SD 64x64 {steps} steps, {n} images: farm {farm:.1f} images/s, local render "
                  f"{local:.1f} images/s ({before:.1f} before, {after:.1f} after), ratio {farm / local:.2f} "
                  f"(target >= 0.9)")


if __name__ == "__main__":
    main()
