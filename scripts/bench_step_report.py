"""The report side of scripts/bench_step.py: the printed tables and the plot of a run's records."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from bench_step_torch import TORCH_VARIANTS


def _mib(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:,.0f}"


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_report(records: list[dict[str, Any]], top: int) -> None:
    print()
    print(f"{'config':>8s} {'vk ms':>9s} {'vk tok/s':>10s} {'torch ms':>9s} {'torch tok/s':>11s} {'torch/vk':>8s} "
          f"{'vk MiB':>8s} {'planned':>8s} {'torch MiB':>9s} {'loss rel diff':>13s}")
    for r in records:
        vk, ref = r.get("vk", {}), r.get("torch", {})
        print(f"{r['config']:>8s} {_fmt(vk.get('ms_per_step'), '9.2f')} {_fmt(vk.get('tokens_per_s'), '10,.0f')} "
              f"{_fmt(ref.get('ms_per_step'), '9.2f')} {_fmt(ref.get('tokens_per_s'), '11,.0f')} "
              f"{_fmt(r.get('torch_over_vk'), '8.2f')} {_mib(r['vk_memory']['device_buffers_bytes']):>8s} "
              f"{_mib(r['vk_memory']['planned_bytes']):>8s} {_mib(ref.get('peak_memory_bytes')):>9s} "
              f"{_fmt(r.get('max_rel_loss_diff'), '13.1e')}")
        if "torch_skipped" in r:
            print(f"{'':>8s} (no PyTorch baseline: {r['torch_skipped']})")
    if any(r.get("torch_variants") for r in records):
        names = list(TORCH_VARIANTS)
        print(f"\n{'ms/step':>8s} {'vk':>9s} " + " ".join(f"{n:>13s}" for n in names) + "   (PyTorch ms, x of vk)")
        for r in records:
            variants = r.get("torch_variants", {})
            cells = [f"{variants[n]['ms_per_step']:7.2f} {variants[n]['over_vk']:4.2f}x"
                     if "ms_per_step" in variants.get(n, {}) else f"{'-':>13s}" for n in names]
            print(f"{r['config']:>8s} {_fmt(r.get('vk', {}).get('ms_per_step'), '9.2f')} " + " ".join(cells))
    for r in records:
        ops = r.get("vk", {}).get("top_ops")
        if not ops:
            continue
        print(f"\n{r['config']}: top {min(top, len(ops))} op kinds by GPU time (mean per step; "
              f"GPU total {r['vk']['gpu_ms_per_step']:.2f} ms, wall {r['vk']['ms_per_step']:.2f} ms)")
        for op in ops:
            print(f"  {op['name']:48s} {op['dispatches']:5d} x {op['ms']:9.3f} ms {100 * op['share']:5.1f} %")
        gemms = r["vk"].get("top_gemms") or []
        if gemms:
            print(f"{r['config']}: GEMMs by shape (M x N x K; TFLOP/s with their absmax and split-K passes; torch's "
                  f"fp16 matmul at the same shape where measured)")
        for gemm in gemms:
            torch_rate = gemm.get("torch_float16_tflops")
            print(f"  {gemm['name']:40s} {gemm['count']:4d} x {gemm['ms']:8.3f} ms {_fmt(gemm['tflops'], '7.1f')} TFLOP/s"
                  + (f"  torch fp16 {torch_rate:6.1f} ({100 * gemm['of_torch_fp16']:.0f} %)" if torch_rate else ""))


def plot(records: list[dict[str, Any]], meta: dict[str, Any], path: Path) -> str:
    """Grouped bars per batch x seq: vktrain, then every PyTorch variant measured in the same run."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot"
    labels = [r["config"] for r in records]
    measured = [n for n in TORCH_VARIANTS if any("ms_per_step" in r.get("torch_variants", {}).get(n, {}) for r in records)]
    series = [(f"vktrain ({records[0].get('precision', 'fp32')})", [r.get("vk", {}).get("ms_per_step", np.nan) for r in records])]
    if measured:
        series += [(f"PyTorch {name}", [r.get("torch_variants", {}).get(name, {}).get("ms_per_step", np.nan)
                                        for r in records]) for name in measured]
    else:
        series.append(("PyTorch eager", [r.get("torch", {}).get("ms_per_step", np.nan) for r in records]))
    x = np.arange(len(labels))
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(2.4 + 1.2 * len(labels) * len(series) / 2, 3.8))
    for index, (name, values) in enumerate(series):
        bars = ax.bar(x - 0.4 + width * (index + 0.5), values, width, label=name)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(x, [f"{label}\n(batch x seq)" for label in labels])
    ax.set_ylabel("ms / training step (lower is faster)")
    torch_name = meta.get("torch_device_name") or meta.get("torch_device") or "no baseline"
    ax.set_title(f"LoRA training step, {records[0]['preset']}\nVulkan: {meta['vk_device']}; PyTorch: {torch_name}",
                 fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"
