"""What can be checked of the deployment files without a Docker engine or a TPU: they parse,
the `renderfarm` commands they run are real subcommands with real flags (renderfarm_cli's
own parser), and the settings the farm depends on are there (Redis persistence and its
password, Flower auth, the GCS emulator, private compile caches owned by a non-root user, one
systemd-managed worker per TPU host under its own narrow service account).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import stat
import subprocess
import tempfile
import time
import tomllib
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import pytest
import redis
import yaml
from packaging.specifiers import SpecifierSet

from harness.redis_server import free_port
from renderfarm.connections import sentinels_of
from renderfarm_cli import parser
from tests.helpers import check_renderfarm_args, heredoc, redis_options, sentinel_master

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
BROKER = "redis://:${RENDERFARM_REDIS_PASSWORD}@redis:6379/0"
SECRETS = ("RENDERFARM_REDIS_PASSWORD", "RENDERFARM_FLOWER_AUTH")

# -- validating `renderfarm ...` command lines against the real parser ---------------------------

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
    env = service.get("environment") or {}
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
    assert re.fullmatch(r"\$\{RENDERFARM_FLOWER_AUTH:\?[^}]+\}", auth), \
        f"RENDERFARM_FLOWER_AUTH must come from the environment, required, without a default: {auth!r}"
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
    """300 s: a living worker re-stamps what it holds, so the timeout only bounds how long a
    dead worker's jobs wait, and the comment must not send readers back to batch budgets."""
    timeouts = {name: environment(s).get("RENDERFARM_VISIBILITY_TIMEOUT") for name, s in SERVICES.items()
                if "RENDERFARM_BROKER_URL" in environment(s)}
    assert set(timeouts.values()) == {"300"}, timeouts
    text = (ROOT / "docker-compose.yml").read_text()
    comment = text[:text.index("RENDERFARM_VISIBILITY_TIMEOUT:")].rsplit("x-broker:", 1)[1]
    assert "DEAD worker" in comment and "re-stamps" in comment, comment


def test_volumes_and_dependencies_exist() -> None:
    declared = set(COMPOSE.get("volumes") or {})
    for name, service in SERVICES.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0] if isinstance(volume, str) else volume.get("source")
            if source and not source.startswith((".", "/", "~")):
                assert source in declared, f"{name}: volume {source!r} is not declared"
        for dependency in service.get("depends_on", {}):
            assert dependency in SERVICES, f"{name} depends on unknown {dependency!r}"


def test_bind_mounts_exist_in_the_repository() -> None:
    """A missing bind source is created by Docker, empty and root's: the service would see nothing."""
    for name, service in SERVICES.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0] if isinstance(volume, str) else volume.get("source", "")
            if source.startswith("./") and source != "./out":  # ./out: where `render` writes
                assert (ROOT / source).is_dir(), f"{name}: bind mount {source} is not in the repository"


def test_beat_sees_the_campaign_files_where_the_producer_does() -> None:
    """A schedule keeps the spec's prompt file by its path in the producer's container."""
    def binds(name: str) -> set[str]:
        return {v.removesuffix(":ro") for v in SERVICES[name]["volumes"] if v.startswith("./")}

    shared = binds("beat") & binds("producer")
    assert shared, "beat and producer must mount the campaign folder at the same path"
    assert any(list((ROOT / v.split(":")[0]).glob("*.yaml")) for v in shared)


# -- docker-compose.yml: secrets, interpolated as compose does --------------------------------------

class MissingVariable(Exception):
    pass


VARIABLE = re.compile(r"\$(?:(?P<escaped>\$)|\{(?P<braced>[^}]*)\}|(?P<named>[A-Za-z_][A-Za-z0-9_]*))")


