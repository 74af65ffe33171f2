"""scripts/bench_step.py: the quick export + run end to end in a subprocess (lavapipe, CPU PyTorch
baseline), and the pieces the full-size run relies on but cannot exercise here: the cheaply built
benchmark model has exactly the structure of build_llama + apply_lora, the eager baseline's per-step
dequantization equals vktrain.quant's, and shapes parse or are refused by name.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from vktrain import quant

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_step.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_step", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module's annotations through sys.modules
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


# What torchao and torch print on import although nothing is wrong (vktrain/import_noise.py silences it): its
# unloadable CUDA extensions (torchao/_C_mxfp8.so, _C_cutlass...) and pytree deprecation notices.
IMPORT_NOISE_MARKS = ("Failed to load", "torchao/_C", "pytree", "LeafSpec")


def _assert_no_import_noise(result: subprocess.CompletedProcess) -> None:
    noisy = [line for line in (result.stdout + result.stderr).splitlines()
             if any(mark in line for mark in IMPORT_NOISE_MARKS)]
    assert noisy == [], noisy


def test_quick_export_and_run_end_to_end(tmp_path):
    from vktrain.serialization.pte import PteFile, Tensor
    from vktrain.runtime_shaders.build import all_shader_names

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    result = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out-dir", str(tmp_path),
                             "--torch-variants", "fp32,bf16"], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    _assert_no_import_noise(result)
    summary = json.loads((tmp_path / "step_quick.json").read_text())
    records = summary["results"]
    assert [r["config"] for r in records] == ["1x16", "2x32"]
    assert summary["meta"]["vk_device"] and summary["meta"]["torch_device"] == "cpu"
    declared = set(all_shader_names())  # what the prebuilt SPIR-V cache holds
    for record in records:
        pte = PteFile.load(record["pte"])
        assert pte.buffer.nbytes < 1 << 20
        # Nothing but the delegate's inputs outside it: no weight was left as a top-level constant.
        plan = pte.execution_plan("forward")
        assert not [v for v in plan.values if isinstance(v, Tensor) and v.is_constant]
        vk, ref = record["vk"], record["torch"]
        assert vk["ms_per_step"] > 0 and vk["tokens_per_s"] == pytest.approx(
            record["tokens_per_step"] / vk["ms_per_step"] * 1e3)
        assert record["synthetic_constant_bytes"] > 0
        # Same synthetic weights, LoRA init, batches and hyper-parameters: the losses of every step agree.
        assert len(vk["losses"]) == len(ref["losses"]) == 4
        assert record["max_rel_loss_diff"] < 1e-5
        assert abs(vk["losses"][0] - np.log(256)) < 0.5  # random weights: near-uniform predictions
        assert record["torch_over_vk"] == pytest.approx(ref["ms_per_step"] / vk["ms_per_step"])
        # Every requested PyTorch precision is timed in the same run; fp32 is the one the losses match.
        variants = record["torch_variants"]
        assert list(variants) == ["fp32", "bf16"]
        assert variants["fp32"]["ms_per_step"] == ref["ms_per_step"]
        bf16 = variants["bf16"]
        assert bf16["variant"] == "bf16" and bf16["ms_per_step"] > 0 and len(bf16["losses"]) == 4
        assert bf16["over_vk"] == pytest.approx(bf16["ms_per_step"] / vk["ms_per_step"])
        # bf16 autocast computes differently (8-bit significands), so its losses differ from fp32's but
        # stay near them: the drift is reported, not zero.
        assert 0 < bf16["max_rel_loss_diff"] < 0.1
        ops = vk["top_ops"]
        assert ops and ops == sorted(ops, key=lambda o: -o["ms"])
        assert sum(o["share"] for o in ops) <= 1 + 1e-9
        assert "aten.mm.default" in {o["name"] for o in ops}  # the LoRA / lm_head matmuls dominate tiny shapes
        # The GEMM ops' time split by shape: every entry is one of them, and together they are at most
        # what their op kinds took.
        gemms = vk["top_gemms"]
        assert gemms and gemms == sorted(gemms, key=lambda g: -g["ms"])
        kinds = ("mm", "addmm", "linear_q4gsw", "linear_q4gsw_backward", "linear_dW")
        assert {g["name"].split()[0] for g in gemms} <= set(kinds)
        tokens = record["tokens_per_step"]
        assert any(g["name"].startswith(f"mm {tokens}x") for g in gemms), gemms  # the LoRA products of every token
        gemm_kinds = sum(o["ms"] for o in ops if o["name"].split(".")[1] in kinds)
        assert sum(g["ms"] for g in gemms) <= gemm_kinds * (1 + 1e-9)
        for gemm in gemms:  # the rate is 2 M N K per GEMM of that shape, over the shape's time per step
            M, N, K = (int(v) for v in gemm["name"].split()[1].split("x"))
            assert gemm["count"] >= 1
            assert gemm["tflops"] == pytest.approx(2 * M * N * K * gemm["count"] / (gemm["ms"] * 1e-3) / 1e12)
            assert "torch_float16_tflops" not in gemm  # torch's matmul rates only beside a CUDA baseline
        memory = record["vk_memory"]
        # Device buffers hold at least the resident training state; the plan may overstate what is
        # allocated (tensors planned into memory objects can end up as views).
        assert memory["device_buffers_bytes"] >= memory["state_bytes"] > 0 and memory["planned_bytes"] > 0
        # Buffers are sub-allocated: far fewer device-memory allocations than buffers, all of them in use.
        device_memory = memory["device_memory"]
        assert 1 <= device_memory["allocations"] < memory["buffers"]
        assert device_memory["bytes_in_use"] >= memory["device_buffers_bytes"]
        assert set(record["shaders"]) <= declared, set(record["shaders"]) - declared
    assert (tmp_path / "step_quick.png").stat().st_size > 0
    # The drift script on the same program: its fp32 run starts from the same weights and batch as the
    # benchmark's, and on a device without tensor cores fp16-tc falls back to the fp32 kernels: no drift.
    drift_json = tmp_path / "drift.json"
    drift = subprocess.run([sys.executable, str(SCRIPT.parent / "bench_drift.py"), records[0]["pte"], "--steps", "3",
                            "--out", str(drift_json)], env=env, capture_output=True, text=True, timeout=600)
    assert drift.returncode == 0, drift.stdout[-3000:] + drift.stderr[-3000:]
    _assert_no_import_noise(drift)
    drift_summary = json.loads(drift_json.read_text())
    fp32_run, tc_run = drift_summary["runs"]
    assert fp32_run["precision"] == "fp32" and tc_run["precision"] == "fp16-tc" and len(tc_run["losses"]) == 3
    assert fp32_run["losses"][0] == records[0]["vk"]["losses"][0]
    if "fp32 kernels" in tc_run["gemm_route"]:
        assert tc_run["losses"] == fp32_run["losses"] and drift_summary["drift_vs_fp32"]["fp16-tc"]["max_abs"] == 0
    assert result.stdout.count("op kinds by GPU time") == 2
    assert "(PyTorch ms, x of vk)" in result.stdout


def test_bench_model_has_the_structure_of_build_llama_with_apply_lora(bench):
    from vktrain.lora import LoRAConfig, apply_lora
    from vktrain.models.llama import build_llama

    reference = build_llama("tiny-llama")
    apply_lora(reference, LoRAConfig(rank=bench.LORA_RANK, alpha=bench.LORA_ALPHA, targets=[
        f"*.{t}" for t in bench.LORA_TARGETS], group_size=bench.GROUP_SIZE, seed=0))
    fast = bench.build_bench_model("tiny-llama")

    def describe(model):
        tensors = {name: (tuple(t.shape), t.dtype, t.requires_grad)
                   for name, t in model.named_parameters(remove_duplicate=False)}
        tensors.update({name: (tuple(t.shape), t.dtype) for name, t in model.named_buffers(remove_duplicate=False)})
        modules = {name: (type(m).__name__, getattr(m, "scaling", None), getattr(m, "group_size", None))
                   for name, m in model.named_modules()}
        return tensors, modules

    assert describe(fast) == describe(reference)
    assert fast.lm_head.weight is fast.model.embed_tokens.weight  # tied like the preset
    assert torch.equal(fast.model.norm.weight, torch.ones(fast.config.dim))
    np.testing.assert_array_equal(fast.rope_cos.numpy(), reference.rope_cos.numpy())


def test_random_flat_codes_keep_padding(bench):
    rng = np.random.default_rng(0)
    flat = bench.random_flat_codes(8, 20, rng)  # Kp = 24
    codes = np.stack([flat & 0xF, flat >> 4], axis=-1).reshape(8, -1)
    assert np.all(codes[:, 20:] == quant.CODE_ZERO) and len(np.unique(codes[:, :20])) == 16


@pytest.mark.parametrize("n, k, group_size", [(16, 64, 32), (8, 20, 4)])
def test_eager_dequantization_matches_vktrain_quant(bench, n, k, group_size):
    rng = np.random.default_rng(1)
    flat, scales = quant.quantize(rng.standard_normal((n, k)).astype(np.float32), group_size)
    import bench_step_torch  # on sys.path once bench_step is loaded: the script's PyTorch half

    got = bench_step_torch.torch_dequantize(torch, torch.from_numpy(flat), torch.from_numpy(scales), group_size)
    np.testing.assert_array_equal(got.numpy(), quant.dequantize(flat, scales, group_size, k))


def test_shapes_parse_or_are_refused(bench):
    import argparse

    assert bench.parse_shapes("1x128, 4x512") == [(1, 128), (4, 512)]
    for bad in ("4*512", "0x8", "x8", "4x"):
        with pytest.raises(argparse.ArgumentTypeError, match="BATCHxSEQ"):
            bench.parse_shapes(bad)
    assert bench.op_kind("12:vktrain.adamw.default.vec4") == "vktrain.adamw.default"
    assert bench.op_kind("state_update:model.x.lora_A") == "state_update"


def test_torch_variants_parse_or_are_refused(bench):
    import argparse

    assert bench.parse_torch_variants("fp32, bf16_compile") == ["fp32", "bf16_compile"]
    assert set(bench.TORCH_VARIANTS) == {"fp32", "tf32", "bf16", "bf16_compile"}
    for bad in ("fp16", "", "fp32,bf17"):
        with pytest.raises(argparse.ArgumentTypeError, match="--torch-variants"):
            bench.parse_torch_variants(bad)


def test_smollm2_shapes_match_its_hugging_face_config(bench):
    """The derived benchmark model resolves to the LlamaConfig that from_hf_config builds from SmolLM2-135M's
    config.json values (the ones the shapes depend on)."""
    from dataclasses import replace

    from vktrain.models.llama import LlamaConfig, PRESETS

    hf = {"vocab_size": 49152, "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
          "num_key_value_heads": 3, "intermediate_size": 1536, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
          "tie_word_embeddings": True, "head_dim": 64}
    base, overrides, shapes = bench.DERIVED_MODELS["smollm2-135m"]
    derived = replace(PRESETS[base], **overrides)
    expected = LlamaConfig.from_hf_config(hf, max_seq_len=derived.max_seq_len)
    assert derived == expected
    assert shapes == ((1, 512), (4, 512))


@pytest.fixture(scope="module")
def two_models(bench, tmp_path_factory):
    """Two 1 x 16 steps of two models, exported once: tiny-llama, and a stand-in of tiny-llama's sizes under
    SmolLM2-135M's preset name (what names its results file), so one call holds two models without exporting
    a real one."""
    folder = tmp_path_factory.mktemp("two_models")
    tiny = bench.export_configs(bench.QUICK_PRESET, [(1, 16)], folder, bench.QUICK_SYNTHETIC_MIN_BYTES,
                                prefix="step_tiny", **bench.QUICK_OVERRIDES)
    stand_in = bench.export_configs("smollm2-135m", [(1, 16)], folder, bench.QUICK_SYNTHETIC_MIN_BYTES,
                                    prefix="step_stand_in", **bench.QUICK_OVERRIDES, n_heads=4, n_kv_heads=2,
                                    vocab_size=256, max_seq_len=64)
    return [Path(tiny[0]["path"]), Path(stand_in[0]["path"])]


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), "run", *map(str, args)], env=dict(os.environ,
                          PYTHONUNBUFFERED="1"), capture_output=True, text=True, timeout=600)


def test_one_call_times_every_model_and_precision_with_pytorch_once_per_shape(bench, two_models, tmp_path):
    import bench_results

    def name(benchmark, model=None, suffix=".json"):
        return bench_results.result_name(benchmark, "lavapipe", model, suffix)

    # An earlier call's record of a shape and precision this call does not time: kept in the model's file,
    # left out of the table of this call's shapes x precisions.
    out = tmp_path / "results"
    earlier = {"meta": {}, "results": [{"config": "2x8", "precision": "fp16", "preset": "tiny-llama", "vk": {
        "ms_per_step": 1.0}, "vk_memory": {"device_buffers_bytes": 1}}]}
    out.mkdir()
    (out / name("step", "tiny-llama")).write_text(json.dumps(earlier))
    result = _run(*two_models, "--precisions", "fp16-tc,fp32", "--torch-variants", "fp32", "--steps", "2",
                  "--warmup", "1", "--out-dir", out, "--machine", "lavapipe")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert json.loads((out / name("step", "tiny-llama")).read_text())["runs"][0] == earlier
    # A file per model (and its plot), and the whole table's, all named by bench/results' rule.
    assert sorted(p.name for p in out.iterdir()) == sorted(
        name(benchmark, model, suffix) for benchmark, model in (("step", "tiny-llama"), ("step", "smollm2-135m"),
                                                               ("step_table", None)) for suffix in (".json", ".png"))
    rows = json.loads((out / name("step_table")).read_text())["results"]
    assert [(row["model"], row["shape"]) for row in rows] == [("tiny-llama", "1x16"), ("smollm2-135m", "1x16")]
    for path, model, row in zip(two_models, ("tiny-llama", "smollm2-135m"), rows):
        summary = bench_results.runs(json.loads((out / name("step", model)).read_text()))[-1]
        tc, fp32 = records = summary["results"]
        assert [(r["pte"], r["preset"], r["config"], r["precision"]) for r in records] == [
            (str(path), model, "1x16", "fp16-tc"), (str(path), model, "1x16", "fp32")]
        for record in records:
            assert f"GEMM precision {record['precision']}" in record["gemm_route"] and record["vk"]["ms_per_step"] > 0
        # PyTorch ran once for the shape, in the first precision's record; its fp32 losses are compared with
        # vktrain's fp32 ones (same weights and batches: they agree).
        assert list(tc["torch_variants"]) == ["fp32"] and "torch_variants" not in fp32
        assert fp32["torch_baseline_in"] == "fp16-tc" and tc["torch_losses_against"] == "vk fp32"
        torch_losses = tc["torch"]["losses"]
        assert tc["max_rel_loss_diff"] == max(abs(a - b) / abs(b) for a, b in zip(fp32["vk"]["losses"], torch_losses))
        assert tc["max_rel_loss_diff"] < 1e-5
        assert [(p["phase"]) for p in summary["meta"]["phases"]] == [
            "load fp16-tc", "vk fp16-tc", "PyTorch weights", "load fp32", "vk fp32", "PyTorch fp32"]
        assert {p["pte"] for p in summary["meta"]["phases"]} == {path.name}  # its own model's phases only
        assert summary["meta"]["skipped"] == [] and summary["meta"]["precisions"] == ["fp16-tc", "fp32"]
        # The table's row is what the records hold.
        assert row["vk"] == {"fp16-tc": tc["vk"]["ms_per_step"], "fp32": fp32["vk"]["ms_per_step"]}
        assert row["torch"] == {"fp32": tc["torch"]["ms_per_step"]}
        assert row["vk_gib"]["fp32"] == fp32["vk_memory"]["device_buffers_bytes"] / 2**30
        assert row["torch_over_vk"] == pytest.approx(tc["torch"]["ms_per_step"] / min(row["vk"].values()))
    assert result.stdout.count("PyTorch fp32 done") == 2  # once per .pte, not once per precision
    assert result.stdout.count(": load ") == 2 * 2 * 2  # each precision of each .pte: started, done
    table = result.stdout[result.stdout.index("vk fp16-tc"):]
    assert "tiny-llama" in table and "smollm2-135m" in table and "elapsed" in result.stdout


def test_a_spent_budget_skips_every_phase_and_says_so(two_models, tmp_path):
    out = tmp_path / "results"
    result = _run(*two_models, "--precisions", "fp16-tc,fp32", "--torch-variants", "fp32", "--budget-s", "0",
                  "--out-dir", out, "--machine", "lavapipe")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    skipped = [line.split("] ", 1)[1] for line in result.stdout.splitlines() if "skipped (budget 0 s spent)" in line]
    assert skipped == [f"{path.name}: load {p} skipped (budget 0 s spent)" for path in two_models
                       for p in ("fp16-tc", "fp32")]
    assert "not run (4 phases; budget 0 s)" in result.stdout and "elapsed" in result.stdout
    assert not out.exists()  # nothing measured: no file replaces an earlier call's


def test_the_clock_starts_no_phase_past_the_budget(bench):
    now = [1.0]
    clock = bench.Clock(10.0, 0.0, now=lambda: now[0])
    assert clock.begin("a.pte", "load fp32")
    now[0] = 4.0
    clock.end()
    now[0] = 9.0
    assert clock.begin("b.pte", "vk fp32")  # starts before the budget runs out, ends after
    now[0] = 12.0
    clock.end()
    assert not clock.begin("b.pte", "PyTorch bf16")
    assert clock.phases == [{"pte": "a.pte", "phase": "load fp32", "n": 0, "at_s": 1.0, "s": 3.0},
                            {"pte": "b.pte", "phase": "vk fp32", "n": 1, "at_s": 9.0, "s": 3.0}]
    assert clock.of({"b.pte"}) == {"phases": clock.phases[1:], "skipped": [{"pte": "b.pte", "phase": "PyTorch bf16"}]}
    assert bench.Clock(None, 0.0, now=lambda: 1e9).begin("c.pte", "load fp32")  # no budget: never skips


def test_outputs_are_one_file_per_model_or_refused_by_flag(bench, tmp_path):
    import bench_results
    import bench_step_table

    files, table = bench_step_table.output_paths(tmp_path, "h100", None, ["llama-3.2-1b", "smollm2-135m"])
    assert {model: path.name for model, path in files.items()} == {
        "llama-3.2-1b": "step_h100_llama-3.2-1b.json", "smollm2-135m": "step_h100_smollm2-135m.json"}
    assert table == tmp_path / bench_results.result_name("step_table", "h100")  # the whole table: no model
    assert bench_step_table.output_paths(None, None, tmp_path / "x.json", ["tiny-llama"]) == (
        {"tiny-llama": tmp_path / "x.json"}, None)
    assert "--out-dir DIR --machine" in bench_step_table.output_paths(None, None, tmp_path / "x.json",
                                                                      ["tiny-llama", "smollm2-135m"])
    assert "needs --machine" in bench_step_table.output_paths(tmp_path, None, None, ["tiny-llama"])
    assert "model one of" in bench_step_table.output_paths(tmp_path, "h100", None, ["qwen"])


def test_precisions_parse_or_are_refused(bench, two_models, capsys):
    import argparse

    assert bench.parse_precisions("fp16-tc, fp32") == ["fp16-tc", "fp32"]
    for bad in ("fp8", "", "fp32,fp32"):
        with pytest.raises(argparse.ArgumentTypeError, match="--precisions"):
            bench.parse_precisions(bad)
    for flags, message in ((["--precision", "fp32", "--precisions", "fp16-tc"], "--precision or --precisions"),
                           (["--out", "x.json", "--out-dir", "y"], "not both")):
        with pytest.raises(SystemExit) as exit_info:
            bench.main(["run", str(two_models[0]), *flags])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_compiled_pytorch_variants_run_after_every_pte(bench, two_models, tmp_path, monkeypatch):
    """torch.compile's cold compilation takes minutes a shape on the GPU machine: the compiled variants wait until
    every .pte's other phases are done, so a budget cuts them first. (bf16 stands in for a compiled variant
    here: compiling on the CPU takes too long for a test; only the ordering reads the flag.)"""
    monkeypatch.setattr(bench, "TORCH_VARIANTS", {**bench.TORCH_VARIANTS, "bf16": (False, True, True)})
    assert bench.main(["run", *map(str, two_models), "--torch-variants", "fp32,bf16", "--steps", "1", "--warmup",
                       "0", "--out-dir", str(tmp_path), "--machine", "lavapipe", "--no-plot"]) == 0
    files = [f for f in tmp_path.glob("*.json") if not f.name.startswith("step_table")]
    phases = sorted((p for f in files for p in json.loads(f.read_text())["meta"]["phases"]), key=lambda p: p["n"])
    assert [(p["pte"], p["phase"]) for p in phases] == [
        *((path.name, phase) for path in two_models for phase in ("load fp32", "vk fp32", "PyTorch weights",
                                                                  "PyTorch fp32")),
        *((path.name, "PyTorch bf16") for path in two_models)]
    assert len(files) == 2
    for f in files:
        assert list(json.loads(f.read_text())["results"][0]["torch_variants"]) == ["fp32", "bf16"]


def test_sigterm_keeps_what_finished_and_prints_the_table(two_models, tmp_path):
    """A device call's time limit ends the run with SIGTERM: the records finished so far are written (the
    phase in flight is not), the table is printed, and the exit code is 143."""
    import signal

    out = tmp_path / "results"
    process = subprocess.Popen([sys.executable, str(SCRIPT), "run", *map(str, two_models), "--precisions",
                                "fp16-tc,fp32", "--torch-variants", "fp32", "--steps", "100", "--warmup", "0",
                                "--out-dir", str(out), "--machine", "lavapipe", "--no-plot"],
                               env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    seen = []
    for line in process.stdout:
        seen.append(line)
        if line.rstrip().endswith(f"{two_models[0].name}: vk fp32"):  # fp16-tc's timing is done
            process.send_signal(signal.SIGTERM)
            break
    rest, _ = process.communicate(timeout=300)
    stdout = "".join(seen) + rest
    assert process.returncode == 143, stdout[-3000:]
    summary = json.loads(next(out.glob("*tiny-llama.json")).read_text())
    precisions = [r["precision"] for r in summary["results"]]
    assert precisions[0] == "fp16-tc" and all("ms_per_step" in r["vk"] for r in summary["results"])
    cut = [s for s in summary["meta"]["skipped"] if "cut_at_s" in s]
    if "stopped by SIGTERM" in stdout:  # the signal landed in a phase (else between two)
        assert len(cut) == 1 and cut[0]["pte"] == two_models[0].name
    assert "vk fp16-tc" in stdout[stdout.rindex("model "):] and "elapsed" in stdout
    assert not list(out.glob("*smollm2-135m*"))  # the second .pte never started


def test_each_shape_is_compiled_for_itself(bench, two_models):
    """In one call torch.compile meets several shapes of the same loss code; each is compiled static, as in a
    process of its own (dynamo would otherwise mark the second shape's sizes dynamic). Recorded through a
    backend that keeps the graph inputs' sizes, on the CPU."""
    import re
    from dataclasses import replace

    import bench_step_torch
    from vktrain.backend.kernel_planning import plan_schedule
    from vktrain.runtime.program.runner import TrainingRunner

    sizes = []

    def recording_backend(gm, example_inputs):
        values = [node.meta["example_value"] for node in gm.graph.nodes if node.op == "placeholder"]
        sizes.append([str(getattr(value, "shape", value)) for value in values])  # a tensor's sizes, or a SymInt
        return gm.forward

    class RecordingTorch:  # torch, with torch.compile going through recording_backend
        def __getattr__(self, name):
            return getattr(torch, name)

        def compile(self, fn):
            return torch.compile(fn, backend=recording_backend)

    with TrainingRunner.from_pte(two_models[0], planner=plan_schedule) as runner:
        config = bench.read_config(two_models[0])
        arrays = bench.baseline_arrays(runner.graph, runner.executor, config)
        vocab = runner.vocab_size
    for shape in (config, replace(config, batch=2, seq=8)):
        bench_step_torch.time_torch(RecordingTorch(), torch.device("cpu"), shape, arrays,
                                    [bench.make_batch(shape, vocab, 0)], 0, 1, "bf16_compile", hparams=bench.HPARAMS)
    assert any("[1, 16]" in size for size in sizes[0]) and any("[2, 8]" in size for size in sizes[-1])
    assert not [size for graph in sizes for size in graph if re.search(r"\bs\d+", size)]  # no symbolic size
