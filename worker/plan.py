"""`renderfarm plan`: what a model's programs need of a target's chips, found by compiling them
for those chips before anyone rents one.

For a model (a published architecture by name, a folder or a hub id: diffusion/architectures.py,
shapes in place of weights) and a target (diffusion/targets.py: a TPU topology's devices from
libtpu, a described GPU host's from jax's CUDA plugin, or this machine's CPUs), each program the
worker would run at the job shape (size, steps, scheduler, guidance on or off) is lowered with
the worker's own placement (diffusion/placement.py: the same mesh, weight shardings and
per-device or mesh-wide program) and compiled by XLA for the target. Per program it reports whether
XLA compiled it (or its error), the attention kernel each attention took, XLA's memory per chip
(weights, temp), the largest per-device batch that fits, FLOPs per image with the images/s per
chip at 50% of peak that they allow, and the seconds the compile took. XLA's GPU compiler counts
no FLOPs: for a GPU target they are counted on the same batch's program lowered for this
machine's CPU.

The largest batch is counted from the compiled program as a worker counts it on its own chip
(`--per-device-batch auto`, `auto_per_device_batch`): the weights once, and everything else
(temp, inputs, outputs) taken to grow with the batch, so the count errs low where part of it
is fixed.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import json
import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from renderfarm.jobs import JobError

if TYPE_CHECKING:
    from diffusion.models import LoadedModel
    from diffusion.placement import Placement
    from diffusion.targets import Target
    from worker.engine import Engine, ShapeKey

# What a program renders (plan's --job; a worker's --precompile option), and the placeholder
# job fields that pick its program: an image job's shapes are its size, its strength an input.
JOB_FIELDS: dict[str, dict[str, Any]] = {"text": {}, "img2img": {"init_image": "-", "strength": 1.0},
                                         "inpaint": {"init_image": "-", "mask_image": "-"}}
UTILISATION = 0.5  # the share of the peak a worker should reach (docs/performance.md, "What a model costs per image on a chip")
ERROR_LINES = 6  # of a compiler's error kept in the report
log = logging.getLogger(__name__)


@dataclasses.dataclass
class Memory:
    """XLA's memory of a compiled program on one device (memory_analysis), in bytes."""

    arguments: int
    outputs: int
    temp: int
    code: int
    aliased: int = 0

    @property
    def total(self) -> int:
        """What one run holds on the device at its peak, at most."""
        return self.arguments + self.outputs + self.temp - self.aliased


def memory_of(compiled: Any) -> Memory | None:
    """XLA's memory analysis of a compiled program; None where the backend gives none."""
    analysis = compiled.memory_analysis()
    if analysis is None:
        return None
    return Memory(arguments=int(analysis.argument_size_in_bytes), outputs=int(analysis.output_size_in_bytes),
                  temp=int(analysis.temp_size_in_bytes), code=int(analysis.generated_code_size_in_bytes),
                  aliased=int(analysis.alias_size_in_bytes))


def per_device_batch_that_fits(per_image: float, weights: int, usable: int) -> int:
    """The largest per-device batch that fits `usable` bytes: the weights once, and `per_image`
    bytes (a program's temp, inputs and outputs over its batch) per job (0: not even one)."""
    return max(0, math.floor((usable - weights) / max(1.0, per_image)))


