"""A worker nothing can knock over: hostile messages, faults at chosen points, store failures,
a drain under load, new shapes compiling while messages are held.

Real parts throughout: redis-server, `renderfarm worker` processes, the google-cloud-storage
client against the emulator. Each fault strikes where the test decides, through a proxy in
front of the emulator or of Redis (harness/fault_proxies.py), so no assertion depends on how
fast the worker happens to be.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from PIL import Image
from celery.result import AsyncResult

from harness.farm import (
    WorkerProcess,
    enqueue,
    farm_app,
    jobs,
    manifest_ids,
    wait_done,
    wait_for,
)
from harness.redis_server import RedisServer
from renderfarm import deadletters
from renderfarm.jobs import JobSpec
from renderfarm.layout import image_name, sidecar_name, write_check_name
from producer.campaigns import load_spec, run_campaign
from renderfarm.progress import Progress
from renderfarm.settings import Settings
from renderfarm.sources import SourceRoots
from renderfarm.queue import (
    TASK_NAME,
    job_message,
    priority_list,
    priority_lists,
    queue_name,
    redis_priority,
)
from renderfarm.storage import Storage, open_storage
from harness.fault_proxies import GcsProxy, Rule, TcpProxy
from harness.gcs_emulator import GcsEmulator

REDIS_APPENDONLY = True  # tests/conftest.py
BUCKET = "faults"
OUT = f"gs://{BUCKET}/out"
ENV = {"RENDERFARM_VISIBILITY_TIMEOUT": "5", "RENDERFARM_RESTORE_INTERVAL": "1", "RENDERFARM_MAX_ATTEMPTS": "2"}


@pytest.fixture(scope="module")
def proxy(gcs_server: GcsEmulator) -> Iterator[GcsProxy]:
    gcs_server.create_bucket(BUCKET)
    gcs = GcsProxy(gcs_server.url)
    yield gcs
    gcs.close()


@pytest.fixture()
def start_worker(redis_server: RedisServer, proxy: GcsProxy, gcs: GcsEmulator, tiny_sd: Path,
         tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    """Start workers for a copy of the tiny model (its own queue, so each test sees only its
    own jobs) that store through the proxy; all are stopped after the test."""
    redis_server.client().flushall()
    started: list[WorkerProcess] = []

    def start(model: Path, name: str, broker: str | None = None, env: dict[str, str] | None = None,
              extra: tuple[str, ...] = (), ready: bool = True) -> WorkerProcess:
        worker = WorkerProcess(model, OUT, broker or redis_server.url, name, tmp_path,
                               {**ENV, "STORAGE_EMULATOR_HOST": proxy.url, **(env or {})}, extra=extra)
        started.append(worker)
        if ready:
            worker.wait_ready(farm_app(redis_server.url))
        return worker

    yield start
    for worker in started:
        worker.stop()
    for rule in list(proxy.rules):
        proxy.remove(rule)


def model_copy(tiny_sd: Path, tmp_path: Path, name: str) -> Path:
    model = tmp_path / name
    shutil.copytree(tiny_sd, model)
    return model




def bucket() -> Storage:
    return open_storage(OUT)


def assert_exactly_once(specs: list[JobSpec]) -> None:
    """Every job's PNG and sidecar stored, and one manifest line per job."""
    storage, campaign = bucket(), specs[0].campaign
    for spec in specs:
        assert storage.exists(image_name(campaign, spec.job_id)) and storage.exists(sidecar_name(campaign, spec.job_id))
    assert sorted(manifest_ids(storage, campaign)) == sorted(s.job_id for s in specs)




def attempts(r: redis.Redis, specs: list[JobSpec]) -> list[int]:
    return [int(n or 0) for n in r.hmget(f"rf:c:{specs[0].campaign}:attempts", [s.job_id for s in specs])]


def queued(r: redis.Redis, model: Path) -> int:
    return sum(r.llen(name) for name in priority_lists(queue_name(str(model), "float32")))


# --------------------------------------------------------------------------- hostile messages


def body(args: Any, kwargs: Any, embed: Any) -> str:
    return base64.b64encode(json.dumps([args, kwargs, embed]).encode()).decode()


def with_body(text: bytes) -> Callable[[dict], None]:
    def mutate(m: dict) -> None:
        m["body"] = base64.b64encode(text).decode()
    return mutate


def job_field(**fields: Any) -> Callable[[dict], None]:
    """Change job fields inside the message's body (the JSON encoder writes NaN and huge
    integers as JSON allows Python to read them)."""
    def mutate(m: dict) -> None:
        args, kwargs, embed = json.loads(base64.b64decode(m["body"]))
        kwargs.update(fields)
        m["body"] = body(args, kwargs, embed)
    return mutate


def text_body(text: str) -> Callable[[dict], None]:
    """The body as JSON text (no body_encoding), as the farm's producer sends it."""
    def mutate(m: dict) -> None:
        del m["properties"]["body_encoding"]
        m["body"] = text
    return mutate


def setter(*path: str, value: Any = None, delete: bool = False) -> Callable[[dict], None]:
    def mutate(m: dict) -> None:
        target = m
        for key in path[:-1]:
            target = target[key]
        if delete:
            del target[path[-1]]
        else:
            target[path[-1]] = value
    return mutate


def raw(text: bytes) -> bytes:
    return text


