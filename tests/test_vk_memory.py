"""Device-memory sub-allocation, memory limits and the features validation runs enable.

The pure allocator (vktrain/runtime/vk/allocator.py) is checked against invariants on random
allocate/free sequences and against block counts derived by hand; the device side (memory.py) is
checked on lavapipe: buffers that share a block keep their own bytes, the block count is what the pure
`count_block_allocations` predicts, and requests above the device's limits are refused before the
driver is asked, with errors naming the buffer, the bytes and the limit.
"""
from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from vktrain.errors import VktrainError
from vktrain.runtime import (
    Buffer,
    Device,
    Dispatch,
    ValidationLayerMissingError,
    VulkanError,
    pack_push,
    run_dispatches,
)
from vktrain.runtime.vk.allocator import (
    BlockAllocator,
    BlockPolicy,
    align_up,
    count_block_allocations,
)
from vktrain.runtime.vk.errors import BufferUsageError, DeviceMemoryError

MiB = 1 << 20


# ------------------------------------------------------------------------------ pure allocator
def _recording_allocator(policy: BlockPolicy):
    """A BlockAllocator whose blocks are plain ints, with the lists of blocks created and destroyed."""
    created: list[int] = []
    destroyed: list[int] = []

    def create(size, what):
        created.append(size)
        return len(created)

    return BlockAllocator(policy, create, destroyed.append), created, destroyed


def _assert_disjoint_and_aligned(live, alignment):
    by_block: dict[int, list[tuple[int, int]]] = {}
    for allocation in live:
        assert allocation.offset % alignment == 0
        assert 0 <= allocation.offset and allocation.offset + allocation.nbytes <= allocation.block.size
        by_block.setdefault(id(allocation.block), []).append((allocation.offset, allocation.nbytes))
    for ranges in by_block.values():
        ranges.sort()
        for (start, length), (next_start, _) in zip(ranges, ranges[1:]):
            assert start + length <= next_start, "two live allocations overlap"


@pytest.mark.parametrize("seed", range(4))
def test_random_allocate_free_keeps_allocations_disjoint_and_accounted(seed):
    rng = np.random.default_rng(seed)
    policy = BlockPolicy(block_bytes=64 * 1024, alignment=64)
    allocator, created, destroyed = _recording_allocator(policy)
    live = []
    for _ in range(600):
        if live and rng.random() < 0.45:
            allocator.free(live.pop(int(rng.integers(len(live)))))
        else:
            # Mostly small requests, some above the block size (dedicated blocks), odd alignments.
            nbytes = int(rng.choice([rng.integers(1, 5000), rng.integers(60_000, 150_000)], p=[0.9, 0.1]))
            alignment = int(rng.choice([4, 16, 256, 1024]))
            allocation = allocator.allocate(nbytes, alignment, "random")
            assert allocation.nbytes >= nbytes and allocation.offset % alignment == 0
            live.append(allocation)
        _assert_disjoint_and_aligned(live, policy.alignment)
        assert allocator.bytes_in_use == sum(a.nbytes for a in live)
        assert allocator.live_allocations == len(live)
        assert len(allocator.blocks) == len(created) - len(destroyed)
    for allocation in live:
        allocator.free(allocation)
    # Everything freed: only the one empty shared block kept for reuse is left.
    assert [b.size for b in allocator.blocks] in ([], [policy.block_bytes])
    assert allocator.bytes_in_use == 0


def test_freed_ranges_merge_so_a_full_block_fits_again():
    allocator, created, _ = _recording_allocator(BlockPolicy(block_bytes=4096, alignment=256))
    parts = [allocator.allocate(1024, 1, "quarter") for _ in range(4)]
    assert len(created) == 1 and {p.offset for p in parts} == {0, 1024, 2048, 3072}
    for index in (1, 3, 0, 2):  # free out of order: only merging restores one 4096-byte range
        allocator.free(parts[index])
    whole = allocator.allocate(4096, 1, "whole")
    assert (whole.offset, len(created)) == (0, 1)


def test_dedicated_blocks_are_released_and_one_empty_shared_block_is_kept():
    allocator, created, destroyed = _recording_allocator(BlockPolicy(block_bytes=4096, alignment=256))
    big = allocator.allocate(10_000, 1, "big")
    assert created == [align_up(10_000, 256)]  # larger than a block: a block of its own
    allocator.free(big)
    assert destroyed == [1] and allocator.blocks == []
    first = [allocator.allocate(4096, 1, "full") for _ in range(2)]  # two shared blocks
    for allocation in first:
        allocator.free(allocation)
    assert len(destroyed) == 2 and len(allocator.blocks) == 1  # the second empty one went back


