"""Rewrite imports of modules and names that moved when the imports were made to go one way and kernel planning
moved to the AOT side (issue 25).

    python scripts/follow_moves.py            # rewrites vktrain/, tests/, scripts/, docs/, README.md in place

For a branch written before the moves: after merging it, this points its imports (and the dotted paths in
its comments and docs) at the new homes; then `python3 ../shared/hooks/import_check.py .` and the tests.
A `from OLD import a, b` whose names moved apart is split into one import per new home; an import that
names nothing moved is left as it is. Idempotent. It also lists (without rewriting them) the calls the
planning move changed: since the runtime plans nothing, TrainingRunner / EvalMethod / AccumulateMethod need
`planner=` (the app passes vktrain.backend.kernel_planning.plan_schedule) or a `schedule=`, and
GraphExecutor(device, graph, schedule) a Schedule.
"""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Whole modules: old dotted path -> new one (also rewritten in comments, docs and file paths).
MODULES = {
    "vktrain.runtime.program.pte": "vktrain.serialization.pte",
    "vktrain.runtime.program.pte_objects": "vktrain.serialization.pte_objects",
    "vktrain.runtime.program.pte_schema": "vktrain.serialization.pte_schema",
    "vktrain.runtime.program.verify": "vktrain.serialization.verify",
    "vktrain.train.tokenizer": "vktrain.serialization.tokenizer",
    # Kernel planning: the runtime takes a Schedule, the AOT side plans it (a package move covers its modules:
    # vktrain.runtime.delegate.kernels.layout -> vktrain.backend.kernel_planning.kernels.layout).
    "vktrain.runtime.delegate.planner": "vktrain.backend.kernel_planning.planner",
    "vktrain.runtime.delegate.op_lowering": "vktrain.backend.kernel_planning.op_lowering",
    "vktrain.runtime.delegate.lowering_context": "vktrain.backend.kernel_planning.lowering_context",
    "vktrain.runtime.delegate.kernels": "vktrain.backend.kernel_planning.kernels",
}
# Names that left a module that stays (or moved): (old module, name) -> (new module, new name). A name that left
# a moved module is listed under the module's old path and its new one (kernel_planning_names below).
_LAYOUT = "vktrain.runtime.delegate.kernels.layout"
_ADAPTERS = "vktrain.train.adapters"
_RUNNER = "vktrain.runtime.program.runner"
_PLANNER, _LOWERING, _CONTEXT = "vktrain.runtime.delegate.planner", "vktrain.runtime.delegate.op_lowering", \
    "vktrain.runtime.delegate.lowering_context"
_COOPMAT = "vktrain.runtime.delegate.kernels.coopmat"


def kernel_planning_names(table: dict) -> dict:
    """`table` with each entry of a module that moved to vktrain.backend.kernel_planning also under its new path."""
    moved = {old: new for old, new in MODULES.items() if new.startswith("vktrain.backend.kernel_planning")}
    out = dict(table)
    for (module, name), target in table.items():
        for old, new in moved.items():
            if module == old or module.startswith(old + "."):
                out[(new + module[len(old):], name)] = target
    return out


