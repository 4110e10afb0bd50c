"""Single-file checkpoints without torch: the original-layout files `make oracle` wrote
(tests/oracle/single_file.py; diffusers' from_single_file loads them back to the folders' exact
weights) are read, through views of their bytes, as exactly the folders' own safetensors; they load
to the same parameters as the folders and render diffusers' references; whatever does not fit is
refused, named."""

from __future__ import annotations

import json
import mmap
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from diffusion.convert import WeightsError
from diffusion.models import LoadedModel, load_model
from diffusion.single_file import SingleFile, read_single_file
from diffusion.weights import ST_DTYPES, TensorInfo, read_header, read_tensor
from renderfarm.jobs import JobError
from tests.helpers import BATCHES, ORACLE, TOLERANCE, loaded, max_diffs, same_params
from worker.engine import Engine

SINGLE = Path(__file__).parent / "data" / "single_file"
FAMILIES = ("sd1", "sd2", "sdxl")


def components(family: str) -> list[str]:
    """The folder's weighted components (unet, vae, text_encoder[, text_encoder_2])."""
    return sorted(p.parent.name for p in (ORACLE / family / "model").glob("*/config.json")
                  if p.parent.name != "scheduler")


def configs(family: str) -> dict[str, dict]:
    model = ORACLE / family / "model"
    return {name: json.loads((model / name / "config.json").read_text()) for name in components(family)}


def folder_tensors(family: str, component: str) -> dict[str, np.ndarray]:
    """The component's own safetensors, as the folder holds them (not a variant)."""
    [file] = (ORACLE / family / "model" / component).glob("*model.safetensors")
    return load_file(str(file))


