"""What a storage backend is: names relative to a root, and the rule every name keeps."""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator

from renderfarm.retry import RetryPolicy


def check_name(name: str, *, prefix: bool = False) -> str:
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



class ObjectTooLarge(ValueError):
    """An object over the size a reader allows (`GCSStorage.get(name, max_bytes=...)`)."""

    def __init__(self, url: str, size: int | None, max_bytes: int) -> None:
        super().__init__(f"{url} is {'over ' + str(max_bytes) if size is None else size} bytes, "
                         f"over the {max_bytes} allowed")
        self.size, self.max_bytes = size, max_bytes


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
    def replace_unless(self, name: str, data: bytes, content_type: str, keep: Callable[[bytes], bool],
                       sync: bool = True) -> bool:
        """Store ``data`` under ``name`` unless ``keep(what is there)`` says to keep it; False
        if kept. Atomic against other calls of it on the same name (a write between the look
        and the store makes it look again), so writers that each keep what is newer than theirs
        never replace a newer file with an older one, whatever order their requests land in."""

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


