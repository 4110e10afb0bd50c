"""Weights split over a model axis (diffusion/sharding.py): the same images whatever the
mesh, on 8 CPU devices, and the split chosen from the devices' memory."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from diffusion.models import load_model
from diffusion.placement import make_placement
from diffusion.sharding import (
    MODEL,
    TensorParallel,
    choose_model_parallel,
    interleave,
    split_text_encoders,
    weight_specs,
)
from renderfarm.jobs import JobError, JobSpec
from tests.helpers import engine

PROMPTS = ["a red fox in snow", "a lighthouse at dusk", "a bowl of ramen", "", "a fox", "snow", "dusk", "ramen"]


def test_each_weight_is_split_as_megatron_splits_a_transformer_block() -> None:
    rules = TensorParallel(columns=(r".*/to_q",), rows=(r".*/to_out_0",))
    block = ("down_blocks_0", "attentions_0", "transformer_blocks_0", "attn1")
    assert rules.spec((*block, "to_q", "kernel"), (320, 640), 4) == PartitionSpec(None, MODEL)  # output columns
    assert rules.spec((*block, "to_q", "bias"), (640,), 4) == PartitionSpec(MODEL)
    assert rules.spec((*block, "to_out_0", "kernel"), (640, 320), 4) == PartitionSpec(MODEL, None)  # input rows
    assert rules.spec((*block, "to_out_0", "bias"), (320,), 4) == PartitionSpec()  # added once, after the sum
    assert rules.spec(("conv_in", "kernel"), (3, 3, 4, 320), 4) == PartitionSpec()  # no rule: whole
    assert rules.spec((*block, "to_q", "kernel"), (320, 642), 4) == PartitionSpec()  # 4 does not divide 642
    assert rules.spec((*block, "to_q", "kernel"), (320, 640), 1) == PartitionSpec()


def test_a_packed_layer_is_interleaved_so_each_device_holds_its_slice_of_every_chunk() -> None:
    """Flux's single-block proj_out: rows of attention (1 part) then of the MLP (4 parts)."""
    rules = TensorParallel(rows=("proj_out",), packed=(("proj_out", (1, 4)),))
    assert rules.split(("proj_out", "kernel"), (10, 3), 2) == (0, (2, 8))
    assert rules.split(("proj_out", "kernel"), (10, 3), 4) is None  # 4 does not divide the attention's 2 rows
    rows = interleave(np.arange(10)[:, None], 0, (2, 8), 2)[:, 0]
    assert rows.tolist() == [0, 2, 3, 4, 5, 1, 6, 7, 8, 9]  # device 0: attention row 0, MLP rows 0-3; device 1 the rest


def test_a_family_splits_only_its_transformer_blocks(tiny_sd: Path) -> None:
    """The UNet's attention and MLP linears split; its ResNets, the VAE and CLIP stay whole."""
    model = load_model(str(tiny_sd), model_parallel=1)
    specs = weight_specs(dict(model.family.tensor_parallel), model.params, 4)
    split = {jax.tree_util.keystr(path): spec for path, spec in jax.tree_util.tree_leaves_with_path(
        specs, is_leaf=lambda x: isinstance(x, PartitionSpec)) if spec != PartitionSpec()}
    block = "['unet']['down_blocks_1']['attentions_0']['transformer_blocks_0']"
    assert split[f"{block}['attn1']['to_q']['kernel']"] == PartitionSpec(None, MODEL)
    assert split[f"{block}['attn2']['to_out_0']['kernel']"] == PartitionSpec(MODEL, None)
    assert split[f"{block}['ff']['net_2']['kernel']"] == PartitionSpec(MODEL, None)
    assert all("transformer_blocks" in name for name in split)
    assert not any(name.startswith(("['vae']", "['text_encoder']")) for name in split)


def test_the_split_is_the_fewest_devices_whose_memory_holds_the_weights() -> None:
    gb = 10**9
    # Memory JAX may use: a v5e's 16 GiB less the runtime's 10%; an H100's 80 GB x JAX's 75%.
    v5e, h100 = int(16 * 2**30 * 0.9), 60 * gb
    assert choose_model_parallel(34 * gb, v5e, 8) == 4  # Flux dev in bfloat16: 8.5 GB a chip
    assert choose_model_parallel(34 * gb, h100, 8) == 1  # the same whole on each H100 (45 GB of weights fit)
    assert choose_model_parallel(2 * gb, h100, 8) == 1  # SD 1.5
    assert choose_model_parallel(100 * gb, None, 8) == 1  # no memory limit reported (CPU)
    assert choose_model_parallel(40 * gb, 16 * gb, 6) == 6  # divisors of 6: 1, 2, 3 (13.3 GB each: too many), 6
    # Flux dev's 9.75 GB of text encoders (T5-XXL, CLIP-L) are not split by the model axis: whole
    # on every chip beside its share of the transformer, or spread over all eight chips where
    # whole they do not fit
    flux, text, v6e = 34 * gb, int(9.75 * gb), int(32 * 2**30 * 0.9)
    assert choose_model_parallel(flux, v5e, 8, text) == 4 and split_text_encoders(flux, text, v5e, 4, 8)
    assert choose_model_parallel(flux, v6e, 8, text) == 2 and not split_text_encoders(flux, text, v6e, 2, 8)
    assert split_text_encoders(flux, text, v6e, 1, 8)  # the transformer whole on a v6e chip: T5 spread beside it
    assert choose_model_parallel(flux, h100, 8, text) == 1 and not split_text_encoders(flux, text, h100, 1, 8)
    assert not split_text_encoders(flux, text, None, 1, 8)  # no memory limit reported (CPU)
    with pytest.raises(ValueError, match="do not fit 8 devices of 16.0 GB"):
        choose_model_parallel(200 * gb, 16 * gb, 8)
    with pytest.raises(JobError, match="model_parallel=3: must divide the 8 devices"):
        make_placement(jax.devices(), 3)


