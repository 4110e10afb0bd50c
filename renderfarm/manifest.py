"""A campaign's manifest: one JSON line per finished job, exactly once, whatever happens.

A worker writes a submission's lines (the jobs it stores at once: docs/design.md) after their
PNGs and sidecars are stored and before the jobs are acknowledged. It can die, or lose Redis, between the write and the acknowledgement;
the jobs then come back, their sidecars are found, and their lines must not be written
again. So writes are idempotent by job id, on each backend in the way it can afford:

- A local folder: `CAMPAIGN/manifest.jsonl`, appended under an exclusive flock. Under the
  lock a writer first reads what others appended since it last looked (from its own
  offset, so no write re-reads the file) and appends only the lines of jobs not there yet.
  A writer keeps the ids of the last RECENT_IDS lines of a campaign, not all of them, so a
  worker's memory is bounded however large the campaign: two renders of one job (a
  duplicate delivery) store within moments of each other, and a job that comes back found
  stored is looked for in the whole file (`holds`).
- GCS: an object cannot be appended to; rewriting it per submission moves bytes that grow with
  the campaign, and GCS takes about one write a second per object. So the manifest is a
  folder of parts, `CAMPAIGN/manifest/TIME-WRITER-SEQ.jsonl`, one per stored submission, each
  created once (`if_generation_match=0`) and never rewritten; names sort by time and
  readers list them in that order. A submission's sidecars name its part before the part is
  written (`manifest_part`), so a job found stored when it comes back gets a line only if
  that part does not exist or does not hold it.

Readers (exports, galleries) take the lines in order and can continue from a cursor, so a
gallery refresh reads only what is new. `Records` parses them, one record per job id.
"""

from __future__ import annotations

import abc
import dataclasses
import fcntl
import itertools
import json
import logging
import mmap
import os
import re
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from renderfarm.jobs import JobError, check_campaign
from renderfarm.layout import MANIFEST_BASENAME, validate_job_id
from renderfarm.storage import GCSStorage, LocalStorage, Storage

log = logging.getLogger(__name__)

PARTS = "manifest"  # the GCS manifest's folder in a campaign
PART_RE = re.compile(r"(\d{20})-[A-Za-z0-9.-]{1,64}-\d{8}\.jsonl")  # TIME-WRITER-SEQ.jsonl
# Parts are listed from this long before the newest one seen, so a part written by a host
# whose clock runs behind (or an upload still in flight) is not missed by a reader.
CLOCK_MARGIN_NS = 10 * 60 * 10**9
FETCH_THREADS = 8
RECENT_IDS = 100_000  # job ids a local manifest's writer keeps per campaign (about 10 MB)
RECENT_CAMPAIGNS = 8  # campaigns it keeps them for, the least recently written forgotten first


@dataclasses.dataclass
class Cursor:
    """Where a reader stopped: a byte offset (file) or the parts it has read (GCS)."""

    offset: int = 0
    parts: set[str] = dataclasses.field(default_factory=set)
    newest: str = ""


def job_id_of(line: bytes | str) -> str | None:
    """The job id of a manifest line, None for a line that is not a job record."""
    try:
        return validate_job_id(json.loads(line)["job_id"])
    except (ValueError, KeyError, TypeError, RecursionError):
        return None


def _lines(data: bytes) -> list[bytes]:
    return [line for line in data.split(b"\n") if line.strip()]


class Manifest(abc.ABC):
    """Writes and reads the manifests of one storage root."""

    @abc.abstractmethod
    def new_part(self, campaign: str) -> str:
        """Where the lines of a submission about to be stored go (named in its sidecars)."""

    @abc.abstractmethod
    def append(self, campaign: str, part: str, entries: list[tuple[str, str]]) -> None:
        """Write (job id, line) entries to `part`; a job id already written is skipped."""

    @abc.abstractmethod
    def holds(self, campaign: str, part: str, job_id: str) -> bool:
        """Whether `part` has the line of `job_id` (the part a stored sidecar names)."""

    @abc.abstractmethod
    def read(self, campaign: str, cursor: Cursor | None = None) -> tuple[list[bytes], Cursor]:
        """The lines written since `cursor` (all of them without one), in order, and the
        cursor to continue from. FileNotFoundError if the campaign has no manifest."""


def open_manifest(storage: Storage) -> Manifest:
    """The manifest of a storage root (one object per root: it caches what it has read)."""
    if isinstance(storage, GCSStorage):
        return PartsManifest(storage)
    if isinstance(storage, LocalStorage):
        return FileManifest(storage)
    raise TypeError(f"no manifest for {type(storage).__name__}")


