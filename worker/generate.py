"""Device-side code: the pure generate functions that the engine jits, one per model family.

They follow diffusers' Flax `_generate` step for step, with two changes the job contract
needs: each job's initial latents come from its own seed, and guidance is one value per
job (shape (B,)), so prompts, negatives, seeds and guidance never change the compiled
program. Everything static (family, scheduler, steps, size) is bound before `jax.jit`.

Each returns the images and their PNG scanlines: the byte-wise half of PNG encoding (the
Paeth filter) costs the devices next to nothing and the host's cores a pass per image, so
it is done here and the host only deflates (worker/png.py).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class Inputs(NamedTuple):
    """One padded batch. Leading axis B everywhere; sharded over devices."""

    prompt_ids: jax.Array  # (B, 77) int32; (B, 2, 77) for SDXL
    negative_ids: jax.Array  # same shape as prompt_ids
    has_negative: jax.Array  # (B,) bool: SDXL uses zero embeddings for an empty negative
    keys: jax.Array  # (B, 2) uint32: jax.random.PRNGKey(seed) of each job
    guidance: jax.Array  # (B,) float32


class Output(NamedTuple):
    """What a program returns for a batch."""

    images: jax.Array  # (B, H, W, 3) uint8
    scanlines: jax.Array  # (B, H, 1 + W*3) uint8: each row's PNG filter type, then its filtered bytes


class Static(NamedTuple):
    """What a compiled program is specialised on (the shape key, less the model)."""

    height: int
    width: int
    steps: int


def initial_latents(keys: jax.Array, shape: tuple[int, int, int]) -> jax.Array:
    """The reproducibility contract: normal(PRNGKey(seed), (1, C, h, w)) per job."""
    one = jax.vmap(lambda key: jax.random.normal(key, (1, *shape), jnp.float32))(keys)
    return one.reshape(keys.shape[0], *shape)


def png_scanlines(images: jax.Array) -> jax.Array:
    """PNG's Paeth filter (type 4) of every row, each led by its type byte, as
    `worker.png.paeth_filter` computes it on the host: a = left, b = up, c = up-left,
    the predictor the one of them nearest a + b - c, ties to a, then b."""
    batch, height, width, channels = images.shape
    x = images.reshape(batch, height, width * channels).astype(jnp.int16)
    left = ((0, 0), (0, 0), (channels, 0))
    a = jnp.pad(x, left)[:, :, :-channels]
    b = jnp.pad(x, ((0, 0), (1, 0), (0, 0)))[:, :-1]
    c = jnp.pad(b, left)[:, :, :-channels]
    pa, pb, pc = jnp.abs(b - c), jnp.abs(a - c), jnp.abs(a + b - 2 * c)
    predictor = jnp.where((pa <= pb) & (pa <= pc), a, jnp.where(pb <= pc, b, c))
    filtered = ((x - predictor) & 0xFF).astype(jnp.uint8)  # modulo 256, as PNG wants
    kind = jnp.full((batch, height, 1), 4, jnp.uint8)
    return jnp.concatenate([kind, filtered], axis=-1)


def _denoise(pipe: Any, scheduler: Any, sched_state: Any, params: Any, static: Static,
             inputs: Inputs, context: jax.Array, init_sigma_from_set: bool,
             added_cond_kwargs: dict[str, jax.Array] | None) -> Output:
    """The shared loop: classifier-free guidance with per-job scale, then VAE decode to uint8."""
    f = pipe.vae_scale_factor
    latents = initial_latents(
        inputs.keys, (pipe.unet.config.in_channels, static.height // f, static.width // f))
    guidance = inputs.guidance.astype(jnp.float32)[:, None, None, None]
    state = scheduler.set_timesteps(sched_state, num_inference_steps=static.steps, shape=latents.shape)
    # SD scales by the state before set_timesteps, SDXL after: mirror each pipeline exactly.
    latents = latents * (state if init_sigma_from_set else sched_state).init_noise_sigma
    extra = {} if added_cond_kwargs is None else {"added_cond_kwargs": added_cond_kwargs}

    def body(step: int, carry: tuple[jax.Array, Any]) -> tuple[jax.Array, Any]:
        latents, state = carry
        latents_input = jnp.concatenate([latents] * 2)
        t = jnp.array(state.timesteps, dtype=jnp.int32)[step]
        timestep = jnp.broadcast_to(t, latents_input.shape[0])
        latents_input = scheduler.scale_model_input(state, latents_input, t)
        noise = pipe.unet.apply(
            {"params": params["unet"]}, jnp.array(latents_input), jnp.array(timestep, dtype=jnp.int32),
            encoder_hidden_states=context, **extra,
        ).sample
        uncond, text = jnp.split(noise, 2, axis=0)
        noise = uncond + guidance * (text - uncond)
        return scheduler.step(state, noise, t, latents).to_tuple()

    latents, _ = jax.lax.fori_loop(0, static.steps, body, (latents, state))
    latents = 1 / pipe.vae.config.scaling_factor * latents
    image = pipe.vae.apply({"params": params["vae"]}, latents, method=pipe.vae.decode).sample
    image = (image / 2 + 0.5).clip(0, 1).transpose(0, 2, 3, 1)
    image = jnp.round(image * 255).astype(jnp.uint8)
    return Output(image, png_scanlines(image))


def generate_sd(pipe: Any, scheduler: Any, static: Static,
                params: Any, sched_state: Any, inputs: Inputs) -> Output:
    """SD 1.x / 2.x: one text encoder; the negative prompt is always encoded ("" included)."""
    cond = pipe.text_encoder(inputs.prompt_ids, params=params["text_encoder"])[0]
    uncond = pipe.text_encoder(inputs.negative_ids, params=params["text_encoder"])[0]
    context = jnp.concatenate([uncond, cond])
    return _denoise(pipe, scheduler, sched_state, params, static, inputs, context, False, None)


def generate_sdxl(pipe: Any, scheduler: Any, static: Static,
                  params: Any, sched_state: Any, inputs: Inputs) -> Output:
    """SDXL: two encoders, pooled embeddings and size conditioning; empty negative is zeros."""
    cond, pooled = pipe.get_embeddings(inputs.prompt_ids, params)
    neg, neg_pooled = pipe.get_embeddings(inputs.negative_ids, params)
    has_neg = inputs.has_negative
    neg = jnp.where(has_neg[:, None, None], neg, jnp.zeros_like(neg))
    neg_pooled = jnp.where(has_neg[:, None], neg_pooled, jnp.zeros_like(neg_pooled))
    size = (static.height, static.width)
    time_ids = pipe._get_add_time_ids(size, (0, 0), size, cond.shape[0], dtype=cond.dtype)
    context = jnp.concatenate([neg, cond], axis=0)
    added = {
        "text_embeds": jnp.concatenate([neg_pooled, pooled], axis=0),
        "time_ids": jnp.concatenate([time_ids, time_ids], axis=0),
    }
    return _denoise(pipe, scheduler, sched_state, params, static, inputs, context, True, added)


GENERATORS = {"sd": generate_sd, "sdxl": generate_sdxl}
