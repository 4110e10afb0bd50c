"""What skipping classifier-free guidance saves: images/s of the engine on the tiny SD model
for jobs with guidance 1.0 (cfg-free programs: one UNet call on the conditional latents a
step) against guidance 7.5 at the same steps (50 by default, diffusers' pipelines' own),
and what a user of a few-step model sees: a 4-step cfg-free campaign against the guided one.
Same jobs but for those fields, every program compiled first, alternating rounds, medians.
From the two cfg-free runs it also splits an image's time into what every image costs
once (text encoders, VAE decode, PNG filter: the tiny model's VAE is large beside its UNet,
so this share is far larger than a real model's) and each step's UNet calls.

Usage: PYTHONPATH=. python bench/few_step.py [--size 256] [--steps 50] [--few-steps 4]
                                             [--baseline-steps 25] [--images 32] [--rounds 3]
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

from diffusion.models import load_model  # noqa: E402
from diffusion.tiny import build_tiny_model  # noqa: E402
from renderfarm.jobs import JobSpec  # noqa: E402
from worker.engine import Engine  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=50, help="steps of the guided campaign and of the pair")
    parser.add_argument("--few-steps", type=int, default=4, help="steps of the few-step cfg-free campaign")
    parser.add_argument("--baseline-steps", type=int, default=25, help="steps of the guided campaign it replaces")
    parser.add_argument("--images", type=int, default=32, help="images per round and variant")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rf-few-step-") as tmp:
        folder = str(build_tiny_model(Path(tmp) / "tiny-sd"))
        engine = Engine(load_model(folder))
        few, baseline = f"{args.few_steps} steps trailing, guidance 1.0", f"{args.baseline_steps} steps, guidance 7.5"
        variants = {"guidance 7.5": (args.steps, 7.5, None), "guidance 1.0": (args.steps, 1.0, None),
                    few: (args.few_steps, 1.0, "trailing"), baseline: (args.baseline_steps, 7.5, None)}
        specs = {name: [JobSpec(prompt=f"a lighthouse, variation {i}", model=folder, seed=i, steps=steps,
                                guidance_scale=guidance, width=args.size, height=args.size, campaign="bench",
                                timestep_spacing=spacing)
                        for i in range(args.images)]
                 for name, (steps, guidance, spacing) in variants.items()}
        print(f"jax {jax.__version__}, {jax.device_count()} x {jax.devices()[0].device_kind} devices, "
              f"{os.cpu_count()} cores; tiny SD {args.size}x{args.size}, {args.images} images per round")
        for name in variants:
            engine.prepare(specs[name])  # compile
        rates: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name in variants:
                start = time.perf_counter()
                engine.render(specs[name])
                rates[name].append(args.images / (time.perf_counter() - start))
        med = {name: statistics.median(r) for name, r in rates.items()}
        for name, (steps, _, _) in variants.items():
            print(f"{name:34s} {steps:3d} steps {med[name]:7.2f} images/s  (rounds: "
                  f"{', '.join(f'{r:.2f}' for r in rates[name])})")
        seconds = {name: 1 / rate for name, rate in med.items()}  # per image
        free_step = (seconds["guidance 1.0"] - seconds[few]) / (args.steps - args.few_steps)
        once = seconds[few] - args.few_steps * free_step
        guided_step = (seconds["guidance 7.5"] - once) / args.steps
        print(f"per image: {once * 1e3:.1f} ms once, then a step {free_step * 1e3:.2f} ms cfg-free, "
              f"{guided_step * 1e3:.2f} ms guided ({guided_step / free_step:.2f}x)")
        print(f"cfg-free / guided at {args.steps} steps: {med['guidance 1.0'] / med['guidance 7.5']:.2f} (target >= 1.8)")
        print(f"{args.few_steps}-step trailing cfg-free / {args.baseline_steps}-step guided campaign: "
              f"{med[few] / med[baseline]:.1f}x images/s")


if __name__ == "__main__":
    main()
