"""A LoRA linear's up-product in its base GEMM's epilogue: one dispatch for a 4-bit base GEMM and the addmm
that adds a rank-r product to its output. Off by default (plan_schedule(rank_epilogues=True) turns it on): on an
H100 the Llama-3.2-1B 4 x 512 step ran 99.1-99.6 ms with it against 96.8-97.0 without (two runs each, alternated,
one call; bench/README.md): the fused epilogue stores every accumulator block through shared memory with bounds
checks and sums the rank term in scalar fp32, which cost the base GEMMs ~6 ms more than the 174 addmm
dispatches it removed (~4 ms).

The graph (passes/lora_linear.py, then passes/gemm_epilogue.py) computes a LoRA linear's output and input
gradient as

    forward   base = linear_q4gsw(base_x, W);        y   = addmm(view(base), hs, B^T)     (hs [M, r])
    backward  d_base_x = linear_q4gsw_backward(d_out, W);  d_x = addmm(view(d_base_x), d_hs, A)

(passes/gemm_epilogue.py moves both base GEMMs next to their addmm: only views, no dispatch, between them; a
program exported before that has the forward's adapter chain between them). Where the route runs the base GEMM on the tensor-core kernels
(kernels/coopmat.py) and the addmm on matmul.slang (a rank of at most STARVED_REDUCTION), the planner plans the
pair as the base kernel's RANK_EPILOGUE variant writing y: the rank term is summed in fp32 exactly as that addmm
dispatch sums it (its body's step form, RankEpilogue.fma) and added to the base value with one rounding, so the
outputs are the unfused pair's bits, and the addmm's pass over the base output ([M, N] read, [M, N] written)
disappears. The addmm's own plan is what decides: the pair fuses only where it is one matmul.slang dispatch in
fp32 (not its FP16 variant, coopmat_mm, split-K or windows), the base plan is one unsplit coopmat GEMM in a
tiling whose variant is prebuilt (coopmat_tiling.RANK_TILINGS; any on the emulated route), and hs, Bt and the
output are bound as the kernel reads them (RankEpilogue.problems).

Why at planning time, not as a graph op. The graph and its memory plan are the same for every device; only the
tensor-core route fuses, and only after the route is chosen at load. A fused graph op would need a lowering on
every target (fp32, fp16 SIMT, WebGPU), and on those the base output would have to go somewhere while the addmm
reads it: a scratch buffer always allocated (as large as the largest base output), or in place in y (matmul.slang
reads each addend element only in the invocation writing it, but WebGPU forbids a binding both read and written).
Planning the pair here leaves every other route's plan as it was. The cost: the memory plan still holds the base
output, unwritten on the tensor-core route, alive only between the two ops (no saved activation).

Where the fused dispatch runs: in the addmm's place, where hs and Bt exist, writing the addmm's output and
reading the base GEMM's inputs, which must then still hold their values: nothing but views lies between the two
ops, or each input is alive at the addmm in the memory plan (a constant, graph input or state, or read there or
later: the forward's x, which the backward reads again). Even adjacent, the memory plan may have let the addmm's
output reuse an input's bytes once the base GEMM was done (the first layer's d_out, last read by its base
backward), so a pair whose output overlaps anything the fused dispatch reads stays unfused (on main's
Llama-3.2-1B 4 x 512 step: 1 of its 63 backward pairs). Only an addmm whose addend is the base output itself
pairs: where autograd adds an adapter's product to a running sum of gradients (q, k, v read one x), the addend
is that sum, and the addmm stays (the order of the sum, and so its bits, are autograd's).
"""
from __future__ import annotations

from typing import Callable, Optional

from vktrain.opdefs.runtime_ops import BASE_GEMMS
from vktrain.serialization import graph as vk
from vktrain.serialization.dispatch import BufferBinding, Dispatch

from ..lifetimes import analyze_uses, storage_root, storage_sharers
from .kernels.coopmat import RankEpilogue
from .lowering_context import OpContext, RankProduct, TensorArg

ADDMM = "aten.addmm.default"
RANK_VARIANT = "RANK_EPILOGUE"  # the fused dispatch's define


