"""Storage buffers: memory-type choice by property flags, sub-allocation, direct host access or staging.

Allocation strategy: every Buffer is its own VkBuffer, bound at an offset inside one of a few large
VkDeviceMemory blocks per memory type (`DeviceMemory`, policy and bookkeeping in allocator.py), so a
model with thousands of tensors stays far below maxMemoryAllocationCount. Host-visible blocks are
mapped once, for their lifetime; a buffer's host access is a window of its block's mapping. Requests
above maxMemoryAllocationSize or the heap, and driver out-of-memory, raise DeviceMemoryError naming
the buffer, the bytes asked for and the limit.

Two access paths, chosen per buffer:
* direct: on a unified device (lavapipe, integrated GPUs, resizable BAR) the buffer lives in
  DEVICE_LOCAL | HOST_VISIBLE | HOST_COHERENT memory and write/read are memcpys through the mapping.
* staging: otherwise the buffer is DEVICE_LOCAL only, and write/read go through a temporary
  HOST_VISIBLE | HOST_COHERENT staging buffer and a vkCmdCopyBuffer (synchronous).
`Buffer(..., staging=True)` forces the staging path (tests use it to cover it on unified devices).

Buffer sizes are padded to a multiple of 4 bytes (`Buffer.size`) so shaders may read 32-bit words
over byte tensors; `Buffer.nbytes` is the size asked for.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from vktrain.runtime.vk.allocator import (
    DEFAULT_ALIGNMENT,
    DEFAULT_BLOCK_BYTES,
    Allocation,
    BlockAllocator,
    BlockPolicy,
    MemoryStats,
)
from vktrain.runtime.device_objects import BufferBase, as_bytes_array, check_buffer_size
from vktrain.runtime.vk.errors import BufferUsageError, DeviceMemoryError, VulkanError, format_bytes, vk_call


def find_memory_type(type_flags: Sequence[int], type_bits: int, required: int, preferred: int = 0) -> int | None:
    """Index of the memory type to use, or None.

    `type_flags[i]` are the property flags of memory type i, `type_bits` the types allowed by the
    resource's requirements. Among allowed types having all `required` flags, the one with the most
    `preferred` flags wins; ties go to the lower index (drivers list faster types first).
    """
    best: int | None = None
    best_score = -1
    for index, flags in enumerate(type_flags):
        if not type_bits & (1 << index) or flags & required != required:
            continue
        score = bin(flags & preferred).count("1")
        if score > best_score:
            best, best_score = index, score
    return best


def memory_type_flags(device) -> list[int]:
    """The property flags of each of the device's memory types, by index."""
    mp = device.memory_properties
    return [int(mp.memoryTypes[i].propertyFlags) for i in range(mp.memoryTypeCount)]


def _out_of_memory_results(vk) -> tuple[int, int]:
    """The VkResults that mean memory ran out (the driver's own bookkeeping may live in host memory)."""
    return vk.VK_ERROR_OUT_OF_DEVICE_MEMORY, vk.VK_ERROR_OUT_OF_HOST_MEMORY


@dataclass(frozen=True)
class _BlockMemory:
    """What backs one allocator block: the VkDeviceMemory, and its mapping if host-visible."""

    memory: Any
    mapped: Any | None