def engine_for(model: LoadedModel, per_device_batch: int | None, key_of: Callable[[Engine], ShapeKey],
               **options: Any) -> Engine:
    """An Engine of `per_device_batch` jobs a device; None (`--per-device-batch auto`): the most
    the first device's memory holds of `key_of(engine)`'s program, counted as `renderfarm plan`
    counts (its memory compiled at one job a device, the weights once: XLA's arguments or the
    device's bytes in use, the larger). One job a device where the backend reports no memory
    limit (XLA's CPU backend)."""
    from diffusion.targets import usable_share
    from worker.engine import Engine

    engine = Engine(model, per_device_batch=per_device_batch or 1, **options)
    if per_device_batch is not None:
        return engine
    key = key_of(engine)
    compiled, device = engine.compiled(key), engine.devices[0]
    stats, memory = device.memory_stats() or {}, memory_of(compiled)
    if not stats.get("bytes_limit") or memory is None:
        log.info("--per-device-batch auto: the %s backend reports no memory limit; 1 job a device", device.platform)
        return engine
    weights = max(memory.arguments, int(stats.get("bytes_in_use", 0)))
    per_image, usable = memory.temp + memory.outputs, int(stats["bytes_limit"] * usable_share(device.platform))
    fits = per_device_batch_that_fits(per_image, weights, usable)
    if fits == 0:
        raise JobError("per-device-batch", "auto", f"{key}: one job a device needs {_gb(weights + per_image)} per "
                                                   f"chip, {_gb(weights + per_image - usable)} over the "
                                                   f"{_gb(usable)} usable of {device.device_kind}")
    log.info("--per-device-batch auto: %d jobs a device for %s (%s of weights, %s a job, %s usable of %s)", fits, key,
             _gb(weights), _gb(per_image), _gb(usable), device.device_kind)
    return engine if fits == 1 else Engine(model, per_device_batch=fits, **options)


@dataclasses.dataclass
class ProgramPlan:
    """One program compiled for the target, and what it needs there."""

    shape: str
    guided: bool
    per_device_batch: int
    batch: int  # jobs per batch on the whole target
    model_parallel: int
    compiled: bool
    error: str | None = None
    kernels: dict[str, int] = dataclasses.field(default_factory=dict)  # attention calls per kernel
    attention: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # each call as traced
    weights_bytes: int | None = None  # per chip
    temp_bytes: int | None = None  # per chip
    total_bytes: int | None = None  # per chip: arguments + outputs + temp
    usable_bytes: int | None = None  # per chip
    fits: bool | None = None  # None: the target's memory is unknown
    over_bytes: int | None = None  # per chip, where it does not fit
    largest_per_device_batch: int | None = None
    flops_per_image: float | None = None
    images_per_second_per_chip: float | None = None  # at UTILISATION of the peak
    lower_seconds: float = 0.0
    compile_seconds: float = 0.0


@dataclasses.dataclass
class Plan:
    """A model's programs on a target."""

    model: str
    family: str
    dtype: str
    target: str
    target_label: str
    devices: int
    memory_per_chip: int | None
    usable_per_chip: int | None
    peak_flops_per_chip: float | None
    weights_bytes: int  # one whole copy
    auto_model_parallel: int | None  # the split `--model-parallel auto` takes; None: the weights fit nowhere
    auto_error: str | None
    text_split: bool  # the text encoders' weights spread over every chip (they do not fit whole beside the rest)
    programs: list[ProgramPlan]

    @property
    def ok(self) -> bool:
        """Every program compiled, and fits where the memory is known."""
        return all(p.compiled and p.fits is not False for p in self.programs)


