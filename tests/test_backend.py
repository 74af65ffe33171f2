"""preprocess (edge program -> vktrain blob) and memory planning, on a whole MLP-LoRA training step."""
from __future__ import annotations

import copy
import itertools
import random

import numpy as np
import pytest
import torch

from vktrain.backend import LiveInterval, plan_memory
from vktrain.export import export_forward, export_training_step, lower_to_pte
from vktrain.runtime.program.summary import read_pte, summarize_pte
from vktrain.lora import LoRAConfig, apply_lora, lora_modules
from vktrain.models import build_model
from vktrain.partitioner import supported_ops
from vktrain.ops import adamw_hparams
from vktrain.quant import dequantize, pack_w4x8, unpack_w4x8
from vktrain.serialization import Layout, ValueListValue, deserialize_blob
from vktrain.serialization import graph as vk

BATCH = (2, 8)
GROUP_SIZE = 32


# ---------------------------------------------------------------------------------------------------
# memory planning (unit)


def test_disjoint_lifetimes_share_and_overlapping_ones_do_not():
    plan = plan_memory([LiveInterval(0, 400, 0, 1), LiveInterval(1, 100, 1, 2), LiveInterval(2, 300, 2, 3)])
    # 0 and 2 are disjoint ([0,1] vs [2,3]); 1 overlaps both.
    assert plan.assignment[0] == plan.assignment[2] != plan.assignment[1]
    assert sorted(plan.object_sizes) == [100, 400]
    assert plan.planned_bytes == 500


def test_an_op_never_writes_into_its_own_input():
    # Input read by op 3, output written by op 3: the intervals touch at 3 and must not share.
    plan = plan_memory([LiveInterval(0, 64, 0, 3), LiveInterval(1, 64, 3, 5)])
    assert plan.assignment[0] != plan.assignment[1]
    with pytest.raises(ValueError, match="invalid live interval"):
        LiveInterval(0, 4, 3, 2)


def test_random_plans_are_valid():
    rng = random.Random(0)
    for _ in range(50):
        intervals = []
        for value_id in range(rng.randint(1, 30)):
            first = rng.randint(0, 40)
            intervals.append(LiveInterval(value_id, rng.choice([4, 64, 256, 1024]), first, first + rng.randint(0, 10)))
        plan = plan_memory(intervals)
        for a, b in itertools.combinations(intervals, 2):
            if plan.assignment[a.value_id] == plan.assignment[b.value_id]:
                assert not (a.first <= b.last and b.first <= a.last), (a, b)
        for t in intervals:
            assert plan.object_sizes[plan.assignment[t.value_id]] >= t.nbytes
        assert plan.planned_bytes <= sum(t.nbytes for t in intervals)


def _greedy_plan_by_scanning(intervals):
    """The planning rule written the obvious way (scan every resident): largest first, into the smallest
    existing object (lowest id on ties) none of whose residents overlaps it, else a new object."""
    residents, sizes, assignment = [], [], {}
    for t in sorted(intervals, key=lambda t: (-t.nbytes, t.first, t.value_id)):
        free = [i for i, held in enumerate(residents) if not any(t.overlaps(o) for o in held)]
        best = min(free, key=lambda i: (sizes[i], i)) if free else None
        if best is None:
            residents.append([])
            sizes.append(t.nbytes)
            best = len(sizes) - 1
        residents[best].append(t)
        assignment[t.value_id] = best
    return assignment, sizes


def test_plans_equal_the_scanning_rule_exactly():
    # The planner checks only an object's two neighbouring residents; it must place exactly as a full scan.
    rng = random.Random(1)
    for _ in range(40):
        intervals = []
        for value_id in range(rng.randint(1, 200)):
            first = rng.randint(0, 300)
            intervals.append(LiveInterval(value_id, rng.choice([4, 64, 256, 1024, 4096]), first,
                                          first + rng.choice([0, 1, 2, 5, 20, 100])))
        plan = plan_memory(intervals)
        assert (plan.assignment, plan.object_sizes) == _greedy_plan_by_scanning(intervals)


# ---------------------------------------------------------------------------------------------------
# a whole training step


@pytest.fixture(scope="module")
def model():
    model = build_model("mlp-lora", dim=32, hidden=64, n_layers=2, seed=2)
    apply_lora(model, LoRAConfig(rank=4, alpha=8, group_size=GROUP_SIZE))
    return model


@pytest.fixture(scope="module")
def step_program(model):
    return export_training_step(model, BATCH)


