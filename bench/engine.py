"""How fast the engine renders, here and on a device, against diffusers. Not a test.

Parts (`PYTHONPATH=. python bench/engine.py PART [flags]`; no part runs `device`):

- device: SD 1.5, SDXL and Flux.1 schnell at full size with random weights, through the worker's
  own loader and engine: load, compile cold and warm, images/s, FLOPs and the fraction of
  peak, peak device memory; with `--peer`, diffusers' PyTorch pipeline on the same folder
  (`--compile-peer`: a torch.compile'd denoiser too). With JAX_PLATFORMS=cpu it runs
  `--smoke`: tiny models of the same families, one CPU device, 64x64, 2 steps.
- direct: `renderfarm render` against the Flax pipeline flow of diffusers' SD blog post.
- dtype: float32 against bfloat16 on this CPU, images/s and pixels.
- few-step: cfg-free (guidance <= 1) against guided programs, and a 4-step trailing campaign.
- flux: a tiny Flux rendered on this host's devices.
- img2img: image-to-image batches of one and mixed strengths against text to image.
- scores: a tiny SD batch with and without the device scores.
- shapes: jobs of three shapes interleaved on one queue: the share of batch slots filled.
- warmstart: a new worker's start to its first stored image, cold and warm.

The tiny parts render on 8 virtual CPU devices (`XLA_FLAGS=--xla_force_host_platform_device_count=8`).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "a lighthouse on a cliff at dusk, oil painting, detailed"
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


# -- shared -----------------------------------------------------------------------------------------


def alternate(runs: dict[str, Callable[[], None]], images: int, rounds: int) -> dict[str, list[float]]:
    """images/s of each run per round, the runs alternating so that each sees the same machine."""
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            started = time.perf_counter()
            run()
            rates[name].append(images / (time.perf_counter() - started))
    return rates


def rounds_text(rates: list[float]) -> str:
    return "(rounds: " + ", ".join(f"{r:.2f}" for r in rates) + ")"


def tiny_folder(root: Path, kind: str = "sd") -> str:
    """`renderfarm tiny-model`'s model of family `kind`, written under `root`."""
    from diffusion.tiny import build_tiny_model

    return str(build_tiny_model(root / f"tiny-{kind}", kind=kind))


def tiny_specs(folder: str, images: int, **fields: Any) -> list[Any]:
    from renderfarm.jobs import JobSpec

    return [JobSpec(prompt=f"a lighthouse, variation {i}", model=folder, seed=i, campaign="bench", **fields)
            for i in range(images)]


def machine() -> str:
    import jax

    return f"jax {jax.__version__}, {jax.device_count()} x {jax.devices()[0].device_kind} devices, {os.cpu_count()} cores"


# -- device: full-size models on an accelerator, beside diffusers ---------------------------------------


@dataclass(frozen=True)
class Run:
    """One model of the device part: its architecture (diffusion/architectures/) and job shape."""

    label: str
    family: str
    steps: int
    batch: int  # per device
    guidance: float
    scheduler: str
    peer: str  # diffusers' pipeline class


RUNS = {
    "sd15": Run("SD 1.5", "sd", 25, 8, 7.5, "ddim", "StableDiffusionPipeline"),
    "sdxl": Run("SDXL", "sdxl", 20, 4, 7.5, "ddim", "StableDiffusionXLPipeline"),
    "flux-schnell": Run("Flux.1 schnell", "flux", 4, 4, 0.0, "flow_euler", "FluxPipeline"),
}
SMOKE = {"size": 64, "steps": 2, "batch": 2, "batches": 2}  # on one CPU device


def device_plan(name: str, smoke: bool) -> dict[str, Any]:
    """What the device part writes and runs for `name`: the published configs (or, with `smoke`,
    tiny ones of the same family), size, steps and per-device batch."""
    from diffusion.architectures import architecture
    from diffusion.families import FAMILIES
    from diffusion.families.flux import tiny_configs
    from diffusion.families.latent_unet import unet_config, vae_config
    from diffusion.tiny_parts import text_config

    run, published = RUNS[name], architecture(name)
    configs = {component: published[component] for component in FAMILIES[run.family].components}
    size, steps, batch = published["vae"]["sample_size"], run.steps, run.batch
    if smoke:
        if run.family == "flux":  # a T5 table of 256 rows holds the tiny T5 tokenizer
            configs = tiny_configs(514, 256)
            configs["transformer"] = {**configs["transformer"],
                                      "guidance_embeds": published["transformer"]["guidance_embeds"]}
        else:  # the tiny CLIP tokenizers have 514 tokens
            configs = {"unet": unet_config(run.family), "vae": vae_config(run.family), "text_encoder": text_config(514)}
            if run.family == "sdxl":
                configs["text_encoder_2"] = text_config(514, hidden_act="gelu")
        size, steps, batch = SMOKE["size"], SMOKE["steps"], SMOKE["batch"]
    options = {key: value for key, value in published["model_index"].items() if key != "_class_name"}
    return {**asdict(run), "name": name, "size": size, "steps": steps, "batch": batch, "configs": configs,
            "scheduler_config": published["scheduler"], "options": options}


def _device_specs(folder: Path, plan: dict[str, Any], dtype: str, count: int, offset: int) -> list[Any]:
    from renderfarm.jobs import JobSpec

    return [JobSpec(prompt=f"{PROMPT}, {offset + i}", model=str(folder), seed=offset + i, steps=plan["steps"],
                    guidance_scale=plan["guidance"], width=plan["size"], height=plan["size"],
                    scheduler=plan["scheduler"], dtype=dtype) for i in range(count)]


