"""Prompt files and flags into validated job specs, streamed so big files stay flat in memory.

A .txt file is one prompt a line (blank lines skipped); a .jsonl file is one job a line with
any job field, the line's own values winning over the flags. Errors carry the line number.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from renderfarm.jobs import SEED_LIMIT, SIZE_STEP, JobError, JobSpec, parse_job

FORMATS = (".txt", ".jsonl")
Row = tuple[int | None, Mapping[str, Any]]  # (line number or None for a given prompt, fields)


def read_prompt_file(path: str | Path) -> Iterator[Row]:
    """Yield (line number, job fields) for each non-blank line of a .txt or .jsonl file."""
    path = Path(path)
    if path.suffix not in FORMATS:
        raise JobError("prompts", str(path), f"must be a file ending in {' or '.join(FORMATS)}")
    if not path.is_file():
        raise JobError("prompts", str(path), "must be an existing file")
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise JobError("prompts", raw[:60], f"must be UTF-8 text ({err.reason})", number) from None
            if not text.strip():
                continue
            if path.suffix == ".txt":
                yield number, {"prompt": text.rstrip("\r\n")}
                continue
            try:
                fields = json.loads(text)
            except json.JSONDecodeError as err:
                raise JobError("line", text.strip(), f"must be a JSON object ({err.msg})", number) from None
            if not isinstance(fields, dict):
                raise JobError("line", fields, "must be a JSON object", number)
            yield number, fields


def build_jobs(rows: Iterable[Row], defaults: Mapping[str, Any],
               base_seed: int | None = None, size_step: int = SIZE_STEP) -> Iterator[JobSpec]:
    """Merge each row over the flag defaults and validate it. The i-th job gets seed
    base_seed + i unless its row names a seed; without a base seed, a random recorded one."""
    for i, (line, row) in enumerate(rows):
        fields = {k: v for k, v in defaults.items() if v is not None}
        fields.update(row)
        if "seed" not in row:
            fields["seed"] = secrets.randbelow(SEED_LIMIT) if base_seed is None else base_seed + i
        try:
            yield parse_job(fields, size_step=size_step)
        except JobError as err:
            raise err.at_line(line) if line is not None else err from None


def prompt_rows(prompts: Iterable[str], prompts_file: str | Path | None) -> Iterator[Row]:
    """Given prompts first, then the file's lines, in input order (as `render` reads them)."""
    yield from ((None, {"prompt": p}) for p in prompts)
    if prompts_file is not None:
        yield from read_prompt_file(prompts_file)
