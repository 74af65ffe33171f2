"""The gemm_scale pass (vktrain/backend/passes/gemm_scale.py) and vktrain.mm_scaled: mul(mm(a, b), s) becomes
one GEMM that multiplies its finished sum by s, with the same bits.

Pass level, on hand-built graphs: what fuses (through views, a number or a 0-d constant scale, mul.Tensor and
mul.Scalar) and what must not (the product read twice, a tensor scale, a view that is not shape-only, a constant
weight, a scale fp32 cannot hold). Kernel level, on lavapipe: plan_gemm's scale is the mm followed by the
elementwise mul bit for bit on every fp32 body (thin unsplit / split in both layouts, tiles unsplit / split, the
CPU body). Program level: the LoRA training step exported with and without the pass gives bit-identical losses
and state on the CPU tuning, on the GPU tuning (matmul_thin's SCALE store and the SCALE reduce of a split), on
the fp16 policy's FP16 variants and on the emulated fp16-tc route (coopmat_mm: the product, then the scale in
place), one dispatch fewer per mul; a product over the binding limit (windows, then the scale in place) too.
The scales are not powers of two (a LoRA scaling of 1/3): scaling a slice of a split sum would change bits.
"""
from __future__ import annotations

import numpy as np
import pytest

import vktrain.backend.passes as backend_passes
from vktrain.backend.kernel_planning.kernels.elementwise import plan_unary
from vktrain.backend.kernel_planning.kernels.gemm_passes import plan_scale_in_place
from vktrain.backend.kernel_planning.kernels.gemm_tuning import CPU_TUNING, TUNING_ENV
from vktrain.backend.kernel_planning.kernels.layout import BindingLimit
from vktrain.backend.kernel_planning.kernels.matmul import gemm_scratch_nbytes, plan_gemm, plan_mm_scaled
from vktrain.backend.passes import PASSES, compile_graph
from vktrain.backend.passes.gemm_scale import MM_SCALED, fuse_gemm_scales
from vktrain.contract import PRECISION_FP16, PRECISION_FP16_TC
from vktrain.lora import LoRAConfig, apply_lora
from vktrain.models import build_model
from vktrain.runtime import Buffer, run_dispatches
from vktrain.serialization import graph as vk
from vktrain.serialization.strided_view import KernelArgumentError, StridedView

from _helpers import next_token_batches, planned, ptes_with_and_without, train_recorded

F32 = vk.DType.FLOAT32
MM, VIEW, MUL = "aten.mm.default", "aten.view_copy.default", "aten.mul.Tensor"
PERMUTE, NEG = "aten.permute_copy.default", "aten.neg.default"
THIRD = 1.0 / 3.0


class _Builder:
    """A VkGraph under construction: y = mul(view(mm(a, b)), s) and variations."""

    def __init__(self) -> None:
        self.graph = vk.VkGraph()

    def tensor(self, shape, name) -> int:
        return self.graph.add_value(vk.TensorValue(F32, shape, name=name))

    def input(self, shape, name) -> int:
        value = self.tensor(shape, name)
        self.graph.inputs.append(value)
        return value

    def op(self, name, args, shape, out_name) -> int:
        out = self.tensor(shape, out_name)
        self.graph.ops.append(vk.OpCall(name, tuple(args), (out,)))
        return out

    def number(self, value) -> int:
        return self.graph.add_value(vk.IntValue(value) if isinstance(value, int) else vk.DoubleValue(value))

    def ints(self, items) -> int:
        return self.graph.add_value(vk.IntListValue(tuple(items)))

    def mm(self, a, b, name="m") -> int:
        shape = (self.graph.tensor(a).shape[0], self.graph.tensor(b).shape[1])
        return self.op(MM, (a, b), shape, name)


def _lora_scale_graph(scale=THIRD):
    """y [2, 3, 8] = mul(view(mm(a [6, 4], b [4, 8])), scale)."""
    g = _Builder()
    a, b = g.input((6, 4), "a"), g.input((4, 8), "b")
    m = g.mm(a, b)
    q = g.op(VIEW, (m, g.ints((2, 3, 8))), (2, 3, 8), "q")
    y = g.op(MUL, (q, g.number(scale)), (2, 3, 8), "y")
    g.graph.outputs = [y]
    return g, dict(a=a, b=b, m=m, q=q, y=y)


