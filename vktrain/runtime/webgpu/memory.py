"""Storage buffers on a WebGPU device, with the Vulkan layer's Buffer interface.

Uploads go through `queue.write_buffer` (wgpu copies the bytes into its own mapped staging memory);
downloads copy into a MAP_READ staging buffer and map it (Device.download), which also waits for the
work before it. WebGPU copies whole 4-byte words, so a write that starts or ends inside a word keeps the other
bytes of that word by reading it first.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from vktrain.runtime.vk.errors import BufferUsageError, DeviceMemoryError, format_bytes
from vktrain.runtime.vk.memory import _as_bytes_array, read_extent

_WORD = 4


class Buffer:
    """A storage buffer of `nbytes` bytes (see the module docstring); `staging` is accepted for the
    Vulkan interface and ignored (WebGPU always copies through staging memory)."""

    def __init__(self, device, nbytes: int, *, name: str = "", staging: bool | None = None):
        if not isinstance(nbytes, (int, np.integer)) or nbytes <= 0:
            raise BufferUsageError(f"buffer size must be a positive number of bytes, got {nbytes!r}")
        device._check_open()
        self.device = device
        self.name = name or f"buffer{id(self):x}"
        self.nbytes = int(nbytes)
        self.size = -(-self.nbytes // _WORD) * _WORD
        self.staging = True
        self._handle = None
        limit = device.limits.max_buffer_size
        if self.size > limit:
            raise DeviceMemoryError(f"buffer {self.name!r}", self.size,
                                    f"the WebGPU device's max-buffer-size is {format_bytes(limit)}", limit)
        usage = device.wgpu.BufferUsage
        try:
            self._handle = device.handle.create_buffer(
                label=self.name, size=self.size, usage=usage.STORAGE | usage.COPY_SRC | usage.COPY_DST)
        except device.wgpu.GPUError as exc:
            raise DeviceMemoryError(f"buffer {self.name!r}", self.size, f"wgpu refused it: {exc}") from exc
        device._register(self)

    @classmethod
    def from_array(cls, device, array: Any, *, name: str = "", staging: bool | None = None) -> "Buffer":
        data = _as_bytes_array(array)
        buffer = cls(device, max(data.nbytes, 1), name=name, staging=staging)
        if data.nbytes:
            buffer.write(data)
        return buffer

    # --------------------------------------------------------------------------------- access
    @property
    def handle(self):
        self._check_alive()
        return self._handle

    @property
    def alive(self) -> bool:
        return self._handle is not None

    def _check_alive(self) -> None:
        if not self.alive:
            raise BufferUsageError(f"buffer {self.name!r} was destroyed")

    def _check_range(self, what: str, offset: int, nbytes: int) -> None:
        if not isinstance(offset, (int, np.integer)) or offset < 0:
            raise BufferUsageError(f"{what} {self.name!r}: offset must be a non-negative int, got {offset!r}")
        if offset + nbytes > self.size:
            raise BufferUsageError(
                f"{what} {self.name!r}: {nbytes} bytes at offset {offset} run past the buffer's "
                f"{self.size} bytes")

    def _download(self, offset: int, nbytes: int) -> np.ndarray:
        """Bytes [offset, offset + nbytes) of whole words."""
        return self.device.download(self._handle, offset, nbytes)

    def write(self, data: Any, offset: int = 0) -> None:
        """Copy `data` (numpy array of any dtype, or bytes) into the buffer at byte `offset`."""
        self._check_alive()
        array = _as_bytes_array(data).reshape(-1).view(np.uint8)
        self._check_range("write to", offset, array.nbytes)
        if array.nbytes == 0:
            return
        start, end = offset - offset % _WORD, -(-(offset + array.nbytes) // _WORD) * _WORD
        if (start, end) != (offset, offset + array.nbytes):
            words = np.empty(end - start, np.uint8)
            words[:_WORD] = self._download(start, _WORD)
            words[-_WORD:] = self._download(end - _WORD, _WORD)
            words[offset - start:offset - start + array.nbytes] = array
            array, offset = words, start
        self.device.queue.write_buffer(self._handle, int(offset), array)

    def read(self, dtype: Any = np.uint8, shape: Any = None, offset: int = 0) -> np.ndarray:
        """Return a copy of the buffer contents from byte `offset` as `dtype`, reshaped to `shape`.

        Without `shape`, reads as many whole elements as fit between `offset` and `nbytes`.
        """
        self._check_alive()
        dtype, shape, nbytes = read_extent(self.name, self.nbytes, dtype, shape, offset)
        self._check_range("read from", offset, nbytes)
        if nbytes == 0:
            return np.zeros(shape, dtype)
        start, end = offset - offset % _WORD, -(-(offset + nbytes) // _WORD) * _WORD
        raw = self._download(start, end - start)[offset - start:offset - start + nbytes]
        return raw.view(dtype).reshape(shape)

    def zero(self) -> None:
        """Fill the whole buffer with zero bytes on the device."""
        self._check_alive()
        encoder = self.device.handle.create_command_encoder()
        encoder.clear_buffer(self._handle, 0, self.size)
        self.device.submit([encoder.finish()])

    def destroy(self) -> None:
        """Free the buffer now (idempotent). Device.close() frees any buffer still alive."""
        if self._handle is not None:
            self._handle.destroy()
            self._handle = None
        self.device._unregister(self)

    def __repr__(self) -> str:
        state = "" if self.alive else ", destroyed"
        return f"Buffer({self.name!r}, {self.nbytes} bytes, WebGPU{state})"
