"""`renderfarm plan`: a model's programs compiled for a target's chips on this CPU machine (a TPU
v5e-8 topology through libtpu, an H100 through jax's CUDA plugin, and the CPU devices), with the kernels, memory, fitting batch
and FLOPs read from what XLA compiled; its parts (the targets, the published architectures as
shapes, the attention kernels a traced program took); bad input refused by name."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import pytest

from diffusion.architectures import ARCHITECTURES, abstract_model, abstract_networks
from diffusion.nn.attention import Call, attention, recording, use_kernel
from diffusion.targets import GIB, TARGETS, target
from renderfarm.jobs import COARSEST_SIZE_STEP, FINEST_SIZE_STEP, JobError, JobSpec, parse_job
from tests.helpers import Cli
from worker.plan import Plan, ProgramPlan, engine_for, format_plan, make_plan

def plan_json(cli: Cli, *argv: object) -> tuple[int, dict[str, Any]]:
    code, out, err = cli("plan", *argv, "--json")
    assert code in (0, 1), err
    return code, json.loads(out)


def as_plan(data: dict[str, Any]) -> Plan:
    fields = {key: value for key, value in data.items() if key != "ok"}
    return Plan(**{**fields, "programs": [ProgramPlan(**p) for p in data["programs"]]})


@pytest.fixture(scope="module")
def tpu_plan(tiny_sd: Path) -> Plan:
    """The tiny SD at 96x96 (144-token attentions: splash from 128; 36 at the lower level: XLA's
    heads) on a TPU v5e-8."""
    pytest.importorskip("libtpu", reason="TPU targets compile through libtpu (pip install 'jax[tpu]')")
    return make_plan(str(tiny_sd), "tpu-v5e-8", (96, 96), steps=2)


@pytest.fixture(scope="module")
def gpu_plan(tiny_sd: Path) -> Plan:
    """The tiny SD at 96x96 on one H100, compiled through jax's CUDA plugin."""
    pytest.importorskip("jax_plugins.xla_cuda12", reason="GPU targets compile through jax's CUDA plugin "
                                                          "(jax 0.12, Python 3.12: the test extra)")
    return make_plan(str(tiny_sd), "h100", (96, 96), steps=2)


@pytest.mark.target  # compiles for a TPU v5e-8 (libtpu), left out of make check
def test_a_tpu_plan_compiles_with_splash_and_xla_memory(tpu_plan: Plan) -> None:
    assert tpu_plan.target == "tpu-v5e-8" and tpu_plan.devices == 8 and tpu_plan.ok
    assert tpu_plan.usable_per_chip == int(16 * GIB * 0.9)
    assert tpu_plan.auto_model_parallel == 1
    encoder, program = tpu_plan.programs
    # the text encoders' program, every shape's: CLIP's 77-token attentions take XLA's heads
    assert encoder.compiled and encoder.shape == "text encoders" and encoder.batch == 8
    assert set(encoder.kernels) == {"heads"} and encoder.fits and 0 < encoder.flops_per_image < program.flops_per_image
    # either program's weights per chip are all the model's: the worker holds them all on every chip
    assert min(encoder.weights_bytes, program.weights_bytes) >= tpu_plan.weights_bytes
    assert program.compiled and program.error is None
    assert program.shape == "96x96@2 pndm" and program.batch == 8
    # splash from 128 queries on a TPU, XLA's heads below, as attention.choose says for that backend
    assert program.kernels["splash"] >= 1 and set(program.kernels) == {"splash", "heads"}
    assert all((call["kernel"] == "splash") == (call["queries"] >= 128) for call in program.attention)
    assert program.weights_bytes >= tpu_plan.weights_bytes > 0 and program.temp_bytes > 0
    assert program.fits and program.total_bytes < program.usable_bytes
    assert program.flops_per_image > 0 and program.images_per_second_per_chip > 0
    assert program.compile_seconds > 0


