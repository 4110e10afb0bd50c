"""Compiled executables saved per shape key, so a restarted worker starts warm.

JAX's persistent cache saves XLA's compile, but to find its entry a new process still
traces and lowers the whole pipeline, which is most of a warm start on the tiny model. A
saved executable skips all of that: it is loaded straight onto the devices. Its name is a
fingerprint of everything the program depends on (the model's architecture and scheduler
config, the shape key, the batch, the devices, the libraries and our own device-side
code), so a change of any of them is a miss, never a stale program. The weights are
inputs, not part of the program: the same architecture with other weights reuses it.

Like JAX's cache, the folder holds executable code: it must be writable by the worker alone.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import pickle
from importlib import metadata
from pathlib import Path
from typing import Any

import jax
from jax.experimental import serialize_executable

log = logging.getLogger(__name__)

LIBRARIES = ("jax", "jaxlib", "flax", "diffusers", "transformers")
DEVICE_CODE = ("generate.py", "schedulers.py", "engine.py")  # what the traced function runs


@functools.cache
def _environment() -> dict[str, dict[str, str]]:
    """What every program here depends on besides its own parts (read once per process)."""
    here = Path(__file__).parent
    return {"libraries": {name: metadata.version(name) for name in LIBRARIES},
            "code": {name: hashlib.sha256((here / name).read_bytes()).hexdigest() for name in DEVICE_CODE}}


def fingerprint(**parts: Any) -> str:
    """A stable name for the program these parts define."""
    text = json.dumps({**parts, **_environment()}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:40]


class ExecutableStore:
    """One file per fingerprint: the serialized executable, its pytrees and what the engine
    keeps beside it (its FLOP count)."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
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
