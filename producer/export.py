"""`renderfarm export`: a finished campaign as a dataset other tools read directly.

Formats (every sidecar field comes along; dict-valued fields such as ``spec`` are JSON
strings, so each shard has the same simple schema whatever nulls a batch happens to hold;
``prompt`` and ``seed`` are copied from the spec as plain columns for convenience):

- imagefolder: ``NNNNNN/JOB_ID.png`` plus ``NNNNNN/metadata.jsonl`` per shard, loadable
  with ``datasets.load_dataset("imagefolder", data_dir=...)``;
- webdataset: ``CAMPAIGN-NNNNNN.tar`` shards, each sample ``JOB_ID.png`` + ``JOB_ID.json``
  (the sidecar as stored);
- parquet: ``CAMPAIGN-NNNNNN.parquet`` files with an ``image`` struct {bytes, path} (the
  Hugging Face Image feature, declared in the schema metadata) plus the sidecar columns,
  written in row groups.

Memory stays flat: images stream from storage through a small prefetch window and only
one shard (``--shard-size`` images) is held before it is stored.

Scores (renderfarm/scores.py) come along as plain columns (``nsfw``, ``clip``, ``aesthetic``,
``phash``). ``--where EXPR`` keeps the images whose scores pass (an image without a score
the expression reads does not), and ``--dedup BITS`` keeps the first of each group of
near-duplicates (perceptual hashes within BITS bits) in job order: by seed, as a campaign
gives row i's image k the seed base_seed + i x images_per_prompt + k.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import hashlib
import io
import json
import logging
import sys
import tarfile
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from tqdm import tqdm

from renderfarm.jobs import JobError, check_campaign
from renderfarm.layout import image_name
from renderfarm.manifest import Records
from renderfarm.scores import COLUMNS as SCORE_COLUMNS
from renderfarm.scores import Expression, near_duplicates
from renderfarm.storage import Storage, open_storage

log = logging.getLogger(__name__)
# An image job's source, a column each (null for a text job), typed as the scores are.
SOURCE_COLUMNS = {"init_image": "string", "init_image_sha256": "string", "strength": "float64"}
TYPED_COLUMNS = {**SOURCE_COLUMNS, **SCORE_COLUMNS}

FORMATS = ("imagefolder", "webdataset", "parquet")
DEFAULT_SHARD_SIZE = 1000
ROW_GROUP_ROWS = 100
FETCH_THREADS = 8
PREFETCH = 32  # images in flight or waiting: bounds memory, hides storage latency


@dataclasses.dataclass
class ExportReport:
    campaign: str
    format: str
    target: str
    images: int = 0
    files: list[str] = dataclasses.field(default_factory=list)
    duplicates: int = 0
    bad_lines: list[int] = dataclasses.field(default_factory=list)
    skipped: list[str] = dataclasses.field(default_factory=list)  # job ids whose PNG is missing or corrupt
    filtered: int = 0  # records --where left out (their scores failed it)
    unscored: int = 0  # of those, records without a score it reads
    near_duplicates: int = 0  # records --dedup left out
    dropped: int = 0  # records of jobs whose flagged image was not stored (on_nsfw: drop)

    def summary(self) -> str:
        text = (f"exported {self.images} images of {self.campaign} as {self.format}: "
                f"{len(self.files)} files written to {self.target}")
        if self.duplicates:
            text += f"; {self.duplicates} duplicate manifest lines exported once"
        if self.bad_lines:
            text += f"; skipped unreadable manifest lines {', '.join(map(str, self.bad_lines[:10]))}"
        if self.skipped:
            text += f"; skipped {len(self.skipped)} jobs with a missing or corrupt PNG: {', '.join(self.skipped[:10])}"
        if self.filtered:
            text += f"; {self.filtered} left out by --where" + (
                f" ({self.unscored} without a score it reads)" if self.unscored else "")
        if self.near_duplicates:
            text += f"; {self.near_duplicates} near-duplicates left out by --dedup"
        if self.dropped:
            text += f"; {self.dropped} flagged images were not stored (on_nsfw: drop)"
        return text


def columns(record: dict[str, Any]) -> dict[str, Any]:
    """A sidecar as flat columns: ``prompt`` and ``seed`` first, an image job's source image and
    strength, then its scores each a column of its own, dict/list fields as JSON."""
    spec = record.get("spec") if isinstance(record.get("spec"), dict) else {}
    flat: dict[str, Any] = {"prompt": spec.get("prompt"), "seed": spec.get("seed"),
                            **{name: spec.get(name) for name in SOURCE_COLUMNS}}
    scores = record.get("scores") if isinstance(record.get("scores"), dict) else {}
    for key, value in {**{name: scores.get(name) for name in SCORE_COLUMNS}, **record}.items():
        if key == "scores":
            continue
        flat[key] = json.dumps(value, ensure_ascii=False) if isinstance(value, (dict, list)) else value
    return flat


# --------------------------------------------------------------------------- writers


class _Sharded:
    """Collects samples into shards of ``shard_size`` and stores each when it is full."""

    def __init__(self, target: Storage, campaign: str, shard_size: int, report: ExportReport) -> None:
        self.target, self.campaign, self.shard_size, self.report = target, campaign, shard_size, report
        self.shard = 0
        self.count = 0  # samples in the current shard

    def add(self, record: dict[str, Any], png: bytes) -> None:
        self._add(record, png)
        self.count += 1
        if self.count == self.shard_size:
            self.close()

    def close(self) -> None:
        if self.count:
            self._finish()
            self.shard += 1
            self.count = 0

    def put(self, name: str, data: bytes, content_type: str) -> None:
        self.target.put(name, data, content_type)
        self.report.files.append(name)

    def _add(self, record: dict[str, Any], png: bytes) -> None:
        raise NotImplementedError

    def _finish(self) -> None:
        raise NotImplementedError


class ImageFolderWriter(_Sharded):
    """One folder per shard: the PNGs and a metadata.jsonl whose ``file_name`` is relative to it."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.lines: list[str] = []

    def _add(self, record: dict[str, Any], png: bytes) -> None:
        file_name = f"{record['job_id']}.png"
        self.put(f"{self.shard:06d}/{file_name}", png, "image/png")
        self.lines.append(json.dumps({"file_name": file_name, **columns(record)}, ensure_ascii=False))

    def _finish(self) -> None:
        self.put(f"{self.shard:06d}/metadata.jsonl", "".join(line + "\n" for line in self.lines).encode(),
                 "application/x-ndjson")
        self.lines = []


