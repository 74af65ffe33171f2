"""Upstream ExecuTorch's et_vk training ops as vktrain ops: the records carry the wheel's schemas, the
packed-weight layout converts bit for bit (vktrain.quant.etvk), every mapping refuses what its vktrain op
cannot run, with the reason, and et_vk calls lowered the standard way (torch.export -> lower_to_pte, the
partitioner tagging them, preprocess rewriting them) compute upstream's CPU results on the device."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("executorch.backends.vulkan.custom_ops_lib")
import executorch.backends.vulkan.custom_ops_lib as upstream  # noqa: E402 (registers torch.ops.et_vk)
from executorch.backends.vulkan.patterns.weight_packing_utils import pack_4bit_weight_tensor  # noqa: E402

from vktrain.errors import VktrainError  # noqa: E402
from vktrain.export import lower_to_pte  # noqa: E402
from vktrain.export.etvk import map_etvk_calls  # noqa: E402
from vktrain.opdefs.schema import Schema  # noqa: E402
from vktrain.partitioner import check_node, supported_ops  # noqa: E402
from vktrain.partitioner.etvk_ops import ETVK_OPS, NAMESPACE  # noqa: E402
from vktrain.partitioner.op_registry import executed_op  # noqa: E402
from vktrain.partitioner.etvk_rewrite import EtvkMappingError, lower_etvk_calls  # noqa: E402
from vktrain.quant import dequantize, pack_flat, padded_k, quantize, unpack_flat  # noqa: E402
from vktrain.quant.etvk import EtvkLayoutError, flat_from_etvk  # noqa: E402
from vktrain.runtime.delegate.executor import GraphExecutor  # noqa: E402
from vktrain.backend.kernel_planning.op_lowering import supported_ops as runtime_ops  # noqa: E402
from vktrain.serialization.pte import PteFile  # noqa: E402
from vktrain.runtime.program.summary import summarize_pte  # noqa: E402
from vktrain.serialization.verify import load_delegate_graph  # noqa: E402
from _helpers import planned

et = torch.ops.et_vk


def _codes(n: int, k: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(-8, 8, (n, k)).astype(np.int8)


# ---------------------------------------------------------------------------------------------- records


def test_records_carry_the_wheels_schemas_and_run_as_runtime_ops():
    for op in ETVK_OPS:
        wheel = str(getattr(et, op.schema.name).default._schema)
        assert wheel.startswith(f"{NAMESPACE}::")
        assert Schema.parse(NAMESPACE, wheel[len(NAMESPACE) + 2:]) == op.schema, op.key
        assert op.key in supported_ops() and executed_op(op.key) == op.target and op.target in runtime_ops()


def test_an_op_cannot_be_registered_to_run_as_an_op_the_runtime_lacks():
    from vktrain.partitioner import get_op_features, register_op
    from vktrain.partitioner.op_registry import OpFeatures

    with pytest.raises(ValueError, match=r"no lowering or kernel for vktrain.nothing.default, which it runs as"):
        register_op("et_vk.nothing.default", runs_as="vktrain.nothing.default")(lambda key: OpFeatures(key))
    assert get_op_features("et_vk.nothing.default") is None


# ---------------------------------------------------------------------------------------------- layout


@pytest.mark.parametrize("K", [32, 12, 20, 4])
def test_upstreams_packing_is_vktrains_flat_layout_when_it_pads_k_to_8(K):
    q = _codes(8, K)
    upstream_bytes = pack_4bit_weight_tensor(torch.from_numpy(q)).numpy()   # inner_dim_padding=8 (its default)
    np.testing.assert_array_equal(upstream_bytes, pack_flat(q))
    np.testing.assert_array_equal(flat_from_etvk(upstream_bytes, K), upstream_bytes)
    # ... and upstream's CPU reference reads vktrain's bytes as the same codes.
    np.testing.assert_array_equal(upstream.unpack_4bit_weight_tensor(torch.from_numpy(pack_flat(q)),
                                                                     torch.empty(K)).numpy(), q)


@pytest.mark.parametrize("K", [12, 20, 36])
def test_unpadded_upstream_bytes_convert_losslessly(K):
    q = _codes(12, K, seed=K)
    unpadded = pack_4bit_weight_tensor(torch.from_numpy(q), inner_dim_padding=None).numpy()
    assert unpadded.shape == (12, K // 2) != (12, padded_k(K) // 2)
    flat = flat_from_etvk(unpadded, K)
    np.testing.assert_array_equal(flat, pack_flat(q))
    np.testing.assert_array_equal(unpack_flat(flat, K), q)


def test_padding_nibbles_become_code_8_and_the_k_codes_stay():
    q = _codes(4, 12)
    dirty = pack_flat(q).copy()
    dirty[:, 6:] = 0x3F   # upstream's reference never reads past K; vktrain's kernels need code 8 there
    flat = flat_from_etvk(dirty, 12)
    np.testing.assert_array_equal(flat, pack_flat(q))
    assert np.all(flat[:, 6:] == 0x88)


def test_too_few_packed_columns_is_a_vktrain_error():
    with pytest.raises(EtvkLayoutError, match="hold 8 codes per row, fewer than K=12") as info:
        flat_from_etvk(np.zeros((4, 4), np.uint8), 12)
    assert isinstance(info.value, VktrainError)
    with pytest.raises(EtvkLayoutError, match="must be uint8"):
        flat_from_etvk(np.zeros((4, 8), np.int8), 12)


def test_upstreams_dequantization_is_vktrains_bit_for_bit():
    weight = np.random.default_rng(1).standard_normal((16, 64)).astype(np.float32)
    flat, scales = quantize(weight, 32)
    q = upstream.unpack_4bit_weight_tensor(torch.from_numpy(flat), torch.empty(64))
    theirs = torch.ops.torchao.dequantize_affine(q, [1, 32], torch.from_numpy(scales).t(),
                                                 torch.zeros(16, 2, dtype=torch.int32), torch.int8, -8, 7)
    np.testing.assert_array_equal(theirs.numpy(), dequantize(flat, scales, 32))


# ---------------------------------------------------------------------------------------------- refusals


class _Call(torch.nn.Module):
    """One et_vk call; tensors named in `constants` are buffers (frozen weights), the rest inputs."""

    def __init__(self, call, constants: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.call = call
        for name, tensor in constants.items():
            self.register_buffer(name, tensor)

    def forward(self, *inputs):
        return self.call(self, *inputs)


def _refusal(call, constants: dict, *inputs) -> str | None:
    program = torch.export.export(_Call(call, constants), inputs)
    (node,) = [n for n in program.graph.nodes if str(n.target).startswith(f"{NAMESPACE}.")]
    return check_node(node, program)


def _q4gsw(n: int, k: int, group_size: int, padding: int | None = 8) -> dict:
    w, s = quantize(np.random.default_rng(2).standard_normal((n, k)).astype(np.float32), group_size)
    packed = pack_4bit_weight_tensor(torch.from_numpy(unpack_flat(w, k)), inner_dim_padding=padding)
    return {"w": packed, "s": torch.from_numpy(s)}


def test_linear_q4gsw_is_taken_with_unpadded_and_padded_weights():
    for padding in (8, None):
        assert _refusal(lambda m, x: et.linear_q4gsw(x, m.w, m.s, 4), _q4gsw(8, 12, 4, padding), torch.randn(3, 12)) is None


def test_linear_q4gsw_refusals_name_what_vktrain_cannot_run():
    six_rows = {"w": pack_4bit_weight_tensor(torch.from_numpy(_codes(6, 8))), "s": torch.ones(2, 6)}
    reason = _refusal(lambda m, x: et.linear_q4gsw(x, m.w, m.s, 4), six_rows, torch.randn(3, 8))
    assert "et_vk.linear_q4gsw.default" in reason and "N=6 (out features) must be a multiple of 4" in reason
    reason = _refusal(lambda m, x, w: et.linear_q4gsw(x, w, m.s, 4), {"s": torch.ones(2, 8)}, torch.randn(3, 8),
                      torch.zeros(8, 4, dtype=torch.uint8))
    assert "'weights' must be a constant" in reason and "Q4GSW_W4X8" in reason


def test_linear_q4gsw_backward_refuses_weights_padded_past_k():
    """Upstream's d_x has 2 * weights.shape[1] columns: with K = 12 padded to 16 that is not K."""
    reason = _refusal(lambda m, d: et.linear_q4gsw_backward(d, m.w, m.s, 4), _q4gsw(8, 12, 4), torch.randn(3, 8))
    assert "2 * weights.shape[1] = 16 columns" in reason and "cover K=12" in reason
    assert _refusal(lambda m, d: et.linear_q4gsw_backward(d, m.w, m.s, 4), _q4gsw(8, 12, 4, None),
                    torch.randn(3, 8)) is None


