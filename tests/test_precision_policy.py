"""GEMM precision policies (docs/PRECISION.md): what a blob allows, the route chosen at load, and the
training step each one runs.

On lavapipe (no tensor cores) the fp16-tc routing is tested through the executor's forced-capability
path: `emulate_tensor_cores=True` selects the coopmat kernels as on a device that has them, and runs
their COOPMAT_EMULATE variant (the same shaders with the cooperative-matrix operations done by plain
arithmetic and the same rounding: fp16 inputs, fp32 sums).

Tolerance of the fp16-tc step-1 loss against the float64 eager reference (derived, first order). The
route also sends mlp-lora's aten.mm ops that coopmat_mm reads (the LoRA products x @ A^T, u @ B^T and the
backward's d_y @ B, d_u @ A) to the tensor cores, but at step 1 those do not move the loss: LoRA's B
starts at zero, so u @ B^T is exactly zero whatever u's rounding, and backward products come after the
loss. What moves it are the 4-bit base products y = x @ deq(W).T; each output element of one of them moves by
at most eps_e = ((2u + u^2 + 2^-24) + (K + 16) 2^-23) * S_e + 2^-25 (sum_k |x_k| + sum_k |w_k|), with
u = 2^-11 the fp16 unit roundoff and S_e = sum_k |x_k w_k| (tests/test_kernels_coopmat.py derives this
bound; for these K <= 64 the fp32-sum term is far below the fp16 input rounding). To first order the
loss then moves by at most sum over every base GEMM output e of |dL/dy_e| * eps_e (the gradients taken
in float64 by autograd on the reference itself), which is the bound: it assumes every rounding error
pushes the loss the same way, so the measured error sits well inside it (printed with -s). Terms of
second order are ~(2u)^2 relative and, with the fp32 arithmetic of everything else, fit in the fp32
parity tolerance (LOSS_RTOL) added on top. A wrong weight, row or tile moves the loss by a whole term
(~1e-1 here), two orders above the bound.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vktrain.contract import (METADATA_GEMM_PRECISIONS, PRECISION_AUTO, PRECISION_FP16, PRECISION_FP16_TC,
                              PRECISION_FP32, PRECISIONS)
from vktrain.lora import LoRAConfig, apply_lora
from vktrain.lora.layers import LoRAQ4Linear
from vktrain.runtime.delegate.executor import GraphExecutor
from vktrain.backend.kernel_planning.kernels.coopmat import GemmRoute, coopmat_supported, select_gemm_route
from vktrain.errors import PrecisionPolicyError
from vktrain.contract import allowed_precisions
from vktrain.backend.kernel_planning.kernels.coopmat_tiling import (
    EMULATED_LOOP_BUDGET,
    MIN_WORKGROUPS,
    STARVED_REDUCTION,
    CoopmatTiling,
    emulated_loop_trips,
)
from vktrain.serialization.strided_view import StridedView
from vktrain.runtime.program.runner import TrainingRunner
from vktrain.runtime.vk.coopmat import CooperativeMatrixShape
from vktrain.train.command import add_train_arguments, run_train

from vktrain.export import export_training_step, lower_to_pte
from vktrain.models import build_model

from _helpers import LOSS_RTOL, _cast_floating, export_mlp_lora_training_step
from vktrain.backend.kernel_planning import plan_schedule
from _helpers import planned

BATCH, SEQ, VOCAB = 2, 8, 64
HPARAMS = np.array([1e-2, 0.9, 0.999, 1e-8, 0.01], np.float32)
FP16_UNIT_ROUNDOFF = 2.0 ** -11
FP32_TRUNCATION = 2.0 ** -23
FP16_SUBNORMAL_HALF_SPACING = 2.0 ** -25
TENSOR_CORES = CooperativeMatrixShape(16, 16, 16, "float16", "float16", "float32", "float32", False, "subgroup")


def _device(properties=(), features=frozenset({"shaderFloat16"}), subgroup_operations=0x1, subgroup_size=32):
    """What select_gemm_route reads of a vktrain Device."""
    return SimpleNamespace(name="test-gpu", cooperative_matrix_properties=tuple(properties), features=features,
                           subgroup_operations=subgroup_operations, subgroup_size=subgroup_size)


# ----------------------------------------------------------------------------------- no device needed
def test_a_blob_allows_what_its_metadata_lists_and_an_older_blob_fp32_only():
    assert allowed_precisions({METADATA_GEMM_PRECISIONS: json.dumps(PRECISIONS)}) == PRECISIONS
    assert allowed_precisions({METADATA_GEMM_PRECISIONS: '["fp32", "fp16-tc"]'}) == ("fp32", "fp16-tc")  # before fp16
    assert allowed_precisions({}) == (PRECISION_FP32,)
    for bad in ('"fp32"', "[]", '["fp32", "bf16"]', "not json"):
        with pytest.raises(PrecisionPolicyError, match=f"step.pte: blob metadata '{METADATA_GEMM_PRECISIONS}'"):
            allowed_precisions({METADATA_GEMM_PRECISIONS: bad}, "step.pte")


def test_fp32_keeps_the_fp32_kernels_even_on_a_device_with_tensor_cores():
    route = select_gemm_route(PRECISION_FP32, PRECISIONS, _device([TENSOR_CORES]))
    assert not route.tensor_cores and not route.takes_tensor_cores(4096, 4096)


def test_fp16_tc_takes_the_tensor_cores_where_the_device_lists_the_kernels_shape():
    route = select_gemm_route(PRECISION_FP16_TC, PRECISIONS, _device([TENSOR_CORES], subgroup_size=64))
    assert route.tensor_cores and not route.emulate and route.subgroup_size == 64
    assert "VK_KHR_cooperative_matrix" in route.describe()


@pytest.mark.parametrize("listed", [(), (CooperativeMatrixShape(16, 16, 16, "bfloat16", "bfloat16", "float32",
                                                                "float32", False, "subgroup"),)])
def test_fp16_tc_falls_back_to_fp32_kernels_and_says_why(listed):
    route = select_gemm_route(PRECISION_FP16_TC, PRECISIONS, _device(listed))
    assert not route.tensor_cores and not route.takes_tensor_cores(4096, 4096)
    assert "test-gpu lists no 16x16x16 float16 x float16 + float32" in route.describe()


def test_a_policy_the_blob_does_not_allow_or_nobody_knows_is_refused_by_name():
    with pytest.raises(PrecisionPolicyError, match=f"allows GEMM precision fp32 .*{METADATA_GEMM_PRECISIONS}.*fp16-tc"):
        select_gemm_route(PRECISION_FP16_TC, (PRECISION_FP32,), _device([TENSOR_CORES]))
    with pytest.raises(PrecisionPolicyError, match="unknown GEMM precision 'bf16'"):
        select_gemm_route("bf16", PRECISIONS, _device([TENSOR_CORES]))


def test_auto_is_fp16_tc_where_the_device_and_the_program_allow_it_and_fp32_elsewhere():
    fast = select_gemm_route(PRECISION_AUTO, PRECISIONS, _device([TENSOR_CORES]))
    assert fast.precision == PRECISION_FP16_TC and fast.tensor_cores
    assert fast.describe().startswith("GEMM precision fp16-tc") and "auto -> fp16-tc: test-gpu has" in fast.reason
    no_tensor_cores = select_gemm_route(PRECISION_AUTO, PRECISIONS, _device())
    assert no_tensor_cores.precision == PRECISION_FP32 and not no_tensor_cores.tensor_cores
    assert no_tensor_cores.reason == "auto -> fp32: test-gpu has no tensor-core kernels"
    old_blob = select_gemm_route(PRECISION_AUTO, (PRECISION_FP32,), _device([TENSOR_CORES]))
    assert old_blob.precision == PRECISION_FP32 and "the program allows only fp32" in old_blob.reason


def test_the_runtime_asks_for_auto_by_default():
    import inspect
    assert inspect.signature(plan_schedule).parameters["precision"].default == PRECISION_AUTO
    assert inspect.signature(TrainingRunner).parameters["precision"].default == PRECISION_AUTO


def test_emulation_needs_fp16_arithmetic_and_subgroups():
    assert select_gemm_route(PRECISION_FP16_TC, PRECISIONS, _device(), emulate=True).emulate
    with pytest.raises(PrecisionPolicyError, match="shaderFloat16"):
        select_gemm_route(PRECISION_FP16_TC, PRECISIONS, _device(features=frozenset()), emulate=True)


def test_small_outputs_stay_on_the_split_k_simt_kernels():
    route = GemmRoute(PRECISION_FP16_TC, True, "test")
    # 64-row x 128-column tiles: M = 128 tokens gives 2 rows of tiles, so N = 2048 has 32 tiles, 8192 has 128.
    assert MIN_WORKGROUPS == 128
    assert not route.takes_tensor_cores(128, 2048) and route.takes_tensor_cores(128, 8192)
    assert route.takes_tensor_cores(512, 2048) and not route.takes_tensor_cores(512, 1920)


def _matrix(rows: int, cols: int) -> StridedView:
    return StridedView.contiguous((rows, cols))


def _transposed(rows: int, cols: int) -> StridedView:
    """A [rows, cols] view of a row-major [cols, rows] tensor (a weight read as W^T)."""
    return StridedView((rows, cols), (1, rows))


def test_mm_takes_the_tensor_cores_for_large_row_major_or_transposed_weight_operands():
    route = GemmRoute(PRECISION_FP16_TC, True, "test")
    # The tied LM head of SmolLM2 at 4 x 512 tokens: logits = h @ W^T, and d_h = d_logits @ W.
    assert route.dense_b_transposed(_matrix(2048, 576), _transposed(576, 49152)) is True
    assert route.dense_b_transposed(_matrix(2048, 49152), _matrix(49152, 576)) is False
    # The LoRA B product (K = rank 16) of a 2048-wide projection: a large output over a starved reduction keeps
    # the fp32 kernels (STARVED_REDUCTION); a reduction one vec4 longer takes the tensor cores.
    assert route.dense_b_transposed(_matrix(2048, 16), _transposed(16, 2048)) is None
    assert route.dense_b_transposed(_matrix(2048, STARVED_REDUCTION), _transposed(STARVED_REDUCTION, 2048)) is None
    longer = STARVED_REDUCTION + 4
    assert route.dense_b_transposed(_matrix(2048, longer), _transposed(longer, 2048)) is True
    # Skinny outputs (x @ A^T of rank 16) keep the fp32 split-K kernels; d_h at 128 tokens (a small output
    # over the vocabulary) takes the tensor cores split over K (kernels/coopmat_tiling.py default_split_k).
    assert route.dense_b_transposed(_matrix(2048, 2048), _transposed(2048, 16)) is None
    assert route.dense_b_transposed(_matrix(128, 49152), _matrix(49152, 576)) is False
    assert route.dense_b_transposed(_matrix(128, 256), _matrix(256, 576)) is None  # too short to split
    # What coopmat_mm cannot read: A transposed (the LoRA weight gradients), other strides, offsets,
    # rows that are not whole vec4.
    assert route.dense_b_transposed(_transposed(2048, 2048), _matrix(2048, 2048)) is None
    assert route.dense_b_transposed(_matrix(2048, 2048), StridedView((2048, 2048), (4096, 1))) is None
    assert route.dense_b_transposed(_matrix(2048, 2048), StridedView((2048, 2048), (2048, 1), 2048)) is None
    assert route.dense_b_transposed(_matrix(2048, 2046), _matrix(2046, 2048)) is None
    assert route.dense_b_transposed(_matrix(2048, 2048), _matrix(2048, 2046)) is None


def test_mm_keeps_the_fp32_kernel_on_the_fp32_policy_and_without_tensor_cores():
    head = (_matrix(2048, 576), _transposed(576, 49152))
    assert select_gemm_route(PRECISION_FP32, PRECISIONS, _device([TENSOR_CORES])).dense_b_transposed(*head) is None
    assert select_gemm_route(PRECISION_FP16_TC, PRECISIONS, _device()).dense_b_transposed(*head) is None
    assert select_gemm_route(PRECISION_FP16_TC, PRECISIONS, _device([TENSOR_CORES])).dense_b_transposed(*head)


def test_emulated_route_keeps_reductions_past_lavapipe_loop_budget_on_the_fp32_kernels():
    route = select_gemm_route(PRECISION_FP16_TC, PRECISIONS, _device(subgroup_size=8), emulate=True)
    assert route.dense_b_transposed(_matrix(16, 68), _matrix(68, 8)) is False  # emulated: any size
    assert route.dense_b_transposed(_matrix(16, 64), _matrix(64, 8)) is None  # but not a starved reduction
    too_long = 32
    while emulated_loop_trips(CoopmatTiling(tile_m=64), too_long, 8) <= EMULATED_LOOP_BUDGET:
        too_long += 32
    assert route.dense_b_transposed(_matrix(16, too_long - 32), _matrix(too_long - 32, 64)) is False
    assert route.dense_b_transposed(_matrix(16, too_long), _matrix(too_long, 64)) is None
    assert not route.takes_tensor_cores(16, 64, too_long) and route.takes_tensor_cores(16, 64, too_long - 32)


def _lowered_addmm(route: GemmRoute, M: int, N: int, K: int) -> list:
    """The dispatches the op lowering plans on `route` for the LoRA B product with its folded add:
    addmm(base [M, N], u [M, K], B^T [K, N]) with B [N, K] row-major."""
    from vktrain.backend.kernel_planning.lowering_context import OpContext, TensorArg
    from vktrain.backend.kernel_planning.op_lowering import OP_LOWERINGS
    from vktrain.serialization import graph as vk
    from vktrain.serialization.dispatch import BufferBinding

    def tensor(value_id, key, shape, view=None):
        return TensorArg(value_id, BufferBinding(key, 0, 4 * shape[0] * shape[1]), shape, "float32", view=view)

    args = [tensor(0, "base", (M, N)), tensor(1, "u", (M, K)), tensor(2, "b", (K, N), _transposed(K, N)), 1.0, 1.0]
    op = vk.OpCall(ADDMM, (0, 1, 2, 3, 4), (99,))
    context = OpContext(0, op, args, [tensor(99, "out", (M, N))], f"0:{ADDMM}",
                        lambda nbytes, purpose: BufferBinding(f"scratch.{purpose}", 0, nbytes), gemm=route)
    return OP_LOWERINGS[ADDMM].lower(context)


@pytest.mark.parametrize("precision", [PRECISION_FP16_TC, PRECISION_FP16])
def test_a_starved_reduction_keeps_the_fp32_kernel_without_an_absmax_pass(precision):
    """The emulated (test-path) routes take every GEMM whatever its size, but not a reduction of at most
    STARVED_REDUCTION (the LoRA rank): that addmm plans the fp32 kernel alone; a longer one still takes the
    tensor cores (fp16-tc) or the FP16 variant (fp16), each after its absmax pass."""
    route = select_gemm_route(precision, PRECISIONS, _device(subgroup_size=8), emulate=True)
    for K in (16, STARVED_REDUCTION):  # the fp32 kernel with the bias epilogue (no device limits: its 32 x 64 tile)
        shaders = [d.shader for d in _lowered_addmm(route, 64, 128, K)]
        assert shaders == ["matmul@HAS_BIAS=1+TILE_M=32+TILE_N=64+VEC4_C"], (K, shaders)
    longer = [d.shader for d in _lowered_addmm(route, 64, 128, STARVED_REDUCTION + 4)]
    assert longer[0] == "coopmat_absmax" and len(longer) == 2, longer
    if precision == PRECISION_FP16_TC:
        assert longer[1].startswith("coopmat_mm@") and "+ADDEND+COOPMAT_EMULATE" in longer[1], longer
    else:
        assert longer[1] == "matmul@HAS_BIAS=1+TILE_M=32+TILE_N=64+VEC4_C+FP16", longer


# ----------------------------------------------------------------------------------- the training step
@pytest.fixture(scope="module")
def step_program(tmp_path_factory):
    path = tmp_path_factory.mktemp("pte") / "mlp_lora_step.pte"
    # Reductions of the base GEMMs past STARVED_REDUCTION (kernels/coopmat_tiling.py: 96, 128 and the head's
    # d_x over a vocabulary of 2 * VOCAB), so that the emulated route sends them to the tensor cores (a
    # reduction of 64 or less keeps the fp32 kernels on every route). The batches' tokens stay below VOCAB.
    return path, export_mlp_lora_training_step(path, (BATCH, SEQ), 2 * VOCAB, dim=96, hidden=128)


def _batch():
    generator = torch.Generator().manual_seed(99)
    token_ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels = (5 * token_ids + 2) % VOCAB
    labels[0, :2] = -1
    return token_ids, labels


def _first_loss(runner) -> float:
    token_ids, labels = _batch()
    return runner.step(token_ids.numpy(), labels.numpy(), HPARAMS)


BASE_GEMMS = ("vktrain.linear_q4gsw.default", "vktrain.linear_q4gsw_backward.default")
MM, ADDMM, MM_SCALED = "aten.mm.default", "aten.addmm.default", "vktrain.mm_scaled.default"


def _base_gemm_ops(runner) -> list[str]:
    """Labels of the 4-bit base GEMMs (forward and d_x), the ops fp16-tc routes."""
    return [f"{i}:{op.name}" for i, op in enumerate(runner.executor.ops) if op.name in BASE_GEMMS]


def _scale(x: torch.Tensor) -> float:
    """coopmat_mm's per-tensor scale 2^e of an operand: max |x| * 2^e in [2^14, 2^15)."""
    largest = float(x.abs().max())
    return 1.0 if largest == 0.0 else 2.0 ** (14 - math.floor(math.log2(largest)))


