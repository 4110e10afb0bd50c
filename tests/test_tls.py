"""The broker's password and TLS with real parts: a redis-server with `--requirepass` and a
TLS port (certificates made by harness/tls.py), the `renderfarm` CLI and one real
`renderfarm worker` that renders jobs over `rediss://` with the password in its URL.

The password is random and long, so finding it anywhere in an output is a leak, never chance.
"""

from __future__ import annotations

import dataclasses
import secrets
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest

from harness.farm import STEPS, WorkerProcess, enqueue, farm_app, wait_for
from harness.redis_server import RedisServer
from harness.tls import make_certificates
from renderfarm.jobs import JobSpec
from renderfarm.layout import image_name, sidecar_name
from renderfarm.progress import Progress
from renderfarm.queue import make_app
from renderfarm.settings import Settings, redacted
from renderfarm.storage import open_storage
from worker.broker import transport_for

ROOT = Path(__file__).resolve().parent.parent
PASSWORD = f"pw-{secrets.token_hex(16)}"
CAMPAIGN = "over-tls"
JOBS = 9  # a full batch of 8 and a partial one: several pops, acks and stores over the connection


@dataclasses.dataclass
class Broker:
    server: RedisServer
    no_tls: str | None  # why there is no TLS port, if there is none

    def needs_tls(self) -> None:
        if self.no_tls:
            pytest.skip(self.no_tls)


@pytest.fixture(scope="module")
def broker_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    """Password on both ports; TLS beside the plain port when this redis-server build has it
    (else the TLS tests skip and the password tests run on the plain port)."""
    certs = make_certificates(tmp_path_factory.mktemp("tls"))
    try:
        broker = Broker(RedisServer(appendonly=False, password=PASSWORD, tls=certs), None)
    except RuntimeError as err:
        if "tls" not in str(err).lower():
            raise
        broker = Broker(RedisServer(appendonly=False, password=PASSWORD),
                        f"this redis-server build has no TLS (redis-server --tls-port failed): {err}")
    yield broker
    broker.server.close()


@dataclasses.dataclass
class Rendered:
    url: str  # what the worker was given
    jobs: list[JobSpec]
    out: Path
    status: dict
    commandstats: dict[str, dict]  # INFO commandstats from just before the jobs to their end
    log: str  # the worker's whole log, after it stopped


@pytest.fixture(scope="module")
def rendered(broker_server: Broker, tiny_sd: Path, tmp_path_factory: pytest.TempPathFactory) -> Rendered:
    """One worker and its jobs, submitted with the farm's own code over the worker's URL."""
    redis_server = broker_server.server
    url = redis_server.url if broker_server.no_tls else redis_server.tls_url
    out = tmp_path_factory.mktemp("out")
    app = farm_app(url)
    worker = WorkerProcess(tiny_sd, str(out), url, "tls", tmp_path_factory.mktemp("logs"))
    try:
        worker.wait_ready(app)
        client = redis_server.client()
        client.config_resetstat()  # what follows is the worker's consuming, not the ping above
        progress = Progress(client)
        jobs = enqueue(app, progress, [JobSpec(prompt=f"a lighthouse behind TLS {i}", model=str(tiny_sd), seed=i,
                                               steps=STEPS, campaign=CAMPAIGN) for i in range(JOBS)])
        wait_for(lambda: sum(progress.status(CAMPAIGN)[k] for k in ("done", "failed")) >= JOBS, 180, "the jobs")
        status, stats = progress.status(CAMPAIGN), client.info("commandstats")
    finally:
        worker.stop()
    return Rendered(url, jobs, out, status, stats, worker.log.read_text())


@pytest.mark.farm
def test_worker_renders_with_the_password_in_its_url(rendered: Rendered) -> None:
    assert PASSWORD in rendered.url
    assert rendered.status["done"] == JOBS and rendered.status["failed"] == 0, rendered.status
    storage = open_storage(str(rendered.out))
    for job in rendered.jobs:
        assert storage.get(image_name(CAMPAIGN, job.job_id)).startswith(b"\x89PNG")
        assert storage.get(sidecar_name(CAMPAIGN, job.job_id))


@pytest.mark.farm
def test_worker_log_never_shows_the_password(rendered: Rendered) -> None:
    assert "serving" in rendered.log and "127.0.0.1" in rendered.log, rendered.log[-3000:]  # a real log
    assert PASSWORD not in rendered.log


