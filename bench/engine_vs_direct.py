"""Engine vs the reference flow of stable_diffusion_jax_blog.md, in one run, after compile.

direct: pipeline(shard(prompt_ids), replicate(params), rng, jit=True), numpy_to_pil, PNG save
engine: what `renderfarm render` runs (worker.local.render_to_storage): PNG + sidecar + manifest

Both use DDIM, which runs one UNet evaluation per step in both. (The tiny model's own PNDM
does not: diffusers' Flax pipeline loops `steps` times, where PyTorch's PNDM, which the
engine follows, evaluates the UNet `steps + 1` times; comparing them would charge the engine
for the evaluation the Flax pipeline skips.)

Both compile and warm up first, then run in alternating rounds on the same prompts; prints
the median images/s of each and engine/direct.
Usage: python bench/engine_vs_direct.py [--images N] [--rounds R] [--steps S]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax.jax_utils import replicate  # noqa: E402
from flax.training.common_utils import shard  # noqa: E402

from bench.flax_reference import quiet_diffusers  # noqa: E402
from diffusion.models import load_model  # noqa: E402
from diffusion.tiny import build_tiny_model  # noqa: E402
from renderfarm.jobs import JobSpec  # noqa: E402
from renderfarm.storage import open_storage  # noqa: E402
from worker.engine import Engine, enable_compilation_cache  # noqa: E402
from worker.local import render_to_storage  # noqa: E402


def direct_flow(model_dir: Path, steps: int, out: Path) -> Callable[[list[str]], None]:
    """The blog's flow: prepare_inputs, shard, pipeline(jit=True), numpy_to_pil, save."""
    from diffusers import FlaxDDIMScheduler, FlaxStableDiffusionPipeline

    with quiet_diffusers():
        pipeline, params = FlaxStableDiffusionPipeline.from_pretrained(
            str(model_dir), safety_checker=None, feature_extractor=None)
        scheduler = FlaxDDIMScheduler.from_config(pipeline.scheduler.config)
        pipeline = type(pipeline)(**{**pipeline.components, "scheduler": scheduler}, dtype=pipeline.dtype)
        params["scheduler"] = scheduler.create_state()
    p_params = replicate(params)
    n = jax.device_count()
    rng = jax.random.split(jax.random.PRNGKey(0), n)

    def run(prompts: list[str]) -> None:
        for i in range(0, len(prompts), n):
            prompt_ids = shard(pipeline.prepare_inputs(prompts[i:i + n]))
            images = pipeline(prompt_ids, p_params, rng, num_inference_steps=steps, jit=True).images
            images = images.reshape((images.shape[0] * images.shape[1],) + images.shape[-3:])
            for k, image in enumerate(pipeline.numpy_to_pil(np.asarray(images))):
                image.save(out / f"{i + k}.png")

    return run


def engine_flow(model_dir: Path, steps: int, out: Path) -> Callable[[list[str]], None]:
    """What `renderfarm render` runs: engine, PNG + sidecar + manifest per job."""
    engine = Engine(load_model(str(model_dir)))
    storage = open_storage(str(out), durable=False)

    def run(prompts: list[str]) -> None:
        specs = [JobSpec(prompt=p, model=str(model_dir), seed=i, steps=steps, scheduler="ddim")
                 for i, p in enumerate(prompts)]
        render_to_storage(specs, engine, storage, progress=False)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=128, help="per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    prompts = [f"a lighthouse at dawn, painting number {i}" for i in range(args.images)]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        enable_compilation_cache(root / "jax-cache")
        model_dir = build_tiny_model(root / "tiny-sd", kind="sd")
        (root / "direct").mkdir()
        flows = {"direct": direct_flow(model_dir, args.steps, root / "direct"),
                 "engine": engine_flow(model_dir, args.steps, root / "engine")}
        rates: dict[str, list[float]] = {name: [] for name in flows}
        for run in flows.values():
            run(prompts[:jax.device_count()])  # compile and warm up
        for _ in range(args.rounds):  # alternate, so both see the same machine
            for name, run in flows.items():
                start = time.perf_counter()
                run(prompts)
                rates[name].append(args.images / (time.perf_counter() - start))
    direct, engine = statistics.median(rates["direct"]), statistics.median(rates["engine"])
    print(f"tiny SD, 64x64, {args.steps} steps, {args.rounds} rounds of {args.images} images, "
          f"{jax.device_count()} {jax.devices()[0].device_kind} devices; median of rounds")
    print(f"direct (blog flow, pmap):        {direct:8.2f} images/s  {fmt(rates['direct'])}")
    print(f"engine (renderfarm render):      {engine:8.2f} images/s  {fmt(rates['engine'])}")
    print(f"ratio engine/direct:             {engine / direct:8.2f}")


def fmt(values: list[float]) -> str:
    return "(rounds: " + ", ".join(f"{v:.1f}" for v in values) + ")"


if __name__ == "__main__":
    main()
