"""diffusion/scores.py held to the PyTorch references in tests/data/scores/ (tests/oracle/scores.py):
transformers' CLIPModel and CLIPImageProcessor, diffusers' StableDiffusionSafetyChecker, LAION's
aesthetic MLP and imagehash, on tiny random towers. No torch needed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.traverse_util import flatten_dict
from PIL import Image
from safetensors.numpy import load_file, save_file

from diffusion import convert
from harness.architectures import VIT_L14
from diffusion.nn.clip import CLIPConfig, CLIPModel
from diffusion.scores import (
    CLIP_MEAN,
    CLIP_STD,
    SCORES,
    SafetyTower,
    ScoreModelError,
    Scorers,
    hamming,
    load_scorers,
    phash,
    preprocess,
)

DATA = Path(__file__).parent / "data" / "scores"
# The same pixels (CLIPImageProcessor's): float32 sums in another order.
EMBEDS_REL = 1e-5  # of the largest embedding component
CLIP_ATOL = 1e-4  # CLIP score points (of 100)
AESTHETIC_ATOL = 1e-6
# Our on-device preprocessing (jax.image.resize, bicubic, antialiased, each pass rounded to 8 bits)
# against CLIPImageProcessor's PIL resize (the same in 8-bit fixed point). Measured on these
# images: pixels 2/255, CLIP score 0.026, aesthetic 7e-6, safety scores one rounding step.
PIXEL_ATOL = 2  # of 255, any pixel of the crop
DEVICE_CLIP_ATOL = 0.1  # CLIP score points
DEVICE_AESTHETIC_ATOL = 1e-4
DEVICE_SAFETY_ATOL = 1.5e-3  # one step (0.001) of the checker's rounding


@pytest.fixture(scope="module")
def ref() -> dict[str, Any]:
    with np.load(DATA / "reference.npz") as npz:
        ref = {k: npz[k] for k in npz.files}
    ref["prompts"] = json.loads(str(ref["prompts"]))
    n = len(ref["prompts"])
    ref["images"] = [np.asarray(Image.open(DATA / "images" / f"{i}.png").convert("RGB")) for i in range(n)]
    ref["crops"] = np.stack([np.asarray(Image.open(DATA / "crops" / f"{i}.png")) for i in range(n)])
    # CLIPImageProcessor's pixel_values, NHWC (the oracle checked they are these).
    ref["pixels"] = ((ref["crops"] / np.float32(255) - np.array(CLIP_MEAN, np.float32))
                     / np.array(CLIP_STD, np.float32)).astype(np.float32)
    return ref


@pytest.fixture(scope="module")
def scorers() -> Scorers:
    return load_scorers(safety=DATA / "safety_checker", clip=DATA / "clip", aesthetic=DATA / "aesthetic.safetensors")


@pytest.fixture(scope="module")
def score_pixels(scorers: Scorers) -> Any:
    return jax.jit(scorers.score_pixels)


@pytest.fixture(scope="module")
def on_processor_pixels(scorers: Scorers, score_pixels: Any, ref: dict[str, Any]) -> dict[str, np.ndarray]:
    out = score_pixels(scorers.params, ref["pixels"], scorers.tokenize(ref["prompts"]))
    return {k: np.asarray(v) for k, v in out.items()}


def _close(got: Any, want: Any, rel: float) -> None:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=rel * float(np.abs(want).max()))


def test_the_scorers_give_what_was_loaded(scorers: Scorers) -> None:
    assert scorers.scores == SCORES
    assert load_scorers().scores == ("phash",)
    assert load_scorers(safety=DATA / "safety_checker").scores == ("safety", "phash")
    # The tiny checker has a tower of its own: not shared with the CLIP model's.
    assert "vision_model" in scorers.params["safety"]


def test_prompts_tokenize_as_transformers(scorers: Scorers, ref: dict[str, Any]) -> None:
    np.testing.assert_array_equal(scorers.tokenize(ref["prompts"]), ref["input_ids"])


def test_embeddings_match_pytorch(scorers: Scorers, ref: dict[str, Any]) -> None:
    clip = CLIPModel(scorers.models.clip)
    tower = SafetyTower(scorers.models.safety)

    @jax.jit
    def embeds(params: dict, pixels: jax.Array, ids: jax.Array) -> tuple[jax.Array, ...]:
        image, text = clip.apply({"params": params["clip"]}, pixels, ids)
        return image, text, tower.apply({"params": params["safety"]}, pixels)

    image, text, safety = embeds(scorers.params, ref["pixels"], ref["input_ids"])
    _close(image, ref["image_embeds"], EMBEDS_REL)
    _close(text, ref["text_embeds"], EMBEDS_REL)
    _close(safety, ref["safety_embeds"], EMBEDS_REL)


def test_safety_flags_and_concept_scores_are_the_checkers(on_processor_pixels: dict, ref: dict[str, Any]) -> None:
    np.testing.assert_array_equal(on_processor_pixels["nsfw"], ref["nsfw"])
    assert ref["nsfw"].any() and not ref["nsfw"].all()
    # Rounded to 3 decimals as the checker rounds: the same numbers (the oracle kept them off the edges).
    np.testing.assert_allclose(on_processor_pixels["concept_scores"], ref["concept_scores"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(on_processor_pixels["special_scores"], ref["special_scores"], rtol=0, atol=1e-6)


def test_clip_and_aesthetic_scores_match(on_processor_pixels: dict, ref: dict[str, Any]) -> None:
    assert (ref["clip"] == 0).any() and (ref["clip"] > 1).any()  # the floor at 0, and real scores
    np.testing.assert_allclose(on_processor_pixels["clip"], ref["clip"], rtol=0, atol=CLIP_ATOL)
    np.testing.assert_allclose(on_processor_pixels["aesthetic"], ref["aesthetic"], rtol=0, atol=AESTHETIC_ATOL)


def test_device_preprocessing_is_clip_image_processors(scorers: Scorers, score_pixels: Any,
                                                        ref: dict[str, Any]) -> None:
    """Each image as rendered (several sizes and aspects, up and down): the crop within
    PIXEL_ATOL of the processor's, the scores within the device tolerances; and `score_batch`,
    from the uint8 batch, is `score_pixels` after `preprocess`."""
    ids = scorers.tokenize(ref["prompts"])
    pixels = np.concatenate([preprocess(jnp.asarray(image[None]), 224) for image in ref["images"]])
    crops = (pixels * np.array(CLIP_STD, np.float32) + np.array(CLIP_MEAN, np.float32)) * 255
    assert np.abs(crops - ref["crops"]).max() <= PIXEL_ATOL + 1e-3
    out = score_pixels(scorers.params, pixels, ids)
    np.testing.assert_allclose(out["clip"], ref["clip"], rtol=0, atol=DEVICE_CLIP_ATOL)
    np.testing.assert_allclose(out["aesthetic"], ref["aesthetic"], rtol=0, atol=DEVICE_AESTHETIC_ATOL)
    np.testing.assert_array_equal(out["nsfw"], ref["nsfw"])
    np.testing.assert_allclose(out["concept_scores"], ref["concept_scores"], rtol=0, atol=DEVICE_SAFETY_ATOL)

    batch = np.stack([ref["images"][0], ref["images"][-1]])  # the two 256x256 images
    whole = jax.jit(scorers.score_batch)(scorers.params, jnp.asarray(batch), ids[[0, -1]])
    for key, value in whole.items():
        np.testing.assert_allclose(value, np.asarray(out[key])[[0, -1]], rtol=0, atol=1e-4)


def test_phash_is_imagehashs_bit_for_bit(ref: dict[str, Any]) -> None:
    hashes = [phash(image) for image in ref["images"]]
    assert [f"{h:016x}" for h in hashes] == list(ref["phash"])
    assert hamming(hashes[0], hashes[-1]) <= 4  # the last image is the first, a little brighter
    assert min(hamming(a, b) for i, a in enumerate(hashes[:-1]) for b in hashes[i + 1:-1]) > 10
    assert hamming(0, 2**64 - 1) == 64


# --------------------------------------------------------------------------- one tower, full size

def _shared_checker(tmp_path: Path) -> Path:
    """A safety checker whose tower and projection are the tiny CLIP model's (as the published
    checker's are CLIP ViT-L/14's), with the reference checker's concepts and thresholds."""
    folder = tmp_path / "safety_checker"
    folder.mkdir()
    clip = load_file(DATA / "clip" / "model.safetensors")
    checker = load_file(DATA / "safety_checker" / "model.safetensors")
    tensors = {f"vision_model.{k}": v for k, v in clip.items() if k.startswith("vision_model.")}
    tensors["visual_projection.weight"] = clip["visual_projection.weight"]
    tensors.update({k: v for k, v in checker.items() if "embeds" in k})
    save_file(tensors, folder / "model.safetensors")
    shutil.copy(DATA / "clip" / "config.json", folder / "config.json")
    return folder


