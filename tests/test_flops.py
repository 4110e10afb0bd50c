"""The engine knows the FLOPs of each compiled shape, so a worker can log its achieved
FLOP/s; XLA counts a loop's body once, and the engine's count must still grow with steps."""

from __future__ import annotations

from collections.abc import Iterator

import jax
import jax.numpy as jnp
import pytest

from diffusion.families.latent_unet import unet_flops
from diffusion.flops import PEAK_ENV, describe_rate, peak_flops, program_flops
from harness.farm import STEPS
from worker.engine import ShapeKey


def test_engine_counts_flops_of_each_compiled_shape(sd_engine) -> None:  # noqa: ANN001
    key = ShapeKey(64, 64, STEPS, "pndm")
    compiled = sd_engine.compiled(key)
    flops = sd_engine.flops(key)
    assert flops is not None and flops > 0
    # the whole batch on all devices: more than XLA's count of one device's program
    assert flops > program_flops(compiled) * len(sd_engine.devices)
    assert sd_engine.flops(ShapeKey(128, 64, STEPS, "pndm")) is None  # not compiled


def test_flops_grow_with_steps_by_one_unet_call_per_step(sd_engine) -> None:  # noqa: ANN001
    short, long = ShapeKey(64, 64, STEPS, "pndm"), ShapeKey(64, 64, 2 * STEPS, "pndm")
    programs = [program_flops(sd_engine.compiled(key)) for key in (short, long)]
    # XLA's premise the engine corrects for: the denoising loop is counted once
    assert programs[0] == pytest.approx(programs[1], rel=1e-3)
    model = sd_engine.model
    per_device = sd_engine.batch_size // len(sd_engine.devices)
    step = model.family.denoiser_flops(model.networks, model.params, 2 * per_device, 64, 64)
    assert step is not None and step > 0
    # the family's denoiser call is its UNet on 64 / 8 latents and the text encoder's 77 positions
    unet = model.networks["unet"]
    assert step == unet_flops(unet, model.params["unet"], 2 * per_device, 8, 8, 77)
    assert unet_flops(unet, model.params["unet"], 2 * per_device, 8, 8, 154) > step
    # a UNet call costs in proportion to its batch (two latents per job: guidance)
    assert unet_flops(unet, model.params["unet"], 4 * per_device, 8, 8, 77) == pytest.approx(2 * step, rel=0.01)
    extra = sd_engine.flops(long) - sd_engine.flops(short)
    assert extra == pytest.approx(STEPS * step * len(sd_engine.devices), rel=1e-3)
    # the rest of the program (text encoder, VAE decode) does not grow with steps
    fixed = sd_engine.flops(short) - STEPS * step * len(sd_engine.devices)
    assert 0 < fixed < sd_engine.flops(short)


def test_a_cfg_free_program_evaluates_the_unet_on_one_latent_per_job(sd_engine) -> None:  # noqa: ANN001
    """Jobs with guidance <= 1 get a program of their own whose step is one UNet call on
    the conditional latents alone: XLA counts one step (the loop body once), and a guided
    step costs one more UNet call per job than a cfg-free one."""
    guided, free = ShapeKey(64, 64, STEPS, "pndm"), ShapeKey(64, 64, STEPS, "pndm", guided=False)
    programs = {key: program_flops(sd_engine.compiled(key)) for key in (guided, free)}
    model = sd_engine.model
    per_device = sd_engine.batch_size // len(sd_engine.devices)
    one_call = model.family.denoiser_flops(model.networks, model.params, per_device, 64, 64)
    saved = programs[guided] - programs[free]
    assert saved >= 0.99 * one_call, (saved, one_call)
    assert sd_engine.flops(free) < sd_engine.flops(guided) - (STEPS - 1) * one_call * len(sd_engine.devices)


@pytest.fixture
def fresh_counts() -> Iterator[None]:
    """unet_flops's kept counts emptied before and after: a test's stand-in counts stay its own,
    and what other tests in this process counted does not answer for it."""
    unet_flops.cache_clear()
    yield
    unet_flops.cache_clear()


@pytest.mark.usefixtures("fresh_counts")
def test_a_denoiser_is_counted_once_per_shapes_and_attention_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every program compiled for a shape asks for its denoiser's count: the same network on the
    same shapes is lowered once, whatever the parameters' values; other sizes, parameter dtypes
    or attention kernels are counted anew."""
    from diffusion.families import latent_unet
    from diffusion.nn.attention import use_kernel
    from diffusion.nn.unet import UNet2DConditionModel, UNetConfig

    lowered: list[object] = []
    monkeypatch.setattr(latent_unet, "program_flops", lambda program: lowered.append(program) or 1.0)
    unet = UNet2DConditionModel(UNetConfig.from_dict(latent_unet.unet_config("sd")))
    shapes = jax.eval_shape(unet.init_params, jax.random.PRNGKey(0))
    params = jax.tree.map(lambda leaf: jnp.zeros(leaf.shape, leaf.dtype), shapes)
    for args in ((shapes, 2, 8, 8, 77), (params, 2, 8, 8, 77), (shapes, 2, 8, 8, 77)):
        latent_unet.unet_flops(unet, *args)
    assert len(lowered) == 1
    latent_unet.unet_flops(unet, shapes, 4, 8, 8, 77)
    latent_unet.unet_flops(unet, jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, jnp.bfloat16), shapes),
                           2, 8, 8, 77)
    with use_kernel("chunked"):
        latent_unet.unet_flops(unet, shapes, 2, 8, 8, 77)
    assert len(lowered) == 4


def test_program_flops_of_a_lowered_matmul() -> None:
    x = jax.ShapeDtypeStruct((64, 32), jnp.float32)
    y = jax.ShapeDtypeStruct((32, 16), jnp.float32)
    assert program_flops(jax.jit(jnp.matmul).lower(x, y)) == 2 * 64 * 32 * 16


def test_peak_and_fraction_of_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PEAK_ENV, raising=False)
    assert peak_flops("TPU v5 lite") == 197e12
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("cpu") is None
    text = describe_rate(8 * 98.5e12, 1.0, "TPU v5 lite", 8)
    assert text.startswith("788.00 TFLOP/s, 50% of peak")
    assert describe_rate(1e12, 2.0, "cpu", 8) == "0.50 TFLOP/s"
    assert describe_rate(None, 2.0, "cpu", 8) == "FLOP/s unknown"
    monkeypatch.setenv(PEAK_ENV, "100")
    assert peak_flops("cpu") == 100e12


def test_a_targets_peak_is_what_a_worker_on_its_device_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """One table of chips: `renderfarm plan`'s targets and a worker's own device agree (a v4
    target's device is one of a chip's two TensorCores, with half its peak)."""
    from diffusion.targets import TARGETS

    monkeypatch.delenv(PEAK_ENV, raising=False)
    kinds = {"tpu-v5e-8": "TPU v5 lite", "tpu-v5p-8": "TPU v5p", "tpu-v6e-8": "TPU v6 lite", "h100": "NVIDIA H100 80GB HBM3",
             "h100-8": "NVIDIA H100 80GB HBM3", "a100-80g": "NVIDIA A100-SXM4-80GB", "l4": "NVIDIA L4"}
    for name, kind in kinds.items():
        assert TARGETS[name].peak_flops == peak_flops(kind), name
    assert TARGETS["tpu-v4-8"].peak_flops == peak_flops("TPU v4") / 2
    assert TARGETS["cpu"].peak_flops is None
