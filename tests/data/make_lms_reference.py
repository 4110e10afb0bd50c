"""Regenerate lms_reference.json: PyTorch diffusers' LMSDiscreteScheduler on a tiny case.

Not part of the test run, and PyTorch is not a project dependency. Run it in a scratch venv:

    python3 -m venv /tmp/lmsref
    /tmp/lmsref/bin/pip install torch==2.13.0 diffusers==0.39.0 numpy scipy
    /tmp/lmsref/bin/python tests/data/make_lms_reference.py

tests/test_schedulers.py runs worker.schedulers.LMSScheduler on the same case and compares.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from diffusers import LMSDiscreteScheduler

# An SD 1.x scheduler config as the pipelines ship it (PNDM); no timestep_spacing key.
CONFIG = {
    "num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012,
    "beta_schedule": "scaled_linear", "prediction_type": "epsilon", "steps_offset": 1,
    "skip_prk_steps": True, "set_alpha_to_one": False, "trained_betas": None,
}
SHAPE = (1, 4, 2, 2)
STEPS = (3, 6)


def fake_model(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """A deterministic stand-in for the UNet's noise prediction."""
    return 0.1 * torch.sin(x) + 0.001 * t * x


def run(config: dict, noise: np.ndarray, steps: int) -> dict:
    """The pipeline's loop: set_timesteps, scale by init_noise_sigma, scale_model_input, step."""
    scheduler = LMSDiscreteScheduler.from_config(config)
    scheduler.set_timesteps(steps)
    sample = torch.from_numpy(noise) * scheduler.init_noise_sigma
    for t in scheduler.timesteps:
        model_input = scheduler.scale_model_input(sample, t)
        sample = scheduler.step(fake_model(model_input, t), t, sample).prev_sample
    return {
        "timesteps": scheduler.timesteps.tolist(),
        "sigmas": scheduler.sigmas.tolist(),
        "init_noise_sigma": float(scheduler.init_noise_sigma),
        "sample": sample.numpy().ravel().tolist(),
    }


def main() -> None:
    noise = np.random.default_rng(0).standard_normal(SHAPE, dtype=np.float32)
    reference = {
        "config": CONFIG,
        "shape": list(SHAPE),
        "noise": noise.ravel().tolist(),
        "runs": {str(n): run(CONFIG, noise, n) for n in STEPS},
    }
    path = Path(__file__).with_name("lms_reference.json")
    path.write_text(json.dumps(reference, indent=1) + "\n")
    print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
