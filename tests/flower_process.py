"""A real Flower process for tests, started through `renderfarm flower`, and a client for
its HTTP API with basic auth.

    with run_flower(redis.url, auth="ops:s3cret-pw") as flower:
        flower.wait_for_workers([node_name])         # before sending jobs: see below
        ...send jobs...
        tasks = flower.api("/api/tasks?taskname=renderfarm.render")

Flower only sees events sent while it listens (Celery events are broadcast, not queued), so
start it first and wait until it reports the worker online before sending jobs.

The process runs `python -m renderfarm_cli flower`.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from harness.redis_server import free_port

ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")


FLOWER_COMMAND = [sys.executable, "-m", "renderfarm_cli", "flower"]


def child_env(**updates: str | None) -> dict[str, str]:
    """This environment without Flower settings, with the repository importable, plus updates."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWER_") and k != "RENDERFARM_FLOWER_AUTH"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    for key, value in updates.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def poll(fetch: Callable[[], T | None], what: str, timeout: float = 20.0, interval: float = 0.1) -> T:
    """Call `fetch` until it returns something truthy; fail with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = fetch()
        if last:
            return last
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


@dataclass
class Response:
    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class FlowerProcess:
    url: str
    auth: str | None
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def credentials(self) -> tuple[str, str] | None:
        """The first user:password of `auth`, what `api` sends."""
        if not self.auth:
            return None
        user, _, password = self.auth.split(",")[0].strip().partition(":")
        return user, password

    def get(self, path: str, credentials: tuple[str, str] | None | bool = True, timeout: float = 10) -> Response:
        """GET `path`; `credentials`: True for our own, None/False for none, or (user, password)."""
        creds = self.credentials if credentials is True else (credentials or None)
        headers = {}
        if creds:
            token = base64.b64encode(f"{creds[0]}:{creds[1]}".encode()).decode()
            headers["Authorization"] = f"Basic {token}"
        request = urllib.request.Request(self.url + path, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as resp:
                return Response(resp.status, resp.read(), dict(resp.headers))
        except urllib.error.HTTPError as err:
            return Response(err.code, err.read(), dict(err.headers))

    def api(self, path: str) -> Any:
        """GET `path` with our credentials and return its JSON; anything but 200 raises."""
        resp = self.get(path)
        if resp.status != 200:
            raise AssertionError(f"GET {path}: HTTP {resp.status}: {resp.body[:500]!r}")
        return resp.json()

    def worker_status(self) -> dict[str, bool]:
        """Flower's view of the workers from their events: node name -> online (heartbeats)."""
        return self.api("/api/workers?status=true")

    def wait_for_workers(self, names: Iterable[str], timeout: float = 30) -> dict[str, bool]:
        wanted = set(names)

        def online() -> dict[str, bool] | None:
            status = self.worker_status()
            return status if all(status.get(name) for name in wanted) else None

        return poll(online, f"workers {sorted(wanted)} online in Flower", timeout)

    def tasks(self, query: str = "") -> dict[str, dict[str, Any]]:
        """/api/tasks: task id -> Flower's record (name, state, kwargs as a repr string, ...)."""
        return self.api("/api/tasks" + (f"?{query}" if query else ""))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def _start(cmd: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    with open(log_path, "ab") as log:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 10) -> None:
    """SIGTERM (Flower and Celery shut down cleanly on it), then SIGKILL if needed."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout)


@contextmanager
def run_flower(broker_url: str, auth: str | None = "user:pw", extra_args: Sequence[str] = (),
               env: Mapping[str, str] | None = None, timeout: float = 30) -> Iterator[FlowerProcess]:
    """A `renderfarm flower` process on a free port of 127.0.0.1, ready (its /healthcheck answers).

    `auth` goes into RENDERFARM_FLOWER_AUTH; `auth=None` starts it with --no-auth instead.
    `extra_args` are Flower options (`--name=value`, passed after `--`); `env` more variables.
    """
    tmp = Path(tempfile.mkdtemp(prefix="rf-flower-"))
    env = child_env(RENDERFARM_FLOWER_AUTH=auth, **(env or {}))
    flower: FlowerProcess | None = None
    try:
        for _attempt in range(3):  # a free port can be taken between probe and bind
            port = free_port()
            log_path = tmp / f"flower-{port}.log"
            cmd = [*FLOWER_COMMAND, "--port", str(port), "--address", "127.0.0.1", "--broker", broker_url]
            if auth is None:
                cmd.append("--no-auth")
            if extra_args:
                cmd += ["--", *extra_args]
            flower = FlowerProcess(f"http://127.0.0.1:{port}", auth, _start(cmd, env, log_path), log_path)
            if _wait_ready(flower, timeout):
                break
            stop_process(flower.proc)
        else:
            raise RuntimeError(f"Flower did not start; last log:\n{flower.log()[-3000:] if flower else ''}")
        yield flower
    finally:
        if flower is not None:
            stop_process(flower.proc)
        for path in tmp.iterdir():
            path.unlink()
        tmp.rmdir()


def _wait_ready(flower: FlowerProcess, timeout: float) -> bool:
    """True once /healthcheck answers; False if the process exited (e.g. the port was taken)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if flower.proc.poll() is not None:
            return False
        try:
            if flower.get("/healthcheck", credentials=None, timeout=2).body == b"OK":
                return True
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"Flower at {flower.url} not ready after {timeout}s; log:\n{flower.log()[-3000:]}")
