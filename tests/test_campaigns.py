"""Campaign runs against a real redis-server and the session's farm (real `renderfarm worker`
processes with the tiny model): bad rows and --strict, a finished campaign run again (at the
producer: its results stored), resume of a cancelled campaign (every job stored exactly once),
and the `renderfarm campaign` commands; windowed campaigns, with a feeder killed or cut off
from Redis as it sends a chunk, and its lock."""

from __future__ import annotations

import dataclasses
import importlib
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis

import producer.window
from harness.farm import STEPS, manifest_ids, wait_for
from harness.redis_server import RedisServer
from producer.campaigns import CampaignSpec, StrictError, campaign_jobs, load_spec, run_campaign
from producer.status import cancel_campaign
from producer.window import FeederBusy
from renderfarm.progress import ATTEMPTS_TTL, NOT_OPEN, NOT_SUBMITTED, Progress
from renderfarm.queue import queue_name
from renderfarm.settings import Settings
from renderfarm.storage import open_storage
from harness.fault_proxies import TcpProxy
from harness.gcs_emulator import GcsEmulator
from tests.helpers import FARM_OUT, Cli, Farm, store_jobs
from tests.helpers import submitted as submitted_jobs

SUBMIT = importlib.import_module("producer.submit")  # `producer.submit` is also the package's function


def queued(server: RedisServer, model: str) -> int:
    """Messages waiting in a model's queue, over its priority sub-queues."""
    client = server.client()
    return sum(client.llen(name) for name in client.scan_iter(f"{queue_name(model, 'float32')}*"))


def write_spec(tmp_path: Path, name: str, model: str, source: str, **keys: object) -> Path:
    lines = {"name": name, "model": model, "output": "out", "prompts": source, "base_seed": 1000,
             "width": 64, "height": 64, "steps": STEPS, **keys}
    path = tmp_path / f"{name}.yaml"
    path.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in lines.items()))
    return path


def test_bad_rows_are_skipped_and_reported_and_strict_enqueues_nothing(
        broker: str, redis_server: RedisServer, tmp_path: Path, cli: Cli) -> None:
    rows = [f"good {i}" for i in range(2500)]  # more than two submit chunks
    rows[1200] = '{"prompt": "x", "steps": 0}'
    rows[2400] = '{"prompt": ""}'
    lines = [json.dumps({"prompt": r}) if r.startswith("good") else r for r in rows] + ["{not json"]
    (tmp_path / "rows.jsonl").write_text("\n".join(lines) + "\n")
    path = write_spec(tmp_path, "bad", "some/model", "rows.jsonl")

    code, out, err = cli("campaign", "run", path, "--strict", "--broker", broker)
    assert code == 1
    assert "has 3 bad rows (first: line 1201: steps=0: must be in 1..500); --strict enqueues nothing" in err
    assert "bad line 2401: prompt='': must not be empty" in err and "bad line 2501: line='{not json'" in err
    assert redis_server.client().dbsize() == 0  # not a message, not a counter
    with pytest.raises(StrictError):
        run_campaign(load_spec(path), settings=Settings(broker_url=broker), strict=True)
    assert queued(redis_server, "some/model") == 0

    code, out, _ = cli("campaign", "validate", path)
    assert code == 1
    assert "2501 rows" in out and "2498 jobs" in out and "3 bad rows" in out and "  line 1201: steps=0" in out

    code, out, _ = cli("campaign", "run", path, "--broker", broker)
    assert code == 0
    assert "campaign bad: 2501 rows, 2498 jobs, 3 bad rows skipped" in out
    assert "bad line 1201: steps=0: must be in 1..500" in out and "enqueued 2498 jobs" in out
    assert queued(redis_server, "some/model") == 2498
    seeds = sorted(j.seed for j in campaign_jobs(load_spec(path)))
    assert seeds[1199:1201] == [1000 + 1199, 1000 + 1201]  # the bad row's seed is skipped, none shifted


