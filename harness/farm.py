"""Real farm processes for the tests and the benchmarks: `renderfarm worker` subprocesses against a real Redis."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import redis
from celery import Celery
from kombu.exceptions import OperationalError

from renderfarm.jobs import JobSpec
from renderfarm.manifest import open_manifest
from renderfarm.progress import Progress
from renderfarm.queue import TASK_NAME, job_message, make_app
from renderfarm.settings import Settings
from renderfarm.storage import Storage

STEPS = 3  # few steps: the tests check plumbing and numerics, not image quality


class WorkerProcess:
    """`renderfarm worker` in its own process, as an operator starts it (`entry`: how Python
    runs the command; bench/standin.py runs it with stand-in devices)."""

    def __init__(self, model: Path, out: str, broker: str, name: str, log_dir: Path,
                 env: dict[str, str] | None = None, precompile: str = "64x64@3",
                 extra: tuple[str, ...] = (), entry: tuple[str, ...] = ("-m", "renderfarm_cli")) -> None:
        self.name = f"{name}@test"
        self.log = log_dir / f"{name}.log"
        self.proc = subprocess.Popen(
            [sys.executable, *entry, "worker", "--model", str(model), "--out", out,
             "--broker", broker, "--node-name", self.name, "--max-wait", "0.5",
             "--precompile", precompile, *extra],
            stdout=self.log.open("w"), stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})

    def wait_ready(self, app: Celery, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"worker exited: {self.log.read_text()[-3000:]}"
            try:
                if app.control.ping(destination=[self.name], timeout=0.5):
                    return
            except (redis.ConnectionError, OperationalError):
                continue  # kombu's pooled connection from before a Redis restart fails once
        raise AssertionError(f"worker not ready: {self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


def farm_app(broker: str) -> Celery:
    return make_app(Settings(broker_url=broker))


def enqueue(app: Celery, progress: Progress, specs: Iterable[JobSpec]) -> list[JobSpec]:
    """Record the jobs as submitted, then send them, as the producer does: a worker records
    progress only for a job on its campaign's books, and may take a job the moment it is sent."""
    specs = list(specs)
    for campaign in {s.campaign for s in specs}:
        progress.submitted(campaign, [s.job_id for s in specs if s.campaign == campaign])
    for spec in specs:
        app.send_task(TASK_NAME, **job_message(spec))
    return specs


def wait_for(condition: Callable[[], bool], timeout: float, what: str, interval: float = 0.25) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}")


def manifest_records(storage: Storage, campaign: str) -> list[dict]:
    """Every line of a campaign's manifest, duplicates included (so tests can count them)."""
    lines, _ = open_manifest(storage).read(campaign)
    return [json.loads(line) for line in lines]


def manifest_ids(storage: Storage, campaign: str) -> list[str]:
    return [record["job_id"] for record in manifest_records(storage, campaign)]


def jobs(model: Path, campaign: str, n: int, seed: int = 0, **fields: Any) -> list[JobSpec]:
    """`n` distinct jobs of a campaign on `model` (guidance varied), `fields` set on each."""
    return [JobSpec(**{"prompt": f"{campaign} lighthouse {i}", "model": str(model), "seed": seed + i,
                       "steps": STEPS, "campaign": campaign, "guidance_scale": 2.0 + i % 4, **fields})
            for i in range(n)]


def wait_done(progress: Progress, campaign: str, n: int, timeout: float = 180) -> dict[str, Any]:
    """Wait until every one of the campaign's `n` jobs is done or failed; its status then."""
    wait_for(lambda: progress.status(campaign)["done"] + progress.status(campaign)["failed"] >= n,
             timeout, f"{n} jobs of {campaign}")
    return progress.status(campaign)

