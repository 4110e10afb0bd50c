"""The `renderfarm` command: the application's entry point, wiring both sides' commands.

The shared package (`renderfarm`) holds the contracts and imports neither side; each command
lives with the side it drives (`producer.commands`, `producer.schedules`, `producer.export`,
`producer.flower`, `worker.commands`) and registers itself here. Nothing imports JAX (or
pyarrow, Flower, Celery's worker) until its command runs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from renderfarm.jobs import JobError


def parser() -> argparse.ArgumentParser:
    from producer import commands as producer_commands
    from producer import export, flower, schedules
    from worker import commands as worker_commands

    top = argparse.ArgumentParser(prog="renderfarm", description="Text-to-image render farm on JAX.")
    sub = top.add_subparsers(dest="command", required=True)
    for module in (worker_commands, producer_commands, schedules, flower, export):
        module.register(sub)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.handler(args)
    except JobError as err:
        print(f"renderfarm: error: {err}", file=sys.stderr)
        return 2
