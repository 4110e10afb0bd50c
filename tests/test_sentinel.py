"""The farm behind Redis Sentinel, with real parts: a primary redis-server with a password, a
replica of it (`--replicaof`), three sentinels (`redis-server --sentinel`, quorum 2, a primary
that has not answered for 1 s is down), `renderfarm worker` processes and the `renderfarm
campaign run` CLI, every one given the same `sentinel://` broker URL (renderfarm/connections.py).

The replica replicates through a proxy, which holds back the primary's last second of writes
before the primary is killed mid-campaign (SIGKILL), as asynchronous replication loses them: the
sentinels promote the replica, the workers follow it with their own transport (the atomic pop,
loaded again on the new master), and a second run of the windowed campaign submits what storage
lacks. Every job is stored exactly once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from flower.utils.broker import Broker
from kombu import Connection
from redbeat.schedulers import get_redis

from harness.fault_proxies import TcpProxy
from harness.farm import STEPS, WorkerProcess, farm_app, manifest_ids, wait_for
from harness.redis_server import RedisServer, SentinelServer, sentinel_url
from producer.campaigns import campaign_jobs, load_spec
from producer.schedules import schedule_app
from renderfarm.connections import SENTINEL_KWARGS, Sentinels, celery_settings, redbeat_settings, sentinels_of
from renderfarm.jobs import JobError
from renderfarm.layout import image_name, sidecar_name
from renderfarm.progress import Progress, retrying_client
from renderfarm.queue import make_app
from renderfarm.settings import Settings
from renderfarm.storage import open_storage
from worker.broker import POP_AND_RECORD_SHA, SentinelTransport, transport_for

ROOT = Path(__file__).resolve().parents[1]
MASTER = "rf-test"
PASSWORD = f"pw-{secrets.token_hex(12)}"
ENV = {"RENDERFARM_VISIBILITY_TIMEOUT": "5", "RENDERFARM_RESTORE_INTERVAL": "1"}
JOBS, WINDOW = 96, 16  # several windows, and a kill while jobs are queued, held and being stored
LAG = 1.0  # seconds of the primary's last writes that its replica never gets
FEEDER = """
import sys
import producer.window
from renderfarm_cli import main