def child_ours(job: dict[str, Any]) -> dict[str, Any]:
    """One process of ours: load, the program (compiled, or the saved executable), the first
    batch; cold, also `batches` more in steady state. Times from this process's start."""
    import logging

    import jax

    from diffusion.flops import peak_flops
    from diffusion.models import load_model
    from worker.engine import Engine, enable_compilation_cache
    from worker.executables import ExecutableStore

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    imported = time.time()
    plan, folder = job["plan"], Path(job["folder"])
    cache = enable_compilation_cache(Path(job["cache"]) / "jax")
    store = ExecutableStore(Path(job["cache"]) / "executables")
    started = time.perf_counter()
    model = load_model(str(folder), job["dtype"])
    load_seconds = time.perf_counter() - started
    engine = Engine(model, per_device_batch=plan["batch"], executables=store)
    specs = _device_specs(folder, plan, job["dtype"], engine.batch_size, 0)
    key = engine.check(specs[0])
    started = time.perf_counter()
    program = engine.compiled(key)
    ready_seconds = time.perf_counter() - started
    started = time.perf_counter()
    engine.render(specs)
    first_batch_seconds = time.perf_counter() - started
    first_batch_done = time.time()
    analysis = program.memory_analysis()
    devices = engine.devices
    result = {
        "device_kind": devices[0].device_kind, "platform": devices[0].platform, "devices": len(devices),
        "jax": jax.__version__, "batch": engine.batch_size, "imports_seconds": imported - job["spawned"],
        "load_seconds": load_seconds, "weights_bytes": sum(leaf.nbytes for leaf in jax.tree.leaves(model.params))
        // len(devices), "program_seconds": ready_seconds, "compile_seconds": engine.compile_seconds,
        "saved_executable_loaded": store.loaded > 0, "persistent_cache_hits": engine.cache_hits,
        "first_batch_seconds": first_batch_seconds, "start_to_first_batch_seconds": first_batch_done - job["spawned"],
        "peak_bytes": engine.peak_memory(key),
        "bytes_limit": (devices[0].memory_stats() or {}).get("bytes_limit"),
        "xla_temp_bytes": getattr(analysis, "temp_size_in_bytes", None) if analysis is not None else None,
        "cache": str(cache),
    }
    flops = engine.flops(key)
    result["flops_per_image"] = None if flops is None else flops / engine.batch_size
    peak = peak_flops(devices[0].device_kind)
    result["peak_flops_per_device"] = peak
    if job["mode"] == "cold":
        timed = _device_specs(folder, plan, job["dtype"], engine.batch_size * job["batches"], engine.batch_size)
        started = time.perf_counter()
        engine.render(timed)
        seconds = time.perf_counter() - started
        result |= {"steady_seconds": seconds, "steady_images": len(timed), "images_per_second": len(timed) / seconds}
        if flops is not None and peak is not None:
            result["fraction_of_peak"] = result["flops_per_image"] * result["images_per_second"] / (peak * len(devices))
    return result


def child_peer(job: dict[str, Any]) -> dict[str, Any]:
    """diffusers' PyTorch pipeline on the same folder: SD in float16 on a GPU (float32 on a CPU,
    where float16 kernels are missing or slow), Flux in bfloat16; SDPA attention; SD with DDIM
    from the model's scheduler config, Flux with its own flow-matching Euler; the same batch,
    steps, size and guidance; the first call, then `batches` timed."""
    import diffusers
    import torch

    imported = time.time()
    plan = job["plan"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not job["smoke"]:  # a TPU VM, say: full size on its CPU would take hours
        raise SystemExit("the peer needs a CUDA device (torch.cuda.is_available() is False); run without --peer")
    flux = plan["family"] == "flux"
    dtype = torch.bfloat16 if flux else torch.float16 if device == "cuda" else torch.float32
    started = time.perf_counter()
    pipe = getattr(diffusers, plan["peer"]).from_pretrained(job["folder"], torch_dtype=dtype).to(device)
    if device == "cuda":
        torch.cuda.synchronize()
    load_seconds = time.perf_counter() - started
    if not flux:
        pipe.scheduler = diffusers.DDIMScheduler.from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    denoiser = "transformer" if flux else "unet"
    batch = plan["batch"]  # one device
    processors = sorted({type(p).__name__ for p in getattr(pipe, denoiser).attn_processors.values()})
    extra = {"max_sequence_length": 256} if flux else {}  # schnell's T5 length, as ours

    def call(seed: int) -> None:
        generator = torch.Generator(device).manual_seed(seed)
        pipe(prompt=[f"{PROMPT}, {seed + i}" for i in range(batch)], num_inference_steps=plan["steps"],
             guidance_scale=plan["guidance"], height=plan["size"], width=plan["size"], generator=generator,
             output_type="np", **extra)
        if device == "cuda":
            torch.cuda.synchronize()

    def timed(label: str) -> dict[str, Any]:
        started = time.perf_counter()
        call(0)
        first = time.perf_counter() - started
        started = time.perf_counter()
        for b in range(job["batches"]):
            call(batch * (b + 1))
        seconds = time.perf_counter() - started
        return {f"{label}first_batch_seconds": first, f"{label}images_per_second": batch * job["batches"] / seconds}

    result = {"torch": torch.__version__, "diffusers": diffusers.__version__, "device": device,
              "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "dtype": str(dtype).removeprefix("torch."), "attention": processors, "batch": batch,
              "imports_seconds": imported - job["spawned"], "load_seconds": load_seconds}
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    result |= timed("")
    result["peak_bytes"] = torch.cuda.max_memory_allocated() if device == "cuda" else None
    if job["compile_peer"]:
        if device == "cuda":
            getattr(pipe, denoiser).to(memory_format=torch.channels_last)
        setattr(pipe, denoiser, torch.compile(getattr(pipe, denoiser), fullgraph=True))
        result |= timed("compiled_")
    return result


def run_child(kind: str, job: dict[str, Any], python: str, env: dict[str, str], logs: Path,
              timeout: float) -> dict[str, Any]:
    """Run one measured process; its result, or SystemExit with the tail of its log."""
    logs.mkdir(parents=True, exist_ok=True)
    name = f"{job['model']}-{kind}"
    job_file, result_file, log_file = logs / f"{name}.job.json", logs / f"{name}.result.json", logs / f"{name}.log"
    result_file.unlink(missing_ok=True)
    job = {**job, "mode": kind, "spawned": time.time()}
    job_file.write_text(json.dumps(job))
    with log_file.open("w") as log:
        proc = subprocess.run([python, str(Path(__file__).resolve()), "device", "--child", str(job_file),
                               str(result_file)], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                              timeout=timeout, check=False)
    if proc.returncode != 0 or not result_file.is_file():
        tail = "\n".join(log_file.read_text(errors="replace").splitlines()[-30:])
        raise SystemExit(f"{name} failed (exit {proc.returncode}); the end of {log_file}:\n{tail}")
    return {**json.loads(result_file.read_text()), "wall_seconds": time.time() - job["spawned"]}


def _gb(n: float | None) -> str:
    """Bytes in GB, or in MB / kB where that would read 0.00 GB (the tiny models)."""
    if n is None:
        return "n/a"
    for unit, scale in (("GB", 1e9), ("MB", 1e6)):
        if n >= scale / 100:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 1e3:.2f} kB"


