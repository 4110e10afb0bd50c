"""A farm worker whose devices are stand-ins, to benchmark the control plane.

`python -m bench.standin SECONDS worker ARGS...` runs `renderfarm worker ARGS...` with the
engine's rendering replaced: a batch "renders" in SECONDS on a device that does one batch
after another (an accelerator that is never slow to answer); dispatch returns at once, as
JAX's does, and the images are blank. Everything else is the real worker: validation,
batching, storing, acknowledgements (bench/control.py worker and fleet, bench/host.py).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np

import worker.engine
from diffusion.generate import Output
from renderfarm.jobs import JobSpec
from worker.engine import Engine, ShapeKey


class _Pending:
    """Blank images that a stand-in device finishes at `ready_at` (time.monotonic()):
    like a jax.Array being computed, it blocks only when its pixels are read."""

    def __init__(self, shape: tuple[int, ...], ready_at: float) -> None:
        self.shape, self.ready_at = shape, ready_at

    def is_ready(self) -> bool:
        return time.monotonic() >= self.ready_at

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        time.sleep(max(0.0, self.ready_at - time.monotonic()))
        return np.zeros(self.shape, dtype or np.uint8)


class StandInEngine(Engine):
    """The engine's validation, batching and output, with stand-in devices."""

    seconds_per_batch = 0.0
    _busy_until = 0.0  # when the stand-in device finishes its last batch

    def compiled(self, key: ShapeKey) -> None:
        return None

    def ready(self, key: ShapeKey) -> bool:
        return True

    def dispatch(self, key: ShapeKey, jobs: list[JobSpec]) -> tuple[Output, list[bool]]:
        self._busy_until = max(time.monotonic(), self._busy_until) + self.seconds_per_batch
        # Blank rows under PNG filter type 0 (none) are blank scanlines.
        shape = (self.batch_size, key.height, key.width, 3)
        scanlines = (self.batch_size, key.height, 1 + key.width * 3)
        return Output(_Pending(shape, self._busy_until), _Pending(scanlines, self._busy_until)), [False] * len(jobs)


def main(argv: list[str]) -> int:
    from renderfarm_cli import main as renderfarm

    StandInEngine.seconds_per_batch = float(argv[0])
    worker.engine.Engine = StandInEngine  # what `renderfarm worker` builds
    return renderfarm(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