@dataclasses.dataclass
class _Recent:
    """What a local manifest's writer knows of a campaign's file: how far it has read, and
    the job ids of the last RECENT_IDS lines (a dict, for its insertion order)."""

    offset: int = 0
    ids: dict[str, None] = dataclasses.field(default_factory=dict)

    def add(self, ids: Iterable[str]) -> None:
        for job_id in ids:
            self.ids.pop(job_id, None)
            self.ids[job_id] = None
        for oldest in list(itertools.islice(self.ids, max(0, len(self.ids) - RECENT_IDS))):
            del self.ids[oldest]


class FileManifest(Manifest):
    """`CAMPAIGN/manifest.jsonl` on a local disk, idempotent under an exclusive flock."""

    def __init__(self, storage: LocalStorage) -> None:
        self.storage = storage
        self._lock = threading.Lock()  # flock is per process; this orders our own threads
        self._recent: dict[str, _Recent] = {}  # by campaign, the least recently used first

    def new_part(self, campaign: str) -> str:
        return MANIFEST_BASENAME

    def _catch_up(self, campaign: str, fd: int) -> _Recent:
        """The campaign's recent job ids, after reading what was appended since the last look."""
        recent = self._recent.pop(campaign, None) or _Recent()
        self._recent[campaign] = recent
        for forgotten in list(itertools.islice(self._recent, max(0, len(self._recent) - RECENT_CAMPAIGNS))):
            del self._recent[forgotten]
        size = os.fstat(fd).st_size
        if size < recent.offset:  # the file was replaced: read it again
            recent.offset, recent.ids = 0, {}
        data = os.pread(fd, size - recent.offset, recent.offset)
        whole = data.rfind(b"\n") + 1  # a torn last line (a writer died) is not a record yet
        recent.add(filter(None, map(job_id_of, _lines(data[:whole]))))
        recent.offset += whole
        return recent

    def append(self, campaign: str, part: str, entries: list[tuple[str, str]]) -> None:
        data = _encode(entries)
        if not data:
            return
        name = f"{check_campaign(campaign)}/{MANIFEST_BASENAME}"
        with self._lock:
            fd = self.storage.open_file(name, os.O_RDWR | os.O_APPEND | os.O_CREAT)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                recent = self._catch_up(campaign, fd)
                fresh = [(job_id, line) for job_id, line in dict(entries).items() if job_id not in recent.ids]
                if not fresh:
                    return
                payload = _encode(fresh)
                size = os.fstat(fd).st_size
                if size and os.pread(fd, 1, size - 1) != b"\n":
                    payload = b"\n" + payload  # end the torn line of a writer that died
                os.write(fd, payload)
                if self.storage.durable:
                    os.fsync(fd)
                recent.add(job_id for job_id, _ in fresh)
                recent.offset = size + len(payload)
            finally:
                os.close(fd)  # releases the flock

    def holds(self, campaign: str, part: str, job_id: str) -> bool:
        with self._lock:
            try:
                fd = self.storage.open_file(f"{check_campaign(campaign)}/{MANIFEST_BASENAME}", os.O_RDONLY)
            except FileNotFoundError:
                return False
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)
                return job_id in self._catch_up(campaign, fd).ids or _in_file(fd, job_id)
            finally:
                os.close(fd)

    def read(self, campaign: str, cursor: Cursor | None = None) -> tuple[list[bytes], Cursor]:
        cursor = cursor or Cursor()
        fd = self.storage.open_file(f"{check_campaign(campaign)}/{MANIFEST_BASENAME}", os.O_RDONLY)
        with open(fd, "rb") as file:  # FileNotFoundError when there is none
            file.seek(cursor.offset)
            data = file.read()
        whole = data.rfind(b"\n") + 1
        return _lines(data[:whole]), Cursor(offset=cursor.offset + whole)


