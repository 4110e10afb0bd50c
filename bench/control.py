"""How many jobs per second the control plane moves: submitting, ingesting a campaign, one
worker's per-job path, and a fleet of workers on one Redis. Not a test.

Parts (`PYTHONPATH=. python bench/control.py [PART ...] [flags]`; no part runs `submit worker`):

- submit: `producer.submit` of an N-line prompt file (a validating pass, then chunked,
  pipelined enqueue of Celery messages) into a fresh redis-server: jobs/s and peak RSS.
- ingest: the same through `producer.campaigns.run_campaign` (validation, a listing of what
  storage holds, the enqueue): jobs/s, CPU per job, RSS over the run, Redis memory per job.
- worker: one `renderfarm worker` whose devices answer at once (bench/standin.py): jobs/s
  through broker, batching, events, storage and acks, and the worker's CPU per job.
- fleet: many stand-in workers (each batch takes `--batch-seconds`) on one Redis: jobs/s
  against the ideal, Redis commands and CPU per job, `redis-benchmark` on the farm's commands,
  and from them how many workers one Redis feeds.

Every part starts its own redis-server; the workers are real `renderfarm worker` processes with
the stand-in engine (`python -m bench.standin SECONDS worker ...`), loading the tiny SD model.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import resource
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# 8 virtual devices per worker: batch 8, as on a TPU host of 8 chips.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import redis  # noqa: E402

from harness.farm import WorkerProcess, farm_app, wait_for  # noqa: E402
from harness.redis_server import RedisServer  # noqa: E402
from producer import submit  # noqa: E402
from renderfarm.progress import key  # noqa: E402

DEVICES = 8
# The control plane, not this machine's disk: where there is a RAM-backed folder, the stand-in
# workers store there (a worker's fsyncs cost about 1 ms each on this disk).
SHM = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
# Per-host job rates to size a Redis for (jobs/s of one 8-chip host at 50% of peak: bench/cost.py).
HOSTS = {"SD 1.5 25 steps, v5e-8 at 50% of peak": 18.8, "SD 1.5 25 steps, v6e-8 at 50%": 87.7,
         "SDXL 20 steps, v5e-8 at 50%": 2.81}
PAYLOAD = "x" * 1024  # about the size of a job message or a task event
PROMPT = "a lighthouse on a cliff at dusk, oil painting, variation {}"


# -- shared -----------------------------------------------------------------------------------------


def prompts_file(folder: Path, lines: int) -> Path:
    """An N-line prompt file of distinct prompts."""
    path = folder / "prompts.txt"
    with path.open("w") as f:
        for i in range(lines):
            f.write(PROMPT.format(i) + "\n")
    return path


def queued(client: redis.Redis, queue: str) -> int:
    """Messages in a queue's priority lists."""
    return sum(client.llen(name) for name in client.scan_iter(f"{queue}*"))


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def stat_seconds(stat: str) -> float:
    """User + system CPU seconds in a /proc/PID/stat (or a thread's task/TID/stat) line."""
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc), or of this one."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    return stat_seconds(Path(f"/proc/{pid}/stat").read_text())


def tiny_model(folder: Path) -> Path:
    """The tiny SD folder the workers load (the stand-in renders nothing with it)."""
    from diffusion.tiny import build_tiny_model

    return build_tiny_model(folder / "tiny-sd")


def done_at_least(client: redis.Redis, campaign: str, n: int, timeout: float) -> tuple[float, int]:
    """When the campaign first had n jobs done, and how many: polled every 10 ms (one SCARD:
    cheap beside the worker), so the figures' grain is small beside a run."""
    done_key = key(campaign, "done")
    wait_for(lambda: client.scard(done_key) >= n, timeout, f"{n} jobs", interval=0.01)
    return time.perf_counter(), client.scard(done_key)


