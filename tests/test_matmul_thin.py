"""matmul_thin.slang (kernels/matmul_thin.py): the thin fp32 GEMMs (an output side of at most 16 over a long
reduction: the LoRA products), both layouts of the large operand X, against float64 numpy.

Bound: each output is a sum of the K fp32 products a_k b_k in a fixed order (each thread's k in order, the
threads' partials, the split-K slices), every product rounded at most once and every term through at most
K - 1 additions, so |got - sum a_k b_k| <= gamma_K * sum_k |a_k b_k| with gamma_K = K u / (1 - K u), u = 2^-24
(Higham, Accuracy and Stability, 3.1), checked per element. With an addend d (aten.addmm, beta = alpha = 1)
the output is fl(sum + d): the mm's bits plus one fp32 add, checked bit for bit against the mm followed by
the add.
"""
from __future__ import annotations

import numpy as np
import pytest

from vktrain.runtime import Buffer, run_dispatches
from vktrain.backend.kernel_planning.kernels import matmul_thin
from vktrain.backend.kernel_planning.kernels.gemm_tuning import CPU_TUNING
from vktrain.backend.kernel_planning.kernels.matmul import gemm_scratch_nbytes, plan_gemm
from vktrain.backend.kernel_planning.kernels.matmul_thin import (CHUNK, COLUMNS, MAX_CHUNKS, ROWS, plan_thin_gemm,
                                                                 thin_layout)
from vktrain.serialization.strided_view import KernelArgumentError, StridedView

U = 2.0 ** -24


def _gamma(n: int) -> float:
    return n * U / (1 - n * U)


# (name, M, K, N, A stored transposed, B stored transposed, layout): the step's four LoRA products scaled down,
# at edges: P not a multiple of a workgroup's 32 rows / 64 columns, R < 16, K not a multiple of the chunk
# (and odd where X's rows run along K: COLUMNS reads vec4 along P), the thin side M (out^T).
CASES = [
    ("x_at", 70, 256, 16, False, True, ROWS),        # x [T, K] @ A^T: A stored [r, K]
    ("dy_b", 100, 388, 12, False, False, ROWS),      # d_y [T, N] @ B [N, r]
    ("d_b", 200, 301, 16, True, False, COLUMNS),     # d_y^T [N, T] @ u [T, r]: d_y stored [T, N]
    ("d_a", 16, 300, 72, True, False, COLUMNS),      # d_u^T [r, T] @ x [T, K]: out^T, d_u stored [T, r]
    ("a_x_t", 5, 520, 36, False, True, ROWS),        # [r, K] @ X^T with X stored [N, K]: out^T, rows along K
]


def _operands(M, K, N, a_transposed, b_transposed, seed):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((M, K)).astype(np.float32)
    b = rng.standard_normal((K, N)).astype(np.float32)
    a_view = StridedView((M, K), (1, M)) if a_transposed else StridedView.contiguous((M, K))
    b_view = StridedView((K, N), (1, K)) if b_transposed else StridedView.contiguous((K, N))
    stored = {"a": np.ascontiguousarray(a.T) if a_transposed else a,
              "b": np.ascontiguousarray(b.T) if b_transposed else b}
    return a, b, a_view, b_view, stored


def _run(device, dispatches, arrays, shape, scratch_nbytes=0, **options) -> np.ndarray:
    """`out` after the dispatches, NaN-poisoned before (and the scratch): a skipped write shows."""
    arrays = dict(arrays, out=np.full(shape, np.nan, np.float32))
    if scratch_nbytes:
        arrays["scratch"] = np.full(scratch_nbytes // 4, np.nan, np.float32)
    buffers = {name: Buffer.from_array(device, np.ascontiguousarray(array)) for name, array in arrays.items()}
    try:
        run_dispatches(device, dispatches, buffers, **options)
        return buffers["out"].read(np.float32, shape)
    finally:
        for buffer in buffers.values():
            buffer.destroy()


def _assert_within_bound(got, a, b, label):
    exact = a.astype(np.float64) @ b.astype(np.float64)
    bound = _gamma(a.shape[1]) * (np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64)))
    excess = np.abs(got - exact) > bound
    assert np.isfinite(got).all() and not excess.any(), \
        f"{label}: {np.count_nonzero(excess)} outputs beyond gamma_K |A||B| (max ratio " \
        f"{np.max(np.abs(got - exact) / bound)})"