producer.window.LOCK_SECONDS = 1  # the lock of a run that lost its master lapses a second later
sys.exit(main(sys.argv[1:]))
"""


@dataclasses.dataclass
class SentinelSet:
    servers: list[RedisServer]  # a primary and its replica, at first
    sentinels: list[SentinelServer]
    link: TcpProxy  # the replica's connection to the primary: a test can hold back what it sends

    @property
    def url(self) -> str:
        return sentinel_url(self.sentinels, PASSWORD)

    def master(self) -> RedisServer:
        """The server every sentinel names as the master, once they agree and it answers as one."""
        ports = {s.master_port() for s in self.sentinels}
        (server,) = [s for s in self.servers if {s.port} == ports and s.proc is not None]
        assert server.client().info("replication")["role"] == "master"
        return server

    def replica(self) -> RedisServer:
        (server,) = [s for s in self.servers if s is not self.master()]
        return server

    def ready(self, timeout: float = 30) -> SentinelSet:
        """Both servers up (one killed by a test comes back, and the sentinels make it a replica),
        the replica in sync, and every sentinel knowing it and the two other sentinels."""
        for server in self.servers:
            if server.proc is None:
                server.start()

        def settled() -> bool:
            try:
                master, replica = self.master(), self.replica()
                link = replica.client().info("replication")
                known = [(s.client().sentinel_slaves(MASTER), s.client().sentinel_sentinels(MASTER))
                         for s in self.sentinels]
            except Exception:  # noqa: BLE001 - not settled yet, whatever is still moving
                return False
            return link["role"] == "slave" and link.get("master_link_status") == "up" and all(
                len(others) == 2 and [r["port"] for r in replicas if not r["is_sdown"]] == [replica.port]
                for replicas, others in known)

        wait_for(settled, timeout, "the sentinels and the replica")
        return self


@pytest.fixture(scope="module")
def sentinel_set() -> Iterator[SentinelSet]:
    primary = RedisServer(appendonly=True, password=PASSWORD)
    link = TcpProxy(primary.port)
    replica = RedisServer(appendonly=True, password=PASSWORD, replica_of=link.port)
    sentinels = []
    try:
        # A long failover timeout: a sentinel re-points a replica that replicates from another
        # address than the master's (the proxy's) only that long after it first saw it.
        sentinels = [SentinelServer(primary, MASTER, quorum=2, failover_timeout_ms=60_000) for _ in range(3)]
        yield SentinelSet([primary, replica], sentinels, link)
    finally:
        for sentinel in sentinels:
            sentinel.close()
        replica.close()
        link.close()
        primary.close()


# -- the URL, read into each part ------------------------------------------------------------

def test_a_sentinel_url_names_the_sentinels_the_master_and_its_credentials() -> None:
    url = "sentinel://:p%40ss@s1:26380;sentinel://s2;sentinel://s3:26381/2?master_name=farm"
    sentinels = sentinels_of(url)
    assert sentinels == Sentinels((("s1", 26380), ("s2", 26379), ("s3", 26381)), "farm", 2, None, "p@ss")
    assert sentinels_of("redis://:pw@h:6379/0") is None
    for auth, sent in (("ops:pw@", "ops:pw@"), ("ops@", "ops@"), (":pw@", ":pw@"), ("", "")):
        assert sentinels_of(f"sentinel://{auth}s1/0?master_name=m").url == f"sentinel://{sent}s1:26379/0"
    # kombu and Celery's backend take the credentials and database from the first part, and
    # would hand a query's keys to redis-py: each gets them where it reads them.
    celery = celery_settings(url)
    assert celery["broker_url"] == celery["result_backend"] == \
        "sentinel://:p%40ss@s1:26380/2;sentinel://s2:26379/2;sentinel://s3:26381/2"
    for options in (celery["broker_transport_options"], celery["result_backend_transport_options"]):
        assert options == {"master_name": "farm", "sentinel_kwargs": SENTINEL_KWARGS}
    app = make_app(Settings(broker_url=url))
    assert app.conf.broker_transport_options["master_name"] == "farm"
    assert app.conf.broker_transport_options["visibility_timeout"] == Settings().visibility_timeout
    assert app.conf.result_backend_transport_options["master_name"] == "farm"
    beat = redbeat_settings(url)
    assert beat["redbeat_redis_url"].startswith("redis-sentinel://")
    assert beat["redbeat_redis_options"] == {
        "sentinels": [("s1", 26380), ("s2", 26379), ("s3", 26381)], "service_name": "farm", "db": 2,
        "username": None, "password": "p@ss", "sentinel_kwargs": SENTINEL_KWARGS}
    assert transport_for(url) == "worker.broker:SentinelTransport"
    assert transport_for("redis://h/0") == "worker.broker:Transport"


@pytest.mark.parametrize(("url", "rule"), [
    ("sentinel://:secret@s1:26379/0", "names the master"),
    ("sentinel://:secret@s1:26379/0?master_name=m&ssl_cert_reqs=none", "master_name only, not ssl_cert_reqs"),
    ("sentinel://:secret@s1:26379/0;sentinel://:other@s2/0?master_name=m", "different passwords"),
    ("sentinel://:secret@s1/0;sentinel://s2/1?master_name=m", "different dbs"),
    ("sentinel://:secret@s1/0;redis://s2/0?master_name=m", "sentinel://HOST"),
    ("sentinel://:secret@s1:x/0?master_name=m", "port must be a number"),
])
def test_a_bad_sentinel_url_is_refused_with_its_rule_and_never_its_password(url: str, rule: str) -> None:
    with pytest.raises(JobError, match=rule) as refused:
        sentinels_of(url)
    assert refused.value.field == "broker" and "secret" not in str(refused.value)


def test_a_failed_connection_keeps_the_workers_transport_and_the_masters_password() -> None:
    """kombu moves to a URL's next `;` part at every failed connection, taking its transport from
    that part's scheme: a worker would go on with kombu's stock Sentinel transport (no atomic pop)
    and without the password only the first part carries. The farm's failover strategy stays put."""
    url = "sentinel://:pw@127.0.0.1:1;sentinel://127.0.0.1:2;sentinel://127.0.0.1:3/0?master_name=m"
    app = make_app(Settings(broker_url=url))
    app.conf.broker_transport = transport_for(url)
    connection: Connection = app.connection_for_write()
    for _ in range(3):
        connection.maybe_switch_next()  # what kombu does after each failed connection
    assert connection.transport_cls == "worker.broker:SentinelTransport"
    assert (connection.hostname, connection.port, connection.password) == ("127.0.0.1", 1, "pw")
    assert len(connection.alt) == 3  # every sentinel still asked, each time


