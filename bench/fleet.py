"""The control plane at fleet size: one Redis, 16 workers with stand-in devices (bench/standin.py)
processes (each batch "renders" by sleeping: an accelerator that is never slow to answer),
10,000 jobs through `producer.submit`. Prints measured jobs/s against the ideal
(workers x batch size / batch time), the Redis commands the farm spends per job (INFO
commandstats before and after), `redis-benchmark` figures for those commands on this
machine, and from both how many workers one Redis can feed.

Usage: PYTHONPATH=. python bench/fleet.py [--workers 16] [--jobs 10000] [--batch-seconds 2.0]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

# 8 virtual devices per worker: batch 8, as on a TPU host of 8 chips.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import redis  # noqa: E402

from harness.farm import WorkerProcess, farm_app  # noqa: E402
from harness.redis_server import RedisServer  # noqa: E402
from producer import submit  # noqa: E402
from renderfarm.progress import key  # noqa: E402

SHM = Path("/dev/shm") if Path("/dev/shm").is_dir() else None  # the control plane, not this disk
DEVICES = 8
TARGET = 0.9
CAMPAIGN = "fleet"
TICK = os.sysconf("SC_CLK_TCK")
# Per-worker job rates to size a Redis for (jobs/s of one 8-chip host, from bench/flops.py).
HOSTS = {"SD 1.5 25 steps, v5e-8 at 50% of peak": 18.8, "SD 1.5 25 steps, v6e-8 at 50%": 87.7,
         "SDXL 20 steps, v5e-8 at 50%": 2.81}
PAYLOAD = "x" * 1024  # about the size of a job message or a task event


def command_stats(client: redis.Redis) -> dict[str, int]:
    return {name.removeprefix("cmdstat_"): int(v["calls"])
            for name, v in client.info("commandstats").items()}


def redis_cpu(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def proc_cpu(pid: int) -> float:
    """CPU seconds (user + system) of a live process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0) > 0}


def submit_jobs(n: int, model: str, broker: str) -> None:
    submit([f"a lighthouse on a cliff at dusk, variation {i}" for i in range(n)], model=model,
           campaign=CAMPAIGN, seed=0, broker=broker, progress=False)


def producer_commands(n: int, model: str) -> tuple[dict[str, int], float]:
    """What submitting n jobs costs Redis alone (a fresh server, no workers)."""
    server = RedisServer(appendonly=False)
    try:
        client = server.client()
        before, cpu = command_stats(client), redis_cpu(client)
        submit_jobs(n, model, server.url)
        return delta(command_stats(client), before), redis_cpu(client) - cpu
    finally:
        server.close()


def run_fleet(model: Path, tmp: Path, workers: int, n: int, seconds: float) -> dict[str, object]:
    server = RedisServer(appendonly=False)
    out = Path(tempfile.mkdtemp(prefix="rf-fleet-out-", dir=SHM))
    procs: list[WorkerProcess] = []
    try:
        started = time.perf_counter()
        procs = [WorkerProcess(model, str(out), server.url, f"fleet-{i}-{os.getpid()}", tmp,
                               precompile="64x64@25", entry=("-m", "bench.standin", str(seconds)))
                 for i in range(workers)]
        app = farm_app(server.url)
        for proc in procs:
            proc.wait_ready(app, timeout=600)
        startup = time.perf_counter() - started
        client = server.client()
        time.sleep(3)  # let every worker settle into its idle BRPOP loop
        done_key, polls = key(CAMPAIGN, "done"), 0
        stats0, rcpu0 = command_stats(client), redis_cpu(client)
        wcpu0 = sum(proc_cpu(p.proc.pid) for p in procs)
        t_submit = time.perf_counter()
        submit_jobs(n, str(model), server.url)
        submitted = time.perf_counter() - t_submit
        first = None
        while True:
            done, now = client.scard(done_key), time.perf_counter()
            polls += 1
            if first is None and done:
                first = (now, done)
            if done >= n:
                break
            if now - t_submit > 30 * n / (workers * DEVICES / seconds) + 120:
                raise RuntimeError(f"only {done} of {n} jobs done")
            time.sleep(0.05)
        wcpu = sum(proc_cpu(p.proc.pid) for p in procs) - wcpu0
        stats, rcpu = delta(command_stats(client), stats0), redis_cpu(client) - rcpu0
        stats["scard"] = stats.get("scard", 0) - polls  # this script's own polling
        stats.pop("info", None)
        rss = max(int(re.search(r"VmHWM:\s+(\d+)", Path(f"/proc/{p.proc.pid}/status").read_text())[1])
                  for p in procs) / 1024
        assert first is not None
        return {"startup": startup, "submit": submitted, "first": first, "last": now, "t_submit": t_submit,
                "stats": stats, "redis_cpu": rcpu, "worker_cpu": wcpu, "rss": rss,
                "stored": sum(1 for _ in out.rglob("*.png"))}
    finally:
        for proc in procs:
            proc.proc.terminate()
        for proc in procs:
            proc.stop()
        server.close()
        shutil.rmtree(out, ignore_errors=True)


