"""GEMM epilogues: an add of a matmul product becomes the matmul's own epilogue (aten.addmm), one
dispatch and one pass over the output fewer, with every fp32 rounding unchanged.

The pattern, over fp32 tensors:

    m = mm(a, b);  q = view(...view(m))          (zero or more shape-only views, each read only by the next)
    y = add(p, q, alpha=1)   or   add(q, p, alpha=1)

where q is read by nothing but that add, and p has q's shape and exists before the mm (a graph input,
constant or state, or an earlier op's output). It becomes

    p_rows = view(p, [M, N]);  m = addmm(p_rows, a, b, beta=1, alpha=1);  y = view(...view(m))

(no view of p when it is [M, N] already; without views the addmm writes y). Why the result is the
same bits: fp32 addition is commutative and 1 * x is exact, so addmm's epilogue `acc + p` rounds
once, exactly as add(p, q) did; the kernels keep it so: matmul.slang adds the bias after the product
(and a split-K GEMM after summing its slices, kernels/matmul.py), coopmat_mm's ADDEND variant after
unscaling its accumulators. Nothing else is re-associated: an add whose operands are both sums
stays an add.

Ordering. Where p is written after the mm but before the add, by an op all of whose inputs exist
before the mm, that op is moved to just before the mm: the graph is functional (no op has side
effects before the in-place pass, which runs later), so computing a value earlier changes no value.
This is what lets a LoRA linear's input gradient absorb the base's: the lora_linear expansion
(passes/lora_linear.py) writes d_x = view(mm(d_hs, A)) and then d_base_x =
linear_q4gsw_backward(d_out, W), which reads only d_out (written before the whole backward chain)
and frozen weights, and autograd adds the two; the base backward now runs first, and its d_x is the
LoRA mm's addend. An add whose p depends on anything written at or after the mm is left alone. The
forward's base, y = add(linear_q4gsw(base_x, W), view(mm(hs, B^T))), is written before its adapter's chain:
an op writing p before the mm moves to just before it too when it is a 4-bit base GEMM (linear_q4gsw or
its backward) whose p nothing else reads, so that both directions' base GEMM and addmm are adjacent (only
views between): where the base runs on the tensor cores, the planner then adds the addmm's product in the
base GEMM's epilogue (kernel_planning/rank_epilogue.py). Moving it later is as safe (nothing reads p
before the add) and moves no bits.

An mm whose second operand is a constant (or a view of one) is left alone too: a frozen weight read
only through aten.mm may later be held as Q8_0 (passes/q8_0_weights.py), which rewrites exactly those
mm ops. After the lora_linear expansion and fusion (it sees their final chain), before every storage
pass (the views, in-place and memory decisions see the addmm).
"""
from __future__ import annotations

from dataclasses import dataclass

from vktrain.opdefs.runtime_ops import BASE_GEMMS
from vktrain.serialization import graph as vk
from vktrain.serialization.graph import decode_scalar

from ..lifetimes import GraphUses, analyze_uses
from .views import SHAPE_ONLY_VIEWS

MM = "aten.mm.default"
ADDMM = "aten.addmm.default"
ADD = "aten.add.Tensor"
VIEW = "aten.view_copy.default"


@dataclass(frozen=True)
class _Fusion:
    """One add to fold into its mm: op indices in the current chain and the values they involve."""
    add: int
    mm: int
    views: tuple[int, ...]   # the view ops from the mm's output to q, in order
    addend: int              # p
    hoist: int | None        # the op writing p, to move just before the mm (None: p stays where it is)

    @property
    def ops(self) -> set[int]:
        return {self.add, self.mm, *self.views} | ({self.hoist} if self.hoist is not None else set())


def fp32_tensor(graph: vk.VkGraph, value_id: int) -> vk.TensorValue | None:
    value = graph.values[value_id]
    if isinstance(value, vk.TensorValue) and value.dtype == vk.DType.FLOAT32 and value.layout == vk.Layout.PLAIN:
        return value
    return None


def _read_only_by(uses: GraphUses, value_id: int, reader: int) -> bool:
    return uses.readers.get(value_id, []) == [reader]


def product_chain(graph: vk.VkGraph, uses: GraphUses, q: int, consumer: int) -> tuple[int, tuple[int, ...]] | None:
    """(mm index, view indices) when q is an mm's output through shape-only views, each value of the
    chain read only by the next op (q by op `consumer`); else None. (The gemm_scale pass's pattern too.)"""
    views: list[int] = []
    value, reader = q, consumer
    while True:
        if not _read_only_by(uses, value, reader) or fp32_tensor(graph, value) is None:
            return None
        index = uses.producer.get(value)
        if index is None:
            return None
        op = graph.ops[index]
        if op.name == MM:
            return index, tuple(reversed(views))
        if op.name not in SHAPE_ONLY_VIEWS or len(op.outputs) != 1:
            return None
        views.append(index)
        value, reader = op.args[0], index