def make_plan(ref: str, target_name: str, size: tuple[int, int] | None = None, steps: int = 25,
              guidance: tuple[float, ...] | None = None, scheduler: str | None = None, dtype: str = "bfloat16",
              per_device_batch: int = 1, model_parallel: int | None = None,
              memory_per_chip: int | None = None, job: str = "text") -> Plan:
    """Compile `ref`'s programs for target `target_name` at one job shape, a program per
    guidance scale given (on or off; None: the family's default), and say what each needs per
    chip; `job` is one of JOB_FIELDS (text to image, image to image, inpainting). `model_parallel` None takes the split `auto` chooses; `memory_per_chip` replaces the
    target's memory."""
    from diffusion.architectures import abstract_model
    from diffusion.placement import make_placement
    from diffusion.sharding import choose_model_parallel, split_text_encoders
    from diffusion.targets import target, target_devices
    from renderfarm.jobs import parse_job
    from worker.engine import shape_key

    chosen = target(target_name)
    if per_device_batch < 1:
        raise JobError("per-device-batch", per_device_batch, "must be at least 1")
    if memory_per_chip is not None:
        if memory_per_chip < 1:
            raise JobError("memory-per-chip", memory_per_chip, "must be a positive number of bytes")
        chosen = dataclasses.replace(chosen, memory=memory_per_chip)
    devices = list(target_devices(chosen))
    model = abstract_model(ref, dtype)
    weights = _bytes(model.params)
    text_bytes = sum(_bytes(model.params[name]) for name in model.family.text_encoders)
    usable = chosen.usable_bytes
    try:
        auto, auto_error = choose_model_parallel(weights, usable, len(devices), text_bytes), None
    except ValueError as err:
        auto, auto_error = None, str(err)
    split = model_parallel or auto
    if split is None:
        raise JobError("model", ref, f"{auto_error}: nothing to compile for {chosen.name}")
    width, height = size or (model.native_size, model.native_size)
    # the job contract's rules (sizes, steps, guidance, scheduler, image jobs), as a job of this
    # shape meets them
    images = JOB_FIELDS[job]
    specs = [parse_job({"prompt": "-", "model": ref, "seed": 0, "width": width, "height": height, "steps": steps,
                        "guidance_scale": scale, "scheduler": scheduler, "dtype": dtype, **images},
                       size_step=model.size_step) for scale in guidance or (model.family.default_guidance,)]
    try:
        keys = dict.fromkeys(shape_key(model, spec) for spec in specs)
    except JobError as err:
        if err.field in images:  # a placeholder's: the model does not render this kind of job
            raise JobError("job", job, err.rule) from None
        raise
    text_split = split_text_encoders(weights, text_bytes, usable, split, len(devices))
    programs = _programs(model, chosen, make_placement(devices, split, text_split), per_device_batch, list(keys))
    return Plan(model=ref, family=model.family.name, dtype=dtype, target=chosen.name, target_label=chosen.label,
                devices=len(devices), memory_per_chip=chosen.memory, usable_per_chip=usable,
                peak_flops_per_chip=chosen.peak_flops, weights_bytes=weights, auto_model_parallel=auto,
                auto_error=auto_error, text_split=text_split, programs=programs)


