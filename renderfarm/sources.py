"""What an image job may name as its source (`init_image`, `mask_image`), and how the bytes are
read: only regular files and storage objects, at most MAX_SOURCE_BYTES of them, and on a farm
worker only under the source roots it was started with (`renderfarm worker --source-root`).

A job must not be able to make a worker read a device, a pipe or /proc (a read that never ends
freezes or kills it), nor copy a file of the worker's disk or an object of a bucket the
producer cannot read into a campaign's output (a strength near 0 renders the source back).
So a worker reads a path only once it has resolved it (symlinks followed) to a regular file
under one of its folders, opened without following a link swapped in meanwhile, and an object
only in its buckets; and it refuses a source outside its roots in the same words as a missing
one, so a refusal never tells whether a path exists. A worker without roots takes no image
jobs, and a queued job must carry its source's sha256 (the producer computes it at submit).

The producer and `renderfarm render` read what their own user names (no roots), with the same
rules for regular files and size.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import os
import stat
from collections.abc import Sequence
from urllib.parse import unquote

from renderfarm.jobs import JobError, JobSpec
from renderfarm.storage.base import ObjectTooLarge, check_name
from renderfarm.storage.gcs import BUCKET_RE, GCSStorage

# A source's bytes are read whole into memory before PIL decodes them (renderfarm.images bounds
# the decode's pixels): 64 MiB holds an 8192x8192 JPEG or a 4096x4096 PNG of a photograph.
MAX_SOURCE_BYTES = 64 * 2**20
READ_CHUNK = 1 << 20
READ_SECONDS = 60.0  # a farm worker's read of a source not done this long after it started fails its job
# What opening a path can fail with that says only that it is not a source the worker may read.
_NOT_READABLE = {errno.ENOENT, errno.ENOTDIR, errno.EACCES, errno.EPERM, errno.ELOOP, errno.EISDIR,
                 errno.ENXIO, errno.ENODEV, errno.ENAMETOOLONG}
# Where the kernel says which file an open descriptor is (Linux): checked after the open, so a
# component swapped for a link between the resolve and the open cannot lead outside the roots.
_FD_LINKS = "/proc/self/fd"


@dataclasses.dataclass(frozen=True)
class SourceRoots:
    """The folders and buckets a farm worker may read image jobs' sources from."""

    folders: tuple[str, ...] = ()  # real paths (symlinks resolved), each a folder
    buckets: tuple[tuple[str, str], ...] = ()  # (bucket, prefix: '' or ending in '/')

    @classmethod
    def parse(cls, refs: Sequence[str]) -> SourceRoots:
        """`--source-root` values: local folders (which must exist) and `gs://bucket[/prefix]`."""
        folders, buckets = [], []
        for ref in refs:
            if ref.startswith("gs://"):
                bucket, _, prefix = ref.removeprefix("gs://").partition("/")
                prefix = prefix.strip("/")
                try:
                    if prefix:
                        check_name(prefix)
                except ValueError:
                    bucket = ""
                if not BUCKET_RE.fullmatch(bucket):
                    raise JobError("source-root", ref, "must be a folder or gs://bucket[/prefix] (a valid bucket "
                                                       "name, a prefix without empty, '.' or '..' parts)")
                buckets.append((bucket, f"{prefix}/" if prefix else ""))
            elif "://" in ref and not ref.startswith("file://"):
                raise JobError("source-root", ref, "must be a local folder, file:// or gs://bucket[/prefix]")
            else:
                folder = os.path.realpath(os.path.expanduser(unquote(ref.removeprefix("file://"))))
                if not os.path.isdir(folder):
                    raise JobError("source-root", ref, "must be an existing folder")
                folders.append(folder)
        return cls(tuple(dict.fromkeys(folders)), tuple(dict.fromkeys(buckets)))

    def __bool__(self) -> bool:
        return bool(self.folders or self.buckets)

    def __str__(self) -> str:
        return ", ".join([*self.folders, *(f"gs://{bucket}/{prefix}" for bucket, prefix in self.buckets)])

    def allows_path(self, real: str) -> bool:
        """Whether a resolved path lies in one of the folders."""
        return any(real == folder or real.startswith(folder.rstrip(os.sep) + os.sep) for folder in self.folders)

    def allows_object(self, bucket: str, name: str) -> bool:
        return any(bucket == b and name.startswith(prefix) for b, prefix in self.buckets)

    @property
    def rule(self) -> str:
        """The one refusal for a source outside the roots, missing, or not a regular file."""
        return f"must be a regular file or object under this worker's source roots ({self}) that it can read"


