"""A LoRA linear's up-product in its base GEMM's epilogue, planned (vktrain/backend/kernel_planning/rank_epilogue.py).

Pass level: the gemm_epilogue pass moves the forward's base GEMM next to the addmm that adds its adapter's
product (the backward's already moves there), so only views lie between the two. Program level, on lavapipe: a
tiny-llama LoRA training step (rank 16) on the emulated tensor-core route planned with and without the rank
epilogues gives bit-identical losses and state over several steps, with one dispatch fewer per fused pair and
every fused dispatch a base GEMM's RANK_EPILOGUE variant, also for a program exported as before that move (the
adapter's chain between the forward's pairs: the fused dispatch runs in the addmm's place); on the routes without tensor cores the plan is the
same dispatch for dispatch with the switch on or off.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from vktrain.backend.kernel_planning import plan_schedule
from vktrain.backend.kernel_planning.kernels.coopmat import GemmRoute, RankEpilogue
from vktrain.backend.kernel_planning.lowering_context import OpContext, RankProduct, TensorArg
from vktrain.backend.kernel_planning.op_lowering import _rank_args
from vktrain.backend.kernel_planning.rank_epilogue import rank_epilogue_pairs, rank_product
from vktrain.backend.passes import compile_graph
from vktrain.backend.passes import gemm_epilogue
from vktrain.backend.passes.gemm_epilogue import fuse_gemm_epilogues
from vktrain.contract import PRECISION_FP16, PRECISION_FP16_TC, PRECISION_FP32
from vktrain.export import export_training_step, lower_to_pte
from vktrain.lora import LoRAConfig, apply_lora
from vktrain.models import build_model
from vktrain.runtime.program.runner import TrainingRunner
from vktrain.serialization import graph as vk
from vktrain.serialization.dispatch import BufferBinding, Dispatch
from vktrain.serialization.pte import PteFile
from vktrain.serialization.verify import load_delegate_graph
from vktrain.serialization.strided_view import StridedView

from _helpers import next_token_batches, planned, train_recorded

F32 = vk.DType.FLOAT32
LINEAR_Q4GSW = "vktrain.linear_q4gsw.default"
HPARAMS = np.array([1e-2, 0.9, 0.999, 1e-8, 0.01], np.float32)


def test_the_forward_base_gemm_moves_next_to_its_addmm():
    """y = add(linear_q4gsw(x), view(mm(hs, bt))) with the adapter's mm written after the base: the base op
    moves to just before the addmm (only the addend's view between them)."""
    g = vk.VkGraph()

    def tensor(shape, name):
        return g.add_value(vk.TensorValue(F32, shape, name=name))

    x, hs, bt = tensor((2, 3, 4), "x"), tensor((6, 2), "hs_in"), tensor((2, 8), "bt")
    weights, scales = tensor((8, 2), "w"), tensor((1, 8), "s")  # placeholders: the passes read no weight
    g.inputs = [x, hs, bt, weights, scales]
    base = tensor((2, 3, 8), "base")
    g.ops.append(vk.OpCall(LINEAR_Q4GSW, (x, weights, scales, g.add_value(vk.IntValue(4)),
                                          g.add_value(vk.NullValue())), (base,)))
    h = tensor((6, 2), "h")
    g.ops.append(vk.OpCall("aten.neg.default", (hs,), (h,)))  # the adapter's chain, after the base
    m = tensor((6, 8), "m")
    g.ops.append(vk.OpCall("aten.mm.default", (h, bt), (m,)))
    q = tensor((2, 3, 8), "q")
    g.ops.append(vk.OpCall("aten.view_copy.default", (m, g.add_value(vk.IntListValue((2, 3, 8)))), (q,)))
    y = tensor((2, 3, 8), "y")
    g.ops.append(vk.OpCall("aten.add.Tensor", (base, q, g.add_value(vk.IntValue(1))), (y,)))
    g.outputs = [y]
    fuse_gemm_epilogues(g)
    assert [op.name for op in g.ops] == ["aten.neg.default", LINEAR_Q4GSW, "aten.view_copy.default",
                                         "aten.addmm.default", "aten.view_copy.default"]
    compile_graph(g)
    assert rank_epilogue_pairs(g) == {1: 3}


@pytest.fixture(scope="module")
def tiny_llama_step(tmp_path_factory):
    """The tiny-llama LoRA step's .pte, and one exported as before the forward's base GEMM moved next to its
    addmm (its adapter's chain between them: the fused dispatch then runs in the addmm's place)."""
    model = build_model("tiny-llama")
    torch.manual_seed(0)
    apply_lora(model, LoRAConfig(rank=16, alpha=32, seed=0))
    program = export_training_step(model, (2, 8))
    folder = tmp_path_factory.mktemp("rank_epilogue")
    path, unmoved = folder / "step.pte", folder / "step_unmoved.pte"
    path.write_bytes(lower_to_pte(program))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gemm_epilogue, "BASE_GEMMS", ("vktrain.linear_q4gsw_backward.default",))
        unmoved.write_bytes(lower_to_pte(program))
    return {"moved": path, "unmoved": unmoved}, model.vocab_size


