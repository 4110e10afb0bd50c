"""diffusion/weights.py and diffusion/convert.py: checkpoint files -> the Flax parameter trees.

The PyTorch names come from tests/data/weights/*.json (tests/oracle/weights.py: the names and
shapes diffusers 0.42 / transformers 5.23 really save for tiny SD 1.x/2.x/XL UNets, a VAE and the
CLIP text encoders). Each test builds a state dict with those names and shapes and random values,
writes it with the `safetensors` package, and loads it into the trees of diffusers 0.39's and
transformers 4.57's Flax classes, the trees our diffusion/nn modules keep. No torch here.
"""

from __future__ import annotations

import functools
import json
import pickle
import struct
import tracemalloc
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax.serialization import msgpack_restore
from flax.traverse_util import flatten_dict
from huggingface_hub.serialization import split_state_dict_into_shards_factory
from safetensors.numpy import load_file, save_file

from diffusion import weights
from diffusion.weights import MAX_HEADER, WeightsError, load_weights
from renderfarm.jobs import JobError

DATA = Path(__file__).parent / "data" / "weights"
ENTRIES = {path.stem: json.loads(path.read_text(encoding="utf-8")) for path in sorted(DATA.glob("*.json"))}
F32, BF16 = np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16)
FILE = {"unet": "diffusion_pytorch_model", "vae": "diffusion_pytorch_model",
        "clip": "model", "clip_projection": "model"}


@functools.cache
def expected(name: str) -> dict:
    """The Flax parameter shapes of entry `name`'s model (diffusers 0.39 / transformers 4.57)."""
    entry = ENTRIES[name]
    kind, config, key = entry["kind"], entry["config"], jax.random.PRNGKey(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from diffusers import FlaxAutoencoderKL, FlaxUNet2DConditionModel
        from transformers import (
            CLIPTextConfig,
            FlaxCLIPTextModel,
            FlaxCLIPTextModelWithProjection,
        )
        if kind in ("unet", "vae"):
            module = (FlaxUNet2DConditionModel if kind == "unet" else FlaxAutoencoderKL).from_config(config)
            return jax.eval_shape(module.init_weights, key)
        cls = FlaxCLIPTextModel if kind == "clip" else FlaxCLIPTextModelWithProjection
        model = cls(CLIPTextConfig(**config), _do_init=False)
        return jax.eval_shape(lambda k: model.init_weights(k, (1, 77)), key)


def state_dict(name: str, seed: int = 0, dtype: Any = np.float32) -> dict[str, np.ndarray]:
    """Random values under entry `name`'s PyTorch names and shapes."""
    rng = np.random.default_rng(seed)
    return {key: rng.standard_normal(shape).astype(dtype) for key, shape in ENTRIES[name]["tensors"].items()}


def component(root: Path, tensors: dict[str, np.ndarray], file: str = "diffusion_pytorch_model.safetensors") -> Path:
    folder = root / "c"
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / file, metadata={"format": "pt"})
    return folder / file


def load(root: Path, name: str, dtype: Any = F32, variant: str | None = None) -> dict:
    return flatten_dict(load_weights(root, "c", ENTRIES[name]["kind"], expected(name), dtype, variant))


def raises(match: str, *args: Any, **kwargs: Any) -> pytest.ExceptionInfo:
    with pytest.raises(WeightsError) as info:
        load_weights(*args, **kwargs)
    assert isinstance(info.value, JobError) and info.value.field == "model"
    for part in match.split("|"):
        assert part in str(info.value), (part, str(info.value))
    return info


