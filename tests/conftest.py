"""How the tests see the world: eight CPU devices, no hub, tiny models built here, compiled
pipelines shared across tests (compilation is the slow part on a CPU), and one farm of real
processes shared by the test files whose campaigns are namespaced anyway."""

from __future__ import annotations

import os
import shutil
import tempfile

# Before anything imports JAX or huggingface_hub (both read these once, at import).
_SANDBOX = tempfile.mkdtemp(prefix="renderfarm-tests-")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Compiling is most of the suite's time on a CPU, and the tiny models run in milliseconds either
# way: XLA skips its costlier optimisations (LLVM at -O0), which compiles about a quarter faster.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HOME"] = os.path.join(_SANDBOX, "hf")
os.environ["RENDERFARM_MODEL_CACHE"] = os.path.join(_SANDBOX, "models")
# One compile cache for the whole run: pytest-xdist's test processes inherit the first process's
# environment, and the processes the tests start (`renderfarm render`, workers) inherit theirs,
# so a program one of them compiled, the others load.
os.environ.setdefault("RENDERFARM_TESTS_COMPILE_CACHE", os.path.join(_SANDBOX, "jax-cache"))
os.environ["RENDERFARM_COMPILE_CACHE"] = os.environ["RENDERFARM_TESTS_COMPILE_CACHE"]

from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from harness.farm import WorkerProcess, farm_app  # noqa: E402
from harness.redis_server import RedisServer, free_port  # noqa: E402
from renderfarm.progress import Progress  # noqa: E402
from renderfarm.storage import Storage, open_storage  # noqa: E402
from harness.fault_proxies import GcsProxy  # noqa: E402
from harness.gcs_emulator import GcsEmulator  # noqa: E402
from tests.helpers import FARM_OUT, STORE_THREADS, Cli, Farm, engine, scrape  # noqa: E402


def pytest_unconfigure() -> None:
    """Each process removes its own sandbox; the first process's, which holds the shared compile
    cache, goes when the run is over (pytest-xdist's test processes end before it)."""
    shutil.rmtree(_SANDBOX, ignore_errors=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that uses the session's farm is a `farm` test, marked or not (`make check`)."""
    for item in items:
        if "farm" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.farm)


# `make test` runs three processes (pytest-xdist; compiling is single-threaded). The files that use
# the session's farm run in one of them, so one farm starts; the oracle's renders of each model
# family run in one, so each family's models load once (SDXL's and the others' side by side).
FARM_FILES = ("test_farm.py", "test_promises.py", "test_campaigns.py", "test_window.py", "test_metrics.py",
              "test_flower.py")
ORACLE_FILES = ("test_reference.py", "test_engine.py", "test_single_file.py")
FLUX_FILES = ("test_flux.py", "test_flux_files.py", "test_flux_lora.py")
# Files whose tests mostly wait, on a clock (a beat's schedule, a visibility timeout) or on a
# process of their own (a Celery worker, the engine benchmark's smoke run): run in one process,
# taken early (pytest-xdist hands out the groups with the most tests first), so that their
# waits overlap the other processes' compiles instead of leaving a core idle at the end.
WAITING_FILES = ("test_schedules.py", "test_broker.py", "test_producer.py", "test_bench_engine.py", "test_sentinel.py")
# Files whose module-scoped fixtures are costly (renders, workers) or whose tests share what one
# process compiles, loads or traces (test_loading's conversions and old-loader references,
# test_nn's Flax classes): each runs in one process, so that these are built once
# (test_executables' store must also compile its program itself, which a second process would
# load from the shared cache). Every other test runs wherever there is room.
WHOLE_FILES = ("test_sharding.py", "test_executables.py", "test_tls.py", "test_faults.py", "test_tokenizer.py",
               "test_flux_modules.py", "test_plan.py", "test_loading.py", "test_nn.py")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    from xdist.scheduler import LoadScopeScheduling

    class Groups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::")[0].rsplit("/", 1)[-1]
            if file in FARM_FILES:
                return "farm"
            if file in ORACLE_FILES:
                return "oracle-sdxl" if "sdxl" in nodeid else "oracle-sd"
            if file in FLUX_FILES:
                return "oracle-flux"
            if file in WAITING_FILES:
                return "waiting"
            return file if file in WHOLE_FILES else nodeid

    return Groups(config, log)


@pytest.fixture(scope="session", autouse=True)
def compile_cache() -> Path:
    from worker.engine import enable_compilation_cache

    return enable_compilation_cache(os.environ["RENDERFARM_COMPILE_CACHE"])