# -- every client, through the sentinels ------------------------------------------------------

def test_every_part_reaches_the_current_master_through_the_sentinels(sentinel_set: SentinelSet) -> None:
    """The producer's and worker's clients, the Celery app's broker (kombu's stock Sentinel
    transport and the worker's), its result backend, redbeat and Flower's broker view, all from
    the one URL, all writing to (or reading) the server the sentinels name."""
    master = sentinel_set.ready().master().client()
    url = sentinel_set.url
    Progress.from_url(url).cancel("through-sentinel")
    assert master.exists("rf:c:through-sentinel:cancel")
    retrying = retrying_client(url)
    assert retrying.set("rf:test:retrying", 1) and master.get("rf:test:retrying") == b"1"
    retry = retrying.connection_pool.connection_kwargs["retry"]  # progress.py's policy, kept behind Sentinel
    assert retry.get_retries() == 3
    app = make_app(Settings(broker_url=url))
    with app.connection_for_write() as connection:
        connection.default_channel.client.lpush("rf.test.queue", b"job")
    assert master.llen("rf.test.queue") == 1
    app.backend.client.set("rf:test:backend", 1)
    assert master.get("rf:test:backend") == b"1"
    app.conf.broker_transport = transport_for(url)
    with app.connection_for_write() as connection:
        assert isinstance(connection.transport, SentinelTransport)
        assert connection.default_channel._shared_client.get("rf:test:backend") == b"1"
    assert get_redis(schedule_app(Settings(broker_url=url))).set("rf:beat:test", 1)
    assert master.get("rf:beat:test") == b"1"
    with farm_app(url).connection() as connection:
        flower = Broker(connection.as_uri(include_password=True),
                        broker_options=app.conf.broker_transport_options, broker_use_ssl=None)
    assert asyncio.run(flower.queues(["rf.test.queue"])) == [{"name": "rf.test.queue", "messages": 1}]
    master.delete("rf:c:through-sentinel:cancel", "rf.test.queue")


# -- a campaign through a failover ------------------------------------------------------------

def write_spec(tmp_path: Path, model: Path, out: Path) -> Path:
    (tmp_path / "rows.txt").write_text("".join(f"a lighthouse in a gale {i}\n" for i in range(JOBS)))
    keys = {"name": "failover", "model": str(model), "output": str(out), "prompts": "rows.txt", "base_seed": 3,
            "width": 64, "height": 64, "steps": STEPS, "window": WINDOW}
    path = tmp_path / "failover.yaml"
    path.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in keys.items()))
    return path


