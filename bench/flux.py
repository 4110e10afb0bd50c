"""Flux.1 by the numbers: what full-size schnell and dev cost per 1024x1024 image, what their
weights need per chip, and what the farm renders of a tiny Flux on this machine.

1. FLOPs per image, counted by XLA's cost analysis of the lowered calls (shapes only: no
   weights, no network): the transformer once per step on one image (no classifier-free pass;
   dev's guidance is an input), T5-XXL on 256 (schnell) or 512 (dev) tokens, CLIP-L, the
   16-channel VAE's decoder. Then images/s at 50% of each accelerator's dense bf16 peak, and
   the fraction of peak maxdiffusion's published TPU v6e-4 figures reach.
2. Memory: each component's parameters and bf16 bytes, and the split over a host's chips the
   worker chooses (diffusion.sharding.choose_model_parallel: weights at most 3/4 of the memory
   JAX may use on a chip).
3. The tiny Flux of `renderfarm tiny-model --kind flux` rendered by the engine on the host's
   devices: images/s in steady state, compile excluded.

The configs are the published ones (black-forest-labs/FLUX.1-schnell and -dev, each
component's config.json), keeping the fields our modules read.

Usage: PYTHONPATH=. python bench/flux.py [--images 64] [--size 64] [--steps 4] [--rounds 3] [--skip-full]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.flops import CLIP_L, HARDWARE, KEY, UTILISATION, VAE, vae_decode  # noqa: E402
from diffusion.families.flux import FAMILY, max_sequence_length  # noqa: E402
from diffusion.family import Networks  # noqa: E402
from diffusion.flops import program_flops  # noqa: E402
from diffusion.models import load_model  # noqa: E402
from diffusion.nn.clip import CLIPTextConfig, CLIPTextModel  # noqa: E402
from diffusion.nn.flux import FluxConfig, FluxTransformer2DModel  # noqa: E402
from diffusion.nn.t5 import T5Config, T5EncoderModel  # noqa: E402
from diffusion.nn.vae import AutoencoderKL, VAEConfig  # noqa: E402
from diffusion.sharding import choose_model_parallel  # noqa: E402
from diffusion.targets import GPU_USABLE, TPU_USABLE  # noqa: E402
from diffusion.tiny import build_tiny_model  # noqa: E402
from renderfarm.jobs import JobSpec  # noqa: E402
from worker.engine import Engine  # noqa: E402

SIZE = 1024
T5_XXL = {"vocab_size": 32128, "d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_layers": 24, "num_heads": 64,
          "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128,
          "feed_forward_proj": "gated-gelu"}
FLUX_VAE = {**VAE, "latent_channels": 16, "sample_size": SIZE, "scaling_factor": 0.3611, "shift_factor": 0.1159,
            "use_quant_conv": False, "use_post_quant_conv": False}
# variant: transformer config (diffusers' defaults are the released size), steps, maxdiffusion's
# published figure on a TPU v6e-4 (its README): images, seconds
VARIANTS = {"schnell": ({"guidance_embeds": False}, 4, (4, 0.8)), "dev": ({"guidance_embeds": True}, 28, (4, 5.5))}
V6E4_PEAK = 4 * 918e12
# chips a worker may split the weights over: the memory JAX may use on each (diffusion.targets)
CHIPS = {"TPU v5e (16 GB)": 16e9 * TPU_USABLE, "TPU v6e (32 GB)": 32e9 * TPU_USABLE, "H100 (80 GB)": 80e9 * GPU_USABLE,
         "H200 (141 GB)": 141e9 * GPU_USABLE}
HOST_CHIPS = 8


def parameters(tree: Any) -> int:
    return sum(leaf.size for leaf in jax.tree.leaves(tree))


def components(variant: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """name -> (module, abstract params) of the full-size pipeline."""
    modules = {"transformer": FluxTransformer2DModel(FluxConfig.from_dict(variant)),
               "text_encoder_2": T5EncoderModel(T5Config.from_dict(T5_XXL)),
               "text_encoder": CLIPTextModel(CLIPTextConfig.from_dict(CLIP_L)),
               "vae": AutoencoderKL(VAEConfig.from_dict(FLUX_VAE))}
    return {name: (module, jax.eval_shape(module.init_params, KEY)) for name, module in modules.items()}


def encoder_flops(module: Any, params: Any, tokens: int) -> float:
    ids = jax.ShapeDtypeStruct((1, tokens), jnp.int32)
    flops = program_flops(jax.jit(lambda p, i: module.apply({"params": p}, i)).lower(params, ids))
    assert flops is not None
    return flops


def full_size() -> None:
    print(f"Full-size Flux.1 at {SIZE}x{SIZE}: FLOPs from XLA's cost analysis of the lowered calls "
          f"(jax {jax.__version__}); images/s at {UTILISATION:.0%} of dense bf16 peak\n")
    vae = vae_decode(SIZE, FLUX_VAE)
    for name, (config, steps, (images, seconds)) in VARIANTS.items():
        started = time.perf_counter()
        parts = components(config)
        nets = Networks(modules=tuple((part, module) for part, (module, _) in parts.items()))
        params = {part: shapes for part, (_, shapes) in parts.items()}
        step = FAMILY.denoiser_flops(nets, params, 1, SIZE, SIZE)
        assert step is not None
        tokens = max_sequence_length(parts["transformer"][0].config)
        t5 = encoder_flops(*parts["text_encoder_2"], tokens)
        clip = encoder_flops(*parts["text_encoder"], 77)
        per_image = steps * step + t5 + clip + vae
        print(f"{name}, {steps} steps, T5 on {tokens} tokens (counted in {time.perf_counter() - started:.0f} s):")
        print(f"  transformer, per image per step {step / 1e12:8.3f} TFLOP")
        print(f"  T5-XXL + CLIP-L, per image      {(t5 + clip) / 1e12:8.3f} TFLOP")
        print(f"  VAE decode, per image           {vae / 1e12:8.3f} TFLOP")
        row = "  ".join(f"{hw} {UTILISATION * chips * peak / per_image:6.2f}" for hw, (chips, peak) in HARDWARE.items())
        print(f"  {per_image / 1e12:.1f} TFLOP/image (transformer {steps * step / per_image:.0%}); images/s: {row}")
        achieved = images * per_image / seconds
        print(f"  published: maxdiffusion on a TPU v6e-4, {images} images in {seconds} s = {images / seconds:.1f} "
              f"images/s = {achieved / 1e12:.0f} TFLOP/s, {achieved / V6E4_PEAK:.0%} of its "
              f"{V6E4_PEAK / 1e12:.0f} TFLOP/s peak")
        if name == "dev":
            memory(parts)
        print()


def memory(parts: dict[str, tuple[Any, Any]]) -> None:
    counts = {name: parameters(shapes) for name, (_, shapes) in parts.items()}
    weights = 2 * sum(counts.values())  # bf16
    print("  parameters (bf16 bytes): " + ", ".join(f"{name} {n / 1e9:.2f}B ({2 * n / 1e9:.1f} GB)"
                                                    for name, n in counts.items()))
    for chip, capacity in CHIPS.items():
        split = choose_model_parallel(weights, int(capacity), HOST_CHIPS)
        print(f"  {HOST_CHIPS} x {chip}: weights over {split} chip(s), {weights / split / 1e9:.1f} GB each; "
              f"{HOST_CHIPS // split} image(s) at a time (data axis)")


def tiny(images: int, size: int, steps: int, rounds: int) -> None:
    with tempfile.TemporaryDirectory(prefix="rf-flux-") as tmp:
        folder = str(build_tiny_model(Path(tmp) / "tiny-flux", kind="flux"))
        engine = Engine(load_model(folder))
        specs = [JobSpec(prompt=f"a lighthouse, variation {i}", model=folder, seed=i, steps=steps, guidance_scale=3.5,
                         width=size, height=size, campaign="bench") for i in range(images)]
        started = time.perf_counter()
        engine.prepare(specs)
        compiled = time.perf_counter() - started
        rates = []
        for _ in range(rounds):
            started = time.perf_counter()
            engine.render(specs)
            rates.append(images / (time.perf_counter() - started))
        print(f"tiny Flux (dev layout) {size}x{size}, {steps} steps, {images} images a round on "
              f"{jax.device_count()} x {jax.devices()[0].device_kind} ({os.cpu_count()} cores): "
              f"{statistics.median(rates):.2f} images/s (rounds: {', '.join(f'{r:.2f}' for r in rates)}; "
              f"compiled in {compiled:.0f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=64, help="tiny Flux images per round")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-full", action="store_true", help="only the tiny model's images/s")
    args = parser.parse_args()
    if not args.skip_full:
        full_size()
    tiny(args.images, args.size, args.steps, args.rounds)


if __name__ == "__main__":
    main()