def _float64_loss_and_fp16_bound(model, batch, head=None) -> tuple[float, float]:
    """The float64 eager step-1 loss, and the first-order bound of the module docstring on how far
    rounding the inputs of every base GEMM (and, given `head`, the lm_head's mm, whose operands are
    scaled per tensor first) to fp16 moves it."""
    model = copy.deepcopy(model)
    _cast_floating(model, torch.float64)
    records = []

    def record(module, inputs, output):
        output.retain_grad()
        records.append((module, inputs[0].detach(), output))

    routed = [m for m in model.modules() if isinstance(m, LoRAQ4Linear)] + ([getattr(model, head)] if head else [])
    hooks = [m.register_forward_hook(record) for m in routed]
    token_ids, labels = batch
    loss = model.loss(token_ids, labels, (labels >= 0).sum().to(torch.float32))
    loss.backward()
    for hook in hooks:
        hook.remove()
    bound = 0.0
    for module, x, output in records:
        x = x.reshape(-1, module.in_features)
        if isinstance(module, LoRAQ4Linear):
            w, x_scale, w_scale = module.dequantized_weight().to(torch.float64), 1.0, 1.0
        else:  # the head's mm: both operands scaled by powers of two before their rounding, the result back
            w = module.weight.detach()
            x_scale, w_scale = _scale(x), _scale(w)
        K = module.in_features
        relative = 2 * FP16_UNIT_ROUNDOFF + FP16_UNIT_ROUNDOFF ** 2 + 2.0 ** -24 + (K + 16) * FP32_TRUNCATION
        per_output = relative * (x.abs() @ w.abs().T) + FP16_SUBNORMAL_HALF_SPACING * (
            x.abs().sum(1, keepdim=True) / w_scale + w.abs().sum(1)[None, :] / x_scale)
        # d loss / d base output = d loss / d module output: the module adds the LoRA branch to it.
        bound += float((output.grad.reshape(-1, module.out_features).abs() * per_output).sum())
    return float(loss.detach()), bound, len(records)