def interpolate(value: object, env: dict[str, str]) -> object:
    """Compose's interpolation of the parsed file's values: $$, $VAR, ${VAR}, ${VAR:-default},
    ${VAR-default}, ${VAR:?error}, ${VAR?error} (the colon forms treat empty as unset)."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match[str]) -> str:
        if match["escaped"]:
            return "$"
        if match["named"]:
            return env.get(match["named"], "")
        name, op, arg = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])(.*))?", match["braced"], re.DOTALL).groups()
        current = env.get(name)
        unset = current is None or (op is not None and op.startswith(":") and current == "")
        if op in (":-", "-"):
            return arg if unset else current
        if op in (":?", "?") and unset:
            raise MissingVariable(f"{name}: {arg}")
        return current or ""

    return VARIABLE.sub(substitute, value)


def compose_with(**env: str) -> dict:
    return interpolate(COMPOSE, env)


def test_secrets_are_required_and_have_no_default() -> None:
    """Without either secret compose refuses to start, naming it; everything else has a default."""
    with_both = {name: f"value-of-{name}" for name in SECRETS}
    compose_with(**with_both)
    for name in SECRETS:
        with pytest.raises(MissingVariable, match=f"^{name}: set {name}"):
            compose_with(**{k: v for k, v in with_both.items() if k != name})
    text = (ROOT / "docker-compose.yml").read_text()
    for match in re.finditer(r"\$\{([A-Za-z_0-9]+)(:?-[^}]*)?\}", text):
        assert match[1] not in SECRETS or not match[2], f"{match[0]}: a secret must have no default"


def test_redis_password_reaches_redis_and_every_broker_url() -> None:
    password = "pw-from-the-environment"
    services = compose_with(RENDERFARM_REDIS_PASSWORD=password, RENDERFARM_FLOWER_AUTH="ops:x")["services"]
    assert option(services["redis"]["command"], "--requirepass") == password
    urls = {name: environment(s).get("RENDERFARM_BROKER_URL") for name, s in services.items()}
    talks_to_redis = {name for name, s in SERVICES.items() if "redis" in s.get("depends_on", {})}
    assert talks_to_redis >= {"worker", "flower", "beat", "producer"}
    for name in talks_to_redis:
        assert urls[name] == f"redis://:{password}@redis:6379/0", (name, urls[name])


def test_redis_healthcheck_authenticates(tmp_path: Path) -> None:
    """The compose healthcheck, run against redis-server started with the compose command:
    healthy with the service's environment, unhealthy without the password in it."""
    if not shutil.which("redis-server") or not shutil.which("redis-cli"):
        pytest.skip("redis-server and redis-cli are needed")
    redis_service = compose_with(RENDERFARM_REDIS_PASSWORD="hc-pw", RENDERFARM_FLOWER_AUTH="ops:x")["services"]["redis"]
    port = free_port()
    server = subprocess.Popen([*redis_service["command"], "--port", str(port), "--bind", "127.0.0.1",
                               "--dir", str(tmp_path), "--save", ""],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis(port=port, password="hc-pw").ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)
        kind, script = redis_service["healthcheck"]["test"]
        assert kind == "CMD-SHELL" and script.startswith("redis-cli ")
        script = script.replace("redis-cli", f"redis-cli -p {port}", 1)
        env = {k: v for k, v in os.environ.items() if not k.startswith("REDISCLI_")}

        def healthy(extra: dict[str, str]) -> bool:
            return subprocess.run(["sh", "-c", script], env={**env, **extra}, timeout=10, check=False).returncode == 0

        assert healthy(environment(redis_service))
        assert not healthy({}), "the healthcheck passes without authenticating"
    finally:
        server.kill()
        server.wait()


# -- docker-compose.sentinel.yml: Redis behind Sentinel ---------------------------------------------

SENTINEL_OVERLAY = yaml.safe_load((ROOT / "docker-compose.sentinel.yml").read_text())


def overridden(base: object, override: object) -> object:
    """What `docker compose -f BASE -f OVERRIDE` runs: mappings merged key by key, anything else
    (a command) replaced by the override's."""
    if isinstance(base, dict) and isinstance(override, dict):
        return {**base, **{k: overridden(base[k], v) if k in base else v for k, v in override.items()}}
    return override


def sentinel_farm(password: str) -> dict:
    """Both files' services, interpolated as compose does with the two secrets set."""
    env = {"RENDERFARM_REDIS_PASSWORD": password, "RENDERFARM_FLOWER_AUTH": "ops:x"}
    return interpolate(overridden(COMPOSE, SENTINEL_OVERLAY), env)["services"]


def sentinel_names(services: dict) -> list[str]:
    return sorted(name for name, s in services.items() if "--sentinel" in " ".join(s.get("command", [])))