@pytest.mark.parametrize("name, M, K, N, a_transposed, b_transposed, mode", CASES, ids=[c[0] for c in CASES])
def test_thin_gemm_matches_float64_within_the_fp32_bound_unsplit_and_split(vk_device, name, M, K, N, a_transposed,
                                                                          b_transposed, mode):
    a, b, a_view, b_view, stored = _operands(M, K, N, a_transposed, b_transposed, seed=M + K + N)
    layout = thin_layout(a_view, b_view)
    assert layout is not None and layout.mode == mode
    # The GPU tuning's default plans, without scratch (unsplit) and with the scratch gemm_scratch_nbytes sizes.
    unsplit = plan_gemm("out", "a", a_view, "b", b_view)
    assert [d.shader for d in unsplit] == [layout.shader()] and unsplit[0].groups[2] == 1
    nbytes = gemm_scratch_nbytes(1, M, N, K)
    split = plan_gemm("out", "a", a_view, "b", b_view, scratch="scratch")
    assert split[0].shader == layout.shader() and len(split) == 1 + (split[0].groups[2] > 1)
    results = {}
    for label, dispatches in (("unsplit", unsplit), ("default split", split)):
        results[label] = _run(vk_device, dispatches, stored, (M, N), nbytes)
        _assert_within_bound(results[label], a, b, f"{name} {label}")
    # Forced slices, the last ones empty (past K: zeros), and the runtime cutting the grid: the same bits twice.
    slices = -(-K // CHUNK[mode]) + 2
    forced = plan_thin_gemm("out", "a", "b", layout, scratch="scratch", split_k=slices)
    assert forced[0].groups[2] == slices and forced[1].shader == "linear_splitk_reduce"
    got = _run(vk_device, forced, stored, (M, N), 4 * slices * M * N)
    _assert_within_bound(got, a, b, f"{name} split {slices}")
    again = _run(vk_device, forced, stored, (M, N), 4 * slices * M * N, max_group_count=1)
    assert got.tobytes() == again.tobytes(), "a fixed summation order: the same bits however the grid is cut"


# Reductions long enough for the default plan to split them (at least two slices of MIN_SPLIT_SLICE).
ADDEND_CASES = [("dy_b", 100, 1028, 12, False, False, ROWS), ("d_a", 16, 600, 72, True, False, COLUMNS)]


@pytest.mark.parametrize("split", [False, True], ids=["unsplit", "split"])
@pytest.mark.parametrize("name, M, K, N, a_transposed, b_transposed, mode", ADDEND_CASES,
                         ids=[c[0] for c in ADDEND_CASES])
def test_thin_addmm_is_the_mm_followed_by_the_add_bit_for_bit(vk_device, split, name, M, K, N, a_transposed,
                                                              b_transposed, mode):
    """aten.addmm(d, A, B) with d of the output's shape (what the gemm_epilogue pass folds) takes the same
    kernel as the mm and adds d once the sum is whole (ADDEND unsplit, the reduce split)."""
    a, b, a_view, b_view, stored = _operands(M, K, N, a_transposed, b_transposed, seed=K)
    d = (np.random.default_rng(1).standard_normal((M, N)) * 10).astype(np.float32)
    scratch = dict(scratch="scratch") if split else {}
    nbytes = gemm_scratch_nbytes(1, M, N, K)
    product = _run(vk_device, plan_gemm("out", "a", a_view, "b", b_view, **scratch), stored, (M, N), nbytes)
    fused = plan_gemm("out", "a", a_view, "b", b_view, bias="d", bias_view=StridedView.contiguous((M, N)), **scratch)
    assert fused[0].shader.startswith(thin_layout(a_view, b_view).shader())
    if split:
        assert fused[0].groups[2] > 1 and fused[-1].shader == "linear_splitk_reduce@HAS_BIAS"
    else:
        assert [x.shader for x in fused] == [thin_layout(a_view, b_view).shader(addend=True)]
    got = _run(vk_device, fused, dict(stored, d=d), (M, N), nbytes)
    np.testing.assert_array_equal(got.view(np.uint32), (product + d).view(np.uint32))


def test_the_planner_takes_the_thin_kernel_only_where_it_applies():
    lora_a = StridedView.contiguous((16, 2048)).transpose(0, 1)  # A^T of A [r, in]
    x, d_y = StridedView.contiguous((2048, 2048)), StridedView.contiguous((2048, 8192))
    # The step's four products at T = 2048, r = 16: both layouts, the thin side on either side.
    assert thin_layout(x, lora_a).mode == ROWS
    assert thin_layout(d_y, StridedView.contiguous((8192, 16))).mode == ROWS
    assert thin_layout(d_y.transpose(0, 1), StridedView.contiguous((2048, 16))).mode == COLUMNS
    d_a = thin_layout(StridedView.contiguous((2048, 16)).transpose(0, 1), x)
    assert d_a.mode == COLUMNS and (d_a.P, d_a.R, d_a.c_p_stride, d_a.c_r_stride) == (2048, 16, 1, 2048)
    # Not thin: both sides wide, both thin, a short reduction, X without an aligned contiguous axis.
    assert thin_layout(x, x) is None
    assert thin_layout(StridedView.contiguous((16, 2048)), StridedView.contiguous((2048, 16))) is None
    assert thin_layout(StridedView.contiguous((2048, 64)), StridedView.contiguous((64, 16))) is None
    assert thin_layout(StridedView.contiguous((64, 130)), StridedView.contiguous((130, 16))) is None  # K % 4
    assert thin_layout(StridedView((64, 256), (260, 1), 2), StridedView.contiguous((256, 16))) is None  # offset
    assert thin_layout(StridedView((70, 256), (1, 70)), StridedView.contiguous((256, 16))) is None  # P % 4, COLUMNS
    assert thin_layout(StridedView((64, 256), (3, 192)), StridedView.contiguous((256, 16))) is None  # no unit stride
    # The planner: the CPU tuning keeps its register-tile body (faster on lavapipe), and a bias of another shape,
    # alpha, a forced tile or split, a device of fewer than 256 invocations per workgroup keep matmul's tiles.
    a, b = StridedView.contiguous((64, 256)), StridedView.contiguous((256, 16))
    assert plan_gemm("out", "a", a, "b", b)[0].shader == "matmul_thin"
    assert "CPU_REGISTER_TILES" in plan_gemm("out", "a", a, "b", b, tuning=CPU_TUNING)[0].shader
    for options in (dict(bias="d", bias_view=StridedView.contiguous((16,))), dict(alpha=2.0), dict(tile=(64, 16)),
                    dict(scratch="s", split_k=2), dict(max_workgroup_size=128),
                    dict(bias="d", bias_view=StridedView.contiguous((64, 16)), beta=0.5)):
        assert plan_gemm("out", "a", a, "b", b, **options)[0].shader.startswith("matmul@"), options


def test_split_targets_and_lavapipe_loop_budget():
    # T = 2048: x @ A^T (64 workgroups of 32 rows) split to 256 workgroups, slices of whole chunks.
    layout = thin_layout(StridedView.contiguous((2048, 2048)), StridedView.contiguous((16, 2048)).transpose(0, 1))
    assert layout.workgroups == 64 and matmul_thin.default_split_k(layout) == 4
    assert matmul_thin.slice_length(layout, 4) == 512
    assert gemm_scratch_nbytes(1, 2048, 16, 2048) >= 4 * 4 * 2048 * 16
    # A reduction whose chunk loop would pass lavapipe's budget keeps matmul's tiles (or splits), and the thin
    # plan refuses it by name.
    long_k = 4 * (MAX_CHUNKS * CHUNK[ROWS] // 4 + 1)
    a, b = StridedView.contiguous((64, long_k)), StridedView.contiguous((long_k, 16))
    too_long = thin_layout(a, b)
    assert not matmul_thin.runs_within_lavapipe_loops(too_long)
    assert plan_gemm("out", "a", a, "b", b)[0].shader.startswith("matmul@")
    assert matmul_thin.runs_within_lavapipe_loops(too_long, 2)
    with pytest.raises(KernelArgumentError, match=r"more than \d+ chunks of 128 \(lavapipe's loop limit\)"):
        plan_thin_gemm("out", "a", "b", too_long)
    with pytest.raises(KernelArgumentError, match=r"split_k=2 needs a scratch"):
        plan_thin_gemm("out", "a", "b", layout, split_k=2)


def test_the_lora_gemm_benchmark_smoke_run_plans_old_and_new_without_torch(tmp_path, vk_device):
    """scripts/bench_lora_gemms.py (the GPU measurement of this change) at lavapipe sizes: it runs without
    torch (the GPU machine's script needs numpy and the vulkan binding only), times main's plan against the
    new one and checks both against float64."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    if vk_device.subgroup_size < 8:  # main's plan takes the emulated coopmat kernels, whose plans need >= 8 lanes
        pytest.skip(f"{vk_device.name} has subgroups of {vk_device.subgroup_size} lanes (LP_NATIVE_VECTOR_WIDTH=128); "
                    f"the emulated coopmat kernels of main's plan need 8")

    script = Path(__file__).resolve().parent.parent / "scripts" / "bench_lora_gemms.py"
    out = tmp_path / "lora.json"
    code = (f"import runpy, sys; sys.argv = [{str(script)!r}, '--emulate', '--tokens', '256', '--sites', '256:128', "
            f"'--replays', '1', '--warmup', '0', '--out', {str(out)!r}]\n"
            "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\nexcept SystemExit as exit:\n"
            "    assert not exit.code, exit.code\nassert 'torch' not in sys.modules, 'the GPU script imported torch'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = {r["product"]: r for r in json.loads(out.read_text())["results"]}
    assert len(records) == 6
    for name in ("y = base + xa @ B^T", "dx = dx_base + dxa @ A"):  # K = r: main took the tensor cores
        assert records[name]["old"]["shaders"][0] == "coopmat_absmax"
        assert [s.split("@")[0] for s in records[name]["new"]["shaders"]] == ["matmul"]
    assert records["dB = d_y^T @ xa"]["new"]["shaders"][0] == "matmul_thin@COLUMNS"
    assert records["xa = x @ A^T"]["new"]["shaders"][0] == "matmul_thin"
    assert all(r[plan]["rel_err"] < 1e-4 for r in records.values() for plan in ("old", "new"))


def test_a_lora_training_run_on_the_gpu_tuning_takes_the_thin_kernels_and_follows_float64(vk_device, tmp_path,
                                                                                          monkeypatch):
    """The executor on the GPU tuning (VKTRAIN_GEMM_TUNING=gpu; lavapipe would pick its CPU bodies): at 128 tokens
    and width 128 every LoRA product of mlp-lora is thin (x @ A^T, d_y @ B in rows, times the LoRA scaling: the
    SCALE variant of the gemm_scale pass's mm_scaled; the weight gradients in COLUMNS), and the run follows the
    float64 eager reference within the package's training bounds (tests/_helpers.py)."""
    import torch

    from _helpers import (assert_training_matches_reference, eager_float64_and_float32_training,
                          export_mlp_lora_training_step, runner_losses)
    from vktrain.backend.kernel_planning import plan_schedule
    from vktrain.backend.kernel_planning.kernels.gemm_tuning import TUNING_ENV
    from vktrain.runtime.program.runner import TrainingRunner

    batch, seq, vocab, steps = 2, 64, 64, 4
    hyper = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    hparams = np.array([hyper["lr"], *hyper["betas"], hyper["eps"], hyper["weight_decay"]], np.float32)
    path = tmp_path / "mlp.pte"
    model = export_mlp_lora_training_step(path, (batch, seq), vocab, dim=128, hidden=128)

    def batches():
        generator = torch.Generator().manual_seed(7)
        for _ in range(steps):
            token_ids = torch.randint(0, vocab, (batch, seq), generator=generator)
            yield token_ids, (3 * token_ids + 1) % vocab

    reference = eager_float64_and_float32_training(model, batches(), **hyper)
    initial = {name: param.detach().numpy() for name, param in model.named_parameters()}
    monkeypatch.setenv(TUNING_ENV, "gpu")
    with TrainingRunner.from_pte(path, vk_device, planner=plan_schedule) as runner:
        shaders = {d.shader for d in runner.executor.dispatches}
        assert {"matmul_thin@SCALE", "matmul_thin@COLUMNS"} <= shaders, sorted(shaders)
        losses = runner_losses(runner, batches(), hparams)
        lora = runner.lora_state()
        exp_avg = {name: runner.read_state("optimizer.exp_avg." + name) for name in reference.state}
    assert_training_matches_reference(losses, {n: lora["model." + n] for n in reference.state}, exp_avg,
                                      reference, {n: initial[n] for n in reference.state})
