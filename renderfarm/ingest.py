"""Prompt files and flags into validated job specs, streamed so big files stay flat in memory.

`submit` and `render` read a .txt file (one prompt a line, blank lines skipped) or a .jsonl
file (one job a line with any job field, the line's own values winning over the flags);
an error stops them, with its line number.

Campaigns (`source_rows`) also read .csv and .parquet, and never stop at a bad row: each
row comes out as its fields or as the JobError that says why it is bad, with its line
(row, for Parquet) number, so the caller can skip and report it. A row is a non-blank line
(.txt, .jsonl), a CSV record after the header, or a Parquet table row.
"""

from __future__ import annotations

import csv
import json
import secrets
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from renderfarm.images import check_init_image
from renderfarm.jobs import COARSEST_SIZE_STEP, SEED_LIMIT, JobError, JobSpec, parse_job

FORMATS = (".txt", ".jsonl")
SOURCE_FORMATS = (".txt", ".csv", ".parquet", ".jsonl")
Row = tuple[int | None, Mapping[str, Any]]  # (line number or None for a given prompt, fields)
SourceRow = tuple[int, "dict[str, Any] | JobError"]  # (line or row number, fields or why not)

# Columns (CSV, Parquet) or keys (JSONL) a campaign row may set for itself, with the type a
# CSV cell is read as. Seeds derive from the row's position and the campaign is the spec's.
ROW_FIELDS: dict[str, Callable[[str], Any]] = {
    "prompt": str, "negative_prompt": str, "model": str, "steps": int, "guidance_scale": float,
    "width": int, "height": int, "scheduler": str, "dtype": str, "priority": int, "variant": str,
    "timestep_spacing": str, "karras": lambda cell: _BOOLEANS[cell.strip().lower()], "init_image": str,
    "mask_image": str, "strength": float}
_BOOLEANS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
_CELL_RULES = {int: "must be an integer", float: "must be a number"}
SPEC_ONLY = {"seed": "seeds derive from base_seed and the row's position",
             "campaign": "the campaign is the spec's name"}
PARQUET_BATCH = 8192  # rows per Arrow batch: flat memory, few Python calls


def _lines(path: Path) -> Iterator[tuple[int, str | JobError]]:
    """Each non-blank line of a UTF-8 text file, without its line end, or why it is unreadable."""
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                yield number, JobError("prompts", raw[:60], f"must be UTF-8 text ({err.reason})")
                continue
            if text.strip():
                yield number, text.rstrip("\r\n")


def _json_object(text: str) -> dict[str, Any] | JobError:
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as err:
        return JobError("line", text.strip(), f"must be a JSON object ({err.msg})")
    return fields if isinstance(fields, dict) else JobError("line", fields, "must be a JSON object")


def _check_file(path: Path, formats: tuple[str, ...]) -> None:
    if path.suffix not in formats:
        raise JobError("prompts", str(path), f"must be a file ending in {' or '.join(formats)}")
    if not path.is_file():
        raise JobError("prompts", str(path), "must be an existing file")


def read_prompt_file(path: str | Path) -> Iterator[Row]:
    """Yield (line number, job fields) for each non-blank line of a .txt or .jsonl file."""
    path = Path(path)
    _check_file(path, FORMATS)
    for number, text in _lines(path):
        fields = text if isinstance(text, JobError) else \
            {"prompt": text} if path.suffix == ".txt" else _json_object(text)
        if isinstance(fields, JobError):
            raise fields.at_line(number) from None
        yield number, fields


def build_jobs(rows: Iterable[Row], defaults: Mapping[str, Any],
               base_seed: int | None = None, size_step: int | None = None) -> Iterator[JobSpec]:
    """Merge each row over the flag defaults and validate it. The i-th job gets seed
    base_seed + i unless its row names a seed; without a base seed, a random recorded one.
    An image job's init image is read and checked here, before anything is enqueued. Sizes
    are held to `size_step`, the model's, where it is known (`renderfarm render`); a producer
    gives none: sizes are held to the finest step of any family and an image job's default
    size is rounded to the coarsest, so it renders on every family (renderfarm.jobs)."""
    for i, (line, row) in enumerate(rows):
        fields = {k: v for k, v in defaults.items() if v is not None}
        fields.update(row)
        if "seed" not in row:
            fields["seed"] = secrets.randbelow(SEED_LIMIT) if base_seed is None else base_seed + i
        try:
            yield check_init_image(parse_job(fields, size_step=size_step), size_step or COARSEST_SIZE_STEP)
        except JobError as err:
            raise err.at_line(line) if line is not None else err from None


def prompt_rows(prompts: Iterable[str], prompts_file: str | Path | None) -> Iterator[Row]:
    """Given prompts first, then the file's lines, in input order (as `render` reads them)."""
    yield from ((None, {"prompt": p}) for p in prompts)
    if prompts_file is not None:
        yield from read_prompt_file(prompts_file)


def row_unit(path: str | Path) -> str:
    """What a source's row numbers count: lines of a text file, rows of a Parquet table."""
    return "row" if Path(path).suffix == ".parquet" else "line"