def test_validate_prints_jobs_and_shapes(tmp_path: Path, cli: Cli) -> None:
    (tmp_path / "p.csv").write_text("prompt,width,guidance_scale,notes\na,128,,x\nb,,,y\nc,,1.0,z\n")
    path = write_spec(tmp_path, "shapes", "org/m", "p.csv", images_per_prompt=3)
    code, out, _ = cli("campaign", "validate", path)
    assert code == 0
    assert "campaign shapes: 3 rows from" in out and "9 jobs (3 per row), seeds 1000..1008" in out
    assert "org/m 128x64 3 steps default scheduler: 3 jobs" in out and "org/m 64x64 3 steps" in out
    assert "org/m 64x64 3 steps default scheduler cfg-free: 3 jobs" in out  # guidance <= 1: a program of its own
    assert "ignored columns (not job fields): notes" in out and out.rstrip().endswith("valid")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmodel: m\noutput: o\nprompts: p.csv\nbase_seed: 0\nstep: 3\n")
    code, _, err = cli("campaign", "validate", bad)
    assert code == 2 and f"{bad}: step=3: unknown key" in err


@pytest.fixture()
def worker(farm: Farm, gcs: GcsEmulator, tiny_sd: Path) -> dict:
    """The session's farm as these tests use it: where its workers store (this test's storage
    client pointed at the emulator) and the model whose queue they serve."""
    return {"out": FARM_OUT, "model": str(tiny_sd)}


def write_worker_spec(tmp_path: Path, worker: dict, name: str, n: int) -> Path:
    (tmp_path / f"{name}.txt").write_text("".join(f"{name} lighthouse {i}\n" for i in range(n)))
    return write_spec(tmp_path, name, worker["model"], f"{name}.txt", output=str(worker["out"]),
                      images_per_prompt=2)


@pytest.mark.farm
def test_a_campaign_run_with_wait_reports_when_it_is_finished(
        worker: dict, farm: Farm, tmp_path: Path, cli: Cli) -> None:
    path = write_worker_spec(tmp_path, worker, "twice", 4)
    code, out, _ = cli("campaign", "run", path, "--wait", "--timeout", 240, "--broker", farm.broker)
    assert code == 0, out
    assert "enqueued 8 jobs" in out and "finished: 8 done, 0 failed, 0 cancelled" in out
    assert re.search(r"campaign twice: [\d.]+ device-hours, [\d,]+ images per device-hour", out), out
    ids = {j.job_id for j in campaign_jobs(load_spec(path))}
    assert sorted(manifest_ids(open_storage(str(worker["out"])), "twice")) == sorted(ids)


@pytest.mark.parametrize("window", [None, 6])
def test_a_finished_campaign_run_again_submits_nothing(broker: str, redis_server: RedisServer, tmp_path: Path,
                                                       cli: Cli, sd_model: Any, window: int | None) -> None:
    """Every job's result in storage (stored as a worker stores it): a run, windowed or not,
    sends nothing and touches no file; what the worker does with a finished job delivered again
    is tests/test_farm.py's."""
    out = tmp_path / "out"
    path = write_spec(tmp_path, "twice", "some/model", "rows.txt", output=str(out), images_per_prompt=2,
                      **({"window": window} if window else {}))
    (tmp_path / "rows.txt").write_text("".join(f"twice lighthouse {i}\n" for i in range(4)))
    spec = load_spec(path)
    jobs = list(campaign_jobs(spec))
    store_jobs(open_storage(str(out)), sd_model, jobs, [(200, 40, 40)] * len(jobs))
    stamps = {p: p.stat().st_mtime_ns for p in (out / "twice").iterdir()}

    run = run_campaign(spec, settings=Settings(broker_url=broker))
    assert (run.jobs, run.already_done, run.submitted, run.submission) == (8, 8, 0, None)
    assert "nothing to do: all 8 jobs already in storage" in run.summary()
    code, printed, _ = cli("campaign", "run", path, "--broker", broker)
    assert code == 0 and "nothing to do: all 8 jobs already in storage" in printed, printed
    assert queued(redis_server, "some/model") == 0
    assert {p: p.stat().st_mtime_ns for p in (out / "twice").iterdir()} == stamps


