"""What `vktrain inspect` reports about a .pte, read with the torch-free reader (serialization/pte.py):
the program's instructions and operators, and for the vktrain delegate its op histogram, constants,
memory plan (and how many device-memory allocations it takes), state, I/O and the partitioner's refusals.
Torch- and executorch-free, like the rest of the runtime: `vktrain inspect` runs on a machine with
neither. The export's own check (vktrain.export.lower) reads its .pte through `read_pte` too.
"""
from __future__ import annotations

import collections
import hashlib
import json
from dataclasses import dataclass, field

from vktrain.contract import (BACKEND_ID, METADATA_BAKED_SCALARS, METADATA_REFUSALS, METADATA_STATE_BYTES,
                              METADATA_UNPLANNED_MEMORY_BYTES, TRAIN_METHOD)
from vktrain.contract import allowed_precisions
from vktrain.serialization.pte import PteFile, PteFormatError
from vktrain.serialization.pte_objects import DelegateCall, KernelCall
from vktrain.serialization.verify import device_buffer_requests
from vktrain.runtime.vk.allocator import count_block_allocations
from vktrain.serialization import deserialize_blob
from vktrain.serialization import graph as vk


@dataclass
class PteDelegate:
    backend_id: str
    payload: bytes
    compile_specs: dict[str, bytes] = field(default_factory=dict)


@dataclass
class PteContents:
    delegates: list[PteDelegate]
    operators: list[str]        # the program's kernel operator table (ops left outside any delegate)
    delegate_calls: int
    kernel_calls: int


def _main_method(pte: PteFile) -> str:
    """The method a report is about: the only one, else the training step."""
    methods = pte.method_names
    if len(methods) == 1:
        return methods[0]
    if TRAIN_METHOD not in methods:
        raise PteFormatError(f"{pte.source}: expected a .pte with one method or a {TRAIN_METHOD!r} method, found {len(methods)} "
                             f"({methods})")
    return TRAIN_METHOD


def read_pte(data: bytes, method: str | None = None, source: str = "<bytes>") -> PteContents:
    """The delegates, operator table and instruction counts of one method of a .pte (default: the only
    method, else the training step's); `source` names the file in errors."""
    pte = PteFile.from_bytes(data, source)
    if method is None and not pte.method_names:
        raise PteFormatError(f"{source}: expected a .pte with one method, found 0 ([])")
    plan = pte.execution_plan(method or _main_method(pte))
    delegates = [PteDelegate(d.id, bytes(d.data), dict(d.compile_specs)) for d in plan.delegates]
    operators = [f"{op.name}.{op.overload}" if op.overload else op.name for op in plan.operators]
    kinds = collections.Counter(type(instruction).__name__ for instruction in plan.instructions)
    return PteContents(delegates, operators, kinds[DelegateCall.__name__], kinds[KernelCall.__name__])


def _tensor_summary(graph: vk.VkGraph, value_id: int) -> dict:
    t = graph.tensor(value_id)
    return {"name": t.name, "dtype": t.dtype.name.lower(), "shape": list(t.shape), "bytes": t.nbytes}


