"""The gemm_epilogue pass (vktrain/backend/passes/gemm_epilogue.py): add(p, mm(a, b)) becomes
addmm(p, a, b), with the same bits.

Pass level, on hand-built graphs: what fuses (through views, either operand order, with the op writing
p moved ahead of the mm) and what must not (the product read twice, alpha != 1, p depending on something
written after the mm, broadcast shapes, a constant weight). Program level, on lavapipe: the training
step exported with and without the pass (everything else equal) gives bit-identical losses and state
over several steps, on tiny-llama (fp32 and emulated fp16-tc routes: coopmat_mm's ADDEND variant) and
on a LoRA MLP of Llama-3.2-1B's hidden size (2048) with rank 16, with exactly one dispatch fewer per
fused add.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from vktrain.backend.passes import compile_graph
from vktrain.backend.passes.gemm_epilogue import fuse_gemm_epilogues
from vktrain.backend.passes.views import SHAPE_ONLY_VIEWS
from vktrain.contract import PRECISION_FP16_TC
from vktrain.lora import LoRAConfig, apply_lora
from vktrain.models import build_model
from vktrain.runtime.program.runner import TrainingRunner
from vktrain.serialization import graph as vk
from vktrain.backend.kernel_planning import plan_schedule

from _helpers import next_token_batches, ptes_with_and_without, train_recorded

F32 = vk.DType.FLOAT32
MM, ADDMM, ADD, VIEW = "aten.mm.default", "aten.addmm.default", "aten.add.Tensor", "aten.view_copy.default"
NEG = "aten.neg.default"


class _Builder:
    """A VkGraph under construction: y = add(p, view(mm(a_rows, b))) and variations."""

    def __init__(self) -> None:
        self.graph = vk.VkGraph()

    def tensor(self, shape, name, dtype=F32) -> int:
        return self.graph.add_value(vk.TensorValue(dtype, shape, name=name))

    def input(self, shape, name) -> int:
        value = self.tensor(shape, name)
        self.graph.inputs.append(value)
        return value

    def op(self, name, args, shape, out_name) -> int:
        out = self.tensor(shape, out_name)
        self.graph.ops.append(vk.OpCall(name, tuple(args), (out,)))
        return out

    def scalar(self, value) -> int:
        return self.graph.add_value(vk.IntValue(value) if isinstance(value, int) else vk.DoubleValue(value))

    def view(self, value, shape, name) -> int:
        return self.op(VIEW, (value, self.graph.add_value(vk.IntListValue(shape))), shape, name)

    def mm(self, a, b, name) -> int:
        shape = (self.graph.tensor(a).shape[0], self.graph.tensor(b).shape[1])
        return self.op(MM, (a, b), shape, name)

    def add(self, x, y, name, alpha=1) -> int:
        return self.op(ADD, (x, y, self.scalar(alpha)), self.graph.tensor(x).shape, name)


def _lora_update_graph(*, p_first=True, alpha=1, hoisted_p=False):
    """y [2, 3, 8] = add(p, view(mm(a [6, 4], b [4, 8]))): p an input, or (hoisted_p) neg(x) written after
    the mm from an input."""
    g = _Builder()
    a, b = g.input((6, 4), "a"), g.input((4, 8), "b")
    p = g.input((2, 3, 8), "x" if hoisted_p else "p")
    m = g.mm(a, b, "m")
    q = g.view(m, (2, 3, 8), "q")
    if hoisted_p:
        p = g.op(NEG, (p,), (2, 3, 8), "p")
    y = g.add(p, q, "y", alpha) if p_first else g.add(q, p, "y", alpha)
    g.graph.outputs = [y]
    return g, dict(a=a, b=b, p=p, m=m, q=q, y=y)


def _names(graph):
    return [op.name for op in graph.ops]


@pytest.mark.parametrize("p_first", [True, False], ids=["add(p, q)", "add(q, p)"])
def test_an_add_of_a_viewed_product_becomes_addmm_of_the_viewed_addend(p_first):
    g, v = _lora_update_graph(p_first=p_first)
    fuse_gemm_epilogues(g.graph)
    view_p, addmm, view_y = g.graph.ops
    assert _names(g.graph) == [VIEW, ADDMM, VIEW]
    assert view_p.args[0] == v["p"] and g.graph.tensor(view_p.outputs[0]).shape == (6, 8)
    assert addmm.args[:3] == (view_p.outputs[0], v["a"], v["b"]) and addmm.outputs == (v["m"],)
    assert [vk.decode_scalar(g.graph.values[i]) for i in addmm.args[3:]] == [1, 1]  # beta, alpha
    assert view_y.args[0] == v["m"] and view_y.outputs == (v["y"],)  # the add's output, written by the view
    compile_graph(g.graph)  # the storage passes take the result: both views are views
    assert all(g.graph.tensor(op.outputs[0]).is_view for op in (view_p, view_y))


def test_a_two_dimensional_product_is_written_by_the_addmm_itself():
    g = _Builder()
    a, b, p = g.input((6, 4), "a"), g.input((4, 8), "b"), g.input((6, 8), "p")
    y = g.add(g.mm(a, b, "m"), p, "y")
    g.graph.outputs = [y]
    fuse_gemm_epilogues(g.graph)
    (addmm,) = g.graph.ops
    assert addmm.name == ADDMM and addmm.args[:3] == (p, a, b) and addmm.outputs == (y,)


def test_the_op_writing_the_addend_after_the_mm_moves_before_it():
    g, v = _lora_update_graph(hoisted_p=True)
    neg = g.graph.ops[2]
    fuse_gemm_epilogues(g.graph)
    assert _names(g.graph) == [NEG, VIEW, ADDMM, VIEW]
    assert g.graph.ops[0] is neg and g.graph.ops[1].args[0] == v["p"]


def test_a_lazily_transposed_weight_stays_a_strided_view_of_the_addmm():
    """The LoRA update reads permute(lora_B): after the pass the addmm reads it in place, as the mm did."""
    g = _Builder()
    x, lora_b, p = g.input((6, 4), "x"), g.input((8, 4), "lora_B"), g.input((6, 8), "p")
    b_t = g.op("aten.permute_copy.default", (lora_b, g.graph.add_value(vk.IntListValue((1, 0)))), (4, 8), "b_t")
    y = g.add(p, g.mm(x, b_t, "m"), "y")
    g.graph.outputs = [y]
    compile_graph(g.graph)
    assert _names(g.graph) == ["aten.permute_copy.default", ADDMM]
    assert g.graph.tensor(b_t).is_view and g.graph.tensor(b_t).view_strides == (1, 4)


def _unchanged(graph_builder) -> None:
    before = list(graph_builder.graph.ops)
    fuse_gemm_epilogues(graph_builder.graph)
    assert graph_builder.graph.ops == before


def test_a_product_read_by_another_op_is_not_fused():
    g, v = _lora_update_graph()
    g.graph.outputs.append(g.op(NEG, (v["q"],), (2, 3, 8), "other"))
    _unchanged(g)
    g, v = _lora_update_graph()
    g.graph.outputs.append(v["m"])  # the mm's own output read after the step
    _unchanged(g)


@pytest.mark.parametrize("alpha", [2, 0.5, -1])
def test_an_add_with_alpha_other_than_one_is_not_fused(alpha):
    _unchanged(_lora_update_graph(alpha=alpha)[0])


def test_an_addend_depending_on_something_written_after_the_mm_is_not_fused():
    g = _Builder()
    a, b, c = g.input((6, 4), "a"), g.input((4, 8), "b"), g.input((4, 8), "c")
    m = g.mm(a, b, "m")
    later = g.mm(a, c, "later")               # written after m ...
    p = g.op(NEG, (later,), (6, 8), "p")      # ... so p cannot move ahead of m
    g.graph.outputs = [g.add(p, m, "y"), later]
    _unchanged(g)


@pytest.mark.parametrize("p_shape", [(8,), (1, 8), (6, 1)])
def test_a_broadcast_addend_is_not_fused(p_shape):
    g = _Builder()
    a, b, p = g.input((6, 4), "a"), g.input((4, 8), "b"), g.input(p_shape, "p")
    g.graph.outputs = [g.op(ADD, (g.mm(a, b, "m"), p, g.scalar(1)), (6, 8), "y")]
    _unchanged(g)


def test_a_product_of_a_constant_weight_is_not_fused():
    """A frozen weight read only through aten.mm may be held as Q8_0 later (passes/q8_0_weights.py)."""
    g = _Builder()
    a, p = g.input((6, 4), "a"), g.input((6, 8), "p")
    w = g.graph.add_constant_tensor(np.ones((4, 8), np.float32), name="w")
    g.graph.outputs = [g.add(p, g.mm(a, w, "m"), "y")]
    _unchanged(g)


def test_a_sum_of_two_products_fuses_one_and_keeps_the_other_an_operand():
    """add(mm1, mm2): one product is the other's addend; nothing is re-associated."""
    g = _Builder()
    a, b, c = g.input((6, 4), "a"), g.input((4, 8), "b"), g.input((4, 8), "c")
    m1, m2 = g.mm(a, b, "m1"), g.mm(a, c, "m2")
    g.graph.outputs = [g.add(m1, m2, "y")]
    fuse_gemm_epilogues(g.graph)
    assert _names(g.graph) == [MM, ADDMM] and g.graph.ops[1].args[0] == m1