def test_one_tower_serves_the_checker_with_clips_weights(tmp_path: Path, ref: dict[str, Any]) -> None:
    folder = _shared_checker(tmp_path)
    shared = load_scorers(safety=folder, clip=DATA / "clip")
    alone = load_scorers(safety=folder)
    assert "vision_model" not in shared.params["safety"] and "vision_model" in alone.params["safety"]
    ids = shared.tokenize(ref["prompts"])
    got = jax.jit(shared.score_pixels)(shared.params, ref["pixels"], ids)
    want = jax.jit(alone.score_pixels)(alone.params, ref["pixels"])
    for key in ("nsfw", "concept_scores", "special_scores"):
        np.testing.assert_array_equal(got[key], want[key])


def test_configs_of_transformers_4_read_as_transformers_reads_them() -> None:
    """A `vision_config_dict` / `text_config_dict` (configs saved by transformers 4.2x) replaces
    its sub-config whole, the defaults included (transformers 5.23's CLIPConfig gives the same)."""
    stale = {**VIT_L14, "vision_config": {**VIT_L14["vision_config"], "hidden_size": 768, "patch_size": 32},
             "vision_config_dict": {"hidden_size": 1024, "patch_size": 14, "num_attention_heads": 16},
             "text_config_dict": {"num_hidden_layers": 3}}
    config = CLIPConfig.from_dict(stale)
    vision, text = config.vision_config, config.text_config
    assert (vision.hidden_size, vision.patch_size, vision.intermediate_size, vision.num_hidden_layers) == (
        1024, 14, 3072, 12)
    assert (text.num_hidden_layers, text.hidden_size) == (3, 512)


