"""The producer against a real redis-server: submit (CLI and Python API), validation before
enqueue, skipping done jobs, status, cancel, --wait, and a real Celery worker consuming what
submit wrote."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from kombu.message import Message

from harness.redis_server import RedisServer
from producer import WaitTimeout, campaign_status, submit, wait_for
from producer.submit import enqueue_jobs
from renderfarm.jobs import JobError, JobSpec, parse_job
from renderfarm.progress import FAILURES_SHOWN, QUEUES, Progress
from renderfarm.queue import (
    ENQUEUED_HEADER,
    TASK_NAME,
    job_message,
    make_app,
    queue_name,
    redis_priority,
)
from renderfarm.settings import Settings
from tests.celery_echo_app import ECHO_KEY
from tests.helpers import Cli
from worker.envelope import open_envelope

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture()
def progress(redis_server: RedisServer) -> Progress:
    return Progress(redis_server.client())


def drain(broker: str, queue: str) -> list[Message]:
    """Every message of the queue, as kombu's Redis transport delivers them (priority first)."""
    with make_app(Settings(broker_url=broker)) as app, app.connection_for_read() as connection:
        channel = connection.default_channel
        messages = []
        while (message := channel.basic_get(queue, no_ack=True)) is not None:
            messages.append(message)
        return messages


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_submit_txt_enqueues_one_celery_message_per_prompt(cli: Cli, broker: str, tmp_path: Path,
                                                           progress: Progress) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red fox\n\nun château, la nuit\r\na \"quoted\" \\ prompt\n")
    code, out, _ = cli("submit", "a lighthouse", "--prompts", prompts, "--model", "org/model",
                       "--campaign", "c1", "--seed", 10, "--steps", 4, "--priority", 7, "--broker", broker)
    assert code == 0
    assert "enqueued 4 jobs for campaign c1 on queue rf.float32.org/model" in out

    texts = ["a lighthouse", "a red fox", "un château, la nuit", 'a "quoted" \\ prompt']
    expected = [JobSpec(prompt=p, model="org/model", seed=10 + i, steps=4, campaign="c1", priority=7)
                for i, p in enumerate(texts)]
    messages = drain(broker, "rf.float32.org/model")
    assert [m.headers["id"] for m in messages] == [s.job_id for s in expected]
    for message, spec in zip(messages, expected):
        args, kwargs, _embed = message.decode()
        assert (args, parse_job(kwargs)) == ([], spec)
        assert kwargs == job_message(spec)["kwargs"]  # the fields that are set
        assert message.content_type == "application/json"
        assert message.headers["task"] == "renderfarm.render"
        assert set(message.headers) == {"task", "id", ENQUEUED_HEADER}  # a worker's door adds Flower's reprs
        assert message.properties["priority"] == redis_priority(7)
    assert progress.status("c1")["submitted"] == 4
    assert progress.r.smembers("rf:queues") == {b"rf.float32.org/model"}


def test_submit_jsonl_routes_each_job_to_its_model_queue_and_priority(broker: str, tmp_path: Path) -> None:
    rows = [{"prompt": "urgent", "priority": 9}, {"prompt": "other model", "model": "x/y", "dtype": "bfloat16"},
            {"prompt": "background", "seed": 7, "priority": 0}, {"prompt": "default"}]
    submission = submit(prompts_file=write_jsonl(tmp_path / "jobs.jsonl", rows), model="m", campaign="c2",
                        seed=0, priority=3, broker=broker)
    assert (submission.enqueued, submission.queues) == (4, ("rf.float32.m", "rf.bfloat16.x/y"))

    main = drain(broker, "rf.float32.m")
    assert [m.decode()[1]["prompt"] for m in main] == ["urgent", "default", "background"]
    assert [m.decode()[1]["seed"] for m in main] == [0, 3, 7]
    assert [m.properties["priority"] for m in main] == [redis_priority(p) for p in (9, 3, 0)]
    (other,) = drain(broker, "rf.bfloat16.x/y")
    assert parse_job(other.decode()[1]) == JobSpec(prompt="other model", model="x/y", seed=1, dtype="bfloat16",
                                                   campaign="c2", priority=3)


