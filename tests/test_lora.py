"""diffusion/lora.py: LoRA files (diffusers/PEFT and kohya layouts) -> weight deltas, held to diffusers.

tests/data/lora (tests/oracle/lora.py) holds one LoRA per tiny pipeline (sd1, sdxl) in both layouts: the
PEFT file saved by diffusers' `save_lora_weights` (alphas in its LoraConfig metadata), the kohya file with
SGM block names for sdxl's UNet (alphas as tensors; diffusers loads it into exactly the PEFT file's
weights), and diffusers' fused-minus-base weights after `fuse_lora(lora_scale)` for one tensor of each
kind. The model's tensor names and shapes come from the model folders' headers. No torch here.
"""

from __future__ import annotations

import functools
import json
import math
import pickle
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from diffusion.lora import LoraFile, _sgm_names, read_lora
from diffusion.weights import WeightsError, read_header
from renderfarm.jobs import JobError

DATA = Path(__file__).parent / "data"
LORAS = DATA / "lora"
SCALE = json.loads((LORAS / "jobs.json").read_text(encoding="utf-8"))["lora_scale"]
FAMILIES = ("sd1", "sdxl")
FORMATS = ("peft", "kohya")
Deltas = dict[str, dict[str, np.ndarray]]


@functools.cache
def components(family: str) -> dict[str, dict[str, tuple[int, ...]]]:
    """Each LoRA-able component's diffusers PyTorch tensor names -> shapes, from the model folder."""
    found = {}
    for component in ("unet", "text_encoder", "text_encoder_2"):
        folder = DATA / "oracle" / family / "model" / component
        for name in ("diffusion_pytorch_model.safetensors", "model.safetensors"):
            if (folder / name).is_file():
                found[component] = {key: info.shape for key, info in read_header(folder / name).items()}
    return found


def lora_path(family: str, fmt: str) -> Path:
    return LORAS / family / f"{fmt}.safetensors"


@functools.cache
def read(family: str, fmt: str) -> LoraFile:
    return read_lora(lora_path(family, fmt))


def deltas(path: Path, family: str, scale: float = SCALE) -> Deltas:
    return read_lora(path).deltas(components(family), scale)


def rewritten(tmp_path: Path, family: str, fmt: str, change, metadata: dict[str, str] | None = None) -> Path:
    """A copy of a LoRA file with its tensors passed through `change` (a dict -> dict function)."""
    path = tmp_path / f"{family}-{fmt}.safetensors"
    save_file(change(load_file(lora_path(family, fmt))), path, metadata=metadata)
    return path


def assert_same(got: Deltas, want: Deltas, factor: float = 1.0, atol: float = 1e-7) -> None:
    assert got.keys() == want.keys()
    for component in want:
        assert got[component].keys() == want[component].keys(), component
        for name, delta in want[component].items():
            assert got[component][name].dtype == np.float32
            np.testing.assert_allclose(got[component][name], delta * factor, rtol=1e-6, atol=atol, err_msg=name)


# ---------------------------------------------------------------------------------------- held to diffusers

@pytest.mark.parametrize("family", FAMILIES)
def test_both_formats_of_a_lora_give_the_same_deltas(family: str) -> None:
    peft, kohya = read(family, "peft"), read(family, "kohya")
    assert (peft.format, kohya.format) == ("diffusers", "kohya")
    assert len(peft.modules) == len(kohya.modules) > 90
    assert peft.components == kohya.components == set(components(family))
    assert_same(kohya.deltas(components(family), SCALE), peft.deltas(components(family), SCALE))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("family", FAMILIES)