def _programs(model: LoadedModel, chosen: Target, placement: Placement, per_device_batch: int,
              keys: list[ShapeKey]) -> list[ProgramPlan]:
    """The text encoders' program for each guidance kind of `keys`, then each key's generate
    program, compiled for the target's devices: what XLA says of each. Every program's weights
    per chip are all that the chip holds of the model (the worker keeps both programs' weights
    on the devices), and a shape's FLOPs per image count its text encoders' program too."""
    from diffusion.flops import denoise_flops
    from diffusion.generate import Static, text_inputs
    from diffusion.placement import by_program, encoded_shapes, lower_encode, lower_generate
    from diffusion.schedulers import make

    family, networks = model.family, model.networks
    devices, split = placement.devices, placement.model_parallel
    batch = placement.batch_size(per_device_batch)
    # each program's weights per chip, as placed: the text encoders', the rest
    text_bytes, other_bytes = (sum(math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
                                   for leaf in _leaves(part))
                               for part in by_program(family, placement.abstract(family, model.params)))

    def program(shape: str, guided: bool) -> ProgramPlan:
        return ProgramPlan(shape=shape, guided=guided, per_device_batch=per_device_batch, batch=batch,
                           model_parallel=split, compiled=False)

    @functools.cache
    def arguments(where: Placement, key: ShapeKey) -> tuple[Any, Any, Any]:
        """The programs' arguments for `key` as shapes placed on `where`: the text encoders'
        weights, the other weights and the batch's inputs."""
        text, weights = by_program(family, where.abstract(family, model.params))
        return text, weights, model.abstract_inputs(batch, where.batch, (key.height, key.width) if key.image else None,
                                                    key.mask)

    @functools.cache
    def encoded(where: Placement, key: ShapeKey) -> Any:
        """What the text encoders return for `key`'s batch, as shapes (traced once a placement)."""
        text, _, inputs = arguments(where, key)
        return encoded_shapes(family, networks, key.guided, where, text, text_inputs(inputs))

    programs, encoder_flops = [], {}
    firsts: dict[bool, ShapeKey] = {}
    for key in keys:
        firsts.setdefault(key.guided, key)
    for guided, first in firsts.items():
        def lower_text(where: Placement, first: ShapeKey = first) -> Any:
            text, _, inputs = arguments(where, first)
            return lower_encode(family, networks, first.guided, where, text, text_inputs(inputs))

        plan = program(f"text encoders{'' if guided else ' cfg-free'}", guided)
        compiled = _compile(plan, chosen, placement, text_inputs(arguments(placement, first)[2]), lower_text,
                            text_bytes, other_bytes)
        counted = None if compiled is None else _flops(compiled, len(devices), lower_text)
        if counted is not None:
            plan.flops_per_image = encoder_flops[guided] = counted / batch
        programs.append(plan)
    for key in keys:
        def lower(where: Placement, key: ShapeKey = key) -> Any:
            _, weights, inputs = arguments(where, key)
            return lower_generate(family, networks, make(key.scheduler, model.configs["scheduler"]),
                                  Static(key.height, key.width, key.steps, key.guided, key.image, key.mask),
                                  where, weights, inputs, encoded(where, key))

        plan = program(str(key), key.guided)
        compiled = _compile(plan, chosen, placement, (arguments(placement, key)[2], encoded(placement, key)), lower,
                            other_bytes, text_bytes)
        if compiled is not None:
            denoiser = family.denoiser_flops(networks, model.params, (2 if key.guided else 1) * batch, key.height,
                                             key.width)
            total = denoise_flops(_flops(compiled, len(devices), lower), denoiser, key.steps)
            if total is not None:
                plan.flops_per_image = total / batch + encoder_flops.get(key.guided, 0.0)
                if chosen.peak_flops:
                    plan.images_per_second_per_chip = UTILISATION * chosen.peak_flops / plan.flops_per_image
        programs.append(plan)
    return programs


def _compile(plan: ProgramPlan, chosen: Target, placement: Any, inputs: Any, lower: Callable[[Any], Any],
             own: int, resident: int) -> Any:
    """Lower `lower(placement)` (attention recorded) and compile it for the target, filling
    `plan` with what XLA says; the compiled program, or None where XLA refused it. `inputs`: the
    shapes of its arguments besides the weights; `own`: its weights per chip as placed;
    `resident`: the other program's, which stay on the devices while it runs."""
    from diffusion.nn.attention import recording

    started = time.perf_counter()
    with recording() as calls:
        lowered = lower(placement)
    plan.lower_seconds = time.perf_counter() - started
    plan.attention = [dataclasses.asdict(call) for call in calls]
    plan.kernels = dict(collections.Counter(call.kernel for call in calls))
    started = time.perf_counter()
    try:
        compiled = lowered.compile(compiler_options=chosen.compiler_options)
    except Exception as err:  # noqa: BLE001 - the compiler's refusal is the report
        plan.compile_seconds = time.perf_counter() - started
        plan.error = "\n".join(str(err).strip().splitlines()[:ERROR_LINES])
        return None
    plan.compile_seconds = time.perf_counter() - started
    plan.compiled = True
    memory = memory_of(compiled)
    if memory is not None:
        inputs_bytes = _bytes(inputs) // placement.data_parallel
        # XLA's arguments leave out weights the program never reads (the VAE's encoder) and pad
        # small ones to the chip's tiles: the larger of its count and the placed bytes, and the
        # other program's weights beside them
        plan.weights_bytes = max(memory.arguments - inputs_bytes, own) + resident
        memory.arguments = plan.weights_bytes + inputs_bytes
        plan.temp_bytes, plan.total_bytes = memory.temp, memory.total
        usable = chosen.usable_bytes
        if usable is not None:
            plan.usable_bytes = usable
            plan.fits = memory.total <= usable
            plan.over_bytes = None if plan.fits else memory.total - usable
            plan.largest_per_device_batch = per_device_batch_that_fits(
                (memory.total - plan.weights_bytes) / plan.per_device_batch, plan.weights_bytes, usable)
    return compiled


