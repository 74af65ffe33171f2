"""The q4gsw tensor-core kernels' rank epilogue (RANK_EPILOGUE, kernels/coopmat.py RankEpilogue): a LoRA
linear's up-product added in the base GEMM's epilogue, C = base + hs @ Bt, in one dispatch.

On lavapipe the coopmat kernels run emulated (COOPMAT_EMULATE: the cooperative-matrix operations done by plain
arithmetic; every other line of the body, the shared edge block and the epilogue included, is the tensor-core
kernel's). Each fused output must be
  * the bits of the unfused pair, the base kernel writing `base` and matmul.slang's addmm(base, hs, Bt) (beta =
    alpha = 1), run here in both of its bodies: the GPU tuning's shared-memory body (s + h * b: RANK_FMA off) and
    the CPU tuning's register tiles (fma: RANK_FMA on), for a rank that is a multiple of 16 and one that is not
    (matmul's zero steps past r), for the forward (Bt a transposed view of B [N, r]) and the input gradient (Bt
    = A [r, K] row-major, added after the base's unscaling);
  * within the derived bound of the float64 result: the base GEMM's fp16-input bound (tests/test_kernels_coopmat.py)
    plus the fp32 rank sum's, gamma_(r+1) * sum_k |h_k b_k| with gamma_n = n 2^-24 / (1 - n 2^-24), plus one
    rounding of the total (2^-24 |y|). Every output starts as NaN, so one no lane writes fails.
"""
from __future__ import annotations

import numpy as np
import pytest

from vktrain.backend.kernel_planning.kernels.coopmat import (RankEpilogue, SUBGROUP_BASIC_BIT,
                                                             plan_coopmat_linear_q4gsw,
                                                             plan_coopmat_linear_q4gsw_backward)
from vktrain.backend.kernel_planning.kernels.coopmat_tiling import (DEFAULT_TILINGS, RANK_TILINGS, TILING_BY_NAME,
                                                                    CoopmatTiling, emulated_loop_trips)
from vktrain.backend.kernel_planning.kernels.gemm_passes import ABSMAX_MAX_PARTIALS
from vktrain.backend.kernel_planning.kernels.gemm_tuning import CPU_TUNING, GPU_TUNING
from vktrain.backend.kernel_planning.kernels.linear import prepack_weights
from vktrain.backend.kernel_planning.kernels.matmul import plan_gemm
from vktrain.quant import dequantize, quantize
from vktrain.runtime import Buffer, Program
from vktrain.runtime_shaders.build import all_shader_names
from vktrain.serialization.strided_view import KernelArgumentError, StridedView

U32 = 2.0 ** -24
FP16_U = 2.0 ** -11
GROUP = 32
# Partial tiles in M and N (64-row tiles), two K steps, subgroups of 8 lanes: 2 columns per lane.
M, N_FWD, K_FWD = 70, 132, 64


# The emulated route's 64-row tiles, and the GPU default tilings that fit lavapipe's 32 KiB (the forward's at
# fewer than 256 128 x 128 tiles, the input gradient's above): their subgroup tiles and edges differ.
FORWARD_TILINGS = [CoopmatTiling(tile_m=64), TILING_BY_NAME["bm64+bn64+bk64"]]
BACKWARD_TILINGS = [CoopmatTiling(tile_m=64), TILING_BY_NAME["bm128"]]


def _emulated(device, tiling=FORWARD_TILINGS[0]) -> dict:
    if "shaderFloat16" not in device.features or not device.subgroup_operations & SUBGROUP_BASIC_BIT:
        pytest.skip(f"{device.name} lacks shaderFloat16 or basic subgroup operations in compute shaders")
    if device.subgroup_size < 8:
        pytest.skip(f"{device.name} has subgroups of {device.subgroup_size} lanes; the emulated coopmat kernels "
                    f"need 8 or more (LP_NATIVE_VECTOR_WIDTH=128 gives 4)")
    return dict(emulate=True, subgroup_size=device.subgroup_size, tiling=tiling)