def test_deltas_are_what_diffusers_fuses(family: str, fmt: str) -> None:
    """`fuse_lora(lora_scale)` minus the base weights, for one tensor of each kind (attention, feed-forward,
    proj_in/out, LoCon convs with their own rank and alpha, samplers, embeddings, CLIP projections)."""
    got = read(family, fmt).deltas(components(family), SCALE)
    reference = load_file(LORAS / f"{family}-deltas.safetensors")
    assert len(reference) > 25
    for key, fused_minus_base in reference.items():
        component, name = key.split(".", 1)
        assert got[component][name].shape == fused_minus_base.shape
        # float32 fused - base carries the rounding of the fused weight (|W| < 2: ulp 2.4e-7)
        np.testing.assert_allclose(got[component][name], fused_minus_base, rtol=0, atol=3e-7, err_msg=key)


def test_a_delta_is_scale_times_alpha_over_rank_times_up_down() -> None:
    """The formula itself, from the kohya file's raw tensors (LoCon convs included): no other factor."""
    raw = load_file(lora_path("sd1", "kohya"))
    placed = read("sd1", "kohya").fit(components("sd1"))
    kinds = set()
    for patches in placed.values():
        for target, patch in patches.items():
            name = patch.module.key.removesuffix(".lora_down.weight")
            down, up, alpha = raw[f"{name}.lora_down.weight"], raw[f"{name}.lora_up.weight"], raw[f"{name}.alpha"]
            kernel = down if down.ndim == 4 else down[:, :, None, None]
            want = 0.5 * float(alpha) / down.shape[0] * np.einsum("or,rihw->oihw", up.reshape(up.shape[:2]), kernel)
            np.testing.assert_allclose(patch.delta(0.5), want.reshape(patch.shape), rtol=1e-5, atol=1e-8,
                                       err_msg=target)
            kinds.add((down.ndim, down.shape[2:], float(alpha) / down.shape[0]))
    assert {(2, (), 0.75), (4, (3, 3), 0.5), (4, (1, 1), 0.5), (2, (), 5 / 3)} <= kinds


# --------------------------------------------------------------------------------------- scale and alpha

def test_scale_zero_gives_zero_deltas_and_doubling_it_doubles_them() -> None:
    lora, model = read("sdxl", "kohya"), components("sdxl")
    zero, one, two = (lora.deltas(model, scale) for scale in (0.0, 1.0, 2.0))
    assert all(not delta.any() for patches in zero.values() for delta in patches.values())
    assert all(delta.any() for patches in one.values() for delta in patches.values())
    assert_same(two, one, factor=2.0, atol=0)
    assert_same(lora.deltas(model, SCALE), one, factor=SCALE)


@pytest.mark.parametrize("scale", [math.nan, math.inf, "0.7", None, True])
def test_a_scale_that_is_not_a_finite_number_is_refused(scale) -> None:
    with pytest.raises(JobError, match="lora_scale=.*must be a finite number"):
        read("sd1", "kohya").deltas(components("sd1"), scale)


def test_kohya_alphas_are_honoured(tmp_path: Path) -> None:
    """Alpha over rank per module: doubled alphas double the deltas; without alphas, alpha is the rank."""
    base = deltas(lora_path("sd1", "kohya"), "sd1")
    doubled = rewritten(tmp_path, "sd1", "kohya", lambda t: {k: np.asarray(v * 2) if k.endswith(".alpha") else v
                                                             for k, v in t.items()})
    assert_same(deltas(doubled, "sd1"), base, factor=2.0)
    no_alpha = deltas(rewritten(tmp_path, "sd1", "kohya", lambda t: {k: v for k, v in t.items()
                                                                      if not k.endswith(".alpha")}), "sd1")
    # the oracle's alphas: unet 3 (rank 4), its convs 1 (rank 2), text_encoder 5 (rank 3)
    unet, te = no_alpha["unet"], no_alpha["text_encoder"]
    to_q = "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.weight"
    conv = "down_blocks.0.resnets.0.conv1.weight"
    q_proj = "text_model.encoder.layers.0.self_attn.q_proj.weight"
    np.testing.assert_allclose(unet[to_q] * 3 / 4, base["unet"][to_q], rtol=1e-6)
    np.testing.assert_allclose(unet[conv] * 1 / 2, base["unet"][conv], rtol=1e-6)
    np.testing.assert_allclose(te[q_proj] * 5 / 3, base["text_encoder"][q_proj], rtol=1e-6)


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.int16, np.int8, np.uint64, np.uint32, np.uint16, np.uint8,
                                   np.float16, np.float64])
