"""The accelerators a model can be planned for (`renderfarm plan`): what each target is, and its
devices to compile for without owning one.

TPU targets compile on any machine with libtpu installed (`pip install "jax[tpu]"`):
`jax.experimental.topologies.get_topology_desc` describes a TPU host's chips, and XLA compiles
for them with their real memory and cost model. `cpu` compiles for this machine's CPU devices.
GPU targets compile through jax's CUDA plugin (jax 0.12 and later, Python 3.12) for a described
GPU: XLA's `GpuTargetConfig`, written here from the chip's public specs (`Gpu`), with the cuDNN
and CUDA versions installed beside the plugin (the nvidia-cudnn-cu12 and nvidia-cuda-nvcc-cu12
wheels, the ones a worker installing the same lock runs). Without a GPU the plugin starts only
with `JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1` (it checks the CUDA libraries a GPU run would load),
set here before JAX starts its backends; on older jax the GPU targets are refused with what to
install.

Memory per device is the chip's HBM; `usable` is the share of it a program may take: JAX's
allocator takes 75% of a GPU's memory by default (`XLA_PYTHON_CLIENT_MEM_FRACTION`), and on a
TPU 10% is left for the runtime and fragmentation (docs/performance.md, "The largest batch per
device"); a worker on the chip itself counts from JAX's `bytes_limit` (`usable_share`).
libtpu's v4 topology has no megacore: a v4 chip compiles as its two TensorCores, each a device
with half the chip's memory and peak.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from diffusion.errors import ModelError

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
class Gpu:
    """What XLA's GpuTargetConfig needs of an NVIDIA GPU beyond its memory, from its public specs."""

    device: str  # the name its driver reports (jax's device_kind)
    capability: tuple[int, int]  # CUDA compute capability
    sms: int  # streaming multiprocessors
    cores_per_sm: int  # FP32 lanes per SM
    clock_ghz: float  # boost clock
    bandwidth: float  # memory bandwidth, bytes/s
    l2_bytes: int
    shared_per_sm: int  # shared memory per SM, bytes
    threads_per_sm: int

    def target_config(self, memory: int, cudnn: tuple[int, int, int], cuda: tuple[int, int]) -> str:
        """The GpuTargetConfig as text (the plugin's `target_config`) for this GPU with `memory`
        bytes, `cudnn` and `cuda` (major, minor[, patch]) installed."""
        major, minor = self.capability
        return f"""gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 threads_per_core_limit: {self.threads_per_sm}
  shared_memory_per_block: 49152 shared_memory_per_core: {self.shared_per_sm}
  shared_memory_per_block_optin: {self.shared_per_sm - 1024}
  core_count: {self.sms} fpus_per_core: {self.cores_per_sm} clock_rate_ghz: {self.clock_ghz}
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: {int(self.bandwidth)} l2_cache_size: {self.l2_bytes} device_memory_size: {memory}
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
  cuda_compute_capability {{ major: {major} minor: {minor} }}
}}
platform_name: "CUDA"
dnn_version_info {{ major: {cudnn[0]} minor: {cudnn[1]} patch: {cudnn[2]} }}
runtime_version {{ major: {cuda[0]} minor: {cuda[1]} }}
device_description_str: "{self.device}"
"""


# NVIDIA's datasheets and CUDA programming guide (shared memory per SM less the 1 KB a block
# reserves is the most one block may opt into).
H100_SXM = Gpu("NVIDIA H100 80GB HBM3", (9, 0), 132, 128, 1.98, 3.35e12, 50 * 2**20, 228 * 2**10, 2048)
A100_SXM_80G = Gpu("NVIDIA A100-SXM4-80GB", (8, 0), 108, 64, 1.41, 2.039e12, 40 * 2**20, 164 * 2**10, 2048)
L4 = Gpu("NVIDIA L4", (8, 9), 58, 128, 2.04, 300e9, 48 * 2**20, 100 * 2**10, 1536)


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
    gpu: Gpu | None = None  # the GPU (cuda targets)

    @property
    def compiler_options(self) -> dict[str, int]:
        """XLA's options for compiling for this target without its devices. A GPU's autotuner
        (`xla_gpu_autotune_level`, 0: off) can time no candidate kernel on a machine without the
        GPU, and trying them took half of a tiny model's compile; XLA's default kernels stand in,
        with the same memory counts. A worker on the GPU compiles, and autotunes, its own."""
        return {"xla_gpu_autotune_level": 0} if self.platform == "cuda" else {}

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
    Target("h100", "NVIDIA H100 SXM (1 GPU)", "cuda", 1, 80 * GB, GPU_USABLE, _peak("NVIDIA H100"), gpu=H100_SXM),
    Target("h100-8", "NVIDIA H100 SXM x8", "cuda", 8, 80 * GB, GPU_USABLE, _peak("NVIDIA H100"), gpu=H100_SXM),
    Target("a100-80g", "NVIDIA A100 80GB SXM (1 GPU)", "cuda", 1, 80 * GB, GPU_USABLE, _peak("NVIDIA A100"),
           gpu=A100_SXM_80G),
    Target("l4", "NVIDIA L4 (1 GPU)", "cuda", 1, 24 * GB, GPU_USABLE, _peak("NVIDIA L4"), gpu=L4),
    Target("cpu", "this machine's CPU devices", "cpu", 0, None, 1.0, None),
)}


