"""`python -m tests.oracle [PART ...]`: regenerate the reference data under tests/data/.

Run by `make oracle` inside build/oracle-venv (tests/oracle/requirements.txt), from the project root.
Each part is a module of this package with `write(data: pathlib.Path) -> None` that rewrites its own
subfolder of tests/data/. Every part runs, in the fixed order of PARTS (pipelines first: the tiny
checkpoints it writes under tests/data/oracle/ are there for the parts after it); naming parts on
the command line runs only those, still in that order.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from pathlib import Path

PARTS = ("pipelines", "tokenizer", "schedulers", "nn", "weights", "samplers", "single_file", "lora", "flux",
         "flux_files", "flux_lora", "t5_tokenizer", "scores", "img2img", "inpaint")


def main(argv: list[str]) -> int:
    unknown = sorted(set(argv) - set(PARTS))
    if unknown:
        print(f"unknown part(s) {', '.join(unknown)}; known: {', '.join(PARTS)}", file=sys.stderr)
        return 2
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the contract's latents: CPU, float32
    os.environ["HF_HUB_OFFLINE"] = "1"  # nothing here may download anything
    data = Path(__file__).parents[1] / "data"
    for name in PARTS:
        if argv and name not in argv:
            continue
        start = time.perf_counter()
        importlib.import_module(f"{__package__}.{name}").write(data)
        print(f"oracle: {name} written in {time.perf_counter() - start:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
