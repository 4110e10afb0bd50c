"""`renderfarm flower` end to end: a real redis-server, a real Celery worker (solo pool) serving
the job task `renderfarm.render` (tests/celery_flower_app.py, no JAX), a real Flower started
through our command with basic auth, and jobs sent the way producers send them
(`renderfarm.queue.job_message`). Everything is read back through Flower's HTTP API.

Flower 2.2 endpoints relied on:
  /api/workers?status=true   {node name: online?}, from worker events (heartbeats)
  /api/workers?refresh=true  {node name: {registered, active_queues, stats, ...}} (inspect)
  /api/tasks[?search=...]    {task id: {name, state, kwargs (a repr string), result, worker, ...}}
  /healthcheck, /metrics     served without auth (Flower's design)
"""

from __future__ import annotations

import argparse
import ast
import re
import socket
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from harness.redis_server import RedisServer
from producer.flower import (
    ENV_AUTH,
    FlowerConfigError,
    check_flower_options,
    cmd_flower,
    flower_argv,
    parse_auth,
)
from renderfarm.jobs import JobSpec
from renderfarm.queue import TASK_NAME, job_message, queue_name
from tests.celery_flower_app import create_app
from tests.flower_process import (
    FLOWER_COMMAND,
    ROOT,
    FlowerProcess,
    child_env,
    poll,
    run_flower,
    stop_process,
)

AUTH = "ops:s3cret-pw, viewer:pass:with:colons"  # two users; a password may contain ':'
N_JOBS = 10


@dataclass
class Farm:
    redis: RedisServer
    flower: FlowerProcess
    worker: str  # the worker's Celery node name
    queue: str
    model: str
    jobs: dict[str, JobSpec]  # job id -> spec of every job the fixture sent

    def send(self, spec: JobSpec) -> str:
        create_app(self.redis.url).send_task(TASK_NAME, **job_message(spec))
        return spec.job_id

    def wait_success(self, job_ids: list[str], timeout: float = 30) -> dict[str, dict[str, Any]]:
        def done() -> dict[str, dict[str, Any]] | None:
            tasks = self.flower.tasks(f"taskname={TASK_NAME}")
            return tasks if all(tasks.get(i, {}).get("state") == "SUCCESS" for i in job_ids) else None

        return poll(done, f"{len(job_ids)} jobs SUCCESS in Flower", timeout)


def start_worker(broker_url: str, queue: str, node: str, log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "celery", "-A", "tests.celery_flower_app", "worker", "--pool", "solo",
           "-Q", queue, "-n", node, "--loglevel", "INFO", "--without-mingle", "--without-gossip"]
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, cwd=ROOT, env=child_env(RENDERFARM_BROKER_URL=broker_url),
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def spec(model: str, campaign: str, seed: int, prompt: str | None = None) -> JobSpec:
    return JobSpec(prompt=prompt or f"a red fox in snow, variant {seed}", model=model, seed=seed,
                   negative_prompt="blurry", steps=4, campaign=campaign)


@pytest.fixture(scope="module")
def farm() -> Iterator[Farm]:
    uid = uuid.uuid4().hex[:8]
    model = f"flower-test-{uid}"
    queue = queue_name(model, "float32")
    node = f"flowertest-{uid}@{socket.gethostname()}"
    redis = RedisServer()
    log = Path(tempfile.mkdtemp(prefix="rf-flower-worker-")) / "worker.log"
    worker = None
    try:
        with run_flower(redis.url, auth=AUTH) as flower:  # first: events are not queued for it
            worker = start_worker(redis.url, queue, node, log)
            try:
                flower.wait_for_workers([node], timeout=30)
            except TimeoutError as err:
                raise RuntimeError(f"{err}\nworker log:\n{log.read_text()[-3000:]}\n"
                                   f"flower log:\n{flower.log()[-3000:]}") from None
            farm = Farm(redis, flower, node, queue, model, {})
            for seed in range(N_JOBS):  # two campaigns, 7 + 3 jobs
                job = spec(model, f"demo-{uid}" if seed < 7 else f"other-{uid}", seed)
                farm.jobs[farm.send(job)] = job
            yield farm
    finally:
        if worker is not None:
            stop_process(worker)
        redis.close()
        log.unlink(missing_ok=True)
        log.parent.rmdir()


def kwargs_of(task: dict[str, Any]) -> dict[str, Any]:
    """Flower reports a task's kwargs as the repr Celery put in the message; parse it back."""
    value = ast.literal_eval(task["kwargs"])
    assert isinstance(value, dict), task["kwargs"]
    return value


# -- through a real Flower ------------------------------------------------------------------------

def test_worker_online(farm: Farm) -> None:
    assert farm.flower.worker_status()[farm.worker] is True
    info = farm.flower.api(f"/api/workers?refresh=true&workername={farm.worker}")[farm.worker]
    assert TASK_NAME in info["registered"]
    assert [q["name"] for q in info["active_queues"]] == [farm.queue]
    assert info["stats"]["pool"]["implementation"].endswith("solo:TaskPool")