def usable_share(platform: str) -> float:
    """The share of a device's JAX `bytes_limit` a program may take on `platform` (a GPU's
    limit is already JAX's share of its memory)."""
    return TPU_USABLE if platform == "tpu" else 1.0


def target(name: str) -> Target:
    """The target called `name`; an unknown name is refused naming the known ones."""
    if name not in TARGETS:
        raise ModelError("target", name, f"must be one of {', '.join(TARGETS)}")
    return TARGETS[name]


def target_devices(chosen: Target) -> Sequence[jax.Device]:
    """The devices to compile for: a TPU topology's (libtpu), a described GPU host's (jax's CUDA
    plugin), or this machine's CPUs; a refusal says what a target needs."""
    import jax

    if chosen.platform == "cpu":
        return jax.devices("cpu")
    from jax.experimental import topologies

    if chosen.platform == "cuda":
        return _checked(chosen, _gpu_devices(chosen))
    # A compile-only client: other processes may use libtpu at the same time (by default the
    # second one is refused: "Internal error when accessing libtpu multi-process lockfile").
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        devices = topologies.get_topology_desc(topology_name=chosen.topology, platform="tpu").devices
    except Exception as err:  # noqa: BLE001 - libtpu missing or refusing the topology: say which
        raise ModelError("target", chosen.name, f"compiling for {chosen.label} needs libtpu "
                                                f"(pip install 'jax[tpu]=={jax.__version__}'): {err}") from None
    return _checked(chosen, devices)


def _checked(chosen: Target, devices: Sequence[jax.Device]) -> Sequence[jax.Device]:
    """`devices`, refused unless the target has that many."""
    if len(devices) != chosen.devices:
        raise ModelError("target", chosen.name, f"the compiler describes {len(devices)} devices for {chosen.label}, "
                                                f"the target {chosen.devices}")
    return devices


def _gpu_devices(chosen: Target) -> Sequence[jax.Device]:
    """A described GPU host's devices from jax's CUDA plugin, for the cuDNN and CUDA installed."""
    import jax
    from jax.experimental import topologies

    assert chosen.gpu is not None and chosen.memory is not None
    needs = (f"compiling for {chosen.label} without the GPU needs jax 0.12 or later (Python 3.12) with the CUDA "
             f"plugin of its version, nvcc and cuDNN (jax-cuda12-plugin, nvidia-cuda-nvcc-cu12 and "
             f"nvidia-cudnn-cu12: `make` installs them); this is jax {jax.__version__}")
    try:
        cudnn, cuda = (_version(name) for name in ("nvidia-cudnn-cu12", "nvidia-cuda-nvcc-cu12"))
    except importlib.metadata.PackageNotFoundError as err:
        raise ModelError("target", chosen.name, f"{needs}: {err.name} is not installed") from None
    # The plugin checks the CUDA libraries a GPU run loads when JAX starts it, and with no GPU
    # fails; a compile-only client loads none of them.
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    config = chosen.gpu.target_config(chosen.memory, cudnn[:3], cuda[:2])
    try:
        return topologies.get_topology_desc(platform="cuda", target_config=config,
                                            topology=f"1x1x{chosen.devices}").devices
    except Exception as err:  # noqa: BLE001 - no plugin, or one JAX started before: say which
        raise ModelError("target", chosen.name, f"{needs}, started with JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 (or "
                                                f"JAX_PLATFORMS=cpu) before JAX starts its backends: {err}") from None


def _version(package: str) -> tuple[int, ...]:
    """The installed `package`'s version as numbers: (9, 28, 0, 42)."""
    return tuple(int(part) for part in importlib.metadata.version(package).split(".") if part.isdigit())
