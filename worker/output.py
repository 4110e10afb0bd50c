"""Finished jobs into stored results: PNG, sidecar JSON and manifest lines (the storage layout).

The PNG carries only what defines its pixels, so a job rendered twice gives the same bytes;
where, when and how fast it was rendered goes in the sidecar.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import hashlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from importlib import metadata
from typing import Any

import jax
import numpy as np
from PIL import Image

from diffusion.models import LoadedModel
from diffusion.scores import phash
from renderfarm.gallery import store_thumbnail
from renderfarm.jobs import JobError
from renderfarm.layout import image_name, sidecar_name, write_check_name
from renderfarm.manifest import open_manifest
from renderfarm.storage import Storage, open_storage
from worker.engine import Rendered
from worker.png import encode_png

LIBRARIES = ("renderfarm", "jax", "jaxlib", "flax", "tokenizers")
Stored = tuple[Rendered, "tuple[dict[str, Any], str] | Exception"]  # a sidecar and its line, or why not


@functools.cache
def library_versions() -> dict[str, str]:
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "unknown"
    return versions


def result_png(result: Rendered) -> bytes:
    """Deterministic PNG: same job, same pixels, same bytes; its text holds the job spec."""
    spec = json.dumps({"job_id": result.spec.job_id, **result.spec.to_dict()})  # ASCII: tEXt-safe
    return encode_png(result.image, {"renderfarm": spec}, result.scanlines)


def sidecar(result: Rendered, model: LoadedModel, png: bytes, devices: list[jax.Device],
            manifest_part: str) -> dict[str, Any]:
    """Everything needed to reproduce and audit one image, and where its manifest line goes
    (so a job that comes back after it was stored finds out whether that line was written)."""
    key = result.key
    return {
        "job_id": result.spec.job_id,
        "spec": result.spec.to_dict(),
        "width": key.width,
        "height": key.height,
        "scheduler": key.scheduler,
        "guidance_scale": model.guidance_scale(result.spec.guidance_scale),  # the job's, or its family's default
        "classifier_free_guidance": key.guided,
        "truncated": result.truncated,
        "model": {"ref": model.ref, "revision": model.revision, "variant": model.variant,
                  "family": model.family.name, "base": model.base,
                  "loras": [list(lora) for lora in model.loras or ()],
                  "weights": list(model.weights)},  # every file the weights came from, with its sha256
        "dtype": model.dtype,
        "png_sha256": hashlib.sha256(png).hexdigest(),
        "worker": {"host": socket.gethostname(), "pid": os.getpid(), "device_kind": devices[0].device_kind,
                   "device_count": len(devices)},
        "batch": {"seq": result.batch.seq, "jobs": result.batch.jobs, "slots": result.batch.slots},
        # its share of the devices' time its batch took: what the image cost
        "device_seconds": round(result.batch.device_seconds_per_job, 6),
        "timings": {"batch_seconds": round(result.batch.seconds, 4)},
        "versions": library_versions(),
        "manifest_part": manifest_part,
        **_scores(result),
    }


def _scores(result: Rendered) -> dict[str, Any]:
    """The sidecar's `scores` (renderfarm/scores.py), the device's and the host's perceptual
    hash, and `scores_missing`, when the job asked for any; a gated job's `gate`: whether the
    kept image passed, which attempt it is and its seed (what reproduces it), every attempt."""
    if not result.spec.scores:
        return {}
    scores = dict(result.scores)
    if "phash" in result.spec.scores:
        scores["phash"] = f"{phash(result.image):016x}"
    gate = {"gate": {"expression": result.spec.gate, "passed": result.attempts[result.kept]["passed"],
                     "kept": result.kept, "seed": result.attempts[result.kept]["seed"],
                     "attempts": [{k: v for k, v in a.items() if k != "failed"} for a in result.attempts]}} \
        if result.attempts else {}
    return {"scores": scores, **({"scores_missing": result.unscored} if result.unscored else {}), **gate}


def store_result(storage: Storage, result: Rendered, model: LoadedModel, devices: list[jax.Device],
                 manifest_part: str) -> tuple[dict[str, Any], str]:
    """Store one job's PNG and gallery thumbnail, then its sidecar (so a sidecar always
    has its image, unless it says `dropped`: the job's `on_nsfw: drop` and a flagged image);
    returns the sidecar and its JSON text, which is its manifest line."""
    flagged = result.scores.get("nsfw") is True and result.spec.on_nsfw
    if flagged == "black":  # as diffusers' pipelines black out what their checker flags
        result = dataclasses.replace(result, image=np.zeros_like(result.image), scanlines=None)
    png = result_png(result)
    record = sidecar(result, model, png, devices, manifest_part)
    campaign, job_id = result.spec.campaign, result.spec.job_id
    if flagged == "drop":  # the sidecar alone: the job is done, and a run again does not redo it
        record.update(png_sha256=None, dropped="nsfw")
    else:
        storage.put(image_name(campaign, job_id), png, "image/png")
        store_thumbnail(storage, campaign, job_id, Image.fromarray(result.image))
    if flagged:
        record["on_nsfw"] = flagged
    line = json.dumps(record)
    storage.put(sidecar_name(campaign, job_id), line.encode(), "application/json")
    return record, line


def check_writable(out: str) -> None:
    """Refuse to start a worker that cannot write its output: it writes a small file there and
    reads it back (layout.write_check_name), so a missing bucket, a revoked write or a
    read-only folder is refused at start-up, before minutes of loading and compiling, not found
    job by job. Another worker of the host may write the file in between: its record will do."""
    name = write_check_name(socket.gethostname())
    body = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "at": time.time()}).encode()
    try:
        storage = open_storage(out)
        storage.put(name, body, "application/json")
        if "host" not in json.loads(storage.get(name)):
            raise OSError(f"{storage.url(name)} read back is not what a worker writes there")
    except Exception as err:  # noqa: BLE001 - whatever the backend raises, the worker cannot start
        raise JobError("out", out, f"must be storage this worker can write and read back "
                                   f"({type(err).__name__}: {err})") from None


def default_store_threads() -> int:
    """One store thread per core up to 8: on an accelerator host the cores are free for
    deflating and uploading (about 6 ms of one core per 512x512 image, and a v6e-8 host
    renders SD 1.5 at up to about 90 images/s); on a CPU-only host the cores are the
    devices, and 2 suffice."""
    return max(2, min(8, os.cpu_count() or 2))


OnStored = Callable[[list[dict[str, Any]]], None]
OnFailed = Callable[[Rendered, Exception], None]


@dataclasses.dataclass
class _Storing:
    """A submission on the store threads: its manifest part per campaign, its futures, and
    whom to tell how it went."""

    parts: dict[str, str]
    futures: list[Future[list[Stored]]]
    on_stored: OnStored
    on_failed: OnFailed | None


class ResultWriter:
    """Encodes and stores rendered results on a thread pool while the devices render the
    next ones (PNG encoding and uploads release the GIL). Each `submit` hands it the results
    of one batch (`renderfarm render`) or of one bundle (the farm worker: worker.bundles). At
    most `max_pending` submissions wait, so memory stays bounded; `submit` blocks beyond that.
    Per submission, in submission order, once all of its jobs are through: manifest lines
    for the stored ones, then `on_stored(records)`, then `on_failed(result, error)` for each
    job that could not be stored or whose manifest line could not be written (by default the
    error is raised): the writer's, or the ones `submit` was given with it. Every job
    submitted reaches exactly one of the two, unless its submission is abandoned."""

    def __init__(self, storage: Storage, model: LoadedModel, devices: list[jax.Device],
                 threads: int | None = None, max_pending: int = 2,
                 on_stored: OnStored = lambda records: None, on_failed: OnFailed | None = None) -> None:
        threads = default_store_threads() if threads is None else threads
        if threads < 1:
            raise JobError("store_threads", threads, "must be at least 1")
        self.storage, self.model, self.devices, self.threads = storage, model, devices, threads
        self.max_pending, self.on_stored, self.on_failed = max_pending, on_stored, on_failed
        self.manifest = open_manifest(storage)
        self.stopping = threading.Event()  # set: `submit` no longer waits for old submissions
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="store")
        self._pending: collections.deque[_Storing] = collections.deque()

    def submit(self, results: list[Rendered], on_stored: OnStored | None = None,
               on_failed: OnFailed | None = None) -> None:
        """Store `results` on the store threads; `on_stored` and `on_failed`, if given, are
        told how it went instead of the writer's (the worker's bundle that owns those jobs)."""
        parts = {campaign: self.manifest.new_part(campaign) for campaign in {r.spec.campaign for r in results}}
        # One task per thread, not per job: a future costs the consumer's thread more than
        # a small image costs to store.
        chunks = [results[i::self.threads] for i in range(min(self.threads, len(results)))]
        futures = [self._pool.submit(self._store, chunk, parts) for chunk in chunks]
        self._pending.append(_Storing(parts, futures, on_stored or self.on_stored, on_failed or self.on_failed))
        while len(self._pending) > self.max_pending and not self.stopping.is_set():
            self._finish_oldest(wait=0.1)  # in slices, so a worker told to stop stops waiting
        self.poll()

    def _store(self, chunk: list[Rendered], parts: dict[str, str]) -> list[Stored]:
        done: list[Stored] = []
        for result in chunk:
            try:
                done.append((result, store_result(self.storage, result, self.model, self.devices,
                                                  parts[result.spec.campaign])))
            except Exception as err:  # noqa: BLE001 - handed to on_failed, raised by default
                done.append((result, err))
        return done

    def poll(self) -> None:
        """Finish the submissions, oldest first, that are stored already; never blocks on one."""
        while self._pending and all(f.done() for f in self._pending[0].futures):
            self._finish_oldest()

    def finish(self, until: float) -> None:
        """Finish the submissions, oldest first, that are stored before `until` (monotonic)."""
        while self._pending and self._finish_oldest(wait=max(0.0, until - time.monotonic())):
            pass

    def abandon(self) -> None:
        """Give up the submissions not finished yet (their jobs are to be tried again elsewhere):
        neither callback hears of them. A store already running completes; its job is not
        reported as stored."""
        for storing in self._pending:
            for future in storing.futures:
                future.cancel()
        self._pending.clear()

    def _finish_oldest(self, wait: float | None = None) -> bool:
        """Finish the oldest submission once it is stored (waiting at most `wait` seconds, if
        given); False if it was not stored in time."""
        oldest = self._pending[0]
        parts, futures = oldest.parts, oldest.futures
        if wait is not None and concurrent.futures.wait(futures, timeout=wait).not_done:
            return False
        self._pending.popleft()
        done = sorted((pair for future in futures for pair in future.result()),
                      key=lambda pair: pair[0].index)  # submission order
        stored = [(result, outcome) for result, outcome in done if not isinstance(outcome, Exception)]
        failures = [(result, outcome) for result, outcome in done if isinstance(outcome, Exception)]
        by_campaign: dict[str, list[tuple[str, str]]] = {}
        for result, (_, line) in stored:
            by_campaign.setdefault(result.spec.campaign, []).append((result.spec.job_id, line))
        try:
            for campaign, entries in by_campaign.items():
                self.manifest.append(campaign, parts[campaign], entries)
        except Exception as err:  # noqa: BLE001 - their files stay; the jobs come back and find them
            failures += [(result, err) for result, _ in stored]
            stored = []
        oldest.on_stored([record for _, (record, _) in stored])
        for result, err in failures:
            if oldest.on_failed is None:
                raise err
            oldest.on_failed(result, err)
        return True

    def flush(self) -> None:
        """Wait for every submission to be stored."""
        while self._pending:
            self._finish_oldest()

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> ResultWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
