"""Device-side code every family shares: the contract's latents, the denoising loop, the
VAE decode, and the PNG filter. A family (diffusion/families) encodes its prompts and calls
these; the engine jits the family's `generate` with everything static bound first.

The loop is diffusers' PyTorch pipelines' (StableDiffusionPipeline and the XL one), the
reference our images are held to, with two changes the job contract needs: each job's
initial latents come from its own seed, and guidance is one value per job (shape (B,)), so
prompts, negatives, seeds and guidance never change the compiled program. Like PyTorch,
jobs with a guidance scale <= 1 run no classifier-free guidance: they have programs of their
own (`Static.guided` is False) that encode no negative prompt and evaluate the UNet once a
step on the conditional input alone, half the work of a guided step.

Each program returns the images and their PNG scanlines: the byte-wise half of PNG encoding
(the Paeth filter) costs the devices next to nothing and the host's cores a pass per image,
so it is done here and the host only deflates (worker/png.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from diffusion.family import Networks
from diffusion.nn.unet import UNet2DConditionModel
from diffusion.nn.vae import AutoencoderKL
from diffusion.schedulers import Scheduler
from diffusion.sharding import tensor_parallel


class Inputs(NamedTuple):
    """One padded batch. Leading axis B everywhere; sharded over devices."""

    prompt_ids: jax.Array  # (B, T, 77) int32: one row per text encoder (T = 1 for SD 1.x/2.x)
    negative_ids: jax.Array  # same shape as prompt_ids
    has_negative: jax.Array  # (B,) bool: SDXL uses zero embeddings for an empty negative
    keys: jax.Array  # (B, 2) uint32: jax.random.PRNGKey(seed) of each job
    guidance: jax.Array  # (B,) float32


class ImageInputs(NamedTuple):
    """An image-to-image or inpainting batch: the family's text inputs, each job's init image
    (and mask) and the loop index its denoising starts at (diffusers' `get_timesteps`:
    steps - int(steps * strength)). The start is an input, not a static, so jobs of any
    strength share one program."""

    text: Inputs
    pixels: jax.Array  # (B, 3, H, W) float32 in [-1, 1], VaeImageProcessor's preprocess
    start: jax.Array  # (B,) int32
    mask: jax.Array | None = None  # inpainting (Static.mask): (B, 1, H, W) float32, 1 repaints

    @property
    def keys(self) -> jax.Array:
        return self.text.keys

    @property
    def guidance(self) -> jax.Array:
        return self.text.guidance


def text_inputs(inputs: Any) -> Any:
    """What a family's `encode` takes of a batch's inputs: an image batch's `text`, else all of them."""
    return inputs.text if isinstance(inputs, ImageInputs) else inputs


class ImageLatents(NamedTuple):
    """What an image job's loop starts from (`image_latents`)."""

    latents: jax.Array  # (B, C, h, w): the init image's scaled latents
    blend: jax.Array | None  # (B, 1, h, w): a UNet of C channels inpainting: the mask, 1 repaints
    condition: jax.Array | None  # (B, 1 + C, h, w): an inpainting UNet's: the mask, the masked image's latents


# The fold of a job's key its VAE latent sample draws from: past any step index the stochastic
# schedulers fold in (at most 500 steps), so no image job's draws repeat one another; an
# inpainting UNet's masked image draws its own sample from the next fold.
LATENT_SAMPLE_FOLD = 2**20
MASKED_SAMPLE_FOLD = LATENT_SAMPLE_FOLD + 1


class Output(NamedTuple):
    """What a program returns for a batch."""

    images: jax.Array  # (B, H, W, 3) uint8
    scanlines: jax.Array  # (B, H, 1 + W*3) uint8: each row's PNG filter type, then its filtered bytes


class Static(NamedTuple):
    """What a compiled program is specialised on (the shape key, less the model)."""

    height: int
    width: int
    steps: int
    guided: bool  # classifier-free guidance: every job's scale > 1
    image: bool = False  # image to image: the inputs are ImageInputs
    mask: bool = False  # inpainting (with image): ImageInputs with their mask


def initial_latents(keys: jax.Array, shape: tuple[int, int, int]) -> jax.Array:
    """The reproducibility contract: normal(PRNGKey(seed), (1, C, h, w)) per job."""
    one = jax.vmap(lambda key: jax.random.normal(key, (1, *shape), jnp.float32))(keys)
    return one.reshape(keys.shape[0], *shape)


