"""Whether a .pte's program fits a device profile, planned with no device (`vktrain inspect STEP.pte
--device-profile NAME`): the planner the caller gives (vktrain.backend.kernel_planning.plan_schedule, a
function of the graph and the profile) makes each schedule, so the dispatches, the buffers and every binding
are known before a device is opened.

The report, per vktrain delegate of the main method (the training step's, else the only one): the dispatches
(and the submits a replay takes under the profile's max_dispatches_per_submit, split dispatches counted as
recorded under its max workgroup count),
the GEMM precision they were planned at (the planner's precision policy on the profile: fp16 adds dispatches
fp32 has none of, so a run records the same dispatches when it runs at the same precision),
the planned device memory (every buffer of the schedule: constants, state, activations, scratch), the largest
allocation against the profile's max allocation size, the largest binding against its max storage binding
size, the shader variants (distinct shader + specialization constants), and the refusals, each with the
limit, the value needed, the profile's value and what to change.

The program's device memory is the training step's buffers plus those of its eval and accumulate methods that
the step does not hold (they bind the step's adapters, grad_acc state and byte-identical frozen constants,
and their activations reuse the step's intermediate and scratch buffers where they fit:
counted once, as the runtime allocates them, evaluation.py, accumulation.py); it is judged against the
profile's memory budget
(memory_budget_bytes; 0: none, reported only).
"""
from __future__ import annotations

from dataclasses import dataclass


from vktrain.contract import ACCUMULATE_METHOD, BACKEND_ID, EVAL_METHOD, TRAIN_METHOD
from vktrain.errors import GraphLoweringError
from vktrain.runtime.program.schedules import Planner
from vktrain.runtime.program.summary import read_pte
from vktrain.runtime.vk.schedule import plan_submits, split_groups
from vktrain.serialization import deserialize_blob
from vktrain.serialization import graph as vk
from vktrain.serialization.device_profile import DeviceProfile
from vktrain.serialization.pte import PteFile
from vktrain.serialization.schedule_memory import (MEMORY_BUDGET_ADVICE, TRANSIENT_ROLES, memory_budget_refusal,
                                                   owned_bytes, reused_buffers)
from vktrain.serialization.strided_view import KernelArgumentError

# What to change, by what a buffer holds (ScheduleBuffer.role): activations scale with batch x seq, the
# adapters and their AdamW moments with the rank, the frozen weights with the model alone.
ACTIVATIONS_ADVICE = ("export with --activation-checkpointing every-layer (the decoder layers' activations are "
                      "recomputed in the backward) or a smaller --batch or --seq (activations scale with batch x seq)")
ADVICE = {
    "input": ACTIVATIONS_ADVICE, "output": ACTIVATIONS_ADVICE, "intermediate": ACTIVATIONS_ADVICE,
    "scratch": ACTIVATIONS_ADVICE, "shared": ACTIVATIONS_ADVICE,
    "state": "export with a smaller --lora-rank (the adapters and their AdamW moments scale with the rank)",
    "constant": "the frozen weights do not shrink with batch, seq or rank: a smaller model, "
                "or a device with larger allocations",
}
BINDING_ADVICE = ("if the tensor named is an activation (its shape holds batch x seq), export with a smaller "
                  "--batch or --seq; a weight's bindings shrink only with the model")


@dataclass(frozen=True)
class _Shared:
    """What the planner reads of a SharedTensor (planner.py `shared`), with no device."""

    offset: int
    tensor: vk.TensorValue


def _shared_with(owners: list[vk.VkGraph], graph: vk.VkGraph) -> dict[str, _Shared]:
    """The tensors of `graph` (the eval or accumulate method's) the runtime binds to the training step's buffers rather than
    allocating: the step's state under the same name, and its named constants held byte for byte
    (GraphExecutor.shared_state / constants_matching)."""
    state, constants = {}, {}
    for owner in owners:
        for s in owner.mutable_state:
            tensor = owner.tensor(s.state_id)
            if tensor.name:
                state[tensor.name] = tensor
        for value in owner.values:
            if isinstance(value, vk.TensorValue) and value.constant_id >= 0 and value.name and value.storage_of < 0:
                constants.setdefault(value.name, []).append((owner, value))
    shared = {}
    for value in graph.values:
        if not (isinstance(value, vk.TensorValue) and value.name):
            continue
        if value.name in state:  # eval's adapters (constants there), accumulate's grad_acc (its state too)
            shared[value.name] = _Shared(0, state[value.name])
            continue
        if value.constant_id < 0:
            continue
        if len(constants.get(value.name, ())) != 1:
            continue
        owner, tensor = constants[value.name][0]
        if (tensor.shape, tensor.dtype, tensor.layout, tensor.storage_dtype) != \
                (value.shape, value.dtype, value.layout, value.storage_dtype):
            continue
        if vk.same_stored_bytes(graph.constants[value.constant_id], owner.constants[tensor.constant_id]):
            shared[value.name] = _Shared(0, tensor)
    return shared