# One of each kind of layer per model: PyTorch name, Flax path, how the layout changes.
CONV, LINEAR, SAME = (2, 3, 1, 0), (1, 0), None
SPOT_CHECKS = {
    "unet": [
        ("conv_in.weight", "conv_in/kernel", CONV),
        ("time_embedding.linear_1.weight", "time_embedding/linear_1/kernel", LINEAR),
        ("conv_norm_out.weight", "conv_norm_out/scale", SAME),
        ("conv_norm_out.bias", "conv_norm_out/bias", SAME),
        ("mid_block.attentions.0.transformer_blocks.0.attn1.to_out.0.weight",
         "mid_block/attentions_0/transformer_blocks_0/attn1/to_out_0/kernel", LINEAR),
        ("mid_block.attentions.0.transformer_blocks.0.attn2.to_k.weight",
         "mid_block/attentions_0/transformer_blocks_0/attn2/to_k/kernel", LINEAR),
        ("mid_block.attentions.0.transformer_blocks.0.ff.net.0.proj.weight",
         "mid_block/attentions_0/transformer_blocks_0/ff/net_0/proj/kernel", LINEAR),
        ("mid_block.attentions.0.transformer_blocks.0.norm2.weight",
         "mid_block/attentions_0/transformer_blocks_0/norm2/scale", SAME),
        ("up_blocks.0.resnets.0.conv_shortcut.weight", "up_blocks_0/resnets_0/conv_shortcut/kernel", CONV),
    ],
    "vae": [
        ("encoder.conv_in.weight", "encoder/conv_in/kernel", CONV),
        ("quant_conv.weight", "quant_conv/kernel", CONV),
        ("decoder.up_blocks.0.upsamplers.0.conv.weight", "decoder/up_blocks_0/upsamplers_0/conv/kernel", CONV),
        ("encoder.down_blocks.0.downsamplers.0.conv.weight",
         "encoder/down_blocks_0/downsamplers_0/conv/kernel", CONV),
        ("decoder.mid_block.attentions.0.group_norm.weight", "decoder/mid_block/attentions_0/group_norm/scale", SAME),
    ],
    "clip": [
        ("text_model.embeddings.token_embedding.weight", "text_model/embeddings/token_embedding/embedding", SAME),
        ("text_model.embeddings.position_embedding.weight",
         "text_model/embeddings/position_embedding/embedding", SAME),
        ("text_model.encoder.layers.1.mlp.fc1.weight", "text_model/encoder/layers/1/mlp/fc1/kernel", LINEAR),
        ("text_model.encoder.layers.0.self_attn.v_proj.weight",
         "text_model/encoder/layers/0/self_attn/v_proj/kernel", LINEAR),
        ("text_model.final_layer_norm.weight", "text_model/final_layer_norm/scale", SAME),
    ],
}
SPOT_CHECKS["clip_projection"] = SPOT_CHECKS["clip"] + [("text_projection.weight", "text_projection/kernel", LINEAR)]
# The VAE mid-block attention: both PyTorch namings -> the Flax VAE's names.
for new, old, flax in (("to_q", "query", "query"), ("to_k", "key", "key"), ("to_v", "value", "value"),
                       ("to_out.0", "proj_attn", "proj_attn")):
    SPOT_CHECKS["vae"].append((f"encoder.mid_block.attentions.0.{new}.weight",
                               f"encoder/mid_block/attentions_0/{flax}/kernel", LINEAR))
    SPOT_CHECKS["vae"].append((f"decoder.mid_block.attentions.0.{old}.bias",
                               f"decoder/mid_block/attentions_0/{flax}/bias", SAME))


def _spot(name: str, tensors: dict[str, np.ndarray], loaded: dict) -> int:
    """Check the spot-check layers present under this entry's naming; returns how many."""
    done = 0
    for torch_name, flax_path, axes in SPOT_CHECKS[ENTRIES[name]["kind"]]:
        candidates = [torch_name, torch_name.removeprefix("text_model.")]
        source = next((tensors[c] for c in candidates if c in tensors), None)
        if source is None:
            continue
        want = source.transpose(axes) if axes else source
        np.testing.assert_array_equal(loaded[tuple(flax_path.split("/"))], want, err_msg=f"{name}: {torch_name}")
        done += 1
    return done


@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_checkpoint_fills_every_parameter(tmp_path: Path, name: str) -> None:
    """Each real naming lands on every parameter of the Flax tree, each value exactly once,
    and conv / linear / norm / embedding layouts converted (spot checks, values against
    safetensors' own reader)."""
    kind = ENTRIES[name]["kind"]
    file = component(tmp_path, state_dict(name), f"{FILE[kind]}.safetensors")
    tensors = load_file(file)  # the reference reader
    loaded = load(tmp_path, name)
    shapes = {path: leaf.shape for path, leaf in flatten_dict(expected(name)).items()}
    assert {path: array.shape for path, array in loaded.items()} == shapes
    assert all(array.dtype == F32 and array.flags.c_contiguous for array in loaded.values())
    every = lambda arrays: np.sort(np.concatenate([a.ravel() for a in arrays]))
    np.testing.assert_array_equal(every(loaded.values()), every(tensors.values()))
    assert _spot(name, tensors, loaded) >= 4