# kind -> (mutation of a real message, or raw bytes; what the dead letter's reason says)
ENVELOPE: dict[str, tuple[Callable[[dict], None] | bytes, str]] = {
    "body-not-base64": (setter("body", value="!!! not base64 !!!"), "body='!!! not base64 !!!': must be base64"),
    "body-encoding-unknown": (setter("properties", "body_encoding", value="rot13"), "properties.body_encoding='rot13'"),
    # no body_encoding: the body is read as JSON text, and this one is base64
    "body-encoding-missing": (setter("properties", "body_encoding", delete=True), "body='W1td"),
    "task-id-list": (setter("headers", "id", value=["a", "b"]), "headers.id=['a', 'b']"),
    "task-id-int": (setter("headers", "id", value=7), "headers.id=7"),
    "task-id-missing": (setter("headers", "id", delete=True), "headers.id=None"),
    "task-id-surrogate": (setter("headers", "id", value="\ud800"), "headers.id='\\ud800': must be valid Unicode"),
    "headers-not-object": (setter("headers", value="x"), "headers='x': must be a JSON object"),
    "task-other": (setter("headers", "task", value="celery.backend_cleanup"), "headers.task='celery.backend_cleanup'"),
    "task-missing": (setter("headers", "task", delete=True), "headers.task=None"),
    "pickle": (setter("content-type", value="application/x-python-serialize"),
               "content-type='application/x-python-serialize'"),
    "content-encoding-binary": (setter("content-encoding", value="binary"), "content-encoding='binary'"),
    "body-bad-json": (with_body(b"{not json"), "body='{not json': must be JSON that kombu decodes"),
    "body-object": (with_body(b'{"a": 1}'), "body={'a': 1}: must be Celery's [args, kwargs, embed]"),
    "body-two-items": (with_body(b"[[], {}]"), "body=[[], {}]: must be Celery's [args, kwargs, embed]"),
    "kwargs-list": (with_body(b"[[], [1], {}]"), "body.kwargs=[1]: must be a JSON object"),
    "callbacks": (with_body(b'[[], {}, {"callbacks": [{"task": "os.system"}]}]'), "body.embed.callbacks"),
    "body-not-utf8": (with_body(b"\xff\xfe\xfd"), "must be UTF-8"),
    "body-huge-int": (with_body(b'[[], {"seed": ' + b"9" * 5000 + b"}, {}]"),
                      "must be JSON that kombu decodes (ValueError: Exceeds"),
    "properties-missing": (setter("properties", delete=True), "properties=None: must be a JSON object"),
    "delivery-tag-int": (setter("properties", "delivery_tag", value=12), "properties.delivery_tag=12"),
    "delivery-info-missing": (setter("properties", "delivery_info", delete=True), "properties.delivery_info=None"),
    "priority-text": (setter("properties", "priority", value="high"), "properties.priority='high'"),
    "eta": (setter("headers", "eta", value="2999-01-01T00:00:00"), "headers.eta='2999-01-01T00:00:00'"),
    "retries-text": (setter("headers", "retries", value="many"), "headers.retries='many'"),
    "retries-huge": (setter("headers", "retries", value=10**400), "headers.retries=<integer of"),
    "timelimit-three": (setter("headers", "timelimit", value=[1, 2, 3]), "headers.timelimit=[1, 2, 3]"),
    "kwargsrepr-object": (setter("headers", "kwargsrepr", value={"x": 1}), "headers.kwargsrepr={'x': 1}"),
    "not-json": (b"\x00\x01 garbage", "message=b'\\x00\\x01 garbage': must be JSON that kombu decodes"),
    "json-list": (b"[1, 2, 3]", "message=[1, 2, 3]: must be a JSON object"),
    "nested": (b"[" * 100_000 + b"]" * 100_000, "must be JSON that kombu decodes (RecursionError"),
    "two-megabytes": (b"x" * (2 << 20), "must be at most 1048576 bytes"),
    # kombu's JSON object hook (kombu.utils.json) raises on these, where Celery would log the
    # message and acknowledge it: refused at the door, so each gets its dead letter
    "body-unknown-type": (job_field(prompt={"__type__": "nope", "__value__": 1}),
                          "must be JSON that kombu decodes (ValueError: ('Unsupported type', <class 'type'>, "
                          "{'__type__': 'nope'"),
    "body-bad-datetime": (job_field(prompt={"__type__": "datetime", "__value__": "not a date"}),
                          "(ValueError: Invalid isoformat string: 'not a date')"),
    "header-unknown-type": (setter("headers", "rf_note", value={"__type__": "gone", "__value__": 1}),
                            "{'__type__': 'gone', '__value__': 1})"),
    # kombu's Message encodes a text body to UTF-8 before it decodes it
    "text-body-surrogate": (text_body('[[], {"prompt": "\ud800"}, {}]'),
                            "must be valid Unicode (surrogates not allowed at 17)"),
    "compressed": (setter("headers", "compression", value="application/x-gzip"),
                   "headers.compression='application/x-gzip': must be null (render jobs are sent uncompressed)"),
}
JOB = {
    "guidance-400-digits": (job_field(guidance_scale=10**400), "guidance_scale=<integer of 1329 bits>: must be finite"),
    "guidance-nan": (job_field(guidance_scale=float("nan")), "guidance_scale=nan: must be finite"),
    "guidance-text": (job_field(guidance_scale="7.5"), "guidance_scale='7.5': must be a number"),
    "seed-negative": (job_field(seed=-1), "seed=-1: must be in 0..4294967295"),
    "seed-float": (job_field(seed=1.5), "seed=1.5: must be an integer"),
    "steps-bool": (job_field(steps=True), "steps=True: must be an integer"),
    "prompt-surrogate": (job_field(prompt="a \ud800 fox"), "must be valid Unicode (lone surrogate at 2)"),
    "negative-surrogate": (job_field(negative_prompt="\udfff"), "negative_prompt='\\udfff': must be valid Unicode"),
    "prompt-nested": (job_field(prompt=[[[[["deep"]]]]]), "prompt=[[[...]]]: must be a string"),
    "prompt-long": (job_field(prompt="x" * 200_000), "must be at most 10000 characters"),
    "campaign-path": (job_field(campaign="../etc"), "campaign='../etc': must match"),
    "unknown-field": (job_field(colour="red"), "colour='red': unknown field"),
    "other-model": (job_field(model="someone/else"), "model='someone/else': this engine serves"),
    "width-odd": (job_field(width=100), "width=100: must be a multiple of 16"),
    "scheduler-unknown": (job_field(scheduler="heun"), "scheduler='heun': must be one of"),
    "positional": (lambda m: m.update(body=body(["a fox"], {}, {})), "args=['a fox']: a job has keyword fields only"),
    # a well-formed kombu object: the door and Celery decode it to a UUID, which the contract refuses
    "prompt-uuid": (job_field(prompt={"__type__": "uuid", "__value__": {"hex": "12345678" * 4}}),
                    "prompt=UUID('12345678-1234-5678-1234-567812345678'): must be a string"),
    # a valid job its campaign never sent: refused, and nothing of the campaign is written
    "never-submitted": (job_field(seed=123_456), "campaign='hostile-bad': never sent this job"),
    # a message naming another queue: its letter is kept in the queue it was popped from
    "routing-key-elsewhere": (lambda m: (setter("properties", "delivery_info", "routing_key", value="x" * 200_000)(m),
                                         job_field(steps=0)(m)), "steps=0: must be in 1..500"),
}


