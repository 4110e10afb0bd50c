"""diffusion.convert's inverse (`torch_name`, `torch_shape`) and harness/torch_pipeline.py's
torch-free PyTorch-format folders: the names are diffusers' and transformers' own, and every
family's written folder loads through the worker's loader."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import pytest
from flax.traverse_util import flatten_dict
from safetensors import safe_open

from diffusion.convert import target, torch_name, torch_shape
from diffusion.families import FAMILIES, detect
from diffusion.families.flux import tiny_configs
from diffusion.families.latent_unet import unet_config, vae_config
from diffusion.nn import parameter_shapes
from diffusion.tiny_parts import text_config
from harness.torch_pipeline import write_torch_pipeline

ORACLE = Path(__file__).resolve().parent / "data" / "oracle"
T5_VOCAB = 256  # at least the tiny T5 tokenizer's size
FLOW = {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 1.0, "use_dynamic_shifting": False,
        "num_train_timesteps": 1000}
PNDM = {"_class_name": "PNDMScheduler", "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear",
        "num_train_timesteps": 1000, "skip_prk_steps": True, "set_alpha_to_one": False, "steps_offset": 1}


def tiny(family: str) -> dict[str, dict]:
    """Tiny component configs of `family`, as bench/engine.py's device part writes them."""
    if family == "flux":
        return tiny_configs(514, T5_VOCAB)
    configs = {"unet": unet_config(family), "vae": vae_config(family), "text_encoder": text_config(514)}
    if family == "sdxl":
        configs["text_encoder_2"] = text_config(514, hidden_act="gelu")
    return configs


@pytest.mark.parametrize("name", ["sd1", "sd2", "sdxl"])
def test_torch_names_and_shapes_are_diffusers_own(name: str) -> None:
    """The names and shapes for our parameters are exactly those of the oracle's checkpoints,
    which diffusers' and transformers' save_pretrained wrote."""
    folder = ORACLE / name / "model"
    family = detect(str(folder), json.loads((folder / "model_index.json").read_text()))
    for component, spec in family.components.items():
        module = spec.module(spec.config.from_dict(json.loads((folder / component / "config.json").read_text())))
        shapes = flatten_dict(jax.eval_shape(module.init_params, jax.random.PRNGKey(0)))
        ours = {torch_name(spec.kind, path): torch_shape(path[-1], tuple(leaf.shape)) for path, leaf in shapes.items()}
        file = "model.safetensors" if spec.kind.startswith("clip") else "diffusion_pytorch_model.safetensors"
        with safe_open(str(folder / component / file), "np") as saved:
            theirs = {key: tuple(saved.get_slice(key).get_shape()) for key in saved.keys()}  # noqa: SIM118
        theirs.pop("text_model.embeddings.position_ids", None)  # a buffer, not a parameter
        assert ours == theirs, f"{name}/{component}"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_torch_name_inverts_the_loaders_rules(family: str) -> None:
    """Every parameter of every family (Flux's transformer and T5 among them, which no oracle
    checkpoint covers) goes back to its own path and shape through `target`."""
    configs = tiny(family)
    for component, spec in FAMILIES[family].components.items():
        shapes = flatten_dict(parameter_shapes(spec.module(spec.config.from_dict(configs[component]))))
        for path, leaf in shapes.items():
            shape = torch_shape(path[-1], tuple(leaf.shape))
            back = target(spec.kind, torch_name(spec.kind, path), len(shape))
            assert back is not None and back.path == path and back.shape(shape) == tuple(leaf.shape), path


def test_a_written_flux_folder_loads(tmp_path: Path) -> None:
    """A tiny Flux schnell written in PyTorch's format loads through the worker's loader, with the
    tensors' names and shapes checked against the model (a misfit is refused), and is kept."""
    from diffusion.models import load_model

    configs = tiny("flux")
    configs["transformer"] = {**configs["transformer"], "guidance_embeds": False}
    written = write_torch_pipeline(tmp_path / "flux", "flux", configs, FLOW)
    assert written["written"] and written["bytes"] > 0
    assert json.loads((tmp_path / "flux" / "model_index.json").read_text())["_class_name"] == "FluxPipeline"
    model = load_model(str(tmp_path / "flux"), "float32")
    assert model.family.name == "flux" and set(model.params) == set(configs)
    assert not write_torch_pipeline(tmp_path / "flux", "flux", configs, FLOW)["written"]


def test_a_written_sd_folder_loads_with_real_embedding_rows(tmp_path: Path) -> None:
    """Text encoders keep the configured embedding rows (49,408 at full size) behind the small
    tokenizer, whose special ids the config names."""
    from diffusion.models import load_model

    configs = tiny("sd")
    configs["text_encoder"] = {**configs["text_encoder"], "vocab_size": 1000}
    write_torch_pipeline(tmp_path / "sd", "sd", configs, PNDM, options={"requires_safety_checker": False})
    index = json.loads((tmp_path / "sd" / "model_index.json").read_text())
    assert index["requires_safety_checker"] is False and index["safety_checker"] == [None, None]
    text = json.loads((tmp_path / "sd" / "text_encoder" / "config.json").read_text())
    assert (text["vocab_size"], text["eos_token_id"]) == (1000, 513)
    model = load_model(str(tmp_path / "sd"), "float32")
    rows = model.params["text_encoder"]["text_model"]["embeddings"]["token_embedding"]["embedding"]
    assert rows.shape[0] == 1000