def _names(graph):
    return [op.name for op in graph.ops]


def _scale_of(graph, op) -> float:
    return vk.decode_scalar(graph.values[op.args[2]])


@pytest.mark.parametrize("scale", [THIRD, 2, -0.75])
def test_a_scaled_viewed_product_becomes_mm_scaled_and_the_view_writes_the_mul_output(scale):
    g, v = _lora_scale_graph(scale)
    fuse_gemm_scales(g.graph)
    assert _names(g.graph) == [MM_SCALED, VIEW]
    fused, view = g.graph.ops
    assert fused.args[:2] == (v["a"], v["b"]) and fused.outputs == (v["m"],) and _scale_of(g.graph, fused) == scale
    assert view.args[0] == v["m"] and view.outputs == (v["y"],)
    compile_graph(g.graph)  # the storage passes take the result: the view stays a view
    assert g.graph.tensor(view.outputs[0]).is_view


def test_a_two_dimensional_product_is_written_by_mm_scaled_itself_and_its_transposed_operand_stays_a_view():
    """The LoRA forward reads permute(lora_A): mm_scaled reads it in place, as the mm did."""
    g = _Builder()
    x, lora_a = g.input((6, 4), "x"), g.input((8, 4), "lora_A")
    a_t = g.op(PERMUTE, (lora_a, g.ints((1, 0))), (4, 8), "a_t")
    y = g.op("aten.mul.Scalar", (g.mm(x, a_t), g.number(0.1)), (6, 8), "y")
    g.graph.outputs = [y]
    compile_graph(g.graph)
    assert _names(g.graph) == [PERMUTE, MM_SCALED] and g.graph.ops[1].outputs == (y,)
    assert g.graph.tensor(a_t).is_view and g.graph.tensor(a_t).view_strides == (1, 4)


@pytest.mark.parametrize("constant_first", [False, True], ids=["mul(q, c)", "mul(c, q)"])
def test_a_zero_dim_float32_constant_scale_fuses_with_its_value(constant_first):
    g = _Builder()
    a, b = g.input((6, 4), "a"), g.input((4, 8), "b")
    c = g.graph.add_constant_tensor(np.array(0.3, np.float32), name="c")
    m = g.mm(a, b)
    g.graph.outputs = [g.op(MUL, (c, m) if constant_first else (m, c), (6, 8), "y")]
    fuse_gemm_scales(g.graph)
    (fused,) = g.graph.ops
    assert fused.name == MM_SCALED and _scale_of(g.graph, fused) == float(np.float32(0.3))


def _unchanged(builder) -> None:
    before = list(builder.graph.ops)
    fuse_gemm_scales(builder.graph)
    assert builder.graph.ops == before


def test_a_product_read_by_another_op_is_not_fused():
    g, v = _lora_scale_graph()
    g.graph.outputs.append(g.op(NEG, (v["q"],), (2, 3, 8), "other"))
    _unchanged(g)
    g, v = _lora_scale_graph()
    g.graph.outputs.append(v["m"])  # the mm's own output read after the step
    _unchanged(g)


def test_a_tensor_scale_is_not_fused():
    g = _Builder()
    a, b = g.input((6, 4), "a"), g.input((4, 8), "b")
    s = g.input((), "s")  # 0-d, but an input: its value is the step's
    row = g.graph.add_constant_tensor(np.full(8, 0.5, np.float32), name="row")  # a constant, not 0-d
    g.graph.outputs = [g.op(MUL, (g.mm(a, b, "m1"), s), (6, 8), "y1"), g.op(MUL, (g.mm(a, b, "m2"), row), (6, 8), "y2")]
    _unchanged(g)


def test_a_view_that_is_not_shape_only_is_not_fused():
    g = _Builder()
    a, b = g.input((6, 4), "a"), g.input((4, 8), "b")
    t = g.op(PERMUTE, (g.mm(a, b), g.ints((1, 0))), (8, 6), "t")
    g.graph.outputs = [g.op(MUL, (t, g.number(THIRD)), (8, 6), "y")]
    _unchanged(g)