def step_noise(keys: jax.Array, i: jax.Array, shape: tuple[int, int, int]) -> jax.Array:
    """The reproducibility contract's noise rule for stochastic schedulers: step i of a job
    adds normal(fold_in(PRNGKey(seed), i), (1, C, h, w)), its own whatever the batch."""
    one = jax.vmap(lambda key: jax.random.normal(jax.random.fold_in(key, i), (1, *shape), jnp.float32))(keys)
    return one.reshape(keys.shape[0], *shape)


def denoise(unet: UNet2DConditionModel, unet_params: Any, scheduler: Scheduler, static: Static,
            latent_shape: tuple[int, int, int], inputs: Inputs | ImageInputs, context: jax.Array,
            added: Mapping[str, jax.Array] | None, image: ImageLatents | None = None) -> jax.Array:
    """The sampling loop of diffusers' PyTorch UNet pipelines on the contract's latents, or
    (image to image, inpainting) from `image`'s latents noised to each job's start.
    Guided, `context` (and `added`) hold each job's unconditional row and then its conditional
    one (`guided_rows`); unguided, the conditional input alone. An inpainting UNet's extra
    input channels (`image.condition`) follow the scaled latents in every call."""
    condition = None if image is None else image.condition
    if condition is not None and static.guided:
        condition = guided_rows(condition, condition)

    def predict(model_input: jax.Array, t: jax.Array) -> jax.Array:
        if condition is not None:
            model_input = jnp.concatenate([model_input, condition], axis=1)
        return unet.apply({"params": unet_params}, model_input, t, context, added)

    if image is None:
        return sample(predict, scheduler, static, initial_latents(inputs.keys, latent_shape), inputs)
    return sample(predict, scheduler, static, image.latents, inputs, inputs.start, image.blend)


def sample(predict: Callable[[jax.Array, jax.Array], jax.Array], scheduler: Scheduler, static: Static,
           latents: jax.Array, inputs: Any, start: jax.Array | None = None,
           blend: jax.Array | None = None) -> jax.Array:
    """The loop every family shares, from `latents` (B, ...) with the denoiser `predict`
    (model input, timesteps (B,)) -> prediction; `inputs` gives the jobs' `keys` and
    `guidance`. Guided, each step predicts on each job's latents twice (`guided_rows`) and
    each job has its own scale. Latents and the scheduler's state stay float32
    whatever the denoiser computes in.

    With `start` ((B,) loop indices), `latents` are each job's image latents, noised here to
    its first timestep (the scheduler's `add_noise`, the contract's latents as the noise); the
    loop runs from the batch's earliest start and a job's latents change only from its own.
    A multistep scheduler's history is each job's own, from its start (`begin`), as diffusers'
    img2img pipelines start the scheduler part way.
    Inpainting (`static.mask`) as StableDiffusionInpaintPipeline: a job of strength 1 (start 0)
    starts from the noise alone, and with `blend` (the mask at the latents' size) each step's
    kept area is the image's latents noised to the next step's level (the last: not noised)."""
    state = scheduler.set_timesteps(static.steps, latents.shape)  # host side: constants
    first: jax.Array | int = 0
    rows = (-1, *[1] * (latents.ndim - 1))
    image = latents
    if start is None:
        latents = latents * state.init_noise_sigma
    else:
        noise = initial_latents(inputs.keys, latents.shape[1:])
        latents = scheduler.add_noise(state, image, noise, start)
        if static.mask:
            latents = jnp.where((start == 0).reshape(rows), noise * state.init_noise_sigma, latents)
        first = jnp.min(start)
    guidance = inputs.guidance.astype(jnp.float32).reshape(rows)
    last = state.timesteps.shape[0] - 1

    def body(i: jax.Array, carry: tuple[jax.Array, Any]) -> tuple[jax.Array, Any]:
        latents, state = carry
        model_input = scheduler.scale_model_input(state, guided_rows(latents, latents) if static.guided else latents, i)
        t = jnp.broadcast_to(state.timesteps[i], model_input.shape[:1])
        with tensor_parallel():  # the denoiser is the network a family splits
            prediction = predict(model_input, t).astype(jnp.float32)
        if static.guided:
            pairs = prediction.reshape(latents.shape[0], 2, *latents.shape[1:])
            uncond, text = pairs[:, 0], pairs[:, 1]
            prediction = uncond + guidance * (text - uncond)
        noise_arg = (step_noise(inputs.keys, i, latents.shape[1:]),) if scheduler.stochastic else ()
        begin = {"begin": start} if scheduler.history and start is not None else {}
        stepped, state = scheduler.step(state, prediction, i, latents, *noise_arg, **begin)
        if blend is not None:
            following = jnp.broadcast_to(jnp.minimum(i + 1, last), start.shape)
            kept = jnp.where(i < last, scheduler.add_noise(state, image, noise, following), image)
            stepped = (1 - blend) * kept + blend * stepped
        if start is not None:  # a job not started yet keeps its noised latents
            stepped = jnp.where((i >= start).reshape(rows), stepped, latents)
        return stepped, state

    latents, _ = jax.lax.fori_loop(first, state.timesteps.shape[0], body, (latents, state))
    return latents