def test_q4gsw_requant_needs_k_a_multiple_of_8():
    scales = {"s": torch.ones(3, 8)}
    reason = _refusal(lambda m, latent: et.q4gsw_requant(latent, m.s, 4), scales, torch.randn(8, 12))
    assert "expected K % 8 == 0" in reason and "[8, 6]" in reason and "[8, 8]" in reason
    assert _refusal(lambda m, latent: et.q4gsw_requant(latent, m.s, 4), {"s": torch.ones(4, 8)},
                    torch.randn(8, 16)) is None


def test_fused_ce_needs_a_positive_n_valid_and_linear_dw_vktrains_row_dims():
    labels = torch.zeros(4, dtype=torch.int64)
    assert "n_valid=0.0 must be finite and > 0" in _refusal(lambda m, lg, lb: et.fused_ce(lg, lb, 0.0), {},
                                                              torch.randn(4, 8), labels)
    assert _refusal(lambda m, lg, lb: et.fused_ce(lg, lb, 4.0), {}, torch.randn(4, 8), labels) is None
    reason = _refusal(lambda m, d, x: et.linear_dW(d, x), {}, torch.randn(4, 8), torch.randn(2, 2, 12))
    assert "as vktrain.linear_dW.default" in reason and "must share their leading (row) dims" in reason


