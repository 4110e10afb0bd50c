"""What a model costs per image on a chip: FLOPs per image of each published architecture at
full size, the chips `renderfarm plan` knows, and the images/s each chip gives at 50% of its
dense bfloat16 peak, beside published figures.

Everything comes from the families themselves, no weights and no network: the architectures are
diffusion/architectures/*.json (`diffusion.architectures.abstract_model`), the program is the
engine's own programs for one image on one device (`diffusion.placement.lower_encode` and
`lower_generate`, as `renderfarm plan` lowers them), counted by XLA (`cost_analysis` of the lowered program). XLA
counts the denoising loop's body once, so the other steps are added from the family's own
denoiser count (`Family.denoiser_flops`), as the engine and plan do. The chips are
diffusion/targets.py's `TARGETS`, whose peaks come from its one table of chips by JAX device
kind (`PEAK_TFLOPS`), which also gives a published figure's peak.

    PYTHONPATH=. python bench/cost.py [--models sd15,sdxl] [--memory] [--scores]

`--memory` compiles each model's float32 program on this CPU at 1 and 2 images (XLA's
`memory_analysis`) and prints the largest per-device batch that fits each chip, by arithmetic;
`--scores` prints the device scores' FLOPs per image beside each render's. The default takes
one to five minutes on a 2-core CPU (lowering the full-size programs); `--memory` more.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import time
from dataclasses import dataclass

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from diffusion.architectures import ARCHITECTURES, abstract_model  # noqa: E402
from diffusion.flops import peak_flops, program_flops  # noqa: E402
from diffusion.generate import Static  # noqa: E402
from diffusion.models import LoadedModel  # noqa: E402
from diffusion.placement import by_program, encoded_shapes, lower_encode, lower_generate, make_placement  # noqa: E402
from diffusion.schedulers import make  # noqa: E402
from diffusion.sharding import choose_model_parallel, split_text_encoders  # noqa: E402
from diffusion.targets import TARGETS  # noqa: E402

UTILISATION = 0.5  # the share of peak a worker should reach: both published SD figures below reach more
STEPS = {"sd15": (25, 50), "sd21": (25,), "sdxl": (20, 25), "flux-schnell": (4,), "flux-dev": (28,)}
CHIPS = tuple(t for t in TARGETS.values() if t.peak_flops)  # the targets with a known peak


@dataclass(frozen=True)
class Published:
    """A published timing: `images` of `architecture` at `steps` in `seconds` on `devices` x `device_kind`."""

    label: str
    architecture: str
    steps: int
    device_kind: str
    devices: int
    images: int
    seconds: float


PUBLISHED = (
    Published("SD 1.4 on a TPU v2-8 (Hugging Face's Flax blog)", "sd15", 50, "TPU v2", 8, 8, 7.0),
    Published("SDXL on a TPU v5e-4 (Hugging Face's SDXL on TPU v5e post)", "sdxl", 20, "TPU v5 lite", 4, 4, 2.3),
    Published("maxdiffusion schnell on a TPU v6e-4", "flux-schnell", 4, "TPU v6 lite", 4, 4, 0.8),
    Published("maxdiffusion dev on a TPU v6e-4", "flux-dev", 28, "TPU v6 lite", 4, 4, 5.5),
)


@dataclass
class Cost:
    """One architecture's FLOPs per image: a denoiser step, the rest (encoders, decode, scheduler)."""

    name: str
    size: int
    guided: bool
    step: float
    rest: float
    parameters: int
    text_parameters: int  # the text encoders'

    def per_image(self, steps: int) -> float:
        return self.rest + steps * self.step


def lowered(model: LoadedModel, size: int, steps: int, batch: int = 1) -> tuple[jax.stages.Lowered, jax.stages.Lowered]:
    """The engine's two programs for `batch` images of `model` on one device, lowered from
    shapes: the text encoders' and the generate program."""
    family = model.family
    placement = make_placement(jax.devices("cpu")[:1], 1)
    guided = family.classifier_free and family.default_guidance > 1
    scheduler = make(model.default_scheduler, model.configs["scheduler"])
    text, weights = by_program(family, placement.abstract(family, model.params))
    inputs = model.abstract_inputs(batch, placement.batch)
    encoded = encoded_shapes(family, model.networks, guided, placement, text, inputs)
    return (lower_encode(family, model.networks, guided, placement, text, inputs),
            lower_generate(family, model.networks, scheduler, Static(size, size, steps, guided), placement, weights,
                           inputs, encoded))


