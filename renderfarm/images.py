"""Init images and masks of image jobs: read from a path or storage URL (renderfarm.sources
says what may be read), checked and digested by the producer before a job is enqueued, and
made by the worker into the pixels diffusers' img2img and inpaint pipelines start from
(`diffusers.utils.load_image`, then `VaeImageProcessor`: the image processor's for the image,
the mask processor's for the mask).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import warnings

import numpy as np
import PIL.Image
import PIL.ImageOps

from renderfarm.jobs import JobError, JobSpec
from renderfarm.sources import SourceRoots, read_source

MAX_PIXELS = 8192 * 8192  # a larger image is refused, never decoded (a decompression bomb)
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff")  # an images source's files


def open_image(data: bytes, ref: str, field: str = "init_image") -> PIL.Image.Image:
    """The image as `diffusers.utils.load_image` gives it: EXIF orientation applied, RGB."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", PIL.Image.DecompressionBombWarning)
            image = PIL.Image.open(io.BytesIO(data))
            if image.width * image.height > MAX_PIXELS:
                raise JobError(field, ref, f"is {image.width}x{image.height}: at most {MAX_PIXELS} pixels")
            image.load()
    except (OSError, PIL.Image.DecompressionBombError, PIL.Image.DecompressionBombWarning) as err:
        raise JobError(field, ref, f"must be an image PIL can read ({err})") from None
    return PIL.ImageOps.exif_transpose(image).convert("RGB")


def check_init_image(spec: JobSpec, size_step: int) -> JobSpec:
    """The producer's check of an image job: its image (and mask) exist and are images, the
    mask's shape fits the image's; the spec gains their sha256 (so its id follows the pixels,
    not the paths) and, where it names none, the image's own width and height rounded down to
    the size step."""
    if spec.init_image is None:
        return spec
    image, digest = load_init_image(spec)
    mask_digest = check_mask(spec, image)[1] if spec.mask_image is not None else None
    width, height = (spec.width or default_size(image.width, size_step, spec.init_image),
                     spec.height or default_size(image.height, size_step, spec.init_image))
    return dataclasses.replace(spec, init_image_sha256=digest, width=width, height=height,
                               mask_image_sha256=mask_digest)


def check_mask(spec: JobSpec, image: PIL.Image.Image,
               roots: SourceRoots | None = None) -> tuple[PIL.Image.Image, str]:
    """An inpainting job's mask read and held to its image: both are resized to the job's
    size, so the mask must have the image's aspect ratio (any scale of it); with its sha256."""
    mask, digest = load_mask_image(spec, roots)
    if mask.width * image.height != mask.height * image.width:
        raise JobError("mask_image", spec.mask_image,
                       f"is {mask.width}x{mask.height}: it must have its init image's shape, "
                       f"{image.width}x{image.height} (or that scaled)")
    return mask, digest


def load_init_image(spec: JobSpec, roots: SourceRoots | None = None) -> tuple[PIL.Image.Image, str]:
    """A job's init image, opened, and its sha256; refused if the job names another digest
    (the file changed since the job was made, or the job was altered). `roots`: a farm
    worker's source roots (renderfarm.sources); None reads what the caller's user names."""
    return _load(spec.init_image, spec.init_image_sha256, "init_image", roots)


def load_mask_image(spec: JobSpec, roots: SourceRoots | None = None) -> tuple[PIL.Image.Image, str]:
    """A job's mask, opened as its init image is, and its sha256 (checked as the image's)."""
    return _load(spec.mask_image, spec.mask_image_sha256, "mask_image", roots)


def _load(ref: str, expected: str | None, field: str, roots: SourceRoots | None) -> tuple[PIL.Image.Image, str]:
    data = read_source(ref, field, roots)
    digest = hashlib.sha256(data).hexdigest()
    if expected not in (None, digest):
        raise JobError(field, ref, f"is not the image the job was made with: sha256 {digest}, not {expected}")
    return open_image(data, ref, field), digest


def default_size(pixels: int, size_step: int, ref: str) -> int:
    """An image side rounded down to the size step (at least one step), at most 2048."""
    if pixels < size_step:
        raise JobError("init_image", ref, f"is {pixels} pixels on a side: give width and height, or at least {size_step}")
    return min(pixels // size_step * size_step, 2048)


def init_pixels(image: PIL.Image.Image, width: int, height: int) -> np.ndarray:
    """(3, height, width) float32 in [-1, 1]: VaeImageProcessor's resize (PIL lanczos) and normalisation."""
    resized = image.resize((width, height), resample=PIL.Image.LANCZOS)
    return (np.asarray(resized, np.float32) / 255.0 * 2 - 1).transpose(2, 0, 1)


def mask_pixels(mask: PIL.Image.Image, width: int, height: int) -> np.ndarray:
    """(1, height, width) float32, 1 where the job repaints: the inpaint pipelines' mask
    processor (VaeImageProcessor with do_convert_grayscale and do_binarize): the RGB mask
    resized (PIL lanczos), then grayscale, then 1 from 0.5 up and 0 below."""
    gray = mask.resize((width, height), resample=PIL.Image.LANCZOS).convert("L")
    return (np.asarray(gray, np.float32)[None] / 255.0 >= 0.5).astype(np.float32)
