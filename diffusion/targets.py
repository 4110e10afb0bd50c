"""The accelerators a model can be planned for (`renderfarm plan`): what each target is, and its
devices to compile for without owning one.

TPU targets compile on any machine with libtpu installed (`pip install "jax[tpu]"`):
`jax.experimental.topologies.get_topology_desc` describes a TPU host's chips, and XLA compiles
for them with their real memory and cost model. `cpu` compiles for this machine's CPU devices.
GPU targets need jax's CUDA plugin with a described GPU (`GpuTargetConfig`), which takes jax
0.12 (Python 3.12); on older jax they are refused with what to install.

Memory per device is the chip's HBM; `usable` is the share of it a program may take: JAX's
allocator takes 75% of a GPU's memory by default (`XLA_PYTHON_CLIENT_MEM_FRACTION`), and on a
TPU 10% is left for the runtime and fragmentation (docs/performance.md, "The largest batch per
device"); a worker on the chip itself counts from JAX's `bytes_limit` (`usable_share`).
libtpu's v4 topology has no megacore: a v4 chip compiles as its two TensorCores, each a device
with half the chip's memory and peak.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from renderfarm.jobs import JobError

if TYPE_CHECKING:
    import jax

GIB, GB = 2**30, 10**9
# The one table of chips' peaks: dense bfloat16 TFLOP/s per JAX device, by JAX's device_kind
# (vendor spec sheets). The targets below take theirs from it, and a worker on a device reads
# its own (diffusion.flops.peak_flops). TPU v2 and v3 show each of a chip's two TensorCores as
# a device; later TPUs and GPUs show one device per chip.
PEAK_TFLOPS = {
    "TPU v2": 22.5, "TPU v3": 61.5, "TPU v4": 275.0, "TPU v5 lite": 197.0, "TPU v5e": 197.0,
    "TPU v5": 459.0, "TPU v5p": 459.0, "TPU v6 lite": 918.0, "TPU v6e": 918.0, "TPU7x": 2307.0,
    "NVIDIA H100 PCIe": 756.0, "NVIDIA H100": 989.0, "NVIDIA H200": 989.0, "NVIDIA A100": 312.0,
    "NVIDIA L4": 121.0,
}
# The share of a device's memory (HBM, or JAX's `bytes_limit` on the device itself) a program
# may take: a GPU's limit is already JAX's 75%; on a TPU, 10% is left over.
TPU_USABLE, GPU_USABLE = 0.9, 0.75


@dataclasses.dataclass(frozen=True)
class Target:
    """An accelerator host to plan for: its devices as JAX sees them, each one's memory and peak."""

    name: str
    label: str
    platform: str  # "tpu", "cuda" or "cpu"
    devices: int  # JAX devices on the host
    memory: int | None  # bytes of memory per device; None: no limit known (cpu)
    usable: float  # share of `memory` a program may take
    peak_flops: float | None  # dense bfloat16 FLOP/s per device
    topology: str | None = None  # libtpu's topology name (TPU targets)

    @property
    def usable_bytes(self) -> int | None:
        """What a program may take of one device's memory (None: no limit known)."""
        return None if self.memory is None else int(self.memory * self.usable)


def _peak(device_kind: str, share: float = 1.0) -> float:
    """FLOP/s of a device of `device_kind` (`share` of one, where a target's device is part of it)."""
    return PEAK_TFLOPS[device_kind] * 1e12 * share


TARGETS: dict[str, Target] = {target.name: target for target in (
    # libtpu's v4 topology compiles each chip as its two TensorCores: half a chip's memory and peak
    Target("tpu-v4-8", "TPU v4-8 (4 chips, 8 TensorCores)", "tpu", 8, 16 * GIB, TPU_USABLE, _peak("TPU v4", 0.5),
           "v4:2x2x1"),
    Target("tpu-v5e-8", "TPU v5e-8 (8 chips)", "tpu", 8, 16 * GIB, TPU_USABLE, _peak("TPU v5 lite"), "v5e:2x4"),
    Target("tpu-v5p-8", "TPU v5p-8 (4 chips)", "tpu", 4, 95 * GIB, TPU_USABLE, _peak("TPU v5p"), "v5p:2x2x1"),
    Target("tpu-v6e-8", "TPU v6e-8 (8 chips)", "tpu", 8, 32 * GIB, TPU_USABLE, _peak("TPU v6 lite"), "v6e:2x4"),
    Target("h100", "NVIDIA H100 SXM (1 GPU)", "cuda", 1, 80 * GB, GPU_USABLE, _peak("NVIDIA H100")),
    Target("h100-8", "NVIDIA H100 SXM x8", "cuda", 8, 80 * GB, GPU_USABLE, _peak("NVIDIA H100")),
    Target("a100-80g", "NVIDIA A100 80GB (1 GPU)", "cuda", 1, 80 * GB, GPU_USABLE, _peak("NVIDIA A100")),
    Target("l4", "NVIDIA L4 (1 GPU)", "cuda", 1, 24 * GB, GPU_USABLE, _peak("NVIDIA L4")),
    Target("cpu", "this machine's CPU devices", "cpu", 0, None, 1.0, None),
)}


def usable_share(platform: str) -> float:
    """The share of a device's JAX `bytes_limit` a program may take on `platform` (a GPU's
    limit is already JAX's share of its memory)."""
    return TPU_USABLE if platform == "tpu" else 1.0


def target(name: str) -> Target:
    """The target called `name`; an unknown name is refused naming the known ones."""
    if name not in TARGETS:
        raise JobError("target", name, f"must be one of {', '.join(TARGETS)}")
    return TARGETS[name]


def target_devices(chosen: Target) -> Sequence[jax.Device]:
    """The devices to compile for: a TPU topology's (libtpu), this machine's CPUs, or a refusal
    that says what a GPU target needs."""
    import jax

    if chosen.platform == "cpu":
        return jax.devices("cpu")
    if chosen.platform == "cuda":
        raise JobError("target", chosen.name, f"compiling for {chosen.label} without the GPU needs jax[cuda12]>=0.12 "
                                              f"(Python 3.12) and its CUDA plugin given a described GPU "
                                              f"(GpuTargetConfig), which plan does not drive yet; this is jax "
                                              f"{jax.__version__}: the TPU targets and cpu compile here")
    from jax.experimental import topologies

    # A compile-only client: other processes may use libtpu at the same time (by default the
    # second one is refused: "Internal error when accessing libtpu multi-process lockfile").
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        devices = topologies.get_topology_desc(topology_name=chosen.topology, platform="tpu").devices
    except Exception as err:  # noqa: BLE001 - libtpu missing or refusing the topology: say which
        raise JobError("target", chosen.name, f"compiling for {chosen.label} needs libtpu "
                                              f"(pip install 'jax[tpu]=={jax.__version__}'): {err}") from None
    if len(devices) != chosen.devices:
        raise JobError("target", chosen.name, f"libtpu's topology {chosen.topology} has {len(devices)} devices, "
                                              f"the target {chosen.devices}")
    return devices
