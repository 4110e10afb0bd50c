"""How to spread a batch over local devices: pmap, jit with automatic partitioning, or jit of
a shard_map. Same generate function, same inputs; prints seconds per batch after compile.

Usage: python bench/parallelism.py [--steps 4] [--repeats 30]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax.jax_utils import replicate  # noqa: E402

from diffusion.generate import Inputs, Output, Static  # noqa: E402
from diffusion.models import load_model  # noqa: E402
from diffusion.placement import BATCH, WHOLE  # noqa: E402
from diffusion.tiny import build_tiny_model  # noqa: E402
from renderfarm.jobs import JobSpec  # noqa: E402
from worker.engine import Engine  # noqa: E402


def seconds_per_call(call: Callable[[], Output], repeats: int) -> float:
    jax.block_until_ready(call())  # compile and warm up
    start = time.perf_counter()
    for _ in range(repeats):
        jax.block_until_ready(call())
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = load_model(str(build_tiny_model(Path(tmp) / "tiny-sd", kind="sd")))
    engine = Engine(model)
    n = len(engine.devices)
    specs = [JobSpec(prompt=f"a lighthouse {i}", model=model.ref, seed=i, steps=args.steps) for i in range(n)]
    key = engine.check(specs[0])
    inputs, _ = engine._inputs(key, specs)
    params = engine._params
    fn = partial(model.family.generate, model.networks, engine.scheduler(key),
                 Static(key.height, key.width, key.steps, key.guided))
    mesh = engine.placement.mesh

    per_device = Inputs(*(np.asarray(x).reshape(n, 1, *x.shape[1:]) for x in inputs))
    pmapped = jax.pmap(fn)
    p_params = replicate(params)
    auto = jax.jit(fn)
    mapped = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(WHOLE, BATCH), out_specs=BATCH, check_vma=False))
    results = {
        "pmap": seconds_per_call(lambda: pmapped(p_params, per_device), args.repeats),
        "jit, automatic partitioning": seconds_per_call(lambda: auto(params, inputs), args.repeats),
        "jit of shard_map (engine)": seconds_per_call(lambda: mapped(params, inputs), args.repeats),
    }
    print(f"tiny SD, 64x64, {args.steps} steps, batch {n} on {n} {engine.devices[0].device_kind} devices")
    for name, seconds in results.items():
        print(f"{name:30s} {seconds * 1000:8.1f} ms/batch  {n / seconds:8.1f} images/s")


if __name__ == "__main__":
    main()
