"""Flux.1 on the farm (diffusion/families/flux.py): the tiny schnell and dev pipelines of
tests/oracle/flux.py, loaded by the farm's loader, render diffusers' FluxPipeline images
(tests/data/flux) through the engine, `renderfarm render` and weights split over devices;
T5's ids are transformers'; the family runs flow_euler only and counts one pass a step."""

from __future__ import annotations

import dataclasses
import gzip
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from diffusion.families import FAMILIES
from diffusion.families.flux import pack, unpack
from diffusion.family import Geometry
from diffusion.models import LoadedModel, load_model
from diffusion.tokenizer import T5Tokenizer
from renderfarm.jobs import JobError, JobSpec, parse_job
from tests.helpers import render_command, worst
from worker.engine import Engine
from worker.output import sidecar

DATA = Path(__file__).parent / "data" / "flux"
JOBS = json.loads((DATA / "jobs.json").read_text(encoding="utf-8"))["jobs"]
VARIANTS = ("schnell", "dev")
TOLERANCE = 2  # of 255, per channel


def spec(job: dict[str, Any], model: str) -> JobSpec:
    return JobSpec(prompt=job["prompt"], seed=job["seed"], steps=job["steps"], guidance_scale=job["guidance_scale"],
                   width=job["width"], height=job["height"], model=model)


def jobs_of(variant: str) -> list[dict[str, Any]]:
    return [job for job in JOBS if job["model"] == f"{variant}/model"]


def images_of(jobs: list[dict[str, Any]]) -> list[Path]:
    """diffusers' images of the jobs."""
    return [DATA / job["image"] for job in jobs]


