"""LoRA linears: vktrain.lora_linear_q4gsw and its backward written out as the op chain they stand for.

The two ops exist so that export traces one node per LoRA linear instead of ~25 (vktrain/ops/lora_linear.py);
the runtime has no kernel for them. This pass rewrites each into exactly the ATen chain (plus the q4gsw base
op) that the unfused module `linear_q4gsw(base_x) + ((x @ A.t()) * scaling) @ B.t()` traces to, in the
order autograd records it, so the op chain, the memory plan and every rounding are the unfused program's.

For x [..., M, K] (rank > 2 flattened to [M, K] rows by a view, as torch's matmul does), r = A's rows:

    forward   base = linear_q4gsw(base_x);  h = view(mm(view(x), permute(A)));  hs = mul(h, scaling)
              y = add(base, view(mm(view(hs), permute(B))))
    backward  d_B = permute(permute(mm(permute(view(d_out)), view(hs))))     (B's gradient through B.t())
              d_hs = view(mm(view(d_out), permute(permute(B)))) * scaling
              d_A = permute(permute(mm(permute(view(d_hs)), view(x))))
              d_x = view(mm(view(d_hs), permute(permute(A))));  d_base_x = linear_q4gsw_backward(d_out)

The backward reads the forward's intermediates (view(x), permute(A), permute(B), view(hs)), as the unfused
graph does: it is matched to the forward of the same (x, lora_A, lora_B); in a graph without that forward
(a partition of a program split between delegates) its chain starts by recomputing them. Where autograd adds d_x into an
earlier gradient of x (x feeds several linears), it does so as soon as d_x exists, before d_A's permute
and the base's backward: an add reading d_x right after the backward is moved there. Chain ops whose
outputs nobody reads (d_x of a first layer) are dropped by the fusion pass's dead-op sweep that follows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from vktrain.opdefs.runtime_ops import EXPANDED_OPS, LORA_LINEAR, LORA_LINEAR_BACKWARD
from vktrain.serialization import graph as vk

# Ops no kernel implements: this pass replaces them (the op registry accepts them for it).

_LINEAR_Q4GSW = "vktrain.linear_q4gsw.default"
_LINEAR_Q4GSW_BACKWARD = "vktrain.linear_q4gsw_backward.default"
_VIEW = "aten.view_copy.default"
_PERMUTE = "aten.permute_copy.default"
_MM = "aten.mm.default"
_MUL = "aten.mul.Tensor"
_ADD = "aten.add.Tensor"


@dataclass(frozen=True)
class _Forward:
    """The forward chain's values the backward reads."""
    x_rows: int      # x as [M, K] rows (x itself when 2-D)
    a_t: int         # permute(lora_A) [K, r]
    b_t: int         # permute(lora_B) [r, N]
    hs_rows: int     # scaling * x A^T as [M, r] rows


class _Writer:
    """Appends ops to `ops`, creating their output tensors in `graph`."""

    def __init__(self, graph: vk.VkGraph, ops: list[vk.OpCall], name: str, dtype: vk.DType) -> None:
        self.graph, self.ops, self.name, self.dtype = graph, ops, name, dtype

    def op(self, key: str, args: tuple[int, ...], shape: tuple[int, ...], role: str, out: int | None = None) -> int:
        if out is None:
            out = self.graph.add_value(vk.TensorValue(self.dtype, shape, name=f"{self.name}.{role}"))
        self.ops.append(vk.OpCall(key, args, (out,)))
        return out

    def ints(self, items: tuple[int, ...]) -> int:
        return self.graph.add_value(vk.IntListValue(tuple(items)))

    def transpose(self, value: int, role: str) -> int:
        rows, cols = self.graph.tensor(value).shape
        return self.op(_PERMUTE, (value, self.ints((1, 0))), (cols, rows), role)

    def view(self, value: int, shape: tuple[int, ...], role: str, out: int | None = None) -> int:
        return self.op(_VIEW, (value, self.ints(shape)), shape, role, out)

    def mm(self, a: int, b: int, role: str, out: int | None = None) -> int:
        return self.op(_MM, (a, b), (self.graph.tensor(a).shape[0], self.graph.tensor(b).shape[1]), role, out)


class _Rows:
    """x's leading dims: tensors of [..., C] are viewed as [M, C] rows and back, unless x is 2-D already."""

    def __init__(self, writer: _Writer, lead: tuple[int, ...]) -> None:
        self.writer, self.lead, self.flat = writer, lead, len(lead) > 1
        self.m = math.prod(lead)

    def to_rows(self, value: int, role: str) -> int:
        if not self.flat:
            return value
        return self.writer.view(value, (self.m, self.writer.graph.tensor(value).shape[-1]), role)

    def from_rows(self, value: int, role: str) -> int:
        if not self.flat:
            return value
        return self.writer.view(value, self.lead + (self.writer.graph.tensor(value).shape[-1],), role)

    def mm_to(self, a: int, b: int, role: str, out: int) -> None:
        """`out` [..., C] = a @ b, written by the mm itself (2-D x) or by a view of its rows."""
        if self.flat:
            rows = self.writer.mm(a, b, role + "_rows")
            self.writer.view(rows, self.lead + (self.writer.graph.tensor(out).shape[-1],), role, out)
        else:
            self.writer.mm(a, b, role, out)


