"""The backend's graph passes (vktrain/backend/passes) and the one memory planning, on small hand-built
VkGraphs: a graph in, the recorded decision out (no device). The executor's side (binding the recorded
storage and running it) is tested in test_executor.py."""
from __future__ import annotations

import numpy as np
import pytest

from vktrain.backend.memory_planning import plan_graph_memory
from vktrain.backend.passes import PASSES, compile_graph
from vktrain.backend.passes.fusion import fuse_patterns
from vktrain.backend.passes.in_place import update_state_in_place
from vktrain.backend.passes.prepacked_layout import type_prepacked_outputs
from vktrain.backend.passes.storage_dtype import downcast_int64_storage
from vktrain.backend.passes.views import decide_views
from vktrain.quant import w4x8_num_words
from vktrain.serialization import deserialize_blob, serialize_blob
from vktrain.serialization import graph as vk

from _helpers import assert_import_loads_none

F32, I64, I32 = vk.DType.FLOAT32, vk.DType.INT64, vk.DType.INT32


def _tensor(graph: vk.VkGraph, dtype, shape, name: str) -> int:
    return graph.add_value(vk.TensorValue(dtype, shape, name=name))


def _ints(graph: vk.VkGraph, *items: int) -> int:
    return graph.add_value(vk.IntListValue(items))


# ------------------------------------------------------------------------------------------------
# fusion
# ------------------------------------------------------------------------------------------------

def _relu_backward_graph():
    g = vk.VkGraph()
    h, grad = _tensor(g, F32, (3, 8), "h"), _tensor(g, F32, (3, 8), "grad")
    g.inputs = [h, grad]
    mask = _tensor(g, vk.DType.BOOL, (3, 8), "mask")
    zero = _tensor(g, F32, (), "zero")
    d_h = _tensor(g, F32, (3, 8), "d_h")
    threshold = g.add_value(vk.IntValue(0))
    g.ops = [vk.OpCall("aten.le.Scalar", (h, threshold), (mask,)),
             vk.OpCall("aten.scalar_tensor.default", (g.add_value(vk.IntValue(0)),), (zero,)),
             vk.OpCall("aten.where.self", (mask, zero, grad), (d_h,))]
    g.outputs = [d_h]
    return g, dict(h=h, grad=grad, mask=mask, d_h=d_h, threshold=threshold)


def test_where_le_becomes_threshold_backward_and_the_mask_is_dropped():
    graph, ids = _relu_backward_graph()
    fuse_patterns(graph)
    assert graph.ops == [vk.OpCall("aten.threshold_backward.default", (ids["grad"], ids["h"], ids["threshold"]),
                                   (ids["d_h"],))]


def test_a_mask_with_other_readers_is_kept():
    graph, ids = _relu_backward_graph()
    graph.outputs.append(ids["mask"])  # the mask itself is needed: le stays (the scalar does not)
    fuse_patterns(graph)
    assert [op.name for op in graph.ops] == ["aten.le.Scalar", "aten.threshold_backward.default"]


def test_where_with_a_nonzero_branch_is_not_fused():
    graph, ids = _relu_backward_graph()
    graph.ops[1] = vk.OpCall("aten.scalar_tensor.default", (graph.add_value(vk.DoubleValue(0.5)),),
                             graph.ops[1].outputs)
    before = list(graph.ops)
    fuse_patterns(graph)
    assert graph.ops == before


def test_sub_of_full_like_becomes_rsub():
    g = vk.VkGraph()
    x = _tensor(g, F32, (3, 4), "x")
    g.inputs = [x]
    null = g.add_value(vk.NullValue())
    s, empty, ones, out = (_tensor(g, F32, (3, 4), name) for name in ("s", "empty", "ones", "out"))
    fill, alpha = g.add_value(vk.IntValue(1)), g.add_value(vk.IntValue(1))
    g.ops = [vk.OpCall("aten.sigmoid.default", (x,), (s,)),
             vk.OpCall("aten.empty.memory_format", (_ints(g, 3, 4), null, null, null, null, null), (empty,)),
             vk.OpCall("aten.full_like.default", (empty, fill, null, null, null, g.add_value(vk.BoolValue(False)),
                                                  null), (ones,)),
             vk.OpCall("aten.sub.Tensor", (ones, s, alpha), (out,))]
    g.outputs = [out]
    fuse_patterns(g)
    assert g.ops == [vk.OpCall("aten.sigmoid.default", (x,), (s,)), vk.OpCall("aten.rsub.Scalar", (s, fill, alpha),
                                                                              (out,))]


