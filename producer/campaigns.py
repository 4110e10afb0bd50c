"""Campaigns: a YAML spec names a prompt source and every job parameter; running it submits
the jobs whose results are not in storage yet, so a finished, crashed or cancelled campaign
is resumed by running it again.

Seeds derive from the spec, never from chance: row i (its position in the source, bad rows
included, so a bad row shifts no other row's seeds), image k gets
`base_seed + i * images_per_prompt + k`. The job id hashes the pixels-defining fields, so the
same spec gives the same jobs and the same object names every time. An image job's id hashes
its init image's bytes: a changed file is a new job. A list of strengths makes one job per
strength of each row's image k, all with its seed.

A run makes two streaming passes over the source (flat memory at any size): the first
validates every row, counts the jobs and collects the bad rows (with --strict, a bad row
stops the run here, before anything is enqueued); the second enqueues the good rows' jobs
that storage does not hold. docs/campaigns.md describes the format.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from producer.submit import Submission, enqueue_jobs
from producer.templates import MODES, check_templates, expand
from producer.window import Feeder, check_window
from renderfarm.images import IMAGE_SUFFIXES, check_init_image
from renderfarm.ingest import SourceReader, SourceRow, row_unit
from renderfarm.jobs import (
    COARSEST_SIZE_STEP,
    SEED_LIMIT,
    JobError,
    JobSpec,
    Lora,
    check_campaign,
    check_int,
    check_scores,
    parse_job,
    parse_loras,
    sampler_label,
)
from renderfarm.layout import sidecar_job_id
from renderfarm.settings import Settings
from renderfarm.storage import open_storage

SHOWN_BAD_ROWS = 10  # bad rows a run keeps to show; it always counts them all
JOB_FIELDS = ("negative_prompt", "steps", "guidance_scale", "width", "height", "scheduler", "timestep_spacing",
              "karras", "dtype", "variant", "base", "loras", "scores", "gate", "rerolls", "on_nsfw",
              "priority")
# A compiled program the jobs need: model, width, height, steps, sampler (sampler_label), guided
# (classifier-free guidance: scale > 1), image to image
NeededProgram = tuple[str, int | None, int | None, int, str, bool, bool]


class SpecError(JobError):
    """A bad campaign spec: the key, the value, the rule, and the spec file."""

    def __init__(self, err: JobError, spec_file: str | Path | None) -> None:
        super().__init__(err.field, err.value, err.rule, err.line)
        self.spec_file = spec_file
        if spec_file is not None:
            self.args = (f"{spec_file}: {self.args[0]}",)


@dataclasses.dataclass(frozen=True)
class CampaignSpec:
    """A validated campaign (construction validates, so `dataclasses.replace` does too).
    Paths are absolute once parsed; `to_dict` gives a mapping `parse_spec` takes back."""

    name: str
    model: str
    output: str  # storage URL root the farm's workers write to; resume looks there
    base_seed: int
    prompts: str | None = None  # a .txt, .csv, .parquet or .jsonl file ...
    prompt_column: str = "prompt"
    image_column: str = "init_image"  # a table's column of init images (paths relative to the file)
    templates: tuple[str, ...] = ()  # ... or dynamicprompts templates ...
    images: str | None = None  # ... or a folder or storage prefix of init images, each a row ...
    prompt: str | None = None  # ... with this prompt
    wildcards: str | None = None
    mode: str = "combinatorial"
    samples: int | None = None
    template_seed: int | None = None  # random mode's seed; default base_seed
    images_per_prompt: int = 1
    # Every job's own parameters, with the job contract's defaults.
    negative_prompt: str = JobSpec.negative_prompt
    steps: int = JobSpec.steps
    guidance_scale: float | None = JobSpec.guidance_scale
    width: int | None = JobSpec.width
    height: int | None = JobSpec.height
    scheduler: str | None = JobSpec.scheduler
    timestep_spacing: str | None = JobSpec.timestep_spacing
    karras: bool | None = JobSpec.karras
    dtype: str = JobSpec.dtype
    variant: str | None = JobSpec.variant
    base: str | None = JobSpec.base  # a single-file model's pipeline
    loras: tuple[Lora, ...] | None = JobSpec.loras  # "REF[:SCALE]" each in YAML
    scores: tuple[str, ...] | None = JobSpec.scores  # of safety, clip, aesthetic, phash (renderfarm/scores.py)
    gate: str | None = JobSpec.gate  # what a kept image's scores pass, e.g. "clip >= 28 and not nsfw"
    rerolls: int | None = JobSpec.rerolls  # renders again while the gate fails, at most this often
    on_nsfw: str | None = JobSpec.on_nsfw  # keep, black or drop an image the safety checker flags
    priority: int | None = JobSpec.priority
    strength: tuple[float, ...] | None = None  # image jobs: one job per strength of each image
    schedule: str | None = None  # cron expression, for `renderfarm schedule`
    window: int | None = None  # at most this many jobs queued or running (producer/window.py)

    def __post_init__(self) -> None:
        try:
            check_campaign(self.name)
        except JobError as err:
            raise JobError("name", self.name, err.rule) from None
        for key in ("model", "output"):
            if not isinstance(getattr(self, key), str) or not getattr(self, key).strip():
                raise JobError(key, getattr(self, key), "must be a non-empty string")
        check_int("base_seed", self.base_seed, 0, SEED_LIMIT - 1)
        check_int("images_per_prompt", self.images_per_prompt, 1, SEED_LIMIT)
        for strength in self.strength or (None,):  # every job parameter, by the job contract's rules
            parse_job({"prompt": "-", "model": self.model, "seed": self.base_seed, "campaign": self.name,
                       **self.job_defaults(), **({} if strength is None else
                                                 {"init_image": "-", "strength": strength})})
        self._check_source()
        if self.schedule is not None:
            _check_cron(self.schedule)
        if self.window is not None:
            check_window(self.window)

    def _check_source(self) -> None:
        if [self.prompts is not None, bool(self.templates), self.images is not None].count(True) != 1:
            raise JobError("prompts", self.prompts, "give exactly one source: `prompts: FILE`, "
                           "`template: TEXT`, `templates: [TEXT, ...]` or `images: FOLDER` with `prompt: TEXT`")
        for key in ("prompt_column", "image_column"):
            if not isinstance(getattr(self, key), str) or not getattr(self, key):
                raise JobError(key, getattr(self, key), "must be a non-empty string")
        if (self.prompt is None) != (self.images is None):
            raise JobError("prompt", self.prompt, "goes with `images: FOLDER` (one prompt for every image), "
                           "and an images source needs it")
        if self.prompts is not None or self.images is not None:
            for key in ("wildcards", "samples", "template_seed"):
                if getattr(self, key) is not None:
                    raise JobError(key, getattr(self, key), "applies to template sources only")
        if self.images is not None:
            if not isinstance(self.images, str) or ("://" not in self.images and not Path(self.images).is_dir()):
                raise JobError("images", self.images, "must be an existing folder or a gs:// prefix")
            parse_job({"prompt": self.prompt, "model": self.model, "seed": 0})
            return
        if self.prompts is not None:
            if not isinstance(self.prompts, str):
                raise JobError("prompts", self.prompts, "must be a file path")
            SourceReader(self.prompts, self.prompt_column)  # the file exists and has a known type
            return
        if not isinstance(self.templates, tuple) or not all(isinstance(t, str) and t.strip()
                                                             for t in self.templates):
            raise JobError("templates", self.templates, "must be a list of non-empty strings")
        if self.mode not in MODES:
            raise JobError("mode", self.mode, f"must be one of {', '.join(MODES)}")
        if self.samples is not None:
            check_int("samples", self.samples, 1, SEED_LIMIT)
        elif self.mode == "random":
            raise JobError("samples", None, "is required with mode random (prompts per template)")
        if self.template_seed is not None:
            check_int("template_seed", self.template_seed, 0, SEED_LIMIT - 1)
        if self.wildcards is not None and (not isinstance(self.wildcards, str) or not Path(self.wildcards).is_dir()):
            raise JobError("wildcards", self.wildcards, "must be an existing folder")
        check_templates(self.templates, Path(self.wildcards) if self.wildcards else None)

    def job_defaults(self) -> dict[str, Any]:
        """The job fields every row gets unless it sets its own."""
        return {f: getattr(self, f) for f in JOB_FIELDS if getattr(self, f) is not None}

    def to_dict(self) -> dict[str, Any]:
        """Every set key, paths absolute, templates as a list: `parse_spec` reads it back."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if getattr(self, f.name) is not None and getattr(self, f.name) != ()}
        if self.templates:
            out["templates"] = list(self.templates)
        if self.loras:
            out["loras"] = [list(lora) for lora in self.loras]
        if self.scores:
            out["scores"] = list(self.scores)
        if self.strength:
            out["strength"] = list(self.strength)
        return out

    @property
    def source(self) -> str:
        return self.prompts or self.images or "templates"


