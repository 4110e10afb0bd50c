"""What can be checked of the container files without a Docker engine: they parse, and the
commands they run are real `renderfarm` subcommands with real flags."""

from __future__ import annotations

import shlex
from pathlib import Path

import yaml

from renderfarm.cli import parser

ROOT = Path(__file__).resolve().parent.parent


def renderfarm_commands(script: str) -> list[list[str]]:
    return [words[1:] for part in script.split("&&")
            if (words := shlex.split(part)) and words[0] == "renderfarm"]


def test_compose_services_run_real_commands() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    render = compose["services"]["render"]
    assert (ROOT / render["build"]["dockerfile"]).is_file()
    commands = renderfarm_commands(" ".join(render["command"]))
    assert [c[0] for c in commands] == ["tiny-model", "render"]
    for command in commands:
        parser().parse_args(command)  # exits on an unknown subcommand or flag


def test_worker_image_entry_point() -> None:
    dockerfile = (ROOT / "infra" / "worker.Dockerfile").read_text()
    assert 'ENTRYPOINT ["renderfarm"]' in dockerfile
    for copied in ("renderfarm", "producer", "worker", "requirements.lock", "pyproject.toml"):
        assert (ROOT / copied).exists(), copied
