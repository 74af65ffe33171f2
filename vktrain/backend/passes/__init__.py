"""The backend's graph passes: torch-free rewrites of the in-memory VkGraph that make every storage
decision ahead of time, in this order (`PASSES`), before the one memory planning (`compile_graph`):

1. lora_linear.expand_lora_linears: the one-op LoRA linears export traces (vktrain.lora_linear_q4gsw and
   its backward) become the op chain the unfused module traces to, op for op. First: everything after
   sees that chain.
2. fusion.fuse_patterns: op patterns no kernel implements become one op that a kernel does
   (where(le) -> threshold_backward, sub(full_like) -> rsub); ops left unread are dropped. Before the
   storage passes, so they and the lifetimes see the final op chain.
3. gemm_epilogue.fuse_gemm_epilogues: add(p, mm(a, b)) (through shape-only views, the product read only by
   the add, p existing before the mm, alpha 1) becomes addmm(p, a, b): the add is the GEMM's epilogue,
   rounded exactly as before. An op writing p after the mm from values that exist before it moves ahead
   of the mm (a LoRA linear's base d_x before its adapter's d_x), and a 4-bit base GEMM writing p before
   it moves down to it (the forward's base), so that the planner can add the product in the base GEMM's
   tensor-core epilogue (kernel_planning/rank_epilogue.py). After fusion's dead-op sweep, before
   the storage passes (the views of p and the addmm's lazily transposed operands are theirs to decide).
4. gemm_scale.fuse_gemm_scales: mul(mm(a, b), s) (through shape-only views, the product read only by the mul,
   s a number or a 0-d constant) becomes vktrain.mm_scaled(a, b, s): the GEMM multiplies its finished sum by
   fp32(s), the one rounding the mul made (a LoRA adapter's scaling, forward and backward). After the
   epilogue pass (neither pattern is the other's), before the storage passes (mm_scaled reads lazy
   transposes as mm does).
5. storage_dtype.downcast_int64_storage: int64 tensors are stored as int32. Before the view decisions,
   which compare stored dtypes (int64 <-> int32 copies become views).
6. prepacked_layout.type_prepacked_outputs: q4gsw_requant outputs are typed as the W_4X8 words they hold.
   Before memory planning, which sizes them.
7. views.decide_views: byte-preserving ops and lazy transposes produce views of their source's storage.
8. in_place.update_state_in_place: adamw outputs use their state's storage when nothing reads the old
   value later (needs the views: a view of the state is such a reader).
   ce_in_place.write_ce_gradient_in_place: fused_ce's dlogits takes its logits' storage when nothing reads
   the logits later (one [R, V] tensor instead of two; the kernel's in-place variant runs).
9. constant_storage.narrow_float_constants: float32 constants whose values are all exactly GGUF Q8_0
   blocks, bfloat16 or float16 numbers are stored in the blob in the smallest of those forms
   (ConstantData.stored_encoding / stored_dtype), widened bit for bit when read.
   It changes no tensor, only how constant bytes travel in the file.
10. q8_0_weights.hold_q8_0_weights: a Q8_0 constant read only as an embedding table and as aten.mm's
   second operand (a tied head and its backward) stays Q8_0 on the device (int8 codes and float32 scales,
   vktrain.quant.q8_0), read by the Q8_0 ops instead. After constant_storage, which finds the Q8_0 values.

Then memory_planning.plan_graph_memory places every tensor with storage of its own into memory
objects by the lifetime of everything sharing that storage. The result is recorded per tensor in the
blob (schema.fbs `Tensor`: mem_obj_id, mem_offset, storage_of, is_view, view_strides, view_offset,
stored_dtype); the runtime executes those records and decides nothing.
"""
from __future__ import annotations

from vktrain.serialization import graph as vk

from ..memory_planning import MemoryPlan, plan_graph_memory
from .ce_in_place import write_ce_gradient_in_place
from .constant_storage import narrow_float_constants
from .fusion import fuse_patterns
from .gemm_epilogue import fuse_gemm_epilogues
from .gemm_scale import fuse_gemm_scales
from .in_place import update_state_in_place
from .lora_linear import expand_lora_linears
from .prepacked_layout import type_prepacked_outputs
from .q8_0_weights import hold_q8_0_weights
from .storage_dtype import downcast_int64_storage
from .views import decide_views

PASSES = (expand_lora_linears, fuse_patterns, fuse_gemm_epilogues, fuse_gemm_scales, downcast_int64_storage,
          type_prepacked_outputs, decide_views, update_state_in_place, write_ce_gradient_in_place,
          narrow_float_constants, hold_q8_0_weights)


def compile_graph(graph: vk.VkGraph) -> MemoryPlan:
    """Run PASSES over `graph` (in place), then plan its memory; returns the plan it recorded."""
    for graph_pass in PASSES:
        graph_pass(graph)
    return plan_graph_memory(graph)


__all__ = ["PASSES", "compile_graph"]
