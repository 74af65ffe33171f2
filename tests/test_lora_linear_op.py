"""The one-op LoRA linear (vktrain.lora_linear_q4gsw + its backward) and the backend pass that writes it
out (vktrain/backend/passes/lora_linear.py).

References: the unfused module formula `linear_q4gsw(x) + ((x @ A.t()) * scaling) @ B.t()` under torch's
own autograd in float64, and for the lowered program the delegate that the unfused module exports to:
the expanded program must be it op for op (names, argument wiring, storage, memory plan), so the
runtime runs exactly the kernels it ran before the op existed."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from test_ops import random_q4gsw
from vktrain.opdefs.runtime_ops import LORA_LINEAR_BACKWARD
from vktrain.backend.passes.lora_linear import expand_lora_linears
from vktrain.export import export_training_step, lower_to_pte
from vktrain.lora import LoRAConfig, LoRAQ4Linear, apply_lora
from vktrain.models import build_model
from vktrain.opdefs import TensorMeta, infer_outputs
from vktrain.quant import padded_k
from vktrain.serialization.pte import PteFile
from vktrain.serialization import graph as vk
from vktrain.serialization.blob import deserialize_blob

N, K, R, GROUP = 12, 20, 3, 4
SCALING = 16.0 / 3


def example_calls():
    weights, scales = random_q4gsw(N, K, GROUP, seed=0)
    gen = torch.Generator().manual_seed(1)
    x, lora_a, lora_b = (torch.randn(*shape, generator=gen) for shape in ((2, 3, K), (R, K), (N, R)))
    return {
        "lora_linear_q4gsw": (x, lora_a, lora_b, SCALING, x.clone(), weights, scales, GROUP, torch.randn(N)),
        "lora_linear_q4gsw_backward": (torch.randn(2, 3, N), x, lora_a, lora_b, SCALING, weights, scales, GROUP),
    }


def _unfused(x, lora_a, lora_b, scaling, base_x, weights, scales, group_size, bias=None):
    base = torch.ops.vktrain.linear_q4gsw(base_x, weights, scales, group_size, bias)
    return base + ((x @ lora_a.t()) * scaling) @ lora_b.t()


@pytest.mark.parametrize("lead", [(2, 3), (5,)])
def test_forward_and_gradients_equal_the_unfused_formula_in_float64(lead):
    weights, scales = random_q4gsw(N, K, GROUP, seed=2)
    gen = torch.Generator().manual_seed(3)
    x, base_x, lora_a, lora_b, bias = (torch.randn(*shape, generator=gen, dtype=torch.float64, requires_grad=True)
                                       for shape in (lead + (K,), lead + (K,), (R, K), (N, R), (N,)))
    d_out = torch.randn(lead + (N,), generator=gen, dtype=torch.float64)
    inputs = (x, lora_a, lora_b, base_x, bias)
    fused = torch.ops.vktrain.lora_linear_q4gsw(x, lora_a, lora_b, SCALING, base_x, weights, scales, GROUP, bias)
    expected = _unfused(x, lora_a, lora_b, SCALING, base_x, weights, scales, GROUP, bias)
    torch.testing.assert_close(fused, expected, rtol=1e-13, atol=1e-13)
    for got, want in zip(torch.autograd.grad(fused, inputs, d_out), torch.autograd.grad(expected, inputs, d_out)):
        torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)


def test_gradcheck():
    weights, scales = random_q4gsw(N, K, GROUP, seed=4)
    gen = torch.Generator().manual_seed(5)
    x, base_x, lora_a, lora_b = (torch.randn(*shape, generator=gen, dtype=torch.float64, requires_grad=True)
                                 for shape in ((2, 2, K), (2, 2, K), (R, K), (N, R)))
    assert torch.autograd.gradcheck(
        lambda x, a, b, bx: torch.ops.vktrain.lora_linear_q4gsw(x, a, b, SCALING, bx, weights, scales, GROUP),
        (x, lora_a, lora_b, base_x))


@pytest.mark.parametrize("name", ["lora_linear_q4gsw", "lora_linear_q4gsw_backward"])
def test_opcheck(name):
    torch.library.opcheck(getattr(torch.ops.vktrain, name).default, example_calls()[name],
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("change, fragment", [
    ({"lora_B": TensorMeta((N, R + 1), "float32")}, f"lora_B must have shape [N, r] = [{N}, {R}]"),
    ({"lora_A": TensorMeta((R, K + 4), "float32")}, f"lora_A must have shape [r, K] with r >= 1 and K = {K}"),
    ({"base_x": TensorMeta((2, 4, K), "float32")}, "base_x"),
    ({"x": TensorMeta((K,), "float32"), "base_x": TensorMeta((K,), "float32")}, "x must have at least 2 dims"),
])
def test_definition_refuses_inconsistent_shapes(change, fragment):
    args = {"x": TensorMeta((2, 3, K), "float32"), "lora_A": TensorMeta((R, K), "float32"),
            "lora_B": TensorMeta((N, R), "float32"), "scaling": SCALING, "base_x": TensorMeta((2, 3, K), "float32"),
            "weights": TensorMeta((N, padded_k(K) // 2), "uint8"), "scales": TensorMeta((K // GROUP, N), "float32"),
            "group_size": GROUP, "bias": None}
    refusal = infer_outputs("vktrain.lora_linear_q4gsw.default", {**args, **change})
    assert isinstance(refusal, str) and fragment in refusal, refusal


# ---- the lowered program: the expansion is the unfused module's delegate, op for op ---------------------------

def _unfused_forward(self, x):
    base = torch.ops.vktrain.linear_q4gsw(x, self.weights, self.scales, self.group_size, self.bias)
    return base + ((x @ self.lora_A.t()) * self.scaling) @ self.lora_B.t()


class _RowsModel(nn.Module):
    """Token rows as 2-D [B*S, D] activations (a 2-D LoRA input, whose chain has no views), linears with bias."""

    def __init__(self) -> None:
        super().__init__()
        self.vocab_size, dim = 64, 32
        self.embed = nn.Embedding(self.vocab_size, dim)
        self.up = nn.Linear(dim, 64)
        self.down = nn.Linear(64, dim)
        self.head = nn.Linear(dim, self.vocab_size, bias=False)

    def get_output_embeddings(self):
        return self.head

    def loss(self, token_ids, labels, n_valid):
        h = self.embed(token_ids).reshape(-1, self.embed.embedding_dim)
        h = self.down(torch.relu(self.up(h)))
        loss, _ = torch.ops.vktrain.fused_ce(self.head(h), labels.reshape(-1), n_valid)
        return loss


def _delegate(model, batch, monkeypatch, unfused: bool) -> vk.VkGraph:
    with monkeypatch.context() as patch:
        if unfused:
            patch.setattr(LoRAQ4Linear, "forward", _unfused_forward)
        program = export_training_step(model, batch)
    targets = {node.target for node in program.graph.nodes if node.op == "call_function"}
    assert (torch.ops.vktrain.lora_linear_q4gsw_backward.default in targets) is not unfused
    return deserialize_blob(bytes(PteFile.from_bytes(lower_to_pte(program)).delegates[0].data))


def _canonical(graph: vk.VkGraph):
    """The graph with value ids replaced by what they are: op outputs by (op index, output index), inputs by
    position, constants and state by name; every tensor with its storage record."""
    producer = {out: (i, j) for i, op in enumerate(graph.ops) for j, out in enumerate(op.outputs)}
    inputs = {value: i for i, value in enumerate(graph.inputs)}

    def value(value_id):
        v = graph.values[value_id]
        if isinstance(v, vk.ValueListValue):
            return "list", tuple(value(i) for i in v.items)
        if not isinstance(v, vk.TensorValue):
            return v
        where = (("op",) + producer[value_id] if value_id in producer else ("input", inputs[value_id])
                 if value_id in inputs else ("named", v.name))
        storage = value(v.storage_of) if v.storage_of not in (-1, value_id) else None
        data = graph.constant_array(value_id).tobytes() if v.constant_id >= 0 else None
        return (where, v.dtype, v.shape, v.layout, v.mem_obj_id, v.mem_offset, v.is_view, v.view_strides,
                v.view_offset, v.stored_dtype, storage, data)

    return ([(op.name, tuple(map(value, op.args)), tuple(map(value, op.outputs))) for op in graph.ops],
            [value(v) for v in graph.outputs], [(value(s.state_id), value(s.update_id)) for s in graph.mutable_state],
            graph.memory_objects)


@pytest.mark.parametrize("make_model, batch", [
    (lambda: build_model("tiny-llama"), (2, 8)),   # 3-D activations, x shared by q/k/v and gate/up, GQA
    (_RowsModel, (2, 4)),                          # 2-D activations, biases, ReLU
])
def test_expanded_program_is_the_unfused_modules_program(make_model, batch, monkeypatch):
    model = make_model()
    torch.manual_seed(0)
    apply_lora(model, LoRAConfig(rank=4, alpha=8))
    expected = _canonical(_delegate(model, batch, monkeypatch, unfused=True))
    actual = _canonical(_delegate(model, batch, monkeypatch, unfused=False))
    assert [op[0] for op in actual[0]] == [op[0] for op in expected[0]]
    for index, (got, want) in enumerate(zip(actual[0], expected[0])):
        assert got == want, f"op {index} ({want[0]}) differs"
    assert actual[1:] == expected[1:]


def test_a_backward_without_its_forward_recomputes_the_values_its_chain_reads():
    """A partition holding a LoRA linear's backward but not its forward (a program split between delegates)."""
    graph = vk.VkGraph()

    def tensor(shape, name, dtype=vk.DType.FLOAT32):
        return graph.add_value(vk.TensorValue(dtype, shape, name=name))
    args = (tensor((2, 2, N), "d_out"), tensor((2, 2, K), "x"), tensor((R, K), "lora_A"), tensor((N, R), "lora_B"),
            graph.add_value(vk.DoubleValue(SCALING)), tensor((N, padded_k(K) // 2), "weights", vk.DType.UINT8),
            tensor((K // GROUP, N), "scales"), graph.add_value(vk.IntValue(GROUP)))
    outputs = (tensor((2, 2, K), "bwd[0]"), tensor((R, K), "bwd[1]"), tensor((N, R), "bwd[2]"),
               tensor((2, 2, K), "bwd[3]"))
    graph.ops.append(vk.OpCall(LORA_LINEAR_BACKWARD, args, outputs))
    expand_lora_linears(graph)
    view, permute, mm, mul = "aten.view_copy.default", "aten.permute_copy.default", "aten.mm.default", "aten.mul.Tensor"
    recomputed = [permute, view, mm, view, mul, permute, view]  # permute(A), x rows, h, scaling * h, permute(B), rows
    chain = [view, permute, mm, permute, permute, mm, view, permute, mul, view, permute, mm, permute, permute, mm,
             view, permute, "vktrain.linear_q4gsw_backward.default"]
    assert [op.name for op in graph.ops] == recomputed + chain
    written = set()
    for op in graph.ops:  # every operand exists before it is read: an input, a scalar, or an earlier op's output
        tensors = [a for a in op.args if isinstance(graph.values[a], vk.TensorValue)]
        assert all(a in written or a < outputs[0] for a in tensors), op
        written.update(op.outputs)
    assert {out for op in graph.ops for out in op.outputs} >= set(outputs)
    hs_rows = graph.ops[len(recomputed) - 1].outputs[0]
    assert graph.ops[len(recomputed) + 2].args == (graph.ops[len(recomputed) + 1].outputs[0], hs_rows)  # d_B's mm


def test_the_step_traces_one_node_per_lora_linear_and_one_per_its_backward():
    model = build_model("tiny-llama")
    layers = apply_lora(model, LoRAConfig(rank=4, alpha=8)).replaced
    program = export_training_step(model, (1, 4))
    targets = [node.target for node in program.graph.nodes if node.op == "call_function"]
    assert targets.count(torch.ops.vktrain.lora_linear_q4gsw.default) == len(layers)
    assert targets.count(torch.ops.vktrain.lora_linear_q4gsw_backward.default) == len(layers)