def test_kohya_alphas_of_any_integer_or_float_dtype_are_read(tmp_path: Path, dtype: type) -> None:
    """diffusers' `convert_state_dict_to_kohya` writes each alpha as an int64 scalar (`torch.tensor(rank)`), and
    diffusers loads such files: the same alphas in any integer or float dtype give the float32 file's deltas."""
    raw = load_file(lora_path("sdxl", "kohya"))
    alphas = {k: v for k, v in raw.items() if k.endswith(".alpha")}
    assert {float(v) for v in alphas.values()} == {1.0, 2.0, 3.0, 5.0}  # whole numbers: exact in every dtype
    path = tmp_path / "converted.safetensors"
    save_file({**raw, **{k: np.array(int(v), dtype) for k, v in alphas.items()}}, path)
    assert {v.dtype for k, v in load_file(path).items() if k.endswith(".alpha")} == {np.dtype(dtype)}
    assert_same(deltas(path, "sdxl"), deltas(lora_path("sdxl", "kohya"), "sdxl"), atol=0)


def test_peft_alphas_come_from_the_lora_config_in_the_header(tmp_path: Path) -> None:
    with safe_open(lora_path("sd1", "peft"), "np") as f:
        config = json.loads(f.metadata()["lora_adapter_metadata"])
    assert config["unet.lora_alpha"] != config["unet.r"] and config["unet.alpha_pattern"]
    base = deltas(lora_path("sd1", "peft"), "sd1")
    # without the config, alpha is the rank (diffusers); with `.alpha` tensors, those
    plain = rewritten(tmp_path, "sd1", "peft", dict)
    no_alpha = deltas(plain, "sd1")
    conv, to_q = "down_blocks.0.resnets.0.conv1.weight", "mid_block.attentions.0.transformer_blocks.0.attn2.to_q.weight"
    np.testing.assert_allclose(no_alpha["unet"][to_q] * 3 / 4, base["unet"][to_q], rtol=1e-6)
    np.testing.assert_allclose(no_alpha["unet"][conv] * 1 / 2, base["unet"][conv], rtol=1e-6)

    def with_alphas(tensors: dict) -> dict:
        alphas = {k.replace(".lora_A.weight", ".alpha"): np.array(2.0 * v.shape[0], np.float32)
                  for k, v in tensors.items() if k.endswith(".lora_A.weight")}
        return {**tensors, **alphas}

    assert_same(deltas(rewritten(tmp_path, "sd1", "peft", with_alphas), "sd1"), no_alpha, factor=2.0)
    # an alpha_pattern no module matches leaves lora_alpha; rsLoRA divides by sqrt(rank)
    changed = {**config, "unet.alpha_pattern": {"^nothing": 9.0}, "text_encoder.use_rslora": True}
    other = deltas(rewritten(tmp_path, "sd1", "peft", dict, {"lora_adapter_metadata": json.dumps(changed)}), "sd1")
    np.testing.assert_allclose(other["unet"][conv], no_alpha["unet"][conv] * 3 / 2, rtol=1e-6)
    q_proj = "text_model.encoder.layers.0.self_attn.q_proj.weight"
    np.testing.assert_allclose(other["text_encoder"][q_proj], no_alpha["text_encoder"][q_proj] * 5 / math.sqrt(3),
                               rtol=1e-6)


# ------------------------------------------------------------------------------------------- other forms

