"""What can be checked of the deployment files without a Docker engine or a TPU: they parse,
the `renderfarm` commands they run are real subcommands with real flags (renderfarm.cli's
own parser), and the settings the farm depends on are there (Redis persistence, Flower auth,
the GCS emulator, private compile caches, one systemd-managed worker per TPU host).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shlex
import shutil
import stat
import subprocess
import tomllib
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml
from packaging.specifiers import SpecifierSet

from renderfarm.cli import parser

ROOT = Path(__file__).resolve().parent.parent
INFRA = ROOT / "infra"
TPU = INFRA / "tpu"
DOCKERFILE = INFRA / "worker.Dockerfile"
UNIT = TPU / "renderfarm-worker.service"
STARTUP = TPU / "startup.sh"
CREATE = TPU / "create-tpu-vms.sh"
OPERATIONS = ROOT / "docs" / "operations.md"
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
BROKER = "redis://redis:6379/0"

# -- validating `renderfarm ...` command lines against the real parser ---------------------------

def subcommands(top: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return {name: sub for action in top._actions if isinstance(action, argparse._SubParsersAction)
            for name, sub in action.choices.items()}


def check_renderfarm_args(argv: list[str], where: str) -> argparse.Namespace:
    """Parse `renderfarm ARGV` with renderfarm.cli.parser(); fail with the parser's message."""
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


def renderfarm_commands(script: str) -> list[list[str]]:
    """The `renderfarm` invocations of a `sh -c` script (commands joined by &&)."""
    return [words[1:] for part in script.split("&&")
            if (words := shlex.split(part)) and words[0] == "renderfarm"]


def image_entrypoint_is_renderfarm() -> bool:
    return 'ENTRYPOINT ["renderfarm"]' in DOCKERFILE.read_text()


def service_commands(name: str, service: dict) -> list[list[str]]:
    """The `renderfarm` argument lists a compose service runs."""
    entrypoint = service.get("entrypoint")
    command = service.get("command", [])
    if isinstance(command, str):
        command = shlex.split(command)
    if entrypoint in (["sh", "-c"], ["/bin/sh", "-c"], ["bash", "-c"]):
        return renderfarm_commands(" ".join(command))
    if entrypoint:
        words = shlex.split(entrypoint) if isinstance(entrypoint, str) else list(entrypoint)
        return [words[1:] + command] if Path(words[0]).name == "renderfarm" else []
    ours = service.get("build", {}).get("dockerfile") == "infra/worker.Dockerfile"
    if ours and image_entrypoint_is_renderfarm():
        return [list(command)] if command else []
    return []


def unit_entries(section: str) -> list[tuple[str, str]]:
    """(key, value) pairs of one section of the systemd unit, in order (keys may repeat)."""
    entries, current = [], None
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            current = line.strip("[]")
        elif current == section:
            key, _, value = line.partition("=")
            entries.append((key.strip(), value.strip()))
    return entries


def exec_start_args() -> list[str]:
    """ExecStart's `renderfarm` arguments, with systemd's variables and specifiers filled in."""
    line = next(v for k, v in unit_entries("Service") if k == "ExecStart")
    words = shlex.split(line)
    index = next(i for i, w in enumerate(words) if Path(w).name == "renderfarm")
    numeric = {"RENDERFARM_PER_DEVICE_BATCH": "1", "RENDERFARM_MAX_WAIT": "2"}
    args = []
    for word in words[index + 1:]:
        if re.fullmatch(r"\$[A-Z_]+", word):  # $VAR: split into zero or more words; empty here
            continue
        word = re.sub(r"\$\{([A-Z_]+)\}", lambda m: numeric.get(m[1], f"value-of-{m[1]}"), word)
        args.append(word.replace("%H", "host"))
    return args


def doc_commands() -> Iterator[tuple[str, list[str]]]:
    """`renderfarm ...` and `docker compose run ... producer ...` lines of docs/operations.md's code blocks."""
    if not OPERATIONS.exists():
        return
    in_code = False
    pending = ""
    for number, raw in enumerate(OPERATIONS.read_text().splitlines(), start=1):
        if raw.lstrip().startswith("```"):
            in_code, pending = not in_code, ""
            continue
        if not in_code:
            continue
        line = pending + raw.split(" #")[0].strip()
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        try:
            words = shlex.split(line)
        except ValueError:
            continue
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):  # VAR=value prefixes
            words = words[1:]
        if words[:1] == ["$"]:
            words = words[1:]
        if words[:1] == ["renderfarm"] and len(words) > 1 and not words[1].startswith("-"):
            yield f"docs/operations.md:{number}", words[1:]
        elif words[:3] == ["docker", "compose", "run"]:
            rest = [w for w in words[3:] if w not in ("--rm", "-it", "-T")]
            if rest and rest[0] in SERVICES and service_commands(rest[0], SERVICES[rest[0]]) and len(rest) > 1:
                yield f"docs/operations.md:{number}", rest[1:]


