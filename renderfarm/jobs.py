"""The job contract: one place that says what a job is, what is valid, and what its id is.

Producers, the local renderer and workers all validate through `parse_job`, so a bad value
gets the same error (field, value, rule) wherever it is caught.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import operator
import re
from collections.abc import Mapping
from typing import Any

# The model layer's names a job chooses from (schedulers, dtypes, scores, ...) and their rules.
from diffusion.choices import DTYPES, SCHEDULERS, SCORES, SPACINGS, Lora, check_sampler, check_variant
from renderfarm.errors import JobError  # the contract's error, raised and imported from here
from renderfarm.scores import Expression  # a gate's language

SEED_LIMIT = 2**32
MAX_PROMPT_CHARS = 10_000  # far beyond 77 tokens; stops megabyte prompts at the door
MAX_MODEL_CHARS = 1_000  # hub ids, paths and URLs are far shorter
# Size steps (VAE factor x the denoiser's downsampling) of the published families. A worker holds a
# job's size to its own model's step; the producer, which does not know the model's family, to
# the finest, so it refuses no size some family renders, and rounds a size it chooses (an image
# job's default) to the coarsest, a size every family renders. tests/test_plan.py holds both to
# the published architectures' own.
FINEST_SIZE_STEP = 16  # Flux: VAE 8 x its 2x2 patches
COARSEST_SIZE_STEP = 64  # SD 1.x and 2.x: VAE 8 x UNet 2**3 (SDXL's is 32: 2**2)
CAMPAIGN_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")

# Fields that change the pixels, so they make the job id.
PIXEL_FIELDS = (
    "model", "prompt", "negative_prompt", "seed", "steps", "guidance_scale",
    "width", "height", "scheduler", "dtype", "variant", "timestep_spacing", "karras", "base", "loras",
    "gate", "rerolls", "on_nsfw", "init_image_sha256", "strength", "mask_image_sha256",
)
# Pixel fields that enter the canonical JSON only when set, so ids made before they existed stay.
OPTIONAL_PIXEL_FIELDS = ("variant", "timestep_spacing", "karras", "base", "loras", "gate", "rerolls", "on_nsfw",
                         "init_image_sha256", "strength", "mask_image_sha256")
ON_NSFW = ("keep", "black", "drop")  # an image the safety checker flags: stored, stored black, not stored
MAX_REROLLS = 16
# A re-roll's seeds: attempt k renders with seed + k x REROLL_STRIDE (mod 2**32), not seed + k,
# which is the next image of the same row in a campaign with several images per prompt.
REROLL_STRIDE = 65_537
# A job without a guidance scale renders with its model family's own (diffusion/family.py) but
# hashes as 7.5, the contract's default before families had their own: the ids of jobs made
# then, and of campaigns resumed now, stay as they were.
ID_GUIDANCE = 7.5
MAX_LORAS = 16
# The strength of an image job that names none (diffusers' StableDiffusionImg2ImgPipeline's default).
DEFAULT_STRENGTH = 0.8
DEFAULT_INPAINT_STRENGTH = 1.0  # StableDiffusionInpaintPipeline's: the masked area from noise alone
SHA256_RE = re.compile(r"[0-9a-f]{64}")
# The canonical JSON a job id hashes: sorted keys, no spaces, UTF-8 as is. One encoder for
# all jobs (json.dumps with options builds one per call, a third of a job id's cost).
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """One image. `None` for guidance_scale, width, height, scheduler, timestep_spacing or
    karras means the model's own default (its family's guidance, as its diffusers pipeline's;
    its unet and scheduler configs)."""

    prompt: str
    model: str
    seed: int
    negative_prompt: str = ""
    steps: int = 25
    guidance_scale: float | None = None
    width: int | None = None
    height: int | None = None
    scheduler: str | None = None
    dtype: str = "float32"
    campaign: str = "local"
    priority: int | None = None
    variant: str | None = None  # which weights files of the model (diffusers' `variant`); None: the default
    timestep_spacing: str | None = None  # leading, trailing or linspace; None: the scheduler config's
    karras: bool | None = None  # Karras sigmas (lms, euler, dpm); None: the scheduler config's
    base: str | None = None  # a single-file model's pipeline (configs, tokenizers); None: its lineage's standard one
    loras: tuple[Lora, ...] | None = None  # merged into the weights at load, in this order
    scores: tuple[str, ...] | None = None  # of SCORES, in that order; they describe the pixels, not make them
    gate: str | None = None  # a filter on the scores (renderfarm/scores.py) the kept image should pass
    rerolls: int | None = None  # renders again, each with the next seed of its own, while the gate fails
    on_nsfw: str | None = None  # of ON_NSFW; None: keep (the image stored, its sidecar says nsfw)
    init_image: str | None = None  # image to image: a path or storage URL the workers can read
    init_image_sha256: str | None = None  # its content's digest, filled by the producer: the id follows the pixels
    strength: float | None = None  # with init_image: how much of the schedule runs, (0, 1]
    mask_image: str | None = None  # inpainting, with init_image: white repaints, black keeps
    mask_image_sha256: str | None = None  # its content's digest, filled by the producer

    @functools.cached_property
    def job_id(self) -> str:
        """Content-derived: the same pixels-defining spec always gives the same id. Cached
        (the spec is frozen): producers and workers ask for it several times per job."""
        fields = dict(zip(PIXEL_FIELDS, _pixel_values(self)))
        if fields["guidance_scale"] is None:
            fields["guidance_scale"] = ID_GUIDANCE
        for name in OPTIONAL_PIXEL_FIELDS:
            if fields[name] is None:
                del fields[name]
        if "loras" in fields:
            fields["loras"] = [list(lora) for lora in fields["loras"]]
        canonical = _CANONICAL.encode(fields)
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:32]

    def to_dict(self) -> dict[str, Any]:
        return dict(zip(FIELDS, _values(self)))

    @classmethod
    def _validated(cls, **fields: Any) -> JobSpec:
        """A spec from every field, already checked (parse_job): a frozen dataclass's
        __init__ sets each field through object.__setattr__, which costs 3x this."""
        spec = object.__new__(cls)
        spec.__dict__.update(fields)
        return spec


FIELDS = {f.name: f for f in dataclasses.fields(JobSpec)}
FIELD_NAMES = frozenset(FIELDS)
_values, _pixel_values = operator.attrgetter(*FIELDS), operator.attrgetter(*PIXEL_FIELDS)


def check_int(field: str, value: Any, lo: int, hi: int) -> int:
    """An integer in lo..hi, or the JobError that says so (job fields and campaign keys alike)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise JobError(field, value, f"must be an integer in {lo}..{hi}")
    if not lo <= value <= hi:
        raise JobError(field, value, f"must be in {lo}..{hi}")
    return value