def test_fp16_tc_routes_every_base_gemm_and_step_one_matches_float64_within_the_derived_bound(
        vk_device, step_program):
    path, model = step_program
    with TrainingRunner.from_pte(path, vk_device, planner=plan_schedule) as fp32_runner:
        assert fp32_runner.executor.tensor_core_ops == []
        assert not any("coopmat" in d.shader for d in fp32_runner.executor.dispatches)
        fp32_loss = _first_loss(fp32_runner)
    with TrainingRunner.from_pte(path, vk_device, planner=plan_schedule, precision=PRECISION_FP16_TC, emulate_tensor_cores=True) as runner:
        base_ops = _base_gemm_ops(runner)
        # Three forward GEMMs; d_x of the head and the second layer (the first layer's input is the frozen
        # embedding's output, which needs no gradient).
        assert len(base_ops) == 5 and set(base_ops) <= set(runner.executor.tensor_core_ops)
        routed_mm = [label for label in runner.executor.tensor_core_ops if label not in base_ops]
        # Every other routed op is a mm: at least the two forward LoRA products of each of the three modules
        # (u @ B^T as the addmm the LoRA add was folded into, backend/passes/gemm_epilogue.py; x @ A^T * scaling as
        # the mm_scaled of backend/passes/gemm_scale.py, its product on coopmat_mm, then the mul).
        assert all(label.endswith((MM, ADDMM, MM_SCALED)) for label in routed_mm) and len(routed_mm) >= 6, routed_mm
        gemm_shaders = {d.shader for d in runner.executor.dispatches
                        if d.name in runner.executor.tensor_core_ops and d.shader.startswith("coopmat_")
                        and d.shader != "coopmat_absmax"}
        assert {s.split("@")[0] for s in gemm_shaders} == {"coopmat_linear_q4gsw", "coopmat_linear_q4gsw_backward",
                                                          "coopmat_mm"}, gemm_shaders
        assert all("COOPMAT_EMULATE" in s for s in gemm_shaders), gemm_shaders
        assert f"{len(runner.executor.tensor_core_ops)} of" in runner.gemm_report()
        assert "emulated" in runner.gemm_report()
        tc_loss = _first_loss(runner)
    reference, bound, routed = _float64_loss_and_fp16_bound(model, _batch())
    assert routed == 3, "mlp-lora has two layers and the head, each a LoRA q4gsw linear"
    tolerance = bound + LOSS_RTOL * abs(reference)
    error = abs(tc_loss - reference)
    print(f"fp16-tc step-1 loss {tc_loss!r} vs float64 {reference!r}: |err| {error:.2e}, first-order bound "
          f"{bound:.2e} (fp32 route: |err| {abs(fp32_loss - reference):.2e})")
    assert error <= tolerance, f"fp16-tc loss {tc_loss} is {error:.3e} from float64 {reference}, bound {tolerance:.3e}"
    assert bound < 1e-2 * abs(reference)  # the bound says something: far below a wrong product's ~1e-1
    assert abs(fp32_loss - reference) <= LOSS_RTOL * abs(reference)
    assert tc_loss != fp32_loss  # the step really ran the fp16-input kernels