NAMES = {
    **{(_LAYOUT, n): ("vktrain.serialization.strided_view", n) for n in (
        "KernelArgumentError", "_as_int_tuple", "check_shape", "contiguous_strides", "normalize_dim", "StridedView",
        "TRANSPOSE_OPS", "transposed_view", "infer_reshape", "MAX_ELEMENTS")},
    **{(_ADAPTERS, n): ("vktrain.serialization.peft_adapters", n) for n in (
        "ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "PEFT_PREFIX", "LORA_SUFFIXES", "AdapterError", "peft_name",
        "load_adapter_config", "load_adapters")},
    (_ADAPTERS, "_LORA_PARTS"): ("vktrain.serialization.peft_adapters", "LORA_PARTS"),
    (_ADAPTERS, "_check_pair"): ("vktrain.serialization.peft_adapters", "check_pair"),
    **{("vktrain.backend.passes.lora_linear", n): ("vktrain.opdefs.runtime_ops", n) for n in (
        "EXPANDED_OPS", "LORA_LINEAR", "LORA_LINEAR_BACKWARD")},
    **{("vktrain.train.eval_command", n): ("vktrain.train.held_out", n) for n in (
        "check_max_batches", "eval_batches", "evaluate_data")},
    **{("vktrain.runtime.webgpu.device", n): ("vktrain.runtime.webgpu.features", n) for n in (
        "INSIDE_PASS_FEATURE", "UNIFORM_SLOT_ALIGNMENT")},
    **{("vktrain.models.loading", n): ("vktrain.models.pretrained", n) for n in ("load", "open_model")},
    **{("vktrain.cli", n): ("vktrain.train.model_options", n) for n in (
        "UsageError", "add_quantization_arguments", "quantization_importance")},
    ("vktrain.cli", "_parse_model_args"): ("vktrain.train.model_options", "parse_model_args"),
    ("vktrain.lora.calibration", "calibration_tokens"): ("vktrain.train.model_options", "calibration_tokens"),
    **{("vktrain.runtime.vk.schedule", n): ("vktrain.serialization.dispatch", n) for n in (
        "ACCESS_MODES", "FIRST_KERNEL_SPEC_ID", "LOCAL_SIZE_SPEC_IDS", "MAX_SPLIT_DISPATCHES", "PUSH_HEADER_BYTES",
        "BufferBinding", "Dispatch", "SpecValue", "ScheduleError")},
    ("vktrain.runtime.vk.errors", "ScheduleError"): ("vktrain.serialization.dispatch", "ScheduleError"),
    **{(_RUNNER, n): ("vktrain.runtime.program.interpreter", n) for n in (
        "ProgramInterpreter", "VerifiedTrainingProgram", "verify_training_program", "check_hparams_input",
        "check_instructions_supported", "check_loss_output", "check_storageless_tensors", "plan_input_names",
        "CPU_KERNELS")},
    # Facts about a Schedule the runtime checks: the ground floor (serialization/schedule_memory.py, schedule.py).
    **{(_PLANNER, n): ("vktrain.serialization.schedule_memory", n) for n in (
        "MEMORY_BUDGET_ADVICE", "TRANSIENT_ROLES", "allocation_refusals", "check_allocations", "check_memory_budget",
        "memory_budget_refusal", "owned_bytes", "reused_buffers")},
    (_PLANNER, "SHARED_PREFIX"): ("vktrain.serialization.schedule", "SHARED_PREFIX"),
    **{(module, "GraphLoweringError"): ("vktrain.errors", "GraphLoweringError")
       for module in (_PLANNER, _LOWERING, _CONTEXT)},
    (_COOPMAT, "PrecisionPolicyError"): ("vktrain.errors", "PrecisionPolicyError"),
    (_COOPMAT, "allowed_precisions"): ("vktrain.contract", "allowed_precisions"),
    ("vktrain.runtime.vk.coopmat", "supports_shape"): ("vktrain.serialization.device_profile", "supports_shape"),
    **{("vktrain.runtime.vk.schedule", n): ("vktrain.serialization.dispatch", n) for n in ("ceil_div", "pack_push")},
}
NAMES = kernel_planning_names(NAMES)
# Names used without an import that were renamed (a module that imported the old name uses the new one).
RENAMED = {old_name: new_name for (_, old_name), (_, new_name) in NAMES.items() if old_name != new_name}
WHERE = ("vktrain", "tests", "scripts", "docs", "README.md")
SUFFIXES = (".py", ".md", ".sh", ".toml", ".txt")
LINE = 120
# Files that name the old homes on purpose (the layer test's synthetic tree of the old imports).
KEEP = {Path("tests/test_layers.py")}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_lines(indent: str, module: str, names: list[tuple[str, str | None]], comment: str) -> list[str]:
    items = [name if alias is None else f"{name} as {alias}" for name, alias in names]
    line = f"{indent}from {module} import {', '.join(items)}" + (f"  {comment}" if comment else "")
    if len(line) <= LINE:
        return [line]
    lines, current = [f"{indent}from {module} import (" + (f"  {comment}" if comment else "")], indent + "    "
    for item in items:
        if len(current) + len(item) + 2 > LINE and current.strip():
            lines.append(current.rstrip())
            current = indent + "    "
        current += item + ", "
    return lines + [current.rstrip().rstrip(","), indent + ")"]


