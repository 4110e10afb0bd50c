"""Loading to the devices (diffusion/weights.py's device path, which load_model runs): the same
parameters, bit for bit, as the host path (numpy, tensor by tensor: what the loader did before),
whether they are permuted and cast on the devices (accelerators) or in the reading threads (CPU
devices), for every source the loader takes (folders and their fp16/bf16 variants, sharded
checkpoints, single files with transposed views, LoRAs merged in float32, mixed and misaligned
dtypes); placed replicated on every device; with every check still made before any data is read."""

from __future__ import annotations

import functools
import json
import logging
import shutil
from pathlib import Path
from typing import Any
from unittest import mock

import jax
import ml_dtypes
import numpy as np
import pytest
from flax.traverse_util import flatten_dict
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from safetensors.numpy import load_file, save_file

from diffusion import weights
from diffusion.convert import WeightsError
from diffusion.families import detect
from diffusion.models import LoadedModel, load_model, replicated
from diffusion.weights import TensorInfo, load_tensors, read_header
from renderfarm.jobs import JobError
from tests.helpers import same_params

DATA = Path(__file__).parent / "data"
ORACLE = DATA / "oracle"
SINGLE = DATA / "single_file"
LORA = DATA / "lora" / "sd1" / "kohya.safetensors"
DTYPES = ("float32", "bfloat16")
MODES = ("device", "host")  # RENDERFARM_CONVERT: where the device path permutes and casts


def old_path(where: Path, kind: str, tensors: Any, wanted: Any, target: np.dtype, deltas: Any, sharding: Any) -> dict:
    """The loader as it was: numpy on the host, tensor by tensor; then placed."""
    return jax.device_put(weights._read_safetensors(where, kind, tensors, wanted, target, deltas), sharding)


@functools.cache
def reference(*args: Any, **kwargs: Any) -> LoadedModel:
    """load_model with the old loader (once per model: both modes compare against it)."""
    with mock.patch.object(weights, "_place_safetensors", old_path):
        return load_model(*args, **kwargs)


def assert_same_bits(new: dict, old: dict) -> None:
    """The same parameters, dtypes, shapes and bytes; the new ones replicated on every device."""
    assert new.keys() == old.keys()
    for component in new:
        flat_new, flat_old = flatten_dict(new[component]), flatten_dict(old[component])
        assert flat_new.keys() == flat_old.keys(), component  # (jax sorts dict keys: order is no matter)
        for path, leaf in flat_new.items():
            expected = np.asarray(flat_old[path])
            assert isinstance(leaf, jax.Array), (component, path)
            assert leaf.sharding.is_fully_replicated and leaf.sharding.device_set == set(jax.local_devices())
            got = np.asarray(leaf)
            assert (got.dtype, got.shape) == (expected.dtype, expected.shape), (component, path)
            assert got.tobytes() == expected.tobytes(), (component, path)


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("RENDERFARM_CONVERT", request.param)
    return request.param


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("model", "variant"), [("sd1", None), ("sd1", "fp16"), ("sdxl", None), ("sdxl", "bf16"),
                                                ("sd1-sharded", None)])
def test_folders_load_as_the_old_loader_did_bit_for_bit(model: str, variant: str | None, dtype: str,
                                                        mode: str) -> None:
    folder = str(ORACLE / model / "model")
    assert_same_bits(load_model(folder, dtype, variant).params,
                     reference(folder, dtype, variant).params)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", ["sd2", "sdxl"])
def test_single_files_with_transposed_views_load_as_before(family: str, dtype: str, mode: str) -> None:
    """SD 2.x and XL single files hold OpenCLIP's text projection transposed (diffusion/single_file.py)."""
    args = (str(SINGLE / f"{family}.safetensors"), dtype)
    base = str(ORACLE / family / "model")
    assert_same_bits(load_model(*args, base=base).params, reference(*args, base=base).params)


