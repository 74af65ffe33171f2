"""Imports go one way: no circles between modules, no import against the layers, and a runtime that needs
neither torch nor the AOT side, nor holds any kernel choice (planning is the AOT side's: the runtime runs the
Schedule it is given). Every import counts, also those inside functions (a function-level import is still a
dependency).

The layer order is this file's (the developers' guide states it; ../shared/hooks/import_check.py, the
commit hook, applies the same rules), so the test needs nothing beside the clone.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# Top-level package or module of vktrain -> its layer; a module may import its own layer or lower ones.
LAYER = {
    # 0, the ground floor: formats and definitions both sides stand on
    "errors": 0, "contract": 0, "gguf_names": 0, "quant": 0, "opdefs": 0, "serialization": 0, "data": 0,
    "import_noise": 0,  # standard library only: the package's __init__ ("") silences known import noise with it
    # the kernel sources and their build (SPIR-V, WGSL, reflection): the AOT side embeds them in the blob
    # (vktrain export --target), the runtime loads them; they import nothing but errors and serialization
    "runtime_shaders": 0,
    "": 0,
    # 1, AOT side (torch, executorch)
    "ops": 1, "models": 1, "lora": 1, "export": 1, "partitioner": 1, "backend": 1,
    # 1, runtime side (never imports the AOT side, nor the AOT side it)
    "runtime": 1, "native": 1,
    # 2, the app
    "train": 2, "fleet": 2, "generate": 2, "executorch_backend": 2, "cli": 2, "inspect_command": 2,
}
AOT = {name for name in ("ops", "models", "lora", "export", "partitioner", "backend")}
RUNTIME = {"runtime", "native"}
# Third-party packages of the AOT side: no vktrain/runtime module may import them.
AOT_THIRD_PARTY = {"torch", "torchao", "executorch", "transformers", "peft"}
# The ground floor's build-time code generators (they read torch's and executorch's schemas); nothing else on
# the ground floor imports the AOT side's packages.
GENERATORS = {"vktrain.opdefs.generate", "vktrain.serialization.generate"}
# Generated flatbuffer code: no vktrain imports of its own.
SKIPPED_PARTS = {"generated", "pte_schema"}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imported_names(path: Path, name: str) -> set[str]:
    """Every module name `path` imports (absolute, relative ones resolved; `from m import x` counts m and m.x)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def import_graph(root: Path) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(module -> the vktrain modules it imports, module -> the other top-level packages it imports) for
    the package under `root`/vktrain."""
    files = [p for p in (root / "vktrain").rglob("*.py") if not SKIPPED_PARTS & set(p.parts)]
    modules = {module_name(p, root): p for p in files}
    graph, external = {}, {}
    for name, path in modules.items():
        targets, others = set(), set()
        for imported in imported_names(path, name):
            if imported != "vktrain" and not imported.startswith("vktrain."):
                others.add(imported.split(".")[0])
                continue
            while imported and imported not in modules:  # `from m import function` -> m
                imported = imported.rpartition(".")[0]
            if imported and imported != name and not name.startswith(imported + ".") and imported != "vktrain":
                targets.add(imported)
        graph[name], external[name] = targets, others
    return graph, external


def _top(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def against_the_layers(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for a, targets in sorted(graph.items()):
        for b in sorted(targets):
            ta, tb = _top(a), _top(b)
            if ta == tb:
                continue
            if ta not in LAYER or tb not in LAYER:
                found.append(f"{a} imports {b}: {ta if ta not in LAYER else tb} has no layer (add it to LAYER)")
            elif LAYER[tb] > LAYER[ta] or (ta in RUNTIME and tb in AOT) or (ta in AOT and tb in RUNTIME):
                found.append(f"{a} imports {b}")
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, comps, counter = {}, {}, set(), [], [], 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    comps.append(sorted(comp))
    return comps


def runtime_imports_of_the_aot_side(graph, external, floor: str = "runtime") -> list[str]:
    """What modules of `floor` (the runtime; or "ground": every layer-0 package but the generators) import of
    torch, executorch and the like or of the AOT packages."""
    found = []
    for name in sorted(graph):
        if floor == "ground":
            if LAYER.get(_top(name)) != 0 or name in GENERATORS:
                continue
        elif _top(name) != floor:
            continue
        found += [f"{name} imports {m}" for m in sorted(external[name] & AOT_THIRD_PARTY)]
        found += [f"{name} imports {m}" for m in sorted(graph[name]) if _top(m) in AOT]
    return found


# Kernel planning (op lowering, the kernel families' plan functions, the planner) is the AOT side's
# (vktrain/backend/kernel_planning): no runtime module is named after it, imports it, or builds a dispatch (a
# Dispatch record or its push-constant bytes) the way a plan function does.
PLANNING_PARTS = {"kernel_planning", "kernels", "planner", "op_lowering", "lowering_context"}
DISPATCH_BUILDERS = {"Dispatch", "pack_push"}


def planning_in_the_runtime(root: Path, graph: dict[str, set[str]]) -> list[str]:
    """Each runtime module (RUNTIME floors) that is, imports or does kernel planning, one phrase each."""
    found = []
    for path in sorted((root / "vktrain").rglob("*.py")):
        name = module_name(path, root)
        if _top(name) not in RUNTIME or SKIPPED_PARTS & set(path.parts):
            continue
        if PLANNING_PARTS & set(name.split(".")):
            found.append(f"{name} is kernel planning (the AOT side's: vktrain/backend/kernel_planning)")
        found += [f"{name} imports {m}" for m in sorted(graph.get(name, ())) if PLANNING_PARTS & set(m.split("."))
                  or _top(m) in AOT]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call):
                called = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
                if called in DISPATCH_BUILDERS:
                    found.append(f"{name} builds a dispatch ({called}(...), line {node.lineno})")
    return found


@pytest.fixture(scope="module")
def package_graph():
    return import_graph(REPO)


def test_every_top_level_package_has_a_layer(package_graph):
    graph, _ = package_graph
    assert sorted({_top(m) for m in graph} - set(LAYER) - {""}) == []


def test_no_import_goes_against_the_layers(package_graph):
    graph, _ = package_graph
    assert against_the_layers(graph) == []


def test_no_import_circles(package_graph):
    graph, _ = package_graph
    assert circles(graph) == []


def test_the_runtime_imports_neither_torch_nor_the_aot_side(package_graph):
    graph, external = package_graph
    assert "vktrain.runtime.program.runner" in graph  # the walk saw the runtime
    assert runtime_imports_of_the_aot_side(graph, external) == []


def test_the_runtime_holds_no_kernel_planning(package_graph):
    graph, _ = package_graph
    assert "vktrain.backend.kernel_planning.planner" in graph and "vktrain.runtime.delegate.executor" in graph
    assert planning_in_the_runtime(REPO, graph) == []


def test_the_planning_check_finds_what_it_looks_for(tmp_path):
    """A small tree with a planner module under the runtime, a runtime module importing the AOT planner, and
    one building a dispatch and its push constants; the AOT side's planner itself is fine."""
    files = {
        "vktrain/__init__.py": "",
        "vktrain/runtime/__init__.py": "",
        "vktrain/runtime/delegate/__init__.py": "",
        "vktrain/runtime/delegate/op_lowering.py": "",
        "vktrain/runtime/delegate/executor.py": "def load():\n    from vktrain.backend.kernel_planning import planner\n",
        "vktrain/runtime/guard.py": "from vktrain.serialization import dispatch as d\n"
                                    "x = d.Dispatch('copy', 1, push_constants=d.pack_push(4))\n",
        "vktrain/backend/__init__.py": "",
        "vktrain/backend/kernel_planning/__init__.py": "",
        "vktrain/backend/kernel_planning/planner.py": "from vktrain.serialization.dispatch import Dispatch\n"
                                                      "x = Dispatch('copy', 1)\n",
        "vktrain/serialization/__init__.py": "",
        "vktrain/serialization/dispatch.py": "",
    }
    for relative, text in files.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(text)
    graph, _ = import_graph(tmp_path)
    assert planning_in_the_runtime(tmp_path, graph) == [
        "vktrain.runtime.delegate.executor imports vktrain.backend.kernel_planning",
        "vktrain.runtime.delegate.executor imports vktrain.backend.kernel_planning.planner",
        "vktrain.runtime.delegate.op_lowering is kernel planning (the AOT side's: vktrain/backend/kernel_planning)",
        "vktrain.runtime.guard builds a dispatch (Dispatch(...), line 2)",
        "vktrain.runtime.guard builds a dispatch (pack_push(...), line 2)"]


