"""How the tests see the world: eight CPU devices, no hub, tiny models built here, and
compiled pipelines shared across tests (compilation is the slow part on a CPU)."""

from __future__ import annotations

import os
import tempfile

# Before anything imports JAX or huggingface_hub (both read these once, at import).
_SANDBOX = tempfile.mkdtemp(prefix="renderfarm-tests-")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HOME"] = os.path.join(_SANDBOX, "hf")
os.environ["RENDERFARM_MODEL_CACHE"] = os.path.join(_SANDBOX, "models")
os.environ["RENDERFARM_COMPILE_CACHE"] = os.path.join(_SANDBOX, "jax-cache")

from collections.abc import Callable, Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from tests.farm import STEPS  # noqa: E402, F401 - the tests' step count, imported from here
from tests.gcs_emulator import GcsEmulator  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402


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
    from worker.engine import Engine

    return Engine(sd_model)


@pytest.fixture(scope="session")
def sdxl_engine(sdxl_model):  # noqa: ANN001, ANN201
    from worker.engine import Engine

    return Engine(sdxl_model)


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


Cli = Callable[..., tuple[int, str, str]]


@pytest.fixture()
def cli(capsys: pytest.CaptureFixture[str]) -> Cli:
    """`renderfarm ARGS` in this process, as a user types it: (exit code, stdout, stderr)."""
    import renderfarm_cli

    def run(*argv: object) -> tuple[int, str, str]:
        code = renderfarm_cli.main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return code, out, err
    return run