@pytest.mark.target  # compiles for an H100 (jax's CUDA plugin)
def test_a_gpu_plan_compiles_with_cudnn_and_says_so(gpu_plan: Plan) -> None:
    assert gpu_plan.target == "h100" and gpu_plan.devices == 1 and gpu_plan.ok
    assert gpu_plan.usable_per_chip == int(80e9 * 0.75)
    encoder, program = gpu_plan.programs
    assert encoder.compiled and encoder.shape == "text encoders" and set(encoder.kernels) == {"cudnn"}
    assert program.compiled and program.batch == 1
    # every attention of the tiny SD is cuDNN's on CUDA (bfloat16, heads of at most 128)
    assert set(program.kernels) == {"cudnn"}
    assert program.weights_bytes >= gpu_plan.weights_bytes > 0 and program.temp_bytes > 0
    assert program.fits and program.largest_per_device_batch > 1
    # the GPU backend counts no FLOPs: the denoiser's own count, at 50% of an H100's 989 TFLOP/s
    assert program.images_per_second_per_chip == pytest.approx(0.5 * 989e12 / program.flops_per_image)
    text = format_plan(gpu_plan)
    assert "on h100: NVIDIA H100 SXM (1 GPU), 1 devices, 80.00 GB a chip, 60.00 GB usable" in text
    assert f"attention: cudnn x{program.kernels['cudnn']}" in text
    assert f"largest per-device batch {program.largest_per_device_batch}" in text


@pytest.mark.target
def test_the_largest_batch_fits_and_one_more_does_not(tpu_plan: Plan) -> None:
    _, program = tpu_plan.programs
    weights, largest, usable = program.weights_bytes, program.largest_per_device_batch, program.usable_bytes
    per_image = program.total_bytes - weights  # compiled at one image a device
    assert largest > 1
    assert weights + largest * per_image <= usable < weights + (largest + 1) * per_image


@pytest.mark.target
def test_the_text_report_says_what_the_plan_says(tpu_plan: Plan) -> None:
    text = format_plan(tpu_plan)
    _, program = tpu_plan.programs
    assert "on tpu-v5e-8: TPU v5e-8 (8 chips), 8 devices" in text
    assert "auto split: model parallel 1" in text
    assert "96x96@2 pndm: batch 8 (1 per device, model parallel 1)" in text
    assert f"splash x{program.kernels['splash']}" in text
    assert f"largest per-device batch {program.largest_per_device_batch}" in text


def test_a_program_that_does_not_fit_says_by_how_much_per_chip(cli: Cli, tiny_sd: Path) -> None:
    """An inpainting job's program (the VAE encodes the image and the loop blends the mask in):
    planned as the worker compiles it."""
    code, data = plan_json(cli, tiny_sd, "--target", "cpu", "--size", "64", "--steps", "2", "--guidance", "1",
                           "--memory-per-chip", "0.001", "--job", "inpaint")
    assert code == 1 and data["ok"] is False  # a program that does not fit fails the command, for scripts
    encoder, program = data["programs"]
    assert encoder["shape"] == "text encoders cfg-free" and encoder["fits"] is False
    assert program["compiled"] and program["shape"] == "64x64@2 pndm cfg-free inpaint"
    assert set(program["kernels"]) == {"batch"}  # the CPU's kernel
    assert data["devices"] == len(jax.devices("cpu")) and data["usable_per_chip"] == 1_000_000
    assert program["fits"] is False and program["largest_per_device_batch"] == 0
    assert program["over_bytes"] == program["total_bytes"] - 1_000_000 > 0
    text = format_plan(as_plan(data))
    assert f"DOES NOT FIT: {program['total_bytes'] / 1e6:.2f} MB per chip, {program['over_bytes'] / 1e6:.2f} MB " \
           "over the 1.00 MB usable" in text


def test_text_encoders_too_large_to_sit_whole_beside_the_rest_are_spread_over_every_chip(
        cli: Cli, tiny_sd: Path) -> None:
    """Told to keep a copy of the weights on each chip where they take more than the share
    weights may take, the text encoders are spread over all chips: each program then holds the
    rest whole and an eighth of the text encoders."""
    code, data = plan_json(cli, tiny_sd, "--target", "cpu", "--size", "64", "--steps", "2", "--model-parallel", "1",
                           "--memory-per-chip", "0.0025")  # 75% of 2.5 MB: less than the tiny SD's 2.17 MB
    assert data["text_split"] is True and data["devices"] == 8
    encoder, program = data["programs"]
    assert encoder["compiled"] and program["compiled"] and encoder["shape"] == "text encoders"
    assert program["weights_bytes"] < data["weights_bytes"]  # the rest whole, an eighth of the text encoders
    assert "; at model parallel 1 the text encoders are spread over every chip" in format_plan(as_plan(data))


