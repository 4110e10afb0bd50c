"""Campaigns through a window: Redis memory and jobs/s of a campaign fed with `--window`
against one submitted all at once, with stand-in workers, and what one queued job costs Redis.

Stand-in workers here are processes that do at the Redis level what a worker does per job,
with the worker's own code and scripts, as fast as they can: pop messages and record them
unacked (worker/lua/pop_and_record.lua), open each at the door (worker.envelope), mark them
started and finished (renderfarm.progress, lua/finish.lua), and ack them. No Celery and no
devices: the farm's control plane at its fastest on this machine, so a window that holds it
back shows. (bench/control.py fleet runs real worker processes; at its 2.2 ms of CPU per job, 10
million jobs would take this 2-core machine three hours.)

Prints, for each run: jobs, jobs/s from the start of the run (its scan included) to the last
job finished, and Redis's peak memory over its baseline (INFO used_memory_peak). Then bytes
per queued job: a fresh Redis, a campaign of --bytes-jobs jobs submitted with no worker,
used_memory after minus before, per job, by key.

Usage: PYTHONPATH=. python bench/window.py [--jobs 300000] [--compare-jobs 100000]
       [--window 20000] [--workers 2] [--bytes-jobs 20000]

The defaults take about a minute on a 2-core machine (`make bench`); docs/performance.md's
figures are `--jobs 10000000 --compare-jobs 1000000 --window 100000 --bytes-jobs 100000`.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

from harness.redis_server import RedisServer
from producer.campaigns import CampaignSpec, run_campaign
from renderfarm.progress import Progress
from renderfarm.queue import priority_lists, queue_name
from renderfarm.settings import Settings
from worker.broker import POP_AND_RECORD
from worker.envelope import open_envelope

MODEL = "org/model"
ROWS = 1000  # prompts; images_per_prompt makes up the campaign's size
POP = 64  # messages per pop, as a worker's prefetch allows


def consume(url: str, queue: str) -> None:
    """A stand-in worker: pop, open, start, finish, ack, until killed."""
    client = redis.Redis.from_url(url)
    progress = Progress(client)
    pop = client.register_script(POP_AND_RECORD)
    lists = priority_lists(queue)
    keys = [*lists, "unacked_index", "unacked"]
    idle = 0.001
    while True:
        popped = pop(keys=keys, args=[time.time(), POP, *[queue] * len(lists)])
        if not popped:
            time.sleep(idle)
            idle = min(idle * 2, 0.05)
            continue
        idle = 0.001
        jobs, tags = [], []
        for _, item, tag in popped:
            payload = open_envelope(item)
            jobs.append((_kwargs(payload)["campaign"], payload["headers"]["id"]))
            tags.append(tag)
        progress.started(jobs)
        progress.finished(jobs, [0.0] * len(jobs))
        pipe = client.pipeline(transaction=False)
        pipe.zrem("unacked_index", *tags)
        pipe.hdel("unacked", *tags)
        pipe.execute()


def _kwargs(payload: dict) -> dict:
    """The job's fields, as kombu and Celery decode them."""
    body = payload["body"]
    if payload["properties"].get("body_encoding") == "base64":
        body = base64.b64decode(body)
    return json.loads(body)[1]