@pytest.mark.farm
def test_rediss_keeps_the_atomic_pop(broker_server: Broker, rendered: Rendered) -> None:
    """Over TLS the worker still takes messages with its pop script (EVALSHA), never with
    stock kombu's BRPOP, which pops before recording and loses a job to a kill in between."""
    broker_server.needs_tls()
    assert rendered.url.startswith("rediss://")
    assert rendered.commandstats.get("cmdstat_evalsha", {}).get("calls", 0) > 0, sorted(rendered.commandstats)
    assert "cmdstat_brpop" not in rendered.commandstats, rendered.commandstats["cmdstat_brpop"]


def test_worker_transport_verifies_the_server_certificate(broker_server: Broker, tmp_path: Path) -> None:
    """The worker's connection, made as `renderfarm worker` makes it, checks the server's
    certificate against the URL's CA: TLS that verifies nothing would pass every other test."""
    broker_server.needs_tls()
    server = broker_server.server

    def ping(url: str) -> bool:
        app = make_app(Settings(broker_url=url))
        app.conf.broker_transport = transport_for(url)
        with app.connection_for_write() as connection:
            connection.ensure_connection(max_retries=1)  # Celery's setting would retry for ever
            return connection.default_channel.client.ping()

    assert ping(server.tls_url)
    stranger = make_certificates(tmp_path).ca  # a CA that did not sign the server's certificate
    with pytest.raises(Exception, match="certificate verify failed"):
        ping(server.tls_url.replace(quote(str(server.tls.ca), safe="/"), quote(str(stranger), safe="/")))
    # No ssl_* parameters: verified against the system's CAs (kombu's own default verifies nothing).
    with pytest.raises(Exception, match="certificate verify failed"):
        ping(server.tls_url.partition("?")[0])


@pytest.mark.parametrize("port", ["plain", "tls"])
def test_status_error_names_the_host_not_the_password(broker_server: Broker, port: str) -> None:
    wrong = f"wrong-{secrets.token_hex(16)}"
    if port == "tls":
        broker_server.needs_tls()
    redis_server = broker_server.server
    url = (redis_server.url if port == "plain" else redis_server.tls_url).replace(PASSWORD, wrong)
    result = subprocess.run([sys.executable, "-m", "renderfarm_cli", "status", "somecampaign", "--broker", url],
                            cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 1, result.stderr
    number = redis_server.port if port == "plain" else redis_server.tls_port
    assert f"127.0.0.1:{number}" in result.stderr and ":***@" in result.stderr, result.stderr
    assert wrong not in result.stderr + result.stdout
    assert "Traceback" not in result.stderr


# -- the pieces, without processes --------------------------------------------------------------------

def test_redacted() -> None:
    assert redacted("redis://:s3cr3t@10.0.0.3:6379/0") == "redis://:***@10.0.0.3:6379/0"
    assert redacted("rediss://default:s3cr3t@h:6380/0?ssl_cert_reqs=required") == \
        "rediss://default:***@h:6380/0?ssl_cert_reqs=required"
    assert redacted("redis://localhost:6379/0") == "redis://localhost:6379/0"
    assert redacted("redis://user@h/0") == "redis://user@h/0"


def test_redacted_hides_a_password_with_at_or_slash() -> None:
    for password in ("p@ss-word", "pa/ss"):
        assert redacted(f"redis://:{password}@h:6379/0") == "redis://:***@h:6379/0", password


def test_rediss_url_sets_the_apps_tls_from_its_query() -> None:
    app = make_app(Settings(broker_url="rediss://:pw@h:6380/0?ssl_cert_reqs=required&ssl_ca_certs=/etc/ca.pem"
                                       "&ssl_certfile=/etc/c.pem&ssl_keyfile=/etc/c.key"))
    assert app.conf.broker_use_ssl == {"ssl_cert_reqs": ssl.CERT_REQUIRED, "ssl_ca_certs": "/etc/ca.pem",
                                       "ssl_certfile": "/etc/c.pem", "ssl_keyfile": "/etc/c.key"}
    assert make_app(Settings(broker_url="rediss://h/0?ssl_cert_reqs=none")).conf.broker_use_ssl == \
        {"ssl_cert_reqs": ssl.CERT_NONE}