@pytest.mark.parametrize("sizes_mib, expected_blocks", [
    ([100] * 5, 3),  # two 100 MiB buffers per 256 MiB block: ceil(5 / 2)
    ([200, 100, 50], 2),  # first fit: the 50 MiB one fills the hole next to the 200 MiB one
    ([300, 10, 300], 3),  # each 300 MiB buffer gets a dedicated block; the 10 MiB one a shared block
    ([1] * 256, 1),  # 256 x 1 MiB fill exactly one block
    ([1] * 257, 2),
])
def test_count_block_allocations_matches_hand_derived_counts(sizes_mib, expected_blocks):
    assert count_block_allocations([s * MiB for s in sizes_mib]) == expected_blocks


def test_count_rounds_sizes_to_the_alignment():
    # 4097 bytes take 8192 with 4096-byte alignment: 8 fit a 64 KiB block, the 9th needs a second.
    policy = BlockPolicy(block_bytes=64 * 1024, alignment=4096)
    assert count_block_allocations([4097] * 8, policy) == 1
    assert count_block_allocations([4097] * 9, policy) == 2


def test_regular_blocks_never_exceed_the_device_limits():
    assert BlockPolicy(block_bytes=256 * MiB, heap_bytes=1024 * MiB).regular_block_bytes == 128 * MiB  # heap / 8
    policy = BlockPolicy(block_bytes=256 * MiB, max_allocation_bytes=64 * MiB, heap_bytes=1024 * MiB)
    assert policy.regular_block_bytes == 64 * MiB
    assert count_block_allocations([40 * MiB] * 3, policy) == 3  # 40 MiB x 1 per 64 MiB block
    with pytest.raises(DeviceMemoryError, match=r"buffer 1 .*67108868 bytes.*maxMemoryAllocationSize is 67108864"):
        count_block_allocations([4, 64 * MiB + 4], policy)
    heap_limited = BlockPolicy(heap_bytes=8 * MiB)
    with pytest.raises(DeviceMemoryError, match=r"memory heap holds 8388608 bytes \(8.00 MiB\)") as info:
        count_block_allocations([9 * MiB], heap_limited)
    assert (info.value.requested_bytes, info.value.limit_bytes) == (9 * MiB, 8 * MiB)
    assert isinstance(info.value, VktrainError)


def test_bad_policies_and_sizes_are_refused():
    with pytest.raises(BufferUsageError, match="power of two"):
        BlockPolicy(alignment=48)
    with pytest.raises(BufferUsageError, match="block_bytes must be positive"):
        BlockPolicy(block_bytes=0)
    with pytest.raises(BufferUsageError, match="allocation size must be positive"):
        count_block_allocations([16, 0])
    with pytest.raises(BufferUsageError, match="memory_block_bytes must be a positive number of bytes, got -1"):
        Device(validation=False, memory_block_bytes=-1)


# ------------------------------------------------------------------------------ on the device
@pytest.fixture
def small_block_device():
    """A device of its own whose shared blocks are 1 MiB, so block boundaries are cheap to reach."""
    try:
        device = Device(validation=True, memory_block_bytes=MiB)
    except ValidationLayerMissingError:
        device = Device(validation=False, memory_block_bytes=MiB)
    yield device
    messages = device.take_validation_messages()
    device.close()
    messages += device.take_validation_messages()
    assert not messages, "\n".join(map(str, messages))


def test_buffers_share_blocks_as_predicted_and_keep_their_own_bytes(small_block_device):
    device = small_block_device
    rng = np.random.default_rng(7)
    sizes = [int(s) for s in rng.integers(1, 200_000, size=40)] + [3 * MiB, 5]
    buffers = [Buffer(device, size, name=f"b{i}") for i, size in enumerate(sizes)]
    stats = device.memory_stats()
    policy = device.memory.policy(buffers[0]._raw.type_index)
    assert stats.allocations == count_block_allocations(sizes, policy)
    assert stats.allocations < len(sizes) // 4  # far fewer allocations than buffers
    assert stats.buffers == len(sizes)
    assert stats.bytes_in_use == sum(align_up(b.size, policy.alignment) for b in buffers)
    assert stats.bytes_reserved >= stats.bytes_in_use
    # Distinct bytes in every buffer, written after all exist: an overlap would clobber a neighbour.
    contents = [rng.integers(0, 256, size=size, dtype=np.uint8) for size in sizes]
    for buffer, data in zip(buffers, contents):
        buffer.write(data)
    for buffer, data in zip(buffers, contents):
        np.testing.assert_array_equal(buffer.read(np.uint8, data.size), data)
    for buffer in buffers:
        assert buffer._raw.allocation.offset % device.limits.min_storage_buffer_offset_alignment == 0
        buffer.destroy()
    after = device.memory_stats()
    assert (after.allocations, after.bytes_in_use, after.buffers) == (1, 0, 0)  # one empty block kept
    assert (after.peak_allocations, after.peak_bytes_reserved) == (stats.allocations, stats.bytes_reserved)