@pytest.fixture(scope="module")
def step_pte(step_program):
    return lower_to_pte(step_program)  # lowers a deep copy: step_program stays usable


@pytest.fixture(scope="module")
def step_graph(step_pte):
    contents = read_pte(step_pte)
    assert len(contents.delegates) == 1
    return deserialize_blob(contents.delegates[0].payload)


def _named_tensors(graph):
    return {v.name: (i, v) for i, v in enumerate(graph.values) if hasattr(v, "layout") and v.name}


def test_training_step_is_exactly_one_delegate_call(step_pte):
    contents = read_pte(step_pte)
    assert contents.delegate_calls == 1
    assert contents.kernel_calls == 0
    assert contents.operators == []
    assert [d.backend_id for d in contents.delegates] == ["VktrainVulkanBackend"]


@pytest.mark.parametrize("activation, fused_op, absent_op", [
    ("gelu", "aten.gelu_backward.default", "aten.erf.default"),
    ("silu", "aten.silu.default", "aten.sigmoid_backward.default"),
])
def test_other_activations_lower_into_one_delegate(activation, fused_op, absent_op):
    model = build_model("mlp-lora", dim=16, hidden=16, n_layers=1, activation=activation)
    apply_lora(model, LoRAConfig(rank=2, group_size=16))
    contents = read_pte(lower_to_pte(export_training_step(model, (1, 4))))
    assert (contents.delegate_calls, contents.kernel_calls, contents.operators) == (1, 0, [])
    names = [op.name for op in deserialize_blob(contents.delegates[0].payload).ops]
    assert fused_op in names and absent_op not in names  # kept whole, not decomposed


def test_op_chain_is_the_edge_graph(step_graph, model):
    names = [op.name for op in step_graph.ops]
    # What the partitioner delegates, plus the ops the backend's passes write (gemm_scale: the LoRA scaling).
    assert set(names) <= set(supported_ops()) | {"vktrain.mm_scaled.default"}
    n_lora = len(lora_modules(model))
    # Each adapter's scaling, forward (h * s) and backward (d_h * s), is its GEMM's: no aten.mul is left.
    assert names.count("vktrain.mm_scaled.default") == 2 * n_lora and "aten.mul.Tensor" not in names
    assert names.count("vktrain.linear_q4gsw.default") == n_lora
    assert names.count("vktrain.adamw.default") == 2 * n_lora
    assert names.count("vktrain.fused_ce.default") == 1
    # The first layer's input is the frozen embedding: no d_x is needed there.
    assert names.count("vktrain.linear_q4gsw_backward.default") == n_lora - 1
    # The aten.alias / loss-seed multiplications of the joint graph were removed before lowering.
    assert "aten.alias_copy.default" not in names and "aten.full_like.default" not in names
    # ReLU's backward stays one op (PRESERVED_OPS) instead of le + scalar_tensor + where.
    assert names.count("aten.threshold_backward.default") == 2
    assert "aten.where.self" not in names and "aten.le.Scalar" not in names
    assert sorted(step_graph.tensor(i).name for i in step_graph.inputs) == ["hparams", "labels", "n_valid", "token_ids"]
    (loss,) = step_graph.outputs
    assert step_graph.tensor(loss).shape == () and step_graph.tensor(loss).dtype.name == "FLOAT32"


def _schema(op_name: str):
    namespace, name, overload = op_name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)._schema


def test_op_arguments_follow_the_schema(step_graph):
    """Every op passes all non-out schema arguments positionally (defaults filled in)."""
    for op in step_graph.ops:
        arguments = [a for a in _schema(op.name).arguments if not a.is_out]
        assert len(op.args) == len(arguments), op.name
        returns = _schema(op.name).returns
        assert len(op.outputs) == len(returns), op.name
        if op.name == "aten.view_copy.default":
            (size,) = [step_graph.values[op.args[1]].items]
            assert tuple(size) == step_graph.tensor(op.outputs[0]).shape or -1 in size
        if op.name == "aten.embedding.default":
            # weight, indices, then the defaults padding_idx=-1, scale_grad_by_freq=False, sparse=False
            assert step_graph.tensor(op.args[0]).name == "model.embed.weight"
            assert [step_graph.values[a].value for a in op.args[2:]] == [-1, False, False]
        if op.name in ("vktrain.linear_q4gsw.default", "vktrain.linear_q4gsw_backward.default"):
            assert step_graph.values[op.args[3]].value == GROUP_SIZE