@pytest.mark.parametrize("export", ["moved", "unmoved"])
def test_emulated_tensor_core_step_is_bit_identical_with_rank_epilogues(vk_device, tiny_llama_step, export):
    if vk_device.subgroup_size < 8:
        pytest.skip(f"{vk_device.name} has subgroups of {vk_device.subgroup_size} lanes; the emulated coopmat "
                    f"kernels need 8 or more (LP_NATIVE_VECTOR_WIDTH=128 gives 4)")
    paths, vocab = tiny_llama_step
    path = paths[export]
    pte = PteFile.load(path)
    _, graph = load_delegate_graph(pte, pte.execution_plan("forward"))
    dispatching = [any(not graph.tensor(v).is_view for v in graph.ops[k].outputs)
                   for i, j in rank_epilogue_pairs(graph).items() for k in range(i + 1, j)]
    assert any(dispatching) == (export == "unmoved")
    batches = next_token_batches((2, 8), vocab, 3, seed=3)
    options = dict(precision=PRECISION_FP16_TC, emulate_tensor_cores=True)
    (_, dispatches, losses, state), (_, dispatches_u, losses_u, state_u) = (
        train_recorded(path, vk_device, batches, HPARAMS, functools.partial(plan_schedule, rank_epilogues=flag),
                       **options) for flag in (True, False))
    shaders, shaders_u = [s for s, _ in dispatches], [s for s, _ in dispatches_u]
    assert losses == losses_u, (losses, losses_u)
    assert state.keys() == state_u.keys()
    for name in state:
        assert state[name].tobytes() == state_u[name].tobytes(), f"state {name} differs"
    fused = [s for s in shaders if "RANK_EPILOGUE" in s]
    assert {s.split("@")[0] for s in fused} == {"coopmat_linear_q4gsw", "coopmat_linear_q4gsw_backward"}
    assert "RANK_EPILOGUE" not in "".join(shaders_u)
    # Each fused pair is one dispatch fewer: the addmm's, nothing else.
    addmm = sum(s.startswith("matmul@HAS_BIAS=1") for s in shaders_u)
    assert len(shaders_u) - len(shaders) == len(fused) == addmm - sum(s.startswith("matmul@HAS_BIAS=1") for s in shaders)
    forward = sum(s.startswith("coopmat_linear_q4gsw@") for s in fused)
    assert forward and len(fused) > forward  # both directions, in either export
    print(f"{export}: {len(fused)} of {addmm} addmm dispatches fused ({forward} forward); losses {losses}")


@pytest.mark.parametrize("precision", [PRECISION_FP32, PRECISION_FP16])
def test_routes_without_tensor_cores_plan_the_same_dispatches(vk_device, tiny_llama_step, precision):
    path = tiny_llama_step[0]["moved"]
    with TrainingRunner.from_pte(path, vk_device, planner=plan_schedule) as runner:
        graph = runner.executor.graph
    assert rank_epilogue_pairs(graph), "the step has base GEMM + addmm pairs to fuse"
    on, off = (planned(vk_device, graph, precision=precision, rank_epilogues=flag) for flag in (True, False))
    assert on.dispatches == off.dispatches and on.buffers == off.buffers