def real_message(app: Celery, r: redis.Redis, spec: JobSpec) -> dict[str, Any]:
    """A message as a producer sends it, read back from Redis."""
    queue = queue_name(spec.model, spec.dtype)
    app.send_task(TASK_NAME, **job_message(spec))
    item = r.rpop(priority_list(queue, redis_priority(spec.priority)))
    return json.loads(item)


def hostile(template: dict[str, Any], mutation: Callable[[dict], None] | bytes, kind: str) -> bytes:
    if isinstance(mutation, bytes):
        return mutation
    message = copy.deepcopy(template)
    message["properties"]["delivery_tag"] = str(uuid.uuid4())
    message["headers"]["id"] = kind
    mutation(message)
    return json.dumps(message).encode()


@pytest.mark.farm
def test_hostile_messages_are_dead_lettered_with_reasons_and_every_good_job_lands(
        start_worker: Callable[..., WorkerProcess], tiny_sd: Path, tmp_path: Path, redis_server: RedisServer) -> None:
    model = model_copy(tiny_sd, tmp_path, "hostile")
    r, app, progress = redis_server.client(), farm_app(redis_server.url), Progress(redis_server.client())
    queue = queue_name(str(model), "float32")
    template = real_message(app, r, jobs(model, "hostile-bad", 1, seed=10_000)[0])
    good = jobs(model, "hostile", 16)
    kinds = {**ENVELOPE, **JOB}
    assert len(kinds) >= 30
    target = priority_list(queue, redis_priority(None))
    for i, (kind, (mutation, _)) in enumerate(kinds.items()):
        r.lpush(target, hostile(template, mutation, kind))
        if i % 3 == 0 and good:
            enqueue(app, progress, [good.pop()])
    enqueue(app, progress, good)
    good = jobs(model, "hostile", 16)
    worker = start_worker(model, "hostile")
    pid = worker.proc.pid
    letters = deadletters.DeadLetters(r)
    wait_for(lambda: letters.counts().get(queue, {}).get("total", 0) >= len(kinds), 120, "every hostile message")
    status = wait_done(progress, "hostile", 16)
    assert (status["done"], status["failed"]) == (16, 0)
    assert_exactly_once(good)
    assert worker.proc.poll() is None and worker.proc.pid == pid
    assert "Traceback" not in worker.log.read_text()

    entries = letters.entries(queue, limit=1000)
    assert letters.counts()[queue] == {"total": len(kinds), "kept": len(kinds)}
    reasons = [entry["reason"] for entry in entries]
    for kind, (_, expected) in kinds.items():
        matching = [reason for reason in reasons if expected in reason]
        assert len(matching) == 1, (kind, expected, reasons)
    assert sum(reason.startswith("message rejected: ") for reason in reasons) == len(ENVELOPE)
    assert sum(reason.startswith("invalid job: ") for reason in reasons) == len(JOB)
    for kind, (_, expected) in JOB.items():  # a job's failure is its result too (Flower shows it)
        result = AsyncResult(kind, app=app)
        wait_for(lambda res=result: res.state == "FAILURE", 30, f"{kind} to fail")
        assert expected in str(result.result), (kind, result.result)
    assert r.hlen("unacked") == 0 and queued(r, model) == 0
    assert set(letters.counts()) == {queue} and r.keys("rf:c:hostile-bad:*") == []
    assert max(len(name) for name in r.keys("*")) < 1000  # no key named from a message