def test_a_product_of_a_constant_weight_is_not_fused():
    """A frozen weight read only through aten.mm may be held as Q8_0 later (passes/q8_0_weights.py)."""
    g = _Builder()
    a = g.input((6, 4), "a")
    w = g.graph.add_constant_tensor(np.ones((4, 8), np.float32), name="w")
    g.graph.outputs = [g.op(MUL, (g.mm(a, w), g.number(THIRD)), (6, 8), "y")]
    _unchanged(g)


@pytest.mark.parametrize("scale", [float("inf"), float("nan"), 1e39])
def test_a_scale_fp32_cannot_hold_is_not_fused(scale):
    _unchanged(_lora_scale_graph(scale)[0])


# ----------------------------------------------------------------------------------------------- kernels
def _run(device, dispatches, arrays, shape, scratch_nbytes=0) -> np.ndarray:
    """`out` after the dispatches, NaN-poisoned before (and the scratch): a skipped write shows."""
    arrays = dict(arrays, out=np.full(shape, np.nan, np.float32), product=np.full(shape, np.nan, np.float32))
    if scratch_nbytes:
        arrays["scratch"] = np.full(scratch_nbytes // 4, np.nan, np.float32)
    buffers = {name: Buffer.from_array(device, np.ascontiguousarray(array)) for name, array in arrays.items()}
    try:
        run_dispatches(device, dispatches, buffers)
        return buffers["out"].read(np.float32, shape)
    finally:
        for buffer in buffers.values():
            buffer.destroy()


# (name, M, K, N, A stored transposed, B stored transposed, plan options, the GEMM's shader, split): the LoRA
# products the pass scales (x @ A^T, d_y @ B) on each fp32 body.
KERNEL_CASES = [
    ("thin rows", 70, 256, 16, False, True, {}, "matmul_thin@SCALE", False),
    ("thin rows split", 100, 1028, 12, False, False, dict(scratch="scratch"), "matmul_thin", True),
    ("thin columns", 16, 300, 72, True, False, {}, "matmul_thin@COLUMNS+SCALE", False),
    ("thin columns split", 16, 600, 72, True, False, dict(scratch="scratch"), "matmul_thin@COLUMNS", True),
    ("tiles", 40, 60, 12, False, True, {}, "matmul@HAS_BIAS=0+TILE_M=64+TILE_N=16", False),
    ("tiles split", 12, 1000, 16, False, False, dict(scratch="scratch"), "matmul@HAS_BIAS=0+TILE_M=16+TILE_N=64+VEC4_C",
     True),
    ("tiles forced split", 70, 256, 16, False, True, dict(scratch="scratch", split_k=3),
     "matmul@HAS_BIAS=0+TILE_M=64+TILE_N=16+VEC4_C", True),
]


@pytest.mark.parametrize("name, M, K, N, a_t, b_t, options, shader, split", KERNEL_CASES,
                         ids=[c[0] for c in KERNEL_CASES])
def test_a_scaled_gemm_is_the_mm_followed_by_the_mul_bit_for_bit(vk_device, name, M, K, N, a_t, b_t, options,
                                                                 shader, split):
    """The GPU tuning's bodies (tests/test_wgsl_kernels.py runs this on WebGPU too)."""
    _check_scaled_gemm(vk_device, name, M, K, N, a_t, b_t, options, shader, split)


def test_the_cpu_body_scales_as_the_mm_followed_by_the_mul_bit_for_bit(vk_device):
    """The CPU tuning's register tiles (Vulkan only): alpha * acc, never split."""
    _check_scaled_gemm(vk_device, "cpu body", 70, 256, 16, False, True, dict(tuning=CPU_TUNING),
                       "matmul@HAS_BIAS=0+CPU_REGISTER_TILES", False)


def _check_scaled_gemm(vk_device, name, M, K, N, a_t, b_t, options, shader, split):
    rng = np.random.default_rng(K)
    a, b = rng.standard_normal((M, K)).astype(np.float32), rng.standard_normal((K, N)).astype(np.float32)
    a_view = StridedView((M, K), (1, M)) if a_t else StridedView.contiguous((M, K))
    b_view = StridedView((K, N), (1, K)) if b_t else StridedView.contiguous((K, N))
    stored = {"a": np.ascontiguousarray(a.T) if a_t else a, "b": np.ascontiguousarray(b.T) if b_t else b}
    nbytes = max(gemm_scratch_nbytes(1, M, N, K), 4 * options.get("split_k", 1) * M * N)
    mm = plan_gemm("product", "a", a_view, "b", b_view, **options)
    mul = plan_unary("mul_scalar", "out", "product", StridedView.contiguous((M, N)), scalar0=THIRD)
    expected = _run(vk_device, mm + mul, stored, (M, N), nbytes)
    fused = plan_gemm("out", "a", a_view, "b", b_view, scale=THIRD, **options)
    assert fused[0].shader.startswith(shader), [d.shader for d in fused]
    if split:
        assert fused[0].groups[2] > 1 and [d.shader for d in fused][1:] == ["linear_splitk_reduce@SCALE"]
    else:
        assert len(fused) == 1
    got = _run(vk_device, fused, stored, (M, N), nbytes)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32), err_msg=name)