def test_the_ground_floor_imports_neither_torch_nor_the_aot_side(package_graph):
    graph, external = package_graph
    assert "vktrain.serialization.pte" in graph
    assert runtime_imports_of_the_aot_side(graph, external, floor="ground") == []


def test_the_checks_find_what_they_look_for(tmp_path):
    """A small tree with one of each: an upward import, a runtime -> AOT import, torch in the runtime and on
    the ground floor, and a circle made of function-level and relative imports."""
    files = {
        "vktrain/__init__.py": "",
        "vktrain/serialization/__init__.py": "",
        "vktrain/serialization/reader.py": "import torch\n\ndef f():\n    from vktrain.train.tool import helper\n",
        "vktrain/runtime/__init__.py": "",
        "vktrain/runtime/a.py": "from .b import thing\nimport torch\n",
        "vktrain/runtime/b.py": "def g():\n    from vktrain.runtime import a\n    from vktrain.backend.passes import p\n",
        "vktrain/backend/__init__.py": "",
        "vktrain/backend/passes.py": "",
        "vktrain/train/__init__.py": "",
        "vktrain/train/tool.py": "",
    }
    for relative, text in files.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(text)
    graph, external = import_graph(tmp_path)
    assert against_the_layers(graph) == ["vktrain.runtime.b imports vktrain.backend.passes",
                                         "vktrain.serialization.reader imports vktrain.train.tool"]
    assert circles(graph) == [["vktrain.runtime.a", "vktrain.runtime.b"]]
    assert runtime_imports_of_the_aot_side(graph, external) == ["vktrain.runtime.a imports torch",
                                                                "vktrain.runtime.b imports vktrain.backend.passes"]
    assert runtime_imports_of_the_aot_side(graph, external, floor="ground") == [
        "vktrain.serialization.reader imports torch"]


