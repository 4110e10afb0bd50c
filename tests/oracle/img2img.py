"""Reference images for image-to-image jobs: diffusers' `StableDiffusionImg2ImgPipeline`
(`StableDiffusionXLImg2ImgPipeline` for sdxl, no aesthetic score: its size conditions the job's size).

`write(data)` rebuilds `data/img2img/` from the tiny SD checkpoints tests/oracle/pipelines.py wrote
(`data/oracle/<family>/model`, read back with `from_pretrained`, never rebuilt here):

    img2img/init-exif.png, init.png      the init images: one stored 96x72 with EXIF orientation 6
                                         (72x96 once transposed), one 64x64 without EXIF
    img2img/<family>/<scheduler>/<i>.png one pipeline call per job, batch size 1
    img2img/jobs.json                    every job: its fields, init image and strength, relative to data/

Each init image is read as `diffusers.utils.load_image` reads it (EXIF orientation applied, RGB) and
resized to the job's size by the pipeline's own `image_processor.resize` (PIL lanczos). The pipeline
draws two noises from its generator; here both are the contract's (docs/design.md): the VAE's latent
sample `normal(fold_in(PRNGKey(seed), 2**20))` (`randn_tensor` of diffusers' vae module) and the
noise `add_noise` mixes in, the contract's initial latents `normal(PRNGKey(seed))` (`randn_tensor`
of the img2img pipeline's module, the XL one's for sdxl). The jobs of a set share a batch on the farm, strengths mixed.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import shutil
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import PIL.Image
import torch
from diffusers import StableDiffusionImg2ImgPipeline, StableDiffusionXLImg2ImgPipeline
from diffusers.models.autoencoders import vae as vae_module
from diffusers.pipelines.stable_diffusion import (
    pipeline_stable_diffusion_img2img as img2img_module,
)
from diffusers.pipelines.stable_diffusion_xl import (
    pipeline_stable_diffusion_xl_img2img as xl_img2img_module,
)
from diffusers.utils import load_image

from tests.oracle import pipelines
from tests.oracle.pipelines import NATIVE, STEPS
from tests.oracle.noise import seeded_noise
from tests.oracle.schedulers import CLASSES

LATENT_SAMPLE_FOLD = 2**20  # diffusion.generate.LATENT_SAMPLE_FOLD (the oracle imports nothing of the farm)
# Two schedulers a family, six in all: multistep (pndm, sd1's own, and dpm), stochastic (euler_a,
# lcm) and single-step (ddim, euler). Each scheduler's arithmetic from every start is checked
# against PyTorch's by tests/test_schedulers.py on a fake UNet; these sets check the pipelines.
SCHEDULERS = {"sd1": ("pndm", "euler_a"), "sd2": ("ddim", "lcm"), "sdxl": ("euler", "dpm")}
# One batch per (family, scheduler): strengths and images mixed. With 4 steps, strength s starts at
# loop index 4 - int(4 s): 0.3 -> 3, 0.5 -> 2, 0.8 -> 1, 1.0 -> 0.
JOBS: tuple[dict[str, Any], ...] = (
    {"prompt": "a watercolour of a harbour", "negative_prompt": None, "seed": 0, "guidance_scale": 7.5,
     "strength": 0.8, "init_image": "img2img/init-exif.png"},
    {"prompt": "a red fox in fresh snow", "negative_prompt": "blurry", "seed": 1, "guidance_scale": 3.0,
     "strength": 0.5, "init_image": "img2img/init.png"},
    {"prompt": "Portrait of an old sailor", "negative_prompt": None, "seed": 2, "guidance_scale": 12.0,
     "strength": 0.3, "init_image": "img2img/init-exif.png"},
    {"prompt": "a bowl of ramen", "negative_prompt": "", "seed": 2**32 - 1, "guidance_scale": 5.0,
     "strength": 1.0, "init_image": "img2img/init.png"},
    {"prompt": "a city street in the rain", "negative_prompt": None, "seed": 77, "guidance_scale": 7.5,
     "strength": 0.8, "init_image": "img2img/init.png"},
    {"prompt": "a lighthouse on a cliff at dusk", "negative_prompt": None, "seed": 5, "guidance_scale": 4.0,
     "strength": 0.5, "init_image": "img2img/init-exif.png"},
)


def _init_images(root: pathlib.Path) -> None:
    """Two smooth, coloured test pictures; the first stored sideways with EXIF orientation 6."""
    y, x = np.mgrid[0:72, 0:96].astype(np.float32)
    sideways = np.stack([x / 95 * 255, y / 71 * 255, 128 + 100 * np.sin(x / 9) * np.cos(y / 7)], -1)
    exif = PIL.Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 degrees clockwise to display
    PIL.Image.fromarray(sideways.clip(0, 255).astype(np.uint8)).save(root / "init-exif.png", exif=exif.tobytes())
    y, x = np.mgrid[0:64, 0:64].astype(np.float32)
    disc = ((x - 28) ** 2 + (y - 36) ** 2 < 300).astype(np.float32)
    square = np.stack([200 * disc + 30, 80 + x * 2, 220 - 150 * disc], -1)
    PIL.Image.fromarray(square.clip(0, 255).astype(np.uint8)).save(root / "init.png")


def _contract(key: jax.Array, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.from_numpy(np.array(jax.random.normal(key, shape, jnp.float32)))


@contextlib.contextmanager
def contract_draws(seed: int, pipeline_module: Any = img2img_module,
                   vae_folds: tuple[int, ...] = (LATENT_SAMPLE_FOLD,)) -> Iterator[None]:
    """The pipeline's draws replaced by the contract's: the VAE's latent samples, in the order the
    pipeline encodes, each from its fold of the job's key; the noise the pipeline's module draws,
    the contract's latents. Every fold must be drawn."""
    key = jax.random.PRNGKey(seed)
    folds = list(vae_folds)
    draws = {vae_module: lambda shape: _contract(jax.random.fold_in(key, folds.pop(0)), shape),
             pipeline_module: lambda shape: _contract(key, shape)}
    originals = {module: module.randn_tensor for module in draws}
    for module, draw in draws.items():
        module.randn_tensor = lambda shape, *_, dtype=None, _draw=draw, **__: _draw(tuple(shape)).to(dtype=dtype)
    try:
        yield
    finally:
        for module, original in originals.items():
            module.randn_tensor = original
    if folds:
        raise AssertionError(f"the pipeline drew fewer VAE samples than the contract's folds {vae_folds}")


