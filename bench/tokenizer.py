"""Tokenizer speed: the worker tokenizes every prompt of every batch on the host, so this prints
prompts/s for batches of 64 distinct typical prompts, per tokenizer folder (CLIP's real vocabulary,
built from tests/data/tokenizer/). Not a test.

Usage: PYTHONPATH=. python bench/tokenizer.py
"""

from __future__ import annotations

import itertools
import tempfile
import time
import timeit
from pathlib import Path

from diffusion.tokenizer import CLIPTokenizer
from harness.tokenizer import build_folder

SUBJECTS = ["a lighthouse on a cliff", "a red fox in fresh snow", "a bowl of ramen", "an astronaut riding a horse",
            "a watercolor map of an imaginary island", "portrait of an old fisherman", "a cyberpunk street at night",
            "a cozy cabin in the woods"]
STYLES = ["oil painting", "telephoto photograph, 85mm, bokeh", "studio lighting, highly detailed, 8k",
          "trending on artstation, by greg rutkowski", "(masterpiece:1.2), best quality, sharp focus",
          "watercolor, soft pastel colors", "cinematic lighting, volumetric fog, unreal engine",
          "pencil sketch, cross hatching"]


def main() -> None:
    prompts = [f"{subject}, {style}" for subject, style in itertools.product(SUBJECTS, STYLES)]
    data = Path(__file__).resolve().parent.parent / "tests" / "data"
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("sd", "sdxl_2"):
            tokenizer = CLIPTokenizer.from_folder(build_folder(data, name, Path(tmp) / name))
            start = time.perf_counter()
            tokenizer(prompts)
            first = time.perf_counter() - start
            per_batch = min(timeit.repeat(lambda: tokenizer(prompts), number=100, repeat=5)) / 100
            print(f"{name}: {len(prompts) / per_batch:,.0f} prompts/s ({per_batch * 1e3:.2f} ms per batch of "
                  f"{len(prompts)}; first batch {first * 1e3:.2f} ms)")


if __name__ == "__main__":
    main()