def cost(name: str) -> Cost:
    """XLA's FLOPs of `name`'s programs at its native size, split into a step and the rest."""
    model = abstract_model(name, "float32")
    size = model.native_size
    guided = model.family.classifier_free and model.family.default_guidance > 1
    counts = [program_flops(program) for program in lowered(model, size, STEPS[name][0])]
    step = model.family.denoiser_flops(model.networks, model.params, 2 if guided else 1, size, size)
    if None in counts or step is None:
        raise SystemExit(f"{name}: XLA gave no FLOP count on this backend")
    parameters = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(model.params))
    text = sum(math.prod(leaf.shape) for name in model.family.text_encoders
               for leaf in jax.tree.leaves(model.params[name]))
    return Cost(name, size, guided, step, sum(counts) - step, parameters, text)


def print_costs(costs: list[Cost]) -> None:
    """FLOPs per image, images/s per chip at 50% of peak, and the published figures' share of peak."""
    print("chips (diffusion/targets.py): dense bf16 peak per JAX device, memory per device")
    for chip in CHIPS:
        print(f"  {chip.name:10} {chip.label:36} {chip.peak_flops / 1e12:7.1f} TFLOP/s  "
              f"{chip.memory / 1e9:6.1f} GB x {chip.devices}")
    print(f"\nFLOPs per image (XLA, lowered program + (steps - 1) denoiser calls); images/s per device at "
          f"{UTILISATION:.0%} of peak")
    print(f"  {'model':24}{'TFLOP':>9}  {'step':>7}  {'rest':>6}  " + "".join(f"{c.name:>10}" for c in CHIPS))
    for c in costs:
        for steps in STEPS[c.name]:
            flops = c.per_image(steps)
            rates = "".join(f"{UTILISATION * chip.peak_flops / flops:10.2f}" for chip in CHIPS)
            print(f"  {f'{c.name} {c.size}x{c.size} @{steps}':24}{flops / 1e12:9.1f}  {c.step / 1e12:7.3f}  "
                  f"{c.rest / 1e12:6.3f}  {rates}   (denoiser {steps * c.step / flops:.0%})")
    print("  (step: one denoiser call per image, on 2 rows where classifier-free guidance runs; rest: text "
          "encoders, VAE decode and scheduler)")
    by_name = {c.name: c for c in costs}
    for p in PUBLISHED:
        if p.architecture in by_name and peak_flops(p.device_kind):
            rate = p.images * by_name[p.architecture].per_image(p.steps) / p.seconds
            peak = p.devices * peak_flops(p.device_kind)
            print(f"published: {p.label}: {p.images} images at {p.steps} steps in {p.seconds} s = "
                  f"{rate / 1e12:,.0f} TFLOP/s, {rate / peak:.0%} of its {peak / 1e12:,.0f} TFLOP/s")


def print_splits(costs: list[Cost]) -> None:
    """Weights in bfloat16 and the split the worker chooses on each chip (`choose_model_parallel`;
    `+t`: the text encoders spread over every device, `split_text_encoders`)."""
    print("\nweights in bfloat16, and devices per copy of them (`--model-parallel auto`; +t: the text encoders "
          "spread over every device) on each host")
    for c in costs:
        weights, text = 2 * c.parameters, 2 * c.text_parameters
        splits = []
        for chip in CHIPS:
            try:
                split = choose_model_parallel(weights, chip.usable_bytes, chip.devices, text)
                spread = split_text_encoders(weights, text, chip.usable_bytes, split, chip.devices)
                splits.append(f"{chip.name} {split}{'+t' if spread else ''}")
            except ValueError:
                splits.append(f"{chip.name} -")
        print(f"  {c.name:13} {c.parameters / 1e9:6.2f} B parameters, {weights / 1e9:6.2f} GB: {', '.join(splits)}")


