"""DPM-Solver++ multistep, as PyTorch diffusers' `DPMSolverMultistepScheduler`.

Which order each step uses (warm-up, `lower_order_final`, `euler_at_final`) and every scalar of
the update (alphas, sigmas, log-SNR steps h and their ratios) depend only on the config and the
step count, so `set_timesteps` computes them in float32 with PyTorch's formulas and op order; the
device keeps the last `solver_order` data predictions in a fixed-size buffer and picks the
step's order with a select. Only the deterministic algorithm_type "dpmsolver++" is ported
(diffusers' default, and what it turns "deis" into).
"""

from __future__ import annotations

import dataclasses
import math

import flax
import jax
import jax.numpy as jnp
import numpy as np

from diffusion.schedulers.common import (
    F32,
    SigmaScheduleConfig,
    check_first_timestep,
    const,
    data_prediction,
    interp_sigmas,
    karras_sigmas,
    noised,
    sigma_to_t,
    steps_taken,
    threshold,
    train_sigmas,
)

_COEFFS = ("ratio", "b", "c1", "c2", "inv_r0", "inv_r1", "w", "inv_r01")


@flax.struct.dataclass
class DPMState:
    init_noise_sigma: jax.Array  # () float32
    timesteps: jax.Array  # (M,) float32, integer-valued
    order: jax.Array  # (M,) int32: the solver order of each step (of a job begun at step 0)
    alpha: jax.Array  # (M,) alpha_t of sigmas[i], to turn the model output into x0
    sigma: jax.Array  # (M,) sigma_t of sigmas[i]
    coeffs: jax.Array  # (M, solver_order, len(_COEFFS)): each step's scalars of an update of each order
    outputs: jax.Array  # (solver_order, *shape) float32: data predictions, newest first