def stored_queues(server: RedisServer, since: float = 0.0) -> dict[bytes, list[str]]:
    """Each queue list's messages as Redis holds them, their random delivery tags and their
    enqueue times (each checked to be no earlier than `since`) blanked."""
    client, tag = server.client(), re.compile(r'"delivery_tag": "[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"')
    enqueued = re.compile(rf'"{ENQUEUED_HEADER}": ([0-9.e+-]+)')
    lists = {}
    for name in client.scan_iter("rf.*", _type="list"):
        messages = [m.decode() for m in client.lrange(name, 0, -1)]
        assert all(len(tag.findall(m)) == 1 for m in messages)
        assert all(len(times := enqueued.findall(m)) == 1 and since <= float(times[0]) <= time.time() for m in messages)
        lists[name] = [enqueued.sub(f'"{ENQUEUED_HEADER}": -', tag.sub('"delivery_tag": "-"', m)) for m in messages]
    return lists


def celery_view(item: bytes, broker: str) -> dict[str, Any]:
    """What a farm worker's Celery makes of a stored message once it passed the door: the task,
    its id, args, kwargs and the reprs Flower shows, its delivery info and priority."""
    payload = open_envelope(item)
    with make_app(Settings(broker_url=broker)) as app, app.connection_for_write() as conn:
        message = conn.default_channel.Message(payload, channel=conn.default_channel)
        args, kwargs, embed = message.decode()
    headers = message.headers
    return {"task": headers["task"], "id": headers["id"], "args": args, "kwargs": kwargs, "embed": embed,
            "argsrepr": headers["argsrepr"], "kwargsrepr": headers["kwargsrepr"],
            "routing_key": message.delivery_info["routing_key"], "priority": message.properties["priority"]}


def test_a_job_is_read_as_celery_and_kombu_would_write_it_in_less_than_half_the_bytes(
        broker: str, redis_server: RedisServer) -> None:
    """Submit fills in per-queue templates of only what a worker reads rather than running
    as_task_v2 and kombu's publish per job: past the worker's door, Celery must read the same
    job as from `send_task`'s message (task, id, fields, Flower's reprs, routing, priority), in
    the same priority lists and order, from less than half the bytes."""
    specs = [JobSpec(prompt='un château "q" \\ ☃ it\'s', model="org/m", seed=3, steps=4, width=512,
                     campaign="c1", priority=7),
             JobSpec(prompt="b", model="org/m", seed=4, guidance_scale=0.0, campaign="c1"),
             JobSpec(prompt="urgent", model="org/m", seed=5, scheduler="ddim", campaign="c1", priority=9),
             JobSpec(prompt="other", model="x/y", seed=6, dtype="bfloat16", campaign="c2", priority=0),
             JobSpec(prompt="b2", model="org/m", seed=8, campaign="c1"),
             # a kwargsrepr past Celery's size limit: cut as Celery's saferepr cuts it
             JobSpec(prompt="p" * 10_000, negative_prompt="n" * 10_000, model="org/m", seed=7, campaign="c1")]
    client, started = redis_server.client(), time.time()
    enqueue_jobs(specs, Settings(broker_url=broker))
    stored_queues(redis_server, since=started)  # each with its enqueue time
    ours = {name: client.lrange(name, 0, -1) for name in client.scan_iter("rf.*", _type="list")}

    client.flushall()
    with make_app(Settings(broker_url=broker)) as app, app.producer_or_acquire() as producer:
        for spec in specs:
            m = job_message(spec)
            shown = repr(m["kwargs"])  # the door's repr: Celery's saferepr (30x a repr) only to cut it
            app.send_task(TASK_NAME, task_id=m["task_id"], kwargs=m["kwargs"], queue=m["queue"],
                          priority=m["priority"], producer=producer,
                          kwargsrepr=shown if len(shown) <= app.amqp.kwargsrepr_maxsize else None)
    theirs = {name: client.lrange(name, 0, -1) for name in client.scan_iter("rf.*", _type="list")}
    assert sorted(ours) == sorted(theirs) and sorted(len(v) for v in ours.values()) == [1, 1, 1, 3]  # queue x priority
    views = []
    for name, messages in ours.items():
        views += [celery_view(m, broker) for m in messages]
        assert views[-len(messages):] == [{**celery_view(m, broker), "embed": {}} for m in theirs[name]]  # in order
    by_id = {s.job_id: s for s in specs}  # every field of every job:
    assert sorted(v["id"] for v in views) == sorted(by_id) and all(parse_job(v["kwargs"]) == by_id[v["id"]]
                                                                    for v in views)
    sizes = [(len(m), len(t)) for name in ours for m, t in zip(ours[name], theirs[name])]
    assert all(size < 0.5 * send_task_size for size, send_task_size in sizes[:-1]), sizes  # the long one aside


