"""`renderfarm --help` explains every command: each flag and argument says what it is, and a
flag with a default says which."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

from renderfarm_cli import parser


def actions(p: argparse.ArgumentParser, path: str = "renderfarm") -> Iterator[tuple[str, argparse.Action]]:
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from actions(child, f"{path} {name}")
        elif not isinstance(action, argparse._HelpAction):
            yield path, action


ALL = list(actions(parser()))


def name(path: str, action: argparse.Action) -> str:
    return f"{path} {'/'.join(action.option_strings) or action.dest}"


def test_every_command_is_walked() -> None:
    commands = {path for path, _ in ALL}
    assert {"renderfarm render", "renderfarm worker", "renderfarm submit", "renderfarm status",
            "renderfarm schedule add", "renderfarm export", "renderfarm flower"} <= commands


def test_every_flag_says_what_it_does() -> None:
    silent = [name(*a) for a in ALL if not a[1].help or a[1].help == argparse.SUPPRESS]
    assert not silent


def test_every_default_is_named() -> None:
    defaulted = [a for a in ALL if a[1].option_strings and not a[1].required
                 and a[1].default not in (None, False, argparse.SUPPRESS)]
    assert len(defaulted) > 10
    unnamed = [name(*a) for a in defaulted if "default" not in a[1].help]
    assert not unnamed