def read(info: TensorInfo) -> np.ndarray:
    """A tensor read through its view, in the file's own dtype."""
    with open(info.file, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return read_tensor(data, info, None, ST_DTYPES[info.dtype].numpy)


def read_family(family: str, path: Path | None = None) -> SingleFile:
    return read_single_file(path or SINGLE / f"{family}.safetensors", configs(family))


@pytest.fixture(scope="module")
def folders() -> dict[str, LoadedModel]:
    """The folders' models, as the other oracle tests load them (once a session)."""
    return {family: loaded(f"{family}/model", None)[0] for family in FAMILIES}


# ---------------------------------------------------------------------------------- reading the files

@pytest.mark.parametrize("family", FAMILIES)
def test_every_component_read_through_the_views_is_the_folders_own_safetensors(family: str) -> None:
    """Family detected; each component's names are exactly the diffusers names of the folder's file,
    and each tensor, read through its view (reshaped, a third of a fused projection, transposed),
    equals the folder's bit for bit. For sd1 this also proves the EMA copies are not used: they hold
    other values (test_ema_copies_...)."""
    single = read_family(family)
    assert single.lineage == family
    assert sorted(single.components) == components(family)
    for component in components(family):
        want, got = folder_tensors(family, component), single.components[component]
        assert sorted(got) == sorted(want), component
        for name, info in got.items():
            value = read(info)
            assert value.dtype == want[name].dtype and value.shape == want[name].shape, f"{component} {name}"
            assert np.array_equal(value, want[name]), f"{component} {name}"


@pytest.mark.parametrize("family", FAMILIES)
def test_every_tensor_of_the_file_is_either_placed_or_ignored(family: str) -> None:
    header = read_header(SINGLE / f"{family}.safetensors")
    single = read_family(family)
    views = [info for tensors in single.components.values() for info in tensors.values()]
    placed = {name for name, t in header.items() if any(t.start <= v.start < t.start + t.nbytes for v in views)}
    assert placed.isdisjoint(single.ignored)
    assert placed | set(single.ignored) == set(header)


def test_the_tensors_real_files_carry_beside_the_weights_are_ignored_with_a_reason() -> None:
    sd1, sd2, sdxl = (read_family(family).ignored for family in FAMILIES)
    unet = {name for name in read_header(SINGLE / "sd1.safetensors") if name.startswith("model.diffusion_model.")}
    assert set(sd1) == ({"model_ema." + "".join(name.split(".")[1:]) for name in unet}
                        | {"model_ema.decay", "model_ema.num_updates", "betas", "alphas_cumprod",
                           "cond_stage_model.transformer.text_model.embeddings.position_ids"})
    assert "EMA copy" in sd1["model_ema.decay"] and "training sampler" in sd1["alphas_cumprod"]
    assert "position ids" in sd1["cond_stage_model.transformer.text_model.embeddings.position_ids"]
    layer = "cond_stage_model.model.transformer.resblocks.2."
    assert {name for name in sd2 if not name.startswith(layer)} == {"cond_stage_model.model.text_projection",
                                                                    "cond_stage_model.model.logit_scale"}
    assert {name for name in sd2 if name.startswith(layer)} == {  # SD_2_TEXT_ENCODER_KEYS_TO_IGNORE's, one layer up
        f"{layer}{part}{leaf}" for part in ("attn.in_proj_", "attn.out_proj.", "ln_1.", "ln_2.", "mlp.c_fc.", "mlp.c_proj.")
        for leaf in ("weight", "bias")}
    assert "past the base's text_encoder (2 layers)" in sd2[f"{layer}attn.in_proj_weight"]
    assert "no projection" in sd2["cond_stage_model.model.text_projection"]
    assert set(sdxl) == {"conditioner.embedders.0.transformer.text_model.embeddings.position_ids",
                         "conditioner.embedders.1.model.logit_scale"}


def test_ema_copies_hold_other_values_than_the_weights_read() -> None:
    """So a reader that took sd1's EMA copies would fail the tests above and render other pixels."""
    header = read_header(SINGLE / "sd1.safetensors")
    regular = {name: info for name, info in header.items() if name.startswith("model.diffusion_model.")}
    assert len(regular) > 100  # diffusers calls a file EMA from 100 model_ema tensors on
    for name, info in regular.items():
        ema = header["model_ema." + "".join(name.split(".")[1:])]
        assert ema.shape == info.shape and not np.array_equal(read(ema), read(info)), name


def test_views_are_the_files_bytes_reshaped_split_and_transposed() -> None:
    """The three kinds of view, on the real files: no tensor is copied at read time."""
    header, single = read_header(SINGLE / "sdxl.safetensors"), read_family("sdxl")
    vae = single.components["vae"]["decoder.mid_block.attentions.0.to_q.weight"]
    conv = header["first_stage_model.decoder.mid.attn_1.q.weight"]
    assert (conv.shape, vae.shape, vae.start, vae.nbytes) == ((8, 8, 1, 1), (8, 8), conv.start, conv.nbytes)
    fused = header["conditioner.embedders.1.model.transformer.resblocks.0.attn.in_proj_weight"]
    parts = [single.components["text_encoder_2"][f"text_model.encoder.layers.0.self_attn.{x}_proj.weight"] for x in "qkv"]
    assert [(p.start, p.nbytes, p.shape) for p in parts] == [
        (fused.start + k * fused.nbytes // 3, fused.nbytes // 3, (48, 48)) for k in range(3)]
    projection = single.components["text_encoder_2"]["text_projection.weight"]
    stored = header["conditioner.embedders.1.model.text_projection"]
    assert (stored.shape, projection.shape, projection.transposed) == ((48, 40), (40, 48), True)
    assert np.array_equal(read(projection), read(stored).T)


# -------------------------------------------------------------------------------------------- loading

@pytest.mark.oracle
@pytest.mark.parametrize("family", FAMILIES)
def test_a_single_file_loads_the_folders_weights(family: str, folders: dict[str, LoadedModel]) -> None:
    single = load_model(str(SINGLE / f"{family}.safetensors"), base=str(ORACLE / family / "model"))
    same_params(single, folders[family])
    assert single.family.name == ("sdxl" if family == "sdxl" else "sd")
    assert [w["role"] for w in single.weights] == ["single_file"]


@pytest.mark.oracle
@pytest.mark.parametrize("family", FAMILIES)
def test_a_single_file_renders_diffusers_references(family: str) -> None:
    """The file holds the folder's weights (diffusers' from_single_file says so), so it renders
    the folder's PyTorch references."""
    model = load_model(str(SINGLE / f"{family}.safetensors"), base=str(ORACLE / family / "model"))
    jobs = BATCHES[(f"{family}/model", None, "euler", 64, 64)]
    assert max(max_diffs(Engine(model), model, jobs)) <= TOLERANCE


@pytest.mark.oracle
def test_a_unet_saved_alone_takes_the_rest_from_its_base(tmp_path: Path, folders: dict[str, LoadedModel]) -> None:
    """SDXL-Lightning's `*_unet.safetensors`: a diffusers UNet alone; VAE and text encoders are the base's."""
    unet = tmp_path / "lightning_unet.safetensors"
    shutil.copy(ORACLE / "sdxl" / "model" / "unet" / "diffusion_pytorch_model.safetensors", unet)
    model = load_model(str(unet), base=str(ORACLE / "sdxl" / "model"))
    same_params(model, folders["sdxl"])
    assert model.weights[0]["role"] == "single_file"
    assert {w["file"].split("/")[0] for w in model.weights[1:]} == {"vae", "text_encoder", "text_encoder_2"}


# ------------------------------------------------------------------------------------------- refusals

def edited(tmp_path: Path, family: str = "sd1", drop: str | None = None,
           add: dict[str, np.ndarray] | None = None) -> Path:
    tensors = load_file(str(SINGLE / f"{family}.safetensors"))
    if drop:
        del tensors[drop]
    path = tmp_path / "edited.safetensors"
    save_file(tensors | (add or {}), str(path))
    return path


@pytest.mark.parametrize(("family", "name"), [
    ("sd1", "model.diffusion_model.extra_head.weight"),
    ("sd1", "model.diffusion_model.input_blocks.3.2.weight"),  # a third part of a UNet row
    ("sd1", "first_stage_model.decoder.up.4.block.0.conv1.weight"),  # past the VAE's 4 up blocks
    ("sd1", "first_stage_model.encoder.up.0.block.0.conv1.weight"),  # the encoder has no up blocks
    ("sd1", "cond_stage_model.mystery.weight"),
    ("sd2", "cond_stage_model.model.transformer.resblocks.0.attn.scale"),
    ("sdxl", "conditioner.embedders.2.model.ln_final.weight"),
    ("sdxl", "lora_unet_down_blocks_0.alpha"),
])
def test_a_tensor_no_rule_knows_is_refused_naming_it(tmp_path: Path, family: str, name: str) -> None:
    path = edited(tmp_path, family, add={name: np.zeros(3, np.float32)})
    with pytest.raises(WeightsError, match=rf"edited.safetensors: 1 tensor that no rule of a {family} checkpoint "
                                           rf"places or ignores: {name.replace('.', '[.]')}$"):
        read_family(family, path)
    with pytest.raises(JobError, match="1 tensor that no rule"):
        load_model(str(path), base=str(ORACLE / family / "model"))


def test_many_unknown_tensors_are_counted(tmp_path: Path) -> None:
    path = edited(tmp_path, add={f"extra.{i}": np.zeros(1, np.float32) for i in range(8)})
    with pytest.raises(WeightsError, match=r"8 tensors that no rule .*: extra[.]0, .*, extra[.]4 and 3 more$"):
        read_family("sd1", path)


@pytest.mark.parametrize(("drop", "missing"), [
    ("model.diffusion_model.out.2.weight", "conv_out.weight"),
    ("first_stage_model.decoder.mid.attn_1.q.weight", "decoder.mid_block.attentions.0.to_q.weight"),
])
def test_a_missing_tensor_is_left_out_of_its_component_and_refused_at_load(tmp_path: Path, drop: str,
                                                                            missing: str) -> None:
    """read_single_file places what the file holds; the model's own check (convert.fit) names the
    parameter no tensor filled."""
    path = edited(tmp_path, drop=drop)
    single = read_family("sd1", path)
    component = "unet" if drop.startswith("model.") else "vae"
    assert set(folder_tensors("sd1", component)) - set(single.components[component]) == {missing}
    flax = {"conv_out.weight": "conv_out/kernel",
            "decoder.mid_block.attentions.0.to_q.weight": "decoder/mid_block/attentions_0/query/kernel"}[missing]
    with pytest.raises(JobError, match=rf"edited.safetensors.*1 parameter left missing: {flax}"):
        load_model(str(path), base=str(ORACLE / "sd1" / "model"))


def test_a_tensor_the_model_has_no_parameter_for_is_refused_at_load(tmp_path: Path) -> None:
    name = "cond_stage_model.transformer.text_model.encoder.layers.9.mlp.fc1.weight"
    path = edited(tmp_path, add={name: np.zeros((37, 32), np.float32)})
    with pytest.raises(JobError, match=r"text_model\.encoder\.layers\.9\.mlp\.fc1\.weight \(no parameter"):
        load_model(str(path), base=str(ORACLE / "sd1" / "model"))


def test_two_tensors_placed_on_one_name_are_refused(tmp_path: Path) -> None:
    """diffusers reads the upsampler from output_blocks.i.1.conv or .2.conv, the last one winning;
    a file with both is misnamed."""
    upsampler = load_file(str(SINGLE / "sd1.safetensors"))["model.diffusion_model.output_blocks.1.2.conv.weight"]
    path = edited(tmp_path, add={"model.diffusion_model.output_blocks.1.1.conv.weight": upsampler})
    with pytest.raises(WeightsError, match=r"tensors '?model.diffusion_model.output_blocks.1.[12].conv.weight'? and "
                                           r"'?model.diffusion_model.output_blocks.1.[12].conv.weight'? are both unet's "
                                           r"up_blocks.0.upsamplers.0.conv.weight"):
        read_family("sd1", path)


@pytest.mark.parametrize(("family", "name", "shape", "message"), [
    ("sd1", "first_stage_model.decoder.mid.attn_1.q.weight", (8, 8, 3, 3), "takes 1x1 convs or linears"),
    ("sd2", "cond_stage_model.model.transformer.resblocks.0.attn.in_proj_bias", (95,), "has 3 x width rows"),
])
def test_a_tensor_that_cannot_be_a_view_is_refused(tmp_path: Path, family: str, name: str, shape: tuple[int, ...],
                                                   message: str) -> None:
    path = edited(tmp_path, family, add={name: np.zeros(shape, np.float32)})
    with pytest.raises(WeightsError, match=rf"tensor '?{name.replace('.', '[.]')}'? has shape \[{', '.join(map(str, shape))}\]: .*{message}"):
        read_family(family, path)


@pytest.mark.parametrize("suffix", [".ckpt", ".pt", ".bin", ".pth", ".CKPT"])
def test_a_pickle_is_refused_without_being_opened(tmp_path: Path, suffix: str) -> None:
    marker = tmp_path / "unpickled"
    pickle = tmp_path / f"model{suffix}"
    pickle.write_bytes(b"\x80\x04cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR.")
    for path in (pickle, tmp_path / f"absent{suffix}"):  # an absent file too: the name alone refuses it
        with pytest.raises(WeightsError, match=rf"{path.name} is a pickle file, which is never loaded"):
            read_single_file(path, configs("sd1"))
    assert not marker.exists()
    with pytest.raises(JobError, match="is a pickle file, which is never loaded"):
        load_model(str(pickle), base=str(ORACLE / "sd1" / "model"))
    assert not marker.exists()


def test_a_file_of_another_kind_is_refused_saying_what_was_looked_for(tmp_path: Path) -> None:
    random = tmp_path / "random.safetensors"
    save_file({"layer.0.weight": np.random.default_rng(0).normal(size=(4, 4)).astype(np.float32)}, str(random))
    lora = Path(__file__).parent / "data" / "lora" / "sd1" / "kohya.safetensors"
    for path in (random, lora):
        for with_configs in (None, configs("sd1")):
            with pytest.raises(WeightsError, match=rf"{path.name} is not a Stable Diffusion or Flux checkpoint whose "
                                                   r"lineage could be detected: looked for the text encoders of SDXL "
                                                   r"\(conditioner\.embedders\.1\.model\.\*\), SD 2\.x .* SD 1\.x "
                                                   r"\(cond_stage_model\.transformer\.\*\), or a diffusers UNet"):
                read_single_file(path, with_configs)
        with pytest.raises(JobError, match="is not a Stable Diffusion or Flux checkpoint"):
            load_model(str(path), base=str(ORACLE / "sd1" / "model"))
    mixed = edited(tmp_path, add={"cond_stage_model.model.ln_final.weight": np.zeros(32, np.float32)})
    with pytest.raises(WeightsError, match=r"edited.safetensors holds the text encoders or transformers of several "
                                           r"lineages: sd2 \(cond_stage_model\.model\.\*\), "
                                           r"sd1 \(cond_stage_model\.transformer\.\*\)$"):
        read_single_file(mixed)


def test_a_base_of_another_family_is_refused() -> None:
    with pytest.raises(JobError, match="holds sd1 weights, but the base .* is a sdxl pipeline"):
        load_model(str(SINGLE / "sd1.safetensors"), base=str(ORACLE / "sdxl" / "model"))
    with pytest.raises(JobError, match=r"holds sdxl weights, but the base has no text_encoder_2/config.json with "
                                       r"num_hidden_layers \(is the base a sdxl pipeline\?\)"):
        load_model(str(SINGLE / "sdxl.safetensors"), base=str(ORACLE / "sd1" / "model"))


def test_single_file_arguments_are_checked() -> None:
    with pytest.raises(JobError, match="base=.*applies to a single-file --model"):
        load_model(str(ORACLE / "sd1" / "model"), base=str(ORACLE / "sd1" / "model"))
    with pytest.raises(JobError, match="a single-file checkpoint has no variants"):
        load_model(str(SINGLE / "sd1.safetensors"), variant="fp16", base=str(ORACLE / "sd1" / "model"))


def test_without_configs_only_the_family_is_read() -> None:
    """What choosing the default base needs, before any config is fetched."""
    for family in FAMILIES:
        single = read_single_file(SINGLE / f"{family}.safetensors")
        assert (single.lineage, single.components, single.ignored) == (family, {}, {})