@pytest.fixture(scope="module", params=VARIANTS)
def variant(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def model(variant: str) -> LoadedModel:
    return load_model(str(DATA / variant / "model"))


@pytest.fixture(scope="module")
def engine(model: LoadedModel) -> Engine:
    return Engine(model)


@pytest.mark.oracle
def test_the_engine_renders_diffusers_images(engine: Engine, variant: str) -> None:
    jobs = jobs_of(variant)
    assert len(jobs) == 3 and {(j["width"], j["height"]) for j in jobs} == {(64, 64), (64, 128)}
    images = [r.image for r in engine.render([spec(job, engine.model.ref) for job in jobs])]
    difference = worst(images, images_of(jobs))
    print(f"{variant}: engine max difference {difference}/255")
    assert difference <= TOLERANCE
    assert len({image.tobytes() for image in images}) == len(jobs)


@pytest.mark.oracle
def test_one_pass_a_step_whatever_the_guidance_scale(engine: Engine, variant: str) -> None:
    job = jobs_of(variant)[0]
    keys = {engine.check(spec({**job, "guidance_scale": scale}, engine.model.ref)) for scale in (0.0, 1.0, 3.5, 7.0)}
    assert [key.guided for key in keys] == [False]  # one program: the scale is an input, never a second pass
    key = keys.pop()
    engine.compiled(key)  # the count is taken when the program is compiled
    assert engine.flops(key) is not None and engine.flops(key) > 0
    single = engine.model.family.denoiser_flops(engine.model.networks, engine.model.params, engine.batch_size,
                                               key.height, key.width)
    assert single is not None and engine.flops(key) > key.steps * single  # the loop, the encoders and the VAE


@pytest.mark.oracle
def test_dev_takes_the_guidance_scale_and_schnell_ignores_it(engine: Engine, variant: str) -> None:
    job = jobs_of(variant)[0]
    one, other = (engine.render([spec({**job, "guidance_scale": scale}, engine.model.ref)])[0].image
                  for scale in (1.5, 5.0))
    assert (one.tobytes() != other.tobytes()) == (variant == "dev")


@pytest.mark.oracle
def test_a_job_without_guidance_renders_with_fluxpipelines_default(engine: Engine, variant: str) -> None:
    """FluxPipeline's default guidance is 3.5, not the 7.5 of Stable Diffusion's pipelines: a
    job that names none renders as one that names 3.5 (dev's guidance embedding; schnell has
    none), and its sidecar says so."""
    job = jobs_of(variant)[0]
    unnamed = JobSpec(**{**dataclasses.asdict(spec(job, engine.model.ref)), "guidance_scale": None})
    results = engine.render([unnamed, *(spec({**job, "guidance_scale": scale}, engine.model.ref)
                                        for scale in (3.5, 7.5))])
    default, named, seven = (result.image.tobytes() for result in results)
    assert default == named
    assert (default != seven) == (variant == "dev")
    record = sidecar(results[0], engine.model, b"", engine.devices, "part")
    assert record["guidance_scale"] == 3.5 and record["spec"]["guidance_scale"] is None


@pytest.mark.oracle
def test_render_command_renders_diffusers_images(variant: str, tmp_path: Path) -> None:
    jobs = jobs_of(variant)
    by_seed = render_command(jobs, tmp_path, "--model", str(DATA / variant / "model"))
    difference = worst([by_seed[job["seed"]] for job in jobs], images_of(jobs))
    print(f"{variant}: renderfarm render max difference {difference}/255")
    assert difference <= TOLERANCE


@pytest.mark.oracle
def test_weights_split_over_devices_render_the_same_images() -> None:
    jobs = jobs_of("dev")
    split = load_model(str(DATA / "dev" / "model"), model_parallel=4)
    assert split.model_parallel == 4
    images = [r.image for r in Engine(split).render([spec(job, split.ref) for job in jobs])]
    difference = worst(images, images_of(jobs))
    print(f"dev, model_parallel 4: max difference {difference}/255")
    assert difference <= TOLERANCE


def test_flux_runs_flow_euler_only_and_sd_not_flow_euler(engine: Engine, sd_engine: Engine) -> None:
    job = jobs_of("dev")[0]
    with pytest.raises(JobError, match=r"scheduler='pndm': a flux model runs flow_euler$"):
        engine.check(JobSpec(**{**spec(job, engine.model.ref).to_dict(), "scheduler": "pndm"}))
    assert engine.check(spec(job, engine.model.ref)).scheduler == "flow_euler"  # the folder's own
    with pytest.raises(JobError, match=r"scheduler='flow_euler': a sd model runs pndm, ddim"):
        sd_engine.check(JobSpec(prompt="a fox", seed=0, steps=4, scheduler="flow_euler", model=sd_engine.model.ref))


def test_geometry(model: LoadedModel) -> None:
    assert model.family is FAMILIES["flux"]
    assert model.family.geometry(model.networks) == Geometry(native_size=64, size_step=16)  # VAE 8 x 2x2 packing
    engine = Engine(model)
    assert (engine.check(spec({**jobs_of("dev")[0], "width": None, "height": None}, model.ref)).width) == 64
    job = {**{k: jobs_of("dev")[0][k] for k in ("prompt", "seed", "steps", "height")}, "model": model.ref}
    assert parse_job({**job, "width": 80}, size_step=model.size_step).width == 80
    with pytest.raises(JobError, match=r"width=72: must be a multiple of 16 \(the model's size step\)"):
        parse_job({**job, "width": 72}, size_step=model.size_step)


def test_packing_is_diffusers_patch_order() -> None:
    latents = np.arange(2 * 16 * 4 * 6, dtype=np.float32).reshape(2, 16, 4, 6)
    packed = np.asarray(pack(latents))
    assert packed.shape == (2, 6, 64)
    # token (row 1, column 2) holds channel 0's 2x2 patch at latent rows 2-3, columns 4-5, then channel 1's
    assert packed[0, 1 * 3 + 2, :5].tolist() == [latents[0, 0, 2, 4], latents[0, 0, 2, 5], latents[0, 0, 3, 4],
                                                  latents[0, 0, 3, 5], latents[0, 1, 2, 4]]
    assert np.array_equal(np.asarray(unpack(packed, 4, 6)), latents)


@pytest.mark.parametrize("length", [256, 512])
def test_t5_ids_are_transformers(length: int) -> None:
    cases = [c for c in json.loads((DATA / "t5_ids.json").read_text(encoding="utf-8")) if c["max_length"] == length]
    tokenizer = T5Tokenizer.from_folder(DATA / "dev" / "model" / "tokenizer_2", length)
    ids, cut = tokenizer([c["text"] for c in cases])
    assert ids.tolist() == [c["ids"] for c in cases]
    assert cut == [c["text"].count("ramen ") >= length for c in cases]  # 300 words: cut to 256, not to 512


def test_t5_ids_with_the_released_models_normalizer_are_transformers(tmp_path: Path) -> None:
    """tests/data/t5_tokenizer: SentencePiece's nmt_nfkc charsmap, as every T5 v1.1 tokenizer.json holds it."""
    source = Path(__file__).parent / "data" / "t5_tokenizer"
    (tmp_path / "tokenizer.json").write_bytes(gzip.decompress((source / "tokenizer.json.gz").read_bytes()))
    shutil.copy(source / "tokenizer_config.json", tmp_path)
    reference = json.loads((source / "ids.json").read_text(encoding="utf-8"))
    tokenizer = T5Tokenizer.from_folder(tmp_path, reference["max_length"])
    ids, _ = tokenizer([case["text"] for case in reference["cases"]])
    assert ids.tolist() == [case["ids"] for case in reference["cases"]]


def test_schnell_reads_256_t5_tokens_and_dev_512(model: LoadedModel, variant: str) -> None:
    assert [t.max_length for t in model.tokenizers] == [77, 256 if variant == "schnell" else 512]


@pytest.mark.oracle
def test_the_tiny_recipe_builds_the_same_files_and_renders(tmp_path: Path) -> None:
    from diffusion.tiny import build_tiny_model

    first = build_tiny_model(tmp_path / "a", kind="flux", seed=0)
    files = lambda root: {str(f.relative_to(root)): f.read_bytes() for f in sorted(root.rglob("*")) if f.is_file()}  # noqa: E731
    assert files(first) == files(build_tiny_model(tmp_path / "b", kind="flux", seed=0))
    model = load_model(str(first))
    assert (model.family.name, model.native_size, model.size_step) == ("flux", 64, 16)
    [result] = Engine(model).render([JobSpec(prompt="a red fox", seed=1, steps=2, guidance_scale=3.5, model=str(first))])
    assert result.image.shape == (64, 64, 3) and result.image.std() > 1