@pytest.mark.farm
def test_a_cancelled_campaign_run_again_finishes_every_job_once(
        worker: dict, farm: Farm, tmp_path: Path) -> None:
    settings = Settings(broker_url=farm.broker)
    progress = Progress(farm.redis.client())
    spec = load_spec(write_worker_spec(tmp_path, worker, "halfway", 8))  # 16 jobs
    # Half of it rendered: the first 4 rows are a spec of their own (same rows, same seeds).
    (tmp_path / "first-half.txt").write_text("".join(f"halfway lighthouse {i}\n" for i in range(4)))
    first_half = dataclasses.replace(spec, prompts=str(tmp_path / "first-half.txt"))
    assert run_campaign(first_half, settings=settings).submitted == 8
    wait_for(lambda: progress.status("halfway")["done"] == 8, 240, "the first half")

    # The rest submitted, then cancelled before the (paused) workers reach it: they skip them.
    with farm.paused():
        run = run_campaign(spec, settings=settings)
        assert (run.jobs, run.already_done, run.submitted) == (16, 8, 8)
        cancel_campaign("halfway", farm.broker)
    wait_for(lambda: progress.status("halfway")["cancelled"] == 8, 240, "8 jobs skipped as cancelled")
    storage = open_storage(str(worker["out"]))
    assert len(manifest_ids(storage, "halfway")) == 8

    again = run_campaign(spec, settings=settings)
    assert (again.already_done, again.submitted) == (8, 8)
    assert not progress.is_cancelled("halfway")  # the run lifted the cancel
    wait_for(lambda: progress.status("halfway")["done"] == 16, 240, "every job")
    ids = manifest_ids(storage, "halfway")
    assert len(ids) == len(set(ids)) == 16
    assert set(ids) == {j.job_id for j in campaign_jobs(spec)}
    assert run_campaign(spec, settings=settings).submission is None


# ------------------------------------------------------------------------------ through a window

def campaign_keys(server: RedisServer, campaign: str) -> set[str]:
    return {k.decode().removeprefix(f"rf:c:{campaign}:") for k in server.client().scan_iter(f"rf:c:{campaign}:*")}


class Sampler(threading.Thread):
    """The most jobs a campaign had open (queued or running) and on its queue, sampled."""

    def __init__(self, server: RedisServer, campaign: str, model: str) -> None:
        super().__init__(daemon=True)
        self.server, self.campaign, self.model = server, campaign, model
        self.most_open = self.most_queued = 0
        self.halt = threading.Event()

    def run(self) -> None:
        client = self.server.client()
        while not self.halt.wait(0.01):
            self.most_open = max(self.most_open, client.scard(f"rf:c:{self.campaign}:open"))
            self.most_queued = max(self.most_queued, queued(self.server, self.model))

    def __enter__(self) -> Sampler:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.halt.set()
        self.join()


@pytest.mark.farm
def test_a_windowed_campaign_keeps_at_most_its_window_and_no_key_per_job(
        worker: dict, farm: Farm, tmp_path: Path, cli: Cli) -> None:
    path = write_worker_spec(tmp_path, worker, "windowed", 12)  # 24 jobs
    with Sampler(farm.redis, "windowed", worker["model"]) as sampler:
        code, out, err = cli("campaign", "run", path, "--window", 6, "--wait", "--timeout", 240,
                             "--broker", farm.broker)
    assert code == 0, err
    assert "enqueued 24 jobs" in out and "through a window of 6 jobs" in out, out
    assert "finished: 24 done, 0 failed, 0 cancelled" in out
    assert 0 < sampler.most_open <= 6 and sampler.most_queued <= 6
    ids = manifest_ids(open_storage(str(worker["out"])), "windowed")
    assert len(ids) == len(set(ids)) == 24
    # Counts and the (empty) open set; no set, hash or key that grows with the campaign.
    assert campaign_keys(farm.redis, "windowed") == {"counts", "times"}
    status = Progress(farm.redis.client()).status("windowed")
    assert {k: status[k] for k in ("submitted", "done", "queued", "running", "window", "jobs", "finished")} == \
        {"submitted": 24, "done": 24, "queued": 0, "running": 0, "window": 6, "jobs": 24, "finished": True}
    code, out, _ = cli("status", "windowed", "--broker", farm.broker)
    assert "window            6 jobs queued or running at most, 24 jobs in all" in out, out