def _flop(n: float | None) -> str:
    if n is None:
        return "n/a"
    for unit, scale in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.3g} FLOP"


def report(plan: dict[str, Any], figures: dict[str, Any]) -> None:
    """The device part's lines for one model."""
    cold, warm, peer, folder = figures["cold"], figures["warm"], figures.get("peer"), figures["folder"]
    print(f"\n{plan['label']} {plan['size']}x{plan['size']}, {plan['steps']} steps {plan['scheduler']}, guidance "
          f"{plan['guidance']}, batch {cold['batch']} ({plan['batch']} per device x {cold['devices']} "
          f"{cold['device_kind']})")
    state = f"written in {folder['seconds']:.1f} s" if folder["written"] else "kept from an earlier run"
    print(f"  folder: {_gb(folder['bytes'])} of float16 safetensors, random weights, {state}")
    print(f"  load: {cold['load_seconds']:.2f} s ({_gb(cold['weights_bytes'])} per device in {figures['dtype']})")
    how = "saved executable loaded" if warm["saved_executable_loaded"] else \
        f"compiled again ({warm['persistent_cache_hits']} from the persistent cache)"
    print(f"  compile: cold {cold['compile_seconds']:.2f} s (trace, lower, compile; program ready in "
          f"{cold['program_seconds']:.2f} s with its FLOP count and saving), warm {warm['program_seconds']:.2f} s "
          f"({how}, a new process)")
    print(f"  warm start: first batch {warm['first_batch_seconds']:.2f} s after its program; "
          f"{warm['start_to_first_batch_seconds']:.2f} s from process start (load {warm['load_seconds']:.2f} s); "
          f"cold: {cold['start_to_first_batch_seconds']:.2f} s")
    print(f"  steady state: {cold['images_per_second']:.3f} images/s ({cold['steady_images']} images in "
          f"{cold['steady_seconds']:.2f} s, after a first batch of {cold['first_batch_seconds']:.2f} s)")
    fraction, peak = cold.get("fraction_of_peak"), cold.get("peak_flops_per_device")
    rate = None if cold["flops_per_image"] is None else cold["flops_per_image"] * cold["images_per_second"]
    print(f"  FLOPs per image: {_flop(cold['flops_per_image'])} (XLA); {_flop(rate)}/s = "
          + (f"{fraction:.1%} of peak ({cold['devices']} x {peak / 1e12:g} TFLOP/s)" if fraction is not None
             else f"fraction of peak n/a (no peak known for {cold['device_kind']!r}; set RENDERFARM_PEAK_TFLOPS)"))
    memory = (f"{_gb(cold['peak_bytes'])} after the first batch" + (f" of {_gb(cold['bytes_limit'])}"
              if cold["bytes_limit"] else "")) if cold["peak_bytes"] is not None else \
        f"not reported (the {cold['platform']} backend gives no memory_stats)"
    print(f"  peak device memory: {memory}; XLA temp buffers of the program {_gb(cold['xla_temp_bytes'])} per device")
    if peer:
        print(f"  peer: diffusers {peer['diffusers']} {plan['peer']}, torch {peer['torch']}, {peer['dtype']} on "
              f"{peer['device_name']}, eager, {'/'.join(peer['attention'])}: load {peer['load_seconds']:.2f} s, first "
              f"batch {peer['first_batch_seconds']:.2f} s, {peer['images_per_second']:.3f} images/s (batch "
              f"{peer['batch']}), peak {_gb(peer['peak_bytes']) if peer['peak_bytes'] is not None else 'n/a (cpu)'}")
        print(f"  ours / theirs (images/s per device): {figures['ratio']:.2f}")
        if "compiled_images_per_second" in peer:
            print(f"  peer, torch.compile'd denoiser: first batch {peer['compiled_first_batch_seconds']:.2f} s, "
                  f"{peer['compiled_images_per_second']:.3f} images/s; ours / theirs {figures['ratio_compiled']:.2f}")


