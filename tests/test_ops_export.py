"""The vktrain ops through torch.export, ExecuTorch's to_edge/to_executorch (no delegate) and the joint
forward-backward export used for training."""
import numpy as np
import pytest
import torch
from executorch.exir import to_edge
from torch.export.experimental import _export_forward_backward

import vktrain.ops as ops
from vktrain import quant


def q4gsw(N, K, group_size, seed):
    rng = np.random.default_rng(seed)
    flat = quant.pack_flat(rng.integers(-8, 8, size=(N, K)))
    scales = rng.uniform(0.01, 0.2, size=(K // group_size, N)).astype(np.float32)
    return torch.from_numpy(flat), torch.from_numpy(scales)


class CallOp(torch.nn.Module):
    """forward(*tensors) = torch.ops.vktrain.<name>(...) with the non-tensor arguments baked in."""

    def __init__(self, name, args):
        super().__init__()
        self.op = getattr(torch.ops.vktrain, name).default
        self.template = args

    def forward(self, *tensors):
        it = iter(tensors)
        return self.op(*(next(it) if isinstance(a, torch.Tensor) else a for a in self.template))


def example_args(case):
    weights, scales = q4gsw(12, 20, 4, seed=0)
    return {
        "linear_q4gsw": ("linear_q4gsw", (torch.randn(2, 3, 20), weights, scales, 4, torch.randn(12))),
        "linear_q4gsw_no_bias": ("linear_q4gsw", (torch.randn(5, 20), weights, scales, 4, None)),
        "linear_q4gsw_backward": ("linear_q4gsw_backward", (torch.randn(2, 3, 12), weights, scales, 4)),
        "linear_dW": ("linear_dW", (torch.randn(2, 3, 12), torch.randn(2, 3, 20))),
        "q4gsw_requant": ("q4gsw_requant", (torch.randn(12, 20), scales, 4)),
        "fused_ce": ("fused_ce", (torch.randn(4, 9), torch.tensor([1, -100, 8, 0]), torch.tensor(3.0))),
        "adamw": ("adamw", (torch.randn(5), torch.randn(5), torch.rand(5), torch.randn(5),
                            ops.adamw_hparams(1e-3), torch.tensor(2.0))),
    }[case]


def vktrain_targets(graph):
    return [n.target for n in graph.nodes if n.op == "call_function" and "vktrain" in str(n.target)]


@pytest.mark.parametrize("case", ["linear_q4gsw", "linear_q4gsw_no_bias", "linear_q4gsw_backward", "linear_dW",
                                  "q4gsw_requant", "fused_ce", "adamw"])
def test_op_exports_as_one_node_and_lowers_to_its_out_variant(case):
    name, args = example_args(case)
    module = CallOp(name, args)
    tensors = tuple(a for a in args if isinstance(a, torch.Tensor))
    ep = torch.export.export(module, tensors)
    op_nodes = [n for n in ep.graph.nodes if n.op == "call_function" and n.target.__name__ != "getitem"]
    assert [n.target for n in op_nodes] == [getattr(torch.ops.vktrain, name).default]

    # The exported program still computes what eager does.
    eager = module(*tensors)
    exported = ep.module()(*tensors)
    for got, want in zip(*(r if isinstance(r, tuple) else (r,) for r in (exported, eager))):
        assert torch.equal(got, want)

    program = to_edge(ep).to_executorch()
    assert vktrain_targets(program.exported_program().graph) == [getattr(torch.ops.vktrain, name).out]
    operators = {(o.name, o.overload) for o in program.executorch_program.execution_plan[0].operators}
    assert (f"vktrain::{name}", "out") in operators


def test_linear_q4gsw_exports_with_dynamic_rows():
    weights, scales = q4gsw(8, 16, 8, seed=1)
    module = CallOp("linear_q4gsw", (torch.randn(6, 16), weights, scales, 8, None))
    rows = torch.export.Dim("rows", min=1, max=1024)
    ep = torch.export.export(module, (torch.randn(6, 16), weights, scales),
                             dynamic_shapes=(({0: rows}, None, None),))  # one entry: the *tensors varargs
    x = torch.randn(11, 16)
    torch.testing.assert_close(ep.module()(x, weights, scales), ops.linear_q4gsw(x, weights, scales, 8))


def test_export_refuses_bad_shapes_at_trace_time():
    weights, scales = q4gsw(12, 20, 4, seed=2)
    module = CallOp("linear_q4gsw", (torch.randn(3, 24), weights, scales, 4, None))
    with pytest.raises(ValueError, match=r"x must have shape \[..., 20\]"):
        torch.export.export(module, (torch.randn(3, 24), weights, scales))


# ---- joint forward-backward graph ------------------------------------------------------------------

class LoRAQ4Linear(torch.nn.Module):
    """Frozen q4gsw base plus a trainable low-rank update: y = x @ deq(W).T + (x @ A.T) @ B.T."""

    def __init__(self, N, K, group_size, rank, seed):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        weights, scales = ops.quantize_q4gsw(torch.randn(N, K, generator=gen), group_size)
        self.register_buffer("weights", weights)
        self.register_buffer("scales", scales)
        self.group_size = group_size
        self.lora_a = torch.nn.Parameter(torch.randn(rank, K, generator=gen) * 0.1)
        self.lora_b = torch.nn.Parameter(torch.randn(N, rank, generator=gen) * 0.1)

    def forward(self, x):
        return ops.linear_q4gsw(x, self.weights, self.scales, self.group_size) + (x @ self.lora_a.T) @ self.lora_b.T


class TinyLoRAModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer1 = LoRAQ4Linear(16, 8, 4, rank=2, seed=0)
        self.layer2 = LoRAQ4Linear(12, 16, 8, rank=2, seed=1)

    def forward(self, x, labels, n_valid):
        logits = self.layer2(torch.relu(self.layer1(x)))
        loss, _ = ops.fused_ce(logits.reshape(-1, logits.shape[-1]), labels, n_valid)
        return (loss,)


def test_joint_graph_uses_the_vktrain_backward_ops_and_matches_eager_autograd():
    model = TinyLoRAModel()
    inputs = (torch.randn(2, 3, 8), torch.tensor([1, -100, 3, 11, 0, 5]), torch.tensor(5.0))
    joint = _export_forward_backward(torch.export.export(model, inputs))

    targets = vktrain_targets(joint.graph)
    assert targets.count(torch.ops.vktrain.fused_ce.default) == 1
    assert targets.count(torch.ops.vktrain.linear_q4gsw.default) == 2
    # layer2's input needs a gradient (layer1's LoRA lies below it); layer1's input x does not.
    backward_nodes = [n for n in joint.graph.nodes if n.target == torch.ops.vktrain.linear_q4gsw_backward.default]
    assert len(backward_nodes) == 1
    buffer_of = joint.graph_signature.inputs_to_buffers
    assert [buffer_of[a.name] for a in backward_nodes[0].args[1:3]] == ["layer2.weights", "layer2.scales"]
    # The loss gradient is fused_ce's dlogits: no softmax backward is traced.
    assert not any("softmax" in str(n.target) for n in joint.graph.nodes)

    # Run the joint graph and compare loss and LoRA gradients with eager autograd.
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    user_inputs = iter(inputs)
    flat_inputs = [state[s.target] if s.target is not None else next(user_inputs)
                   for s in joint.graph_signature.input_specs]
    outputs = dict(zip((s.target or "loss" for s in joint.graph_signature.output_specs),
                       joint.graph_module(*flat_inputs)))
    (loss,) = model(*inputs)
    loss.backward()
    torch.testing.assert_close(outputs["loss"], loss.detach())
    for name, param in model.named_parameters():
        torch.testing.assert_close(outputs[name], param.grad, msg=f"gradient of {name}")

    program = to_edge(joint).to_executorch()
    lowered = vktrain_targets(program.exported_program().graph)
    assert set(lowered) == {torch.ops.vktrain.linear_q4gsw.out, torch.ops.vktrain.fused_ce.out,
                            torch.ops.vktrain.linear_q4gsw_backward.out}