@pytest.mark.farm
def test_a_stopped_feeder_resumes_sending_nothing_twice(worker: dict, farm: Farm,
                                                        tmp_path: Path) -> None:
    client, settings = farm.redis.client(), Settings(broker_url=farm.broker)
    path = write_worker_spec(tmp_path, worker, "resumed", 8)  # 16 jobs
    spec = dataclasses.replace(load_spec(path), window=4)
    with farm.paused():  # nothing is taken: the window fills and stays full
        feeder = subprocess.Popen([sys.executable, "-m", "renderfarm_cli", "campaign", "run", str(path),
                                   "--window", "4", "--broker", farm.broker], stderr=subprocess.DEVNULL)
        wait_for(lambda: client.scard("rf:c:resumed:open") == 4, 60, "the window full")
        assert client.exists("rf:c:resumed:feeder")
        with pytest.raises(FeederBusy, match=r"campaign='resumed': is being fed by another run \(.+\)"):
            run_campaign(spec, settings=settings)
        feeder.terminate()  # as an operator stops it: the lock goes with it
        assert feeder.wait(30) == 128 + signal.SIGTERM
        # (a paused worker's pop already sent to Redis may have taken some: they wait in unacked)
        messages = lambda: queued(farm.redis, worker["model"]) + client.hlen("unacked")  # noqa: E731
        assert not client.exists("rf:c:resumed:feeder") and messages() == 4
        runs: list = []
        again = threading.Thread(target=lambda: runs.append(run_campaign(spec, settings=settings)))
        again.start()
        time.sleep(1)
        assert messages() == 4  # the earlier run's 4 stay; the window is full
    again.join(240)
    [run] = runs
    assert (run.jobs, run.already_done, run.queued, run.submitted) == (16, 0, 4, 12)
    assert "skipped 4 jobs already queued by an earlier run" in run.summary()
    progress = Progress(client)
    wait_for(lambda: progress.status("resumed")["finished"], 240, "every job")
    assert int(client.hget("rf:c:resumed:counts", "submitted")) == 16  # each job sent once
    ids = manifest_ids(open_storage(str(worker["out"])), "resumed")
    assert len(ids) == len(set(ids)) == 16 and set(ids) == {j.job_id for j in campaign_jobs(spec)}


@pytest.mark.farm
def test_feeders_of_two_campaigns_run_at_once_and_a_cancel_stops_one(
        worker: dict, farm: Farm, tmp_path: Path) -> None:
    settings, progress = Settings(broker_url=farm.broker), Progress(farm.redis.client())
    specs = {name: dataclasses.replace(load_spec(write_worker_spec(tmp_path, worker, name, 5)), window=3)
             for name in ("left", "right")}  # 10 jobs each
    runs: dict = {}
    with farm.paused():
        feeders = [threading.Thread(target=lambda n=name: runs.__setitem__(n, run_campaign(specs[n], settings=settings)))
                   for name in specs]
        for feeder in feeders:
            feeder.start()
        wait_for(lambda: all(progress.status(n)["queued"] == 3 for n in specs), 60, "both windows filled")
        cancel_campaign("left", farm.broker)
    for feeder in feeders:
        feeder.join(240)
    assert runs["right"].submitted == 10 and runs["right"].submission.stopped is None
    assert runs["left"].submitted == 3
    assert "stopped feeding: campaign left was cancelled; run it again to resume it" in runs["left"].summary()
    wait_for(lambda: progress.status("right")["finished"], 240, "the other campaign")
    wait_for(lambda: progress.status("left")["cancelled"] == 3, 240, "the queued three skipped")
    assert not progress.status("left")["finished"]  # not fed to the end
    again = run_campaign(specs["left"], settings=settings)  # resumes: lifts the cancel, sends the rest
    assert (again.already_done, again.submitted) == (0, 10)
    wait_for(lambda: progress.status("left")["finished"], 240, "the resumed campaign")
    assert len(manifest_ids(open_storage(str(worker["out"])), "left")) == 10


def test_a_campaign_is_windowed_or_not_for_good(broker: str, redis_server: RedisServer, tmp_path: Path,
                                                cli: Cli) -> None:
    redis_server.client().flushall()
    (tmp_path / "rows.txt").write_text("a\nb\nc\n")
    path = write_spec(tmp_path, "kind", "some/model", "rows.txt")
    code, out, err = cli("campaign", "run", path, "--window", 5, "--broker", broker)
    assert code == 0 and "enqueued 3 jobs" in out and "through a window of 5 jobs" in out
    code, out, err = cli("submit", "x", "--model", "some/model", "--campaign", "kind", "--broker", broker)
    assert code == 2 and "campaign='kind': is fed through a window" in err
    code, out, err = cli("campaign", "run", path, "--broker", broker)
    assert code == 2 and "campaign='kind': is fed through a window" in err
    assert queued(redis_server, "some/model") == 3  # neither sent anything

    plain = write_spec(tmp_path, "plain", "some/model", "rows.txt")
    assert cli("campaign", "run", plain, "--broker", broker)[0] == 0
    code, out, err = cli("campaign", "run", plain, "--window", 10, "--broker", broker)
    assert code == 2 and "window=10: campaign plain was submitted without a window" in err
    code, out, err = cli("campaign", "run", plain, "--window", 0, "--broker", broker)
    assert code == 2 and "window=0: must be a whole number of jobs from 1 to" in err
    bad = write_spec(tmp_path, "badwindow", "some/model", "rows.txt", window="many")
    code, out, err = cli("campaign", "validate", bad)
    assert code == 2 and f"{bad}: window='many': must be a whole number of jobs" in err


