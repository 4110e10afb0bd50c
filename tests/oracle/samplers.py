"""Reference images for the stochastic schedulers, the sampler options and the few-step recipes.

`write(data)` rebuilds `data/samplers/` from the tiny checkpoints tests/oracle/pipelines.py wrote
(`data/oracle/<family>/model`, read back with `from_pretrained`, never rebuilt here):

    samplers/<family>/<set>/<i>.png   one PyTorch pipeline call per job, as pipelines.render makes
                                      it: the contract's latents, batch size 1, and for euler_a and
                                      lcm each step's noise by the contract's rule,
                                      normal(fold_in(PRNGKey(seed), step)) (tests/oracle/noise.py)
    samplers/jobs.json                every job: its fields (timestep_spacing and karras as the
                                      job states them), model folder and image, relative to data/

A set is a scheduler with options over the model's config (`timestep_spacing`, `karras` ->
from_config's use_karras_sigmas) at the usual 4 steps and the pipelines' JOBS with their own
guidance scales, or a recipe: the settings a distilled model needs (steps, spacing, guidance 0 or
LCM's 1.5), on a tiny checkpoint of the family the recipe is for.
"""

from __future__ import annotations

import json
import pathlib
import shutil
from typing import Any

from tests.oracle.pipelines import (
    JOBS,
    NATIVE,
    STEPS,
    _save_png,
    job_record,
    load,
    quiet_and_deterministic,
    render,
    versions,
)

# name: (scheduler, timestep_spacing, karras, steps, guidance or None for each job's own, families)
SETS: dict[str, tuple[str, str | None, bool | None, int, float | None, tuple[str, ...]]] = {
    "euler_a": ("euler_a", None, None, STEPS, None, ("sd1", "sd2", "sdxl")),
    "lcm": ("lcm", None, None, STEPS, None, ("sd1", "sd2", "sdxl")),
    # A1111's "DPM++ 2M Karras"
    "dpm-karras": ("dpm", None, True, STEPS, None, ("sd1", "sdxl")),
    # Recipes (docs/models.md): SDXL-Turbo, SDXL-Lightning, LCM-LoRA, Hyper-SD
    "turbo-1": ("euler_a", "trailing", None, 1, 0.0, ("sdxl",)),
    "lightning-4": ("euler", "trailing", None, 4, 0.0, ("sdxl",)),
    "lcm-lora-4": ("lcm", None, None, 4, 1.5, ("sd1", "sdxl")),
    "hyper-sd-8": ("ddim", "trailing", None, 8, 0.0, ("sd1", "sdxl")),
}


def write(data: pathlib.Path) -> None:
    """Rebuild data/samplers (see the module docstring)."""
    quiet_and_deterministic()
    root = data / "samplers"
    shutil.rmtree(root, ignore_errors=True)
    records: list[dict[str, Any]] = []
    for family in ("sd1", "sd2", "sdxl"):
        pipe = load(data / "oracle" / family / "model", family)
        for name, (scheduler, spacing, karras, steps, guidance, families) in SETS.items():
            if family not in families:
                continue
            overrides = {k: v for k, v in (("timestep_spacing", spacing), ("use_karras_sigmas", karras))
                         if v is not None}
            for index, base in enumerate(JOBS):
                job = base if guidance is None else {**base, "guidance_scale": guidance}
                image = f"samplers/{family}/{name}/{index}.png"
                _save_png(data / image, render(pipe, scheduler, job, *NATIVE, steps=steps, **overrides))
                records.append(job_record(f"{family}/{name}", index, f"oracle/{family}/model", None, scheduler, job,
                                          steps, NATIVE, image, timestep_spacing=spacing, karras=karras))
            print(f"oracle: samplers {family}/{name}", flush=True)
    doc = {
        "about": "Reference images of diffusers' PyTorch pipelines (float32, CPU) for the stochastic schedulers, "
                 "the sampler options and the few-step recipes; paths relative to tests/data. See "
                 "tests/oracle/samplers.py and tests/oracle/pipelines.py (render) for how each was made.",
        "noise_rule": "euler_a and lcm add normal(fold_in(PRNGKey(seed), step), (1, C, h, w)) at step "
                      "`step` (0-based), patched into diffusers' randn_tensor (tests/oracle/noise.py)",
        "versions": versions(),
        "jobs": records,
    }
    (root / "jobs.json").write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