def render(pipe: StableDiffusionImg2ImgPipeline | StableDiffusionXLImg2ImgPipeline, data: pathlib.Path,
           job: dict[str, Any], size: tuple[int, int]) -> np.ndarray:
    """One image job: (height, width, 3) uint8."""
    width, height = size
    image = pipe.image_processor.resize(load_image(str(data / job["init_image"])), height, width)
    module = xl_img2img_module if isinstance(pipe, StableDiffusionXLImg2ImgPipeline) else img2img_module
    with torch.no_grad(), contract_draws(job["seed"], module), seeded_noise(pipe.scheduler, job["seed"]):
        out = pipe(job["prompt"], image=image, strength=job["strength"], negative_prompt=job["negative_prompt"],
                   num_inference_steps=STEPS, guidance_scale=job["guidance_scale"], output_type="np").images[0]
    return (out * 255).round().astype(np.uint8)


def emptied(data: pathlib.Path, part: str) -> pathlib.Path:
    """An image part's folder under data/, emptied, with torch quiet and deterministic."""
    pipelines.quiet_and_deterministic()
    root = data / part
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    return root


def write_jobs(root: pathlib.Path, about: str, records: list[dict[str, Any]]) -> None:
    """A part's jobs.json: what it holds, the libraries' versions and every job."""
    doc = {"about": about, "versions": pipelines.versions(), "jobs": records}
    (root / "jobs.json").write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def write(data: pathlib.Path) -> None:
    """Rebuild data/img2img (see the module docstring)."""
    root = emptied(data, "img2img")
    _init_images(root)
    records: list[dict[str, Any]] = []
    for family, schedulers in SCHEDULERS.items():
        text = pipelines.load(data / "oracle" / family / "model", family)
        pipe = (StableDiffusionXLImg2ImgPipeline(**text.components, add_watermarker=False) if family == "sdxl"
                else StableDiffusionImg2ImgPipeline(**text.components))
        pipe.set_progress_bar_config(disable=True)
        for scheduler in schedulers:
            # as tests/oracle/pipelines.render makes it: afresh, from the model's own config
            pipe.scheduler = CLASSES[scheduler].from_config(text.oracle_scheduler_config)
            for index, job in enumerate(JOBS):
                image = f"img2img/{family}/{scheduler}/{index}.png"
                pipelines._save_png(data / image, render(pipe, data, job, NATIVE))
                records.append(pipelines.job_record(
                    f"img2img/{family}/{scheduler}", index, f"oracle/{family}/model", None, scheduler, job, STEPS,
                    NATIVE, image, init_image=job["init_image"], strength=job["strength"]))
    write_jobs(root, "StableDiffusionImg2ImgPipeline (StableDiffusionXLImg2ImgPipeline for sdxl) on the tiny checkpoints, float32, CPU, batch size 1, with "
                     "the contract's noises (tests/oracle/img2img.py); paths relative to tests/data.", records)