def test_fp16_tc_without_tensor_cores_runs_the_fp32_kernels_bit_for_bit(vk_device, step_program):
    if coopmat_supported(vk_device.cooperative_matrix_properties):
        pytest.skip(f"{vk_device.name} has cooperative matrices: the fallback is not taken")
    path = step_program[0]
    with TrainingRunner.from_pte(path, vk_device, planner=plan_schedule) as fp32_runner:
        fp32_loss = _first_loss(fp32_runner)
    with TrainingRunner.from_pte(path, vk_device, planner=plan_schedule, precision=PRECISION_FP16_TC) as runner:
        assert runner.executor.tensor_core_ops == []
        assert "fp32 kernels" in runner.gemm_report() and "lists no 16x16x16" in runner.gemm_report()
        assert _first_loss(runner) == fp32_loss


def test_a_program_not_allowing_the_policy_is_refused_at_load_by_field(vk_device, step_program):
    with TrainingRunner.from_pte(step_program[0], vk_device, planner=plan_schedule) as runner:
        graph = copy.copy(runner.graph)
    graph.metadata = {k: v for k, v in graph.metadata.items() if k != METADATA_GEMM_PRECISIONS}
    with pytest.raises(PrecisionPolicyError, match=f"allows GEMM precision fp32 \\(blob metadata "
                                                   f"'{METADATA_GEMM_PRECISIONS}'\\), not 'fp16-tc'"):
        GraphExecutor(vk_device, graph, planned(vk_device, graph, precision=PRECISION_FP16_TC))


