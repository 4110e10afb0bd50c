"""Single-file checkpoints without torch: the original-layout files `make oracle` wrote
(tests/oracle/single_file.py; diffusers' from_single_file loads them back to the folders' exact
weights) load to the same parameters as the folders, and render diffusers' references."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from flax.traverse_util import flatten_dict
from safetensors.numpy import load_file, save_file

from renderfarm.jobs import JobError
from tests.test_reference import BATCHES, ORACLE, TOLERANCE, max_diffs
from worker.engine import Engine
from worker.models import LoadedModel, load_model
from worker.single_file import read_single_file

SINGLE = Path(__file__).parent / "data" / "single_file"


def same_params(a: LoadedModel, b: LoadedModel) -> None:
    assert a.params.keys() == b.params.keys()
    for component in a.params:
        flat_a, flat_b = flatten_dict(a.params[component]), flatten_dict(b.params[component])
        assert flat_a.keys() == flat_b.keys(), component
        for path in flat_a:
            np.testing.assert_array_equal(flat_a[path], flat_b[path], err_msg=f"{component} {path}")


@pytest.fixture(scope="module")
def folders() -> dict[str, LoadedModel]:
    return {family: load_model(str(ORACLE / family / "model")) for family in ("sd1", "sd2", "sdxl")}


@pytest.mark.parametrize("family", ["sd1", "sd2", "sdxl"])
def test_a_single_file_loads_the_folders_weights(family: str, folders: dict[str, LoadedModel]) -> None:
    single = load_model(str(SINGLE / f"{family}.safetensors"), base=str(ORACLE / family / "model"))
    same_params(single, folders[family])
    assert single.family.name == ("sdxl" if family == "sdxl" else "sd")
    assert [w["role"] for w in single.weights] == ["single_file"]


def test_ema_copies_and_sampler_buffers_are_left_out_with_a_reason() -> None:
    base = ORACLE / "sd1" / "model"
    configs = {name: json.loads((base / name / "config.json").read_text())
               for name in ("unet", "vae", "text_encoder")}
    single = read_single_file(SINGLE / "sd1.safetensors", configs)
    assert single.family == "sd1"
    ema = [name for name in single.ignored if name.startswith("model_ema.")]
    assert len(ema) > 100 and "EMA copy" in single.ignored[ema[0]]
    assert "training sampler" in single.ignored["alphas_cumprod"]
    assert set(single.components) == {"unet", "vae", "text_encoder"}


@pytest.mark.parametrize("family", ["sd1", "sd2", "sdxl"])
def test_a_single_file_renders_diffusers_references(family: str) -> None:
    """The file holds the folder's weights (diffusers' from_single_file says so), so it renders
    the folder's PyTorch references."""
    model = load_model(str(SINGLE / f"{family}.safetensors"), base=str(ORACLE / family / "model"))
    jobs = BATCHES[(f"{family}/model", None, "euler", 64, 64)]
    assert max(max_diffs(Engine(model), model, jobs)) <= TOLERANCE


def test_sd2s_last_openclip_layer_is_left_out_as_diffusers_does(tmp_path: Path,
                                                                folders: dict[str, LoadedModel]) -> None:
    """SD 2.x files hold one more OpenCLIP layer than the text encoder diffusers builds (it takes
    the penultimate layer's output): the layers past the base's config are left out, named."""
    tensors = load_file(str(SINGLE / "sd2.safetensors"))
    prefix = "cond_stage_model.model.transformer.resblocks."
    extra = {name.replace(f"{prefix}1.", f"{prefix}2."): value for name, value in tensors.items()
             if name.startswith(f"{prefix}1.")}
    path = tmp_path / "sd2-24-layers.safetensors"
    save_file({**tensors, **extra}, str(path))
    base = ORACLE / "sd2" / "model"
    same_params(load_model(str(path), base=str(base)), folders["sd2"])
    configs = {name: json.loads((base / name / "config.json").read_text()) for name in ("unet", "vae", "text_encoder")}
    ignored = read_single_file(path, configs).ignored
    assert {name for name in ignored if name.startswith(f"{prefix}2.")} == set(extra)
    assert "the base's text_encoder has 2 layers" in ignored[next(iter(extra))]


