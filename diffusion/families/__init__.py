"""Model families: what the engine knows of a kind of model, one module each (diffusion/family.py
says what a family is).

A family says which components a pipeline folder holds (their networks, config classes and
checkpoint naming), which tokenizers, which pipeline classes it answers to in
`model_index.json`, and how it generates: encode the prompts, denoise, decode (its
`generate`, device-side, jitted by the engine), with its inputs, geometry, FLOP model and
tiny recipe (diffusion/family.py). The engine and the loader use nothing else of it.

Besides the families here, any installed distribution can add one: an entry point in the
group `renderfarm.families` naming a `Family` (`toy = mypackage.toy:FAMILY`), found when this
module is imported, in every process (the worker's, `renderfarm render`'s).
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Mapping
from typing import Any

from diffusion.errors import ModelError
from diffusion.families import flux, sd, sdxl
from diffusion.family import Family

ENTRY_POINTS = "renderfarm.families"


def _installed() -> list[Family]:
    """The families other distributions add through entry points."""
    found = []
    for entry in importlib.metadata.entry_points(group=ENTRY_POINTS):
        family = entry.load()
        if not isinstance(family, Family):
            raise TypeError(f"entry point {entry.name} = {entry.value} in group {ENTRY_POINTS} "
                            f"is a {type(family).__name__}, not a diffusion.family.Family")
        found.append(family)
    return found


def _by_name(families: list[Family]) -> dict[str, Family]:
    named: dict[str, Family] = {}
    for family in families:
        if family.name in named:
            raise ValueError(f"two model families are named {family.name!r}")
        named[family.name] = family
    return named


FAMILIES: dict[str, Family] = _by_name([sd.FAMILY, sdxl.FAMILY, flux.FAMILY, *_installed()])


def detect(ref: str, model_index: Mapping[str, Any]) -> Family:
    """The family of a pipeline folder, from its model_index.json's `_class_name`."""
    name = model_index.get("_class_name")
    for family in FAMILIES.values():
        if name in family.pipelines:
            return family
    known = sorted(p for family in FAMILIES.values() for p in family.pipelines)
    raise ModelError("model", ref, f"is a {name!r} pipeline; the farm renders {', '.join(known)}")