def test_the_command_refuses_bad_input_by_name(cli: Cli) -> None:
    code, out, err = cli("plan", "sd15", "--target", "cpu", "--per-device-batch", "0")
    assert (code, out) == (2, "") and "per-device-batch=0: must be at least 1" in err
    code, out, err = cli("plan", "sd15", "--target", "tpu-v5e")
    assert (code, out) == (2, "") and "target='tpu-v5e': must be one of" in err
    code, out, err = cli("plan", "sd15", "--target", "cpu", "--size", "1008x1024")  # the job contract's rule
    assert (code, out) == (2, "") and "width=1008: must be a multiple of 64 (the model's size step)" in err
    code, out, err = cli("plan", "flux-schnell", "--target", "cpu", "--job", "img2img")
    assert (code, out) == (2, "") and "job='img2img': a flux model renders text to image only" in err


def test_an_unknown_target_names_the_known_ones() -> None:
    with pytest.raises(JobError) as err:
        target("v5e")
    assert all(part in str(err.value) for part in ["target='v5e'", "must be one of", *TARGETS]), err.value


def test_an_unknown_architecture_names_the_known_ones() -> None:
    with pytest.raises(JobError) as err:
        abstract_model("sd3")
    assert "model='sd3'" in str(err.value) and all(name in str(err.value) for name in ARCHITECTURES)


@pytest.mark.parametrize(("name", "family", "parameters"), [
    ("sd15", "sd", 1_066_235_307),  # diffusers' count of stable-diffusion-v1-5 (docs/performance.md)
    ("sdxl", "sdxl", 3_468_837_867),  # and of stable-diffusion-xl-base-1.0
])
def test_published_architectures_have_the_released_sizes(name: str, family: str, parameters: int) -> None:
    model = abstract_model(name, "bfloat16")
    leaves = jax.tree.leaves(model.params)
    assert model.family.name == family
    assert sum(leaf.size for leaf in leaves) == parameters
    assert {str(leaf.dtype) for leaf in leaves} == {"bfloat16"}


def test_the_producers_size_steps_are_the_published_architectures_finest_and_coarsest() -> None:
    """A Flux job 1008 wide passes the producer, which does not know its model's family; the
    worker holds it to its own model's step: Flux's takes it, SD 1.5's refuses it by name."""
    steps = {name: family.geometry(networks).size_step
             for name in ARCHITECTURES for family, networks in [abstract_networks(name)]}
    assert (min(steps.values()), max(steps.values())) == (FINEST_SIZE_STEP, COARSEST_SIZE_STEP)
    job = {"prompt": "a fox", "model": "m", "seed": 1, "width": 1008}
    assert parse_job(job).width == parse_job(job, size_step=steps["flux-dev"]).width == 1008
    with pytest.raises(JobError, match=r"width=1008: must be a multiple of 64 \(the model's size step\)") as err:
        parse_job(job, size_step=steps["sd15"])
    assert err.value.field == "width"


def test_recording_lists_the_kernel_each_attention_took() -> None:
    q = jax.ShapeDtypeStruct((1, 256, 4 * 8), jnp.float32)
    k = jax.ShapeDtypeStruct((1, 77, 4 * 8), jnp.float32)
    with recording() as calls:
        jax.jit(lambda q, k: attention(q, k, k, heads=4)).lower(q, k)
        with use_kernel("chunked"):
            jax.jit(lambda q: attention(q, q, q, heads=4, causal=True)).lower(q)
    assert calls == [Call("batch", 256, 77, 4, 8), Call("chunked", 256, 256, 4, 8)]
    jax.jit(lambda q: attention(q, q, q, heads=4)).lower(q)  # outside the block: not recorded
    assert len(calls) == 2


def test_auto_per_device_batch_takes_one_job_where_the_backend_reports_no_memory(
        sd_model: Any, caplog: pytest.LogCaptureFixture) -> None:
    spec = JobSpec(prompt="a lighthouse", model=sd_model.ref, seed=0, steps=2, width=64, height=64)
    given = engine_for(sd_model, 3, lambda engine: pytest.fail("a given batch compiles nothing"))
    assert given.batch_size == 3 * len(given.devices)
    with caplog.at_level(logging.INFO, logger="worker.plan"):
        engine = engine_for(sd_model, None, lambda engine: engine.check(spec))
    assert engine.batch_size == len(engine.devices) and engine.ready(engine.check(spec))
    assert "the cpu backend reports no memory limit; 1 job a device" in caplog.text


def test_a_worker_sizes_auto_batches_for_a_named_shape(cli: Cli, tiny_sd: Path, tmp_path: Path) -> None:
    code, out, err = cli("worker", "--model", tiny_sd, "--out", tmp_path, "--per-device-batch", "auto")
    assert (code, out) == (2, "")
    assert "per-device-batch='auto': sizes batches for the first --precompile shape" in err