SPEC_KEYS = {f.name for f in dataclasses.fields(CampaignSpec)} | {"template"}


def _check_cron(expr: Any) -> None:
    from celery.schedules import crontab

    rule = "must be a cron expression 'MINUTE HOUR DAY-OF-MONTH MONTH DAY-OF-WEEK'"
    if not isinstance(expr, str) or len(expr.split()) != 5:
        raise JobError("schedule", expr, rule)
    minute, hour, day_of_month, month, day_of_week = expr.split()
    try:
        crontab(minute=minute, hour=hour, day_of_month=day_of_month, month_of_year=month,
                day_of_week=day_of_week)
    except ValueError as err:
        raise JobError("schedule", expr, f"{rule} ({err})") from None


def _strengths(value: Any) -> tuple[float, ...] | None:
    """`strength: 0.6` or `strength: [0.3, 0.5, 0.7]`, each once (the contract checks each value)."""
    if value is None:
        return None
    values = value if isinstance(value, list) else [value]
    if not values or len(set(map(repr, values))) != len(values):
        raise JobError("strength", value, "must be a strength or a list of distinct strengths")
    return tuple(values)


def _resolve(value: Any, base_dir: Path) -> Any:
    """A relative path in a spec is relative to the spec file's folder."""
    return str((base_dir / value).resolve()) if isinstance(value, str) else value


