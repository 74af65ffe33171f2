"""The Vulkan pipeline cache on disk: the driver's compiled pipelines kept between runs, so a second load of
a program (the same kernels and specializations) skips compiling them.

One file per device and driver: `<cache folder>/pipelines/<vendor>-<device>-<driver>-<pipelineCacheUUID>.bin`,
the cache folder being $VKTRAIN_CACHE_DIR, else $XDG_CACHE_HOME/vktrain, else ~/.cache/vktrain (the folder
vktrain's other caches use). `VKTRAIN_PIPELINE_CACHE=0` (or off / false / no) turns it off; a path there puts
the files in that folder instead.

The file is this module's frame around the bytes vkGetPipelineCacheData returned:

    b"VKTRPIPE" | uint32 FORMAT | uint64 payload bytes | sha256 of the payload (32 bytes) | payload

Before the payload reaches the driver (vkCreatePipelineCache's pInitialData) it is checked here: the frame
(magic, format, length, checksum) and the payload's VkPipelineCacheHeaderVersionOne (header size, version
ONE, vendorID, deviceID and pipelineCacheUUID of this device). A file that fails any check -- cut short,
corrupt, another device's or driver's -- is ignored (the load starts with an empty cache, as without a file)
and replaced when the pipelines are written back; reading or writing never fails a load. The file is written
atomically (a temporary file in the same folder, renamed over it), so a reader never sees half of one.
"""
from __future__ import annotations

import hashlib
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

PIPELINE_CACHE_ENV = "VKTRAIN_PIPELINE_CACHE"
CACHE_DIR_ENV = "VKTRAIN_CACHE_DIR"
_OFF = ("0", "off", "false", "no")
MAGIC = b"VKTRPIPE"
FORMAT = 1
_FRAME = struct.Struct("<8sIQ32s")
# VkPipelineCacheHeaderVersionOne: headerSize, headerVersion, vendorID, deviceID (uint32 each), pipelineCacheUUID.
_VK_HEADER = struct.Struct("<IIII16s")
VK_PIPELINE_CACHE_HEADER_VERSION_ONE = 1


def cache_dir() -> Path:
    """vktrain's cache folder: $VKTRAIN_CACHE_DIR, else $XDG_CACHE_HOME/vktrain, else ~/.cache/vktrain."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vktrain"


def pipeline_cache_folder() -> Path | None:
    """Where pipeline cache files live; None when VKTRAIN_PIPELINE_CACHE turns the cache off."""
    setting = os.environ.get(PIPELINE_CACHE_ENV, "").strip()
    if setting.lower() in _OFF:
        return None
    if setting and setting.lower() not in ("1", "on", "true", "yes"):
        return Path(setting)
    return cache_dir() / "pipelines"


@dataclass(frozen=True)
class DeviceKey:
    """What a pipeline cache is valid for: the device (vendor and device id, pipelineCacheUUID) and driver."""

    vendor_id: int
    device_id: int
    driver_version: int
    uuid: bytes  # VkPhysicalDeviceProperties.pipelineCacheUUID, 16 bytes

    @property
    def file_name(self) -> str:
        return f"{self.vendor_id:04x}-{self.device_id:04x}-{self.driver_version:08x}-{self.uuid.hex()}.bin"

    def header_problem(self, payload: bytes) -> str | None:
        """Why the Vulkan header of `payload` is not this device's, or None."""
        if len(payload) < _VK_HEADER.size:
            return f"{len(payload)} bytes, shorter than a VkPipelineCacheHeaderVersionOne"
        size, version, vendor, device, uuid = _VK_HEADER.unpack_from(payload)
        if size < _VK_HEADER.size or size > len(payload):
            return f"header size {size}"
        if version != VK_PIPELINE_CACHE_HEADER_VERSION_ONE:
            return f"header version {version}"
        if (vendor, device, uuid) != (self.vendor_id, self.device_id, self.uuid):
            return (f"written for vendor {vendor:#x} device {device:#x} cache UUID {uuid.hex()}, not this device's "
                    f"{self.vendor_id:#x} / {self.device_id:#x} / {self.uuid.hex()}")
        return None


def frame(payload: bytes) -> bytes:
    return _FRAME.pack(MAGIC, FORMAT, len(payload), hashlib.sha256(payload).digest()) + payload


def unframe(data: bytes) -> tuple[bytes | None, str]:
    """(the payload, "") of a cache file's bytes, or (None, why they are not one)."""
    if len(data) < _FRAME.size:
        return None, f"{len(data)} bytes, shorter than the frame"
    magic, version, length, digest = _FRAME.unpack_from(data)
    if magic != MAGIC:
        return None, "not a vktrain pipeline cache file"
    if version != FORMAT:
        return None, f"format {version}, not {FORMAT}"
    payload = data[_FRAME.size:]
    if len(payload) != length:
        return None, f"{len(payload)} payload bytes, the frame says {length}"
    if hashlib.sha256(payload).digest() != digest:
        return None, "checksum mismatch (corrupt)"
    return payload, ""


class PipelineStore:
    """The cache file of one device (`key`) in `folder`: `read()` its checked payload, `write(payload)` it back.
    `status` says what the last read found (for reports: bench_load.py)."""

    def __init__(self, folder: Path, key: DeviceKey):
        self.path = folder / key.file_name
        self.key = key
        self.status = "not read"

    def read(self) -> bytes | None:
        """The payload to give vkCreatePipelineCache, or None (no file, or one that fails a check: `status`)."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            self.status = "no file"
            return None
        except OSError as exc:
            self.status = f"unreadable ({exc.strerror})"
            return None
        payload, why = unframe(data)
        if payload is not None:
            why = self.key.header_problem(payload) or ""
        if payload is None or why:
            self.status = f"ignored: {why}"
            return None
        self.status = f"read {len(payload)} bytes"
        return payload

    def write(self, payload: bytes) -> bool:
        """Write `payload` atomically; False (and nothing changed) where the folder cannot be written."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, temporary = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(frame(payload))
                os.replace(temporary, self.path)
            except BaseException:
                os.unlink(temporary)
                raise
        except OSError:
            return False  # a read-only or full disk costs the next load its compile time, nothing else
        return True


__all__ = ["DeviceKey", "PIPELINE_CACHE_ENV", "PipelineStore", "cache_dir", "frame", "pipeline_cache_folder",
           "unframe"]
