"""Loss-curve plot of a training run (matplotlib, headless). Written atomically like every output."""
from __future__ import annotations

import io
from pathlib import Path
from typing import Sequence

from vktrain.train.checkpoint import atomic_write_bytes


def loss_series(records: Sequence[dict]) -> dict[str, tuple[list, list]]:
    """The curves plot_losses draws, as (steps, values): the training loss and lr of the steps that
    trained, the held-out loss wherever it was measured (a {"step": 0, "eval_loss"} record: before training)."""
    trained = [r for r in records if "loss" in r]
    evaluated = [r for r in records if "eval_loss" in r]
    return {"training loss": ([r["step"] for r in trained], [r["loss"] for r in trained]),
            "lr": ([r["step"] for r in trained], [r["lr"] for r in trained]),
            "held-out loss": ([r["step"] for r in evaluated], [r["eval_loss"] for r in evaluated])}


def plot_losses(records: Sequence[dict], path: str | Path, title: str = "") -> None:
    """records: [{"step", "loss", "lr"[, "eval_loss"]}, ...] (and records of a held-out loss alone) -> a PNG
    with the loss and the held-out loss where it was measured (left axis) and the LR (right axis)."""
    series = loss_series(records)
    steps = series["training loss"][0]
    if not steps:
        raise ValueError("no training records to plot")
    try:
        import matplotlib
    except ImportError as e:  # a dependency of vktrain; only a stripped device install lacks it
        raise RuntimeError("--plot needs matplotlib (pip install matplotlib)") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(*series["training loss"], color="tab:blue", label="training loss")
    if series["held-out loss"][0]:
        ax.plot(*series["held-out loss"], "o--", color="tab:red", label="held-out loss")
        ax.legend(loc="upper right")
    ax.set_xlabel("step")
    ax.set_ylabel("loss", color="tab:blue")
    ax.grid(alpha=0.3)
    lr_axis = ax.twinx()
    lr_axis.plot(*series["lr"], color="tab:orange", alpha=0.6, label="lr")
    lr_axis.set_ylabel("learning rate", color="tab:orange")
    ax.set_title(title or f"vktrain: steps {steps[0]}..{steps[-1]}")
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png")
    plt.close(fig)
    atomic_write_bytes(path, png.getvalue())