def test_follow_moves_points_old_imports_at_the_new_homes(tmp_path):
    """scripts/follow_moves.py (for branches written before the moves): its table names modules and names that
    exist, and it splits an import whose names moved apart, renames what was renamed, and keeps the rest."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("follow_moves", REPO / "scripts" / "follow_moves.py")
    follow_moves = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(follow_moves)
    for new in follow_moves.MODULES.values():
        assert (REPO / (new.replace(".", "/") + ".py")).is_file() or (REPO / new.replace(".", "/")).is_dir(), new
    for (old, _), (new, name) in follow_moves.NAMES.items():
        tree = ast.parse((REPO / (new.replace(".", "/") + ".py")).read_text())
        defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))} | {
            t.id for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
        assert name in defined, f"{new} defines no {name}"
    path = tmp_path / "old.py"
    path.write_text("from vktrain.train.eval_command import adapter_state, evaluate_data  # used below\n"
                    "from vktrain.cli import _parse_model_args\n"
                    "from vktrain.runtime.program.pte import PteFile\n"
                    "from vktrain.models import load\n"
                    "from vktrain.runtime.delegate.kernels.coopmat import GemmRoute, allowed_precisions\n"
                    "from vktrain.runtime.delegate.kernels.layout import plan_fill, StridedView\n"
                    "from vktrain.runtime.delegate.planner import plan_schedule, owned_bytes\n"
                    "from vktrain.runtime.delegate.kernels import attention  # kernels/attention.py\n"
                    "from vktrain.runtime.delegate import executor, op_lowering\n"
                    "overrides = _parse_model_args(items)  # vktrain/train/tokenizer.py\n")
    assert follow_moves.follow(path) and not follow_moves.follow(path)
    calls = tmp_path / "calls.py"
    calls.write_text("a = TrainingRunner.from_pte(path, device)\nb = TrainingRunner.from_pte(path, planner=plan)\n"
                     "c = GraphExecutor(device, graph, precision='fp32')\nd = GraphExecutor(device, graph, schedule)\n")
    assert [line.split(": ")[0] for line in follow_moves.calls_without_a_schedule(calls)] == [
        f"{calls}:1", f"{calls}:3"]
    assert path.read_text().split("\n") == [
        "from vktrain.train.eval_command import adapter_state  # used below",
        "from vktrain.train.held_out import evaluate_data",
        "from vktrain.train.model_options import parse_model_args",
        "from vktrain.serialization.pte import PteFile",
        "from vktrain.models import load",
        "from vktrain.backend.kernel_planning.kernels.coopmat import GemmRoute",
        "from vktrain.contract import allowed_precisions",
        "from vktrain.backend.kernel_planning.kernels.layout import plan_fill",
        "from vktrain.serialization.strided_view import StridedView",
        "from vktrain.backend.kernel_planning.planner import plan_schedule",
        "from vktrain.serialization.schedule_memory import owned_bytes",
        "from vktrain.backend.kernel_planning.kernels import attention  # kernels/attention.py",
        "from vktrain.runtime.delegate import executor",
        "from vktrain.backend.kernel_planning import op_lowering",
        "overrides = parse_model_args(items)  # vktrain/serialization/tokenizer.py", ""]
