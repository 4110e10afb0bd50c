"""Accelerators: full-size SD 1.5 and SDXL, random weights, through the worker's own loader and
engine, with diffusers' PyTorch pipeline beside them (issue 23, items 2, 4 and 5). Not a test.

Per model it prints: the seconds to load the folder (diffusion.models.load_model), to compile
the program cold (empty caches) and warm (a second process that finds the saved executable
the first left, worker/executables.py, as `renderfarm worker --compile-cache` does), the
images/s in steady state, XLA's FLOPs per image (diffusion/flops.py) and the fraction of the
device's peak, and the devices' peak memory (Engine.peak_memory: `memory_stats()`, which
XLA's CPU backend does not give). With `--peer` it times diffusers' PyTorch pipeline on the
same folder, steps and per-device batch on one device (float16, eager, SDPA; `--compile-peer`
adds a torch.compile'd UNet) and prints ours / theirs per device.

The models are written here, torch-free and without a download: diffusers folders in
PyTorch's safetensors format (float16), with the published configs of
stable-diffusion-v1-5 and stable-diffusion-xl-base-1.0 (model_index.json, unet, vae,
text_encoder(s), scheduler) and random weights. The tokenizers are diffusion/tiny.py's byte-level
CLIP BPE (514 tokens) in front of text encoders with the real 49,408 embedding rows: the
ids change, the work does not. Folders are kept under --workdir and reused.

Shapes: DDIM, guidance 7.5, SD 1.5 512x512 25 steps, 8 images per device; SDXL
1024x1024 20 steps, 4 per device (flags). Every measured part runs in a process of its own,
so torch and JAX never share a device and each number has a clean start: the peer first,
then ours cold, then ours warm (that one loads the model again and serves one batch).

Usage, on a GPU or TPU VM with the worker installed (`pip install .[worker]`), from the
repository root; the peer needs torch and diffusers, in this venv or another one:

    PYTHONPATH=. python bench/accelerator.py --json out.json
    PYTHONPATH=. python bench/accelerator.py --peer --json out.json
    PYTHONPATH=. python bench/accelerator.py --peer --peer-python /opt/torch/bin/python --compile-peer
    PYTHONPATH=. python bench/accelerator.py --models sdxl --sdxl-batch 8
    PYTHONPATH=. python bench/accelerator.py --smoke [--peer]     # tiny models, one CPU device, ~1 min
    PYTHONPATH=. python bench/accelerator.py --memory             # the memory arithmetic (CPU, ~3 min)

Budget: both models, with the peer, meant to take under 5 minutes on one H100: one first batch
and 2 timed ones per measured process (`--batches`); the folders (2.1 GB and 6.9 GB) are
written once under --workdir and reused. Logs of the measured processes go to a run folder
under --workdir, removed at the end unless RENDERFARM_KEEP_RUN=1; a failed one prints the
end of its log. `--memory` compiles the full-size programs on this CPU at batch 1 and 2
(XLA's memory_analysis) and prints the largest batch per device that fits, by arithmetic, on
an 80 GB GPU and a 16 GB TPU v5e chip (docs/performance.md, "Accelerators"). With
JAX_PLATFORMS=cpu (as `make bench` exports it) the plain command runs --smoke.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "a lighthouse on a cliff at dusk, oil painting, detailed"
GUIDANCE = 7.5
SCHEDULER = "ddim"
WRITER_VERSION = 1  # part of a kept folder's marker: a change of the writer rewrites it

# The published configs (each component's config.json), as diffusers and transformers save them.
SD_SCHEDULER = {
    "_class_name": "PNDMScheduler", "beta_end": 0.012, "beta_schedule": "scaled_linear", "beta_start": 0.00085,
    "clip_sample": False, "num_train_timesteps": 1000, "set_alpha_to_one": False, "skip_prk_steps": True,
    "steps_offset": 1, "trained_betas": None,
}
SDXL_SCHEDULER = {
    "_class_name": "EulerDiscreteScheduler", "beta_end": 0.012, "beta_schedule": "scaled_linear",
    "beta_start": 0.00085, "clip_sample": False, "interpolation_type": "linear", "num_train_timesteps": 1000,
    "prediction_type": "epsilon", "sample_max_value": 1.0, "set_alpha_to_one": False, "skip_prk_steps": True,
    "steps_offset": 1, "timestep_spacing": "leading", "trained_betas": None, "use_karras_sigmas": False,
}
SD15_UNET = {
    "_class_name": "UNet2DConditionModel", "act_fn": "silu", "attention_head_dim": 8,
    "block_out_channels": [320, 640, 1280, 1280], "center_input_sample": False, "cross_attention_dim": 768,
    "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
    "downsample_padding": 1, "flip_sin_to_cos": True, "freq_shift": 0, "in_channels": 4, "layers_per_block": 2,
    "mid_block_scale_factor": 1, "norm_eps": 1e-05, "norm_num_groups": 32, "out_channels": 4, "sample_size": 64,
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
}
SDXL_UNET = {
    "_class_name": "UNet2DConditionModel", "act_fn": "silu", "addition_embed_type": "text_time",
    "addition_embed_type_num_heads": 64, "addition_time_embed_dim": 256, "attention_head_dim": [5, 10, 20],
    "block_out_channels": [320, 640, 1280], "center_input_sample": False, "class_embed_type": None,
    "class_embeddings_concat": False, "conv_in_kernel": 3, "conv_out_kernel": 3, "cross_attention_dim": 2048,
    "cross_attention_norm": None, "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    "downsample_padding": 1, "dual_cross_attention": False, "encoder_hid_dim": None, "encoder_hid_dim_type": None,
    "flip_sin_to_cos": True, "freq_shift": 0, "in_channels": 4, "layers_per_block": 2,
    "mid_block_only_cross_attention": None, "mid_block_scale_factor": 1, "mid_block_type": "UNetMidBlock2DCrossAttn",
    "norm_eps": 1e-05, "norm_num_groups": 32, "num_attention_heads": None, "num_class_embeds": None,
    "only_cross_attention": False, "out_channels": 4, "projection_class_embeddings_input_dim": 2816,
    "resnet_out_scale_factor": 1.0, "resnet_skip_time_act": False, "resnet_time_scale_shift": "default",
    "sample_size": 128, "time_cond_proj_dim": None, "time_embedding_act_fn": None, "time_embedding_dim": None,
    "time_embedding_type": "positional", "timestep_post_act": None, "transformer_layers_per_block": [1, 2, 10],
    "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"], "upcast_attention": None,
    "use_linear_projection": True,
}
VAE = {  # SD 1.5's; SDXL's differs in sample_size, scaling_factor and force_upcast
    "_class_name": "AutoencoderKL", "act_fn": "silu", "block_out_channels": [128, 256, 512, 512],
    "down_block_types": ["DownEncoderBlock2D"] * 4, "in_channels": 3, "latent_channels": 4, "layers_per_block": 2,
    "norm_num_groups": 32, "out_channels": 3, "sample_size": 512,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
}
SDXL_VAE = {**VAE, "sample_size": 1024, "scaling_factor": 0.13025, "force_upcast": True}
CLIP_L = {  # openai/clip-vit-large-patch14's text tower: SD 1.5's encoder and SDXL's first
    "architectures": ["CLIPTextModel"], "attention_dropout": 0.0, "dropout": 0.0, "hidden_act": "quick_gelu",
    "hidden_size": 768, "initializer_factor": 1.0, "initializer_range": 0.02, "intermediate_size": 3072,
    "layer_norm_eps": 1e-05, "max_position_embeddings": 77, "model_type": "clip_text_model",
    "num_attention_heads": 12, "num_hidden_layers": 12, "projection_dim": 768, "vocab_size": 49408,
}
CLIP_BIGG = {  # SDXL's text_encoder_2 (OpenCLIP ViT-bigG/14's text tower, with its projection)
    **CLIP_L, "architectures": ["CLIPTextModelWithProjection"], "hidden_act": "gelu", "hidden_size": 1280,
    "intermediate_size": 5120, "num_attention_heads": 20, "num_hidden_layers": 32, "projection_dim": 1280,
}

# name -> (label, family, size, steps, per-device batch, component configs, scheduler config)
FULL = {
    "sd15": ("SD 1.5", "sd", 512, 25, 8, {"unet": SD15_UNET, "vae": VAE, "text_encoder": CLIP_L}, SD_SCHEDULER),
    "sdxl": ("SDXL", "sdxl", 1024, 20, 4,
             {"unet": SDXL_UNET, "vae": SDXL_VAE, "text_encoder": CLIP_L, "text_encoder_2": CLIP_BIGG}, SDXL_SCHEDULER),
}
SMOKE = {"size": 64, "steps": 2, "batch": 2, "batches": 2}  # on one CPU device
# device -> (bytes, the share JAX may use): on a GPU JAX's allocator takes 75% of the memory by
# default (XLA_PYTHON_CLIENT_MEM_FRACTION); on a TPU it has the whole HBM, of which 10% is left
# here for fragmentation and the runtime.
MEMORY_DEVICES = {"80 GB GPU (H100, A100 80GB)": (80e9, 0.75), "16 GB TPU v5e chip": (16e9, 0.90)}


# -- writing the models (torch-free) ----------------------------------------------------------------


def model_plans(smoke: bool) -> dict[str, dict[str, Any]]:
    """Per model: label, family, size, steps, per-device batch and the configs written."""
    from diffusion.tiny_parts import text_config, unet_config, vae_config

    plans = {}
    for name, (label, family, size, steps, batch, configs, scheduler) in FULL.items():
        if smoke:  # diffusion/tiny.py's configs; its tokenizers have 514 tokens (bos 512, eos 513)
            configs = {"unet": unet_config(family), "vae": vae_config(family), "text_encoder": text_config(514)}
            if family == "sdxl":
                configs["text_encoder_2"] = text_config(514, hidden_act="gelu")
            size, steps, batch = SMOKE["size"], SMOKE["steps"], SMOKE["batch"]
        plans[name] = {"label": label, "family": family, "size": size, "steps": steps, "batch": batch,
                       "configs": configs, "scheduler": scheduler}
    return plans


def _torch_name(kind: str, path: tuple[str, ...]) -> str:
    """The PyTorch (diffusers / transformers) name of our Flax parameter `path`: the inverse of
    diffusion.convert.target, which `tests/test_bench_accelerator.py` checks against the oracle's
    checkpoints saved by diffusers itself."""
    *layers, leaf = path
    if kind in ("unet", "vae"):
        renamed = []
        for layer in layers:
            if kind == "vae" and layer in _VAE_ATTENTION:
                renamed.append(_VAE_ATTENTION[layer])
                continue
            stem, _, index = layer.rpartition("_")
            # a list's index joined to its name (down_blocks_0); linear_1 / linear_2 are names
            renamed.append(f"{stem}.{index}" if index.isdigit() and stem and stem != "linear" else layer)
        layers = renamed
    return ".".join([*layers, "weight" if leaf in ("kernel", "scale", "embedding") else leaf])


_VAE_ATTENTION = {"query": "to_q", "key": "to_k", "value": "to_v", "proj_attn": "to_out.0"}


def _torch_shape(leaf: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Flax kernels are (H, W, I, O) and (in, out); PyTorch's (O, I, H, W) and (out, in)."""
    if leaf == "kernel" and len(shape) == 4:
        return (shape[3], shape[2], shape[0], shape[1])
    if leaf == "kernel" and len(shape) == 2:
        return (shape[1], shape[0])
    return tuple(shape)