@pytest.mark.parametrize("numel", [37, 4096 + 3])
def test_the_in_place_scale_is_the_elementwise_mul_bit_for_bit(vk_device, numel):
    """plan_scale_in_place (a product coopmat_mm or GEMM windows wrote): any size, one binding read and written
    (tests/test_wgsl_kernels.py runs this on WebGPU too, which refuses a buffer bound twice)."""
    values = (np.random.default_rng(numel).standard_normal(numel) * 1e3).astype(np.float32)
    values[:4] = [0.0, -0.0, np.inf, 1e-40]  # a signed zero, an infinity, a subnormal
    buffers = {"product": Buffer.from_array(vk_device, values), "out": Buffer.from_array(vk_device, values * 0)}
    try:
        run_dispatches(vk_device, plan_unary("mul_scalar", "out", "product", StridedView.contiguous((numel,)),
                                             scalar0=THIRD), buffers)
        expected = buffers["out"].read(np.float32, (numel,))
        run_dispatches(vk_device, [plan_scale_in_place(out="product", numel=numel, scale=THIRD, label="scale")],
                       buffers)
        got = buffers["product"].read(np.float32, (numel,))
    finally:
        for buffer in buffers.values():
            buffer.destroy()
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))


def test_the_scaled_plans_refuse_what_they_cannot_scale_exactly():
    a, b = StridedView.contiguous((64, 256)), StridedView.contiguous((256, 16))
    with pytest.raises(KernelArgumentError, match="no bias and alpha 1"):
        plan_gemm("out", "a", a, "b", b, bias="p", bias_view=StridedView.contiguous((64, 16)), scale=THIRD)
    with pytest.raises(KernelArgumentError, match="no bias and alpha 1"):
        plan_gemm("out", "a", a, "b", b, alpha=2.0, scale=THIRD)
    with pytest.raises(KernelArgumentError, match="a scaled GEMM has no windows"):
        plan_gemm("out", "a", a, "b", b, scale=THIRD, binding_limit=BindingLimit(32 * 1024))  # a: 64 KiB
    with pytest.raises(KernelArgumentError, match="scale must be a real number"):
        plan_mm_scaled(out="out", self="a", self_shape=(64, 256), mat2="b", mat2_shape=(256, 16), scale="x")


# ---------------------------------------------------------------------------------------- the training step
HPARAMS = np.array([1e-2, 0.9, 0.999, 1e-8, 0.01], np.float32)


