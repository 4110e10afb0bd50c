"""Prompt templates through `dynamicprompts`: variants `{a|b}`, wildcard files `__name__`,
every combination or a fixed number of seeded random samples, streamed one prompt at a time.

The expansion runs on dynamicprompts' own `SamplingContext` (what its Combinatorial and
Random prompt generators wrap) so that a template with a million combinations is a
generator, not a list. A wildcard with no values would make dynamicprompts yield its name
forever, so every wildcard a template uses (and those its values use) is checked first.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from dynamicprompts.commands import Command, WildcardCommand
from dynamicprompts.enums import SamplingMethod
from dynamicprompts.parser.parse import parse
from dynamicprompts.sampling_context import SamplingContext
from dynamicprompts.wildcards import WildcardManager

from renderfarm.jobs import JobError

MODES = {"combinatorial": SamplingMethod.COMBINATORIAL, "random": SamplingMethod.RANDOM}
MAX_WILDCARD_DEPTH = 20  # wildcard values may use wildcards; deeper means a loop


def _wildcard_names(node: Any) -> Iterator[str]:
    """The literal wildcard names anywhere in a parsed template (any command shape)."""
    if isinstance(node, WildcardCommand) and isinstance(node.wildcard, str):
        yield node.wildcard
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        for field in dataclasses.fields(node):
            yield from _wildcard_names(getattr(node, field.name))
    elif isinstance(node, (list, tuple)):
        for item in node:
            yield from _wildcard_names(item)
    elif isinstance(node, dict):
        for item in node.values():
            yield from _wildcard_names(item)


def _parse(template: str, field: str) -> Command:
    try:
        return parse(template)
    except Exception as err:  # noqa: BLE001 - pyparsing raises several kinds
        raise JobError(field, template, f"must be a valid dynamicprompts template ({err})") from None


def check_templates(templates: Sequence[str], wildcards: Path | None) -> None:
    """Parse every template and make sure each wildcard it reaches has values."""
    manager = WildcardManager(wildcards) if wildcards is not None else None
    for number, template in enumerate(templates, start=1):
        field = f"templates[{number}]" if len(templates) > 1 else "template"
        todo, seen = [(_parse(template, field), 0)], set()
        while todo:
            command, depth = todo.pop()
            for name in _wildcard_names(command):
                if name in seen:
                    continue
                seen.add(name)
                values = [] if manager is None else list(manager.get_values(name).string_values)
                if not values:
                    where = f"a file {name}.txt/.yaml/.json under {wildcards}" if wildcards else \
                        "a `wildcards: DIR` folder in the spec"
                    raise JobError(field, template, f"uses wildcard __{name}__, which needs {where}")
                if depth >= MAX_WILDCARD_DEPTH:
                    raise JobError(field, template, f"wildcard __{name}__ nests deeper than "
                                   f"{MAX_WILDCARD_DEPTH} levels (a wildcard that uses itself?)")
                todo += [(_parse(v, f"wildcard __{name}__"), depth + 1) for v in values]


def expand(templates: Sequence[str], wildcards: Path | None, mode: str, samples: int | None,
           seed: int) -> Iterator[str]:
    """Each template's prompts in turn: all its combinations (at most `samples` each), or
    `samples` random draws each from one generator seeded with `seed`, so a spec always
    expands to the same prompts in the same order."""
    manager = WildcardManager(wildcards) if wildcards is not None else WildcardManager()
    context = SamplingContext(default_sampling_method=MODES[mode], wildcard_manager=manager,
                              rand=random.Random(seed))
    for template in templates:
        yield from map(str, context.sample_prompts(template, samples))
