"""The model layer's error: which field, which value, which rule. The farm's job contract
raises the same class under its own name (renderfarm/errors.py: JobError), so a job that a
model refuses (its weights, its scheduler, its family) fails with the same kind of message as a
job the contract refuses. No JAX here: the contract is imported by the producer, which never
loads JAX."""

from __future__ import annotations

import reprlib
from typing import Any

_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlist, _SHOWN.maxdict = 2, 80, 80, 4, 4


def shown(value: Any) -> str:
    """A short repr of any value a hostile producer can send: deep nesting, megabyte strings
    and integers too long for repr (Python refuses over 4,300 digits) all stay short."""
    if isinstance(value, str):
        text = repr(value)
        return text if len(text) <= 160 else f"{value[:80]!r}... ({len(value)} chars)"
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"<integer of {value.bit_length()} bits>"
    try:
        return _SHOWN.repr(value)
    except (ValueError, RecursionError):
        return f"<{type(value).__name__}>"


class ModelError(ValueError):
    """A value that breaks its rule; says which field, which value and which rule (and the
    line, for a value read from a file of many)."""

    def __init__(self, field: str, value: Any, rule: str, line: int | None = None) -> None:
        self.field, self.value, self.rule, self.line = field, value, rule, line
        where = f"line {line}: " if line is not None else ""
        name = field if isinstance(field, str) and len(field) <= 80 and field.isprintable() else shown(field)
        super().__init__(f"{where}{name}={shown(value)}: {rule}")

    def at_line(self, line: int) -> ModelError:
        return ModelError(self.field, self.value, self.rule, line)
