"""Which tuning of the fp32 GEMM kernels (the linear family, matmul.slang) a device runs, chosen once at load.

GPU_TUNING: shared-memory tiles of 64-256 threads and barriers, tuned on large GPUs (bench/results: H200).
CPU_TUNING: register-tile variants for CPU Vulkan implementations (VkPhysicalDeviceType CPU: lavapipe /
llvmpipe, SwiftShader). Those run a workgroup's invocations as the SIMD lanes of one CPU thread, split
a shader at every barrier and turn each load whose address differs between lanes into a per-lane
loop; so each invocation keeps a tile of outputs in registers, a workgroup is one SIMD width of
invocations, nothing goes through shared memory, and nothing is split along the reduction (a CPU has a
handful of cores to keep busy, not a hundred compute units).

The CPU bodies share values between the lanes of a workgroup with subgroupShuffle, one subgroup of
CPU_SUBGROUP_SIZE lanes per workgroup, and load pairs of floats as 64-bit integers: a CPU device whose
subgroups differ (or lack shuffles in compute), or without shaderInt64, keeps the GPU tuning.

The executor picks the tuning with `select_gemm_tuning(device)` and carries it in its GemmRoute
(`GemmRoute.fp32_tuning`); the plan functions take it as `tuning=`. The environment variable
VKTRAIN_GEMM_TUNING=gpu|cpu overrides the device's choice (benchmarks timing both on one device).
"""
from __future__ import annotations

import os
from typing import Any

from vktrain.serialization.strided_view import KernelArgumentError

GPU_TUNING = "gpu"
CPU_TUNING = "cpu"
TUNINGS = (GPU_TUNING, CPU_TUNING)
TUNING_ENV = "VKTRAIN_GEMM_TUNING"

# Vulkan's VkPhysicalDeviceType names as vktrain's Device reports them (Device.device_type).
CPU_DEVICE_TYPE = "cpu"
# What the CPU bodies need (linear_tiles.CPU_LANES = matmul_cpu.CPU_LANES invocations per workgroup).
CPU_SUBGROUP_SIZE = 8
SUBGROUP_SHUFFLE_BIT = 0x10  # VK_SUBGROUP_FEATURE_SHUFFLE_BIT


class GemmTuningError(KernelArgumentError):
    """VKTRAIN_GEMM_TUNING or a plan's `tuning=` names no known tuning."""


def check_tuning(tuning: Any, what: str = "tuning") -> str:
    """`tuning` if it is one of TUNINGS, else a GemmTuningError naming `what`."""
    if tuning not in TUNINGS:
        raise GemmTuningError(f"{what} must be one of {', '.join(TUNINGS)}, got {tuning!r}")
    return tuning


def runs_cpu_bodies(device: Any) -> bool:
    """Whether `device` (what a vktrain Device says of its subgroups and features) can run the CPU bodies."""
    return (device.subgroup_size == CPU_SUBGROUP_SIZE and bool(device.subgroup_operations & SUBGROUP_SHUFFLE_BIT)
            and "shaderInt64" in device.features)


def select_gemm_tuning(device: Any, environ: Any = None) -> str:
    """The tuning for `device` (a vktrain Device): VKTRAIN_GEMM_TUNING when set, else CPU_TUNING for a CPU
    implementation that can run the CPU bodies and GPU_TUNING for everything else."""
    environ = os.environ if environ is None else environ
    override = environ.get(TUNING_ENV, "").strip().lower()
    if override:
        tuning = check_tuning(override, f"the environment variable {TUNING_ENV}")
        if tuning == CPU_TUNING and not runs_cpu_bodies(device):
            raise GemmTuningError(
                f"{TUNING_ENV}={override}: {device.name} cannot run the CPU bodies: they need subgroups of "
                f"{CPU_SUBGROUP_SIZE} lanes with shuffles in compute shaders and shaderInt64, it has "
                f"{device.subgroup_size} lanes, operations {device.subgroup_operations:#x} and features "
                f"{sorted(device.features)}")
        return tuning
    return CPU_TUNING if device.device_type == CPU_DEVICE_TYPE and runs_cpu_bodies(device) else GPU_TUNING