def test_unet_projection_kinds(tmp_path: Path) -> None:
    """proj_in/proj_out are 1x1 convs in SD 1.x and linears in SD 2.x / XL; XL adds add_embedding."""
    for name, axes in (("unet_sd1", CONV), ("unet_sd2", LINEAR), ("unet_sdxl", LINEAR)):
        tensors = state_dict(name)
        component(tmp_path / name, tensors)
        loaded = load(tmp_path / name, name)
        block = "down_blocks.0" if name == "unet_sd1" else "down_blocks.1"
        source = tensors[f"{block}.attentions.0.proj_in.weight"]
        np.testing.assert_array_equal(
            loaded[(block.replace(".", "_"), "attentions_0", "proj_in", "kernel")], source.transpose(axes))
    np.testing.assert_array_equal(loaded[("add_embedding", "linear_2", "kernel")],
                                  tensors["add_embedding.linear_2.weight"].T)


def test_clip_position_ids_buffer_dropped(tmp_path: Path) -> None:
    """transformers < 4.31 saved the int64 `position_ids` buffer; it is not a parameter."""
    tensors = state_dict("clip_text_model")
    tensors["text_model.embeddings.position_ids"] = np.arange(77, dtype=np.int64)[None]
    component(tmp_path, tensors, "model.safetensors")
    assert len(load(tmp_path, "clip_text_model")) == len(tensors) - 1


def test_dtypes_become_the_requested_one(tmp_path: Path) -> None:
    """F16 and BF16 files load as float32 or bfloat16 as asked; F32 rounds to bfloat16."""
    for file_dtype in (np.float16, ml_dtypes.bfloat16, np.float32):
        tensors = state_dict("vae", dtype=file_dtype)
        root = tmp_path / np.dtype(file_dtype).name
        component(root, tensors)
        for target in (F32, BF16):
            loaded = load(root, "vae", target)
            assert {a.dtype for a in loaded.values()} == {target}
            np.testing.assert_array_equal(loaded[("quant_conv", "bias")], tensors["quant_conv.bias"].astype(target))
    for spelling in ("bfloat16", jnp.bfloat16, jnp.dtype("bfloat16")):  # how callers name it
        assert load(root, "vae", spelling)[("quant_conv", "bias")].dtype == BF16
    with pytest.raises(JobError, match="dtype='float16': must be one of float32, bfloat16"):
        load_weights(root, "c", "vae", expected("vae"), np.float16)


def test_variant_chosen_and_missing_one_listed(tmp_path: Path) -> None:
    base = state_dict("vae", seed=1)
    component(tmp_path, base)
    component(tmp_path, state_dict("vae", seed=2, dtype=np.float16), "diffusion_pytorch_model.fp16.safetensors")
    component(tmp_path, state_dict("vae", seed=3, dtype=ml_dtypes.bfloat16),
              "diffusion_pytorch_model.bf16.safetensors")
    (tmp_path / "c" / "diffusion_pytorch_model.bin").write_bytes(b"never read")
    for variant, seed in ((None, 1), ("fp16", 2), ("bf16", 3)):
        want = state_dict("vae", seed=seed, dtype={1: np.float32, 2: np.float16, 3: ml_dtypes.bfloat16}[seed])
        got = load(tmp_path, "vae", variant=variant)[("decoder", "conv_out", "kernel")]
        np.testing.assert_array_equal(got, want["decoder.conv_out.weight"].astype(F32).transpose(CONV))
    raises("c': has no weights of variant 'ema'|diffusion_pytorch_model.ema.safetensors|"
           "variants present: bf16, default, fp16", tmp_path, "c", "vae", expected("vae"), F32, "ema")
    # The one rule for a variant (diffusion.choices.check_variant), which the job contract applies too.
    for bad in ("FP16", "fp-16", "x" * 33, "../fp16"):
        with pytest.raises(JobError, match=r"variant=.*must match \[a-z0-9_\]\{1,32\}"):
            weights.choose_weights(tmp_path / "c", bad)
    (tmp_path / "c" / "diffusion_pytorch_model.safetensors").unlink()
    raises("c': has no weights without a variant (none of diffusion_pytorch_model.safetensors, model.safetensors,|"
           "variants present: bf16, fp16", tmp_path, "c", "vae", expected("vae"), F32)
    with pytest.raises(JobError, match="variant='../x'"):
        load_weights(tmp_path, "c", "vae", expected("vae"), F32, "../x")


