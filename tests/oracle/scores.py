"""Reference outputs of the scores in diffusion/scores.py, by the PyTorch classes that define them.

`write(data)` runs in the oracle venv and rebuilds `data/scores/` (about 0.5 MB):

    clip/               a tiny random transformers CLIPModel (save_pretrained: config.json,
                        model.safetensors in float16) with the tiny CLIP tokenizer's files
    safety_checker/     a tiny random diffusers StableDiffusionSafetyChecker (its own tower),
                        thresholds set so that some images flag and some do not, one only through
                        the special-care adjustment
    aesthetic.safetensors  LAION's aesthetic MLP (a torch Sequential `layers` of the published
                        shapes, input the tiny CLIP's projection_dim)
    images/<i>.png      synthetic images of several sizes and aspects (one a near-copy of another)
    crops/<i>.png       CLIPImageProcessor's resized and centre-cropped 8-bit pixels of each: its
                        pixel_values are (crop / 255 - mean) / std to float32 rounding (checked)
    reference.npz       prompts, input_ids, image_embeds, text_embeds, clip, aesthetic, safety_embeds, nsfw,
                        concept_scores, special_scores, phash (imagehash's hex strings)

The CLIP score is torchmetrics' CLIPScore formula computed here on transformers' CLIPModel
features (100 x cos, floored at 0), not torchmetrics itself: it would add a package for one line.
The safety scores are the checker's own: its `forward`'s per-image result dicts, read from the
frame when it returns (the method returns only the flags). Deterministic.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import sys
import warnings
from typing import Any

import imagehash
import numpy as np
import torch
from diffusers.pipelines.stable_diffusion.safety_checker import StableDiffusionSafetyChecker
from PIL import Image
from transformers import CLIPConfig, CLIPImageProcessorPil, CLIPModel, CLIPTokenizer

from tests.oracle.nn import _liven

_TOWER = {"hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 2}
CONFIG = {
    # eos_token_id 2: OpenAI CLIP's legacy id (pool at the largest id), as openai/clip-vit-large-patch14.
    "text_config": {**_TOWER, "vocab_size": 514, "max_position_embeddings": 77, "eos_token_id": 2,
                    "bos_token_id": 512, "pad_token_id": 513},
    "vision_config": {**_TOWER, "image_size": 224, "patch_size": 32},
    "projection_dim": 16,
}
SIZES = [(256, 256), (300, 200), (200, 360), (97, 131), (512, 384), (256, 256)]  # (width, height)
PROMPTS = ["a red circle", "blue sky over green hills", "a cat", "a photograph of stripes",
           "gold light", "a red circle, again"]


def _images() -> list[np.ndarray]:
    """Smooth synthetic images (gradients, discs, stripes): small PNGs, varied hashes. The last is
    the first with its brightness changed a little, a near-duplicate for the hashes."""
    images = []
    for i, (w, h) in enumerate(SIZES[:-1]):
        rng = np.random.default_rng(100 + i)
        y, x = np.mgrid[0:h, 0:w] / max(w, h)
        channels = []
        for _ in range(3):
            a, b, c = rng.uniform(-3, 3, 3)
            cx, cy, r = rng.uniform(0.2, 0.8), rng.uniform(0.2, 0.8), rng.uniform(0.1, 0.3)
            disc = ((x - cx) ** 2 + (y - cy) ** 2 < r * r) * rng.uniform(-0.5, 0.5)
            channels.append(0.5 + 0.2 * np.sin(a * x + b * y + c) + 0.15 * np.sin(rng.uniform(5, 30) * x) + disc)
        images.append(np.clip(np.stack(channels, -1) * 255, 0, 255).round().astype(np.uint8))
    images.append(np.clip(images[0].astype(np.int16) + 6, 0, 255).astype(np.uint8))
    return images


def _checker_result(checker: StableDiffusionSafetyChecker, clip_input: torch.Tensor,
                    images: np.ndarray) -> tuple[list[bool], list[dict[str, Any]]]:
    """The checker's flags and its forward's own per-image result dicts."""
    code = StableDiffusionSafetyChecker.forward.__wrapped__.__code__
    seen: dict[str, Any] = {}

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "return" and frame.f_code is code:
            seen["result"] = frame.f_locals["result"]

    sys.setprofile(profile)
    try:
        _, flags = checker(clip_input=clip_input, images=images.copy())
    finally:
        sys.setprofile(None)
    return [bool(f) for f in flags], seen["result"]


FLAGGED, ADJUSTED = 2, 4  # the image concept 0 flags; the one flagged only through the adjustment


def _concepts(checker: StableDiffusionSafetyChecker, embeds: torch.Tensor, seed: int) -> None:
    """Concepts and thresholds for the random tower's embeds: special-care 0 (aimed at image
    ADJUSTED) hits it alone; special-care 1 (aimed there too) scores -0.0047 on it, +0.0053 once
    adjusted; concept 0 (aimed at image FLAGGED) flags it alone; concept 1 flags ADJUSTED only
    through the adjustment (-0.0043 without). The other concepts are random and never hit."""
    rng = np.random.default_rng(seed)
    centred = (embeds - embeds.mean(0)).numpy()
    unit = lambda t: t / np.linalg.norm(t, axis=-1, keepdims=True)  # noqa: E731
    noise = lambda: unit(rng.standard_normal(centred.shape[1]))  # noqa: E731
    aim = lambda i: centred[i] + 0.1 * np.linalg.norm(centred[i]) * noise()  # noqa: E731
    special = unit(rng.standard_normal((3, centred.shape[1])))
    concept = unit(rng.standard_normal((17, centred.shape[1])))
    special[0], special[1], concept[0], concept[1] = aim(ADJUSTED), aim(ADJUSTED), aim(FLAGGED), aim(ADJUSTED)
    special, concept = (torch.from_numpy(x.astype(np.float32)).half().float() for x in (special, concept))
    cos = lambda c: (torch.from_numpy(unit(embeds.numpy())) @ torch.from_numpy(unit(c.numpy())).T).numpy()  # noqa: E731
    special_cos, concept_cos = cos(special), cos(concept)
    special_w, concept_w = special_cos.max(0) + 0.05, concept_cos.max(0) + 0.05
    for cosines, weights, index, target, offset in ((special_cos, special_w, 0, ADJUSTED, None),
                                                     (special_cos, special_w, 1, ADJUSTED, 0.0047),
                                                     (concept_cos, concept_w, 0, FLAGGED, None),
                                                     (concept_cos, concept_w, 1, ADJUSTED, 0.0043)):
        column = cosines[:, index]
        runner_up = np.delete(column, target).max()
        assert column[target] > runner_up + 0.03, f"image {target} does not stand out: {column}"
        weights[index] = (column[target] + runner_up) / 2 if offset is None else column[target] + offset
    with torch.no_grad():
        checker.special_care_embeds.copy_(special)
        checker.concept_embeds.copy_(concept)
        checker.special_care_embeds_weights.copy_(torch.from_numpy(special_w).half().float())
        checker.concept_embeds_weights.copy_(torch.from_numpy(concept_w).half().float())


def _unrounded(checker: StableDiffusionSafetyChecker, embeds: torch.Tensor) -> np.ndarray:
    """Every special-care and concept score before the checker rounds it (adjusted as it does)."""
    unit = lambda t: t / t.norm(dim=-1, keepdim=True)  # noqa: E731
    special = (unit(embeds) @ unit(checker.special_care_embeds).T).numpy() - checker.special_care_embeds_weights.numpy()
    concept = (unit(embeds) @ unit(checker.concept_embeds).T).numpy() - checker.concept_embeds_weights.numpy()
    adjusted = np.zeros(len(special), np.float32)
    scores = []
    for j in range(special.shape[1]):
        scores.append(special[:, j] + adjusted)
        adjusted = np.where(np.round(scores[-1], 3) > 0, np.float32(0.01), adjusted)
    return np.concatenate([np.stack(scores, 1), concept + adjusted[:, None]], 1)


def write(data: pathlib.Path) -> None:
    """Rebuild data/scores."""
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    folder = pathlib.Path(data) / "scores"
    shutil.rmtree(folder, ignore_errors=True)
    (folder / "images").mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _write(folder, pathlib.Path(data))


def _write(folder: pathlib.Path, data: pathlib.Path) -> None:
    images = _images()
    for i, image in enumerate(images):
        Image.fromarray(image).save(folder / "images" / f"{i}.png", optimize=True)
    images = [np.asarray(Image.open(folder / "images" / f"{i}.png").convert("RGB")) for i in range(len(images))]

    processor = CLIPImageProcessorPil()  # defaults: OpenAI CLIP's (224, bicubic, CLIP mean/std)
    pixel_values = torch.cat([processor(images=img, return_tensors="pt").pixel_values for img in images])
    crops = np.concatenate([processor(images=img, do_rescale=False, do_normalize=False,
                                      return_tensors="np").pixel_values for img in images])
    crops = crops.transpose(0, 2, 3, 1)
    assert np.array_equal(crops, crops.round()) and crops.min() >= 0 and crops.max() <= 255
    crops = crops.astype(np.uint8)
    (folder / "crops").mkdir()
    for i, crop in enumerate(crops):
        Image.fromarray(crop).save(folder / "crops" / f"{i}.png", optimize=True)
    mean, std = np.array(processor.image_mean, np.float32), np.array(processor.image_std, np.float32)
    rebuilt = ((crops / np.float32(255) - mean) / std).astype(np.float32).transpose(0, 3, 1, 2)
    np.testing.assert_allclose(rebuilt, pixel_values.numpy(), rtol=0, atol=1e-6)

    clip_folder = folder / "clip"
    clip_folder.mkdir()
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(data / "tokenizer" / "tiny" / name, clip_folder / name)
    tokenizer = CLIPTokenizer.from_pretrained(clip_folder)
    input_ids = tokenizer(PROMPTS, padding="max_length", max_length=77, truncation=True,
                          return_tensors="pt").input_ids
    for seed in range(40, 100):  # the first seed whose cosines take both signs: the floor at 0 shows
        torch.manual_seed(seed)
        model = CLIPModel(CLIPConfig(**CONFIG)).eval()
        _liven(model)
        with torch.no_grad():
            image_embeds = model.get_image_features(pixel_values=pixel_values).pooler_output
            text_embeds = model.get_text_features(input_ids=input_ids).pooler_output
        cos = torch.nn.functional.cosine_similarity(image_embeds, text_embeds, dim=-1)
        if (cos > 0.05).sum() >= 2 and (cos < -0.05).sum() >= 2:
            break
    model.half().save_pretrained(clip_folder, safe_serialization=True)
    img_n = image_embeds / image_embeds.norm(p=2, dim=-1, keepdim=True)  # torchmetrics' _clip_score_update
    txt_n = text_embeds / text_embeds.norm(p=2, dim=-1, keepdim=True)
    clip = torch.clamp(100 * (img_n * txt_n).sum(-1), min=0)

    torch.manual_seed(41)
    aesthetic = torch.nn.Module()
    aesthetic.layers = torch.nn.Sequential(  # improved-aesthetic-predictor's MLP, eval: dropouts do nothing
        torch.nn.Linear(CONFIG["projection_dim"], 1024), torch.nn.Dropout(0.2), torch.nn.Linear(1024, 128),
        torch.nn.Dropout(0.2), torch.nn.Linear(128, 64), torch.nn.Dropout(0.1), torch.nn.Linear(64, 16),
        torch.nn.Linear(16, 1)).eval()
    _liven(aesthetic)
    from safetensors.torch import save_file
    save_file({k: v.half().contiguous() for k, v in aesthetic.state_dict().items()}, folder / "aesthetic.safetensors")
    with torch.no_grad():  # simple_inference.py: L2-normalised embeds (numpy), float32
        normed = image_embeds / image_embeds.norm(p=2, dim=-1, keepdim=True)
        aesthetic_scores = aesthetic.layers(normed)[:, 0]

    torch.manual_seed(42)
    checker = StableDiffusionSafetyChecker(CLIPConfig(**CONFIG)).eval()
    _liven(checker)
    with torch.no_grad():
        safety_embeds = checker.visual_projection(checker.vision_model(pixel_values)[1])
    for seed in range(43, 100):  # the first whose scores keep 1e-5 from the checker's rounding edges
        _concepts(checker, safety_embeds, seed)
        unrounded = _unrounded(checker, safety_embeds)
        if np.abs((unrounded * 1000) % 1 - 0.5).min() / 1000 > 1e-5:
            break
    flags, result = _checker_result(checker, pixel_values, np.stack([np.zeros_like(crops[0])] * len(images)))
    assert flags == [i in (FLAGGED, ADJUSTED) for i in range(len(images))], result
    assert [len(r["special_care"]) for r in result] == [2 * (i == ADJUSTED) for i in range(len(images))], result
    checker.half().save_pretrained(folder / "safety_checker", safe_serialization=True)
    concept_scores = np.array([[r["concept_scores"][j] for j in range(17)] for r in result], np.float32)
    special_scores = np.array([[r["special_scores"][j] for j in range(3)] for r in result], np.float32)
    np.savez_compressed(
        folder / "reference.npz",
        prompts=np.array(json.dumps(PROMPTS)), input_ids=input_ids.numpy().astype(np.int32),
        image_embeds=image_embeds.numpy(), text_embeds=text_embeds.numpy(), clip=clip.numpy(),
        aesthetic=aesthetic_scores.numpy(), safety_embeds=safety_embeds.numpy(), nsfw=np.array(flags),
        concept_scores=concept_scores, special_scores=special_scores,
        phash=np.array([str(imagehash.phash(Image.open(folder / "images" / f"{i}.png"))) for i in range(len(images))]))
