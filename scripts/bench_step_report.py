"""The report side of scripts/bench_step.py: the printed tables of a run's records, one row per .pte and precision
(the whole table and its plot: bench_step_table.py)."""
from __future__ import annotations

import itertools
from typing import Any

from bench_step_torch import TORCH_VARIANTS


def _mib(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:,.0f}"


def _fmt(value: float | None, spec: str) -> str:
    """format(value, spec), or "-" as wide as the spec's width."""
    if value is not None:
        return format(value, spec)
    width = "".join(itertools.takewhile(str.isdigit, spec))
    return f"{'-':>{width or 1}s}"


def _label(record: dict[str, Any]) -> str:
    return f"{record['config']} {record.get('precision', 'fp32')}"


def print_report(records: list[dict[str, Any]], top: int) -> None:
    print()
    print(f"{'config':>16s} {'vk ms':>9s} {'vk tok/s':>10s} {'torch ms':>9s} {'torch tok/s':>11s} {'torch/vk':>8s} "
          f"{'vk MiB':>8s} {'planned':>8s} {'torch MiB':>9s} {'loss rel diff':>13s}")
    for r in records:
        vk, ref = r.get("vk", {}), r.get("torch", {})
        print(f"{_label(r):>16s} {_fmt(vk.get('ms_per_step'), '9.2f')} {_fmt(vk.get('tokens_per_s'), '10,.0f')} "
              f"{_fmt(ref.get('ms_per_step'), '9.2f')} {_fmt(ref.get('tokens_per_s'), '11,.0f')} "
              f"{_fmt(r.get('torch_over_vk'), '8.2f')} {_mib(r['vk_memory']['device_buffers_bytes']):>8s} "
              f"{_mib(r['vk_memory']['planned_bytes']):>8s} {_mib(ref.get('peak_memory_bytes')):>9s} "
              f"{_fmt(r.get('max_rel_loss_diff'), '13.1e')}")
        if "torch_skipped" in r:
            print(f"{'':>16s} (no PyTorch baseline: {r['torch_skipped']})")
    if any(r.get("torch_variants") for r in records):
        names = list(TORCH_VARIANTS)
        print(f"\n{'ms/step':>16s} {'vk':>9s} " + " ".join(f"{n:>13s}" for n in names) + "   (PyTorch ms, x of vk)")
        for r in (r for r in records if r.get("torch_variants")):
            variants = r["torch_variants"]
            cells = [f"{variants[n]['ms_per_step']:7.2f} {variants[n]['over_vk']:4.2f}x"
                     if "ms_per_step" in variants.get(n, {}) else f"{'-':>13s}" for n in names]
            print(f"{_label(r):>16s} {_fmt(r.get('vk', {}).get('ms_per_step'), '9.2f')} " + " ".join(cells))
    for r in records:
        ops = r.get("vk", {}).get("top_ops")
        if not ops:
            continue
        print(f"\n{_label(r)}: top {min(top, len(ops))} op kinds by GPU time (mean per step; "
              f"GPU total {r['vk']['gpu_ms_per_step']:.2f} ms, wall {r['vk']['ms_per_step']:.2f} ms)")
        for op in ops:
            print(f"  {op['name']:48s} {op['dispatches']:5d} x {op['ms']:9.3f} ms {100 * op['share']:5.1f} %")
        gemms = r["vk"].get("top_gemms") or []
        if gemms:
            print(f"{_label(r)}: GEMMs by shape (M x N x K; TFLOP/s with their absmax and split-K passes; torch's "
                  f"fp16 matmul at the same shape where measured)")
        for gemm in gemms:
            torch_rate = gemm.get("torch_float16_tflops")
            print(f"  {gemm['name']:40s} {gemm['count']:4d} x {gemm['ms']:8.3f} ms {_fmt(gemm['tflops'], '7.1f')} TFLOP/s"
                  + (f"  torch fp16 {torch_rate:6.1f} ({100 * gemm['of_torch_fp16']:.0f} %)" if torch_rate else ""))