def memory(names: list[str], dtype: str = "float32", batches: tuple[int, int] = (1, 2)) -> None:
    """The largest per-device batch, by arithmetic: (usable - weights in bfloat16 - fixed temp) /
    temp per image, the temps from XLA's memory_analysis of the program compiled here in `dtype`
    for one device at `batches` images. float32 by default because XLA:CPU keeps float32 copies
    of bfloat16 weights for its matmuls, which would hide the activations (and which GPUs and
    TPUs never make; `dtype` bfloat16 shows them); attention traced as the memory-bounded "chunked" kernel, the stand-in for the flash
    kernels, which never hold a whole score matrix either."""
    from diffusion.nn.attention import use_kernel

    chips = [TARGETS["h100"], TARGETS["tpu-v5e-8"]]
    print(f"\nlargest per-device batch, by arithmetic ({dtype} programs compiled on this CPU)")
    for name in names:
        model = abstract_model(name, dtype)
        size, steps = model.native_size, STEPS[name][0]
        temps = {}
        for batch in batches:
            started = time.perf_counter()
            with use_kernel("chunked"):
                # the generate program's: the text encoders' holds far less
                temps[batch] = lowered(model, size, steps, batch)[1].compile().memory_analysis().temp_size_in_bytes
            print(f"  {name} {size}x{size} batch {batch}: XLA temp {temps[batch] / 1e9:.3f} GB "
                  f"(compiled in {time.perf_counter() - started:.0f} s)", flush=True)
        weights = 2 * sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(model.params))
        low, high = batches
        per_image = (temps[high] - temps[low]) / (high - low)
        fixed = max(0.0, temps[low] - low * per_image)
        print(f"  {name}: weights {weights / 1e9:.2f} GB, per image {per_image / 1e9:.3f} GB, fixed {fixed / 1e9:.3f} GB")
        for chip in chips:
            fits = int((chip.usable_bytes - weights - fixed) // per_image) if per_image > 0 else None
            print(f"    {chip.label}: ({chip.usable_bytes / 1e9:.2f} - {weights / 1e9:.2f} - {fixed / 1e9:.2f}) / "
                  f"{per_image / 1e9:.3f} = {fits} images per device")


def score_flops(size: int, batch: int = 8) -> float:
    """FLOPs per image of the four device scores on `size` x `size` renders: one CLIP ViT-L/14
    tower serving the safety checker, the CLIP score and the aesthetic predictor, with the
    device's preprocessing (diffusion/scores.py `score_batch`)."""
    from diffusion.nn import parameter_shapes
    from diffusion.nn.clip import CLIPConfig, CLIPModel
    from diffusion.scores import AestheticPredictor, SafetyTower, ScoreModels, score_batch
    from harness.architectures import VIT_L14

    config = CLIPConfig.from_dict(VIT_L14)
    checker = parameter_shapes(SafetyTower(config))
    params = {"clip": parameter_shapes(CLIPModel(config)),
              "aesthetic": parameter_shapes(AestheticPredictor(config.projection_dim)),
              "safety": {k: v for k, v in checker.items() if k not in ("vision_model", "visual_projection")}}
    images = jax.ShapeDtypeStruct((batch, size, size, 3), jnp.uint8)
    ids = jax.ShapeDtypeStruct((batch, 77), jnp.int32)
    program = jax.jit(functools.partial(score_batch, ScoreModels(config, config, True)))
    return program_flops(program.lower(params, images, ids)) / batch


def print_scores(costs: list[Cost]) -> None:
    print("\nthe device scores beside a render, per image (XLA's FLOPs of the lowered programs)")
    for c in costs:
        scores, render = score_flops(c.size), c.per_image(STEPS[c.name][0])
        print(f"  {c.name} {c.size}x{c.size} @{STEPS[c.name][0]}: render {render / 1e12:.1f} TFLOP, scores "
              f"{scores / 1e9:.0f} GFLOP = {scores / render:.2%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(STEPS), help=f"comma-separated, of {', '.join(ARCHITECTURES)}")
    parser.add_argument("--memory", action="store_true", help="the largest batch per device (CPU compiles, minutes)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="--memory: the programs' dtype (float32: XLA:CPU's bfloat16 programs hold float32 weights)")
    parser.add_argument("--scores", action="store_true", help="the device scores' FLOPs beside each render")
    args = parser.parse_args()
    names = [n for n in args.models.split(",") if n]
    unknown = sorted(set(names) - set(STEPS))
    if unknown:
        parser.error(f"--models: unknown {unknown}; known: {', '.join(STEPS)}")
    started = time.perf_counter()
    costs = [cost(name) for name in names]
    print(f"jax {jax.__version__}; counted in {time.perf_counter() - started:.0f} s\n")
    print_costs(costs)
    print_splits(costs)
    if args.scores:
        print_scores(costs)
    if args.memory:
        memory(names, args.dtype)


if __name__ == "__main__":
    main()
