"""DeviceProfile (vktrain/serialization/device_profile.py): the record kernel planning reads of a device, its
JSON files, the profile of the local device (vktrain/runtime/device_profiles.py), the planner constants
read from it, and `vktrain devices`."""
from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest

from vktrain.cli import main
from vktrain.contract import PRECISION_FP16_TC, PRECISION_FP32, PRECISIONS
from vktrain.backend.kernel_planning.kernels.coopmat import GemmRoute, select_gemm_route
from vktrain.backend.kernel_planning.kernels.coopmat_tiling import (MIN_WORKGROUPS, SPLIT_TARGET_WORKGROUPS, default_split_k,
                                                             default_tiling)
from vktrain.backend.kernel_planning.lowering_context import OpContext
from vktrain.runtime.vk.coopmat import CooperativeMatrixShape
from vktrain.serialization.device_profile import (BUILTIN_PROFILES, LAVAPIPE, NVIDIA_COOPMAT, DeviceProfile,
                                                  DeviceProfileError, builtin_profile, load_profile,
                                                  subgroup_operation_names)
from _helpers import planned

TENSOR_CORES = CooperativeMatrixShape(16, 16, 16, "float16", "float16", "float32", "float32", False, "subgroup")


def _device(properties=(TENSOR_CORES,)):
    """What select_gemm_route reads of a vktrain Device."""
    return SimpleNamespace(name="test-gpu", cooperative_matrix_properties=tuple(properties),
                           features=frozenset({"shaderFloat16"}), subgroup_operations=0x1, subgroup_size=32)


# ---------------------------------------------------------------------------------------------- the record
@pytest.mark.parametrize("name", sorted(BUILTIN_PROFILES))
def test_every_builtin_profile_round_trips_through_json(name, tmp_path):
    profile = builtin_profile(name)
    assert profile.source  # each says where its numbers come from
    path = tmp_path / f"{name}.json"
    path.write_text(profile.to_json())
    assert load_profile(path) == profile
    assert json.loads(path.read_text())["name"] == name


def test_the_h200_profile_carries_what_the_device_notes_record():
    p = NVIDIA_COOPMAT
    assert (p.api, p.device_type, p.subgroup_size, p.max_shared_memory_bytes) == ("vulkan", "discrete", 32, 48 * 1024)
    assert p.max_workgroup_count == (2**31 - 1, 65535, 65535)
    listed = {(s.m, s.n, s.k, s.a_type, s.c_type) for s in p.cooperative_matrix}
    assert {(16, 16, 16, "float16", "float32"), (16, 16, 16, "bfloat16", "float32"), (16, 8, 8, "float16", "float16"),
            (16, 16, 32, "int8", "int32")} <= listed
    assert (p.min_workgroups, p.split_k_target_workgroups) == (MIN_WORKGROUPS, SPLIT_TARGET_WORKGROUPS) == (128, 512)


def _write(tmp_path, data) -> str:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(shared_memory=32768), r"unknown field\(s\) shared_memory"),
    (lambda d: d.pop("max_storage_buffer_range"), r"missing field\(s\) max_storage_buffer_range"),
    (lambda d: d.update(subgroup_size="eight"), r"subgroup_size must be an integer >= 0, got 'eight'"),
    (lambda d: d.update(subgroup_size=12), r"subgroup_size must be a power of two"),
    (lambda d: d.update(max_dispatches_per_submit=-1), r"max_dispatches_per_submit must be an integer >= 0, got -1"),
    (lambda d: d.update(memory_budget_bytes=-1), r"memory_budget_bytes must be an integer >= 0, got -1"),
    (lambda d: d.update(memory_budget_bytes=1.5e9), r"memory_budget_bytes must be an integer >= 0, got 1500000000.0"),
    (lambda d: d.update(api="metal"), r"api must be one of vulkan, webgpu, got 'metal'"),
    (lambda d: d.update(float16=1), r"float16 must be true or false, got 1"),
    (lambda d: d.update(subgroup_operations=["basic", "rotate"]), r"subgroup_operations must be a list of distinct"),
    (lambda d: d.update(max_workgroup_size=[64, 64]), r"max_workgroup_size must be 3 integers"),
    (lambda d: d["cooperative_matrix"][0].update(a_type="float8"), r"cooperative_matrix\[0\] has an invalid a_type"),
    (lambda d: d["cooperative_matrix"][0].pop("scope"), r"cooperative_matrix\[0\] must have exactly the fields"),
])
def test_a_bad_profile_file_is_refused_naming_the_file_and_the_field(tmp_path, change, message):
    data = NVIDIA_COOPMAT.to_dict()
    change(data)
    path = _write(tmp_path, data)
    with pytest.raises(DeviceProfileError, match=rf"device profile {path}: .*{message}"):
        load_profile(path)


