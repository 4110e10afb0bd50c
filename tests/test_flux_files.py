"""Flux checkpoint files (tests/oracle/flux_files.py wrote them from the tiny schnell pipeline of
tests/data/flux): a transformer in Black Forest Labs' names (diffusers' own conversion maps it back
to the folder's tensors) loads with `--base`, bare or under ComfyUI's prefix, to the folder's
parameters bit for bit and renders the folder's FluxPipeline images; a float8 transformer is upcast
as torch upcasts it and renders FluxPipeline's images of the upcast weights; a file that does not
fit is refused, naming the tensor; diffusion/bfl.py sends every BFL row where diffusers does."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from flax.traverse_util import flatten_dict
from PIL import Image
from safetensors.numpy import load_file, save_file

from diffusion import bfl
from diffusion.models import STANDARD_BASES, LoadedModel, load_model
from diffusion.nn.flux import FluxConfig
from diffusion.single_file import read_single_file
from diffusion.weights import ST_DTYPES
from renderfarm.jobs import JobError
from tests.helpers import DATA, TOLERANCE, max_diffs, render_command, same_params, worst
from worker.engine import Engine

FILES = DATA / "flux_files"
FOLDER = DATA / "flux" / "schnell" / "model"
BFL_FILE = FILES / "bfl.safetensors"
SCHNELL_JOBS = [job for job in json.loads((DATA / "flux" / "jobs.json").read_text())["jobs"]
                if job["model"] == "schnell/model"]
FLOAT8_JOBS = json.loads((FILES / "jobs.json").read_text())["jobs"]
PREFIX = "model.diffusion_model."


def tiny_config(variant: str) -> FluxConfig:
    path = DATA / "flux" / variant / "model" / "transformer" / "config.json"
    return FluxConfig.from_dict(json.loads(path.read_text()))


@pytest.fixture(scope="module")
def folder() -> LoadedModel:
    return load_model(str(FOLDER))


def edited(tmp_path: Path, drop: str | None = None, add: dict[str, np.ndarray] | None = None,
           prefix: str = "") -> Path:
    """The BFL file with a tensor dropped or added, its names under `prefix`."""
    tensors = load_file(str(BFL_FILE))
    if drop:
        del tensors[drop]
    path = tmp_path / "flux1-schnell.safetensors"
    save_file({prefix + name: value for name, value in (tensors | (add or {})).items()}, str(path))
    return path


# ------------------------------------------------------------------------------------------ the names

def test_bfl_names_of_the_real_models() -> None:
    dev, schnell = FluxConfig(guidance_embeds=True), FluxConfig()
    assert len(bfl.bfl_tensors(dev)) == 780 and len(bfl.bfl_tensors(schnell)) == 776  # flux1-dev / -schnell
    assert "guidance_in.out_layer" in bfl.bfl_modules(dev) and "guidance_in.out_layer" not in bfl.bfl_modules(schnell)
    assert {"img_in", "txt_in", "time_in.in_layer", "vector_in.out_layer", "double_blocks.18.txt_mlp.2",
            "single_blocks.37.linear1", "final_layer.linear", "final_layer.adaLN_modulation.1"} <= set(
        bfl.bfl_modules(dev))
    assert bfl.diffusers_modules("double_blocks.3.img_attn.qkv", dev) == [
        ("transformer_blocks.3.attn.to_q", 0, 3072), ("transformer_blocks.3.attn.to_k", 3072, 6144),
        ("transformer_blocks.3.attn.to_v", 6144, 9216)]
    assert bfl.diffusers_modules("double_blocks.0.txt_attn.qkv", dev)[0] == ("transformer_blocks.0.attn.add_q_proj",
                                                                             0, 3072)
    assert bfl.diffusers_modules("single_blocks.37.linear1", dev) == [
        ("single_transformer_blocks.37.attn.to_q", 0, 3072), ("single_transformer_blocks.37.attn.to_k", 3072, 6144),
        ("single_transformer_blocks.37.attn.to_v", 6144, 9216),
        ("single_transformer_blocks.37.proj_mlp", 9216, 21504)]
    # BFL's (shift, scale) is diffusers' (scale, shift): the second half first
    assert bfl.diffusers_modules("final_layer.adaLN_modulation.1", dev) == [("norm_out.linear", 3072, 6144),
                                                                             ("norm_out.linear", 0, 3072)]
    assert bfl.diffusers_modules("time_in.in_layer", dev) == [("time_text_embed.timestep_embedder.linear_1", 0, 3072)]
    assert bfl.diffusers_tensors("double_blocks.2.txt_attn.norm.key_norm.scale", dev) == [
        ("transformer_blocks.2.attn.norm_added_k.weight", 0, 128)]
    assert bfl.diffusers_tensors("single_blocks.1.linear1.bias", dev)[3] == (
        "single_transformer_blocks.1.proj_mlp.bias", 9216, 21504)
    for unknown in ("double_blocks.19.img_attn.qkv", "guidance_in.in_layer", "img_attn.qkv"):
        config = schnell if unknown.startswith("guidance") else dev
        with pytest.raises(KeyError, match=rf"'{unknown}' is not a linear layer of a Flux transformer"):
            bfl.diffusers_modules(unknown, config)
    with pytest.raises(KeyError, match=r"'img_in.scale' is not a tensor"):
        bfl.diffusers_tensors("img_in.scale", dev)


@pytest.mark.parametrize("variant", ["schnell", "dev"])
def test_every_row_of_every_diffusers_tensor_comes_from_one_bfl_row(variant: str) -> None:
    """Each diffusers tensor of the folder is filled exactly: its BFL row ranges add up to its rows."""
    config = tiny_config(variant)
    names = load_file(str(DATA / "flux" / variant / "model" / "transformer" / "diffusion_pytorch_model.safetensors"))
    rows: dict[str, int] = {}
    for name in bfl.bfl_tensors(config):
        covered = sorted((first, end) for _, first, end in bfl.diffusers_tensors(name, config))
        assert [first for first, _ in covered][1:] == [end for _, end in covered][:-1], name  # no gap, no overlap
        for key, first, end in bfl.diffusers_tensors(name, config):
            rows[key] = rows.get(key, 0) + end - first
    assert rows == {key: value.shape[0] for key, value in names.items()}


# ------------------------------------------------------------------------------------------ BFL files

@pytest.mark.parametrize("prefix", ["", PREFIX])
def test_a_bfl_file_loads_the_folders_parameters(tmp_path: Path, prefix: str, folder: LoadedModel) -> None:
    path = edited(tmp_path, prefix=prefix) if prefix else BFL_FILE
    assert read_single_file(path).lineage == "flux-schnell"
    single = read_single_file(path, folder.configs)
    views = single.components["transformer"]
    assert all(info.file == path for info in views.values())  # views of the file's bytes
    assert {name for name, info in views.items() if info.rolled} == {"norm_out.linear.weight", "norm_out.linear.bias"}
    model = load_model(str(path), base=str(FOLDER))
    same_params(model, folder)
    assert [w["role"] for w in model.weights] == ["single_file", "pipeline", "pipeline", "pipeline"]
    assert {w["file"].split("/")[0] for w in model.weights[1:]} == {"text_encoder", "text_encoder_2", "vae"}


def test_a_guidance_embedding_makes_a_bfl_file_dev_whose_default_base_is_flux_dev(tmp_path: Path) -> None:
    for prefix in ("", PREFIX):
        path = edited(tmp_path, add={"guidance_in.in_layer.weight": np.zeros((32, 256), np.float16)}, prefix=prefix)
        assert read_single_file(path).lineage == "flux-dev"
    assert (STANDARD_BASES["flux-dev"], STANDARD_BASES["flux-schnell"]) == ("black-forest-labs/FLUX.1-dev",
                                                                            "black-forest-labs/FLUX.1-schnell")


@pytest.mark.oracle
def test_render_command_renders_a_bfl_file_with_its_base_as_the_folder(tmp_path: Path) -> None:
    by_seed = render_command(SCHNELL_JOBS, tmp_path, "--model", str(BFL_FILE), "--base", str(FOLDER))
    difference = worst([by_seed[job["seed"]] for job in SCHNELL_JOBS],
                       [DATA / "flux" / job["image"] for job in SCHNELL_JOBS])
    print(f"BFL file with --base, renderfarm render: max difference {difference}/255")
    assert difference <= TOLERANCE


def pixels(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB")).astype(int)


@pytest.mark.parametrize(("change", "message"), [
    ({"add": {"double_blocks.0.img_attn.extra.weight": np.zeros(3, np.float16)}},
     r"1 tensor with no place in the base's transformer: double_blocks\.0\.img_attn\.extra\.weight \(e\.g\. "
     r"'double_blocks\.0\.img_attn\.extra\.weight' is not a tensor .* with 2 double blocks, 2 single blocks and no "
     r"guidance embedding\)$"),
    ({"add": {"single_blocks.2.linear1.weight": np.zeros((224, 32), np.float16)}},
     r"1 tensor with no place .*: single_blocks\.2\.linear1\.weight"),  # a block past the base's two
    ({"add": {"model.diffusion_model.img_in.weight": np.zeros((32, 64), np.float16)}},
     r"tensors '?img_in\.weight'? and '?model\.diffusion_model\.img_in\.weight'? are both the transformer's "
     r"img_in\.weight: one of them is misnamed"),
    ({"drop": "single_blocks.1.linear2.bias"},
     r"1 tensor of the base's transformer missing, in Black Forest Labs' names: single_blocks\.1\.linear2\.bias$"),
    ({"drop": "double_blocks.0.txt_attn.qkv.weight", "add": {"double_blocks.0.txt_attn.qkv.weight": np.zeros(
        (64, 32), np.float16)}},
     r"tensor '?double_blocks\.0\.txt_attn\.qkv\.weight'? has shape \[64, 32\]: the base's transformer takes 96 rows"),
    ({"add": {"guidance_in.in_layer.weight": np.zeros((32, 256), np.float16)}},
     r"holds flux-dev weights \(a guidance embedding, guidance_in\.in_layer\.weight\), but the base's transformer "
     r"has guidance_embeds=false: use a FLUX\.1-dev base"),
])
def test_a_bfl_file_that_does_not_fit_is_refused_naming_the_tensor(tmp_path: Path, change: dict,
                                                                   message: str) -> None:
    path = edited(tmp_path, **change)
    with pytest.raises(JobError, match=rf"flux1-schnell\.safetensors:? {message}"):
        load_model(str(path), base=str(FOLDER))


def test_a_bfl_file_needs_a_flux_base_and_a_pickle_is_never_opened(tmp_path: Path) -> None:
    with pytest.raises(JobError, match=r"holds flux-schnell weights, but the base has no transformer/config\.json "
                                       r"\(is the base a Flux pipeline\?\)"):
        load_model(str(BFL_FILE), base=str(DATA / "oracle" / "sd1" / "model"))
    marker = tmp_path / "unpickled"
    pickle = tmp_path / "flux1-schnell.pt"
    pickle.write_bytes(b"\x80\x04cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR.")
    with pytest.raises(JobError, match="flux1-schnell.pt.*is a pickle file, which is never loaded"):
        load_model(str(pickle), base=str(FOLDER))
    assert not marker.exists()


# ------------------------------------------------------------------------------------------- float8

def test_float8_values_upcast_as_torch_upcasts_them() -> None:
    """Every one of the 256 values of each float8 dtype, as the loader reads it, is torch's `.float()`."""
    torch_values = np.load(FILES / "float8_values.npz")
    every = np.arange(256, dtype=np.uint8)
    for name in ("F8_E4M3", "F8_E5M2"):
        ours = every.view(ST_DTYPES[name].numpy).astype(np.float32)
        np.testing.assert_array_equal(ours, torch_values[name], err_msg=name)  # NaNs where torch has them
        assert np.isnan(ours).sum() == (2 if name == "F8_E4M3" else 6)


