"""Storage layout and backends: the single place that knows where render outputs live.

A storage root is a URL: ``gs://bucket[/prefix]`` (Google Cloud Storage) or a local
path / ``file://path``.  Layout under the root::

    ROOT/CAMPAIGN/JOB_ID.png        the image
    ROOT/CAMPAIGN/JOB_ID.json       sidecar JSON
    ROOT/CAMPAIGN/manifest.jsonl    one line per finished job (local folders)
    ROOT/CAMPAIGN/manifest/*.jsonl  the same as one part per stored batch (GCS; renderfarm.manifest)
    ROOT/CAMPAIGN/thumbs/JOB_ID.jpg thumbnail (~128 px) for the gallery
    ROOT/CAMPAIGN/index.html        static gallery page (relative links)
    ROOT/CAMPAIGN/preview.png       contact sheet of the newest thumbnails

All backend methods take names relative to the root (e.g. ``"local/abc.png"``).
Missing objects raise :class:`FileNotFoundError` on every backend.  Transient
failures (connection refused/reset, timeouts, HTTP 408/429/5xx, flaky local I/O)
are retried with exponential backoff according to :class:`RetryPolicy`, then re-raised.

google-cloud-storage is imported lazily, so local-only users do not need it.
"""

from __future__ import annotations

import abc
import errno
import http.client
import logging
import os
import random
import re
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, TypeVar
from urllib.parse import unquote

from renderfarm.jobs import check_campaign

if TYPE_CHECKING:  # pragma: no cover - typing only
    from google.cloud import storage