def test_train_takes_the_precision_flag_and_reports_the_choice(vk_device, step_program, tmp_path, capsys):
    data = tmp_path / "ids.npy"
    np.save(data, np.arange(400) % VOCAB)
    parser = add_train_arguments(argparse.ArgumentParser())
    assert parser.parse_args([str(step_program[0]), "--steps", "1"]).precision == PRECISION_AUTO
    args = parser.parse_args([str(step_program[0]), "--steps", "1", "--data", str(data), "--no-progress",
                              "--precision", PRECISION_FP16_TC])
    assert run_train(args, vk_device) == 0
    startup = [line for line in capsys.readouterr().err.splitlines() if "GEMM precision" in line]
    expected = "tensor cores" if coopmat_supported(vk_device.cooperative_matrix_properties) else "fp32 kernels"
    assert len(startup) == 1 and "GEMM precision fp16-tc" in startup[0] and expected in startup[0], startup


def test_inspect_reports_the_precisions_the_program_allows(step_program, capsys):
    from vktrain import cli

    assert cli.main(["inspect", str(step_program[0])]) == 0
    assert "GEMM precisions allowed: fp32, fp16-tc" in capsys.readouterr().out
    assert cli.main(["inspect", "--json", str(step_program[0])]) == 0
    (delegate,) = json.loads(capsys.readouterr().out)["delegates"]
    assert delegate["gemm_precisions"] == list(PRECISIONS)


