"""The engine: one loaded model, its parameters on every local device, the text encoders'
compiled program (one per guidance kind) and one compiled program per shape key, which takes
what the text encoders return. Host-side only: it tokenizes, makes seeds into keys, pads
batches and calls the programs `diffusion.placement` lowers.

Where the weights live and what program a shape compiles to is the model's placement
(diffusion/placement.py, decided when it was loaded): whole copies of the weights and a
per-device program under `shard_map` (docs/performance.md, "Choices not benchmarked here",
says why not pmap or jit's automatic partitioning), or weights split over a model axis and one program
partitioned over the (data, model) mesh. Batches go over the data axis either way.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax.errors import FlaxError

from diffusion.flops import denoise_flops, program_flops
from diffusion.generate import ImageInputs, Output, Static, text_inputs
from diffusion.models import LoadedModel
from diffusion.placement import by_program, encoded_shapes, lower_encode, lower_generate, make_placement
from diffusion.schedulers import Scheduler, make
from diffusion.scores import Scorers, score_batch
from renderfarm.images import check_init_image
from renderfarm.jobs import (
    JobError,
    JobSpec,
    check_sampler,
    image_start,
    job_strength,
    reroll_seed,
    sampler_label,
)
from renderfarm.scores import Expression
from worker.executables import ExecutableStore, evict, fingerprint, private_folder
from worker.sources import InitImages


@dataclasses.dataclass(frozen=True)
class ShapeKey:
    """Jobs that share this share a compiled program (the model is the engine's own)."""

    width: int
    height: int
    steps: int
    scheduler: str
    guided: bool = True  # classifier-free guidance (scale > 1, its family's kind); else one denoiser call a step
    timestep_spacing: str | None = None  # the job's; None: the model's scheduler config
    karras: bool | None = None  # the job's; None: the model's scheduler config
    image: bool = False  # image to image (any strength: the start step is an input)
    mask: bool = False  # inpainting (with image)

    def __str__(self) -> str:
        sampler = sampler_label(self.scheduler, self.timestep_spacing, self.karras)
        kind = " inpaint" if self.mask else " img2img" if self.image else ""
        return f"{self.width}x{self.height}@{self.steps} {sampler}{'' if self.guided else ' cfg-free'}{kind}"


@dataclasses.dataclass(frozen=True)
class Batch:
    """The batch a job was rendered in (docs/design.md, "Batching and compilation"), as its
    sidecar records it (and for measuring how full batches run)."""

    seq: int  # this engine's batch counter
    jobs: int  # real jobs in it
    slots: int  # the compiled batch size (jobs + padding)
    seconds: float  # from its start to its collection
    device_seconds: float = 0.0  # the devices' time it took: its share of their busy time x devices

    @property
    def device_seconds_per_job(self) -> float:
        """What one of its jobs cost in device time (padding is paid by the real jobs)."""
        return self.device_seconds / self.jobs


@dataclasses.dataclass
class Rendered:
    """One finished job: its pixels and what the sidecar must say about how they were made."""

    index: int  # position in the list given to the engine
    spec: JobSpec
    image: np.ndarray  # (H, W, 3) uint8
    key: ShapeKey
    truncated: bool
    batch: Batch
    scanlines: np.ndarray | None = None  # its PNG scanlines, filtered by the devices (diffusion.generate)
    scores: dict[str, Any] = dataclasses.field(default_factory=dict)  # the device's scores it asked for
    unscored: dict[str, str] = dataclasses.field(default_factory=dict)  # score -> why it is missing
    # a gated job's attempts (seed, scores, passed), and which one these pixels are
    attempts: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    kept: int = 0


@functools.cache
def _gate(text: str) -> Expression:
    return Expression(text, field="gate")


def _attempt(result: Rendered, seed: int) -> dict[str, Any]:
    """One attempt of a gated job, as its sidecar lists it: its seed, scores and whether they
    passed. `failed` (dropped from the sidecar): they did not, and not for a missing score,
    which no re-roll would bring."""
    verdict = _gate(result.spec.gate)(result.scores)
    return {"seed": seed, "scores": result.scores, "passed": verdict is True, "failed": verdict is False}


def enable_compilation_cache(folder: str | os.PathLike | None = None, max_bytes: float = 10 * 2**30) -> Path:
    """Turn on JAX's persistent cache, small programs included, so a second process starts
    warm; cut to `max_bytes` here, least recently used entries first. The folder holds
    executable code: it must be private to this user (worker.executables.private_folder).

    Not JAX's own cap: with one, every read takes a file lock and writes a timestamp, and every
    write lists and stats the whole folder, which holds a file per program, down to each
    eager operation's; a process writes its own programs once, so a cut when it starts keeps
    the folder within the cap but for what one process adds."""
    path = private_folder(folder or Path.home() / ".cache" / "renderfarm" / "jax")
    evict(path, "*-cache", max_bytes, "compile cache entry")
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_compilation_cache_max_size", -1)
    return path


def _weights_mismatch(params: Any, expected: Any) -> str | None:
    """The first parameter whose shape or dtype differs from what a program takes, if any."""
    def table(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
        return {jax.tree_util.keystr(path): (tuple(leaf.shape), str(leaf.dtype))
                for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}

    have, want = table(params), table(expected)
    for path in sorted(have.keys() | want.keys()):
        if have.get(path) != want.get(path):
            return f"parameter {path} is {have.get(path)}, the program takes {want.get(path)}"
    return None


log = logging.getLogger(__name__)
# Programs kept per engine, unless --max-programs says otherwise. A kept executable holds its
# code on the device, not its working memory (XLA allocates that per run): the code of the
# kept programs may take PROGRAM_SHARE of a device's memory, within these bounds; where the
# backend reports no memory limit (CPU), DEFAULT_MAX_PROGRAMS.
DEFAULT_MAX_PROGRAMS, MAX_PROGRAMS_BOUNDS, PROGRAM_SHARE = 16, (2, 64), 0.05
CACHE_HIT = "/jax/compilation_cache/cache_hits"
# The scorers' program, jitted once a process: engines of the same scoring models share what it traced and compiled.
_score_batch = jax.jit(score_batch, static_argnums=0)
DEVICE_SCORES = ("safety", "clip", "aesthetic")  # scored on the devices; phash is the host's (worker/output.py)
JAX_EVENTS: collections.Counter[str] = collections.Counter()


@functools.cache
def _count_jax_events() -> None:
    """Count JAX's monitoring events (persistent-cache hits among them) in this process."""
    jax.monitoring.register_event_listener(lambda event, **_: JAX_EVENTS.update([event]))


@dataclasses.dataclass
class InFlight:
    """A batch started on the devices and not collected yet."""

    specs: list[JobSpec]
    indices: list[int]  # positions in the list the batch was cut from
    key: ShapeKey
    output: Output  # of jax.Arrays still computing (or a benchmark's stand-in for them)
    truncated: list[bool]
    started: float
    seq: int
    scores: Any = None  # the scorers' outputs (jax.Arrays still computing), if any job asked

    def ready(self) -> bool:
        is_ready = getattr(self.output.images, "is_ready", None)
        return is_ready is None or is_ready()



def shape_key(model: LoadedModel, spec: JobSpec) -> ShapeKey:
    """The rules a job meets on `model` (its family's schedulers, image jobs, inpainting), and
    the program it renders in; the worker's and `renderfarm plan`'s, which has shapes in place
    of weights."""
    native = model.native_size
    scheduler = spec.scheduler or model.default_scheduler
    family = model.family
    if scheduler not in family.schedulers:
        raise JobError("scheduler", scheduler, f"a {family.name} model runs {', '.join(family.schedulers)}")
    check_sampler(scheduler, spec.timestep_spacing, spec.karras)
    width, height = spec.width or native, spec.height or native
    if model.inpainting_unet and spec.mask_image is None:
        raise JobError("mask_image", None, "this model's UNet inpaints (it takes a mask and a masked image): "
                                           "its jobs need an init_image and a mask_image")
    if spec.mask_image is not None and not family.inpainting:
        raise JobError("mask_image", spec.mask_image, f"a {family.name} model cannot inpaint")
    if spec.init_image is not None:
        if not family.image_to_image:
            raise JobError("init_image", spec.init_image, f"a {family.name} model renders text to image only")
        if spec.width is None or spec.height is None:  # the image's own size, as the producer fills it
            sized = check_init_image(spec, model.size_step)
            width, height = sized.width, sized.height
    return ShapeKey(width, height, spec.steps, scheduler,
                    guided=family.classifier_free and model.guidance_scale(spec.guidance_scale) > 1,
                    timestep_spacing=spec.timestep_spacing, karras=spec.karras, image=spec.init_image is not None,
                    mask=spec.mask_image is not None)

class Engine:
    """Renders lists of job specs on all local devices, in job order."""

    def __init__(self, model: LoadedModel, per_device_batch: int = 1,
                 devices: Sequence[jax.Device] | None = None,
                 executables: ExecutableStore | None = None, max_programs: int | None = None,
                 scorers: Scorers | None = None, init_images: InitImages | None = None) -> None:
        if per_device_batch < 1:
            raise JobError("per_device_batch", per_device_batch, "must be at least 1")
        if max_programs is not None and max_programs < 1:
            raise JobError("max_programs", max_programs, "must be at least 1")
        self.model = model
        # The placement the model was loaded with, unless the engine is given other devices.
        self.placement = model.placement if devices is None and model.placement is not None else \
            make_placement(list(devices or jax.local_devices()), model.model_parallel)
        self.devices = self.placement.devices
        self.batch_size = self.placement.batch_size(per_device_batch)
        self._sharded = self.placement.batch
        # The loader's placement laid the weights out (packed ones interleaved) for this split.
        self._params = jax.device_put(model.params, self.placement.weight_shardings(model.family, model.params))
        self._weights = by_program(model.family, self._params)  # (the text encoders', the rest)
        self._schedulers: dict[tuple[str, str | None, bool | None], Scheduler] = {}
        # Image jobs' sources, read ahead of their batches; a farm worker's reads only its source roots.
        self.init_images = init_images or InitImages()
        # Compiled programs, least recently used first; at most max_programs are kept.
        self._compiled: collections.OrderedDict[ShapeKey, Any] = collections.OrderedDict()
        self._encoders: dict[bool, Any] = {}  # the text encoders' program, by guidance kind: kept
        self._encoder_flops: dict[bool, float | None] = {}
        self._lock = threading.Lock()  # programs compile on a thread of their own (worker.processing)
        self.max_programs = max_programs  # None: sized for device memory by the first program
        self.executables = executables
        self._batches = itertools.count()
        self._last_collected = 0.0  # when the devices last finished a batch (perf_counter)
        self._flops: dict[ShapeKey, float | None] = {}
        self._peak_bytes: dict[ShapeKey, int | None] = {}  # after each shape's first batch (peak_memory)
        self.compile_seconds = 0.0
        self.compiles = 0  # programs compiled (not loaded from saved executables)
        self.cache_hits = 0  # programs found in the persistent compilation cache
        # Scoring models on every device, run on each batch's images where they are (no host round trip).
        self.scorers = scorers
        if scorers is not None and scorers.params:
            self._score_params = jax.device_put(scorers.params, self.placement.replicated)
        _count_jax_events()

    # -- validation and grouping -------------------------------------------------------

    def check(self, spec: JobSpec) -> ShapeKey:
        """The worker-side rules that need the model (the size step is parse_job's, given the
        model's `size_step`); returns the job's shape key."""
        if spec.model != self.model.ref:
            raise JobError("model", spec.model, f"this engine serves {self.model.ref!r}")
        if spec.dtype != self.model.dtype:
            raise JobError("dtype", spec.dtype, f"this engine runs {self.model.dtype}")
        if spec.variant != self.model.variant:
            raise JobError("variant", spec.variant, f"this engine serves the weights variant {self.model.variant!r}")
        if spec.base != self.model.base:
            raise JobError("base", spec.base, f"this engine serves the base {self.model.base!r}")
        if spec.loras != self.model.loras:
            raise JobError("loras", spec.loras, f"this engine serves the LoRA set {self.model.loras!r}")
        return shape_key(self.model, spec)

    def plan(self, specs: Sequence[JobSpec]) -> list[tuple[ShapeKey, list[int]]]:
        """Group job indices by shape key (first-seen order) and cut them into batches."""
        groups: dict[ShapeKey, list[int]] = {}
        for i, spec in enumerate(specs):
            groups.setdefault(self.check(spec), []).append(i)
        return [(key, idx[s:s + self.batch_size])
                for key, idx in groups.items() for s in range(0, len(idx), self.batch_size)]

    # -- compilation -----------------------------------------------------------------

    def scheduler(self, key: ShapeKey) -> Scheduler:
        """The scheduler of `key`: made from the model's scheduler config (diffusers'
        from_config) with the job's sampler fields over it."""
        sampler = (key.scheduler, key.timestep_spacing, key.karras)
        if sampler not in self._schedulers:
            try:
                self._schedulers[sampler] = make(key.scheduler, self.model.configs["scheduler"], key.timestep_spacing, key.karras)
            except ValueError as err:
                raise JobError("scheduler", sampler_label(*sampler),
                               f"cannot run with this model's scheduler config: {err}") from None
        return self._schedulers[sampler]

    def ready(self, key: ShapeKey) -> bool:
        """Whether the programs of `key` are compiled (rendering it will not compile)."""
        return key in self._compiled and key.guided in self._encoders

    def encoder(self, guided: bool) -> Any:
        """The text encoders' program for batches of this guidance kind, every shape's: a saved
        one, or compiled now; kept."""
        with self._lock:
            if guided in self._encoders:
                return self._encoders[guided]
        weights, inputs = self._weights[0], text_inputs(self.model.abstract_inputs(self.batch_size, self._sharded))
        name = self._program_name(("encode", guided)) if self.executables is not None else None
        program, flops = self._load_or_compile(
            f"text encoders{'' if guided else ' cfg-free'}", name, weights,
            lambda: lower_encode(self.model.family, self.model.networks, guided, self.placement, weights, inputs),
            self._program_flops)
        with self._lock:
            self._encoders[guided], self._encoder_flops[guided] = program, flops
        return program

    def compiled(self, key: ShapeKey) -> Any:
        """The executable for a shape key, its text encoders' (`encoder`) made first: a kept
        one, a saved one (worker.executables), or compiled now (XLA's part maybe from JAX's
        persistent cache). Keeping one evicts the least recently used beyond `max_programs`."""
        self.encoder(key.guided)
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
        program = self._compile_generate(key)
        with self._lock:
            self.max_programs = self.max_programs or self._programs_that_fit(program)
            self._compiled[key] = program
            while len(self._compiled) > self.max_programs:
                evicted, _ = self._compiled.popitem(last=False)
                log.info("%s: program evicted (at most %d kept; --max-programs)", evicted, self.max_programs)
        return program

    def _programs_that_fit(self, program: Any) -> int:
        """How many programs like this one fit in PROGRAM_SHARE of a device's memory."""
        limit = (self.devices[0].memory_stats() or {}).get("bytes_limit")
        analysis = program.memory_analysis()
        code = getattr(analysis, "generated_code_size_in_bytes", 0) if analysis is not None else 0
        if not limit or not code:
            return DEFAULT_MAX_PROGRAMS
        low, high = MAX_PROGRAMS_BOUNDS
        return max(low, min(high, int(PROGRAM_SHARE * limit // code)))

    def _compile_generate(self, key: ShapeKey) -> Any:
        family, networks, text, weights = self.model.family, self.model.networks, *self._weights
        inputs = self.model.abstract_inputs(self.batch_size, self._sharded, (key.height, key.width) if key.image else None,
                                            key.mask)

        def lower() -> jax.stages.Lowered:
            encoded = encoded_shapes(family, networks, key.guided, self.placement, text, text_inputs(inputs))
            return lower_generate(family, networks, self.scheduler(key),
                                  Static(key.height, key.width, key.steps, key.guided, key.image, key.mask),
                                  self.placement, weights, inputs, encoded)

        name = self._program_name(key) if self.executables is not None else None
        program, self._flops[key] = self._load_or_compile(str(key), name, weights, lower,
                                                          lambda compiled: self._count_flops(key, compiled))
        return program

    def _load_or_compile(self, label: str, name: str | None, weights: Any, lower: Callable[[], jax.stages.Lowered],
                         count_flops: Callable[[Any], float | None]) -> tuple[Any, float | None]:
        """A program taking `weights` first, and its FLOPs: the saved executable `name`, or
        `lower()` compiled now (and saved)."""
        if name is not None:
            saved = self.executables.load(name, self.devices)
            mismatch = None if saved is None else _weights_mismatch(weights, saved[0].args_info[0][0])
            if mismatch:
                log.warning("%s: saved executable not used: %s", label, mismatch)
            elif saved is not None:
                log.info("%s: saved executable loaded", label)
                return saved[0], saved[1]["flops"]
        start, hits = time.perf_counter(), JAX_EVENTS[CACHE_HIT]
        try:
            lowered = lower()
        except FlaxError as err:  # weights put together by hand, not by the loader, which checks them
            raise JobError("model", self.model.ref, f"weights do not match its config: {err}") from err
        program = lowered.compile()
        seconds = time.perf_counter() - start
        self.compile_seconds += seconds
        self.compiles += 1
        log.info("%s: compiled in %.1fs", label, seconds)
        from_cache = JAX_EVENTS[CACHE_HIT] - hits
        self.cache_hits += from_cache
        flops = count_flops(program)
        # Only fresh compiles are saved: a program that XLA's CPU backend took from JAX's
        # persistent cache serializes without its code (measured: "Function ... not
        # found" when the copy runs).
        if name is not None and not from_cache:
            self.executables.save(name, program, {"flops": flops})
        return program, flops

    def _program_name(self, program: ShapeKey | tuple[str, bool]) -> str:
        """Everything a compiled program depends on (see worker.executables): `program` is its
        shape key, or ("encode", guided) for the text encoders'."""
        key = dataclasses.astuple(program) if isinstance(program, ShapeKey) else program
        return fingerprint(family=self.model.family.name, dtype=self.model.dtype, configs=self.model.configs,
                           options=self.model.networks.options,
                           key=key, batch_size=self.batch_size,
                           model_parallel=self.model.model_parallel, text_split=self.placement.text_split,
                           devices=[(d.platform, d.device_kind, d.id) for d in self.devices])

    def _program_flops(self, compiled: Any) -> float | None:
        """XLA's count of a per-device program, on all devices."""
        program = program_flops(compiled)
        return None if program is None else program * len(self.devices)

    def _count_flops(self, key: ShapeKey, compiled: Any) -> float | None:
        """XLA counts the per-device program, its denoising loop once: all devices' programs,
        plus the other steps' denoiser calls on the whole batch (2 rows per job with
        classifier-free guidance, else 1)."""
        rows = (2 if key.guided else 1) * self.batch_size
        step = self.model.family.denoiser_flops(self.model.networks, self._weights[1], rows, key.height, key.width)
        return denoise_flops(self._program_flops(compiled), step, key.steps)

    def flops(self, key: ShapeKey) -> float | None:
        """FLOPs of one batch of `key` on all devices, from XLA's count of its compiled
        programs (the text encoders' and the rest); None before they are compiled or where the
        backend counts nothing."""
        generate, encode = self._flops.get(key), self._encoder_flops.get(key.guided)
        return None if generate is None else generate + (encode or 0.0)

    def peak_memory(self, key: ShapeKey) -> int | None:
        """The devices' peak memory in use (bytes, the largest of the engine's devices) when the
        first batch of `key` was collected; None before that, or where the backend reports no
        memory statistics (XLA's CPU backend reports none). The peak is the process's so far:
        for the first shape served it is that shape's, for later ones the largest yet."""
        return self._peak_bytes.get(key)

    def _record_peak_memory(self, key: ShapeKey) -> None:
        """Log the devices' peak memory once per shape, after its first batch."""
        if key in self._peak_bytes:
            return
        peaks = [(device.memory_stats() or {}).get("peak_bytes_in_use") for device in self.devices]
        peak = None if None in peaks else max(peaks)
        self._peak_bytes[key] = peak
        if peak is None:
            log.info("%s: peak device memory not reported (the %s backend gives no memory statistics)",
                     key, self.devices[0].platform)
        else:
            limit = (self.devices[0].memory_stats() or {}).get("bytes_limit")
            log.info("%s: peak device memory %.2f GB after its first batch%s", key, peak / 1e9,
                     f" (of {limit / 1e9:.2f} GB)" if limit else "")

    # -- rendering -------------------------------------------------------------------

    def prefetch(self, specs: Sequence[JobSpec], key: ShapeKey) -> None:
        """Start reading the init images of image jobs that will render as `key`, so their
        batch finds them read (worker.sources)."""
        if key.image:
            for spec in specs:
                self.init_images.fetch(spec, key.width, key.height)

    def inputs(self, key: ShapeKey, jobs: list[JobSpec]) -> tuple[Any, list[bool]]:
        """The family's inputs of a padded batch, sharded over the devices (whatever the pytree);
        an image batch's with each job's init image and mask (read ahead: `prefetch`) and start step."""
        padded = jobs + [jobs[-1]] * (self.batch_size - len(jobs))
        host, truncated = self.model.inputs([j.prompt for j in padded], [j.negative_prompt for j in padded],
                                            [j.seed for j in padded],
                                            [self.model.guidance_scale(j.guidance_scale) for j in padded])
        if key.image:
            read = [self.init_images.pixels(j, key.width, key.height) for j in padded]
            host = ImageInputs(host, np.stack([pixels for pixels, _ in read]),
                               np.array([image_start(j.steps, job_strength(j)) for j in padded], np.int32),
                               np.stack([mask for _, mask in read]) if key.mask else None)
        return jax.device_put(host, self._sharded), truncated[:len(jobs)]

    def dispatch(self, key: ShapeKey, jobs: list[JobSpec]) -> tuple[Output, list[bool]]:
        """Start one batch on the devices, its text encoders' program and then the rest; returns
        at once (JAX dispatch is asynchronous)."""
        inputs, truncated = self.inputs(key, jobs)
        program = self.compiled(key)
        text, weights = self._weights
        return program(weights, inputs, self.encoder(key.guided)(text, text_inputs(inputs))), truncated

    def prepare(self, specs: Sequence[JobSpec]) -> list[tuple[ShapeKey, list[int]]]:
        """Validate every job and compile every shape it needs, before anything renders."""
        plan = self.plan(specs)
        for key, _ in plan:
            self.compiled(key)
        return plan

    def start(self, specs: Sequence[JobSpec], key: ShapeKey, idx: list[int]) -> InFlight:
        """Start the batch `specs[i] for i in idx` on the devices, and its scores after it on
        the images where they are, and return at once."""
        jobs = [specs[i] for i in idx]
        output, truncated = self.dispatch(key, jobs)
        return InFlight(jobs, idx, key, output, truncated, time.perf_counter(), next(self._batches),
                        self._start_scores(jobs, output.images))

    def _start_scores(self, jobs: list[JobSpec], images: Any) -> Any:
        """The scorers on the batch's images (padding included), if a job asked for a score
        they give."""
        given = set(self.scorers.scores) & set(DEVICE_SCORES) if self.scorers is not None else set()
        if not any(given & set(job.scores or ()) for job in jobs):
            return None
        padded = jobs + [jobs[-1]] * (self.batch_size - len(jobs))
        return _score_batch(self.scorers.models, self._score_params, images,
                            self.scorers.tokenize([j.prompt for j in padded]))

    def _job_scores(self, spec: JobSpec, scores: dict[str, np.ndarray] | str | None,
                    n: int) -> tuple[dict[str, Any], dict[str, str]]:
        """The device's scores job `spec` (row `n`) asked for, as its sidecar states them
        (renderfarm/scores.py), and why any is missing (`scores`: the batch's outputs on the
        host, or why they failed)."""
        given = self.scorers.scores if self.scorers is not None else ()
        out: dict[str, Any] = {}
        missing: dict[str, str] = {}
        for name in (s for s in spec.scores or () if s in DEVICE_SCORES):
            if name not in given:
                missing[name] = f"this worker has no {name} model (renderfarm worker --{name}-model)"
            elif isinstance(scores, str) or scores is None:
                missing[name] = scores or "not computed"
            elif name == "safety":
                out["nsfw"] = bool(scores["nsfw"][n])
                out["safety_concepts"] = {f"{kind} {i}": round(float(v), 3)
                                          for kind, row in (("concept", scores["concept_scores"][n]),
                                                            ("special", scores["special_scores"][n]))
                                          for i, v in enumerate(row) if v > 0}
            else:
                out[name] = round(float(scores[name][n]), 4)
        return out, missing

    def collect(self, inflight: InFlight) -> list[Rendered]:
        """Wait for a started batch; its jobs' images (padding dropped) and scores, a gated
        job's image the first of its attempts that passes its gate (the job's own seed, then
        each re-roll's: renderfarm.jobs.reroll_seed), or its first when none passes."""
        rendered = self._collected(inflight)
        gated = [r for r in rendered if r.spec.gate is not None]
        for r in gated:
            r.attempts = [_attempt(r, r.spec.seed)]
        retry = [r for r in gated if r.attempts[-1]["failed"] and r.spec.rerolls]
        while retry:
            seeds = [reroll_seed(r.spec.seed, len(r.attempts)) for r in retry]
            again = [dataclasses.replace(r.spec, seed=seed) for r, seed in zip(retry, seeds)]
            for start in range(0, len(again), self.batch_size):
                chunk = list(range(start, min(start + self.batch_size, len(again))))
                for n, result in zip(chunk, self._collected(self.start(again, inflight.key, chunk))):
                    r = retry[n]
                    r.attempts.append(_attempt(result, seeds[n]))
                    if r.attempts[-1]["passed"]:
                        r.image, r.scanlines, r.scores, r.unscored = (result.image, result.scanlines, result.scores,
                                                                      result.unscored)
                        r.kept = len(r.attempts) - 1
            retry = [r for r in retry if r.attempts[-1]["failed"] and len(r.attempts) <= r.spec.rerolls]
        return rendered

    def _collected(self, inflight: InFlight) -> list[Rendered]:
        """A started batch's images (padding dropped) and scores. A scorer that fails costs
        the jobs their scores (each says why), never their images."""
        pixels, scanlines = np.asarray(inflight.output.images), np.asarray(inflight.output.scanlines)
        scores: dict[str, np.ndarray] | str | None = None
        if inflight.scores is not None:
            try:
                scores = {name: np.asarray(value) for name, value in inflight.scores.items()}
            except Exception as err:  # noqa: BLE001 - the images stand without their scores
                log.warning("batch %d: scoring failed: %s", inflight.seq, err)
                scores = f"scoring failed: {type(err).__name__}: {err}"
        now = time.perf_counter()
        # The devices run batches one after another: this one had them from its start, or
        # from the end of the one before if that ended later.
        busy = now - max(inflight.started, self._last_collected)
        self._last_collected = now
        self._record_peak_memory(inflight.key)
        info = Batch(inflight.seq, len(inflight.specs), self.batch_size, now - inflight.started,
                     busy * len(self.devices))
        return [Rendered(i, spec, pixels[n], inflight.key, inflight.truncated[n], info, scanlines[n],
                         *self._job_scores(spec, scores, n))
                for n, (i, spec) in enumerate(zip(inflight.indices, inflight.specs))]

    def iter_render(self, specs: Sequence[JobSpec],
                    plan: list[tuple[ShapeKey, list[int]]] | None = None) -> Iterator[list[Rendered]]:
        """Yield each batch's results while the next batch already runs on the devices."""
        plan = self.prepare(specs) if plan is None else plan
        pending = None
        for n, (key, idx) in enumerate(plan):
            for ahead, ahead_idx in plan[n:n + 2]:  # this batch's images, and the next one's
                self.prefetch([specs[i] for i in ahead_idx], ahead)
            started = self.start(specs, key, idx)
            if pending is not None:
                yield self.collect(pending)
            pending = started
        if pending is not None:
            yield self.collect(pending)

    def render(self, specs: Sequence[JobSpec]) -> list[Rendered]:
        """All jobs, in the order given, padding dropped."""
        done = [r for results in self.iter_render(specs) for r in results]
        return sorted(done, key=lambda r: r.index)
