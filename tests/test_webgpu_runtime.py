"""The WebGPU device layer on a real adapter (lavapipe through wgpu's Vulkan backend here).

References are numpy/float64; the kernels are the WGSL versions of the runtime's test kernels
(vktrain/runtime_shaders/test_axpy.slang, test_grid.slang, test_scale.slang). The Buffer and
Program used are vktrain.runtime's, the same names the Vulkan tests use: the device picks the layer.
"""
from __future__ import annotations

import numpy as np
import pytest

from vktrain.errors import VktrainError
from vktrain.runtime import (
    BindingRangeError,
    Buffer,
    BufferBinding,
    BufferUsageError,
    DeviceMemoryError,
    Dispatch,
    Program,
    ScheduleError,
    ceil_div,
    pack_push,
    run_dispatches,
)

from _helpers import assert_import_loads_none

LOCAL = 64

@pytest.fixture
def gpu(webgpu_device):
    return webgpu_device


@pytest.fixture
def buffers(gpu):
    made: list = []

    def make(data_or_size, **kwargs):
        buffer = Buffer(gpu, data_or_size, **kwargs) if isinstance(data_or_size, int) else \
            Buffer.from_array(gpu, data_or_size, **kwargs)
        made.append(buffer)
        return buffer

    yield make
    for buffer in made:
        buffer.destroy()


def axpy(n: int, alpha: float, x="x", y="y", *, scale: float = 1.0) -> Dispatch:
    return Dispatch("test_axpy", groups=ceil_div(n, LOCAL), bindings=[x, y], push_constants=pack_push(n, alpha),
                    spec_constants={3: scale}, local_size=(LOCAL, 1, 1), label=f"axpy({x}->{y})")


def axpy_reference(alpha: float, x: np.ndarray, y: np.ndarray, scale: float = 1.0) -> np.ndarray:
    return (scale * alpha * x.astype(np.float64) + y.astype(np.float64)).astype(np.float32)


# ------------------------------------------------------------------------------------ memory
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, np.int8, np.uint8, np.int32, np.int64])
def test_upload_download_round_trip(gpu, buffers, dtype):
    from vktrain.runtime.webgpu import Buffer as WebGPUBuffer

    rng = np.random.default_rng(0)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        data = rng.integers(info.min, info.max, size=(3, 37), dtype=dtype, endpoint=True)
    else:
        data = rng.standard_normal((3, 37)).astype(dtype)
    buffer = buffers(data)
    assert isinstance(buffer, WebGPUBuffer)
    np.testing.assert_array_equal(buffer.read(dtype, data.shape), data)


def test_unaligned_writes_keep_the_neighbouring_bytes(gpu, buffers):
    buffer = buffers(np.arange(1, 12, dtype=np.uint8))  # 11 bytes, padded to 12
    assert (buffer.nbytes, buffer.size) == (11, 12)
    buffer.write(np.array([200, 201, 202], np.uint8), offset=3)
    buffer.write(b"\xff", offset=10)
    expected = np.arange(1, 12, dtype=np.uint8)
    expected[3:6] = [200, 201, 202]
    expected[10] = 255
    np.testing.assert_array_equal(buffer.read(np.uint8), expected)
    np.testing.assert_array_equal(buffer.read(np.uint8, 3, offset=5), expected[5:8])


def test_zero_and_access_errors(gpu, buffers):
    buffer = buffers(np.full(10, 7, np.float32), name="sevens")
    buffer.zero()
    np.testing.assert_array_equal(buffer.read(np.float32), np.zeros(10, np.float32))
    with pytest.raises(BufferUsageError, match="'sevens'.*run past"):
        buffer.write(np.zeros(11, np.float32))
    with pytest.raises(BufferUsageError, match="positive"):
        Buffer(gpu, 0)
    buffer.destroy()
    with pytest.raises(BufferUsageError, match="destroyed"):
        buffer.read(np.float32)


def test_buffer_over_max_buffer_size_is_refused_naming_it(gpu):
    too_big = gpu.limits.max_buffer_size + 4
    with pytest.raises(DeviceMemoryError, match="'huge'.*max-buffer-size") as caught:
        Buffer(gpu, too_big, name="huge")
    assert isinstance(caught.value, VktrainError)


