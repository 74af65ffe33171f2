"""Storage buffers on a WebGPU device, with the Vulkan layer's Buffer interface.

Uploads go through `queue.write_buffer` (wgpu copies the bytes into its own mapped staging memory);
downloads copy into a MAP_READ staging buffer and map it (Device.download), which also waits for the
work before it. WebGPU copies whole 4-byte words, so a write that starts or ends inside a word keeps the other
bytes of that word by reading it first.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from vktrain.runtime.device_objects import WORD_BYTES as _WORD, BufferBase, as_bytes_array, check_buffer_size
from vktrain.runtime.vk.errors import DeviceMemoryError, format_bytes
from vktrain.runtime.vk.memory import read_extent


class Buffer(BufferBase):
    """A storage buffer of `nbytes` bytes (see the module docstring); `staging` is accepted for the
    Vulkan interface and ignored (WebGPU always copies through staging memory)."""

    def __init__(self, device, nbytes: int, *, name: str = "", staging: bool | None = None):
        self.size = check_buffer_size(nbytes)
        device._check_open()
        self.device = device
        self.name = name or f"buffer{id(self):x}"
        self.nbytes = int(nbytes)
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

    # --------------------------------------------------------------------------------- access
    @property
    def handle(self):
        self._check_alive()
        return self._handle

    @property
    def alive(self) -> bool:
        return self._handle is not None


    def _download(self, offset: int, nbytes: int) -> np.ndarray:
        """Bytes [offset, offset + nbytes) of whole words."""
        return self.device.download(self._handle, offset, nbytes)

    def write(self, data: Any, offset: int = 0) -> None:
        """Copy `data` (numpy array of any dtype, or bytes) into the buffer at byte `offset`."""
        self._check_alive()
        array = as_bytes_array(data).reshape(-1).view(np.uint8)
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
