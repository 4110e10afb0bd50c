"""Storage rooted at a local folder: atomic writes (temp file, rename), fsynced when the
caller acknowledges a queue after storing.

No link below the root is followed: a symlinked folder would send writes wherever it points,
and a link planted at a temporary file's name would have a write overwrite its target. So
every operation walks the name's folders from a descriptor of the root, opening each without
following a link (and making it there when a write needs it), and creates, renames, reads
and locks relative to the last folder's descriptor: a folder swapped for a link between a
look and a use cannot redirect anything. The root itself (the user's choice) is resolved
once, when the storage is made.
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

from renderfarm.retry import DEFAULT_RETRY, RetryPolicy, with_retries
from renderfarm.storage.base import Storage, check_name

_TMP_PREFIX = ".rf-tmp-"
_TMP_TRIES = 8  # fresh random names to try when one is taken (only a planted file takes one)
_FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NO_LINKS = "a campaign's folders must be real folders, and its files regular files, not symlinks"


def _refused(path: Path) -> ValueError:
    return ValueError(f"{path} is a symlink: {_NO_LINKS}")


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

    def path(self, name: str) -> Path:
        """The file of ``name``, for a caller that opens it itself; refused (ValueError) if a
        folder on the way is a symlink now."""
        check_name(name)
        folder = self.root
        for part in name.split("/")[:-1]:
            folder = folder / part
            if folder.is_symlink():
                raise _refused(folder)
        return self.root / name

    def _open_folder(self, parts: list[str], create: bool) -> int:
        """A descriptor of the folder ``root/parts``, each part opened without following a
        link (a link is refused) and, with ``create``, made when missing."""
        fd = os.open(self.root, _FOLDER & ~os.O_NOFOLLOW)  # the root was resolved when made
        path = self.root
        try:
            for part in parts:
                path = path / part
                try:
                    child = os.open(part, _FOLDER, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    try:
                        os.mkdir(part, dir_fd=fd)
                    except FileExistsError:
                        pass  # another writer made it meanwhile
                    child = os.open(part, _FOLDER, dir_fd=fd)
                except NotADirectoryError:  # O_NOFOLLOW | O_DIRECTORY on a link says this too
                    if stat.S_ISLNK(os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode):
                        raise _refused(path) from None
                    raise
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _folder_of(self, name: str, create: bool) -> tuple[int, str]:
        """The descriptor of ``name``'s folder (see _open_folder) and the file's name in it."""
        *parts, base = check_name(name).split("/")
        return self._open_folder(parts, create), base

    def open_file(self, name: str, flags: int, mode: int = 0o644) -> int:
        """A descriptor of the regular file ``name``, for a caller that reads or appends to it
        itself (renderfarm.manifest): opened relative to its folder's descriptor, a link at the
        name or on the way refused (never followed), a FIFO or device refused without waiting
        on it, the folders made when ``flags`` has O_CREAT."""
        path = self.root / name
        folder, base = self._folder_of(name, create=bool(flags & os.O_CREAT))
        try:
            fd = os.open(base, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode, dir_fd=folder)
        except OSError as err:
            if err.errno == errno.ELOOP:
                raise _refused(path) from None
            raise
        finally:
            os.close(folder)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise ValueError(f"{path} is not a regular file: {_NO_LINKS}")
        os.set_blocking(fd, True)
        return fd

    def _read(self, folder: int, base: str, path: Path) -> bytes:
        """The bytes of the regular file ``base`` in ``folder``; a link there is refused, never
        followed, and a FIFO or device is refused without waiting on it."""
        try:
            fd = os.open(base, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder)
        except OSError as err:
            if err.errno == errno.ELOOP:
                raise _refused(path) from None
            raise
        with open(fd, "rb") as file:
            mode = os.fstat(fd).st_mode
            if stat.S_ISDIR(mode):
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
            if not stat.S_ISREG(mode):
                raise ValueError(f"{path} is not a regular file: {_NO_LINKS}")
            return file.read()

    def _write(self, folder: int, base: str, data: bytes, durable: bool) -> None:
        """``data`` into ``base`` in ``folder`` through a temporary file of an unpredictable
        name, created only where nothing is (O_EXCL, O_NOFOLLOW), then renamed over it."""
        for _ in range(_TMP_TRIES):
            tmp = f"{_TMP_PREFIX}{base}.{secrets.token_hex(8)}"
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                             dir_fd=folder)
                break
            except FileExistsError:
                continue
        else:
            raise FileExistsError(errno.EEXIST, f"{_TMP_TRIES} random temporary names were all taken",
                                  f"{_TMP_PREFIX}{base}.*")
        try:
            try:
                _write_all(fd, data)
                if durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, base, src_dir_fd=folder, dst_dir_fd=folder)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=folder)
            except OSError:
                pass
            raise
        if durable:
            try:
                os.fsync(folder)  # persists the rename (best effort: some filesystems refuse)
            except OSError:
                pass

    def put(self, name: str, data: bytes, content_type: str = "application/octet-stream",
            sync: bool = True) -> None:
        """Atomic write via temp file + rename in the same folder, so readers never see a partial file."""
        data = bytes(data)
        durable = self.durable and sync

        def op() -> None:
            folder, base = self._folder_of(name, create=True)
            try:
                self._write(folder, base, data, durable)
            finally:
                os.close(folder)

        with_retries(op, self.retry, f"put {self.root / name}", local=True)

    def replace_unless(self, name: str, data: bytes, content_type: str, keep: Callable[[bytes], bool],
                       sync: bool = True) -> bool:
        """The look and the store under an exclusive lock of the file's folder (flock), which
        every writer of the host that replaces through this method takes."""
        data = bytes(data)

        def op() -> bool:
            folder, base = self._folder_of(name, create=True)
            try:
                fcntl.flock(folder, fcntl.LOCK_EX)  # released when the descriptor closes
                try:
                    stored: bytes | None = self._read(folder, base, self.root / name)
                except FileNotFoundError:
                    stored = None
                if stored is not None and keep(stored):
                    return False
                self._write(folder, base, data, self.durable and sync)
                return True
            finally:
                os.close(folder)

        return with_retries(op, self.retry, f"replace {self.root / name}", local=True)

    def get(self, name: str) -> bytes:
        def op() -> bytes:
            folder, base = self._folder_of(name, create=False)
            try:
                return self._read(folder, base, self.root / name)
            finally:
                os.close(folder)

        return with_retries(op, self.retry, f"get {self.root / name}", local=True)

    def exists(self, name: str) -> bool:
        """True for a regular file (a link at the name is no stored file)."""
        def op() -> bool:
            try:
                folder, base = self._folder_of(name, create=False)
            except (FileNotFoundError, NotADirectoryError):
                return False
            try:
                return stat.S_ISREG(os.stat(base, dir_fd=folder, follow_symlinks=False).st_mode)
            except (FileNotFoundError, NotADirectoryError):
                return False
            finally:
                os.close(folder)

        return with_retries(op, self.retry, f"exists {self.root / name}", local=True)

    def list(self, prefix: str = "") -> Iterator[str]:
        """String-prefix semantics like GCS (``"c/ab"`` matches ``c/abc.png``); temp files are
        skipped, and links are neither followed nor listed."""
        check_name(prefix, prefix=True)

        def op() -> list[str]:
            found = []
            pending = [prefix.split("/")[:-1]]  # folders to read, as parts below the root
            while pending:
                parts = pending.pop()
                try:
                    folder = self._open_folder(parts, create=False)
                except (FileNotFoundError, NotADirectoryError):
                    continue  # never there, or removed since it was seen
                try:
                    with os.scandir(folder) as entries:
                        for entry in entries:
                            rel = "/".join([*parts, entry.name])
                            if entry.is_dir(follow_symlinks=False):
                                if rel.startswith(prefix) or prefix.startswith(rel + "/"):
                                    pending.append([*parts, entry.name])
                            elif (entry.is_file(follow_symlinks=False) and not entry.name.startswith(_TMP_PREFIX)
                                  and rel.startswith(prefix)):
                                found.append(rel)
                finally:
                    os.close(folder)
            return sorted(found)

        return iter(with_retries(op, self.retry, f"list {self.root}/{prefix}", local=True))

    def url(self, name: str) -> str:
        return str(self.path(name))

    def describe(self) -> str:
        return self.root.as_uri()