def part_device(args: argparse.Namespace) -> None:
    """Per model, each measured part in a process of its own, so torch and JAX never share a
    device and every figure has a clean start: the peer first, then ours cold (empty caches),
    then ours warm (a new process that finds the saved executable the cold one left)."""
    from harness.torch_pipeline import write_torch_pipeline

    if args.child:  # a measured process: nothing above touched JAX or torch
        job = json.loads(Path(args.child[0]).read_text())
        result = child_peer(job) if job["mode"] == "peer" else child_ours(job)
        Path(args.child[1]).write_text(json.dumps(result))
        return
    # This process only writes folders and reads results: it keeps JAX on the CPU, so the
    # accelerator (a TPU opens in one process only) stays free for the measured processes.
    platforms = os.environ.get("JAX_PLATFORMS")
    os.environ["JAX_PLATFORMS"] = "cpu"
    if platforms == "cpu" and not args.smoke:  # `make bench` on a machine without one
        print("JAX_PLATFORMS=cpu: full-size models on a CPU would take hours; running --smoke instead")
        args.smoke = True
    child_env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if args.smoke:  # one device, as the peer has: per device, the two are then compared like for like
        child_env |= {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
                      "CUDA_VISIBLE_DEVICES": ""}
    elif platforms is None:
        del child_env["JAX_PLATFORMS"]
    else:
        child_env["JAX_PLATFORMS"] = platforms
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        raise SystemExit(f"--models: unknown {unknown}; known: {', '.join(RUNS)}")
    dtype = args.dtype or ("float32" if args.smoke else "bfloat16")
    batches = args.batches or SMOKE["batches"]
    everything: dict[str, Any] = {"smoke": args.smoke, "dtype": dtype, "batches": batches, "models": {}}
    workdir = Path(args.workdir) / ("smoke" if args.smoke else "full")
    workdir.mkdir(parents=True, exist_ok=True)
    run = Path(tempfile.mkdtemp(prefix="run-", dir=args.workdir))  # private: the caches hold code
    print(f"device benchmark{' (smoke: tiny models on the CPU)' if args.smoke else ''}: ours in {dtype}; "
          f"logs and caches in {run}", flush=True)
    try:
        for name in names:
            plan = device_plan(name, args.smoke)
            if getattr(args, f"{name.replace('-', '_')}_batch") is not None:
                plan["batch"] = getattr(args, f"{name.replace('-', '_')}_batch")
            folder = workdir / name
            figures: dict[str, Any] = {"dtype": dtype, "plan": {k: v for k, v in plan.items() if k != "configs"}}
            figures["folder"] = write_torch_pipeline(folder, plan["family"], plan["configs"], plan["scheduler_config"],
                                                     options=plan["options"])
            job = {"model": name, "plan": plan, "folder": str(folder), "dtype": dtype, "batches": batches,
                   "cache": str(run / f"cache-{name}"), "compile_peer": args.compile_peer, "smoke": args.smoke}
            if args.peer:  # first: it frees the device when it exits
                figures["peer"] = run_child("peer", job, args.peer_python, child_env, run, args.timeout)
            figures["cold"] = run_child("cold", job, sys.executable, child_env, run, args.timeout)
            figures["warm"] = run_child("warm", job, sys.executable, child_env, run, args.timeout)
            if args.peer:  # per device: ours on all of this host's devices, the peer on one
                ours = figures["cold"]["images_per_second"] / figures["cold"]["devices"]
                figures["ratio"] = ours / figures["peer"]["images_per_second"]
                if "compiled_images_per_second" in figures["peer"]:
                    figures["ratio_compiled"] = ours / figures["peer"]["compiled_images_per_second"]
            everything["models"][name] = figures
            report(plan, figures)
    finally:
        if not os.environ.get("RENDERFARM_KEEP_RUN"):  # set it to keep the logs
            shutil.rmtree(run, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(everything, indent=2, sort_keys=True) + "\n")
        print(f"\nfigures written to {args.json}")


# -- direct: renderfarm render against the blog's Flax pipeline flow ----------------------------------


@contextlib.contextmanager
def quiet_diffusers() -> Iterator[None]:
    """diffusers' Flax classes warn on every use and about the disabled safety checker."""
    import diffusers.utils.logging as dlog
    import transformers.utils.logging as tlog

    old = dlog.get_verbosity(), tlog.get_verbosity()
    dlog.set_verbosity_error()
    tlog.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*Flax classes are deprecated.*")
            warnings.filterwarnings("ignore", category=FutureWarning, module="diffusers")
            yield
    finally:
        dlog.set_verbosity(old[0])
        tlog.set_verbosity(old[1])


def direct_flow(model_dir: str, steps: int, out: Path) -> Callable[[list[str]], None]:
    """The blog's flow: prepare_inputs, shard, pipeline(jit=True), numpy_to_pil, save."""
    import jax
    import numpy as np
    from diffusers import FlaxDDIMScheduler, FlaxStableDiffusionPipeline
    from flax.jax_utils import replicate
    from flax.training.common_utils import shard

    with quiet_diffusers():
        pipeline, params = FlaxStableDiffusionPipeline.from_pretrained(model_dir, safety_checker=None,
                                                                       feature_extractor=None)
        scheduler = FlaxDDIMScheduler.from_config(pipeline.scheduler.config)
        pipeline = type(pipeline)(**{**pipeline.components, "scheduler": scheduler}, dtype=pipeline.dtype)
        params["scheduler"] = scheduler.create_state()
    p_params = replicate(params)
    n = jax.device_count()
    rng = jax.random.split(jax.random.PRNGKey(0), n)
    out.mkdir(parents=True, exist_ok=True)

    def run(prompts: list[str]) -> None:
        for i in range(0, len(prompts), n):
            prompt_ids = shard(pipeline.prepare_inputs(prompts[i:i + n]))
            with quiet_diffusers():
                images = pipeline(prompt_ids, p_params, rng, num_inference_steps=steps, jit=True).images
            images = images.reshape((images.shape[0] * images.shape[1],) + images.shape[-3:])
            for k, image in enumerate(pipeline.numpy_to_pil(np.asarray(images))):
                image.save(out / f"{i + k}.png")

    return run


