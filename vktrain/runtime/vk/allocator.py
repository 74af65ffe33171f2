"""Sub-allocation of buffers from a few large memory blocks: policy and bookkeeping, free of Vulkan.

Why: one VkDeviceMemory per buffer runs into maxMemoryAllocationCount (4096 on many drivers) once a
model has a few thousand tensors, and every allocation costs a driver round trip.

Policy (per memory type): a request goes first-fit into an existing block; failing that, a new block
of `block_bytes` (at most maxMemoryAllocationSize and an eighth of the heap) is made, or a dedicated
block of exactly the request's size when the request is larger. When a block's last buffer is freed
the block is released, except one empty regular block kept for reuse (staging copies are made and
freed on every upload on a discrete GPU). Offsets and sizes are aligned to max(`alignment`, the
resource's own VkMemoryRequirements alignment).

This module does not import Vulkan, so `count_block_allocations` can tell `vktrain inspect` how many
allocations a file's buffers will take, and `MemoryBudget.check_buffers` can refuse a file, without a
device; memory.py backs the blocks with VkDeviceMemory.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from vktrain.runtime.vk.errors import BufferUsageError, DeviceMemoryError, format_bytes

DEFAULT_BLOCK_BYTES = 256 << 20
DEFAULT_ALIGNMENT = 256  # covers minStorageBufferOffsetAlignment on every driver we know of


def align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


@dataclass(frozen=True)
class BlockPolicy:
    """How blocks of one memory type are sized and what a single request may ask for.

    `max_allocation_bytes` is the device's maxMemoryAllocationSize, `heap_bytes` the size of the
    memory type's heap (None: no limit, for planning without a device). `alignment` must be a power of two.
    """

    block_bytes: int = DEFAULT_BLOCK_BYTES
    alignment: int = DEFAULT_ALIGNMENT
    max_allocation_bytes: int | None = None
    heap_bytes: int | None = None

    def __post_init__(self):
        if self.block_bytes <= 0:
            raise BufferUsageError(f"BlockPolicy.block_bytes must be positive, got {self.block_bytes}")
        if self.alignment <= 0 or self.alignment & (self.alignment - 1):
            raise BufferUsageError(f"BlockPolicy.alignment must be a power of two, got {self.alignment}")

    @property
    def regular_block_bytes(self) -> int:
        """The size of a shared block: `block_bytes`, at most maxMemoryAllocationSize and an eighth of
        the heap (as VMA does: on a small heap one block must not take a large share of it)."""
        limits = [self.block_bytes]
        if self.max_allocation_bytes is not None:
            limits.append(self.max_allocation_bytes)
        if self.heap_bytes is not None:
            limits.append(max(self.heap_bytes // 8, 1))
        return min(limits)

    def check_request(self, nbytes: int, what: str) -> None:
        """Refuse a request no block could hold, before anything is allocated."""
        if self.max_allocation_bytes is not None and nbytes > self.max_allocation_bytes:
            raise DeviceMemoryError(
                what, nbytes, f"the device's maxMemoryAllocationSize is {format_bytes(self.max_allocation_bytes)}",
                self.max_allocation_bytes)
        if self.heap_bytes is not None and nbytes > self.heap_bytes:
            raise DeviceMemoryError(what, nbytes, f"its memory heap holds {format_bytes(self.heap_bytes)}",
                                    self.heap_bytes)


class MemoryBlock:
    """One allocation of the driver, carved into sub-allocations with a first-fit free list."""

    def __init__(self, size: int, handle: Any, dedicated: bool):
        self.size = size
        self.handle = handle  # what the backend made (memory.py: VkDeviceMemory and its mapping)
        self.dedicated = dedicated
        self.used_bytes = 0
        self._free: list[tuple[int, int]] = [(0, size)]  # (offset, length), sorted, never adjacent

    @property
    def empty(self) -> bool:
        return self.used_bytes == 0

    def place(self, nbytes: int, alignment: int) -> int | None:
        """Offset of a new `nbytes` range aligned to `alignment`, or None if no free range holds it."""
        for index, (start, length) in enumerate(self._free):
            offset = align_up(start, alignment)
            end = start + length
            if offset + nbytes > end:
                continue
            remainder = [(s, l) for s, l in ((start, offset - start), (offset + nbytes, end - offset - nbytes)) if l]
            self._free[index:index + 1] = remainder
            self.used_bytes += nbytes
            return offset
        return None

    def release(self, offset: int, nbytes: int) -> None:
        """Return [offset, offset + nbytes) to the free list, merged with free neighbours."""
        ranges = sorted(self._free + [(offset, nbytes)])
        merged: list[tuple[int, int]] = []
        for start, length in ranges:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((start, length))
        self._free = merged
        self.used_bytes -= nbytes


@dataclass(frozen=True)
class Allocation:
    """A sub-range of a block; `offset` is where the resource is bound."""

    block: MemoryBlock
    offset: int
    nbytes: int


@dataclass(frozen=True)
class MemoryStats:
    """Device memory as the driver sees it (`allocations`, `bytes_reserved`) and as buffers use it."""

    allocations: int
    bytes_reserved: int
    bytes_in_use: int
    buffers: int
    peak_allocations: int  # the most allocations / reserved bytes live at once since the device opened
    peak_bytes_reserved: int

    def describe(self) -> str:
        return (f"{self.allocations} device-memory allocations, {format_bytes(self.bytes_reserved)} reserved, "
                f"{format_bytes(self.bytes_in_use)} in use by {self.buffers} buffers (peak {self.peak_allocations} "
                f"allocations, {format_bytes(self.peak_bytes_reserved)})")


@dataclass(frozen=True)
class MemoryHeap:
    index: int
    size: int
    device_local: bool


@dataclass(frozen=True)
class MemoryBudget:
    """What a load-time check may compare a file's memory needs against.

    `buffer_heap_bytes`: the size of the heap storage Buffers are placed in (all of a file's device
    buffers together must fit); `max_buffer_bytes`: the largest single Buffer, min(maxMemoryAllocationSize,
    that heap's size). Heap sizes are totals, shared with other processes, so a request that fits can
    still fail at allocation time (as DeviceMemoryError).
    """

    heaps: tuple[MemoryHeap, ...]
    buffer_heap_index: int
    buffer_heap_bytes: int
    max_buffer_bytes: int

    def check_buffers(self, buffer_bytes: Mapping[str, int], what: str) -> None:
        """Refuse device buffers (name -> bytes) that cannot fit this device, before any is allocated.

        `what` names their source (e.g. the file) in the DeviceMemoryError.
        """
        for name, nbytes in buffer_bytes.items():
            if nbytes > self.max_buffer_bytes:
                raise DeviceMemoryError(
                    f"{what}: buffer {name!r}", nbytes,
                    f"the largest buffer this device can hold is {format_bytes(self.max_buffer_bytes)}",
                    self.max_buffer_bytes)
        total = sum(buffer_bytes.values())
        if total > self.buffer_heap_bytes:
            raise DeviceMemoryError(
                f"{what}: {len(buffer_bytes)} device buffers", total,
                f"the device memory heap {self.buffer_heap_index} holds {format_bytes(self.buffer_heap_bytes)}",
                self.buffer_heap_bytes)


class BlockAllocator:
    """The blocks of one memory type.

    `create_block(size, what)` returns the backend's handle for a new block of `size` bytes (or raises
    DeviceMemoryError); `destroy_block(handle)` releases it. `what` names the request for messages.
    """

    def __init__(self, policy: BlockPolicy, create_block: Callable[[int, str], Any],
                 destroy_block: Callable[[Any], None]):
        self.policy = policy
        self._create_block = create_block
        self._destroy_block = destroy_block
        self.blocks: list[MemoryBlock] = []
        self.live_allocations = 0

    @property
    def bytes_reserved(self) -> int:
        return sum(block.size for block in self.blocks)

    @property
    def bytes_in_use(self) -> int:
        return sum(block.used_bytes for block in self.blocks)

    def allocate(self, nbytes: int, alignment: int, what: str) -> Allocation:
        if nbytes <= 0:
            raise BufferUsageError(f"{what}: allocation size must be positive, got {nbytes}")
        alignment = max(alignment, self.policy.alignment)
        # Sizes are rounded to the alignment too, so placement does not depend on how the driver
        # rounds a resource's size (and count_block_allocations predicts it).
        nbytes = align_up(nbytes, alignment)
        self.policy.check_request(nbytes, what)
        for block in self.blocks:
            if not block.dedicated:
                offset = block.place(nbytes, alignment)
                if offset is not None:
                    return self._record(block, offset, nbytes)
        regular = self.policy.regular_block_bytes
        block = None
        if nbytes <= regular:
            try:
                block = MemoryBlock(regular, self._create_block(regular, what), dedicated=False)
            except DeviceMemoryError:
                if nbytes == regular:
                    raise
                # A whole block does not fit any more; the request alone may.
        if block is None:
            block = MemoryBlock(nbytes, self._create_block(nbytes, what), dedicated=True)
        self.blocks.append(block)
        offset = block.place(nbytes, alignment)
        assert offset == 0, "a new block places its first request at offset 0"
        return self._record(block, offset, nbytes)

    def _record(self, block: MemoryBlock, offset: int, nbytes: int) -> Allocation:
        self.live_allocations += 1
        return Allocation(block, offset, nbytes)

    def free(self, allocation: Allocation) -> None:
        block = allocation.block
        block.release(allocation.offset, allocation.nbytes)
        self.live_allocations -= 1
        if not block.empty:
            return
        keep = not block.dedicated and not any(b.empty and not b.dedicated for b in self.blocks if b is not block)
        if not keep:
            self.blocks.remove(block)
            self._destroy_block(block.handle)

    def destroy(self) -> None:
        """Release every block (the device is closing; no buffer may use them any more)."""
        blocks, self.blocks = self.blocks, []
        self.live_allocations = 0
        for block in blocks:
            self._destroy_block(block.handle)


def count_block_allocations(buffer_sizes: Iterable[int], policy: BlockPolicy = BlockPolicy()) -> int:
    """How many device-memory allocations `buffer_sizes`, allocated in this order and kept alive, take.

    It runs the same allocator as the device, so it is exact when the driver asks for no larger size or
    alignment than `policy.alignment` rounds to (true for storage buffers on the drivers we test); a
    size no block could hold raises DeviceMemoryError, as on the device.
    """
    allocator = BlockAllocator(policy, lambda size, what: None, lambda handle: None)
    for index, nbytes in enumerate(buffer_sizes):
        allocator.allocate(int(nbytes), policy.alignment, f"buffer {index} ({nbytes} bytes)")
    return len(allocator.blocks)
