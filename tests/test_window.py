"""A windowed campaign under faults, against a real redis-server: a cancel lifted by a run while
workers skip, an admit sent twice by a dropped connection, a feeder that stalled past its lock,
dead letters requeued, a run that died before it marked the campaign fed, the local manifest's
memory; and the whole window at once (the session's farm: a feeder killed, cut off and
cancelled at random points, dead letters requeued) with every job stored exactly once."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

import producer.campaigns
import producer.window
from harness.farm import STEPS, manifest_ids, wait_for
from harness.redis_server import RedisServer
from producer.campaigns import CampaignSpec, campaign_jobs, load_spec, run_campaign, stored_job_ids
from producer.status import cancel_campaign
from producer.window import FeederBusy, Feeder
from renderfarm import deadletters
from renderfarm.manifest import FileManifest
from renderfarm.progress import ADMIT, REQUEUE, Progress, retrying_client
from renderfarm.queue import queue_name
from renderfarm.settings import Settings
from renderfarm.storage import open_storage
from harness.fault_proxies import TcpProxy
from harness.gcs_emulator import GcsEmulator
from tests.helpers import FARM_OUT, Farm, submitted

MODEL = "some/model"  # no worker serves it: what is sent stays on its queue


def write_spec(tmp_path: Path, name: str, rows: int, window: int, model: str = MODEL, **keys: object) -> CampaignSpec:
    (tmp_path / f"{name}.txt").write_text("".join(f"{name} lighthouse {i}\n" for i in range(rows)))
    lines = {"name": name, "model": model, "output": str(tmp_path / "out"), "prompts": f"{name}.txt",
             "base_seed": 1000, "width": 64, "height": 64, "steps": STEPS, "window": window, **keys}
    path = tmp_path / f"{name}.yaml"
    path.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in lines.items()))
    return load_spec(path)


def messages(client: redis.Redis, model: str = MODEL) -> list[bytes]:
    """Every message on a model's queue, over its priority lists."""
    return [m for name in client.scan_iter(f"{queue_name(model, 'float32')}*") for m in client.lrange(name, 0, -1)]


def task_ids(client: redis.Redis, model: str = MODEL) -> list[str]:
    return [json.loads(m)["headers"]["id"] for m in messages(client, model)]


def counts(client: redis.Redis, campaign: str) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in client.hgetall(f"rf:c:{campaign}:counts").items()}