def command_sites() -> list[tuple[str, list[str]]]:
    sites = [(f"docker-compose.yml:{name}", argv) for name, service in SERVICES.items()
             for argv in service_commands(name, service)]
    sites.append((f"{UNIT.relative_to(ROOT)}:ExecStart", exec_start_args()))
    sites.extend(doc_commands())
    return sites


SITES = command_sites()


@pytest.mark.parametrize(("where", "argv"), SITES, ids=[f"{w}:{a[0]}" for w, a in SITES])
def test_command_is_a_real_subcommand_with_real_flags(where: str, argv: list[str]) -> None:
    check_renderfarm_args(argv, where)


def test_every_farm_role_is_checked() -> None:
    roles = {argv[0] for _, argv in SITES}
    assert {"tiny-model", "render", "worker", "flower", "status", "submit"} <= roles, roles


# -- docker-compose.yml ------------------------------------------------------------------------------

def environment(service: dict) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def option(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_render_service_still_renders_locally() -> None:
    render = SERVICES["render"]
    assert (ROOT / render["build"]["dockerfile"]).is_file()
    commands = renderfarm_commands(" ".join(render["command"]))
    assert [c[0] for c in commands] == ["tiny-model", "render"]
    for command in commands:
        parser().parse_args(command)  # exits on an unknown subcommand or flag


def test_redis_persists_with_the_append_only_file() -> None:
    redis = SERVICES["redis"]
    assert redis["image"].split(":")[0] == "redis" and redis["image"].split(":")[1].startswith("7")
    command = redis["command"]
    assert command[0] == "redis-server" and option(command, "--appendonly") == "yes"
    assert any(v.split(":")[1] == "/data" for v in redis["volumes"]), "the AOF lives in /data: keep it on a volume"


def test_gcs_emulator_has_the_bucket_the_worker_writes_to() -> None:
    gcs = SERVICES["gcs"]
    assert gcs["image"].startswith("fsouza/fake-gcs-server:")
    command = gcs["command"]
    assert option(command, "-scheme") == "http"
    port = option(command, "-port")
    buckets = {Path(v["target"]).name for v in gcs["volumes"] if isinstance(v, dict)
               and Path(v["target"]).parent == Path("/data")}
    worker = service_commands("worker", SERVICES["worker"])[0]
    out = option(worker, "--out")
    assert out.startswith("gs://") and out[5:].split("/")[0] in buckets, (out, buckets)
    assert environment(SERVICES["worker"])["STORAGE_EMULATOR_HOST"] == f"http://gcs:{port}"


def test_worker_runs_on_eight_cpu_devices_against_the_farm() -> None:
    worker = SERVICES["worker"]
    env = environment(worker)
    assert env["RENDERFARM_BROKER_URL"] == BROKER
    assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"
    assert env["JAX_PLATFORMS"] == "cpu"
    argv = service_commands("worker", worker)[0]
    assert argv[0] == "worker"
    # The model it serves is the one the one-shot `model` service builds, on a shared volume.
    model = service_commands("model", SERVICES["model"])[0]
    assert model[:2] == ["tiny-model", option(argv, "--model")]
    assert worker["depends_on"]["model"]["condition"] == "service_completed_successfully"
    assert worker["depends_on"]["redis"]["condition"] == "service_healthy"
    assert "cache:/cache" in worker["volumes"] and "cache:/cache" in SERVICES["model"]["volumes"]


def test_flower_needs_auth_and_shares_the_broker() -> None:
    flower = SERVICES["flower"]
    env = environment(flower)
    auth = env["RENDERFARM_FLOWER_AUTH"]
    match = re.fullmatch(r"\$\{RENDERFARM_FLOWER_AUTH:-([^}]+)\}", auth)
    assert match, f"RENDERFARM_FLOWER_AUTH should come from the environment with a default, got {auth!r}"
    from renderfarm.flower import parse_auth

    parse_auth(match[1])  # the default is well formed
    assert env["RENDERFARM_BROKER_URL"] == BROKER
    argv = service_commands("flower", flower)[0]
    assert argv[0] == "flower" and "--no-auth" not in argv
    assert option(argv, "--port") == "5555" and option(argv, "--address") == "0.0.0.0"
    # /metrics and /healthcheck skip auth: publish on loopback only.
    assert all(str(p).startswith("127.0.0.1:") for p in flower["ports"]), flower["ports"]


def test_producer_is_a_tool_next_to_the_farm() -> None:
    producer = SERVICES["producer"]
    assert producer["profiles"], "the producer runs on demand (docker compose run), not with `up`"
    assert environment(producer)["RENDERFARM_BROKER_URL"] == BROKER


def test_services_share_one_visibility_timeout() -> None:
    timeouts = {name: environment(s).get("RENDERFARM_VISIBILITY_TIMEOUT") for name, s in SERVICES.items()
                if "RENDERFARM_BROKER_URL" in environment(s)}
    assert len(set(timeouts.values())) == 1 and None not in timeouts.values(), timeouts


def test_volumes_and_dependencies_exist() -> None:
    declared = set(COMPOSE.get("volumes") or {})
    for name, service in SERVICES.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0] if isinstance(volume, str) else volume.get("source")
            if source and not source.startswith((".", "/", "~")):
                assert source in declared, f"{name}: volume {source!r} is not declared"
        for dependency in service.get("depends_on", {}):
            assert dependency in SERVICES, f"{name} depends on unknown {dependency!r}"


