"""PNG encoding: the worker's encoder (worker/png.py: Paeth filter, zlib level 1 with the
run-length strategy) against Pillow's default (a filter chosen per row, zlib level 6), in
CPU milliseconds per image on one core and in size. Not a test. "ours" filters on the host;
"deflate" is what is left to the host in the worker, whose devices filter the rows, through
zlib-ng; "zlib" is the same deflate through Python's zlib (same settings, same sizes).
Then the gallery's share of the photographs: a thumbnail (box-reduced first, as the worker
makes it, against Lanczos from full size) and the contact sheet's PNG (zlib level 1, as
the worker saves it, against `optimize=True`).

Images: noise at 256x256 (what the tiny model renders) and 1024x1024, and photographs
shipped inside scikit-image (`make bench` installs it; `pip install .[bench]`), at their
own sizes and one scaled to 1024x1024 (SDXL's size). Generated images are photo-like:
the photographs are the figure that says what the encoder costs in storage.

Usage: PYTHONPATH=. python bench/png.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import io
import statistics
import time
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
from PIL import Image

from renderfarm.gallery import THUMB_SIZE, contact_sheet, make_thumbnail
from worker.png import encode_png, paeth_filter

PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field", "retina")


def images() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out = {f"noise {n}x{n}": rng.integers(0, 256, (n, n, 3), dtype=np.uint8) for n in (256, 1024)}
    try:
        from skimage import data
    except ImportError:
        print("scikit-image is not installed (pip install .[bench]): noise only")
        return out
    for name in PHOTOS:
        pixels = np.ascontiguousarray(getattr(data, name)()[..., :3])
        out[f"{name} {pixels.shape[1]}x{pixels.shape[0]}"] = pixels
    big = Image.fromarray(out["astronaut 512x512"]).resize((1024, 1024), Image.Resampling.LANCZOS)
    out["astronaut 1024x1024 (scaled)"] = np.asarray(big)
    return out


def pillow_png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def cpu_ms(encode: Callable[[Any], Any], subject: Any, repeats: int) -> float:
    """Median CPU milliseconds of one call (CPU time: the figure that competes with the
    devices on a host whose cores are also its devices)."""
    times = []
    for _ in range(repeats):
        start = time.process_time()
        encode(subject)
        times.append(time.process_time() - start)
    return 1000 * statistics.median(times)


def zlib_deflate(rows: np.ndarray) -> bytes:
    """The worker's deflate settings through Python's own zlib."""
    deflate = zlib.compressobj(1, zlib.DEFLATED, 15, 9, zlib.Z_RLE)
    return deflate.compress(rows) + deflate.flush()


def lanczos_thumbnail(image: Image.Image) -> bytes:
    """The thumbnail as the worker made it before: Lanczos from full size."""
    thumb = image.convert("RGB")
    thumb.thumbnail((THUMB_SIZE, THUMB_SIZE), Image.Resampling.LANCZOS, reducing_gap=None)
    out = io.BytesIO()
    thumb.save(out, format="JPEG", quality=85)
    return out.getvalue()


def png_bytes(image: Image.Image, **options: Any) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG", **options)
    return out.getvalue()


def gallery(photos: list[np.ndarray], repeats: int) -> None:
    images = [Image.fromarray(p) for p in photos]
    box = statistics.median(cpu_ms(make_thumbnail, image, repeats) for image in images)
    lanczos = statistics.median(cpu_ms(lanczos_thumbnail, image, repeats) for image in images)
    print(f"thumbnail ({THUMB_SIZE} px JPEG), median over the photographs: box-reduced first {box:.2f} ms, "
          f"Lanczos from full size {lanczos:.2f} ms")
    thumbs = [make_thumbnail(images[i % len(images)]) for i in range(64)]
    with Image.open(io.BytesIO(contact_sheet(thumbs, len(thumbs)))) as sheet:
        sheet.load()
        fast, small = png_bytes(sheet, compress_level=1), png_bytes(sheet, optimize=True)
        fast_ms = cpu_ms(lambda im: png_bytes(im, compress_level=1), sheet, repeats)
        small_ms = cpu_ms(lambda im: png_bytes(im, optimize=True), sheet, repeats)
    print(f"contact sheet of 64 photo thumbnails ({sheet.width}x{sheet.height}): zlib level 1 {fast_ms:.0f} ms, "
          f"{len(fast) / 1024:.0f} KiB; optimize=True {small_ms:.0f} ms, {len(small) / 1024:.0f} KiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(f"{'image':30s} {'Pillow ms':>10s} {'ours ms':>9s} {'deflate ms':>11s} {'zlib ms':>8s} "
          f"{'speed-up':>9s} {'Pillow KiB':>11s} {'ours KiB':>9s} {'size':>6s}")
    photo_sizes, photos = [0, 0], []
    for name, pixels in images().items():
        ours, theirs = encode_png(pixels), pillow_png(pixels)
        decoded = np.asarray(Image.open(io.BytesIO(ours)))
        if not np.array_equal(decoded, pixels):
            raise SystemExit(f"{name}: the PNG does not decode to its pixels")
        height, width, _ = pixels.shape
        rows = paeth_filter(pixels.reshape(height, width * 3), 3)
        theirs_ms, ours_ms = cpu_ms(pillow_png, pixels, args.repeats), cpu_ms(encode_png, pixels, args.repeats)
        deflate_ms = cpu_ms(lambda p: encode_png(p, scanlines=rows), pixels, args.repeats)
        zlib_ms = cpu_ms(zlib_deflate, rows, args.repeats)
        print(f"{name:30s} {theirs_ms:10.1f} {ours_ms:9.1f} {deflate_ms:11.1f} {zlib_ms:8.1f} "
              f"{theirs_ms / ours_ms:8.1f}x {len(theirs) / 1024:11.1f} {len(ours) / 1024:9.1f} "
              f"{len(ours) / len(theirs):6.3f}")
        if not name.startswith("noise"):
            photo_sizes[0] += len(theirs)
            photo_sizes[1] += len(ours)
            photos.append(pixels)
    if photos:
        print(f"photographs, all together: ours / Pillow's size = {photo_sizes[1] / photo_sizes[0]:.3f}")
        gallery(photos, args.repeats)


if __name__ == "__main__":
    main()