def engine_flow(model_dir: str, steps: int, out: Path) -> Callable[[list[str]], None]:
    """What `renderfarm render` runs: engine, PNG + sidecar + manifest per job."""
    from diffusion.models import load_model
    from renderfarm.jobs import JobSpec
    from renderfarm.storage import open_storage
    from worker.engine import Engine
    from worker.local import render_to_storage

    engine = Engine(load_model(model_dir))
    storage = open_storage(str(out), durable=False)
    def run(prompts: list[str]) -> None:
        specs = [JobSpec(prompt=p, model=model_dir, seed=i, steps=steps, scheduler="ddim")
                 for i, p in enumerate(prompts)]
        render_to_storage(specs, engine, storage, progress=False)

    return run


def part_direct(args: argparse.Namespace) -> None:
    """Both DDIM (one UNet call per step in both: the tiny model's own PNDM runs `steps + 1` in
    PyTorch, which the engine follows, and `steps` in diffusers' Flax pipeline); both compiled
    and warmed up, then alternating rounds on the same prompts."""
    import jax

    from worker.engine import enable_compilation_cache

    prompts = [f"a lighthouse at dawn, painting number {i}" for i in range(args.images)]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        enable_compilation_cache(root / "jax-cache")
        model_dir = tiny_folder(root)
        flows = {"direct": direct_flow(model_dir, args.steps, root / "direct"),
                 "engine": engine_flow(model_dir, args.steps, root / "engine")}
        for run in flows.values():
            run(prompts[:jax.device_count()])  # compile and warm up
        rates = alternate({name: lambda run=run: run(prompts) for name, run in flows.items()}, args.images,
                          args.rounds)
    direct, engine = statistics.median(rates["direct"]), statistics.median(rates["engine"])
    print(f"tiny SD, 64x64, {args.steps} steps, {args.rounds} rounds of {args.images} images, {machine()}; "
          "median of rounds")
    print(f"direct (blog flow, pmap):        {direct:8.2f} images/s  {rounds_text(rates['direct'])}")
    print(f"engine (renderfarm render):      {engine:8.2f} images/s  {rounds_text(rates['engine'])}")
    print(f"ratio engine/direct:             {engine / direct:8.2f}")


# -- dtype, few-step, flux: the engine on this host's devices --------------------------------------------


def part_dtype(args: argparse.Namespace) -> None:
    """float32 against bfloat16: the same jobs, both compiled first, alternating rounds; the
    pixel difference of the two renders; and the scheduler state's dtype (float32 in both)."""
    import jax
    import numpy as np

    from diffusion.models import load_model
    from worker.engine import Engine, ShapeKey

    dtypes = ("float32", "bfloat16")
    with tempfile.TemporaryDirectory(prefix="rf-dtype-") as tmp:
        folder = tiny_folder(Path(tmp))
        engines = {dtype: Engine(load_model(folder, dtype)) for dtype in dtypes}
        for dtype, engine in engines.items():
            state = engine.scheduler(ShapeKey(64, 64, 4, "pndm")).set_timesteps(4, (1, 4, 8, 8))
            floats = {str(x.dtype) for x in jax.tree.leaves(state)
                      if hasattr(x, "dtype") and np.issubdtype(x.dtype, np.floating)}
            print(f"{dtype}: scheduler state dtypes {sorted(floats)}, "
                  f"UNet params {sorted({str(x.dtype) for x in jax.tree.leaves(engine.model.params['unet'])})}")
        print(f"{machine()}; tiny SD, {args.steps} steps, {args.images} images per round")
        for size in (int(s) for s in args.sizes.split(",")):
            specs = {d: tiny_specs(folder, args.images, steps=args.steps, width=size, height=size, dtype=d)
                     for d in dtypes}
            images = {d: np.stack([r.image for r in engines[d].render(specs[d])]) for d in dtypes}  # compiles
            rates = alternate({d: lambda d=d: engines[d].render(specs[d]) for d in dtypes}, args.images, args.rounds)
            diff = np.abs(images["float32"].astype(int) - images["bfloat16"].astype(int))
            med = {d: statistics.median(r) for d, r in rates.items()}
            for d in dtypes:
                print(f"{size}x{size} {d:8s} {med[d]:7.1f} images/s  {rounds_text(rates[d])}")
            print(f"{size}x{size} bfloat16/float32 {med['bfloat16'] / med['float32']:.2f}; pixels: max |diff| "
                  f"{diff.max()}/255, mean {diff.mean():.2f}/255, {np.mean(diff > 2):.1%} differ by more than 2")