class PartsManifest(Manifest):
    """`CAMPAIGN/manifest/*.jsonl` on GCS: a part per submission, created once, never rewritten."""

    _writer = re.sub(r"[^A-Za-z0-9.-]", "-", f"{socket.gethostname()}-{os.getpid()}")[:64]

    def __init__(self, storage: GCSStorage) -> None:
        self.storage = storage
        self._seq = itertools.count()

    def new_part(self, campaign: str) -> str:
        return f"{PARTS}/{time.time_ns():020d}-{self._writer}-{next(self._seq):08d}.jsonl"

    def append(self, campaign: str, part: str, entries: list[tuple[str, str]]) -> None:
        data = _encode(list(dict(entries).items()))
        if data and not self.storage.create(f"{check_campaign(campaign)}/{part}", data, "application/x-ndjson"):
            log.info("manifest part %s/%s was written already", campaign, part)

    def holds(self, campaign: str, part: str, job_id: str) -> bool:
        try:
            data = self.storage.get(f"{check_campaign(campaign)}/{part}")
        except FileNotFoundError:
            return False
        return job_id in map(job_id_of, _lines(data))

    def read(self, campaign: str, cursor: Cursor | None = None) -> tuple[list[bytes], Cursor]:
        prefix = f"{check_campaign(campaign)}/{PARTS}/"
        first = cursor is None
        cursor = cursor or Cursor()
        start = None
        if cursor.newest:
            start = prefix + f"{max(0, int(cursor.newest[:20]) - CLOCK_MARGIN_NS):020d}"
        names = [name for name in self.storage.list(prefix, start_offset=start)
                 if PART_RE.fullmatch(name[len(prefix):]) and name[len(prefix):] not in cursor.parts]
        with ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="manifest") as pool:
            parts = list(pool.map(self.storage.get, names))
        legacy = self._legacy(campaign) if first else b""
        if first and not names and not legacy:
            raise FileNotFoundError(self.storage.url(prefix.rstrip("/")))
        seen = {name[len(prefix):] for name in names} | cursor.parts
        newest = max(seen, default="")
        horizon = int(newest[:20]) - CLOCK_MARGIN_NS if newest else 0
        kept = {name for name in seen if int(name[:20]) >= horizon}  # older ones are never listed again
        return _lines(legacy) + [line for data in parts for line in _lines(data)], \
            Cursor(parts=kept, newest=newest)

    def _legacy(self, campaign: str) -> bytes:
        """A `manifest.jsonl` object written before manifests became parts on GCS."""
        try:
            return self.storage.get(f"{campaign}/{MANIFEST_BASENAME}")
        except FileNotFoundError:
            return b""


def _in_file(fd: int, job_id: str) -> bool:
    """Whether a manifest file has a line of `job_id`: a search of its bytes (memory-mapped,
    so the file is never held in memory), each hit confirmed by reading its line."""
    size = os.fstat(fd).st_size
    if not size:
        return False
    needle = job_id.encode()
    with mmap.mmap(fd, size, prot=mmap.PROT_READ) as data:
        at = data.find(needle)
        while at >= 0:
            start, end = data.rfind(b"\n", 0, at) + 1, data.find(b"\n", at)
            if end >= 0 and job_id_of(data[start:end]) == job_id:
                return True
            at = data.find(needle, at + 1)
    return False


def _encode(entries: list[tuple[str, str]]) -> bytes:
    """JSONL bytes; a line holding a newline would split one record into two."""
    for _, line in entries:
        if "\n" in line or "\r" in line:
            raise ValueError(f"a manifest line must not contain newlines: {line[:80]!r}")
    return "".join(line + "\n" for _, line in entries).encode("utf-8")


def no_such_campaign(storage: Storage, campaign: str) -> JobError:
    return JobError("campaign", campaign, f"no such campaign: {storage.url(campaign)}/ has no manifest "
                                          f"(no finished jobs under {storage.describe()})")


class Records:
    """A campaign's records from its manifest lines: each job id once (the first line
    wins), and lines that are not a job record skipped with a warning and counted, so one
    bad line never hides the good ones."""

    def __init__(self, lines: Iterable[bytes], where: str) -> None:
        self._lines, self.where = list(lines), where
        self.duplicates = 0
        self.bad_lines: list[int] = []

    @property
    def lines(self) -> int:
        return len(self._lines)

    @classmethod
    def open(cls, storage: Storage, campaign: str, manifest: Manifest | None = None) -> Records:
        """Every record of a campaign; a clear error naming it if it has no manifest."""
        check_campaign(campaign)
        try:
            lines, _ = (manifest or open_manifest(storage)).read(campaign)
        except FileNotFoundError:
            raise no_such_campaign(storage, campaign) from None
        return cls(lines, f"{storage.url(campaign)} manifest")

    def __iter__(self) -> Iterator[dict[str, Any]]:
        seen: set[str] = set()
        self.duplicates, self.bad_lines = 0, []
        for number, line in enumerate(self._lines, 1):
            try:
                record = json.loads(line)
                job_id = validate_job_id(record["job_id"])
            except (ValueError, KeyError, TypeError, RecursionError) as err:
                log.warning("%s line %d skipped: %s", self.where, number, err)
                self.bad_lines.append(number)
                continue
            if job_id in seen:
                self.duplicates += 1
                continue
            seen.add(job_id)
            yield record