def test_staging_buffers_share_blocks_and_round_trip(small_block_device):
    device = small_block_device
    data = [np.arange(n, dtype=np.float32) * (i + 1) for i, n in enumerate((10, 1000, 300_000))]
    buffers = [Buffer.from_array(device, d, staging=True) for d in data]
    for buffer, expected in zip(buffers, data):
        np.testing.assert_array_equal(buffer.read(np.float32), expected)
    transient = device.memory_stats()
    assert transient.buffers == len(buffers) + 1  # the upload copies were freed; one download buffer is kept


def test_reads_of_uncached_mapped_memory_go_through_a_staging_copy(small_block_device, monkeypatch):
    # A discrete GPU's BAR memory is mapped but uncached: the CPU reads it at tens of MB/s, a DMA at PCIe speed.
    from vktrain.runtime.vk import memory

    device = small_block_device
    data = np.arange(40_000, dtype=np.float32) * 0.5
    cached, uncached = Buffer.from_array(device, data, staging=False), Buffer.from_array(device, data, staging=False)
    assert cached._raw.host_cached  # lavapipe's memory is host memory
    uncached._raw.host_cached = False  # as the H100's device-local, host-visible type
    copies = []
    real_one_shot = device.one_shot
    monkeypatch.setattr(device, "one_shot", lambda record, **kw: copies.append(record) or real_one_shot(record, **kw))
    np.testing.assert_array_equal(cached.read(np.float32), data)
    assert copies == []  # read where it is mapped
    np.testing.assert_array_equal(uncached.read(np.float32), data)
    np.testing.assert_array_equal(uncached.read(np.float32, (3000,), offset=4 * 1000), data[1000:4000])
    assert len(copies) == 2  # each through a copy into cached memory
    small = memory.DIRECT_UNCACHED_READ_BYTES // 4
    np.testing.assert_array_equal(uncached.read(np.float32, (small,), offset=8), data[2:2 + small])
    assert len(copies) == 2  # a few words are read directly


def _count_raw_buffers(monkeypatch) -> list:
    """The list every raw Vulkan buffer created from now on appends what it is for to."""
    from vktrain.runtime.vk import memory

    created = []
    real_init = memory._RawBuffer.__init__

    def counted_init(raw, *args, **kwargs):
        created.append(args[-1])  # what it is for
        real_init(raw, *args, **kwargs)

    monkeypatch.setattr(memory._RawBuffer, "__init__", counted_init)
    return created


def test_downloads_reuse_one_staging_buffer_and_large_ones_free_theirs(small_block_device, monkeypatch):
    from vktrain.runtime.vk import memory

    device = small_block_device
    data = [np.arange(n, dtype=np.float32) - 7 for n in (10, 20_000, 300)]
    buffers = [Buffer.from_array(device, d, staging=True) for d in data]
    created = _count_raw_buffers(monkeypatch)
    buffers[1].read(np.float32)  # the largest first: the download buffer is made once, for it
    live = device.memory_stats().buffers  # the inputs and the one download buffer
    for _ in range(3):
        for buffer, expected in zip(buffers, data):
            np.testing.assert_array_equal(buffer.read(np.float32), expected)
            np.testing.assert_array_equal(buffer.read(np.float32, (2,), offset=8), expected[2:4])
    assert len(created) == 1 and device.memory_stats().buffers == live
    monkeypatch.setattr(memory, "STAGING_REUSE_LIMIT", 1024)  # above it a read gets its own, freed at once
    np.testing.assert_array_equal(buffers[1].read(np.float32), data[1])
    assert len(created) == 2 and device.memory_stats().buffers == live