def _adapter_forward(w: _Writer, rows: _Rows, x: int, lora_a: int, lora_b: int, scaling: int) -> _Forward:
    """The adapter's forward up to its second matmul's operands."""
    a_t = w.transpose(lora_a, "lora_A_t")
    x_rows = rows.to_rows(x, "x_rows")
    h = rows.from_rows(w.mm(x_rows, a_t, "h_rows"), "h")
    hs = w.op(_MUL, (h, scaling), w.graph.tensor(h).shape, "hs")
    b_t = w.transpose(lora_b, "lora_B_t")
    return _Forward(x_rows, a_t, b_t, rows.to_rows(hs, "hs_rows"))


def _expand_forward(graph: vk.VkGraph, op: vk.OpCall, ops: list[vk.OpCall]) -> _Forward:
    x, lora_a, lora_b, scaling, base_x, weights, scales, group_size, bias = op.args
    (y,) = op.outputs
    out = graph.tensor(y)
    w = _Writer(graph, ops, out.name, out.dtype)
    rows = _Rows(w, graph.tensor(x).shape[:-1])
    base = w.op(_LINEAR_Q4GSW, (base_x, weights, scales, group_size, bias), out.shape, "base")
    forward = _adapter_forward(w, rows, x, lora_a, lora_b, scaling)
    update = rows.from_rows(w.mm(forward.hs_rows, forward.b_t, "update_rows"), "update")
    w.op(_ADD, (base, update, graph.add_value(vk.IntValue(1))), out.shape, "y", out=y)
    return forward


def _expand_backward(graph: vk.VkGraph, op: vk.OpCall, forward: _Forward | None, ops: list[vk.OpCall],
                     accumulate: vk.OpCall | None) -> None:
    d_out, x, lora_a, lora_b, scaling, weights, scales, group_size = op.args
    d_x, d_lora_a, d_lora_b, d_base_x = op.outputs
    w = _Writer(graph, ops, graph.tensor(d_x).name.removesuffix("[0]"), graph.tensor(d_x).dtype)
    lead = graph.tensor(x).shape[:-1]
    rows = _Rows(w, lead)
    r = graph.tensor(d_lora_a).shape[0]
    if forward is None:  # the forward is in another graph (a partitioned program): recompute what is read
        forward = _adapter_forward(w, rows, x, lora_a, lora_b, scaling)
    g_rows = rows.to_rows(d_out, "d_out_rows")
    d_b_t = w.transpose(w.mm(w.transpose(g_rows, "d_out_rows_t"), forward.hs_rows, "d_lora_B_t_t"), "d_lora_B_t")
    d_h = rows.from_rows(w.mm(g_rows, w.transpose(forward.b_t, "lora_B"), "d_h_rows"), "d_h")
    w.op(_PERMUTE, (d_b_t, w.ints((1, 0))), graph.tensor(d_lora_b).shape, "d_lora_B", out=d_lora_b)
    d_hs = w.op(_MUL, (d_h, scaling), lead + (r,), "d_hs")
    d_hs_rows = rows.to_rows(d_hs, "d_hs_rows")
    d_a_t = w.transpose(w.mm(w.transpose(d_hs_rows, "d_hs_rows_t"), forward.x_rows, "d_lora_A_t_t"), "d_lora_A_t")
    rows.mm_to(d_hs_rows, w.transpose(forward.a_t, "lora_A"), "d_x", out=d_x)
    if accumulate is not None:
        ops.append(accumulate)
    w.op(_PERMUTE, (d_a_t, w.ints((1, 0))), graph.tensor(d_lora_a).shape, "d_lora_A", out=d_lora_a)
    w.op(_LINEAR_Q4GSW_BACKWARD, (d_out, weights, scales, group_size), graph.tensor(d_base_x).shape, "d_base_x",
         out=d_base_x)


def _accumulation_of(op: vk.OpCall, following: vk.OpCall | None) -> vk.OpCall | None:
    """`following` when it is the add autograd makes of d_x into x's earlier gradient (it reads d_x and no
    other output of the backward `op`), else None."""
    if following is None or following.name != _ADD:
        return None
    d_x, *others = op.outputs
    reads = set(following.args)
    return following if d_x in reads and not reads & set(others) else None


def expand_lora_linears(graph: vk.VkGraph) -> None:
    """Replace every lora_linear_q4gsw (and backward) op of `graph` by its op chain (module docstring)."""
    if not any(op.name in EXPANDED_OPS for op in graph.ops):
        return
    forwards: dict[tuple[int, int, int], _Forward] = {}
    ops: list[vk.OpCall] = []
    moved: set[int] = set()  # indices of accumulations already written into a backward's chain
    for index, op in enumerate(graph.ops):
        if index in moved:
            continue
        if op.name == LORA_LINEAR:
            x, lora_a, lora_b = op.args[:3]
            forwards[(x, lora_a, lora_b)] = _expand_forward(graph, op, ops)
        elif op.name == LORA_LINEAR_BACKWARD:
            following = graph.ops[index + 1] if index + 1 < len(graph.ops) else None
            accumulate = _accumulation_of(op, following)
            if accumulate is not None:
                moved.add(index + 1)
            _expand_backward(graph, op, forwards.get(tuple(op.args[1:4])), ops, accumulate)
        else:
            ops.append(op)
    graph.ops = ops