def test_a_profile_file_from_before_bounded_submits_loads_unbounded(tmp_path):
    # Files written before max_dispatches_per_submit existed lack it: they load, with one submit per step.
    phone = BUILTIN_PROFILES["adreno-6xx"]
    assert phone.max_dispatches_per_submit == 256
    data = phone.to_dict()
    del data["max_dispatches_per_submit"]
    assert load_profile(_write(tmp_path, data)) == dataclasses.replace(phone, max_dispatches_per_submit=0)
    assert load_profile(_write(tmp_path, phone.to_dict())) == phone


def test_a_profile_file_from_before_memory_budgets_loads_without_a_budget(tmp_path):
    # The phone classes carry a 4 GB phone's budget; a file without the field (older) has none: 0.
    phone = BUILTIN_PROFILES["mali-g7xx"]
    assert phone.memory_budget_bytes == 1 << 30
    assert all(BUILTIN_PROFILES[name].memory_budget_bytes == 0 for name in ("lavapipe", "nvidia-coopmat", "desktop-gpu"))
    data = phone.to_dict()
    assert data["memory_budget_bytes"] == 1 << 30
    del data["memory_budget_bytes"], data["max_dispatches_per_submit"]
    assert load_profile(_write(tmp_path, data)) == dataclasses.replace(phone, memory_budget_bytes=0,
                                                                      max_dispatches_per_submit=0)
    budget = dataclasses.replace(phone, name="small", memory_budget_bytes=12345)
    assert load_profile(_write(tmp_path, budget.to_dict())) == budget


