"""A real redis-server for tests, on a free port, that a test can stop and restart with its
data (append-only file on); optionally with a password (`--requirepass`), a TLS port beside
the plain one, or as a replica of another. And real sentinels (`redis-server CONFIG
--sentinel`, no other package) that monitor a primary and fail it over to a replica."""

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


class _Server:
    """A redis-server process of a test's, in a folder of its own: a data node or a sentinel."""

    port: int
    dir: Path
    proc: subprocess.Popen[bytes] | None = None

    def client(self) -> redis.Redis:
        raise NotImplementedError

    def _launch(self, args: list[str], what: str) -> None:
        """Start it and wait until it answers; one that exits (e.g. a build without TLS) fails
        at once with what it printed."""
        output = self.dir / "redis.out"
        with output.open("wb") as out:
            self.proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", *args],
                                         stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if self.client().ping():
                    return
            except redis.ConnectionError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{what} did not start on port {self.port}: {output.read_text()[-2000:]}")

    def stop(self) -> None:
        """Stop at once (SIGKILL): what was written survives only through the append-only file."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


class RedisServer(_Server):
    def __init__(self, appendonly: bool = True, password: str | None = None, tls: TlsFiles | None = None,
                 replica_of: int | None = None) -> None:
        self.port = free_port()
        self.replica_of = replica_of  # the port of its primary, or of a proxy in front of it
        self.tls = tls
        self.tls_port = free_port() if tls else None
        self.password = password
        self.dir = Path(tempfile.mkdtemp(prefix="rf-redis-"))
        self.appendonly = appendonly
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
        args = ["--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.dir), "--save", "", "--appendonly", "yes" if self.appendonly else "no",
                "--appendfsync", "always", "--logfile", str(self.dir / "redis.log"),
                "--repl-diskless-sync-delay", "0"]  # a replica's first sync starts at once, not 5 s later
        if self.password:  # and the primary's, for a replica and for a primary demoted to one
            args += ["--requirepass", self.password, "--masterauth", self.password]
        if self.replica_of:
            args += ["--replicaof", "127.0.0.1", str(self.replica_of)]
        if self.tls:
            args += ["--tls-port", str(self.tls_port), "--tls-cert-file", str(self.tls.cert),
                     "--tls-key-file", str(self.tls.key), "--tls-ca-cert-file", str(self.tls.ca),
                     "--tls-auth-clients", "no"]
        self._launch(args, "redis-server")

    def close(self) -> None:
        # A Celery result that subscribed for its outcome unsubscribes when it is collected, and
        # retries for about 20 s if the server is gone: collect them while it still answers.
        gc.collect()
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class SentinelServer(_Server):
    """A sentinel on a free port monitoring `primary` as `master_name` (with the primary's
    password), quick to act: the primary is down once it has not answered for `down_after_ms`,
    and `quorum` sentinels agreeing on it start a failover to a replica."""

    def __init__(self, primary: RedisServer, master_name: str, quorum: int, down_after_ms: int = 1000,
                 failover_timeout_ms: int = 5000) -> None:
        self.port = free_port()
        self.master_name = master_name
        self.dir = Path(tempfile.mkdtemp(prefix="rf-sentinel-"))
        lines = [f"port {self.port}", "bind 127.0.0.1", f"dir {self.dir}", f"logfile {self.dir / 'sentinel.log'}",
                 f"sentinel monitor {master_name} 127.0.0.1 {primary.port} {quorum}",
                 f"sentinel down-after-milliseconds {master_name} {down_after_ms}",
                 f"sentinel failover-timeout {master_name} {failover_timeout_ms}"]
        if primary.password:
            lines.append(f"sentinel auth-pass {master_name} {primary.password}")
        self.config = self.dir / "sentinel.conf"  # the sentinel rewrites it with what it learns
        self.config.write_text("\n".join(lines) + "\n")
        try:
            self.start()
        except RuntimeError:
            self.close()
            raise

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, decode_responses=True)

    def start(self) -> None:
        self._launch([str(self.config), "--sentinel"], "redis-server --sentinel")

    def master_port(self) -> int:
        """The port of the server this sentinel takes for the master now."""
        return int(self.client().sentinel_get_master_addr_by_name(self.master_name)[1])

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def sentinel_url(sentinels: list[SentinelServer], password: str | None = None, db: int = 0) -> str:
    """The broker URL of the master these sentinels monitor (renderfarm/connections.py)."""
    auth = f":{password}@" if password else ""
    parts = [f"sentinel://{auth if n == 0 else ''}127.0.0.1:{s.port}" for n, s in enumerate(sentinels)]
    return ";".join(parts) + f"/{db}?master_name={sentinels[0].master_name}"