def _delegate_fit(graph: vk.VkGraph, profile: DeviceProfile, planner: Planner) -> dict:
    limits = {"max_allocation_bytes": profile.max_allocation_bytes,
              "max_storage_buffer_range": profile.max_storage_buffer_range}
    try:
        schedule = planner(graph, profile)
    except (GraphLoweringError, KernelArgumentError) as exc:  # a binding no kernel can split
        return {"fits": False, "planned": False, **limits,
                "refusals": [{"limit": "max_storage_buffer_range", "profile_value": profile.max_storage_buffer_range,
                              "message": str(exc), "change": BINDING_ADVICE}]}
    buffers = sorted(schedule.buffers, key=lambda b: b.size_bytes, reverse=True)
    bindings = [(b.size, d.name) for d in schedule.dispatches for b in d.bindings if b.size is not None]
    largest_binding = max(bindings, default=(0, ""))
    refusals = [{"limit": "max_allocation_bytes", "needed": b.size_bytes, "profile_value": profile.max_allocation_bytes,
                 "message": f"buffer {b.key!r} ({b.role}) needs an allocation of {b.size_bytes} bytes, over the "
                            f"profile's max allocation size of {profile.max_allocation_bytes} bytes",
                 "change": ADVICE[b.role]} for b in buffers if b.size_bytes > profile.max_allocation_bytes]
    recorded = [len(split_groups(d.groups, profile.max_workgroup_count)) for d in schedule.dispatches]
    return {
        "fits": not refusals, "planned": True, **limits,
        "dispatches": len(schedule.dispatches),
        "recorded_dispatches": sum(recorded),
        "max_dispatches_per_submit": profile.max_dispatches_per_submit,
        "submits": len(plan_submits(recorded, profile.max_dispatches_per_submit)),
        "device_memory_bytes": sum(b.size_bytes for b in buffers),
        "buffers": len(buffers),
        "shader_variants": len({(d.shader, d.spec_constants) for d in schedule.dispatches}),
        "largest_allocation": {"buffer": buffers[0].key, "role": buffers[0].role, "bytes": buffers[0].size_bytes}
        if buffers else None,
        "largest_binding": {"dispatch": largest_binding[1], "bytes": largest_binding[0]},
        "gemm_tuning": schedule.gemm.fp32_tuning,
        # The GEMM precision planned (the planner's `precision` policy on this profile): it changes the dispatches.
        "gemm_precision": schedule.gemm.precision + (" on tensor cores" if schedule.gemm.tensor_cores else ""),
        "refusals": refusals,
    }


def _graphs(pte: PteFile, data: bytes, method: str | None, source: str) -> list[vk.VkGraph]:
    return [deserialize_blob(d.payload, named_data=pte.named_data) for d in read_pte(data, method, source).delegates
            if d.backend_id == BACKEND_ID]


def _method_fit(pte: PteFile, data: bytes, step: list[vk.VkGraph], profile: DeviceProfile, source: str,
                method: str, planner: Planner) -> dict | None:
    """The eval or accumulate method's own device memory next to the training step's (None: the .pte has
    none). Each method's intermediates reuse the step's (GraphExecutor `arena`; the methods and the step never
    run at once, so both may take the same step buffers): only the excess counts."""
    if TRAIN_METHOD not in pte.method_names or method not in pte.method_names:
        return None
    offered = {}
    if len(step) == 1:  # the runtime's arena: the one step executor's buffers
        try:
            offered = {b.key: b.size_bytes for b in planner(step[0], profile).buffers if b.role in TRANSIENT_ROLES}
        except (GraphLoweringError, KernelArgumentError):
            pass  # the step itself is refused (its delegate's report says why)
    owned, refusals = 0, []
    for graph in _graphs(pte, data, method, source):
        try:
            schedule = planner(graph, profile, shared=_shared_with(step, graph))
        except (GraphLoweringError, KernelArgumentError) as exc:
            refusals.append({"limit": "max_storage_buffer_range", "profile_value": profile.max_storage_buffer_range,
                             "message": f"{method} method: {exc}", "change": BINDING_ADVICE})
            continue
        reused = reused_buffers(schedule, offered)
        offered = {key: nbytes for key, nbytes in offered.items() if key not in reused.values()}
        owned += owned_bytes(schedule) - sum(b.size_bytes for b in schedule.buffers if b.key in reused)
    return {"method": method, "device_memory_bytes": owned, "refusals": refusals}


