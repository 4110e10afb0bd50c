"""Scores of rendered images, computed on the devices that rendered them: diffusers' safety
checker, the CLIP score, LAION's aesthetic predictor; and the perceptual hash, on the host.

Each score is the PyTorch reference's, on the same pixels (tests/test_scores.py holds them to
tests/data/scores/, written by tests/oracle/scores.py):

- safety: diffusers' `StableDiffusionSafetyChecker.forward`. The pooled output of a CLIP vision
  tower, its `visual_projection`, cosine similarities to the 17 `concept_embeds` and 3
  `special_care_embeds`, minus each one's threshold (`concept_embeds_weights`,
  `special_care_embeds_weights`); once a special-care concept scores above 0, 0.01 is added to
  the special-care concepts after it and to every concept; each score rounded to 3 decimals, as
  the checker rounds them, and the image flagged when a concept's rounded score is above 0.
- clip: torchmetrics' `CLIPScore` per image, 100 x cos(image embeds, text embeds) of a CLIPModel
  (CLIP ViT-L/14 for the published figures), floored at 0.
- aesthetic: LAION's improved aesthetic predictor (`sac+logos+ava1-l14-linearMSE`), five Linear
  layers without activations (`layers.0, .2, .4, .6, .7` of its torch Sequential; the dropouts
  between them do nothing at inference) over the L2-normalised image embeds of the CLIP model.
- phash: `imagehash.phash` (64 bits; the hex string imagehash prints is this int's), on the host.

One tower serves every score with the same weights: the CLIP model's image embeds feed the CLIP
score and the aesthetic predictor, and the safety checker's too when its tower and projection
are the CLIP model's (compared at load). CLIP's preprocessing (CLIPImageProcessor's PIL backend,
transformers 4's only one: shortest side to the tower's image_size, bicubic with antialiasing;
centre crop; rescale; CLIP's mean and std) runs on the device on the uint8 batch, inside the same
jittable function; a batch sharded over the devices gives scores sharded alike.

The worker's API:

    scorers = load_scorers(safety=None | Path, clip=None | Path, aesthetic=None | Path,
                           dtype=jnp.float32)    # at start-up; ScoreModelError names the path
    scorers.scores                              # the scores it gives, in SCORES' order
    scorers.params                              # host arrays: place them on the devices once
    ids = scorers.tokenize(prompts)             # (B, 77) int32 (None without a CLIP model)
    out = jax.jit(scorers.score_batch)(params, images, ids)   # images (B, H, W, 3) uint8
    out["nsfw"] (B,) bool; out["concept_scores"] (B, 17), out["special_scores"] (B, 3) float32
    out["clip"] (B,) float32; out["aesthetic"] (B,) float32       (each only when loaded)
    phash(pixels) -> int; hamming(a, b) -> int                 (host)

`score_batch` is `score_pixels` after `preprocess`; `score_pixels` takes pixels already
preprocessed (B, S, S, 3), as CLIPImageProcessor's `pixel_values` transposed to NHWC.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict
from PIL import Image

from diffusion.choices import SCORES
from diffusion.convert import WeightsError
from diffusion.errors import ModelError
from diffusion.nn import parameter_shapes
from diffusion.nn.clip import CLIPConfig, CLIPModel, CLIPVisionModel
from diffusion.nn.layers import Dense, Dtype, param
from diffusion.tokenizer import CLIPTokenizer, TokenizerError
from diffusion.weights import PICKLE_SUFFIXES, load_tensors, load_weights, read_header
# CLIPImageProcessor's (OpenAI CLIP's) normalisation.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
CONCEPTS, SPECIAL_CONCEPTS = 17, 3  # StableDiffusionSafetyChecker's fixed counts
SPECIAL_ADJUSTMENT = 0.01
AESTHETIC_LAYERS = (("0", 1024), ("2", 128), ("4", 64), ("6", 16), ("7", 1))  # (index, out features)


class ScoreModelError(ModelError):
    """A scoring model that cannot be used: `<score>=<path>: <why>`, raised at start-up."""


# ----------------------------------------------------------------------------------- device side

def preprocess(images: jax.Array, size: int) -> jax.Array:
    """uint8 (B, H, W, 3) -> float32 (B, size, size, 3): CLIPImageProcessor's shortest side to
    `size` (bicubic, antialiased when shrinking), the centre crop, 1/255 and CLIP's mean and std.
    Done here so the pixels never leave the device. The resize is PIL's as the processor runs it:
    rows, then columns, each pass rounded and clipped to 8 bits (one float pass differs by up to
    7/255 at sharp edges, where PIL clips the first pass's overshoot)."""
    b, h, w, c = images.shape
    short, long = min(h, w), max(h, w)
    new_long = int(size * long / short)  # transformers' get_resize_output_image_size
    height, width = (size, new_long) if h <= w else (new_long, size)
    x = images.astype(jnp.float32)
    for shape in ((b, h, width, c), (b, height, width, c)):
        x = jnp.clip(jnp.round(jax.image.resize(x, shape, method="bicubic", antialias=True)), 0, 255)
    top, left = (height - size) // 2, (width - size) // 2
    x = x[:, top:top + size, left:left + size]
    return (x / 255 - jnp.array(CLIP_MEAN, jnp.float32)) / jnp.array(CLIP_STD, jnp.float32)


class SafetyTower(nn.Module):
    """The safety checker's own tower and projection: pixels -> image embeds (B, P), in its
    checkpoint's names (`vision_model/vision_model/...`, `visual_projection`); the concept
    embeddings and thresholds are plain parameters beside them."""

    config: CLIPConfig
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, pixels: jax.Array) -> jax.Array:
        cfg = self.config
        pooled = CLIPVisionModel(cfg.vision_config, self.dtype, name="vision_model")(pixels)
        embeds = Dense(cfg.projection_dim, use_bias=False, dtype=self.dtype, name="visual_projection")(pooled)
        param(self, "concept_embeds", (CONCEPTS, cfg.projection_dim))
        param(self, "special_care_embeds", (SPECIAL_CONCEPTS, cfg.projection_dim))
        param(self, "concept_embeds_weights", (CONCEPTS,))
        param(self, "special_care_embeds_weights", (SPECIAL_CONCEPTS,))
        return embeds

    def init_params(self, rng: jax.Array) -> dict:
        """Parameters of the checkpoint's shapes (under `jax.eval_shape`, the shapes alone)."""
        size = self.config.vision_config.image_size
        return self.init(rng, jnp.zeros((1, size, size, self.config.vision_config.num_channels)))["params"]


