"""Model families: what the engine knows of a kind of model, one module each (diffusion/family.py
says what a family is).

A family says which components a pipeline folder holds (their networks, config classes and
checkpoint naming), which tokenizers, which pipeline classes it answers to in
`model_index.json`, and how it generates: encode the prompts, denoise, decode (its
`generate`, device-side, jitted by the engine). The engine and the loader use nothing else
of it, so the next family (Flux, with its transformer and T5 encoder) is one new module here
plus what its checkpoints need in diffusion/convert.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from diffusion.families import sd, sdxl
from diffusion.family import Family
from renderfarm.jobs import JobError

FAMILIES: dict[str, Family] = {family.name: family for family in (sd.FAMILY, sdxl.FAMILY)}


def detect(ref: str, model_index: Mapping[str, Any]) -> Family:
    """The family of a pipeline folder, from its model_index.json's `_class_name`."""
    name = model_index.get("_class_name")
    for family in FAMILIES.values():
        if name in family.pipelines:
            return family
    known = sorted(p for family in FAMILIES.values() for p in family.pipelines)
    raise JobError("model", ref, f"is a {name!r} pipeline; the farm renders {', '.join(known)}")
