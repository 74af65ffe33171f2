"""scripts/bench_webgpu.py --quick end to end in a subprocess: tiny-llama steps exported, timed on the
Vulkan runtime and through WebGPU (both on lavapipe here), the report saying where the time goes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_webgpu.py"


def test_quick_run_times_both_runtimes_on_the_same_programs(tmp_path):
    pytest.importorskip("wgpu", reason="the WebGPU runtime needs wgpu")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    result = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out-dir", str(tmp_path)], env=env,
                            capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((tmp_path / "webgpu_quick.json").read_text())
    assert summary["meta"]["vulkan_device"] and summary["meta"]["webgpu_device"]
    records = summary["results"]
    assert len(records) == 2
    for record in records:
        if "error" in record["webgpu"]:
            pytest.skip(f"WebGPU could not run {record['pte']}: {record['webgpu']['error'][:300]}")
        vulkan, webgpu, comparison = record["vulkan"], record["webgpu"], record["comparison"]
        for run in (vulkan, webgpu):
            assert run["ms_per_step"] > 0 and run["replay_ms"] > 0 and run["load_s"] > 0
            assert run["tokens_per_s"] == pytest.approx(run["tokens_per_step"] / run["ms_per_step"] * 1e3)
            assert len(run["losses"]) == 4 and all(np.isfinite(run["losses"]))
        assert vulkan["encode_ms"] is None and webgpu["encode_ms"] > 0  # WebGPU re-encodes every step
        assert "gpu tuning" in webgpu["gemm_route"]
        # The same synthetic weights, batches and hyper-parameters on both runtimes: the same losses.
        assert comparison["max_rel_loss_diff"] < 1e-5
        assert comparison["webgpu_over_vulkan"] == pytest.approx(webgpu["ms_per_step"] / vulkan["ms_per_step"])
        shaders = [row["shader"] for row in comparison["by_shader"]]
        assert shaders and set(shaders) <= set(vulkan["last_step_ms_by_shader"]) | set(webgpu["last_step_ms_by_shader"])