def _tower_names(prefix: str, width: int, mlp: int, layers: int) -> dict[str, tuple[int, ...]]:
    """A transformers CLIP encoder's tensors: PyTorch names and shapes."""
    names = {}
    for i in range(layers):
        layer = f"{prefix}encoder.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            names |= {f"{layer}self_attn.{proj}.weight": (width, width), f"{layer}self_attn.{proj}.bias": (width,)}
        for norm in ("layer_norm1", "layer_norm2"):
            names |= {f"{layer}{norm}.weight": (width,), f"{layer}{norm}.bias": (width,)}
        names |= {f"{layer}mlp.fc1.weight": (mlp, width), f"{layer}mlp.fc1.bias": (mlp,),
                  f"{layer}mlp.fc2.weight": (width, mlp), f"{layer}mlp.fc2.bias": (width,)}
    return names


def _vision_names(prefix: str) -> dict[str, tuple[int, ...]]:
    return {f"{prefix}embeddings.patch_embedding.weight": (1024, 3, 14, 14),
            f"{prefix}embeddings.class_embedding": (1024,),
            f"{prefix}embeddings.position_embedding.weight": (257, 1024),
            f"{prefix}embeddings.position_ids": (1, 257),  # a buffer transformers 4 saved
            f"{prefix}pre_layrnorm.weight": (1024,), f"{prefix}pre_layrnorm.bias": (1024,),
            f"{prefix}post_layernorm.weight": (1024,), f"{prefix}post_layernorm.bias": (1024,),
            **_tower_names(prefix, 1024, 4096, 24)}


def _flat_shapes(module: Any) -> dict[tuple[str, ...], tuple[int, ...]]:
    shapes = jax.eval_shape(module.init_params, jax.random.PRNGKey(0))
    return {k: tuple(v.shape) for k, v in flatten_dict(shapes).items()}


