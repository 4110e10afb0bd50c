"""Storage roots: a URL, `gs://bucket[/prefix]` (Google Cloud Storage) or a local path /
`file://path`, opened as one backend so callers never branch on it. What lives where under a
root is renderfarm.layout; how failures are retried, renderfarm.retry.

All backend methods take names relative to the root (e.g. ``"local/abc.png"``). Missing
objects raise :class:`FileNotFoundError` on every backend. Transient failures (connection
refused/reset, timeouts, HTTP 408/429/5xx, flaky local I/O) are retried with exponential
backoff according to :class:`RetryPolicy`, then re-raised.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

from renderfarm.retry import RetryPolicy
from renderfarm.storage.base import Storage
from renderfarm.storage.gcs import GCSStorage, make_gcs_client
from renderfarm.storage.local import LocalStorage

__all__ = ["GCSStorage", "LocalStorage", "Storage", "make_gcs_client", "open_storage"]

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
