#!/usr/bin/env python
"""Where a program's load goes: `vktrain train`'s TrainingRunner.from_pte and its eval method's load, per phase.

    python3 scripts/bench_load.py bench/train_smollm2-135m_4x512.pte --out load.json    # any machine with Vulkan
    python3 scripts/bench_load.py bench/*.pte --repeat 3 --label after --out bench/results/load_<machine>_<model>.json

Per .pte, `--repeat` loads in this process, each on a Device of its own (what one `vktrain train` opens), all
with one on-disk pipeline cache that starts empty (a temporary VKTRAIN_PIPELINE_CACHE folder unless
--pipeline-cache gives one, or `0` to run without it): the first load is a cold start, the later ones read
the pipelines the first wrote (vktrain/runtime/vk/pipeline_store.py). Each load is the step
(TrainingRunner.from_pte, `planner=plan_schedule` and timing=False as `vktrain train` calls it; the schedule
embedded at export where the .pte carries one for the device, else planned at load) and, where the program
has one, its eval method (TrainingRunner.eval_method(), as the first held-out evaluation loads it).

Phases (PHASES) are seconds spent in a function minus those of the phases it calls (nested phases do not
count twice), so the phases of one load add up to its wall time; `other` is what no phase covers. `*_cpu_s`:
the process's CPU seconds (every thread's: the driver's compiler threads too), steadier than wall time on a
shared machine.
A synthetic constant (benchmark .pte files) is generated at load (`synthetic_generation`); a real .pte reads
its bytes instead. Stdlib + numpy + the vulkan binding: runs on the GPU machine without executorch.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(REPO_ROOT))  # after PYTHONPATH: PYTHONPATH=OLD_CHECKOUT times that checkout's load (before)
sys.path.insert(0, str(Path(__file__).resolve().parent))

# (module, class or "", function, phase). A function missing in the checkout (an older one) is skipped.
PHASES = [
    ("vktrain.runtime.vk.device", "Device", "__init__", "device_open"),
    ("vktrain.serialization.pte", "PteFile", "load", "pte_read"),
    ("vktrain.runtime.program.interpreter", "", "verify_training_program", "program_checks"),
    ("vktrain.runtime.program.interpreter", "ProgramInterpreter", "__init__", "program_checks"),
    ("vktrain.serialization.verify", "", "verify_plan", "program_checks"),
    ("vktrain.serialization.blob", "", "deserialize_blob", "blob_parse"),
    ("vktrain.serialization.graph", "VkGraph", "validate", "graph_validate"),
    ("vktrain.serialization.verify", "", "check_op_shapes", "op_shape_checks"),
    ("vktrain.serialization.verify", "", "check_device_memory", "program_checks"),
    ("vktrain.runtime.program.embedded", "", "step_selection", "embedded_select"),
    ("vktrain.runtime.program.embedded", "", "method_selection", "embedded_select"),
    ("vktrain.backend.kernel_planning.planner", "", "plan_schedule", "planning"),
    ("vktrain.serialization.verify_schedule", "", "verify_schedule", "schedule_verify"),
    ("vktrain.runtime.delegate.executor", "GraphExecutor", "_allocate_buffers", "buffers"),
    ("vktrain.runtime.delegate.executor", "GraphExecutor", "_upload_constants", "constant_upload"),
    ("vktrain.serialization.synthetic", "SyntheticConstant", "materialize", "synthetic_generation"),
    ("vktrain.runtime.delegate.executor", "GraphExecutor", "reset_state", "state_reset"),
    ("vktrain.runtime.delegate.executor", "GraphExecutor", "constants_matching", "constants_matching"),
    ("vktrain.runtime.vk.pipelines", "PipelineCache", "shader", "shader_modules"),
    ("vktrain.runtime.vk.pipelines", "PipelineCache", "get", "pipelines"),
    ("vktrain.runtime.vk.commands", "Program", "_plan", "dispatch_checks"),
    ("vktrain.runtime.vk.commands", "Program", "_record", "recording"),
    ("vktrain.runtime.vk.commands", "Program", "__init__", "program_other"),
    ("vktrain.runtime.delegate.executor", "GraphExecutor", "__init__", "executor_other"),
]


class PhaseClock:
    """Exclusive seconds per phase: each wrapped call's time minus that of the wrapped calls inside it."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._stack: list[list[float]] = []  # [start, seconds of nested phases] per open call

    def wrap(self, function, phase: str):
        def timed(*args, **kwargs):
            self._stack.append([time.perf_counter(), 0.0])
            try:
                return function(*args, **kwargs)
            finally:
                start, nested = self._stack.pop()
                spent = time.perf_counter() - start
                self.seconds[phase] = self.seconds.get(phase, 0.0) + spent - nested
                if self._stack:
                    self._stack[-1][1] += spent
        timed.__wrapped__ = function
        return timed

    def take(self) -> dict[str, float]:
        seconds, self.seconds = self.seconds, {}
        return seconds