def test_a_unet_saved_alone_takes_the_rest_from_its_base(tmp_path: Path, folders: dict[str, LoadedModel]) -> None:
    """SDXL-Lightning's `*_unet.safetensors`: a diffusers UNet alone; VAE and text encoders are the base's."""
    unet = tmp_path / "lightning_unet.safetensors"
    shutil.copy(ORACLE / "sdxl" / "model" / "unet" / "diffusion_pytorch_model.safetensors", unet)
    model = load_model(str(unet), base=str(ORACLE / "sdxl" / "model"))
    same_params(model, folders["sdxl"])
    assert [w["role"] for w in model.weights][0] == "single_file"
    assert {w["file"].split("/")[0] for w in model.weights[1:]} == {"vae", "text_encoder", "text_encoder_2"}


def _edited(tmp_path: Path, drop: str | None = None, add: str | None = None) -> Path:
    tensors = load_file(str(SINGLE / "sd1.safetensors"))
    if drop:
        del tensors[drop]
    if add:
        tensors[add] = np.zeros(3, np.float32)
    path = tmp_path / "edited.safetensors"
    save_file(tensors, str(path))
    return path


@pytest.mark.parametrize(("drop", "add", "message"), [
    ("model.diffusion_model.out.2.weight", None, r"edited.safetensors.*1 parameter left missing: conv_out/kernel"),
    ("first_stage_model.decoder.mid.attn_1.q.weight", None,
     r"1 parameter left missing: decoder/mid_block/attentions_0/query/kernel"),
    (None, "model.diffusion_model.extra_head.weight", r"1 tensor of no known sd1 component: "
                                                      r"model\.diffusion_model\.extra_head\.weight"),
    (None, "cond_stage_model.transformer.text_model.encoder.layers.9.mlp.fc1.weight",
     r"text_model\.encoder\.layers\.9\.mlp\.fc1\.weight \(no parameter"),
])
def test_a_file_that_does_not_fit_is_refused_naming_the_tensor(tmp_path: Path, drop: str | None, add: str | None,
                                                                 message: str) -> None:
    with pytest.raises(JobError, match=message):
        load_model(str(_edited(tmp_path, drop, add)), base=str(ORACLE / "sd1" / "model"))


def test_other_files_are_refused_clearly(tmp_path: Path) -> None:
    marker = tmp_path / "unpickled"
    pickle = tmp_path / "model.ckpt"
    pickle.write_bytes(b"\x80\x04cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR.")
    with pytest.raises(JobError, match="is a pickle file, which is never loaded"):
        load_model(str(pickle), base=str(ORACLE / "sd1" / "model"))
    assert not marker.exists()
    with pytest.raises(JobError, match="is not a Stable Diffusion checkpoint"):  # a LoRA is not a model
        load_model(str(Path(__file__).parent / "data" / "lora" / "sd1" / "kohya.safetensors"),
                   base=str(ORACLE / "sd1" / "model"))
    with pytest.raises(JobError, match="holds sd1 weights, but the base .* is a sdxl pipeline"):
        load_model(str(SINGLE / "sd1.safetensors"), base=str(ORACLE / "sdxl" / "model"))
    with pytest.raises(JobError, match="base=.*applies to a single-file --model"):
        load_model(str(ORACLE / "sd1" / "model"), base=str(ORACLE / "sd1" / "model"))
    with pytest.raises(JobError, match="a single-file checkpoint has no variants"):
        load_model(str(SINGLE / "sd1.safetensors"), variant="fp16", base=str(ORACLE / "sd1" / "model"))