def test_every_job_is_listed_with_its_spec(farm: Farm) -> None:
    tasks = farm.wait_success(list(farm.jobs))
    for job_id, job in farm.jobs.items():
        task = tasks[job_id]
        assert task["name"] == TASK_NAME
        assert task["uuid"] == job_id  # task id = job id
        assert task["state"] == "SUCCESS"
        assert task["worker"] == farm.worker
        assert kwargs_of(task) == job_message(job)["kwargs"]  # campaign, prompt, seed, ... all there
        assert ast.literal_eval(task["result"]) == {"job_id": job_id, "campaign": job.campaign}
    # The result backend agrees.
    app = create_app(farm.redis.url)
    some = next(iter(farm.jobs))
    assert app.AsyncResult(some).get(timeout=10) == {"job_id": some, "campaign": farm.jobs[some].campaign}


def test_search_finds_a_campaign(farm: Farm) -> None:
    farm.wait_success(list(farm.jobs))
    for campaign in {job.campaign for job in farm.jobs.values()}:
        found = farm.flower.tasks(f"search=kwargs:campaign={campaign}")
        assert set(found) == {i for i, job in farm.jobs.items() if job.campaign == campaign}
    found = farm.flower.tasks(f"search=kwargs:seed=3&taskname={TASK_NAME}")
    assert [kwargs_of(t)["seed"] for t in found.values()] == [3]


def test_api_and_pages_need_auth(farm: Farm) -> None:
    flower = farm.flower
    for path in ("/api/tasks", "/api/workers", "/api/queues/length", "/", "/tasks", f"/task/{next(iter(farm.jobs))}"):
        assert flower.get(path, credentials=None).status == 401, path
        assert flower.get(path, credentials=("ops", "wrong")).status == 401, path
        assert flower.get(path, credentials=("nobody", "s3cret-pw")).status == 401, path
    # Both users of RENDERFARM_FLOWER_AUTH get in (surrounding spaces are trimmed).
    assert flower.get("/api/tasks", credentials=("ops", "s3cret-pw")).status == 200
    assert flower.get("/api/tasks", credentials=("viewer", "pass:with:colons")).status == 200


def test_metrics_and_healthcheck_skip_auth(farm: Farm) -> None:
    """Not a wish, a fact the docs warn about: Flower serves these to anyone."""
    farm.wait_success(list(farm.jobs))
    health = farm.flower.get("/healthcheck", credentials=None)
    assert (health.status, health.body) == (200, b"OK")
    metrics = farm.flower.get("/metrics", credentials=None)
    assert metrics.status == 200
    assert f'task="{TASK_NAME}"'.encode() in metrics.body and farm.worker.encode() in metrics.body


def test_queue_lengths(farm: Farm) -> None:
    farm.wait_success(list(farm.jobs))

    def listed() -> list[dict[str, Any]] | None:
        # Flower lists the queues of the workers it has inspected: inspect them, as its
        # dashboard's refresh does, then read the lengths.
        farm.flower.api(f"/api/workers?refresh=true&workername={farm.worker}")
        queues = farm.flower.api("/api/queues/length")["active_queues"]
        return queues if any(q["name"] == farm.queue for q in queues) else None

    assert {"name": farm.queue, "messages": 0} in poll(listed, f"{farm.queue} in Flower's queue lengths", 30)


def test_long_prompt_job_keeps_its_spec_in_flower(farm: Farm) -> None:
    job = spec(farm.model, f"long-{farm.model}", 99, prompt="a very detailed scene " * 60)
    tasks = farm.wait_success([farm.send(job)])
    assert kwargs_of(tasks[job.job_id])["campaign"] == job.campaign


# -- refusing to start, and --no-auth ----------------------------------------------------------------

def run_command(*args: str, **env: str | None) -> subprocess.CompletedProcess[str]:
    # A broker nobody listens on: the checks must fail before any connection is tried.
    return subprocess.run([*FLOWER_COMMAND, "--broker", "redis://127.0.0.1:9/0", *args], cwd=ROOT,
                          env=child_env(**env), capture_output=True, text=True, timeout=60)


def test_refuses_to_start_without_auth() -> None:
    result = run_command()
    assert result.returncode != 0
    assert f"{ENV_AUTH} is not set" in result.stderr and "--no-auth" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("value", ["admin", "admin:", ":pw", "ops:pw,,x:y", "ops:pw,secret-without-user"])
def test_refuses_malformed_auth_without_echoing_it(value: str) -> None:
    result = run_command(**{ENV_AUTH: value})
    assert result.returncode != 0
    assert ENV_AUTH in result.stderr and "user:password" in result.stderr
    for part in re.split("[,:]", value):  # any part could be a password
        assert len(part) < 4 or part not in result.stderr
    assert "Traceback" not in result.stderr


