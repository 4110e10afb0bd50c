"""What scoring costs beside a render, and how fast exports find near-duplicates.

1. The four scores' share of a render (XLA's FLOPs, from the lowered programs: no weights, no
   compile): one CLIP ViT-L/14 tower serving the safety checker, the CLIP score and the
   aesthetic predictor (diffusion/scores.py `score_batch`, with the device's preprocessing)
   on a batch of rendered images, against the denoiser's FLOPs for the render (its steps x
   one UNet call on 2 rows, classifier-free guidance; the text encoders and the VAE left out,
   so the share shown is an upper bound). The perceptual hash is the host's.
2. The same on this CPU at tiny sizes, in seconds: a batch of the tiny SD model (64x64, 8
   steps, one job a device) rendered by the engine with and without the tiny scoring models
   of tests/data/scores/ (the oracle's: CLIP, safety checker, aesthetic predictor).
3. `renderfarm export --dedup 4` on 1,000,000 hashes (renderfarm/scores.py near_duplicates),
   one in a hundred a near copy of another.

    PYTHONPATH=. python bench/scores.py [--hashes N]
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from diffusion.architectures import abstract_model  # noqa: E402
from diffusion.nn import parameter_shapes  # noqa: E402
from diffusion.nn.clip import CLIPConfig, CLIPModel  # noqa: E402
from diffusion.scores import AestheticPredictor, SafetyTower, ScoreModels, score_batch  # noqa: E402
from harness.architectures import VIT_L14  # noqa: E402
from renderfarm.scores import near_duplicates  # noqa: E402

RENDERS = (("sd15", 512, 25), ("sdxl", 1024, 25))  # architecture, size, steps
BATCH = 8
ROOT = Path(__file__).resolve().parent.parent


def score_flops(size: int) -> float:
    """FLOPs per image of the four device scores on `size` x `size` renders, one tower shared."""
    config = CLIPConfig.from_dict(VIT_L14)
    checker = parameter_shapes(SafetyTower(config))
    params = {"clip": parameter_shapes(CLIPModel(config)),
              "aesthetic": parameter_shapes(AestheticPredictor(config.projection_dim)),
              "safety": {k: v for k, v in checker.items() if k not in ("vision_model", "visual_projection")}}
    images = jax.ShapeDtypeStruct((BATCH, size, size, 3), jnp.uint8)
    ids = jax.ShapeDtypeStruct((BATCH, 77), jnp.int32)
    lowered = jax.jit(functools.partial(score_batch, ScoreModels(config, config, True))).lower(params, images, ids)
    return lowered.cost_analysis()["flops"] / BATCH


def render_flops(name: str, size: int, steps: int) -> float:
    """The denoiser's FLOPs for one image: `steps` calls on 2 rows (classifier-free guidance)."""
    model = abstract_model(name, "float32")
    return steps * model.family.denoiser_flops(model.networks, model.params, 2, size, size)


def tiny_seconds(batches: int = 5) -> tuple[float, float]:
    """Median seconds of a tiny SD batch on this CPU's devices, without and with the scores."""
    from diffusion.models import load_model
    from diffusion.scores import load_scorers
    from diffusion.tiny import build_tiny_model
    from renderfarm.jobs import JobSpec
    from worker.engine import Engine

    data = ROOT / "tests" / "data" / "scores"
    with tempfile.TemporaryDirectory() as folder:
        model = load_model(str(build_tiny_model(Path(folder) / "tiny-sd", kind="sd")))
    scorers = load_scorers(data / "safety_checker", data / "clip", data / "aesthetic.safetensors")
    medians = []
    for engine, scores in ((Engine(model), None), (Engine(model, scorers=scorers), ("safety", "clip", "aesthetic"))):
        specs = [JobSpec(prompt=f"a lighthouse {i}", model=model.ref, seed=i, steps=8, width=64, height=64,
                         scores=scores) for i in range(engine.batch_size)]
        engine.render(specs)  # compiles
        times = []
        for _ in range(batches):
            started = time.perf_counter()
            engine.render(specs)
            times.append(time.perf_counter() - started)
        medians.append(statistics.median(times))
    return medians[0], medians[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hashes", type=int, default=1_000_000)
    args = parser.parse_args()
    print("scores on the devices, per image (XLA's FLOPs of the lowered programs)")
    for name, size, steps in RENDERS:
        scores, render = score_flops(size), render_flops(name, size, steps)
        print(f"  {name} {size}x{size}, {steps} steps: render {render / 1e12:.1f} TFLOP, "
              f"scores {scores / 1e9:.1f} GFLOP = {scores / render:.2%} of the render")
    plain, scored = tiny_seconds()
    print(f"tiny SD batch on this CPU (64x64, 8 steps, 8 devices): {plain:.3f} s, with the scores "
          f"{scored:.3f} s ({(scored - plain) / plain:+.1%})")
    rng = random.Random(0)
    hashes = [f"{rng.getrandbits(64):016x}" for _ in range(args.hashes)]
    for i in range(0, len(hashes), 100):  # one in a hundred: a copy of an earlier one, 1-3 bits off
        flipped = int(hashes[rng.randrange(len(hashes))], 16)
        for _ in range(rng.randrange(1, 4)):
            flipped ^= 1 << rng.randrange(64)
        hashes[i] = f"{flipped:016x}"
    started = time.perf_counter()
    dropped = sum(near_duplicates(hashes, 4))
    print(f"near-duplicates of {len(hashes):,} hashes at Hamming <= 4: {dropped:,} found in "
          f"{time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