class WebDatasetWriter(_Sharded):
    """POSIX tar shards, sample key = job id (hex, so no dots to confuse webdataset's key split)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.buffer = io.BytesIO()
        self.tar = tarfile.open(fileobj=self.buffer, mode="w", format=tarfile.USTAR_FORMAT)

    def _member(self, name: str, data: bytes) -> None:
        info = tarfile.TarInfo(name)
        info.size, info.mode, info.mtime = len(data), 0o644, 0  # fixed: same campaign, same bytes
        self.tar.addfile(info, io.BytesIO(data))

    def _add(self, record: dict[str, Any], png: bytes) -> None:
        self._member(f"{record['job_id']}.png", png)
        self._member(f"{record['job_id']}.json", json.dumps(record, ensure_ascii=False).encode())

    def _finish(self) -> None:
        self.tar.close()
        self.put(f"{self.campaign}-{self.shard:06d}.tar", self.buffer.getvalue(), "application/x-tar")
        self.buffer = io.BytesIO()
        self.tar = tarfile.open(fileobj=self.buffer, mode="w", format=tarfile.USTAR_FORMAT)


_HF_VALUE_TYPES = {"string": "string", "large_string": "large_string", "int64": "int64", "double": "float64",
                   "bool": "bool"}


class ParquetWriter(_Sharded):
    """Parquet files of ``shard_size`` rows written in row groups of ``ROW_GROUP_ROWS``.

    The schema comes from the first row group (null-only columns become strings, the scores'
    columns have their own types) and holds for the whole export; a later record that does
    not fit is an error naming it.
    """

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        import pyarrow as pa  # only this format needs it

        self.pa = pa
        self.rows: list[dict[str, Any]] = []
        self.schema: Any = None
        self.buffer: io.BytesIO | None = None
        self.writer: Any = None

    def _add(self, record: dict[str, Any], png: bytes) -> None:
        self.rows.append({"image": {"bytes": png, "path": f"{record['job_id']}.png"}, **columns(record)})
        if len(self.rows) == ROW_GROUP_ROWS:
            self._write_rows()

    def _infer_schema(self) -> Any:
        pa = self.pa
        inferred = pa.Table.from_pylist(self.rows).schema
        fields = [pa.field(f.name, pa.type_for_alias(TYPED_COLUMNS[f.name])) if f.name in TYPED_COLUMNS else
                  pa.field(f.name, pa.string()) if pa.types.is_null(f.type) else f for f in inferred]
        features: dict[str, Any] = {}
        for field in fields:
            if field.name == "image":
                features["image"] = {"_type": "Image"}
            elif str(field.type) in _HF_VALUE_TYPES:
                features[field.name] = {"dtype": _HF_VALUE_TYPES[str(field.type)], "_type": "Value"}
        metadata = {"huggingface": json.dumps({"info": {"features": features}})} if len(features) == len(fields) else None
        return pa.schema(fields, metadata=metadata)

    def _write_rows(self) -> None:
        if not self.rows:
            return
        pa = self.pa
        import pyarrow.parquet as pq

        if self.schema is None:
            self.schema = self._infer_schema()
        try:
            table = pa.Table.from_pylist(self.rows, schema=self.schema)
            extra = set().union(*self.rows) - set(self.schema.names)
            if extra:
                raise ValueError(f"fields {sorted(extra)} not in the export's schema")
        except (pa.ArrowException, ValueError) as err:
            job_ids = ", ".join(str(r.get("job_id")) for r in self.rows[:3])
            raise JobError("sidecar", job_ids, f"does not fit the parquet schema of the first rows ({err})") from None
        if self.writer is None:
            self.buffer = io.BytesIO()
            self.writer = pq.ParquetWriter(self.buffer, self.schema, compression="zstd")
        self.writer.write_table(table, row_group_size=len(self.rows))
        self.rows = []

    def _finish(self) -> None:
        self._write_rows()
        self.writer.close()
        assert self.buffer is not None
        self.put(f"{self.campaign}-{self.shard:06d}.parquet", self.buffer.getvalue(), "application/vnd.apache.parquet")
        self.writer, self.buffer = None, None


WRITERS = {"imagefolder": ImageFolderWriter, "webdataset": WebDatasetWriter, "parquet": ParquetWriter}


# --------------------------------------------------------------------------- export


def _images(source: Storage, campaign: str, records: Iterable[dict[str, Any]],
            report: ExportReport) -> Iterator[tuple[dict[str, Any], bytes]]:
    """(record, png) in manifest order, fetched ``PREFETCH`` ahead on a thread pool. A PNG
    that is missing or does not match its sidecar's sha256 is skipped and reported."""
    def fetch(record: dict[str, Any]) -> bytes | None:
        try:
            png = source.get(image_name(campaign, record["job_id"]))
        except FileNotFoundError:
            return None
        expected = record.get("png_sha256")
        return png if expected is None or hashlib.sha256(png).hexdigest() == expected else None

    with ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="export") as pool:
        pending: collections.deque[tuple[dict[str, Any], Future[bytes | None]]] = collections.deque()

        def done() -> Iterator[tuple[dict[str, Any], bytes]]:
            record, future = pending.popleft()
            png = future.result()
            if png is None:
                log.warning("export: %s is missing or does not match its sidecar; skipped",
                            source.url(image_name(campaign, record["job_id"])))
                report.skipped.append(record["job_id"])
            else:
                yield record, png

        for record in records:
            pending.append((record, pool.submit(fetch, record)))
            if len(pending) >= PREFETCH:
                yield from done()
        while pending:
            yield from done()


