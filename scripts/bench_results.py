"""bench/results: one current file per (benchmark, machine, model); earlier measurements live in git.

A results file is named `<benchmark>_<machine>[_<model>].json` (its plot, where the script draws one:
the same name with .png): the benchmark is the script that writes it (BENCHMARKS), the machine one of
MACHINES, the model (exactly where the script takes one) one of MODELS, the names `--model` takes. A shape,
precision, tiling, engine or setting goes inside the file, never into its name. A file holds one call's
JSON, or {"runs": [call, ...]} where several calls stand together (one call per shape, say); `write_run`
writes a new call in, replacing what earlier calls measured of the same entries and keeping the rest.
Stdlib only: the GPU machine runs these scripts without the package's dependencies.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable, Hashable

RESULTS_DIR = Path(__file__).resolve().parents[1] / "bench" / "results"
# benchmark -> (the script that writes it, whether its name carries a model: the script takes one)
BENCHMARKS = {
    "attention_kernels": ("bench_attention_kernels.py", False),
    "coopmat": ("bench_coopmat.py", False), "coopmat_attention": ("bench_coopmat_attention.py", False),
    "coopmat_attention_check": ("check_coopmat_attention_kernels.py", False),
    "coopmat_gemm_check": ("check_slang_coop_kernels.py", False), "matmul_check": ("check_slang_gemm_kernels.py", False),
    "step_gemms": ("bench_step_gemms.py", False), "coopmat2_probe": ("probe_coopmat2.py run", False),
    "coopmat_a16_probe": ("by hand: bench/README.md", False), "lora_gemms": ("bench_lora_gemms.py", False),
    "pipeline_stats": ("probe_pipeline_stats.cc: by hand, bench/README.md", False),
    "stage_chunk_probe": ("by hand: bench/README.md", False), "rank_epilogue": ("bench_rank_epilogue.py", False),
    "drift": ("bench_drift.py", True), "export": ("bench_export.py", True),
    "features": ("bench_features.py run", True),
    "federate": ("bench_federate.py run", True), "load": ("bench_load.py", True),
    "fleet_scale": ("bench_fleet_scale.py run", True), "long_context": ("bench_long_context.py export|run", True),
    "kernels": ("bench_kernels.py [--smollm2]", True), "native": ("bench_native.py run", True),
    "packing": ("bench_packing.py run", True), "phone_profiles": ("bench_phone_profiles.py run", True),
    "q8_0_embedding": ("by hand: bench/README.md", True), "gpu_parity": ("by hand: bench/README.md", True), "quant_quality": ("quant_quality.py", True),
    "recipe": ("bench_recipe.py score", True),
    "step": ("bench_step.py run", True), "step_table": ("bench_step.py run --out-dir", False), "train": ("bench_train.py run", True),
    "webgpu": ("bench_webgpu.py run", True),
}
MACHINES = ("h200", "h100", "lavapipe", "cpu")
MODELS = ("llama-3.2-1b", "smollm2-135m", "smollm2-135m-instruct", "tiny-llama")
SUFFIXES = (".json", ".png")
NAME_RULE = "<benchmark>_<machine>[_<model>].json"


PER_MODEL = sorted(b for b, (_, per_model) in BENCHMARKS.items() if per_model)


def _words(words) -> str:
    return "|".join(map(re.escape, sorted(words, key=len, reverse=True)))


_NAME = re.compile(r"(?:(?:{})_(?:{})_(?:{})|(?:{})_(?:{}))(?:{})".format(
    _words(PER_MODEL), _words(MACHINES), _words(MODELS), _words(set(BENCHMARKS) - set(PER_MODEL)),
    _words(MACHINES), _words(SUFFIXES)))
_WORDS = (f"benchmark one of {sorted(BENCHMARKS)}, machine one of {list(MACHINES)}, model one of {list(MODELS)}, "
          f"given exactly for {PER_MODEL}")


def result_name(benchmark: str, machine: str, model: str | None = None, suffix: str = ".json") -> str:
    """The file name of one (benchmark, machine, model)'s current results."""
    name = f"{benchmark}_{machine}{f'_{model}' if model else ''}{suffix}"
    if not is_result_name(name):
        raise ValueError(f"{name!r} is not {NAME_RULE}: {_WORDS}")
    return name


def is_result_name(name: str) -> bool:
    return _NAME.fullmatch(name) is not None


def model_of(path: Path | str) -> str | None:
    """MODELS' word for a checkpoint file or folder ('SmolLM2-135M-Instruct.Q4_1.gguf': smollm2-135m-instruct)."""
    word = Path(path).name.split(".")[0].lower()
    return word if word in MODELS else None


def default_out(benchmark: str, machine: str, model_path: Path | str) -> Path | None:
    """bench/results' file for a script's default --out, or None where the model has no word in MODELS."""
    model = model_of(model_path)
    return RESULTS_DIR / result_name(benchmark, machine, model) if model else None


def out_error(path: Path | None) -> str | None:
    """Why `--out path` may not be written (a name in bench/results/ outside the rule), or None."""
    if path is None or path.resolve().parent != RESULTS_DIR.resolve() or is_result_name(path.name):
        return None
    return (f"--out {path}: files in bench/results/ are named {NAME_RULE} ({_WORDS}; a shape, precision "
            "or setting goes inside the file; bench/README.md)")


def runs(data: dict[str, Any]) -> list[dict[str, Any]]:
    """A results file's calls, oldest first: its "runs", or the file itself where it holds one call."""
    return data["runs"] if isinstance(data.get("runs"), list) and "meta" not in data else [data]


def _entries(run: dict[str, Any]) -> list[dict[str, Any]]:
    return run["results"] if isinstance(run.get("results"), list) else [run]


def merge_run(old: dict[str, Any] | None, run: dict[str, Any], key: Callable[[dict[str, Any]], Hashable]
              ) -> dict[str, Any]:
    """`old` with `run` appended: an earlier call's entries (its "results" records, or the call itself where
    it has none) whose key a new entry has go; a call left without entries goes; one call stays unwrapped."""
    new_keys = {key(entry) for entry in _entries(run)}
    kept = []
    for earlier in runs(old) if old is not None else []:
        if isinstance(earlier.get("results"), list):
            rest = [entry for entry in earlier["results"] if key(entry) not in new_keys]
            if rest:
                kept.append({**earlier, "results": rest})
        elif key(earlier) not in new_keys:
            kept.append(earlier)
    merged = [*kept, run]
    return merged[0] if len(merged) == 1 else {"runs": merged}


def write_run(path: Path, run: dict[str, Any], key: Callable[[dict[str, Any]], Hashable] | None = None
              ) -> dict[str, Any]:
    """Write `run` to path (atomically), merged into the file's earlier calls by `key` (None: replace the
    file). Returns what was written."""
    merged = run
    if key is not None and path.exists():
        try:
            old = json.loads(path.read_text())
        except ValueError as error:
            raise SystemExit(f"{path}: not JSON ({error}); move it away or pass another --out") from error
        merged = merge_run(old, run, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_name(path.name + ".tmp")
    staged.write_text(json.dumps(merged, indent=1, default=str) + "\n")
    staged.replace(path)
    return merged