def parse_spec(mapping: Mapping[str, Any], base_dir: str | Path = ".",
               spec_file: str | Path | None = None) -> CampaignSpec:
    """Validate a spec given as a mapping (a parsed YAML file, a stored schedule)."""
    try:
        if not isinstance(mapping, Mapping):
            raise JobError("spec", mapping, "must be a mapping of keys to values")
        unknown = sorted(set(map(str, mapping)) - SPEC_KEYS)
        if unknown:
            raise JobError(unknown[0], mapping[unknown[0]], f"unknown key (known: {', '.join(sorted(SPEC_KEYS))})")
        for required in ("name", "model", "output", "base_seed"):
            if mapping.get(required) is None:
                raise JobError(required, None, "is required")
        values = dict(mapping)
        if "template" in values:
            if "templates" in values:
                raise JobError("template", values["template"], "give `template` or `templates`, not both")
            values["templates"] = [values.pop("template")]
        templates = values.get("templates", [])
        if not isinstance(templates, list):
            raise JobError("templates", templates, "must be a list of templates")
        values["templates"] = tuple(templates)
        values["loras"] = parse_loras(values.get("loras"))
        if values.get("scores") is not None:
            values["scores"] = check_scores(values["scores"]) or None
        values["strength"] = _strengths(values.get("strength"))
        base = Path(base_dir)
        for key in ("prompts", "wildcards"):
            values[key] = _resolve(values.get(key), base)
        if isinstance(values.get("images"), str) and "://" not in values["images"]:
            values["images"] = _resolve(values["images"], base)
        if isinstance(values["output"], str) and "://" not in values["output"]:
            values["output"] = _resolve(values["output"], base)
        return CampaignSpec(**values)
    except JobError as err:
        raise SpecError(err, spec_file) from None


