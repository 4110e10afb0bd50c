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

SCHEDULERS = ("pndm", "ddim", "lms", "euler", "dpm")
DTYPES = ("float32", "bfloat16")
SEED_LIMIT = 2**32
MAX_PROMPT_CHARS = 10_000  # far beyond 77 tokens; stops megabyte prompts at the door
SIZE_STEP = 64  # VAE factor x UNet downsampling of SD 1.x, 2.x and XL
CAMPAIGN_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")

# Fields that change the pixels, so they make the job id.
PIXEL_FIELDS = (
    "model", "prompt", "negative_prompt", "seed", "steps", "guidance_scale",
    "width", "height", "scheduler", "dtype",
)
# The canonical JSON a job id hashes: sorted keys, no spaces, UTF-8 as is. One encoder for
# all jobs (json.dumps with options builds one per call, a third of a job id's cost).
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)


class JobError(ValueError):
    """A job field that breaks its rule; says which field, which value and which rule."""

    def __init__(self, field: str, value: Any, rule: str, line: int | None = None) -> None:
        self.field, self.value, self.rule, self.line = field, value, rule, line
        shown = repr(value)
        if len(shown) > 160:
            shown = f"{shown[:80]}... ({len(shown)} chars)"
        where = f"line {line}: " if line is not None else ""
        super().__init__(f"{where}{field}={shown}: {rule}")

    def at_line(self, line: int) -> JobError:
        return JobError(self.field, self.value, self.rule, line)


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """One image. `None` for width, height or scheduler means the model's own default."""

    prompt: str
    model: str
    seed: int
    negative_prompt: str = ""
    steps: int = 25
    guidance_scale: float = 7.5
    width: int | None = None
    height: int | None = None
    scheduler: str | None = None
    dtype: str = "float32"
    campaign: str = "local"
    priority: int | None = None

    @functools.cached_property
    def job_id(self) -> str:
        """Content-derived: the same pixels-defining spec always gives the same id. Cached
        (the spec is frozen): producers and workers ask for it several times per job."""
        canonical = _CANONICAL.encode(dict(zip(PIXEL_FIELDS, _pixel_values(self))))
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


def _str(field: str, value: Any) -> str:
    if not isinstance(value, str):
        raise JobError(field, value, "must be a string")
    return value


def check_campaign(value: Any) -> str:
    """Campaign names become folder names, so they may not carry paths or dot-dirs."""
    rule = "must match [A-Za-z0-9._-]{1,128} and not be '.' or '..'"
    if not isinstance(value, str) or not CAMPAIGN_RE.fullmatch(value) or value in (".", ".."):
        raise JobError("campaign", value, rule)
    return value


def _size(field: str, value: Any, size_step: int) -> int | None:
    if value is None:
        return None
    check_int(field, value, 64, 2048)
    if value % size_step:
        raise JobError(field, value, f"must be a multiple of {size_step} (the model's size step)")
    return value


def parse_job(data: Mapping[str, Any], *, size_step: int = SIZE_STEP) -> JobSpec:
    """Validate a job given as a mapping (a JSONL line, CLI flags, a queue message)."""
    if not isinstance(data, Mapping):
        raise JobError("job", data, "must be a JSON object")
    if not FIELD_NAMES.issuperset(data):
        unknown = sorted(set(data) - FIELD_NAMES)
        raise JobError(unknown[0], data[unknown[0]], f"unknown field (known: {', '.join(FIELDS)})")
    for required in ("prompt", "model", "seed"):
        if data.get(required) is None:
            raise JobError(required, None, "is required")

    prompt = _str("prompt", data["prompt"])
    if not prompt.strip():
        raise JobError("prompt", prompt, "must not be empty")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise JobError("prompt", prompt, f"must be at most {MAX_PROMPT_CHARS} characters")
    negative = _str("negative_prompt", data.get("negative_prompt", ""))
    if len(negative) > MAX_PROMPT_CHARS:
        raise JobError("negative_prompt", negative, f"must be at most {MAX_PROMPT_CHARS} characters")
    model = _str("model", data["model"])
    if not model.strip():
        raise JobError("model", model, "must not be empty")

    guidance = data.get("guidance_scale", 7.5)
    if isinstance(guidance, bool) or not isinstance(guidance, (int, float)):
        raise JobError("guidance_scale", guidance, "must be a number in 0..50")
    if not math.isfinite(guidance) or not 0 <= guidance <= 50:
        raise JobError("guidance_scale", guidance, "must be finite and in 0..50")

    scheduler = data.get("scheduler")
    if scheduler is not None and scheduler not in SCHEDULERS:
        raise JobError("scheduler", scheduler, f"must be one of {', '.join(SCHEDULERS)}")
    dtype = data.get("dtype", "float32")
    if dtype not in DTYPES:
        raise JobError("dtype", dtype, f"must be one of {', '.join(DTYPES)}")
    priority = data.get("priority")
    if priority is not None:
        check_int("priority", priority, 0, 9)

    return JobSpec._validated(
        prompt=prompt,
        model=model,
        seed=check_int("seed", data["seed"], 0, SEED_LIMIT - 1),
        negative_prompt=negative,
        steps=check_int("steps", data.get("steps", 25), 1, 500),
        guidance_scale=float(guidance),
        width=_size("width", data.get("width"), size_step),
        height=_size("height", data.get("height"), size_step),
        scheduler=scheduler,
        dtype=dtype,
        campaign=check_campaign(data.get("campaign", "local")),
        priority=priority,
    )