class DeviceMemory:
    """The memory blocks of one device: a BlockAllocator per memory type, blocks made of VkDeviceMemory.

    `block_bytes` sizes the shared blocks (allocator.py: larger requests get a block of their own).
    """

    def __init__(self, device, block_bytes: int = DEFAULT_BLOCK_BYTES):
        if not isinstance(block_bytes, (int, np.integer)) or block_bytes <= 0:
            raise BufferUsageError(f"memory_block_bytes must be a positive number of bytes, got {block_bytes!r}")
        self.device = device
        self.block_bytes = block_bytes
        self._allocators: dict[int, BlockAllocator] = {}
        self._peak_allocations = 0
        self._peak_bytes_reserved = 0

    @property
    def allocation_count(self) -> int:
        """Live VkDeviceMemory allocations, all memory types together."""
        return sum(len(a.blocks) for a in self._allocators.values())

    def policy(self, type_index: int) -> BlockPolicy:
        """The block policy of memory type `type_index` (its heap size and the device's limits)."""
        device = self.device
        heap = device.memory_properties.memoryTypes[type_index].heapIndex
        limits = device.limits
        return BlockPolicy(block_bytes=self.block_bytes,
                           alignment=max(DEFAULT_ALIGNMENT, limits.min_storage_buffer_offset_alignment,
                                         limits.buffer_image_granularity),
                           max_allocation_bytes=limits.max_memory_allocation_size,
                           heap_bytes=int(device.memory_properties.memoryHeaps[heap].size))

    def allocate(self, nbytes: int, alignment: int, type_index: int, what: str) -> Allocation:
        allocator = self._allocators.get(type_index)
        if allocator is None:
            allocator = BlockAllocator(self.policy(type_index),
                                       lambda size, for_what: self._create_block(size, type_index, for_what),
                                       self._destroy_block)
            self._allocators[type_index] = allocator
        allocation = allocator.allocate(nbytes, alignment, what)
        self._peak_allocations = max(self._peak_allocations, self.allocation_count)
        self._peak_bytes_reserved = max(self._peak_bytes_reserved, self._bytes_reserved())
        return allocation

    def free(self, allocation: Allocation, type_index: int) -> None:
        self._allocators[type_index].free(allocation)

    def _bytes_reserved(self) -> int:
        return sum(a.bytes_reserved for a in self._allocators.values())

    def stats(self) -> MemoryStats:
        allocators = list(self._allocators.values())
        return MemoryStats(allocations=self.allocation_count, bytes_reserved=self._bytes_reserved(),
                           bytes_in_use=sum(a.bytes_in_use for a in allocators),
                           buffers=sum(a.live_allocations for a in allocators),
                           peak_allocations=self._peak_allocations, peak_bytes_reserved=self._peak_bytes_reserved)

    def _create_block(self, size: int, type_index: int, what: str) -> _BlockMemory:
        device = self.device
        vk = device.vk
        count_limit = device.limits.max_memory_allocation_count
        if self.allocation_count >= count_limit:
            raise DeviceMemoryError(
                what, size, f"a new device-memory block is needed and the device's maxMemoryAllocationCount "
                f"({count_limit}) allocations are all in use; free buffers first")
        heap = device.memory_properties.memoryTypes[type_index].heapIndex
        heap_bytes = int(device.memory_properties.memoryHeaps[heap].size)
        alloc_info = vk.VkMemoryAllocateInfo(
            sType=vk.VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO, allocationSize=size, memoryTypeIndex=type_index)
        try:
            memory = vk_call("vkAllocateMemory", vk.vkAllocateMemory, device.handle, alloc_info, None,
                             detail=f"{what}, {size} bytes, memory type {type_index}")
        except VulkanError as exc:
            if exc.result not in _out_of_memory_results(vk):
                raise
            reserved = self._bytes_reserved()
            raise DeviceMemoryError(
                what, size, f"vkAllocateMemory failed with {exc.result_name} (memory type {type_index}, heap "
                f"{heap} of {format_bytes(heap_bytes)}, {format_bytes(reserved)} already reserved by vktrain)",
                heap_bytes) from exc
        mapped = None
        try:
            if device.memory_properties.memoryTypes[type_index].propertyFlags & vk.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT:
                # One persistent map per block; the size is explicit (VK_WHOLE_SIZE overflows in the binding).
                mapped = vk_call("vkMapMemory", vk.vkMapMemory, device.handle, memory, 0, size, 0)
        except BaseException:
            vk.vkFreeMemory(device.handle, memory, None)
            raise
        return _BlockMemory(memory, mapped)

    def _destroy_block(self, block: _BlockMemory) -> None:
        vk = self.device.vk
        handle = self.device._device
        if block.mapped is not None:
            vk.vkUnmapMemory(handle, block.memory)
        vk.vkFreeMemory(handle, block.memory, None)

    def destroy(self) -> None:
        """Free every block (Device.close, after every buffer is destroyed)."""
        for allocator in self._allocators.values():
            allocator.destroy()
        self._allocators.clear()