def patch_phases(clock: PhaseClock) -> list[tuple[Any, str, Any]]:
    """Wrap every PHASES function where it is defined and wherever a loaded module imported it by name;
    returns what to put back."""
    import importlib

    undo = []
    for module_name, owner_name, name, phase in PHASES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        owner = getattr(module, owner_name, None) if owner_name else module
        function = owner.__dict__.get(name) if owner is not None else None
        if function is None:
            continue
        kind = type(function) if isinstance(function, (classmethod, staticmethod)) else None
        wrapped = kind(clock.wrap(function.__func__, phase)) if kind else clock.wrap(function, phase)
        undo.append((owner, name, function))
        setattr(owner, name, wrapped)
        if not owner_name:  # `from module import function` copies elsewhere
            for other in list(sys.modules.values()):
                if other is not module and getattr(other, name, None) is function:
                    undo.append((other, name, function))
                    setattr(other, name, wrapped)
    return undo


def load_once(path: Path, clock: PhaseClock) -> dict[str, Any]:
    from vktrain.backend.kernel_planning import plan_schedule
    from vktrain.contract import EVAL_METHOD
    from vktrain.runtime.program.runner import TrainingRunner

    clock.take()
    start, cpu = time.perf_counter(), time.process_time()
    runner = TrainingRunner.from_pte(path, planner=plan_schedule, timing=False)
    step_s, step_cpu_s = time.perf_counter() - start, time.process_time() - cpu
    step = clock.take()
    try:
        result = {"step_s": step_s, "step_cpu_s": step_cpu_s, "step_phases": step, "target": runner.target.profile.name
                  if runner.target is not None else None, "pipelines": len(runner.device.pipelines)}
        if EVAL_METHOD in runner.pte.method_names:
            start, cpu = time.perf_counter(), time.process_time()
            runner.eval_method()
            result["eval_s"], result["eval_cpu_s"] = time.perf_counter() - start, time.process_time() - cpu
            result["eval_phases"] = clock.take()
        result["pipeline_store"] = getattr(runner.device.pipelines, "store_report", lambda: None)()
    finally:
        runner.close()
    for key in ("step", "eval"):
        if f"{key}_s" in result:
            result[f"{key}_phases"]["other"] = result[f"{key}_s"] - sum(result[f"{key}_phases"].values())
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pte", nargs="+", type=Path)
    parser.add_argument("--repeat", type=int, default=2, help="loads per .pte (the first cold, the rest warm)")
    parser.add_argument("--pipeline-cache", default=None,
                        help="the pipeline cache folder (default: a new temporary one; 0: none)")
    parser.add_argument("--label", default="", help="names the code measured (e.g. before / after)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    from bench_results import out_error
    if out_error(args.out):
        parser.error(out_error(args.out))
    if args.repeat < 1:
        parser.error(f"--repeat must be >= 1, got {args.repeat}")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["VKTRAIN_PIPELINE_CACHE"] = args.pipeline_cache if args.pipeline_cache is not None else tmp
        clock = PhaseClock()
        undo = patch_phases(clock)
        from vktrain.errors import VktrainError
        from vktrain.runtime import Device

        with Device(validation=False) as device:
            meta = {"vk_device": device.name, "host": platform.node(), "python": platform.python_version(),
                    "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "label": args.label,
                    "pipeline_cache": os.environ["VKTRAIN_PIPELINE_CACHE"] if args.pipeline_cache is not None
                    else "a new temporary folder"}
        results = []
        try:
            for path in args.pte:
                loads = []
                for index in range(args.repeat):
                    try:
                        load = load_once(path, clock)
                    except VktrainError as exc:  # e.g. no embedded schedule this device runs: said, not fatal
                        print(f"{path.name}: {exc}", flush=True)
                        loads.append({"error": str(exc)})
                        break
                    loads.append(load)
                    top = sorted(load["step_phases"].items(), key=lambda kv: -kv[1])[:6]
                    line = (f"{path.name} load {index + 1}: step {load['step_s']:.2f} s, CPU {load['step_cpu_s']:.2f} s ("
                            + ", ".join(f"{k} {v:.2f}" for k, v in top) + ")")
                    if "eval_s" in load:
                        top = sorted(load["eval_phases"].items(), key=lambda kv: -kv[1])[:6]
                        line += f"; eval {load['eval_s']:.2f} s, CPU {load['eval_cpu_s']:.2f} s (" + ", ".join(
                            f"{k} {v:.2f}" for k, v in top) + ")"
                    print(line + f"; schedule: {load['target'] or 'planned at load'}", flush=True)
                results.append({"pte": path.name, "label": args.label, "loads": loads})
        finally:
            for owner, name, function in reversed(undo):
                setattr(owner, name, function)
    summary = {"meta": meta, "results": results}
    if args.out:  # merged into the file's earlier calls: a call replaces the (label, .pte) entries it measured
        from bench_results import write_run

        write_run(args.out, summary, key=lambda entry: (entry.get("label"), entry.get("pte")))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