def test_batched_uploads_reuse_one_staging_buffer_and_large_ones_free_theirs(small_block_device, monkeypatch):
    """write_pieces (a federation client's adapters, every client) makes its upload buffer once per device."""
    from vktrain.runtime.vk import memory

    device = small_block_device
    buffers = [Buffer(device, 4 * n, staging=True) for n in (10, 20_000, 300)]
    created = _count_raw_buffers(monkeypatch)
    live = device.memory_stats().buffers
    for round_ in range(3):
        data = [np.arange(b.nbytes // 4, dtype=np.float32) * (round_ + 1) for b in buffers]
        Buffer.write_pieces([(b, d, 0) for b, d in zip(buffers, data)])
        for buffer, expected in zip(buffers, data):
            np.testing.assert_array_equal(buffer.read(np.float32), expected)
    uploads = [what for what in created if "upload" in what]
    assert len(uploads) == 1 and device.memory_stats().buffers == live + 2  # the upload and the download one
    monkeypatch.setattr(memory, "STAGING_REUSE_LIMIT", 1024)  # above it an upload gets its own, freed at once
    Buffer.write_pieces([(buffers[1], np.ones(20_000, np.float32), 0)])
    np.testing.assert_array_equal(buffers[1].read(np.float32), np.ones(20_000, np.float32))
    assert len([what for what in created if "upload" in what]) == 2 and device.memory_stats().buffers == live + 2


def test_allocation_count_limit_applies_to_blocks_not_buffers(small_block_device, monkeypatch):
    device = small_block_device
    first = Buffer(device, 1024, name="first")
    count = device.allocation_count
    monkeypatch.setattr(device, "limits", dataclasses.replace(device.limits, max_memory_allocation_count=count))
    second = Buffer(device, 1024, name="fits-the-block")  # no new block needed
    assert device.allocation_count == count
    with pytest.raises(DeviceMemoryError, match=r"'too-big'.*maxMemoryAllocationCount \(\d+\)"):
        Buffer(device, 2 * MiB, name="too-big")
    assert device.memory_stats().buffers == 2
    first.destroy()
    second.destroy()


def test_more_buffers_than_a_driver_allows_allocations(small_block_device, monkeypatch):
    # The issue: one VkDeviceMemory per buffer stops at maxMemoryAllocationCount (4096 on many drivers).
    device = small_block_device
    monkeypatch.setattr(device, "limits", dataclasses.replace(device.limits, max_memory_allocation_count=4096))
    buffers = [Buffer(device, 64, name=f"t{i}") for i in range(4097)]
    try:
        assert device.memory_stats().buffers == 4097
        policy = device.memory.policy(buffers[0]._raw.type_index)
        assert device.allocation_count == count_block_allocations([64] * 4097, policy) <= 4
        buffers[-1].write(np.arange(16, dtype=np.int32))
        np.testing.assert_array_equal(buffers[-1].read(np.int32), np.arange(16, dtype=np.int32))
    finally:
        for buffer in buffers:
            buffer.destroy()


def test_request_above_max_allocation_size_is_refused_before_allocating(small_block_device):
    device = small_block_device
    limit = device.limits.max_memory_allocation_size
    before = device.memory_stats()
    with pytest.raises(DeviceMemoryError) as info:
        Buffer(device, limit + 4, name="too-large")
    error = info.value
    assert (error.requested_bytes, error.limit_bytes) == (limit + 4, limit)
    assert "'too-large'" in str(error) and str(limit + 4) in str(error) and "maxMemoryAllocationSize" in str(error)
    assert device.memory_stats() == before


def test_request_above_the_heap_is_refused_naming_the_heap(small_block_device, monkeypatch):
    device = small_block_device
    budget = device.memory_budget()
    # lavapipe's maxMemoryAllocationSize equals its heap; lift it so the heap is the limit hit.
    monkeypatch.setattr(device, "limits", dataclasses.replace(device.limits, max_memory_allocation_size=1 << 62))
    asked = budget.buffer_heap_bytes + (1 << 20)
    with pytest.raises(DeviceMemoryError, match=r"'weights'.*memory heap holds") as info:
        Buffer(device, asked, name="weights")
    assert (info.value.requested_bytes, info.value.limit_bytes) == (asked, budget.buffer_heap_bytes)
    assert device.memory_stats().allocations == 0


def _failing_allocate_memory(vk, real, fail_above: int):
    def allocate(device, info, allocator):
        if info.allocationSize > fail_above:
            raise vk.exception_codes[vk.VK_ERROR_OUT_OF_DEVICE_MEMORY]()
        return real(device, info, allocator)
    return allocate


def test_driver_out_of_memory_is_a_clear_error(small_block_device, monkeypatch):
    device = small_block_device
    vk = device.vk
    monkeypatch.setattr(vk, "vkAllocateMemory", _failing_allocate_memory(vk, vk.vkAllocateMemory, 0))
    with pytest.raises(DeviceMemoryError) as info:
        Buffer(device, 4096, name="activations")
    error = info.value
    assert isinstance(error.__cause__, VulkanError)
    assert error.__cause__.result_name == "VK_ERROR_OUT_OF_DEVICE_MEMORY"
    budget = device.memory_budget()
    assert "'activations'" in str(error) and "VK_ERROR_OUT_OF_DEVICE_MEMORY" in str(error)
    assert error.limit_bytes == budget.buffer_heap_bytes and str(budget.buffer_heap_bytes) in str(error)
    assert device.memory_stats().allocations == 0


def test_out_of_memory_at_buffer_creation_is_a_clear_error(small_block_device, monkeypatch):
    device = small_block_device
    vk = device.vk

    def create_buffer(*args):
        raise vk.exception_codes[vk.VK_ERROR_OUT_OF_HOST_MEMORY]()

    monkeypatch.setattr(vk, "vkCreateBuffer", create_buffer)
    with pytest.raises(DeviceMemoryError, match=r"'kv-cache': 4096 bytes \(4.00 KiB\) asked for, but vkCreateBuffer "
                                                r"failed with VK_ERROR_OUT_OF_HOST_MEMORY") as info:
        Buffer(device, 4096, name="kv-cache")
    assert isinstance(info.value.__cause__, VulkanError)
    assert device.memory_stats().allocations == 0


def test_a_request_that_fits_alone_survives_a_failing_block_allocation(small_block_device, monkeypatch):
    device = small_block_device
    vk = device.vk
    # The driver refuses a whole 1 MiB block but not the 64 KiB the buffer needs.
    monkeypatch.setattr(vk, "vkAllocateMemory", _failing_allocate_memory(vk, vk.vkAllocateMemory, MiB // 2))
    buffer = Buffer.from_array(device, np.arange(16384, dtype=np.float32), name="fallback")
    np.testing.assert_array_equal(buffer.read(np.float32), np.arange(16384, dtype=np.float32))
    policy = device.memory.policy(buffer._raw.type_index)
    assert device.memory_stats().bytes_reserved == align_up(buffer.size, policy.alignment)
    buffer.destroy()
    assert device.memory_stats().allocations == 0  # a dedicated block is released with its buffer


def test_memory_budget_reports_heaps_and_the_buffer_cap(vk_device):
    vk = vk_device.vk
    budget = vk_device.memory_budget()
    properties = vk.vkGetPhysicalDeviceMemoryProperties(vk_device.physical_device)
    assert [h.size for h in budget.heaps] == [properties.memoryHeaps[i].size for i in range(properties.memoryHeapCount)]
    assert budget.buffer_heap_bytes == budget.heaps[budget.buffer_heap_index].size
    assert budget.max_buffer_bytes == min(budget.buffer_heap_bytes, vk_device.limits.max_memory_allocation_size)
    probe = Buffer(vk_device, 64, name="probe")
    try:
        heap_of_probe = properties.memoryTypes[probe._raw.type_index].heapIndex
        assert heap_of_probe == budget.buffer_heap_index  # the heap real Buffers land in
    finally:
        probe.destroy()


def test_memory_budget_refuses_buffers_the_device_cannot_hold(vk_device):
    budget = vk_device.memory_budget()
    half = budget.max_buffer_bytes // 2
    budget.check_buffers({"weights": half, "activations": 4096}, "model.pte")  # fits: no error
    with pytest.raises(DeviceMemoryError, match=r"model.pte: buffer 'logits'.*largest buffer this device can hold"):
        budget.check_buffers({"weights": 64, "logits": budget.max_buffer_bytes + 1}, "model.pte")
    parts = -(-budget.buffer_heap_bytes // half) + 1  # each buffer allowed, together above the heap
    sizes = {f"part{i}": half for i in range(parts)}
    with pytest.raises(DeviceMemoryError, match=rf"model.pte: {parts} device buffers: {parts * half} bytes") as info:
        budget.check_buffers(sizes, "model.pte")
    assert info.value.limit_bytes == budget.buffer_heap_bytes


# ------------------------------------------------------------------------------ features
def _supports_robust_buffer_access(device) -> bool:
    return bool(device.vk.vkGetPhysicalDeviceFeatures(device.physical_device).robustBufferAccess)


def test_robust_buffer_access_is_enabled_with_validation_only(vk_device):
    if not vk_device.validation_enabled:
        pytest.skip("validation layer not installed")
    supported = _supports_robust_buffer_access(vk_device)
    assert ("robustBufferAccess" in vk_device.features) is supported
    with Device(validation=False) as plain:
        assert "robustBufferAccess" not in plain.features


def test_a_dispatch_past_its_binding_leaves_the_neighbouring_buffer_intact(vk_device):
    # y and its neighbour share a block; the kernel is told n = 4 * len(y). robustBufferAccess
    # (enabled with validation) discards the out-of-range writes; the binding range is y's own size.
    # lavapipe bounds-checks every access anyway, so on it this guards the binding ranges only.
    x = Buffer.from_array(vk_device, np.ones(256, np.float32), name="x")
    y = Buffer.from_array(vk_device, np.zeros(64, np.float32), name="y")
    neighbour = Buffer.from_array(vk_device, np.full(64, 7.0, np.float32), name="neighbour")
    try:
        assert y._raw.allocation.block is neighbour._raw.allocation.block
        dispatch = Dispatch("test_axpy", 4, ["x", "y"], pack_push(256, 2.0), local_size=(64, 1, 1))
        run_dispatches(vk_device, [dispatch], {"x": x, "y": y})
        np.testing.assert_array_equal(y.read(np.float32), np.full(64, 2.0, np.float32))
        np.testing.assert_array_equal(neighbour.read(np.float32), np.full(64, 7.0, np.float32))
    finally:
        for buffer in (x, y, neighbour):
            buffer.destroy()


def test_allocation_counts_are_available_without_vulkan():
    # `vktrain inspect` reports the count on machines without a Vulkan loader.
    root = Path(__file__).resolve().parents[1]
    script = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "vulkan":
                    raise ImportError("blocked import of vulkan")
        sys.meta_path.insert(0, Block())
        from vktrain.runtime import BlockPolicy, count_block_allocations
        print(count_block_allocations([3 << 20] * 10, BlockPolicy(block_bytes=8 << 20)))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=root, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "5"  # two 3 MiB buffers per 8 MiB block


@pytest.mark.parametrize("staging", [False, True])
def test_batched_pieces_write_and_read_the_bytes_one_call_each_would(vk_device, staging):
    # Odd sizes and offsets, two pieces in one buffer, a direct buffer among staging ones, an empty piece.
    rng = np.random.default_rng(7)
    a, b = Buffer(vk_device, 64, staging=staging), Buffer(vk_device, 40, staging=False)
    a_alone, b_alone = Buffer(vk_device, 64, staging=staging), Buffer(vk_device, 40, staging=False)
    for buffer in (a, b, a_alone, b_alone):
        buffer.zero()
    data = [rng.integers(0, 256, n, dtype=np.uint8) for n in (5, 17, 0, 12)]
    places = [(a, a_alone, 3), (a, a_alone, 40), (b, b_alone, 0), (b, b_alone, 25)]
    for (_, alone, offset), array in zip(places, data):
        alone.write(array, offset)
    Buffer.write_pieces([(buffer, array, offset) for (buffer, _, offset), array in zip(places, data)])
    for buffer, alone in ((a, a_alone), (b, b_alone)):
        assert np.array_equal(buffer.read(), alone.read())
    pieces = [(buffer, array.size, offset) for (buffer, _, offset), array in zip(places, data)]
    for got, (buffer, nbytes, offset) in zip(Buffer.read_pieces(pieces), pieces):
        assert got.dtype == np.uint8 and np.array_equal(got, buffer.read(np.uint8, (nbytes,), offset))
    # Zeros: filled on the device where 4-byte aligned (a's 8 at 48), uploaded where not (b's 3 at 1).
    Buffer.write_pieces([], zeros=[(a, 8, 48), (b, 3, 1)])
    a_alone.write(np.zeros(8, np.uint8), 48)
    b_alone.write(np.zeros(3, np.uint8), 1)
    for buffer, alone in ((a, a_alone), (b, b_alone)):
        assert np.array_equal(buffer.read(), alone.read())
    assert not a.read(np.uint8, (8,), 48).any() and a.read(np.uint8, (5,), 40).any()
    with pytest.raises(BufferUsageError, match="run past"):
        Buffer.write_pieces([(a, data[0], 62)])
    for buffer in (a, b, a_alone, b_alone):
        buffer.destroy()