def part_few_step(args: argparse.Namespace) -> None:
    """Guided against cfg-free programs at the same steps, the per-step costs they imply, and a
    few-step trailing cfg-free campaign against the guided campaign it replaces."""
    from diffusion.models import load_model
    from worker.engine import Engine

    with tempfile.TemporaryDirectory(prefix="rf-few-step-") as tmp:
        folder = tiny_folder(Path(tmp))
        engine = Engine(load_model(folder))
        few, baseline = f"{args.few_steps} steps trailing, guidance 1.0", f"{args.baseline_steps} steps, guidance 7.5"
        variants = {"guidance 7.5": (args.steps, 7.5, None), "guidance 1.0": (args.steps, 1.0, None),
                    few: (args.few_steps, 1.0, "trailing"), baseline: (args.baseline_steps, 7.5, None)}
        specs = {name: tiny_specs(folder, args.images, steps=steps, guidance_scale=guidance, width=args.size,
                                  height=args.size, timestep_spacing=spacing)
                 for name, (steps, guidance, spacing) in variants.items()}
        print(f"{machine()}; tiny SD {args.size}x{args.size}, {args.images} images per round")
        for name in variants:
            engine.prepare(specs[name])  # compile
        rates = alternate({name: lambda name=name: engine.render(specs[name]) for name in variants},
                          args.images, args.rounds)
    med = {name: statistics.median(r) for name, r in rates.items()}
    for name, (steps, _, _) in variants.items():
        print(f"{name:34s} {steps:3d} steps {med[name]:7.2f} images/s  {rounds_text(rates[name])}")
    seconds = {name: 1 / rate for name, rate in med.items()}  # per image
    free_step = (seconds["guidance 1.0"] - seconds[few]) / (args.steps - args.few_steps)
    once = seconds[few] - args.few_steps * free_step
    guided_step = (seconds["guidance 7.5"] - once) / args.steps
    print(f"per image: {once * 1e3:.1f} ms once, then a step {free_step * 1e3:.2f} ms cfg-free, "
          f"{guided_step * 1e3:.2f} ms guided ({guided_step / free_step:.2f}x)")
    print(f"cfg-free / guided at {args.steps} steps: {med['guidance 1.0'] / med['guidance 7.5']:.2f} (target >= 1.8)")
    print(f"{args.few_steps}-step trailing cfg-free / {args.baseline_steps}-step guided campaign: "
          f"{med[few] / med[baseline]:.1f}x images/s")


def part_flux(args: argparse.Namespace) -> None:
    """`renderfarm tiny-model --kind flux` rendered by the engine, compile excluded."""
    from diffusion.models import load_model
    from worker.engine import Engine

    with tempfile.TemporaryDirectory(prefix="rf-flux-") as tmp:
        folder = tiny_folder(Path(tmp), "flux")
        engine = Engine(load_model(folder))
        specs = tiny_specs(folder, args.images, steps=args.steps, guidance_scale=3.5, width=args.size, height=args.size)
        started = time.perf_counter()
        engine.prepare(specs)
        compiled = time.perf_counter() - started
        rates = alternate({"flux": lambda: engine.render(specs)}, args.images, args.rounds)["flux"]
    print(f"tiny Flux (dev layout) {args.size}x{args.size}, {args.steps} steps, {args.images} images a round, "
          f"{machine()}: {statistics.median(rates):.2f} images/s {rounds_text(rates)}; compiled in {compiled:.0f} s")


def median_seconds(call: Callable[[], Any], repeats: int) -> float:
    """Median seconds of `repeats` calls, after one untimed call (the compile, the first run)."""
    call()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _dispatch_seconds(engine: Any, specs: list[Any], repeats: int) -> float:
    """Median seconds of one batch of `specs` on the devices (no host work after it)."""
    import jax

    key = engine.check(specs[0])
    return median_seconds(lambda: jax.block_until_ready(engine.dispatch(key, specs)[0]), repeats)


