"""Our model layer (diffusion/nn) against diffusers' / transformers' Flax modules, same weights,
same shapes: images/s of a whole render (text encoders on prompt and negative, the UNet on the
classifier-free guidance batch every step, the VAE decoder), and ms per UNet call for each
attention head layout of diffusion/nn/attention.py next to diffusers' Flax UNet. Not a test.

The models are tiny (diffusion/tiny.py's sizes, GroupNorm over 32 groups so the Flax UNet runs),
the weights random, the images 256x256 (latents 32x32), a batch of 8 images (16 for the UNet).
The denoising loop is a fixed Euler-like stand-in, the same for both, so only the modules
differ. Each program is compiled and run once before timing; rounds alternate between the
two, and the figures are medians.

Usage: PYTHONPATH=. python bench/modules.py [--kinds sd,sdxl] [--size 256] [--batch 8] [--steps 4] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax.traverse_util import flatten_dict, unflatten_dict  # noqa: E402

from bench.flax_reference import quiet_diffusers  # noqa: E402
from diffusion.nn.attention import LAYOUTS, default_layout, use_layout  # noqa: E402
from diffusion.nn.clip import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection  # noqa: E402
from diffusion.nn.unet import UNet2DConditionModel, UNetConfig  # noqa: E402
from diffusion.nn.vae import AutoencoderKL, VAEConfig  # noqa: E402

TOKENS = 77
TEXT = {"vocab_size": 514, "hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2,
        "num_attention_heads": 4, "max_position_embeddings": TOKENS, "bos_token_id": 512, "eos_token_id": 2,
        "pad_token_id": 513}
UNET = {"sample_size": 8, "block_out_channels": (32, 64), "layers_per_block": 1,
        "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D"),
        "up_block_types": ("CrossAttnUpBlock2D", "UpBlock2D"), "attention_head_dim": (2, 4)}
CONFIGS: dict[str, dict[str, dict[str, Any]]] = {
    "sd": {"unet": {**UNET, "cross_attention_dim": 32}, "text": TEXT},
    "sdxl": {
        "unet": {**UNET, "cross_attention_dim": 64, "use_linear_projection": True, "addition_embed_type": "text_time",
                 "addition_time_embed_dim": 8, "projection_class_embeddings_input_dim": 32 + 6 * 8},
        "text": TEXT,
        "text_2": {**TEXT, "hidden_act": "gelu", "projection_dim": 32},
    },
}
VAE = {"block_out_channels": (8, 8, 16, 16), "down_block_types": ("DownEncoderBlock2D",) * 4,
       "up_block_types": ("UpDecoderBlock2D",) * 4, "layers_per_block": 1, "norm_num_groups": 8}


class Modules:
    """The components of one kind ("sd" or "sdxl") in one implementation, as plain functions of
    (params, inputs): `encode(params, ids) -> (context, pooled)`, `unet(params, x, t, context,
    pooled, time_ids)`, `decode(params, latents)`."""

    def __init__(self, kind: str, ours: bool) -> None:
        self.kind, self.ours = kind, ours
        cfg = CONFIGS[kind]
        if ours:
            self.unet_module = UNet2DConditionModel(UNetConfig.from_dict(cfg["unet"]))
            self.vae_module = AutoencoderKL(VAEConfig.from_dict(VAE))
            self.text_modules = [CLIPTextModel(CLIPTextConfig.from_dict(cfg["text"]))]
            if "text_2" in cfg:
                self.text_modules.append(CLIPTextModelWithProjection(CLIPTextConfig.from_dict(cfg["text_2"])))
        else:
            from diffusers import FlaxAutoencoderKL, FlaxUNet2DConditionModel
            from transformers import CLIPTextConfig as HFConfig
            from transformers import FlaxCLIPTextModel, FlaxCLIPTextModelWithProjection

            self.unet_module = FlaxUNet2DConditionModel(**cfg["unet"])
            self.vae_module = FlaxAutoencoderKL(**VAE)
            self.text_modules = [FlaxCLIPTextModel(HFConfig(**cfg["text"]), _do_init=False)]
            if "text_2" in cfg:
                self.text_modules.append(FlaxCLIPTextModelWithProjection(HFConfig(**cfg["text_2"]), _do_init=False))

    def shapes(self) -> dict[str, Any]:
        """The parameter trees' shapes, from diffusers' / transformers' initialisers (ours are the same)."""
        key = jax.random.PRNGKey(0)
        tree = {"unet": jax.eval_shape(self.unet_module.init_weights, key),
                "vae": jax.eval_shape(self.vae_module.init_weights, key)}
        for i, text in enumerate(self.text_modules):
            tree[f"text_{i}"] = jax.eval_shape(lambda k, m=text: m.init_weights(k, (1, TOKENS)), key)
        return tree

    def encode(self, params: dict, ids: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        """SD: the last hidden state. SDXL: both encoders' penultimate states, and the pooled projection."""
        if self.kind == "sd":
            if self.ours:
                return self.text_modules[0].apply({"params": params["text_0"]}, ids).last_hidden_state, None
            return self.text_modules[0](ids, params=params["text_0"])[0], None
        states = []
        for i, text in enumerate(self.text_modules):
            if self.ours:
                out = text.apply({"params": params[f"text_{i}"]}, ids)
                states.append(out.penultimate)
            else:
                out = text(ids, params=params[f"text_{i}"], output_hidden_states=True)
                states.append(out.hidden_states[-2])
        return jnp.concatenate(states, axis=-1), out.text_embeds

    def unet(self, params: dict, x: jax.Array, t: jax.Array, context: jax.Array, pooled: jax.Array | None,
             time_ids: jax.Array | None) -> jax.Array:
        added = None if pooled is None else {"text_embeds": pooled, "time_ids": time_ids}
        if self.ours:
            return self.unet_module.apply({"params": params["unet"]}, x, t.astype(jnp.float32), context, added)
        return self.unet_module.apply({"params": params["unet"]}, x, t, context, added).sample

    def decode(self, params: dict, latents: jax.Array) -> jax.Array:
        vae = self.vae_module
        out = vae.apply({"params": params["vae"]}, latents, method=vae.decode)
        return out if self.ours else out.sample


def random_params(shapes: Any) -> Any:
    """Fixed random values (LeCun-normal-like kernels, unit scales, zero biases), on the device."""
    rng = np.random.default_rng(0)
    flat = {}
    for path, leaf in sorted(flatten_dict(shapes).items()):
        if path[-1] == "bias":
            value = np.zeros(leaf.shape)
        elif path[-1] == "scale":
            value = np.ones(leaf.shape)
        else:
            value = rng.standard_normal(leaf.shape) / np.sqrt(np.prod(leaf.shape[:-1]))
        flat[path] = jnp.asarray(value, jnp.float32)
    return unflatten_dict(flat)


def render_fn(modules: Modules, steps: int, size: int) -> Callable[..., jax.Array]:
    """A jitted render of a batch: text, `steps` guided UNet calls, VAE decode to uint8."""

    def render(params: dict, ids: jax.Array, negative_ids: jax.Array, latents: jax.Array) -> jax.Array:
        context, pooled = modules.encode(params, jnp.concatenate([negative_ids, ids]))
        batch = latents.shape[0]
        time_ids = None
        if pooled is not None:
            time_ids = jnp.tile(jnp.array([[size, size, 0, 0, size, size]], jnp.float32), (2 * batch, 1))

        def step(i: jax.Array, latents: jax.Array) -> jax.Array:
            t = (999 - i * (1000 // steps)).astype(jnp.int32)
            noise = modules.unet(params, jnp.concatenate([latents] * 2), jnp.full((2 * batch,), t), context,
                                 pooled, time_ids)
            uncond, cond = jnp.split(noise, 2)
            return latents - 0.1 * (uncond + 7.5 * (cond - uncond))

        latents = jax.lax.fori_loop(0, steps, step, latents)
        images = modules.decode(params, latents / 0.18215)
        return jnp.round((images / 2 + 0.5).clip(0, 1) * 255).astype(jnp.uint8)

    return jax.jit(render)


def timed(fn: Callable[..., jax.Array], *args: Any) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def alternate(fns: dict[str, Callable[..., jax.Array]], args: tuple, rounds: int) -> dict[str, float]:
    """Median seconds per call of each function: compiled and run once first, then `rounds`
    rounds of one call each, in turn."""
    for fn in fns.values():
        timed(fn, *args)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(timed(fn, *args))
    return {name: statistics.median(ts) for name, ts in times.items()}


def bench_kind(kind: str, args: argparse.Namespace) -> None:
    with quiet_diffusers():
        impls = {"ours": Modules(kind, ours=True), "diffusers": Modules(kind, ours=False)}
        params = random_params(impls["diffusers"].shapes())
        rng = np.random.default_rng(1)
        ids = jnp.asarray(rng.integers(3, 512, (args.batch, TOKENS)), jnp.int32)
        negative_ids = jnp.asarray(rng.integers(3, 512, (args.batch, TOKENS)), jnp.int32)
        latent = args.size // 8
        latents = jnp.asarray(rng.standard_normal((args.batch, 4, latent, latent)), jnp.float32)

        renders = {name: render_fn(m, args.steps, args.size) for name, m in impls.items()}
        seconds = alternate(renders, (params, ids, negative_ids, latents), args.rounds)
        rate = {name: args.batch / s for name, s in seconds.items()}
        for name in renders:
            print(f"{kind:4s} {name:9s} render {rate[name]:7.2f} images/s  ({seconds[name] * 1e3:7.1f} ms a batch)")
        print(f"{kind:4s} ours/diffusers {rate['ours'] / rate['diffusers']:.2f}")

        # One UNet call on the guidance batch, per attention layout (a fresh jit for each: the
        # layout is read at trace time), next to diffusers' Flax UNet.
        context, pooled = jax.jit(impls["ours"].encode)(params, jnp.concatenate([negative_ids, ids]))
        x = jnp.concatenate([latents] * 2)
        t = jnp.full((2 * args.batch,), 500, jnp.int32)
        time_ids = None if pooled is None else jnp.tile(
            jnp.array([[args.size, args.size, 0, 0, args.size, args.size]], jnp.float32), (2 * args.batch, 1))
        unet_args = (params, x, t, context, pooled, time_ids)
        calls = {}
        for layout in LAYOUTS:
            with use_layout(layout):
                fresh = lambda *a: impls["ours"].unet(*a)  # noqa: E731
                calls[f"ours {layout}"] = jax.jit(fresh).lower(*unet_args).compile()
        calls["diffusers"] = jax.jit(impls["diffusers"].unet)
        unet_seconds = alternate(calls, unet_args, args.rounds)
        for name, s in unet_seconds.items():
            default = "  (default)" if name == f"ours {default_layout()}" else ""
            print(f"{kind:4s} unet {name:13s} {s * 1e3:7.1f} ms a call of {2 * args.batch}{default}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", default="sd,sdxl")
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8, help="images a batch (the UNet gets twice as many)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {os.cpu_count()} cores; {args.size}x{args.size}, "
          f"batch {args.batch}, {args.steps} steps, median of {args.rounds} rounds")
    for kind in args.kinds.split(","):
        bench_kind(kind, args)


if __name__ == "__main__":
    main()
