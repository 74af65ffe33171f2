"""Whether a .pte's program fits a device profile, planned with no device (`vktrain inspect STEP.pte
--device-profile NAME`): the planner (runtime/delegate/planner.py) is a function of the graph and the profile,
so the dispatches, the buffers and every binding are known before a device is opened.

The report, per vktrain delegate of the main method (the training step's, else the only one): the dispatches
(and the submits a replay takes under the profile's max_dispatches_per_submit, split dispatches counted as
recorded under its max workgroup count),
the planned device memory (every buffer of the schedule: constants, state, activations, scratch), the largest
allocation against the profile's max allocation size, the largest binding against its max storage binding
size, and the refusals, each with the limit, the value needed, the profile's value and what to change.
A profile records no total-memory budget, so the device memory is reported, not judged.
"""
from __future__ import annotations

from vktrain.contract import BACKEND_ID
from vktrain.runtime.delegate.lowering_context import GraphLoweringError
from vktrain.runtime.delegate.planner import plan_schedule
from vktrain.runtime.program.summary import read_pte
from vktrain.runtime.vk.schedule import plan_submits, split_groups
from vktrain.serialization import deserialize_blob
from vktrain.serialization import graph as vk
from vktrain.serialization.device_profile import DeviceProfile
from vktrain.serialization.pte import PteFile
from vktrain.serialization.strided_view import KernelArgumentError

# What to change, by what a buffer holds (ScheduleBuffer.role): activations scale with batch x seq, the
# adapters and their AdamW moments with the rank, the frozen weights with the model alone.
ACTIVATIONS_ADVICE = "export with a smaller --batch or --seq (activations scale with batch x seq)"
ADVICE = {
    "input": ACTIVATIONS_ADVICE, "output": ACTIVATIONS_ADVICE, "intermediate": ACTIVATIONS_ADVICE,
    "scratch": ACTIVATIONS_ADVICE, "shared": ACTIVATIONS_ADVICE,
    "state": "export with a smaller --lora-rank (the adapters and their AdamW moments scale with the rank)",
    "constant": "the frozen weights do not shrink with batch, seq or rank: a smaller model, "
                "or a device with larger allocations",
}
BINDING_ADVICE = ("if the tensor named is an activation (its shape holds batch x seq), export with a smaller "
                  "--batch or --seq; a weight's bindings shrink only with the model")


def _delegate_fit(graph: vk.VkGraph, profile: DeviceProfile) -> dict:
    limits = {"max_allocation_bytes": profile.max_allocation_bytes,
              "max_storage_buffer_range": profile.max_storage_buffer_range}
    try:
        schedule = plan_schedule(graph, profile)
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
        "largest_allocation": {"buffer": buffers[0].key, "role": buffers[0].role, "bytes": buffers[0].size_bytes}
        if buffers else None,
        "largest_binding": {"dispatch": largest_binding[1], "bytes": largest_binding[0]},
        "gemm_tuning": schedule.gemm.fp32_tuning,
        "refusals": refusals,
    }


def fit_report(data: bytes, profile: DeviceProfile, source: str = "<bytes>") -> dict:
    """Whether the .pte's main method fits `profile` (module docstring); JSON-ready."""
    pte = PteFile.from_bytes(data, source)
    contents = read_pte(data, None, source)
    delegates = [_delegate_fit(deserialize_blob(d.payload, named_data=pte.named_data), profile)
                 for d in contents.delegates if d.backend_id == BACKEND_ID]
    return {"profile": profile.name, "source": profile.source, "fits": all(d["fits"] for d in delegates),
            "delegates": delegates}


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
            lines += [f"    dispatches: {d['dispatches']} (fp32 GEMM tuning {d['gemm_tuning']})",
                      f"    submits per step: {d['submits']} ("
                      + (f"at most {bound} of its {d['recorded_dispatches']} recorded dispatches each)" if bound
                         else f"unbounded: {d['recorded_dispatches']} recorded dispatches)"),
                      f"    planned device memory: {_mib(d['device_memory_bytes'])} in {d['buffers']} buffer(s) "
                      f"(the profile records no memory budget)"]
            if alloc:
                lines.append(f"    largest allocation: {_mib(alloc['bytes'])} (buffer {alloc['buffer']}, {alloc['role']}) "
                             f"of at most {_mib(d['max_allocation_bytes'])}")
            lines.append(f"    largest binding: {_mib(binding['bytes'])} ({binding['dispatch']}) of at most "
                         f"{_mib(d['max_storage_buffer_range'])}")
        for refusal in d["refusals"]:
            lines += [f"    refused ({refusal['limit']}): {refusal['message']}", f"      change: {refusal['change']}"]
    return "\n".join(lines)