def _flops(compiled: Any, devices: int, lower: Callable[[Any], Any]) -> float | None:
    """XLA's count of a compiled per-device program, on all `devices`; where XLA counts none
    (its GPU compiler), the count of the same batch's program lowered (`lower(placement)`) for
    one CPU device."""
    import jax

    from diffusion.flops import program_flops
    from diffusion.placement import make_placement

    counted = program_flops(compiled)
    if counted is not None:
        return counted * devices
    return program_flops(lower(make_placement(jax.devices("cpu")[:1], 1)))


def _leaves(tree: Any) -> list[Any]:
    import jax

    return jax.tree.leaves(tree)


def _bytes(tree: Any) -> int:
    """The bytes of a tree of arrays or shapes, whole."""
    return sum(leaf.size * leaf.dtype.itemsize for leaf in _leaves(tree))


# -- the report ---------------------------------------------------------------------------------


def _si(n: float | None, unit: str) -> str:
    """`n` with the largest SI prefix under it: 2.13 GB, 41.90 TFLOP."""
    if n is None:
        return "-"
    if n == 0:
        return f"0 {unit}"
    prefix, scale = next(((p, s) for p, s in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)) if n >= s), ("", 1))
    return f"{n / scale:.2f} {prefix}{unit}"


def _gb(n: int | None) -> str:
    return _si(n, "B")


def format_plan(plan: Plan) -> str:
    """The plan as text: the model and target, then a block per program."""
    memory = ("no memory limit known" if plan.memory_per_chip is None
              else f"{_gb(plan.memory_per_chip)} a chip, {_gb(plan.usable_per_chip)} usable")
    auto = (f"model parallel {plan.auto_model_parallel}" if plan.auto_model_parallel is not None
            else f"none ({plan.auto_error})")
    lines = [f"{plan.model} ({plan.family}, {plan.dtype}) on {plan.target}: {plan.target_label}, "
             f"{plan.devices} devices, {memory}",
             f"weights {_gb(plan.weights_bytes)} a copy; auto split: {auto}"
             + (f"; at model parallel {plan.programs[0].model_parallel} the text encoders are spread over every chip"
                if plan.text_split else "")]
    for p in plan.programs:
        copy = "device" if p.model_parallel == 1 else f"{p.model_parallel} devices"
        lines.append(f"\n{p.shape}: batch {p.batch} ({p.per_device_batch} per {copy}, model parallel "
                     f"{p.model_parallel})")
        kernels = ", ".join(f"{kernel} x{count}" for kernel, count in sorted(p.kernels.items())) or "none"
        lines.append(f"  attention: {kernels}")
        if not p.compiled:
            lines.append(f"  NOT COMPILED ({p.compile_seconds:.1f} s): " + (p.error or "").replace("\n", "\n    "))
            continue
        lines.append(f"  compiled in {p.compile_seconds:.1f} s (traced and lowered in {p.lower_seconds:.1f} s)")
        lines.append(f"  per chip: weights {_gb(p.weights_bytes)}, temp {_gb(p.temp_bytes)}, "
                     f"in all {_gb(p.total_bytes)}")
        if p.fits is True:
            lines.append(f"  fits: {_gb(p.total_bytes)} of {_gb(p.usable_bytes)} usable; largest per-device "
                         f"batch {p.largest_per_device_batch}")
        elif p.fits is False:
            lines.append(f"  DOES NOT FIT: {_gb(p.total_bytes)} per chip, {_gb(p.over_bytes)} over the "
                         f"{_gb(p.usable_bytes)} usable; largest per-device batch {p.largest_per_device_batch}")
        else:
            lines.append("  fits: unknown (no memory limit known for this target; --memory-per-chip sets one)")
        ceiling = ("" if p.images_per_second_per_chip is None
                   else f"; {p.images_per_second_per_chip:.2f} images/s per chip at {UTILISATION:.0%} of peak")
        lines.append(f"  FLOPs per image: {_si(p.flops_per_image, 'FLOP')}{ceiling}")
    return "\n".join(lines)