BAD_LINES = {
    "malformed JSON": ('{"prompt": "a cat",', "line",
                       "must be a JSON object (Expecting property name enclosed in double quotes)"),
    "bad field": ('{"prompt": "a cat", "steps": 0}', "steps", "must be in 1..500"),
}


@pytest.mark.parametrize("case", list(BAD_LINES))
def test_a_bad_line_enqueues_nothing_and_names_line_field_value_rule(
        case: str, cli: Cli, broker: str, tmp_path: Path, redis_server: RedisServer) -> None:
    line, field, rule = BAD_LINES[case]
    path = tmp_path / "jobs.jsonl"
    good = "".join(json.dumps({"prompt": f"good {i}"}) + "\n" for i in range(2500))  # > 2 chunks
    path.write_text(good + line + "\n" + json.dumps({"prompt": "after"}) + "\n")

    with pytest.raises(JobError) as caught:
        submit(prompts_file=path, model="m", campaign="bad", broker=broker)
    assert (caught.value.line, caught.value.field, caught.value.rule) == (2501, field, rule)
    code, _, err = cli("submit", "--prompts", path, "--model", "m", "--campaign", "bad", "--broker", broker)
    assert code == 2
    value = repr(0) if field == "steps" else "'{\"prompt\": \"a cat\",'"
    assert f"line 2501: {field}={value}: {rule}" in err
    assert redis_server.client().dbsize() == 0  # not a message, not a binding, not a counter


def test_submit_without_jobs_is_an_error(broker: str) -> None:
    with pytest.raises(JobError, match="give at least one PROMPT"):
        submit([], model="m", broker=broker)


def test_resubmitting_skips_jobs_already_done(cli: Cli, broker: str, progress: Progress) -> None:
    first = submit([f"prompt {i}" for i in range(5)], model="m", campaign="again", seed=0, broker=broker)
    specs = [JobSpec(prompt=f"prompt {i}", model="m", seed=i, campaign="again") for i in range(5)]
    progress.finished([("again", specs[0].job_id)])
    progress.finished([("again", specs[3].job_id)])
    progress.failed("again", specs[1].job_id, "device lost")

    code, out, _ = cli("submit", *(f"prompt {i}" for i in range(5)), "--model", "m", "--campaign", "again",
                       "--seed", 0, "--broker", broker)
    assert code == 0
    assert "enqueued 3 jobs" in out and "skipped 2 jobs already done" in out
    ids = [m.headers["id"] for m in drain(broker, queue_name("m", "float32"))]
    assert ids == [s.job_id for s in specs] + [specs[i].job_id for i in (1, 2, 4)]
    status = progress.status("again")
    assert (first.enqueued, status["submitted"], status["done"], status["failed"]) == (5, 5, 2, 0)
    progress.finished([("again", specs[i].job_id) for i in (1, 2, 4)])  # the campaign finished: none is sent
    again = submit([f"prompt {i}" for i in range(5)], model="m", campaign="again", seed=0, broker=broker)
    assert (again.enqueued, again.already_done) == (0, 5)


def test_a_job_given_twice_is_sent_once(broker: str, tmp_path: Path) -> None:
    rows = [{"prompt": "same", "seed": 1}, {"prompt": "other", "seed": 1}, {"prompt": "same", "seed": 1}]
    submission = submit(prompts_file=write_jsonl(tmp_path / "dup.jsonl", rows), model="m", broker=broker)
    assert (submission.enqueued, submission.duplicates) == (2, 1)
    assert len(drain(broker, "rf.float32.m")) == 2


def test_status_in_a_process_whose_redis_restarted(cli: Cli, broker: str, redis_server: RedisServer) -> None:
    """A long-lived process (a notebook, a dashboard) asks again after Redis restarted: the
    connections kombu pooled for the first call are dead sockets, and must not fail the second."""
    submit(["a"], model="some/model", campaign="rs", seed=0, broker=broker)
    assert cli("status", "rs", "--json", "--broker", broker)[0] == 0
    redis_server.stop()
    redis_server.start()  # without its data: the queue is named again, so the workers are asked
    redis_server.client().sadd(QUEUES, "rf.float32.some/model")
    code, out, err = cli("status", "rs", "--json", "--broker", broker)
    assert code == 0, err
    assert [queue["name"] for queue in json.loads(out)["queues"]] == ["rf.float32.some/model"]