def summarize_blob(graph: vk.VkGraph) -> dict:
    """Op histogram, constants, memory plan, mutable state, I/O and refusals of one vktrain blob."""
    # Stored constants dedup by their stored bytes (what the blob dedups); synthetic ones (benchmark
    # blobs) are never generated here: they occupy no bytes in the file, so they count by their record.
    sizes = [vk.constant_nbytes(c) for c in graph.constants]
    unique, stored_unique, stored_sizes, forms = {}, {}, [], collections.Counter()
    for constant, size in zip(graph.constants, sizes):
        if isinstance(constant, vk.SyntheticConstant):
            unique[repr(constant)] = size
            forms["synthetic"] += 1
            continue
        stored = vk.stored_bytes(constant)
        form = constant.stored_form if isinstance(constant, vk.NarrowConstant) else "as read"
        key = (form, hashlib.sha256(stored).digest())
        unique[key], stored_unique[key] = size, stored.nbytes
        stored_sizes.append(stored.nbytes)
        forms[form] += 1
    state = []
    for s in graph.mutable_state:
        entry = _tensor_summary(graph, s.state_id)
        entry["initial"] = "zeros" if s.initial_constant_id < 0 else f"constant {s.initial_constant_id}"
        state.append(entry)
    layouts = collections.Counter(v.layout.name for v in graph.values
                                  if isinstance(v, vk.TensorValue) and v.constant_id >= 0)
    meta = graph.metadata
    return {
        "ops": len(graph.ops),
        "op_histogram": dict(collections.Counter(op.name for op in graph.ops).most_common()),
        "constants": {
            "count": len(graph.constants),
            "bytes": sum(sizes),
            "deduplicated_bytes": sum(unique.values()),
            # What the file holds: narrow constants in their stored form (serialization/narrow_constant.py).
            "stored_bytes": sum(stored_sizes),
            "stored_deduplicated_bytes": sum(stored_unique.values()),
            "stored_forms": dict(forms.most_common()),
            "tensor_layouts": dict(layouts),
        },
        "memory": {
            "planned_bytes": int(meta.get(vk.METADATA_PLANNED_MEMORY_BYTES, sum(m.size_bytes for m in graph.memory_objects))),
            "unplanned_bytes": int(meta.get(METADATA_UNPLANNED_MEMORY_BYTES, 0)),
            "memory_objects": len(graph.memory_objects),
            # Sub-allocated from large blocks (vktrain.runtime.vk.allocator), as the executor's buffers are.
            "device_allocations": count_block_allocations(n for _, n in device_buffer_requests(graph)),
            "state_bytes": int(meta.get(METADATA_STATE_BYTES, 0)),
        },
        "mutable_state": state,
        "inputs": [_tensor_summary(graph, i) for i in graph.inputs],
        "outputs": [_tensor_summary(graph, i) for i in graph.outputs],
        "refusals": json.loads(meta.get(METADATA_REFUSALS, "[]")),
        # Python floats of et_vk calls, constants of the program: no runtime input changes them.
        "baked_scalars": json.loads(meta.get(METADATA_BAKED_SCALARS, "[]")),
        "gemm_precisions": list(allowed_precisions(meta)),  # docs/PRECISION.md; the device picks at load
        "metadata": {k: v for k, v in meta.items() if k not in (METADATA_REFUSALS, METADATA_BAKED_SCALARS)},
        "embedded_schedules": [_embedded_summary(graph, embedded) for embedded in graph.schedules],
        "shader_modules": {"count": len(graph.shader_modules),
                           "bytes": sum(len(module.code) for module in graph.shader_modules)},
    }


def _embedded_summary(graph: vk.VkGraph, embedded) -> dict:
    """One schedule embedded at export (--target): its profile, dispatches, shader variants (shader +
    specialization), the modules it runs and their bytes, and the device memory its buffers take (those
    another method's executor owns not counted)."""
    schedule = embedded.schedule()
    modules = set(embedded.dispatch_modules)
    return {
        "profile": embedded.profile.name, "api": embedded.profile.api,
        "dispatches": len(schedule.dispatches),
        "shader_variants": len({(d.shader, d.specialization()) for d in schedule.dispatches}),
        "shader_modules": len(modules),
        "module_bytes": sum(len(graph.shader_modules[i].code) for i in modules if i < len(graph.shader_modules)),
        "device_memory_bytes": sum(b.size_bytes for b in schedule.buffers if b.role != "shared"),
        "buffers": len(schedule.buffers),
        "gemm": schedule.gemm.precision + (" on tensor cores" if schedule.gemm.tensor_cores else "")
        + f", fp32 tuning {schedule.gemm.fp32_tuning}",
        "tensor_core_ops": len(schedule.tensor_core_ops),
    }


def _summarize_method(data: bytes, method: str | None, named_data, source: str) -> dict:
    contents = read_pte(data, method, source)
    delegates = []
    for delegate in contents.delegates:
        entry = {"backend_id": delegate.backend_id, "payload_bytes": len(delegate.payload)}
        if delegate.backend_id == BACKEND_ID:
            entry.update(summarize_blob(deserialize_blob(delegate.payload, named_data=named_data)))
        delegates.append(entry)
    refusals = [r for d in delegates for r in d.get("refusals", [])]
    unique_refusals = list({(r["node"], r["reason"]): r for r in refusals}.values())
    return {
        "delegate_calls": contents.delegate_calls,
        "kernel_calls": contents.kernel_calls,
        "operators": contents.operators,
        "delegates": delegates,
        "refusals": unique_refusals,
    }


def summarize_pte(data: bytes, source: str = "<bytes>") -> dict:
    """The report of the .pte's main method (the only one, else the training step), and under
    "other_methods" the same report of each other method (the eval method of a training step). Constants
    in the .pte's named data (shared by its methods) count in every method that reads them. `source` names
    the file in errors."""
    pte = PteFile.from_bytes(data, source)
    main = _main_method(pte) if pte.method_names else None
    report = {"pte_bytes": len(data), **_summarize_method(data, main, pte.named_data, source),
              "named_data_bytes": sum(view.nbytes for view in pte.named_data.values())}
    others = [name for name in pte.method_names if name != main]
    if others:
        report["other_methods"] = {name: _summarize_method(data, name, pte.named_data, source) for name in others}
    return report
