"""Reference runs for diffusion/schedulers/: PyTorch diffusers 0.42.1's schedulers in the loop its SD
pipelines run, with a fake UNet.

`write(data)` runs in the oracle venv and rewrites `data/schedulers/`:

    cases.json         the configs (each as `pipe.scheduler.config` holds it: the source class's
                       `from_config` of a real scheduler_config.json, `_use_default_values` and all,
                       plus a case's overrides), every class's `__init__` options and defaults, and
                       per case: scheduler, config, steps, then the timesteps the UNet is fed and
                       init_noise_sigma, or the error PyTorch raises
    trajectories.npz   `noise` (2, 4, 4, 4); per case, the sample after each model evaluation;
                       `alphas_cumprod/<name>` of the training schedules in SCHEDULES; and the
                       image starts' `image/latents`, `image/mask` and per image case and mode
                       (`image/<id>/img2img`, `image/<id>/inpaint`) each job's last sample

Image starts (`image_cases` in cases.json) are the img2img and inpaint pipelines' loops: each job
(seed j) begins at its own loop index (diffusers' `get_timesteps`, `set_begin_index`) from image
latents noised by `add_noise` with the contract's latents normal(PRNGKey(j)) as the noise; inpaint
blends each step's kept area back (4-channel UNets' masked blending) and a job begun at 0 starts
from the noise alone. The farm runs every job of a case as one batch.

The loop is the pipelines': set_timesteps, latents = noise * init_noise_sigma, then per timestep t
scale_model_input, the model, and step (with the pipeline's extra kwargs: eta = 0 for DDIM). The model
is `fake_model` below, fed the scheduler's own t (an int64 or float32 tensor). The stochastic
schedulers (euler_a, lcm) draw each step's noise by the contract's rule, patched into diffusers'
draw by tests/oracle/noise.py.
"""

from __future__ import annotations

import inspect
import io
import json
import shutil
import zipfile
from pathlib import Path
from typing import Any

import diffusers
import jax
import numpy as np
import torch
from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    LCMScheduler,
    LMSDiscreteScheduler,
    PNDMScheduler,
)
from diffusers.utils import logging as diffusers_logging

from tests.oracle.noise import seeded_noise

CLASSES = {"pndm": PNDMScheduler, "ddim": DDIMScheduler, "lms": LMSDiscreteScheduler,
           "euler": EulerDiscreteScheduler, "dpm": DPMSolverMultistepScheduler,
           "euler_a": EulerAncestralDiscreteScheduler, "lcm": LCMScheduler,
           "flow_euler": FlowMatchEulerDiscreteScheduler}
CLASSES_BY_NAME = {cls.__name__: cls for cls in CLASSES.values()}
SHAPE = (2, 4, 4, 4)
STEPS = (1, 2, 3, 4, 7, 25)

_SD = {"beta_end": 0.012, "beta_schedule": "scaled_linear", "beta_start": 0.00085, "num_train_timesteps": 1000,
       "set_alpha_to_one": False, "skip_prk_steps": True, "steps_offset": 1, "trained_betas": None}
