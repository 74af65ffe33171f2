"""The op registry (accept/refuse with reasons) and the VktrainPartitioner on real programs."""
from __future__ import annotations

import operator

import pytest
import torch
from executorch.exir.dialects._ops import ops as exir_ops
from torch import nn

import vktrain.ops  # noqa: F401
from vktrain.export import to_edge_lowered
from vktrain.partitioner import BACKEND_ID, VktrainPartitioner, check_node, get_op_features, op_key, supported_ops
from vktrain.partitioner.op_registry import W4X8
from vktrain.quant import padded_k, quantize

F32 = torch.float32


def _node(target, *args, out, **kwargs):
    """A call_function node whose tensor arguments are placeholders carrying `meta['val']`."""
    graph = torch.fx.Graph()
    fx_args = []
    for i, value in enumerate(args):
        if isinstance(value, torch.Tensor):
            placeholder = graph.placeholder(f"arg{i}")
            placeholder.meta["val"] = value
            fx_args.append(placeholder)
        else:
            fx_args.append(value)
    node = graph.create_node("call_function", target, tuple(fx_args), kwargs, name="node")
    node.meta["val"] = out
    return node


def _q4(N: int, K: int, group_size: int, x_shape=None, weights_shape=None):
    """linear_q4gsw node for raw shapes (no quantizer involved, so refused shapes can be built)."""
    weights = torch.empty(weights_shape or (N, padded_k(K) // 2), dtype=torch.uint8)
    scales = torch.empty(K // group_size if group_size else 1, N)
    x = torch.empty(x_shape or (2, 3, K))
    return _node(torch.ops.vktrain.linear_q4gsw.default, x, weights, scales, group_size, None,
                 out=torch.empty(*x.shape[:-1], N))


def test_op_keys():
    assert op_key(torch.ops.aten.mm.default) == "aten.mm.default"
    assert op_key(exir_ops.edge.aten.mm.default) == "aten.mm.default"
    assert op_key(torch.ops.vktrain.linear_q4gsw.default) == "vktrain.linear_q4gsw.default"
    assert op_key(operator.getitem) == "getitem"
    for key in ("vktrain.linear_q4gsw.default", "vktrain.linear_q4gsw_backward.default", "vktrain.fused_ce.default",
                "vktrain.adamw.default", "aten.embedding.default", "aten.mm.default", "aten.view_copy.default",
                "aten.permute_copy.default", "aten.relu.default", "aten.gelu.default", "aten.sigmoid.default",
                "aten.sum.dim_IntList", "aten.scalar_tensor.default", "vktrain.rms_norm.default",
                "vktrain.causal_attention_backward.default", "vktrain.swiglu_backward.default"):
        assert key in supported_ops(), key


def test_aten_view_ops_are_keyed_by_their_functional_copy():
    """A program lowered whole (no to_edge) still holds ATen views: each is read as its _copy form, which
    must exist, be registered, and take the same arguments (the blob passes them positionally)."""
    from vktrain.partitioner.op_registry import _VIEW_OP_COPY_KEYS

    def overload(key):
        namespace, name, overload_name = key.split(".")
        return getattr(getattr(getattr(torch.ops, namespace), name), overload_name)

    assert op_key(torch.ops.aten.view.default) == "aten.view_copy.default"
    assert op_key(torch.ops.aten.permute.default) == "aten.permute_copy.default"
    for view, copy in _VIEW_OP_COPY_KEYS.items():
        assert copy in supported_ops(), copy
        view_args = [(a.name, str(a.type)) for a in overload(view)._schema.arguments]
        copy_args = [(a.name, str(a.type)) for a in overload(copy)._schema.arguments if not a.is_out]
        assert view_args == copy_args, (view, copy)


def test_registry_accepts_only_ops_the_runtime_executes():
    """Every op the partitioner may delegate has a lowering and a kernel in the runtime (getitem is no
    graph op: preprocess resolves it; the LoRA-linear ops are written out by a backend pass, so no blob
    holds them), so a delegate never fails at load with "unsupported op"."""
    from vktrain.opdefs.runtime_ops import EXPANDED_OPS
    from vktrain.partitioner.op_registry import executed_op
    from vktrain.backend.kernel_planning import op_lowering

    registered = set(supported_ops()) - {"getitem"} - EXPANDED_OPS
    assert registered, "the registry is empty"
    # An et_vk op runs as its vktrain op (vktrain/partitioner/etvk_ops.py): that one must be executable.
    missing = sorted(key for key in registered if executed_op(key) not in op_lowering.supported_ops())
    assert missing == [], f"registered in the partitioner but not executable by the runtime: {missing}"


def test_the_runtime_ops_data_is_what_the_runtime_executes():
    """vktrain.opdefs.runtime_ops (op support as data, what the partitioner and the verifier read without
    importing the runtime) names exactly the ops the runtime's lowering table and kernel registry execute."""
    from vktrain.opdefs.runtime_ops import EXPANDED_OPS, RUNTIME_OPS
    from vktrain.backend.kernel_planning import op_lowering

    assert sorted(RUNTIME_OPS) == op_lowering.supported_ops()
    assert not EXPANDED_OPS & set(op_lowering.supported_ops())


def test_registering_an_op_without_a_runtime_kernel_fails():
    from vktrain.partitioner import register_op
    from vktrain.partitioner.op_registry import OpFeatures

    with pytest.raises(ValueError, match=r"op aten.cumsum.default cannot be registered: the vktrain runtime has no "
                                         r"lowering or kernel for it"):
        register_op("aten.cumsum.default")(lambda key: OpFeatures(key))
    assert get_op_features("aten.cumsum.default") is None


@pytest.mark.parametrize("op, args, out", [
    (torch.ops.aten.le.Scalar, (torch.empty(3), 0.0), torch.empty(3, dtype=torch.bool)),
    (torch.ops.aten.where.self, (torch.empty(3, dtype=torch.bool), torch.empty(3), torch.empty(3)), torch.empty(3)),
])
def test_ops_without_a_gpu_kernel_are_refused(op, args, out):
    # Only the fused ReLU backward (threshold_backward, kept whole) exists on the GPU, not its pieces.
    reason = check_node(_node(op, *args, out=out))
    assert reason is not None and "no OpFeatures registered" in reason


def test_copies_of_bool_or_uint8_tensors_are_refused():
    # The copy kernels move 32-bit words; a bool / uint8 tensor would be garbled.
    reason = check_node(_node(torch.ops.aten.view_copy.default, torch.empty(4, dtype=torch.bool), [2, 2],
                              out=torch.empty(2, 2, dtype=torch.bool)))
    assert "argument 'self' has unsupported dtype torch.bool" in reason
    assert check_node(_node(torch.ops.aten.view_copy.default, torch.empty(4, dtype=torch.int64), [2, 2],
                            out=torch.empty(2, 2, dtype=torch.int64))) is None


def test_backend_id_is_shared_with_the_torch_free_runner():
    from vktrain import contract
    from vktrain.runtime.program import runner

    assert BACKEND_ID == contract.BACKEND_ID == runner.BACKEND_ID == "VktrainVulkanBackend"


def test_q4gsw_weights_are_prepacked():
    assert get_op_features("vktrain.linear_q4gsw.default").prepacked_args() == {1: W4X8}
    assert get_op_features("vktrain.linear_q4gsw_backward.default").prepacked_args() == {1: W4X8}
    assert get_op_features("aten.mm.default").prepacked_args() == {}


def test_linear_q4gsw_accepts_valid_shapes():
    assert check_node(_q4(N=16, K=64, group_size=32)) is None
    assert check_node(_q4(N=12, K=12, group_size=12)) is None  # K = 12 -> Kp = 16, flat [N, 8]


@pytest.mark.parametrize("node, fragments", [
    (lambda: _q4(N=18, K=64, group_size=32), ["N=18 (out features) must be a multiple of 4"]),
    (lambda: _q4(N=16, K=6, group_size=6), ["group_size=6 must be a positive multiple of 4",
                                            "K=6 (in features) must be a multiple of 4"]),
    (lambda: _q4(N=16, K=64, group_size=32, weights_shape=(16, 16)),
     ["weights shape (16, 16) does not match", "expected flat uint8 [N, Kp/2] = [16, 32]"]),
    (lambda: _q4(N=16, K=64, group_size=32, x_shape=(2, 60)), ["x must have shape [..., 64] (last dim = K = in features = G * group_size), got (2, 60)"]),
])
def test_linear_q4gsw_refusals_name_the_problem(node, fragments):
    reason = check_node(node())
    assert reason is not None and reason.startswith("vktrain.linear_q4gsw.default")
    for fragment in fragments:
        assert fragment in reason


def test_group_size_must_divide_k():
    # scales [G, N] imply K = G * group_size; a weights buffer for another K is refused.
    node = _q4(N=8, K=48, group_size=32, weights_shape=(8, 24))
    assert "does not match scales" in check_node(node)


def test_unsupported_dtypes_are_refused():
    reason = check_node(_node(torch.ops.aten.mm.default, torch.empty(4, 4, dtype=torch.float64),
                              torch.empty(4, 4, dtype=torch.float64), out=torch.empty(4, 4, dtype=torch.float64)))
    assert reason == ("aten.mm.default ('node'): argument 'self' has unsupported dtype torch.float64, "
                      "expected one of {float32}")
    reason = check_node(_node(torch.ops.aten.embedding.default, torch.empty(8, 4), torch.empty(3, dtype=torch.float32),
                              out=torch.empty(3, 4)))
    assert "argument 'indices' has unsupported dtype torch.float32" in reason and "int64" in reason
    reason = check_node(_node(torch.ops.aten.relu.default, torch.empty(3, dtype=torch.float16),
                              out=torch.empty(3, dtype=torch.float16)))
    assert "unsupported dtype torch.float16" in reason


def test_fused_ce_and_adamw_shape_rules():
    ok = _node(torch.ops.vktrain.fused_ce.default, torch.empty(6, 256), torch.empty(6, dtype=torch.int64),
               torch.empty(()), out=(torch.empty(()), torch.empty(6, 256)))
    assert check_node(ok) is None
    bad = _node(torch.ops.vktrain.fused_ce.default, torch.empty(6, 256), torch.empty(5, dtype=torch.int64),
                torch.empty(()), out=(torch.empty(()), torch.empty(6, 256)))
    assert "labels must have shape [R] = [6] to match logits (6, 256), got (5,)" in check_node(bad)
    p = torch.empty(4, 8)
    bad_adamw = _node(torch.ops.vktrain.adamw.default, p, p, p, torch.empty(8, 4), torch.empty(5), torch.empty(()),
                      out=(p, p, p))
    assert "grad must match param (float32 (4, 8)), got float32 (8, 4)" in check_node(bad_adamw)


def test_tensor_where_a_number_or_nothing_is_expected_is_refused():
    x = torch.empty(2, 32)
    weights, scales = torch.empty(8, 16, dtype=torch.uint8), torch.empty(1, 8)
    node = _node(torch.ops.vktrain.linear_q4gsw.default, x, weights, scales, torch.empty((), dtype=torch.int64),
                 out=torch.empty(2, 8))
    assert "argument 'group_size' must be a Python number, got the tensor 'arg3'" in check_node(node)
    node = _node(torch.ops.aten.relu.default, torch.empty(3), torch.empty(3), out=torch.empty(3))
    assert "unexpected tensor argument 1" in check_node(node)


def test_unsupported_op_is_refused():
    reason = check_node(_node(torch.ops.aten.cumsum.default, torch.empty(4), 0, out=torch.empty(4)))
    assert reason == ("aten.cumsum.default ('node'): operator is not supported by the vktrain Vulkan backend "
                      "(no OpFeatures registered)")


def test_scalar_operands_are_accepted_where_the_schema_allows():
    assert check_node(_node(torch.ops.aten.mul.Tensor, torch.empty(3), 2.0, out=torch.empty(3))) is None
    reason = check_node(_node(torch.ops.aten.mm.default, torch.empty(3, 3), 2.0, out=torch.empty(3, 3)))
    assert "argument 'mat2' is float 2.0, expected a tensor" in reason


# ---------------------------------------------------------------------------------------------------
# partitioner on real programs


class _CumsumInTheMiddle(nn.Module):
    def forward(self, x):
        return torch.relu(torch.cumsum(torch.relu(x) * 2.0, dim=0))


def test_refused_node_stays_outside_with_its_reason():
    program = torch.export.export(_CumsumInTheMiddle(), (torch.randn(4, 8),))
    partitioner = VktrainPartitioner()
    edge = to_edge_lowered(program, partitioner)
    assert [(r.op, r.node) for r in partitioner.refusals] == [("aten.cumsum.default", "aten_cumsum_default")]
    assert "no OpFeatures registered" in partitioner.refusals[0].reason
    assert partitioner.num_partitions == 2
    top = edge.exported_program().graph_module
    delegates = [n for n in top.graph.nodes if n.op == "get_attr" and n.name.startswith("lowered_module")]
    assert len(delegates) == 2
    assert all(getattr(top, n.target).backend_id == BACKEND_ID for n in delegates)
    outside = [op_key(n.target) for n in top.graph.nodes if n.op == "call_function"
               and "executorch_call_delegate" not in str(n.target) and n.target is not operator.getitem]
    assert outside == ["aten.cumsum.default"]


def test_blocklist_keeps_an_op_out():
    program = torch.export.export(_CumsumInTheMiddle(), (torch.randn(4, 8),))
    partitioner = VktrainPartitioner(operator_blocklist=["aten.relu.default"])
    to_edge_lowered(program, partitioner)
    refused = sorted(r.op for r in partitioner.refusals)
    assert refused == ["aten.cumsum.default", "aten.relu.default", "aten.relu.default"]
    assert all("blocklist" in r.reason for r in partitioner.refusals if r.op == "aten.relu.default")


class _ComputedWeights(nn.Module):
    """linear_q4gsw whose weights are a runtime input: cannot be prepacked, so it is refused."""

    def __init__(self):
        super().__init__()
        weights, scales = quantize(torch.randn(8, 32).numpy(), 32)
        self.register_buffer("scales", torch.from_numpy(scales))
        self.weights = torch.from_numpy(weights)

    def forward(self, x, weights):
        return torch.ops.vktrain.linear_q4gsw(x, weights, self.scales, 32)


def test_prepacked_argument_must_be_constant():
    module = _ComputedWeights()
    program = torch.export.export(module, (torch.randn(2, 32), module.weights))
    partitioner = VktrainPartitioner()
    to_edge_lowered(program, partitioner)
    assert len(partitioner.refusals) == 1
    reason = partitioner.refusals[0].reason
    assert "argument 'weights' must be a constant" in reason and "Q4GSW_W4X8" in reason


def _delegated_op_names(edge) -> list[str]:
    top = edge.exported_program().graph_module
    names = []
    for node in top.graph.nodes:
        if node.op == "get_attr" and node.name.startswith("lowered_module"):
            lowered = getattr(top, node.target).original_module
            names += [op_key(n.target) for n in lowered.graph.nodes if n.op == "call_function"]
    return names


def test_preserved_ops_stay_whole_unless_the_partitioner_refuses_them():
    program = torch.export.export(nn.Sequential(nn.Linear(8, 8), nn.SiLU()), (torch.randn(2, 8),))
    partitioner = VktrainPartitioner()
    names = _delegated_op_names(to_edge_lowered(program, partitioner))
    assert "aten.silu.default" in names and "aten.sigmoid.default" not in names
    # Blocklisted: silu decomposes into core ops (sigmoid * x) that the delegate takes instead.
    partitioner = VktrainPartitioner(operator_blocklist=["aten.silu.default"])
    names = _delegated_op_names(to_edge_lowered(program, partitioner))
    assert "aten.silu.default" not in names and "aten.sigmoid.default" in names
    assert partitioner.refusals == []


def test_transformer_op_records():
    e = torch.empty
    ok = _node(torch.ops.vktrain.rope.default, e(1, 6, 2, 8), e(6, 4), e(6, 4), out=e(1, 6, 2, 8))
    assert check_node(ok) is None
    bad = _node(torch.ops.vktrain.rope.default, e(1, 6, 2, 8), e(6, 8), e(6, 8), out=e(1, 6, 2, 8))
    assert ("cos must have shape [S, D/2] = [6, 4] or [B, S, D/2] = [1, 6, 4] for x [B, S, H, D] = [1, 6, 2, 8], "
            "got (6, 8)") in check_node(bad)
    # Grouped-query attention: Hq must be a multiple of Hkv.
    ok = _node(torch.ops.vktrain.causal_attention.default, e(1, 6, 4, 8), e(1, 6, 2, 8), e(1, 6, 2, 8), 0.35,
               out=(e(1, 6, 4, 8), e(1, 4, 6)))
    assert check_node(ok) is None
    bad = _node(torch.ops.vktrain.causal_attention.default, e(1, 6, 3, 8), e(1, 6, 2, 8), e(1, 6, 2, 8), 0.35,
                out=(e(1, 6, 3, 8), e(1, 3, 6)))
    assert "got Hq=3 (q (1, 6, 3, 8)) and Hkv=2 (k (1, 6, 2, 8))" in check_node(bad)
    bad = _node(torch.ops.vktrain.rms_norm.default, e(2, 6, 8), e(6), 1e-5, out=(e(2, 6, 8), e(2, 6, 1)))
    assert "weight must have shape [D] = [8] to match x (2, 6, 8), got (6,)" in check_node(bad)
    bad = _node(torch.ops.vktrain.swiglu_backward.default, e(2, 8), e(2, 8), e(2, 4), out=(e(2, 8), e(2, 8)))
    assert "up must have the shape of gate (2, 8), got (2, 4)" in check_node(bad)


def test_runtime_argument_names_follow_the_torch_schemas():
    """The blob passes every schema argument positionally (preprocess); the runtime's lowering table names
    them. Both must list the same arguments in the same order, for every op the runtime executes."""
    import executorch.exir.passes.dim_order_ops_registry  # noqa: F401  (registers dim_order_ops)

    from vktrain.backend.kernel_planning.op_lowering import OP_LOWERINGS

    for key, lowering in OP_LOWERINGS.items():
        namespace, name, overload = key.split(".")
        schema = getattr(getattr(getattr(torch.ops, namespace), name), overload)._schema
        expected = tuple(argument.name for argument in schema.arguments if not argument.is_out)
        assert lowering.arg_names == expected, f"{key}: runtime names {lowering.arg_names}, torch schema {expected}"