@pytest.mark.parametrize("dtype", DTYPES)
def test_loras_merge_in_float32_before_the_cast_as_before(dtype: str, mode: str) -> None:
    kwargs = {"base": str(ORACLE / "sd1" / "model"), "loras": ((str(LORA), 0.7), (str(LORA), -0.3))}
    new = load_model(str(SINGLE / "sd1.safetensors"), dtype, **kwargs)
    old = reference(str(SINGLE / "sd1.safetensors"), dtype, **kwargs)
    assert_same_bits(new.params, old.params)
    plain = load_model(str(SINGLE / "sd1.safetensors"), dtype, base=kwargs["base"])
    assert any(not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
               zip(jax.tree.leaves(new.params["unet"]), jax.tree.leaves(plain.params["unet"])))


# ------------------------------------------------------------------------- load_tensors, file by file

def write_safetensors(path: Path, tensors: dict[str, tuple[str, np.ndarray]], gap: int = 0) -> None:
    """Any safetensors dtype, `gap` unused bytes before the first tensor (so all are misaligned)."""
    header, blobs, offset = {}, [b"\0" * gap], gap
    for name, (dtype, array) in tensors.items():
        data = np.ascontiguousarray(array).tobytes()
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + b"".join(blobs))


STORED = {"F16": np.float16, "BF16": ml_dtypes.bfloat16, "F32": np.float32, "F64": np.float64,
          "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}


def mixed_vae(tmp_path: Path, transposed: bool = True) -> tuple[dict[str, TensorInfo], Any]:
    """The sd1 VAE's tensors in every float dtype in turn, misaligned, some 2-D ones stored transposed
    (as single files hold OpenCLIP's projection), some with their rows rolled (as Flux single files
    hold the final modulation); with the model's expected tree."""
    folder = ORACLE / "sd1" / "model"
    state = load_file(str(folder / "vae" / "diffusion_pytorch_model.safetensors"))
    rng = np.random.default_rng(0)
    tensors, flipped, rolled = {}, set(), set()
    for i, (name, array) in enumerate(sorted(state.items())):
        dtype = list(STORED)[i % len(STORED)]
        array = (array + rng.standard_normal(array.shape) * 1e-3).astype(STORED[dtype])  # not the fp32 values
        if transposed and array.ndim == 2 and len(flipped) < 3:
            flipped.add(name)
            array = array.T
        elif transposed and array.ndim == 1 and array.shape[0] > 2 and len(rolled) < 3:
            rolled.add(name)
            array = np.roll(array, 1, axis=0)
        tensors[name] = (dtype, array)
    write_safetensors(tmp_path / "vae.safetensors", tensors, gap=3)
    infos = read_header(tmp_path / "vae.safetensors")
    assert bool(flipped) == transposed and {info.dtype for info in infos.values()} == set(STORED)
    infos = {name: info._replace(shape=info.shape[::-1], transposed=True) if name in flipped else info
             for name, info in infos.items()}
    infos = {name: info._replace(rolled=1) if name in rolled else info for name, info in infos.items()}
    return infos, expected_tree(folder, "vae")


def expected_tree(folder: Path, component: str, dtype: str = "float32") -> Any:
    family = detect(str(folder), json.loads((folder / "model_index.json").read_text()))
    config = family.components[component].config.from_dict(json.loads((folder / component / "config.json").read_text()))
    return jax.eval_shape(family.components[component].module(config, dtype=dtype).init_params, jax.random.PRNGKey(0))


@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_misaligned_and_transposed_tensors_load_as_on_the_host(tmp_path: Path, dtype: str, mode: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """F16, BF16, F32, F64 and float8 (F64 and float8 are cast on the host) in one file,
    none aligned, in groups small enough that there are many (one device_put and program each)."""
    infos, expected = mixed_vae(tmp_path)
    host = load_tensors(tmp_path, "vae", infos, expected, dtype)
    monkeypatch.setattr(weights, "GROUP_BYTES", 4096)
    monkeypatch.setattr(weights, "GROUP_TENSORS", 7)
    placed = load_tensors(tmp_path, "vae", infos, expected, dtype, sharding=replicated())
    assert_same_bits({"vae": placed}, {"vae": host})
    assert len(list(weights._groups(list(infos), infos))) > 10


def test_each_conversion_compiles_once_a_process_for_every_tensor_and_load_that_needs_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The device path compiles a program per distinct conversion (stored shape and dtype,
    permutation, target dtype): a model's repeated layers share one, and a second load of the
    model compiles nothing."""
    monkeypatch.setenv("RENDERFARM_CONVERT", "device")
    lowered: list[Any] = []
    converted = weights._converted

    class Counted:
        def lower(self, spec: Any, conversion: Any) -> Any:
            lowered.append(conversion)
            return converted.lower(spec, conversion)

    monkeypatch.setattr(weights, "_converted", Counted())
    weights._program.cache_clear()
    folder = str(ORACLE / "sd1" / "model")
    first = load_model(folder, "bfloat16")
    tensors = len(jax.tree.leaves(first.params))
    assert len(set(lowered)) == len(lowered) and 0 < len(lowered) < tensors / 4, (len(lowered), tensors)
    compiled = len(lowered)
    assert_same_bits(load_model(folder, "bfloat16").params, first.params)
    assert len(lowered) == compiled


def test_extreme_values_cast_on_the_devices_as_numpy_casts_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rounding ties, subnormals, infinities and the largest values: F32 and F16 to bfloat16 round
    to nearest even on the devices exactly as ml_dtypes does on the host."""
    monkeypatch.setenv("RENDERFARM_CONVERT", "device")
    infos, expected = mixed_vae(tmp_path, transposed=False)
    special32 = np.array([0x00000001, 0x007FFFFF, 0x00800000, 0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF,
                          0x7F800000, 0xFF800000, 0x80000001, 0x3F7FFFFF, 0x477FE000], np.uint32).view(np.float32)
    special16 = np.arange(2**16, dtype=np.uint16).view(np.float16)
    special16 = special16[~np.isnan(special16)]  # NaN payloads aside (XLA quiets signalling NaNs)
    tensors = {}
    for name, info in infos.items():
        size = int(np.prod(info.shape))
        pool = special32 if info.dtype in ("F32", "F64") else special16
        stored = STORED["F32" if info.dtype == "F64" else info.dtype]
        tensors[name] = (info.dtype if info.dtype != "F64" else "F32",
                         np.resize(pool, size).astype(stored).reshape(info.shape))
    write_safetensors(tmp_path / "special.safetensors", tensors, gap=1)
    special = read_header(tmp_path / "special.safetensors")
    for dtype in DTYPES:
        assert_same_bits({"vae": load_tensors(tmp_path, "vae", special, expected, dtype, sharding=replicated())},
                         {"vae": load_tensors(tmp_path, "vae", special, expected, dtype)})


def test_shapes_and_dtypes_are_checked_before_any_data_is_read(tmp_path: Path, mode: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    infos, expected = mixed_vae(tmp_path)
    monkeypatch.setattr(weights, "_read_raw", lambda *a: pytest.fail("tensor data read before the checks"))
    name = next(name for name, info in infos.items() if len(info.shape) == 4)
    wrong = {**infos, name: infos[name]._replace(shape=(1, *infos[name].shape[1:]))}
    with pytest.raises(WeightsError, match=f"1 tensor with the wrong shape: {name}"):
        load_tensors(tmp_path, "vae", wrong, expected, "float32", sharding=replicated())
    integer = {**infos, name: infos[name]._replace(dtype="I32")}
    with pytest.raises(WeightsError, match=f"tensor '{name}' has dtype I32; weights must be one of F64, F32, F16, "
                                           "BF16, F8_E4M3, F8_E5M2"):
        load_tensors(tmp_path, "vae", integer, expected, "float32", sharding=replicated())


def test_a_file_cut_short_while_loading_is_an_error_naming_the_tensor(tmp_path: Path, mode: str) -> None:
    infos, expected = mixed_vae(tmp_path)
    last = max(infos, key=lambda name: infos[name].start)
    with open(tmp_path / "vae.safetensors", "r+b") as f:  # after its header was checked
        f.truncate(infos[last].start + 1)
    with pytest.raises(WeightsError, match=f"vae.safetensors: ends inside tensor '{last}'"):
        load_tensors(tmp_path, "vae", infos, expected, "float32", sharding=replicated())


def test_weights_are_placed_replicated_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    infos, expected = mixed_vae(tmp_path)
    sharded = NamedSharding(Mesh(np.array(jax.local_devices()), ("data",)), PartitionSpec("data"))
    with pytest.raises(ValueError, match="not a fully replicated jax Sharding"):
        load_tensors(tmp_path, "vae", infos, expected, "float32", sharding=sharded)
    monkeypatch.setenv("RENDERFARM_CONVERT", "gpu")
    with pytest.raises(ValueError, match="RENDERFARM_CONVERT='gpu': must be auto, device or host"):
        load_tensors(tmp_path, "vae", infos, expected, "float32", sharding=replicated())


def test_cpu_devices_convert_in_the_reading_threads_and_accelerators_on_the_devices(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RENDERFARM_CONVERT", raising=False)
    assert not weights.convert_on_device(replicated())

    class Accelerator:
        platform = "tpu"

    class Sharding:
        device_set = {Accelerator()}

    assert weights.convert_on_device(Sharding())  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------- load_model

def test_load_model_places_the_weights_on_the_devices_asked_and_logs_the_load(
        caplog: pytest.LogCaptureFixture) -> None:
    folder = str(ORACLE / "sdxl" / "model")
    with caplog.at_level(logging.INFO, logger="diffusion.models"):
        model = load_model(folder, "bfloat16", "bf16", devices=jax.local_devices()[:2])
    [line] = [r.getMessage() for r in caplog.records if r.name == "diffusion.models"]
    leaves = jax.tree.leaves(model.params)
    assert line.startswith(f"loaded {folder} (bfloat16) in ") and line.endswith(
        f" s: {len(leaves)} tensors, {sum(x.nbytes for x in leaves) / 1e9:.2f} GB on 2 devices")
    assert {leaf.sharding.device_set == set(jax.local_devices()[:2]) for leaf in leaves} == {True}


def test_the_engine_keeps_the_placed_weights_without_a_copy() -> None:
    from worker.engine import Engine

    model = load_model(str(ORACLE / "sd1" / "model"))
    engine = Engine(model)
    assert all(a is b for a, b in zip(jax.tree.leaves(engine._params), jax.tree.leaves(model.params), strict=True))


def test_a_second_load_of_an_architecture_traces_no_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each network's expected shapes are traced once per architecture and dtype (seconds for a
    UNet), not at every load; another dtype is another architecture."""
    from diffusion.nn import parameter_shapes

    traced: list[str] = []
    eval_shape = jax.eval_shape

    def counted(f: Any, *args: Any) -> Any:
        if getattr(f, "__name__", None) == "init_params":
            traced.append(type(f.__self__).__name__)
        return eval_shape(f, *args)

    monkeypatch.setattr(jax, "eval_shape", counted)
    parameter_shapes.cache_clear()
    folder = str(ORACLE / "sd1" / "model")
    first = load_model(folder)
    assert sorted(traced) == ["AutoencoderKL", "CLIPTextModel", "UNet2DConditionModel"]
    second = load_model(folder)
    assert len(traced) == 3
    same_params(first, second)
    load_model(folder, "bfloat16")
    assert len(traced) == 6


def test_an_error_of_an_earlier_component_comes_first(tmp_path: Path) -> None:
    """Components load on a thread while the next one's shapes are traced: the errors still come
    in component order (here the text encoder's weights, not the UNet's config)."""
    folder = tmp_path / "model"
    shutil.copytree(ORACLE / "sd1" / "model", folder)
    weights_file = folder / "text_encoder" / "model.safetensors"
    state = load_file(str(weights_file))
    del state["text_model.final_layer_norm.bias"]
    save_file(state, str(weights_file))
    config = json.loads((folder / "unet" / "config.json").read_text())
    (folder / "unet" / "config.json").write_text(json.dumps({**config, "block_out_channels": "wide"}))
    with pytest.raises(WeightsError, match="1 parameter left missing: text_model/final_layer_norm/bias"):
        load_model(str(folder))
    shutil.copy(ORACLE / "sd1" / "model" / "text_encoder" / "model.safetensors", weights_file)
    with pytest.raises(JobError, match="unet/config.json"):
        load_model(str(folder))