@pytest.fixture(scope="module")
def float8_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The schnell folder with its transformer's weights the float8 file (F8_E4M3, diffusers' names)."""
    root = tmp_path_factory.mktemp("float8") / "model"
    shutil.copytree(FOLDER, root)
    shutil.copy(FILES / "float8.safetensors", root / "transformer" / "diffusion_pytorch_model.safetensors")
    return root


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_float8_folder_loads_the_folders_weights_rounded_to_float8(float8_folder: Path, folder: LoadedModel,
                                                                     dtype: str) -> None:
    """Each transformer parameter is the float16 folder's rounded to float8 (as torch rounded it when
    it wrote the file), upcast exactly to the load's dtype."""
    model = load_model(str(float8_folder), dtype)
    assert "transformer/diffusion_pytorch_model.safetensors" in {info["file"] for info in model.weights}
    ours, theirs = flatten_dict(model.params["transformer"]), flatten_dict(folder.params["transformer"])
    assert ours.keys() == theirs.keys()
    rounded = 0
    for path, value in ours.items():
        want = np.asarray(theirs[path]).astype(ml_dtypes.float8_e4m3fn)
        assert value.dtype == np.dtype(dtype), path
        np.testing.assert_array_equal(np.asarray(value), want.astype(dtype), err_msg=str(path))
        rounded += int(np.sum(want.astype(np.float32) != np.asarray(theirs[path])))
    assert rounded > sum(value.size for value in ours.values()) / 2  # float8 holds other values than float16


@pytest.mark.oracle
def test_a_float8_transformer_renders_diffusers_images_of_the_upcast_weights(float8_folder: Path) -> None:
    model = load_model(str(float8_folder))
    differences = max_diffs(Engine(model), model, FLOAT8_JOBS, FILES)
    print(f"float8 transformer: max difference {max(differences)}/255")
    assert max(differences) <= TOLERANCE
    assert [job["seed"] for job in FLOAT8_JOBS] == [job["seed"] for job in SCHNELL_JOBS]
    assert worst([pixels(DATA / "flux" / job["image"]) for job in SCHNELL_JOBS],
                 [FILES / job["image"] for job in FLOAT8_JOBS]) > 3 * TOLERANCE  # float8 renders other images