def reads_a_constant(graph: vk.VkGraph, uses: GraphUses, value_id: int) -> bool:
    """Whether value_id is a constant tensor or made from one by single-input ops (views, transposes)."""
    while True:
        value = graph.values[value_id]
        if isinstance(value, vk.TensorValue) and value.constant_id >= 0:
            return True
        index = uses.producer.get(value_id)
        if index is None or not graph.ops[index].args:
            return False
        value_id = graph.ops[index].args[0]


def _exists_before(graph: vk.VkGraph, uses: GraphUses, op_index: int, position: int) -> bool:
    """Whether every tensor op `op_index` reads is written before `position` (or by no op)."""
    for arg in graph.ops[op_index].args:
        value = graph.values[arg]
        for read in (value.items if isinstance(value, vk.ValueListValue) else (arg,)):
            if uses.producer.get(read, -1) >= position:
                return False
    return True


def _fusion_of(graph: vk.VkGraph, uses: GraphUses, index: int) -> _Fusion | None:
    op = graph.ops[index]
    if op.name != ADD or len(op.args) != 3 or len(op.outputs) != 1:
        return None
    alpha = graph.values[op.args[2]]
    if not isinstance(alpha, (vk.IntValue, vk.DoubleValue)) or decode_scalar(alpha) != 1:
        return None
    out = fp32_tensor(graph, op.outputs[0])
    if out is None:
        return None
    for q, p in ((op.args[1], op.args[0]), (op.args[0], op.args[1])):
        addend, product = fp32_tensor(graph, p), fp32_tensor(graph, q)
        if addend is None or product is None or not addend.shape == product.shape == out.shape:
            continue
        chain = product_chain(graph, uses, q, index)
        if chain is None:
            continue
        mm, views = chain
        if reads_a_constant(graph, uses, graph.ops[mm].args[1]):
            continue
        written = uses.producer.get(p, -1)
        if written < mm:
            sink = (written >= 0 and graph.ops[written].name in BASE_GEMMS and len(graph.ops[written].outputs) == 1
                    and _read_only_by(uses, p, index))
            return _Fusion(index, mm, views, p, written if sink else None)
        if _exists_before(graph, uses, written, mm):
            return _Fusion(index, mm, views, p, written)
    return None


def _rewrite(graph: vk.VkGraph, fusion: _Fusion) -> dict[int, list[vk.OpCall]]:
    """Op index -> the ops replacing it (absent: kept; an empty list: dropped)."""
    add, mm = graph.ops[fusion.add], graph.ops[fusion.mm]
    (y,) = add.outputs
    (m,) = mm.outputs
    rows = graph.tensor(m).shape
    replaced: dict[int, list[vk.OpCall]] = {fusion.add: []}
    before = []
    if fusion.hoist is not None:
        before.append(graph.ops[fusion.hoist])
        replaced[fusion.hoist] = []
    p_rows = fusion.addend
    addend = graph.tensor(fusion.addend)
    if addend.shape != rows:
        p_rows = graph.add_value(vk.TensorValue(vk.DType.FLOAT32, rows, name=f"{addend.name}.rows"))
        before.append(vk.OpCall(VIEW, (fusion.addend, graph.add_value(vk.IntListValue(rows))), (p_rows,)))
    one = graph.add_value(vk.IntValue(1))
    product = m if fusion.views else y
    replaced[fusion.mm] = before + [vk.OpCall(ADDMM, (p_rows, *mm.args, one, one), (product,))]
    if fusion.views:
        last = graph.ops[fusion.views[-1]]
        replaced[fusion.views[-1]] = [vk.OpCall(last.name, last.args, (y,))]
    return replaced


def fuse_gemm_epilogues(graph: vk.VkGraph) -> None:
    """Fold every add of the module docstring's pattern into its mm (in rounds: candidates that share
    an op wait for the next analysis)."""
    while True:
        uses = analyze_uses(graph)
        touched: set[int] = set()
        replaced: dict[int, list[vk.OpCall]] = {}
        for index, op in enumerate(graph.ops):
            if op.name != ADD:
                continue
            fusion = _fusion_of(graph, uses, index)
            if fusion is None or fusion.ops & touched:
                continue
            touched |= fusion.ops
            replaced.update(_rewrite(graph, fusion))
        if not replaced:
            return
        graph.ops = [new for index, op in enumerate(graph.ops) for new in replaced.get(index, [op])]
