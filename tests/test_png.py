"""The worker's PNG encoder: any decoder reads back exactly the pixels and text it was
given, the same input gives the same bytes, and it compresses what can be compressed."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from PIL import Image

from renderfarm.jobs import parse_job
from worker.engine import Batch, Rendered, ShapeKey
from worker.output import result_png
from worker.png import BLOCK_BYTES, encode_png, paeth_filter


def decode(png: bytes) -> tuple[np.ndarray, dict[str, str]]:
    with Image.open(io.BytesIO(png)) as image:
        image.load()
        return np.asarray(image), dict(image.text)


def paeth_by_the_standard(rows: np.ndarray, channels: int) -> np.ndarray:
    """PNG spec 9.4, one byte at a time: the filter written independently of NumPy's."""
    height, width = rows.shape
    out = np.zeros((height, width + 1), np.uint8)
    for y in range(height):
        out[y, 0] = 4
        for x in range(width):
            a = int(rows[y, x - channels]) if x >= channels else 0
            b = int(rows[y - 1, x]) if y else 0
            c = int(rows[y - 1, x - channels]) if x >= channels and y else 0
            p = a + b - c
            pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
            predictor = a if pa <= pb and pa <= pc else b if pb <= pc else c
            out[y, x + 1] = (int(rows[y, x]) - predictor) % 256
    return out


@pytest.mark.parametrize("channels", [3, 4])
def test_the_paeth_filter_is_the_standard_one(channels: int) -> None:
    rng = np.random.default_rng(channels)
    rows = rng.integers(0, 256, (7, 5 * channels), dtype=np.uint8)
    rows[2:4] = rows[1]  # ties between predictors too
    assert np.array_equal(paeth_filter(rows, channels), paeth_by_the_standard(rows, channels))


@pytest.mark.parametrize("shape", [(1, 1, 3), (2, 3, 4), (64, 64, 3), (300, 451, 3), (97, 130, 4)])
def test_any_decoder_reads_back_the_pixels_and_the_text(shape: tuple[int, int, int]) -> None:
    rng = np.random.default_rng(sum(shape))
    pixels = rng.integers(0, 256, shape, dtype=np.uint8)
    pixels[: shape[0] // 2] //= 16  # half noise, half flat-ish: both paths of the predictor
    pixels = np.ascontiguousarray(pixels)
    text = {"renderfarm": json.dumps({"prompt": "a fox", "seed": 3}), "note": "caf\xe9"}
    png = encode_png(pixels, text)
    got, got_text = decode(png)
    assert got.shape == shape and np.array_equal(got, pixels)
    assert got_text == text


def test_images_taller_than_a_block_filter_across_block_edges() -> None:
    width = 256
    rows_per_block = BLOCK_BYTES // (width * 3)
    y, x = np.mgrid[0:3 * rows_per_block + 5, 0:width]
    pixels = np.stack([(x + y) % 256, (x * 3) % 256, (y * 7) % 256], axis=-1).astype(np.uint8)
    assert np.array_equal(decode(encode_png(pixels))[0], pixels)


def test_same_pixels_same_bytes_and_a_view_is_encoded_as_its_pixels() -> None:
    rng = np.random.default_rng(1)
    pixels = rng.integers(0, 256, (40, 80, 3), dtype=np.uint8)
    assert encode_png(pixels, {"k": "v"}) == encode_png(pixels.copy(), {"k": "v"})
    assert encode_png(pixels, {"k": "v"}) != encode_png(pixels, {"k": "w"})
    view = pixels[:, ::2]  # not contiguous
    assert np.array_equal(decode(encode_png(view))[0], view)


def test_smooth_images_compress_and_noise_costs_little_more_than_raw() -> None:
    y, x = np.mgrid[0:256, 0:256]
    smooth = np.stack([x, y, (x + y) // 2], axis=-1).astype(np.uint8)
    assert len(encode_png(smooth)) < smooth.nbytes / 4  # unfiltered, zlib leaves it at 0.94
    noise = np.random.default_rng(2).integers(0, 256, (256, 256, 3), dtype=np.uint8)
    assert len(encode_png(noise)) < noise.nbytes * 1.01 + 1024


@pytest.mark.parametrize("pixels", [np.zeros((4, 4, 3), np.float32), np.zeros((4, 4), np.uint8),
                                    np.zeros((4, 4, 2), np.uint8)])
def test_what_is_not_rgb_bytes_is_refused_by_shape_and_dtype(pixels: np.ndarray) -> None:
    with pytest.raises(ValueError, match=r"must be \(H, W, 3 or 4\) uint8"):
        encode_png(pixels)


def test_scanlines_filtered_elsewhere_are_deflated_as_given_and_must_fit_the_pixels() -> None:
    pixels = np.random.default_rng(4).integers(0, 256, (6, 5, 3), dtype=np.uint8)
    rows = pixels.reshape(6, 15)
    filtered = paeth_filter(rows, 3)
    assert encode_png(pixels, {"k": "v"}, scanlines=filtered) == encode_png(pixels, {"k": "v"})
    unfiltered = np.concatenate([np.zeros((6, 1), np.uint8), rows], axis=1)  # filter type 0: none
    assert np.array_equal(decode(encode_png(pixels, scanlines=unfiltered))[0], pixels)
    with pytest.raises(ValueError, match=r"scanlines must be \(6, 16\) uint8 for pixels of \(6, 5, 3\), not \(6, 15\)"):
        encode_png(pixels, scanlines=rows)


def test_a_stored_image_carries_its_job_spec() -> None:
    spec = parse_job({"prompt": "a lighthouse at dawn", "model": "m", "seed": 7, "width": 64, "height": 64,
                      "campaign": "c"})
    pixels = np.random.default_rng(3).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    rendered = Rendered(0, spec, pixels, ShapeKey(64, 64, 25, "pndm"), False, Batch(0, 1, 8, 0.1))
    got, text = decode(result_png(rendered))
    assert np.array_equal(got, pixels)
    assert json.loads(text["renderfarm"]) == {"job_id": spec.job_id, **spec.to_dict()}