# ----------------------------------------------------------------------------------- the training step
HPARAMS = np.array([1e-2, 0.9, 0.999, 1e-8, 0.01], np.float32)


def _assert_same_bits(fused, unfused):
    (ops, dispatches, losses, state), (ops_u, dispatches_u, losses_u, state_u) = fused, unfused
    shaders, shaders_u = [s for s, _ in dispatches], [s for s, _ in dispatches_u]
    assert losses == losses_u, (losses, losses_u)
    assert state.keys() == state_u.keys()
    for name in state:
        assert state[name].dtype == state_u[name].dtype and state[name].shape == state_u[name].shape, name
        assert state[name].tobytes() == state_u[name].tobytes(), f"state {name} differs"
    fused_adds = ops.count(ADDMM)
    assert fused_adds > 0 and ops_u.count(ADDMM) == 0
    assert ops_u.count(ADD) - ops.count(ADD) == fused_adds
    assert len(shaders_u) - len(shaders) == fused_adds, "each fused add is one dispatch fewer, nothing else"
    print(f"{fused_adds} adds fused: {len(shaders)} dispatches per step instead of {len(shaders_u)}; "
          f"losses {losses}")
    return shaders


def _no_add_reads_a_product(path, device):
    """After the pass no add reads an mm output (directly or through views) that it could have absorbed."""
    with TrainingRunner.from_pte(path, device, planner=plan_schedule) as runner:
        graph = runner.executor.graph
    producer = {out: op for op in graph.ops for out in op.outputs}
    readers: dict[int, int] = {}
    for op in graph.ops:
        for arg in op.args:
            readers[arg] = readers.get(arg, 0) + 1
    for op in graph.ops:
        if op.name != ADD:
            continue
        for value in op.args[:2]:
            source = producer.get(value)
            while source is not None and source.name in SHAPE_ONLY_VIEWS:
                source = producer.get(source.args[0])
            assert source is None or source.name != MM or readers.get(source.outputs[0], 0) > 1 \
                or readers.get(value, 0) > 1, f"an add still reads the product {graph.tensor(value).name}"