def test_vit_l14_builds_with_the_hub_layout() -> None:
    """openai/clip-vit-large-patch14 (CLIPModel) and CompVis/stable-diffusion-safety-checker: every
    hub tensor has its parameter and every parameter its tensor, shapes included."""
    config = CLIPConfig.from_dict(VIT_L14)
    hub = {**_vision_names("vision_model."), **_tower_names("text_model.", 768, 3072, 12),
           "text_model.embeddings.token_embedding.weight": (49408, 768),
           "text_model.embeddings.position_embedding.weight": (77, 768),
           "text_model.embeddings.position_ids": (1, 77),
           "text_model.final_layer_norm.weight": (768,), "text_model.final_layer_norm.bias": (768,),
           "visual_projection.weight": (768, 1024), "text_projection.weight": (768, 768), "logit_scale": ()}
    expected = _flat_shapes(CLIPModel(config))
    convert.plan("clip_model", hub, expected, "openai/clip-vit-large-patch14")
    vision = sum(np.prod(s) for k, s in expected.items() if k[0] in ("vision_model", "visual_projection"))
    assert vision == 303_966_208  # the ViT-L/14 image tower with its projection
    assert sum(np.prod(s) for s in expected.values()) == 427_616_512  # CLIPModel's, less logit_scale

    checker = {**_vision_names("vision_model.vision_model."), "visual_projection.weight": (768, 1024),
               "concept_embeds": (17, 768), "special_care_embeds": (3, 768),
               "concept_embeds_weights": (17,), "special_care_embeds_weights": (3,)}
    convert.plan("safety_checker", checker, _flat_shapes(SafetyTower(config)),
                 "CompVis/stable-diffusion-safety-checker")


# --------------------------------------------------------------------------------------- refusals

def test_a_pickled_aesthetic_model_is_refused_with_the_conversion(tmp_path: Path) -> None:
    pth = tmp_path / "sac+logos+ava1-l14-linearMSE.pth"
    pth.write_bytes(b"\x80\x04K\x01.")  # a pickle: never opened
    with pytest.raises(ScoreModelError) as err:
        load_scorers(clip=DATA / "clip", aesthetic=pth)
    message = str(err.value)
    assert message.startswith(f"aesthetic='{pth}'") and "pickle" in message
    assert f"torch.load('{pth}', map_location='cpu', weights_only=True)" in message
    assert "st.save_file(" in message and str(pth.with_suffix(".safetensors")) in message


def test_missing_and_malformed_models_fail_at_load(tmp_path: Path) -> None:
    cases = [
        (dict(clip=DATA / "clip", aesthetic=tmp_path / "none.safetensors"), "aesthetic", "no such file"),
        (dict(aesthetic=DATA / "aesthetic.safetensors"), "aesthetic", "needs a CLIP model"),
        (dict(safety=tmp_path / "absent"), "safety", "has no config.json"),
    ]
    broken = tmp_path / "broken"
    shutil.copytree(DATA / "safety_checker", broken)
    (broken / "config.json").write_text("{not json")
    cases.append((dict(safety=broken), "safety", "not a CLIPConfig"))
    pickled = tmp_path / "pickled"
    shutil.copytree(DATA / "safety_checker", pickled)
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")
    cases.append((dict(safety=pickled), "safety", "pytorch_model.bin is a pickle file"))
    wrong = tmp_path / "wrong"
    shutil.copytree(DATA / "clip", wrong)
    config = json.loads((wrong / "config.json").read_text())
    config["projection_dim"] = 8
    (wrong / "config.json").write_text(json.dumps(config))
    cases.append((dict(clip=wrong), "clip", "with the wrong shape"))
    untokenized = tmp_path / "untokenized"
    shutil.copytree(DATA / "clip", untokenized)
    (untokenized / "tokenizer_config.json").unlink()
    cases.append((dict(clip=untokenized), "clip", "its tokenizer"))
    for kwargs, score, why in cases:
        with pytest.raises(ScoreModelError) as err:
            load_scorers(**kwargs)
        assert str(err.value).startswith(f"{score}="), err.value
        assert why in str(err.value), err.value
        assert str(kwargs.get(score, "")) in str(err.value)