def _contexts(y_buffer: str, bt_view=None):
    """A base GEMM (x [8, 32] -> base [8, 16]) and an addmm(base, hs [8, 4], Bt [4, 16]) writing y in `y_buffer`."""
    def arg(value_id, buffer, shape, view=None):
        return TensorArg(value_id, BufferBinding(buffer, 0, 4 * int(np.prod(shape))), shape, "float32", view=view)

    base = OpContext(0, vk.OpCall(LINEAR_Q4GSW, (), ()), [arg(0, "x", (8, 32)), arg(1, "w", (16, 4)),
                                                          arg(2, "s", (1, 16)), 32, None],
                     [arg(3, "base", (8, 16))], "0:base", lambda nbytes, purpose: None)
    addmm = OpContext(2, vk.OpCall("aten.addmm.default", (), ()),
                      [arg(4, "base", (8, 16)), arg(5, "hs", (8, 4)), arg(6, "bt", (4, 16), bt_view), 1.0, 1.0],
                      [arg(7, y_buffer, (8, 16))], "2:addmm", lambda nbytes, purpose: None)
    return base, addmm


@pytest.mark.parametrize("shader, fused", [("matmul@HAS_BIAS=1+VEC4_C", True),
                                           ("matmul@HAS_BIAS=1+CPU_REGISTER_TILES+A_PAIRS", True),
                                           ("matmul@HAS_BIAS=1+VEC4_C+FP16", False),
                                           ("coopmat_mm@AB_SCALE+ADDEND", False),
                                           ("matmul_thin@HAS_BIAS=1", False)])
def test_only_an_fp32_matmul_addmm_is_taken_into_the_epilogue(shader, fused):
    base, addmm = _contexts("y")
    product = rank_product(base, addmm, [Dispatch(shader, 1)])
    assert (product is not None) == fused
    if fused:
        assert product.out == addmm.outputs[0].binding and product.epilogue.fma == ("CPU_REGISTER_TILES" in shader)
    assert rank_product(base, addmm, [Dispatch(shader, 1)] * 2) is None  # split-K, windows: two dispatches


def test_an_output_sharing_bytes_with_what_the_fused_dispatch_reads_stays_unfused():
    """The fused dispatch runs where the base GEMM ran and reads its inputs, which the memory plan may have
    let the addmm's output reuse once the base GEMM was done (a layer's d_out, last read by its base backward)."""
    plan = [Dispatch("matmul@HAS_BIAS=1+VEC4_C", 1)]
    for overlapping in ("x", "hs", "bt"):
        assert rank_product(*_contexts(overlapping), plan) is None, overlapping
    assert rank_product(*_contexts("y"), plan) is not None
    transposed = StridedView.contiguous((16, 4)).transpose(0, 1)  # B^T as the forward reads it
    assert rank_product(*_contexts("y", transposed), plan).epilogue.bt_view == transposed


def test_the_base_plan_takes_the_product_only_unsplit_in_a_prebuilt_tiling():
    """On the tensor cores (H200 gates): the Llama-sized base GEMMs take it, a 128-token one (split-K) does not, nor
    does the WebGPU route's f16 body; the emulated route takes it at any size within lavapipe's loop budget."""
    product = RankProduct(BufferBinding("y"), RankEpilogue("hs", StridedView.contiguous((2048, 16)), "bt",
                                                           StridedView.contiguous((16, 2048))))

    def takes(route, m, n, reduction, kernel="coopmat_linear_q4gsw"):
        base, _ = _contexts("y")
        base.gemm, base.rank_product = route, product
        return _rank_args(base, kernel, m, n, reduction) == {"out": product.out, "rank_epilogue": product.epilogue}

    gpu = GemmRoute(PRECISION_FP16_TC, True, "test")
    assert takes(gpu, 2048, 2048, 2048) and takes(gpu, 2048, 2048, 8192, "coopmat_linear_q4gsw_backward")
    assert gpu.default_split_k("coopmat_linear_q4gsw", 128, 2048, 8192) > 1 and not takes(gpu, 128, 2048, 8192)
    assert not takes(GemmRoute(PRECISION_FP16_TC, True, "test", wgsl=True), 2048, 2048, 2048)
    emulated = GemmRoute(PRECISION_FP16_TC, True, "test", emulate=True, subgroup_size=8, min_workgroups=1)
    assert takes(emulated, 70, 132, 64) and not takes(emulated, 70, 132, 1 << 16)