class _RawBuffer:
    """A VkBuffer bound to a sub-range of a device-memory block (internal; Buffer and staging copies use it)."""

    def __init__(self, device, size: int, usage: int, required: int, preferred: int, what: str):
        vk = device.vk
        self.device = device
        self.size = size
        self.handle = None
        self.allocation: Allocation | None = None
        self.type_index = -1
        self.host_cached = False
        self._mapped = None
        flags = memory_type_flags(device)
        # Refuse what no memory could hold before the driver is asked (vkCreateBuffer itself may fail
        # or be flagged by validation for absurd sizes).
        likely_type = find_memory_type(flags, ~0, required, preferred)
        if likely_type is not None:
            device.memory.policy(likely_type).check_request(size, what)
        buffer_info = vk.VkBufferCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO, size=size, usage=usage,
            sharingMode=vk.VK_SHARING_MODE_EXCLUSIVE)
        try:
            self.handle = vk_call("vkCreateBuffer", vk.vkCreateBuffer, device.handle, buffer_info, None,
                                  detail=f"{what}, {size} bytes")
        except VulkanError as exc:
            if exc.result not in _out_of_memory_results(vk):
                raise
            raise DeviceMemoryError(what, size, f"vkCreateBuffer failed with {exc.result_name}") from exc
        try:
            requirements = vk.vkGetBufferMemoryRequirements(device.handle, self.handle)
            type_index = find_memory_type(flags, requirements.memoryTypeBits, required, preferred)
            if type_index is None:
                raise BufferUsageError(
                    f"no memory type for {what} has the property flags {required:#x} "
                    f"(available types: {[hex(f) for f in flags]})")
            self.allocation = device.memory.allocate(int(requirements.size), int(requirements.alignment),
                                                     type_index, what)
            self.type_index = type_index
            self.host_cached = bool(flags[type_index] & vk.VK_MEMORY_PROPERTY_HOST_CACHED_BIT)
            block = self.allocation.block.handle
            vk_call("vkBindBufferMemory", vk.vkBindBufferMemory, device.handle, self.handle, block.memory,
                    self.allocation.offset)
            self._mapped = block.mapped
        except BaseException:
            self.destroy()
            raise

    def write_bytes(self, data: np.ndarray, offset: int) -> None:
        view = np.frombuffer(self._mapped, dtype=np.uint8, count=data.nbytes, offset=self.allocation.offset + offset)
        view[:] = data.reshape(-1).view(np.uint8)
        del view  # no numpy view may outlive the mapping

    def read_bytes(self, nbytes: int, offset: int) -> np.ndarray:
        view = np.frombuffer(self._mapped, dtype=np.uint8, count=nbytes, offset=self.allocation.offset + offset)
        out = view.copy()
        del view
        return out

    def destroy(self) -> None:
        vk = self.device.vk
        device = self.device._device
        if device is None:
            return  # the device is closed: it freed the memory blocks
        self._mapped = None
        if self.handle is not None:
            vk.vkDestroyBuffer(device, self.handle, None)
            self.handle = None
        if self.allocation is not None:
            self.device.memory.free(self.allocation, self.type_index)
            self.allocation = None


# The CPU reads mapped memory fast only where it is host-cached: a discrete GPU's device-local memory seen
# through the PCIe BAR (resizable BAR, Device.unified_memory) reads at ~25 MB/s (measured on the H100: 2 s
# for SmolLM2's 58 MB state), so reads from uncached memory above this size go through a staging copy
# into cached memory (a DMA at PCIe speed); a few words (a loss, a flag) are read directly.
DIRECT_UNCACHED_READ_BYTES = 4096

# Downloads and batched uploads up to this size go through one host-visible buffer per device and
# direction, kept between transfers (reading a state tensor by tensor made and freed one per tensor; a
# federation uploads each client's adapters); a larger one (a whole state, once per checkpoint) gets its
# own, so the device holds no large copy.
STAGING_REUSE_LIMIT = 64 << 20


