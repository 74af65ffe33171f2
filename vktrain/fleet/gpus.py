"""Which Vulkan device a fleet client opens: the GPU Ray assigned its worker, where that can be identified.

Ray (2.55) gives a worker with `num_gpus` GPU ids (`ray.get_runtime_context().get_accelerator_ids()["GPU"]`,
also exported as CUDA_VISIBLE_DEVICES on NVIDIA, HIP_VISIBLE_DEVICES on AMD, ONEAPI_DEVICE_SELECTOR on
Intel). On NVIDIA the ids are NVML indices (Ray counts GPUs through NVML), or the entries of a
CUDA_VISIBLE_DEVICES the node was started with (indices or `GPU-` UUIDs). Vulkan enumerates GPUs in its
own order, so an index means nothing to it: NVML (`pynvml`, else `nvidia-smi`) turns the index into the
GPU's UUID and PCI address, which the Vulkan device reports too (device_identity.py matches them).

Precedence: an explicit VKTRAIN_DEVICE wins; no Ray GPU (CPU clients, the sequential engine, lavapipe)
keeps vktrain's default ranking; a Ray GPU that cannot be named (no pynvml or nvidia-smi: AMD and Intel
hosts, whose ids are not mapped yet) falls back to the default ranking with that reason logged; a GPU
that NVML names but Vulkan does not list (or an id NVML does not know, or a MIG instance, which Vulkan
cannot open) is an error naming the id and the devices seen.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from vktrain.runtime.vk.device import DEVICE_ENV
from vktrain.runtime.vk.device_identity import GpuIdentity, PciAddress, parse_pci_address, parse_uuid
from vktrain.runtime.vk.errors import DeviceSelectionError

NVIDIA_SMI_QUERY = ("nvidia-smi", "--query-gpu=index,uuid,pci.bus_id", "--format=csv,noheader")


@dataclass(frozen=True)
class NvidiaGpu:
    index: int  # NVML's index (nvidia-smi's), which Ray's GPU ids are
    uuid: bytes
    pci: PciAddress


@dataclass(frozen=True)
class DeviceChoice:
    """What a client passes to Device(): a selector (None: VKTRAIN_DEVICE or the default ranking) and why."""
    selector: GpuIdentity | None
    reason: str


def parse_nvidia_smi(text: str) -> list[NvidiaGpu]:
    """`nvidia-smi --query-gpu=index,uuid,pci.bus_id --format=csv,noheader` lines: `0, GPU-..., 00000000:3B:00.0`."""
    gpus = []
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = [field.strip() for field in line.split(",")]
        if len(fields) != 3 or not fields[0].isdigit():
            raise DeviceSelectionError(f"{' '.join(NVIDIA_SMI_QUERY)}: expected 'index, uuid, pci.bus_id' lines, "
                                       f"found {line!r}")
        gpus.append(NvidiaGpu(int(fields[0]), parse_uuid(fields[1]), parse_pci_address(fields[2])))
    return gpus


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _nvml_gpus() -> list[NvidiaGpu] | None:
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:  # not installed, or no NVIDIA driver: the caller tries nvidia-smi
        return None
    try:
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            gpus.append(NvidiaGpu(index, parse_uuid(_text(pynvml.nvmlDeviceGetUUID(handle))),
                                  parse_pci_address(_text(pynvml.nvmlDeviceGetPciInfo(handle).busId))))
        return gpus
    finally:
        pynvml.nvmlShutdown()


def _nvidia_smi_gpus() -> list[NvidiaGpu] | None:
    if shutil.which(NVIDIA_SMI_QUERY[0]) is None:
        return None
    result = subprocess.run(NVIDIA_SMI_QUERY, capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        return None
    return parse_nvidia_smi(result.stdout)


def nvidia_gpus() -> tuple[list[NvidiaGpu] | None, str]:
    """This node's NVIDIA GPUs in NVML order and which tool listed them; (None, "") when neither pynvml
    nor nvidia-smi can."""
    gpus = _nvml_gpus()
    if gpus is not None:
        return gpus, "NVML"
    gpus = _nvidia_smi_gpus()
    return (gpus, "nvidia-smi") if gpus is not None else (None, "")


def ray_gpu_ids() -> list[str] | None:
    """The GPU ids Ray assigned this process (empty with no GPU reserved); None outside a Ray worker (the
    sequential engine, a fleet node)."""
    try:
        import ray
    except ImportError:
        return None
    if not ray.is_initialized():
        return None
    return [str(i) for i in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])]


def client_device_choice(environ: Mapping[str, str] | None = None, ray_ids: Sequence[str] | None = None,
                         list_nvidia: Callable[[], tuple[list[NvidiaGpu] | None, str]] | None = None) -> DeviceChoice:
    """The device a client process opens (module docstring's precedence). Defaults: os.environ, ray_gpu_ids(),
    nvidia_gpus (asked only when Ray assigned an index)."""
    explicit = (os.environ if environ is None else environ).get(DEVICE_ENV, "").strip()
    if explicit:
        return DeviceChoice(None, f"{DEVICE_ENV}={explicit} (explicit; wins over Ray's GPU assignment)")
    ids = ray_gpu_ids() if ray_ids is None else list(ray_ids)
    if ids is None:  # no Ray here to assign a GPU: saying "Ray assigned none" would mislead
        return DeviceChoice(None, "not a Ray worker (--engine sequential, or a fleet node): vktrain's default "
                                  "ranking (discrete first)")
    if not ids:
        return DeviceChoice(None, "no GPU assigned by Ray: vktrain's default ranking (discrete first)")
    first = ids[0]
    source = f"Ray GPU id {first}" + (f" (first of {', '.join(ids)})" if len(ids) > 1 else "")
    if first.upper().startswith("MIG-"):
        raise DeviceSelectionError(f"{source} is a MIG instance; Vulkan cannot open MIG instances, "
                                   f"reserve whole GPUs (or fractions of one) for vktrain clients")
    if first.upper().startswith("GPU-"):
        return DeviceChoice(GpuIdentity(source, uuid=parse_uuid(first)), f"{source}, a UUID")
    if not first.isdigit():
        raise DeviceSelectionError(f"{source}: expected an NVML index or a GPU- UUID, found {first!r}")
    gpus, tool = (nvidia_gpus if list_nvidia is None else list_nvidia)()
    if gpus is None:
        return DeviceChoice(None, f"{source} cannot be named (neither pynvml nor nvidia-smi found; AMD and Intel "
                                  f"ids are not mapped to Vulkan devices): vktrain's default ranking; set "
                                  f"{DEVICE_ENV} per client to choose")
    by_index = {gpu.index: gpu for gpu in gpus}
    if int(first) not in by_index:
        listing = ", ".join(f"{g.index} ({g.pci})" for g in gpus) or "none"
        raise DeviceSelectionError(f"{source} is not a GPU {tool} lists; {tool} lists: {listing}")
    gpu = by_index[int(first)]
    return DeviceChoice(GpuIdentity(f"{source} ({tool} index {gpu.index})", uuid=gpu.uuid, pci=gpu.pci),
                        f"{source}, matched through {tool}'s UUID / PCI address")


__all__ = ["DeviceChoice", "NvidiaGpu", "client_device_choice", "nvidia_gpus", "parse_nvidia_smi", "ray_gpu_ids"]
