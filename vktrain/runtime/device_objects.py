"""What the Vulkan and WebGPU layers' Buffer and Program share, defined once.

vk/memory.py's and webgpu/memory.py's Buffer take BufferBase (construction from an array, the size in
whole words, the alive and range checks); vk/commands.py's and webgpu/program.py's Program take
ProgramBase (replay = submit + wait, the alive check, the context manager). Each layer keeps what
differs: allocation, transfers, recording or encoding, and what `alive` means for its handles.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from vktrain.runtime.vk.errors import BufferUsageError
from vktrain.serialization.dispatch import ScheduleError

WORD_BYTES = 4  # buffers are sized, and WebGPU copies, in whole 4-byte words


def as_bytes_array(data: Any) -> np.ndarray:
    """`data` (a numeric numpy array or bytes) as a C-contiguous array to upload."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return np.frombuffer(bytes(data), dtype=np.uint8)
    array = np.asarray(data)
    if array.dtype == object:
        raise BufferUsageError("cannot upload an object array; pass a numeric numpy array or bytes")
    return np.ascontiguousarray(array)


def check_buffer_size(nbytes: Any) -> int:
    """A Buffer's `nbytes` checked (a positive int), rounded up to whole words: its allocated size."""
    if not isinstance(nbytes, (int, np.integer)) or nbytes <= 0:
        raise BufferUsageError(f"buffer size must be a positive number of bytes, got {nbytes!r}")
    return -(-int(nbytes) // WORD_BYTES) * WORD_BYTES


class BufferBase:
    """The Buffer methods both layers share; a subclass sets `name` and `size` and defines `alive` and
    `write`."""

    name: str
    size: int
    alive: bool

    @classmethod
    def from_array(cls, device, array: Any, *, name: str = "", staging: bool | None = None):
        data = as_bytes_array(array)
        buffer = cls(device, max(data.nbytes, 1), name=name, staging=staging)
        if data.nbytes:
            buffer.write(data)
        return buffer

    @classmethod
    def write_pieces(cls, pieces: list, zeros: list = ()) -> None:
        """Write each (buffer, array, offset) of `pieces` and zero bytes over each (buffer, nbytes, offset) of
        `zeros` (a layer overrides this to batch the transfers)."""
        for buffer, nbytes, offset in zeros:
            buffer.write(np.zeros(nbytes, np.uint8), offset)
        for buffer, array, offset in pieces:
            buffer.write(array, offset)

    @classmethod
    def read_pieces(cls, pieces: list) -> list:
        """The bytes (uint8 arrays) of each (buffer, nbytes, offset) of `pieces` (a layer may batch them)."""
        return [buffer.read(np.uint8, (nbytes,), offset) for buffer, nbytes, offset in pieces]

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


class ProgramBase:
    """The Program methods both layers share; a subclass defines `submit`, `wait`, `alive`, `destroy`."""

    alive: bool

    def replay(self) -> None:
        """Run the dispatches once more and wait for them."""
        self.submit()
        self.wait()

    def _check_alive(self) -> None:
        if not self.alive:
            raise ScheduleError("this Program was destroyed")

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.destroy()