def _rewrite_imports(path: Path, text: str) -> str:
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return text
    in_package = path.is_relative_to(REPO / "vktrain")
    name = _module_name(path) if in_package else ""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    lines, edits, renamed_here = text.split("\n"), [], set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or (node.level and not in_package):
            continue
        base = node.module or ""
        if node.level:
            up = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join(up + ([base] if base else []))
        # `from PACKAGE import module` of a module that moved out of a package that stays.
        moved_modules = {a.name: MODULES[f"{base}.{a.name}"].rpartition(".") for a in node.names
                         if f"{base}.{a.name}" in MODULES and base not in MODULES}
        moved_names = any((base, a.name) in NAMES for a in node.names) or moved_modules
        if not moved_names and not (node.level and base in MODULES):
            continue  # a plain module move is a textual rename (below)
        groups: dict[str, list[tuple[str, str | None]]] = {}
        for alias in node.names:
            target, new_name = NAMES.get((base, alias.name), (MODULES.get(base, base), alias.name))
            if alias.name in moved_modules:
                target, _, new_name = moved_modules[alias.name]
            if new_name != alias.name and alias.asname is None:
                renamed_here.add(alias.name)
            groups.setdefault(target, []).append((new_name, alias.asname))
        first = lines[node.lineno - 1]
        comment = re.search(r"#.*$", first if node.lineno == node.end_lineno else lines[node.end_lineno - 1])
        new = []
        for index, (target, names) in enumerate(groups.items()):
            new += _import_lines(first[:node.col_offset], target, names, comment.group(0) if comment and index == 0
                                 else "")
        edits.append((node.lineno - 1, node.end_lineno, new))
    for start, end, new in sorted(edits, reverse=True):
        lines[start:end] = new
    text = "\n".join(lines)
    for old in renamed_here:
        text = re.sub(rf"(?<![\w.]){re.escape(old)}\b", RENAMED[old], text)
    return text


def _rewrite_paths(text: str) -> str:
    for old, new in MODULES.items():
        text = re.sub(re.escape(old) + r"(?![\w])", new, text)
        text = re.sub(re.escape(old.replace(".", "/")) + r"(?![\w])", new.replace(".", "/"), text)
    return text


PLANNED_CALLS = {"TrainingRunner", "from_pte", "EvalMethod", "AccumulateMethod"}


def calls_without_a_schedule(path: Path) -> list[str]:
    """`path:line: call` of each runner built with neither planner= nor schedule=, and each GraphExecutor given
    no schedule (a GenerationRunner.from_pte plans itself and is not listed)."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except SyntaxError:
        return []
    found, where = [], path.relative_to(REPO) if path.is_relative_to(REPO) else path
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        owner = getattr(getattr(func, "value", None), "id", None)
        keywords = {k.arg for k in node.keywords}
        runner = name in PLANNED_CALLS and (name != "from_pte" or owner == "TrainingRunner")
        if runner and not keywords & {"planner", "schedule", None}:
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)[:90]} (pass planner=plan_schedule)")
        elif name == "GraphExecutor" and len(node.args) < 3 and "schedule" not in keywords:
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)[:90]} (give it a Schedule)")
    return found


def follow(path: Path) -> bool:
    text = path.read_text(encoding="utf-8")
    new = _rewrite_paths(_rewrite_imports(path, text) if path.suffix == ".py" else text)
    if new != text:
        path.write_text(new, encoding="utf-8")
    return new != text


def main() -> int:
    changed, calls = [], []
    for where in WHERE:
        root = REPO / where
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for path in files:
            skipped = {"generated", "pte_schema", "__pycache__"} & set(path.parts)
            if path.suffix in SUFFIXES and not skipped and path.resolve() != Path(__file__).resolve() \
                    and path.relative_to(REPO) not in KEEP:
                if follow(path):
                    changed.append(path.relative_to(REPO))
                if path.suffix == ".py":
                    calls += calls_without_a_schedule(path)
    print("\n".join(f"rewrote {p}" for p in changed) or "nothing to rewrite")
    if calls:
        print("calls to fix by hand (the runtime plans nothing: issue 25):\n  " + "\n  ".join(calls))
    return 0


if __name__ == "__main__":
    sys.exit(main())