@contextlib.contextmanager
def farm_worker(model: Path, tmp: Path, steps: int, stand_in: float | None, out: Path | None = None,
                size: int = 64) -> Iterator[tuple[RedisServer, WorkerProcess]]:
    """A redis-server and one ready `renderfarm worker` with the shape precompiled; with
    `stand_in` seconds, its devices are bench/standin.py's."""
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
    """Submit n jobs (seeds from `seed`) to the ready worker; its jobs/s from the first of them
    stored to the last (compile excluded), how many jobs that span holds, and `measure()` at
    both its ends. The campaign may hold jobs done before."""
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


# -- submit, ingest ---------------------------------------------------------------------------------


def part_submit(args: argparse.Namespace) -> None:
    server = RedisServer(appendonly=False)
    try:
        with tempfile.TemporaryDirectory(prefix="rf-bench-") as tmp:
            path = prompts_file(Path(tmp), args.lines)
            started = time.perf_counter()
            submission = submit(prompts_file=path, model="bench/model", campaign="bench", seed=0, broker=server.url)
            seconds = time.perf_counter() - started
        (queue,) = submission.queues
        if submission.enqueued != args.lines or queued(server.client(), queue) != args.lines:
            raise RuntimeError(f"enqueued {submission.enqueued} of {args.lines}")
    finally:
        server.close()
    print(f"submit: {args.lines:,} jobs in {seconds:.1f} s = {args.lines / seconds:,.0f} jobs/s (target >= 2,000); "
          f"peak RSS of this process {peak_rss_mib():.0f} MiB")


class RssSampler(threading.Thread):
    """This process's RSS every `period` seconds: its peak and when it was reached."""

    def __init__(self, period: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.period, self.samples = period, []
        self.stop = threading.Event()

    @staticmethod
    def rss_mib() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() / 2**20

    def run(self) -> None:
        started = time.perf_counter()
        while not self.stop.wait(self.period):
            self.samples.append((time.perf_counter() - started, self.rss_mib()))


def part_ingest(args: argparse.Namespace) -> None:
    """An N-line .txt campaign through `run_campaign`; the RSS sampled every 50 ms, so a peak
    that is not flat shows as growth over the run."""
    from producer.campaigns import parse_spec, run_campaign
    from renderfarm.settings import Settings

    server = RedisServer(appendonly=False)
    try:
        with tempfile.TemporaryDirectory(prefix="rf-bench-ingest-") as tmp:
            spec = parse_spec({"name": "bench", "model": "bench/model", "output": str(Path(tmp, "out")),
                               "prompts": str(prompts_file(Path(tmp), args.lines)), "base_seed": 0, "steps": 25,
                               "width": 512, "height": 512})
            before = RssSampler.rss_mib()
            sampler = RssSampler()
            sampler.start()
            cpu_before = cpu_seconds()
            started = time.perf_counter()
            run = run_campaign(spec, settings=Settings(broker_url=server.url))
            seconds = time.perf_counter() - started
            cpu = cpu_seconds() - cpu_before
            sampler.stop.set()
            sampler.join()
        client = server.client()
        jobs = queued(client, "rf.float32.bench/model")
        if run.submitted != args.lines or jobs != args.lines:
            raise RuntimeError(f"submitted {run.submitted}, queued {jobs}, expected {args.lines}")
        quarter = [mb for t, mb in sampler.samples if t <= seconds / 4]
        print(f"ingest: {args.lines:,} lines validated and submitted in {seconds:.1f} s = "
              f"{args.lines / seconds:,.0f} jobs/s (target >= 5,000)")
        print(f"  this process used {cpu:.1f} s of CPU: {args.lines / cpu:,.0f} jobs per CPU-second")
        print(f"  peak RSS (getrusage): {peak_rss_mib():.0f} MiB (target < 300); sampled: {before:.0f} MiB before "
              f"the run, {max(quarter, default=before):.0f} MiB peak in its first quarter, "
              f"{max((mb for _, mb in sampler.samples), default=before):.0f} MiB peak overall")
        print(f"  redis memory for {jobs:,} queued jobs: {client.info('memory')['used_memory'] / 2**20:,.0f} MiB")
    finally:
        server.close()


# -- one worker, a fleet ------------------------------------------------------------------------------


def part_worker(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="rf-bench-") as tmp:
        rate, cpu_ms = farm_rate(tiny_model(Path(tmp)), Path(tmp), args.jobs, steps=1, stand_in=0.0, out=SHM)
    print(f"control plane, 1 worker, stand-in renderer, batch {DEVICES}: {rate:,.0f} jobs/s (target >= 500); "
          f"worker CPU {cpu_ms:.2f} ms per job")


def command_stats(client: redis.Redis) -> dict[str, int]:
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in client.info("commandstats").items()}