class _AestheticLayers(nn.Module):
    """The Sequential's Linear layers, named by their indices in it."""

    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for index, features in AESTHETIC_LAYERS:  # no activations: the published model is linear
            x = Dense(features, dtype=self.dtype, name=index)(x)
        return x


class AestheticPredictor(nn.Module):
    """LAION's improved aesthetic predictor: normalised image embeds (B, input_size) -> (B, 1)."""

    input_size: int
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, embeds: jax.Array) -> jax.Array:
        return _AestheticLayers(self.dtype, name="layers")(embeds.astype(self.dtype))

    def init_params(self, rng: jax.Array) -> dict:
        """Parameters of the predictor's shapes (under `jax.eval_shape`, the shapes alone)."""
        return self.init(rng, jnp.zeros((1, self.input_size)))["params"]


def _cosine(a: jax.Array, b: jax.Array) -> jax.Array:
    """torch.nn.functional.normalize both (eps 1e-12), then a @ b.T, in float32."""
    unit = lambda x: x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)  # noqa: E731
    return unit(a.astype(jnp.float32)) @ unit(b.astype(jnp.float32)).T


def safety_scores(image_embeds: jax.Array, checker: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """diffusers' StableDiffusionSafetyChecker.forward from the projected image embeds: the
    rounded special-care and concept scores and the flag (see the module docstring)."""
    special = _cosine(image_embeds, checker["special_care_embeds"])
    concept = _cosine(image_embeds, checker["concept_embeds"])
    special_thresholds = checker["special_care_embeds_weights"].astype(jnp.float32)
    adjustment = jnp.zeros(special.shape[0], jnp.float32)
    special_scores = []
    for i in range(special.shape[1]):  # the checker's loop: a hit adjusts the concepts after it
        score = jnp.round(special[:, i] - special_thresholds[i] + adjustment, 3)
        special_scores.append(score)
        adjustment = jnp.where(score > 0, jnp.float32(SPECIAL_ADJUSTMENT), adjustment)
    concept_scores = jnp.round(concept - checker["concept_embeds_weights"].astype(jnp.float32)
                               + adjustment[:, None], 3)
    return {"nsfw": (concept_scores > 0).any(-1), "concept_scores": concept_scores,
            "special_scores": jnp.stack(special_scores, -1)}


def clip_scores(image_embeds: jax.Array, text_embeds: jax.Array) -> jax.Array:
    """torchmetrics' CLIPScore per pair: 100 x cos, floored at 0 (B,)."""
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    cos = (unit(image_embeds.astype(jnp.float32)) * unit(text_embeds.astype(jnp.float32))).sum(-1)
    return jnp.maximum(100 * cos, 0)


@dataclasses.dataclass(frozen=True)
class ScoreModels:
    """The scoring networks' configs: what `score_pixels` builds (static under jit)."""

    safety: CLIPConfig | None = None
    clip: CLIPConfig | None = None
    aesthetic: bool = False
    dtype: Any = jnp.float32

    def sizes(self) -> tuple[int, ...]:
        """The towers' input sizes, each preprocessed once."""
        return tuple(sorted({c.vision_config.image_size for c in (self.safety, self.clip) if c is not None}))


def score_pixels(models: ScoreModels, params: Mapping[str, Any], pixels: Mapping[int, jax.Array] | jax.Array,
                 input_ids: jax.Array | None = None) -> dict[str, jax.Array]:
    """The scores of preprocessed pixels (B, S, S, 3), or of {S: pixels} where the towers'
    sizes differ; `input_ids` (B, T) the prompts' CLIP tokens, needed with a CLIP model.
    A safety checker without its tower in `params` (shared at load) uses the CLIP model's."""
    at = pixels if isinstance(pixels, Mapping) else {pixels.shape[1]: pixels}
    out: dict[str, jax.Array] = {}
    embeds = None
    if models.clip is not None:
        clip = CLIPModel(models.clip, models.dtype)
        variables = {"params": params["clip"]}
        embeds = clip.apply(variables, at[models.clip.vision_config.image_size], method=CLIPModel.image_embeds)
        if input_ids is None:
            raise ValueError("the CLIP score needs the prompts' input_ids")
        out["clip"] = clip_scores(embeds, clip.apply(variables, input_ids, method=CLIPModel.text_embeds))
        if models.aesthetic:
            unit = embeds.astype(jnp.float32) / jnp.linalg.norm(embeds.astype(jnp.float32), axis=-1, keepdims=True)
            predictor = AestheticPredictor(embeds.shape[-1], models.dtype)
            out["aesthetic"] = predictor.apply({"params": params["aesthetic"]}, unit)[:, 0].astype(jnp.float32)
    if models.safety is not None:
        checker = params["safety"]
        if "vision_model" in checker:
            safety_embeds = SafetyTower(models.safety, models.dtype).apply(
                {"params": checker}, at[models.safety.vision_config.image_size])
        else:
            safety_embeds = embeds
        out.update(safety_scores(safety_embeds, checker))
    return out


def score_batch(models: ScoreModels, params: Mapping[str, Any], images: jax.Array,
                input_ids: jax.Array | None = None) -> dict[str, jax.Array]:
    """The scores of a uint8 batch (B, H, W, 3) as rendered: `preprocess` per tower size, then
    `score_pixels`. Jittable; call it on the device arrays right after the decode."""
    return score_pixels(models, params, {size: preprocess(images, size) for size in models.sizes()}, input_ids)


# ------------------------------------------------------------------------------------- host side

@dataclasses.dataclass(frozen=True)
class Scorers:
    """What `load_scorers` found: the scores it gives, their parameters (host arrays), the
    prompts' tokenizer, and the jittable `score_batch(params, images, input_ids)`."""

    scores: tuple[str, ...]
    models: ScoreModels
    params: dict[str, Any]
    tokenizer: CLIPTokenizer | None = None

    @property
    def score_batch(self) -> Callable[..., dict[str, jax.Array]]:
        """`score_batch(params, images (B, H, W, 3) uint8, input_ids (B, T) | None)`, jittable."""
        return functools.partial(score_batch, self.models)

    @property
    def score_pixels(self) -> Callable[..., dict[str, jax.Array]]:
        """`score_pixels(params, preprocessed pixels, input_ids | None)`, jittable."""
        return functools.partial(score_pixels, self.models)

    def tokenize(self, prompts: list[str]) -> np.ndarray | None:
        """The prompts' CLIP ids (B, T) int32, cut to T as CLIPScore cuts them; None without a CLIP model."""
        return None if self.tokenizer is None else self.tokenizer(prompts)[0]


def load_scorers(safety: Path | str | None = None, clip: Path | str | None = None,
                 aesthetic: Path | str | None = None, dtype: Any = jnp.float32) -> Scorers:
    """The scoring models, checked and loaded on the host, so that a missing or malformed one
    fails the worker's start-up (ScoreModelError: the score, the path, why), not a batch.

    `safety`: a diffusers `safety_checker` folder (config.json, model.safetensors); `clip`: a
    transformers CLIPModel folder (config.json, model.safetensors, its tokenizer files);
    `aesthetic`: the predictor's .safetensors file, which needs `clip` (its input is the CLIP
    model's image embeds). phash needs no model and is always given."""
    params: dict[str, Any] = {}
    safety_config = clip_config = None
    tokenizer = None
    if aesthetic is not None and clip is None:
        raise ScoreModelError("aesthetic", str(aesthetic), "needs a CLIP model (ViT-L/14) for its image embeds")
    if clip is not None:
        clip = Path(clip)
        clip_config = _config("clip", clip)
        params["clip"] = _weights("clip", clip, "clip_model", CLIPModel(clip_config, dtype), dtype)
        try:
            tokenizer = CLIPTokenizer.from_folder(clip)
        except (TokenizerError, OSError) as err:
            raise ScoreModelError("clip", str(clip), f"its tokenizer: {err}") from None
    if aesthetic is not None:
        params["aesthetic"] = _aesthetic(Path(aesthetic), clip_config.projection_dim, dtype)
    if safety is not None:
        safety = Path(safety)
        safety_config = _config("safety", safety)
        checker = _weights("safety", safety, "safety_checker", SafetyTower(safety_config, dtype), dtype)
        if clip_config is not None and _same_tower(checker, safety_config, params["clip"], clip_config):
            checker = {k: v for k, v in checker.items() if k not in ("vision_model", "visual_projection")}
        params["safety"] = checker
    models = ScoreModels(safety_config, clip_config, aesthetic is not None, dtype)
    given = {"safety": safety is not None, "clip": clip is not None, "aesthetic": aesthetic is not None, "phash": True}
    return Scorers(tuple(name for name in SCORES if given[name]), models, params, tokenizer)


def _config(score: str, folder: Path) -> CLIPConfig:
    path = folder / "config.json"
    try:
        return CLIPConfig.from_dict(json.loads(path.read_text(encoding="utf-8")))
    except FileNotFoundError:
        raise ScoreModelError(score, str(folder), "has no config.json") from None
    except (OSError, ValueError, TypeError, AttributeError, UnicodeDecodeError) as err:
        raise ScoreModelError(score, str(path), f"not a CLIPConfig ({err})") from None


def _weights(score: str, folder: Path, kind: str, module: nn.Module, dtype: Any) -> dict:
    try:
        return load_weights(folder.parent, folder.name, kind, parameter_shapes(module), dtype)
    except WeightsError as err:
        raise ScoreModelError(score, str(folder), str(err)) from None


def _aesthetic(path: Path, input_size: int, dtype: Any) -> dict:
    if path.suffix in PICKLE_SUFFIXES:
        target = path.with_suffix(".safetensors")
        raise ScoreModelError("aesthetic", str(path), (
            "a pickle file, which is never loaded: unpickling runs code from the file. Convert it on a "
            "trusted machine with torch: python -c \"import torch, safetensors.torch as st; "
            f"st.save_file(torch.load('{path}', map_location='cpu', weights_only=True), '{target}')\""))
    if not path.is_file():
        raise ScoreModelError("aesthetic", str(path), "no such file (the predictor's .safetensors)")
    try:
        expected = parameter_shapes(AestheticPredictor(input_size, dtype))
        return load_tensors(path, "aesthetic", read_header(path), expected, dtype)
    except WeightsError as err:
        raise ScoreModelError("aesthetic", str(path), f"{err} (its input must be the CLIP model's "
                              f"{input_size} projection features)") from None


def _same_tower(checker: Mapping[str, Any], checker_config: CLIPConfig, clip: Mapping[str, Any],
                clip_config: CLIPConfig) -> bool:
    """Whether the safety checker's tower and projection are the CLIP model's, weight for weight."""
    if (checker_config.vision_config, checker_config.projection_dim) != (
            clip_config.vision_config, clip_config.projection_dim):
        return False
    ours = flatten_dict({"tower": checker["vision_model"]["vision_model"], "projection": checker["visual_projection"]})
    theirs = flatten_dict({"tower": clip["vision_model"], "projection": clip["visual_projection"]})
    return ours.keys() == theirs.keys() and all(np.array_equal(ours[k], theirs[k]) for k in ours)


def phash(pixels: np.ndarray) -> int:
    """`imagehash.phash` of an image (H, W, 3) or (H, W) uint8 as a 64-bit int whose hex is
    imagehash's string: 8-bit luma (PIL), Lanczos to 32x32, 2-D DCT-II, the top-left 8x8 above
    their median, row-major, the first bit the most significant. scipy is imported here, by
    the store threads that hash: a worker or render that hashes nothing does not pay for it."""
    import scipy.fftpack

    image = Image.fromarray(np.asarray(pixels, np.uint8)).convert("L").resize((32, 32), Image.Resampling.LANCZOS)
    dct = scipy.fftpack.dct(scipy.fftpack.dct(np.asarray(image), axis=0), axis=1)
    low = dct[:8, :8]
    bits = (low > np.median(low)).ravel()
    return int("".join("1" if bit else "0" for bit in bits), 2)


def hamming(a: int, b: int) -> int:
    """The number of bits two hashes differ in (near-duplicates: a few)."""
    return (a ^ b).bit_count()