def _selected(records: Records, where: Expression | None, dedup: int | None,
              report: ExportReport) -> Iterator[dict[str, Any]]:
    """The records that pass `where` and, of near-duplicates, the first in job order."""
    def passes(record: dict[str, Any]) -> bool:
        verdict = where(record.get("scores")) if where is not None else True
        report.filtered += not verdict
        report.unscored += verdict is None
        return bool(verdict)

    dropped: set[str] = set()
    if dedup is not None:  # a first pass: the kept images' hashes in job order
        ranked = sorted(((r.get("spec") or {}).get("seed", 0), r["job_id"], (r.get("scores") or {}).get("phash"))
                        for r in records if not r.get("dropped") and passes(r))
        report.filtered = report.unscored = 0  # counted again below
        dropped = {job_id for (_, job_id, _), gone in
                   zip(ranked, near_duplicates([h for _, _, h in ranked], dedup)) if gone}
    for record in records:
        if record.get("dropped"):  # its image was not stored (the job's on_nsfw: drop)
            report.dropped += 1
            continue
        if not passes(record):
            continue
        if record["job_id"] in dropped:
            report.near_duplicates += 1
            continue
        yield record


def export(source: Storage, campaign: str, fmt: str, target: Storage, *, shard_size: int = DEFAULT_SHARD_SIZE,
           overwrite: bool = False, progress: bool = False, where: str | None = None,
           dedup: int | None = None) -> ExportReport:
    """Write the campaign's finished images (each job once) from ``source`` to ``target``;
    with `where`, those whose scores pass it; with `dedup`, the first of each group of
    near-duplicates (renderfarm/scores.py)."""
    check_campaign(campaign)
    expression = Expression(where) if where is not None else None
    if fmt not in WRITERS:
        raise JobError("format", fmt, f"must be one of {', '.join(FORMATS)}")
    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1:
        raise JobError("shard_size", shard_size, "must be an integer >= 1")
    manifest = Records.open(source, campaign)
    if not overwrite and next(iter(target.list("")), None) is not None:
        raise JobError("to", target.describe(), "is not empty: export into a new folder, or pass --overwrite")
    report = ExportReport(campaign, fmt, target.describe())
    writer = WRITERS[fmt](target, campaign, shard_size, report)
    with tqdm(total=manifest.lines, unit="img", disable=not progress, file=sys.stderr) as bar:
        for record, png in _images(source, campaign, _selected(manifest, expression, dedup, report), report):
            writer.add(record, png)
            report.images += 1
            bar.update(1)
        writer.close()
    report.duplicates, report.bad_lines = manifest.duplicates, manifest.bad_lines
    return report


