"""The Vulkan runtime core on a real device (lavapipe here), with validation on (see conftest.py).

References are numpy/float64; shaders are the runtime's own test kernels (test_axpy, test_grid,
test_scale in vktrain/runtime_shaders).
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from vktrain.runtime import (
    BindingRangeError,
    Buffer,
    BufferBinding,
    BufferUsageError,
    Device,
    DeviceSelectionError,
    Dispatch,
    PhysicalDeviceInfo,
    Program,
    ResolvedAccess,
    ScheduleError,
    ShaderNotFoundError,
    VulkanError,
    ceil_div,
    find_memory_type,
    pack_push,
    plan_barriers,
    run_dispatches,
    select_physical_device,
    split_groups,
)
from vktrain.runtime.vk.errors import DeviceMemoryError, vk_call

ROOT = Path(__file__).resolve().parents[1]
LOCAL = 64


def axpy(n: int, alpha: float, x="x", y="y", *, scale: float = 1.0, shader: str = "test_axpy") -> Dispatch:
    return Dispatch(shader, groups=ceil_div(n, LOCAL), bindings=[x, y], push_constants=pack_push(n, alpha),
                    spec_constants={3: scale}, local_size=(LOCAL, 1, 1), label=f"{shader}({x}->{y})")


def axpy_reference(alpha: float, x: np.ndarray, y: np.ndarray, scale: float = 1.0) -> np.ndarray:
    return (scale * alpha * x.astype(np.float64) + y.astype(np.float64)).astype(np.float32)


@pytest.fixture
def buffers(vk_device):
    """Buffers a test creates through make(...) are destroyed after it."""
    made: list[Buffer] = []

    def make(data_or_size, **kwargs) -> Buffer:
        if isinstance(data_or_size, int):
            buffer = Buffer(vk_device, data_or_size, **kwargs)
        else:
            buffer = Buffer.from_array(vk_device, data_or_size, **kwargs)
        made.append(buffer)
        return buffer

    yield make
    for buffer in made:
        buffer.destroy()


# ------------------------------------------------------------------------------------ memory
@pytest.mark.parametrize("staging", [False, True], ids=["direct", "staging"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, np.int8, np.uint8, np.int32, np.int64])
def test_upload_download_round_trip(vk_device, buffers, dtype, staging):
    rng = np.random.default_rng(0)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        data = rng.integers(info.min, info.max, size=(3, 37), dtype=dtype, endpoint=True)
    else:
        data = (rng.standard_normal((3, 37)) * 1e3).astype(dtype)
    buffer = buffers(data, staging=staging)
    assert buffer.staging is staging
    assert buffer.nbytes == data.nbytes and buffer.size % 4 == 0 and buffer.size >= data.nbytes
    np.testing.assert_array_equal(buffer.read(dtype, data.shape), data)

    # Partial write at a byte offset leaves the rest intact; partial read at an offset sees it.
    patch = data[1, :5][::-1].copy()
    offset = data.itemsize * (37 + 2)
    buffer.write(patch, offset=offset)
    expected = data.copy()
    expected[1, 2:7] = patch
    np.testing.assert_array_equal(buffer.read(dtype, data.shape), expected)
    np.testing.assert_array_equal(buffer.read(dtype, 5, offset=offset), patch)


def test_odd_sized_buffer_is_padded_and_bytes_round_trip(vk_device, buffers):
    buffer = buffers(b"\x01\x02\x03\x04\x05\x06\x07")
    assert (buffer.nbytes, buffer.size) == (7, 8)
    assert buffer.read().tobytes() == b"\x01\x02\x03\x04\x05\x06\x07"


@pytest.mark.parametrize("staging", [False, True], ids=["direct", "staging"])
def test_zero_clears_the_buffer(vk_device, buffers, staging):
    buffer = buffers(np.arange(1, 11, dtype=np.int32), staging=staging)
    buffer.zero()
    np.testing.assert_array_equal(buffer.read(np.int32), np.zeros(10, np.int32))


def test_buffer_access_errors_name_the_problem(vk_device, buffers):
    buffer = buffers(16, name="small")
    with pytest.raises(BufferUsageError, match=r"'small'.*20 bytes at offset 0 run past the buffer's 16 bytes"):
        buffer.write(np.zeros(5, np.float32))
    with pytest.raises(BufferUsageError, match="offset must be a non-negative int"):
        buffer.read(np.uint8, 1, offset=-1)
    with pytest.raises(BufferUsageError, match="positive number of bytes"):
        Buffer(vk_device, 0)
    buffer.destroy()
    with pytest.raises(BufferUsageError, match="was destroyed"):
        buffer.read()


def test_buffers_are_sub_allocated_and_counted(vk_device, buffers):
    # Blocks are 256 MiB by default: small buffers share the block the session's earlier ones made.
    buffers(64)
    before = vk_device.memory_stats()
    made = [buffers(4096) for _ in range(8)]
    after = vk_device.memory_stats()
    assert after.allocations == before.allocations == vk_device.allocation_count
    assert after.buffers == before.buffers + len(made)
    assert after.bytes_in_use > before.bytes_in_use
    for buffer in made:
        buffer.destroy()
    assert vk_device.memory_stats() == before


def test_find_memory_type_uses_flags_not_indices():
    device_local, host_visible, coherent, cached = 0x1, 0x2, 0x4, 0x8
    types = [device_local, host_visible | coherent, host_visible | coherent | cached, device_local | host_visible]
    # Required flags decide; among candidates the most preferred flags win, ties go to the lower index.
    assert find_memory_type(types, 0b1111, host_visible | coherent) == 1
    assert find_memory_type(types, 0b1111, host_visible | coherent, preferred=cached) == 2
    assert find_memory_type(types, 0b1011, host_visible | coherent, preferred=cached) == 1  # type 2 excluded
    assert find_memory_type(types, 0b1111, device_local, preferred=host_visible) == 3
    assert find_memory_type(types, 0b0001, host_visible) is None


def test_impossible_allocation_is_refused_naming_buffer_and_limit(vk_device):
    with pytest.raises(DeviceMemoryError) as info:
        Buffer(vk_device, 1 << 50, name="petabyte")
    error = info.value
    assert error.requested_bytes == 1 << 50 and error.limit_bytes < 1 << 50
    assert "petabyte" in str(error) and str(1 << 50) in str(error) and str(error.limit_bytes) in str(error)


def test_vk_call_converts_every_failing_result(vk_device):
    vk = vk_device.vk

    def fails_with(code):
        def fn():
            raise vk.exception_codes[code]()
        return fn

    with pytest.raises(VulkanError, match=r"vkQueueSubmit failed with VK_ERROR_DEVICE_LOST \(-4\)"):
        vk_call("vkQueueSubmit", fails_with(vk.VK_ERROR_DEVICE_LOST))
    with pytest.raises(VulkanError, match=r"vkWaitForFences failed with VK_TIMEOUT \(2\)"):
        vk_call("vkWaitForFences", fails_with(vk.VK_TIMEOUT))


# ------------------------------------------------------------------------------------ dispatch
def test_axpy_matches_numpy(vk_device, buffers):
    n, alpha = 1000, 1.75  # not a multiple of the local size: the tail is guarded
    rng = np.random.default_rng(1)
    xs, ys = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    sentinel = np.float32(123.0)
    x, y = buffers(xs), buffers(np.append(ys, sentinel))  # one element past n must stay untouched
    run_dispatches(vk_device, [axpy(n, alpha, scale=0.5)], {"x": x, "y": y})
    out = y.read(np.float32)
    np.testing.assert_allclose(out[:n], axpy_reference(alpha, xs, ys, scale=0.5), rtol=1e-6, atol=1e-6)
    assert out[n] == sentinel


def test_variant_is_compiled_with_its_define(vk_device, buffers):
    n = 100
    xs, ys = np.arange(n, dtype=np.float32), np.ones(n, np.float32)
    x, y = buffers(xs), buffers(ys)
    run_dispatches(vk_device, [axpy(n, 2.0, shader="test_axpy@NEGATE")], {"x": x, "y": y})
    np.testing.assert_array_equal(y.read(np.float32), ys - 2.0 * xs)


def test_staging_buffers_work_in_a_program(vk_device, buffers):
    n = 300
    rng = np.random.default_rng(2)
    xs, ys = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    x, y = buffers(xs, staging=True), buffers(ys, staging=True)
    run_dispatches(vk_device, [axpy(n, -3.0)], {"x": x, "y": y})
    np.testing.assert_allclose(y.read(np.float32), axpy_reference(-3.0, xs, ys), rtol=1e-6, atol=1e-6)


def test_replay_with_new_inputs(vk_device, buffers):
    n, alpha = 777, 0.25
    x, y = buffers(4 * n), buffers(4 * n)
    rng = np.random.default_rng(3)
    with Program(vk_device, [axpy(n, alpha)], {"x": x, "y": y}) as program:
        for _ in range(5):
            xs, ys = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
            x.write(xs)
            y.write(ys)
            program.replay()
            np.testing.assert_allclose(y.read(np.float32), axpy_reference(alpha, xs, ys), rtol=1e-6, atol=1e-6)


def test_replay_accumulates_in_place(vk_device, buffers):
    # Without new inputs each replay adds alpha*x again: replays really re-run on current contents.
    n = 64
    xs = np.arange(n, dtype=np.float32)
    x, y = buffers(xs), buffers(np.zeros(n, np.float32))
    with Program(vk_device, [axpy(n, 1.0)], {"x": x, "y": y}) as program:
        for count in range(1, 4):
            program.replay()
            np.testing.assert_array_equal(y.read(np.float32), count * xs)


def test_replay_after_a_bound_buffer_is_destroyed_is_refused(vk_device, buffers):
    x, y = buffers(np.ones(8, np.float32), name="x_in"), buffers(np.ones(8, np.float32))
    with Program(vk_device, [axpy(8, 1.0)], {"x": x, "y": y}) as program:
        program.replay()
        x.destroy()
        with pytest.raises(ScheduleError, match=r"buffers \['x_in'\] were destroyed"):
            program.replay()


def test_buffer_objects_can_be_bound_directly(vk_device, buffers):
    n = 10
    x, y = buffers(np.ones(n, np.float32)), buffers(np.ones(n, np.float32))
    run_dispatches(vk_device, [axpy(n, 4.0, x=x, y=BufferBinding(y, access="rw"))])
    np.testing.assert_array_equal(y.read(np.float32), np.full(n, 5.0, np.float32))


def test_bindings_at_offsets_see_their_subrange(vk_device, buffers):
    align = vk_device.limits.min_storage_buffer_offset_alignment
    n = 50
    count = align // 4 + n  # floats: padding of one alignment unit, then the data
    xs = np.arange(count, dtype=np.float32)
    x, y = buffers(xs), buffers(np.zeros(count, np.float32))
    dispatch = Dispatch("test_axpy", groups=1, local_size=(LOCAL, 1, 1), push_constants=pack_push(n, 1.0),
                        bindings=[BufferBinding("x", offset=align, size=4 * n), BufferBinding("y", offset=align)])
    run_dispatches(vk_device, [dispatch], {"x": x, "y": y})
    expected = np.zeros(count, np.float32)
    expected[align // 4:] = xs[align // 4:]
    np.testing.assert_array_equal(y.read(np.float32), expected)


# ------------------------------------------------------------------------------------ splitting
def test_split_groups_tiles_the_grid_once():
    chunks = split_groups((7, 5, 1), (3, 2, 4))
    assert len(chunks) == 3 * 3
    covered = np.zeros((7, 5), int)
    for (ox, oy, oz), (cx, cy, cz) in chunks:
        assert cx <= 3 and cy <= 2 and (oz, cz) == (0, 1)
        covered[ox:ox + cx, oy:oy + cy] += 1
    assert (covered == 1).all()
    assert split_groups((4, 1, 1), (65535, 65535, 65535)) == [((0, 0, 0), (4, 1, 1))]
    assert len(split_groups((2**32 - 1, 1, 1), (65535, 65535, 65535))) == 65537  # ceil((2^32 - 1) / 65535)
    # A corrupt grid is refused before its 4e9 chunks are built (the list alone would exhaust memory).
    with pytest.raises(ScheduleError, match=r"would be split into 4295098369 dispatches"):
        split_groups((2**32 - 1, 2**32 - 1, 1), (65535, 65535, 65535))


def test_split_dispatch_computes_every_element_once(vk_device, buffers):
    n, alpha = 1000, 3.0  # 16 groups of 64, at most 3 per vkCmdDispatch
    rng = np.random.default_rng(4)
    xs, ys = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    x, y = buffers(xs), buffers(ys)
    with Program(vk_device, [axpy(n, alpha)], {"x": x, "y": y}, max_group_count=3) as program:
        assert program.recorded_dispatch_count == ceil_div(16, 3)
        program.replay()
    np.testing.assert_allclose(y.read(np.float32), axpy_reference(alpha, xs, ys), rtol=1e-6, atol=1e-6)


def test_split_dispatch_in_three_dimensions(vk_device, buffers):
    groups, local = (5, 4, 3), (2, 2, 2)
    size = (2 * 5 - 1, 2 * 4, 2 * 3 - 1)  # partial last groups on x and z
    total = size[0] * size[1] * size[2]
    counts, ids = buffers(np.zeros(total, np.uint32)), buffers(np.full(total, 0xFFFFFFFF, np.uint32))
    dispatch = Dispatch("test_grid", groups=groups, bindings=["counts", "ids"],
                        push_constants=pack_push(*size, 0))
    with Program(vk_device, [dispatch], {"counts": counts, "ids": ids}, max_group_count=(2, 3, 2)) as program:
        assert program.recorded_dispatch_count == 3 * 2 * 2
        program.replay()
    np.testing.assert_array_equal(counts.read(np.uint32), np.ones(total, np.uint32))
    np.testing.assert_array_equal(ids.read(np.uint32), np.arange(total, dtype=np.uint32))
    assert local == (2, 2, 2)  # test_grid.slang's fixed local size, which `size` above assumes


def test_plan_submits_counts_split_chunks_one_by_one():
    from vktrain.runtime.vk.schedule import plan_submits

    # Dispatch 1 records 3 chunks and dispatch 3 records 5: with 2 per submit they straddle submits.
    counts = [1, 3, 1, 5, 2]
    assert plan_submits(counts, 2) == [[(0, 0, 1), (1, 0, 1)], [(1, 1, 3)], [(2, 0, 1), (3, 0, 1)],
                                       [(3, 1, 3)], [(3, 3, 5)], [(4, 0, 2)]]
    for bound in range(1, 14):
        submits = plan_submits(counts, bound)
        assert len(submits) == ceil_div(sum(counts), bound)
        assert all(sum(end - first for _, first, end in runs) <= bound for runs in submits)
        # every chunk of every dispatch exactly once, in recording order
        flat = [(i, c) for runs in submits for i, first, end in runs for c in range(first, end)]
        assert flat == [(i, c) for i, n in enumerate(counts) for c in range(n)]
    assert plan_submits(counts, None) == plan_submits(counts, 0) == [[(0, 0, 1), (1, 0, 3), (2, 0, 1), (3, 0, 5),
                                                                      (4, 0, 2)]]
    with pytest.raises(ScheduleError, match=r"max_dispatches_per_submit must be an integer >= 0 .* got -1"):
        plan_submits(counts, -1)


@pytest.mark.parametrize("bound", [1, 5, 7])
def test_bounded_submits_run_a_dependent_split_chain_like_one_submit(vk_device, buffers, bound):
    n, alphas = 1000, (3.0, -0.5, 2.0, 0.25)  # 16 groups of 64, at most 3 per vkCmdDispatch: 6 chunks each
    rng = np.random.default_rng(5)
    xs, ys = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    chain = [axpy(n, alpha) for alpha in alphas]  # each reads the y the one before wrote
    results = {}
    for per_submit in (None, bound):
        x, y = buffers(xs), buffers(ys)
        with Program(vk_device, chain, {"x": x, "y": y}, max_group_count=3, timing=True,
                     max_dispatches_per_submit=per_submit) as program:
            assert program.recorded_dispatch_count == 4 * 6
            expected_submits = 1 if per_submit is None else ceil_div(24, per_submit)
            assert program.submits_per_replay == expected_submits
            program.replay()
            program.replay()
            assert program.submit_count == 2 * expected_submits
            seconds = program.timings()
            if vk_device.timestamps_supported:
                assert len(seconds) == len(chain) and all(s >= 0 for s in seconds)
        results[per_submit] = y.read(np.float32)
    reference = ys
    for _ in range(2):
        for alpha in alphas:
            reference = axpy_reference(alpha, xs, reference)
    np.testing.assert_allclose(results[bound], reference, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(results[bound], results[None])


def test_shader_without_group_offset_header_is_not_split(vk_device, buffers):
    data = buffers(np.ones(300, np.float32))  # 300 > 4 groups * 32: the grid-stride loop takes 3 trips
    grid_stride = Dispatch("test_scale", groups=4, bindings=["d"], push_constants=pack_push(300, 2.0, 4))
    run_dispatches(vk_device, [grid_stride], {"d": data})
    np.testing.assert_array_equal(data.read(np.float32), np.full(300, 2.0, np.float32))
    with pytest.raises(ScheduleError, match="cannot be split.*uint4 vktrain_group_offset"):
        Program(vk_device, [grid_stride], {"d": data}, max_group_count=3)


# ------------------------------------------------------------------------------------ barriers
def access(buffer, start, end, *, reads=True, writes=False):
    return ResolvedAccess(buffer, start, end, reads, writes)


def test_plan_barriers_only_between_dependent_dispatches():
    x_to_y = [access("x", 0, 64), access("y", 0, 64, writes=True)]
    a_to_b = [access("a", 0, 64), access("b", 0, 64, writes=True)]
    y_to_z = [access("y", 0, 64), access("z", 0, 64, writes=True)]
    y_hi_to_w = [access("y", 64, 128), access("w", 0, 64, writes=True)]  # disjoint range of y
    overwrite_x = [access("x", 0, 8, reads=False, writes=True)]
    read_x = [access("x", 0, 64)]
    assert plan_barriers([x_to_y, a_to_b]) == [False, False]          # independent
    assert plan_barriers([x_to_y, y_to_z]) == [False, True]           # read after write
    assert plan_barriers([x_to_y, y_hi_to_w]) == [False, False]       # same buffer, other bytes
    assert plan_barriers([x_to_y, overwrite_x]) == [False, True]      # write after read
    assert plan_barriers([overwrite_x, overwrite_x]) == [False, True]  # write after write
    assert plan_barriers([x_to_y, read_x]) == [False, False]          # read after read
    # A barrier clears the pending set: the third dispatch only depends on the first, already fenced.
    assert plan_barriers([x_to_y, y_to_z, a_to_b, [access("y", 0, 4)]]) == [False, True, False, False]


def test_plan_barriers_is_safe_and_minimal_on_random_schedules():
    rng = np.random.default_rng(6)
    for _ in range(200):
        schedule = []
        for _ in range(rng.integers(1, 12)):
            dispatch = []
            for _ in range(rng.integers(1, 4)):
                start = int(rng.integers(0, 6)) * 16
                mode = rng.choice(["r", "w", "rw"])
                dispatch.append(access(f"buf{rng.integers(0, 3)}", start, start + 16 * int(rng.integers(1, 3)),
                                       reads="r" in mode, writes="w" in mode))
            schedule.append(dispatch)
        barriers = plan_barriers(schedule)

        def conflict(i, j):
            return any(a.buffer_id == b.buffer_id and a.start < b.end and b.start < a.end and (a.writes or b.writes)
                       for a in schedule[i] for b in schedule[j])

        for j in range(len(schedule)):
            # Safe: every conflicting earlier dispatch is separated by a barrier at or before j.
            for i in range(j):
                if conflict(i, j):
                    assert any(barriers[i + 1:j + 1]), (i, j, barriers)
            # Minimal: a barrier at j exists only because j conflicts with something since the last one.
            if barriers[j]:
                previous = max([k for k in range(j) if barriers[k]], default=0)
                assert any(conflict(i, j) for i in range(previous, j)), (j, barriers)


def test_dispatch_normalizes_and_is_hashable():
    d = Dispatch("k", 7, ["a", BufferBinding("b", 16, 32, "r")], pack_push(1), {5: 1.5, 3: 2})
    assert d.groups == (7, 1, 1)
    assert d.bindings == (BufferBinding("a"), BufferBinding("b", 16, 32, "r"))
    assert d.spec_constants == ((3, 2), (5, 1.5))
    assert Dispatch("k", (7,), ["a", BufferBinding("b", 16, 32, "r")], pack_push(1), [(3, 2), (5, 1.5)]) == d
    assert hash(d) == hash(Dispatch("k", (7, 1, 1), d.bindings, d.push_constants, {3: 2, 5: 1.5}))
    assert Dispatch("k", 1, local_size=(8, 4, 1), spec_constants={3: 1}).specialization() == \
        ((0, 8), (1, 4), (2, 1), (3, 1))
    with pytest.raises(ScheduleError, match="access must be one of"):
        BufferBinding("a", access="write")
    with pytest.raises(ScheduleError, match="1 to 3 axes"):
        Dispatch("k", (1, 1, 1, 1))
    assert Dispatch("k", (1, 2**32 - 1)).groups == (1, 2**32 - 1, 1)
    # Beyond 32 bits the group-offset header cannot be packed (it raised struct.error at recording).
    with pytest.raises(ScheduleError, match=r"group count 4294967296 .* 32-bit work-group index"):
        Dispatch("k", (1, 2**32))


def test_pack_push_matches_glsl_scalar_layout():
    packed = pack_push(3, -2, 1.5, True, 2**32 - 1)
    assert packed == (np.array([3], "<u4").tobytes() + np.array([-2], "<i4").tobytes()
                      + np.array([1.5], "<f4").tobytes() + np.array([1, 2**32 - 1], "<u4").tobytes())
    for bad in (2**32, -(2**31) - 1):
        with pytest.raises(ScheduleError, match="does not fit in 32 bits"):
            pack_push(bad)
    with pytest.raises(ScheduleError, match="int, float or bool"):
        pack_push("3")


def test_program_barriers_follow_shader_access_and_chain_is_correct(vk_device, buffers):
    n = 256
    rng = np.random.default_rng(5)
    xs, ys, zs, as_, bs = (rng.standard_normal(n).astype(np.float32) for _ in range(5))
    named = {k: buffers(v) for k, v in dict(x=xs, y=ys, z=zs, a=as_, b=bs).items()}
    chain = [axpy(n, 2.0, "x", "y"), axpy(n, 3.0, "a", "b"), axpy(n, -1.0, "y", "z"), axpy(n, 0.5, "x", "a")]
    with Program(vk_device, chain, named) as program:
        # y<-x ; b<-a (independent) ; z<-y reads y written by #0 ; a<-x writes a that #1 read, but #2's
        # barrier already ordered #1 before it.
        assert program.barriers == [False, False, True, False]
        program.replay()
    y_ref = axpy_reference(2.0, xs, ys)
    np.testing.assert_allclose(named["y"].read(np.float32), y_ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(named["b"].read(np.float32), axpy_reference(3.0, as_, bs), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(named["z"].read(np.float32), axpy_reference(-1.0, y_ref, zs), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(named["a"].read(np.float32), axpy_reference(0.5, xs, as_), rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------ timing
def test_timings_are_positive_per_dispatch(vk_device, buffers):
    if not vk_device.timestamps_supported:
        pytest.skip("this device's compute queue has no timestamps")
    n = 4096
    x, y = buffers(np.ones(n, np.float32)), buffers(np.ones(n, np.float32))
    dispatches = [axpy(n, 1.0), axpy(n, 2.0)]
    with Program(vk_device, dispatches, {"x": x, "y": y}, timing=True) as program:
        with pytest.raises(ScheduleError, match="before the first replay"):
            program.timings()
        program.replay()
        seconds = program.timings()
    assert len(seconds) == 2
    assert all(0 < s < 10 for s in seconds), seconds


def test_timings_are_none_without_timestamp_support(vk_device, buffers, monkeypatch):
    monkeypatch.setattr(vk_device, "timestamp_valid_bits", 0)
    assert not vk_device.timestamps_supported
    x, y = buffers(np.ones(8, np.float32)), buffers(np.ones(8, np.float32))
    with Program(vk_device, [axpy(8, 1.0)], {"x": x, "y": y}, timing=True) as program:
        program.replay()
        assert program.timings() is None
    np.testing.assert_array_equal(y.read(np.float32), np.full(8, 2.0, np.float32))


# ------------------------------------------------------------------------------------ checks
def test_binding_past_max_storage_buffer_range_is_refused(vk_device, buffers, monkeypatch):
    small = dataclasses.replace(vk_device.limits, max_storage_buffer_range=1024)
    monkeypatch.setattr(vk_device, "limits", small)
    x, y = buffers(2048), buffers(2048)
    with pytest.raises(BindingRangeError, match=r"2048 bytes, more than the device's maxStorageBufferRange of 1024"):
        Program(vk_device, [axpy(512, 1.0)], {"x": x, "y": y})
    # The same buffers bound in ranges within the limit are fine.
    ok = Dispatch("test_axpy", groups=4, local_size=(LOCAL, 1, 1), push_constants=pack_push(256, 1.0),
                  bindings=[BufferBinding("x", 0, 1024), BufferBinding("y", 1024, 1024)])
    Program(vk_device, [ok], {"x": x, "y": y}).destroy()


def test_dispatch_mismatches_are_clear_errors(vk_device, buffers):
    x, y = buffers(256), buffers(256)
    named = {"x": x, "y": y}
    cases = [
        (Dispatch("test_axpy", 1, ["x"], pack_push(64, 1.0)), r"declares 2 storage buffers .* binds 1"),
        (Dispatch("test_axpy", 1, ["x", "y"], pack_push(64)), r"expects 8 bytes of push constants after the 16-byte"),
        (Dispatch("test_axpy", 1, ["x", "nope"], pack_push(64, 1.0)), r"'nope', which is not in the buffers mapping"),
        (Dispatch("test_axpy", 1, ["x", "y"], pack_push(64, 1.0), {7: 1}), r"no specialization constant with id 7"),
        (Dispatch("test_axpy", 1, ["x", "y"], pack_push(64, 1.0), {3: True}), r"spec constant 3 is float, got True"),
        (Dispatch("test_axpy", 1, ["x", "y"], pack_push(64, 1.0), {3: 2}), None),  # int into float: allowed
        (Dispatch("test_scale", 1, ["x"], pack_push(64, 1.0, 1), local_size=(64, 1, 1)), r"does not take its local size"),
        (Dispatch("test_axpy", 1, ["x", "y"], pack_push(64, 1.0), local_size=(4096, 1, 1)), r"exceeds the device"),
        (Dispatch("test_axpy", 1, [BufferBinding("x", offset=2), "y"], pack_push(64, 1.0)),
         r"offset 2 is not a multiple of the device's minStorageBufferOffsetAlignment"),
        (Dispatch("test_axpy", 1, [BufferBinding("x", size=512), "y"], pack_push(64, 1.0)), r"outside the buffer"),
    ]
    for dispatch, pattern in cases:
        if pattern is None:
            Program(vk_device, [dispatch], named).destroy()
            continue
        with pytest.raises((ScheduleError, BindingRangeError), match=pattern):
            Program(vk_device, [dispatch], named)


def test_unknown_shader_names_what_to_do(vk_device, buffers):
    with pytest.raises(ShaderNotFoundError, match="no_such_kernel"):
        Program(vk_device, [Dispatch("no_such_kernel", 1)], {})
    with pytest.raises(ScheduleError, match="non-empty shader name"):
        Dispatch("", 1)
    with pytest.raises(ScheduleError, match="group count must be an int >= 1"):
        Dispatch("test_axpy", (4, 0))
    with pytest.raises(ScheduleError, match="multiple of 4 bytes"):
        Dispatch("test_axpy", 1, push_constants=b"abc")
    with pytest.raises(ScheduleError, match="reserved for local_size"):
        Dispatch("test_axpy", 1, spec_constants={0: 3}, local_size=(64, 1, 1))


def test_pipelines_are_cached_by_shader_and_specialization(vk_device, buffers):
    x, y = buffers(256), buffers(256)
    cache = vk_device.pipelines
    Program(vk_device, [axpy(64, 1.0, scale=1.0)], {"x": x, "y": y}).destroy()
    count = len(cache)
    Program(vk_device, [axpy(64, 2.0, scale=1.0), axpy(64, 5.0, scale=1.0)], {"x": x, "y": y}).destroy()
    assert len(cache) == count  # push constants differ, pipeline shared
    Program(vk_device, [axpy(64, 1.0, scale=0.25)], {"x": x, "y": y}).destroy()
    assert len(cache) == count + 1  # a new specialization is a new pipeline


def test_validation_messages_are_collected(vk_device):
    if not vk_device.validation_enabled:
        pytest.skip("validation layer not installed")
    vk = vk_device.vk
    info = vk.VkBufferCreateInfo(sType=vk.VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO, size=0,
                                 usage=vk.VK_BUFFER_USAGE_STORAGE_BUFFER_BIT, sharingMode=vk.VK_SHARING_MODE_EXCLUSIVE)
    try:
        handle = vk.vkCreateBuffer(vk_device.handle, info, None)  # size 0 is invalid usage
        vk.vkDestroyBuffer(vk_device.handle, handle, None)
    except vk.VkError:
        pass
    messages = vk_device.take_validation_messages()  # taken, so the fixture sees a clean device
    assert any("VUID-VkBufferCreateInfo-size-00912" in m.id_name and m.severity == "error" for m in messages)


# ------------------------------------------------------------------------------------ device
def fake(index, name, device_type):
    return PhysicalDeviceInfo(index, name, device_type)


def test_physical_device_ranking_and_overrides():
    cpu, integrated, discrete, virtual = 4, 1, 2, 3
    devices = [fake(0, "llvmpipe (LLVM 15)", cpu), fake(1, "Intel Iris Xe", integrated),
               fake(2, "NVIDIA H200", discrete), fake(3, "virtio-gpu", virtual)]
    assert select_physical_device(devices, None) == 2
    assert select_physical_device(devices[:2] + devices[3:], None) == 1
    assert select_physical_device([devices[0], devices[3]], None) == 3
    assert select_physical_device([fake(0, "a", cpu), fake(1, "b", cpu)], None) == 0  # tie: first
    assert select_physical_device(devices, "0") == 0
    assert select_physical_device(devices, 3) == 3
    assert select_physical_device(devices, "h200") == 2
    assert select_physical_device(devices, "  IRIS ") == 1
    with pytest.raises(DeviceSelectionError, match=r"index out of range.*\[2\] NVIDIA H200 \(discrete\)"):
        select_physical_device(devices, "7")
    with pytest.raises(DeviceSelectionError, match=r"'radeon' matches no device name; available devices: \[0\]"):
        select_physical_device(devices, "radeon")
    with pytest.raises(DeviceSelectionError, match="ambiguous"):
        select_physical_device([fake(0, "GPU A", discrete), fake(1, "GPU B", discrete)], "gpu")


@pytest.mark.parametrize("by", ["index", "name"])
def test_device_override_by_environment(vk_device, monkeypatch, by):
    target = vk_device.info
    # The name with its case swapped: matching is case-insensitive (substrings: see the unit test).
    selector = str(target.index) if by == "index" else target.name.swapcase()
    monkeypatch.setenv("VKTRAIN_DEVICE", selector)
    with Device(validation=False) as device:
        assert device.info == target
        assert device.available_devices == vk_device.available_devices
    assert device.closed


def test_bad_device_override_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("VKTRAIN_DEVICE", "no-such-gpu-anywhere")
    with pytest.raises(DeviceSelectionError, match=r"no-such-gpu-anywhere.*matches no device name.*available"):
        Device(validation=False)
    monkeypatch.setenv("VKTRAIN_DEVICE", "99")
    with pytest.raises(DeviceSelectionError, match=r"VKTRAIN_DEVICE=99: device index out of range"):
        Device(validation=False)


@pytest.mark.parametrize("value, enabled", [("1", True), ("0", False)])
def test_validation_follows_the_environment(vk_device, monkeypatch, value, enabled):
    if not vk_device.validation_enabled:
        pytest.skip("validation layer not installed")
    monkeypatch.setenv("VKTRAIN_VALIDATION", value)
    with Device() as device:
        assert device.validation_enabled is enabled


def _run_isolated(script: str, **env_overrides: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.update(env_overrides)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120)


def test_missing_loader_is_a_clear_error_and_schedules_still_import():
    # Simulate a machine without libvulkan: the binding's dlopen raises OSError on import.
    result = _run_isolated("""
        import sys
        class NoLoader:
            def find_spec(self, name, path=None, target=None):
                if name == "vulkan":
                    raise OSError("libvulkan.so.1: cannot open shared object file")
        sys.meta_path.insert(0, NoLoader())
        from vktrain.runtime import Device, Dispatch, VulkanUnavailableError
        Dispatch("test_axpy", 4)  # schedules are plain data: no Vulkan needed
        try:
            Device()
        except VulkanUnavailableError as exc:
            print(exc)
    """)
    assert result.returncode == 0, result.stderr
    assert "libvulkan.so.1" in result.stdout and "apt-get install libvulkan1 mesa-vulkan-drivers" in result.stdout


def test_no_driver_is_a_clear_error():
    # A loader that finds no driver (ICD list pointing nowhere) cannot create an instance.
    result = _run_isolated("""
        from vktrain.runtime import Device, VulkanUnavailableError
        try:
            Device(validation=False)
        except VulkanUnavailableError as exc:
            print("unavailable:", exc)
    """, VK_DRIVER_FILES="/nonexistent/icd.json", VK_ICD_FILENAMES="/nonexistent/icd.json")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("unavailable:") and "mesa-vulkan-drivers" in result.stdout, result.stdout


def test_device_reports_limits_and_capabilities(vk_device):
    limits = vk_device.limits
    assert limits.max_storage_buffer_range >= 2**27  # the Vulkan-required minimum
    assert limits.min_storage_buffer_offset_alignment >= 4  # test_dispatch_mismatches relies on it
    assert all(c >= 65535 for c in limits.max_compute_work_group_count)
    assert limits.max_push_constants_size >= 128
    assert limits.max_memory_allocation_size >= 2**30  # the Vulkan-required minimum (maintenance3)
    assert 1 <= limits.buffer_image_granularity <= 131072  # the spec's required range
    assert vk_device.api_version >= vk_device.vk.VK_MAKE_VERSION(1, 1, 0)
    assert vk_device.device_type in ("discrete", "integrated", "virtual", "cpu", "other")
    size = vk_device.subgroup_size
    assert size >= 1 and size & (size - 1) == 0  # a power of two, per the spec
    assert vk_device.subgroup_operations & vk_device.vk.VK_SUBGROUP_FEATURE_BASIC_BIT  # required in 1.1 compute


def test_close_frees_everything_it_created():
    from vktrain.runtime import ValidationLayerMissingError
    try:
        device = Device(validation=True)
    except ValidationLayerMissingError:
        pytest.skip("validation layer not installed")
    x = Buffer.from_array(device, np.ones(16, np.float32))
    y = Buffer(device, 64, staging=True)
    program = Program(device, [axpy(16, 1.0)], {"x": x, "y": y}, timing=True)
    program.replay()
    device.close()  # nothing destroyed by hand: the device frees its children
    device.close()  # idempotent
    assert device.validation_messages == []
    assert not x.alive and not program.alive


# ------------------------------------------------------------------------------------ isolation
def test_runtime_imports_without_torch_or_executorch():
    script = """
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("torch", "executorch"):
                    raise ImportError(f"blocked import of {name}")
        sys.meta_path.insert(0, Block())
        import numpy as np
        import vktrain.runtime as rt
        with rt.Device(validation=False) as dev:
            x = rt.Buffer.from_array(dev, np.arange(8, dtype=np.float32))
            y = rt.Buffer.from_array(dev, np.ones(8, dtype=np.float32))
            d = rt.Dispatch("test_axpy", 1, ["x", "y"], rt.pack_push(8, 2.0), local_size=(64, 1, 1))
            rt.run_dispatches(dev, [d], {"x": x, "y": y})
            assert (y.read(np.float32) == 1 + 2 * np.arange(8)).all()
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "executorch"))
        assert not loaded, loaded
        print("ok")
    """
    result = _run_isolated(script)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stdout + result.stderr
