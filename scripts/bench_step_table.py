"""The whole step table of scripts/bench_step.py run: phases timed against a budget, one results file per model,
and the table (rows per model x shape: vktrain per precision, every PyTorch variant, memory) printed and plotted.

A row is derived from a model's records (oldest first, a later record of the same shape and precision
wins): `vk` {precision: ms/step}, `vk_gib` {precision: device buffers GiB}, `torch` {variant: ms/step},
`torch_peak_gib` {variant: GiB}, `compared` {vk: the fastest precision, torch: bf16_compile where measured,
else the fastest variant} and `torch_over_vk`: the compared PyTorch ms over the compared vktrain ms (> 1:
vktrain is faster). Stdlib + numpy; matplotlib optional.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from bench_results import result_name, runs, write_run
from bench_step_torch import TORCH_VARIANTS

BENCHMARK, TABLE_BENCHMARK = "step", "step_table"
REFERENCE_VARIANT = "bf16_compile"  # what the ratio compares against where it was measured
GIB = 2**30


class Clock:
    """The phases of one call (load, vk timing per precision, each PyTorch variant), timed from `started`
    (the process start: a device call's limit counts from there). Past `budget_s`, no new phase starts:
    begin() records it as skipped and returns False."""

    def __init__(self, budget_s: float | None, started: float, now: Callable[[], float] = time.monotonic):
        self.budget_s, self.started, self.now = budget_s, started, now
        self.phases: list[dict[str, Any]] = []
        self.skipped: list[dict[str, str]] = []
        self._open: dict[str, Any] | None = None

    def elapsed(self) -> float:
        return self.now() - self.started

    def _say(self, text: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')} {self.elapsed():7.1f} s] {text}", flush=True)

    def begin(self, pte: str, phase: str) -> bool:
        if self.budget_s is not None and self.elapsed() >= self.budget_s:
            self.skipped.append({"pte": pte, "phase": phase})
            self._say(f"{pte}: {phase} skipped (budget {self.budget_s:g} s spent)")
            return False
        # n: the call's phase order (at_s, rounded to 10 ms, can tie between quick phases)
        self._open = {"pte": pte, "phase": phase, "n": len(self.phases), "at_s": self.elapsed()}
        self._say(f"{pte}: {phase}")
        return True

    def end(self) -> None:
        phase, self._open = self._open, None
        phase["s"] = round(self.elapsed() - phase["at_s"], 2)
        phase["at_s"] = round(phase["at_s"], 2)
        self.phases.append(phase)
        self._say(f"{phase['pte']}: {phase['phase']} done in {phase['s']:.1f} s")

    def cut(self, why: str) -> None:
        """The phase in flight was stopped (by a signal): it is listed with the skipped ones."""
        if self._open is not None:
            phase, self._open = self._open, None
            self.skipped.append({"pte": phase["pte"], "phase": phase["phase"], "cut_at_s": round(self.elapsed(), 2)})
            self._say(f"{phase['pte']}: {phase['phase']} stopped by {why}")

    def of(self, ptes: set[str]) -> dict[str, list]:
        """The phases and skips of these .pte files (by name), for their model's results file."""
        return {"phases": [p for p in self.phases if p["pte"] in ptes],
                "skipped": [s for s in self.skipped if s["pte"] in ptes]}


def output_paths(out_dir: Path | None, machine: str | None, out: Path | None, models: list[str]
                 ) -> tuple[dict[str, Path], Path | None] | str:
    """({model: its results file}, the whole table's file or None), or why the flags cannot hold these models.
    --out-dir DIR --machine M: DIR/step_M_<model>.json each, and DIR/step_table_M.json; --out FILE: one model."""
    if out_dir is not None:
        if machine is None:
            return "--out-dir needs --machine (the files are named step_<machine>_<model>.json)"
        try:
            return ({m: out_dir / result_name(BENCHMARK, machine, m) for m in models},
                    out_dir / result_name(TABLE_BENCHMARK, machine))
        except ValueError as error:
            return f"--out-dir: {error}"
    if out is not None and len(models) > 1:
        return (f"--out {out} holds one model's records, and these .pte files are of {', '.join(models)}: "
                f"pass --out-dir DIR --machine MACHINE (one file per model)")
    return ({models[0]: out} if out is not None else {}), None


class ResultFiles:
    """Each model's results file (this call's records merged in: its shapes at its precisions replace theirs,
    the file's others stay) with its plot, and the whole table's file and plot, merged by (model, shape) into
    the table's earlier rows. Plots and rows show the call's shapes x precisions, from the merged files: where
    a budget skipped a phase, an earlier call's measurement of it stands in."""

    def __init__(self, files: dict[str, Path], table: Path | None, shapes: set[tuple[str, str]],
                 precisions: list[str], draw: bool, precision_order):
        self.files, self.table, self.shapes, self.precisions = files, table, shapes, precisions
        self.draw, self.precision_order = draw, precision_order
        self.merged: dict[str, list[dict[str, Any]]] = {}  # model -> its file's records after the last write

    def rows(self, model: str) -> list[dict[str, Any]]:
        return table_rows([r for r in self.merged[model] if (model, r["config"]) in self.shapes
                           and r.get("precision", "fp32") in self.precisions])

    def save(self, model: str, meta: dict[str, Any], records: list[dict[str, Any]], load_only: bool) -> None:
        if model not in self.files or not records:  # nothing measured: an earlier call's records stay
            return
        written = write_run(self.files[model], {"meta": meta, "results": records},
                            key=lambda r: (r["config"], r.get("precision"), r.get("rank_epilogues", False)))
        self.merged[model] = [r for call in runs(written) for r in call["results"]]
        print(f"wrote {self.files[model]}", flush=True)
        if load_only:
            return
        self._plot(self.rows(model), meta, self.files[model])
        if self.table is not None:
            rows = [row for m in self.merged for row in self.rows(m)]
            table = write_run(self.table, {"meta": {**meta, "from": [self.files[m].name for m in self.merged]},
                                           "results": rows}, key=lambda row: (row["model"], row["shape"]))
            print(f"wrote {self.table}", flush=True)
            self._plot([row for call in runs(table) for row in call["results"]], meta, self.table)

    def _plot(self, rows: list[dict[str, Any]], meta: dict[str, Any], path: Path) -> None:
        if self.draw:
            print(plot_table(rows, meta, path.with_suffix(".png"), self.precision_order), flush=True)


def table_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (model, shape) of `records` (oldest first; see the module docstring)."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for r in records:
        row = rows.setdefault((r["preset"], r["config"]), {"model": r["preset"], "shape": r["config"], "vk": {},
                                                            "vk_gib": {}, "torch": {}, "torch_peak_gib": {}})
        precision = r.get("precision", "fp32")
        if "ms_per_step" in r.get("vk", {}):
            row["vk"][precision] = r["vk"]["ms_per_step"]
            row["vk_gib"][precision] = r["vk_memory"]["device_buffers_bytes"] / GIB
        variants = r.get("torch_variants") or ({"fp32": r["torch"]} if "torch" in r else {})
        for name, result in variants.items():
            if "ms_per_step" in result:
                row["torch"][name] = result["ms_per_step"]
                if "peak_memory_bytes" in result:
                    row["torch_peak_gib"][name] = result["peak_memory_bytes"] / GIB
    for row in rows.values():
        compared = row["compared"] = {}
        if row["vk"]:
            compared["vk"] = min(row["vk"], key=row["vk"].get)
        if row["torch"]:
            compared["torch"] = REFERENCE_VARIANT if REFERENCE_VARIANT in row["torch"] else min(
                row["torch"], key=row["torch"].get)
        if len(compared) == 2:
            row["torch_over_vk"] = row["torch"][compared["torch"]] / row["vk"][compared["vk"]]
    return list(rows.values())


def _columns(rows: list[dict[str, Any]], key: str, order) -> list[str]:
    seen = {name for row in rows for name in row[key]}
    return [name for name in order if name in seen] + sorted(seen - set(order))


def print_table(rows: list[dict[str, Any]], precision_order) -> None:
    """ms/step per model x shape: vktrain per precision, each PyTorch variant; the ratio and both memories."""
    precisions, variants = _columns(rows, "vk", precision_order), _columns(rows, "torch", TORCH_VARIANTS)

    def cell(value: float | None, spec: str, width: int) -> str:
        return f"{'-' if value is None else format(value, spec):>{width}s}"

    names = [f"vk {p}" for p in precisions] + variants
    width = max([9, *map(len, names)])
    print(f"\n{'model':14s} {'shape':>7s} " + " ".join(f"{n:>{width}s}" for n in names)
          + f" {'torch/vk':>9s} {'vk GiB':>7s} {'torch GiB':>9s}   (ms/step; torch/vk: "
          f"{REFERENCE_VARIANT} or the fastest PyTorch over the fastest vktrain, > 1: vktrain faster)")
    for row in rows:
        compared = row["compared"]
        print(f"{row['model']:14s} {row['shape']:>7s} "
              + " ".join(cell(row["vk"].get(p), ".2f", width) for p in precisions) + " "
              + " ".join(cell(row["torch"].get(v), ".2f", width) for v in variants)
              + f" {cell(row.get('torch_over_vk'), '.2f', 8)}{'x' if 'torch_over_vk' in row else ' '}"
              + f" {cell(row['vk_gib'].get(compared.get('vk')), '.2f', 7)}"
              + f" {cell(row['torch_peak_gib'].get(compared.get('torch')), '.2f', 9)}")


def plot_table(rows: list[dict[str, Any]], meta: dict[str, Any], path: Path, precision_order) -> str:
    """Two panels, one above the other, of grouped bars per model x shape: ms/step (vktrain per precision,
    each PyTorch variant) and GiB (vktrain's device buffers, PyTorch's peak)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot"
    precisions, variants = _columns(rows, "vk", precision_order), _columns(rows, "torch", TORCH_VARIANTS)
    models = {row["model"] for row in rows}
    labels = [f"{row['shape']}" if len(models) == 1 else f"{row['model']}\n{row['shape']}" for row in rows]
    series = [(f"vktrain {p}", "vk", "vk_gib", p) for p in precisions]
    series += [(f"PyTorch {v}", "torch", "torch_peak_gib", v) for v in variants]
    x = np.arange(len(rows))
    width = 0.8 / max(len(series), 1)
    fig, axes = plt.subplots(2, 1, sharex=True, figsize=(max(6.0, 1.5 + 0.45 * len(rows) * len(series)), 7.5))
    for ax, (index_key, unit, fmt) in zip(axes, ((1, "ms / training step (lower is faster)", "%.0f"),
                                                 (2, "GiB (vktrain: device buffers; PyTorch: peak)", "%.1f"))):
        for index, entry in enumerate(series):
            values = [row[entry[index_key]].get(entry[3], np.nan) for row in rows]
            bars = ax.bar(x - 0.4 + width * (index + 0.5), values, width, label=entry[0])
            ax.bar_label(bars, fmt=fmt, fontsize=6)
        ax.set_xticks(x, labels, fontsize=8)
        ax.set_ylabel(unit)
    axes[0].legend(fontsize=7)
    torch_name = meta.get("torch_device_name") or meta.get("torch_device") or "no baseline"
    fig.suptitle(f"LoRA training step, {', '.join(sorted(models))} (batch x seq)\nVulkan: {meta['vk_device']}; "
                 f"PyTorch: {torch_name}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"