def _run(device, dispatches, inputs: dict, outputs: dict) -> dict:
    """Run `dispatches` over buffers made of `inputs` (arrays) and `outputs` (shapes, filled with NaN)."""
    inputs = {"absmax": np.full(2 * ABSMAX_MAX_PARTIALS, 0x7F7F7F7F, np.uint32), **inputs}
    buffers = {key: Buffer.from_array(device, np.ascontiguousarray(a), name=key) for key, a in inputs.items()}
    for key, shape in outputs.items():
        buffers[key] = Buffer.from_array(device, np.full(shape, np.nan, np.float32), name=key)
    try:
        with Program(device, dispatches, buffers) as program:
            program.replay()
        return {key: buffers[key].read(np.float32, shape) for key, shape in outputs.items()}
    finally:
        for buffer in buffers.values():
            buffer.destroy()


def _addmm(tuning: str, out: str, rows: int, cols: int, r: int, bt_view: StridedView) -> list:
    """matmul.slang's addmm(base, hs, Bt) into `out`, as the planner plans it on `tuning`."""
    return plan_gemm(out, "hs", StridedView.contiguous((rows, r)), "bt", bt_view, bias="base",
                     bias_view=StridedView.contiguous((rows, cols)), tuning=tuning, label="addmm")


def _assert_bound(actual, base64, rank64, magnitude_base, absolute_base, h64, b64, label):
    """|y - y64| within the base's fp16 bound plus the fp32 rank sum's and the final rounding (module docstring)."""
    r = h64.shape[1]
    gamma = (r + 1) * U32 / (1 - (r + 1) * U32)
    expected = base64 + rank64
    bound = magnitude_base + absolute_base + gamma * (np.abs(h64) @ np.abs(b64)) + U32 * np.abs(expected)
    error = np.abs(actual - expected)
    assert np.isfinite(actual).all(), f"{label}: outputs not written"
    assert (error <= bound).all(), f"{label}: {np.count_nonzero(error > bound)} outputs outside the bound"


def _base_bound(a64, b64, K):
    relative = 2 * FP16_U + FP16_U ** 2 + U32 + (K + 16) * 2.0 ** -23
    magnitude = relative * (np.abs(a64) @ np.abs(b64))
    absolute = 2.0 ** -25 * (np.abs(a64).sum(1, keepdims=True) + np.abs(b64).sum(0, keepdims=True))
    return magnitude, absolute


@pytest.mark.parametrize("tuning, r, tiling", [(GPU_TUNING, 16, FORWARD_TILINGS[0]), (CPU_TUNING, 16, FORWARD_TILINGS[0]),
                                              (GPU_TUNING, 8, FORWARD_TILINGS[0]), (CPU_TUNING, 8, FORWARD_TILINGS[0]),
                                              (GPU_TUNING, 16, FORWARD_TILINGS[1])],
                         ids=["gpu-r16", "cpu-r16", "gpu-r8", "cpu-r8", "gpu-r16-bm64+bn64+bk64"])
def test_forward_rank_epilogue_is_the_unfused_pair_bit_for_bit(vk_device, tuning, r, tiling):
    backend = _emulated(vk_device, tiling)
    rng = np.random.default_rng(r)
    flat, scales = quantize(rng.standard_normal((N_FWD, K_FWD)).astype(np.float32), GROUP)
    x = rng.standard_normal((M, K_FWD)).astype(np.float32)
    hs = rng.standard_normal((M, r)).astype(np.float32)
    lora_b = rng.standard_normal((N_FWD, r)).astype(np.float32)  # B [N, r]; the product reads B^T in place
    hs[3] = 0.0
    hs[5] = -0.0  # rows of zero products: the sign of a zero sum is part of the bits
    bt_view = StridedView.contiguous((N_FWD, r)).transpose(0, 1)
    inputs = {"x": x, "w": prepack_weights(flat, K_FWD), "s": scales, "hs": hs, "bt": lora_b}
    base_plan = plan_coopmat_linear_q4gsw(M=M, N=N_FWD, K=K_FWD, group_size=GROUP, out="base", x="x", weights="w",
                                          scales="s", **backend)
    unfused = _run(vk_device, base_plan + _addmm(tuning, "y", M, N_FWD, r, bt_view), inputs,
                   {"base": (M, N_FWD), "y": (M, N_FWD)})
    (matmul_dispatch,) = _addmm(tuning, "y", M, N_FWD, r, bt_view)
    rank = RankEpilogue("hs", StridedView.contiguous((M, r)), "bt", bt_view,
                        fma="CPU_REGISTER_TILES" in matmul_dispatch.shader)
    fused_plan = plan_coopmat_linear_q4gsw(M=M, N=N_FWD, K=K_FWD, group_size=GROUP, out="y", x="x", weights="w",
                                           scales="s", rank_epilogue=rank, **backend)
    assert len(fused_plan) == 1 and "RANK_EPILOGUE" in fused_plan[0].shader
    fused = _run(vk_device, fused_plan, inputs, {"y": (M, N_FWD)})["y"]
    np.testing.assert_array_equal(fused.view(np.uint32), unfused["y"].view(np.uint32))
    deq = dequantize(flat, scales, GROUP).astype(np.float64).T
    x64, h64, b64 = x.astype(np.float64), hs.astype(np.float64), lora_b.T.astype(np.float64)
    _assert_bound(fused.astype(np.float64), x64 @ deq, h64 @ b64, *_base_bound(x64, deq, K_FWD), h64, b64,
                  f"forward r={r} {tuning}")