# ------------------------------------------------------------------------------------ dispatch
def test_axpy_with_params_and_spec_constants_matches_numpy(gpu, buffers):
    rng = np.random.default_rng(1)
    n = 1000
    x, y = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    bx, by = buffers(x, name="x"), buffers(y, name="y")
    with Program(gpu, [axpy(n, 1.5, scale=-0.25)], {"x": bx, "y": by}) as program:
        program.replay()
        np.testing.assert_allclose(by.read(np.float32), axpy_reference(1.5, x, y, -0.25), rtol=1e-6, atol=1e-6)
        program.replay()  # re-encoded: a command buffer is never submitted twice
    expected = axpy_reference(1.5, x, axpy_reference(1.5, x, y, -0.25), -0.25)
    np.testing.assert_allclose(by.read(np.float32), expected, rtol=1e-6, atol=1e-6)


def test_replays_see_new_inputs_and_refuse_destroyed_buffers(gpu, buffers):
    """Each replay submits the command buffer encoded ahead during the one before: it must still read what
    was written in between, and a buffer destroyed since must stop it."""
    n = 100
    bx, by = buffers(np.ones(n, np.float32)), buffers(np.zeros(n, np.float32), name="y")
    program = Program(gpu, [axpy(n, 1.0, bx, by)])
    program.replay()
    bx.write(np.full(n, 5, np.float32))
    program.replay()
    np.testing.assert_array_equal(by.read(np.float32), np.full(n, 6, np.float32))
    by.destroy()
    with pytest.raises(ScheduleError, match=r"cannot replay: buffers \['y'\] were destroyed"):
        program.replay()
    program.destroy()