def test_the_sentinel_overlay_needs_the_password_too() -> None:
    with pytest.raises(MissingVariable, match="^RENDERFARM_REDIS_PASSWORD: set RENDERFARM_REDIS_PASSWORD"):
        interpolate(SENTINEL_OVERLAY, {"RENDERFARM_FLOWER_AUTH": "ops:x"})


def test_the_sentinel_overlay_points_every_farm_service_at_its_sentinels() -> None:
    """Each service that talks to Redis gets one URL naming every sentinel at its port, the
    master the sentinels monitor and Redis's password; the rest of its environment is kept."""
    services = sentinel_farm("pw-sentinel")
    sentinels = sentinel_names(services)
    assert len(sentinels) == 3
    for name in ("worker", "flower", "beat", "producer"):
        env = environment(services[name])
        parsed = sentinels_of(env["RENDERFARM_BROKER_URL"])
        assert parsed is not None and parsed.password == "pw-sentinel", name
        assert sorted(parsed.hosts) == [(sentinel, 26379) for sentinel in sentinels], name
        assert parsed.master == "renderfarm" and env["RENDERFARM_VISIBILITY_TIMEOUT"] == "300", name
        assert all(services[name]["depends_on"][s]["condition"] == "service_healthy" for s in sentinels), name
        assert service_commands(name, services[name]) == service_commands(name, SERVICES[name])
    for sentinel in sentinels:
        config = heredoc(services[sentinel]["command"][2]).replace("$SENTINEL_HOST", sentinel)
        assert "port 26379" in config.splitlines()
        assert "sentinel monitor renderfarm redis 6379 2" in config
        assert "sentinel auth-pass renderfarm pw-sentinel" in config
        assert f"sentinel announce-ip {sentinel}" in config.splitlines(), "each sentinel announces its own name"


def test_the_sentinel_overlay_runs_a_replica_of_redis_and_a_majority_of_sentinels(tmp_path: Path) -> None:
    services = sentinel_farm("pw-sentinel")
    primary, before = redis_options(services["redis"]["command"]), redis_options(SERVICES["redis"]["command"])
    assert {k: v for k, v in primary.items() if k in before} == {**before, "--requirepass": "pw-sentinel"}
    assert primary["--masterauth"] == "pw-sentinel" and primary["--replica-announce-ip"] == "redis"
    replica = redis_options(services["redis-replica"]["command"])
    assert replica["--replicaof"] == "redis 6379" and replica["--replica-announce-ip"] == "redis-replica"
    assert replica["--requirepass"] == replica["--masterauth"] == "pw-sentinel" and replica["--appendonly"] == "yes"
    assert environment(services["redis-replica"])["REDISCLI_AUTH"] == "pw-sentinel"  # its healthcheck's
    declared = set(SENTINEL_OVERLAY["volumes"])
    sentinels = sentinel_names(services)
    for name in ["redis-replica", *sentinels]:
        (volume,) = services[name]["volumes"]
        assert volume.split(":") == [volume.split(":")[0], "/data"] and volume.split(":")[0] in declared, name
    (monitor,) = {line for s in sentinels for line in heredoc(services[s]["command"][2]).splitlines()
                  if line.startswith("sentinel monitor ")}
    assert len(sentinels) // 2 < int(monitor.split()[-1]) <= len(sentinels), "a majority of the sentinels"
    config = heredoc(services[sentinels[0]]["command"][2]).replace("$SENTINEL_HOST", sentinels[0])
    master = sentinel_master(config, "redis", tmp_path)
    assert (master["name"], master["quorum"], master["down-after-milliseconds"]) == ("renderfarm", 2, 5000)


# -- docker-compose.yml: a non-root image -------------------------------------------------------------

def test_farm_containers_do_not_run_as_root() -> None:
    for name, service in SERVICES.items():
        if service.get("build", {}).get("dockerfile") == "infra/worker.Dockerfile":
            assert str(service.get("user", "")).split(":")[0] not in ("root", "0"), name


def test_shared_cache_is_a_named_volume() -> None:
    """Only a named volume takes the image's /cache ownership (the worker's user, mode 700) on
    first use; a bind mount would keep the host folder's, which the worker refuses."""
    for name, service in SERVICES.items():
        for volume in service.get("volumes", []):
            if isinstance(volume, str) and volume.split(":")[1] == "/cache":
                assert volume.split(":")[0] in (COMPOSE.get("volumes") or {}), (name, volume)


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