def test_status_reports_counts_failures_and_queues_nobody_consumes(cli: Cli, broker: str,
                                                                   progress: Progress) -> None:
    submit(["a", "b", "c"], model="some/model", campaign="st", seed=0, broker=broker)
    specs = [JobSpec(prompt=p, model="some/model", seed=i, campaign="st") for i, p in enumerate("abc")]
    progress.finished([("st", specs[0].job_id)])
    progress.failed("st", specs[1].job_id, "out of memory")

    code, out, _ = cli("status", "st", "--json", "--broker", broker)
    assert code == 0
    report = json.loads(out)
    assert {k: report[k] for k in ("submitted", "queued", "running", "done", "failed", "cancelled")} == \
        {"submitted": 3, "queued": 1, "running": 0, "done": 1, "failed": 1, "cancelled": 0}
    assert report["failures"] == {specs[1].job_id: "out of memory"}
    assert report["queues"] == [{"name": "rf.float32.some/model", "jobs": 3, "consumers": 0, "dead_letters": 0}]
    warning = "queue rf.float32.some/model has 3 jobs and no worker consumes it"
    assert report["warnings"] == [warning]

    code, out, _ = cli("status", "st", "--broker", broker)
    assert code == 0
    assert f"warning: {warning}" in out and f"{specs[1].job_id}: out of memory" in out


def commands(server: RedisServer, *names: str) -> int:
    """How many of these commands Redis has run (a script's own calls count under their names)."""
    stats = server.client().info("commandstats")
    return sum(stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in names)


def test_status_counts_every_failure_and_reads_only_a_sample(cli: Cli, broker: str, redis_server: RedisServer,
                                                             progress: Progress) -> None:
    """A campaign with more failures than status shows: the count is every one (HLEN), the
    reasons a sample of at most FAILURES_SHOWN (never the whole hash, which a followed run
    would read every second), and `--failures` streams them all. `submit --wait` counts its
    own failed jobs in Redis, whichever of its set and the failed hash is larger."""
    ids = [f"job-{n:04d}" for n in range(FAILURES_SHOWN * 3 + 7)]
    progress.submitted("many", ids, "rf.q")
    for job_id in ids:
        progress.failed("many", job_id, f"out of memory at {job_id}")
    whole = commands(redis_server, "hgetall", "hkeys", "hvals")
    report = progress.status("many")
    assert commands(redis_server, "hgetall", "hkeys", "hvals") - whole == 3  # times, counts, scores
    assert (report["failed"], len(report["failures"]), report["failures_cut"]) == (len(ids), FAILURES_SHOWN, True)
    assert all(reason == f"out of memory at {job_id}" and job_id in ids
               for job_id, reason in report["failures"].items())
    assert report["queued"] == 0 and report["finished"]
    progress.submitted("few", ["a"], "rf.q")
    progress.failed("few", "a", "out of memory")
    few = progress.status("few")
    assert (few["failed"], few["failures"], few["failures_cut"]) == (1, {"a": "out of memory"}, False)

    code, out, _ = cli("status", "many", "--broker", broker)
    assert code == 0 and f"failures ({len(ids)}):" in out
    assert f"... and {len(ids) - 10} more (renderfarm status many --failures lists all)" in out
    code, out, _ = cli("status", "many", "--failures", "--broker", broker)
    assert code == 0 and sorted(out.splitlines()) == [f"{job_id}: out of memory at {job_id}" for job_id in ids]
    code, out, _ = cli("status", "many", "--failures", "--json", "--broker", broker)
    assert sorted(json.loads(line)["job_id"] for line in out.splitlines()) == ids

    for jobs in (["a lighthouse"], [f"lighthouse {n}" for n in range(len(ids) + 1)]):  # fewer, more than failed
        submission = submit(jobs, model="m", campaign="many", seed=0, broker=broker)
        mine = [JobSpec(prompt=p, model="m", seed=i, campaign="many").job_id for i, p in enumerate(jobs)]
        progress.failed("many", mine[0], "bad luck")
        progress.finished([("many", job_id) for job_id in mine[1:]])
        whole = commands(redis_server, "hgetall", "hkeys", "hvals", "smismember")
        assert wait_for(submission, timeout=10, progress=False, poll=0.05) == \
            {"done": len(jobs) - 1, "failed": 1, "cancelled": 0}
        assert commands(redis_server, "hgetall", "hkeys", "hvals", "smismember") == whole