def test_fp16_tc_runs_the_tied_lm_head_on_tensor_cores_and_step_one_matches_float64_within_the_bound(
        vk_device, tmp_path):
    """tiny-llama (tied head, a plain mm over the embedding): fp16-tc routes the head's logits
    h @ W^T (and d_h = d_logits @ W) to coopmat_mm, and the step-1 loss stays within the first-order
    bound of every routed forward GEMM, the head's with its operand scales (module docstring)."""
    model = build_model("tiny-llama")
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets="*_proj", group_size=32, seed=0))
    path = tmp_path / "tiny_llama_step.pte"
    path.write_bytes(lower_to_pte(export_training_step(model, (BATCH, SEQ))))
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(7)
    token_ids = torch.randint(0, vocab, (BATCH, SEQ), generator=generator)
    labels = torch.randint(0, vocab, (BATCH, SEQ), generator=generator)
    labels[1, -3:] = -1
    with TrainingRunner.from_pte(path, vk_device, planner=plan_schedule, precision=PRECISION_FP16_TC, emulate_tensor_cores=True) as runner:
        executor = runner.executor
        shapes = {label: [executor.graph.tensor(v).shape for v in executor.ops[int(label.split(":")[0])].args[:2]]
                  for label in executor.tensor_core_ops if label.endswith(MM)}
        dim = model.config.dim
        head = [label for label, (a, b) in shapes.items() if list(a) == [BATCH * SEQ, dim] and list(b) == [dim, vocab]]
        d_h = [label for label, (a, b) in shapes.items() if list(a) == [BATCH * SEQ, vocab] and list(b) == [vocab, dim]]
        assert len(head) == 1 and len(d_h) == 1, shapes
        head_shader = {d.shader for d in executor.dispatches if d.name == head[0]}
        assert head_shader == {f"coopmat_mm@AB_SCALE+B_TRANSPOSED+BM=64+COOPMAT_EMULATE+SUBGROUP_SIZE={vk_device.subgroup_size}"
                               if vk_device.subgroup_size != 32 else
                               "coopmat_mm@AB_SCALE+B_TRANSPOSED+BM=64+COOPMAT_EMULATE"}, head_shader
        loss = runner.step(token_ids.numpy(), labels.numpy(), HPARAMS)
    reference, bound, routed = _float64_loss_and_fp16_bound(model, (token_ids, labels), head="lm_head")
    assert routed == 7 * model.config.n_layers + 1
    error = abs(loss - reference)
    print(f"tiny-llama fp16-tc step-1 loss {loss!r} vs float64 {reference!r}: |err| {error:.2e}, bound {bound:.2e}")
    assert error <= bound + LOSS_RTOL * abs(reference)
    # The head's term dominates the bound (S_e = sum_k |h_k w_k| over the unit-variance embedding, and
    # every |d loss / d logit| counted as if all roundings pushed one way): 1.6% of the loss here, the
    # measured error ~1e-4. A wrong layout or tile of the head gives unrelated logits, moving the loss
    # by a sizeable fraction of itself.
    assert bound < 2e-2 * abs(reference)