def _download_buffer(device, nbytes: int, what: str) -> _RawBuffer:
    vk = device.vk
    return _RawBuffer(device, nbytes, vk.VK_BUFFER_USAGE_TRANSFER_DST_BIT,
                      vk.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT | vk.VK_MEMORY_PROPERTY_HOST_COHERENT_BIT,
                      vk.VK_MEMORY_PROPERTY_HOST_CACHED_BIT, what)


def _upload_buffer(device, nbytes: int, what: str) -> _RawBuffer:
    vk = device.vk
    return _RawBuffer(device, nbytes, vk.VK_BUFFER_USAGE_TRANSFER_SRC_BIT,
                      vk.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT | vk.VK_MEMORY_PROPERTY_HOST_COHERENT_BIT, 0, what)


class _ReusedStaging:
    """One of the device's two reused staging buffers, downloads (Buffer.read, read_pieces) and uploads
    (write_pieces: a federation writes each client's ~10 MB of adapters), grown to a power of two as
    transfers need; freed with the device (a registered child). Transfers wait for their copy, so one
    buffer per direction serves them all."""

    def __init__(self, device, upload: bool) -> None:
        self.device, self.upload, self.raw = device, upload, None
        device._register(self)

    @classmethod
    def of(cls, device, upload: bool = False) -> "_ReusedStaging":
        attribute = "_upload_staging" if upload else "_download_staging"
        staging = getattr(device, attribute, None)
        if staging is None:
            staging = cls(device, upload)
            setattr(device, attribute, staging)
        return staging

    def buffer(self, nbytes: int) -> _RawBuffer:
        if self.raw is None or self.raw.size < nbytes:
            self.destroy_buffer()
            size = min(1 << max(16, (nbytes - 1).bit_length()), max(nbytes, STAGING_REUSE_LIMIT))
            make = _upload_buffer if self.upload else _download_buffer
            self.raw = make(self.device, size, f"the reused staging {'upload' if self.upload else 'download'} buffer")
        return self.raw

    def destroy_buffer(self) -> None:
        if self.raw is not None:
            self.raw.destroy()
            self.raw = None

    def destroy(self) -> None:
        self.destroy_buffer()
        self.device._unregister(self)
        setattr(self.device, "_upload_staging" if self.upload else "_download_staging", None)


def buffer_memory_flags(vk, staging: bool) -> tuple[int, int]:
    """(required, preferred) memory property flags of a Buffer on the staging or the direct path."""
    if staging:
        return vk.VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT, 0
    return (vk.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT | vk.VK_MEMORY_PROPERTY_HOST_COHERENT_BIT,
            vk.VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT)