def check_queued(spec: JobSpec, roots: SourceRoots | None) -> None:
    """A farm worker's rules for a queued image job, before anything is read: it serves image
    jobs only with source roots, and each source must carry its sha256 (the producer's)."""
    if spec.init_image is None:
        return
    if not roots:
        raise JobError("init_image", spec.init_image, "this worker takes no image jobs: it reads sources only "
                                                      "under its --source-root folders and buckets, and has none")
    for field in ("init_image", "mask_image"):
        if getattr(spec, field) is not None and getattr(spec, f"{field}_sha256") is None:
            raise JobError(f"{field}_sha256", None, f"is required on a queued job with a {field} "
                                                    "(renderfarm submit fills it from the bytes it read)")


def read_source(ref: str, field: str, roots: SourceRoots | None = None, max_bytes: int = MAX_SOURCE_BYTES) -> bytes:
    """The bytes of `ref`, a local path, `file://` or `gs://` URL: a regular file or an object of
    at most `max_bytes`, under `roots` when given. Raises JobError for a source that is not one
    (in the same words whether it is missing or not allowed, given roots); other errors (a
    failing disk, storage away or forbidding the read) as they come, for the caller to classify."""
    if ref.startswith("gs://"):
        bucket, _, name = ref.removeprefix("gs://").partition("/")
        return _read_object(ref, field, bucket, name, roots, max_bytes)
    if "://" in ref and not ref.startswith("file://"):
        raise JobError(field, ref, "must be a local path, a file:// or a gs:// URL")
    return _read_file(ref, field, os.path.expanduser(unquote(ref.removeprefix("file://"))), roots, max_bytes)


def _refused(ref: str, field: str, roots: SourceRoots | None, why: str) -> JobError:
    return JobError(field, ref, roots.rule if roots is not None else f"must be a readable regular file or object ({why})")


def _too_large(ref: str, field: str, size: int | None, max_bytes: int) -> JobError:
    said = f"{size} bytes" if size is not None else f"over {max_bytes} bytes"
    return JobError(field, ref, f"is {said}: a source may be at most {max_bytes} bytes")


def _read_file(ref: str, field: str, path: str, roots: SourceRoots | None, max_bytes: int) -> bytes:
    real = os.path.realpath(path)
    if roots is not None and not roots.allows_path(real):
        raise _refused(ref, field, roots, "outside the source roots")
    try:
        # Non-blocking: a FIFO opens at once (and is then refused) instead of waiting for a writer.
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:
        if err.errno in _NOT_READABLE:
            raise _refused(ref, field, roots, type(err).__name__ if err.errno == errno.ENOENT else err.strerror) \
                from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _refused(ref, field, roots, "not a regular file")
        if roots is not None and os.path.isdir(_FD_LINKS) and not roots.allows_path(os.readlink(f"{_FD_LINKS}/{fd}")):
            raise _refused(ref, field, roots, "outside the source roots")
        if info.st_size > max_bytes:
            raise _too_large(ref, field, info.st_size, max_bytes)
        chunks, read = [], 0
        while read <= max_bytes and (chunk := os.read(fd, min(READ_CHUNK, max_bytes + 1 - read))):
            chunks.append(chunk)
            read += len(chunk)
        if read > max_bytes:  # a file that grew, or one whose size the kernel does not know (/proc)
            raise _too_large(ref, field, None, max_bytes)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _read_object(ref: str, field: str, bucket: str, name: str, roots: SourceRoots | None, max_bytes: int) -> bytes:
    try:
        check_name(name)
        if not BUCKET_RE.fullmatch(bucket):
            raise ValueError(f"invalid bucket {bucket!r}")
    except ValueError as err:
        raise JobError(field, ref, f"must be gs://BUCKET/OBJECT ({err})") from None
    if roots is not None and not roots.allows_object(bucket, name):
        raise _refused(ref, field, roots, "outside the source roots")
    try:
        return _bucket(bucket).get(name, max_bytes=max_bytes)
    except FileNotFoundError:
        raise _refused(ref, field, roots, "FileNotFoundError") from None
    except ObjectTooLarge as err:
        raise _too_large(ref, field, err.size, max_bytes) from None


@functools.lru_cache(maxsize=64)
def _bucket(bucket: str) -> GCSStorage:
    """One client per bucket a process reads sources from (building one per read costs more
    than a small read)."""
    return GCSStorage(bucket)