def test_w4x8_constants_equal_pack_w4x8_of_the_model_weights(step_graph, model):
    named = _named_tensors(step_graph)
    for path, layer in lora_modules(model).items():
        value_id, tensor = named[f"model.{path}.weights"]
        assert tensor.layout == Layout.Q4GSW_W4X8
        expected = pack_w4x8(layer.weights.numpy(), layer.in_features)
        stored = step_graph.constant_array(value_id)
        assert stored.dtype == np.uint32 and stored.tobytes() == expected.tobytes()
        scales_id, scales = named[f"model.{path}.scales"]
        assert scales.layout == Layout.PLAIN
        assert step_graph.constant_array(scales_id).tobytes() == layer.scales.numpy().tobytes()


def test_a_weight_used_by_forward_and_backward_is_one_value(step_graph, model):
    w4x8_values = [i for i, v in enumerate(step_graph.values) if getattr(v, "layout", None) == Layout.Q4GSW_W4X8]
    assert len(w4x8_values) == len(lora_modules(model))
    uses = sum(arg in w4x8_values for op in step_graph.ops for arg in op.args)
    assert uses == 2 * len(lora_modules(model)) - 1  # forward everywhere, backward except the first layer


def test_mutable_state_holds_adapters_moments_and_step(step_graph, model):
    by_name = {step_graph.tensor(s.state_id).name: s for s in step_graph.mutable_state}
    paths = [f"{p}.{w}" for p in lora_modules(model) for w in ("lora_A", "lora_B")]
    assert set(by_name) == ({f"model.{p}" for p in paths} | {f"optimizer.exp_avg.{p}" for p in paths}
                            | {f"optimizer.exp_avg_sq.{p}" for p in paths} | {"optimizer.step"})
    for path in paths:
        state = by_name[f"model.{path}"]
        initial = model.get_parameter(path).detach().numpy()
        if path.endswith("lora_A"):  # kaiming init: stored as the initial constant
            stored = np.frombuffer(step_graph.constants[state.initial_constant_id], dtype=np.float32)
            assert stored.tobytes() == initial.tobytes()
        else:  # lora_B starts at zero: no constant, zero-filled
            assert state.initial_constant_id == -1
        assert by_name[f"optimizer.exp_avg.{path}"].initial_constant_id == -1
        # The state is updated by the adamw output, which is a different (planned) tensor.
        assert state.update_id != state.state_id
        assert any(state.update_id in op.outputs and op.name == "vktrain.adamw.default" for op in step_graph.ops)
    assert by_name["optimizer.step"].initial_constant_id == -1