def read_extent(name: str, buffer_nbytes: int, dtype: Any, shape: Any, offset: int) -> tuple[np.dtype, tuple, int]:
    """(dtype, shape, nbytes) of a Buffer.read: without `shape`, as many whole elements as fit between
    `offset` and the buffer's end. Shared by the Vulkan and WebGPU buffers."""
    dtype = np.dtype(dtype)
    if shape is None:
        shape = (max(buffer_nbytes - offset, 0) // dtype.itemsize,)
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    if any(not isinstance(d, (int, np.integer)) or d < 0 for d in shape):
        raise BufferUsageError(f"read from {name!r}: shape must be non-negative ints, got {shape!r}")
    return dtype, shape, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize


class Buffer(BufferBase):
    """A storage buffer of `nbytes` bytes on `device` (see the module docstring for the paths).

    `write(array, offset)` uploads; `read(dtype, shape, offset)` downloads a copy. Offsets are bytes.
    A device of another layer (the WebGPU Device) gets that layer's Buffer, named by its `buffer_type`.
    """

    def __new__(cls, device, *args, **kwargs):
        other = getattr(device, "buffer_type", None)
        if cls is Buffer and other is not None:
            return other(device, *args, **kwargs)
        return super().__new__(cls)

    def __init__(self, device, nbytes: int, *, name: str = "", staging: bool | None = None):
        self.size = check_buffer_size(nbytes)
        vk = device.vk
        self.device = device
        self.name = name or f"buffer{id(self):x}"
        self.nbytes = int(nbytes)
        self._raw = None
        usage = (vk.VK_BUFFER_USAGE_STORAGE_BUFFER_BIT | vk.VK_BUFFER_USAGE_TRANSFER_SRC_BIT
                 | vk.VK_BUFFER_USAGE_TRANSFER_DST_BIT)
        if staging is None:
            staging = not device.unified_memory
        required, preferred = buffer_memory_flags(vk, staging)
        what = f"buffer {self.name!r}"
        self._raw = _RawBuffer(device, self.size, usage, required, preferred, what)
        # Even a staging buffer may land in host-visible memory (unified devices); forced staging
        # still copies, so the copy path is what gets exercised.
        self.staging = bool(staging)
        device._register(self)

    # --------------------------------------------------------------------------------- access
    @property
    def handle(self):
        self._check_alive()
        return self._raw.handle

    @property
    def alive(self) -> bool:
        return self._raw is not None and self._raw.handle is not None


    def write(self, data: Any, offset: int = 0) -> None:
        """Copy `data` (numpy array of any dtype, or bytes) into the buffer at byte `offset`."""
        self._check_alive()
        array = as_bytes_array(data)
        self._check_range("write to", offset, array.nbytes)
        if array.nbytes == 0:
            return
        if not self.staging:
            self._raw.write_bytes(array, offset)
            return
        vk = self.device.vk
        staging = _RawBuffer(self.device, array.nbytes, vk.VK_BUFFER_USAGE_TRANSFER_SRC_BIT,
                             vk.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT | vk.VK_MEMORY_PROPERTY_HOST_COHERENT_BIT,
                             0, f"staging upload for {self.name!r}")
        try:
            staging.write_bytes(array, 0)
            self.device.one_shot(lambda cb: _record_copy(vk, cb, staging.handle, 0, self._raw.handle,
                                                         offset, array.nbytes))
        finally:
            staging.destroy()

    def read(self, dtype: Any = np.uint8, shape: Any = None, offset: int = 0) -> np.ndarray:
        """Return a copy of the buffer contents from byte `offset` as `dtype`, reshaped to `shape`.

        Without `shape`, reads as many whole elements as fit between `offset` and `nbytes`.
        """
        self._check_alive()
        dtype, shape, nbytes = read_extent(self.name, self.nbytes, dtype, shape, offset)
        self._check_range("read from", offset, nbytes)
        if nbytes == 0:
            return np.zeros(shape, dtype)
        if not self.staging and (self._raw.host_cached or nbytes <= DIRECT_UNCACHED_READ_BYTES):
            raw = self._raw.read_bytes(nbytes, offset)
        else:
            vk = self.device.vk
            reused = nbytes <= STAGING_REUSE_LIMIT
            staging = (_ReusedStaging.of(self.device).buffer(nbytes) if reused
                       else _download_buffer(self.device, nbytes, f"staging download for {self.name!r}"))
            try:
                self.device.one_shot(lambda cb: _record_copy(vk, cb, self._raw.handle, offset, staging.handle,
                                                             0, nbytes))
                raw = staging.read_bytes(nbytes, 0)
            finally:
                if not reused:
                    staging.destroy()
        return raw.view(dtype).reshape(shape)

    @classmethod
    def write_pieces(cls, pieces: list, zeros: list = ()) -> None:
        """Write each (buffer, array, offset) of `pieces`, bit for bit as `buffer.write(array, offset)` would,
        and zero bytes over each (buffer, nbytes, offset) of `zeros`: the staging ones packed into one upload
        buffer and copied by one submit (a client's 1,260 state tensors were 1,260 buffer creations, submits
        and waits), the zeros filled on the device where Vulkan's 4-byte alignment allows (not uploaded)."""
        staged, fills, pieces = [], [], list(pieces)
        for buffer, nbytes, offset in zeros:
            buffer._check_alive()
            buffer._check_range("zero", offset, nbytes)
            if buffer.staging and offset % 4 == 0 and nbytes % 4 == 0:
                fills.append((buffer._raw.handle, offset, nbytes))
            else:
                pieces.append((buffer, np.zeros(nbytes, np.uint8), offset))
        for buffer, data, offset in pieces:
            buffer._check_alive()
            array = as_bytes_array(data)
            buffer._check_range("write to", offset, array.nbytes)
            if array.nbytes == 0:
                continue
            if buffer.staging:
                staged.append((buffer, array, offset))
            else:
                buffer._raw.write_bytes(array, offset)
        if not staged and not fills:
            return
        device = (staged or zeros)[0][0].device
        vk = device.vk
        if not staged:
            device.one_shot(lambda cb: _record_copies(vk, cb, [], fills))
            return
        total = sum(array.nbytes for _, array, _ in staged)
        reused = total <= STAGING_REUSE_LIMIT
        upload = (_ReusedStaging.of(device, upload=True).buffer(total) if reused
                  else _upload_buffer(device, total, f"staging upload for {len(staged)} writes"))
        try:
            copies, at = [], 0
            for buffer, array, offset in staged:
                upload.write_bytes(array, at)
                copies.append((upload.handle, at, buffer._raw.handle, offset, array.nbytes))
                at += array.nbytes
            device.one_shot(lambda cb: _record_copies(vk, cb, copies, fills))
        finally:
            if not reused:
                upload.destroy()

    @classmethod
    def read_pieces(cls, pieces: list) -> list:
        """The bytes (uint8 arrays) of each (buffer, nbytes, offset) of `pieces`, as `buffer.read` gives
        them: what needs a staging copy goes through one download buffer and one submit."""
        out: list = [None] * len(pieces)
        staged = []
        for i, (buffer, nbytes, offset) in enumerate(pieces):
            buffer._check_alive()
            buffer._check_range("read from", offset, nbytes)
            if nbytes == 0:
                out[i] = np.zeros((0,), np.uint8)
            elif not buffer.staging and (buffer._raw.host_cached or nbytes <= DIRECT_UNCACHED_READ_BYTES):
                out[i] = buffer._raw.read_bytes(nbytes, offset)
            else:
                staged.append((i, buffer, nbytes, offset))
        if not staged:
            return out
        device = staged[0][1].device
        vk = device.vk
        total = sum(nbytes for _, _, nbytes, _ in staged)
        reused = total <= STAGING_REUSE_LIMIT
        download = (_ReusedStaging.of(device).buffer(total) if reused
                    else _download_buffer(device, total, f"staging download for {len(staged)} reads"))
        try:
            copies, at = [], 0
            for _, buffer, nbytes, offset in staged:
                copies.append((buffer._raw.handle, offset, download.handle, at, nbytes))
                at += nbytes
            device.one_shot(lambda cb: _record_copies(vk, cb, copies))
            raw = download.read_bytes(total, 0)
        finally:
            if not reused:
                download.destroy()
        at = 0
        for i, _, nbytes, _ in staged:
            out[i] = raw[at:at + nbytes]
            at += nbytes
        return out

    def zero(self) -> None:
        """Fill the whole buffer with zero bytes on the device."""
        self._check_alive()
        vk = self.device.vk

        def record(cb):
            record_memory_barrier(
                vk, cb,
                vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT | vk.VK_PIPELINE_STAGE_TRANSFER_BIT,
                vk.VK_ACCESS_SHADER_READ_BIT | vk.VK_ACCESS_SHADER_WRITE_BIT | vk.VK_ACCESS_TRANSFER_WRITE_BIT,
                vk.VK_PIPELINE_STAGE_TRANSFER_BIT,
                vk.VK_ACCESS_TRANSFER_WRITE_BIT)
            vk.vkCmdFillBuffer(cb, self._raw.handle, 0, self.size, 0)
            record_memory_barrier(
                vk, cb,
                vk.VK_PIPELINE_STAGE_TRANSFER_BIT,
                vk.VK_ACCESS_TRANSFER_WRITE_BIT,
                vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT | vk.VK_PIPELINE_STAGE_HOST_BIT,
                vk.VK_ACCESS_SHADER_READ_BIT | vk.VK_ACCESS_SHADER_WRITE_BIT | vk.VK_ACCESS_HOST_READ_BIT)

        self.device.one_shot(record)

    def destroy(self) -> None:
        """Free the buffer now (idempotent). Device.close() frees any buffer still alive."""
        if self._raw is not None:
            self._raw.destroy()
            self._raw = None
        self.device._unregister(self)

    def __repr__(self) -> str:
        path = "staging" if self.staging else "direct"
        state = "" if self.alive else ", destroyed"
        return f"Buffer({self.name!r}, {self.nbytes} bytes, {path}{state})"


def record_memory_barrier(vk, cb, src_stage: int, src_access: int, dst_stage: int, dst_access: int) -> None:
    """Record a global memory barrier (src stage/access -> dst stage/access) into command buffer `cb`."""
    barrier = vk.VkMemoryBarrier(sType=vk.VK_STRUCTURE_TYPE_MEMORY_BARRIER, srcAccessMask=src_access,
                                 dstAccessMask=dst_access)
    vk.vkCmdPipelineBarrier(cb, src_stage, dst_stage, 0, 1, [barrier], 0, None, 0, None)


def _record_copies(vk, cb, copies: list, fills: list = ()) -> None:
    """Record the (src, src_offset, dst, dst_offset, nbytes) copies and the (dst, offset, nbytes) zero fills
    between one pair of barriers, as _record_copy fences one (a batch's ranges never overlap: distinct
    tensors)."""
    record_memory_barrier(
        vk, cb,
        vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT | vk.VK_PIPELINE_STAGE_TRANSFER_BIT,
        vk.VK_ACCESS_SHADER_READ_BIT | vk.VK_ACCESS_SHADER_WRITE_BIT | vk.VK_ACCESS_TRANSFER_WRITE_BIT,
        vk.VK_PIPELINE_STAGE_TRANSFER_BIT,
        vk.VK_ACCESS_TRANSFER_READ_BIT | vk.VK_ACCESS_TRANSFER_WRITE_BIT)
    # One cffi array of regions and the raw entry point: the binding's wrappers cost ~40 us a call, which
    # for a client's ~1,260 tensors (each its own buffer) was most of the batched write.
    by_pair: dict = {}
    for src, src_offset, dst, dst_offset, nbytes in copies:
        by_pair.setdefault((src, dst), []).append((src_offset, dst_offset, nbytes))
    regions = vk.ffi.new("VkBufferCopy[]", len(copies))
    at = 0
    for (src, dst), pair_regions in by_pair.items():
        first = at
        for src_offset, dst_offset, nbytes in pair_regions:
            region = regions[at]
            region.srcOffset, region.dstOffset, region.size = src_offset, dst_offset, nbytes
            at += 1
        vk.lib.vkCmdCopyBuffer(cb, src, dst, len(pair_regions), regions + first)
    for dst, offset, nbytes in fills:
        vk.lib.vkCmdFillBuffer(cb, dst, offset, nbytes, 0)
    record_memory_barrier(vk, cb, vk.VK_PIPELINE_STAGE_TRANSFER_BIT, vk.VK_ACCESS_TRANSFER_WRITE_BIT,
                          vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT | vk.VK_PIPELINE_STAGE_HOST_BIT,
                          vk.VK_ACCESS_SHADER_READ_BIT | vk.VK_ACCESS_SHADER_WRITE_BIT | vk.VK_ACCESS_HOST_READ_BIT)


def _record_copy(vk, cb, src, src_offset: int, dst, dst_offset: int, nbytes: int) -> None:
    """One copy, fenced as _record_copies fences a batch: earlier device work on either buffer finishes before
    it, its result is visible to later shaders and to the host."""
    _record_copies(vk, cb, [(src, src_offset, dst, dst_offset, nbytes)])
