"""Check a farm image against diffusers' PyTorch pipeline, from its sidecar alone.

Renders the job again with diffusers (the reproducibility contract, docs/design.md) and prints
the largest per-channel difference from the farm's PNG; exits 1 if it is over 2/255.

    pip install torch diffusers transformers peft jax pillow   # any machine; CPU is fine
    python examples/check_image.py out/CAMPAIGN/JOB_ID.json
    python examples/check_image.py JOB_ID.json --model /local/copy --lora gs://b/l.safetensors=/local/l.safetensors

A sidecar names a model as the farm was given it (a folder, a hub id, a single file and its
`base`, LoRAs with their scales); `--model` and `--lora REF=PATH` point at local copies of
what this machine cannot reach (gs:// objects).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import diffusers
import jax
import numpy as np
import torch
from diffusers.schedulers import scheduling_euler_ancestral_discrete, scheduling_lcm
from PIL import Image

SCHEDULERS = {"pndm": "PNDMScheduler", "ddim": "DDIMScheduler", "lms": "LMSDiscreteScheduler",
              "euler": "EulerDiscreteScheduler", "dpm": "DPMSolverMultistepScheduler",
              "euler_a": "EulerAncestralDiscreteScheduler", "lcm": "LCMScheduler"}
BASES = {"sd": "stable-diffusion-v1-5/stable-diffusion-v1-5", "sdxl": "stabilityai/stable-diffusion-xl-base-1.0"}


def local(ref: str, given: dict[str, str]) -> str:
    """A file reference as a local path: given on the command line, a path, or a hub file."""
    if ref in given or Path(ref).exists():
        return given.get(ref, ref)
    from huggingface_hub import hf_hub_download

    name, _, revision = ref.partition("@")
    parts = name.split("/")
    return hf_hub_download("/".join(parts[:2]), "/".join(parts[2:]), revision=revision or None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sidecar", type=Path)
    parser.add_argument("--model", help="a local copy of the sidecar's model (folder or file)")
    parser.add_argument("--lora", action="append", default=[], metavar="REF=PATH", help="a local copy of a LoRA")
    args = parser.parse_args()
    record = json.loads(args.sidecar.read_text())
    spec, model = record["spec"], record["model"]
    given = dict(item.split("=", 1) for item in args.lora)
    cls = diffusers.StableDiffusionXLPipeline if model["family"] == "sdxl" else diffusers.StableDiffusionPipeline
    ref = args.model or model["ref"]
    if ref.endswith(".safetensors"):
        pipe = cls.from_single_file(local(ref, {}), config=model["base"] or BASES[model["family"]])
    else:
        pipe = cls.from_pretrained(ref, revision=model["revision"], variant=model["variant"])
    pipe.set_progress_bar_config(disable=True)
    names = [f"lora{i}" for i in range(len(model["loras"]))]
    for name, (lora, _) in zip(names, model["loras"]):
        pipe.load_lora_weights(local(lora, given), adapter_name=name)
    if names:
        pipe.set_adapters(names, adapter_weights=[scale for _, scale in model["loras"]])
    options = {k: v for k, v in (("timestep_spacing", spec["timestep_spacing"]),
                                 ("use_karras_sigmas", spec["karras"])) if v is not None}
    pipe.scheduler = getattr(diffusers, SCHEDULERS[record["scheduler"]]).from_config(pipe.scheduler.config, **options)
    height, width, factor = record["height"], record["width"], pipe.vae_scale_factor
    key = jax.random.PRNGKey(spec["seed"])
    shape = (1, pipe.unet.config.in_channels, height // factor, width // factor)
    latents = torch.from_numpy(np.array(jax.random.normal(key, shape)))

    def step_noise(*_, dtype: torch.dtype | None = None, **__) -> torch.Tensor:
        """The farm's noise for a stochastic scheduler's step i: normal(fold_in(key, i))."""
        noise = jax.random.normal(jax.random.fold_in(key, pipe.scheduler.step_index), shape)
        return torch.from_numpy(np.array(noise)).to(dtype=dtype)

    scheduling_euler_ancestral_discrete.randn_tensor = scheduling_lcm.randn_tensor = step_noise
    with torch.no_grad():
        image = pipe(spec["prompt"], negative_prompt=spec["negative_prompt"] or None,
                     num_inference_steps=spec["steps"], guidance_scale=spec["guidance_scale"], height=height,
                     width=width, latents=latents, output_type="np").images[0]
    pixels = (image * 255).round().astype(np.int16)
    farm = np.asarray(Image.open(args.sidecar.with_suffix(".png")).convert("RGB"), np.int16)
    diff = int(np.abs(pixels - farm).max())
    print(f"{args.sidecar.stem}: largest difference {diff}/255 from diffusers' PyTorch pipeline "
          f"({'within' if diff <= 2 else 'over'} the contract's 2/255)")
    return 0 if diff <= 2 else 1


if __name__ == "__main__":
    sys.exit(main())