def _shard(root: Path, tensors: dict[str, np.ndarray], stem: str, variant: str | None = None) -> int:
    """Shards and index as diffusers/transformers save_pretrained write them (huggingface_hub's
    splitter, `stem[.variant]-0000i-of-0000n.safetensors`, `stem.safetensors.index[.variant].json`)."""
    pattern = f"{stem}{'.' + variant if variant else ''}{{suffix}}.safetensors"
    split = split_state_dict_into_shards_factory(
        tensors, get_storage_size=lambda a: a.nbytes, filename_pattern=pattern, max_shard_size=20_000)
    folder = root / "c"
    folder.mkdir(parents=True, exist_ok=True)
    for file, names in split.filename_to_tensors.items():
        save_file({n: tensors[n] for n in names}, folder / file, metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())},
             "weight_map": split.tensor_to_filename}
    index_name = f"{stem}.safetensors.index{'.' + variant if variant else ''}.json"
    (folder / index_name).write_text(json.dumps(index, indent=2, sort_keys=True))
    return len(split.filename_to_tensors)


def test_sharded_equals_unsharded(tmp_path: Path) -> None:
    for name, stem in (("unet_sdxl", "diffusion_pytorch_model"), ("clip_projection", "model")):
        tensors = state_dict(name)
        component(tmp_path / "whole" / name, tensors, f"{stem}.safetensors")
        assert _shard(tmp_path / name, tensors, stem) > 2
        _shard(tmp_path / name, {k: v.astype(np.float16) for k, v in tensors.items()}, stem, "fp16")
        whole = load(tmp_path / "whole" / name, name)
        for variant, dtype in ((None, np.float32), ("fp16", np.float16)):
            sharded = load(tmp_path / name, name, variant=variant)
            assert sharded.keys() == whole.keys()
            for key, value in whole.items():
                np.testing.assert_array_equal(sharded[key], value.astype(dtype).astype(F32))


# Each lie edits the weight_map; `other` is a shard that does not hold conv_in.bias.
INDEX_LIES = {
    "path in shard name": (lambda m, other: m.update({"conv_in.bias": "../../etc/passwd"}),
                           "shard '../../etc/passwd' is not a plain file name"),
    "missing shard": (lambda m, other: m.update({"conv_in.bias": "gone.safetensors"}),
                      "shard 'gone.safetensors' is missing"),
    "wrong shard": (lambda m, other: m.update({"conv_in.bias": other}), "tensor 'conv_in.bias' of "),
    "unlisted tensor": (lambda m, other: m.pop("conv_in.bias"), "tensor 'conv_in.bias' of "),
    "tensor in no shard": (lambda m, other: m.update({"ghost.weight": other}),
                           "tensor 'ghost.weight' is mapped to "),
}


@pytest.mark.parametrize("case", sorted(INDEX_LIES))
def test_sharded_index_must_agree_with_shards(tmp_path: Path, case: str) -> None:
    lie, match = INDEX_LIES[case]
    _shard(tmp_path, state_dict("unet_sd1"), "diffusion_pytorch_model")
    index_file = tmp_path / "c" / "diffusion_pytorch_model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    weight_map = index["weight_map"]
    lie(weight_map, next(f for f in sorted(weight_map.values()) if f != weight_map["conv_in.bias"]))
    index_file.write_text(json.dumps(index))
    raises(f"diffusion_pytorch_model.safetensors.index.json: {match}", tmp_path, "c", "unet",
           expected("unet_sd1"), F32)


