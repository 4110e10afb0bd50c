"""A real redis-server for tests, on a free port, that a test can stop and restart with its
data (append-only file on); optionally with a password (`--requirepass`) and a TLS port
beside the plain one."""

from __future__ import annotations

import gc
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

import redis

from harness.tls import TlsFiles


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, appendonly: bool = True, password: str | None = None, tls: TlsFiles | None = None) -> None:
        self.port = free_port()
        self.tls = tls
        self.tls_port = free_port() if tls else None
        self.password = password
        self.dir = Path(tempfile.mkdtemp(prefix="rf-redis-"))
        self.appendonly = appendonly
        self.proc: subprocess.Popen[bytes] | None = None
        try:
            self.start()
        except RuntimeError:
            self.close()
            raise

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def tls_url(self) -> str:
        """The TLS port's URL: certificates verified against the test CA."""
        assert self.tls is not None, "started without TLS"
        auth = f":{self.password}@" if self.password else ""
        return (f"rediss://{auth}127.0.0.1:{self.tls_port}/0"
                f"?ssl_cert_reqs=required&ssl_ca_certs={quote(str(self.tls.ca), safe='/')}")

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, password=self.password)

    def start(self) -> None:
        """Start and wait until it answers; a server that exits (e.g. a build without TLS)
        fails at once with what it printed."""
        args = [shutil.which("redis-server") or "redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.dir), "--save", "", "--appendonly", "yes" if self.appendonly else "no",
                "--appendfsync", "always", "--logfile", str(self.dir / "redis.log")]
        if self.password:
            args += ["--requirepass", self.password]
        if self.tls:
            args += ["--tls-port", str(self.tls_port), "--tls-cert-file", str(self.tls.cert),
                     "--tls-key-file", str(self.tls.key), "--tls-ca-cert-file", str(self.tls.ca),
                     "--tls-auth-clients", "no"]
        output = self.dir / "redis.out"
        with output.open("wb") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if self.client().ping():
                    return
            except redis.ConnectionError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not start on port {self.port}: {output.read_text()[-2000:]}")

    def stop(self) -> None:
        """Stop at once (SIGKILL): what was written survives only through the append-only file."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def close(self) -> None:
        # A Celery result that subscribed for its outcome unsubscribes when it is collected, and
        # retries for about 20 s if the server is gone: collect them while it still answers.
        gc.collect()
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