def _old_diffusers_names(key: str) -> str:
    """The same LoRA as older diffusers saved it: attention processors in the UNet and CLIP attention,
    `lora_linear_layer` in CLIP's MLP, `.lora.down` elsewhere, and CLIP names with `text_model.`."""
    module, _, factor = key.rpartition(".lora_")
    role = {"A.weight": "down", "B.weight": "up"}[factor]
    if module.startswith("text_encoder.") and not module.startswith("text_encoder.text_model."):
        module = module.replace("text_encoder.", "text_encoder.text_model.", 1)
    head, _, last = module.rpartition(".")
    if last in ("to_q", "to_k", "to_v") and "attn" in head:
        return f"{head}.processor.{last}_lora.{role}.weight"
    if module.endswith(".to_out.0"):
        return f"{module.removesuffix('.to_out.0')}.processor.to_out_lora.{role}.weight"
    if last in ("q_proj", "k_proj", "v_proj", "out_proj"):
        return f"{head}.to_{last.removesuffix('_proj')}_lora.{role}.weight"
    if ".mlp." in module:
        return f"{module}.lora_linear_layer.{role}.weight"
    return f"{module}.lora.{role}.weight"


def test_older_diffusers_layouts_give_the_same_deltas(tmp_path: Path) -> None:
    want = deltas(rewritten(tmp_path, "sdxl", "peft", dict), "sdxl")  # no config: alpha is the rank
    renamed = {_old_diffusers_names(k): v for k, v in load_file(lora_path("sdxl", "peft")).items()}
    assert any("processor.to_out_lora" in k for k in renamed) and any("self_attn.to_q_lora" in k for k in renamed)
    assert any("lora_linear_layer" in k for k in renamed) and any(".lora.down." in k for k in renamed)
    path = tmp_path / "old.safetensors"
    save_file(renamed, path)
    assert_same(deltas(path, "sdxl"), want)


def test_a_linear_lora_on_a_1x1_conv_changes_its_kernel(tmp_path: Path) -> None:
    """sd1's proj_in/proj_out are 1x1 convs; some trainers save their LoRA factors as linear ones."""
    def flattened(tensors: dict) -> dict:
        return {k: v.reshape(v.shape[:2]) if "proj_in" in k or "proj_out" in k else v for k, v in tensors.items()}

    path = rewritten(tmp_path, "sd1", "kohya", flattened)
    assert load_file(path)["lora_unet_mid_block_attentions_0_proj_in.lora_down.weight"].ndim == 2
    got = deltas(path, "sd1")
    assert got["unet"]["mid_block.attentions.0.proj_in.weight"].shape == (16, 16, 1, 1)
    assert_same(got, deltas(lora_path("sd1", "kohya"), "sd1"))


def test_sgm_names_follow_sdxls_block_layout() -> None:
    """The real SDXL UNet's layout (3 levels, 2 ResNets a level down and 3 up), as kohya names it."""
    names = ["conv_in", "conv_out", "time_embedding.linear_1", "add_embedding.linear_2"]
    for block, attention in enumerate((False, True, True)):
        for layer in range(2):
            names += [f"down_blocks.{block}.resnets.{layer}.{leaf}" for leaf in ("conv1", "time_emb_proj")]
            names += [f"down_blocks.{block}.attentions.{layer}.proj_in"] * attention
        names += [f"down_blocks.{block}.downsamplers.0.conv"] * (block < 2)
    for block, attention in enumerate((True, True, False)):
        for layer in range(3):
            names += [f"up_blocks.{block}.resnets.{layer}.conv_shortcut"]
            names += [f"up_blocks.{block}.attentions.{layer}.transformer_blocks.9.attn2.to_k"] * attention
        names += [f"up_blocks.{block}.upsamplers.0.conv"] * (block < 2)
    names += ["mid_block.resnets.0.conv2", "mid_block.attentions.0.proj_out", "mid_block.resnets.1.conv1"]
    sgm = _sgm_names(names)
    assert set(sgm) == set(names)
    known = {
        "conv_in": "input_blocks.0.0", "conv_out": "out.2", "time_embedding.linear_1": "time_embed.0",
        "add_embedding.linear_2": "label_emb.0.2",
        "down_blocks.0.resnets.1.time_emb_proj": "input_blocks.2.0.emb_layers.1",
        "down_blocks.0.downsamplers.0.conv": "input_blocks.3.0.op",
        "down_blocks.1.attentions.0.proj_in": "input_blocks.4.1.proj_in",
        "down_blocks.2.resnets.1.conv1": "input_blocks.8.0.in_layers.2",
        "mid_block.resnets.0.conv2": "middle_block.0.out_layers.3",
        "mid_block.attentions.0.proj_out": "middle_block.1.proj_out",
        "mid_block.resnets.1.conv1": "middle_block.2.in_layers.2",
        "up_blocks.0.attentions.0.transformer_blocks.9.attn2.to_k": "output_blocks.0.1.transformer_blocks.9.attn2.to_k",
        "up_blocks.0.upsamplers.0.conv": "output_blocks.2.2.conv",
        "up_blocks.1.attentions.2.transformer_blocks.9.attn2.to_k": "output_blocks.5.1.transformer_blocks.9.attn2.to_k",
        "up_blocks.1.upsamplers.0.conv": "output_blocks.5.2.conv",
        "up_blocks.2.resnets.2.conv_shortcut": "output_blocks.8.0.skip_connection",
    }
    assert {name: sgm[name] for name in known} == known