# ------------------------------------------------------------------------------------------------
# int64 -> int32 storage, prepacked-layout typing
# ------------------------------------------------------------------------------------------------

def test_int64_tensors_are_stored_as_int32_and_keep_their_dtype():
    g = vk.VkGraph()
    ids, x = _tensor(g, I64, (4,), "ids"), _tensor(g, F32, (4,), "x")
    table = g.add_constant_tensor(np.arange(6, dtype=np.int64), name="table")
    downcast_int64_storage(g)
    for value_id in (ids, table):
        tensor = g.tensor(value_id)
        assert (tensor.dtype, tensor.stored_dtype, tensor.storage_dtype) == (I64, I32, I32)
        assert tensor.stored_nbytes == 4 * tensor.numel and tensor.nbytes == 8 * tensor.numel
    assert g.tensor(x).stored_dtype is None and g.tensor(x).storage_dtype == F32


def _requant_graph(n: int, k: int, group: int, returned: bool):
    g = vk.VkGraph()
    latent = _tensor(g, F32, (n, k), "latent")
    g.inputs = [latent]
    scales = g.add_constant_tensor(np.ones((k // group, n), np.float32), name="scales")
    codes = g.add_value(vk.TensorValue(vk.DType.UINT8, (n, k // 2), vk.Layout.Q4GSW_FLAT, name="codes"))
    g.ops = [vk.OpCall("vktrain.q4gsw_requant.default", (latent, scales, g.add_value(vk.IntValue(group))),
                       (codes,))]
    g.outputs = [codes] if returned else []
    return g, codes


@pytest.mark.parametrize("n", [8, 12])  # N % 8 == 4: the W_4X8 words take more bytes than the flat codes
def test_requant_output_is_typed_as_the_w4x8_words_it_holds(n):
    k = 64
    graph, codes = _requant_graph(n, k, 32, returned=False)
    type_prepacked_outputs(graph)
    tensor = graph.tensor(codes)
    assert (tensor.dtype, tensor.shape, tensor.layout) == (vk.DType.UINT32, (w4x8_num_words(n, k),),
                                                           vk.Layout.Q4GSW_W4X8)
    graph.validate()  # a W_4X8 tensor must be rank-1 uint32


def test_requant_output_cannot_leave_the_step():
    graph, codes = _requant_graph(8, 32, 32, returned=True)
    with pytest.raises(vk.GraphError, match=rf"value {codes} \(the q4gsw_requant result of op 0, W_4X8 words"):
        type_prepacked_outputs(graph)


# ------------------------------------------------------------------------------------------------
# views
# ------------------------------------------------------------------------------------------------

def test_reshapes_are_views_of_the_storage_root():
    g = vk.VkGraph()
    x = _tensor(g, F32, (2, 6), "x")
    g.inputs = [x]
    a, flat, square, out = (_tensor(g, F32, shape, name) for shape, name in (
        ((2, 6), "a"), ((12,), "flat"), ((3, 4), "square"), ((3, 4), "out")))
    g.ops = [vk.OpCall("aten.relu.default", (x,), (a,)),
             vk.OpCall("aten.view_copy.default", (a, _ints(g, -1)), (flat,)),
             vk.OpCall("aten.view_copy.default", (flat, _ints(g, 3, 4)), (square,)),
             vk.OpCall("aten.neg.default", (square,), (out,))]
    g.outputs = [out]
    decide_views(g)
    for view in (flat, square):  # a view of a view points at the tensor that has the bytes
        tensor = g.tensor(view)
        assert (tensor.storage_of, tensor.is_view, tensor.view_strides) == (a, True, ())
    assert g.tensor(a).storage_of == -1 and not g.tensor(out).is_view


def test_int64_to_int32_copies_are_views_once_stored_alike():
    g = vk.VkGraph()
    ids = _tensor(g, I64, (5,), "ids")
    narrow = _tensor(g, I32, (5,), "narrow")
    g.inputs, g.outputs = [ids], [narrow]
    null = g.add_value(vk.NullValue())
    g.ops = [vk.OpCall("aten._to_copy.default", (ids, g.add_value(vk.StringValue("int32")), null, null, null,
                                                 g.add_value(vk.BoolValue(False)), null), (narrow,))]
    decide_views(g)
    assert not g.tensor(narrow).is_view  # int64 still stored as int64: the copy converts
    downcast_int64_storage(g)
    decide_views(g)
    assert g.tensor(narrow).is_view and g.tensor(narrow).storage_of == ids


def _transpose_graph(second_reader: str):
    """t = x.T read by mm (and `second_reader`), tt = t.T read by relu."""
    g = vk.VkGraph()
    x, w = _tensor(g, F32, (4, 6), "x"), _tensor(g, F32, (4, 5), "w")
    g.inputs = [x, w]
    t, y, tt, r, extra = (_tensor(g, F32, shape, name) for shape, name in (
        ((6, 4), "t"), ((6, 5), "y"), ((4, 6), "tt"), ((4, 6), "r"), ((6, 4), "extra")))
    g.ops = [vk.OpCall("aten.permute_copy.default", (x, _ints(g, 1, 0)), (t,)),
             vk.OpCall("aten.mm.default", (t, w), (y,)),
             vk.OpCall("aten.t_copy.default", (t,), (tt,)),
             vk.OpCall("aten.relu.default", (tt,), (r,)),
             vk.OpCall(second_reader, (t,), (extra,))]
    g.outputs = [y, r, extra]
    return g, dict(x=x, t=t, tt=tt)


def test_transposes_read_by_strided_readers_are_strided_views():
    graph, ids = _transpose_graph("aten.t_copy.default")
    decide_views(graph)
    t, tt = graph.tensor(ids["t"]), graph.tensor(ids["tt"])
    assert (t.storage_of, t.is_view, t.view_strides, t.view_offset) == (ids["x"], True, (1, 6), 0)
    # The second transpose cancels the first: a contiguous view of x's bytes (relu may read it).
    assert (tt.storage_of, tt.is_view, tt.view_strides) == (ids["x"], True, ())


def test_a_transpose_read_by_an_elementwise_op_is_materialised():
    graph, ids = _transpose_graph("aten.neg.default")
    decide_views(graph)
    assert graph.tensor(ids["t"]).storage_of == -1 and not graph.tensor(ids["t"]).is_view
    assert not graph.tensor(ids["tt"]).is_view  # a transpose of t's own bytes, read by relu


def test_a_reshape_of_a_strided_view_is_not_a_view():
    g = vk.VkGraph()
    x = _tensor(g, F32, (4, 6), "x")
    g.inputs = [x]
    t, flat, out = _tensor(g, F32, (6, 4), "t"), _tensor(g, F32, (24,), "flat"), _tensor(g, F32, (24,), "out")
    g.ops = [vk.OpCall("aten.permute_copy.default", (x, _ints(g, 1, 0)), (t,)),
             vk.OpCall("aten.view_copy.default", (t, _ints(g, -1)), (flat,)),
             vk.OpCall("aten.neg.default", (flat,), (out,))]
    g.outputs = [out]
    decide_views(g)
    assert not g.tensor(t).is_view  # its reader (a reshape) does not take strided operands
    assert g.tensor(flat).is_view and g.tensor(flat).storage_of == t


def test_a_view_of_state_read_after_the_step_is_not_made():
    g = vk.VkGraph()
    state = _tensor(g, F32, (2, 3), "model.w")
    flat, back, update = _tensor(g, F32, (6,), "flat"), _tensor(g, F32, (2, 3), "back"), _tensor(g, F32, (2, 3), "u")
    g.ops = [vk.OpCall("aten.view_copy.default", (state, _ints(g, -1)), (flat,)),
             vk.OpCall("aten.view_copy.default", (flat, _ints(g, 2, 3)), (back,)),
             vk.OpCall("aten.neg.default", (back,), (update,))]
    g.mutable_state = [vk.MutableState(state, update)]
    g.outputs = [flat]  # returned: read after the end-of-step state copy
    decide_views(g)
    assert not g.tensor(flat).is_view
    assert g.tensor(back).is_view and g.tensor(back).storage_of == flat


# ------------------------------------------------------------------------------------------------
# in-place optimizer updates
# ------------------------------------------------------------------------------------------------

def _adamw_graph(read_param_after_update: bool):
    g = vk.VkGraph()
    param, avg, avg_sq, step = (_tensor(g, F32, shape, name) for shape, name in (
        ((8,), "model.w"), ((8,), "optimizer.exp_avg.w"), ((8,), "optimizer.exp_avg_sq.w"), ((), "optimizer.step")))
    grad, hparams = _tensor(g, F32, (8,), "grad"), _tensor(g, F32, (5,), "hparams")
    g.inputs = [grad, hparams]
    outputs = tuple(_tensor(g, F32, (8,), f"adamw[{i}]") for i in range(3))
    g.ops = [vk.OpCall("vktrain.adamw.default", (param, avg, avg_sq, grad, hparams, step), outputs)]
    if read_param_after_update:
        old = _tensor(g, F32, (8,), "old")
        g.ops.append(vk.OpCall("aten.neg.default", (param,), (old,)))
        g.outputs = [old]
    g.mutable_state = [vk.MutableState(s, u) for s, u in zip((param, avg, avg_sq), outputs)]
    return g, (param, avg, avg_sq), outputs


@pytest.mark.parametrize("read_param_after_update", [False, True])
def test_adamw_updates_its_state_in_place_unless_the_old_value_is_read_later(read_param_after_update):
    graph, states, outputs = _adamw_graph(read_param_after_update)
    update_state_in_place(graph)
    shared = [graph.tensor(out).storage_of for out in outputs]
    assert shared == [-1 if read_param_after_update else states[0], states[1], states[2]]
    assert not any(graph.tensor(out).is_view for out in outputs)  # adamw still writes them


def test_an_in_place_update_is_refused_when_a_view_of_the_state_is_read_later():
    graph, (param, _, _), outputs = _adamw_graph(False)
    flat, negated = _tensor(graph, F32, (8,), "flat"), _tensor(graph, F32, (8,), "negated")
    graph.ops.insert(0, vk.OpCall("aten.view_copy.default", (param, _ints(graph, -1)), (flat,)))
    graph.ops.append(vk.OpCall("aten.neg.default", (flat,), (negated,)))
    graph.outputs = [negated]
    decide_views(graph)
    assert graph.tensor(flat).storage_of == param
    update_state_in_place(graph)
    assert graph.tensor(outputs[0]).storage_of == -1


def test_state_copies_that_depend_on_each_other_are_refused():
    g = vk.VkGraph()
    first, second = _tensor(g, F32, (4,), "first"), _tensor(g, F32, (4,), "second")
    g.mutable_state = [vk.MutableState(first, second), vk.MutableState(second, first)]  # a swap
    with pytest.raises(vk.GraphError, match="the copy order would matter"):
        update_state_in_place(g)


# ------------------------------------------------------------------------------------------------
# memory planning over the final storage
# ------------------------------------------------------------------------------------------------

def _embedding_graph():
    """copy = clone(ids) [int64]; flat = view(copy); other = clone(ids); rows = embedding(table, flat);
    out = neg(rows); returns out and other."""
    g = vk.VkGraph()
    ids = _tensor(g, I64, (2, 3), "ids")
    g.inputs = [ids]
    table = g.add_constant_tensor(np.zeros((10, 4), np.float32), name="table")
    copy, flat = _tensor(g, I64, (2, 3), "copy"), _tensor(g, I64, (6,), "flat")
    rows, other, out = _tensor(g, F32, (6, 4), "rows"), _tensor(g, I64, (2, 3), "other"), _tensor(g, F32, (6, 4), "o")
    null, false = g.add_value(vk.NullValue()), g.add_value(vk.BoolValue(False))
    g.ops = [vk.OpCall("aten.clone.default", (ids, null), (copy,)),
             vk.OpCall("aten.view_copy.default", (copy, _ints(g, -1)), (flat,)),
             vk.OpCall("aten.clone.default", (ids, null), (other,)),
             vk.OpCall("aten.embedding.default", (table, flat, g.add_value(vk.IntValue(-1)), false, false), (rows,)),
             vk.OpCall("aten.neg.default", (rows,), (out,))]
    g.outputs = [out, other]
    return g, dict(ids=ids, table=table, copy=copy, flat=flat, other=other)


def test_planning_spans_views_and_sizes_stored_bytes():
    """The op output `copy` and its view `flat` are one storage, alive until the embedding reads the
    view, and sized as int32; the view itself is not planned."""
    g, ids = _embedding_graph()
    plan = compile_graph(g)
    copy, flat, other = g.tensor(ids["copy"]), g.tensor(ids["flat"]), g.tensor(ids["other"])
    assert flat.is_view and flat.storage_of == ids["copy"]
    # copy's storage lives from op 0 to op 3 (through its view), so `other` (op 2 on) cannot share it.
    assert copy.mem_obj_id != other.mem_obj_id and flat.mem_obj_id == copy.mem_obj_id
    sizes = {m.id: m.size_bytes for m in g.memory_objects}
    assert sizes[copy.mem_obj_id] >= 6 * 4
    assert plan.tensor_bytes == 2 * 6 * 4 + 2 * 24 * 4  # copy and other as int32, rows and out
    assert plan.planned_bytes == sum(sizes.values()) < plan.tensor_bytes  # out reuses copy's object
    assert g.tensor(ids["ids"]).mem_obj_id == -1 and g.tensor(ids["table"]).mem_obj_id == -1


def test_a_read_tensor_that_nothing_writes_is_refused():
    g = vk.VkGraph()
    x, ghost, y = _tensor(g, F32, (4,), "x"), _tensor(g, F32, (4,), "ghost"), _tensor(g, F32, (4,), "y")
    g.inputs, g.outputs = [x], [y]
    g.ops = [vk.OpCall("aten.mul.Tensor", (x, ghost), (y,))]
    with pytest.raises(vk.GraphError, match=rf"value {ghost} \(ghost\) is read but nothing writes it"):
        plan_graph_memory(g)


def test_the_blob_records_the_final_storage():
    """Stored dtypes, memory objects, views and strides survive the blob unchanged."""
    for graph in (_embedding_graph()[0], _transpose_graph("aten.t_copy.default")[0]):
        compile_graph(graph)
        read = deserialize_blob(serialize_blob(graph))
        assert read.values == graph.values and read.memory_objects == graph.memory_objects
        assert read.ops == graph.ops
    assert any(isinstance(v, vk.TensorValue) and v.view_strides == (1, 6) for v in read.values)


def test_passes_are_the_documented_order():
    assert [p.__name__ for p in PASSES] == ["expand_lora_linears", "fuse_patterns", "fuse_gemm_epilogues",
                                            "fuse_gemm_scales", "downcast_int64_storage",
                                            "type_prepacked_outputs", "decide_views", "update_state_in_place",
                                            "write_ce_gradient_in_place", "narrow_float_constants",
                                            "hold_q8_0_weights"]


def test_passes_and_memory_planning_import_without_torch_or_vulkan():
    assert_import_loads_none(["vktrain.backend.passes", "vktrain.backend.memory_planning"],
                             forbidden=["torch", "executorch", "vulkan"])