__all__ = [
    "JOB_ID_RULE",
    "GCSStorage",
    "LocalStorage",
    "RetryPolicy",
    "Storage",
    "image_name",
    "index_name",
    "is_transient_error",
    "make_gcs_client",
    "manifest_name",
    "open_storage",
    "preview_name",
    "sidecar_name",
    "thumbnail_name",
    "validate_job_id",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

# --------------------------------------------------------------------------- layout

JOB_ID_RULE = "lowercase hex [0-9a-f]{1,128}"
_JOB_ID_RE = re.compile(r"[0-9a-f]{1,128}")
MANIFEST_BASENAME = "manifest.jsonl"


def validate_job_id(job_id: str) -> str:
    """Return ``job_id`` if it is lowercase hex, else raise ValueError (keeps names path-safe)."""
    if not isinstance(job_id, str) or not _JOB_ID_RE.fullmatch(job_id):
        raise ValueError(f"invalid job_id {job_id!r}: must be {JOB_ID_RULE}")
    return job_id


def image_name(campaign: str, job_id: str) -> str:
    """Relative name of a job's PNG image: ``CAMPAIGN/JOB_ID.png``."""
    return f"{check_campaign(campaign)}/{validate_job_id(job_id)}.png"


def sidecar_name(campaign: str, job_id: str) -> str:
    """Relative name of a job's sidecar JSON: ``CAMPAIGN/JOB_ID.json``."""
    return f"{check_campaign(campaign)}/{validate_job_id(job_id)}.json"


def manifest_name(campaign: str) -> str:
    """Relative name of a campaign's manifest (one JSON line per finished job)."""
    return f"{check_campaign(campaign)}/{MANIFEST_BASENAME}"


def thumbnail_name(campaign: str, job_id: str) -> str:
    """Relative name of a job's gallery thumbnail: ``CAMPAIGN/thumbs/JOB_ID.jpg``."""
    return f"{check_campaign(campaign)}/thumbs/{validate_job_id(job_id)}.jpg"


def index_name(campaign: str) -> str:
    """Relative name of a campaign's static gallery page: ``CAMPAIGN/index.html``."""
    return f"{check_campaign(campaign)}/index.html"


def preview_name(campaign: str) -> str:
    """Relative name of a campaign's contact sheet: ``CAMPAIGN/preview.png``."""
    return f"{check_campaign(campaign)}/preview.png"


def _check_name(name: str, *, prefix: bool = False) -> str:
    """Reject names that could escape the root (absolute, ``..``, empty segments).

    With ``prefix=True`` the empty string and a trailing ``/`` are allowed (listing prefixes).
    """
    if not isinstance(name, str):
        raise TypeError(f"storage name must be str, got {type(name).__name__}")
    if prefix and name == "":
        return name
    parts = name.split("/")
    if prefix and parts[-1] == "":
        parts = parts[:-1]
    if (
        not name
        or name.startswith("/")
        or "\\" in name
        or "\x00" in name
        or any(p in ("", ".", "..") for p in parts)
    ):
        raise ValueError(
            f"invalid storage name {name!r}: must be a relative 'a/b/c' path without empty, '.' or '..' segments"
        )
    return name


# --------------------------------------------------------------------------- retries


@dataclass(frozen=True)
class RetryPolicy:
    """How hard to retry transient errors: total tries, first backoff, backoff cap (delays
    double each time, with jitter)."""

    attempts: int = 6
    base_delay: float = 0.2
    max_delay: float = 5.0

    def delay(self, failures: int) -> float:
        """Jittered exponential delay after ``failures`` consecutive failures (>= 1)."""
        d = min(self.max_delay, self.base_delay * (2 ** (failures - 1)))
        return d * (0.5 + random.random() / 2)


DEFAULT_RETRY = RetryPolicy()

# Local OSErrors that retrying cannot fix.
_PERMANENT_ERRNOS = {
    errno.ENOENT,
    errno.EISDIR,
    errno.ENOTDIR,
    errno.EACCES,
    errno.EPERM,
    errno.EEXIST,
    errno.ENAMETOOLONG,
    errno.EINVAL,
    errno.EROFS,
    errno.ENOTEMPTY,
    errno.ELOOP,
    errno.EBADF,
}
_TRANSIENT_HTTP = {408, 429, 500, 502, 503, 504}


def _google_transient(exc: BaseException) -> bool | None:
    """Classify google/requests/urllib3 exceptions; None if not one of theirs."""
    try:
        import requests
        import urllib3
        from google.api_core import exceptions as gexc
    except ImportError:  # pragma: no cover - GCS extras not installed
        return None
    if isinstance(exc, gexc.PreconditionFailed):
        return False
    if isinstance(exc, gexc.GoogleAPICallError):
        return exc.code in _TRANSIENT_HTTP
    if isinstance(
        exc,
        (
            requests.ConnectionError,
            requests.Timeout,
            requests.exceptions.ChunkedEncodingError,
            urllib3.exceptions.ProtocolError,
            urllib3.exceptions.TimeoutError,
            urllib3.exceptions.PoolError,
        ),
    ):
        return True
    try:
        from google.auth.exceptions import TransportError

        if isinstance(exc, TransportError):
            inner = exc.args[0] if exc.args and isinstance(exc.args[0], BaseException) else None
            return True if inner is None else is_transient_error(inner, local=False)
    except ImportError:  # pragma: no cover
        pass
    try:
        from google.cloud.storage.exceptions import InvalidResponse

        if isinstance(exc, InvalidResponse):
            return getattr(exc.response, "status_code", None) in _TRANSIENT_HTTP
    except ImportError:  # pragma: no cover
        pass
    return None


def is_transient_error(exc: BaseException, *, local: bool = False) -> bool:
    """True if ``exc`` is worth retrying (network blips, throttling, 5xx, flaky local I/O).

    ``local=True`` additionally treats generic OSErrors as transient, except those that
    retrying cannot fix (missing file, permissions, ...).
    """
    g = _google_transient(exc)
    if g is not None:
        return g
    if isinstance(exc, (ConnectionError, TimeoutError, socket.timeout)):
        return True
    if isinstance(exc, (http.client.RemoteDisconnected, http.client.IncompleteRead, http.client.BadStatusLine)):
        return True
    if local and isinstance(exc, OSError):
        return exc.errno not in _PERMANENT_ERRNOS and not isinstance(
            exc, (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError, FileExistsError)
        )
    return False


def _with_retries(fn: Callable[[], T], policy: RetryPolicy, what: str, *, local: bool) -> T:
    """Run ``fn``; on transient errors back off and retry up to ``policy.attempts`` tries."""
    failures = 0
    while True:
        try:
            return fn()
        except Exception as exc:
            if not is_transient_error(exc, local=local):
                raise
            failures += 1
            if failures >= policy.attempts:
                log.warning("storage: %s failed after %d attempts: %r", what, failures, exc)
                raise
            delay = policy.delay(failures)
            log.info("storage: %s transient error (%r); retry %d/%d in %.2fs", what, exc, failures, policy.attempts - 1, delay)
            time.sleep(delay)


# --------------------------------------------------------------------------- base


class Storage(abc.ABC):
    """Object store addressed by names relative to a root (see module docstring)."""

    retry: RetryPolicy

    @abc.abstractmethod
    def put(self, name: str, data: bytes, content_type: str = "application/octet-stream",
            sync: bool = True) -> None:
        """Store ``data`` under ``name`` (overwrites; repeating with the same bytes is harmless).
        ``sync=False`` is for files remade from others when missing (gallery thumbnails):
        stored whole, but a crash of the machine may lose them, so no fsync is paid."""

    @abc.abstractmethod
    def get(self, name: str) -> bytes:
        """Return the bytes stored under ``name``; raise FileNotFoundError if absent."""

    @abc.abstractmethod
    def exists(self, name: str) -> bool:
        """True if an object/file named ``name`` exists."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[str]:
        """Names (relative to the root, sorted) that start with ``prefix``; fetched eagerly, then iterated."""

    @abc.abstractmethod
    def url(self, name: str) -> str:
        """Human/tool-usable location of ``name`` (gs:// URL or absolute local path)."""

    @abc.abstractmethod
    def describe(self) -> str:
        """Root URL of this storage (accepted back by :func:`open_storage`)."""

    def __str__(self) -> str:
        return self.describe()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.describe()!r})"