@pytest.fixture(scope="session")
def tiny_sd(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from diffusion.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-sd", kind="sd")


@pytest.fixture(scope="session")
def tiny_sdxl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from diffusion.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-sdxl", kind="sdxl")


@pytest.fixture(scope="session")
def sd_model(tiny_sd: Path):  # noqa: ANN201 - LoadedModel, imported lazily
    from diffusion.models import load_model

    return load_model(str(tiny_sd))


@pytest.fixture(scope="session")
def sdxl_model(tiny_sdxl: Path):  # noqa: ANN201
    from diffusion.models import load_model

    return load_model(str(tiny_sdxl))


@pytest.fixture(scope="session")
def sd_engine(sd_model):  # noqa: ANN001, ANN201 - Engine on all 8 devices
    return engine(sd_model)


@pytest.fixture(scope="session")
def sdxl_engine(sdxl_model):  # noqa: ANN001, ANN201
    return engine(sdxl_model)


@pytest.fixture(scope="module")
def redis_server(request: pytest.FixtureRequest) -> Iterator[RedisServer]:
    """A redis-server of the module's own; a module that restarts it sets REDIS_APPENDONLY
    = True, so what was written survives (the append-only file, as in production)."""
    server = RedisServer(appendonly=getattr(request.module, "REDIS_APPENDONLY", False))
    yield server
    server.close()


@pytest.fixture()
def broker(redis_server: RedisServer) -> str:
    """The module's Redis, emptied for each test."""
    redis_server.client().flushall()
    return redis_server.url


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[GcsEmulator]:
    with GcsEmulator() as emulator:
        yield emulator


@pytest.fixture()
def gcs(gcs_server: GcsEmulator, monkeypatch: pytest.MonkeyPatch) -> GcsEmulator:
    """The emulator, with the google client of this test pointed at it."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_server.url)
    return gcs_server


# Short timeouts, so that jobs a Redis restart strands come back within seconds (tests/test_farm.py).
FARM_ENV = {"RENDERFARM_VISIBILITY_TIMEOUT": "10", "RENDERFARM_RESTORE_INTERVAL": "1",
            "RENDERFARM_MAX_ATTEMPTS": "2"}

# Test instrumentation for the farm's workers only: Python 3.11 does not give its threads
# OS-level names (3.14 does), so a test cannot see a worker's thread pools from outside.
# This names each thread's OS thread after the Python thread (ThreadPoolExecutor's
# `store_0`, `store_1`, ...); it changes nothing else.
THREAD_NAMES = '''\
import ctypes
import threading

_prctl = ctypes.CDLL(None).prctl
_bootstrap_inner = threading.Thread._bootstrap_inner


def _named(self):
    try:
        _prctl(15, self.name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except Exception:
        pass
    _bootstrap_inner(self)


threading.Thread._bootstrap_inner = _named
'''


@pytest.fixture(scope="session")
def farm(gcs_server: GcsEmulator, tiny_sd: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Farm]:
    """Started once a session (worker processes are the slow part of a farm test): a Redis of its
    own (append-only, so that a restart keeps what was written), two workers with --metrics-port
    and --store-threads 3, storing to FARM_OUT through a proxy and reading image jobs' sources
    from the session's temporary folders (every test's tmp_path is below them). The first worker
    compiles into a cold cache of its own, so that its metrics show the compile; the second uses
    the session's."""
    server = RedisServer(appendonly=True)
    gcs_server.create_bucket(FARM_OUT.removeprefix("gs://").split("/")[0])
    proxy = GcsProxy(gcs_server.url)
    site = tmp_path_factory.mktemp("thread-names")
    (site / "sitecustomize.py").write_text(THREAD_NAMES)
    env = {**FARM_ENV, "STORAGE_EMULATOR_HOST": proxy.url,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    logs = tmp_path_factory.mktemp("farm-logs")
    app = farm_app(server.url)
    ports = [free_port(), free_port()]
    cold = ("--compile-cache", str(tmp_path_factory.mktemp("cold-cache")))
    workers = [WorkerProcess(tiny_sd, FARM_OUT, server.url, f"w{i}", logs, env,
                             extra=("--store-threads", str(STORE_THREADS), "--metrics-port", str(port),
                                    "--source-root", str(tmp_path_factory.getbasetemp()), *(cold if i == 0 else ())))
               for i, port in enumerate(ports)]
    try:
        for worker in workers:
            worker.wait_ready(app)
        yield Farm(server, app, Progress(server.client()), workers, proxy, env, logs, ports,
                   [scrape(port) for port in ports])
    finally:
        for worker in workers:
            worker.stop()
        proxy.close()
        server.close()


@pytest.fixture()
def bucket(farm: Farm, gcs: GcsEmulator) -> Storage:
    """The farm's output, read straight from the emulator (not through the proxy)."""
    return open_storage(FARM_OUT)


@pytest.fixture()
def cli(capsys: pytest.CaptureFixture[str]) -> Cli:
    """`renderfarm ARGS` in this process, as a user types it: (exit code, stdout, stderr)."""
    import renderfarm_cli

    def run(*argv: object) -> tuple[int, str, str]:
        code = renderfarm_cli.main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return code, out, err
    return run