@pytest.fixture(scope="module")
def images_by_mesh(tiny_sd: Path) -> dict[int, np.ndarray]:
    """The same 8 jobs rendered with the weights whole on each device (8x1), split over 4
    (2x4) and over all 8 (1x8), by engines that save their programs in the session's compile
    cache (the 8x1 one is the session's other engines' program; `renderfarm render
    --model-parallel 4` below loads the 2x4 one)."""
    out = {}
    for model_parallel in (1, 4, 8):
        model = load_model(str(tiny_sd), model_parallel=model_parallel)
        renderer = engine(model)
        specs = [JobSpec(prompt=p, seed=n, steps=3, guidance_scale=7.5, width=64, height=64, model=str(tiny_sd))
                 for n, p in enumerate(PROMPTS)]
        out[model_parallel] = np.stack([r.image for r in renderer.render(specs)])
        assert renderer.batch_size == 8 // model_parallel
    return out


def test_split_weights_live_in_shards(tiny_sd: Path) -> None:
    model = load_model(str(tiny_sd), model_parallel=4)
    assert model.model_parallel == 4
    block = model.params["unet"]["down_blocks_1"]["attentions_0"]["transformer_blocks_0"]
    to_q = block["attn1"]["to_q"]["kernel"]  # (64, 64): split over its 64 output columns
    assert {shard.data.shape for shard in to_q.addressable_shards} == {(64, 16)}
    conv = model.params["unet"]["conv_in"]["kernel"]  # convolutions stay whole
    assert {shard.data.shape for shard in conv.addressable_shards} == {conv.shape}
    expected = model.placement.weight_shardings(model.family, model.params)
    assert jax.tree.all(jax.tree.map(lambda a, s: a.sharding.is_equivalent_to(s, a.ndim), model.params, expected))


def test_every_mesh_renders_the_same_images(images_by_mesh: dict[int, np.ndarray]) -> None:
    whole = images_by_mesh[1].astype(int)
    assert len({image.tobytes() for image in images_by_mesh[1]}) == len(PROMPTS)
    for model_parallel in (4, 8):
        assert np.abs(images_by_mesh[model_parallel].astype(int) - whole).max() <= 1, model_parallel


@pytest.mark.parametrize("model_parallel", [1, 4])
def test_text_encoders_spread_over_every_device_render_the_same_images(
        tiny_sd: Path, images_by_mesh: dict[int, np.ndarray], model_parallel: int) -> None:
    """Spread (`split_text_encoders`), each device holds a slice of every text encoder weight a
    device count divides, and their program runs over the mesh: the images do not change."""
    model = load_model(str(tiny_sd), model_parallel=model_parallel)
    placement = make_placement(jax.devices(), model_parallel, text_split=True)
    renderer = engine(dataclasses.replace(model, placement=placement))
    shards = [(leaf.size, {shard.data.size for shard in leaf.addressable_shards})
              for leaf in jax.tree.leaves(renderer._params["text_encoder"]) if any(d % 8 == 0 for d in leaf.shape)]
    assert shards and all(sizes == {size // 8} for size, sizes in shards)
    specs = [JobSpec(prompt=p, seed=n, steps=3, guidance_scale=7.5, width=64, height=64, model=str(tiny_sd))
             for n, p in enumerate(PROMPTS)]
    images = np.stack([r.image for r in renderer.render(specs)])
    assert np.abs(images.astype(int) - images_by_mesh[1].astype(int)).max() <= 1


def test_a_split_that_does_not_divide_the_devices_is_refused(tiny_sd: Path) -> None:
    with pytest.raises(JobError, match=r"model_parallel=3: must divide the 8 devices"):
        load_model(str(tiny_sd), model_parallel=3)


def test_render_splits_the_weights_when_told(tiny_sd: Path, tmp_path: Path,
                                             images_by_mesh: dict[int, np.ndarray]) -> None:
    from PIL import Image

    done = subprocess.run([sys.executable, "-m", "renderfarm_cli", "render", "--model", str(tiny_sd), "--out",
                           str(tmp_path), "--campaign", "split", "--seed", "0", "--steps", "3", "--width", "64",
                           "--height", "64", "--model-parallel", "4", "--quiet", "a red fox in snow"],
                          capture_output=True, text=True, env=os.environ, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "on 8 cpu devices (batch 2)" in done.stdout  # two copies of the weights, a job each
    [png] = [p for p in (tmp_path / "split").glob("*.png") if p.stem != "preview"]
    assert np.abs(np.asarray(Image.open(png)).astype(int) - images_by_mesh[1][0].astype(int)).max() <= 1