# --------------------------------------------------------------------------- local

_TMP_PREFIX = ".rf-tmp-"


def _fsync_dir(path: Path) -> None:
    """Persist a rename/creation in ``path`` (best effort; some filesystems refuse)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


class LocalStorage(Storage):
    """Storage rooted at a local directory (created if missing).

    Writes are always atomic (a reader never sees half a file). With ``durable`` they are
    also fsynced before returning, which a worker that acks a queue after storing needs; a
    local render into a folder does not, and skips the cost (about 1 ms per file here).
    """

    def __init__(self, root: Path | str, retry: RetryPolicy | None = None, durable: bool = True) -> None:
        self.root = Path(root).expanduser().resolve()
        self.retry = retry or DEFAULT_RETRY
        self.durable = durable
        self.root.mkdir(parents=True, exist_ok=True)
        self._real_folders: set[str] = set()  # top-level folders found not to be symlinks

    def path(self, name: str) -> Path:
        """The file of ``name``. A campaign folder that is a symlink is refused: writes
        would land wherever it points, outside the root."""
        _check_name(name)
        top = name.partition("/")[0]
        if "/" in name and top not in self._real_folders:
            folder = self.root / top
            if folder.is_symlink():
                raise ValueError(f"{folder} is a symlink: a campaign folder must be a real folder "
                                 f"under {self.root}")
            if folder.is_dir():
                self._real_folders.add(top)
        return self.root / name


    def put(self, name: str, data: bytes, content_type: str = "application/octet-stream",
            sync: bool = True) -> None:
        """Atomic write via temp file + os.replace in the same directory, so readers never see a partial file."""
        path = self.path(name)
        data = bytes(data)
        durable = self.durable and sync

        def op() -> None:
            # Named by thread id (unique on the host while it lives): no mkstemp, and the
            # folder is made only when missing, not on every write.
            tmp = path.with_name(f"{_TMP_PREFIX}{path.name}.{threading.get_native_id()}")
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
            try:
                fd = os.open(tmp, flags, 0o644)
            except FileNotFoundError:
                path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(tmp, flags, 0o644)
            try:
                try:
                    _write_all(fd, data)
                    if durable:
                        os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, path)
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
            if durable:
                _fsync_dir(path.parent)

        _with_retries(op, self.retry, f"put {path}", local=True)

    def get(self, name: str) -> bytes:
        path = self.path(name)
        return _with_retries(path.read_bytes, self.retry, f"get {path}", local=True)

    def exists(self, name: str) -> bool:
        path = self.path(name)
        return _with_retries(path.is_file, self.retry, f"exists {path}", local=True)

    def list(self, prefix: str = "") -> Iterator[str]:
        """String-prefix semantics like GCS (``"c/ab"`` matches ``c/abc.png``); temp files are skipped."""
        _check_name(prefix, prefix=True)

        def op() -> list[str]:
            base = self.root / prefix.rpartition("/")[0] if "/" in prefix else self.root
            if not base.is_dir():
                return []
            found = []
            for dirpath, _dirnames, filenames in os.walk(base):
                rel_dir = Path(dirpath).relative_to(self.root).as_posix()
                for fn in filenames:
                    if fn.startswith(_TMP_PREFIX):
                        continue
                    rel = fn if rel_dir == "." else f"{rel_dir}/{fn}"
                    if rel.startswith(prefix):
                        found.append(rel)
            return sorted(found)

        return iter(_with_retries(op, self.retry, f"list {self.root}/{prefix}", local=True))

    def url(self, name: str) -> str:
        return str(self.path(name))

    def describe(self) -> str:
        return self.root.as_uri()


# --------------------------------------------------------------------------- GCS

EMULATOR_PROJECT = "renderfarm-emulator"


def make_gcs_client(project: str | None = None) -> "storage.Client":
    """Build a google-cloud-storage client.

    With ``STORAGE_EMULATOR_HOST`` set (tests / local emulator) use anonymous credentials,
    so no ADC lookup happens; otherwise default credentials (ADC / metadata server).
    """
    from google.cloud import storage

    if os.environ.get("STORAGE_EMULATOR_HOST"):
        from google.auth.credentials import AnonymousCredentials

        return storage.Client(
            project=project or os.environ.get("GOOGLE_CLOUD_PROJECT") or EMULATOR_PROJECT,
            credentials=AnonymousCredentials(),
        )
    return storage.Client() if project is None else storage.Client(project=project)


_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]")


class GCSStorage(Storage):
    """Storage in ``gs://bucket/prefix`` via google-cloud-storage.

    The client is created lazily (and re-created after ``fork``) so instances can be built
    before worker processes start.  The client's own retries are disabled (``retry=None``);
    this class does its own retrying so the policy is uniform and configurable.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        client: "storage.Client | None" = None,
        retry: RetryPolicy | None = None,
        timeout: float = 60.0,
    ) -> None:
        if not isinstance(bucket, str) or not _BUCKET_RE.fullmatch(bucket):
            raise ValueError(f"invalid GCS bucket name {bucket!r}")
        prefix = prefix.strip("/")
        if prefix:
            _check_name(prefix)
        self.bucket_name = bucket
        self.prefix = prefix
        self.retry = retry or DEFAULT_RETRY
        self.timeout = timeout
        self._client = client
        self._client_pid = os.getpid() if client is not None else None
        self._lock = threading.Lock()

    # -- plumbing
    @property
    def client(self) -> "storage.Client":
        """The google client, created on first use in this process."""
        with self._lock:
            if self._client is None or self._client_pid != os.getpid():
                self._client = make_gcs_client()
                self._client_pid = os.getpid()
            return self._client

    def _key(self, name: str) -> str:
        _check_name(name)
        return f"{self.prefix}/{name}" if self.prefix else name

    def _blob(self, name: str) -> "storage.Blob":
        return self.client.bucket(self.bucket_name).blob(self._key(name))

    def _run(self, fn: Callable[[], T], what: str) -> T:
        return _with_retries(fn, self.retry, what, local=False)

    # -- API
    def put(self, name: str, data: bytes, content_type: str = "application/octet-stream",
            sync: bool = True) -> None:
        """Unconditional overwrite: retrying after an ambiguous failure just rewrites the same
        bytes. An upload is durable once it returns, whatever ``sync`` says."""
        data = bytes(data)

        def op() -> None:
            self._blob(name).upload_from_string(data, content_type=content_type, retry=None, timeout=self.timeout)

        self._run(op, f"put {self.url(name)}")

    def get(self, name: str) -> bytes:
        from google.api_core.exceptions import NotFound

        def op() -> bytes:
            try:
                return self._blob(name).download_as_bytes(retry=None, timeout=self.timeout)
            except NotFound:
                raise FileNotFoundError(self.url(name)) from None

        return self._run(op, f"get {self.url(name)}")

    def exists(self, name: str) -> bool:
        return self._run(lambda: self._blob(name).exists(retry=None, timeout=self.timeout), f"exists {self.url(name)}")

    def list(self, prefix: str = "", start_offset: str | None = None) -> Iterator[str]:
        """Listing is collected fully inside the retry loop, so a mid-pagination blip restarts
        cleanly. ``start_offset`` (a name) skips the names that sort before it."""
        _check_name(prefix, prefix=True)
        root = f"{self.prefix}/" if self.prefix else ""
        start = None if start_offset is None else root + start_offset

        def op() -> list[str]:
            blobs = self.client.list_blobs(self.bucket_name, prefix=root + prefix, start_offset=start,
                                           retry=None, timeout=self.timeout)
            return sorted(b.name[len(root):] for b in blobs if not b.name.endswith("/"))

        return iter(self._run(op, f"list gs://{self.bucket_name}/{root}{prefix}"))

    def create(self, name: str, data: bytes, content_type: str = "application/octet-stream") -> bool:
        """Store ``data`` under ``name`` only if nothing is there yet (``if_generation_match=0``);
        False if something is. A retry after an ambiguous failure that did land finds it there."""
        from google.api_core.exceptions import PreconditionFailed

        data = bytes(data)

        def op() -> bool:
            try:
                self._blob(name).upload_from_string(data, content_type=content_type, if_generation_match=0,
                                                    retry=None, timeout=self.timeout)
            except PreconditionFailed:
                return False
            return True

        return self._run(op, f"create {self.url(name)}")

    def url(self, name: str) -> str:
        return f"gs://{self.bucket_name}/{self._key(name)}"

    def describe(self) -> str:
        return f"gs://{self.bucket_name}/{self.prefix}" if self.prefix else f"gs://{self.bucket_name}"