def test_refuses_unknown_or_owned_flower_options() -> None:
    result = run_command("--", "--persistant=True", **{ENV_AUTH: "a:b"})
    assert result.returncode != 0 and "--persistant: not a Flower" in result.stderr
    result = run_command("--", "--basic_auth=x:y", **{ENV_AUTH: "a:b"})
    assert result.returncode != 0 and ENV_AUTH in result.stderr


def test_no_auth_runs_open_but_flower_keeps_its_api_closed(farm: Farm) -> None:
    with run_flower(farm.redis.url, auth=None) as open_flower:
        assert "WARNING: no authentication" in open_flower.log()
        assert open_flower.get("/workers", credentials=None).status == 200  # the UI is open
        api = open_flower.get("/api/tasks", credentials=None)
        assert api.status == 401 and b"FLOWER_UNAUTHENTICATED_API" in api.body


def test_generic_celery_variables_do_not_hijack_flower(farm: Farm) -> None:
    """Celery's command line reads APP and BROKER_URL from the environment; ours must not."""
    env = {"APP": "no_such_module", "BROKER_URL": "redis://127.0.0.1:9/0"}
    with run_flower(farm.redis.url, auth=AUTH, env=env) as other:
        assert other.wait_for_workers([farm.worker])  # on the farm's broker
        assert "ignoring APP, BROKER_URL" in other.log()


# -- the pieces, without processes --------------------------------------------------------------------

def test_parse_auth() -> None:
    assert parse_auth("a:b") == ["a:b"]
    assert parse_auth(" a:b , c:d:e ") == ["a:b", "c:d:e"]
    for bad in ("", "a", "a:", ":b", "a:b,", "a:b,,c:d"):
        with pytest.raises(FlowerConfigError, match=ENV_AUTH):
            parse_auth(bad)


WELL_KNOWN = ["change-me", "changeme", "admin", "password", "flower", "secret", "123456", "Change_Me", "ADMIN"]


def test_parse_auth_refuses_well_known_passwords() -> None:
    messages = set()
    for password in WELL_KNOWN:
        with pytest.raises(FlowerConfigError, match="user 'ops' has a well-known or guessable password") as err:
            parse_auth(f"viewer:a-long-random-one, ops:{password}")
        messages.add(str(err.value))
    assert len(messages) == 1, "the message must not depend on (so cannot show) the password"


@pytest.mark.parametrize("entry", ["ops:ops", "Admin:admin", "grafana:GRAFANA"])
def test_parse_auth_refuses_the_user_name_as_password(entry: str) -> None:
    with pytest.raises(FlowerConfigError, match=f"user '{entry.split(':')[0]}' has a well-known or guessable"):
        parse_auth(entry)


def test_parse_auth_takes_other_passwords() -> None:
    assert parse_auth("ops:change-me-now-7f3a, admin:s3cret-pw") == ["ops:change-me-now-7f3a", "admin:s3cret-pw"]


def test_command_refuses_a_well_known_password_before_starting_flower(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Through the command's own function; Flower would start at make_app, which fails here."""
    def start_flower(*args: object, **kwargs: object) -> None:
        raise AssertionError("Flower would start with a well-known password")

    monkeypatch.setattr("renderfarm.queue.make_app", start_flower)
    monkeypatch.setenv(ENV_AUTH, "grafana:Change-Me")
    args = argparse.Namespace(port=5555, address="127.0.0.1", max_tasks=100, flower_args=[], no_auth=False,
                              broker="redis://127.0.0.1:9/0")
    assert cmd_flower(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("renderfarm flower: error:") and "'grafana'" in err and ENV_AUTH in err
    assert "Change-Me" not in err


def test_flower_argv() -> None:
    args = argparse.Namespace(port=5555, address="0.0.0.0", max_tasks=500_000,
                              flower_args=["--persistent=True", "--db=/var/lib/flower/state"])
    assert flower_argv(args, ["a:b", "c:d"]) == [
        "flower", "--port=5555", "--address=0.0.0.0", "--max_tasks=500000", "--basic_auth=a:b,c:d",
        "--persistent=True", "--db=/var/lib/flower/state"]
    assert "--basic_auth" not in " ".join(flower_argv(args, []))
    for owned in ("--basic-auth=x:y", "--port=1", "--max_tasks=3"):
        with pytest.raises(FlowerConfigError):
            check_flower_options([owned])
    with pytest.raises(FlowerConfigError, match="--name=value"):
        check_flower_options(["--persistent", "True"])


def test_cli_wiring() -> None:
    from producer.flower import cmd_flower
    from renderfarm_cli import parser

    args = parser().parse_args(["flower", "--port", "1", "--address", "0.0.0.0", "--no-auth", "--",
                                "--persistent=True"])
    assert args.handler is cmd_flower and args.flower_args == ["--persistent=True"]