def test_a_cancelled_campaign_run_again_while_workers_skip_loses_no_job(
        broker: str, redis_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The run lifts the cancel before it reads the open jobs: a worker that read the cancel
    before and skips a queued job while the run lists storage records nothing (the job stays
    open, and the worker puts it back), so every job is open or sent, none lost."""
    client, progress = redis_server.client(), Progress(redis_server.client())
    spec = write_spec(tmp_path, "recancel", 6, window=10)
    settings = Settings(broker_url=broker)
    assert run_campaign(spec, settings=settings).submitted == 6
    cancel_campaign("recancel", broker)
    listing = producer.campaigns.stored_job_ids

    def listing_while_workers_skip(spec: CampaignSpec) -> set[str]:
        for job_id in client.smembers("rf:c:recancel:open"):  # what workers that read the flag earlier do
            progress.skipped("recancel", job_id.decode())
        return listing(spec)

    monkeypatch.setattr(producer.campaigns, "stored_job_ids", listing_while_workers_skip)
    run = run_campaign(spec, settings=settings)
    status = progress.status("recancel")
    assert (status["queued"], status["cancelled"], status["jobs"]) == (6, 0, 6), status
    assert (run.queued, run.submitted) == (6, 0)
    assert not progress.is_cancelled("recancel")
    assert sorted(task_ids(client)) == sorted(i.decode() for i in client.smembers("rf:c:recancel:open"))


def test_a_skip_after_the_cancel_was_lifted_records_nothing(redis_server: RedisServer) -> None:
    client, progress = redis_server.client(), submitted(redis_server, "lifted", list("ab"), window=10)
    progress.cancel("lifted")
    assert progress.skipped("lifted", "a")  # recorded: the cancel stands
    progress.resume("lifted")
    assert not progress.skipped("lifted", "b")  # a worker that read the flag before the resume
    assert client.smembers("rf:c:lifted:open") == {b"b"} and not client.exists("rf:c:lifted:cancelled")


def test_an_admit_sent_again_after_its_reply_was_lost_sends_nothing_twice(
        broker: str, redis_server: RedisServer, tmp_path: Path) -> None:
    """The connection drops after Redis ran the admit and before its reply came: redis-py sends
    it again, and the second run does nothing (each job pushed and counted once)."""
    client = redis_server.client()
    proxy = TcpProxy(redis_server.port)
    try:
        proxy.cut_reply(hashlib.sha1(ADMIT.encode()).hexdigest().encode())
        spec = write_spec(tmp_path, "twice", 4, window=10)
        run = run_campaign(spec, settings=Settings(broker_url=proxy.url()))
    finally:
        proxy.close()
    assert proxy.cut.is_set()  # the admit's reply was dropped, and the admit sent again
    assert run.submitted == 4
    assert sorted(task_ids(client)) == sorted(j.job_id for j in campaign_jobs(spec))
    assert counts(client, "twice")["submitted"] == "4" and client.scard("rf:c:twice:open") == 4


def test_a_job_open_already_is_neither_pushed_nor_counted_again(redis_server: RedisServer) -> None:
    client, progress = redis_server.client(), submitted(redis_server, "again", list("a"), window=10)
    assert progress.admit("again", [("a", "rf.q", "a"), ("b", "rf.q", "b")], ["rf.q"], "holder", "t2") == ("ok", 1)
    assert client.lrange("rf.q", 0, -1) == [b"b", b"a"]
    assert client.hget("rf:c:again:counts", "submitted") == b"2"


def test_an_admit_sent_again_after_a_job_finished_in_between_does_nothing(redis_server: RedisServer) -> None:
    """Its token marks it run: a job that finished before the admit came again is not
    opened, pushed or counted a second time."""
    client, progress = redis_server.client(), submitted(redis_server, "between", list("ab"), window=10)
    progress.finished([("between", "a")])
    assert progress.admit("between", [(i, "rf.q", i) for i in "ab"], ["rf.q"], "holder", "t1") == ("ok", 2)
    assert client.lrange("rf.q", 0, -1) == [b"b", b"a"] and client.smembers("rf:c:between:open") == {b"b"}
    status = progress.status("between")
    assert (status["submitted"], status["done"]) == (2, 1)


def test_a_feeder_that_stalled_past_its_lock_sends_nothing_more(
        broker: str, redis_server: RedisServer, tmp_path: Path) -> None:
    """It looked at its lock, stalled past the lock's expiry (another run took it over), and
    came back to send a chunk: the admit refuses it."""
    client = redis_server.client()
    spec = write_spec(tmp_path, "stalled", 4, window=10)
    with Feeder("stalled", 10, Settings(broker_url=broker)) as feeder:
        client.set("rf:c:stalled:feeder", "the run that took over", ex=100)
        with pytest.raises(FeederBusy, match="campaign='stalled': lost its feeder lock"):
            feeder.feed(campaign_jobs(spec), 4, 0, progress=False)
    assert messages(client) == [] and not client.exists("rf:c:stalled:open")
    assert client.get("rf:c:stalled:feeder") == b"the run that took over"


def test_a_feeder_that_lost_its_lock_writes_nothing_over_the_live_runs_books(
        broker: str, redis_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its lock expired while it stalled and another run took the campaign and fed it: the
    stale run's start and end marks (which would say 100 jobs, or fed when the live run is
    not) write nothing and raise FeederBusy, so status counts by the live run's books; nor can
    a stale run lift a cancel."""
    client, settings = redis_server.client(), Settings(broker_url=broker)
    spec = write_spec(tmp_path, "fenced", 4, window=10)
    stale = Feeder("fenced", 10, settings)
    try:
        client.delete("rf:c:fenced:feeder")  # expired
        with Feeder("fenced", 10, settings) as live:
            live._start(4)
            books = counts(client, "fenced")
            assert books == {"window": "10", "jobs": "4"}
            for write in (lambda: stale._start(100), stale.fed):
                with pytest.raises(FeederBusy, match="campaign='fenced': lost its feeder lock"):
                    write()
                assert counts(client, "fenced") == books
            live.feed(campaign_jobs(spec), 4, 0, progress=False)
        assert counts(client, "fenced")["fed"] == "1" and Progress(client).status("fenced")["jobs"] == 4
    finally:
        stale.__exit__()

    cancel_campaign("fenced", broker)
    checked = Progress.is_cancelled

    def taken_over_meanwhile(self: Progress, campaign: str) -> bool:
        client.set("rf:c:fenced:feeder", "the run that took over", ex=100)
        return checked(self, campaign)

    monkeypatch.setattr(Progress, "is_cancelled", taken_over_meanwhile)
    with pytest.raises(FeederBusy, match="lost its feeder lock"):
        Feeder("fenced", 10, settings)
    assert client.exists("rf:c:fenced:cancel") and client.get("rf:c:fenced:feeder") == b"the run that took over"


def test_a_cancel_between_waiting_for_room_and_the_send_stops_the_run(
        broker: str, redis_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = write_spec(tmp_path, "late", 4, window=10)
    waited = Feeder._wait_for_room

    def cancelled_right_after(self: Feeder, most: int, poll: float) -> str | None:
        stopped = waited(self, most, poll)
        cancel_campaign("late", broker)
        return stopped

    monkeypatch.setattr(Feeder, "_wait_for_room", cancelled_right_after)
    run = run_campaign(spec, settings=Settings(broker_url=broker))
    assert run.submitted == 0 and "stopped feeding: campaign late was cancelled" in run.summary()
    assert Progress(redis_server.client()).is_cancelled("late") and messages(redis_server.client()) == []


def dead_letter(client: redis.Redis, progress: Progress, campaign: str, job_id: str, message: bytes) -> str:
    """What a worker does with a job it cannot take: dead-lettered and failed for good."""
    queue = queue_name(MODEL, "float32")
    pipe = client.pipeline()
    deadletters.add(pipe, queue, "invalid job: scheduler='flow_euler': not this model's", message, job_id)
    pipe.execute()
    progress.failed(campaign, job_id, "invalid job")
    return queue


def test_a_requeued_dead_letter_is_booked_open_and_not_sent_again_by_a_run(
        broker: str, redis_server: RedisServer, tmp_path: Path) -> None:
    client, progress = redis_server.client(), Progress(redis_server.client())
    spec = write_spec(tmp_path, "letters", 3, window=10)
    settings = Settings(broker_url=broker)
    run_campaign(spec, settings=settings)
    [name] = client.scan_iter(f"{queue_name(MODEL, 'float32')}*")
    message = client.rpop(name)  # a worker took it, and refused it
    job_id = json.loads(message)["headers"]["id"]
    queue = dead_letter(client, progress, "letters", job_id, message)
    client.hset("rf:c:letters:attempts", job_id, 1)
    assert progress.status("letters")["failed"] == 1 and client.scard("rf:c:letters:open") == 2
    assert deadletters.DeadLetters(client).requeue(queue) == (1, 0)
    assert client.sismember("rf:c:letters:open", job_id) and progress.status("letters")["failed"] == 0
    assert not client.hexists("rf:c:letters:attempts", job_id)
    again = run_campaign(spec, settings=settings)  # open: left to the workers
    assert (again.queued, again.submitted) == (3, 0)
    assert sorted(task_ids(client)) == sorted(j.job_id for j in campaign_jobs(spec))

    # A run sent the job again before the letter was requeued: the letter goes, not a second copy.
    message = client.rpop(name)
    job_id = json.loads(message)["headers"]["id"]
    dead_letter(client, progress, "letters", job_id, message)
    run_campaign(spec, settings=settings)
    assert deadletters.DeadLetters(client).requeue(queue) == (0, 0)
    assert task_ids(client).count(job_id) == 1 and client.llen(deadletters.entries_key(queue)) == 0


def test_a_requeue_whose_connection_drops_loses_no_letter(broker: str, redis_server: RedisServer) -> None:
    """Each letter moves in one script: a reply lost (and the command sent again) neither loses
    a letter nor pushes one twice."""
    client = redis_server.client()
    queue = queue_name(MODEL, "float32")
    pipe = client.pipeline()
    for n in range(3):
        deadletters.add(pipe, queue, "message rejected: x", json.dumps({"n": n}).encode())
    pipe.execute()
    proxy = TcpProxy(redis_server.port)
    try:
        proxy.cut_reply(b"$4\r\nRPOP\r\n", hashlib.sha1(REQUEUE.encode()).hexdigest().encode())
        assert deadletters.DeadLetters(retrying_client(proxy.url())).requeue(queue)[1] == 0
    finally:
        proxy.close()
    assert proxy.cut.is_set()
    assert sorted(json.loads(m)["n"] for m in messages(client)) == [0, 1, 2]
    assert client.llen(deadletters.entries_key(queue)) == 0


def test_a_job_failed_for_good_leaves_no_attempts_behind(redis_server: RedisServer) -> None:
    client, progress = redis_server.client(), submitted(redis_server, "spent", list("ab"), window=10)
    assert progress.started([("spent", "a"), ("spent", "b")]) == [1, 1]
    progress.failed("spent", "a", "out of memory")
    progress.cancel("spent")
    progress.skipped("spent", "b")
    assert not client.exists("rf:c:spent:attempts")


def test_a_run_with_nothing_to_send_marks_the_campaign_fed(
        broker: str, redis_server: RedisServer, tmp_path: Path, sd_model: object) -> None:
    """The run before sent its last chunk and died before it marked the campaign fed; its jobs
    were then rendered. A run again has nothing to send, and the campaign is finished."""
    from tests.helpers import store_jobs

    client, progress = redis_server.client(), Progress(redis_server.client())
    spec = dataclasses.replace(write_spec(tmp_path, "unfed", 3, window=10), model=sd_model.ref)
    run_campaign(spec, settings=Settings(broker_url=broker))
    client.hdel("rf:c:unfed:counts", "fed")  # the run died before its last step
    jobs = list(campaign_jobs(spec))
    store_jobs(open_storage(spec.output), sd_model, jobs, [(9, 9, 9)] * len(jobs))
    progress.finished([("unfed", job.job_id) for job in jobs])
    assert not progress.status("unfed")["finished"]
    run = run_campaign(spec, settings=Settings(broker_url=broker))
    assert run.submission is None and run.already_done == 3
    assert progress.status("unfed")["finished"]


def test_a_local_manifest_keeps_a_bounded_number_of_ids(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """However large a campaign, a worker keeps the ids of its last RECENT_IDS lines; a job
    found stored when it comes back is still looked for in the whole file."""
    monkeypatch.setattr("renderfarm.manifest.RECENT_IDS", 10)
    manifest = FileManifest(open_storage(str(tmp_path)))
    line = lambda job_id: json.dumps({"job_id": job_id})  # noqa: E731
    ids = [f"{n:032x}" for n in range(100)]
    for start in range(0, 100, 5):
        manifest.append("big", "manifest.jsonl", [(i, line(i)) for i in ids[start:start + 5]])
    assert len(manifest._recent["big"].ids) == 10
    manifest.append("big", "manifest.jsonl", [(ids[-1], line(ids[-1]))])  # a recent one: not again
    assert manifest.holds("big", "manifest.jsonl", ids[0]) and not manifest.holds("big", "manifest.jsonl", "f" * 32)
    assert len(manifest._recent["big"].ids) == 10
    assert (tmp_path / "big" / "manifest.jsonl").read_text().count("\n") == 100


# --------------------------------------------------------------------------- the whole window

FEEDER = """
import sys
import producer.window
from renderfarm_cli import main

producer.window.LOCK_SECONDS = 1  # a killed run's lock expires a second later
producer.window.POLL_SECONDS = 0.05
sys.exit(main(sys.argv[1:]))
"""
# RENDERFARM_WINDOW_FAULT_JOBS=5120 runs it at ten times the size (docs/campaigns.md)
FAULT_JOBS = int(os.environ.get("RENDERFARM_WINDOW_FAULT_JOBS", "512"))
FAULT_SEED = int(os.environ.get("RENDERFARM_WINDOW_FAULT_SEED", "0"))  # replay a failure with its seed


@pytest.mark.farm
def test_a_windowed_campaign_under_faults_stores_every_job_exactly_once(
        farm: Farm, gcs: GcsEmulator, tmp_path: Path, tiny_sd: Path) -> None:
    """A campaign of FAULT_JOBS jobs (1 in 16 a scheduler the model does not run: failed for good
    and dead-lettered) fed through a window of 16 to the session's two workers, while at
    seeded random points the feeder is killed and run again, its Redis connections dropped,
    the campaign cancelled and run again, and the dead letters requeued. Then one run with no
    fault: every job that can be is stored exactly once, and the counts add up."""
    rng = random.Random(FAULT_SEED)
    name = f"faults-{FAULT_SEED}"
    rows = FAULT_JOBS // 2
    (tmp_path / "rows.jsonl").write_text("".join(
        json.dumps({"prompt": f"fault {i}", **({"scheduler": "flow_euler"} if i % 8 == 7 else {})}) + "\n"
        for i in range(rows)))
    lines = {"name": name, "model": str(tiny_sd), "output": FARM_OUT, "prompts": "rows.jsonl", "base_seed": 7,
             "images_per_prompt": 2, "width": 64, "height": 64, "steps": STEPS, "window": 16}
    (tmp_path / "spec.yaml").write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in lines.items()))
    spec = load_spec(tmp_path / "spec.yaml")
    client, progress, letters = farm.redis.client(), farm.progress, deadletters.DeadLetters(farm.redis.client())
    queue = queue_name(str(tiny_sd), "float32")
    proxy = TcpProxy(farm.redis.port)
    env = {**os.environ, "STORAGE_EMULATOR_HOST": farm.env["STORAGE_EMULATOR_HOST"], "PYTHONPATH": os.pathsep.join(
        filter(None, [str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH")]))}

    def feeder() -> subprocess.Popen:
        wait_for(lambda: not client.exists(f"rf:c:{name}:feeder"), 30, "the last run's lock to go")
        return subprocess.Popen([sys.executable, "-c", FEEDER, "campaign", "run", str(tmp_path / "spec.yaml"),
                                 "--broker", proxy.url()], env=env, cwd=tmp_path,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    faults, began = [], time.monotonic()
    try:
        run = feeder()
        for _ in range(max(8, FAULT_JOBS // 64)):
            time.sleep(rng.uniform(0.2, 2.0))
            fault = rng.choice(["kill", "drop", "cancel", "requeue"])
            faults.append(fault)
            if fault == "kill":
                run.send_signal(signal.SIGKILL)
            elif fault == "drop":
                proxy.drop_all()  # the run fails or carries on, as its client's retry allows
            elif fault == "cancel":
                cancel_campaign(name, farm.broker)
            else:
                letters.requeue(queue)
            if run.poll() is not None or fault in ("kill", "cancel"):
                run.wait(60)
                run = feeder()
        run.wait(240)  # fed to the end, stopped by a cancel, or failed by a fault
        final = feeder()
        assert final.wait(240) == 0, faults
        print(f"faults {faults}, fed at {time.monotonic() - began:.1f} s")
    finally:
        proxy.close()
    letters.requeue(queue)  # the last ones fail again: each job ends once, whatever it went through
    wait_for(lambda: progress.status(name)["finished"], 300, f"campaign {name} ({faults})")
    print(f"finished at {time.monotonic() - began:.1f} s")
    status = progress.status(name)
    jobs = list(campaign_jobs(spec))
    good = {job.job_id for job in jobs if job.scheduler != "flow_euler"}
    assert status["done"] + status["failed"] + status["cancelled"] == status["jobs"] == len(jobs), (status, faults)
    assert (status["done"], status["failed"], status["cancelled"]) == (len(good), len(jobs) - len(good), 0), faults
    ids = manifest_ids(open_storage(FARM_OUT), name)
    assert len(ids) == len(set(ids)) and set(ids) == good, faults
    pngs = {n.rsplit("/", 1)[-1].removesuffix(".png") for n in open_storage(FARM_OUT).list(f"{name}/")
            if re.fullmatch(r"[^/]+/[0-9a-f]{32}\.png", n)}
    assert pngs == stored_job_ids(spec) == good, faults