def fit_report(data: bytes, profile: DeviceProfile, source: str = "<bytes>", *, planner: Planner) -> dict:
    """Whether the .pte's main method (with its eval method's memory) fits `profile` (module docstring), each
    schedule made by `planner` (schedules.py `Planner`); JSON-ready."""
    pte = PteFile.from_bytes(data, source)
    graphs = _graphs(pte, data, None, source)
    delegates = [_delegate_fit(graph, profile, planner) for graph in graphs]
    methods = {method: _method_fit(pte, data, graphs, profile, source, method, planner)
               for method in (EVAL_METHOD, ACCUMULATE_METHOD)}
    step_bytes = sum(d.get("device_memory_bytes", 0) for d in delegates)
    total = step_bytes + sum(m["device_memory_bytes"] for m in methods.values() if m)
    refusals = [refusal for m in methods.values() if m for refusal in m["refusals"]]
    over = memory_budget_refusal(total, profile)
    if over and all(d["planned"] for d in delegates):
        refusals.append({"limit": "memory_budget_bytes", "needed": total, "profile_value": profile.memory_budget_bytes,
                         "message": over, "change": MEMORY_BUDGET_ADVICE})
    return {"profile": profile.name, "source": profile.source,
            "fits": all(d["fits"] for d in delegates) and not refusals,
            "device_memory_bytes": total, "step_device_memory_bytes": step_bytes,
            "memory_budget_bytes": profile.memory_budget_bytes, "eval": methods[EVAL_METHOD],
            "accumulate": methods[ACCUMULATE_METHOD],
            "delegates": delegates, "refusals": refusals}


def _mib(n: int) -> str:
    """`n` bytes in the largest unit (KiB, MiB, GiB) that keeps it at least 1."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


def format_fit(path: str, report: dict) -> str:
    """The fit report as `vktrain inspect --device-profile` prints it."""
    lines = [f"{path} on device profile {report['profile']}: {'fits' if report['fits'] else 'does NOT fit'}",
             f"  profile source: {report['source']}"]
    for index, d in enumerate(report["delegates"]):
        lines.append(f"  delegate {index}:")
        if d["planned"]:
            alloc, binding = d["largest_allocation"], d["largest_binding"]
            bound = d["max_dispatches_per_submit"]
            lines += [f"    dispatches: {d['dispatches']} (GEMMs {d['gemm_precision']}, as vktrain train --precision "
                      f"plans them here; fp32 GEMM tuning {d['gemm_tuning']})",
                      f"    submits per step: {d['submits']} ("
                      + (f"at most {bound} of its {d['recorded_dispatches']} recorded dispatches each)" if bound
                         else f"unbounded: {d['recorded_dispatches']} recorded dispatches)"),
                      f"    shader variants: {d['shader_variants']}",
                      f"    planned device memory: {_mib(d['device_memory_bytes'])} in {d['buffers']} buffer(s)"]
            if alloc:
                lines.append(f"    largest allocation: {_mib(alloc['bytes'])} (buffer {alloc['buffer']}, {alloc['role']}) "
                             f"of at most {_mib(d['max_allocation_bytes'])}")
            lines.append(f"    largest binding: {_mib(binding['bytes'])} ({binding['dispatch']}) of at most "
                         f"{_mib(d['max_storage_buffer_range'])}")
        for refusal in d["refusals"]:
            lines += [f"    refused ({refusal['limit']}): {refusal['message']}", f"      change: {refusal['change']}"]
    budget = report["memory_budget_bytes"]
    methods = [m for m in (report["eval"], report.get("accumulate")) if m]
    parts = (f" (training step {_mib(report['step_device_memory_bytes'])}"
             + "".join(f" + {m['method']} method {_mib(m['device_memory_bytes'])}" for m in methods)
             + " it does not share)") if methods else ""
    lines.append(f"  program device memory: {_mib(report['device_memory_bytes'])}{parts} "
                 + (f"of a budget of {_mib(budget)}" if budget else "(the profile records no memory budget)"))
    for refusal in report["refusals"]:
        lines += [f"  refused ({refusal['limit']}): {refusal['message']}", f"    change: {refusal['change']}"]
    return "\n".join(lines)


TABLE_COLUMNS = ("profile", "fits", "dispatches", "shader variants", "submits", "device memory", "budget",
                 "largest allocation", "largest binding", "refusals")


def _row(report: dict) -> tuple[str, ...]:
    planned = [d for d in report["delegates"] if d["planned"]]
    refusals = len(report["refusals"]) + sum(len(d["refusals"]) for d in report["delegates"])
    largest = lambda key: _mib(max((d[key]["bytes"] for d in planned if d[key]), default=0))  # noqa: E731
    return (report["profile"], "yes" if report["fits"] else "NO",
            str(sum(d["dispatches"] for d in planned)), str(sum(d["shader_variants"] for d in planned)),
            str(sum(d["submits"] for d in planned)), _mib(report["device_memory_bytes"]),
            _mib(report["memory_budget_bytes"]) if report["memory_budget_bytes"] else "none",
            largest("largest_allocation"), largest("largest_binding"), str(refusals))


def format_fit_table(path: str, reports: list[dict]) -> str:
    """One fit line per profile (`vktrain inspect STEP.pte --device-profile all`), then each refusal."""
    rows = [TABLE_COLUMNS] + [_row(r) for r in reports]
    widths = [max(len(row[i]) for row in rows) for i in range(len(TABLE_COLUMNS))]
    lines = [f"{path} on every built-in device profile (device memory: the training step and its eval and accumulate methods)"]
    lines += ["  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    for r in reports:
        for refusal in r["refusals"] + [x for d in r["delegates"] for x in d["refusals"]]:
            lines.append(f"  {r['profile']}: refused ({refusal['limit']}): {refusal['message']}; "
                         f"change: {refusal['change']}")
    return "\n".join(lines)