def cmd_plan(args: argparse.Namespace) -> int:
    plan = make_plan(args.model, args.target, args.size, args.steps, args.guidance and tuple(args.guidance),
                     args.scheduler, args.dtype, args.per_device_batch, args.model_parallel,
                     None if args.memory_per_chip is None else int(args.memory_per_chip * 1e9), args.job)
    print(json.dumps({**dataclasses.asdict(plan), "ok": plan.ok}, indent=2) if args.json else format_plan(plan))
    return 0 if plan.ok else 1


def _size(text: str) -> tuple[int, int]:
    width, _, height = text.partition("x")
    if not width.isdigit() or not (height or width).isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: WIDTHxHEIGHT or one number for a square")
    return int(width), int(height or width)


def _scales(text: str) -> list[float]:
    try:
        return [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: guidance scales, comma-separated (1 or less: no "
                                         "classifier-free guidance)") from None


def register(sub: argparse._SubParsersAction, model_parallel: Callable[[str], int | None]) -> None:
    """`renderfarm plan`; `model_parallel` parses --model-parallel as the worker's flag does."""
    from diffusion.architectures import ARCHITECTURES
    from diffusion.targets import TARGETS

    plan = sub.add_parser("plan", help="compile a model's programs for a target's chips: memory, kernels, "
                                       "FLOPs, the batch that fits (no chip needed)")
    plan.add_argument("model", help=f"a published architecture ({', '.join(ARCHITECTURES)}, random weights), a "
                                    "pipeline folder or a hub id")
    plan.add_argument("--target", required=True, help=f"the chips to plan for: {', '.join(TARGETS)}")
    plan.add_argument("--size", type=_size, metavar="WxH", help="image size (default: the model's native size)")
    plan.add_argument("--steps", type=int, default=25, help="denoising steps (default 25)")
    plan.add_argument("--guidance", type=_scales, metavar="G[,G]",
                      help="guidance scales: a program each for guidance on (> 1) and off (default: the family's "
                           "own, 7.5 for SD, 3.5 for Flux)")
    plan.add_argument("--scheduler", help="the job's scheduler (default: the model's own)")
    plan.add_argument("--job", choices=tuple(JOB_FIELDS), default="text",
                      help="the jobs' kind: text to image, image to image or inpainting (default text); an image "
                           "job's program runs every step, as a strength-1 job does")
    plan.add_argument("--dtype", default="bfloat16", help="float32 or bfloat16 (default bfloat16)")
    plan.add_argument("--per-device-batch", type=int, default=1, metavar="N",
                      help="jobs per copy of the weights in the compiled batch (default 1)")
    plan.add_argument("--model-parallel", type=model_parallel, default=None, metavar="N|auto",
                      help="devices per copy of the weights (default auto: the split the worker would choose)")
    plan.add_argument("--memory-per-chip", type=float, metavar="GB",
                      help="each device's memory in GB (10^9 bytes), in place of the target's")
    plan.add_argument("--json", action="store_true", help="the plan as JSON, for scripts")
    plan.set_defaults(handler=cmd_plan)
