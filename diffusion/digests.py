"""sha256 of weights files, computed once per file and remembered by path, size, mtime, inode and ctime.

Every sidecar names the digest of every weights file its image came from (a base's component
files, a single-file checkpoint, each LoRA), so an image says exactly which bytes made it. A
worker restarts often and its files are gigabytes: the digests are kept in one small JSON file
beside the model cache, keyed by the file's resolved path, size, modification time, inode and
change time, so a restart re-hashes nothing that has not changed. Size and mtime are not
enough: `cp -p` and `rsync -t` replace a file's bytes and set its mtime back, but no copy can
set the ctime, and a file renamed over another has a new inode, so a replaced file is hashed
again (a chmod moves the ctime too: one re-hash more, never a stale digest). A path keeps one
entry: writing it drops the path's older ones, those of the old path|size|mtime keys
included. Writers replace the file atomically; workers sharing a host may both hash a new
file once, never read a torn cache.
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


def _key(path: Path, stat: os.stat_result) -> str:
    return f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{stat.st_ino}|{stat.st_ctime_ns}"


def _read(cache: Path) -> dict[str, str]:
    try:
        data = json.loads(cache.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}  # no cache yet, or an unreadable one: hashing again is always right
    return data if isinstance(data, dict) else {}


def file_sha256(path: Path, cache: Path) -> str:
    """The file's sha256 (hex), from `cache` (a JSON file) when its path, size, mtime, inode
    and ctime are unchanged."""
    path = Path(path).resolve()
    with open(path, "rb") as f:
        key = _key(path, os.fstat(f.fileno()))  # of the bytes read here, whatever the path names later
        with _lock:
            known = _read(cache).get(key)
        if isinstance(known, str):
            return known
        digest = hashlib.sha256()
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    value = digest.hexdigest()
    with _lock:
        # the path's older entries can never match again (another file named `{path}|...` may
        # lose its entry: one re-hash)
        entries = {k: v for k, v in _read(cache).items() if not k.startswith(f"{path}|")}
        entries[key] = value
        cache.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache.parent, prefix=".sha256-")
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            json.dump(entries, out)
        os.replace(tmp, cache)
    return value