def spec(name: str, jobs: int, window: int | None, folder: Path) -> CampaignSpec:
    prompts = folder / "prompts.txt"
    if not prompts.exists():
        prompts.write_text("".join(f"a lighthouse on a cliff at dusk, variation {i}\n" for i in range(ROWS)))
    assert jobs % ROWS == 0, f"--jobs must be a multiple of {ROWS}"
    return CampaignSpec(name=name, model=MODEL, output=str(folder / "out"), base_seed=0, prompts=str(prompts),
                        images_per_prompt=jobs // ROWS, window=window)


def run(jobs: int, window: int | None, workers: int, folder: Path) -> dict[str, float]:
    """One campaign through `workers` stand-in workers on a fresh Redis."""
    server = RedisServer(appendonly=False)
    procs = []
    try:
        client = server.client()
        base = client.info("memory")["used_memory"]
        queue = queue_name(MODEL, "float32")
        procs = [subprocess.Popen([sys.executable, __file__, "--consume", server.url, queue])
                 for _ in range(workers)]
        campaign = spec(f"w{window or 0}-{jobs}", jobs, window, folder)
        progress = Progress(client)
        started = time.perf_counter()
        run_campaign(campaign, settings=Settings(broker_url=server.url))
        fed = time.perf_counter() - started
        while progress.status(campaign.name)["done"] < jobs:
            assert all(p.poll() is None for p in procs), "a stand-in worker died"
            time.sleep(0.05)
        seconds = time.perf_counter() - started
        memory = client.info("memory")
        return {"jobs": jobs, "seconds": seconds, "fed": fed, "rate": jobs / seconds,
                "peak_mib": (memory["used_memory_peak"] - base) / 2**20}
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        server.close()


def bytes_per_job(jobs: int, window: bool, folder: Path) -> tuple[float, dict[str, float]]:
    """Redis bytes per queued job, no worker, and by key (per job)."""
    server = RedisServer(appendonly=False)
    try:
        client = server.client()
        base = client.info("memory")["used_memory"]
        name = "bytes-window" if window else "bytes"
        run_campaign(spec(name, jobs, jobs if window else None, folder), settings=Settings(broker_url=server.url))
        used = client.info("memory")["used_memory"] - base
        keys = {k.decode(errors="replace"): client.memory_usage(k, samples=0) / jobs for k in client.scan_iter("*")}
        return used / jobs, {k: v for k, v in keys.items() if v >= 1}
    finally:
        server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=300_000, help="the windowed campaign's size")
    parser.add_argument("--compare-jobs", type=int, default=100_000,
                        help="the size both ways are run at (all at once must fit this machine's memory)")
    parser.add_argument("--window", type=int, default=20_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--bytes-jobs", type=int, default=20_000)
    parser.add_argument("--consume", nargs=2, metavar=("URL", "QUEUE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.consume:
        consume(*args.consume)
        return
    with tempfile.TemporaryDirectory(prefix="rf-window-") as tmp:
        folder = Path(tmp)
        print(f"window: {args.workers} stand-in workers, one Redis, {os.cpu_count()} cores")
        for window in (False, True):
            per_job, keys = bytes_per_job(args.bytes_jobs, window, folder)
            how = f"window {args.bytes_jobs}" if window else "no window"
            print(f"  bytes per queued job ({how}, {args.bytes_jobs} jobs queued): {per_job:,.0f} B; by key: "
                  + ", ".join(f"{k!r} {v:,.0f}" for k, v in sorted(keys.items(), key=lambda kv: -kv[1])))
        results = []
        for jobs, window in ((args.compare_jobs, None), (args.compare_jobs, args.window), (args.jobs, args.window)):
            r = run(jobs, window, args.workers, folder)
            results.append(r)
            print(f"  {jobs:>11,} jobs, {'window ' + format(window, ',') if window else 'all at once':>14}: "
                  f"{r['rate']:>8,.0f} jobs/s ({r['seconds']:.0f} s, fed in {r['fed']:.0f} s), "
                  f"Redis peak {r['peak_mib']:,.0f} MiB over its baseline", flush=True)
        unwindowed, windowed, big = results
        print(f"  windowed / all at once, {args.compare_jobs:,} jobs: {windowed['rate'] / unwindowed['rate']:.3f} "
              f"(target >= 0.95); {args.jobs:,} windowed / {args.compare_jobs:,} all at once: "
              f"{big['rate'] / unwindowed['rate']:.3f}")
        print(f"  Redis peak: {big['peak_mib']:,.0f} MiB for {args.jobs:,} jobs through a window of {args.window:,}; "
              f"{unwindowed['peak_mib']:,.0f} MiB for {args.compare_jobs:,} all at once")


if __name__ == "__main__":
    main()