def test_memory_plan_is_valid_and_saves_memory(step_graph, step_pte):
    """Recompute the lifetime of every planned storage (an op output with storage of its own, together with
    the views and in-place outputs using it) from the op chain, independently of the planner."""
    n_ops = len(step_graph.ops)

    def root(value_id):
        tensor = step_graph.tensor(value_id)
        return tensor.storage_of if tensor.storage_of >= 0 else value_id

    first, last = {}, {}
    for index, op in enumerate(step_graph.ops):
        for out in op.outputs:
            first.setdefault(root(out), index)
            last[root(out)] = max(last.get(root(out), index), index)
        args = list(op.args)
        for arg in op.args:
            if isinstance(step_graph.values[arg], ValueListValue):
                args += list(step_graph.values[arg].items)
        for arg in args:
            if isinstance(step_graph.values[arg], vk.TensorValue) and root(arg) in last:
                last[root(arg)] = max(last[root(arg)], index)
    for value_id in list(step_graph.outputs) + [s.update_id for s in step_graph.mutable_state]:
        last[root(value_id)] = n_ops  # read after the chain ends
    produced = {out for op in step_graph.ops for out in op.outputs}
    planned = {v: step_graph.tensor(v) for v in first if v in produced}  # not inputs, constants, state
    assert all(t.mem_obj_id >= 0 and t.storage_of == -1 for t in planned.values())
    for op in step_graph.ops:  # a tensor using planned storage records the same memory object
        for out in op.outputs:
            if root(out) in planned:
                assert step_graph.tensor(out).mem_obj_id == planned[root(out)].mem_obj_id
    sizes = {m.id: m.size_bytes for m in step_graph.memory_objects}
    for a, b in itertools.combinations(planned, 2):
        if planned[a].mem_obj_id == planned[b].mem_obj_id:
            assert not (first[a] <= last[b] and first[b] <= last[a]), (planned[a].name, planned[b].name)
    for t in planned.values():
        assert t.mem_offset + t.stored_nbytes <= sizes[t.mem_obj_id]
    total = sum(-(-t.stored_nbytes // 4) * 4 for t in planned.values())  # whole 32-bit words each
    planned_bytes = sum(sizes.values())
    assert planned_bytes < 0.6 * total  # the multi-layer step reuses most of its activation memory
    memory = summarize_pte(step_pte)["delegates"][0]["memory"]
    assert memory["planned_bytes"] == planned_bytes and memory["unplanned_bytes"] == total
    # Inputs, state and constants are never planned into shared objects.
    for value_id in list(step_graph.inputs) + [s.state_id for s in step_graph.mutable_state]:
        assert step_graph.tensor(value_id).mem_obj_id == -1


def test_identical_weights_are_stored_once():
    model = build_model("mlp-lora", dim=64, hidden=64, n_layers=2, seed=4)
    with torch.no_grad():
        model.layers[1].weight.copy_(model.layers[0].weight)  # same bytes in two layers
    apply_lora(model, LoRAConfig(rank=2, group_size=GROUP_SIZE))
    pte = lower_to_pte(export_forward(model, BATCH))
    payload = read_pte(pte).delegates[0].payload
    graph = deserialize_blob(payload)
    packed = pack_w4x8(model.layers[0].weights.numpy(), 64).tobytes()
    named = _named_tensors(graph)
    for path in ("layers.0", "layers.1"):
        assert graph.constant_array(named[f"model.{path}.weights"][0]).tobytes() == packed
    assert payload.count(packed) == 1
    constants = summarize_pte(pte)["delegates"][0]["constants"]
    assert constants["bytes"] - constants["deduplicated_bytes"] >= len(packed)


def test_refusals_reach_the_blob_metadata():
    class Cumsum(torch.nn.Module):
        def forward(self, x):
            return torch.relu(torch.cumsum(x * 3.0, dim=0))

    pte = lower_to_pte(torch.export.export(Cumsum(), (torch.randn(4, 4),)))
    report = summarize_pte(pte)
    assert report["delegate_calls"] == 2 and report["kernel_calls"] == 1
    assert report["operators"] == ["aten::cumsum.out"]
    assert [r["op"] for r in report["refusals"]] == ["aten.cumsum.default"]
    assert "no OpFeatures registered" in report["refusals"][0]["reason"]


# ---------------------------------------------------------------------------------------------------
# Execute the blob with a small numpy interpreter: checks that the op chain, argument order, constants
# (W_4X8 decoded back through vktrain.quant) and the state mapping mean what the exported program means.


def _np_fused_ce(logits, labels, n_valid):
    logits = logits.astype(np.float64)
    valid = labels >= 0
    shifted = logits - logits.max(axis=1, keepdims=True)
    lse = np.log(np.exp(shifted).sum(axis=1))
    picked = shifted[np.arange(len(labels)), np.where(valid, labels, 0)]
    loss = np.where(valid, lse - picked, 0.0).sum() / n_valid
    softmax = np.exp(shifted - lse[:, None])
    softmax[np.arange(len(labels)), np.where(valid, labels, 0)] -= 1.0
    return np.float32(loss), (np.where(valid[:, None], softmax, 0.0) / n_valid).astype(np.float32)


def _np_adamw(p, m, v, g, hparams, t):
    lr, b1, b2, eps, wd = (float(h) for h in hparams)
    p = p * (1 - lr * wd)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    p = p - lr * (m / (1 - b1 ** float(t))) / (np.sqrt(v / (1 - b2 ** float(t))) + eps)
    return p.astype(np.float32), m.astype(np.float32), v.astype(np.float32)


class _BlobInterpreter:
    def __init__(self, graph):
        self.graph = graph
        self.state = {}
        for s in graph.mutable_state:
            t = graph.tensor(s.state_id)
            initial = (np.zeros(t.shape, t.dtype.numpy_dtype) if s.initial_constant_id < 0 else
                       np.frombuffer(graph.constants[s.initial_constant_id], t.dtype.numpy_dtype).reshape(t.shape))
            self.state[s.state_id] = initial.copy()

    def _weights(self, value_id, scales, group_size):
        t = self.graph.tensor(value_id)
        assert t.layout == Layout.Q4GSW_W4X8
        N, K = scales.shape[1], scales.shape[0] * group_size
        flat = unpack_w4x8(self.graph.constant_array(value_id), N, K)
        return dequantize(flat, scales, group_size)

    def run(self, inputs_by_name):
        g = self.graph
        env = dict(self.state)
        for value_id in g.inputs:
            env[value_id] = inputs_by_name[g.tensor(value_id).name]

        def val(i):
            if i in env:
                return env[i]
            v = g.values[i]
            if hasattr(v, "constant_id") and v.constant_id >= 0:
                return g.constant_array(i)
            if hasattr(v, "items"):
                return v.items
            return getattr(v, "value", None)  # NullValue -> None

        for op in g.ops:
            a = [val(i) if not (hasattr(g.values[i], "layout") and g.values[i].layout == Layout.Q4GSW_W4X8)
                 else i for i in op.args]
            name = op.name
            if name == "aten.view_copy.default":
                out = (a[0].reshape(a[1]),)
            elif name == "aten.permute_copy.default":
                out = (np.ascontiguousarray(a[0].transpose(a[1])),)
            elif name == "aten.mm.default":
                out = (a[0] @ a[1],)
            elif name == "aten.addmm.default":
                out = (np.asarray(a[3] * a[0] + a[4] * (a[1] @ a[2]), np.float32),)
            elif name == "aten.mul.Tensor":
                out = (np.asarray(a[0] * a[1], np.float32),)
            elif name == "vktrain.mm_scaled.default":  # the product rounded to fp32, then the fp32 multiply
                out = (np.asarray(a[0] @ a[1], np.float32) * np.float32(a[2]),)
            elif name == "aten.add.Tensor":
                out = (np.asarray(a[0] + a[2] * a[1], np.float32),)
            elif name == "aten.relu.default":
                out = (np.maximum(a[0], 0),)
            elif name == "aten.threshold_backward.default":
                out = (np.where(a[1] <= a[2], np.float32(0), a[0]),)
            elif name == "aten.embedding.default":
                out = (a[0][a[1]],)
            elif name == "vktrain.linear_q4gsw.default":
                W = self._weights(a[1], a[2], a[3])
                out = ((a[0] @ W.T + (0 if a[4] is None else a[4])).astype(np.float32),)
            elif name == "vktrain.linear_q4gsw_backward.default":
                out = ((a[0] @ self._weights(a[1], a[2], a[3])).astype(np.float32),)
            elif name == "vktrain.fused_ce.default":
                out = _np_fused_ce(*a)
            elif name == "vktrain.adamw.default":
                out = _np_adamw(*a)
            else:
                raise NotImplementedError(name)
            for value_id, result in zip(op.outputs, out):
                expected = g.tensor(value_id)
                result = np.asarray(result)
                assert result.shape == expected.shape, (name, result.shape, expected.shape)
                env[value_id] = result
        for s in g.mutable_state:
            self.state[s.state_id] = env[s.update_id]
        return [env[i] for i in g.outputs]

    def state_by_name(self):
        return {self.graph.tensor(i).name: v for i, v in self.state.items()}


def test_interpreting_the_blob_reproduces_the_exported_step(step_program, step_graph):
    program = copy.deepcopy(step_program).module()  # running it mutates its buffers
    interpreter = _BlobInterpreter(step_graph)
    gen = torch.Generator().manual_seed(21)
    # eps well above float32 gradient noise: AdamW divides by sqrt(v), which amplifies rounding
    # differences of near-zero gradients (numpy vs torch matmul order) up to ~lr with a tiny eps.
    hparams = adamw_hparams(5e-2, 0.9, 0.99, 1e-3, 0.05)
    for _ in range(2):
        ids = torch.randint(0, 256, BATCH, generator=gen)
        labels = torch.randint(-1, 256, BATCH, generator=gen)
        n_valid = (labels >= 0).sum().to(torch.float32)
        expected = program(ids, labels, hparams, n_valid)
        (loss,) = interpreter.run({"token_ids": ids.numpy(), "labels": labels.numpy(), "n_valid": n_valid.numpy(),
                                   "hparams": hparams.numpy()})
        np.testing.assert_allclose(loss, expected.numpy(), rtol=1e-5)
    state = interpreter.state_by_name()
    assert state["optimizer.step"] == 2.0
    for name, value in state.items():
        np.testing.assert_allclose(value, program.get_buffer(name).numpy(), rtol=1e-4, atol=1e-6, err_msg=name)
