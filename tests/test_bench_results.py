"""bench/results keeps one current file per (benchmark, machine, model), named by scripts/bench_results.py's
rule, and every file the docs, scripts, code and tests name there exists (history: `git show COMMIT:PATH`)."""
from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_results", REPO / "scripts" / "bench_results.py")
bench_results = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_results)
RESULTS = bench_results.RESULTS_DIR

TEXT_SUFFIXES = {".md", ".py", ".sh", ".txt", ".toml", ".yml", ".yaml", ".cfg", ".cpp", ".h", ".hpp", ".c",
                 ".glsl", ".comp", ".wgsl", ".slang", ".cmake"}
SKIPPED_DIRS = {"__pycache__", "node_modules", "build", "dist"}
# An earlier measurement cited as `git show 1a2b3c4:bench/results/NAME` lives in git, not in the tree.
GIT_CITATION = re.compile(r"\b[0-9a-f]{7,40}:bench/results/\S+")
RESULTS_PATH = re.compile(r"bench/results/([^\s`'\")\];:]+?\.(?:json|png))(?![\w-])")
# bench/README.md names its files relative to bench/ ("results/NAME.json").
RELATIVE_PATH = re.compile(r"(?<![\w/.-])results/([^\s`'\")\];:]+?\.(?:json|png))(?![\w-])")
# A bare name that looks like a results file: <something>_<machine>[...].json|png.
BARE_NAME = re.compile(r"(?<![\w/.-])([a-z0-9_.-]*_(?:{})(?:[_.][A-Za-z0-9_.*-]*)?\.(?:json|png))(?![\w-])".format(
    "|".join(bench_results.MACHINES)))


def _text_files():
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in SKIPPED_DIRS
                   and Path(root, d) != RESULTS]
        for name in files:
            path = Path(root, name)
            if path.suffix in TEXT_SUFFIXES and path != Path(__file__).resolve():
                yield path


def _references(path: Path, text: str) -> set[str]:
    text = GIT_CITATION.sub("", text)
    names = set(RESULTS_PATH.findall(text)) | set(BARE_NAME.findall(text))
    if path == REPO / "bench" / "README.md":
        names |= set(RELATIVE_PATH.findall(text))
    return {name for name in names if "<" not in name}  # `<model>`: a pattern (the rule, a script's default)


def test_every_results_file_is_named_by_the_rule():
    files = sorted(p.name for p in RESULTS.iterdir())
    assert files, "bench/results is empty"
    bad = [name for name in files if not bench_results.is_result_name(name)]
    assert not bad, (f"bench/results names outside {bench_results.NAME_RULE} (a shape, precision or version "
                     f"goes inside the file; earlier runs live in git): {bad}")
    plots_alone = [name for name in files if name.endswith(".png") and name[:-4] + ".json" not in files]
    assert not plots_alone, f"plots without their JSON: {plots_alone}"
    for name in files:
        if name.endswith(".json"):
            data = json.loads((RESULTS / name).read_text())
            assert bench_results.runs(data), name


def test_every_referenced_results_file_exists():
    missing = []
    for path in _text_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for name in sorted(_references(path, text)):
            if not (RESULTS / name).is_file():
                missing.append(f"{path.relative_to(REPO)}: {name}")
    assert not missing, ("references to bench/results files that do not exist (cite an earlier run as "
                         "`git show COMMIT:bench/results/NAME`):\n" + "\n".join(missing))


def test_the_reference_scan_sees_the_forms_docs_use(tmp_path):
    """The scan above must catch what it guards against, or it passes by seeing nothing."""
    readme = REPO / "bench" / "README.md"
    text = ("`results/step_h200_x.json`, bench/results/kernels_h200_sweep.json, step_h200_speed_1x128_torch.json "
            "and bench/results/webgpu_h200_{1x128,4x512}.json, step_h200_*_mm_v1.json, "
            "bench/results/drift_h200.json. Not git show 9b36390:bench/results/step_h200_speed_final.json")
    assert _references(readme, text) == {"step_h200_x.json", "kernels_h200_sweep.json",
                                         "step_h200_speed_1x128_torch.json", "webgpu_h200_{1x128,4x512}.json",
                                         "step_h200_*_mm_v1.json", "drift_h200.json"}
    assert _references(tmp_path / "x.md", "a/results/out.json, --out cpu.json, kernels_<machine>.json.") == set()