def test_status_of_a_finished_campaign_shows_its_totals(cli: Cli, broker: str, progress: Progress) -> None:
    submit(["a", "b", "c"], model="m", campaign="fin", seed=0, broker=broker)
    specs = [JobSpec(prompt=p, model="m", seed=i, campaign="fin") for i, p in enumerate("abc")]
    progress.finished([("fin", specs[0].job_id)])
    code, out, _ = cli("status", "fin", "--broker", broker)
    assert "ETA" in out and "finished" not in out  # two jobs still queued

    progress.finished([("fin", s.job_id) for s in specs[1:]])
    code, out, _ = cli("status", "fin", "--json", "--broker", broker)
    report = json.loads(out)
    assert report["finished"] and report["elapsed_seconds"] > 0
    code, out, _ = cli("status", "fin", "--broker", broker)
    assert code == 0
    assert re.search(r"finished +3 images in \d+:\d\d:\d\d, [\d.]+ images/s", out), out
    assert "rate" not in out and "ETA" not in out


def test_status_shows_device_time_and_the_cost_per_1000_images(cli: Cli, broker: str, progress: Progress,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers report each image's share of its batch's device time; a job finished twice (a
    redelivery after it was stored) counts once; with a price per device-hour, status gives
    the cost per 1,000 images."""
    submit(["a", "b", "c"], model="m", campaign="cost", seed=0, broker=broker)
    ids = [("cost", JobSpec(prompt=p, model="m", seed=i, campaign="cost").job_id) for i, p in enumerate("abc")]
    progress.finished(ids[:2], [1.5, 2.1])
    progress.finished(ids[:1], [1.5])  # redelivered
    progress.finished(ids[2:], [2.4])
    report = progress.status("cost")
    assert report["device_seconds"] == pytest.approx(6.0)
    assert report["images_per_device_hour"] == pytest.approx(3 * 3600 / 6.0)
    code, out, _ = cli("status", "cost", "--broker", broker)
    assert code == 0 and "0.002 device-hours, 1,800 images per device-hour" in out and "cost" not in out.split("\n", 1)[1]
    monkeypatch.setenv("RENDERFARM_PRICE_PER_DEVICE_HOUR", "1.2")
    code, out, _ = cli("status", "cost", "--json", "--broker", broker)
    assert json.loads(out)["cost_per_1000_images"] == pytest.approx(1000 * 1.2 / 1800)
    code, out, _ = cli("status", "cost", "--price-per-device-hour", 3.6, "--broker", broker)  # the flag wins
    assert "cost         2.0000 per 1,000 images at 3.6 per device-hour" in out
    for value, name in (("-1", "--price-per-device-hour"), ("nan", "--price-per-device-hour")):
        code, _, err = cli("status", "cost", "--price-per-device-hour", value, "--broker", broker)
        assert code == 2 and f"{name}={float(value)!r}: must be a finite number >= 0" in err
    monkeypatch.setenv("RENDERFARM_PRICE_PER_DEVICE_HOUR", "cheap")
    code, _, err = cli("status", "cost", "--broker", broker)
    assert code == 2 and "RENDERFARM_PRICE_PER_DEVICE_HOUR='cheap': must be a finite number >= 0" in err


def test_cancel_sets_the_flag_and_skipped_jobs_show_cancelled(cli: Cli, broker: str, progress: Progress) -> None:
    submit(["a", "b"], model="m", campaign="cx", seed=0, broker=broker)
    code, out, _ = cli("cancel", "cx", "--broker", broker)
    assert code == 0
    assert "campaign cx cancelled: workers skip its 2 queued jobs" in out
    assert progress.is_cancelled("cx")
    for i, prompt in enumerate("ab"):  # what the worker does with each queued job
        progress.skipped("cx", JobSpec(prompt=prompt, model="m", seed=i, campaign="cx").job_id)
    status = progress.status("cx")
    assert (status["queued"], status["cancelled"], status["cancel_requested"]) == (0, 2, True)

    again = submit(["c"], model="m", campaign="cx", broker=broker)
    assert again.resumed == ("cx",) and not progress.is_cancelled("cx")
    assert "lifted the cancel" in again.summary()


def test_wait_times_out_when_nothing_consumes(cli: Cli, broker: str) -> None:
    started = time.monotonic()
    code, out, err = cli("submit", "a cat", "--model", "nobody/serves", "--campaign", "w", "--wait",
                         "--timeout", 1, "--broker", broker)
    assert code == 1
    assert "enqueued 1 jobs" in out
    assert "timed out after 1 s: 0 of 1 jobs finished" in err
    assert "warning: queue rf.float32.nobody/serves has 1 jobs and no worker consumes it" in err
    assert time.monotonic() - started < 10


def test_wait_follows_exactly_the_jobs_of_its_submission(broker: str, progress: Progress) -> None:
    submit(["older"], model="m", campaign="wf", seed=100, broker=broker)  # never finishes
    submission = submit(["a", "b", "c"], model="m", campaign="wf", seed=0, broker=broker)
    ids = [JobSpec(prompt=p, model="m", seed=i, campaign="wf").job_id for i, p in enumerate("abc")]

    def worker() -> None:
        time.sleep(0.2)
        progress.finished([("wf", ids[0])])
        progress.failed("wf", ids[1], "bad luck")
        progress.cancel("wf")  # a worker skips a job only while its campaign is cancelled
        progress.skipped("wf", ids[2])

    thread = threading.Thread(target=worker)
    thread.start()
    assert wait_for(submission, timeout=10, progress=False, poll=0.05) == \
        {"done": 1, "failed": 1, "cancelled": 1}
    thread.join()
    with pytest.raises(WaitTimeout, match="0 of 1 jobs finished"):
        submit(["more"], model="m", campaign="wf", broker=broker, wait=True, timeout=0.1, progress=False)


def test_a_real_celery_worker_consumes_submitted_jobs_intact_and_by_priority(
        broker: str, tmp_path: Path, redis_server: RedisServer) -> None:
    rows = [{"prompt": "low", "priority": 0}, {"prompt": "top", "priority": 9},
            {"prompt": "mid", "priority": 5, "negative_prompt": "blurry", "width": 640, "guidance_scale": 3.25},
            {"prompt": "default, é 日本 \\ \"q\""}, {"prompt": "top again", "priority": 9, "seed": 4_000_000_000},
            {"prompt": "two", "priority": 2, "scheduler": "ddim", "steps": 3}]
    submission = submit(prompts_file=write_jsonl(tmp_path / "echo.jsonl", rows), model="echo/model",
                        campaign="echo", seed=0, broker=broker)
    (queue,) = submission.queues
    specs = [JobSpec(**{"model": "echo/model", "campaign": "echo", "seed": i, **row}) for i, row in enumerate(rows)]
    urgency = [9 - redis_priority(s.priority) for s in specs]
    expected = [specs[i] for i in sorted(range(len(specs)), key=lambda i: -urgency[i])]  # stable

    log = (tmp_path / "worker.log").open("w")
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "tests.celery_echo_app", "worker", "--pool", "solo",
         "-Q", queue, "--prefetch-multiplier", "1", "--without-gossip", "--without-mingle",
         "--loglevel", "warning", "--hostname", f"echo-{redis_server.port}@%h"],
        cwd=REPO, env={**os.environ, "RENDERFARM_BROKER_URL": broker, "PYTHONPATH": str(REPO)},
        stdout=log, stderr=subprocess.STDOUT)
    try:
        client = redis_server.client()
        deadline = time.monotonic() + 60
        while client.llen(ECHO_KEY) < len(rows) and worker.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        records = [json.loads(r) for r in client.lrange(ECHO_KEY, 0, -1)]
        assert len(records) == len(rows), (tmp_path / "worker.log").read_text()
        assert [r["id"] for r in records] == [s.job_id for s in expected]
        assert [r["job"] for r in records] == [job_message(s)["kwargs"] for s in expected]
        assert [parse_job(r["job"]) for r in records] == expected
        assert [r["kwargsrepr"] for r in records] == [None] * len(rows)  # stock Celery: no door, no repr
        assert {r["queue"] for r in records} == {queue}

        report = campaign_status("echo", broker)  # the live worker answers: it consumes the queue
        assert report["queues"] == [{"name": queue, "jobs": 0, "consumers": 1, "dead_letters": 0}]
        assert report["warnings"] == []
    finally:
        worker.terminate()
        try:
            worker.wait(timeout=20)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
        log.close()


def test_broker_down_is_a_clear_error(cli: Cli) -> None:
    code, _, err = cli("status", "c", "--broker", "redis://127.0.0.1:1/0")
    assert code == 1
    assert "renderfarm: error: broker redis://127.0.0.1:1/0:" in err


def test_the_producer_side_never_imports_jax() -> None:
    check = ("import sys, producer, producer.commands, producer.status, producer.submit; "
             "sys.exit(any(m == 'jax' or m.startswith('jax.') for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", check], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                          timeout=60).returncode == 0