class _Values:
    """Random float16 values fast enough for 3.5 billion parameters: one pool of standard normals,
    pre-scaled once per distinct scale, read at a random offset per tensor (cyclically).
    Flax's default initialisers' shapes: LeCun normal kernels and embeddings, zero biases, unit
    norm scales. For timing, not for images: the weights only have to be finite and sane."""

    POOL = 1 << 22

    def __init__(self, seed: int) -> None:
        import numpy as np

        self.np = np
        self.rng = np.random.default_rng(seed)
        self.pool = self.rng.standard_normal(self.POOL, dtype=np.float32)
        self.scaled: dict[float, bytes] = {}

    def chunks(self, leaf: str, flax_shape: tuple[int, ...]) -> Any:
        np = self.np
        n = math.prod(flax_shape)
        if leaf in ("bias", "scale"):
            value = np.zeros(min(n, self.POOL), np.float16) + (1.0 if leaf == "scale" else 0.0)
            data = value.tobytes()
            start = 0
        else:
            scale = float(1.0 / math.sqrt(max(1, math.prod(flax_shape[:-1]))))
            if scale not in self.scaled:
                self.scaled[scale] = (self.pool * scale).astype(np.float16).tobytes()
            data = self.scaled[scale]
            start = int(self.rng.integers(self.POOL)) * 2
        left = n * 2
        while left:
            piece = data[start:start + left]
            yield piece
            left -= len(piece)
            start = 0