def guided_rows(unconditional: jax.Array, conditional: jax.Array) -> jax.Array:
    """A guided denoiser call's input rows: each job's unconditional row, then its conditional
    one (2B rows). A job's pair stays together, so where the batch is split over devices each
    device holds both rows of its jobs and nothing moves between devices to pair them."""
    return jnp.stack([unconditional, conditional], axis=1).reshape(-1, *conditional.shape[1:])


def denoise_and_decode(nets: Networks, scheduler: Scheduler, static: Static, params: Any, inputs: Inputs,
                       context: jax.Array, added: Mapping[str, jax.Array] | None) -> Output:
    """What every family does once its prompts are encoded: the loop on the contract's
    latents (the UNet's channels, the size over the VAE's scale factor), then the VAE."""
    unet, vae = nets["unet"], nets["vae"]
    f = vae.config.scale_factor
    image = image_latents(unet, vae, params["vae"], static, inputs) if static.image else None
    latents = denoise(unet, params["unet"], scheduler, static,
                      (unet.config.in_channels, static.height // f, static.width // f), inputs, context, added, image)
    return decode(vae, params["vae"], latents)


def image_latents(unet: UNet2DConditionModel, vae: AutoencoderKL, vae_params: Any, static: Static,
                  inputs: ImageInputs) -> ImageLatents:
    """An image batch's start, as the img2img and inpaint pipelines make it: the init images'
    latents; inpainting, the mask at the latents' size (torch's nearest interpolation: each
    f x f block's top-left pixel), which a UNet of the latents' channels blends with and an
    inpainting UNet (more input channels) takes beside the masked image's latents (the
    image where the mask is below 0.5, grey elsewhere)."""
    latents = encode(vae, vae_params, inputs.pixels, inputs.keys)
    if not static.mask:
        return ImageLatents(latents, None, None)
    f = vae.config.scale_factor
    mask = inputs.mask[:, :, ::f, ::f]
    if unet.config.in_channels == latents.shape[1]:
        return ImageLatents(latents, mask, None)
    masked = encode(vae, vae_params, inputs.pixels * (inputs.mask < 0.5), inputs.keys, MASKED_SAMPLE_FOLD)
    return ImageLatents(latents, None, jnp.concatenate([mask, masked], axis=1))


def encode(vae: AutoencoderKL, vae_params: Any, pixels: jax.Array, keys: jax.Array,
           fold: int = LATENT_SAMPLE_FOLD) -> jax.Array:
    """Images to scaled latents as diffusers' img2img and inpaint pipelines make them: a sample
    of the VAE's latent distribution, mean + std * normal(fold_in(PRNGKey(seed), fold)) per
    job, times scaling_factor."""
    mean, logvar = vae.apply({"params": vae_params}, pixels, method=vae.encode)
    mean, logvar = mean.astype(jnp.float32), logvar.astype(jnp.float32)
    folded = jax.vmap(lambda key: jax.random.fold_in(key, fold))(keys)
    noise = initial_latents(folded, mean.shape[1:])
    return vae.config.scaling_factor * (mean + jnp.exp(0.5 * logvar) * noise)


def decode(vae: AutoencoderKL, vae_params: Any, latents: jax.Array, shift: float = 0.0) -> Output:
    """Latents to uint8 pixels as the PyTorch pipelines' image processor makes them: the VAE
    decodes latents / scaling_factor + `shift` (Flux's pipeline adds the VAE's shift_factor;
    the SD pipelines add nothing)."""
    pixels = vae.apply({"params": vae_params}, latents / vae.config.scaling_factor + shift, method=vae.decode)
    image = (pixels.astype(jnp.float32) / 2 + 0.5).clip(0, 1).transpose(0, 2, 3, 1)
    image = jnp.round(image * 255).astype(jnp.uint8)
    return Output(image, png_scanlines(image))


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
