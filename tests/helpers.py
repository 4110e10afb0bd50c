"""Helpers more than one test file uses, so that no test file imports another: the session's
farm, the reproducibility contract's references (`make oracle` wrote them under tests/data/),
results stored as a worker stores them, command lines checked against the real parser, and the
type of the `cli` fixture."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import io
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from flax.traverse_util import flatten_dict
from PIL import Image

from diffusion.models import LoadedModel, load_model
from harness.farm import STEPS, WorkerProcess
from harness.redis_server import RedisServer, free_port
from renderfarm.jobs import JobSpec, parse_job
from renderfarm.layout import manifest_name
from renderfarm.progress import Progress
from renderfarm.storage import Storage
from renderfarm_cli import parser
from harness.fault_proxies import GcsProxy
from tests.stepwise import render_stepwise
from worker.engine import Engine
from worker.executables import ExecutableStore

Cli = Callable[..., tuple[int, str, str]]  # the `cli` fixture: (exit code, stdout, stderr)

# --------------------------------------------------------------------------- the session's farm

FARM_OUT = "gs://farm/out"  # where the farm's workers store, through `Farm.proxy`
STORE_THREADS = 3  # each farm worker's --store-threads


@dataclasses.dataclass
class Farm:
    """The session's farm (tests/conftest.py): a redis-server, two `renderfarm worker` processes
    on the tiny model storing to FARM_OUT through `proxy`, each serving /metrics. Each test gives
    it campaigns of its own; a test that breaks a worker on purpose starts its own."""

    redis: RedisServer
    app: Any  # the Celery app producers send with
    progress: Progress
    workers: list[WorkerProcess]
    proxy: GcsProxy  # in front of the emulator: a test can stall or fail storage requests
    env: dict[str, str]  # the workers' environment, for a test's own worker beside them
    logs: Path
    metrics_ports: list[int]
    started: list[dict[str, float]]  # each worker's /metrics once it was ready

    @property
    def broker(self) -> str:
        return self.redis.url

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Every worker stopped (SIGSTOP) meanwhile: nothing is taken, rendered or stored."""
        for worker in self.workers:
            worker.proc.send_signal(signal.SIGSTOP)
        try:
            yield
        finally:
            for worker in self.workers:
                worker.proc.send_signal(signal.SIGCONT)


