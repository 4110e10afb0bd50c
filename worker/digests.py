"""sha256 of weights files, computed once per file and remembered by path, size and mtime.

Every sidecar names the digest of every weights file its image came from (a base's component
files, a single-file checkpoint, each LoRA), so an image says exactly which bytes made it. A
worker restarts often and its files are gigabytes: the digests are kept in one small JSON file
beside the model cache, keyed by the file's resolved path, size and modification time, so a
restart re-hashes nothing that has not changed. Writers replace the file atomically; workers
sharing a host may both hash a new file once, never read a torn cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from pathlib import Path

CHUNK = 8 * 2**20
_lock = threading.Lock()


def _key(path: Path) -> str:
    stat = path.stat()
    return f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"


def _read(cache: Path) -> dict[str, str]:
    try:
        data = json.loads(cache.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}  # no cache yet, or an unreadable one: hashing again is always right
    return data if isinstance(data, dict) else {}


def file_sha256(path: Path, cache: Path) -> str:
    """The file's sha256 (hex), from `cache` (a JSON file) when its path, size and mtime are
    unchanged."""
    path = Path(path)
    key = _key(path)
    with _lock:
        known = _read(cache).get(key)
    if isinstance(known, str):
        return known
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    value = digest.hexdigest()
    with _lock:
        entries = _read(cache)
        entries[key] = value
        cache.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache.parent, prefix=".sha256-")
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            json.dump(entries, out)
        os.replace(tmp, cache)
    return value