# scheduler/scheduler_config.json of public pipelines.
SOURCES: dict[str, dict[str, Any]] = {
    # runwayml/stable-diffusion-v1-5
    "sd15": {"_class_name": "PNDMScheduler", "_diffusers_version": "0.6.0", **_SD, "clip_sample": False},
    # stabilityai/stable-diffusion-2-1
    "sd21": {"_class_name": "DDIMScheduler", "_diffusers_version": "0.8.0", **_SD, "clip_sample": False,
             "prediction_type": "v_prediction"},
    # stabilityai/stable-diffusion-xl-base-1.0
    "sdxl": {"_class_name": "EulerDiscreteScheduler", "_diffusers_version": "0.19.0.dev0", **_SD,
             "clip_sample": False, "interpolation_type": "linear", "prediction_type": "epsilon",
             "sample_max_value": 1.0, "timestep_spacing": "leading", "use_karras_sigmas": False},
    # an Euler config that sets sigma bounds, which diffusers carries into other classes' configs
    "sdxl-bounds": {"_class_name": "EulerDiscreteScheduler", **_SD, "timestep_spacing": "leading",
                    "sigma_min": 0.3, "sigma_max": 10.0},
    # a 100-step schedule given as trained_betas
    "trained": {"_class_name": "DDIMScheduler", "num_train_timesteps": 100, "clip_sample": False,
                "trained_betas": [round(float(b), 6) for b in np.linspace(0.001, 0.1, 100)]},
}
# Training schedules whose alphas_cumprod (DDIMScheduler's) are written too.
SCHEDULES = {
    "linear": {},
    "scaled_linear": {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear"},
    "squaredcos_cap_v2": {"beta_schedule": "squaredcos_cap_v2"},
    "rescaled": {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear",
                 "rescale_betas_zero_snr": True},
}
FEW = (3, 7)
# (scheduler, source, overrides, steps)
CASES: list[tuple[str, str, dict[str, Any], tuple[int, ...]]] = [
    ("pndm", "sd15", {}, STEPS),
    ("pndm", "sd15", {"skip_prk_steps": False}, STEPS),  # PyTorch fails below 4 steps
    ("pndm", "sd21", {}, (1, 2, 7)),
    ("pndm", "sd15", {"timestep_spacing": "trailing"}, (2, 7)),
    ("pndm", "sd15", {"timestep_spacing": "linspace", "skip_prk_steps": False}, (4, 7)),
    ("pndm", "sd15", {"timestep_spacing": "trailing", "skip_prk_steps": False}, (4,)),
    ("ddim", "sd21", {}, STEPS),
    ("ddim", "sd15", {}, STEPS),
    ("ddim", "sd21", {"timestep_spacing": "trailing", "rescale_betas_zero_snr": True}, (1, 2, 7)),
    ("ddim", "sdxl", {"timestep_spacing": "linspace", "clip_sample": True, "prediction_type": "sample"}, (2, 7)),
    ("ddim", "sd15", {"thresholding": True, "dynamic_thresholding_ratio": 0.9, "sample_max_value": 1.5,
                      "set_alpha_to_one": True}, FEW),
    ("ddim", "sd15", {"beta_schedule": "squaredcos_cap_v2", "clip_sample": True, "clip_sample_range": 2.0}, FEW),
    ("ddim", "trained", {}, FEW),
    ("lms", "sd15", {}, STEPS),
    ("lms", "sdxl", {}, (1, 2, 4, 7)),
    ("lms", "sd15", {"use_karras_sigmas": True}, STEPS),
    ("lms", "sd21", {"timestep_spacing": "trailing"}, (2, 7)),
    ("lms", "sd15", {"prediction_type": "sample", "beta_schedule": "linear"}, (3,)),
    ("lms", "sdxl-bounds", {"use_exponential_sigmas": True}, FEW),
    ("lms", "sdxl-bounds", {"use_karras_sigmas": True}, (3,)),
    ("euler", "sdxl", {}, STEPS),
    ("euler", "sd15", {}, STEPS),
    ("euler", "sdxl", {"timestep_spacing": "trailing"}, (1, 2, 7)),
    ("euler", "sdxl", {"use_karras_sigmas": True}, STEPS),
    ("euler", "sd21", {}, (2, 7)),
    ("euler", "sd21", {"timestep_type": "continuous", "use_karras_sigmas": True, "final_sigmas_type": "sigma_min",
                       "timestep_spacing": "trailing"}, (2, 7)),
    ("euler", "sd15", {"interpolation_type": "log_linear"}, FEW),
    ("euler", "sd21", {"rescale_betas_zero_snr": True, "timestep_spacing": "trailing"}, (2, 7)),
    ("euler", "sdxl-bounds", {"use_exponential_sigmas": True}, FEW),
    ("euler", "sdxl-bounds", {"use_karras_sigmas": True, "prediction_type": "original_sample"}, (3,)),
    ("dpm", "sdxl", {}, STEPS),
    ("dpm", "sd15", {}, STEPS),
    ("dpm", "sd15", {"solver_order": 3}, STEPS),
    ("dpm", "sd15", {"solver_order": 3, "lower_order_final": False}, STEPS),
    ("dpm", "sd15", {"lower_order_final": False}, FEW),
    ("dpm", "sdxl", {"use_karras_sigmas": True}, STEPS),
    ("dpm", "sdxl", {"use_karras_sigmas": True, "solver_order": 3}, (7, 25)),
    ("dpm", "sd15", {"solver_type": "heun"}, FEW),
    ("dpm", "sd15", {"euler_at_final": True, "final_sigmas_type": "sigma_min"}, (3, 7, 25)),
    ("dpm", "sd15", {"final_sigmas_type": "sigma_min", "solver_order": 3}, (7, 25)),
    ("dpm", "sd15", {"use_lu_lambdas": True}, FEW),
    ("dpm", "sdxl-bounds", {"use_exponential_sigmas": True}, FEW),
    ("dpm", "sdxl-bounds", {"use_karras_sigmas": True}, (3,)),
    ("dpm", "sd21", {"timestep_spacing": "trailing"}, (2, 7)),
    ("dpm", "sd21", {"rescale_betas_zero_snr": True, "timestep_spacing": "trailing"}, (2, 7)),
    ("dpm", "sd15", {"prediction_type": "sample", "thresholding": True, "dynamic_thresholding_ratio": 0.9,
                     "sample_max_value": 1.5}, FEW),
    ("dpm", "sd15", {"solver_order": 1}, (2, 7)),
    ("dpm", "sd15", {"lambda_min_clipped": -2.0}, FEW),
    # DEIS's and UniPC's values, which PyTorch maps to DPM-Solver++'s (DEIS only with sigma_min)
    ("dpm", "sd15", {"algorithm_type": "deis", "solver_type": "logrho", "final_sigmas_type": "sigma_min"}, FEW),
    ("dpm", "sd15", {"algorithm_type": "deis"}, (3,)),
    ("dpm", "sd15", {"solver_type": "bh2"}, (3,)),
    # unrounded timesteps; at 7 steps the first one repeats and PyTorch fails
    ("dpm", "sd15", {"beta_schedule": "squaredcos_cap_v2", "use_karras_sigmas": True}, FEW),
    # the stochastic ones, fed the noise rule's draws (tests/oracle/noise.py)
    ("euler_a", "sd15", {}, STEPS),
    ("euler_a", "sdxl", {}, (1, 2, 4, 7)),
    ("euler_a", "sdxl", {"timestep_spacing": "trailing"}, (1, 2, 4)),  # SDXL-Turbo's
    ("euler_a", "sd21", {}, (2, 7)),
    ("euler_a", "sd21", {"rescale_betas_zero_snr": True, "timestep_spacing": "trailing"}, (2, 7)),
    ("lcm", "sd15", {}, (1, 2, 4, 8, 25)),
    ("lcm", "sd21", {}, (2, 4)),
    ("lcm", "sd15", {"original_inference_steps": 20, "clip_sample": True}, (4, 20, 25)),  # PyTorch fails at 25
    ("lcm", "sd15", {"timestep_scaling": 3.0, "prediction_type": "sample", "beta_schedule": "linear"}, (3,)),
]


# (scheduler, source, overrides, steps, each job's first loop index): every scheduler the UNet
# families run, with history (pndm with and without PRK, lms, dpm of order 2 and 3) and without.
IMAGE_CASES: list[tuple[str, str, dict[str, Any], int, tuple[int, ...]]] = [
    ("pndm", "sd15", {}, 7, (0, 1, 2, 3, 6)),
    ("pndm", "sd15", {"skip_prk_steps": False}, 7, (0, 1, 2, 5, 6)),
    ("ddim", "sd21", {}, 7, (0, 1, 4, 6)),
    ("lms", "sd15", {}, 7, (0, 1, 2, 4, 6)),
    ("euler", "sdxl", {"use_karras_sigmas": True}, 7, (0, 2, 6)),
    ("dpm", "sdxl", {}, 7, (0, 1, 2, 5, 6)),
    ("dpm", "sd15", {"solver_order": 3}, 25, (0, 1, 2, 3, 20, 24)),
    ("euler_a", "sd15", {}, 7, (0, 1, 4, 6)),
    ("lcm", "sd15", {}, 4, (0, 1, 2, 3)),
]
IMAGE_JOBS = 6  # the most starts a case has: image latents and masks for that many jobs


def fake_model(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """A deterministic stand-in for the UNet that depends on the timestep it is fed."""
    return 0.1 * torch.sin(x) + 0.001 * t * x


def pipeline_config(source: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """What `StableDiffusionPipeline.from_pretrained(...).scheduler.config` holds for the source's
    scheduler_config.json, with `overrides` set as `from_config(config, **overrides)` would."""
    raw = SOURCES[source]
    config = dict(CLASSES_BY_NAME[raw["_class_name"]].from_config(raw).config)
    config.update(overrides)
    config["_use_default_values"] = sorted(set(config["_use_default_values"]) - set(overrides))
    return config


def pipeline_step(scheduler: Any, latents: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """One step of the pipelines' loop with the fake UNet: scale_model_input, the model, and step
    with the pipeline's extra kwargs (eta = 0 for DDIM)."""
    parameters = set(inspect.signature(scheduler.step).parameters)
    extra = {k: v for k, v in (("eta", 0.0), ("generator", None)) if k in parameters}
    model_input = scheduler.scale_model_input(latents, t)
    return scheduler.step(fake_model(model_input, t), t, latents, **extra, return_dict=False)[0]


def run(cls: type, config: dict[str, Any], steps: int, noise: np.ndarray) -> tuple[dict[str, Any], np.ndarray]:
    """The pipeline's denoising loop; returns the timesteps, init_noise_sigma and every sample."""
    scheduler = cls.from_config(config)
    scheduler.set_timesteps(steps)
    latents = torch.from_numpy(noise) * scheduler.init_noise_sigma
    trajectory = []
    with seeded_noise(scheduler, 0):  # the whole sample as one job (tests/test_schedulers.py draws the same)
        for t in scheduler.timesteps:
            latents = pipeline_step(scheduler, latents, t)
            trajectory.append(latents.numpy())
    result = {"timesteps": [float(t) for t in scheduler.timesteps],
              "init_noise_sigma": float(scheduler.init_noise_sigma)}
    return result, np.stack(trajectory)


def run_image(cls: type, config: dict[str, Any], steps: int, start: int, seed: int, image: torch.Tensor,
              mask: torch.Tensor | None) -> np.ndarray:
    """One job of the img2img (`mask` None) or inpaint pipeline's loop from loop index `start`;
    its last sample."""
    scheduler = cls.from_config(config)
    scheduler.set_timesteps(steps)
    timesteps = scheduler.timesteps[start * scheduler.order:]
    if hasattr(scheduler, "set_begin_index"):
        scheduler.set_begin_index(start * scheduler.order)
    noise = torch.from_numpy(np.array(jax.random.normal(jax.random.PRNGKey(seed), tuple(image.shape))))
    if mask is not None and start == 0:  # the inpaint pipeline at strength 1: the noise alone
        latents = noise * scheduler.init_noise_sigma
    else:
        latents = scheduler.add_noise(image, noise, timesteps[:1])
    with seeded_noise(scheduler, seed):
        for k, t in enumerate(timesteps):
            latents = pipeline_step(scheduler, latents, t)
            if mask is not None:  # StableDiffusionInpaintPipeline's blend for a 4-channel UNet
                kept = image
                if k < len(timesteps) - 1:
                    kept = scheduler.add_noise(image, noise, torch.tensor([timesteps[k + 1]]))
                latents = (1 - mask) * kept + mask * latents
    return latents.numpy()


def _defaults(cls: type) -> dict[str, Any]:
    parameters = inspect.signature(cls.__init__).parameters.values()
    return {p.name: p.default for p in parameters if p.name != "self"}


def _save_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """np.savez, but with fixed timestamps, so the same arrays give the same bytes."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, array in arrays.items():
            buffer = io.BytesIO()
            np.lib.format.write_array(buffer, np.ascontiguousarray(array), allow_pickle=False)
            archive.writestr(zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0)), buffer.getvalue(),
                             compress_type=zipfile.ZIP_DEFLATED)


def write(data: Path) -> None:
    """Rewrite data/schedulers/ (see the module docstring)."""
    diffusers_logging.set_verbosity_error()  # from_config's "not expected" and deprecation chatter
    root = data / "schedulers"
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    noise = np.random.default_rng(0).standard_normal(SHAPE, dtype=np.float32)
    configs, cases, arrays = {}, [], {"noise": noise}
    for name, source, overrides, step_counts in CASES:
        label = "-".join([source, *(f"{k}={v}" for k, v in overrides.items())])
        configs[label] = pipeline_config(source, overrides)
        for steps in step_counts:
            case = {"id": f"{name}/{label}/{steps}", "scheduler": name, "config": label, "steps": steps}
            try:
                result, arrays[case["id"]] = run(CLASSES[name], configs[label], steps, noise)
            except (ValueError, IndexError) as e:
                result = {"error": f"{type(e).__name__}: {e}"}
            cases.append({**case, **result})
    rng = np.random.default_rng(1)
    latents = rng.standard_normal((IMAGE_JOBS, 1, *SHAPE[1:]), dtype=np.float32)
    masks = (rng.random((IMAGE_JOBS, 1, 1, *SHAPE[2:])) > 0.5).astype(np.float32)
    arrays["image/latents"], arrays["image/mask"] = latents, masks
    image_cases = []
    for name, source, overrides, steps, starts in IMAGE_CASES:
        label = "-".join([source, *(f"{k}={v}" for k, v in overrides.items())])
        configs.setdefault(label, pipeline_config(source, overrides))
        case_id = f"{name}/{label}/{steps}"
        image_cases.append({"id": case_id, "scheduler": name, "config": label, "steps": steps, "starts": list(starts)})
        for mode in ("img2img", "inpaint"):
            arrays[f"image/{case_id}/{mode}"] = np.stack([
                run_image(CLASSES[name], configs[label], steps, start, seed, torch.from_numpy(latents[seed]),
                          torch.from_numpy(masks[seed]) if mode == "inpaint" else None)
                for seed, start in enumerate(starts)])
    for name, config in SCHEDULES.items():
        arrays[f"alphas_cumprod/{name}"] = DDIMScheduler(**config).alphas_cumprod.numpy()
    classes = {name: _defaults(cls) for name, cls in CLASSES.items()}
    doc = {"torch": torch.__version__, "diffusers": diffusers.__version__, "shape": list(SHAPE),
           "classes": classes, "schedules": SCHEDULES, "configs": configs, "cases": cases,
           "image_cases": image_cases}
    (root / "cases.json").write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    _save_npz(root / "trajectories.npz", arrays)