def test_worker_image_runs_as_its_own_user_who_owns_the_caches() -> None:
    """The worker refuses a compile cache that is not its user's or that others may write
    (worker.executables.private_folder): the image's user must own them, mode 700."""
    lines = dockerfile_lines(DOCKERFILE)
    words = [shlex.split(line) for line in lines]
    users = [i for i, w in enumerate(words) if w[0].upper() == "USER"]
    assert users, "the image must end as a non-root USER"
    last = users[-1]
    assert all(w[0].upper() in ("ENV", "ENTRYPOINT", "CMD", "LABEL", "EXPOSE") for w in words[last + 1:])
    user, _, group = words[last][1].partition(":")
    assert user not in ("root", "0") and group not in ("root", "0")
    run = " ".join(line for line in lines if line.startswith("RUN "))
    created = re.search(r"useradd (.*?)(?:&&|$)", run)
    assert created, "the image creates its user"
    uid = re.search(r"--uid[ =](\d+)", created[1])
    name = shlex.split(created[1])[-1]
    assert uid and int(uid[1]) >= 1000, "a fixed, non-system uid"
    assert user in (uid[1], name), f"USER {user} is not the user the image creates ({name}, uid {uid[1]})"
    install = re.search(r"install -d (.*?)(?:&&|$)", run)
    assert install, "the image creates its cache folders"
    flags = shlex.split(install[1])
    owner = flags[flags.index("-o") + 1]
    assert owner in (name, uid[1]) and flags[flags.index("-m") + 1] == "700", flags
    env = dict(pair.split("=", 1) for line in lines if line.startswith("ENV ")
               for pair in shlex.split(line)[1:])
    for variable in ("RENDERFARM_COMPILE_CACHE", "RENDERFARM_MODEL_CACHE"):
        assert env[variable] in flags, f"{variable}={env[variable]} is not made the user's, mode 700"
    made = [f for f in flags if f.startswith("/")]
    for folder in made:  # each parent of a cache the image makes is made (and owned) too
        parent = str(Path(folder).parent)
        assert parent == "/" or parent in made, f"{parent} would be root's"


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


CREATE_SETTINGS = {"ZONE": "us-west4-a", "PROJECT": "proj", "MODEL": "org/model@main", "OUT": "gs://bucket/renders",
                   "BROKER_SECRET": "renderfarm-broker", "PACKAGE": "renderfarm[tpu] @ git+https://x/y@v1"}
ACCOUNT = "renderfarm-worker@proj.iam.gserviceaccount.com"


def fake_gcloud(folder: Path, describe_exit: int = 0) -> Path:
    """A `gcloud` that appends its arguments to folder/calls and succeeds (`iam service-accounts
    describe` exits with `describe_exit`: 1 for an account that does not exist)."""
    calls = folder / "calls"
    script = folder / "gcloud"
    script.write_text(f"""#!/usr/bin/env bash
printf '%q ' "$@" >>{shlex.quote(str(calls))}; echo >>{shlex.quote(str(calls))}
[[ "$1 $2 $3" == "iam service-accounts describe" ]] && exit {describe_exit}
exit 0
""")
    script.chmod(0o755)
    return calls