def _adamw(*scalars):
    def call(m, grad):
        return et.adamw_step(m.p, m.m, m.v, grad, *scalars)[0].sum()
    return call


def test_adamw_step_refuses_scalars_vktrains_adamw_cannot_honour():
    state = {name: torch.zeros(4, 8) for name in ("p", "m", "v")}
    grad = torch.randn(4, 8)
    assert _refusal(_adamw(1e-3, 0.9, 0.999, 1e-8, 0.0, 0.1, 0.001), state, grad) is None
    reason = _refusal(_adamw(1e-3, 0.9, 0.9999999, 1e-8, 0.0, 0.1, 0.001), state, grad)
    assert "beta2=0.9999999 must be in [0, " in reason and "exactly 1" in reason
    reason = _refusal(_adamw(1e-3, 0.9, 0.999, 1e-8, 0.0, 0.0, 0.001), state, grad)
    assert "bias_correction1=0.0 must be finite and > 0" in reason
    assert "lr=-1.0" in _refusal(_adamw(-1.0, 0.9, 0.999, 1e-8, 0.0, 0.1, 0.001), state, grad)


def test_adamw_step_must_write_distinct_buffers_and_not_in_an_edge_program():
    grad = torch.randn(4, 8)
    scalars = (1e-3, 0.9, 0.999, 1e-8, 0.0, 0.1, 0.001)
    on_input = torch.export.export(_Call(lambda m, p, g: et.adamw_step(p, m.m, m.v, g, *scalars)[1].sum(),
                                         {"m": torch.zeros(4, 8), "v": torch.zeros(4, 8)}), (torch.zeros(4, 8), grad))
    with pytest.raises(EtvkMappingError, match="argument 'param' is written in place, so it must be a buffer"):
        map_etvk_calls(on_input)

    def twice(m, g):
        et.adamw_step(m.p, m.m, m.v, g, *scalars)
        return et.adamw_step(m.p, m.m2, m.v2, g, *scalars)[0].sum()
    program = torch.export.export(_Call(twice, {n: torch.zeros(4, 8) for n in ("p", "m", "v", "m2", "v2")}), (grad,))
    with pytest.raises(EtvkMappingError, match="buffer 'p' .* is already written by 'adamw_step'"):
        map_etvk_calls(program)
    with pytest.raises(EtvkMappingError, match="writes .* in place, which a functional"):
        lower_etvk_calls(program, [])


# ---------------------------------------------------------------------------------------------- device


class _UpstreamLinear(torch.nn.Module):
    """An et_vk.linear_q4gsw with bias over weights packed WITHOUT K padding (K = 12), behind a reshape
    (which sends the program down the standard route: to_edge, the partitioner, preprocess)."""

    def __init__(self) -> None:
        super().__init__()
        for name, tensor in _q4gsw(8, 12, 4, padding=None).items():
            self.register_buffer(name, tensor)
        self.register_buffer("bias", torch.linspace(-1, 1, 8))

    def forward(self, x):
        return et.linear_q4gsw(x.reshape(-1, 12), self.w, self.s, 4, self.bias)