def test_every_variable_has_a_default() -> None:
    """`docker compose up` must work with an empty environment."""
    text = (ROOT / "docker-compose.yml").read_text()
    for match in re.finditer(r"\$\{([^}]*)\}", text):
        assert ":-" in match[1], f"${{{match[1]}}} has no default"


# -- images --------------------------------------------------------------------------------------------

def dockerfile_lines(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text().replace("\\\n", " ").splitlines()
            if line.strip() and not line.strip().startswith("#")]


def dockerfiles() -> list[Path]:
    return sorted(INFRA.rglob("*Dockerfile"))


@pytest.mark.parametrize("path", dockerfiles(), ids=lambda p: p.name)
def test_dockerfile_copies_existing_paths(path: Path) -> None:
    copies = [line.split()[1:] for line in dockerfile_lines(path) if line.split()[0].upper() in ("COPY", "ADD")]
    assert copies
    for words in copies:
        words = [w for w in words if not w.startswith("--")]
        if any(w.startswith("--from") for w in words):
            continue
        for source in words[:-1]:
            assert (ROOT / source).exists(), f"{path.name}: COPY {source}: not in the repository"
    ignore = path.with_name(path.name + ".dockerignore")
    if ignore.exists():  # the build context must still hold what is copied
        ignored = {line.strip() for line in ignore.read_text().splitlines() if line.strip() and line[0] != "#"}
        for words in copies:
            assert not set(words[:-1]) & ignored, f"{ignore.name} excludes a COPY source"


def test_worker_image() -> None:
    lines = dockerfile_lines(DOCKERFILE)
    assert 'ENTRYPOINT ["renderfarm"]' in lines
    for copied in ("renderfarm", "producer", "worker", "requirements.lock", "pyproject.toml"):
        assert (ROOT / copied).exists(), copied
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    default = next(line.split("=", 1)[1] for line in lines if line.startswith("ARG EXTRA="))
    assert default in extras and "tpu" in extras, "EXTRA=worker (default) and EXTRA=tpu must be pyproject extras"
    # The image installs a Flower that accepts the version the tests ran.
    spec = next(line.split("=", 1)[1] for line in lines if line.startswith("ARG FLOWER_SPEC="))
    assert version("flower") in SpecifierSet(spec.strip('"').removeprefix("flower"))


# -- TPU VM provisioning --------------------------------------------------------------------------------

def shell_scripts() -> list[Path]:
    return sorted(INFRA.rglob("*.sh"))


@pytest.mark.parametrize("script", shell_scripts(), ids=lambda p: str(p.relative_to(INFRA)))
def test_shell_script_is_strict_and_parses(script: Path) -> None:
    text = script.read_text()
    assert text.startswith("#!/usr/bin/env bash\n") or text.startswith("#!/bin/bash\n")
    assert "\nset -euo pipefail\n" in text
    assert script.stat().st_mode & stat.S_IXUSR, f"{script.name} is not executable"
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_there_are_shell_scripts() -> None:
    assert {STARTUP, CREATE} <= set(shell_scripts())


def test_systemd_unit_restarts_one_worker() -> None:
    service = dict(unit_entries("Service"))
    assert service["Restart"] == "always"
    assert service["EnvironmentFile"] == "/etc/renderfarm/worker.env"
    assert re.search(r"/renderfarm worker\b", service["ExecStart"])
    assert service.get("User") not in (None, "root"), "the worker runs as its own user"
    assert dict(unit_entries("Install"))["WantedBy"] == "multi-user.target"


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze not installed")
def test_systemd_unit_verifies(tmp_path: Path) -> None:
    copy = tmp_path / UNIT.name
    copy.write_text(UNIT.read_text())
    result = subprocess.run(["systemd-analyze", "verify", str(copy)], capture_output=True, text=True,
                            env={**os.environ, "SYSTEMD_LOG_LEVEL": "warning"})
    problems = [line for line in (result.stdout + result.stderr).splitlines()
                if line.strip() and "/opt/renderfarm/venv/bin/renderfarm" not in line]  # installed on the VM
    assert not problems, problems


