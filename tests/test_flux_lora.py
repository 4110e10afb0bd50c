"""Flux LoRAs (diffusion/lora.py with the flux family's LoraTargets): diffusers/PEFT files and kohya's
files in Black Forest Labs' module names, merged at load, render diffusers' FluxPipeline images.

tests/data/flux_lora (tests/oracle/flux_lora.py) holds, per tiny pipeline of tests/data/flux (schnell,
dev), one LoRA on the transformer and CLIP in both formats (diffusers loads the kohya file into exactly
the PEFT file's weights: checked there) and the images FluxPipeline renders with it fused at 0.7.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from diffusion.families import FAMILIES
from diffusion.lora import LoraFile, read_lora
from diffusion.models import load_model
from diffusion.nn.flux import FluxConfig
from diffusion.weights import WeightsError, read_header
from renderfarm.jobs import JobError, JobSpec
from tests.helpers import render_command, worst
from worker.engine import Engine

DATA = Path(__file__).parent / "data"
LORAS = DATA / "flux_lora"
REFERENCE = json.loads((LORAS / "jobs.json").read_text(encoding="utf-8"))
VARIANTS = ("schnell", "dev")
FORMATS = ("peft", "kohya")
TOLERANCE = 2  # of 255, per channel
FLUX = FAMILIES["flux"]
Shapes = dict[str, dict[str, tuple[int, ...]]]


def model_folder(variant: str) -> Path:
    return DATA / "flux" / variant / "model"


def lora_path(variant: str, fmt: str) -> Path:
    return LORAS / variant / f"{fmt}.safetensors"


def jobs_of(variant: str, fmt: str) -> list[dict[str, Any]]:
    return [job for job in REFERENCE["jobs"] if job["lora"] == f"flux_lora/{variant}/{fmt}.safetensors"]


@functools.cache
def shapes(folder: Path) -> Shapes:
    """Each component's diffusers PyTorch tensor names -> shapes, from a model folder's headers."""
    return {component.name: {key: info.shape for key, info in read_header(file).items()}
            for component in sorted(folder.iterdir()) for file in component.glob("*.safetensors")}


def config(variant: str) -> FluxConfig:
    return FluxConfig.from_dict(json.loads((model_folder(variant) / "transformer" / "config.json").read_text()))


def deltas(lora: LoraFile, variant: str) -> dict[str, dict[str, np.ndarray]]:
    return lora.deltas(shapes(model_folder(variant)), REFERENCE["lora_scale"], FLUX.loras, config(variant))


def rewritten(tmp_path: Path, variant: str, fmt: str, change) -> Path:
    """A copy of a LoRA file with its tensors passed through `change` (a dict -> dict function)."""
    path = tmp_path / f"{variant}-{fmt}.safetensors"
    save_file(change(load_file(lora_path(variant, fmt))), path)
    return path


# ------------------------------------------------------------------------------------------- the deltas

@pytest.mark.parametrize("variant", VARIANTS)
def test_both_formats_give_the_same_deltas(variant: str) -> None:
    """The kohya file (BFL names, fused qkv and linear1, the final modulation's halves swapped) and the PEFT
    file change the same weights by the same amounts; dev's LoRA also changes the guidance embedder."""
    peft, kohya = read_lora(lora_path(variant, "peft")), read_lora(lora_path(variant, "kohya"))
    assert (peft.format, kohya.format) == ("diffusers", "kohya")
    assert peft.components == {"transformer", "text_encoder"} and kohya.components == {"unet", "text_encoder"}
    assert len(kohya.modules) < len(peft.modules)  # fused: qkv and linear1 are one kohya module each
    want, got = deltas(peft, variant), deltas(kohya, variant)
    assert got.keys() == want.keys() == {"transformer", "text_encoder"}
    for component in want:
        assert got[component].keys() == want[component].keys()
        for name, delta in want[component].items():
            # float32 products summed in another order (fused rows): a few units in the last place
            np.testing.assert_allclose(got[component][name], delta, rtol=1e-6, atol=1e-7, err_msg=name)
    split = {"single_transformer_blocks.0.attn.to_q.weight", "single_transformer_blocks.0.proj_mlp.weight",
             "transformer_blocks.1.attn.add_v_proj.weight", "norm_out.linear.weight", "x_embedder.weight"}
    assert split <= want["transformer"].keys()
    guidance = "time_text_embed.guidance_embedder.linear_1.weight"
    assert (guidance in want["transformer"]) == (variant == "dev")


def test_a_fused_modules_alpha_scales_all_its_parts(tmp_path: Path) -> None:
    """alpha / rank of a kohya module is its parts' scale: doubling linear1's alpha doubles to_q ... proj_mlp,
    and the final layer's alpha counts (diffusers leaves it unread)."""
    doubled = ("lora_unet_single_blocks_0_linear1.alpha", "lora_unet_final_layer_adaLN_modulation_1.alpha")
    path = rewritten(tmp_path, "schnell", "kohya", lambda t: {k: np.asarray(v * 2) if k in doubled else v
                                                              for k, v in t.items()})
    base, twice = (deltas(read_lora(file), "schnell")["transformer"] for file in (lora_path("schnell", "kohya"), path))
    for name in base:
        factor = 2 if name.startswith(("single_transformer_blocks.0.attn.", "single_transformer_blocks.0.proj_mlp",
                                       "norm_out.linear")) else 1
        np.testing.assert_allclose(twice[name], base[name] * factor, rtol=1e-6, err_msg=name)
    assert {name for name in base if name.startswith("single_transformer_blocks.0.attn.")} == {
        f"single_transformer_blocks.0.attn.to_{p}.weight" for p in "qkv"}


# ------------------------------------------------------------------------------------------- refusals

def test_a_kohya_key_of_an_unknown_bfl_module_is_refused(tmp_path: Path) -> None:
    path = rewritten(tmp_path, "schnell", "kohya", lambda t: {k.replace("double_blocks_1_", "double_blocks_7_"): v
                                                              for k, v in t.items()})
    with pytest.raises(WeightsError, match=r"10 modules that do not fit: lora_unet_double_blocks_7_img_attn_proj\."
                                           r"lora_down\.weight \(no such module in the model's transformer\), .*; "
                                           r"kohya's names of the model's transformer modules are "
                                           r"double_blocks_0_img_attn_proj, .* and 29 more \(is the LoRA for another "
                                           r"model family\?\)"):
        deltas(read_lora(path), "schnell")


def test_a_fused_module_of_another_size_is_refused(tmp_path: Path) -> None:
    key = "lora_unet_single_blocks_0_linear1.lora_up.weight"
    path = rewritten(tmp_path, "schnell", "kohya", lambda t: {**t, key: t[key][:-1]})
    with pytest.raises(WeightsError, match=r"lora_unet_single_blocks_0_linear1\.lora_down\.weight \(makes a "
                                           r"\[223, 32\] delta, but transformer single_blocks\.0\.linear1 has 224 "
                                           r"output rows \(single_transformer_blocks\.0\.attn\.to_q, .*proj_mlp\)\)"):
        deltas(read_lora(path), "schnell")


def test_a_lora_of_another_flux_component_is_refused(tmp_path: Path) -> None:
    """T5 (text_encoder_2) takes no LoRA, as in diffusers' FluxLoraLoaderMixin."""
    path = rewritten(tmp_path, "schnell", "peft", lambda t: {k.replace("text_encoder.", "text_encoder_2.", 1): v
                                                             for k, v in t.items()})
    with pytest.raises(WeightsError, match=r"12 modules for text_encoder_2 \(.*\), which is not a component the model "
                                           r"has and a LoRA may change \(those are transformer, text_encoder\)"):
        deltas(read_lora(path), "schnell")


@pytest.mark.parametrize(("fmt", "rule"), [
    ("peft", r"lora/sd1/peft\.safetensors'?: does not fit the model: \d+ modules for unet \(.*\), which is not a "
             r"component the model has and a LoRA may change \(those are transformer, text_encoder\); 12 modules "
             r"that do not fit: text_encoder\.encoder\.layers\.0\.mlp\.fc1\.lora_A\.weight \(makes a \[37, 32\] delta, "
             r"but text_encoder text_model\.encoder\.layers\.0\.mlp\.fc1\.weight is \[37, 20\]\)"),
    ("kohya", r"lora/sd1/kohya\.safetensors'?: does not fit the model: 95 modules that do not fit: lora_te_text_model_"
              r"encoder_layers_0_mlp_fc1\.lora_down\.weight \(makes a \[37, 32\] delta, but text_encoder .*; kohya's "
              r"names of the model's transformer modules are double_blocks_0_img_attn_proj, .*\(is the LoRA for "
              r"another model family\?\)"),
])
def test_an_sd_lora_on_a_flux_model_is_refused(fmt: str, rule: str) -> None:
    """Before any weight is read: the loader names the LoRA and the keys that do not fit."""
    with pytest.raises(JobError, match=rule):
        load_model(str(model_folder("schnell")), loras=((str(DATA / "lora" / "sd1" / f"{fmt}.safetensors"), 1.0),))


@pytest.mark.parametrize(("fmt", "rule"), [
    ("peft", r"dev/peft\.safetensors'?: does not fit the model: 30 modules for transformer \(.*\), which is not a "
             r"component the model has and a LoRA may change \(those are unet, text_encoder\)"),
    ("kohya", r"dev/kohya\.safetensors'?: does not fit the model: 35 modules that do not fit: lora_te1_text_model_"
              r"encoder_layers_0_mlp_fc1\.lora_down\.weight \(makes a \[37, 20\] delta, but text_encoder .* and 30 "
              r"more \(is the LoRA for another model family\?\)"),
])
def test_a_flux_lora_on_an_sd_model_is_refused(fmt: str, rule: str) -> None:
    with pytest.raises(JobError, match=rule):
        load_model(str(DATA / "oracle" / "sd1" / "model"), loras=((str(lora_path("dev", fmt)), 1.0),))


# ------------------------------------------------------------------------------------ held to diffusers

def spec(job: dict[str, Any], model: str, loras: Any) -> JobSpec:
    return JobSpec(prompt=job["prompt"], seed=job["seed"], steps=job["steps"], guidance_scale=job["guidance_scale"],
                   width=job["width"], height=job["height"], model=model, loras=loras)


@pytest.mark.oracle
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_the_engine_renders_diffusers_images(variant: str, fmt: str) -> None:
    jobs = jobs_of(variant, fmt)
    model = load_model(str(model_folder(variant)), loras=((str(lora_path(variant, fmt)), REFERENCE["lora_scale"]),))
    assert [w["role"] for w in model.weights].count("lora") == 1
    images = [r.image for r in Engine(model).render([spec(job, model.ref, model.loras) for job in jobs])]
    difference = worst(images, [DATA / job["image"] for job in jobs])
    print(f"{variant} {fmt}: engine max difference {difference}/255")
    assert difference <= TOLERANCE
    plain = worst(images, [DATA / "flux" / variant / f"{i}.png" for i in range(len(jobs))])
    assert plain > 8 * TOLERANCE  # the LoRA shows: without it the test would fail


@pytest.mark.oracle
def test_render_command_renders_diffusers_images_with_a_kohya_lora(tmp_path: Path) -> None:
    jobs = jobs_of("schnell", "kohya")
    lora = f"{lora_path('schnell', 'kohya')}:{REFERENCE['lora_scale']}"
    by_seed = render_command(jobs, tmp_path, "--model", str(model_folder("schnell")), "--lora", lora)
    difference = worst([by_seed[job["seed"]] for job in jobs], [DATA / job["image"] for job in jobs])
    print(f"schnell kohya: renderfarm render max difference {difference}/255")
    assert difference <= TOLERANCE
