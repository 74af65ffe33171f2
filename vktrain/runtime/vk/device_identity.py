"""Which Vulkan physical device is a GPU named by another API (NVML, CUDA, a scheduler such as Ray).

Two identities survive across APIs: the device UUID (VkPhysicalDeviceIDProperties.deviceUUID, core in
Vulkan 1.1; on NVIDIA it is the NVML/nvidia-smi UUID `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`) and the
PCI address (VK_EXT_pci_bus_info, where the driver lists it; NVML's `pci.bus_id`). `GpuIdentity` holds
either or both, with where they came from; `match_physical_device` picks the one Vulkan device that has
them, the UUID deciding when both sides know it, else the PCI address.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from vktrain.runtime.vk.errors import DeviceSelectionError

UUID_BYTES = 16
_PCI_PATTERN = re.compile(r"^(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])$")


@dataclass(frozen=True)
class PciAddress:
    domain: int
    bus: int
    device: int
    function: int

    def __str__(self) -> str:
        return f"{self.domain:04x}:{self.bus:02x}:{self.device:02x}.{self.function}"


def parse_pci_address(text: str) -> PciAddress:
    """`[domain:]bus:device.function` in hex: nvidia-smi's `00000000:3B:00.0`, lspci's `3b:00.0`."""
    match = _PCI_PATTERN.match(text.strip())
    if match is None:
        raise DeviceSelectionError(f"PCI address {text!r}: expected [domain:]bus:device.function in hex "
                                   f"(e.g. 00000000:3B:00.0)")
    domain, bus, device, function = match.groups()
    return PciAddress(int(domain or "0", 16), int(bus, 16), int(device, 16), int(function))


def parse_uuid(text: str) -> bytes:
    """The 16 bytes of a UUID written as NVML does (`GPU-` prefix, dashes optional)."""
    digits = text.strip()
    if digits.upper().startswith("GPU-"):
        digits = digits[4:]
    digits = digits.replace("-", "")
    if not re.fullmatch(r"[0-9a-fA-F]{32}", digits):
        raise DeviceSelectionError(f"GPU UUID {text!r}: expected 32 hex digits (e.g. GPU-1b2c...-...), "
                                   f"found {len(digits)} characters")
    return bytes.fromhex(digits)


def format_uuid(uuid: bytes) -> str:
    """NVML's spelling of a 16-byte UUID (so a log line can be compared with nvidia-smi -L)."""
    h = uuid.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


@dataclass(frozen=True)
class GpuIdentity:
    """A GPU as another API names it. `source` says who named it (e.g. "Ray GPU id 3 (NVML index 3)")."""

    source: str
    uuid: bytes | None = None
    pci: PciAddress | None = None

    def __post_init__(self) -> None:
        if self.uuid is None and self.pci is None:
            raise DeviceSelectionError(f"{self.source}: neither a UUID nor a PCI address identifies the GPU")
        if self.uuid is not None and len(self.uuid) != UUID_BYTES:
            raise DeviceSelectionError(f"{self.source}: a device UUID has {UUID_BYTES} bytes, got {len(self.uuid)}")

    def describe(self) -> str:
        parts = ([f"uuid {format_uuid(self.uuid)}"] if self.uuid is not None else []) + \
                ([f"pci {self.pci}"] if self.pci is not None else [])
        return f"{self.source}: {', '.join(parts)}"


def describe_identity(uuid: bytes | None, pci: PciAddress | None) -> str:
    """A Vulkan device's identities for listings ("uuid ..., pci ..." or "no uuid, no pci")."""
    return ", ".join([f"uuid {format_uuid(uuid)}" if uuid is not None else "no uuid",
                      f"pci {pci}" if pci is not None else "no pci"])


def match_physical_device(devices: Sequence, identity: GpuIdentity) -> int:
    """Index of the one device in `devices` (PhysicalDeviceInfo: `.index`, `.uuid`, `.pci`, `.describe()`)
    that `identity` names: by UUID where both sides know one, else by PCI address. No match, or several,
    is a DeviceSelectionError naming the identity and every device seen."""
    def same(device) -> bool:
        if identity.uuid is not None and device.uuid is not None:
            return device.uuid == identity.uuid
        return identity.pci is not None and device.pci is not None and device.pci == identity.pci

    matches = [device for device in devices if same(device)]
    if len(matches) == 1:
        return matches[0].index
    listing = "; ".join(f"{d.describe()} {describe_identity(d.uuid, d.pci)}" for d in devices) or "none"
    found = "matches no Vulkan device" if not matches else f"matches {len(matches)} Vulkan devices"
    raise DeviceSelectionError(f"{identity.describe()} {found}; Vulkan devices seen: {listing}")


__all__ = ["GpuIdentity", "PciAddress", "UUID_BYTES", "describe_identity", "format_uuid", "match_physical_device",
           "parse_pci_address", "parse_uuid"]
