"""The reproducibility contract against its reference: diffusers' PyTorch pipelines.

`make oracle` (tests/oracle/pipelines.py) built three tiny pipelines with diffusers' and
transformers' PyTorch classes (SD 1.x, SD 2.x with v-prediction, SDXL), saved them as
diffusers folders (safetensors: float32, an fp16 and a bf16 variant, a sharded copy) and
rendered reference images with StableDiffusionPipeline / StableDiffusionXLPipeline for every
scheduler, from the contract's latents. Here the farm loads each checkpoint with its own
code (no torch) and renders the same jobs in batches of eight on eight devices: every image
must be within 2/255 per channel of PyTorch's.
"""

from __future__ import annotations

import functools
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flax.serialization import msgpack_serialize
from PIL import Image

from renderfarm.jobs import JobSpec
from worker.engine import Engine
from worker.models import LoadedModel, load_model

ORACLE = Path(__file__).parent / "data" / "oracle"
TOLERANCE = 2  # out of 255, per channel (the contract)


def reference_jobs() -> dict[tuple[str, str | None, str, int, int], list[dict[str, Any]]]:
    """Every reference job, by what a batch shares: model folder, variant, scheduler, size."""
    batches: dict[tuple[str, str | None, str, int, int], list[dict[str, Any]]] = defaultdict(list)
    for index in sorted(ORACLE.glob("*/jobs.json")):
        for job in json.loads(index.read_text())["jobs"]:
            batches[(job["model"], job["variant"], job["scheduler"], job["width"], job["height"])].append(job)
    return dict(batches)


BATCHES = reference_jobs()


def representable(job: dict[str, Any], model: LoadedModel) -> bool:
    """A job the contract can state. A job's empty negative prompt is PyTorch's `None`: SDXL
    then uses zeros (force_zeros_for_empty_prompt), where an explicit "" would be encoded."""
    return not (job["negative_prompt"] == "" and model.family.name == "sdxl"
                and model.networks.force_zeros_for_empty_prompt)


@functools.cache
def loaded(folder: str, variant: str | None) -> tuple[LoadedModel, Engine]:
    model = load_model(str(ORACLE / folder), variant=variant)
    return model, Engine(model)


def spec(model: LoadedModel, job: dict[str, Any]) -> JobSpec:
    return JobSpec(prompt=job["prompt"], model=model.ref, seed=job["seed"], steps=job["steps"],
                   negative_prompt=job["negative_prompt"] or "", guidance_scale=job["guidance_scale"],
                   width=job["width"], height=job["height"], scheduler=job["scheduler"], variant=job["variant"])


def max_diffs(engine: Engine, model: LoadedModel, jobs: list[dict[str, Any]]) -> list[int]:
    jobs = [job for job in jobs if representable(job, model)]
    rendered = engine.render([spec(model, job) for job in jobs])
    # Like PyTorch, a scale <= 1 runs no classifier-free guidance: a program of its own.
    assert [r.key.guided for r in rendered] == [job["guidance_scale"] > 1 for job in jobs]
    return [int(np.abs(np.asarray(Image.open(ORACLE / job["image"]).convert("RGB"), np.int16)
                       - result.image.astype(np.int16)).max())
            for job, result in zip(jobs, rendered)]


def test_the_oracle_covers_every_family_scheduler_and_format() -> None:
    kinds = {(model.split("/")[0], variant, scheduler) for model, variant, scheduler, _, _ in BATCHES}
    for family in ("sd1", "sd2", "sdxl"):
        assert {s for f, v, s in kinds if f == family and v is None} == {"pndm", "ddim", "lms", "euler", "dpm"}
    assert ("sd1", "fp16", "dpm") in kinds and ("sdxl", "bf16", "euler") in kinds
    assert any(model.startswith("sd1-sharded") for model, *_ in BATCHES)
    assert {(w, h) for *_, w, h in BATCHES} == {(64, 64), (64, 128)}
    guidance = {job["guidance_scale"] for jobs in BATCHES.values() for job in jobs}
    assert {0.5, 1.0, 7.5} <= guidance  # with and without classifier-free guidance


@pytest.mark.parametrize("batch", sorted(BATCHES, key=str), ids=lambda b: f"{b[0]}-{b[1] or 'f32'}-{b[2]}-{b[3]}x{b[4]}")
def test_images_match_diffusers_pytorch(batch: tuple[str, str | None, str, int, int]) -> None:
    folder, variant, *_ = batch
    model, engine = loaded(folder, variant)
    diffs = max_diffs(engine, model, BATCHES[batch])
    assert len(diffs) >= 6 and max(diffs) <= TOLERANCE, f"{batch}: max differences {diffs} (out of 255)"


def test_flax_msgpack_weights_render_the_same(tmp_path: Path) -> None:
    """Today's Flax checkpoints (diffusers' Flax parameter names, msgpack) load unchanged:
    the same weights saved that way render the same references."""
    model, _ = loaded("sd1/model", None)
    folder = tmp_path / "sd1-flax"
    source = ORACLE / "sd1" / "model"
    for path in source.rglob("*"):
        if path.is_file() and not path.name.endswith(".safetensors"):
            (folder / path.relative_to(source)).parent.mkdir(parents=True, exist_ok=True)
            (folder / path.relative_to(source)).write_bytes(path.read_bytes())
    for name, params in model.params.items():
        weights = "diffusion_flax_model.msgpack" if name in ("unet", "vae") else "flax_model.msgpack"
        (folder / name / weights).write_bytes(msgpack_serialize(params))
    flax = load_model(str(folder))
    assert not list(folder.rglob("*.safetensors"))
    diffs = max_diffs(Engine(flax), flax, BATCHES[("sd1/model", None, "euler", 64, 64)])
    assert max(diffs) <= TOLERANCE, diffs