@pytest.mark.parametrize("tuning, tiling", [(GPU_TUNING, BACKWARD_TILINGS[0]), (CPU_TUNING, BACKWARD_TILINGS[0]),
                                           (GPU_TUNING, BACKWARD_TILINGS[1])], ids=["gpu", "cpu", "gpu-bm128"])
def test_input_gradient_rank_epilogue_is_the_unfused_pair_bit_for_bit(vk_device, tuning, tiling):
    """d_x[M, K] = d_out[M, N] @ deq(W) + d_hs @ A, A [r, K] row-major; d_out tiny (scaled by 2^e before its
    fp16 rounding and the base unscaled before the rank term is added)."""
    backend = _emulated(vk_device, tiling)
    rng = np.random.default_rng(7)
    n, k, r = 96, 160, 16  # the GEMM's reduction n, its output columns k
    flat, scales = quantize(rng.standard_normal((n, k)).astype(np.float32), GROUP)
    d_out = (rng.standard_normal((M, n)) * 1e-6).astype(np.float32)
    d_hs = (rng.standard_normal((M, r)) * 1e-6).astype(np.float32)
    lora_a = rng.standard_normal((r, k)).astype(np.float32)
    bt_view = StridedView.contiguous((r, k))
    inputs = {"d_out": d_out, "w": prepack_weights(flat, k), "s": scales, "hs": d_hs, "bt": lora_a}
    common = dict(M=M, N=n, K=k, group_size=GROUP, d_out="d_out", weights="w", scales="s", absmax="absmax", **backend)
    base_plan = plan_coopmat_linear_q4gsw_backward(out="base", **common)
    unfused = _run(vk_device, base_plan + _addmm(tuning, "dx", M, k, r, bt_view), inputs,
                   {"base": (M, k), "dx": (M, k)})
    (matmul_dispatch,) = _addmm(tuning, "dx", M, k, r, bt_view)
    rank = RankEpilogue("hs", StridedView.contiguous((M, r)), "bt", bt_view,
                        fma="CPU_REGISTER_TILES" in matmul_dispatch.shader)
    fused_plan = plan_coopmat_linear_q4gsw_backward(out="dx", rank_epilogue=rank, **common)
    assert [d.shader.split("@")[0] for d in fused_plan] == ["coopmat_absmax", "coopmat_linear_q4gsw_backward"]
    fused = _run(vk_device, fused_plan, inputs, {"dx": (M, k)})["dx"]
    np.testing.assert_array_equal(fused.view(np.uint32), unfused["dx"].view(np.uint32))
    scale = 2.0 ** -int(np.floor(np.log2(np.abs(d_out).max())) - 14)  # the kernel's 2^e (max in [2^14, 2^15))
    deq = dequantize(flat, scales, GROUP).astype(np.float64)
    d64, h64, b64 = d_out.astype(np.float64), d_hs.astype(np.float64), lora_a.astype(np.float64)
    magnitude, absolute = _base_bound(d64 * scale, deq, n)
    _assert_bound(fused.astype(np.float64), d64 @ deq, h64 @ b64, magnitude / scale, absolute / scale, h64, b64,
                  f"input gradient {tuning}")