@pytest.mark.farm
def test_a_windowed_campaign_outlives_its_primary_and_stores_every_job_exactly_once(
        sentinel_set: SentinelSet, tiny_sd: Path, tmp_path: Path) -> None:
    sentinels = sentinel_set.ready()
    url, out = sentinels.url, tmp_path / "out"
    spec_path = write_spec(tmp_path, tiny_sd, out)
    jobs = list(campaign_jobs(load_spec(spec_path)))
    storage = open_storage(str(out))

    def stored() -> int:
        return sum(storage.exists(image_name("failover", job.job_id)) for job in jobs)

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}

    def run_campaign() -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, "-c", FEEDER, "campaign", "run", str(spec_path), "--broker", url],
                                env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    primary, replica = sentinels.master(), sentinels.replica()
    assert replica.client().info("replication")["master_port"] == sentinels.link.port
    workers = [WorkerProcess(tiny_sd, str(out), url, f"sentinel-{n}", tmp_path, ENV, extra=("--per-device-batch", "1"))
               for n in range(2)]
    try:
        for worker in workers:
            worker.wait_ready(farm_app(url))
        began = time.monotonic()
        first = run_campaign()
        wait_for(lambda: stored() >= JOBS // 3, 120, "a third of the campaign stored")
        sentinels.link.pause()  # asynchronous replication, lagging: what the primary acknowledges
        time.sleep(LAG)  # from here on never reaches the replica
        before, done_before = stored(), Progress(primary.client()).status("failover")["done"]
        primary.stop()  # SIGKILL
        killed = time.monotonic()
        sentinels.link.drop_all()  # and what was on its way to the replica is gone with it
        sentinels.link.resume()
        wait_for(lambda: {s.master_port() for s in sentinels.sentinels} == {replica.port}, 30, "the promotion")
        promoted = time.monotonic()
        progress = Progress.from_url(url)
        done_then = progress.status("failover")["done"]  # less what the lag lost
        first_output, _ = first.communicate(timeout=120)  # it fed to the end, or lost its master
        wait_for(lambda: not progress.r.exists("rf:c:failover:feeder"), 10, "the first run's lock to lapse")
        second = run_campaign()  # submits what the failover lost
        wait_for(lambda: progress.status("failover")["done"] > done_then, 60, "a job done through the new master")
        resumed = time.monotonic()
        rerun_output, _ = second.communicate(timeout=120)
        assert second.returncode == 0, rerun_output
        wait_for(lambda: progress.status("failover")["finished"], 120, "the campaign to finish")
        finished = time.monotonic()
        calls = replica.client().info("commandstats")  # the workers' (`status` below pops its replies with BRPOP)
        shown = subprocess.run([sys.executable, "-m", "renderfarm_cli", "status", "failover", "--json",
                                "--broker", url], env=env, capture_output=True, text=True, timeout=60, check=True).stdout
        print(f"{before} of {JOBS} stored at the kill, {done_before} done on the primary, {done_then} on the "
              f"replica, promoted {promoted - killed:.1f} s after the kill; a job done through it "
              f"{resumed - killed:.1f} s after; the first run exited {first.returncode} "
              f"({first_output.strip().splitlines()[-1:]}), the second: {rerun_output.strip().splitlines()[-1:]}; "
              f"finished {finished - killed:.1f} s after the kill, {finished - began:.1f} s after the start")
    finally:
        for worker in workers:
            worker.stop()
    logs = [worker.log.read_text() for worker in workers]
    assert all("Connection to broker lost" in log for log in logs)  # the workers saw the failover
    for text in (first_output, rerun_output, *logs):
        assert PASSWORD not in text  # its errors name hosts, never the password
    assert before < JOBS, "the primary was killed after the campaign, not during it"
    assert done_then < done_before, "the failover lost none of the primary's last writes: no lag was made"
    status = progress.status("failover")
    report = json.loads(shown)  # `renderfarm status`, its queues' consumers asked over the new master
    assert report["done"] == status["done"] and [q["consumers"] for q in report["queues"]] == [len(workers)], report
    # Storage is the truth. The counts are what reached the new master: a job admitted and done
    # within the lag is in neither, and the second run, finding it stored, does not count it.
    assert status["finished"] and status["failed"] == 0 and status["done"] == status["jobs"] <= JOBS, status
    for job in jobs:
        assert storage.exists(image_name("failover", job.job_id))
        assert storage.exists(sidecar_name("failover", job.job_id))
    assert sorted(manifest_ids(storage, "failover")) == sorted(job.job_id for job in jobs)  # one line each
    # The workers went on with their own transport on the new master: the pop script, loaded
    # there again (a promoted replica has no scripts), never stock kombu's BRPOP.
    new_master = replica.client()
    assert new_master.script_exists(POP_AND_RECORD_SHA) == [True]
    assert calls.get("cmdstat_evalsha", {}).get("calls", 0) > 0 and "cmdstat_brpop" not in calls, sorted(calls)