def test_the_door_refuses_each_hostile_envelope_and_decodes_as_kombu_does(redis_server: RedisServer) -> None:
    """Each ENVELOPE kind is refused by worker.envelope with its reason, no worker needed; each
    JOB kind passes it (the job contract refuses it later). The door's decoder is the one kombu
    decodes JSON bodies and unacked records with, so a kombu object in a job's fields reaches
    the contract as kombu makes it: a UUID, not a string."""
    import kombu.transport.redis
    import kombu.utils.json
    from kombu.serialization import registry

    from renderfarm.jobs import JobError, parse_job
    from worker.envelope import Rejected, open_envelope

    assert registry._decoders["application/json"] is kombu.utils.json.loads is kombu.transport.redis.loads
    template = real_message(farm_app(redis_server.url), redis_server.client(),
                            JobSpec(prompt="a door", model="some/model", seed=1, campaign="door"))
    for kind, (mutation, expected) in ENVELOPE.items():
        with pytest.raises(Rejected) as refused:
            open_envelope(hostile(template, mutation, kind))
        assert expected in str(refused.value), (kind, str(refused.value)[:300])
    for kind, (mutation, _) in JOB.items():
        assert open_envelope(hostile(template, mutation, kind))["headers"]["id"] == kind
    payload = open_envelope(hostile(template, JOB["prompt-uuid"][0], "prompt-uuid"))
    kwargs = kombu.utils.json.loads(base64.b64decode(payload["body"]))[1]
    assert kwargs["prompt"] == uuid.UUID("12345678" * 4)
    with pytest.raises(JobError, match=re.escape(JOB["prompt-uuid"][1])):
        parse_job(kwargs)