# -------------------------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("fmt", FORMATS)
def test_an_sdxl_lora_on_an_sd1_model_is_refused_naming_the_keys(fmt: str) -> None:
    with pytest.raises(WeightsError) as caught:
        read("sdxl", fmt).deltas(components("sd1"), SCALE)
    message = str(caught.value)
    assert str(lora_path("sdxl", fmt)) in message
    assert "12 modules for text_encoder_2" in message
    assert "which is not a component the model has and a LoRA may change (those are unet, text_encoder)" in message
    assert "50 modules that do not fit" in message and "and 45 more" in message
    key = ("lora_unet_input_blocks_3_1_transformer_blocks_0_attn2_to_k.lora_down.weight" if fmt == "kohya"
           else "unet.down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_k.lora_A.weight")
    assert f"{key} (makes a [16, 80] delta, but unet down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_k." \
           "weight is [16, 32])" in message
    assert "no such module in the model's unet" in message


def test_a_module_the_model_lacks_is_refused(tmp_path: Path) -> None:
    path = rewritten(tmp_path, "sd1", "kohya", lambda t: {k.replace("mid_block_resnets_1", "mid_block_resnets_7"): v
                                                          for k, v in t.items()})
    with pytest.raises(WeightsError, match=r"3 modules that do not fit: lora_unet_mid_block_resnets_7_conv1\."
                                           r"lora_down\.weight \(no such module in the model's unet\)"):
        deltas(path, "sd1")


def test_a_safetensors_file_that_is_not_a_lora_is_refused() -> None:
    unet = DATA / "oracle" / "sd1" / "model" / "unet" / "diffusion_pytorch_model.safetensors"
    with pytest.raises(WeightsError, match=r"diffusion_pytorch_model\.safetensors'?: is not a LoRA: 208 keys like "
                                           r"conv_in\.bias, conv_in\.weight, .* and 203 more"):
        read_lora(unet)


@pytest.mark.parametrize("suffix", [".ckpt", ".pt", ".bin", ".pth", ".CKPT"])
def test_a_pickle_is_refused_without_being_opened(tmp_path: Path, suffix: str) -> None:
    marker = tmp_path / "unpickled"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    path = tmp_path / f"lora{suffix}"
    path.write_bytes(pickle.dumps(Payload()))
    with pytest.raises(WeightsError, match=rf"lora{suffix}'?: is a pickle file .*never loaded: unpickling runs code"):
        read_lora(path)
    assert not marker.exists()


