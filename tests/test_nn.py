"""diffusion/nn: parameter trees equal to diffusers'/transformers' Flax classes, outputs equal to
their PyTorch modules (tests/data/nn/, written by tests/oracle/nn.py) and, where the Flax
classes compute the same thing, to the Flax classes on the same weights. No torch needed."""

from __future__ import annotations

import functools
import json
import re
import types
import warnings
from pathlib import Path
from typing import Any

import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.traverse_util import flatten_dict, unflatten_dict

from diffusion.nn.attention import LAYOUTS, attention, use_layout
from diffusion.nn.clip import CLIPConfig, CLIPModel, CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection
from diffusion.nn.layers import GroupNorm, LayerNorm
from diffusion.nn.unet import UNet2DConditionModel, UNetConfig
from diffusion.nn.vae import AutoencoderKL, VAEConfig

DATA = Path(__file__).parent / "data" / "nn"
KEY = jax.random.PRNGKey(0)

# Flax-runnable tiny configs: GroupNorm over 32 groups, the one grouping diffusers' Flax UNet knows.
_UNET = {"sample_size": 8, "block_out_channels": (32, 64), "layers_per_block": 1, "cross_attention_dim": 32}
FLAX_CONFIGS: dict[str, dict[str, Any]] = {
    "sd": {**_UNET, "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"),
           "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D"), "attention_head_dim": 2, "layers_per_block": 2},
    "sd2": {**_UNET, "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"),
            "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D"), "attention_head_dim": (2, 4),
            "use_linear_projection": True},
    "sdxl": {**_UNET, "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D"),
             "up_block_types": ("CrossAttnUpBlock2D", "UpBlock2D"), "attention_head_dim": (2, 4),
             "transformer_layers_per_block": (1, 2), "use_linear_projection": True,
             "addition_embed_type": "text_time", "addition_time_embed_dim": 8,
             "projection_class_embeddings_input_dim": 16 + 6 * 8},
    "vae": {"block_out_channels": (32, 64), "down_block_types": ("DownEncoderBlock2D",) * 2,
            "up_block_types": ("UpDecoderBlock2D",) * 2, "layers_per_block": 1, "norm_num_groups": 32},
    "clip": {"vocab_size": 100, "hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2,
             "num_attention_heads": 4, "hidden_act": "quick_gelu", "eos_token_id": 2},
    "clip_projection": {"vocab_size": 100, "hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "hidden_act": "gelu", "eos_token_id": 97, "projection_dim": 16},
}


def _flax_model(name: str) -> Any:
    """diffusers' / transformers' Flax class for a FLAX_CONFIGS entry."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import diffusers
        import transformers

        diffusers.utils.logging.set_verbosity_error()
        transformers.logging.set_verbosity_error()
        config = FLAX_CONFIGS[name]
        if name == "vae":
            return diffusers.FlaxAutoencoderKL(**config)
        if name.startswith("clip"):
            projection = "projection_dim" in config
            cls = transformers.FlaxCLIPTextModelWithProjection if projection else transformers.FlaxCLIPTextModel
            return cls(transformers.CLIPTextConfig(**config), _do_init=False)
        return diffusers.FlaxUNet2DConditionModel(**config)


def _ours(name: str, config: dict[str, Any], dtype: Any = jnp.float32) -> Any:
    if name.startswith("clip"):
        cls = CLIPTextModelWithProjection if "projection_dim" in config else CLIPTextModel
        return cls(CLIPTextConfig.from_dict(config), dtype)
    if name == "vae":
        return AutoencoderKL(VAEConfig.from_dict(config), dtype)
    return UNet2DConditionModel(UNetConfig.from_dict(config), dtype)


@functools.cache
def _flax_shapes(name: str) -> dict:
    """The Flax class's parameter shapes, traced once a config (seconds for diffusers' UNet)."""
    model = _flax_model(name)
    if name.startswith("clip"):
        return jax.eval_shape(lambda key: model.init_weights(key, (1, 77)), KEY)
    return jax.eval_shape(model.init_weights, KEY)


def _paths(tree: Any) -> dict[str, tuple[int, ...]]:
    return {"/".join(path): leaf.shape for path, leaf in flatten_dict(tree).items()}


def _random_params(shapes: Any, seed: int) -> dict:
    """Unit-ish weights, norm scales near 1, small non-zero biases: every parameter matters."""
    rng = np.random.default_rng(seed)
    params = {}
    for path, leaf in sorted(flatten_dict(shapes).items()):
        if path[-1] == "scale":
            value = 1 + 0.1 * rng.standard_normal(leaf.shape)
        elif path[-1] == "bias":
            value = 0.05 * rng.standard_normal(leaf.shape)
        else:
            value = rng.standard_normal(leaf.shape) / np.sqrt(np.prod(leaf.shape[:-1]))
        params[path] = value.astype(np.float32)
    return unflatten_dict(params)


def _close(got: Any, want: Any, rel: float = 1e-5) -> None:
    """Equal within `rel` of the reference's largest magnitude (float32 sums in another order)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=rel * float(np.abs(want).max()))