class SourceReader:
    """Streams a campaign's prompt file as SourceRows. Columns it does not know are ignored
    (datasets carry ids, URLs, captions...) and named in `ignored`, so a typo shows up in
    `campaign validate`; a `seed` or `campaign` column is an error (`SPEC_ONLY`)."""

    MAX_IGNORED = 20  # names kept: enough to spot a typo, bounded for odd JSONL files

    def __init__(self, path: str | Path, prompt_column: str = "prompt", image_column: str = "init_image") -> None:
        self.path, self.prompt_column, self.image_column = Path(path), prompt_column, image_column
        _check_file(self.path, SOURCE_FORMATS)
        self.ignored: dict[str, None] = {}  # an ordered set

    def rows(self) -> Iterator[SourceRow]:
        reader = {".txt": self._txt, ".jsonl": self._jsonl, ".csv": self._csv,
                  ".parquet": self._parquet}[self.path.suffix]
        return reader()

    def _target(self, column: str) -> str | None:
        """The job field a column sets, or None if it is ignored (SPEC_ONLY: the caller's error)."""
        if column == self.prompt_column:
            return "prompt"
        if column == self.image_column:
            return "init_image"
        if column in ROW_FIELDS and column not in ("prompt", "init_image"):
            return column
        if len(self.ignored) < self.MAX_IGNORED:
            self.ignored[column] = None
        return None

    def _columns(self, names: list[str]) -> list[tuple[int, str]]:
        """(position, job field) of the columns used; the prompt column must be there."""
        if self.prompt_column not in names:
            raise JobError("prompt_column", self.prompt_column,
                           f"must be a column of {self.path} (it has: {', '.join(names) or 'none'})")
        for name in names:
            if name in SPEC_ONLY:
                raise JobError("prompts", str(self.path),
                               f"has a column {name!r}, which may not be set per row: {SPEC_ONLY[name]}")
        return [(i, field) for i, name in enumerate(names) if (field := self._target(name))]

    def _txt(self) -> Iterator[SourceRow]:
        for number, text in _lines(self.path):
            yield number, text if isinstance(text, JobError) else {"prompt": text}

    def _jsonl(self) -> Iterator[SourceRow]:
        for number, text in _lines(self.path):
            fields = text if isinstance(text, JobError) else _json_object(text)
            if isinstance(fields, JobError):
                yield number, fields
            elif fixed := SPEC_ONLY.keys() & fields.keys():
                name = min(fixed)
                yield number, JobError(name, fields[name], f"may not be set per row: {SPEC_ONLY[name]}")
            else:
                yield number, {target: value for name, value in fields.items()
                               if value is not None and (target := self._target(name))}

    def _csv(self) -> Iterator[SourceRow]:
        with self.path.open(newline="", encoding="utf-8", errors="surrogateescape") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            if header is None:
                raise JobError("prompts", str(self.path), "must start with a header row naming its columns")
            columns = [(i, field, ROW_FIELDS[field]) for i, field in self._columns(header)]
            width, line = len(header), reader.line_num
            for record in reader:
                number, line = line + 1, reader.line_num  # a quoted cell may span lines
                if not record:
                    continue
                if len(record) != width:
                    yield number, JobError("row", record, f"must have {width} cells like the header")
                    continue
                yield number, _csv_fields(record, columns)

    def _parquet(self) -> Iterator[SourceRow]:
        import pyarrow.parquet as pq  # only Parquet users pay for the import

        try:
            table = pq.ParquetFile(self.path)
        except Exception as err:  # noqa: BLE001 - pyarrow's errors for a file it cannot read
            raise JobError("prompts", str(self.path), f"must be a Parquet file ({err})") from None
        with table:
            columns = self._columns(table.schema_arrow.names)
            names = [table.schema_arrow.names[i] for i, _ in columns]
            fields = [field for _, field in columns]
            number = 0
            for batch in table.iter_batches(batch_size=PARQUET_BATCH, columns=names):
                for values in zip(*(batch.column(name).to_pylist() for name in names)):
                    number += 1
                    yield number, {f: v for f, v in zip(fields, values) if v is not None}


def _csv_fields(record: list[str], columns: list[tuple[int, str, Callable[[str], Any]]]) -> dict[str, Any] | JobError:
    """A CSV record's job fields: empty cells take the spec's value, numbers are parsed."""
    fields: dict[str, Any] = {}
    for i, field, kind in columns:
        cell = record[i]
        if not cell.isascii():
            try:
                cell.encode("utf-8")
            except UnicodeEncodeError:
                return JobError(field, cell.encode("utf-8", "surrogateescape")[:60], "must be UTF-8 text")
        if kind is str:
            if cell or field == "prompt":
                fields[field] = cell
        elif cell.strip():
            try:
                fields[field] = kind(cell)
            except (ValueError, KeyError):
                return JobError(field, cell, _CELL_RULES.get(kind, "must be true or false"))
    return fields
