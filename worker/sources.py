"""Image jobs' sources read ahead: a job's init image (and an inpainting job's mask) is read,
checked against its digest, decoded and resized on threads of its own from the moment the
worker takes the job, so storage reads overlap the devices' work instead of stalling them
(`bench/host.py reads`).

A source is read once for every job that starts from it at the same size: a campaign that
renders each photo at three strengths reads each photo once. What may be read is
renderfarm.sources' (a farm worker's source roots, regular files and objects, a size cap).

Every wait for a read has a deadline (`seconds` from the read's start): a source that cannot be
had in time fails its job (SourceTimeout, which the worker retries as storage being away),
never the batch or the worker. Reads kept for later jobs are bounded by their bytes.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np

from renderfarm.images import check_mask, init_pixels, load_init_image, mask_pixels
from renderfarm.jobs import JobError, JobSpec
from renderfarm.sources import READ_SECONDS, SourceRoots

READ_THREADS = 8  # reads wait on storage, not on the cores (PIL's decode and resize release the GIL)
KEPT = 512  # sources kept read or being read, at most (a few batches' worth)
# ... and at most this many bytes of decoded pixels: a batch of 2048x2048 inpainting jobs holds
# 64 MiB a job, so two batches of 8 (the one rendering, the next read ahead) fit.
KEPT_BYTES = 2**30

Source = tuple[str, str | None, str | None, str | None, int, int]  # init_image, mask_image, their sha256s, size
Read = tuple[np.ndarray, np.ndarray | None]  # (3, H, W) pixels in [-1, 1], (1, H, W) mask (1 repaints) or None


class SourceTimeout(TimeoutError):
    """A source read that did not finish within its deadline (storage slow or stalled)."""

    def __init__(self, ref: str, seconds: float) -> None:
        super().__init__(f"init_image={ref!r}: not read within {seconds:g} s")


@dataclasses.dataclass
class _Entry:
    future: Future[Read]
    started: float  # monotonic


class InitImages:
    """Image jobs' pixels, read ahead and kept for the jobs that share a source. `roots`: a farm
    worker's source roots (None: read what the caller's user names, as `renderfarm render`)."""

    def __init__(self, roots: SourceRoots | None = None, seconds: float = READ_SECONDS, threads: int = READ_THREADS,
                 kept: int = KEPT, kept_bytes: int = KEPT_BYTES) -> None:
        self.roots, self.seconds = roots, seconds
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="init-image")
        self._kept, self._kept_bytes = kept, kept_bytes
        self._entries: collections.OrderedDict[Source, _Entry] = collections.OrderedDict()
        self._lock = threading.RLock()  # a read done already runs its callback (_evict) at once

    def fetch(self, spec: JobSpec, width: int, height: int) -> Future[Read]:
        """Start reading the job's source at its size (once per source and size; again if
        the last read failed for storage being away, or stalled past its deadline)."""
        return self._entry(spec, width, height, again=True).future

    def _entry(self, spec: JobSpec, width: int, height: int, again: bool = False) -> _Entry:
        assert spec.init_image is not None
        source = (spec.init_image, spec.init_image_sha256, spec.mask_image, spec.mask_image_sha256, width, height)
        with self._lock:
            entry = self._entries.get(source)
            started = entry is None or (again and _retry(entry, self.seconds))
            if started:
                entry = _Entry(self._pool.submit(self._read, spec, width, height), time.monotonic())
                self._entries[source] = entry
            self._entries.move_to_end(source)
            if started:
                self._evict()
                entry.future.add_done_callback(lambda _: self._evict())  # its bytes are known then
            return entry

    def _evict(self) -> None:
        """Drop the least recently fetched reads past the count, then past the bytes (the one
        fetched last is never dropped: its job waits for it). Run as a read starts and as one
        ends, the two moments the count or the bytes grow."""
        with self._lock:
            while len(self._entries) > self._kept:
                self._entries.popitem(last=False)
            held = sum(_bytes(entry) for entry in self._entries.values())
            while held > self._kept_bytes and len(self._entries) > 1:
                held -= _bytes(self._entries.popitem(last=False)[1])

    def ready(self, specs: list[JobSpec], width: int, height: int) -> bool:
        """Whether the reads of the image jobs among `specs` are over (done, or past their
        deadline): `unreadable` then answers without waiting."""
        now = time.monotonic()
        return all(entry.future.done() or now >= entry.started + self.seconds
                   for entry in (self._entry(spec, width, height) for spec in specs if spec.init_image is not None))

    def pixels(self, spec: JobSpec, width: int, height: int) -> Read:
        """The job's pixels and mask, waiting for their read until its deadline; raises its
        JobError, or SourceTimeout."""
        entry = self._entry(spec, width, height)
        error = self._wait(entry, spec)
        if error is not None:
            raise error
        return entry.future.result()

    def unreadable(self, specs: list[JobSpec], width: int, height: int) -> dict[int, BaseException]:
        """Which of `specs` (by position) have a source that could not be read, and why (a
        JobError: the source is not the job's image, for good; SourceTimeout: not read in
        time; anything else as the read raised it, for the worker to classify); waits for the
        reads of the image jobs among them, each until its deadline."""
        failed = {}
        for n, spec in enumerate(specs):
            if spec.init_image is not None and (error := self._wait(self._entry(spec, width, height), spec)) is not None:
                failed[n] = error
        return failed

    def _wait(self, entry: _Entry, spec: JobSpec) -> BaseException | None:
        try:
            return entry.future.exception(timeout=max(0.0, entry.started + self.seconds - time.monotonic()))
        except FutureTimeout:
            return SourceTimeout(spec.init_image, self.seconds)

    def _read(self, spec: JobSpec, width: int, height: int) -> Read:
        image, _ = load_init_image(spec, self.roots)
        if spec.mask_image is None:
            return init_pixels(image, width, height), None
        mask, _ = check_mask(spec, image, self.roots)  # its digest checked, and held to its image
        return init_pixels(image, width, height), mask_pixels(mask, width, height)


def _retry(entry: _Entry, seconds: float) -> bool:
    """Whether a kept read is to be started again: it failed, and not because the source is
    not the job's (that is for good), or it ran past its deadline."""
    future = entry.future
    if not future.done():
        return time.monotonic() > entry.started + seconds
    return future.exception() is not None and not isinstance(future.exception(), JobError)


def _bytes(entry: _Entry) -> int:
    """The bytes a kept read holds (0 until it is done, or if it failed)."""
    future = entry.future
    if not future.done() or future.exception() is not None:
        return 0
    pixels, mask = future.result()
    return pixels.nbytes + (0 if mask is None else mask.nbytes)