def test_dead_letters_can_be_listed_requeued_and_purged(redis_server: RedisServer, tiny_sd: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    from renderfarm_cli import main

    r = redis_server.client()
    r.flushall()
    app = farm_app(redis_server.url)
    spec = jobs(tiny_sd, "dl", 1)[0]
    message = real_message(app, r, spec)
    queue = queue_name(spec.model, "float32")
    pipe = r.pipeline()
    deadletters.add(pipe, queue, "invalid job: steps=0: must be in 1..500", json.dumps(message).encode(), spec.job_id)
    deadletters.add(pipe, queue, "message rejected: too big", b"x" * (deadletters.KEPT_MESSAGE_BYTES + 1))
    pipe.execute()
    broker = ["--broker", redis_server.url]
    assert main(["deadletters", *broker]) == 0
    out = capsys.readouterr().out
    assert f"{queue}: 2 dead letters (2 kept)" in out and "steps=0: must be in 1..500" in out
    assert main(["deadletters", *broker, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [e["job_id"] for e in listed[queue]["entries"]] == [None, spec.job_id]
    assert main(["deadletters", *broker, "--requeue", "--queue", queue]) == 0
    assert "requeued 1, dropped 1 cut message" in capsys.readouterr().out
    assert json.loads(r.rpop(priority_list(queue, redis_priority(None)))) == message
    pipe = r.pipeline()
    deadletters.add(pipe, queue, "message rejected: x", b"{}")
    pipe.execute()
    assert main(["deadletters", *broker, "--purge", "--queue", queue]) == 0
    assert deadletters.DeadLetters(r).counts() == {}


def test_a_requeue_moves_only_the_letters_kept_when_it_started(redis_server: RedisServer) -> None:
    """A worker refuses each requeued message again and dead-letters it anew (here before the
    requeue reads its next letter): the requeue still moves the letters it found, each once,
    and returns; the new letters wait for the next requeue."""
    r = redis_server.client()
    r.flushall()
    queue = queue_name("some/model", "float32")
    pipe = r.pipeline()
    for n in range(20):
        deadletters.add(pipe, queue, "message rejected: x", json.dumps({"n": n}).encode())
    pipe.execute()
    letters = deadletters.DeadLetters(r)
    move, moved = letters._requeue, []

    def refused_again(keys: list[str], args: list[Any]) -> int:
        outcome = move(keys=keys, args=args)
        if outcome == 1:  # the worker takes the message and refuses it again
            message = r.rpop(priority_list(queue, redis_priority(None)))
            moved.append(json.loads(message)["n"])
            assert len(moved) <= 40, "the requeue keeps taking the letters of its own requeued messages"
            again = r.pipeline()
            deadletters.add(again, queue, "message rejected: again", message)
            again.execute()
        return outcome

    letters._requeue = refused_again
    assert letters.requeue(queue) == (20, 0)
    assert moved == list(range(20))
    assert [entry["reason"] for entry in letters.entries(queue)] == ["message rejected: again"] * 20


# --------------------------------------------------------------------------- what a job names


def image_job(spec: JobSpec, ref: str, data: bytes | None = None) -> JobSpec:
    """An image job naming `ref`, with the sha256 of `data` (of nothing readable: any digest)."""
    return dataclasses.replace(spec, init_image=ref, init_image_sha256=hashlib.sha256(data or b"").hexdigest(),
                               strength=0.5, scheduler="euler", width=64, height=64)


def photo(path: Path, colour: tuple[int, int, int]) -> bytes:
    Image.new("RGB", (64, 64), colour).save(path)
    return path.read_bytes()


@pytest.mark.farm
def test_sources_a_job_names_cannot_freeze_the_worker_nor_be_read_outside_its_roots(
        start_worker: Callable[..., WorkerProcess], proxy: GcsProxy, tiny_sd: Path, tmp_path: Path,
        redis_server: RedisServer) -> None:
    """Image jobs naming a device, a pipe in the source roots, a file outside them and a missing
    one, among text and image jobs that are fine, and one naming an object whose read storage
    holds: each bad one is refused with its reason (outside the roots and missing in the same
    words), the held one fails its attempts at its read's deadline (refunded once, then counted)
    without holding up its batch, everything else lands once, and the worker is the same
    process throughout."""
    model = model_copy(tiny_sd, tmp_path, "sources")
    r, app, progress = redis_server.client(), farm_app(redis_server.url), Progress(redis_server.client())
    roots, private = tmp_path / "source-root", tmp_path / "private"
    roots.mkdir(), private.mkdir()
    good_bytes, secret_bytes = photo(roots / "photo.png", (200, 60, 0)), photo(private / "secret.png", (0, 0, 200))
    os.mkfifo(roots / "pipe")
    bucket().put("sources/held.png", good_bytes)
    held = proxy.add(Rule(r"^sources/held\.png$", hold=True, method="GET"))
    worker = start_worker(model, "sources", env={"RENDERFARM_MAX_REFUNDS": "1"},
                          extra=("--source-root", str(roots), "--source-root", f"gs://{BUCKET}/sources",
                                 "--source-seconds", "2", "--precompile", "64x64@3,64x64@3:euler:img2img"))
    pid = worker.proc.pid
    base = jobs(model, "sources", 16, seed=500)
    good = base[:8] + [image_job(spec, str(roots / "photo.png"), good_bytes) for spec in base[8:12]]
    bad = {"/dev/zero": image_job(base[12], "/dev/zero"), str(roots / "pipe"): image_job(base[13], str(roots / "pipe")),
           str(private / "secret.png"): image_job(base[14], str(private / "secret.png"), secret_bytes),
           str(roots / "gone.png"): image_job(base[15], str(roots / "gone.png"))}
    slow = image_job(jobs(model, "sources-held", 1, seed=900)[0], f"gs://{BUCKET}/sources/held.png", good_bytes)
    enqueue(app, progress, [slow])
    enqueue(app, progress, [*good, *bad.values()])
    status = wait_done(progress, "sources", 16)
    assert held.matched >= 1 and progress.status("sources-held")["failed"] == 0  # its reads still held
    assert (status["done"], status["failed"]) == (12, 4)
    assert_exactly_once(good)
    rule = SourceRoots.parse([str(roots), f"gs://{BUCKET}/sources"]).rule
    assert status["failures"] == {spec.job_id: f"invalid job: init_image={ref!r}: {rule}" for ref, spec in bad.items()}

    held_status = wait_done(progress, "sources-held", 1, timeout=120)
    reason = held_status["failures"][slow.job_id]
    assert reason.startswith("source: SourceTimeout: init_image='gs://faults/sources/held.png': not read within 2 s")
    assert reason.endswith("(after 2 attempts and 1 retries not counted)"), reason
    assert held.matched == 3 and attempts(r, [slow]) == [2]  # read three times: refunded once, counted twice
    held.release()
    letters = [entry["job_id"] for entry in deadletters.DeadLetters(r).entries(queue_name(str(model), "float32"))]
    assert sorted(letters) == sorted([slow.job_id, *(spec.job_id for spec in bad.values())])
    assert worker.proc.poll() is None and worker.proc.pid == pid
    assert "this worker takes no image jobs" not in worker.log.read_text()
    assert f"image jobs' sources are read from {roots}, gs://{BUCKET}/sources/ only" in worker.log.read_text()


@pytest.mark.farm
def test_every_failure_is_classified_once_and_none_goes_round_for_ever(
        start_worker: Callable[..., WorkerProcess], proxy: GcsProxy, tiny_sd: Path, tmp_path: Path,
        redis_server: RedisServer) -> None:
    """A source the kernel cannot read (/proc/self/mem: EIO) and stores that storage forbids
    (403 on every write of a campaign) are permanent: each attempt counts, and after the 2
    allowed each job fails for good, dead-lettered; the good jobs land meanwhile. Once the
    cause is fixed, a requeue of the dead letters renders the forbidden campaign."""
    model = model_copy(tiny_sd, tmp_path, "classified")
    r, app, progress = redis_server.client(), farm_app(redis_server.url), Progress(redis_server.client())
    queue = queue_name(str(model), "float32")
    forbidden = proxy.add(Rule(r"^out/forbidden/", status=403, method="POST"))
    worker = start_worker(model, "classified", extra=("--source-root", "/proc",
                                                      "--precompile", "64x64@3,64x64@3:euler:img2img"))
    unreadable = image_job(jobs(model, "classified", 1, seed=700)[0], "/proc/self/mem")
    good = jobs(model, "classified", 8, seed=710)
    refused = jobs(model, "forbidden", 8, seed=720)
    enqueue(app, progress, [unreadable, *good, *refused])
    status = wait_done(progress, "classified", 9)
    assert (status["done"], status["failed"]) == (8, 1)
    assert_exactly_once(good)
    reason = status["failures"][unreadable.job_id]
    assert reason.startswith("source: OSError: [Errno 5] Input/output error") and reason.endswith("(after 2 attempts)")
    forbidden_status = wait_done(progress, "forbidden", 8)
    assert forbidden_status["failed"] == 8 and attempts(r, refused) == [2] * 8
    assert all(why.startswith("storage: Forbidden: 403") and why.endswith("(after 2 attempts)")
               for why in forbidden_status["failures"].values()), forbidden_status["failures"]
    letters = deadletters.DeadLetters(r)
    assert sorted(entry["job_id"] for entry in letters.entries(queue)) == sorted(
        [unreadable.job_id, *(spec.job_id for spec in refused)])

    proxy.remove(forbidden)  # the cause fixed: a write permission granted
    assert letters.requeue(queue) == (9, 0)
    wait_for(lambda: progress.status("forbidden")["done"] == 8, 120, "the requeued jobs to render")
    assert_exactly_once(refused)
    assert worker.proc.poll() is None


@pytest.mark.farm
def test_a_windowed_jobs_failure_keeps_its_reason_when_its_message_comes_again(
        start_worker: Callable[..., WorkerProcess], tiny_sd: Path, tmp_path: Path, redis_server: RedisServer) -> None:
    """A job of a windowed campaign failed for good (here its source lies outside the worker's
    source roots, which the producer does not know) and then delivered again (a worker killed between its dead letter and its acknowledgement,
    or anyone pushing the message back): the campaign has closed the job, so the delivery is
    dead-lettered again and the campaign's books keep the job's own reason, counted once."""
    model = model_copy(tiny_sd, tmp_path, "closed")
    r = redis_server.client()
    (tmp_path / "roots").mkdir(), (tmp_path / "private").mkdir()
    photo(tmp_path / "private" / "secret.png", (0, 0, 200))
    (tmp_path / "rows.jsonl").write_text(json.dumps({"prompt": "a fox", "init_image": "private/secret.png",
                                                     "strength": 0.5}) + "\n")
    lines = {"name": "closed", "model": str(model), "output": OUT, "prompts": "rows.jsonl", "base_seed": 1,
             "width": 64, "height": 64, "steps": 3, "window": 4}
    (tmp_path / "closed.yaml").write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in lines.items()))
    run_campaign(load_spec(tmp_path / "closed.yaml"), settings=Settings(broker_url=redis_server.url))
    start_worker(model, "closed", extra=("--source-root", str(tmp_path / "roots")))
    progress, letters = Progress(r), deadletters.DeadLetters(r)
    queue = queue_name(str(model), "float32")
    status = wait_done(progress, "closed", 1)
    (reason,) = status["failures"].values()
    assert reason.endswith(SourceRoots.parse([str(tmp_path / "roots")]).rule), reason
    (letter,) = letters.entries(queue)
    r.lpush(priority_list(queue, redis_priority(None)), base64.b64decode(letter["message"]))
    wait_for(lambda: letters.counts()[queue]["total"] == 2, 60, "the second delivery dead-lettered")
    assert "not open in this windowed campaign" in letters.entries(queue)[0]["reason"]
    status = progress.status("closed")
    assert status["failures"] == {letter["job_id"]: reason} and (status["failed"], status["jobs"]) == (1, 1)


def test_workers_of_one_host_starting_together_pass_the_write_check(proxy: GcsProxy, gcs: GcsEmulator,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Two workers of a host write the same check file: one may read back the other's record."""
    from worker.output import check_writable

    name = write_check_name(socket.gethostname())
    other = json.dumps({"host": socket.gethostname(), "pid": 1, "at": 0.0}).encode()
    between = proxy.add(Rule(rf"^out/{re.escape(name)}$", method="POST", times=1,
                             after=lambda seen: bucket().put(name, other)))
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
    check_writable(OUT)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs.url)
    assert between.matched == 1 and bucket().get(name) == other


def test_a_worker_that_cannot_write_its_output_refuses_to_start(gcs: GcsEmulator, tiny_sd: Path,
                                                                redis_server: RedisServer) -> None:
    """Before it loads a model, a worker writes a small file to its output and reads it back:
    a missing bucket or a folder it cannot make is refused at start-up, naming the output."""
    for out, error in (("gs://no-such-bucket-for-renders/out", "NotFound"), ("/proc/renderfarm-out", "")):
        done = subprocess.run([sys.executable, "-m", "renderfarm_cli", "worker", "--model", str(tiny_sd), "--out", out,
                               "--broker", redis_server.url, "--precompile", "64x64@3"],
                              capture_output=True, text=True, timeout=120, env={**os.environ, **ENV})
        assert done.returncode == 2, done.stderr[-2000:]
        assert f"renderfarm: error: out={out!r}: must be storage this worker can write and read back ({error}" \
            in done.stderr, done.stderr[-2000:]
        assert "loaded in" not in done.stderr + done.stdout


# --------------------------------------------------------------------------- exactly once


@pytest.mark.farm
@pytest.mark.parametrize("point", ["after-manifest", "before-manifest"])
def test_killed_between_store_and_ack_every_job_lands_once(
        point: str, start_worker: Callable[..., WorkerProcess], proxy: GcsProxy, tiny_sd: Path, tmp_path: Path,
        redis_server: RedisServer) -> None:
    """The worker is stopped at the chosen point of its first batch: its PNGs and sidecars
    stored and either its manifest part written ("after-manifest": Redis is paused as the
    part's write returns, so the acks cannot go out) or not ("before-manifest": the part's
    write is held). Then SIGKILL. The jobs come back, are found stored, and each gets one
    manifest line."""
    model = model_copy(tiny_sd, tmp_path, f"kill-{point}")
    r, progress = redis_server.client(), Progress(redis_server.client())
    campaign = f"kill-{point}"
    redis_proxy = TcpProxy(redis_server.port)
    reached = Rule(rf"^out/{campaign}/manifest/", times=1)
    if point == "after-manifest":
        reached.after = lambda seen: (redis_proxy.pause(), reached.held.set())
    else:
        reached.hold = True
    proxy.add(reached)
    try:
        victim = start_worker(model, "victim", broker=redis_proxy.url())
        specs = enqueue(farm_app(redis_server.url), progress, jobs(model, campaign, 16))
        assert reached.held.wait(120), "the worker never reached its first manifest write"
        part = reached.hits[0].name.removeprefix(f"out/{campaign}/")
        sidecars = [bucket().get(sidecar_name(campaign, s.job_id)) if bucket().exists(sidecar_name(campaign, s.job_id))
                    else b"{}" for s in specs]
        first = [s for s, sidecar in zip(specs, sidecars) if json.loads(sidecar).get("manifest_part") == part]
        assert len(first) == 8  # the first batch is stored, ...
        assert progress.status(campaign)["done"] == 0  # ... and none of it acknowledged
        victim.kill()
        if point == "before-manifest":
            reached.status = 503  # the held write of the dead worker is never forwarded
        redis_proxy.drop_all()
        redis_proxy.resume()
        proxy.remove(reached)
        start_worker(model, "rescuer")
        status = wait_done(progress, campaign, 16)
    finally:
        redis_proxy.close()
    assert (status["done"], status["failed"]) == (16, 0)
    assert_exactly_once(specs)
    assert attempts(r, first) == [2] * 8  # they did come back: the fault struck between store and ack


@pytest.mark.farm
def test_store_failures_are_requeued_never_leaked_and_jobs_are_told_apart_by_campaign(
        start_worker: Callable[..., WorkerProcess], proxy: GcsProxy, tiny_sd: Path, tmp_path: Path,
        redis_server: RedisServer) -> None:
    model = model_copy(tiny_sd, tmp_path, "leak")
    r, app, progress = redis_server.client(), farm_app(redis_server.url), Progress(redis_server.client())
    # Storage answering 403 is a permanent failure (worker/outcomes.py): each counts an attempt,
    # the job goes back on its queue, and with 3 attempts allowed every job below lands.
    # The same spec in two campaigns in one batch; the first campaign's first upload fails.
    twin = jobs(model, "twin-a", 1, seed=77)[0]
    twins = [twin, JobSpec(**{**twin.to_dict(), "campaign": "twin-b"})]
    fillers = jobs(model, "twin-b", 6, seed=200)
    failing_png = proxy.add(Rule(r"^out/twin-a/", status=403, times=1))
    # Two batches whose manifest parts cannot be written at first (403: not retried by storage).
    failing_manifest = proxy.add(Rule(r"^out/leak/manifest/", status=403, times=2))
    # A batch whose manifest part lands but whose answer is lost: the worker hears 403 and puts
    # the jobs back; they come back and find themselves stored.
    lost_answer = proxy.add(Rule(r"^out/landed/manifest/", status=403, times=1, landed=True))
    enqueue(app, progress, twins + fillers)
    leak = enqueue(app, progress, jobs(model, "leak", 16, seed=300))
    landed = enqueue(app, progress, jobs(model, "landed", 8, seed=400))
    start_worker(model, "leaky", env={"RENDERFARM_MAX_ATTEMPTS": "3"})
    for campaign, n in (("twin-a", 1), ("twin-b", 7), ("leak", 16), ("landed", 8)):
        status = wait_done(progress, campaign, n)
        assert (status["done"], status["failed"]) == (n, 0), campaign
    assert failing_png.matched == 1 and failing_manifest.matched == 2 and lost_answer.matched == 1
    assert_exactly_once([twins[0]])
    assert_exactly_once([twins[1], *fillers])
    assert_exactly_once(leak)
    assert_exactly_once(landed)  # its manifest lines once, though the worker heard they failed
    assert attempts(r, [twins[1]]) == [1] and attempts(r, [twins[0]]) == [2]  # told apart; the 403 counted
    assert set(attempts(r, landed)) == {2}
    wait_for(lambda: r.hlen("unacked") == 0, 30, "every message settled")  # none held forever


# --------------------------------------------------------------------------- drain


@pytest.mark.farm
@pytest.mark.parametrize("release_after", [None, 1.0])
def test_sigterm_under_load_stores_what_it_can_and_requeues_the_rest_at_once(
        release_after: float | None, start_worker: Callable[..., WorkerProcess], proxy: GcsProxy, tiny_sd: Path,
        tmp_path: Path, redis_server: RedisServer) -> None:
    """A worker with batches rendered and one being stored (its uploads held) is told to
    stop. Within --drain-seconds it stores what it can (everything, if the uploads are let
    go in time) and puts every other job back on the queue at once, far inside the
    visibility timeout; a second worker finishes the rest, each job stored once."""
    model = model_copy(tiny_sd, tmp_path, f"drain-{release_after}")
    r, progress = redis_server.client(), Progress(redis_server.client())
    campaign = f"drain-{'release' if release_after else 'hold'}"
    held = proxy.add(Rule(rf"^out/{campaign}/", hold=True))
    worker = start_worker(model, "drained", env={"RENDERFARM_VISIBILITY_TIMEOUT": "3600"},
                          extra=("--drain-seconds", "4"))
    specs = enqueue(farm_app(redis_server.url), progress, jobs(model, campaign, 40))
    assert held.held.wait(120)
    wait_for(lambda: progress.status(campaign)["running"] >= 16, 60, "two batches taken")
    started = time.monotonic()
    worker.proc.send_signal(signal.SIGTERM)
    if release_after:
        time.sleep(release_after)
        held.release()
    worker.proc.wait(30)
    drain_seconds = time.monotonic() - started
    done = progress.status(campaign)["done"]
    assert drain_seconds < 4 + 5  # the drain deadline, and the process's own exit
    assert r.hlen("unacked") == 0  # nothing left for the visibility timeout to restore
    assert queued(r, model) + done == 40
    if release_after:
        assert done >= 8  # the batch being stored was finished and acknowledged
    else:
        assert done == 0
    proxy.remove(held)
    stored_by_drained = [s for s in specs if bucket().exists(sidecar_name(campaign, s.job_id))]
    start_worker(model, "rescuer")
    status = wait_done(progress, campaign, 40)
    assert (status["done"], status["failed"]) == (40, 0)
    assert_exactly_once(specs)
    if release_after:
        assert set(attempts(r, stored_by_drained)) == {1}  # not rendered again
    print(f"drain under load: exited {drain_seconds:.2f}s after SIGTERM, {done} of 40 stored "
          f"(uploads {'let go after 1 s' if release_after else 'held throughout'})")


DRAIN_EXIT_MARGIN = 1.0  # seconds past its drain deadline a worker may take to put its jobs back and exit


@pytest.mark.farm
def test_the_drain_deadline_holds_while_a_batch_outlasts_it(
        start_worker: Callable[..., WorkerProcess], tiny_sd: Path, tmp_path: Path,
        redis_server: RedisServer) -> None:
    """A batch on the devices takes longer than the whole drain window (256x256, 20 steps:
    seconds on these CPU devices; `--drain-seconds 2`), so the worker's main thread is
    waiting on the devices when SIGTERM comes. The deadline holds anyway: the process is
    gone by SIGTERM + drain seconds (and DRAIN_EXIT_MARGIN, what putting the jobs back
    takes), the batch's results dropped and every job back on its queue at once, its
    attempt not counted; a second worker renders each one once."""
    model = model_copy(tiny_sd, tmp_path, "outlasted")
    r, progress = redis_server.client(), Progress(redis_server.client())
    worker = start_worker(model, "outlasted", env={"RENDERFARM_VISIBILITY_TIMEOUT": "3600"},
                          extra=("--drain-seconds", "2", "--precompile", "256x256@20"))
    specs = enqueue(farm_app(redis_server.url), progress,
                    jobs(model, "outlasted", 16, width=256, height=256, steps=20))
    wait_for(lambda: progress.status("outlasted")["running"] == 16, 60, "both batches on the devices")
    started = time.monotonic()
    worker.proc.send_signal(signal.SIGTERM)
    worker.proc.wait(60)
    exited = time.monotonic() - started
    assert exited <= 2 + DRAIN_EXIT_MARGIN, f"exited {exited:.2f}s after SIGTERM"
    assert progress.status("outlasted")["done"] == 0  # no batch finished in the window
    assert r.hlen("unacked") == 0 and queued(r, model) == 16  # all back, none left for the timeout
    start_worker(model, "rescuer")
    status = wait_done(progress, "outlasted", 16)
    assert (status["done"], status["failed"]) == (16, 0)
    assert_exactly_once(specs)
    assert set(attempts(r, specs)) == {1}  # the stopped worker's attempt was not counted
    print(f"drain deadline: exited {exited:.2f}s after SIGTERM with --drain-seconds 2, a batch on the devices")


# --------------------------------------------------------------------------- compiling


@pytest.mark.farm
def test_a_new_shape_compiles_without_the_held_messages_being_redelivered(
        start_worker: Callable[..., WorkerProcess], tiny_sd: Path, tmp_path: Path, redis_server: RedisServer) -> None:
    model = model_copy(tiny_sd, tmp_path, "compile")
    r, progress = redis_server.client(), Progress(redis_server.client())
    worker = start_worker(model, "compiler", env={"RENDERFARM_VISIBILITY_TIMEOUT": "1"})
    shape = {"width": 128, "height": 64, "steps": 5}  # compiled by no other test
    specs = enqueue(farm_app(redis_server.url), progress, jobs(model, "compile", 16, **shape))
    status = wait_done(progress, "compile", 16)
    assert (status["done"], status["failed"]) == (16, 0)
    seconds = [float(s) for s in re.findall(r"compiled in ([\d.]+)s", worker.log.read_text())]
    assert seconds and max(seconds) > 1  # longer than the visibility timeout: a real test
    assert attempts(r, specs) == [1] * 16  # held all along, never delivered again
    assert_exactly_once(specs)


# --------------------------------------------------------------------------- killed mid-batch


@pytest.mark.farm
def test_workers_killed_mid_batch_lose_nothing(start_worker: Callable[..., WorkerProcess], proxy: GcsProxy,
                                                tiny_sd: Path, tmp_path: Path, redis_server: RedisServer) -> None:
    """Two workers killed while their first batch is being stored (its uploads held), the
    second one on jobs restored from the first; a third finishes, each job once."""
    model = model_copy(tiny_sd, tmp_path, "killed")
    r, progress = redis_server.client(), Progress(redis_server.client())
    specs = enqueue(farm_app(redis_server.url), progress, jobs(model, "killed", 24, seed=300))
    for victim in ("victim", "victim2"):
        held = proxy.add(Rule(r"^out/killed/", hold=True))
        worker = start_worker(model, victim, ready=False)  # soon too busy storing (held) to answer pings
        assert held.held.wait(120)  # its first batch is being stored
        if victim == "victim2":  # ... and it is made of jobs restored from the first victim
            wait_for(lambda: max(attempts(r, specs)) >= 2, 60, "restored jobs taken")
        worker.kill()
        held.status = 503  # the dead worker's held uploads are never forwarded
        proxy.remove(held)
        assert progress.status("killed")["done"] == 0
    start_worker(model, "rescuer")
    status = wait_done(progress, "killed", 24)
    assert (status["done"], status["failed"]) == (24, 0)
    assert_exactly_once(specs)
    assert max(attempts(r, specs)) >= 2