def redis_cpu(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0) > 0}


def submit_fleet_jobs(n: int, model: str, broker: str) -> None:
    submit([PROMPT.format(i) for i in range(n)], model=model, campaign="fleet", seed=0, broker=broker, progress=False)


def producer_commands(n: int, model: str) -> tuple[dict[str, int], float]:
    """What submitting n jobs costs Redis alone (a fresh server, no workers)."""
    server = RedisServer(appendonly=False)
    try:
        client = server.client()
        before, cpu = command_stats(client), redis_cpu(client)
        submit_fleet_jobs(n, model, server.url)
        return delta(command_stats(client), before), redis_cpu(client) - cpu
    finally:
        server.close()


def run_fleet(model: Path, tmp: Path, workers: int, n: int, seconds: float) -> dict[str, Any]:
    """Start the stand-in workers, submit n jobs, and poll the done set every 50 ms until all
    are stored; what Redis and the workers spent meanwhile."""
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
        time.sleep(3)  # let every worker settle into its idle loop
        done_key, polls = key("fleet", "done"), 0
        stats0, rcpu0 = command_stats(client), redis_cpu(client)
        wcpu0 = sum(cpu_seconds(p.proc.pid) for p in procs)
        t_submit = time.perf_counter()
        submit_fleet_jobs(n, str(model), server.url)
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
        wcpu = sum(cpu_seconds(p.proc.pid) for p in procs) - wcpu0
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
    """ops/s of the farm's kinds of command on a fresh redis-server, 50 clients, without and
    with pipelining (16 per round trip)."""
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