def _assert_same_bits(fused, unfused):
    """The same losses and state; one dispatch fewer per fused mul but those whose product a kernel that
    cannot scale computes (gemm_lowering's `_scaled_product`: the mm, then its `.scale` in place). Returns the
    shaders and the count of those."""
    (ops, dispatches, losses, state), (ops_u, dispatches_u, losses_u, state_u) = fused, unfused
    assert losses == losses_u, (losses, losses_u)
    assert state.keys() == state_u.keys()
    for name in state:
        assert state[name].tobytes() == state_u[name].tobytes(), f"state {name} differs"
    scaled = ops.count(MM_SCALED)
    assert scaled > 0 and ops_u.count(MM_SCALED) == 0
    assert ops_u.count(MUL) - ops.count(MUL) == scaled and ops_u.count(MM) - ops.count(MM) == scaled
    in_place = sum(label.endswith(".scale") for _, label in dispatches)
    assert len(dispatches_u) - len(dispatches) == scaled - in_place, "one dispatch fewer per mul, nothing else"
    print(f"{scaled} muls fused ({in_place} scaled in place): {len(dispatches)} dispatches per step instead of "
          f"{len(dispatches_u)}; losses {losses}")
    return [shader for shader, _ in dispatches], in_place


@pytest.fixture(scope="module")
def mlp_programs(tmp_path_factory):
    """mlp-lora of width 256 / 128 at 2 x 32 tokens, rank 12, alpha 4 (scaling 1/3) on every linear: on the GPU
    tuning x @ A^T over K = 256 splits in two, over K = 128 does not, and the head's d_y @ B (K = 64) takes the
    tiles."""
    vocab = 64
    model = build_model("mlp-lora", dim=256, hidden=128, vocab_size=vocab, n_layers=2, activation="relu")
    apply_lora(model, LoRAConfig(rank=12, alpha=4.0, targets="*", group_size=32, seed=0))
    return ptes_with_and_without(fuse_gemm_scales, model, (2, 32), tmp_path_factory.mktemp("mlp")), vocab


def test_the_step_is_bit_identical_with_fused_scales_on_the_cpu_tuning(vk_device, mlp_programs):
    (fused, unfused), vocab = mlp_programs
    batches = next_token_batches((2, 32), vocab, 3, seed=5)
    _, in_place = _assert_same_bits(train_recorded(fused, vk_device, batches, HPARAMS), train_recorded(unfused, vk_device, batches, HPARAMS))
    assert in_place == 0


def test_the_step_is_bit_identical_with_fused_scales_on_the_gpu_tuning(vk_device, mlp_programs, monkeypatch):
    """matmul_thin's SCALE store unsplit, the SCALE reduce after a split, and the tiles' alpha."""
    (fused, unfused), vocab = mlp_programs
    batches = next_token_batches((2, 32), vocab, 3, seed=5)
    monkeypatch.setenv(TUNING_ENV, "gpu")
    shaders, in_place = _assert_same_bits(train_recorded(fused, vk_device, batches, HPARAMS), train_recorded(unfused, vk_device, batches, HPARAMS))
    assert in_place == 0
    assert {"matmul_thin@SCALE", "linear_splitk_reduce@SCALE"} <= set(shaders), sorted(set(shaders))


def test_the_step_is_bit_identical_with_fused_scales_on_the_emulated_tensor_cores(vk_device, mlp_programs):
    """The emulated fp16-tc route (a test path taking every mm of a long enough reduction): coopmat_mm cannot scale
    its sum, so it writes the product and the scale follows in place (linear_splitk_reduce@SCALE+IN_PLACE)."""
    if vk_device.subgroup_size < 8:  # the emulated coopmat plans need >= 8 lanes
        pytest.skip(f"{vk_device.name} has subgroups of {vk_device.subgroup_size} lanes (LP_NATIVE_VECTOR_WIDTH=128); "
                    f"the emulated coopmat kernels need 8")
    (fused, unfused), vocab = mlp_programs
    batches = next_token_batches((2, 32), vocab, 2, seed=5)
    options = dict(precision=PRECISION_FP16_TC, emulate_tensor_cores=True)
    shaders, in_place = _assert_same_bits(train_recorded(fused, vk_device, batches, HPARAMS, **options),
                                            train_recorded(unfused, vk_device, batches, HPARAMS, **options))
    assert in_place > 0 and any(s.startswith("coopmat_mm") for s in shaders)
    assert "linear_splitk_reduce@SCALE+IN_PLACE" in shaders