def part_img2img(args: argparse.Namespace) -> None:
    """One image-to-image program for every strength: batches of one strength and of mixed ones
    against text to image, on the oracle's tiny SD 1.x checkpoint (64x64, euler, guided)."""
    from diffusion.models import load_model
    from renderfarm.jobs import JobSpec
    from worker.engine import Engine

    data = ROOT / "tests" / "data"
    model = load_model(str(data / "oracle" / "sd1" / "model"))
    engine = Engine(model)
    n = engine.batch_size

    def jobs(strengths: list[float | None]) -> list[JobSpec]:
        return [JobSpec(prompt=f"a harbour {i}", model=model.ref, seed=i, steps=args.steps, scheduler="euler",
                        width=64, height=64, strength=s,
                        init_image=None if s is None else str(data / "img2img" / "init.png"))
                for i, s in enumerate(strengths)]

    text = _dispatch_seconds(engine, jobs([None] * n), args.repeats)
    print(f"text to image, {args.steps} steps: {text * 1e3:.0f} ms a batch of {n}")
    for label, strengths in (("1.0", [1.0] * n), ("0.8", [0.8] * n), ("0.3", [0.3] * n),
                             ("0.3 and 0.8 mixed", [0.3, 0.8] * (n // 2))):
        t = _dispatch_seconds(engine, jobs(strengths), args.repeats)
        print(f"image to image, strength {label}: {t * 1e3:.0f} ms a batch ({t / text:.2f} of text to image)")
    print(f"programs compiled: {engine.compiles} (one text to image, one image to image)")


def part_scores(args: argparse.Namespace) -> None:
    """A tiny SD batch (64x64, 8 steps, one job a device) with and without the oracle's tiny
    scoring models (CLIP, safety checker, aesthetic predictor): what the scores add here."""
    from diffusion.models import load_model
    from diffusion.scores import load_scorers
    from worker.engine import Engine

    data = ROOT / "tests" / "data" / "scores"
    with tempfile.TemporaryDirectory() as tmp:
        model = load_model(tiny_folder(Path(tmp)))
    scorers = load_scorers(data / "safety_checker", data / "clip", data / "aesthetic.safetensors")
    medians = []
    for engine, scores in ((Engine(model), None), (Engine(model, scorers=scorers), ("safety", "clip", "aesthetic"))):
        specs = tiny_specs(model.ref, engine.batch_size, steps=8, width=64, height=64, scores=scores)
        medians.append(median_seconds(lambda engine=engine, specs=specs: engine.render(specs), args.repeats))
    plain, scored = medians
    print(f"tiny SD batch, 64x64, 8 steps, {machine()}: {plain:.3f} s, with the scores {scored:.3f} s "
          f"({(scored - plain) / plain:+.1%}; medians of {args.repeats})")


# -- shapes, warmstart: a real worker process ------------------------------------------------------------

SHAPES = ((64, 64), (96, 64), (64, 96))  # the tiny model's size step is 16
WARM_SHAPES = "64x64@25,128x128@25"
# The worker's log lines that end a phase of its start, and what the phase is called.
PHASES = {"loaded in": "imports and model", "ready in": "shapes", "ready.": "Celery"}
LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO \S+: (.*)$")


def part_shapes(args: argparse.Namespace) -> None:
    """Jobs of three shapes interleaved on one queue, one worker at batch 8 and its default
    `--max-wait` of 2 s; every sidecar names its batch, from which the fill and order follow."""
    from harness.farm import WorkerProcess, farm_app, manifest_ids, manifest_records, wait_for
    from harness.redis_server import RedisServer
    from producer.submit import submit_jobs
    from renderfarm.jobs import JobSpec
    from renderfarm.progress import Progress
    from renderfarm.settings import Settings
    from renderfarm.storage import open_storage

    with tempfile.TemporaryDirectory(prefix="rf-bench-") as tmp:
        model = tiny_folder(Path(tmp))
        server = RedisServer(appendonly=False)
        out = Path(tmp) / "out"
        precompile = ",".join(f"{w}x{h}@{args.steps}" for w, h in SHAPES)
        worker = WorkerProcess(Path(model), str(out), server.url, "shapes", Path(tmp), precompile=precompile,
                               extra=("--max-wait", "2"))
        try:
            worker.wait_ready(farm_app(server.url), timeout=600)
            specs = [JobSpec(prompt=f"a lighthouse, variation {i}", model=model, seed=i, steps=args.steps,
                             width=SHAPES[i % 3][0], height=SHAPES[i % 3][1], campaign="shapes")
                     for i in range(args.jobs)]  # interleaved: shape 0, 1, 2, 0, 1, 2, ...
            submit_jobs(lambda: specs, Settings(broker_url=server.url))
            progress = Progress(server.client())
            wait_for(lambda: progress.status("shapes")["done"] >= args.jobs, 900, f"{args.jobs} jobs")
        finally:
            worker.stop()
            server.close()
        storage = open_storage(str(out))
        assert len(set(manifest_ids(storage, "shapes"))) == args.jobs
        batches = {record["batch"]["seq"]: {**record["batch"], "shape": (record["width"], record["height"])}
                   for record in manifest_records(storage, "shapes")}
    jobs = sum(b["jobs"] for b in batches.values())
    slots = sum(b["slots"] for b in batches.values())
    order = [batches[seq]["shape"] for seq in sorted(batches)]
    runs: dict[tuple[int, int], list[int]] = defaultdict(list)
    for position, shape in enumerate(order):
        runs[shape].append(position)
    print(f"{jobs} jobs of {len(runs)} shapes, interleaved on one queue, in {len(batches)} batches "
          f"of {slots // len(batches)} slots")
    print(f"fill: {jobs} jobs / {slots} slots = {jobs / slots:.3f} (target >= 0.9)")
    for shape, positions in sorted(runs.items()):
        gaps = [b - a - 1 for a, b in zip(positions, positions[1:])]
        print(f"  {shape[0]}x{shape[1]}: {len(positions)} batches, last at {positions[-1] + 1} of {len(order)}, "
              f"max other batches between two of its own: {max(gaps, default=0)}")
    print("batch order:", " ".join("ABC"[sorted(runs).index(s)] for s in order))


def _phases(log: Path, started: float, stored: float) -> str:
    """Seconds each phase of a worker's start took, from its log timestamps (millisecond grain):
    imports and model load, the precompiled shapes, Celery, then to the first stored image."""
    ends = {"first image": stored}
    for line in log.read_text().splitlines():
        match = LOG_LINE.match(line)
        for marker, phase in PHASES.items() if match else ():
            if marker in match[2]:  # type: ignore[index]  # a phase ends at its last such line
                ends[phase] = datetime.datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()  # type: ignore[index]
    previous, parts = started, []
    for phase in [*PHASES.values(), "first image"]:
        end = ends.get(phase, previous)
        parts.append(f"{phase} {end - previous:.1f}")
        previous = end
    return ", ".join(parts)


def _first_image_seconds(model: str, tmp: Path, cache: Path, run: str) -> tuple[float, str]:
    """A fresh worker against a queue that already holds one job: seconds until it is stored
    (polled every 10 ms, the figure's grain), and how they were spent."""
    from harness.farm import WorkerProcess, enqueue, farm_app, wait_for
    from harness.redis_server import RedisServer
    from renderfarm.jobs import JobSpec
    from renderfarm.layout import sidecar_name
    from renderfarm.progress import Progress
    from renderfarm.storage import open_storage

    server = RedisServer(appendonly=False)
    out = tmp / f"out-{run}"
    spec = JobSpec(prompt=f"a lighthouse at dusk ({run})", model=model, seed=1, campaign="warm")
    enqueue(farm_app(server.url), Progress(server.client()), [spec])
    started, wall = time.perf_counter(), time.time()
    worker = WorkerProcess(Path(model), str(out), server.url, f"warm-{run}", tmp, precompile=WARM_SHAPES,
                           env={"RENDERFARM_COMPILE_CACHE": str(cache)})
    try:
        storage = open_storage(str(out))
        wait_for(lambda: storage.exists(sidecar_name("warm", spec.job_id)), 600, "the first image", interval=0.01)
        seconds = time.perf_counter() - started
        return seconds, _phases(worker.log, wall, wall + seconds)
    finally:
        worker.stop()
        server.close()


def part_warmstart(args: argparse.Namespace) -> None:
    """A new `renderfarm worker` with two precompiled shapes and a job already waiting: seconds
    to its first stored image with an empty cache folder, then with the one that start filled."""
    colds, warms = [], []
    with tempfile.TemporaryDirectory(prefix="rf-bench-") as tmp:
        model = tiny_folder(Path(tmp))
        for r in range(args.rounds):
            cache = Path(tmp) / f"cache-{r}"
            for name, runs in (("cold", colds), ("warm", warms)):
                seconds, spent = _first_image_seconds(model, Path(tmp), cache, f"{name}{r}")
                runs.append(seconds)
                print(f"round {r + 1}: {name} {seconds:.1f} s ({spent})")
    cold, warm = statistics.median(colds), statistics.median(warms)
    print(f"start to first stored image, tiny SD, shapes {WARM_SHAPES}: cold {cold:.1f} s, warm {warm:.1f} s, "
          f"warm/cold {warm / cold:.2f} (target <= 0.3)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parts = parser.add_subparsers(dest="part")
    device = parts.add_parser("device", help="full-size models on a device, beside diffusers (default)")
    device.add_argument("--models", default=",".join(RUNS), help=f"comma-separated: {', '.join(RUNS)}")
    device.add_argument("--smoke", action="store_true", help="tiny models, one CPU device, 2 steps, 64x64")
    device.add_argument("--peer", action="store_true", help="time diffusers' PyTorch pipeline too")
    device.add_argument("--peer-python", default=sys.executable, help="a python with torch and diffusers")
    device.add_argument("--compile-peer", action="store_true", help="the peer with a torch.compile'd denoiser too")
    device.add_argument("--dtype", default=None, help="ours: bfloat16 (default; float32 with --smoke)")
    for name, run in RUNS.items():
        device.add_argument(f"--{name}-batch", type=int, help=f"per device (default {run.batch}; "
                                                             f"{SMOKE['batch']} with --smoke)")
    device.add_argument("--batches", type=int, help=f"timed batches after the first (default {SMOKE['batches']})")
    device.add_argument("--workdir", default=str(ROOT / "build" / "accelerator"), help="model folders, kept")
    device.add_argument("--timeout", type=float, default=900, help="seconds per measured process")
    device.add_argument("--json", metavar="FILE", help="write every figure here")
    device.add_argument("--child", nargs=2, metavar=("JOB", "RESULT"), help=argparse.SUPPRESS)
    direct = parts.add_parser("direct", help="renderfarm render against the blog's Flax pipeline flow")
    direct.add_argument("--images", type=int, default=128, help="per round")
    direct.add_argument("--rounds", type=int, default=3)
    direct.add_argument("--steps", type=int, default=4)
    dtype = parts.add_parser("dtype", help="float32 against bfloat16 on this CPU")
    dtype.add_argument("--sizes", default="64,256")
    dtype.add_argument("--steps", type=int, default=4)
    dtype.add_argument("--images", type=int, default=64, help="images per round")
    dtype.add_argument("--rounds", type=int, default=5)
    few = parts.add_parser("few-step", help="cfg-free against guided programs")
    few.add_argument("--size", type=int, default=256)
    few.add_argument("--steps", type=int, default=50, help="steps of the guided and cfg-free pair")
    few.add_argument("--few-steps", type=int, default=4, help="steps of the few-step cfg-free campaign")
    few.add_argument("--baseline-steps", type=int, default=25, help="steps of the guided campaign it replaces")
    few.add_argument("--images", type=int, default=32, help="images per round and variant")
    few.add_argument("--rounds", type=int, default=3)
    flux = parts.add_parser("flux", help="a tiny Flux on this host's devices")
    flux.add_argument("--images", type=int, default=64, help="per round")
    flux.add_argument("--size", type=int, default=64)
    flux.add_argument("--steps", type=int, default=4)
    flux.add_argument("--rounds", type=int, default=3)
    img2img = parts.add_parser("img2img", help="image-to-image strengths against text to image")
    img2img.add_argument("--steps", type=int, default=20)
    img2img.add_argument("--repeats", type=int, default=5)
    scores = parts.add_parser("scores", help="a tiny batch with and without the device scores")
    scores.add_argument("--repeats", type=int, default=5)
    shapes = parts.add_parser("shapes", help="batch slots filled by three interleaved shapes")
    shapes.add_argument("--jobs", type=int, default=300)
    shapes.add_argument("--steps", type=int, default=4)
    warmstart = parts.add_parser("warmstart", help="a worker's start to its first image, cold and warm")
    warmstart.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(sys.argv[1:] or ["device"])
    {"device": part_device, "direct": part_direct, "dtype": part_dtype, "few-step": part_few_step,
     "flux": part_flux, "img2img": part_img2img, "scores": part_scores, "shapes": part_shapes,
     "warmstart": part_warmstart}[args.part](args)


if __name__ == "__main__":
    main()
