"""Command-line flags both sides share: the job fields (`render` and `submit` make jobs) and
the broker. Argparse only; what each command does lives with the side it drives."""

from __future__ import annotations

import argparse
from typing import Any

from renderfarm.jobs import DTYPES, ON_NSFW, SCHEDULERS, SCORES, SPACINGS

JOB_DEFAULTS = ("model", "campaign", "steps", "guidance_scale", "negative_prompt", "width", "height",
                "scheduler", "timestep_spacing", "karras", "dtype", "variant", "base", "loras", "scores", "gate",
                "rerolls", "on_nsfw", "init_image", "strength", "mask_image")


def job_flags(parser: argparse.ArgumentParser) -> None:
    """The job fields every command that makes jobs accepts (render, submit); unset ones take
    the job contract's defaults (docs/design.md)."""
    parser.add_argument("prompts_args", nargs="*", metavar="PROMPT", help="prompts, one job each")
    parser.add_argument("--prompts", metavar="FILE", help=".txt (a prompt a line) or .jsonl (a job a line)")
    parser.add_argument("--model", required=True,
                        help="hub id[@revision], local folder or gs:// folder, or one .safetensors file (local, "
                             "gs:// or hub org/repo/file.safetensors[@revision])")
    parser.add_argument("--campaign", default="local", help="folder under --out (default: local)")
    parser.add_argument("--seed", type=int, help="base seed: job i gets SEED+i (default: random, recorded)")
    parser.add_argument("--steps", type=int, metavar="N", help="denoising steps, 1..500 (default 25)")
    parser.add_argument("--guidance", type=float, dest="guidance_scale", metavar="SCALE",
                        help="guidance scale, 0..50 (default: the model family's own, 7.5 for Stable "
                             "Diffusion, 3.5 for Flux; <= 1: no classifier-free guidance)")
    parser.add_argument("--negative", dest="negative_prompt", metavar="TEXT", help="negative prompt (default: none)")
    parser.add_argument("--width", type=int, metavar="PIXELS",
                        help="image width, a multiple of the model's size step (default: the model's native size)")
    parser.add_argument("--height", type=int, metavar="PIXELS",
                        help="image height, a multiple of the model's size step (default: the model's native size)")
    parser.add_argument("--scheduler", choices=SCHEDULERS, help="the sampler that denoises (default: the one the model's scheduler config names)")
    parser.add_argument("--timestep-spacing", choices=SPACINGS,
                        help="where the steps fall on the training schedule; trailing for few-step "
                             "models (default: the model's scheduler config)")
    parser.add_argument("--karras", action=argparse.BooleanOptionalAction,
                        help="Karras sigmas (lms, euler, dpm; --scheduler dpm --karras is A1111's "
                             "'DPM++ 2M Karras') (default: the model's scheduler config)")
    parser.add_argument("--score", dest="scores", action="append", choices=SCORES,
                        help="score each image where it renders (its sidecar and the manifest carry the "
                             "scores: docs/datasets.md); repeat for more (default: none)")
    parser.add_argument("--gate", metavar="EXPR",
                        help="what a kept image's scores must pass, e.g. 'clip >= 28 and not nsfw' (the scores it "
                             "reads must be asked for with --score)")
    parser.add_argument("--on-nsfw", dest="on_nsfw", choices=ON_NSFW,
                        help="an image the safety checker flags (with --score safety): keep it (its sidecar "
                             "says nsfw), store it black as diffusers does, or drop it (its sidecar alone is "
                             "stored) (default: keep)")
    parser.add_argument("--rerolls", type=int, metavar="N",
                        help="render a job again, each time with its next seed, while its image fails --gate, "
                             "at most N times (0..16; default 0)")
    parser.add_argument("--init-image", dest="init_image", metavar="PATH_OR_URL",
                        help="image to image (SD 1.x/2.x and SDXL): every job starts from this image, a "
                             "local path or gs:// URL the workers can read (default: none, text to image)")
    parser.add_argument("--strength", type=float, metavar="S",
                        help="with --init-image: how much of the schedule runs, in (0, 1] (default 0.8; 1.0 "
                             "with --mask-image)")
    parser.add_argument("--mask-image", dest="mask_image", metavar="PATH_OR_URL",
                        help="with --init-image: inpainting (SD 1.x/2.x and SDXL): repaint where "
                             "this mask is white, keep where black; the init image's shape or that scaled (default: "
                             "none)")
    weights_flags(parser)


def weights_flags(parser: argparse.ArgumentParser) -> None:
    """What, besides --model, says which weights render and how: jobs and workers name the same set."""
    parser.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="compute dtype of the networks (default float32; bfloat16 halves memory on TPUs)")
    parser.add_argument("--variant", help="the model's weights variant, e.g. fp16 (its *.fp16.safetensors files)")
    parser.add_argument("--base", metavar="REF",
                        help="for a single-file --model (x.safetensors): the pipeline whose configs and "
                             "tokenizers it uses, and the weights of the components the file lacks (a Flux "
                             "transformer file: all but the transformer) (default: the standard hub pipeline of "
                             "its lineage, the released model it descends from)")
    parser.add_argument("--lora", dest="loras", action="append", metavar="REF[:SCALE]",
                        help="a LoRA merged into the weights (file, gs:// or hub org/repo/file.safetensors; "
                             "scale default 1.0); repeat for more (default: none)")


def job_defaults(args: argparse.Namespace) -> dict[str, Any]:
    """The job fields given by `job_flags`, for every job of the command."""
    return {name: getattr(args, name) for name in JOB_DEFAULTS}


def broker_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--broker", metavar="URL",
                        help="Redis broker URL: redis://, rediss:// or sentinel://...?master_name=NAME "
                             "(default: $RENDERFARM_BROKER_URL or redis://localhost:6379/0)")
