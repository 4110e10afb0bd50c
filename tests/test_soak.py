"""A soak that mixes every fault: one windowed campaign of text and image jobs (a few of them
bad, and hostile messages pushed among them) rendered by three workers while, at seeded random
times, workers are SIGKILLed and SIGTERMed and started again, Redis is restarted, every Redis
connection is dropped, storage fails for a moment and for a while, and the feeder is killed and
run again. At the end every good job is stored exactly once (its PNG, sidecar and one manifest
line), every bad job and hostile message is in the dead letters with its reason, the campaign's
counts add up, and every Redis key is within the bound docs/operations.md states for it.

Real parts throughout: redis-server (append-only) behind a proxy that drops connections,
`renderfarm worker` processes, `renderfarm campaign run` processes, the GCS emulator behind a
proxy that fails requests. RENDERFARM_SOAK_SEED replays a run's schedule of faults (each run
prints its seed); RENDERFARM_SOAK_SCALE=10 (`make soak`) runs ten times the jobs and faults.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import redis
from PIL import Image

from harness.farm import STEPS, WorkerProcess, farm_app, manifest_ids, wait_for
from harness.farm import jobs as harness_jobs
from harness.fault_proxies import GcsProxy, Rule, TcpProxy
from harness.gcs_emulator import GcsEmulator
from harness.redis_server import RedisServer
from producer.campaigns import campaign_jobs, load_spec, stored_job_ids
from renderfarm import deadletters
from renderfarm.progress import Progress
from renderfarm.queue import priority_list, priority_lists, queue_name, redis_priority
from renderfarm.sources import SourceRoots
from renderfarm.storage import open_storage
from tests.test_faults import ENVELOPE, JOB, hostile, real_message
from tests.test_window import FEEDER

SCALE = int(os.environ.get("RENDERFARM_SOAK_SCALE", "1"))
SEED = int(os.environ.get("RENDERFARM_SOAK_SEED", random.randrange(2**31)))
JOBS = 1000 * SCALE
WINDOW = 100
WORKERS = 3
BUCKET = "soak"
OUT = f"gs://{BUCKET}/out"
# Short timeouts, so that a killed worker's jobs come back within seconds; attempts to spare for
# the jobs a run of kills catches on the devices more than once.
ENV = {"RENDERFARM_VISIBILITY_TIMEOUT": "5", "RENDERFARM_RESTORE_INTERVAL": "1", "RENDERFARM_MAX_ATTEMPTS": "6"}
ROUNDS = 2 * SCALE  # each kind of fault strikes this often, in a random order
FAULTS = ("sigkill-worker", "sigterm-worker", "restart-redis", "drop-connections", "storage-blip",
          "storage-outage", "kill-feeder", "hostile")
# Every key a campaign run may leave, by pattern (docs/operations.md, "What Redis holds").
KNOWN_KEYS = [r"rf:queues", r"rf:dead", r"rf:dead:.+", r"rf:fleet", r"rf:fleet:.+", r"rf:c:[A-Za-z0-9._-]+:\w+",
              r"unacked", r"unacked_index", r"unacked_mutex", r"_kombu\.binding.*", r"celery-task-meta-.+",
              r".*\.reply\.celery\.pidbox", r"celery"]


def campaign_rows(folder: Path, jobs: int) -> tuple[Path, Path]:
    """Rows of a campaign: text jobs, 1 in 5 an image job from a photo under the source root,
    1 in 97 an image job from a photo outside it (the producer reads it; the workers refuse it)."""
    roots, private = folder / "sources", folder / "private"
    roots.mkdir(), private.mkdir()
    for n in range(3):
        Image.new("RGB", (64, 64), (80 * n, 200 - 60 * n, 40)).save(roots / f"photo{n}.png")
    Image.new("RGB", (64, 64), (0, 0, 250)).save(private / "secret.png")
    rows = []
    for i in range(jobs):
        row: dict[str, object] = {"prompt": f"soak {i}"}
        if i % 97 == 96:
            row |= {"init_image": "private/secret.png", "strength": 0.6}
        elif i % 5 == 4:
            row |= {"init_image": f"sources/photo{i % 3}.png", "strength": 0.6}
        rows.append(json.dumps(row) + "\n")
    (folder / "rows.jsonl").write_text("".join(rows))
    return roots, private


def key_bound_violations(client: redis.Redis, campaign: str, queue: str, bad: int) -> list[str]:
    """What is over its stated bound once the campaign is finished (docs/operations.md)."""
    found = []
    for raw in client.scan_iter("*"):
        name = raw.decode(errors="replace")
        if not any(re.fullmatch(pattern, name) for pattern in KNOWN_KEYS) and name not in priority_lists(queue):
            found.append(f"unexpected key {name!r}")
        elif name.startswith("celery-task-meta-") and client.ttl(raw) < 0:
            found.append(f"{name} has no expiry")
        elif name.startswith("rf:c:") and not name.startswith(f"rf:c:{campaign}:"):
            found.append(f"{name}: a campaign nobody submitted")
    sizes = {"open": client.scard(f"rf:c:{campaign}:open"), "running": client.scard(f"rf:c:{campaign}:running"),
             "attempts": client.hlen(f"rf:c:{campaign}:attempts"), "refunds": client.hlen(f"rf:c:{campaign}:refunds"),
             "unacked": client.hlen("unacked"), "queued": sum(client.llen(name) for name in priority_lists(queue))}
    found += [f"{what}: {n} left" for what, n in sizes.items() if n]
    if client.hlen(f"rf:c:{campaign}:failed") != bad:
        found.append(f"failed: {client.hlen(f'rf:c:{campaign}:failed')} reasons for {bad} bad jobs")
    if client.llen(deadletters.entries_key(queue)) > deadletters.MAX_KEPT:
        found.append("dead letters over their cap")
    if {m.decode() for m in client.smembers("rf:queues")} != {queue} or set(deadletters.DeadLetters(client).counts()) \
            != {queue}:
        found.append("a queue other than the campaign's was named")
    return found


@pytest.mark.farm
def test_a_soak_of_every_fault_stores_each_good_job_once_and_bounds_every_key(
        gcs_server: GcsEmulator, gcs: GcsEmulator, tiny_sd: Path, tmp_path: Path) -> None:
    rng = random.Random(SEED)
    print(f"soak seed {SEED} (RENDERFARM_SOAK_SEED={SEED} replays it), {JOBS} jobs")
    model = tmp_path / "model"
    shutil.copytree(tiny_sd, model)  # a model reference of its own: its own queue
    roots, _ = campaign_rows(tmp_path, JOBS)
    name = f"soak-{SEED}"
    lines = {"name": name, "model": str(model), "output": OUT, "prompts": "rows.jsonl", "base_seed": SEED,
             "width": 64, "height": 64, "steps": STEPS, "window": WINDOW}
    (tmp_path / "spec.yaml").write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in lines.items()))
    spec = load_spec(tmp_path / "spec.yaml")
    jobs = list(campaign_jobs(spec))
    outside = SourceRoots.parse([str(roots)])
    bad = {job.job_id for job in jobs
           if job.init_image is not None and not outside.allows_path(os.path.realpath(job.init_image))}
    good = {job.job_id for job in jobs} - bad
    queue = queue_name(str(model), "float32")

    gcs_server.create_bucket(BUCKET)
    server = RedisServer(appendonly=True)
    client, progress = server.client(), Progress(server.client())
    broker, storage_proxy = TcpProxy(server.port), GcsProxy(gcs_server.url)
    env = {**ENV, "STORAGE_EMULATOR_HOST": storage_proxy.url}
    feeder_env = {**os.environ, "STORAGE_EMULATOR_HOST": gcs_server.url, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH")]))}
    logs = tmp_path / "logs"
    logs.mkdir()
    starts = Counter()

    def start(n: int) -> WorkerProcess:
        starts[n] += 1
        return WorkerProcess(model, OUT, broker.url(), f"soak{n}-{starts[n]}", logs, env,
                             precompile="64x64@3,64x64@3:img2img",
                             extra=("--source-root", str(roots), "--drain-seconds", "3"))

    def feeder() -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", FEEDER, "campaign", "run", str(tmp_path / "spec.yaml"),
                                 "--broker", broker.url()], env=feeder_env, cwd=tmp_path,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    app = farm_app(server.url)
    template = real_message(app, client, harness_jobs(model, "hostile-bad", 1, seed=10_000)[0])  # never submitted
    pushed: dict[str, str] = {}  # hostile kind -> the reason its dead letter must give
    faults: Counter[str] = Counter()
    workers = [start(n) for n in range(WORKERS)]
    for worker in workers:  # compiled (the first time, into the session's cache) before any fault
        worker.wait_ready(app, timeout=300)
    stopping: list[tuple[int, WorkerProcess]] = []
    outages: list[tuple[float, Rule]] = []
    most_open, began, fed = 0, time.monotonic(), False
    run = feeder()
    try:
        deadline = began + 300 * SCALE
        schedule = [fault for _ in range(ROUNDS) for fault in rng.sample(FAULTS, len(FAULTS))]
        while time.monotonic() < deadline:
            time.sleep(rng.uniform(1.5, 4.0) if schedule else 0.5)
            for at, rule in [(at, rule) for at, rule in outages if at <= time.monotonic()]:
                storage_proxy.remove(rule)
                outages.remove((at, rule))
            for n, worker in [(n, worker) for n, worker in stopping if worker.proc.poll() is not None]:
                stopping.remove((n, worker))
                workers[n] = start(n)
            if run.poll() is not None and not fed:
                fed = run.returncode == 0
                if not fed:
                    run = feeder()
            try:
                most_open = max(most_open, client.scard(f"rf:c:{name}:open"))
                status = progress.status(name)
            except redis.ConnectionError:
                continue  # Redis restarting
            if fed and status["finished"] and sum(status[k] for k in ("done", "failed", "cancelled")) == len(jobs):
                break
            if os.environ.get("RENDERFARM_SOAK_TRACE"):
                print(f"{time.monotonic() - began:6.1f}s done {status['done']} failed {status['failed']} "
                      f"open {client.scard(f'rf:c:{name}:open')} fed {fed} {dict(faults)}", flush=True)
            if not schedule:
                continue  # every fault struck: the farm finishes what they left
            fault = schedule.pop()
            faults[fault] += 1
            if os.environ.get("RENDERFARM_SOAK_TRACE"):
                print(time.strftime("%H:%M:%S"), f"{time.time() % 1:.2f}", "fault", fault, flush=True)
            if fault in ("sigkill-worker", "sigterm-worker"):
                live = [n for n in range(WORKERS) if all(n != m for m, _ in stopping)]
                n = rng.choice(live)
                if fault == "sigkill-worker":
                    workers[n].kill()
                    workers[n] = start(n)
                else:
                    workers[n].proc.send_signal(signal.SIGTERM)
                    stopping.append((n, workers[n]))
            elif fault == "restart-redis":
                server.stop()
                time.sleep(rng.uniform(0.2, 1.5))
                server.start()
            elif fault == "drop-connections":
                broker.drop_all()
            elif fault == "storage-blip":
                storage_proxy.add(Rule(rf"^out/{name}/", status=rng.choice([500, 503, 429]), times=rng.randint(1, 6)))
            elif fault == "storage-outage":
                outages.append((time.monotonic() + rng.uniform(1, 4), storage_proxy.add(Rule(rf"^out/{name}/", status=503))))
            elif fault == "kill-feeder":
                if run.poll() is None:
                    run.send_signal(signal.SIGKILL)
                    run.wait()
                fed, run = False, feeder()  # a run after the campaign was fed sends nothing
            else:
                kind = rng.choice(sorted(set(ENVELOPE) | set(JOB)))
                if kind not in pushed:
                    mutation, reason = {**ENVELOPE, **JOB}[kind]
                    try:
                        client.lpush(priority_list(queue, redis_priority(None)), hostile(template, mutation, kind))
                        pushed[kind] = reason
                    except redis.ConnectionError:
                        faults[fault] -= 1
        seconds = time.monotonic() - began
        for at, rule in outages:
            storage_proxy.remove(rule)
        for n, worker in stopping:
            worker.proc.wait(30)
            workers[n] = start(n)
        run.wait(120)
        assert run.returncode == 0 or feeder().wait(120) == 0, (SEED, faults)
        wait_for(lambda: progress.status(name)["finished"] and client.hlen("unacked") == 0, 180 * SCALE,
                 f"the soak's campaign to finish (seed {SEED})")
    finally:
        for worker in workers:
            worker.stop()
        broker.close()
        storage_proxy.close()

    status = progress.status(name)
    storage = open_storage(OUT)
    ids = manifest_ids(storage, name)
    duplicated = len(ids) - len(set(ids))
    lost = len(good - set(ids))
    print(f"soak seed {SEED}: {len(jobs)} jobs ({len(bad)} bad) and {len(pushed)} hostile messages in {seconds:.0f} s "
          f"under {sum(faults.values())} faults ({dict(sorted(faults.items()))}), worker starts {sum(starts.values())}, "
          f"most open {most_open}: lost {lost}, doubled {duplicated}")
    if os.environ.get("RENDERFARM_SOAK_TRACE"):
        report = {}
        prefix = f"{name}/manifest/"
        parts = {n: storage.get(n).decode() for n in storage.list(prefix)}
        for job_id in {i for i in ids if ids.count(i) > 1} | (good - set(ids)):
            sidecar = storage.get(f"{name}/{job_id}.json") if storage.exists(f"{name}/{job_id}.json") else b"{}"
            report[job_id] = {"parts": [n for n, text in parts.items() if job_id in text],
                              "sidecar_part": json.loads(sidecar).get("manifest_part"),
                              "logs": [f"{log.name}: {line}" for log in logs.iterdir()
                                       for line in log.read_text(errors="replace").splitlines() if job_id in line]}
        (tmp_path / "report.json").write_text(json.dumps(report, indent=1))
        print("report in", tmp_path / "report.json")
    assert set(faults) == set(FAULTS), (SEED, faults)  # every kind of fault struck
    assert (lost, duplicated) == (0, 0) and set(ids) == good, SEED
    assert stored_job_ids(spec) == good, SEED  # their sidecars, and nothing of the bad jobs
    pngs = {n.rsplit("/", 1)[-1].removesuffix(".png") for n in storage.list(f"{name}/")
            if re.fullmatch(r"[^/]+/[0-9a-f]{32}\.png", n)}
    assert pngs == good, SEED
    assert status["done"] + status["failed"] + status["cancelled"] == status["jobs"] == len(jobs), (SEED, status)
    assert (status["done"], status["failed"], status["cancelled"]) == (len(good), len(bad), 0), (SEED, status)
    letters = deadletters.DeadLetters(client).entries(queue, limit=deadletters.MAX_KEPT)
    assert bad <= {entry["job_id"] for entry in letters}, SEED
    rule = outside.rule
    assert all(reason.endswith(rule) for reason in status["failures"].values()), (SEED, status["failures"])
    reasons = [entry["reason"] for entry in letters]
    for kind, reason in pushed.items():
        assert any(reason in text for text in reasons), (SEED, kind, reason)
    assert most_open <= WINDOW, (SEED, most_open)
    assert key_bound_violations(client, name, queue, len(bad)) == [], SEED
    server.close()
