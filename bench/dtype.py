"""float32 against bfloat16 on this machine's CPU: images/s of the engine on the tiny SD
model (same jobs, both compiled first, alternating rounds, medians) and the largest pixel
difference between the two renders of the same jobs. Also checks that the scheduler state
stays float32 when the weights are bfloat16.

Usage: PYTHONPATH=. python bench/dtype.py [--sizes 64,256] [--steps 4] [--images 64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from diffusion.models import load_model  # noqa: E402
from diffusion.tiny import build_tiny_model  # noqa: E402
from renderfarm.jobs import JobSpec  # noqa: E402
from worker.engine import Engine, ShapeKey  # noqa: E402

DTYPES = ("float32", "bfloat16")


def scheduler_dtypes(engine: Engine, name: str) -> set[str]:
    """dtypes of the floating leaves of the scheduler state the engine's programs build."""
    scheduler = engine.scheduler(ShapeKey(64, 64, 4, name))  # what the compiled program runs
    leaves = jax.tree.leaves(scheduler.set_timesteps(4, (1, 4, 8, 8)))
    return {str(x.dtype) for x in leaves if hasattr(x, "dtype") and np.issubdtype(x.dtype, np.floating)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64,256")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--images", type=int, default=64, help="images per round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rf-dtype-") as tmp:
        folder = str(build_tiny_model(Path(tmp) / "tiny-sd"))
        engines = {dtype: Engine(load_model(folder, dtype)) for dtype in DTYPES}
        for dtype, engine in engines.items():
            print(f"{dtype}: scheduler state dtypes {sorted(scheduler_dtypes(engine, 'pndm'))}, "
                  f"UNet params {sorted({str(x.dtype) for x in jax.tree.leaves(engine.model.params['unet'])})}")
        print(f"jax {jax.__version__}, {jax.device_count()} x {jax.devices()[0].device_kind} devices, "
              f"{os.cpu_count()} cores; tiny SD, {args.steps} steps, {args.images} images per round")
        for size in (int(s) for s in args.sizes.split(",")):
            specs = {d: [JobSpec(prompt=f"a lighthouse, variation {i}", model=folder, seed=i, steps=args.steps,
                                 width=size, height=size, dtype=d, campaign="bench")
                         for i in range(args.images)] for d in DTYPES}
            images = {d: np.stack([r.image for r in engines[d].render(specs[d])]) for d in DTYPES}  # compile
            rates: dict[str, list[float]] = {d: [] for d in DTYPES}
            for _ in range(args.rounds):
                for d in DTYPES:
                    start = time.perf_counter()
                    engines[d].render(specs[d])
                    rates[d].append(args.images / (time.perf_counter() - start))
            diff = np.abs(images["float32"].astype(int) - images["bfloat16"].astype(int))
            med = {d: statistics.median(r) for d, r in rates.items()}
            for d in DTYPES:
                print(f"{size}x{size} {d:8s} {med[d]:7.1f} images/s  (rounds: "
                      f"{', '.join(f'{r:.1f}' for r in rates[d])})")
            print(f"{size}x{size} bfloat16/float32 {med['bfloat16'] / med['float32']:.2f}; pixels: max |diff| "
                  f"{diff.max()}/255, mean {diff.mean():.2f}/255, {np.mean(diff > 2):.1%} differ by more than 2")


if __name__ == "__main__":
    main()