def test_msgpack_folder_loads_unchanged(tiny_sd: Path) -> None:
    """Today's Flax checkpoints (diffusion.tiny's msgpack folders) load as they are."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from diffusers import FlaxAutoencoderKL, FlaxUNet2DConditionModel
    for component_name, cls, file in (("unet", FlaxUNet2DConditionModel, "diffusion_flax_model.msgpack"),
                                      ("vae", FlaxAutoencoderKL, "diffusion_flax_model.msgpack"),
                                      ("text_encoder", None, "flax_model.msgpack")):
        stored = msgpack_restore((tiny_sd / component_name / file).read_bytes())
        shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), stored)
        kind = {"unet": "unet", "vae": "vae", "text_encoder": "clip"}[component_name]
        for dtype in (F32, BF16):
            loaded = load_weights(tiny_sd, component_name, kind, shapes, dtype)
            assert jax.tree.structure(loaded) == jax.tree.structure(stored)
            for got, want in zip(jax.tree.leaves(loaded), jax.tree.leaves(stored)):
                np.testing.assert_array_equal(got, want.astype(dtype))
                assert got.dtype == dtype
        if cls is not None:  # the stored tree is the Flax module's own
            module = cls.from_config(cls.load_config(tiny_sd / component_name))
            want = jax.tree.map(lambda a: a.shape, jax.eval_shape(module.init_weights, jax.random.PRNGKey(0)))
            assert jax.tree.map(lambda a: a.shape, stored) == want
        if component_name == "vae":  # a tree under "params" (module.init's) comes back under it
            assert list(load_weights(tiny_sd, "vae", "vae", {"params": shapes}, F32)) == ["params"]


# -------------------------------------------------------------------------------------- lying headers

def _raw(root: Path, header: Any, data: bytes = b"", length: int | None = None) -> Path:
    """A safetensors file written by hand: any header, any declared length."""
    folder = root / "c"
    folder.mkdir(parents=True, exist_ok=True)
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    path = folder / "diffusion_pytorch_model.safetensors"
    path.write_bytes(struct.pack("<Q", len(body) if length is None else length) + body + data)
    return path


def _entry(dtype: str = "F32", shape: Any = (2, 2), offsets: Any = (0, 16)) -> dict:
    return {"dtype": dtype, "shape": list(shape) if isinstance(shape, tuple) else shape,
            "data_offsets": list(offsets) if isinstance(offsets, tuple) else offsets}


LIES = {
    "unknown dtype": ({"conv_in.bias": _entry(dtype="F128")}, "tensor 'conv_in.bias' has unknown dtype 'F128'"),
    "negative shape": ({"conv_in.bias": _entry(shape=(-2, -2))}, "tensor 'conv_in.bias' has shape [-2, -2]"),
    "float shape": ({"conv_in.bias": _entry(shape=(2.0, 2))}, "tensor 'conv_in.bias' has shape [2.0, 2]"),
    "bool shape": ({"conv_in.bias": _entry(shape=(True, 4))}, "tensor 'conv_in.bias' has shape [True, 4]"),
    "string shape": ({"conv_in.bias": _entry(shape="4")}, "tensor 'conv_in.bias' has shape '4'"),
    "offsets past the end": ({"conv_in.bias": _entry(offsets=(0, 4 * 10**12), shape=(10**12,))},
                             "tensor 'conv_in.bias' has data_offsets [0, 4000000000000] outside the file's 64"),
    "offsets backwards": ({"conv_in.bias": _entry(offsets=(16, 0))},
                          "tensor 'conv_in.bias' has data_offsets [16, 0]"),
    "negative offset": ({"conv_in.bias": _entry(offsets=(-16, 0))},
                        "tensor 'conv_in.bias' has data_offsets [-16, 0]"),
    "size mismatch (10^12 elements)": ({"conv_in.bias": _entry(shape=(10**6, 10**6))},
                                       ("tensor 'conv_in.bias' has 16 bytes of data, but F32 x [1000000, 1000000] "
                                        "needs 4000000000000")),
    "overlap": ({"conv_in.bias": _entry(), "conv_in.weight": _entry(offsets=(8, 24), shape=(4,))},
                "tensor 'conv_in.weight' overlaps tensor 'conv_in.bias'"),
    "not an entry": ({"conv_in.bias": [1, 2]}, "tensor 'conv_in.bias' is not an object with dtype"),
    "duplicate names": (b'{"conv_in.bias": {}, "conv_in.bias": {}}',
                        "header is not valid JSON (duplicate key 'conv_in.bias'"),
    "invalid json": (b'{"conv_in.bias": ', "header is not valid JSON"),
    "not utf-8": (b'{"\xff": 1}', "header is not valid JSON"),
    "not an object": (b"[]", "header is not a JSON object"),
    "bad metadata": ({"__metadata__": [1]}, "header's __metadata__ is not a JSON object"),
    "nested 100,000 deep": (b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                            "header is not valid JSON (nested deeper than Python's JSON parser goes)"),
}


@pytest.mark.parametrize("case", sorted(LIES))
def test_lying_header_refused_without_allocating(tmp_path: Path, case: str) -> None:
    header, match = LIES[case]
    _raw(tmp_path, header, bytes(64))
    want = expected("unet_sd1")
    tracemalloc.start()  # numpy's buffers are traced too
    try:
        raises(f"diffusion_pytorch_model.safetensors: {match}", tmp_path, "c", "unet", want, F32)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20, f"{peak} bytes allocated to refuse a 64-byte file"


def test_hostile_names_stay_short_in_errors(tmp_path: Path) -> None:
    long = "x" * 10**6
    _raw(tmp_path / "header", {long: _entry(dtype="F128")})
    info = raises("tensor 'xxxxx", tmp_path / "header", "c", "unet", expected("unet_sd1"), F32)
    assert len(str(info.value)) < 1000
    tensors = state_dict("unet_sd1")
    tensors[long] = np.zeros(1, np.float32)
    component(tmp_path / "fit", tensors)
    info = raises("1 tensor with no home in the model: xxxxx", tmp_path / "fit", "c", "unet", expected("unet_sd1"), F32)
    assert len(str(info.value)) < 1000


def test_header_length_checked_before_reading(tmp_path: Path) -> None:
    _raw(tmp_path, b"{}", length=10**6)
    raises("declares a 1000000-byte header in a 10-byte file", tmp_path, "c", "unet",
           expected("unet_sd1"), F32)
    path = _raw(tmp_path, b"{}", length=MAX_HEADER + 1)
    with open(path, "r+b") as f:  # sparse: the file really is longer than the limit
        f.truncate(MAX_HEADER + 100)
    raises(f"declares a {MAX_HEADER + 1}-byte header, over the {MAX_HEADER}-byte limit", tmp_path, "c",
           "unet", expected("unet_sd1"), F32)
    path.write_bytes(b"\x01\x00")
    raises("is 2 bytes, too short", tmp_path, "c", "unet", expected("unet_sd1"), F32)


def test_headers_far_past_real_checkpoints_are_refused(tmp_path: Path) -> None:
    """The caps the module documents: 16 MiB of header (real ones are ~200 KB to a few MB) and
    100,000 tensors a file (a shard of a 30B-parameter model lists a few thousand)."""
    path = _raw(tmp_path / "bytes", b"{}", length=16 * 2**20 + 1)
    with open(path, "r+b") as f:  # sparse: the file really is longer than the header it declares
        f.truncate(17 * 2**20)
    raises("declares a 16777217-byte header, over the 16777216-byte limit", tmp_path / "bytes", "c", "unet",
           expected("unet_sd1"), F32)
    empty = _entry(shape=(0,), offsets=(0, 0))  # a tensor of no bytes: the header is all there is
    _raw(tmp_path / "count", {f"t{i}": empty for i in range(100_001)})
    raises("diffusion_pytorch_model.safetensors: header lists 100001 tensors, over the 100000-tensor limit",
           tmp_path / "count", "c", "unet", expected("unet_sd1"), F32)


def test_an_index_nested_too_deep_is_refused(tmp_path: Path) -> None:
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "diffusion_pytorch_model.safetensors.index.json").write_bytes(
        b'{"weight_map": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    raises("diffusion_pytorch_model.safetensors.index.json: is not a JSON object with a weight_map "
           "(nested deeper than Python's JSON parser goes)", tmp_path, "c", "unet", expected("unet_sd1"), F32)


def test_unloadable_dtype_named(tmp_path: Path) -> None:
    tensors = state_dict("unet_sd1")
    tensors["conv_in.bias"] = tensors["conv_in.bias"].astype(np.int32)
    component(tmp_path, tensors)
    raises("tensor 'conv_in.bias' has dtype I32; weights must be one of F64, F32, F16, BF16, F8_E4M3, F8_E5M2",
           tmp_path, "c", "unet", expected("unet_sd1"), F32)


def test_shapes_checked_before_any_data_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tensors = state_dict("unet_sd1")
    tensors["conv_in.weight"] = tensors["conv_in.weight"][:, :2]
    component(tmp_path, tensors)
    monkeypatch.setattr(weights, "read_tensor", lambda *a: pytest.fail("tensor data read before the shapes fit"))
    raises("1 tensor with the wrong shape: conv_in.weight (as conv_in/kernel [3, 3, 2, 32], the model's is "
           "[3, 3, 4, 32])", tmp_path, "c",
           "unet", expected("unet_sd1"), F32)


# ----------------------------------------------------------------------------------------- misfits

def test_tensor_without_home_and_missing_parameter_named(tmp_path: Path) -> None:
    tensors = state_dict("unet_sd1")
    tensors["conv_in.lora_up.weight"] = np.zeros((4, 4), np.float32)
    del tensors["conv_out.bias"]
    component(tmp_path, tensors)
    raises("1 tensor with no home in the model: conv_in.lora_up.weight (no parameter "
           "conv_in/lora_up/kernel)|1 parameter left missing: conv_out/bias [4]",
           tmp_path, "c", "unet", expected("unet_sd1"), F32)


def test_two_tensors_for_one_parameter_refused(tmp_path: Path) -> None:
    """A VAE with both attention namings, or CLIP names with and without `text_model.`."""
    tensors = state_dict("vae")
    tensors["encoder.mid_block.attentions.0.query.bias"] = tensors["encoder.mid_block.attentions.0.to_q.bias"]
    component(tmp_path / "vae", tensors)
    raises("1 tensor with no home in the model: encoder.mid_block.attentions.0.", tmp_path / "vae", "c", "vae",
           expected("vae"), F32)
    tensors = state_dict("clip")
    tensors["text_model.final_layer_norm.bias"] = tensors["final_layer_norm.bias"]
    component(tmp_path / "clip", tensors, "model.safetensors")
    raises("bias (text_model/final_layer_norm/bias is already filled by ", tmp_path / "clip", "c", "clip",
           expected("clip"), F32)


def test_wrong_architecture_lists_a_few_and_counts_the_rest(tmp_path: Path) -> None:
    """An SD 2.x UNet (linear projections, other layout) is not an SD 1.x one."""
    component(tmp_path, state_dict("unet_sd2"))
    info = raises("2 tensors with the wrong shape: mid_block.attentions.0.proj_in.weight (as mid_block/attentions_0/"
                  "proj_in/kernel [64, 64], the model's is [1, 1, 64, 64])|78 tensors with no home in the model: "
                  "down_blocks.1.attentions.0.norm.bias (no parameter down_blocks_1/attentions_0/norm/bias)|"
                  "and 73 more|78 parameters left missing",
                  tmp_path, "c", "unet", expected("unet_sd1"), F32)
    assert len(str(info.value)) < 2000
    component(tmp_path, state_dict("clip_projection"), "diffusion_pytorch_model.safetensors")
    raises("text_projection.weight (no parameter text_projection/kernel)", tmp_path, "c", "clip",
           expected("clip"), F32)


# ------------------------------------------------------------------------------------------ pickles

class _Payload:
    """Unpickling this creates a file: the proof that a loader ran the pickle."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize("file", ["diffusion_pytorch_model.bin", "model.ckpt", "model.pt", "weights.pth"])
def test_pickles_refused_and_never_opened(tmp_path: Path, file: str) -> None:
    folder = tmp_path / "c"
    folder.mkdir()
    marker = tmp_path / "pwned"
    (folder / file).write_bytes(pickle.dumps(_Payload(marker)))
    (folder / "config.json").write_text("{}")
    raises(f"{file} is a pickle file, which is never loaded: unpickling runs code|"
           "save_pretrained(folder, safe_serialization=True)", tmp_path, "c", "unet", expected("unet_sd1"), F32)
    assert not marker.exists()


def test_nothing_to_load(tmp_path: Path) -> None:
    (tmp_path / "c").mkdir()
    raises("c': holds no weights (looked for diffusion_pytorch_model.safetensors, model.safetensors",
           tmp_path, "c", "unet", expected("unet_sd1"), F32)
    raises("is not a folder", tmp_path, "missing", "unet", expected("unet_sd1"), F32)
    raises("weights kind 'dit' is not one of unet, vae, clip, clip_projection", tmp_path, "c", "dit",
           expected("vae"), F32)