# --------------------------------------------------------------------------- factory

_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def open_storage(url: str, retry: RetryPolicy | None = None, durable: bool = True) -> Storage:
    """Open the storage root named by ``url`` so callers never branch on backend themselves.

    ``gs://bucket[/prefix]`` -> :class:`GCSStorage`; ``file:///abs``, ``file://rel`` or a
    plain path (relative paths resolve against the cwd) -> :class:`LocalStorage`.
    """
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"storage URL must be a non-empty string, got {url!r}")
    url = url.strip()
    m = _SCHEME_RE.match(url)
    if m is None:
        return LocalStorage(Path(url), retry=retry, durable=durable)
    scheme = m.group(1).lower()
    rest = url[m.end():]
    if scheme == "gs":
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise ValueError(f"storage URL {url!r} has no bucket (expected gs://bucket[/prefix])")
        return GCSStorage(bucket, prefix, retry=retry)
    if scheme == "file":
        if rest.startswith("localhost/"):
            rest = rest[len("localhost"):]
        if not rest:
            raise ValueError(f"storage URL {url!r} has no path")
        return LocalStorage(Path(unquote(rest)), retry=retry, durable=durable)
    raise ValueError(f"unsupported storage URL scheme {scheme!r} in {url!r} (use gs:// or a local path)")