def check_text(field: str, value: Any, limit: int) -> str:
    """A string of at most `limit` characters that is valid Unicode: a lone surrogate
    (`"\\ud800"` in JSON) has no UTF-8 form, so it could not be hashed into a job id."""
    if not isinstance(value, str):
        raise JobError(field, value, "must be a string")
    if len(value) > limit:
        raise JobError(field, value, f"must be at most {limit} characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise JobError(field, value, f"must be valid Unicode (lone surrogate at {err.start})") from None
    return value


def check_number(field: str, value: Any, lo: float, hi: float) -> float:
    """A finite number in lo..hi. Integers are compared as integers: a 400-digit one has
    no float, and converting it first would raise OverflowError instead of this error."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise JobError(field, value, f"must be a number in {lo:g}..{hi:g}")
    if isinstance(value, float) and not math.isfinite(value):
        raise JobError(field, value, f"must be finite and in {lo:g}..{hi:g}")
    if not lo <= value <= hi:
        raise JobError(field, value, f"must be finite and in {lo:g}..{hi:g}")
    return float(value)


def check_campaign(value: Any) -> str:
    """Campaign names become folder names, so they may not carry paths or dot-dirs."""
    rule = "must match [A-Za-z0-9._-]{1,128} and not be '.' or '..'"
    if not isinstance(value, str) or not CAMPAIGN_RE.fullmatch(value) or value in (".", ".."):
        raise JobError("campaign", value, rule)
    return value


def parse_lora(value: Any) -> Lora:
    """A LoRA as a job names it: "REF[:SCALE]" (scale 1 when absent; a tail that is not a
    number belongs to the reference, as in gs://...) or [REF, SCALE]."""
    if isinstance(value, (list, tuple)) and len(value) == 2:
        ref, scale = value
    elif isinstance(value, str):
        ref, _, tail = value.rpartition(":")
        try:
            scale = float(tail)
        except ValueError:
            ref, scale = value, 1.0
        if not ref:
            ref, scale = value, 1.0
    else:
        raise JobError("loras", value, 'each must be "REF[:SCALE]" or [REF, SCALE]')
    check_text("loras", ref, MAX_MODEL_CHARS)
    if not ref.strip():
        raise JobError("loras", value, "a LoRA reference must not be empty")
    return ref, check_number("loras", scale, -10, 10)


def parse_loras(value: Any) -> tuple[Lora, ...] | None:
    """A job's (or a command line's) LoRA list; None or empty: none."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or len(value) > MAX_LORAS:
        raise JobError("loras", value, f"must be a list of at most {MAX_LORAS} LoRAs")
    return tuple(parse_lora(lora) for lora in value) or None


def loras_key(loras: tuple[Lora, ...] | None) -> str | None:
    """A short name for a LoRA set (queue names): the digest of its canonical JSON."""
    if not loras:
        return None
    return hashlib.sha256(_CANONICAL.encode([list(lora) for lora in loras]).encode()).hexdigest()[:12]


def sampler_label(scheduler: str | None, timestep_spacing: str | None, karras: bool | None) -> str:
    """How listings name a sampler: `euler_a trailing`, `dpm karras`, `default scheduler`."""
    parts = [scheduler or "default scheduler", timestep_spacing or ""]
    parts.append({True: "karras", False: "no-karras", None: ""}[karras])
    return " ".join(filter(None, parts))


def _size(field: str, value: Any, size_step: int | None) -> int | None:
    if value is None:
        return None
    check_int(field, value, 64, 2048)
    step, whose = (FINEST_SIZE_STEP, "the finest size step of any model family") if size_step is None else \
        (size_step, "the model's size step")
    if value % step:
        raise JobError(field, value, f"must be a multiple of {step} ({whose})")
    return value


def check_scores(value: Any, field: str = "scores") -> tuple[str, ...]:
    """A job's or a campaign's scores: names from SCORES, each once, in SCORES' order."""
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise JobError(field, value, f"must be a list of score names from {', '.join(SCORES)}")
    unknown = [n for n in names if n not in SCORES]
    if unknown:
        raise JobError(field, unknown[0], f"is not a score; the scores are {', '.join(SCORES)}")
    return tuple(n for n in SCORES if n in names)


def _one_of(field: str, value: Any, names: tuple[str, ...], optional: bool = False) -> Any:
    # `in` on a tuple compares with ==, which any JSON value supports (a list is never equal).
    if (value is None and optional) or (isinstance(value, str) and value in names):
        return value
    raise JobError(field, value, f"must be one of {', '.join(names)}")


def parse_job(data: Mapping[str, Any], *, size_step: int | None = None) -> JobSpec:
    """Validate a job given as a mapping (a JSONL line, CLI flags, a queue message). Its width
    and height are held to `size_step`, the model's, where the caller knows the model (a worker,
    `renderfarm render`); else (a producer) to the finest step of any family."""
    if not isinstance(data, Mapping):
        raise JobError("job", data, "must be a JSON object")
    if not FIELD_NAMES.issuperset(data):
        unknown = sorted(set(data) - FIELD_NAMES)
        raise JobError(unknown[0], data[unknown[0]], f"unknown field (known: {', '.join(FIELDS)})")
    for required in ("prompt", "model", "seed"):
        if data.get(required) is None:
            raise JobError(required, None, "is required")

    prompt = check_text("prompt", data["prompt"], MAX_PROMPT_CHARS)
    if not prompt.strip():
        raise JobError("prompt", prompt, "must not be empty")
    negative = check_text("negative_prompt", data.get("negative_prompt", ""), MAX_PROMPT_CHARS)
    model = check_text("model", data["model"], MAX_MODEL_CHARS)
    if not model.strip():
        raise JobError("model", model, "must not be empty")
    guidance = data.get("guidance_scale")
    if guidance is not None:
        guidance = check_number("guidance_scale", guidance, 0, 50)
    scheduler = _one_of("scheduler", data.get("scheduler"), SCHEDULERS, optional=True)
    dtype = _one_of("dtype", data.get("dtype", "float32"), DTYPES)
    priority = data.get("priority")
    if priority is not None:
        check_int("priority", priority, 0, 9)
    variant = data.get("variant")
    if variant is not None:
        check_variant(variant)
    spacing = _one_of("timestep_spacing", data.get("timestep_spacing"), SPACINGS, optional=True)
    karras = data.get("karras")
    if karras is not None and not isinstance(karras, bool):
        raise JobError("karras", karras, "must be true or false")
    if scheduler is not None:
        check_sampler(scheduler, spacing, karras)
    base = data.get("base")
    if base is not None and not check_text("base", base, MAX_MODEL_CHARS).strip():
        raise JobError("base", base, "must not be empty")
    loras = parse_loras(data.get("loras"))
    scores = check_scores(data["scores"]) if data.get("scores") is not None else None
    gate, rerolls = _gate(data.get("gate"), data.get("rerolls"), scores or ())
    on_nsfw = _one_of("on_nsfw", data.get("on_nsfw"), ON_NSFW, optional=True)
    if on_nsfw not in (None, "keep") and "safety" not in (scores or ()):
        raise JobError("on_nsfw", on_nsfw, "needs the safety score: ask for it in scores")
    steps = check_int("steps", data.get("steps", 25), 1, 500)
    init_image, digest, strength, mask, mask_digest = _image(data, steps, scheduler)

    return JobSpec._validated(
        prompt=prompt,
        model=model,
        seed=check_int("seed", data["seed"], 0, SEED_LIMIT - 1),
        negative_prompt=negative,
        steps=steps,
        guidance_scale=guidance,
        width=_size("width", data.get("width"), size_step),
        height=_size("height", data.get("height"), size_step),
        scheduler=scheduler,
        dtype=dtype,
        campaign=check_campaign(data.get("campaign", "local")),
        priority=priority,
        variant=variant,
        timestep_spacing=spacing,
        karras=karras,
        base=base,
        loras=loras,
        scores=scores or None,
        gate=gate,
        rerolls=rerolls,
        on_nsfw=None if on_nsfw == "keep" else on_nsfw,
        init_image=init_image,
        init_image_sha256=digest,
        strength=strength,
        mask_image=mask,
        mask_image_sha256=mask_digest,
    )


def image_start(steps: int, strength: float) -> int:
    """The loop index an image job's denoising starts at, as diffusers' `get_timesteps`:
    the last int(steps * strength) steps of the schedule run."""
    return steps - min(int(steps * strength), steps)


def job_strength(spec: JobSpec) -> float:
    """An image job's strength: its own, or its kind's default (inpainting 1.0, else 0.8)."""
    if spec.strength is not None:
        return spec.strength
    return DEFAULT_INPAINT_STRENGTH if spec.mask_image is not None else DEFAULT_STRENGTH


def _image(data: Mapping[str, Any], steps: int,
           scheduler: str | None) -> tuple[str | None, str | None, float | None, str | None, str | None]:
    """An image job's init image reference, its digest (when given), strength (default 0.8,
    1.0 with a mask), and its mask's reference and digest."""
    ref, strength, mask = data.get("init_image"), data.get("strength"), data.get("mask_image")
    if ref is None:
        for field in ("init_image_sha256", "strength", "mask_image", "mask_image_sha256"):
            if data.get(field) is not None:
                raise JobError(field, data[field], "needs an init_image")
        return None, None, None, None, None
    digest = _image_ref(data, "init_image")
    mask_digest = _image_ref(data, "mask_image") if mask is not None else None
    if mask is None and data.get("mask_image_sha256") is not None:
        raise JobError("mask_image_sha256", data["mask_image_sha256"], "needs a mask_image")
    if strength is None:
        strength = DEFAULT_STRENGTH if mask is None else DEFAULT_INPAINT_STRENGTH
    strength = check_number("strength", strength, 0, 1)
    if strength == 0:
        raise JobError("strength", strength, "must be in (0, 1]: above 0")
    if image_start(steps, strength) == steps:
        raise JobError("strength", strength, f"leaves no step of {steps}: int(steps * strength) must be at least 1")
    return ref, digest, float(strength), mask, mask_digest


def _image_ref(data: Mapping[str, Any], field: str) -> str | None:
    """An image field's reference checked (non-empty text); its `<field>_sha256`, if given."""
    ref, digest = data[field], data.get(f"{field}_sha256")
    if not check_text(field, ref, MAX_MODEL_CHARS).strip():
        raise JobError(field, ref, "must not be empty")
    if digest is not None and not (isinstance(digest, str) and SHA256_RE.fullmatch(digest)):
        raise JobError(f"{field}_sha256", digest, "must be 64 lowercase hex digits (the image's sha256)")
    return digest


def reroll_seed(seed: int, attempt: int) -> int:
    """The seed attempt `attempt` of a gated job renders with (attempt 0: the job's own)."""
    return (seed + attempt * REROLL_STRIDE) % SEED_LIMIT


def _gate(gate: Any, rerolls: Any, scores: tuple[str, ...]) -> tuple[str | None, int | None]:
    """A job's gate (it must ask for the scores the gate reads) and its re-rolls (with a gate)."""
    if rerolls is not None:
        check_int("rerolls", rerolls, 0, MAX_REROLLS)
        if gate is None:
            raise JobError("rerolls", rerolls, "needs a gate: the scores an image must pass to be kept")
    if gate is None:
        return None, None
    expression = Expression(gate, field="gate")
    unasked = [score for score in expression.needs if score not in scores]
    if unasked:
        raise JobError("gate", gate, f"reads {', '.join(unasked)}: ask for it in scores")
    return expression.text, rerolls or None
