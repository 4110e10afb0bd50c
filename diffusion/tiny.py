"""Tiny random-weight pipelines for tests, demos and benchmarks, one recipe per family
(`Family.tiny`, made of diffusion/tiny_parts.py).

The real checkpoints are gigabytes and need network access; these folders are a few megabytes,
are built offline in a few seconds, and load through exactly the code real models load through
(diffusion.models).
"""

from __future__ import annotations

import os
import pathlib

from diffusion.families import FAMILIES


def build_tiny_model(out_dir: str | os.PathLike, kind: str = "sd", seed: int = 0) -> pathlib.Path:
    """Build a tiny random-weight text-to-image pipeline of family `kind` in `out_dir` (the
    family's own recipe, `Family.tiny`).

    Once compiled, it renders a batch of 64x64 images in tens of milliseconds on a CPU, so the
    whole farm can be exercised offline. The weights depend only on `seed`: two builds with the
    same seed write identical files. Returns the folder's path.
    """
    if kind not in FAMILIES:
        raise ValueError(f"kind must be one of {tuple(FAMILIES)}, got {kind!r}")
    out = pathlib.Path(out_dir)
    FAMILIES[kind].tiny(FAMILIES[kind], out, seed)
    return out