@dataclasses.dataclass(frozen=True, kw_only=True)
class DPMScheduler(SigmaScheduleConfig):
    """Options and defaults of PyTorch's `DPMSolverMultistepScheduler`."""

    solver_order: int = 2
    thresholding: bool = False
    dynamic_thresholding_ratio: float = 0.995
    sample_max_value: float = 1.0
    algorithm_type: str = "dpmsolver++"
    solver_type: str = "midpoint"
    lower_order_final: bool = True
    euler_at_final: bool = False
    use_lu_lambdas: bool = False
    use_flow_sigmas: bool = False
    flow_shift: float = 1.0
    final_sigmas_type: str = "zero"
    lambda_min_clipped: float = -math.inf
    variance_type: str | None = None
    rescale_betas_zero_snr: bool = False
    use_dynamic_shifting: bool = False
    time_shift_type: str = "exponential"

    name = "dpm"
    diffusers_class = "DPMSolverMultistepScheduler"
    history = True

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require("solver_order", (1, 2, 3))
        # PyTorch's constructor turns DEIS's and UniPC's values into these.
        self.require("algorithm_type", ("dpmsolver++", "deis"))
        self.require("solver_type", ("midpoint", "heun", "logrho", "bh1", "bh2"))
        self.require("use_flow_sigmas", (False,))
        self.require("final_sigmas_type", ("zero", "sigma_min"))
        self.require("variance_type", (None,))
        if self.algorithm_type == "deis" and self.final_sigmas_type == "zero":
            raise ValueError("dpm scheduler: algorithm_type='deis' needs final_sigmas_type='sigma_min' "
                             "(as in PyTorch diffusers), not 'zero'")

    def set_timesteps(self, steps: int, shape: tuple[int, ...]) -> DPMState:
        """Timesteps, per-step orders and update coefficients for `steps`."""
        alphas_cumprod = self.alphas_cumprod(self.rescale_betas_zero_snr)
        if self.rescale_betas_zero_snr:
            alphas_cumprod[-1] = 2**-24  # as PyTorch: keeps the first sigma finite
        sigmas_train = train_sigmas(alphas_cumprod)
        log_sigmas = np.log(sigmas_train)
        lambdas = np.log(np.sqrt(alphas_cumprod)) - np.log(np.sqrt(F32(1) - alphas_cumprod))
        last = self.num_train_timesteps - np.searchsorted(lambdas[::-1], self.lambda_min_clipped)
        # DPM spaces steps + 1 points and drops the last (t = 0), except with trailing spacing.
        if self.timestep_spacing == "trailing":
            timesteps = self.spaced_timesteps(steps, last)
        else:
            timesteps = self.spaced_timesteps(steps + 1, last)[:-1].round()
        # As PyTorch: Karras, else Lu's, else exponential sigmas replace the spaced ones, and the
        # timesteps become theirs, rounded (truncated for exponential sigmas or a cosine schedule).
        rounded = self.beta_schedule != "squaredcos_cap_v2"
        if self.use_lu_lambdas and not self.use_karras_sigmas:  # log sigma evenly spaced
            sigmas = np.exp(karras_sigmas(float(log_sigmas[-1]), float(log_sigmas[0]), steps, rho=1.0))
        else:
            sigmas = self.resampled_sigmas(sigmas_train[::-1], steps)
            rounded = rounded and not self.use_exponential_sigmas
        if sigmas is None:
            sigmas = interp_sigmas(timesteps, sigmas_train)
        else:
            timesteps = sigma_to_t(sigmas, log_sigmas)
            timesteps = timesteps.round() if rounded else timesteps
        timesteps = timesteps.astype(np.int64)
        check_first_timestep(timesteps)
        final = sigmas_train[0] if self.final_sigmas_type == "sigma_min" else 0.0
        sigmas = np.append(sigmas, final).astype(F32)

        alpha = F32(1) / np.sqrt(sigmas * sigmas + F32(1))
        sigma = sigmas * alpha
        order = self._orders(len(timesteps))
        # Every order a step can take: up to `order`, lower for a job begun part way (image jobs).
        coeffs = np.zeros((len(timesteps), self.solver_order, len(_COEFFS)), F32)
        with np.errstate(divide="ignore"):  # a final sigma of 0 has lambda = inf
            lam = np.log(alpha) - np.log(sigma)
            for i, top in enumerate(order):
                for k in range(1, top + 1):
                    # lambda at sigmas[i + 1], sigmas[i] and the (up to) two before
                    coeffs[i, k - 1] = self._coefficients(alpha[i + 1], sigma[i + 1] / sigma[i], lam[i + 1::-1][:4], k)
        return DPMState(
            init_noise_sigma=const(1.0),
            timesteps=const(timesteps),
            order=jnp.asarray(order, jnp.int32),
            alpha=const(alpha[:-1]),
            sigma=const(sigma[:-1]),
            coeffs=const(coeffs),
            outputs=jnp.zeros((self.solver_order, *shape), jnp.float32),
        )

    def _orders(self, m: int) -> list[int]:
        """PyTorch's order for each of `m` steps: warm-up, then lower orders at the end."""
        orders = []
        for i in range(m):
            final = i == m - 1 and (self.euler_at_final or (self.lower_order_final and m < 15)
                                    or self.final_sigmas_type == "zero")
            second = i == m - 2 and self.lower_order_final and m < 15
            if self.solver_order == 1 or i < 1 or final:
                orders.append(1)
            elif self.solver_order == 2 or i < 2 or second:
                orders.append(2)
            else:
                orders.append(3)
        return orders

    def _coefficients(self, alpha_t: np.float32, ratio: np.float32, lam: np.ndarray,
                      order: int) -> list[np.float32]:
        """The scalars of an `order` update to lam[0] from lam[1] (lam[2:], older, for the
        multistep terms), in float32 as PyTorch computes them; unused ones are 0."""
        h = lam[0] - lam[1]
        b = alpha_t * (np.exp(-h) - F32(1))
        c1 = c2 = inv_r0 = inv_r1 = w = inv_r01 = F32(0)
        if order >= 2:
            r0 = (lam[1] - lam[2]) / h
            inv_r0 = F32(1) / r0
            heun = alpha_t * ((np.exp(-h) - F32(1)) / h + F32(1))
            c1 = -(F32(0.5) * b) if order == 2 and self.solver_type != "heun" else heun
        if order == 3:
            r1 = (lam[2] - lam[3]) / h
            inv_r1, w, inv_r01 = F32(1) / r1, r0 / (r0 + r1), F32(1) / (r0 + r1)
            c2 = alpha_t * ((np.exp(-h) - F32(1) + h) / (h * h) - F32(0.5))
        return [ratio, b, c1, c2, inv_r0, inv_r1, w, inv_r01]

    def add_noise(self, state: DPMState, original: jax.Array, noise: jax.Array, start: jax.Array) -> jax.Array:
        """alpha_t x + sigma_t noise at each job's begin index."""
        return noised(original, noise, start, state.sigma, state.alpha)

    def scale_model_input(self, state: DPMState, sample: jax.Array, i: jax.Array) -> jax.Array:
        """DPM-Solver does not scale the model input."""
        return sample

    def step(self, state: DPMState, model_output: jax.Array, i: jax.Array, sample: jax.Array,
             begin: jax.Array | int = 0) -> tuple[jax.Array, DPMState]:
        """Convert the output to a data prediction x0, then a multistep update of order
        state.order[i] from the newest predictions m0, m1, m2; lower for a job begun at step
        `begin` that holds fewer (PyTorch's lower_order_nums counts a job's own steps)."""
        x = sample.astype(jnp.float32)
        x0 = data_prediction(self.prediction_type, x, model_output.astype(jnp.float32), state.alpha[i], state.sigma[i])
        if self.thresholding:
            x0 = threshold(x0, self.dynamic_thresholding_ratio, self.sample_max_value)
        outputs = jnp.concatenate([x0[None], state.outputs[:-1]])
        coeffs = [dict(zip(_COEFFS, (state.coeffs[i, k, n] for n in range(len(_COEFFS)))))
                  for k in range(self.solver_order)]

        # The update of every order up to solver_order, then the step's: cheaper than a branch.
        first = coeffs[0]["ratio"] * x - coeffs[0]["b"] * outputs[0]
        updates = [first]
        if self.solver_order >= 2:
            c = coeffs[1]
            updates.append(first + c["c1"] * (c["inv_r0"] * (outputs[0] - outputs[1])))
        if self.solver_order == 3:
            c = coeffs[2]
            d1 = c["inv_r0"] * (outputs[0] - outputs[1])
            d1_1 = c["inv_r1"] * (outputs[1] - outputs[2])
            updates.append(first + c["c1"] * (d1 + c["w"] * (d1 - d1_1)) - c["c2"] * (c["inv_r01"] * (d1 - d1_1)))
        order = jnp.minimum(state.order[i], steps_taken(i, begin, x.ndim) + 1)
        prev = updates[-1]
        for k in range(len(updates) - 1, 0, -1):
            prev = jnp.where(order == k, updates[k - 1], prev)
        return prev.astype(sample.dtype), state.replace(outputs=outputs)
