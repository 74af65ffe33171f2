"""`vktrain inspect`: what a .pte holds (methods, delegate payloads, constants, planned memory, state, the schedules
embedded at export), or with --device-profile whether it fits a device class (runtime/program/fit.py)."""
from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

from vktrain.contract import EVERY_LAYER, METADATA_ACTIVATION_CHECKPOINTING, PRECISION_AUTO


def format_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_report(path: str, report: dict, verbose: bool = False) -> str:
    """The `vktrain inspect` text; `verbose`: every state tensor, not only their summary by kind."""
    lines = [f"{path}: {report['pte_bytes']} bytes"]
    if report.get("named_data_bytes"):
        lines.append(f"named data (constants shared by the methods): {format_bytes(report['named_data_bytes'])}")
    lines += _format_method(report, verbose)
    for name, method in report.get("other_methods", {}).items():
        lines.append(f"method {name!r}:")
        lines += ["  " + line for line in _format_method(method, verbose)]
    return "\n".join(lines)


def state_kind(name: str) -> str:
    """A state tensor's kind: its last name component (lora_A, lora_B, ...), under its optimizer slot
    for optimizer state: 'optimizer.exp_avg.model.l.0.q.lora_A' -> 'optimizer.exp_avg of lora_A'."""
    parts = name.split(".")
    if parts[0] == "optimizer" and len(parts) > 2:
        return f"optimizer.{parts[1]} of {parts[-1]}"
    return ".".join(parts[:2]) if parts[0] == "optimizer" else parts[-1]


def _tensor_bytes(entry: dict) -> int:
    import numpy as np

    return int(np.prod(entry["shape"], dtype=np.int64)) * np.dtype(entry["dtype"]).itemsize


def _format_state(state: list[dict], verbose: bool) -> list[str]:
    total = sum(_tensor_bytes(s) for s in state)
    lines = [f"  mutable state: {len(state)} tensor(s), {format_bytes(total)}"
             + ("" if verbose or not state else " (each one: --verbose)")]
    if verbose:
        return lines + [f"    {s['name']} {s['dtype']}{s['shape']} (initial: {s['initial']})" for s in state]
    kinds: dict[str, list[dict]] = {}
    for s in state:
        kinds.setdefault(state_kind(s["name"]), []).append(s)
    for kind, members in kinds.items():
        dtypes = ", ".join(sorted({m["dtype"] for m in members}))
        lines.append(f"    {kind}: {len(members)} tensor(s), {format_bytes(sum(map(_tensor_bytes, members)))} "
                     f"({dtypes})")
    return lines


def _format_embedded(delegate: dict) -> list[str]:
    """The schedules embedded at export (--target), one line per device profile."""
    embedded = delegate.get("embedded_schedules") or []
    if not embedded:
        return ["  embedded schedules: none (the kernels are planned at load)"]
    modules = delegate["shader_modules"]
    lines = [f"  embedded schedules: {len(embedded)} ({modules['count']} shader module(s), "
             f"{format_bytes(modules['bytes'])})"]
    for e in embedded:
        lines.append(f"    {e['profile']} ({e['api']}): {e['dispatches']} dispatches, {e['shader_variants']} shader "
                     f"variants, {e['shader_modules']} modules ({format_bytes(e['module_bytes'])}), planned memory "
                     f"{format_bytes(e['device_memory_bytes'])} in {e['buffers']} buffers; {e['gemm']}")
    return lines