def rank_epilogue_pairs(graph: vk.VkGraph) -> dict[int, int]:
    """Base GEMM op index -> the addmm's, for every aten.addmm whose addend (argument 0) uses the storage of a
    4-bit base GEMM's output that nothing but the addmm and views read, where the base GEMM's inputs still hold
    their values when the addmm runs (the fused dispatch runs there): only views (no dispatch) lie between the
    two, or each input is alive there in the memory plan."""
    uses = analyze_uses(graph)
    sharing = storage_sharers(graph)
    kept = set(graph.inputs) | {s.state_id for s in graph.mutable_state}  # storage no plan reuses

    def readers_of(root: int) -> set[int]:
        return {reader for value in [root, *sharing.get(root, [])] for reader in uses.readers.get(value, ())}

    def intact_at(value_id: int, index: int) -> bool:
        value = graph.values[value_id]
        if not isinstance(value, vk.TensorValue):
            return True
        root = storage_root(graph, value_id)
        return value.constant_id >= 0 or root in kept or max(readers_of(root), default=-1) >= index

    def moves_nothing(index: int) -> bool:  # every output a view: no dispatch
        outputs = graph.ops[index].outputs
        return bool(outputs) and all(graph.tensor(v).is_view for v in outputs)

    pairs: dict[int, int] = {}
    for index, op in enumerate(graph.ops):
        if op.name != ADDMM or not op.args:
            continue
        root = storage_root(graph, op.args[0])
        base = uses.producer.get(root)
        if base is None or graph.ops[base].name not in BASE_GEMMS or graph.ops[base].outputs != (root,):
            continue
        readers = readers_of(root)
        if index not in readers or not all(base < reader <= index and (reader == index or moves_nothing(reader))
                                           for reader in readers):
            continue
        adjacent = all(moves_nothing(between) for between in range(base + 1, index))
        if adjacent or all(intact_at(arg, index) for arg in graph.ops[base].args):
            pairs[base] = index
    return pairs


def _overlap(a: BufferBinding, b: BufferBinding) -> bool:
    if a.buffer != b.buffer:
        return False
    a_end = a.offset + (a.size if a.size is not None else 1 << 62)
    b_end = b.offset + (b.size if b.size is not None else 1 << 62)
    return a.offset < b_end and b.offset < a_end


def rank_product(base: OpContext, addmm: OpContext, addmm_plan: list[Dispatch]) -> Optional[RankProduct]:
    """What the base op `base` adds in its epilogue for `addmm` (planned alone as `addmm_plan`), or None where
    the pair must stay two dispatches (module docstring)."""
    if len(addmm_plan) != 1:
        return None
    shader = addmm_plan[0].shader
    name, _, defines = shader.partition("@")
    flags = set(defines.split("+"))
    if name != "matmul" or "HAS_BIAS=1" not in flags or flags & {"FP16", "B_Q8_0"}:
        return None
    bias, hs, bt = addmm.args[:3]
    beta, alpha = addmm.args[3:5]
    (out,), (base_out,) = addmm.outputs, base.outputs
    if not all(isinstance(t, TensorArg) for t in (bias, hs, bt)) or (beta, alpha) != (1, 1):
        return None
    if (bias.binding != base_out.binding or not bias.strided.is_contiguous or bias.strided.offset
            or bias.numel != base_out.numel or out.shape != bias.shape):
        return None
    epilogue = RankEpilogue(hs.binding, hs.strided, bt.binding, bt.strided, fma="CPU_REGISTER_TILES" in flags)
    if epilogue.problems(*out.shape):
        return None
    reads = [t for t in base.args if isinstance(t, TensorArg)] + [hs, bt]
    if any(_overlap(out.binding, t.binding) for t in reads) or any(_overlap(bias.binding, t.binding) for t in (hs, bt)):
        return None  # the output would overwrite what the dispatch reads, or hs / Bt are the unwritten base's bytes
    return RankProduct(out.binding, epilogue)


def fused_plan(base: OpContext, lower_base: Callable[[OpContext], list[Dispatch]], addmm: OpContext,
               lower_addmm: Callable[[OpContext], list[Dispatch]]) -> Optional[list[Dispatch]]:
    """The base op's dispatches with the addmm's product in its epilogue, or None where the pair stays two
    (the base lowering takes the rank product only on the tensor-core route, unsplit, in a prebuilt variant)."""
    product = rank_product(base, addmm, lower_addmm(addmm))
    if product is None:
        return None
    base.rank_product = product
    planned = lower_base(base)
    fused = any(RANK_VARIANT in d.shader.partition("@")[2].split("+") for d in planned)
    return planned if fused else None