def test_startup_script_writes_what_the_unit_reads() -> None:
    startup = STARTUP.read_text()
    service = dict(unit_entries("Service"))
    assert f"ENV_FILE={service['EnvironmentFile']}" in startup
    used = set(re.findall(r"\$\{?([A-Z_]+)\}?", service["ExecStart"]))
    written = set(re.findall(r"env_line ([A-Z_]+) ", startup))
    assert used <= written, f"ExecStart uses {sorted(used - written)} that startup.sh never writes"
    exec_path = shlex.split(service["ExecStart"])[0]
    assert exec_path == "/opt/renderfarm/venv/bin/renderfarm" and "VENV=$PREFIX/venv" in startup
    # A private compile cache (mode 700, the worker's user) and one systemd-managed worker.
    assert re.search(r"install -d -o renderfarm -g renderfarm -m 700 [^\n]*\$CACHE/jax", startup)
    assert "-m 600 \"$tmp\" \"$ENV_FILE\"" in startup
    assert "systemctl enable renderfarm-worker.service" in startup
    assert "systemctl restart renderfarm-worker.service" in startup


def create_dry_run(**env: str) -> str:
    settings = {"DRY_RUN": "1", "ZONE": "us-west4-a", "MODEL": "org/model@main", "OUT": "gs://bucket/renders",
                "BROKER_SECRET": "renderfarm-broker", "PACKAGE": "renderfarm[tpu] @ git+https://x/y@v1", **env}
    result = subprocess.run(["bash", str(CREATE)], capture_output=True, text=True,
                            env={"PATH": os.environ["PATH"], **settings})
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.parametrize(("generation", "accelerator", "runtime"),
                         [("v5e", "v5litepod-8", "v2-alpha-tpuv5-lite"), ("v6e", "v6e-8", "v2-alpha-tpuv6e")])
def test_create_tpu_vms(generation: str, accelerator: str, runtime: str) -> None:
    lines = create_dry_run(GENERATION=generation, COUNT="2").splitlines()
    assert len(lines) == 2
    for number, line in enumerate(lines, start=1):
        words = shlex.split(line)
        assert words[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "create", f"renderfarm-{generation}-{number}"]
        flags = dict(w.split("=", 1) for w in words[6:] if w.startswith("--") and "=" in w)
        assert flags["--accelerator-type"] == accelerator and flags["--version"] == runtime
        files = dict(item.split("=", 1) for item in flags["--metadata-from-file"].split(","))
        assert Path(files["startup-script"]) == STARTUP and Path(files["renderfarm-worker-unit"]) == UNIT
        delimiter, _, body = flags["--metadata"][1:].partition("^")
        metadata = dict(item.split("=", 1) for item in body.split(delimiter))
        assert metadata["renderfarm-out"] == "gs://bucket/renders"
        assert metadata["renderfarm-package"] == "renderfarm[tpu] @ git+https://x/y@v1"
        # Every attribute startup.sh requires is given; none is given that it does not read.
        startup = STARTUP.read_text()
        read = set(re.findall(r"meta (renderfarm-[a-z-]+)", startup))
        required = set(re.findall(r"\$\(meta (renderfarm-[a-z-]+)\)", startup))
        given = set(metadata) | (set(files) - {"startup-script"})
        assert required - {"renderfarm-broker-url"} <= given, required - given
        assert given <= read, given - read


def test_create_tpu_vms_refuses_bad_settings() -> None:
    for env in ({"GENERATION": "v4"}, {"CHIPS": "16"}, {"BROKER_SECRET": ""}):
        result = subprocess.run(["bash", str(CREATE)], capture_output=True, text=True,
                                env={"PATH": os.environ["PATH"], "DRY_RUN": "1", "ZONE": "z", "MODEL": "m",
                                     "OUT": "gs://b/p", "PACKAGE": "p", "BROKER_SECRET": "s", **env})
        assert result.returncode != 0 and "create-tpu-vms:" in result.stderr, env


# -- docs ----------------------------------------------------------------------------------------------

def test_operations_doc_covers_the_essentials() -> None:
    text = OPERATIONS.read_text()
    for needle in ("RENDERFARM_FLOWER_AUTH", "/metrics", "/healthcheck", "RENDERFARM_VISIBILITY_TIMEOUT",
                   "docker compose", "create-tpu-vms.sh", "--max-tasks", "appendonly"):
        assert needle in text, needle