def part_fleet(args: argparse.Namespace) -> None:
    workers, n, seconds = args.workers, args.fleet_jobs, args.batch_seconds
    with tempfile.TemporaryDirectory(prefix="rf-fleet-") as tmp:
        model = tiny_model(Path(tmp))
        produced, produced_cpu = producer_commands(n, str(model))
        r = run_fleet(model, Path(tmp), workers, n, seconds)
    ideal = workers * DEVICES / seconds
    (t_first, c_first), t_last = r["first"], r["last"]
    rate = (n - c_first) / (t_last - t_first)
    span = t_last - r["t_submit"]
    print(f"fleet: {workers} workers x batch {DEVICES} (stand-in {seconds:g} s per batch), one Redis, {n} jobs; "
          f"workers ready after {r['startup']:.0f} s; submit took {r['submit']:.1f} s; {r['stored']} PNGs stored")
    print(f"  measured {rate:.1f} jobs/s from the first stored job to the last ({c_first} done at the first, "
          f"{t_last - t_first:.1f} s); ideal {workers} x {DEVICES} / {seconds:g} = {ideal:.1f} jobs/s")
    print(f"  measured/ideal = {rate / ideal:.3f} (target >= 0.9); from the start of submit: "
          f"{n / span:.1f} jobs/s = {n / span / ideal:.3f} of ideal")
    print(f"  CPU during the run ({span:.0f} s, {os.cpu_count()} cores): workers {r['worker_cpu']:.0f} s "
          f"({r['worker_cpu'] / span:.2f} cores, {1e3 * r['worker_cpu'] / n:.1f} ms per job), Redis "
          f"{r['redis_cpu']:.1f} s ({r['redis_cpu'] / span:.2f} cores); peak RSS of one worker {r['rss']:.0f} MiB")
    farm = {k: v - produced.get(k, 0) for k, v in r["stats"].items() if v - produced.get(k, 0) > 0}
    per_job_cpu = (r["redis_cpu"] - produced_cpu) / n
    print(f"\nRedis commands per job (INFO commandstats after - before, less the producer's "
          f"{sum(produced.values()) / n:.2f}/job measured on its own server and this script's polls):")
    print("  " + ", ".join(f"{k} {v / n:.2f}" for k, v in sorted(farm.items(), key=lambda kv: -kv[1])))
    print(f"  total {sum(farm.values()) / n:.2f} commands per job; Redis CPU {1e6 * per_job_cpu:.0f} us per job for "
          f"the farm (+{1e6 * produced_cpu / n:.0f} us for submitting it)")
    if args.skip_benchmark:
        return
    bench = redis_benchmark()
    print("\nredis-benchmark on this machine (50 clients, 100000 requests, 1 KiB payloads for LPUSH/PUBLISH), ops/s:")
    names = sorted({name for name, _ in bench})
    print("  " + "  ".join(f"{name} {bench[(name, 1)]:,.0f} / P16 {bench[(name, 16)]:,.0f}" for name in names))
    print("\nOne Redis core's capacity for the farm (a command without its own figure costs the mean of the others):")
    capacities = {"Redis CPU per job (measured in the run)": 1 / per_job_cpu}
    for p in (1, 16):
        mean = sum(bench[(k, p)] for k in names) / len(names)
        cost = sum(v / n / bench.get((k, p), mean) for k, v in farm.items())
        capacities[f"commands/job x redis-benchmark cost, P{p}"] = 1 / cost
        print(f"  P{p}: {' + '.join(f'{v / n:.2f}/{bench.get((k, p), mean):,.0f}' for k, v in farm.items())} "
              f"= {1e6 * cost:.0f} us per job -> {1 / cost:,.0f} jobs/s")
    per_worker = DEVICES / seconds
    for label, jobs_per_s in capacities.items():
        hosts = ", ".join(f"{jobs_per_s / rate_:,.0f} hosts of {name} ({rate_:g} jobs/s)"
                          for name, rate_ in HOSTS.items())
        print(f"  {label}: {jobs_per_s:,.0f} jobs/s = {jobs_per_s / per_worker:,.0f} workers like these "
              f"({per_worker:g} jobs/s each), or {hosts}")


LINES = {"submit": 100_000, "ingest": 1_000_000}  # the prompt file's default length per part
PARTS = {"submit": part_submit, "ingest": part_ingest, "worker": part_worker, "fleet": part_fleet}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("parts", nargs="*", metavar="PART", help=f"of {', '.join(PARTS)} (default: submit worker)")
    parser.add_argument("--lines", type=int, help="submit: 100,000 lines (default); ingest: 1,000,000")
    parser.add_argument("--jobs", type=int, default=4000, help="worker: jobs through the stand-in worker")
    parser.add_argument("--workers", type=int, default=16, help="fleet: stand-in workers")
    parser.add_argument("--fleet-jobs", type=int, default=10_000, help="fleet: jobs")
    parser.add_argument("--batch-seconds", type=float, default=2.0,
                        help="fleet: stand-in seconds per batch of 8 (2.0: SDXL at 20 steps on a v5e-8 at 70%% of peak)")
    parser.add_argument("--skip-benchmark", action="store_true", help="fleet: without redis-benchmark")
    args = parser.parse_args()
    unknown = [part for part in args.parts if part not in PARTS]
    if unknown:
        parser.error(f"unknown parts {unknown}; known: {', '.join(PARTS)}")
    for part in args.parts or ["submit", "worker"]:
        PARTS[part](argparse.Namespace(**{**vars(args), "lines": args.lines or LINES.get(part)}))


if __name__ == "__main__":
    main()
