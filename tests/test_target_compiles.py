"""The tiny SD, SDXL and Flux programs compiled for accelerators that are not here, and their
compiled HLO read: the denoising loop gathers no weight whole, and all-reduces no more often
than Megatron's tensor parallelism needs (one per row-split layer, diffusion/sharding.py).

- a TPU v5e-8 (libtpu's v5e:2x4 topology) at every split of its 8 chips, attention traced as
  on the TPU (splash);
- eight H100s (jax's CUDA plugin given a described GPU, Python 3.12) split as a (4, 2) mesh,
  the one split that exercises both axes, attention traced as on CUDA (cuDNN, inside
  shard_map).

The models are the tiny ones with 8 heads (every split divides them), one UNet level and a
one-block VAE, so that each program compiles in seconds.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import jax
import pytest
from jax.sharding import PartitionSpec

from diffusion.architectures import abstract_model
from diffusion.generate import Static
from diffusion.models import LoadedModel
from diffusion.nn.attention import recording
from diffusion.placement import by_program, encoded_shapes, lower_encode, lower_generate, make_placement
from diffusion.schedulers import make
from diffusion.targets import target, target_devices
from diffusion.tiny import build_tiny_model

pytestmark = pytest.mark.target
SPLITS = (1, 2, 4, 8)
GPU_SPLIT = 2  # of eight H100s: a (4, 2) mesh
SIZE, STEPS = 16, 2  # 16x16 latents (the one-block VAE does not downsample): 256 tokens, splash's size
# Reductions one denoiser call needs when its blocks are split: the UNet's transformer block
# after its self-attention, cross-attention and MLP; Flux's double block after each stream's
# attention and MLP, its single block after proj_out.
UNET_BLOCK, DOUBLE_BLOCK, SINGLE_BLOCK = 3, 4, 1


def _configs(kind: str) -> dict[str, dict[str, Any]]:
    """What the tiny models change to compile fast at every split: 8 heads, one level."""
    vae = {"block_out_channels": [16], "down_block_types": ["DownEncoderBlock2D"],
           "up_block_types": ["UpDecoderBlock2D"]}
    if kind == "flux":
        return {"vae": vae, "transformer": {"num_attention_heads": 8}}
    return {"vae": vae, "unet": {"block_out_channels": [64], "attention_head_dim": [8],
                                 "down_block_types": ["CrossAttnDownBlock2D"],
                                 "up_block_types": ["CrossAttnUpBlock2D"]}}


@pytest.fixture(scope="module")
def v5e_8() -> list[jax.Device]:
    return list(target_devices(target("tpu-v5e-8")))


@pytest.fixture(scope="module")
def h100_8() -> list[jax.Device]:
    pytest.importorskip("jax_plugins.xla_cuda12", reason="GPU targets compile through jax's CUDA plugin "
                                                          "(jax 0.12, Python 3.12: the test extra)")
    return list(target_devices(target("h100-8")))


@pytest.fixture(scope="module", params=["sd", "sdxl", "flux"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """A tiny model of the family, shapes in place of weights, bfloat16 as on a TPU."""
    folder = build_tiny_model(tmp_path_factory.mktemp("tiny") / request.param, kind=request.param)
    for component, changes in _configs(request.param).items():
        path = folder / component / "config.json"
        path.write_text(json.dumps(json.loads(path.read_text()) | changes))
    return abstract_model(str(folder), "bfloat16")


def _compile(model: LoadedModel, name: str, devices: list[jax.Device], split: int) -> tuple[str, list[str]]:
    """The compiled HLO of the model's generate program (guided where its family guides) for
    target `name`'s `devices`, and the kernel each traced attention took."""
    placement = make_placement(devices, split)
    scheduler = model.family.schedulers[0] if model.family.name == "flux" else "ddim"
    guided = model.family.classifier_free
    text, weights = by_program(model.family, placement.abstract(model.family, model.params))
    inputs = model.abstract_inputs(placement.batch_size(1), placement.batch)
    with recording() as calls:
        lowered = lower_generate(model.family, model.networks, make(scheduler, model.configs["scheduler"]),
                                 Static(SIZE, SIZE, STEPS, guided), placement, weights, inputs,
                                 encoded_shapes(model.family, model.networks, guided, placement, text, inputs))
    return lowered.compile(compiler_options=target(name).compiler_options).as_text(), [call.kernel for call in calls]


def _computations(hlo: str) -> dict[str, str]:
    """Each computation of an HLO module's text by name."""
    parts = re.split(r"\n(?=(?:ENTRY )?%\S+ \(.*\{\n)", hlo)
    return {re.match(r"(?:ENTRY )?(%\S+)", part).group(1): part for part in parts if part.startswith(("%", "ENTRY"))}


def _loop(hlo: str, denoiser: str) -> str:
    """The text of the denoising loop's body and every computation it calls."""
    computations = _computations(hlo)
    bodies = [name for text in computations.values() for name in re.findall(r"body=(%[\w.\-]+)", text)]
    seen: set[str] = set()
    todo = bodies
    while todo:
        name = todo.pop()
        if name not in seen and name in computations:
            seen.add(name)
            todo += re.findall(r"%[\w.\-]+", computations[name])
    loop = "\n".join(computations[name] for name in seen)
    assert denoiser in loop, f"no while loop runs the {denoiser}"
    return loop


