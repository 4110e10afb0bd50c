"""Storage rooted at a local folder: atomic writes (temp file, rename), fsynced when the
caller acknowledges a queue after storing."""

from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from renderfarm.retry import DEFAULT_RETRY, RetryPolicy, with_retries
from renderfarm.storage.base import Storage, check_name

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
        check_name(name)
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

        with_retries(op, self.retry, f"put {path}", local=True)

    def replace_unless(self, name: str, data: bytes, content_type: str, keep: Callable[[bytes], bool],
                       sync: bool = True) -> bool:
        """The look and the store under an exclusive lock of the file's folder (flock), which
        every writer of the host that replaces through this method takes."""
        path = self.path(name)

        def op() -> bool:
            path.parent.mkdir(parents=True, exist_ok=True)
            folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
            try:
                fcntl.flock(folder, fcntl.LOCK_EX)  # released when the descriptor closes
                try:
                    stored: bytes | None = path.read_bytes()
                except FileNotFoundError:
                    stored = None
                if stored is not None and keep(stored):
                    return False
                self.put(name, data, content_type, sync=sync)
                return True
            finally:
                os.close(folder)

        return with_retries(op, self.retry, f"replace {path}", local=True)

    def get(self, name: str) -> bytes:
        path = self.path(name)
        return with_retries(path.read_bytes, self.retry, f"get {path}", local=True)

    def exists(self, name: str) -> bool:
        path = self.path(name)
        return with_retries(path.is_file, self.retry, f"exists {path}", local=True)

    def list(self, prefix: str = "") -> Iterator[str]:
        """String-prefix semantics like GCS (``"c/ab"`` matches ``c/abc.png``); temp files are skipped."""
        check_name(prefix, prefix=True)

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

        return iter(with_retries(op, self.retry, f"list {self.root}/{prefix}", local=True))

    def url(self, name: str) -> str:
        return str(self.path(name))

    def describe(self) -> str:
        return self.root.as_uri()