def test_a_profile_file_that_is_no_json_object_is_refused(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text("{not json")
    with pytest.raises(DeviceProfileError, match=rf"device profile {path} is not valid JSON"):
        load_profile(path)
    with pytest.raises(DeviceProfileError, match=r"expected a JSON object with the fields name, api"):
        load_profile(_write(tmp_path, [1, 2]))
    with pytest.raises(DeviceProfileError, match=r"no built-in device profile 'h100'; built-in: lavapipe, "):
        builtin_profile("h100")


def test_subgroup_flags_name_the_vulkan_bits():
    assert subgroup_operation_names(0xBF) == ("basic", "vote", "arithmetic", "ballot", "shuffle", "shuffle_relative",
                                              "quad")
    assert subgroup_operation_names(0) == ()


# ------------------------------------------------------------------------------- what the planner reads
def test_the_gemm_route_takes_its_gate_and_split_targets_from_the_profile():
    device = _device()
    plain = select_gemm_route(PRECISION_FP16_TC, PRECISIONS, device)
    # The H200's numbers are the defaults: planning with its profile (or lavapipe's) changes nothing.
    assert select_gemm_route(PRECISION_FP16_TC, PRECISIONS, device, profile=NVIDIA_COOPMAT) == plain
    assert select_gemm_route(PRECISION_FP16_TC, PRECISIONS, device, profile=LAVAPIPE) == plain
    # 128 tokens x N = 2048 over K = 8192: 16 size tiles, so the gate alone keeps it off the tensor cores; a
    # split to 512 workgroups (8 slices of the 64 x 64 tiling's 64 tiles) takes it there.
    tiling = default_tiling("coopmat_mm", 128, 2048, 8192, emulate=False)
    assert plain.default_split_k("coopmat_mm", 128, 2048, 8192) == default_split_k(tiling, 128, 2048, 8192) == 8
    assert plain.takes_tensor_cores(128, 2048, 8192)
    smaller = dataclasses.replace(NVIDIA_COOPMAT, name="half-split", split_k_target_workgroups=256)
    route = select_gemm_route(PRECISION_FP16_TC, PRECISIONS, device, profile=smaller)
    assert route.split_target_workgroups == 256 and route.default_split_k("coopmat_mm", 128, 2048, 8192) == 4
    # A gate above what the split reaches keeps the GEMM on the fp32 kernels.
    strict = dataclasses.replace(NVIDIA_COOPMAT, name="strict", min_workgroups=1024)
    route = select_gemm_route(PRECISION_FP16_TC, PRECISIONS, device, profile=strict)
    assert route.min_workgroups == route.split_min_workgroups == 1024
    assert not route.takes_tensor_cores(128, 2048, 8192) and route.takes_tensor_cores(4096, 8192, 2048)
    # The emulated test path keeps its gate of 1 (every GEMM) and splits as the device would.
    emulated = select_gemm_route(PRECISION_FP16_TC, PRECISIONS, device, emulate=True, profile=smaller)
    assert emulated.min_workgroups == 1 and emulated.split_target_workgroups == 256
    assert select_gemm_route(PRECISION_FP32, PRECISIONS, device, profile=smaller).split_target_workgroups == 256


@pytest.mark.parametrize("emulate", [False, True])
def test_with_the_h200_numbers_the_routes_split_is_the_one_the_plans_choose_themselves(emulate):
    """The lowering passes the route's split (from the profile) to the coopmat plans: with the H200's numbers,
    the profiles' today, that is the split each plan picks by itself from its scratch, dispatch for dispatch."""
    from vktrain.backend.kernel_planning.kernels.coopmat import (plan_coopmat_linear_q4gsw,
                                                          plan_coopmat_linear_q4gsw_backward, plan_coopmat_mm)
    from vktrain.backend.kernel_planning.kernels.coopmat_tiling import split_k_scratch_nbytes

    route = select_gemm_route(PRECISION_FP16_TC, PRECISIONS, _device(), emulate=emulate, profile=LAVAPIPE)
    common = dict(emulate=emulate, scratch="scratch", out="out")
    shapes = [(128, 2048, 2048), (128, 512, 8192), (64, 64, 4000), (2048, 2048, 2048), (128, 2048, 256)]
    if emulate:  # lavapipe's loop budget (coopmat_tiling.EMULATED_LOOP_BUDGET) caps the emulated reductions
        shapes = [(M, N, min(K, 1024)) for M, N, K in shapes]
    for M, N, K in shapes:
        cases = [("coopmat_mm", (M, N, K), plan_coopmat_mm, dict(M=M, N=N, K=K, a="a", b="b", absmax="m")),
                 ("coopmat_linear_q4gsw", (M, N, K), plan_coopmat_linear_q4gsw,
                  dict(M=M, N=N, K=K, group_size=32, x="x", weights="w", scales="s")),
                 ("coopmat_linear_q4gsw_backward", (M, K, N), plan_coopmat_linear_q4gsw_backward,
                  dict(M=M, N=N, K=K, group_size=32, d_out="d", weights="w", scales="s", absmax="m"))]
        for kernel, dims, plan, args in cases:
            split = route.default_split_k(kernel, *dims)
            assert 4 * split * dims[0] * dims[1] == (split_k_scratch_nbytes(kernel, *dims, emulate=emulate)
                                                      or 4 * dims[0] * dims[1]), (kernel, dims)
            assert plan(**args, **common, split_k=split) == plan(**args, **common), (kernel, dims)


def test_an_op_context_reads_shared_memory_and_workgroup_size_from_the_profile():
    limits = SimpleNamespace(max_compute_shared_memory_size=65536, max_compute_work_group_invocations=2048,
                             max_compute_work_group_size=(2048, 1, 1))
    context = OpContext(0, None, [], [], "0:op", None, limits)
    assert (context.shared_memory_bytes, context.max_workgroup_size) == (65536, 2048)
    phone = builtin_profile("adreno-6xx")
    context = OpContext(0, None, [], [], "0:op", None, limits, GemmRoute(PRECISION_FP32, False, "test"), None, phone)
    assert (context.shared_memory_bytes, context.max_workgroup_size) == (16384, 128)


# ------------------------------------------------------------------------------------- the local device
@pytest.fixture(scope="module")
def local_profile(vk_device):
    from vktrain.runtime.device_profiles import profile_of

    return profile_of(vk_device)


def test_the_local_lavapipe_device_has_the_builtin_lavapipe_profile(local_profile):
    if not local_profile.name.startswith("llvmpipe"):
        pytest.skip(f"the local device is {local_profile.name}, not lavapipe")
    assert local_profile.planning_fields() == LAVAPIPE.planning_fields()
    assert local_profile.source.startswith("queried: llvmpipe")


def test_the_executor_plans_with_the_devices_profile(vk_device, local_profile):
    from vktrain.backend.passes import compile_graph
    from vktrain.runtime.delegate.executor import GraphExecutor
    from vktrain.serialization import graph as vk

    graph = vk.VkGraph()
    x = graph.add_value(vk.TensorValue(vk.DType.FLOAT32, (4,), name="x"))
    y = graph.add_value(vk.TensorValue(vk.DType.FLOAT32, (4,), name="y"))
    graph.inputs, graph.ops, graph.outputs = [x], [vk.OpCall("aten.relu.default", (x,), (y,))], [y]
    compile_graph(graph)
    with GraphExecutor(vk_device, graph, planned(vk_device, graph), timing=False) as executor:
        assert executor.profile == local_profile
        route = executor.gemm_route
        assert (route.split_min_workgroups, route.split_target_workgroups) == (
            local_profile.min_workgroups, local_profile.split_k_target_workgroups)


def test_vktrain_devices_prints_the_local_profile_and_the_builtins(capsys, tmp_path, local_profile):
    assert main(["devices", "--json"]) == 0
    listed = [DeviceProfile.from_dict(item) for item in json.loads(capsys.readouterr().out)]
    assert local_profile in listed
    assert main(["devices"]) == 0
    out = capsys.readouterr().out
    assert local_profile.name in out and "built-in profile with the same planning fields:" in out
    assert main(["devices", "--builtin", "--json"]) == 0
    assert [DeviceProfile.from_dict(item) for item in json.loads(capsys.readouterr().out)] == list(
        BUILTIN_PROFILES.values())
    bad = NVIDIA_COOPMAT.to_dict()
    bad["max_shared_memory"] = bad.pop("max_shared_memory_bytes")
    path = _write(tmp_path, bad)
    assert main(["devices", "--profile", path]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"vktrain devices: error: device profile {path}: unknown field(s) max_shared_memory; "
                          f"missing field(s) max_shared_memory_bytes"), err