# --------------------------------------------------------------------------- CLI


def cmd_export(args: argparse.Namespace) -> int:
    report = export(open_storage(args.source), args.campaign, args.format, open_storage(args.to, durable=False),
                    shard_size=args.shard_size, overwrite=args.overwrite, progress=not args.quiet,
                    where=args.where, dedup=args.dedup)
    print(report.summary())
    if report.skipped:
        print(f"renderfarm: warning: {len(report.skipped)} images were not exported (see above)", file=sys.stderr)
        return 1
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("export", help="export a campaign as imagefolder, webdataset or parquet")
    parser.add_argument("campaign", metavar="CAMPAIGN", help="the campaign's name (its folder under --from)")
    parser.add_argument("--from", dest="source", required=True, metavar="URL",
                        help="storage root the campaign is in (local folder or gs://bucket/prefix)")
    parser.add_argument("--format", required=True, choices=FORMATS,
                        help="imagefolder: PNGs + metadata.jsonl a folder; webdataset: tar shards; "
                             "parquet: image bytes and metadata in columns")
    parser.add_argument("--to", required=True, metavar="URL", help="empty folder or gs:// prefix to write to")
    parser.add_argument("--shard-size", type=int, default=DEFAULT_SHARD_SIZE,
                        help=f"images per folder, tar or parquet file (default {DEFAULT_SHARD_SIZE}); "
                             "a tar or parquet shard is built in memory before it is stored")
    parser.add_argument("--where", metavar="EXPR",
                        help="only images whose scores pass, e.g. 'clip >= 28 and aesthetic >= 5.5 and not nsfw'")
    parser.add_argument("--dedup", type=int, metavar="BITS",
                        help="of images whose perceptual hashes are within BITS bits, only the first by job order")
    parser.add_argument("--overwrite", action="store_true", help="write into a folder that is not empty")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(handler=cmd_export)
