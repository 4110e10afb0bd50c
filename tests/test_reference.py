"""The reproducibility contract against its reference: diffusers' PyTorch pipelines.

`make oracle` (tests/oracle/pipelines.py) built three tiny pipelines with diffusers' and
transformers' PyTorch classes (SD 1.x, SD 2.x with v-prediction, SDXL), saved them as
diffusers folders (safetensors: float32, an fp16 and a bf16 variant, a sharded copy) and
rendered reference images with StableDiffusionPipeline / StableDiffusionXLPipeline for every
scheduler, from the contract's latents. Here the farm loads each checkpoint with its own
code (no torch) and renders the same jobs in the engine's batches of eight, each network compiled
once and the loop run step by step (tests/stepwise.py): every image must be within 2/255 per
channel of PyTorch's. tests/test_engine.py holds the fused program to the same references.
"""

from __future__ import annotations

import json
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from flax.serialization import msgpack_serialize

from diffusion.models import load_model
from renderfarm.jobs import JobError
from tests.helpers import BATCHES, DATA, ORACLE, SAMPLER_BATCHES, TOLERANCE, loaded, max_diffs
from worker.engine import Engine


def lora_jobs() -> dict[str, list[dict[str, Any]]]:
    """The LoRA references (tests/oracle/lora.py): per family and file format, the jobs diffusers
    rendered after `load_lora_weights` and `fuse_lora(lora_scale)`; paths relative to tests/data."""
    batches: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for job in json.loads((DATA / "lora" / "jobs.json").read_text())["jobs"]:
        batches[job["batch"]].append(job)
    return dict(batches)


LORA_BATCHES = lora_jobs()


def test_the_oracle_covers_every_family_scheduler_and_format() -> None:
    kinds = {(model.split("/")[0], variant, scheduler) for model, variant, scheduler, _, _ in BATCHES}
    for family in ("sd1", "sd2", "sdxl"):
        assert {s for f, v, s in kinds if f == family and v is None} == {"pndm", "ddim", "lms", "euler", "dpm"}
    assert ("sd1", "fp16", "dpm") in kinds and ("sdxl", "bf16", "euler") in kinds
    assert any(model.startswith("sd1-sharded") for model, *_ in BATCHES)
    assert {(w, h) for *_, w, h in BATCHES} == {(64, 64), (64, 128)}
    guidance = {job["guidance_scale"] for jobs in BATCHES.values() for job in jobs}
    assert {0.5, 1.0, 7.5} <= guidance  # with and without classifier-free guidance


@pytest.mark.oracle
@pytest.mark.parametrize("batch", sorted(BATCHES, key=str), ids=lambda b: f"{b[0]}-{b[1] or 'f32'}-{b[2]}-{b[3]}x{b[4]}")
def test_images_match_diffusers_pytorch(batch: tuple[str, str | None, str, int, int]) -> None:
    folder, variant, *_ = batch
    model, engine = loaded(folder, variant)
    diffs = max_diffs(engine, model, BATCHES[batch])
    assert len(diffs) >= 6 and max(diffs) <= TOLERANCE, f"{batch}: max differences {diffs} (out of 255)"


def test_the_samplers_cover_the_stochastic_schedulers_options_and_recipes() -> None:
    sets = {batch.split("/", 1)[1] for batch in SAMPLER_BATCHES}
    assert {"euler_a", "lcm", "dpm-karras", "turbo-1", "lightning-4", "lcm-lora-4", "hyper-sd-8"} <= sets
    jobs = [job for batch in SAMPLER_BATCHES.values() for job in batch]
    assert {job["timestep_spacing"] for job in jobs} >= {None, "trailing"}
    assert {job["karras"] for job in jobs} >= {None, True}
    assert {job["model"].split("/")[1] for job in jobs if job["scheduler"] in ("euler_a", "lcm")} == {"sd1", "sd2", "sdxl"}


@pytest.mark.oracle
@pytest.mark.parametrize("batch", sorted(SAMPLER_BATCHES))
def test_samplers_and_recipes_match_diffusers_pytorch(batch: str) -> None:
    """euler_a and lcm with the contract's step noise, the job's timestep_spacing and karras over
    the model's scheduler config, and the few-step recipes (docs/models.md): within 2/255."""
    jobs = SAMPLER_BATCHES[batch]
    model, engine = loaded(jobs[0]["model"].removeprefix("oracle/"), None)  # the engine the oracle's jobs use
    diffs = max_diffs(engine, model, jobs, images=DATA)
    assert len(diffs) >= 6 and max(diffs) <= TOLERANCE, f"{batch}: max differences {diffs} (out of 255)"


