"""Flux's networks (diffusion/nn/flux.py, t5.py, the 16-channel VAE) against diffusers' and
transformers' PyTorch modules: each tiny network of tests/data/flux/modules/ (written by
tests/oracle/flux.py with the libraries' save_pretrained) is loaded through the farm's own
loader, so the checkpoint names ("flux", "t5", "vae" kinds) are tested with the numbers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffusion.convert import WeightsError
from diffusion.nn.flux import FluxConfig, FluxTransformer2DModel
from diffusion.nn.t5 import T5Config, T5EncoderModel, relative_buckets
from diffusion.nn.vae import AutoencoderKL, VAEConfig
from diffusion.weights import load_tensors, safetensors_tensors

DATA = Path(__file__).parent / "data" / "flux" / "modules"
NETWORKS = {"transformer_schnell": (FluxTransformer2DModel, FluxConfig, "flux"),
            "transformer_dev": (FluxTransformer2DModel, FluxConfig, "flux"),
            "t5": (T5EncoderModel, T5Config, "t5"), "vae": (AutoencoderKL, VAEConfig, "vae")}


@pytest.fixture(scope="module")
def io() -> dict[str, np.ndarray]:
    with np.load(DATA / "io.npz") as npz:
        return dict(npz)


def load(name: str) -> tuple[Any, Any]:
    """The network `name` and its weights, as the loader reads a pipeline component."""
    module_cls, config_cls, kind = NETWORKS[name]
    folder = DATA / name
    module = module_cls(config_cls.from_dict(json.loads((folder / "config.json").read_text())))
    expected = jax.eval_shape(module.init_params, jax.random.PRNGKey(0))
    source = next(folder.glob("*.safetensors"))
    return module, load_tensors(folder, kind, safetensors_tensors(source), expected, jnp.float32)


@pytest.mark.parametrize("name", ["transformer_schnell", "transformer_dev"])
def test_transformer_matches_diffusers(io: dict[str, np.ndarray], name: str) -> None:
    module, params = load(name)
    get = lambda key: io[f"{name}/in/{key}"]  # noqa: E731
    guidance = get("guidance") if module.config.guidance_embeds else None
    out = module.apply({"params": params}, get("latents"), get("timestep"), get("context"), get("pooled"), guidance,
                       get("img_ids"), get("txt_ids"))
    expected = io[f"{name}/out/sample"]
    np.testing.assert_allclose(np.asarray(out), expected, atol=2e-4 * np.abs(expected).max(), rtol=0)


def test_guidance_changes_the_dev_transformer(io: dict[str, np.ndarray]) -> None:
    """The guidance embedding is used: another scale, another prediction."""
    module, params = load("transformer_dev")
    get = lambda key: io[f"transformer_dev/in/{key}"]  # noqa: E731
    run = lambda g: np.asarray(module.apply({"params": params}, get("latents"), get("timestep"), get("context"),  # noqa: E731
                                            get("pooled"), g, get("img_ids"), get("txt_ids")))
    assert np.abs(run(get("guidance")) - run(get("guidance") * 2)).max() > 1e-3


def test_t5_matches_transformers(io: dict[str, np.ndarray]) -> None:
    module, params = load("t5")
    out = module.apply({"params": params}, io["t5/in/input_ids"])
    expected = io["t5/out/last_hidden_state"]
    np.testing.assert_allclose(np.asarray(out), expected, atol=2e-5 * np.abs(expected).max(), rtol=0)


def test_t5_buckets_reach_the_logarithmic_range() -> None:
    """The oracle's 24 tokens with 8 buckets over distance 16 use every bucket, exact and
    logarithmic, but 4 (a key at distance 0 after the query: none)."""
    buckets = relative_buckets(24, 8, 16)
    assert sorted(set(buckets.ravel().tolist())) == [0, 1, 2, 3, 5, 6, 7]
    assert buckets[0, 0] == 0 and buckets[0, 1] == 5 and buckets[1, 0] == 1


def test_flux_vae_decodes_as_diffusers(io: dict[str, np.ndarray]) -> None:
    module, params = load("vae")
    assert not module.config.use_post_quant_conv and "post_quant_conv" not in params
    out = module.apply({"params": params}, io["vae/in/latents"], method=module.decode)
    expected = io["vae/out/decoded"]
    np.testing.assert_allclose(np.asarray(out), expected, atol=1e-4, rtol=0)


def test_a_flux_checkpoint_does_not_fit_another_config() -> None:
    """The schnell weights lack the dev config's guidance embedder: refused, naming what is missing."""
    dev = json.loads((DATA / "transformer_dev" / "config.json").read_text())
    module = FluxTransformer2DModel(FluxConfig.from_dict(dev))
    expected = jax.eval_shape(module.init_params, jax.random.PRNGKey(0))
    source = next((DATA / "transformer_schnell").glob("*.safetensors"))
    with pytest.raises(WeightsError, match="guidance_embedder"):
        load_tensors(DATA / "transformer_schnell", "flux", safetensors_tensors(source), expected, jnp.float32)


def test_configs_refuse_what_is_not_implemented() -> None:
    with pytest.raises(ValueError, match="feed_forward_proj='relu'"):
        T5Config.from_dict({"feed_forward_proj": "relu"})
    with pytest.raises(ValueError, match="patch_size=2"):
        FluxConfig.from_dict({"patch_size": 2})
    with pytest.raises(ValueError, match="axes_dims_rope"):
        FluxConfig.from_dict({"attention_head_dim": 16, "axes_dims_rope": [4, 4, 4]})