# --------------------------------------------------------------------------- parameter trees

@pytest.mark.parametrize("name", FLAX_CONFIGS)
def test_parameter_tree_is_the_flax_classes(name: str) -> None:
    ours = _ours(name, FLAX_CONFIGS[name])
    assert _paths(jax.eval_shape(ours.init_params, KEY)) == _paths(_flax_shapes(name))


# ------------------------------------------------------------------ outputs: PyTorch (committed)

def _reference(name: str) -> tuple[dict[str, Any], dict, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """config, params (Flax names), inputs, PyTorch's outputs of tests/data/nn/<name>.npz."""
    z = np.load(DATA / f"{name}.npz")
    flat, offset = {}, 0
    for path, shape in json.loads(str(z["index"])):
        size = int(np.prod(shape))
        flat[tuple(path.split("/"))] = z["params"][offset:offset + size].reshape(shape).astype(np.float32)
        offset += size
    inputs = {k.removeprefix("in/"): z[k] for k in z.files if k.startswith("in/")}
    outputs = {k.removeprefix("out/"): z[k] for k in z.files if k.startswith("out/")}
    return json.loads(str(z["config"])), unflatten_dict(flat), inputs, outputs


def _run_unet(model: UNet2DConditionModel, params: dict, inputs: dict[str, np.ndarray]) -> jax.Array:
    added = ({"text_embeds": inputs["text_embeds"], "time_ids": inputs["time_ids"]}
             if "time_ids" in inputs else None)
    return jax.jit(model.apply)({"params": params}, inputs["sample"], inputs["timesteps"],
                                inputs["encoder_hidden_states"], added)


@pytest.mark.parametrize("name", ["sd1", "sd2", "sdxl"])
def test_unet_matches_pytorch(name: str) -> None:
    """GroupNorm over 4 or 8 groups, norm_eps, freq_shift / flip_sin_to_cos, fractional
    timesteps (799.2), exact-GELU GEGLU, the transformer GroupNorm's eps 1e-6, SDXL's added
    text/time embedding: what PyTorch diffusers computes."""
    config, params, inputs, outputs = _reference(name)
    _close(_run_unet(_ours(name, config), params, inputs), outputs["sample"])


def test_unet_bfloat16_follows_float32() -> None:
    """bfloat16 compute on float32 parameters: bfloat16 out, near the float32 result."""
    config, params, inputs, outputs = _reference("sd2")
    got = _run_unet(_ours("sd2", config, jnp.bfloat16), params, inputs)
    assert got.dtype == jnp.bfloat16
    _close(got, outputs["sample"], rel=0.05)  # measured: 1.2% of the largest value


def test_vae_matches_pytorch() -> None:
    config, params, inputs, outputs = _reference("vae")
    vae = _ours("vae", config)
    mean, logvar = jax.jit(functools.partial(vae.apply, method=vae.encode))({"params": params}, inputs["pixels"])
    _close(mean, outputs["mean"])
    _close(logvar, outputs["logvar"])
    decoded = jax.jit(functools.partial(vae.apply, method=vae.decode))({"params": params}, inputs["latents"])
    _close(decoded, outputs["decoded"])


@pytest.mark.parametrize("name", ["clip_l", "clip_bigg"])
def test_text_encoder_matches_pytorch(name: str) -> None:
    """quick_gelu / gelu, the causal mask, penultimate = hidden_states[-2], and pooling at the
    end-of-text token by each of transformers 5's rules (the ids make the other rule miss)."""
    config, params, inputs, outputs = _reference(name)
    out = jax.jit(_ours(name, config).apply)({"params": params}, inputs["input_ids"])
    for key, want in outputs.items():
        _close(getattr(out, key), want)


# ------------------------------------------------------------ outputs: diffusers' Flax classes

def _torch_numerics_linen() -> types.SimpleNamespace:
    """flax.linen as diffusers' Flax attention sees it, with PyTorch's numerics where it
    differs: the exact GELU in GEGLU and eps 1e-6 in the transformer's GroupNorm."""
    linen = types.SimpleNamespace(**{k: getattr(fnn, k) for k in dir(fnn) if not k.startswith("__")})
    linen.gelu = functools.partial(jax.nn.gelu, approximate=False)
    linen.GroupNorm = lambda num_groups, epsilon: fnn.GroupNorm(num_groups=num_groups, epsilon=1e-6)
    return linen


@pytest.mark.parametrize("name", ["sd", "sdxl"])  # sdxl's layout covers sd2's (linear projection, heads list)
def test_unet_matches_flax_unet(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Integer timesteps and 32 groups, where diffusers' Flax UNet is PyTorch's but for GEGLU's
    GELU and one GroupNorm eps (patched on the Flax side)."""
    from diffusers.models import attention_flax

    monkeypatch.setattr(attention_flax, "nn", _torch_numerics_linen())
    flax_unet, config = _flax_model(name), FLAX_CONFIGS[name]
    params = _random_params(_flax_shapes(name), seed=1)
    rng = np.random.default_rng(2)
    sample = rng.standard_normal((2, 4, 16, 16)).astype(np.float32)
    timesteps = jnp.array([999, 13], jnp.int32)
    context = rng.standard_normal((2, 7, 32)).astype(np.float32)
    added = None
    if "addition_embed_type" in config:
        added = {"text_embeds": rng.standard_normal((2, 16)).astype(np.float32),
                 "time_ids": np.array([[64, 64, 0, 0, 64, 64], [128, 96, 8, 4, 128, 96]], np.float32)}
    want = jax.jit(lambda p: flax_unet.apply({"params": p}, sample, timesteps, context, added).sample)(params)
    got = jax.jit(_ours(name, config).apply)({"params": params}, sample, timesteps.astype(jnp.float32), context, added)
    _close(got, want)


def test_vae_matches_flax_vae() -> None:
    flax_vae, vae = _flax_model("vae"), _ours("vae", FLAX_CONFIGS["vae"])
    params = {"params": _random_params(_flax_shapes("vae"), seed=3)}
    rng = np.random.default_rng(4)
    pixels = rng.uniform(-1, 1, (2, 3, 16, 16)).astype(np.float32)
    latents = rng.standard_normal((2, 4, 8, 8)).astype(np.float32)
    def moments(x: jax.Array) -> tuple[jax.Array, jax.Array]:
        posterior = flax_vae.apply(params, x, method=flax_vae.encode).latent_dist
        return posterior.mean.transpose(0, 3, 1, 2), posterior.logvar.transpose(0, 3, 1, 2)

    want_mean, want_logvar = jax.jit(moments)(pixels)
    mean, logvar = jax.jit(functools.partial(vae.apply, method=vae.encode))(params, pixels)
    _close(mean, want_mean)
    _close(logvar, want_logvar)
    decode = jax.jit(lambda latents: flax_vae.apply(params, latents, method=flax_vae.decode).sample)
    _close(jax.jit(functools.partial(vae.apply, method=vae.decode))(params, latents), decode(latents))


@pytest.mark.parametrize("name", ["clip", "clip_projection"])
def test_text_encoder_matches_flax_clip(name: str) -> None:
    flax_clip, config = _flax_model(name), FLAX_CONFIGS[name]
    params = _random_params(_flax_shapes(name), seed=5)
    ids = np.random.default_rng(6).integers(0, 100, (2, 77)).astype(np.int32)
    want = jax.jit(lambda ids: flax_clip(ids, params=params, output_hidden_states=True))(ids)
    got = jax.jit(_ours(name, config).apply)({"params": params}, ids)
    _close(got.last_hidden_state, want.last_hidden_state)
    _close(got.penultimate, want.hidden_states[-2])
    if name == "clip":
        _close(got.pooled, want.pooler_output)
    else:
        _close(got.text_embeds, want.text_embeds)


# -------------------------------------------------------------------------------- attention

@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
def test_attention_layouts_compute_attention(layout: str, causal: bool) -> None:
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((2, 5, 12)).astype(np.float32) for _ in range(3))
    heads, dim = 3, 4
    split = lambda x: x.reshape(2, 5, heads, dim).transpose(0, 2, 1, 3).astype(np.float64)  # noqa: E731
    scores = split(q) @ split(k).transpose(0, 1, 3, 2) / np.sqrt(dim)
    if causal:
        scores = np.where(np.tril(np.ones((5, 5), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    want = (probs / probs.sum(-1, keepdims=True)) @ split(v)
    with use_layout(layout):  # a fresh function: jit caches traces per function, not per layout
        got = jax.jit(lambda q, k, v: attention(q, k, v, heads, causal))(q, k, v)
    _close(got, want.transpose(0, 2, 1, 3).reshape(2, 5, 12))


def test_norms_use_two_pass_variance() -> None:
    """As torch's GroupNorm and LayerNorm: exact on activations far from zero mean, where
    E[x^2] - E[x]^2 in float32 loses the variance."""
    x = (300 + np.random.default_rng(8).standard_normal((2, 4, 4, 8))).astype(np.float32)
    groups = x.reshape(2, 16, 2, 4).astype(np.float64)
    want = (groups - groups.mean((1, 3), keepdims=True)) / np.sqrt(groups.var((1, 3), keepdims=True) + 1e-6)
    norm = GroupNorm(2, 1e-6)
    _close(norm.apply(norm.init(KEY, x), x), want.reshape(x.shape), rel=1e-4)
    rows = x.astype(np.float64)
    want = (rows - rows.mean(-1, keepdims=True)) / np.sqrt(rows.var(-1, keepdims=True) + 1e-5)
    norm = LayerNorm(1e-5)
    _close(norm.apply(norm.init(KEY, x), x), want, rel=1e-4)


# ------------------------------------------------------------------------------------ configs

# The config.json files of the public SDXL base and SD 1.5 checkpoints, key for key.
SDXL_UNET = {
    "_class_name": "UNet2DConditionModel", "_diffusers_version": "0.19.0.dev0", "act_fn": "silu",
    "addition_embed_type": "text_time", "addition_embed_type_num_heads": 64, "addition_time_embed_dim": 256,
    "attention_head_dim": [5, 10, 20], "block_out_channels": [320, 640, 1280], "center_input_sample": False,
    "class_embed_type": None, "class_embeddings_concat": False, "conv_in_kernel": 3, "conv_out_kernel": 3,
    "cross_attention_dim": 2048, "cross_attention_norm": None,
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"], "downsample_padding": 1,
    "dual_cross_attention": False, "encoder_hid_dim": None, "encoder_hid_dim_type": None, "flip_sin_to_cos": True,
    "freq_shift": 0, "in_channels": 4, "layers_per_block": 2, "mid_block_only_cross_attention": None,
    "mid_block_scale_factor": 1, "mid_block_type": "UNetMidBlock2DCrossAttn", "norm_eps": 1e-05,
    "norm_num_groups": 32, "num_attention_heads": None, "num_class_embeds": None, "only_cross_attention": False,
    "out_channels": 4, "projection_class_embeddings_input_dim": 2816, "resnet_out_scale_factor": 1.0,
    "resnet_skip_time_act": False, "resnet_time_scale_shift": "default", "sample_size": 128,
    "time_cond_proj_dim": None, "time_embedding_act_fn": None, "time_embedding_dim": None,
    "time_embedding_type": "positional", "timestep_post_act": None, "transformer_layers_per_block": [1, 2, 10],
    "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"], "upcast_attention": None,
    "use_linear_projection": True,
}
SDXL_VAE = {
    "_class_name": "AutoencoderKL", "_diffusers_version": "0.20.0.dev0", "act_fn": "silu",
    "block_out_channels": [128, 256, 512, 512], "down_block_types": ["DownEncoderBlock2D"] * 4,
    "force_upcast": True, "in_channels": 3, "latent_channels": 4, "layers_per_block": 2, "norm_num_groups": 32,
    "out_channels": 3, "sample_size": 1024, "scaling_factor": 0.13025, "up_block_types": ["UpDecoderBlock2D"] * 4,
}
SD15_TEXT_ENCODER = {
    "_name_or_path": "openai/clip-vit-large-patch14", "architectures": ["CLIPTextModel"], "attention_dropout": 0.0,
    "bos_token_id": 0, "dropout": 0.0, "eos_token_id": 2, "hidden_act": "quick_gelu", "hidden_size": 768,
    "initializer_factor": 1.0, "initializer_range": 0.02, "intermediate_size": 3072, "layer_norm_eps": 1e-05,
    "max_position_embeddings": 77, "model_type": "clip_text_model", "num_attention_heads": 12,
    "num_hidden_layers": 12, "pad_token_id": 1, "projection_dim": 768, "torch_dtype": "float32",
    "transformers_version": "4.22.0.dev0", "vocab_size": 49408,
}


def test_real_configs_are_read() -> None:
    unet = UNetConfig.from_dict(SDXL_UNET)
    assert (unet.heads, unet.depths, unet.cross_attention_dim) == ((5, 10, 20), (1, 2, 10), 2048)
    vae = VAEConfig.from_dict(SDXL_VAE)
    assert (vae.scale_factor, vae.scaling_factor, vae.layers_per_block) == (8, 0.13025, 2)
    clip = CLIPTextConfig.from_dict(SD15_TEXT_ENCODER)
    assert (clip.hidden_size, clip.eos_token_id, clip.hidden_act) == (768, 2, "quick_gelu")


@pytest.mark.parametrize("cls, base, key, value", [
    (UNetConfig, SDXL_UNET, "class_embed_type", "timestep"),
    (UNetConfig, SDXL_UNET, "addition_embed_type", "text"),
    (UNetConfig, SDXL_UNET, "down_block_types", ["AttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"]),
    (UNetConfig, SDXL_UNET, "mid_block_type", "UNetMidBlock2DSimpleCrossAttn"),
    (UNetConfig, SDXL_UNET, "only_cross_attention", [False, True, True]),
    (UNetConfig, SDXL_UNET, "layers_per_block", [2, 2, 3]),
    (UNetConfig, SDXL_UNET, "resnet_time_scale_shift", "scale_shift"),
    (UNetConfig, SDXL_UNET, "time_cond_proj_dim", 256),
    (UNetConfig, SDXL_UNET, "center_input_sample", True),
    (UNetConfig, SDXL_UNET, "attention_head_dim", [5, 10, 7]),
    (VAEConfig, SDXL_VAE, "mid_block_add_attention", False),
    (VAEConfig, SDXL_VAE, "up_block_types", ["AttnUpDecoderBlock2D"] * 4),
    (CLIPTextConfig, SD15_TEXT_ENCODER, "hidden_act", "relu"),
    (CLIPTextConfig, SD15_TEXT_ENCODER, "model_type", "clip"),
    (CLIPTextConfig, SD15_TEXT_ENCODER, "eos_token_id", [2, 3]),
])
def test_unsupported_config_is_refused(cls: Any, base: dict, key: str, value: Any) -> None:
    with pytest.raises(ValueError, match=re.escape(f"{key}={value!r}: ")):
        cls.from_dict({**base, key: value})


def test_clip_model_tree_is_transformers_flax_clip_model() -> None:
    """CLIPModel (both towers and projections, diffusion/scores.py's CLIP score) has the tree of
    transformers' FlaxCLIPModel, which is the PyTorch checkpoints' names, less its logit_scale."""
    import transformers

    config = {"text_config": FLAX_CONFIGS["clip"], "projection_dim": 16,
              "vision_config": {"hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2,
                                "num_attention_heads": 4, "image_size": 32, "patch_size": 8}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = transformers.FlaxCLIPModel(transformers.CLIPConfig(**config), _do_init=False)
        want = _paths(jax.eval_shape(lambda key: theirs.init_weights(key, ((1, 77), (1, 32, 32, 3))), KEY))
    ours = CLIPModel(CLIPConfig.from_dict(config))
    assert want.pop("logit_scale") == ()
    assert _paths(jax.eval_shape(ours.init_params, KEY)) == want