# stabilityai/sdxl-turbo's scheduler/scheduler_config.json
TURBO_SCHEDULER = {
    "_class_name": "EulerAncestralDiscreteScheduler", "_diffusers_version": "0.24.0.dev0", "beta_end": 0.012,
    "beta_schedule": "scaled_linear", "beta_start": 0.00085, "clip_sample": False, "interpolation_type": "linear",
    "num_train_timesteps": 1000, "prediction_type": "epsilon", "sample_max_value": 1.0, "set_alpha_to_one": False,
    "skip_prk_steps": True, "steps_offset": 1, "timestep_spacing": "trailing", "trained_betas": None,
    "use_karras_sigmas": False,
}


@pytest.mark.oracle
def test_a_turbo_model_folder_needs_no_sampler_fields(tmp_path: Path) -> None:
    """A model whose scheduler config is SDXL-Turbo's renders the Turbo recipe from its own
    config: jobs that name no scheduler or spacing get euler_a with trailing spacing."""
    folder = tmp_path / "turbo"
    shutil.copytree(ORACLE / "sdxl" / "model", folder)
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(TURBO_SCHEDULER))
    turbo = load_model(str(folder))
    assert turbo.default_scheduler == "euler_a"
    jobs = [{**job, "scheduler": None, "timestep_spacing": None} for job in SAMPLER_BATCHES["sdxl/turbo-1"]]
    diffs = max_diffs(Engine(turbo), turbo, jobs, images=DATA)
    assert max(diffs) <= TOLERANCE, diffs


def test_the_lora_references_cover_every_deterministic_scheduler_on_sdxl() -> None:
    """SDXL's LoRA renders under each of pndm, ddim, lms, euler and dpm, with and without a negative
    prompt (tests/oracle/lora.py), not only under the formats' euler."""
    sdxl = [jobs for batch, jobs in LORA_BATCHES.items() if batch.startswith("lora/sdxl/peft")]
    assert {jobs[0]["scheduler"] for jobs in sdxl} == {"pndm", "ddim", "lms", "euler", "dpm"}
    for batch in ("pndm", "ddim", "lms", "dpm"):
        jobs = LORA_BATCHES[f"lora/sdxl/peft-{batch}"]
        assert {(job["seed"], job["negative_prompt"]) for job in jobs} >= {(12, None), (12, "blurry")}


@pytest.mark.oracle
@pytest.mark.parametrize("batch", sorted(LORA_BATCHES))
def test_loras_match_diffusers_pytorch(batch: str) -> None:
    """A LoRA (UNet, convs and text encoders; PEFT and kohya files) merged at load at scale
    0.7 renders what diffusers renders after load_lora_weights and fuse_lora(lora_scale=0.7),
    on SDXL under every deterministic scheduler."""
    jobs = LORA_BATCHES[batch]
    lora = ((str(DATA / jobs[0]["lora"]), jobs[0]["lora_scale"]),)
    model = load_model(str(DATA / jobs[0]["model"]), loras=lora)
    assert [w["role"] for w in model.weights].count("lora") == 1
    diffs = max_diffs(Engine(model), model, jobs, images=DATA)
    assert len(diffs) >= 6 and max(diffs) <= TOLERANCE, f"{batch}: max differences {diffs} (out of 255)"


@pytest.mark.oracle
def test_loras_stack_and_a_lora_of_another_family_is_refused() -> None:
    """Two LoRAs add up: the same LoRA in its two formats at 0.35 each is the 0.7 reference;
    and an SDXL LoRA on an SD 1.x model is refused before anything loads, naming its keys."""
    jobs = LORA_BATCHES["lora/sd1/peft"]
    halves = tuple((str(DATA / "lora" / "sd1" / f"{kind}.safetensors"), 0.35) for kind in ("peft", "kohya"))
    model = load_model(str(DATA / jobs[0]["model"]), loras=halves)
    assert [(w["role"], w["scale"]) for w in model.weights if w["role"] == "lora"] == [("lora", 0.35)] * 2
    assert max(max_diffs(Engine(model), model, jobs, images=DATA)) <= TOLERANCE
    with pytest.raises(JobError, match=r"sdxl/kohya.safetensors.*does not fit the model: .*modules for text_encoder_2"):
        load_model(str(DATA / jobs[0]["model"]), loras=((str(DATA / "lora" / "sdxl" / "kohya.safetensors"), 1.0),))


@pytest.mark.oracle
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