def _collectives(loop: str, op: str) -> list[list[tuple[int, ...]]]:
    """Each `op` (all-reduce, all-gather, ...; synchronous or started) in `loop`: the shapes it
    produces (an asynchronous start on a GPU gives its operands first, `((operands), results)`:
    left out)."""
    found = []
    for result in re.findall(rf"= (\S+|\(.*?\)) {op}(?:-start)?\(", loop):
        result = re.sub(r"^\(\([^()]*\),", "(", result)
        found.append([tuple(int(d) for d in dims.split(",") if d) for dims in re.findall(r"\w+\[([\d,]*)\]", result)])
    return found


@pytest.mark.parametrize("split", SPLITS)
def test_the_program_compiles_for_a_v5e_8_and_partitions_as_tensor_parallelism_does(
        model: LoadedModel, v5e_8: list[jax.Device], split: int) -> None:
    hlo, kernels = _compile(model, "tpu-v5e-8", v5e_8, split)
    assert "splash" in kernels and "tpu_custom_call" in hlo  # Mosaic kernels, under shard_map where split
    _assert_tensor_parallel(model, v5e_8, split, hlo)


def test_the_program_compiles_for_eight_h100s_with_cudnn_and_partitions_as_tensor_parallelism_does(
        model: LoadedModel, h100_8: list[jax.Device]) -> None:
    hlo, kernels = _compile(model, "h100-8", h100_8, GPU_SPLIT)
    # cuDNN for every attention of the tiny denoisers and VAEs (bfloat16, narrow heads), a custom
    # call each device runs on its part
    assert set(kernels) == {"cudnn"}
    assert "__cudnn$fmha" in hlo
    assert "tpu_custom_call" not in hlo
    _assert_tensor_parallel(model, h100_8, GPU_SPLIT, hlo)


def test_the_text_encoders_program_compiles_for_a_v5e_8_whole_on_each_chip_or_spread_over_all(
        model: LoadedModel, v5e_8: list[jax.Device]) -> None:
    """The text encoders run in a program of their own with XLA's attention (77 CLIP tokens; T5's
    position bias): whole on every chip of the widest split, all-reducing nothing; or spread over
    all eight chips (`split_text_encoders`), each holding an eighth of their weights."""
    programs = {}
    for placement in (make_placement(v5e_8, SPLITS[-1]), make_placement(v5e_8, 1, text_split=True)):
        text, _ = by_program(model.family, placement.abstract(model.family, model.params))
        with recording() as calls:
            lowered = lower_encode(model.family, model.networks, model.family.classifier_free, placement, text,
                                   model.abstract_inputs(placement.batch_size(1), placement.batch))
        programs[placement.text_split] = lowered.compile()
        assert {call.kernel for call in calls} == {"heads"}
    assert "all-reduce(" not in programs[False].as_text()
    whole, spread = (programs[split].memory_analysis().argument_size_in_bytes for split in (False, True))
    assert spread < whole / 2, (spread, whole)


def _assert_tensor_parallel(model: LoadedModel, devices: list[jax.Device], split: int, hlo: str) -> None:
    """The compiled program's denoising loop gathers no split weight whole, and all-reduces a
    block's activations as often as tensor parallelism needs at most (never where unsplit)."""
    denoiser = model.networks[model.family.loras.denoiser]
    loop = _loop(hlo, type(denoiser).__name__)
    gathered = {shape for gather in _collectives(loop, "all-gather") for shape in gather}
    placement = make_placement(devices, split)
    specs = jax.tree.leaves(placement.weight_shardings(model.family, model.params))
    split_weights = {tuple(leaf.shape) for leaf, sharding in zip(jax.tree.leaves(model.params), specs, strict=True)
                     if sharding.spec != PartitionSpec()}
    assert bool(split_weights) == (split > 1)
    # a split bias has the shape of one image's modulation vector, which is gathered (below) where
    # a device holds one image (the GPU's compiler drops the batch axis of 1): matrices only
    matrices = {shape for shape in split_weights if len(shape) > 1}
    assert not gathered & matrices, "a split weight is gathered whole in the denoising loop"
    config = denoiser.config
    # Reductions of a block's activations (an image's tokens x width or more); the modulation
    # vectors (a few values an image) are gathered whole, whichever collective XLA picks.
    if model.family.name == "flux":
        image = (SIZE // 2) ** 2 * config.inner_dim
        needed = DOUBLE_BLOCK * config.num_layers + SINGLE_BLOCK * config.num_single_layers
    else:
        image = SIZE ** 2 * config.block_out_channels[0]
        blocks = len(re.findall(r"transformer_blocks_\d+/attn1/to_q/kernel", " ".join(
            jax.tree_util.keystr(path, simple=True, separator="/")
            for path, _ in jax.tree_util.tree_leaves_with_path(model.params["unet"]))))
        needed = UNET_BLOCK * blocks
    reductions = sum(math.prod(shape) >= image for shapes in _collectives(loop, "all-reduce") for shape in shapes)
    assert 0 < reductions <= needed if split > 1 else reductions == 0, (reductions, needed)