def test_the_step_is_bit_identical_with_fused_scales_on_the_fp16_variants(vk_device, mlp_programs):
    """The fp16 policy's test path (every mm past STARVED_REDUCTION on matmul.slang's FP16 variants): the scale is
    their alpha unsplit (after the exact unscaling of the sum) and the SCALE reduce's split."""
    (fused, unfused), vocab = mlp_programs
    batches = next_token_batches((2, 32), vocab, 2, seed=5)
    options = dict(precision=PRECISION_FP16, emulate_tensor_cores=True)
    shaders, in_place = _assert_same_bits(train_recorded(fused, vk_device, batches, HPARAMS, **options),
                                            train_recorded(unfused, vk_device, batches, HPARAMS, **options))
    assert in_place == 0 and any(s.endswith("+FP16") for s in shaders)
    assert "linear_splitk_reduce@SCALE" in shaders


def _scaled_product_graph(fused: bool):
    """y [80, 12] = mul(mm(a [80, 4096], b [4096, 12]), 1/3), the pair or (fused) the pass's mm_scaled, compiled."""
    g = _Builder()
    a, b = g.input((80, 4096), "a"), g.input((4096, 12), "b")
    g.graph.outputs = [g.op(MUL, (g.mm(a, b), g.number(THIRD)), (80, 12), "y")]
    passes = PASSES if fused else tuple(p for p in PASSES if p is not fuse_gemm_scales)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(backend_passes, "PASSES", passes)
        compile_graph(g.graph)
    return g.graph


def test_a_scaled_product_over_the_binding_limit_is_the_mm_in_windows_then_the_mul(vk_device):
    """`a` (1.25 MiB) over a 1 MiB binding limit: the GEMM runs in windows, which cannot scale a whole sum, so
    mm_scaled's lowering plans aten.mm's windows and the scale in place after them."""
    from vktrain.runtime.delegate.executor import GraphExecutor

    rng = np.random.default_rng(3)
    inputs = rng.standard_normal((80, 4096)).astype(np.float32), rng.standard_normal((4096, 12)).astype(np.float32)
    results = {}
    for fused in (True, False):
        graph = _scaled_product_graph(fused)
        assert [op.name for op in graph.ops] == ([MM_SCALED] if fused else [MM, MUL])
        with GraphExecutor(vk_device, graph, planned(vk_device, graph, max_binding_bytes=1 << 20)) as executor:
            labels = [d.label for d in executor.dispatches]
            (results[fused],) = executor.run(*inputs)
        assert sum(".window" in label for label in labels) > 1, labels
        if fused:
            assert labels[-1].endswith(".scale"), labels
    np.testing.assert_array_equal(results[True].view(np.uint32), results[False].view(np.uint32))


def test_the_gpu_check_script_runs_without_torch_and_finds_the_pair_and_the_fused_gemm_equal(tmp_path, vk_device):
    """scripts/check_gemm_scale.py (the GPU check of this change) at lavapipe sizes: numpy and the vulkan binding
    only; the split and the unsplit thin product, one dispatch fewer each, bit-identical."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "check_gemm_scale.py"
    out = tmp_path / "scale.json"
    code = (f"import runpy, sys; sys.argv = [{str(script)!r}, '--tokens', '64', '--sites', '256:128', "
            f"'--replays', '1', '--warmup', '0', '--out', {str(out)!r}]\n"
            "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\nexcept SystemExit as exit:\n"
            "    assert not exit.code, exit.code\nassert 'torch' not in sys.modules, 'the GPU script imported torch'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    records = {r["product"]: r for r in report["results"]}
    assert records["h = x @ A^T"]["fused"]["shaders"] == ["matmul_thin", "linear_splitk_reduce@SCALE"]  # K = 256
    assert records["d_h = d_y @ B"]["fused"]["shaders"] == ["matmul_thin@SCALE"]  # K = 128: unsplit
    assert all(r["bit_identical"] and r["pair"]["dispatches"] - r["fused"]["dispatches"] == 1 for r in records.values())
    assert report["totals"]["64"]["all_bit_identical"]
