"""PNG encoding fast enough to keep up with the devices.

Pillow's encoder picks a filter per row by trying all five and then deflates at level 6:
about 8 ms for a 256x256 image and 0.4 s for a 1024x1024 photo on one core here, which on
a host whose cores also feed the devices is time taken from rendering. This encoder
applies the Paeth filter to the whole image with NumPy and deflates at level 1 with the
run-length strategy, through zlib-ng (the same format and sizes as zlib, faster:
`bench/host.py png` prints both): several times faster than Pillow, and on photographs within a few percent of its
size (`bench/host.py png` measures both on real photos and on noise). In the worker the devices
filter (diffusion.generate.png_scanlines: nothing to them, a NumPy pass per image to the host),
so the host only deflates; NumPy and zlib-ng release the GIL, so the store threads encode
in parallel.

The output is a plain 8-bit RGB PNG that any decoder reads; the same pixels and text give
the same bytes.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np
from zlib_ng import zlib_ng

SIGNATURE = b"\x89PNG\r\n\x1a\n"
PAETH = 4  # the PNG filter type byte
BLOCK_BYTES = 32 * 1024  # rows filtered and deflated together: NumPy's temporaries stay in cache


def _chunk(kind: bytes, payload: bytes) -> bytes:
    crc = zlib.crc32(payload, zlib.crc32(kind))
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", crc)


def paeth_filter(rows: np.ndarray, channels: int, above: np.ndarray | None = None) -> np.ndarray:
    """Paeth-filtered scanlines, each led by its filter type byte.

    `rows` is (n, width * channels) uint8; `above` is the unfiltered row before the first
    (None: the top of the image, where PNG reads zeros). Encoding predicts from unfiltered bytes only, so the
    whole block is filtered at once (decoding is the sequential direction)."""
    n, width = rows.shape
    padded = np.zeros((n + 1, width + channels), np.int16)  # a zero column left, `above` on top
    if above is not None:
        padded[0, channels:] = above
    padded[1:, channels:] = rows
    x, a = padded[1:, channels:], padded[1:, :-channels]  # the byte, the one to its left
    b, c = padded[:-1, channels:], padded[:-1, :-channels]  # above, above-left
    pa, pb = b - c, a - c  # |p - a| and |p - b| once made absolute, with p = a + b - c
    pc = np.abs(pa + pb)
    np.abs(pa, out=pa)
    np.abs(pb, out=pb)
    predictor = np.where(pb <= pc, b, c)
    np.copyto(predictor, a, where=(pa <= pb) & (pa <= pc))
    out = np.empty((n, width + 1), np.uint8)
    out[:, 0] = PAETH
    np.subtract(x, predictor, out=out[:, 1:], casting="unsafe")  # modulo 256, as PNG wants
    return out


def encode_png(pixels: np.ndarray, text: dict[str, str] | None = None,
               scanlines: np.ndarray | None = None) -> bytes:
    """An RGB or RGBA PNG of `pixels` ((H, W, 3 or 4) uint8), with `text` as tEXt chunks
    (Latin-1 keys and values, as the PNG standard requires). `scanlines`, if given, are
    the pixels' rows already filtered ((H, 1 + W*C) uint8, each led by its filter type,
    as the devices return them: diffusion.generate.png_scanlines); only deflating is left."""
    if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] not in (3, 4):
        raise ValueError(f"pixels must be (H, W, 3 or 4) uint8, not {pixels.shape} {pixels.dtype}")
    height, width, channels = pixels.shape
    if scanlines is not None and (scanlines.dtype != np.uint8 or scanlines.shape != (height, 1 + width * channels)):
        raise ValueError(f"scanlines must be ({height}, {1 + width * channels}) uint8 for pixels of "
                         f"{pixels.shape}, not {scanlines.shape} {scanlines.dtype}")
    deflate = zlib_ng.compressobj(1, zlib_ng.DEFLATED, 15, 9, zlib_ng.Z_RLE)
    if scanlines is not None:
        parts = [deflate.compress(np.ascontiguousarray(scanlines))]
    else:
        rows = np.ascontiguousarray(pixels).reshape(height, width * channels)
        parts, above = [], None
        step = max(1, BLOCK_BYTES // (width * channels))
        for top in range(0, height, step):
            block = rows[top:top + step]
            parts.append(deflate.compress(paeth_filter(block, channels, above)))
            above = block[-1]
    parts.append(deflate.flush())
    color_type = 2 if channels == 3 else 6
    header = struct.pack(">IIBBBBB", width, height, 8, color_type, 0, 0, 0)
    texts = [_chunk(b"tEXt", key.encode("latin-1") + b"\0" + value.encode("latin-1"))
             for key, value in (text or {}).items()]
    return b"".join([SIGNATURE, _chunk(b"IHDR", header), *texts,
                     _chunk(b"IDAT", b"".join(parts)), _chunk(b"IEND", b"")])