@pytest.mark.parametrize(("change", "rule"), [
    (lambda t: {**t, "lora_unet_conv_in.hada_w1_a": t["lora_unet_conv_in.lora_down.weight"]},
     r"has keys this LoRA reader does not know: 1 key like lora_unet_conv_in\.hada_w1_a .*LoHa"),
    (lambda t: {**t, "unet.conv_in.lora_A.weight": t["lora_unet_conv_in.lora_down.weight"]},
     r"mixes kohya keys .* with others \(unet\.conv_in\.lora_A\.weight\)"),
    (lambda t: {k: v for k, v in t.items() if k != "lora_unet_conv_in.lora_up.weight"},
     r"'lora_unet_conv_in\..*' has no up factor"),
    (lambda t: {**t, "lora_unet_conv_in.lora_up.weight": t["lora_unet_conv_in.lora_up.weight"][:, :1]},
     r"'lora_unet_conv_in\.lora_down\.weight' \[2, 4, 3, 3\] and its up factor \[8, 1, 1, 1\] are not a LoRA pair"),
    (lambda t: {**t, "lora_unet_conv_in.alpha": np.array(0.0, np.float32)},
     r"'lora_unet_conv_in\.alpha'=0\.0: alpha must be a finite non-zero number"),
    (lambda t: {**t, "lora_unet_conv_in.alpha": np.array(np.nan, np.float32)}, r"alpha must be a finite non-zero"),
    (lambda t: {**t, "lora_unet_conv_in.alpha": np.ones(2, np.float32)}, r"has shape \[2\], not a single number"),
    (lambda t: {**t, "lora_unet_conv_in.alpha": np.array([4, 4], np.int64)}, r"has shape \[2\], not a single number"),
    (lambda t: {**t, "lora_unet_conv_in.alpha": np.array(0, np.int64)}, r"\.alpha'=0: alpha must be a finite non-zero"),
    (lambda t: {**t, "lora_unet_conv_in.alpha": np.array(True)},
     r"'lora_unet_conv_in\.alpha' has dtype BOOL; an alpha must be an integer or float number \(F64, .*, U64\)"),
    (lambda t: {**t, "lora_unet_conv_in.lora_up.weight": t["lora_unet_conv_in.lora_up.weight"].astype(np.int32)},
     r"'lora_unet_conv_in\.lora_up\.weight' has dtype I32; LoRA factors must be one of F64, F32, F16, BF16, "
     r"F8_E4M3, F8_E5M2"),
])
def test_a_broken_kohya_file_is_refused(tmp_path: Path, change, rule: str) -> None:
    with pytest.raises(WeightsError, match=rule):
        read_lora(rewritten(tmp_path, "sd1", "kohya", change))


def test_two_spellings_of_one_factor_are_refused(tmp_path: Path) -> None:
    key = "unet.conv_in.lora_A.weight"
    path = rewritten(tmp_path, "sd1", "peft", lambda t: {**t, "unet.conv_in.lora.down.weight": t[key]})
    with pytest.raises(WeightsError, match=r"'unet\.conv_in\.lora.*' and 'unet\.conv_in\.lora.*' are both the down"):
        read_lora(path)


@pytest.mark.parametrize(("metadata", "rule"), [
    ({"unet.use_dora": True}, r"unet\.use_dora=True: LoRAs with use_dora are not supported"),
    ({"unet.alpha_pattern": {"conv(.*)+$": 2}}, r"alpha_pattern key 'conv\(\.\*\)\+\$': only module names"),
    ({"unet.lora_alpha": 0}, r"unet\.lora_alpha=0: alpha must be a finite non-zero number"),
    ("not json", r"lora_adapter_metadata in the header is not a JSON object"),
])
def test_a_peft_file_with_a_config_we_cannot_honour_is_refused(tmp_path: Path, metadata, rule: str) -> None:
    text = metadata if isinstance(metadata, str) else json.dumps(metadata)
    with pytest.raises(WeightsError, match=rule):
        read_lora(rewritten(tmp_path, "sd1", "peft", dict, {"lora_adapter_metadata": text}))
