"""What the schedulers share: diffusers' config semantics and the host-side schedule.

PyTorch diffusers derives everything but the per-step arithmetic (betas, alphas_cumprod, the
timestep spacing, the sigmas) from the config and the step count alone, so here it is computed
once on the host in numpy and becomes constants of the compiled program. It is computed the way
PyTorch computes it: float32 where diffusers uses torch tensors (with torch's own linspace, which
rounds differently from numpy's, and its float64 cumprod), float64 where it uses numpy, cast
where it casts. Also shared are the few helpers that run on the device: the sigma schedulers'
(lms, euler, euler_a) input scaling and x0 estimate, dpm's and lcm's x0 estimate, dynamic
thresholding.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping
from typing import Any, ClassVar, Self

import jax
import jax.numpy as jnp
import numpy as np

F32 = np.float32


@dataclasses.dataclass(frozen=True, kw_only=True)
class Configured:
    """A scheduler whose fields are its PyTorch class's `__init__` options, with its defaults,
    made from a model's scheduler config as diffusers' `from_config` does."""

    name: ClassVar[str]  # make()'s name for it, of diffusion.choices.SCHEDULERS
    diffusers_class: ClassVar[str]  # the PyTorch class it ports, as model folders name it
    # A stochastic scheduler's `step` takes a fifth argument: the step's noise, drawn from the
    # job's own key by the generate loop (the reproducibility contract's noise rule).
    stochastic: ClassVar[bool] = False
    # A multistep scheduler's `step` takes `begin`: each job's first loop index, where its history
    # starts (image jobs start part way, as diffusers' img2img pipelines set the begin index).
    history: ClassVar[bool] = False

    @classmethod
    def from_config(cls, config: Mapping[str, Any], **overrides: Any) -> Self:
        """diffusers' `from_config(config, **overrides)`: the config's keys this class knows,
        except those the config lists in `_use_default_values` (its own class merely defaulted
        them), which take this class's defaults; everything else is ignored; `overrides` win."""
        defaulted = set(config.get("_use_default_values", ()))
        names = {f.name for f in dataclasses.fields(cls)}
        given = {k: v for k, v in config.items() if k in names and k not in defaulted} | overrides
        if given.get("trained_betas") is not None:
            given["trained_betas"] = tuple(float(b) for b in given["trained_betas"])
        return cls(**given)

    def require(self, option: str, allowed: Collection[Any]) -> None:
        """Refuse a value of `option` outside `allowed`, naming both."""
        value = getattr(self, option)
        if value not in allowed:
            raise ValueError(f"{self.name} scheduler: {option}={value!r} is not supported "
                             f"(supported: {', '.join(map(repr, allowed))})")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerConfig(Configured):
    """The options every scheduler of the DDPM training schedule takes; subclasses add theirs
    and redeclare a field to change its default."""

    num_train_timesteps: int = 1000
    beta_start: float = 0.0001
    beta_end: float = 0.02
    beta_schedule: str = "linear"
    trained_betas: tuple[float, ...] | None = None
    prediction_type: str = "epsilon"
    timestep_spacing: str = "linspace"
    steps_offset: int = 0

    prediction_types: ClassVar[tuple[str, ...]] = ("epsilon", "v_prediction", "sample")

    def __post_init__(self) -> None:
        self.require("beta_schedule", ("linear", "scaled_linear", "squaredcos_cap_v2"))
        self.require("prediction_type", self.prediction_types)
        self.require("timestep_spacing", ("linspace", "leading", "trailing"))

    def alphas_cumprod(self, rescale_zero_snr: bool = False) -> np.ndarray:
        """float32 alphas_cumprod of the training schedule, as the PyTorch constructors build it."""
        n = self.num_train_timesteps
        if self.trained_betas is not None:
            betas = np.asarray(self.trained_betas, F32)
        elif self.beta_schedule == "linear":
            betas = torch_linspace(self.beta_start, self.beta_end, n)
        elif self.beta_schedule == "scaled_linear":
            betas = torch_linspace(self.beta_start**0.5, self.beta_end**0.5, n) ** 2
        else:  # squaredcos_cap_v2: betas_for_alpha_bar, in Python floats
            def alpha_bar(t: float) -> float:
                return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2
            betas = np.array([min(1 - alpha_bar((i + 1) / n) / alpha_bar(i / n), 0.999)
                              for i in range(n)]).astype(F32)
        if rescale_zero_snr:
            betas = _rescale_zero_terminal_snr(betas)
        # torch.cumprod accumulates float32 in float64.
        return np.cumprod((F32(1) - betas).astype(np.float64)).astype(F32)

    def spaced_timesteps(self, steps: int, last: int | None = None) -> np.ndarray:
        """`timestep_spacing` over [0, last) (default the whole schedule): descending float64,
        fractional for linspace (callers round or cast as their PyTorch class does)."""
        n = self.num_train_timesteps
        last = n if last is None else last
        if self.timestep_spacing == "linspace":
            return np.linspace(0, last - 1, steps)[::-1]
        if self.timestep_spacing == "leading":
            return (np.arange(steps) * (last // steps))[::-1].astype(np.float64) + self.steps_offset
        return np.arange(last, 0, -n / steps).round() - 1  # trailing


@dataclasses.dataclass(frozen=True, kw_only=True)
class SigmaScheduleConfig(SchedulerConfig):
    """The options of the schedulers that may replace their spaced sigmas (lms, euler, dpm).

    `sigma_min` and `sigma_max` are arguments of Euler only; but diffusers' from_config registers
    a config's other keys on the scheduler's config too, where lms's exponential and dpm's Karras
    and exponential schedules look them up, so they are honoured there as well."""

    use_karras_sigmas: bool = False
    use_exponential_sigmas: bool = False
    use_beta_sigmas: bool = False
    sigma_min: float | None = None
    sigma_max: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require("use_beta_sigmas", (False, None))  # would need scipy's beta quantiles
        if self.use_karras_sigmas and self.use_exponential_sigmas:
            raise ValueError(f"{self.name} scheduler: use_karras_sigmas=True and use_exponential_sigmas=True "
                             "exclude each other")

    def resampled_sigmas(self, sigmas: np.ndarray, steps: int, karras_bounds: bool = True) -> np.ndarray | None:
        """The Karras or exponential schedule between the ends of the descending `sigmas` (or
        sigma_min / sigma_max, which lms's Karras schedule ignores), or None for neither."""
        sigma_max, sigma_min = float(sigmas[0]), float(sigmas[-1])
        if self.use_karras_sigmas:
            if karras_bounds:
                sigma_max, sigma_min = self._bounds(sigma_max, sigma_min)
            return karras_sigmas(sigma_max, sigma_min, steps)
        if self.use_exponential_sigmas:
            return exponential_sigmas(*self._bounds(sigma_max, sigma_min), steps)
        return None

    def _bounds(self, sigma_max: float, sigma_min: float) -> tuple[float, float]:
        return (sigma_max if self.sigma_max is None else self.sigma_max,
                sigma_min if self.sigma_min is None else self.sigma_min)


def const(x: Any) -> jax.Array:
    """A float32 state array."""
    return jnp.asarray(x, jnp.float32)


def torch_linspace(start: float, end: float, steps: int) -> np.ndarray:
    """torch.linspace(start, end, steps, dtype=torch.float32) bit for bit, as torch's CPU kernel
    computes it: a float32 step, each half fused-multiply-added from its own end."""
    start32, end32 = F32(start), F32(end)
    if steps == 1:
        return np.array([start32])
    step = (end32 - start32) / F32(steps - 1)
    i = np.arange(steps)
    # A float32 product is exact in float64, so this rounds like an FMA.
    head = start32.astype(np.float64) + np.float64(step) * i
    tail = end32.astype(np.float64) - np.float64(step) * (steps - 1 - i)
    return np.where(i < steps // 2, head, tail).astype(F32)


def _rescale_zero_terminal_snr(betas: np.ndarray) -> np.ndarray:
    """diffusers' rescale_zero_terminal_snr, in float32 like its torch code."""
    alphas_bar_sqrt = np.sqrt(np.cumprod((F32(1) - betas).astype(np.float64)).astype(F32))
    first, last = alphas_bar_sqrt[0], alphas_bar_sqrt[-1]
    alphas_bar_sqrt = (alphas_bar_sqrt - last) * (first / (first - last))
    alphas_bar = alphas_bar_sqrt**2
    alphas = np.concatenate([alphas_bar[:1], alphas_bar[1:] / alphas_bar[:-1]])
    return F32(1) - alphas


def train_sigmas(alphas_cumprod: np.ndarray) -> np.ndarray:
    """float32 sigma of each training timestep, ascending in t."""
    return np.sqrt((F32(1) - alphas_cumprod) / alphas_cumprod)


def interp_sigmas(timesteps: np.ndarray, sigmas: np.ndarray) -> np.ndarray:
    """Sigmas at (possibly fractional) timesteps, float64 like numpy's interp."""
    return np.interp(timesteps, np.arange(len(sigmas)), sigmas)


def karras_sigmas(sigma_max: float, sigma_min: float, steps: int, rho: float = 7.0) -> np.ndarray:
    """Karras et al.'s schedule (k-diffusion's get_sigmas_karras), float64."""
    ramp = np.linspace(0, 1, steps)
    max_inv_rho, min_inv_rho = sigma_max ** (1 / rho), sigma_min ** (1 / rho)
    return (max_inv_rho + ramp * (min_inv_rho - max_inv_rho)) ** rho


def exponential_sigmas(sigma_max: float, sigma_min: float, steps: int) -> np.ndarray:
    """Sigmas evenly spaced in log sigma, float64."""
    return np.exp(np.linspace(math.log(sigma_max), math.log(sigma_min), steps))


def sigma_to_t(sigmas: np.ndarray, log_sigmas: np.ndarray) -> np.ndarray:
    """diffusers' `_sigma_to_t`: the fractional timestep of each sigma, interpolating log sigma
    between training timesteps (float64; `log_sigmas` float32 as in diffusers)."""
    log_sigma = np.log(np.maximum(sigmas, 1e-10))
    dists = log_sigma - log_sigmas[:, np.newaxis]
    low = np.cumsum(dists >= 0, axis=0).argmax(axis=0).clip(max=log_sigmas.shape[0] - 2)
    w = np.clip((log_sigmas[low] - log_sigma) / (log_sigmas[low] - log_sigmas[low + 1]), 0, 1)
    return (1 - w) * low + w * (low + 1)


def check_timesteps(timesteps: np.ndarray, num_train_timesteps: int) -> None:
    """Refuse a schedule that indexes past the training schedule (PyTorch raises IndexError)."""
    bad = timesteps[timesteps >= num_train_timesteps]
    if bad.size:
        raise ValueError(f"the schedule reaches timestep {int(bad[0])}, past the {num_train_timesteps} "
                         "training timesteps (PyTorch diffusers fails here too); choose another "
                         "timestep_spacing, steps_offset or step count")


def check_first_timestep(timesteps: np.ndarray) -> None:
    """Refuse a schedule whose first timestep repeats: PyTorch's index-stepping schedulers then
    start at its second occurrence and run past their sigmas at the end."""
    if np.count_nonzero(timesteps == timesteps[0]) > 1:
        raise ValueError(f"the schedule starts with timestep {timesteps[0]} more than once (PyTorch diffusers "
                         "then skips a step and fails); choose another sigma schedule or step count")


def denoised(prediction_type: str, sample: jax.Array, model_output: jax.Array, sigma: jax.Array) -> jax.Array:
    """The Karras-style (sigma-parametrised) schedulers' x0 estimate, in diffusers' op order."""
    if prediction_type == "epsilon":
        return sample - sigma * model_output
    if prediction_type == "v_prediction":
        return model_output * (-sigma / jnp.sqrt(sigma * sigma + 1)) + sample / (sigma * sigma + 1)
    return model_output  # "sample"


def data_prediction(prediction_type: str, sample: jax.Array, model_output: jax.Array, alpha: jax.Array,
                    sigma: jax.Array) -> jax.Array:
    """The alpha/sigma-parametrised schedulers' x0 estimate (dpm's and lcm's), from a sample
    x = alpha * x0 + sigma * eps, in diffusers' op order."""
    if prediction_type == "epsilon":
        return (sample - sigma * model_output) / alpha
    if prediction_type == "v_prediction":
        return alpha * sample - sigma * model_output
    return model_output  # "sample"


def init_noise_sigma(sigmas: np.ndarray, timestep_spacing: str) -> jax.Array:
    """lms's, euler's and euler_a's init_noise_sigma: the largest sigma, or sqrt(sigma^2 + 1) of it with
    leading spacing (so SDXL's latents start at sqrt(sigma_max^2 + 1))."""
    sigma = sigmas.max()
    return const(sigma if timestep_spacing in ("linspace", "trailing") else np.sqrt(sigma * sigma + F32(1)))


def scale_by_sigma(sample: jax.Array, sigma: jax.Array) -> jax.Array:
    """lms's, euler's and euler_a's model input: the sample divided by sqrt(sigma^2 + 1)."""
    return (sample / jnp.sqrt(sigma * sigma + 1)).astype(sample.dtype)


def noised(original: jax.Array, noise: jax.Array, start: jax.Array, noise_scale: jax.Array,
           signal: jax.Array | None = None) -> jax.Array:
    """PyTorch's `add_noise` at each job's first loop index (`start`: (B,)), an image job's
    start: signal[start] x + noise_scale[start] noise, in diffusers' op order (sigma schedulers:
    no signal, x + noise sigma)."""
    rows = (-1,) + (1,) * (original.ndim - 1)
    if signal is None:
        return original + noise * noise_scale[start].reshape(rows)
    return signal[start].reshape(rows) * original + noise_scale[start].reshape(rows) * noise


def steps_taken(i: jax.Array, begin: jax.Array | int, ndim: int) -> jax.Array:
    """How many steps each job has taken before loop index `i` (i - begin), shaped to broadcast
    over samples of `ndim` dimensions: a multistep scheduler's history is each job's own."""
    return jnp.reshape(jnp.asarray(i - begin, jnp.int32), (-1,) + (1,) * (ndim - 1))


def threshold(x0: jax.Array, ratio: float, max_value: float) -> jax.Array:
    """Imagen's dynamic thresholding (diffusers' `_threshold_sample`): per sample, clip to the
    `ratio` quantile s of |x0| (s within [1, max_value]) and divide by s."""
    flat = x0.reshape(x0.shape[0], -1)
    s = jnp.clip(jnp.quantile(jnp.abs(flat), ratio, axis=1), 1, max_value)[:, None]
    return (jnp.clip(flat, -s, s) / s).reshape(x0.shape)
