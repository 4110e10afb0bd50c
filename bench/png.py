"""PNG encoding: the worker's encoder (worker/png.py: Paeth filter, zlib level 1 with the
run-length strategy) against Pillow's default (a filter chosen per row, zlib level 6), in
CPU milliseconds per image on one core and in size. Not a test. "ours" filters on the host;
"deflate" is what is left to the host in the worker, whose devices filter the rows.

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
from collections.abc import Callable

import numpy as np
from PIL import Image

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


def cpu_ms(encode: Callable[[np.ndarray], bytes], pixels: np.ndarray, repeats: int) -> float:
    """Median CPU milliseconds of one encode (CPU time: the figure that competes with the
    devices on a host whose cores are also its devices)."""
    times = []
    for _ in range(repeats):
        start = time.process_time()
        encode(pixels)
        times.append(time.process_time() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(f"{'image':30s} {'Pillow ms':>10s} {'ours ms':>9s} {'deflate ms':>11s} {'speed-up':>9s} "
          f"{'Pillow KiB':>11s} {'ours KiB':>9s} {'size':>6s}")
    photo_sizes = [0, 0]
    for name, pixels in images().items():
        ours, theirs = encode_png(pixels), pillow_png(pixels)
        decoded = np.asarray(Image.open(io.BytesIO(ours)))
        if not np.array_equal(decoded, pixels):
            raise SystemExit(f"{name}: the PNG does not decode to its pixels")
        height, width, _ = pixels.shape
        rows = paeth_filter(pixels.reshape(height, width * 3), 3, np.zeros(width * 3, np.uint8))
        theirs_ms, ours_ms = cpu_ms(pillow_png, pixels, args.repeats), cpu_ms(encode_png, pixels, args.repeats)
        deflate_ms = cpu_ms(lambda p: encode_png(p, scanlines=rows), pixels, args.repeats)
        print(f"{name:30s} {theirs_ms:10.1f} {ours_ms:9.1f} {deflate_ms:11.1f} {theirs_ms / ours_ms:8.1f}x "
              f"{len(theirs) / 1024:11.1f} {len(ours) / 1024:9.1f} {len(ours) / len(theirs):6.3f}")
        if not name.startswith("noise"):
            photo_sizes[0] += len(theirs)
            photo_sizes[1] += len(ours)
    if photo_sizes[0]:
        print(f"photographs, all together: ours / Pillow's size = {photo_sizes[1] / photo_sizes[0]:.3f}")


if __name__ == "__main__":
    main()
