"""GraphExecutor on hand-built VkGraphs (lavapipe), compiled by the backend's passes
(vktrain.backend.passes.compile_graph), against the op library's CPU references.

Covers: the linear_q4gsw -> fused_ce -> backward chain with a W_4X8 constant and an int64 view; AdamW in
place on mutable state with a replayed hparams buffer (and the copy path when the old value is still
needed); the executor binding exactly the recorded storage (memory objects at their planned size, views,
in-place outputs); fused graphs; load-time and input errors; timings. The passes' decisions themselves
are tested in test_backend_passes.py.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import vktrain.ops  # noqa: F401  (registers torch.ops.vktrain.*)
from vktrain.quant import pack_w4x8, quantize
from vktrain.runtime.delegate.executor import ExecutorInputError, GraphExecutor
from vktrain.backend.passes import compile_graph
from vktrain.errors import GraphLoweringError
from vktrain.serialization import graph as vk
from _helpers import planned

F32, I64 = vk.DType.FLOAT32, vk.DType.INT64


def _tensor(graph: vk.VkGraph, dtype, shape, name: str, mem: int = -1) -> int:
    return graph.add_value(vk.TensorValue(dtype, shape, mem_obj_id=mem, name=name))


def _compiled(graph: vk.VkGraph) -> vk.VkGraph:
    compile_graph(graph)
    return graph


def _view_ops(graph: vk.VkGraph) -> set[int]:
    """Indices of the ops the blob records as producing views (the executor dispatches nothing for them)."""
    return {i for i, op in enumerate(graph.ops) if all(graph.tensor(out).is_view for out in op.outputs)}


def _mem_buffers(executor: GraphExecutor) -> dict[str, int]:
    return {key: size for key, size in executor.buffer_bytes.items() if key.startswith("mem")}


def _state(graph: vk.VkGraph, name: str, shape, initial: np.ndarray | None = None) -> tuple[int, int]:
    """A mutable-state tensor and the constant id of its initial value (-1 = zeros)."""
    constant = -1 if initial is None else graph.add_constant(np.ascontiguousarray(initial, np.float32))
    return _tensor(graph, F32, shape, name), constant


# ------------------------------------------------------------------------------------------------
# linear_q4gsw -> fused_ce -> linear_q4gsw_backward / linear_dW
# ------------------------------------------------------------------------------------------------

M, K, N, GROUP = 12, 64, 40, 32


@pytest.fixture(scope="module")
def linear_ce_case():
    rng = np.random.default_rng(7)
    weight = rng.standard_normal((N, K)).astype(np.float32)
    flat, scales = quantize(weight, GROUP)

    g = vk.VkGraph()
    x = _tensor(g, F32, (M, K), "x")
    labels_2d = _tensor(g, I64, (3, 4), "labels")
    n_valid = _tensor(g, F32, (), "n_valid")
    g.inputs = [x, labels_2d, n_valid]
    w = g.add_constant_tensor(pack_w4x8(flat, K), vk.Layout.Q4GSW_W4X8, "head.weights")
    s = g.add_constant_tensor(scales, name="head.scales")
    group_size, no_bias, flat_shape = g.add_value(vk.IntValue(GROUP)), g.add_value(vk.NullValue()), \
        g.add_value(vk.IntListValue((M,)))
    labels = _tensor(g, I64, (M,), "labels_flat")
    logits = _tensor(g, F32, (M, N), "logits")  # ops 1-2
    loss = _tensor(g, F32, (), "loss")
    dlogits = _tensor(g, F32, (M, N), "dlogits")
    d_x = _tensor(g, F32, (M, K), "d_x")  # op 3 on: disjoint from logits
    d_w = _tensor(g, F32, (N, K), "d_w")
    g.ops = [
        vk.OpCall("aten.view_copy.default", (labels_2d, flat_shape), (labels,)),
        vk.OpCall("vktrain.linear_q4gsw.default", (x, w, s, group_size, no_bias), (logits,)),
        vk.OpCall("vktrain.fused_ce.default", (logits, labels, n_valid), (loss, dlogits)),
        vk.OpCall("vktrain.linear_q4gsw_backward.default", (dlogits, w, s, group_size), (d_x,)),
        vk.OpCall("vktrain.linear_dW.default", (dlogits, x), (d_w,)),
    ]
    g.outputs = [loss, d_x, d_w]
    return _compiled(g), flat, scales, dict(labels=labels, labels_2d=labels_2d, logits=logits, dlogits=dlogits, d_x=d_x)


def _reference_chain(x, labels, n_valid, flat, scales):
    x_t, w_t, s_t = torch.from_numpy(x), torch.from_numpy(flat), torch.from_numpy(scales)
    logits = torch.ops.vktrain.linear_q4gsw(x_t, w_t, s_t, GROUP)
    loss, dlogits = torch.ops.vktrain.fused_ce(logits, torch.from_numpy(labels).reshape(-1),
                                               torch.tensor(n_valid, dtype=torch.float32))
    d_x = torch.ops.vktrain.linear_q4gsw_backward(dlogits, w_t, s_t, GROUP)
    d_w = torch.ops.vktrain.linear_dW(dlogits, x_t)
    return loss.numpy(), d_x.numpy(), d_w.numpy()


@pytest.mark.parametrize("staging", [None, True], ids=["default_path", "staging_copies"])
def test_linear_ce_chain_matches_op_library(vk_device, linear_ce_case, staging):
    graph, flat, scales, ids = linear_ce_case
    rng = np.random.default_rng(0)
    with GraphExecutor(vk_device, graph, planned(vk_device, graph), staging=staging) as executor:
        # The labels view is the input's buffer; the cross-entropy gradient overwrites its logits (one memory
        # object, passes/ce_in_place.py), which are allocated at their planned size.
        assert executor.storage_of(ids["labels"]) == executor.storage_of(ids["labels_2d"])
        assert executor.storage_of(ids["logits"]) == executor.storage_of(ids["dlogits"])
        assert executor.storage_of(ids["logits"]).startswith("mem")
        assert _mem_buffers(executor) == {f"mem{m.id}": m.size_bytes for m in graph.memory_objects}
        assert not any(d.name.startswith("0:") for d in executor.dispatches)
        for trial in range(2):  # the second replay sees new inputs through the same recorded Program
            x = rng.standard_normal((M, K)).astype(np.float32)
            labels = rng.integers(0, N, (3, 4))
            labels[trial, :2] = -1  # ignored rows
            n_valid = float(np.count_nonzero(labels >= 0))
            loss, d_x, d_w = executor.run(x, labels, np.float32(n_valid))
            ref_loss, ref_dx, ref_dw = _reference_chain(x, labels, n_valid, flat, scales)
            np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
            np.testing.assert_allclose(d_x, ref_dx, rtol=1e-4, atol=1e-5 * np.abs(ref_dx).max())
            np.testing.assert_allclose(d_w, ref_dw, rtol=1e-4, atol=1e-5 * np.abs(ref_dw).max())


def test_input_errors_name_the_problem(vk_device, linear_ce_case):
    graph = linear_ce_case[0]
    x = np.zeros((M, K), np.float32)
    labels = np.zeros((3, 4), np.int64)
    with GraphExecutor(vk_device, graph, planned(vk_device, graph)) as executor:
        with pytest.raises(ExecutorInputError, match=r"input 'x' has shape \[12, 60\], expected \[12, 64\]"):
            executor.run(np.zeros((M, 60), np.float32), labels, np.float32(1))
        with pytest.raises(ExecutorInputError, match=r"input 'labels' holds values in \[0, 4294967296\]"):
            executor.run(x, np.full((3, 4), 2**32, np.int64) * (np.arange(12).reshape(3, 4) > 0), np.float32(1))
        # A label >= V would be silently ignored by the kernel (the CPU reference raises): refused on the host.
        bad_labels = labels.copy()
        bad_labels[2, 1] = N
        with pytest.raises(ExecutorInputError, match=r"input 'labels' holds 40 at \[2, 1\], but it must be a class "
                                                     r"of the 40-wide logits of op 2 \(fused_ce\) \(< 40\)"):
            executor.run(x, bad_labels, np.float32(1))
        assert executor.index_limits == {"labels": N}
        executor.run(x, np.full((3, 4), -100), np.float32(1))  # any negative label is an ignored row
        with pytest.raises(ExecutorInputError, match="input 'labels' must hold integers"):
            executor.run(x, labels.astype(np.float32), np.float32(1))
        with pytest.raises(ExecutorInputError, match=r"takes 3 inputs \(x, labels, n_valid\), got 2"):
            executor.run(x, labels)


# ------------------------------------------------------------------------------------------------
# AdamW on mutable state
# ------------------------------------------------------------------------------------------------

NUMEL = 10  # 2 vec4s + a 2-element scalar tail


def _adamw_graph(read_param_after_update: bool):
    g = vk.VkGraph()
    rng = np.random.default_rng(3)
    initial_param = rng.standard_normal(NUMEL).astype(np.float32)
    param, param_init = _state(g, "model.w.lora_A", (NUMEL,), initial_param)
    exp_avg, _ = _state(g, "optimizer.exp_avg.w.lora_A", (NUMEL,))
    exp_avg_sq, _ = _state(g, "optimizer.exp_avg_sq.w.lora_A", (NUMEL,))
    step, _ = _state(g, "optimizer.step", ())
    grad = _tensor(g, F32, (NUMEL,), "grad")
    hparams = _tensor(g, F32, (5,), "hparams")
    g.inputs = [grad, hparams]
    one = g.add_constant_tensor(np.array(1.0, np.float32), name="one")
    alpha = g.add_value(vk.IntValue(1))
    new_step = _tensor(g, F32, (), "step_plus_one")
    new_param, new_avg, new_avg_sq = (_tensor(g, F32, (NUMEL,), f"adamw[{i}]") for i in range(3))
    g.ops = [vk.OpCall("aten.add.Tensor", (step, one, alpha), (new_step,)),
             vk.OpCall("vktrain.adamw.default", (param, exp_avg, exp_avg_sq, grad, hparams, new_step),
                       (new_param, new_avg, new_avg_sq))]
    if read_param_after_update:
        # Returns the parameter as it was before the update: the update cannot overwrite it in place.
        old_param = _tensor(g, F32, (NUMEL,), "old_param_times_one")
        g.ops.append(vk.OpCall("aten.mul.Tensor", (param, one), (old_param,)))
        g.outputs = [old_param]
    else:
        g.outputs = [new_step]
    g.mutable_state = [vk.MutableState(step, new_step), vk.MutableState(param, new_param, param_init),
                       vk.MutableState(exp_avg, new_avg), vk.MutableState(exp_avg_sq, new_avg_sq)]
    return _compiled(g), initial_param, dict(param=param, new_param=new_param, exp_avg=exp_avg, new_avg=new_avg)


HPARAM_SCHEDULE = [np.array([lr, 0.9, 0.999, 1e-8, wd], np.float32)
                   for lr, wd in ((1e-2, 0.0), (5e-3, 0.1), (2e-2, 0.01))]


@pytest.mark.parametrize("read_param_after_update", [False, True], ids=["in_place", "copy_then_update"])
def test_adamw_state_updates_follow_torch_reference(vk_device, read_param_after_update):
    graph, initial_param, ids = _adamw_graph(read_param_after_update)
    rng = np.random.default_rng(11)
    param = torch.from_numpy(initial_param.copy())
    exp_avg, exp_avg_sq = torch.zeros(NUMEL), torch.zeros(NUMEL)
    with GraphExecutor(vk_device, graph, planned(vk_device, graph)) as executor:
        in_place = executor.storage_of(ids["new_param"]) == executor.storage_of(ids["param"])
        assert in_place is not read_param_after_update
        assert executor.storage_of(ids["new_avg"]) == executor.storage_of(ids["exp_avg"])
        copies = sorted(d.name for d in executor.dispatches if d.name.startswith("state_update:"))
        expected = ["state_update:optimizer.step"] + (["state_update:model.w.lora_A"] if read_param_after_update else [])
        assert copies == sorted(expected)
        for t, hparams in enumerate(HPARAM_SCHEDULE, start=1):
            grad = rng.standard_normal(NUMEL).astype(np.float32)
            (output,) = executor.run(grad, hparams)
            if read_param_after_update:
                np.testing.assert_array_equal(output, param.numpy())
            else:
                assert output == np.float32(t)
            param, exp_avg, exp_avg_sq = torch.ops.vktrain.adamw(
                param, exp_avg, exp_avg_sq, torch.from_numpy(grad), torch.from_numpy(hparams),
                torch.tensor(float(t)))
            np.testing.assert_allclose(executor.read_state("model.w.lora_A"), param.numpy(), rtol=1e-5, atol=1e-7)
            np.testing.assert_allclose(executor.read_state("optimizer.exp_avg.w.lora_A"), exp_avg.numpy(),
                                       rtol=1e-5, atol=1e-8)
            np.testing.assert_allclose(executor.read_state("optimizer.exp_avg_sq.w.lora_A"), exp_avg_sq.numpy(),
                                       rtol=1e-5, atol=1e-10)
            assert executor.read_state("optimizer.step") == np.float32(t)


@pytest.mark.parametrize("staging", [None, True], ids=["default_path", "staging_copies"])
def test_state_read_write_reset(vk_device, staging):
    graph, initial_param, _ = _adamw_graph(read_param_after_update=False)
    with GraphExecutor(vk_device, graph, planned(vk_device, graph), staging=staging) as executor:
        assert executor.state_names == ["optimizer.step", "model.w.lora_A", "optimizer.exp_avg.w.lora_A",
                                        "optimizer.exp_avg_sq.w.lora_A"]
        np.testing.assert_array_equal(executor.read_state("model.w.lora_A"), initial_param)
        np.testing.assert_array_equal(executor.read_state("optimizer.exp_avg.w.lora_A"), np.zeros(NUMEL, np.float32))
        executor.run(np.ones(NUMEL, np.float32), HPARAM_SCHEDULE[0])
        checkpoint = {name: executor.read_state(name) for name in executor.state_names}
        assert not np.array_equal(checkpoint["model.w.lora_A"], initial_param)
        executor.run(np.ones(NUMEL, np.float32), HPARAM_SCHEDULE[0])
        for name, value in checkpoint.items():
            executor.write_state(name, value)
        np.testing.assert_array_equal(executor.read_state("model.w.lora_A"), checkpoint["model.w.lora_A"])
        assert executor.read_state("optimizer.step") == np.float32(1)
        executor.reset_state()
        np.testing.assert_array_equal(executor.read_state("model.w.lora_A"), initial_param)
        assert executor.read_state("optimizer.step") == np.float32(0)
        with pytest.raises(KeyError, match="no mutable state named 'model.w.lora_B'"):
            executor.read_state("model.w.lora_B")
        with pytest.raises(ExecutorInputError, match=r"has shape \[10\], got an array of shape \[9\]"):
            executor.write_state("model.w.lora_A", np.zeros(9, np.float32))


# ------------------------------------------------------------------------------------------------
# Memory objects, views and the threshold_backward rewrite
# ------------------------------------------------------------------------------------------------

def _shared_memory_graph(exp_first: bool):
    """[c = exp(x);] a = relu(x or c); v = view(a); b = neg(v); y = b * v; w = view(y); z = exp(w)"""
    g = vk.VkGraph()
    x = _tensor(g, F32, (4, 6), "x")
    g.inputs = [x]
    ops = []
    relu_input = x
    if exp_first:
        relu_input = _tensor(g, F32, (4, 6), "c")
        ops.append(vk.OpCall("aten.exp.default", (x,), (relu_input,)))
    a = _tensor(g, F32, (4, 6), "a")
    v = _tensor(g, F32, (24,), "v")
    b = _tensor(g, F32, (24,), "b")
    y = _tensor(g, F32, (24,), "y")
    w = _tensor(g, F32, (2, 12), "w")
    z = _tensor(g, F32, (2, 12), "z")
    ops += [vk.OpCall("aten.relu.default", (relu_input,), (a,)),
            vk.OpCall("aten.view_copy.default", (a, g.add_value(vk.IntListValue((-1,)))), (v,)),
            vk.OpCall("aten.neg.default", (v,), (b,)),
            vk.OpCall("aten.mul.Tensor", (b, v), (y,)),
            vk.OpCall("aten.view_copy.default", (y, g.add_value(vk.IntListValue((2, 12)))), (w,)),
            vk.OpCall("aten.exp.default", (w,), (z,))]
    g.ops = ops
    g.outputs = [z]
    return _compiled(g), dict(a=a, v=v, b=b, y=y, w=w, z=z)


def _storage_lifetimes(graph: vk.VkGraph) -> dict[int, tuple[int, int]]:
    """Per storage root: [first write, last read] over every tensor using that storage, recomputed from the
    op chain (reads after the step count as len(ops)), independently of the planner."""
    spans: dict[int, list[int]] = {}
    for index, op in enumerate(graph.ops):
        for value_id in op.args + op.outputs:
            if isinstance(graph.values[value_id], vk.TensorValue):
                tensor = graph.tensor(value_id)
                root = tensor.storage_of if tensor.storage_of >= 0 else value_id
                spans.setdefault(root, []).append(index)
    for value_id in graph.outputs:
        tensor = graph.tensor(value_id)
        spans.setdefault(tensor.storage_of if tensor.storage_of >= 0 else value_id, []).append(len(graph.ops))
    return {root: (min(indices), max(indices)) for root, indices in spans.items()}


@pytest.mark.parametrize("exp_first", [False, True], ids=["relu_of_input", "relu_of_exp"])
def test_memory_objects_and_views_bind_the_recorded_storage(vk_device, exp_first):
    graph, ids = _shared_memory_graph(exp_first)
    x = np.random.default_rng(5).standard_normal((4, 6)).astype(np.float32)
    shift = len(graph.ops) - 6  # op index of relu
    assert _view_ops(graph) == {shift + 1, shift + 4}
    lifetimes = _storage_lifetimes(graph)
    with GraphExecutor(vk_device, graph, planned(vk_device, graph)) as executor:
        assert executor.storage_of(ids["a"]) == executor.storage_of(ids["v"])
        assert executor.storage_of(ids["w"]) == executor.storage_of(ids["y"])
        # Storage roots sharing a buffer are never alive at the same time.
        roots = [v for v in lifetimes if executor.storage_of(v).startswith("mem")]
        for first in roots:
            for second in roots:
                if first < second and executor.storage_of(first) == executor.storage_of(second):
                    (a0, a1), (b0, b1) = lifetimes[first], lifetimes[second]
                    assert a1 < b0 or b1 < a0, (first, second)
        assert _mem_buffers(executor) == {f"mem{m.id}": m.size_bytes for m in graph.memory_objects}
        assert all(m.size_bytes == 96 for m in graph.memory_objects)
        (z,) = executor.run(x)
    x64 = x.astype(np.float64)
    relu = np.maximum(np.exp(x64) if exp_first else x64, 0).reshape(-1)
    np.testing.assert_allclose(z, np.exp(-relu * relu).reshape(2, 12), rtol=1e-5)


def _relu_backward_graph():
    g = vk.VkGraph()
    h = _tensor(g, F32, (3, 8), "h")
    grad = _tensor(g, F32, (3, 8), "grad")
    g.inputs = [h, grad]
    mask = _tensor(g, vk.DType.BOOL, (3, 8), "mask")
    zero = _tensor(g, F32, (), "zero")
    d_h = _tensor(g, F32, (3, 8), "d_h")
    null = g.add_value(vk.NullValue())
    g.ops = [vk.OpCall("aten.le.Scalar", (h, g.add_value(vk.IntValue(0))), (mask,)),
             vk.OpCall("aten.scalar_tensor.default",
                       (g.add_value(vk.IntValue(0)), g.add_value(vk.StringValue("float32")),
                        g.add_value(vk.StringValue("strided")), g.add_value(vk.StringValue("cpu")), null), (zero,)),
             vk.OpCall("aten.where.self", (mask, zero, grad), (d_h,))]
    g.outputs = [d_h]
    return g


def test_where_le_becomes_threshold_backward(vk_device):
    graph = _compiled(_relu_backward_graph())
    assert [op.name for op in graph.ops] == ["aten.threshold_backward.default"]
    rng = np.random.default_rng(2)
    h = np.maximum(rng.standard_normal((3, 8)), 0).astype(np.float32)  # a ReLU output: exact zeros
    grad = rng.standard_normal((3, 8)).astype(np.float32)
    with GraphExecutor(vk_device, graph, planned(vk_device, graph)) as executor:
        (d_h,) = executor.run(h, grad)
    expected = torch.where(torch.from_numpy(h) <= 0, torch.tensor(0.0), torch.from_numpy(grad)).numpy()
    np.testing.assert_array_equal(d_h, expected)


def test_unsupported_op_fails_at_load(vk_device):
    g = vk.VkGraph()
    x = _tensor(g, F32, (4,), "x")
    y = _tensor(g, F32, (4,), "y")
    g.inputs, g.outputs = [x], [y]
    g.ops = [vk.OpCall("aten.sin.default", (x,), (y,))]
    with pytest.raises(GraphLoweringError, match=r"unsupported op aten.sin.default \(op 0\)"):
        GraphExecutor(vk_device, g, planned(vk_device, g))


def test_wrong_arity_fails_at_load(vk_device):
    g = vk.VkGraph()
    x = _tensor(g, F32, (4,), "x")
    y = _tensor(g, F32, (4,), "y")
    g.inputs, g.outputs = [x], [y]
    g.ops = [vk.OpCall("aten.add.Tensor", (x, x), (y,))]
    with pytest.raises(GraphLoweringError, match=r"has 2 arguments, its schema has 3 \(self, other, alpha\)"):
        GraphExecutor(vk_device, g, planned(vk_device, g))


def test_timings_label_every_dispatch(vk_device):
    graph, _ = _shared_memory_graph(exp_first=True)
    with GraphExecutor(vk_device, graph, planned(vk_device, graph)) as executor:
        with pytest.raises(RuntimeError, match="before the first run"):
            executor.timings()
        executor.run(np.ones((4, 6), np.float32))
        timings = executor.timings()
        if timings is None:
            pytest.skip("the device cannot write timestamps")
        assert [label for label, _ in timings] == [d.name for d in executor.dispatches]
        assert [label.split(":")[0] for label, _ in timings] == ["0", "1", "3", "4", "6"]
        assert all(seconds >= 0 for _, seconds in timings)


def _transpose_graph():
    """t = x.T (read only by mm: a view); y = t @ w; tt = t.T (cancels: x's bytes again) -> relu;
    u = y.T read by relu (needs contiguous data: one strided copy)."""
    g = vk.VkGraph()
    x = _tensor(g, F32, (4, 6), "x")
    w = _tensor(g, F32, (4, 5), "w")
    g.inputs = [x, w]
    swap = g.add_value(vk.IntListValue((1, 0)))
    t, y, tt, r1, u, r2 = (_tensor(g, F32, shape, name) for shape, name in (
        ((6, 4), "t"), ((6, 5), "y"), ((4, 6), "tt"), ((4, 6), "r1"), ((5, 6), "u"), ((5, 6), "r2")))
    g.ops = [vk.OpCall("aten.permute_copy.default", (x, swap), (t,)),
             vk.OpCall("aten.mm.default", (t, w), (y,)),
             vk.OpCall("aten.t_copy.default", (t,), (tt,)),
             vk.OpCall("aten.relu.default", (tt,), (r1,)),
             vk.OpCall("aten.transpose_copy.int", (y, g.add_value(vk.IntValue(0)), g.add_value(vk.IntValue(1))), (u,)),
             vk.OpCall("aten.relu.default", (u,), (r2,))]
    g.outputs = [y, r1, r2]
    return _compiled(g), dict(x=x, t=t, tt=tt, u=u)


def test_transposes_are_views_where_readers_allow(vk_device):
    graph, ids = _transpose_graph()
    rng = np.random.default_rng(9)
    x = rng.standard_normal((4, 6)).astype(np.float32)
    w = rng.standard_normal((4, 5)).astype(np.float32)
    assert _view_ops(graph) == {0, 2}
    assert graph.tensor(ids["t"]).view_strides == (1, 6) and graph.tensor(ids["tt"]).view_strides == ()
    with GraphExecutor(vk_device, graph, planned(vk_device, graph)) as executor:
        assert executor.storage_of(ids["t"]) == executor.storage_of(ids["tt"]) == executor.storage_of(ids["x"])
        assert executor.storage_of(ids["u"]) != executor.storage_of(ids["x"])
        assert [d.name.split(":")[0] for d in executor.dispatches] == ["1", "3", "4", "5"]
        y, r1, r2 = executor.run(x, w)
    y_ref = x.astype(np.float64).T @ w.astype(np.float64)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(r1, np.maximum(x, 0))
    np.testing.assert_allclose(r2, np.maximum(y_ref.T, 0), rtol=1e-5, atol=1e-6)


def test_views_take_no_planned_memory(vk_device):
    """lm_head's pattern: t = weight.T; logits = x @ t; r = relu(logits); flat = view(r). t is a view of
    the constant's bytes and flat a view of r, so only logits and r (overlapping at relu) are planned."""
    vocab, dim, rows = 16, 8, 3
    g = vk.VkGraph()
    x = _tensor(g, F32, (rows, dim), "x")
    g.inputs = [x]
    weight_array = np.random.default_rng(11).standard_normal((vocab, dim)).astype(np.float32)
    weight = g.add_constant_tensor(weight_array, name="lm_head.weight")
    t = _tensor(g, F32, (dim, vocab), "t")
    logits = _tensor(g, F32, (rows, vocab), "logits")
    r = _tensor(g, F32, (rows, vocab), "r")
    flat = _tensor(g, F32, (rows * vocab,), "flat")
    g.ops = [vk.OpCall("aten.permute_copy.default", (weight, g.add_value(vk.IntListValue((1, 0)))), (t,)),
             vk.OpCall("aten.mm.default", (x, t), (logits,)),
             vk.OpCall("aten.relu.default", (logits,), (r,)),
             vk.OpCall("aten.view_copy.default", (r, g.add_value(vk.IntListValue((-1,)))), (flat,))]
    g.outputs = [flat]
    _compiled(g)
    assert _view_ops(g) == {0, 3}
    x_array = np.random.default_rng(12).standard_normal((rows, dim)).astype(np.float32)
    with GraphExecutor(vk_device, g, planned(vk_device, g)) as executor:
        assert executor.storage_of(t) == executor.storage_of(weight)
        assert executor.storage_of(r) == executor.storage_of(flat) != executor.storage_of(logits)
        assert _mem_buffers(executor) == {"mem0": 4 * rows * vocab, "mem1": 4 * rows * vocab}
        (result,) = executor.run(x_array)
    expected = np.maximum(x_array.astype(np.float64) @ weight_array.astype(np.float64).T, 0).reshape(-1)
    np.testing.assert_allclose(result, expected, rtol=1e-5, atol=1e-6)


def test_fusion_runs_before_memory_planning(vk_device):
    """Planned on the blob's op list, neg's output could reuse relu's storage once `le` had read it; after
    the rewrite threshold_backward still reads the relu output then. Fusion runs before the one memory
    planning, so the plan already keeps them apart."""
    g = vk.VkGraph()
    x = _tensor(g, F32, (2, 8), "x")
    grad = _tensor(g, F32, (2, 8), "grad")
    g.inputs = [x, grad]
    h = _tensor(g, F32, (2, 8), "h")
    mask = _tensor(g, vk.DType.BOOL, (2, 8), "mask")
    zero = _tensor(g, F32, (), "zero")
    negated = _tensor(g, F32, (2, 8), "negated")
    d_h = _tensor(g, F32, (2, 8), "d_h")
    g.ops = [vk.OpCall("aten.relu.default", (x,), (h,)),
             vk.OpCall("aten.le.Scalar", (h, g.add_value(vk.IntValue(0))), (mask,)),
             vk.OpCall("aten.scalar_tensor.default", (g.add_value(vk.DoubleValue(0.0)),), (zero,)),
             vk.OpCall("aten.neg.default", (grad,), (negated,)),
             vk.OpCall("aten.where.self", (mask, zero, negated), (d_h,))]
    g.outputs = [d_h]
    _compiled(g)
    assert [op.name for op in g.ops] == ["aten.relu.default", "aten.neg.default", "aten.threshold_backward.default"]
    rng = np.random.default_rng(4)
    x_in = rng.standard_normal((2, 8)).astype(np.float32)
    grad_in = rng.standard_normal((2, 8)).astype(np.float32)
    with GraphExecutor(vk_device, g, planned(vk_device, g)) as executor:
        assert executor.storage_of(h) != executor.storage_of(negated)
        (result,) = executor.run(x_in, grad_in)
    np.testing.assert_array_equal(result, np.where(x_in <= 0, np.float32(0), -grad_in))


def test_requantized_weights_feed_the_linear_kernel(vk_device):
    """q4gsw_requant writes W_4X8 words on the GPU (the graph declares flat uint8): linear_q4gsw reads them."""
    n, k, rows = 12, 64, 3  # N % 8 == 4: the W_4X8 buffer is larger than the flat one
    rng = np.random.default_rng(8)
    _, scales = quantize(rng.standard_normal((n, k)).astype(np.float32), GROUP)
    g = vk.VkGraph()
    latent = _tensor(g, F32, (n, k), "latent")
    x = _tensor(g, F32, (rows, k), "x")
    g.inputs = [latent, x]
    s = g.add_constant_tensor(scales, name="scales")
    group_size = g.add_value(vk.IntValue(GROUP))
    codes = g.add_value(vk.TensorValue(vk.DType.UINT8, (n, k // 2), vk.Layout.Q4GSW_FLAT, name="codes"))
    y = _tensor(g, F32, (rows, n), "y")
    g.ops = [vk.OpCall("vktrain.q4gsw_requant.default", (latent, s, group_size), (codes,)),
             vk.OpCall("vktrain.linear_q4gsw.default", (x, codes, s, group_size, g.add_value(vk.NullValue())), (y,))]
    g.outputs = [y]
    _compiled(g)
    latent_in = (rng.standard_normal((n, k)) * 4 * scales.repeat(GROUP, axis=0).T).astype(np.float32)
    x_in = rng.standard_normal((rows, k)).astype(np.float32)
    with GraphExecutor(vk_device, g, planned(vk_device, g)) as executor:
        (result,) = executor.run(latent_in, x_in)
    flat = torch.ops.vktrain.q4gsw_requant(torch.from_numpy(latent_in), torch.from_numpy(scales), GROUP)
    expected = torch.ops.vktrain.linear_q4gsw(torch.from_numpy(x_in), flat, torch.from_numpy(scales), GROUP).numpy()
    np.testing.assert_allclose(result, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def test_requantized_weights_cannot_be_returned(vk_device):
    g = vk.VkGraph()
    latent = _tensor(g, F32, (8, 32), "latent")
    g.inputs = [latent]
    s = g.add_constant_tensor(np.ones((1, 8), np.float32), name="scales")
    codes = g.add_value(vk.TensorValue(vk.DType.UINT8, (8, 16), vk.Layout.Q4GSW_FLAT, name="codes"))
    g.ops = [vk.OpCall("vktrain.q4gsw_requant.default", (latent, s, g.add_value(vk.IntValue(32))), (codes,))]
    g.outputs = [codes]
    with pytest.raises(vk.GraphError, match="q4gsw_requant result of op 0, W_4X8 words on the GPU"):
        compile_graph(g)


def test_dtype_copies_convert_or_alias(vk_device):
    """_to_dim_order_copy (ExecuTorch's spelling of .to()): int64 -> float32 converts on the GPU, int64 ->
    int32 is the same bytes there (an alias)."""
    g = vk.VkGraph()
    ids = _tensor(g, I64, (2, 5), "ids")
    g.inputs = [ids]
    as_float = _tensor(g, F32, (2, 5), "as_float")
    as_int32 = _tensor(g, vk.DType.INT32, (2, 5), "as_int32")
    doubled = _tensor(g, F32, (2, 5), "doubled")

    def to_dim_order_copy(dtype: str, out: int) -> vk.OpCall:
        null = g.add_value(vk.NullValue())
        return vk.OpCall("dim_order_ops._to_dim_order_copy.default",
                         (ids, g.add_value(vk.StringValue(dtype)), null, null, null,
                          g.add_value(vk.BoolValue(False)), g.add_value(vk.IntListValue((0, 1)))), (out,))

    g.ops = [to_dim_order_copy("float32", as_float), to_dim_order_copy("int32", as_int32),
             vk.OpCall("aten.mul.Tensor", (as_float, g.add_value(vk.DoubleValue(2.0))), (doubled,))]
    g.outputs = [doubled, as_int32]
    values = np.array([[0, 1, -7, 2**24 + 1, 5], [100, -2**31, 3, 2**31 - 1, 9]], np.int64)
    _compiled(g)
    assert _view_ops(g) == {1}
    with GraphExecutor(vk_device, g, planned(vk_device, g)) as executor:
        doubled_out, int32_out = executor.run(values)
    np.testing.assert_array_equal(doubled_out, values.astype(np.float32) * 2)
    assert int32_out.dtype == np.int32
    np.testing.assert_array_equal(int32_out, values)


def test_one_minus_tensor_built_from_full_like_becomes_rsub(vk_device):
    """SiLU's backward spells 1 - sigmoid(x) as sub(full_like(empty_permuted(...), 1), sigmoid(x))."""
    g = vk.VkGraph()
    x = _tensor(g, F32, (3, 4), "x")
    g.inputs = [x]
    null = g.add_value(vk.NullValue())
    s, empty, ones, out = (_tensor(g, F32, (3, 4), name) for name in ("s", "empty", "ones", "out"))
    g.ops = [vk.OpCall("aten.sigmoid.default", (x,), (s,)),
             vk.OpCall("aten.empty_permuted.default",
                       (g.add_value(vk.IntListValue((3, 4))), g.add_value(vk.IntListValue((0, 1))),
                        g.add_value(vk.StringValue("float32")), g.add_value(vk.StringValue("strided")),
                        g.add_value(vk.StringValue("cpu")), g.add_value(vk.BoolValue(False))), (empty,)),
             vk.OpCall("aten.full_like.default", (empty, g.add_value(vk.IntValue(1)), null, null, null,
                                                  g.add_value(vk.BoolValue(False)), null), (ones,)),
             vk.OpCall("aten.sub.Tensor", (ones, s, g.add_value(vk.IntValue(1))), (out,))]
    g.outputs = [out]
    _compiled(g)
    assert [op.name for op in g.ops] == ["aten.sigmoid.default", "aten.rsub.Scalar"]
    x_in = np.random.default_rng(6).standard_normal((3, 4)).astype(np.float32)
    with GraphExecutor(vk_device, g, planned(vk_device, g)) as executor:
        (result,) = executor.run(x_in)
    np.testing.assert_allclose(result, 1 - torch.sigmoid(torch.from_numpy(x_in)).numpy(), rtol=1e-5, atol=1e-6)


def test_int64_stored_as_int64_is_refused_at_load(vk_device):
    """A graph the backend's passes did not compile stores int64 as int64, which no kernel reads."""
    g = vk.VkGraph()
    ids = _tensor(g, I64, (4,), "ids")
    flat = _tensor(g, I64, (4,), "flat")
    g.inputs, g.outputs = [ids], [flat]
    g.ops = [vk.OpCall("aten.clone.default", (ids, g.add_value(vk.NullValue())), (flat,))]
    with pytest.raises(GraphLoweringError, match=r"value 0 \(ids\) is stored as int64; the GPU kernels hold int64"):
        GraphExecutor(vk_device, g, planned(vk_device, g))


def test_the_executor_binds_recorded_offsets_inside_a_memory_object(vk_device):
    """Storage is whatever the blob records: two tensors alive at once in ONE memory object, at byte
    offsets 0 and 256 (a placement the planner does not make today, so only the record can cause it)."""
    g = vk.VkGraph()
    x = _tensor(g, F32, (4, 6), "x")
    g.inputs = [x]
    g.memory_objects = [vk.MemoryObject(0, 256 + 96)]
    a = g.add_value(vk.TensorValue(F32, (4, 6), mem_obj_id=0, mem_offset=0, name="a"))
    b = g.add_value(vk.TensorValue(F32, (4, 6), mem_obj_id=0, mem_offset=256, name="b"))
    y = _tensor(g, F32, (4, 6), "y")
    g.ops = [vk.OpCall("aten.exp.default", (x,), (a,)),
             vk.OpCall("aten.neg.default", (x,), (b,)),
             vk.OpCall("aten.mul.Tensor", (a, b), (y,))]
    g.outputs = [y]
    x_in = np.random.default_rng(13).standard_normal((4, 6)).astype(np.float32)
    with GraphExecutor(vk_device, g, planned(vk_device, g)) as executor:
        assert executor.buffer_bytes["mem0"] == 256 + 96
        assert executor.storage_of(a) == executor.storage_of(b) == "mem0"
        (result,) = executor.run(x_in)
    x64 = x_in.astype(np.float64)
    np.testing.assert_allclose(result, -np.exp(x64) * x64, rtol=1e-6, atol=1e-7)
