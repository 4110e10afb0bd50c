"""Reference images for inpainting jobs: diffusers' `StableDiffusionInpaintPipeline`
(`StableDiffusionXLInpaintPipeline` for sdxl, no aesthetic score: its size conditions the job's size).

`write(data)` rebuilds `data/inpaint/` from the tiny SD checkpoints tests/oracle/pipelines.py wrote
(`data/oracle/<family>/model`) and img2img's init images (`data/img2img/`, tests/oracle/img2img.py):

    inpaint/sd1-inpainting/model       a tiny inpainting checkpoint: sd1's text encoder, tokenizer,
                                       VAE and scheduler with a 9-channel UNet of its own (latents,
                                       mask, masked image's latents), as sd-1.5-inpainting
    inpaint/sdxl-inpainting/model      the same of sdxl's, as stable-diffusion-xl-1.0-inpainting-0.1
    inpaint/mask.png, mask-small.png   the masks (white repaints), soft-edged so that binarizing
                                       at 0.5 matters: one 64x64 grayscale for init.png, one 36x48
                                       RGB for init-exif.png (72x96 once turned: half its size)
    inpaint/<model>/<scheduler>/<i>.png one pipeline call per job, batch size 1
    inpaint/jobs.json                  every job: its fields, images and strength, relative to data/

The pipeline reads the image and mask as `diffusers.utils.load_image` gives them and resizes both
itself (its image and mask processors). Its draws are the contract's (docs/design.md): the noise
its module draws is the job's initial latents, and each VAE latent sample (the init image's, then
the masked image's, in the order the pipeline encodes them) is drawn from its fold of the job's key.
A 4-channel UNet's pipeline encodes both; a 9-channel one's skips the init image at strength 1.
A job without a strength is the contract's default, 1.0: the SD pipeline's own default too, so it is
not passed there, while the XL pipeline, whose default is 0.9999, is given it.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import numpy as np
import PIL.Image
import torch
from diffusers import StableDiffusionInpaintPipeline, StableDiffusionXLInpaintPipeline
from diffusers.pipelines.stable_diffusion import (
    pipeline_stable_diffusion_inpaint as inpaint_module,
)
from diffusers.pipelines.stable_diffusion_xl import (
    pipeline_stable_diffusion_xl_inpaint as xl_inpaint_module,
)
from diffusers.utils import load_image

from tests.oracle import pipelines
from tests.oracle.img2img import LATENT_SAMPLE_FOLD, contract_draws, emptied, write_jobs
from tests.oracle.pipelines import NATIVE, STEPS
from tests.oracle.noise import seeded_noise
from tests.oracle.schedulers import CLASSES

MASKED_SAMPLE_FOLD = LATENT_SAMPLE_FOLD + 1  # diffusion.generate.MASKED_SAMPLE_FOLD
DEFAULT_STRENGTH = 1.0  # an inpainting job's without one (renderfarm.jobs)
INPAINTING_SEED = 150  # the 9-channel UNet's weights
# (model folder relative to data/, scheduler) of each set: a batch on the farm, strengths mixed.
INPAINTING = "inpaint/sd1-inpainting/model"
XL_INPAINTING = "inpaint/sdxl-inpainting/model"  # as diffusers/stable-diffusion-xl-1.0-inpainting-0.1
SETS = (("oracle/sd1/model", "lms"), ("oracle/sd1/model", "euler_a"), ("oracle/sd2/model", "dpm"),
        (INPAINTING, "euler"), ("oracle/sdxl/model", "ddim"), (XL_INPAINTING, "pndm"))
# With 4 steps, strength s starts at loop index 4 - int(4 s): 1.0 -> 0 (from noise alone), 0.8 and
# 0.75 -> 1, 0.5 -> 2, 0.3 -> 3. A strength of None is the contract's default, 1.0.
JOBS: tuple[dict[str, Any], ...] = (
    {"prompt": "a watercolour of a harbour", "negative_prompt": None, "seed": 0, "guidance_scale": 7.5,
     "strength": None, "init_image": "img2img/init.png", "mask_image": "inpaint/mask.png"},
    {"prompt": "a red fox in fresh snow", "negative_prompt": "blurry", "seed": 1, "guidance_scale": 3.0,
     "strength": 0.75, "init_image": "img2img/init-exif.png", "mask_image": "inpaint/mask-small.png"},
    {"prompt": "Portrait of an old sailor", "negative_prompt": None, "seed": 2, "guidance_scale": 12.0,
     "strength": 0.5, "init_image": "img2img/init.png", "mask_image": "inpaint/mask.png"},
    {"prompt": "a bowl of ramen", "negative_prompt": "", "seed": 2**32 - 1, "guidance_scale": 5.0,
     "strength": 1.0, "init_image": "img2img/init-exif.png", "mask_image": "inpaint/mask-small.png"},
    {"prompt": "a city street in the rain", "negative_prompt": None, "seed": 77, "guidance_scale": 7.5,
     "strength": 0.3, "init_image": "img2img/init-exif.png", "mask_image": "inpaint/mask-small.png"},
    {"prompt": "a lighthouse on a cliff at dusk", "negative_prompt": None, "seed": 5, "guidance_scale": 4.0,
     "strength": 0.8, "init_image": "img2img/init.png", "mask_image": "inpaint/mask.png"},
)


def _masks(root: pathlib.Path) -> None:
    """Two soft-edged masks: a disc in grayscale (64x64), a slanted band in RGB (36x48)."""
    y, x = np.mgrid[0:64, 0:64].astype(np.float32)
    disc = np.clip((20 - np.hypot(x - 34, y - 28)) / 6 + 0.5, 0, 1)
    PIL.Image.fromarray((disc * 255).round().astype(np.uint8), mode="L").save(root / "mask.png")
    y, x = np.mgrid[0:48, 0:36].astype(np.float32)
    band = np.clip((x + 0.6 * y - 30) / 5, 0, 1)
    rgb = np.stack([band * 255, band * 230, band * 250], -1)  # not grey: the mask processor's grayscale matters
    PIL.Image.fromarray(rgb.round().astype(np.uint8)).save(root / "mask-small.png")


def _inpainting_model(data: pathlib.Path, family: str, folder: pathlib.Path) -> None:
    """`family`'s tiny checkpoint (sd1 or sdxl) with a 9-channel UNet, saved as an inpainting
    pipeline and read back."""
    text = pipelines.load(data / "oracle" / family / "model", family)
    components = {**text.components, "unet": pipelines.unet(family, INPAINTING_SEED, in_channels=9)}
    if family == "sdxl":
        pipe = StableDiffusionXLInpaintPipeline(**components, requires_aesthetics_score=False,
                                                force_zeros_for_empty_prompt=True, add_watermarker=False)
    else:
        pipe = StableDiffusionInpaintPipeline(**components, requires_safety_checker=False)
    pipelines.save(pipe, folder, family)
    pipelines._check_same_weights(_load(folder), pipelines._state(pipe), str(folder))


def _load(folder: pathlib.Path) -> StableDiffusionInpaintPipeline | StableDiffusionXLInpaintPipeline:
    """A checkpoint's inpaint pipeline: the XL one for an SDXL folder (requires_aesthetics_score off, as
    for a base model, and no watermark)."""
    if json.loads((folder / "model_index.json").read_text())["_class_name"].startswith("StableDiffusionXL"):
        pipe = StableDiffusionXLInpaintPipeline.from_pretrained(folder, torch_dtype=torch.float32,
                                                                add_watermarker=False)
    else:
        pipe = StableDiffusionInpaintPipeline.from_pretrained(folder, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def render(pipe: StableDiffusionInpaintPipeline | StableDiffusionXLInpaintPipeline, data: pathlib.Path,
           job: dict[str, Any], size: tuple[int, int]) -> np.ndarray:
    """One inpainting job: (height, width, 3) uint8."""
    width, height = size
    xl = isinstance(pipe, StableDiffusionXLInpaintPipeline)
    given = DEFAULT_STRENGTH if job["strength"] is None and xl else job["strength"]
    strength = {} if given is None else {"strength": given}
    encodes_image = pipe.unet.config.in_channels == 4 or given not in (None, 1.0)
    folds = (LATENT_SAMPLE_FOLD, MASKED_SAMPLE_FOLD) if encodes_image else (MASKED_SAMPLE_FOLD,)
    module = xl_inpaint_module if xl else inpaint_module
    with torch.no_grad(), contract_draws(job["seed"], module, folds), seeded_noise(pipe.scheduler, job["seed"]):
        out = pipe(job["prompt"], image=load_image(str(data / job["init_image"])),
                   mask_image=load_image(str(data / job["mask_image"])), height=height, width=width,
                   negative_prompt=job["negative_prompt"], num_inference_steps=STEPS,
                   guidance_scale=job["guidance_scale"], output_type="np", **strength).images[0]
    return (out * 255).round().astype(np.uint8)


def write(data: pathlib.Path) -> None:
    """Rebuild data/inpaint (see the module docstring)."""
    root = emptied(data, "inpaint")
    _masks(root)
    _inpainting_model(data, "sd1", data / INPAINTING)
    _inpainting_model(data, "sdxl", data / XL_INPAINTING)
    records: list[dict[str, Any]] = []
    for model, scheduler in SETS:
        pipe = _load(data / model)
        pipe.scheduler = CLASSES[scheduler].from_config(pipe.scheduler.config)
        name = model.split("/")[-2]
        for index, job in enumerate(JOBS):
            image = f"inpaint/{name}/{scheduler}/{index}.png"
            pipelines._save_png(data / image, render(pipe, data, job, NATIVE))
            records.append(pipelines.job_record(
                f"inpaint/{name}/{scheduler}", index, model, None, scheduler, job, STEPS, NATIVE, image,
                init_image=job["init_image"], mask_image=job["mask_image"], strength=job["strength"],
                in_channels=pipe.unet.config.in_channels))
    write_jobs(root, "StableDiffusionInpaintPipeline on the tiny checkpoints (4-channel sd1 and sd2 UNets, and "
                     "inpaint/sd1-inpainting's 9-channel one), StableDiffusionXLInpaintPipeline on sdxl's (4-channel) "
                     "and inpaint/sdxl-inpainting's (9-channel), "
                     "float32, CPU, batch size 1, with the contract's noises (tests/oracle/inpaint.py); strength null: "
                     "the contract's default, 1.0 (given to the XL pipeline, whose own is 0.9999); paths relative to "
                     "tests/data.",
               records)