@pytest.fixture(scope="module")
def tiny_llama_programs(tmp_path_factory):
    model = build_model("tiny-llama")
    torch.manual_seed(0)
    # A rank past STARVED_REDUCTION (kernels/coopmat_tiling.py): the fused u @ B^T + base products then reduce
    # over enough to take the tensor cores (coopmat_mm's ADDEND variant) on the fp16-tc route; at a rank of
    # 64 or less they keep matmul.slang's bias epilogue.
    apply_lora(model, LoRAConfig(rank=68, alpha=136, seed=0))
    return ptes_with_and_without(fuse_gemm_epilogues, model, (2, 8), tmp_path_factory.mktemp("tiny_llama")), model.vocab_size


def test_tiny_llama_step_is_bit_identical_with_fused_epilogues(vk_device, tiny_llama_programs):
    (fused, unfused), vocab = tiny_llama_programs
    batches = next_token_batches((2, 8), vocab, 3, seed=5)
    _assert_same_bits(train_recorded(fused, vk_device, batches, HPARAMS), train_recorded(unfused, vk_device, batches, HPARAMS))
    _no_add_reads_a_product(fused, vk_device)


def test_tiny_llama_fp16_tc_step_is_bit_identical_with_the_coopmat_addend(vk_device, tiny_llama_programs):
    """Emulated tensor cores: every routed mm runs coopmat_mm, the fused ones its ADDEND variant."""
    if vk_device.subgroup_size < 8:
        pytest.skip(f"{vk_device.name} has subgroups of {vk_device.subgroup_size} lanes; the emulated coopmat "
                    f"kernels need 8 or more (LP_NATIVE_VECTOR_WIDTH=128 gives 4)")
    (fused, unfused), vocab = tiny_llama_programs
    batches = next_token_batches((2, 8), vocab, 2, seed=5)
    options = dict(precision=PRECISION_FP16_TC, emulate_tensor_cores=True)
    shaders = _assert_same_bits(train_recorded(fused, vk_device, batches, HPARAMS, **options),
                                train_recorded(unfused, vk_device, batches, HPARAMS, **options))
    assert any(s.startswith("coopmat_mm@") and "ADDEND" in s for s in shaders), sorted(set(shaders))


def test_a_llama_sized_lora_mlp_step_is_bit_identical_with_fused_epilogues(vk_device, tmp_path):
    """Hidden size 2048 (Llama-3.2-1B's), LoRA rank 16 on every linear, 2 x 32 tokens."""
    vocab = 64
    model = build_model("mlp-lora", dim=2048, hidden=2048, vocab_size=vocab, n_layers=1, activation="relu")
    apply_lora(model, LoRAConfig(rank=16, alpha=32.0, targets="*", group_size=32, seed=0))
    fused, unfused = ptes_with_and_without(fuse_gemm_epilogues, model, (2, 32), tmp_path)
    batches = next_token_batches((2, 32), vocab, 3, seed=5)
    _assert_same_bits(train_recorded(fused, vk_device, batches, HPARAMS), train_recorded(unfused, vk_device, batches, HPARAMS))