def run_create(gcloud_dir: Path | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    path = os.environ["PATH"] if gcloud_dir is None else f"{gcloud_dir}{os.pathsep}{os.environ['PATH']}"
    return subprocess.run(["bash", str(CREATE)], capture_output=True, text=True, check=False,
                          env={"PATH": path, **CREATE_SETTINGS, **env})


def create_dry_run(**env: str) -> str:
    """The commands DRY_RUN=1 prints; a `gcloud` on the PATH must not be run at all."""
    with tempfile.TemporaryDirectory() as folder:
        calls = fake_gcloud(Path(folder))
        result = run_create(Path(folder), DRY_RUN="1", **env)
        assert result.returncode == 0, result.stderr
        assert not calls.exists(), f"DRY_RUN=1 ran gcloud: {calls.read_text()}"
    return result.stdout


def vm_creates(output: str) -> list[list[str]]:
    return [words for line in output.splitlines() if (words := shlex.split(line))[:5] ==
            ["gcloud", "compute", "tpus", "tpu-vm", "create"]]


def flag_values(words: list[str]) -> dict[str, str]:
    return dict(w.split("=", 1) for w in words if w.startswith("--") and "=" in w)


def grants(output: str) -> set[tuple[str, str, str]]:
    """(resource, member, role) of every IAM binding the output adds."""
    found = set()
    for line in output.splitlines():
        words = shlex.split(line)
        if "add-iam-policy-binding" in words:
            flags = flag_values(words)
            found.add((words[words.index("add-iam-policy-binding") + 1], flags["--member"], flags["--role"]))
    return found


@pytest.mark.parametrize(("generation", "accelerator", "runtime"),
                         [("v5e", "v5litepod-8", "v2-alpha-tpuv5-lite"), ("v6e", "v6e-8", "v2-alpha-tpuv6e")])
def test_create_tpu_vms(generation: str, accelerator: str, runtime: str) -> None:
    creates = vm_creates(create_dry_run(GENERATION=generation, COUNT="2"))
    assert len(creates) == 2
    for number, words in enumerate(creates, start=1):
        assert words[5] == f"renderfarm-{generation}-{number}"
        flags = flag_values(words[6:])
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
    for env, why in (({"GENERATION": "v4"}, "GENERATION"), ({"CHIPS": "16"}, "CHIPS"),
                     ({"BROKER_SECRET": ""}, "BROKER_SECRET"), ({"OUT": "/local/out"}, "OUT"),
                     ({"PROJECT": ""}, "PROJECT"),
                     ({"SERVICE_ACCOUNT": "123-compute@developer.gserviceaccount.com"}, "SERVICE_ACCOUNT")):
        result = run_create(DRY_RUN="1", **env)
        assert result.returncode != 0, env
        assert result.stderr.startswith("create-tpu-vms:") and why in result.stderr, (env, result.stderr)


def test_create_tpu_vms_uses_a_dedicated_account_with_narrow_grants() -> None:
    """The VMs run as the farm's own account, which may touch the output bucket's objects, read
    the buckets it installs and loads from, and read the broker secret: nothing project-wide."""
    member = f"serviceAccount:{ACCOUNT}"
    output = create_dry_run(MODEL="gs://models/sd21", PACKAGE="gs://bucket/wheels/rf.whl",
                            CONSTRAINTS="gs://wheels/requirements.lock")
    lines = [shlex.split(line) for line in output.splitlines()]
    assert all(words[0] == "gcloud" for words in lines), "DRY_RUN=1 prints gcloud commands only"
    assert ["gcloud", "iam", "service-accounts", "create", "renderfarm-worker", "--project=proj"] == lines[0][:6]
    assert grants(output) == {("gs://bucket", member, "roles/storage.objectUser"),
                              ("gs://models", member, "roles/storage.objectViewer"),
                              ("gs://wheels", member, "roles/storage.objectViewer"),
                              ("renderfarm-broker", member, "roles/secretmanager.secretAccessor")}
    secret = next(words for words in lines if words[:3] == ["gcloud", "secrets", "add-iam-policy-binding"])
    assert flag_values(secret)["--project"] == "proj"
    assert not any("projects" in words[:3] for words in lines), "no project-wide binding"
    for words in vm_creates(output):
        flags = flag_values(words)
        assert flags["--service-account"] == ACCOUNT
        # Secret Manager takes no narrower scope than cloud-platform; IAM limits the account.
        assert set(flags["--scopes"].split(",")) == {"https://www.googleapis.com/auth/devstorage.read_write",
                                                     "https://www.googleapis.com/auth/cloud-platform"}


def test_create_tpu_vms_without_a_secret_has_storage_scope_only() -> None:
    output = create_dry_run(BROKER_SECRET="", BROKER_URL="redis://:pw@10.0.0.3:6379/0")
    assert grants(output) == {("gs://bucket", f"serviceAccount:{ACCOUNT}", "roles/storage.objectUser")}
    for words in vm_creates(output):
        assert flag_values(words)["--scopes"] == "https://www.googleapis.com/auth/devstorage.read_write"
        assert flag_values(words)["--service-account"] == ACCOUNT


@pytest.mark.parametrize("exists", [False, True])
def test_create_tpu_vms_creates_or_reuses_the_account(tmp_path: Path, exists: bool) -> None:
    """A real run (gcloud faked): the account is created only when `describe` does not find it,
    and the grants and VMs follow in that order."""
    calls = fake_gcloud(tmp_path, describe_exit=0 if exists else 1)
    result = run_create(tmp_path, SERVICE_ACCOUNT="rf@proj.iam.gserviceaccount.com")
    assert result.returncode == 0, result.stderr
    run = [shlex.split(line)[:4] for line in calls.read_text().splitlines()]
    expected = [["iam", "service-accounts", "describe", "rf@proj.iam.gserviceaccount.com"]]
    expected += [] if exists else [["iam", "service-accounts", "create", "rf"]]
    expected += [["storage", "buckets", "add-iam-policy-binding", "gs://bucket"],
                 ["secrets", "add-iam-policy-binding", "renderfarm-broker", "--project=proj"],
                 ["compute", "tpus", "tpu-vm", "create"]]
    assert run == expected


# -- docs ----------------------------------------------------------------------------------------------

def test_operations_doc_covers_the_essentials() -> None:
    text = OPERATIONS.read_text()
    for needle in ("RENDERFARM_FLOWER_AUTH", "/metrics", "/healthcheck", "RENDERFARM_VISIBILITY_TIMEOUT",
                   "docker compose", "create-tpu-vms.sh", "--max-tasks", "appendonly"):
        assert needle in text, needle


def test_every_file_the_packages_read_goes_into_the_wheel() -> None:
    """A wheel (the image's `pip install .`) holds a package's .py files and only the other
    files package-data names: the Redis scripts read at import must be among them."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = setuptools.get("package-data", {})
    tracked = subprocess.run(["git", "ls-files", *(p.rstrip("*") for p in setuptools["packages"]["find"]["include"])],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    data = [Path(f) for f in tracked if not f.endswith(".py")]
    assert data, "the packages read .lua scripts: this test must see them"
    for path in data:
        package, rest = path.parts[0], Path(*path.parts[1:])
        assert any(rest.match(pattern) for pattern in patterns.get(package, [])), \
            f"{path} is not in [tool.setuptools.package-data] {package}: a wheel would leave it out"


def test_the_preemption_watcher_drains_the_worker_on_the_notice(tmp_path: Path) -> None:
    """A spot VM's notice: the metadata server's `instance/preempted` turns TRUE. The watcher
    long-polls it (wait_for_change, with the last ETag) and starts the worker's drain at once;
    here the metadata server is a local stand-in and the "worker" a process that must get SIGTERM."""
    import http.server
    import threading

    preempted, requests = threading.Event(), []

    class Metadata(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            requests.append((self.path, self.headers.get("Metadata-Flavor")))
            if "last_etag=NONE" not in self.path:
                preempted.wait(20)  # wait_for_change: answer when the value changes
            body = b"TRUE" if preempted.is_set() else b"FALSE"
            self.send_response(200)
            self.send_header("ETag", "e2" if preempted.is_set() else "e1")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metadata)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    worker = subprocess.Popen(["sleep", "60"])
    env = {**os.environ, "METADATA_URL": f"http://127.0.0.1:{server.server_port}/instance/preempted",
           "ON_PREEMPT": f"kill -TERM {worker.pid}"}
    watcher = subprocess.Popen(["bash", str(TPU / "preemption-watch.sh")], env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 10
        while len(requests) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(requests) == 2 and worker.poll() is None  # waiting on the change, not draining
        preempted.set()
        assert worker.wait(10) == -15  # SIGTERM: the worker's warm shutdown
        assert watcher.wait(10) == 0
    finally:
        worker.kill()
        watcher.kill()
        server.shutdown()
    assert "this VM is being preempted" in watcher.stderr.read()
    assert all(flavor == "Google" and "wait_for_change=true" in path for path, flavor in requests)
    assert "last_etag=e1" in requests[1][0]
    startup, create = STARTUP.read_text(), CREATE.read_text()
    assert "renderfarm-preemption-watch=$here/preemption-watch.sh" in create
    assert "renderfarm-preemption-unit=$here/renderfarm-preemption.service" in create
    assert "systemctl enable renderfarm-preemption.service" in startup
    assert "ExecStart=/opt/renderfarm/preemption-watch.sh" in (TPU / "renderfarm-preemption.service").read_text()
