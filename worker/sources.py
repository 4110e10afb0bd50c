"""Image jobs' sources read ahead: a job's init image (and an inpainting job's mask) is read,
checked against its digest, decoded and resized on threads of its own from the moment the
worker takes the job, so storage reads overlap the devices' work instead of stalling them
(`bench/host.py reads`).

A source is read once for every job that starts from it at the same size: a campaign that
renders each photo at three strengths reads each photo once.
"""

from __future__ import annotations

import collections
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from renderfarm.images import check_mask, init_pixels, load_init_image, mask_pixels
from renderfarm.jobs import JobError, JobSpec

READ_THREADS = 8  # reads wait on storage, not on the cores (PIL's decode and resize release the GIL)
KEPT = 512  # sources kept read (decoded at their size): a few batches' worth, bounded memory

Source = tuple[str, str | None, str | None, str | None, int, int]  # init_image, mask_image, their sha256s, size
Read = tuple[np.ndarray, np.ndarray | None]  # (3, H, W) pixels in [-1, 1], (1, H, W) mask (1 repaints) or None


class InitImages:
    """Image jobs' pixels, read ahead and kept for the jobs that share a source."""

    def __init__(self, threads: int = READ_THREADS, kept: int = KEPT) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="init-image")
        self._kept = kept
        self._futures: collections.OrderedDict[Source, Future[Read]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def fetch(self, spec: JobSpec, width: int, height: int) -> Future[Read]:
        """Start reading the job's source at its size (once per source and size)."""
        assert spec.init_image is not None
        source = (spec.init_image, spec.init_image_sha256, spec.mask_image, spec.mask_image_sha256, width, height)
        with self._lock:
            future = self._futures.get(source)
            if future is None or _transient(future):  # storage was away: read it again
                future = self._pool.submit(_read, spec, width, height)
                self._futures[source] = future
                while len(self._futures) > self._kept:
                    self._futures.popitem(last=False)
            self._futures.move_to_end(source)
            return future

    def pixels(self, spec: JobSpec, width: int, height: int) -> Read:
        """The job's pixels and mask, waiting for their read; raises its JobError."""
        return self.fetch(spec, width, height).result()

    def unreadable(self, specs: list[JobSpec], width: int, height: int) -> dict[int, BaseException]:
        """Which of `specs` (by position) have a source that could not be read, and why (a
        JobError: the source is not the job's image, for good; anything else: storage away);
        waits for the reads of the image jobs among them."""
        failed = {}
        for n, spec in enumerate(specs):
            if spec.init_image is not None and (error := self.fetch(spec, width, height).exception()) is not None:
                failed[n] = error
        return failed


def _transient(future: Future[Read]) -> bool:
    return future.done() and future.exception() is not None and not isinstance(future.exception(), JobError)


def _read(spec: JobSpec, width: int, height: int) -> Read:
    image, _ = load_init_image(spec)
    if spec.mask_image is None:
        return init_pixels(image, width, height), None
    mask, _ = check_mask(spec, image)  # its digest checked, and held to its image
    return init_pixels(image, width, height), mask_pixels(mask, width, height)