def write_safetensors(path: Path, tensors: list[tuple[str, tuple[int, ...], Any]]) -> int:
    """A safetensors file of float16 tensors (name, shape, iterator of their bytes), streamed:
    an 8-byte little-endian header length, the JSON header, the data in header order."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, _ in tensors:
        size = math.prod(shape) * 2
        header[name] = {"dtype": "F16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    with partial.open("wb") as out:
        out.write(struct.pack("<Q", len(text)))
        out.write(text)
        for _, _, chunks in tensors:
            for chunk in chunks:
                out.write(chunk)
    os.replace(partial, path)
    return offset


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_pipeline(out: Path, plan: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    """A diffusers folder in PyTorch's format: model_index.json, each component's config.json
    and float16 safetensors (random weights), diffusion/tiny.py's tokenizers, the scheduler
    config. Kept: a second call with the same plan returns at once. Returns what it wrote."""
    from flax.traverse_util import flatten_dict

    from diffusion.families import FAMILIES
    from diffusion.nn import parameter_shapes
    from diffusion.tiny_parts import EOS, clip_tokenizer_files

    digest = hashlib.sha256(json.dumps([plan["configs"], plan["scheduler"], seed, WRITER_VERSION],
                                       sort_keys=True).encode()).hexdigest()
    marker = out / ".complete"
    if marker.is_file() and marker.read_text() == digest:
        return {"written": False, "seconds": 0.0, "bytes": _weights_bytes(out)}
    started = time.perf_counter()
    shutil.rmtree(out, ignore_errors=True)
    family = FAMILIES[plan["family"]]
    vocab = clip_tokenizer_files(out / "tokenizer", pad=EOS)
    if plan["family"] == "sdxl":
        clip_tokenizer_files(out / "tokenizer_2", pad="!")  # as SDXL's second tokenizer pads
    index: dict[str, Any] = {"_class_name": family.pipelines[0], "_diffusers_version": "0.42.1",
                             "feature_extractor": [None, None], "image_encoder": [None, None],
                             "scheduler": ["diffusers", plan["scheduler"]["_class_name"]]}
    if plan["family"] == "sd":
        index |= {"safety_checker": [None, None], "requires_safety_checker": False}
    else:
        index["force_zeros_for_empty_prompt"] = True
    values = _Values(seed)
    for name, component in sorted(family.components.items()):
        config = dict(plan["configs"][name])
        if component.kind.startswith("clip"):  # the tokenizer's special ids, whatever the vocabulary size
            config |= {"bos_token_id": vocab - 2, "eos_token_id": vocab - 1, "pad_token_id": vocab - 1}
        module = component.module(component.config.from_dict(config))
        shapes = flatten_dict(parameter_shapes(module))
        tensors = [(_torch_name(component.kind, path), _torch_shape(path[-1], tuple(leaf.shape)),
                    values.chunks(path[-1], tuple(leaf.shape))) for path, leaf in shapes.items()]
        tensors.sort(key=lambda t: t[0])
        _write_json(out / name / "config.json", config)
        weights = "model.safetensors" if component.kind.startswith("clip") else "diffusion_pytorch_model.safetensors"
        write_safetensors(out / name / weights, tensors)
        library = "transformers" if component.kind.startswith("clip") else "diffusers"
        index[name] = [library, type(module).__name__]
    for name in family.tokenizers:
        index[name] = ["transformers", "CLIPTokenizer"]
    _write_json(out / "scheduler" / "scheduler_config.json", plan["scheduler"])
    _write_json(out / "model_index.json", index)
    marker.write_text(digest)
    return {"written": True, "seconds": time.perf_counter() - started, "bytes": _weights_bytes(out)}


def _weights_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*.safetensors"))


# -- the measured processes -------------------------------------------------------------------------


def _specs(folder: Path, plan: dict[str, Any], dtype: str, count: int, offset: int) -> list[Any]:
    from renderfarm.jobs import JobSpec

    return [JobSpec(prompt=f"{PROMPT}, {offset + i}", model=str(folder), seed=offset + i, steps=plan["steps"],
                    guidance_scale=GUIDANCE, width=plan["size"], height=plan["size"], scheduler=SCHEDULER,
                    dtype=dtype) for i in range(count)]


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
    specs = _specs(folder, plan, job["dtype"], engine.batch_size, 0)
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
        timed = _specs(folder, plan, job["dtype"], engine.batch_size * job["batches"], engine.batch_size)
        started = time.perf_counter()
        engine.render(timed)
        seconds = time.perf_counter() - started
        result |= {"steady_seconds": seconds, "steady_images": len(timed), "images_per_second": len(timed) / seconds}
        if flops is not None and peak is not None:
            result["fraction_of_peak"] = result["flops_per_image"] * result["images_per_second"] / (peak * len(devices))
    return result


def child_peer(job: dict[str, Any]) -> dict[str, Any]:
    """diffusers' PyTorch pipeline on the same folder: float16 on a GPU (float32 on a CPU,
    where float16 kernels are missing or slow), SDPA attention, DDIM from the model's scheduler
    config, the same batch, steps, size and guidance; the first call, then `batches` timed."""
    import diffusers
    import torch
    from diffusers import DDIMScheduler, StableDiffusionPipeline, StableDiffusionXLPipeline

    imported = time.time()
    plan = job["plan"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not job["smoke"]:  # a TPU VM, say: full size on its CPU would take hours
        raise SystemExit("the peer needs a CUDA device (torch.cuda.is_available() is False); run without --peer")
    dtype = torch.float16 if device == "cuda" else torch.float32
    cls = StableDiffusionXLPipeline if plan["family"] == "sdxl" else StableDiffusionPipeline
    started = time.perf_counter()
    pipe = cls.from_pretrained(job["folder"], torch_dtype=dtype).to(device)
    if device == "cuda":
        torch.cuda.synchronize()
    load_seconds = time.perf_counter() - started
    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    batch = plan["batch"]  # one device
    processors = sorted({type(p).__name__ for p in pipe.unet.attn_processors.values()})

    def call(seed: int) -> None:
        generator = torch.Generator(device).manual_seed(seed)
        pipe(prompt=[f"{PROMPT}, {seed + i}" for i in range(batch)], num_inference_steps=plan["steps"],
             guidance_scale=GUIDANCE, height=plan["size"], width=plan["size"], generator=generator,
             output_type="np")
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
            pipe.unet.to(memory_format=torch.channels_last)
        pipe.unet = torch.compile(pipe.unet, fullgraph=True)
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
        proc = subprocess.run([python, str(Path(__file__).resolve()), "--child", str(job_file), str(result_file)],
                              cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, check=False)
    if proc.returncode != 0 or not result_file.is_file():
        tail = "\n".join(log_file.read_text(errors="replace").splitlines()[-30:])
        raise SystemExit(f"{name} failed (exit {proc.returncode}); the end of {log_file}:\n{tail}")
    return {**json.loads(result_file.read_text()), "wall_seconds": time.time() - job["spawned"]}


# -- the memory arithmetic --------------------------------------------------------------------------


def memory_arithmetic(plans: dict[str, dict[str, Any]], batches: tuple[int, ...] = (1, 2)) -> dict[str, Any]:
    """The largest per-device batch that fits, by arithmetic: weights in bfloat16 (2 bytes a
    parameter; the engine keeps a whole copy on every device) plus the working memory of the
    whole program (text encoders, the UNet loop, the VAE decode), which is XLA's temp bytes
    (`memory_analysis()`) of the program compiled here, on the CPU, for one device at
    `batches` images: a fixed part and a part per image, from the two.

    Compiled in float32, as an upper bound of bfloat16's working memory: XLA:CPU has no
    bfloat16 matmuls and keeps float32 copies of bfloat16 weights for them (measured: SD 1.5
    in bfloat16 has 3.55 GB of fixed temp, 4 bytes x its UNet's 859.5 M parameters), which
    would hide the activations, and which GPUs and TPUs never make. Attention is traced as
    the memory-bounded "chunked" kernel, the stand-in here for cuDNN's and splash's flash
    kernels, which never hold a whole score matrix either."""
    import jax
    import jax.numpy as jnp

    from diffusion.families import FAMILIES
    from diffusion.family import Networks
    from diffusion.generate import Static
    from diffusion.nn import parameter_shapes
    from diffusion.nn.attention import use_kernel
    from diffusion.schedulers import make

    results = {}
    for name, plan in plans.items():
        family = FAMILIES[plan["family"]]
        modules, params, counts = {}, {}, {}
        for component, spec in family.components.items():
            module = spec.module(spec.config.from_dict(dict(plan["configs"][component])), dtype=jnp.float32)
            params[component] = parameter_shapes(module)
            counts[component] = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params[component]))
            modules[component] = module
        networks = Networks(tuple(modules.items()), family.options)
        scheduler = make(SCHEDULER, plan["scheduler"])
        static = Static(plan["size"], plan["size"], plan["steps"], True)
        temps = {}
        lengths = [types.SimpleNamespace(max_length=77) for _ in family.tokenizers]  # CLIP's 77 positions each
        for batch in batches:
            inputs = family.abstract_inputs(lengths, batch)
            started = time.perf_counter()
            program = functools.partial(family.generate, networks, scheduler, static)
            with use_kernel("chunked"):
                lowered = jax.jit(program).lower(params, inputs)
            temps[batch] = lowered.compile().memory_analysis().temp_size_in_bytes
            print(f"  {plan['label']} {plan['size']}x{plan['size']} batch {batch}: XLA temp "
                  f"{temps[batch] / 1e9:.2f} GB (float32, CPU compile {time.perf_counter() - started:.0f} s)",
                  flush=True)
        weights = 2 * sum(counts.values())
        low, high = min(batches), max(batches)
        per_image = (temps[high] - temps[low]) / (high - low)
        fixed = max(0.0, temps[low] - low * per_image)
        fits = {device: max(0, int((size * share - weights - fixed) // per_image)) if per_image > 0 else None
                for device, (size, share) in MEMORY_DEVICES.items()}
        results[name] = {"label": plan["label"], "size": plan["size"], "parameters": counts, "weights_bytes": weights,
                         "temp_bytes": {str(b): t for b, t in temps.items()}, "per_image_bytes": per_image,
                         "fixed_bytes": fixed, "max_per_device_batch": fits}
    return results


def print_memory(results: dict[str, Any]) -> None:
    print("\nlargest per-device batch, by arithmetic, not measured: (memory x usable share - weights in "
          "bfloat16 - fixed temp) / temp per image, the temps from XLA's memory_analysis of the float32 "
          "program compiled on this CPU")
    for r in results.values():
        params = ", ".join(f"{c} {n / 1e6:,.1f} M" for c, n in sorted(r["parameters"].items()))
        print(f"{r['label']} {r['size']}x{r['size']}: parameters {params} = "
              f"{sum(r['parameters'].values()) / 1e9:.3f} B -> weights {r['weights_bytes'] / 1e9:.2f} GB per device")
        temps = ", ".join(f"batch {b} {t / 1e9:.2f} GB" for b, t in r["temp_bytes"].items())
        print(f"  XLA temp: {temps} -> per image {r['per_image_bytes'] / 1e9:.2f} GB, "
              f"fixed {r['fixed_bytes'] / 1e9:.2f} GB")
        for device, (size, share) in MEMORY_DEVICES.items():
            n = r["max_per_device_batch"][device]
            print(f"  {device}: ({size / 1e9:.0f} x {share:.2f} - {r['weights_bytes'] / 1e9:.2f} - "
                  f"{r['fixed_bytes'] / 1e9:.2f}) / {r['per_image_bytes'] / 1e9:.2f} = {n} images per device")


# -- the report -------------------------------------------------------------------------------------


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


def report(name: str, plan: dict[str, Any], figures: dict[str, Any]) -> None:
    cold, warm, peer, folder = figures["cold"], figures["warm"], figures.get("peer"), figures["folder"]
    per = plan["batch"]
    print(f"\n{plan['label']} {plan['size']}x{plan['size']}, {plan['steps']} steps {SCHEDULER.upper()}, guidance "
          f"{GUIDANCE}, batch {cold['batch']} ({per} per device x {cold['devices']} {cold['device_kind']})")
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
    fraction = cold.get("fraction_of_peak")
    peak = cold.get("peak_flops_per_device")
    rate = None if cold["flops_per_image"] is None else cold["flops_per_image"] * cold["images_per_second"]
    print(f"  FLOPs per image: {_flop(cold['flops_per_image'])} (XLA); {_flop(rate)}/s = "
          + (f"{fraction:.1%} of peak ({cold['devices']} x {peak / 1e12:g} TFLOP/s)" if fraction is not None
             else f"fraction of peak n/a (no peak known for {cold['device_kind']!r}; set RENDERFARM_PEAK_TFLOPS)"))
    memory = (f"{_gb(cold['peak_bytes'])} after the first batch" + (f" of {_gb(cold['bytes_limit'])}"
              if cold["bytes_limit"] else "")) if cold["peak_bytes"] is not None else \
        f"not reported (the {cold['platform']} backend gives no memory_stats)"
    print(f"  peak device memory: {memory}; XLA temp buffers of the program {_gb(cold['xla_temp_bytes'])} per device")
    if peer:
        print(f"  peer: diffusers {peer['diffusers']} {cls_name(plan)}, torch {peer['torch']}, {peer['dtype']} on "
              f"{peer['device_name']}, eager, {'/'.join(peer['attention'])}: load {peer['load_seconds']:.2f} s, first "
              f"batch {peer['first_batch_seconds']:.2f} s, {peer['images_per_second']:.3f} images/s (batch "
              f"{peer['batch']}), peak {_gb(peer['peak_bytes']) if peer['peak_bytes'] is not None else 'n/a (cpu)'}")
        print(f"  ours / theirs (images/s per device): {figures['ratio']:.2f}")
        if "compiled_images_per_second" in peer:
            print(f"  peer, torch.compile'd UNet: first batch {peer['compiled_first_batch_seconds']:.2f} s, "
                  f"{peer['compiled_images_per_second']:.3f} images/s; ours / theirs {figures['ratio_compiled']:.2f}")


def cls_name(plan: dict[str, Any]) -> str:
    return "StableDiffusionXLPipeline" if plan["family"] == "sdxl" else "StableDiffusionPipeline"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="sd15,sdxl", help="comma-separated: sd15, sdxl")
    parser.add_argument("--smoke", action="store_true", help="tiny models, CPU, 2 steps, 64x64: seconds")
    parser.add_argument("--memory", action="store_true", help="only the memory arithmetic (CPU compiles)")
    parser.add_argument("--peer", action="store_true", help="time diffusers' PyTorch pipeline too")
    parser.add_argument("--peer-python", default=sys.executable, help="a python with torch and diffusers")
    parser.add_argument("--compile-peer", action="store_true", help="the peer with a torch.compile'd UNet too")
    parser.add_argument("--dtype", default=None, help="ours: bfloat16 (default; float32 with --smoke)")
    parser.add_argument("--sd15-batch", type=int, help="per device (default 8; 1 with --smoke)")
    parser.add_argument("--sdxl-batch", type=int, help="per device (default 4; 1 with --smoke)")
    parser.add_argument("--batches", type=int, default=None, help="timed batches after the first (default 2)")
    parser.add_argument("--workdir", default=str(ROOT / "build" / "accelerator"), help="model folders, kept")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per measured process")
    parser.add_argument("--json", metavar="FILE", help="write every figure here")
    parser.add_argument("--child", nargs=2, metavar=("JOB", "RESULT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:  # a measured process: nothing above touched JAX or torch
        job = json.loads(Path(args.child[0]).read_text())
        result = child_peer(job) if job["mode"] == "peer" else child_ours(job)
        Path(args.child[1]).write_text(json.dumps(result))
        return

    # This process only writes folders and reads results: it keeps JAX on the CPU, so the
    # accelerator (a TPU opens in one process only) stays free for the measured processes.
    platforms = os.environ.get("JAX_PLATFORMS")
    os.environ["JAX_PLATFORMS"] = "cpu"
    if platforms == "cpu" and not (args.smoke or args.memory):  # `make bench` on a machine without one
        print("JAX_PLATFORMS=cpu: full-size models on a CPU would take hours; running --smoke instead")
        args.smoke = True
    child_env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if args.smoke:
        # One device, as the peer has: per device, the two are then compared like for like.
        child_env |= {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
        child_env["CUDA_VISIBLE_DEVICES"] = ""  # the peer on the CPU too
    elif platforms is None:
        del child_env["JAX_PLATFORMS"]
    else:
        child_env["JAX_PLATFORMS"] = platforms
    plans = model_plans(args.smoke)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in plans]
    if unknown:
        parser.error(f"--models: unknown {unknown}; known: {', '.join(plans)}")
    plans = {n: plans[n] for n in names}
    for name, flag in (("sd15", args.sd15_batch), ("sdxl", args.sdxl_batch)):
        if flag is not None and name in plans:
            plans[name]["batch"] = flag
    dtype = args.dtype or ("float32" if args.smoke else "bfloat16")
    batches = args.batches or (SMOKE["batches"] if args.smoke else 2)
    everything: dict[str, Any] = {"smoke": args.smoke, "dtype": dtype, "batches": batches, "models": {}}

    if args.memory:
        results = memory_arithmetic(plans)
        print_memory(results)
        everything["memory"] = results
    else:
        workdir = Path(args.workdir) / ("smoke" if args.smoke else "full")
        workdir.mkdir(parents=True, exist_ok=True)
        run = Path(tempfile.mkdtemp(prefix="run-", dir=args.workdir))  # private: the caches hold code
        print(f"accelerator benchmark{' (smoke: tiny models on the CPU)' if args.smoke else ''}: ours in {dtype}; "
              f"logs and caches in {run}", flush=True)
        try:
            for name, plan in plans.items():
                folder = workdir / name
                figures: dict[str, Any] = {"dtype": dtype, "plan": {k: v for k, v in plan.items() if k != "configs"}}
                figures["folder"] = write_pipeline(folder, plan)
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
                report(name, plan, figures)
        finally:
            if not os.environ.get("RENDERFARM_KEEP_RUN"):  # set it to keep the logs
                shutil.rmtree(run, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(everything, indent=2, sort_keys=True) + "\n")
        print(f"\nfigures written to {args.json}")


if __name__ == "__main__":
    main()
