"""Print a markdown table of a bench_kernels.py JSON (default configurations only), with % of the H200 targets.

    python scripts/summarize_bench.py bench/results/kernels_h200_llama-3.2-1b.json

A file of several runs (bench_results.py) gives each case's row from the newest run that timed it.
"""
from __future__ import annotations

import json
import sys

from bench_results import runs


def main(path: str) -> None:
    calls = runs(json.load(open(path)))[::-1]  # newest first
    data = calls[0]
    targets = data.get("targets", {})
    peak_gflops = 1e3 * targets.get("gemm_fp32_tflops_ref", 51.0)
    peak_gbps = 1e3 * targets.get("hbm_tbps_ref", 4.2)
    meta = data["meta"]
    print(f"{meta.get('vk_device')} (Vulkan) vs torch {meta.get('torch')} on {meta.get('torch_device_name', meta.get('torch_device'))}, "
          f"{meta.get('time_utc')}\n")
    print("| kernel | shape | Vulkan ms | GFLOP/s | GB/s | % fp32 peak | % HBM | torch ms | torch/Vulkan |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    seen = set()
    for r in (record for call in calls for record in call["results"]):
        key = (r["kernel"], json.dumps(r["shape"], sort_keys=True))
        if key in seen:  # sweep rows repeat a case with other tilings; a run's first row is its default
            continue
        seen.add(key)
        shape = " ".join(f"{k}={v}" for k, v in r["shape"].items())
        gf, gb = r.get("vk_gflops") or 0.0, r.get("vk_gbps") or 0.0
        torch_ms = r.get("torch_ms")
        ratio = r.get("torch_over_vk")
        print(f"| {r['kernel']} | {shape} | {r['vk_ms']:.4f} | {gf:,.0f} | {gb:,.0f} | {100 * gf / peak_gflops:.0f}% | "
              f"{100 * gb / peak_gbps:.0f}% | {torch_ms if torch_ms is None else f'{torch_ms:.4f}'} | "
              f"{'-' if ratio is None else f'{ratio:.2f}'} |")


if __name__ == "__main__":
    main(sys.argv[1])