def load_spec(path: str | Path) -> CampaignSpec:
    """Read and validate a campaign YAML file; relative paths in it resolve against its folder."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise JobError("spec", str(path), f"must be a readable UTF-8 file ({err})") from None
    try:
        mapping = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        raise SpecError(JobError("spec", str(path), f"must be valid YAML ({err})", line), None) from None
    return parse_spec(mapping, path.resolve().parent, spec_file=path)


# ----------------------------------------------------------------------------- rows and jobs


@dataclasses.dataclass(frozen=True)
class BadRow:
    """A source row that makes no job, where it is and why."""

    index: int  # 0-based position among the rows
    where: str  # "line 12", "row 12" (Parquet), "prompt 12" (templates)
    error: JobError

    def __str__(self) -> str:
        return f"{self.where}: {self.error}"


@dataclasses.dataclass
class Scan:
    """What the validating pass found: counts, the first bad rows, the shapes the jobs need."""

    rows: int = 0
    bad_rows: int = 0
    first_bad: list[BadRow] = dataclasses.field(default_factory=list)
    jobs: int = 0
    stored: int = 0  # jobs whose results are already in storage (when it was looked at)
    queued: int = 0  # jobs storage lacks that are open (a windowed campaign's queued or running)
    shapes: collections.Counter[NeededProgram] = dataclasses.field(default_factory=collections.Counter)
    ignored_columns: tuple[str, ...] = ()

    def bad(self, row: BadRow) -> None:
        self.bad_rows += 1
        if len(self.first_bad) < SHOWN_BAD_ROWS:
            self.first_bad.append(row)


def _source_rows(spec: CampaignSpec) -> tuple[str, Iterator[SourceRow], SourceReader | None]:
    if spec.prompts is not None:
        reader = SourceReader(spec.prompts, spec.prompt_column, spec.image_column)
        folder = Path(spec.prompts).parent
        return row_unit(spec.prompts), ((n, _located(fields, folder)) for n, fields in reader.rows()), reader
    if spec.images is not None:
        return "image", _image_rows(spec.images, spec.prompt or ""), None
    seed = spec.base_seed if spec.template_seed is None else spec.template_seed
    prompts = expand(spec.templates, Path(spec.wildcards) if spec.wildcards else None, spec.mode,
                     spec.samples, seed)
    return "prompt", ((n, {"prompt": p}) for n, p in enumerate(prompts, start=1)), None


def _located(fields: dict[str, Any] | JobError, folder: Path) -> dict[str, Any] | JobError:
    """A row's init image and mask paths, relative to its source file's folder (as the spec's
    paths are to the spec's)."""
    if isinstance(fields, JobError):
        return fields
    located = dict(fields)
    for field in ("init_image", "mask_image"):
        ref = fields.get(field)
        if isinstance(ref, str) and ref and "://" not in ref and not Path(ref).is_absolute():
            located[field] = str((folder / ref).resolve())
    return located


def _image_rows(prefix: str, prompt: str) -> Iterator[SourceRow]:
    """An images source: each image file under the folder or prefix (by name) is a row."""
    storage = open_storage(prefix, durable=False)
    names = (name for name in storage.list() if Path(name).suffix.lower() in IMAGE_SUFFIXES)
    for number, name in enumerate(names, start=1):
        yield number, {"prompt": prompt, "init_image": storage.url(name)}


def _row_jobs(fields: Mapping[str, Any], seed: int, strengths: tuple[float, ...] | None) -> list[JobSpec]:
    """A row's jobs for one seed: one per strength of the spec (a row's own strength wins). An
    init image is read once for them all: its digest joins each job's id."""
    variants = [{"strength": s} for s in strengths] if strengths and "strength" not in fields else [{}]
    jobs = [parse_job({**variant, **fields, "seed": seed}) for variant in variants]
    if jobs[0].init_image is None:
        return jobs
    sized = check_init_image(jobs[0], COARSEST_SIZE_STEP)
    return [dataclasses.replace(job, init_image_sha256=sized.init_image_sha256, width=sized.width,
                                height=sized.height, mask_image_sha256=sized.mask_image_sha256) for job in jobs]


def campaign_jobs(spec: CampaignSpec, on_bad: Callable[[BadRow], None] | None = None,
                  on_rows: Callable[[int, SourceReader | None], None] | None = None) -> Iterator[JobSpec]:
    """Every job of the campaign, in source order; a bad row goes to `on_bad` and is skipped.
    Raises if a seed would reach 2**32. `on_rows(rows, reader)` is called at the end."""
    unit, rows, reader = _source_rows(spec)
    defaults = {"model": spec.model, "campaign": spec.name, **spec.job_defaults()}
    per_row, base = spec.images_per_prompt, spec.base_seed
    index = -1
    for index, (number, fields) in enumerate(rows):
        first = base + index * per_row
        if first + per_row > SEED_LIMIT:
            raise JobError("base_seed", base, f"{unit} {number} (row {index}) would get seeds up to "
                           f"{first + per_row - 1}: seeds base_seed + row x images_per_prompt + image "
                           "must stay below 2**32; lower base_seed or split the source")
        if isinstance(fields, JobError):
            if on_bad is not None:
                on_bad(BadRow(index, f"{unit} {number}", fields))
            continue
        try:
            jobs = _row_jobs({**defaults, **fields}, first, spec.strength)
        except JobError as err:
            if on_bad is not None:
                on_bad(BadRow(index, f"{unit} {number}", err))
            continue
        for k in range(per_row):
            yield from (dataclasses.replace(job, seed=first + k) if k else job for job in jobs)
    if on_rows is not None:
        on_rows(index + 1, reader)


def stored_job_ids(spec: CampaignSpec) -> set[str]:
    """The ids of the campaign's jobs whose results are in storage: one listing of the
    campaign's folder. A sidecar is written after its image, so it marks a finished job."""
    storage = open_storage(spec.output, durable=False)
    return {job_id for name in storage.list(f"{spec.name}/") if (job_id := sidecar_job_id(spec.name, name))}


def scan_campaign(spec: CampaignSpec, stored: set[str] | None = None, open_ids: set[str] | None = None) -> Scan:
    """The validating pass: counts rows, bad rows and jobs (and which are in `stored`, or else
    in `open_ids`)."""
    scan = Scan()

    def finish(rows: int, reader: SourceReader | None) -> None:
        scan.rows = rows
        scan.ignored_columns = tuple(reader.ignored) if reader is not None else ()

    for job in campaign_jobs(spec, scan.bad, finish):
        scan.jobs += 1
        sampler = sampler_label(job.scheduler, job.timestep_spacing, job.karras)
        guided = job.guidance_scale is None or job.guidance_scale > 1  # every family's default guides
        scan.shapes[(job.model, job.width, job.height, job.steps, sampler, guided, job.init_image is not None)] += 1
        if stored and job.job_id in stored:
            scan.stored += 1
        elif open_ids and job.job_id in open_ids:
            scan.queued += 1
    return scan


class StrictError(JobError):
    """--strict and the source has bad rows: nothing was enqueued."""

    def __init__(self, spec: CampaignSpec, scan: Scan) -> None:
        super().__init__("prompts", spec.source, f"has {scan.bad_rows} bad rows (first: {scan.first_bad[0]}); "
                         "--strict enqueues nothing")
        self.scan = scan


@dataclasses.dataclass(frozen=True)
class CampaignRun:
    """What one run of a campaign found and did."""

    campaign: str
    rows: int
    bad_rows: int
    first_bad: tuple[BadRow, ...]
    jobs: int  # of the good rows, images_per_prompt each
    already_done: int  # in storage before this run
    submission: Submission | None  # None: nothing to do
    seconds: float
    queued: int = 0  # a windowed run: jobs an earlier run queued, left to the workers

    @property
    def submitted(self) -> int:
        return self.submission.enqueued if self.submission is not None else 0

    def summary(self) -> str:
        lines = [f"campaign {self.campaign}: {self.rows} rows, {self.jobs} jobs"
                 + (f", {self.bad_rows} bad rows skipped" if self.bad_rows else "")]
        lines += [f"  bad {row}" for row in self.first_bad]
        if self.bad_rows > len(self.first_bad):
            lines.append(f"  ... and {self.bad_rows - len(self.first_bad)} more bad rows "
                         "(`renderfarm campaign validate` lists the first ones; fix them and run again)")
        if self.submission is None:
            lines.append(f"nothing to do: all {self.jobs} jobs already in storage")
            return "\n".join(lines)
        if self.already_done:
            lines.append(f"{self.already_done} jobs already in storage, not submitted again")
        lines.append(self.submission.summary())
        return "\n".join(lines)


def run_campaign(spec: CampaignSpec, *, settings: Settings | None = None, strict: bool = False,
                 progress: bool = False) -> CampaignRun:
    """Submit the campaign's jobs that storage does not hold yet (with a window, those not
    queued either, fed as the window allows: producer/window.py). Raises StrictError (with
    `strict`) or JobError (no good row, a seed past 2**32) before enqueuing anything; lifts
    a cancel of the campaign when it submits (see Progress.resume)."""
    started = time.perf_counter()
    if spec.window is not None:
        return _run_windowed(spec, settings, strict, progress, started)
    stored = stored_job_ids(spec)
    scan = _checked_scan(spec, stored, strict)
    submission = None
    if scan.stored < scan.jobs:
        todo = (job for job in campaign_jobs(spec) if job.job_id not in stored) if stored else campaign_jobs(spec)
        submission = enqueue_jobs(todo, settings, started=started)
    return CampaignRun(spec.name, scan.rows, scan.bad_rows, tuple(scan.first_bad), scan.jobs, scan.stored,
                       submission, time.perf_counter() - started)


def _run_windowed(spec: CampaignSpec, settings: Settings | None, strict: bool, progress: bool,
                  started: float) -> CampaignRun:
    assert spec.window is not None
    with Feeder(spec.name, spec.window, settings) as feeder:  # before the listing: see Feeder
        stored = stored_job_ids(spec)
        # Only the spec's own open jobs are queued for it: ids of rows edited out since are not.
        scan = _checked_scan(spec, stored, strict, feeder.queued)
        skip, todo = stored | feeder.queued, scan.jobs - scan.stored - scan.queued
        submission = None
        if todo or scan.queued:
            submission = feeder.feed((job for job in campaign_jobs(spec) if job.job_id not in skip), todo,
                                     scan.queued, started, progress)
        elif feeder.counted:  # every job stored: an earlier run may have died before it marked it fed
            feeder.fed()
    return CampaignRun(spec.name, scan.rows, scan.bad_rows, tuple(scan.first_bad), scan.jobs, scan.stored,
                       submission, time.perf_counter() - started, scan.queued)


def _checked_scan(spec: CampaignSpec, stored: set[str], strict: bool, open_ids: set[str] | None = None) -> Scan:
    scan = scan_campaign(spec, stored, open_ids)
    if strict and scan.bad_rows:
        raise StrictError(spec, scan)
    if not scan.jobs:
        first = f" (first bad: {scan.first_bad[0]})" if scan.first_bad else ""
        raise JobError("prompts", spec.source, f"gives no valid job: {scan.bad_rows} bad rows of {scan.rows}{first}")
    return scan