def test_dependent_dispatches_see_each_others_writes(gpu, buffers):
    n = 777
    a = np.linspace(-1, 1, n, dtype=np.float32)
    ba, bb, bc = buffers(a, name="a"), buffers(np.zeros(n, np.float32), name="b"), buffers(np.ones(n, np.float32))
    # b += 2a; c += 3b; a += -1c: each reads what the one before wrote.
    dispatches = [axpy(n, 2.0, "a", "b"), axpy(n, 3.0, "b", bc), axpy(n, -1.0, bc, "a")]
    program = Program(gpu, dispatches, {"a": ba, "b": bb})
    assert program.barriers == [False, True, True]  # the plan data the Vulkan layer uses
    program.replay()
    b = 2.0 * a.astype(np.float64)
    c = 1.0 + 3.0 * b
    np.testing.assert_allclose(bb.read(np.float32), b, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(bc.read(np.float32), c, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ba.read(np.float32), a - c, rtol=1e-6, atol=1e-6)
    program.destroy()


def test_bindings_at_offsets_touch_only_their_range(gpu, buffers):
    n = 48  # 192 bytes; bind the second half of each buffer
    x = np.arange(2 * n, dtype=np.float32)
    bx, by = buffers(x), buffers(np.zeros(2 * n, np.float32))
    half = 4 * n
    dispatch = Dispatch("test_axpy", groups=1, bindings=[BufferBinding(bx, half, half), BufferBinding(by, half, half)],
                        push_constants=pack_push(n, 1.0), local_size=(LOCAL, 1, 1))
    run_dispatches(gpu, [dispatch])
    np.testing.assert_array_equal(by.read(np.float32), np.concatenate([np.zeros(n), x[n:]]).astype(np.float32))


@pytest.mark.parametrize("grid,max_group_count", [((5, 3, 2), 2), ((9, 1, 1), (4, 1, 1)), ((3, 4, 5), None)])
def test_split_grids_run_every_invocation_once(gpu, buffers, grid, max_group_count):
    size = tuple(2 * g - 1 for g in grid)  # invocations; the last group of each axis is half out of range
    total = size[0] * size[1] * size[2]
    counts, ids = buffers(np.zeros(total, np.uint32)), buffers(np.zeros(total, np.uint32))
    dispatch = Dispatch("test_grid", groups=grid, bindings=[counts, ids], push_constants=pack_push(*size, 0))
    with Program(gpu, [dispatch], max_group_count=max_group_count) as program:
        expected_chunks = 1
        limit = (max_group_count,) * 3 if isinstance(max_group_count, int) else max_group_count
        if limit is not None:
            for g, m in zip(grid, limit):
                expected_chunks *= ceil_div(g, m)
        assert program.recorded_dispatch_count == expected_chunks
        program.replay()
    np.testing.assert_array_equal(counts.read(np.uint32), np.ones(total, np.uint32))
    np.testing.assert_array_equal(ids.read(np.uint32), np.arange(total, dtype=np.uint32))


def test_shader_without_header_runs_but_is_never_split(gpu, buffers):
    n = 1000
    data = np.arange(n, dtype=np.float32)
    buffer = buffers(data)
    run_dispatches(gpu, [Dispatch("test_scale", groups=3, bindings=[buffer], push_constants=pack_push(n, 0.5, 3))])
    np.testing.assert_array_equal(buffer.read(np.float32), data * 0.5)
    with pytest.raises(ScheduleError, match="test_scale.*cannot be split.*vktrain_group_offset"):
        Program(gpu, [Dispatch("test_scale", groups=9, bindings=[buffer], push_constants=pack_push(n, 0.5, 9))],
                max_group_count=4)


@pytest.mark.parametrize("inside_pass", [True, False], ids=["one-pass", "pass-per-dispatch"])
def test_timings_per_dispatch(gpu, buffers, monkeypatch, inside_pass):
    from vktrain.runtime.webgpu.features import INSIDE_PASS_FEATURE

    if not gpu.timestamps_supported or (inside_pass and INSIDE_PASS_FEATURE not in gpu.features):
        pytest.skip(f"{gpu.name} has no timestamp-query{' inside passes' if inside_pass else ''}")
    if not inside_pass:  # what browser WebGPU offers: timestamps at pass boundaries only
        monkeypatch.setattr(gpu, "features", gpu.features - {INSIDE_PASS_FEATURE})
    n = 4096
    bx, by = buffers(np.ones(n, np.float32)), buffers(np.zeros(n, np.float32))
    with Program(gpu, [axpy(n, 1.0, bx, by), axpy(n, 1.0, bx, by)], timing=True) as program:
        with pytest.raises(ScheduleError, match="before the first replay"):
            program.timings()
        program.replay()
        seconds = program.timings()
        assert len(seconds) == 2 and all(0 < s < 10 for s in seconds)
        assert program.last_encode_s > 0
        program.timing_enabled = False  # one untimed pass from now on
        program.replay()
        assert program.timings() is None
    np.testing.assert_array_equal(by.read(np.float32), np.full(n, 4, np.float32))


@pytest.mark.parametrize("inside_pass", [True, False], ids=["one-pass", "pass-per-dispatch"])
def test_bounded_submits_run_a_dependent_split_chain_like_one_submit(gpu, buffers, monkeypatch, inside_pass):
    # 4 dependent axpys of 16 groups, at most 3 per dispatch (6 chunks each); 5 per submit cuts dispatches
    # mid-way, so a timed dispatch may start in one command buffer and end in the next.
    from vktrain.runtime.webgpu.features import INSIDE_PASS_FEATURE

    timed = gpu.timestamps_supported and (not inside_pass or INSIDE_PASS_FEATURE in gpu.features)
    if not inside_pass:
        monkeypatch.setattr(gpu, "features", gpu.features - {INSIDE_PASS_FEATURE})
    n, alphas = 1000, (3.0, -0.5, 2.0, 0.25)
    rng = np.random.default_rng(5)
    xs, ys = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    results = {}
    for per_submit in (None, 5):
        bx, by = buffers(xs), buffers(ys)
        with Program(gpu, [axpy(n, alpha, bx, by) for alpha in alphas], max_group_count=3, timing=timed,
                     max_dispatches_per_submit=per_submit) as program:
            assert program.recorded_dispatch_count == 24
            expected_submits = 1 if per_submit is None else ceil_div(24, per_submit)
            assert program.submits_per_replay == expected_submits
            program.replay()
            program.replay()
            assert program.submit_count == 2 * expected_submits
            if timed:
                seconds = program.timings()
                assert len(seconds) == len(alphas) and all(0 <= s < 10 for s in seconds) and sum(seconds) > 0
        results[per_submit] = by.read(np.float32)
    reference = ys
    for _ in range(2):
        for alpha in alphas:
            reference = axpy_reference(alpha, xs, reference)
    np.testing.assert_allclose(results[5], reference, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(results[5], results[None])


@pytest.mark.parametrize("inside_pass, capacity, count", [(True, None, 4100), (False, 32, 41)],
                         ids=["one-pass-over-4096", "pass-per-dispatch-small-sets"])
def test_timings_of_more_dispatches_than_one_query_set_holds(gpu, buffers, monkeypatch, inside_pass, capacity, count):
    # WebGPU caps a QuerySet at 4096 queries; a 30-layer step has ~4,600 dispatches. The timestamps go to
    # several sets: at wgpu's own limit in one pass, and with a small forced capacity with a pass per dispatch
    # (2 queries each, 41 dispatches: 3 sets).
    from vktrain.runtime.webgpu import program as program_module
    from vktrain.runtime.webgpu.features import INSIDE_PASS_FEATURE

    if not gpu.timestamps_supported or (inside_pass and INSIDE_PASS_FEATURE not in gpu.features):
        pytest.skip(f"{gpu.name} has no timestamp-query{' inside passes' if inside_pass else ''}")
    if not inside_pass:
        monkeypatch.setattr(gpu, "features", gpu.features - {INSIDE_PASS_FEATURE})
    if capacity is not None:
        monkeypatch.setattr(program_module, "QUERY_SET_CAPACITY", capacity)
    n = 64
    bx, by = buffers(np.ones(n, np.float32)), buffers(np.zeros(n, np.float32))
    with Program(gpu, [axpy(n, 1.0, bx, by) for _ in range(count)], timing=True) as program:
        program.replay()
        seconds = program.timings()
        assert len(seconds) == count and all(0 <= s < 10 for s in seconds) and sum(seconds) > 0
    np.testing.assert_array_equal(by.read(np.float32), np.full(n, count, np.float32))


# ------------------------------------------------------------------------------------ refusals
def test_missing_kernels_are_refused_at_load_naming_every_one(gpu, buffers):
    from vktrain.runtime.webgpu import MissingKernelsError
    from vktrain.runtime_shaders.wgsl import WGSLKernelNotFoundError, wgsl_source

    b = buffers(np.zeros(4, np.float32))
    dispatches = [Dispatch("no_such_kernel", groups=1, bindings=[b]), axpy(4, 1.0, b, b),
                  Dispatch("linear_q4gsw@NOT_A_VARIANT", groups=1)]
    with pytest.raises(MissingKernelsError) as caught:
        Program(gpu, dispatches)
    assert caught.value.shaders == ["linear_q4gsw@NOT_A_VARIANT", "no_such_kernel"]
    assert "no_such_kernel" in str(caught.value) and "linear_q4gsw@NOT_A_VARIANT" in str(caught.value)
    with pytest.raises(WGSLKernelNotFoundError, match="'no_such_kernel'") as lookup:
        wgsl_source("no_such_kernel")
    assert isinstance(lookup.value, VktrainError) and isinstance(caught.value, VktrainError)
    assert "fn main" in wgsl_source("test_axpy")


def test_binding_over_the_storage_binding_limit_is_refused_naming_the_tensor(gpu, buffers):
    limit = gpu.limits.max_storage_buffer_range
    big = buffers(limit + 256, name="lm_head.weight")  # never submitted: refused before any GPU work
    small = buffers(np.zeros(4, np.float32))
    with pytest.raises(BindingRangeError, match="'lm_head.weight'.*max-storage-buffer-binding-size"):
        Program(gpu, [axpy(4, 1.0, big, small)])
    # A range of it within the limit binds.
    ok = Dispatch("test_axpy", groups=1, bindings=[BufferBinding(big, 256, 16), small],
                  push_constants=pack_push(4, 1.0), local_size=(LOCAL, 1, 1))
    Program(gpu, [ok]).destroy()


def test_dispatches_that_do_not_fit_their_kernel_are_refused(gpu, buffers):
    x, y = buffers(np.zeros(64, np.float32), name="x"), buffers(np.zeros(64, np.float32), name="y")
    alignment = gpu.limits.min_storage_buffer_offset_alignment
    cases = [
        (Dispatch("test_axpy", groups=1, bindings=[x], push_constants=pack_push(4, 1.0)), ScheduleError,
         "declares 2 storage buffers but the Dispatch binds 1"),
        (Dispatch("test_axpy", groups=1, bindings=[x, y], push_constants=pack_push(4)), ScheduleError,
         "expects 8 bytes of push constants after the 16-byte group-offset header, the Dispatch gives 4"),
        (Dispatch("test_axpy", groups=1, bindings=[x, y], push_constants=pack_push(4, 1.0), spec_constants={7: 1}),
         ScheduleError, r"no override constant with @id\(7\)"),
        (Dispatch("test_grid", groups=1, bindings=[x, y], push_constants=pack_push(1, 1, 1, 0), local_size=(4, 1, 1)),
         ScheduleError, r"does not take its workgroup size x from override @id\(0\)"),
        (Dispatch("test_axpy", groups=1, bindings=[x, y], push_constants=pack_push(4, 1.0),
                  local_size=(gpu.limits.max_compute_work_group_invocations + 1, 1, 1)),
         ScheduleError, "exceeds the device's max-compute-workgroup-size"),
        (Dispatch("test_axpy", groups=1, bindings=[BufferBinding(x, alignment // 2), y],
                  push_constants=pack_push(4, 1.0)), BindingRangeError, "min-storage-buffer-offset-alignment"),
        (Dispatch("test_axpy", groups=1, bindings=[BufferBinding(x, 0, 512), y], push_constants=pack_push(4, 1.0)),
         BindingRangeError, r"range \[0, 512\) is outside the buffer's 256 bytes"),
        (Dispatch("test_axpy", groups=1, bindings=["nope", y], push_constants=pack_push(4, 1.0)), ScheduleError,
         "names buffer 'nope', which is not in the buffers mapping"),
    ]
    for dispatch, error, message in cases:
        with pytest.raises(error, match=message):
            Program(gpu, [dispatch])


def test_workgroup_memory_and_params_layout_are_read_from_the_wgsl():
    from vktrain.runtime.webgpu.reflect import reflect_wgsl

    source = """
        struct Params { vktrain_group_offset: vec4<u32>, dims: vec3<u32>, scale: f32, extra: vec2<f32>, }
        const TILE = 16u;
        @id(0) override LOCAL_SIZE_X: u32 = 64u;
        @id(4) override FLAG: bool = false;
        var<workgroup> tile: array<f32, TILE * LOCAL_SIZE_X>;
        var<workgroup> partial: array<vec4<f32>, 8>;
        @group(0) @binding(0) var<storage, read> a: array<f32>;
        @group(0) @binding(1) var<storage, read_write> b: array<f32>;
        @group(0) @binding(2) var<uniform> params: Params;
        @compute @workgroup_size(LOCAL_SIZE_X) fn main() {}
    """
    interface = reflect_wgsl("k", source)
    assert [(b.binding, b.readonly) for b in interface.storage] == [(0, True), (1, False)]
    assert interface.has_group_offset_header and interface.spec_types == {0: "uint", 4: "bool"}
    # vec4 @0, vec3 @16 (12 bytes), f32 @28, vec2 @32 (8 bytes): the GLSL std430 block is 40 bytes.
    assert interface.params_bytes == 40 and interface.params_struct_bytes == 48
    assert interface.workgroup_memory_bytes({0: 128}) == 4 * 16 * 128 + 16 * 8
    with pytest.raises(ScheduleError, match="params block 'params' is at binding 3"):
        reflect_wgsl("k", source.replace("@binding(2) var<uniform>", "@binding(3) var<uniform>"))
    with pytest.raises(ScheduleError, match="storage bindings \\[0, 2\\]"):
        reflect_wgsl("k", source.replace("@binding(1) var<storage", "@binding(2) var<storage")
                     .replace("@binding(2) var<uniform>", "@binding(3) var<uniform>"))


# ------------------------------------------------------------------------------------ device
def test_device_reports_gpu_tuning_and_fp16_tc_takes_f16_wgsl_not_tensor_cores(gpu, monkeypatch):
    from vktrain.backend.kernel_planning.kernels.coopmat import PRECISION_FP16_TC, PRECISION_FP32, select_gemm_route
    from vktrain.backend.kernel_planning.kernels.gemm_tuning import TUNING_ENV, GemmTuningError, select_gemm_tuning

    monkeypatch.delenv(TUNING_ENV, raising=False)
    assert select_gemm_tuning(gpu) == "gpu"  # even on lavapipe, a CPU adapter
    with pytest.raises(GemmTuningError, match="cannot run the CPU bodies"):
        select_gemm_tuning(gpu, {TUNING_ENV: "cpu"})
    route = select_gemm_route(PRECISION_FP16_TC, (PRECISION_FP32, PRECISION_FP16_TC), gpu)
    # WebGPU has no cooperative matrices: fp16-tc runs the f16 WGSL kernels where the device has shader-f16.
    if "shader-f16" in gpu.kernel_features:
        assert route.tensor_cores and route.wgsl and route.fp16_kernels == "f16 WGSL kernels"
    else:
        assert not route.tensor_cores


def test_vulkan_path_does_not_import_wgpu():
    assert_import_loads_none(["vktrain.runtime", "vktrain.runtime.delegate.executor", "vktrain.runtime.program.runner",
                              "vktrain.runtime.runtimes", "vktrain.train.command"], ["wgpu", "torch"])


def test_adapter_choice_and_limits_are_refused_with_reasons(gpu, monkeypatch):
    from vktrain.runtime import DeviceSelectionError
    from vktrain.runtime.webgpu import Device, WebGPUUnavailableError
    from vktrain.runtime.webgpu import device as device_module

    with pytest.raises(DeviceSelectionError, match="'no such adapter' matches no device name; available devices: "
                                                   r"\[0\]"):
        Device("no such adapter")
    monkeypatch.setitem(device_module._REQUIRED_LIMITS, "max-storage-buffers-per-shader-stage", 10**6)
    with pytest.raises(WebGPUUnavailableError, match=r"below vktrain's minimum: max-storage-buffers-per-shader-stage "
                                                     r"= \d+ \(vktrain needs 1000000\)"):
        Device()
