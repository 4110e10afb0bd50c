"""Init images of image-to-image jobs: read from a path or storage URL, checked and digested
by the producer before a job is enqueued, and made by the worker into the pixels diffusers'
img2img pipelines start from (`diffusers.utils.load_image`, then `VaeImageProcessor`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import posixpath
import warnings

import numpy as np
import PIL.Image
import PIL.ImageOps

from renderfarm.jobs import JobError, JobSpec
from renderfarm.storage import open_storage

MAX_PIXELS = 8192 * 8192  # a larger image is refused, never decoded (a decompression bomb)
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff")  # an images source's files


def read_init_image(ref: str) -> bytes:
    """The bytes of `ref`: a local path, `file://` or `gs://` URL (through renderfarm.storage)."""
    folder, name = posixpath.split(ref.rstrip("/"))
    try:
        return open_storage(folder or ".").get(name)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, ValueError) as err:
        raise JobError("init_image", ref, f"must be a readable image file ({type(err).__name__})") from None


def open_init_image(data: bytes, ref: str) -> PIL.Image.Image:
    """The image as `diffusers.utils.load_image` gives it: EXIF orientation applied, RGB."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", PIL.Image.DecompressionBombWarning)
            image = PIL.Image.open(io.BytesIO(data))
            if image.width * image.height > MAX_PIXELS:
                raise JobError("init_image", ref, f"is {image.width}x{image.height}: at most {MAX_PIXELS} pixels")
            image.load()
    except (OSError, PIL.Image.DecompressionBombError, PIL.Image.DecompressionBombWarning) as err:
        raise JobError("init_image", ref, f"must be an image PIL can read ({err})") from None
    return PIL.ImageOps.exif_transpose(image).convert("RGB")


def check_init_image(spec: JobSpec, size_step: int) -> JobSpec:
    """The producer's check of an image job: its image exists and is an image; the spec gains
    the image's sha256 (so its id follows the pixels, not the path) and, where it names none,
    the image's own width and height rounded down to the size step."""
    if spec.init_image is None:
        return spec
    image, digest = load_init_image(spec)
    width, height = (spec.width or default_size(image.width, size_step, spec.init_image),
                     spec.height or default_size(image.height, size_step, spec.init_image))
    return dataclasses.replace(spec, init_image_sha256=digest, width=width, height=height)


def load_init_image(spec: JobSpec) -> tuple[PIL.Image.Image, str]:
    """A job's init image, opened, and its sha256; refused if the job names another digest
    (the file changed since the job was made, or the job was altered)."""
    data = read_init_image(spec.init_image)
    digest = hashlib.sha256(data).hexdigest()
    if spec.init_image_sha256 not in (None, digest):
        raise JobError("init_image", spec.init_image,
                       f"is not the image the job was made with: sha256 {digest}, not {spec.init_image_sha256}")
    return open_init_image(data, spec.init_image), digest


def default_size(pixels: int, size_step: int, ref: str) -> int:
    """An image side rounded down to the size step (at least one step), at most 2048."""
    if pixels < size_step:
        raise JobError("init_image", ref, f"is {pixels} pixels on a side: give width and height, or at least {size_step}")
    return min(pixels // size_step * size_step, 2048)


def init_pixels(image: PIL.Image.Image, width: int, height: int) -> np.ndarray:
    """(3, height, width) float32 in [-1, 1]: VaeImageProcessor's resize (PIL lanczos) and normalisation."""
    resized = image.resize((width, height), resample=PIL.Image.LANCZOS)
    return (np.asarray(resized, np.float32) / 255.0 * 2 - 1).transpose(2, 0, 1)