def _format_method(report: dict, verbose: bool = False) -> list[str]:
    lines = [f"instructions: {report['delegate_calls']} delegate call(s), {report['kernel_calls']} kernel call(s)",
             f"operator table: {', '.join(report['operators']) if report['operators'] else '(empty)'}"]
    for i, d in enumerate(report["delegates"]):
        lines.append(f"delegate {i}: {d['backend_id']}, payload {format_bytes(d['payload_bytes'])}")
        if "ops" not in d:
            continue
        c, m = d["constants"], d["memory"]
        lines.append(f"  ops: {d['ops']}")
        for name, count in d["op_histogram"].items():
            lines.append(f"    {count:5d}  {name}")
        forms = ", ".join(f"{count} {form}" for form, count in c["stored_forms"].items())
        lines.append(f"  constants: {c['count']}, {format_bytes(c['bytes'])} as read "
                     f"({format_bytes(c['deduplicated_bytes'])} deduplicated); stored in "
                     f"{format_bytes(c['stored_deduplicated_bytes'])} ({forms}); layouts {c['tensor_layouts']}")
        lines.append(f"  planned GPU memory: {format_bytes(m['planned_bytes'])} in {m['memory_objects']} object(s) "
                     f"(unplanned {format_bytes(m['unplanned_bytes'])}); state {format_bytes(m['state_bytes'])}; "
                     f"{m['device_allocations']} device-memory allocation(s)")
        checkpointing = d["metadata"].get(METADATA_ACTIVATION_CHECKPOINTING)
        if checkpointing is not None:
            what = "each decoder layer" if checkpointing == EVERY_LAYER else \
                f"each segment of {checkpointing} decoder layers"
            lines.append(f"  activation checkpointing: {checkpointing} (the backward recomputes {what} from its input)")
        lines.append("  inputs: " + ", ".join(f"{t['name']} {t['dtype']}{t['shape']}" for t in d["inputs"]))
        lines.append("  outputs: " + ", ".join(f"{t['name']} {t['dtype']}{t['shape']}" for t in d["outputs"]))
        lines.append(f"  GEMM precisions allowed: {', '.join(d['gemm_precisions'])} (vktrain train --precision; "
                     f"the kernels are chosen by device at load)")
        lines += _format_state(d["mutable_state"], verbose)
        lines += _format_embedded(d)
        if d["baked_scalars"]:
            lines.append(f"  baked scalars (traced into {len(d['baked_scalars'])} et_vk call(s); constants of the "
                         f"program, so an LR schedule cannot change them):")
        for b in d["baked_scalars"]:
            values = ", ".join(f"{name}={value!r}" for name, value in b["scalars"].items())
            lines.append(f"    {b['node']} ({b['op']}): {values}")
    lines.append(f"refused nodes: {len(report['refusals'])}")
    for r in report["refusals"]:
        lines.append(f"  {r['node']}: {r['reason']}")
    return lines


def _planner(precision: str):
    """plan_schedule at the GEMM precision policy `precision`, as `vktrain train --precision` plans."""
    from vktrain.backend.kernel_planning import plan_schedule

    return functools.partial(plan_schedule, precision=precision)


def cmd_inspect(args: argparse.Namespace) -> int:
    try:
        data = Path(args.file).read_bytes()
    except OSError as e:
        print(f"vktrain inspect: error: cannot read {args.file}: {e.strerror}", file=sys.stderr)
        return 2
    if args.device_profile is None and args.precision != PRECISION_AUTO:
        print(f"vktrain inspect: error: --precision {args.precision} plans the program for a device profile: it "
              f"needs --device-profile NAME|FILE.json|all", file=sys.stderr)
        return 2
    planner = _planner(args.precision)
    if args.device_profile == "all":
        from vktrain.runtime.program.fit import fit_report, format_fit_table
        from vktrain.serialization.device_profile import BUILTIN_PROFILES

        reports = [fit_report(data, profile, args.file, planner=planner) for profile in BUILTIN_PROFILES.values()]
        print(json.dumps({"profiles": reports}, indent=2) if args.json else format_fit_table(args.file, reports))
        return 0
    if args.device_profile is not None:
        from vktrain.runtime.program.fit import fit_report, format_fit
        from vktrain.serialization.device_profile import resolve_profile

        report = fit_report(data, resolve_profile(args.device_profile), args.file, planner=planner)
        print(json.dumps(report, indent=2) if args.json else format_fit(args.file, report))
        return 0
    from vktrain.runtime.program.summary import summarize_pte

    report = summarize_pte(data, args.file)
    print(json.dumps(report, indent=2) if args.json else format_report(args.file, report, args.verbose))
    return 0