def test_et_vk_calls_lowered_the_standard_way_compute_upstreams_result_on_the_device(tmp_path, vk_device):
    module = _UpstreamLinear()
    x = torch.randn(2, 3, 12)
    pte = lower_to_pte(torch.export.export(module, (x,)))
    report = summarize_pte(pte)
    assert report["delegate_calls"] == 1 and report["kernel_calls"] == 0 and report["refusals"] == []
    (delegate,) = report["delegates"]
    assert delegate["op_histogram"].get("vktrain.linear_q4gsw.default") == 1
    assert delegate["constants"]["tensor_layouts"].get("Q4GSW_W4X8") == 1 and delegate["baked_scalars"] == []

    path = tmp_path / "linear.pte"
    path.write_bytes(pte)
    program = PteFile.load(path)
    _, graph = load_delegate_graph(program, program.execution_plan("forward"))
    with GraphExecutor(vk_device, graph, planned(vk_device, graph)) as executor:
        (out,) = executor.run(x.numpy())
    expected = module(x).double().numpy()
    # fp32 dot products of K = 12 terms (+ bias): |error| <= (K + 1) eps sum |x w| + |bias| eps.
    deq = dequantize(flat_from_etvk(module.w.numpy(), 12), module.s.numpy(), 4).astype(np.float64)
    bound = 13 * np.finfo(np.float32).eps * (np.abs(x.reshape(-1, 12).double().numpy()) @ np.abs(deq).T + 1)
    assert np.all(np.abs(out - expected) <= bound)


def test_the_backend_reports_the_scalars_it_bakes_on_the_standard_route():
    class Loss(torch.nn.Module):
        def forward(self, logits, labels):
            return et.fused_ce(logits.reshape(-1, 8), labels.reshape(-1), 6.0)[0]

    pte = lower_to_pte(torch.export.export(Loss(), (torch.randn(2, 3, 8), torch.zeros(2, 3, dtype=torch.int64))))
    (delegate,) = summarize_pte(pte)["delegates"]
    assert delegate["op_histogram"].get("vktrain.fused_ce.default") == 1
    assert [(entry["op"], entry["scalars"]) for entry in delegate["baked_scalars"]] == [
        ("et_vk.fused_ce.default", {"n_valid": 6.0})]


def test_the_linear_q4gsw_of_upstreams_quantized_linear_fusion_is_taken_as_it_is():
    """torchao's int4 weight-only linear (the upstream Vulkan recipe) -> to_edge -> upstream's
    FusePatternsPass gives an edge et_vk.linear_q4gsw over K-padded bytes: the registry takes it, its
    bytes need no repacking, and vktrain's op computes the torchao model's output."""
    torchao = pytest.importorskip("torchao.quantization")
    from executorch.backends.vulkan._passes.fuse_patterns import FusePatternsPass
    from executorch.exir import EdgeCompileConfig, to_edge
    from torchao.quantization.granularity import PerGroup

    from vktrain.partitioner.etvk_ops import Repacked, mapped_call

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False))
    torchao.quantize_(model, torchao.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)))
    x = torch.randn(4, 64)
    program = to_edge(torch.export.export(model, (x,)),
                      compile_config=EdgeCompileConfig(_check_ir_validity=False)).exported_program()
    fuse = FusePatternsPass()
    fuse._exported_program = program
    fuse(program.graph_module)
    (node,) = [n for n in program.graph.nodes if "et_vk" in str(n.target)]
    assert check_node(node, program) is None

    mapped = mapped_call(node)
    weights, scales = (program.state_dict[program.graph_signature.inputs_to_parameters[node.args[i].name]]
                       for i in (1, 2))
    assert isinstance(mapped.args["weights"], Repacked) and mapped.args["weights"].K == 64
    np.testing.assert_array_equal(flat_from_etvk(weights.numpy(), 64), weights.numpy())
    out = torch.ops.vktrain.linear_q4gsw(x, weights, scales, mapped.args["group_size"]).numpy()
    expected = model(x).double().numpy()
    # Both are fp32 dot products of K = 64 terms over the same dequantized weights, each within
    # K eps sum |x w| of the exact one.
    deq = dequantize(weights.numpy(), scales.numpy(), 32).astype(np.float64)
    bound = 2 * 64 * np.finfo(np.float32).eps * (np.abs(x.double().numpy()) @ np.abs(deq).T)
    assert np.all(np.abs(out - expected) <= bound)