def scrape(port: int) -> dict[str, float]:
    """A worker's /metrics as {sample with labels: value}."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples

# --------------------------------------------------------------------------- the oracle's references

DATA = Path(__file__).parent / "data"
ORACLE = DATA / "oracle"
TOLERANCE = 2  # out of 255, per channel (the contract)


def reference_jobs() -> dict[tuple[str, str | None, str, int, int], list[dict[str, Any]]]:
    """Every reference job, by what a batch shares: model folder, variant, scheduler, size."""
    batches: dict[tuple[str, str | None, str, int, int], list[dict[str, Any]]] = defaultdict(list)
    for index in sorted(ORACLE.glob("*/jobs.json")):
        for job in json.loads(index.read_text())["jobs"]:
            batches[(job["model"], job["variant"], job["scheduler"], job["width"], job["height"])].append(job)
    return dict(batches)


BATCHES = reference_jobs()


def sampler_jobs() -> dict[str, list[dict[str, Any]]]:
    """The stochastic schedulers, the sampler options and the few-step recipes
    (tests/oracle/samplers.py), by set; model and image paths are relative to tests/data."""
    batches: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for job in json.loads((DATA / "samplers" / "jobs.json").read_text())["jobs"]:
        batches[job["batch"]].append(job)
    return dict(batches)


SAMPLER_BATCHES = sampler_jobs()


def representable(job: dict[str, Any], model: LoadedModel) -> bool:
    """A job the contract can state. A job's empty negative prompt is PyTorch's `None`: SDXL
    then uses zeros (force_zeros_for_empty_prompt), where an explicit "" would be encoded."""
    return not (job.get("negative_prompt") == "" and model.family.name == "sdxl"
                and dict(model.networks.options).get("force_zeros_for_empty_prompt", False))


@functools.cache
def loaded(folder: str, variant: str | None) -> tuple[LoadedModel, Engine]:
    """An oracle checkpoint (a folder under tests/data/oracle, or an absolute path) and its engine,
    loaded (and compiled) once per session for every test file that renders it: loading is the
    slow part on a CPU."""
    model = load_model(str(ORACLE / folder), variant=variant)
    return model, engine(model)


def engine(model: LoadedModel, **options: Any) -> Engine:
    """An engine on every device (or as `options` say) that saves and loads its programs in the
    session's compile cache, as `renderfarm render` and the workers do: a program one test
    process compiled is loaded by the others, not traced again (tracing is half of a tiny
    program's compile)."""
    return Engine(model, executables=ExecutableStore(Path(os.environ["RENDERFARM_COMPILE_CACHE"]) / "executables"),
                  **options)


def spec(model: LoadedModel, job: dict[str, Any]) -> JobSpec:
    """A reference job for `model` (Flux's jobs name no negative prompt, scheduler or variant;
    an image job names its init image and mask relative to tests/data)."""
    return JobSpec(prompt=job["prompt"], model=model.ref, seed=job["seed"], steps=job["steps"],
                   negative_prompt=job.get("negative_prompt") or "", guidance_scale=job["guidance_scale"],
                   width=job["width"], height=job["height"], scheduler=job.get("scheduler"), variant=job.get("variant"),
                   timestep_spacing=job.get("timestep_spacing"), karras=job.get("karras"), base=model.base,
                   loras=model.loras, init_image=_data_path(job, "init_image"), mask_image=_data_path(job, "mask_image"),
                   strength=job.get("strength"))


def _data_path(job: dict[str, Any], field: str) -> str | None:
    """A reference job's image field, a path relative to tests/data, as the worker reads it."""
    return str(DATA / job[field]) if job.get(field) else None


def max_diffs(engine: Engine, model: LoadedModel, jobs: list[dict[str, Any]], images: Path = ORACLE) -> list[int]:
    """Each job's largest channel difference from its reference image (under `images`), rendered
    with each network compiled once (tests/stepwise.py)."""
    jobs = [job for job in jobs if representable(job, model)]
    rendered = render_stepwise(engine, [spec(model, job) for job in jobs])
    # Like PyTorch, a scale <= 1 runs no classifier-free guidance: a program of its own.
    assert [key.guided for key, _ in rendered] == [job["guidance_scale"] > 1 for job in jobs]
    return [int(np.abs(np.asarray(Image.open(images / job["image"]).convert("RGB"), np.int16)
                       - image.astype(np.int16)).max())
            for job, (_, image) in zip(jobs, rendered)]


def one_program_matches(engine: Engine, model: LoadedModel, jobs: list[dict[str, Any]], batch: str) -> list[int]:
    """An image batch (tests/data's img2img and inpaint sets, strengths mixed) of one shape key,
    so one program serves every strength, each image within TOLERANCE of its reference; the
    differences."""
    assert len({engine.check(spec(model, job)) for job in jobs}) == 1
    diffs = max_diffs(engine, model, jobs, images=DATA)
    assert max(diffs) <= TOLERANCE, f"{batch}: max differences {diffs} (out of 255)"
    return diffs


def worst(images: list[np.ndarray], files: list[Path]) -> int:
    """The largest channel difference between images and the PNG files they are held to, in order."""
    wanted = [np.asarray(Image.open(file).convert("RGB")).astype(int) for file in files]
    assert [image.shape for image in images] == [want.shape for want in wanted]
    return max(int(np.abs(image.astype(int) - want).max()) for image, want in zip(images, wanted))


def same_params(a: LoadedModel, b: LoadedModel) -> None:
    """The same parameters, bit for bit, component by component."""
    assert a.params.keys() == b.params.keys()
    for component in a.params:
        flat_a, flat_b = flatten_dict(a.params[component]), flatten_dict(b.params[component])
        assert flat_a.keys() == flat_b.keys(), component
        for path in flat_a:
            np.testing.assert_array_equal(flat_a[path], flat_b[path], err_msg=f"{component} {path}")


def render_command(jobs: list[dict[str, Any]], tmp_path: Path, *flags: str) -> dict[int, np.ndarray]:
    """`renderfarm render --prompts JOBS.jsonl FLAGS...` in a process of its own, as a user runs it:
    the images it wrote, by their job's seed (from the PNG's fields)."""
    prompts, out = tmp_path / "jobs.jsonl", tmp_path / "out"
    fields = ("prompt", "seed", "steps", "guidance_scale", "width", "height")
    prompts.write_text("".join(json.dumps({k: job[k] for k in fields if k in job}) + "\n" for job in jobs), encoding="utf-8")
    done = subprocess.run([sys.executable, "-m", "renderfarm_cli", "render", "--prompts", str(prompts), "--out", str(out),
                           "--campaign", "render", "--quiet", *flags], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    by_seed = {}
    for path in (out / "render").glob("*.png"):
        image = Image.open(path)
        fields = [json.loads(text) for text in image.text.values() if text.startswith("{")]
        if fields and "seed" in fields[0]:
            by_seed[fields[0]["seed"]] = np.asarray(image.convert("RGB"))
    return by_seed


# --------------------------------------------------------------------------- stored results

COLOURS = [(230, 30, 30), (30, 200, 40), (40, 60, 230), (240, 220, 20), (200, 40, 220)]
HOSTILE = ['<script>alert("x")</script> a cat', '"><img src=x onerror=alert(1)> a dog']


def store_jobs(storage: Storage, model: Any, jobs: list[JobSpec],
               colours: list[tuple[int, int, int]]) -> list[dict[str, Any]]:
    """The jobs' results, solid colours, stored the way the worker stores them (worker/output.py's
    ResultWriter: PNG, sidecar, manifest lines, thumbnail): finished jobs without a render."""
    import jax

    from worker.engine import Batch, Rendered, ShapeKey
    from worker.output import ResultWriter

    results = [Rendered(i, job, np.full((job.height, job.width, 3), colour, np.uint8),
                        ShapeKey(job.width, job.height, job.steps, "pndm"), False, Batch(0, len(jobs), 8, 0.1))
               for i, (job, colour) in enumerate(zip(jobs, colours, strict=True))]
    stored: list[dict[str, Any]] = []
    with ResultWriter(storage, model, jax.devices(), on_stored=stored.extend) as writer:
        writer.submit(results)
    return stored


def store_results(storage: Storage, model: Any, campaign: str, colours: list[tuple[int, int, int]],
                  prompts: list[str] | None = None, size: tuple[int, int] = (64, 64)) -> list[dict[str, Any]]:
    """Solid-colour results of a campaign, one job per colour, as the worker stores them."""
    width, height = size
    prompts = prompts or [f"a {c} square" for c in ("red", "green", "blue", "yellow", "magenta")][:len(colours)]
    jobs = [parse_job({"prompt": p, "model": model.ref, "seed": 100 + i, "steps": STEPS, "width": width,
                       "height": height, "campaign": campaign}) for i, p in enumerate(prompts)]
    return store_jobs(storage, model, jobs, colours)


def append_raw(storage: Storage, campaign: str, lines: list[str]) -> None:
    """Lines appended to a local manifest behind its back (the worker never writes a job twice)."""
    with storage.path(manifest_name(campaign)).open("a") as file:
        file.writelines(line + "\n" for line in lines)


# --------------------------------------------------------------------------- `renderfarm` command lines

def subcommands(top: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return {name: sub for action in top._actions if isinstance(action, argparse._SubParsersAction)
            for name, sub in action.choices.items()}


def check_renderfarm_args(argv: list[str], where: str) -> argparse.Namespace:
    """Parse `renderfarm ARGV` with renderfarm_cli.parser(); fail with the parser's message."""
    assert argv, f"{where}: `renderfarm` without a subcommand"
    top = parser()
    known = subcommands(top)
    if argv[0] not in known:
        pytest.fail(f"{where}: `renderfarm {argv[0]}` is not a renderfarm subcommand ({sorted(known)})")
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return top.parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where}: renderfarm {shlex.join(argv)}\n{err.getvalue()}")


def submitted(server: RedisServer, campaign: str, ids: list[str], window: int | None = None) -> Progress:
    """An empty Redis holding a campaign whose `ids` were submitted, each its own message on the
    list rf.q: plainly, or with a `window` as its feeder ("holder") admits them."""
    client = server.client()
    client.flushall()
    progress = Progress(client)
    if window is None:
        progress.submitted(campaign, ids, "rf.q")
        return progress
    client.hset(f"rf:c:{campaign}:counts", "window", window)
    client.set(f"rf:c:{campaign}:feeder", "holder")
    assert progress.admit(campaign, [(i, "rf.q", i) for i in ids], ["rf.q"], "holder", "t1") == ("ok", len(ids))
    return progress



# --------------------------------------------------------------------------- deployments' sentinels

def heredoc(script: str) -> str:
    """What a deployment's shell script writes with `cat > FILE <<EOF` (a sentinel's configuration)."""
    lines = script.splitlines()
    start = next(i for i, line in enumerate(lines) if line.rstrip().endswith("<<EOF"))
    end = lines.index("EOF", start)
    return "\n".join(lines[start + 1:end]) + "\n"


def redis_options(command: list[str]) -> dict[str, str]:
    """A deployment's redis-server command line as its `--flag value` pairs (`--replicaof HOST
    PORT` as one "HOST PORT")."""
    assert command[0] == "redis-server", command
    options, rest = {}, command[1:]
    while rest:
        width = 3 if rest[0] == "--replicaof" else 2
        options[rest[0]] = " ".join(rest[1:width])
        rest = rest[width:]
    return options


def sentinel_master(config: str, monitored: str, folder: Path) -> dict[str, Any]:
    """Start a real sentinel (`redis-server CONFIG --sentinel`) on a deployment's configuration,
    with a free port for its own and `monitored` (the host it names) read as localhost, and
    return what it says of the master it monitors: a configuration redis-server refuses fails."""
    port = free_port()
    lines = [f"port {port}" if line.startswith("port ") else line.replace(f" {monitored} ", " localhost ")
             for line in config.splitlines()]
    path = folder / "sentinel.conf"
    path.write_text("\n".join(lines) + "\n")
    server = subprocess.Popen(["redis-server", str(path), "--sentinel", "--dir", str(folder)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        client = redis.Redis(port=port, decode_responses=True)
        for _ in range(100):
            assert server.poll() is None, f"redis-server refused the configuration: {server.communicate()[0]}"
            with contextlib.suppress(redis.ConnectionError):
                (master,) = client.sentinel_masters().values()
                return master
            time.sleep(0.05)
        raise AssertionError("the sentinel did not start")
    finally:
        server.kill()
        server.wait()