@pytest.mark.parametrize("name", ["step_h200_fp16tc_s5.json", "step_h200_speed_1x128_before.json",
                                  "coopmat_h200_v1.json", "step_h200_fp16tc_final.png", "step_h200_1x128.json",
                                  "kernels_lavapipe_smollm2.json", "export_smollm2_cpu.json", "step_h300.json",
                                  "step_h200.json", "federate_h200.json", "coopmat_h200_llama-3.2-1b.json"])
def test_versions_shapes_unknown_words_and_models_where_none_belongs_are_outside_the_rule(name):
    assert not bench_results.is_result_name(name)
    assert "bench/README.md" in bench_results.out_error(RESULTS / name)


def test_the_rule_names_a_benchmark_machine_and_model():
    assert bench_results.result_name("step", "h200", "llama-3.2-1b") == "step_h200_llama-3.2-1b.json"
    assert bench_results.result_name("coopmat_attention", "h200") == "coopmat_attention_h200.json"
    # The whole step table of both models (bench_step.py run --out-dir) takes no model.
    assert bench_results.result_name("step_table", "h100", suffix=".png") == "step_table_h100.png"
    assert not bench_results.is_result_name("step_table_h100_llama-3.2-1b.json")
    assert bench_results.out_error(RESULTS / "step_h200_smollm2-135m.json") is None
    assert bench_results.out_error(Path("/tmp/step_h200_fp16tc_s5.json")) is None  # outside bench/results
    for args in (("step", "h200", "llama-3.2-1b-fp16tc"), ("step", "h200"), ("coopmat", "h200", "llama-3.2-1b")):
        with pytest.raises(ValueError, match="benchmark one of"):
            bench_results.result_name(*args)
    assert bench_results.model_of("/x/SmolLM2-135M-Instruct.Q4_1.gguf") == "smollm2-135m-instruct"
    assert bench_results.model_of("/x/other.gguf") is None


def test_a_new_call_replaces_its_shapes_and_keeps_the_others(tmp_path):
    path = tmp_path / "step_h200_llama-3.2-1b.json"
    key = lambda r: r["config"]  # noqa: E731

    def call(t, *shapes):
        return {"meta": {"time_utc": t}, "results": [{"config": s, "t": t} for s in shapes]}

    assert bench_results.write_run(path, call("1", "1x128", "4x512"), key) == call("1", "1x128", "4x512")
    bench_results.write_run(path, call("2", "4x512"), key)
    assert json.loads(path.read_text()) == {"runs": [call("1", "1x128"), call("2", "4x512")]}
    bench_results.write_run(path, call("3", "1x128"), key)
    assert json.loads(path.read_text()) == {"runs": [call("2", "4x512"), call("3", "1x128")]}
    bench_results.write_run(path, call("4", "4x512", "1x128"), key)
    assert json.loads(path.read_text()) == call("4", "4x512", "1x128")  # one call again: unwrapped
    assert bench_results.write_run(path, call("5", "2x64"), None) == call("5", "2x64")  # no key: replaced
    assert not list(tmp_path.glob("*.tmp"))


def test_calls_without_records_merge_by_their_own_key(tmp_path):
    path = tmp_path / "federate_h200_smollm2-135m.json"
    key = lambda r: r["engine"]  # noqa: E731
    for engine, seconds in (("ray", 1.0), ("sequential", 2.0), ("ray", 3.0)):
        bench_results.write_run(path, {"engine": engine, "s": seconds}, key)
    assert bench_results.runs(json.loads(path.read_text())) == [{"engine": "sequential", "s": 2.0},
                                                                {"engine": "ray", "s": 3.0}]
    # A file of one call that keeps its own "runs" beside "meta" (bench_drift.py) is that one call.
    drift = {"meta": {}, "runs": [{"precision": "fp32"}]}
    assert bench_results.runs(drift) == [drift]
