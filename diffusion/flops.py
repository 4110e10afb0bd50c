"""FLOPs of compiled programs and the achieved FLOP/s against a device's peak, so a worker
on real hardware can say what fraction of its accelerators' peak it reaches.

The counts are XLA's own (`cost_analysis`), which needs shapes only, never weights. One
trap: XLA counts the body of a loop once, whatever its trip count, so a program that runs
the UNet in a `fori_loop` of N steps reports the cost of one step; `denoise_flops` adds
the other N - 1 from a separately lowered denoiser call (each family's `denoiser_flops`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from typing import Any

from diffusion.targets import PEAK_TFLOPS

PEAK_ENV = "RENDERFARM_PEAK_TFLOPS"  # per JAX device; overrides diffusion.targets' table


def program_flops(compiled: Any) -> float | None:
    """FLOPs XLA counted for a compiled (or lowered) program; None where the backend gives
    none. jax returns a dict, a one-element list of dicts (older releases) or None."""
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - some backends do not implement cost analysis
        return None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    flops = cost.get("flops") if isinstance(cost, Mapping) else None
    return float(flops) if flops is not None and flops > 0 else None


def counted_once(count: Callable[..., float | None]) -> Callable[..., float | None]:
    """`count(network, params, *sizes)`, FLOPs of a network lowered on the shapes of its
    `params`, kept per network, parameter shapes and dtypes, sizes and the attention it traces
    (`traced_as`): lowering a denoiser takes about as long as tracing the program it is counted
    for, and every program compiled for a shape asks for its denoiser's count (each scheduler's,
    step count's and guidance's)."""
    counts: dict[Any, float | None] = {}

    @functools.wraps(count)
    def counted(network: Any, params: Any, *sizes: Any) -> float | None:
        import jax

        from diffusion.nn.attention import traced_as

        leaves, tree = jax.tree.flatten(params)
        key = (network, tree, tuple((tuple(leaf.shape), str(leaf.dtype)) for leaf in leaves), sizes, traced_as())
        if key not in counts:
            counts[key] = count(network, params, *sizes)
        return counts[key]

    counted.cache_clear = counts.clear  # type: ignore[attr-defined]  # as functools' caches have
    return counted


def denoise_flops(program: float | None, unet_step: float | None, steps: int) -> float | None:
    """FLOPs of a program whose `steps`-long denoising loop XLA counted once."""
    if program is None or unet_step is None:
        return None
    return program + (steps - 1) * unet_step


def peak_flops(device_kind: str) -> float | None:
    """Peak FLOP/s of one device: $RENDERFARM_PEAK_TFLOPS, else the chips' table (longest matching
    prefix of JAX's device_kind), else None (CPUs and unknown devices)."""
    if os.environ.get(PEAK_ENV):
        return float(os.environ[PEAK_ENV]) * 1e12
    matches = [name for name in PEAK_TFLOPS if device_kind.startswith(name)]
    return PEAK_TFLOPS[max(matches, key=len)] * 1e12 if matches else None


def describe_rate(flops: float | None, seconds: float, device_kind: str, devices: int) -> str:
    """'41.2 TFLOP/s, 21% of peak (8 x TPU v5 lite at 197 TFLOP/s)' for one batch."""
    if flops is None or seconds <= 0:
        return "FLOP/s unknown"
    rate = flops / seconds
    text = f"{rate / 1e12:.2f} TFLOP/s"
    peak = peak_flops(device_kind)
    if peak is not None:
        text += f", {rate / (peak * devices):.0%} of peak ({devices} x {device_kind} at {peak / 1e12:g} TFLOP/s)"
    return text