def test_a_counted_campaign_tells_a_job_delivered_again_after_it_finished(redis_server: RedisServer) -> None:
    """Its attempts are forgotten when it is done: a later delivery of it is not open
    (NOT_OPEN, nothing recorded: the worker looks for its stored result), and it is counted done
    once."""
    client = redis_server.client()
    client.flushall()
    progress = Progress(client)
    client.hset("rf:c:counted:counts", "window", 10)
    client.set("rf:c:counted:feeder", "holder")
    assert progress.admit("counted", [("a", "rf.q", "message a"), ("b", "rf.q", "message b")], ["rf.q"],
                          "holder", "first") == ("ok", 2)
    assert client.lrange("rf.q", 0, -1) == [b"message b", b"message a"]  # as LPUSH rf.q a b
    client.delete("rf.q")
    assert progress.started([("counted", "a"), ("counted", "b")]) == [1, 1]
    progress.finished([("counted", "a")], [1.5])
    assert not client.hexists("rf:c:counted:attempts", "a")
    assert progress.started([("counted", "a"), ("counted", "b")]) == [NOT_OPEN, 2]
    assert not client.hexists("rf:c:counted:attempts", "a") and not client.sismember("rf:c:counted:running", "a")
    progress.finished([("counted", "a"), ("counted", "b")], [1.5, 2.0])
    status = progress.status("counted")
    assert (status["submitted"], status["done"], status["device_seconds"]) == (2, 2, 3.5)
    assert not client.exists("rf:c:counted:attempts", "rf:c:counted:open", "rf:c:counted:done")