def redis_benchmark(requests: int = 100_000) -> dict[tuple[str, int], float]:
    """ops/s of the farm's kinds of command on a fresh redis-server, 50 clients, without
    and with pipelining (16 per round trip)."""
    server = RedisServer(appendonly=False)
    commands = {
        "lpush": ["LPUSH", "bq", PAYLOAD], "brpop": ["BRPOP", "bq", "1"],
        "sadd": ["SADD", "s", "__rand_int__"], "srem": ["SREM", "s", "__rand_int__"],
        "hincrby": ["HINCRBY", "h", "__rand_int__", "1"], "hset": ["HSET", "hh", "__rand_int__", "1"],
        "zadd": ["ZADD", "z", "__rand_int__", "__rand_int__"], "zrem": ["ZREM", "z", "__rand_int__"],
        "publish": ["PUBLISH", "ch", PAYLOAD], "exists": ["EXISTS", "k__rand_int__"],
    }
    rates: dict[tuple[str, int], float] = {}
    try:
        for pipeline in (1, 16):
            for name, argv in commands.items():  # LPUSH first fills the list BRPOP empties
                text = subprocess.run(
                    ["redis-benchmark", "-p", str(server.port), "-n", str(requests), "-r", "100000",
                     "-P", str(pipeline), "-q", *argv], capture_output=True, text=True, check=True).stdout
                rates[(name, pipeline)] = float(re.findall(r"([\d.]+) requests per second", text)[-1])
    finally:
        server.close()
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--batch-seconds", type=float, default=2.0,
                        help="stand-in time per batch of 8 (default 2.0: SDXL on a v5e-8 host, see docs/ceiling.md)")
    parser.add_argument("--skip-benchmark", action="store_true")
    args = parser.parse_args()
    workers, n, seconds = args.workers, args.jobs, args.batch_seconds
    with tempfile.TemporaryDirectory(prefix="rf-fleet-") as tmp:
        from diffusion.tiny import build_tiny_model  # only to build the folder the workers load

        model = build_tiny_model(Path(tmp) / "tiny-sd")
        produced, produced_cpu = producer_commands(n, str(model))
        r = run_fleet(model, Path(tmp), workers, n, seconds)
    ideal = workers * DEVICES / seconds
    (t_first, c_first), t_last = r["first"], r["last"]  # type: ignore[misc]
    rate = (n - c_first) / (t_last - t_first)
    overall = n / (t_last - r["t_submit"])  # type: ignore[operator]
    span = t_last - r["t_submit"]  # type: ignore[operator]
    print(f"fleet: {workers} workers x batch {DEVICES} (stand-in {seconds:g} s per batch), one Redis, "
          f"{n} jobs; workers ready after {r['startup']:.0f} s; submit took {r['submit']:.1f} s; "
          f"{r['stored']} PNGs stored")
    print(f"  measured {rate:.1f} jobs/s from the first stored job to the last ({c_first} done at the first, "
          f"{t_last - t_first:.1f} s); ideal {workers} x {DEVICES} / {seconds:g} = {ideal:.1f} jobs/s")
    print(f"  measured/ideal = {rate / ideal:.3f} (target >= {TARGET}); from the start of submit: "
          f"{overall:.1f} jobs/s = {overall / ideal:.3f} of ideal")
    print(f"  CPU during the run ({span:.0f} s, {os.cpu_count()} cores): workers {r['worker_cpu']:.0f} s "
          f"({r['worker_cpu'] / span:.2f} cores, {1e3 * r['worker_cpu'] / n:.1f} ms per job), Redis "  # type: ignore[operator]
          f"{r['redis_cpu']:.1f} s ({r['redis_cpu'] / span:.2f} cores); peak RSS of one worker {r['rss']:.0f} MiB")  # type: ignore[operator]
    stats: dict[str, int] = r["stats"]  # type: ignore[assignment]
    farm = {k: v - produced.get(k, 0) for k, v in stats.items() if v - produced.get(k, 0) > 0}
    total = sum(farm.values())
    print(f"\nRedis commands per job (INFO commandstats after - before, less the producer's "
          f"{sum(produced.values()) / n:.2f}/job measured on its own server and this script's polls):")
    print("  " + ", ".join(f"{k} {v / n:.2f}" for k, v in sorted(farm.items(), key=lambda kv: -kv[1])))
    print(f"  total {total / n:.2f} commands per job; Redis CPU {1e6 * (r['redis_cpu'] - produced_cpu) / n:.0f} us "  # type: ignore[operator]
          f"per job for the farm (+{1e6 * produced_cpu / n:.0f} us for submitting it)")
    if args.skip_benchmark:
        return
    bench = redis_benchmark()
    print("\nredis-benchmark on this machine (50 clients, 100000 requests, 1 KiB payloads for LPUSH/PUBLISH), ops/s:")
    names = sorted({name for name, _ in bench})
    print("  " + "  ".join(f"{name} {bench[(name, 1)]:,.0f} / P16 {bench[(name, 16)]:,.0f}" for name in names))
    # A command without its own figure costs what the benchmarked ones cost on average.
    print("\nOne Redis core's capacity for the farm:")
    per_job_cpu = (r["redis_cpu"] - produced_cpu) / n  # type: ignore[operator]
    capacities = {"Redis CPU per job (measured in the run)": 1 / per_job_cpu}
    for p in (1, 16):
        mean = sum(bench[(k, p)] for k in names) / len(names)
        cost = sum(v / n / bench.get((k, p), mean) for k, v in farm.items())
        capacities[f"commands/job x redis-benchmark cost, P{p}"] = 1 / cost
        print(f"  P{p}: {' + '.join(f'{v / n:.2f}/{bench.get((k, p), mean):,.0f}' for k, v in farm.items())} "
              f"= {1e6 * cost:.0f} us per job -> {1 / cost:,.0f} jobs/s")
    print(f"  Redis CPU: {1e6 * per_job_cpu:.0f} us per job -> {1 / per_job_cpu:,.0f} jobs/s")
    per_worker = DEVICES / seconds
    for label, jobs_per_s in capacities.items():
        hosts = ", ".join(f"{jobs_per_s / rate_:,.0f} hosts of {name} ({rate_:g} jobs/s)"
                          for name, rate_ in HOSTS.items())
        print(f"  {label}: {jobs_per_s:,.0f} jobs/s = {jobs_per_s / per_worker:,.0f} workers like these "
              f"({per_worker:g} jobs/s each), or {hosts}")


if __name__ == "__main__":
    main()
