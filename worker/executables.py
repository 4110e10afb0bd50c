"""Compiled executables saved per shape key, so a restarted worker starts warm.

JAX's persistent cache saves XLA's compile, but to find its entry a new process still
traces and lowers the whole pipeline, which is most of a warm start on the tiny model. A
saved executable skips all of that: it is loaded straight onto the devices. Its name is a
fingerprint of everything the program depends on (the model's architecture and scheduler
config, the shape key, the batch, the devices, the libraries and our own device-side
code), so a change of any of them is a miss, never a stale program. The weights are
inputs, not part of the program: the same architecture with other weights reuses it.

Like JAX's cache, the folder holds executable code (and the pytrees beside it are pickled):
whoever can write there can run code in the worker. So both folders are used only if they
belong to the worker's user and no one else may write to them (`private_folder`), and each
has a size cap, least recently used entries evicted first (`evict`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import pickle
import stat
from importlib import metadata
from pathlib import Path
from typing import Any

import jax
from jax.experimental import serialize_executable

from renderfarm.jobs import JobError

log = logging.getLogger(__name__)

LIBRARIES = ("jax", "jaxlib", "flax")
# What the traced function runs: the engine, and the model layer's loop, networks, schedulers,
# families and sharding (paths from the repository's root).
DEVICE_CODE = ("worker/engine.py", "diffusion/generate.py", "diffusion/family.py", "diffusion/sharding.py",
               "diffusion/nn/*.py", "diffusion/schedulers/*.py", "diffusion/families/*.py")


@functools.cache
def _environment() -> dict[str, dict[str, str]]:
    """What every program here depends on besides its own parts (read once per process)."""
    root = Path(__file__).parent.parent
    files = sorted(path for pattern in DEVICE_CODE for path in root.glob(pattern))
    return {"libraries": {name: metadata.version(name) for name in LIBRARIES},
            "code": {path.relative_to(root).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
                     for path in files}}


def fingerprint(**parts: Any) -> str:
    """A stable name for the program these parts define."""
    text = json.dumps({**parts, **_environment()}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:40]


def private_folder(folder: str | os.PathLike, field: str = "compile_cache") -> Path:
    """`folder`, created private if missing; refused unless it belongs to this user and
    neither group nor others may write to it (what is loaded from it runs as the worker)."""
    path = Path(folder).expanduser()
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if info.st_uid != os.geteuid():
        raise JobError(field, str(path), f"must belong to the worker's user (uid {os.geteuid()}), "
                                         f"not uid {info.st_uid}: code loaded from it runs in the worker")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise JobError(field, str(path), f"must not be writable by group or others (mode "
                                         f"{stat.S_IMODE(info.st_mode):o}; chmod go-w it): code loaded "
                                         f"from it runs in the worker")
    return path


class ExecutableStore:
    """One file per fingerprint: the serialized executable, its pytrees and what the engine
    keeps beside it (its FLOP count). At most `max_bytes` are kept; loading an entry marks
    it used, and saving one beyond the cap removes the least recently used."""

    def __init__(self, folder: str | os.PathLike, max_bytes: float = 10 * 2**30) -> None:
        self.folder = private_folder(folder)
        self.max_bytes = max_bytes
        self.loaded = 0  # executables this process loaded instead of compiling

    def _path(self, name: str) -> Path:
        return self.folder / f"{name}.xla"

    def load(self, name: str, devices: list[jax.Device]) -> tuple[Any, dict[str, Any]] | None:
        """The saved executable and its extras, or None (missing, or unreadable: then it is
        compiled again and saved over)."""
        path = self._path(name)
        if not path.is_file():
            return None
        try:
            payload, in_tree, out_tree, extras = pickle.loads(path.read_bytes())
            compiled = serialize_executable.deserialize_and_load(
                payload, in_tree, out_tree, backend=devices[0].client, execution_devices=devices)
        except Exception:  # noqa: BLE001 - a broken entry costs a compile, never a render
            log.warning("saved executable %s unreadable: removed, compiling again", path, exc_info=True)
            path.unlink(missing_ok=True)
            return None
        self.loaded += 1
        os.utime(path)  # used: the last to be evicted
        return compiled, extras

    def save(self, name: str, compiled: Any, extras: dict[str, Any]) -> None:
        """Atomically, so a concurrent reader never loads half an executable."""
        try:
            payload, in_tree, out_tree = serialize_executable.serialize(compiled)
        except (ValueError, NotImplementedError) as err:  # a backend that cannot serialize
            log.info("executable not saved: %s", err)
            return
        path = self._path(name)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_bytes(pickle.dumps((payload, in_tree, out_tree, extras)))
        os.replace(tmp, path)
        self._evict()

    def _evict(self) -> None:
        evict(self.folder, "*.xla", self.max_bytes, "saved executable")


def evict(folder: Path, pattern: str, max_bytes: float, what: str) -> None:
    """Remove the least recently used files of `folder` matching `pattern` until those left
    hold at most `max_bytes`: used last is the later of a file's access and modification
    times (a loaded executable is touched; the filesystem records a read of JAX's entries)."""
    entries = []
    for path in folder.glob(pattern):
        try:
            info = path.stat()
        except FileNotFoundError:  # removed by another process meanwhile
            continue
        entries.append((max(info.st_atime, info.st_mtime), info.st_size, path))
    kept = 0
    for _, size, path in sorted(entries, reverse=True):
        kept += size
        if kept > max_bytes:
            log.info("%s %s evicted (cache over %.1f GB)", what, path.name, max_bytes / 2**30)
            path.unlink(missing_ok=True)