def test_the_feeder_lock_outlives_a_long_scan_and_goes_with_the_run(redis_server: RedisServer,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A scan of a large source takes longer than the lock lasts: the lock is renewed meanwhile."""
    monkeypatch.setattr(producer.window, "LOCK_SECONDS", 1)
    client, settings = redis_server.client(), Settings(broker_url=redis_server.url)
    client.flushall()
    with producer.window.Feeder("long", 10, settings):
        time.sleep(3)  # three lifetimes of the lock
        assert 0 < client.pttl("rf:c:long:feeder") <= 1000
        with pytest.raises(FeederBusy):
            producer.window.Feeder("long", 10, settings)
    assert not client.exists("rf:c:long:feeder")
    with producer.window.Feeder("long", 10, settings):  # free again
        pass


def test_the_feeder_lock_is_renewed_and_released_only_by_its_holder(redis_server: RedisServer,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that stalls past its lock's expiry, right after it looked at the lock, while another
    run takes the lock over, neither frees nor extends the other run's lock."""
    client, settings, name = redis_server.client(), Settings(broker_url=redis_server.url), "rf:c:stalled:feeder"
    client.flushall()

    def stall_after_its_next_lock_command(feeder: producer.window.Feeder) -> None:
        send, stalls = feeder.client.execute_command, [True]

        def command(*args: object, **options: object) -> object:
            reply = send(*args, **options)
            if name in args and stalls:
                stalls.pop()
                client.set(name, "another run", ex=100)  # the stalled run's lock expired; another took it
            return reply
        monkeypatch.setattr(feeder.client, "execute_command", command)

    feeder = producer.window.Feeder("stalled", 10, settings)  # renews every 5 s: this releases first
    stall_after_its_next_lock_command(feeder)
    feeder.__exit__()
    assert client.get(name) == b"another run"

    client.flushall()
    monkeypatch.setattr(producer.window, "LOCK_SECONDS", 1)  # renewed every 1/6 s
    feeder = producer.window.Feeder("stalled", 10, settings)
    stall_after_its_next_lock_command(feeder)
    wait_for(lambda: feeder.lock.lost, 10, "the stalled run to find its lock lost")
    assert client.get(name) == b"another run" and client.ttl(name) > 50  # not cut to the stalled run's 1 s
    with pytest.raises(FeederBusy, match="lost its feeder lock"):
        feeder.lock.check()
    feeder.__exit__()
    assert client.get(name) == b"another run"


@pytest.mark.parametrize("window", [None, 10])
def test_a_job_counts_once_in_the_state_it_ends_in(redis_server: RedisServer, window: int | None) -> None:
    """Failed for good or skipped, then rendered after all (a requeued dead letter, a duplicate
    delivery): done, and no longer failed or cancelled. Done, then failed or skipped (a
    duplicate delivery): still done. With a window or without."""
    ids = ["a", "b", "c"]
    progress = submitted_jobs(redis_server, "ends", ids, window)
    progress.started(("ends", job_id) for job_id in ids)
    progress.failed("ends", "a", "out of memory")
    progress.cancel("ends")  # a worker skips a job only while its campaign is cancelled
    progress.skipped("ends", "b")
    progress.finished([("ends", job_id) for job_id in ids], [1.0, 2.0, 4.0])
    counts = lambda: {k: progress.status("ends")[k]  # noqa: E731
                      for k in ("submitted", "queued", "running", "done", "failed", "cancelled", "device_seconds")}
    ended = {"submitted": 3, "queued": 0, "running": 0, "done": 3, "failed": 0, "cancelled": 0, "device_seconds": 7.0}
    assert counts() == ended
    progress.failed("ends", "c", "a duplicate delivery failed")
    progress.skipped("ends", "a")
    assert counts() == ended


def contents(client: redis.Redis) -> dict[bytes, object]:
    """Every key in Redis with what it holds."""
    read = {b"hash": client.hgetall, b"set": client.smembers, b"list": lambda k: client.lrange(k, 0, -1),
            b"string": client.get}
    return {k: read[client.type(k)](k) for k in client.keys()}


def records_nothing(progress: Progress, jobs: list[tuple[str, str]]) -> list[int]:
    """Check that what a worker may record of jobs it is delivered (started, then each failed,
    skipped, finished) leaves Redis as it was after each step; the answers of `started`."""
    before = contents(progress.r)
    attempts = progress.started(jobs)
    steps = [lambda: None] + [lambda c=c, j=j: progress.failed(c, j, "invalid job: steps=0") for c, j in jobs] + \
        [lambda c=c, j=j: progress.skipped(c, j) for c, j in jobs] + \
        [lambda: progress.finished(jobs, [1.0] * len(jobs), [(True, True)] * len(jobs))]
    for step in steps:
        step()
        assert contents(progress.r) == before
    return attempts


def test_a_job_of_a_campaign_nobody_submitted_creates_no_key(redis_server: RedisServer) -> None:
    """A message may name any campaign: started, failed, skipped and finished, its job records
    nothing, cancelled campaign or not."""
    client = redis_server.client()
    client.flushall()
    progress = Progress(client)
    assert records_nothing(progress, [("ghost", "a"), ("ghost", "b"), ("other", "c")]) == [NOT_SUBMITTED] * 3
    assert client.keys() == []
    progress.cancel("ghost")
    assert records_nothing(progress, [("ghost", "a")]) == [NOT_SUBMITTED]


@pytest.mark.parametrize("window", [None, 10])
def test_a_job_not_on_its_campaigns_books_adds_no_field(redis_server: RedisServer, window: int | None) -> None:
    """A known campaign, a job id it never had (NOT_SUBMITTED), or with a window one that is no
    longer open (NOT_OPEN: done here) or never was: nothing of it is recorded, and the jobs on
    the books are as they were."""
    progress = submitted_jobs(redis_server, "books", ["a", "b"], window)
    client = progress.r
    assert progress.started([("books", "a"), ("books", "b")]) == [1, 1]
    progress.finished([("books", "a")], [2.0])
    progress.cancel("books")
    strangers = [("books", "never")] + ([("books", "a")] if window else [])
    assert records_nothing(progress, strangers) == [NOT_SUBMITTED if window is None else NOT_OPEN] * len(strangers)
    assert progress.started([("books", "b")]) == [2] and client.hget("rf:c:books:attempts", "b") == b"2"


def test_an_uncounted_campaigns_attempts_expire_after_their_last_start(redis_server: RedisServer) -> None:
    """Its attempts hash keeps a field per job started, and no hash for ever: each start
    renews its expiry (a counted campaign's forgets each job as it ends instead)."""
    progress = submitted_jobs(redis_server, "ttl", ["a", "b"])
    client = progress.r
    assert client.ttl("rf:c:ttl:attempts") == -2  # no hash before a start
    progress.started([("ttl", "a")])
    assert ATTEMPTS_TTL - 5 <= client.ttl("rf:c:ttl:attempts") <= ATTEMPTS_TTL
    client.expire("rf:c:ttl:attempts", 60)
    progress.started([("ttl", "b")])
    assert ATTEMPTS_TTL - 5 <= client.ttl("rf:c:ttl:attempts") <= ATTEMPTS_TTL


@pytest.mark.parametrize("window", [None, 10])
def test_transient_failures_are_refunded_within_a_bound_then_count(redis_server: RedisServer,
                                                                  window: int | None) -> None:
    """A job whose attempts storage keeps cutting short is refunded `bound` times, then each
    attempt counts, so a failure that never ends reaches max_attempts; a stopping worker's put
    back is always refunded; a job failure always counts. A job that ends forgets its refunds,
    and one never started records none."""
    progress = submitted_jobs(redis_server, "refunds", ["a", "b", "c"], window)
    client = progress.r
    # (the attempt it starts as, its refunds once put back, its attempts counted then)
    for attempt, refunds, counted in ((1, 1, 0), (1, 2, 0), (1, 3, 1), (2, 4, 2)):
        assert progress.started([("refunds", "a")]) == [attempt]
        assert progress.released([("refunds", "a")], "bounded", 2) == [refunds]
        assert int(client.hget("rf:c:refunds:attempts", "a")) == counted
    progress.started([("refunds", "b"), ("refunds", "c")])
    assert progress.released([("refunds", "b")], "refund") == [0] and client.hget("rf:c:refunds:attempts", "b") == b"0"
    assert progress.released([("refunds", "c")], "count") == [0] and client.hget("rf:c:refunds:attempts", "c") == b"1"
    assert client.sismember("rf:c:refunds:running", "a") == 0 and ATTEMPTS_TTL - 5 <= client.ttl("rf:c:refunds:refunds")
    assert progress.released([("refunds", "never")], "bounded", 2) == [0]
    assert client.hkeys("rf:c:refunds:refunds") == [b"a"]
    progress.started([("refunds", "a")])
    progress.finished([("refunds", "a")])
    assert not client.exists("rf:c:refunds:refunds")


def test_a_running_campaign_has_a_rate_and_an_eta_from_its_first_store(redis_server: RedisServer) -> None:
    """Status mid-way: with every done image from one store (a worker storing two batches
    together), the rate is over the time since submission; once images came in two stores, it
    is over the time between them. The ETA is the jobs left at that rate."""
    client = redis_server.client()
    client.flushall()
    progress = Progress(client)
    ids = [f"j{i}" for i in range(8)]

    def stamps() -> dict[str, float]:
        return {k.decode(): float(v) for k, v in client.hgetall("rf:c:rate:times").items()}

    progress.submitted("rate", ids, "rf.q")
    assert progress.status("rate")["images_per_second"] is None  # nothing done: no rate
    progress.started(("rate", job_id) for job_id in ids)
    time.sleep(0.05)
    progress.finished([("rate", job_id) for job_id in ids[:4]])
    report, times = progress.status("rate"), stamps()
    assert times["first_done"] == times["last_done"]
    since = times["last_done"] - times["first_submitted"]
    assert report["images_per_second"] == pytest.approx(4 / since)
    assert report["eta_seconds"] == pytest.approx(4 / report["images_per_second"])
    time.sleep(0.05)
    progress.finished([("rate", job_id) for job_id in ids[4:6]])
    report, times = progress.status("rate"), stamps()
    assert report["images_per_second"] == pytest.approx(5 / (times["last_done"] - times["first_done"]))
    assert report["eta_seconds"] == pytest.approx(2 / report["images_per_second"])


def test_a_windowed_run_leaves_open_only_its_own_jobs_and_lifts_a_cancel_with_nothing_to_send(
        broker: str, redis_server: RedisServer, tmp_path: Path) -> None:
    """Rows edited out since the last run leave open ids that are not the spec's: the run still
    sends the spec's jobs that are neither stored nor open. And a run with nothing to send but
    open jobs lifts a cancel, so those render."""
    settings, progress = Settings(broker_url=broker), Progress(redis_server.client())
    (tmp_path / "rows.txt").write_text("a\nb\nc\nd\n")
    spec = load_spec(write_spec(tmp_path, "edited", "some/model", "rows.txt", window=10))
    assert run_campaign(spec, settings=settings).submitted == 4
    (tmp_path / "rows.txt").write_text("a\nb\ne\nf\n")  # c and d edited out (e and f take their seeds)
    run = run_campaign(spec, settings=settings)
    assert (run.jobs, run.already_done, run.queued, run.submitted) == (4, 0, 2, 2)
    assert queued(redis_server, "some/model") == 6
    assert progress.status("edited")["jobs"] == 6  # c and d are rendered too: counted in the total

    cancel_campaign("edited", broker)
    run = run_campaign(spec, settings=settings)
    assert (run.queued, run.submitted) == (4, 0)
    assert not progress.is_cancelled("edited")
    assert "campaign edited was cancelled: this submission lifted the cancel" in run.summary()
    assert queued(redis_server, "some/model") == 6


def submitted(server: RedisServer, campaign: str) -> int:
    return int(server.client().hget(f"rf:c:{campaign}:counts", "submitted") or 0)


def finishes_every_job_once(worker: dict, server: RedisServer, spec: CampaignSpec) -> None:
    """Run the campaign again once the earlier run's lock is gone: every job is stored once."""
    client, progress = server.client(), Progress(server.client())
    wait_for(lambda: not client.exists(f"rf:c:{spec.name}:feeder"), 60, "the earlier run's lock to expire")
    run_campaign(spec, settings=Settings(broker_url=server.url))
    wait_for(lambda: progress.status(spec.name)["finished"], 240, "every job")
    assert submitted(server, spec.name) == 8  # each job sent once
    ids = manifest_ids(open_storage(str(worker["out"])), spec.name)
    assert len(ids) == len(set(ids)) == 8 and set(ids) == {j.job_id for j in campaign_jobs(spec)}


KILLED_FEEDER = """
import importlib, os, signal, sys
import producer.window
from renderfarm_cli import main

producer.window.LOCK_SECONDS = 1  # the killed run's lock expires a second later
chunks = []

def pushing(messages):
    chunks.append(messages)
    if len(chunks) == 2:
        os.kill(os.getpid(), signal.SIGKILL)

importlib.import_module("producer.submit").pushing = pushing
main(sys.argv[1:])
"""


@pytest.mark.farm
def test_a_feeder_killed_as_it_sends_a_chunk_leaves_no_open_job_without_its_message(
        worker: dict, farm: Farm, tmp_path: Path) -> None:
    """Killed as it sends its second chunk (window 4, chunks of 2): that chunk is neither
    recorded open nor pushed, so a run again sends it and the campaign finishes."""
    path = write_worker_spec(tmp_path, worker, "killed", 4)  # 8 jobs
    feeder = subprocess.run([sys.executable, "-c", KILLED_FEEDER, "campaign", "run", str(path), "--window", "4",
                             "--broker", farm.broker], capture_output=True, text=True, timeout=120)
    assert feeder.returncode == -signal.SIGKILL, feeder.stderr[-2000:]
    assert submitted(farm.redis, "killed") == 2  # the first chunk only
    finishes_every_job_once(worker, farm.redis, dataclasses.replace(load_spec(path), window=4))


@pytest.mark.farm
def test_redis_failing_as_a_feeder_sends_a_chunk_leaves_no_open_job_without_its_message(
        worker: dict, farm: Farm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The feeder's Redis goes away as it sends its second chunk: the run fails, that chunk is
    neither recorded open nor pushed, and a run again sends it."""
    spec = dataclasses.replace(load_spec(write_worker_spec(tmp_path, worker, "lost", 4)), window=4)  # 8 jobs
    proxy = TcpProxy(farm.redis.port)
    chunks: list = []

    def pushing(messages: list) -> None:
        chunks.append(messages)
        if len(chunks) == 2:  # every connection of the feeder dropped, and no new one taken (a listener
            proxy._listener.shutdown(socket.SHUT_RDWR)  # closed while a thread waits in accept takes them)
            proxy.close()

    with monkeypatch.context() as patched:  # for this run only (the emulator's address stays set)
        patched.setattr(SUBMIT, "pushing", pushing)
        patched.setattr(producer.window, "LOCK_SECONDS", 1)  # the lock it cannot release expires soon
        try:
            with pytest.raises(redis.ConnectionError):
                run_campaign(spec, settings=Settings(broker_url=proxy.url()))
        finally:
            proxy.close()
    assert submitted(farm.redis, "lost") == 2  # the first chunk only
    finishes_every_job_once(worker, farm.redis, spec)