@pytest.mark.parametrize("hs_view, bt_shape, match", [
    (StridedView.contiguous((M, 6)), (6, N_FWD), "vec4 rows"),
    (StridedView.contiguous((M, 16), offset=2), (16, N_FWD), "vec4 rows"),
    (StridedView.contiguous((16, M)).transpose(0, 1), (16, N_FWD), "vec4 rows"),
    (StridedView.contiguous((M, 16)), (8, N_FWD), r"not \[70, r\] and \[r, 132\]"),
])
def test_rank_epilogue_refuses_operands_the_kernel_cannot_read(hs_view, bt_shape, match):
    rank = RankEpilogue("hs", hs_view, "bt", StridedView.contiguous(bt_shape))
    with pytest.raises(KernelArgumentError, match=match):
        plan_coopmat_linear_q4gsw(M=M, N=N_FWD, K=K_FWD, group_size=GROUP, out="y", x="x", weights="w", scales="s",
                                  rank_epilogue=rank)


def test_rank_epilogue_is_unsplit_and_counts_its_loop_trips():
    rank = RankEpilogue("hs", StridedView.contiguous((512, 16)), "bt", StridedView.contiguous((16, 2048)))
    with pytest.raises(KernelArgumentError, match="unsplit"):
        plan_coopmat_linear_q4gsw(M=512, N=2048, K=2048, group_size=32, out="y", x="x", weights="w", scales="s",
                                  split_k=2, scratch="scratch", rank_epilogue=rank)
    (gemm,) = plan_coopmat_linear_q4gsw(M=512, N=2048, K=8192, group_size=32, out="y", x="x", weights="w",
                                        scales="s", scratch="scratch", rank_epilogue=rank)
    assert gemm.groups[2] == 1 and [b.buffer for b in gemm.bindings] == ["y", "x", "w", "s", "hs", "bt"]
    tiling = CoopmatTiling(tile_m=64)
    # Per accumulator: r / 4 trips for each of the 16 / 8 columns a lane of 8 owns.
    assert emulated_loop_trips(tiling, 64, 8, rank=16) - emulated_loop_trips(tiling, 64, 8, rank=0) == \
        tiling.fragments * (2 * 4 - 256 // 8)


def test_the_default_tilings_rank_variants_are_prebuilt():
    """What the planner fuses on a GPU (no shader compiler there) must be in the shaders' variant lines."""
    built = set(all_shader_names())
    assert {name for *_, name in DEFAULT_TILINGS["coopmat_linear_q4gsw"]} <= set(RANK_TILINGS["coopmat_linear_q4gsw"])
    for kernel, names in RANK_TILINGS.items():
        for name in names:
            tiling = TILING_BY_NAME[name]
            defines = ["A_SCALE"] if kernel.endswith("backward") else []
            variant = f"{kernel}@" + "+".join(defines + tiling.defines + ["RANK_EPILOGUE"])
            assert variant in built, variant


def test_the_gpu_check_smoke_run_finds_the_fused_pairs_bit_identical(tmp_path, vk_device):
    """scripts/bench_rank_epilogue.py (the GPU check of this kernel) at lavapipe sizes: it runs without torch
    (numpy and the vulkan binding only), fuses both directions of each site and finds them bit-identical."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    _emulated(vk_device)
    script = Path(__file__).resolve().parent.parent / "scripts" / "bench_rank_epilogue.py"
    out = tmp_path / "rank_epilogue.json"
    code = (f"import runpy, sys; sys.argv = [{str(script)!r}, '--emulate', '--tokens', '64', '--sites', '256:128', "
            f"'--replays', '1', '--warmup', '0', '--out', {str(out)!r}]\n"
            "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\nexcept SystemExit as exit:\n"
            "    assert not exit.code, exit.code\nassert 'torch' not in sys.modules, 'the GPU script imported torch'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [r["direction"] for r in data["results"]] == ["forward", "backward"]
    for record in data["results"]:
        assert record["fused"] and record["bit_identical"] and record["rel_err"] < 1e-2, record
        assert len(record["fused_shaders"]) == len(record["base_shaders"]) and "RANK_EPILOGUE" in record["fused_shaders"][-1]
    assert data["totals"]["all_bit_identical"] and data["totals"]["fused_pairs_per_step"] == 2 * 16
