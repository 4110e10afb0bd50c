"""What a render may choose of the model layer, by name: its schedulers (and which of them take
a timestep spacing or Karras sigmas), its dtypes, a weights variant, LoRAs and image scores,
with the rules that tie them. The schedulers, the loader and the scorers are made for these
names; the farm's job contract (renderfarm/jobs.py) checks jobs against them. No JAX here: the
producer imports the contract."""

from __future__ import annotations

import re
from typing import Any

from diffusion.errors import ModelError

# Each the port of a PyTorch class (diffusion/schedulers); flow_euler is the flow models' (Flux).
SCHEDULERS = ("pndm", "ddim", "lms", "euler", "dpm", "euler_a", "lcm", "flow_euler")
SPACINGS = ("leading", "trailing", "linspace")  # diffusers' timestep_spacing
KARRAS_SCHEDULERS = ("lms", "euler", "dpm")  # those with Karras sigmas (use_karras_sigmas)
UNSPACED_SCHEDULERS = ("lcm", "flow_euler")  # those that place their own timesteps (timestep_spacing does not apply)
DTYPES = ("float32", "bfloat16")
VARIANT_RE = re.compile(r"[a-z0-9_]{1,32}")  # a weights variant: fp16, bf16, ... (file name infix)
SCORES = ("safety", "clip", "aesthetic", "phash")  # computed where the image renders (diffusion/scores.py)
Lora = tuple[str, float]  # (reference, scale)


def check_variant(value: Any) -> str:
    """A weights variant names files (`diffusion_pytorch_model.fp16.safetensors`)."""
    if not isinstance(value, str) or not VARIANT_RE.fullmatch(value):
        raise ModelError("variant", value, "must match [a-z0-9_]{1,32} (fp16, bf16, ...)")
    return value


def check_sampler(scheduler: str, timestep_spacing: str | None, karras: bool | None) -> None:
    """The rules that tie the sampler fields together, once the scheduler is known (named by
    the job, or the model's own on the worker)."""
    if karras and scheduler not in KARRAS_SCHEDULERS:
        raise ModelError("karras", karras, f"needs a scheduler with Karras sigmas ({', '.join(KARRAS_SCHEDULERS)}), "
                                           f"not {scheduler}")
    if timestep_spacing is not None and scheduler in UNSPACED_SCHEDULERS:
        raise ModelError("timestep_spacing", timestep_spacing, f"does not apply to {scheduler}, which places its "
                                                               "own timesteps")
