"""diffusion/digests.py: a weights file's sha256 is remembered, and never reported for other bytes."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pytest

from diffusion.digests import file_sha256


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("how", ["in place (cp -p)", "renamed over (rsync -t)"])
def test_a_file_replaced_with_its_size_and_mtime_kept_is_hashed_again(tmp_path: Path, how: str) -> None:
    cache, weights = tmp_path / "sha256.json", tmp_path / "w.safetensors"
    weights.write_bytes(b"weights one")
    assert file_sha256(weights, cache) == sha256(b"weights one")
    old = weights.stat()
    time.sleep(0.05)  # past the clock tick the kernel stamps ctimes with
    if how.startswith("in place"):
        weights.write_bytes(b"weights two")
    else:
        (tmp_path / "new").write_bytes(b"weights two")
        os.replace(tmp_path / "new", weights)
    os.utime(weights, ns=(old.st_atime_ns, old.st_mtime_ns))
    new = weights.stat()
    assert (new.st_size, new.st_mtime_ns) == (old.st_size, old.st_mtime_ns)  # what a size+mtime key sees
    assert file_sha256(weights, cache) == sha256(b"weights two")
    assert list(json.loads(cache.read_text()).values()) == [sha256(b"weights two")]  # one entry per path


def test_entries_keyed_the_old_way_are_ignored_and_dropped(tmp_path: Path) -> None:
    """A cache written before inode and ctime were in the key: its entries (path|size|mtime) are never
    believed, the file is hashed again, and its old entry goes; other files' entries stay."""
    cache, weights = tmp_path / "sha256.json", tmp_path / "w.safetensors"
    weights.write_bytes(b"weights")
    stat = weights.stat()
    old_key = f"{weights.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    other = f"{tmp_path.resolve() / 'other.safetensors'}|7|1"
    cache.write_text(json.dumps({old_key: "f" * 64, other: "e" * 64}))
    assert file_sha256(weights, cache) == sha256(b"weights")
    entries = json.loads(cache.read_text())
    assert old_key not in entries and entries[other] == "e" * 64 and len(entries) == 2
    # the new entry is believed while the file is unchanged (a forged one comes back)
    cache.write_text(json.dumps({key: "d" * 64 for key in entries}))
    assert file_sha256(weights, cache) == "d" * 64
