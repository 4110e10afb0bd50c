"""Campaign ingest benchmark (not a test): validate and submit an N-line prompt file through
`producer.campaigns.run_campaign` into a redis-server it starts on a free port; print jobs/s
and the process's peak resident memory (getrusage, and the RSS sampled every 50 ms, so a
peak that is not flat shows as growth over the run). Targets: >= 5,000 jobs/s and < 300 MB
at 1,000,000 lines.

Usage: PYTHONPATH=. python bench/ingest.py [--lines 1000000] [--profile FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import resource
import tempfile
import threading
import time
from pathlib import Path

from harness.redis_server import RedisServer
from producer.campaigns import parse_spec, run_campaign
from renderfarm.settings import Settings

TARGET_RATE, TARGET_MB = 5000, 300


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


class RssSampler(threading.Thread):
    """The process's RSS every `period` seconds: its peak and when it was reached."""

    def __init__(self, period: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.period, self.samples = period, []
        self.stop = threading.Event()

    def run(self) -> None:
        started = time.perf_counter()
        while not self.stop.wait(self.period):
            self.samples.append((time.perf_counter() - started, rss_mb()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--profile", metavar="FILE", help="write a cProfile of the run here")
    args = parser.parse_args()
    server = RedisServer(appendonly=False)
    try:
        with tempfile.TemporaryDirectory(prefix="rf-bench-ingest-") as tmp:
            path = Path(tmp, "prompts.txt")
            with path.open("w") as f:
                for i in range(args.lines):
                    f.write(f"a lighthouse on a cliff at dusk, oil painting, variation {i}\n")
            spec = parse_spec({"name": "bench", "model": "bench/model", "output": str(Path(tmp, "out")),
                               "prompts": str(path), "base_seed": 0, "steps": 25, "width": 512,
                               "height": 512})
            before = rss_mb()
            sampler = RssSampler()
            sampler.start()
            profile = cProfile.Profile() if args.profile else None
            cpu_before = cpu_seconds()
            started = time.perf_counter()
            if profile:
                profile.enable()
            run = run_campaign(spec, settings=Settings(broker_url=server.url))
            if profile:
                profile.disable()
                profile.dump_stats(args.profile)
            seconds = time.perf_counter() - started
            cpu = cpu_seconds() - cpu_before
            sampler.stop.set()
            sampler.join()
        client = server.client()
        queued = sum(client.llen(name) for name in client.scan_iter("rf.float32.bench/model*"))
        if run.submitted != args.lines or queued != args.lines:
            raise RuntimeError(f"submitted {run.submitted}, queued {queued}, expected {args.lines}")
        peak_sampled = max((mb for _, mb in sampler.samples), default=rss_mb())
        quarter = [mb for t, mb in sampler.samples if t <= seconds / 4]
        rate = args.lines / seconds
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
        print(f"ingest: {args.lines:,} lines validated and submitted in {seconds:.1f} s = "
              f"{rate:,.0f} jobs/s (target >= {TARGET_RATE:,})")
        print(f"  this process used {cpu:.1f} s of CPU: {args.lines / cpu:,.0f} jobs per CPU-second "
              f"(the rate on an idle core; wall time shares the machine with redis-server and others)")
        print(f"  peak RSS (getrusage): {peak:.0f} MiB (target < {TARGET_MB}); sampled: {before:.0f} MiB "
              f"before the run, {max(quarter, default=before):.0f} MiB peak in its first quarter, "
              f"{peak_sampled:.0f} MiB peak overall")
        print(f"  redis memory for {queued:,} queued jobs: "
              f"{client.info('memory')['used_memory'] / 2**20:,.0f} MiB (redis-server, not this process)")
    finally:
        server.close()


if __name__ == "__main__":
    main()
