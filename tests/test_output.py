"""The ResultWriter's promise: storing overlaps rendering, but never runs more than
`max_pending` batches behind, so a slow store holds back the renderer instead of filling
memory with finished images."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

from harness.farm import STEPS
from renderfarm.jobs import JobError, parse_job
from renderfarm.storage import open_storage
from worker.engine import Batch, Rendered, ShapeKey
from worker.output import ResultWriter

SIZE = 512  # noise this big takes about 15 ms to encode: storing is the slow side


def noise_batch(model: Any, n: int, seq: int) -> list[Rendered]:
    rng = np.random.default_rng(seq)
    key = ShapeKey(SIZE, SIZE, STEPS, "pndm")
    return [Rendered(i, parse_job({"prompt": f"batch {seq} job {i}", "model": model.ref, "seed": seq * 100 + i,
                                   "steps": STEPS, "width": SIZE, "height": SIZE, "campaign": "bp"}),
                     rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8), key, False, Batch(seq, n, n, 0.1))
            for i in range(n)]


def test_submit_waits_once_max_pending_batches_are_behind(sd_model: Any, tmp_path: Path) -> None:
    stored_batches: list[int] = []
    writer = ResultWriter(open_storage(str(tmp_path), durable=False), sd_model, jax.devices(), threads=1,
                          max_pending=2, on_stored=lambda records: stored_batches.append(records[0]["batch"]["seq"]))
    with writer:
        for seq in range(6):
            writer.submit(noise_batch(sd_model, 4, seq))
            # Back from submit: at most 2 batches still waiting, so all older ones are stored.
            assert stored_batches[:seq - 1] == list(range(max(seq - 1, 0)))
    assert stored_batches == list(range(6))  # in submission order, every one


def test_store_threads_share_a_batch_and_must_be_at_least_one(sd_model: Any, tmp_path: Path) -> None:
    storage = open_storage(str(tmp_path), durable=False)
    stored: list[list[int]] = []
    with ResultWriter(storage, sd_model, jax.devices(), threads=3,
                      on_stored=lambda records: stored.append([r["spec"]["seed"] for r in records])) as writer:
        writer.submit(noise_batch(sd_model, 7, 0))
    assert stored == [list(range(7))]  # every job, in batch order, from three threads' chunks
    with pytest.raises(JobError, match=r"store_threads=0: must be at least 1"):
        ResultWriter(storage, sd_model, jax.devices(), threads=0)
