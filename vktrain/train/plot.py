"""Loss-curve plot of a training run (matplotlib, headless). Written atomically like every output."""
from __future__ import annotations

import io
from pathlib import Path
from typing import Sequence

from vktrain.train.checkpoint import atomic_write_bytes


def plot_losses(records: Sequence[dict], path: str | Path, title: str = "") -> None:
    """records: [{"step", "loss", "lr"[, "eval_loss"]}, ...] -> a PNG with the loss and the held-out loss
    where it was measured (left axis) and the LR (right axis)."""
    if not records:
        raise ValueError("no training records to plot")
    try:
        import matplotlib
    except ImportError as e:  # a dependency of vktrain; only a stripped device install lacks it
        raise RuntimeError("--plot needs matplotlib (pip install matplotlib)") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(steps, [r["loss"] for r in records], color="tab:blue", label="training loss")
    evaluated = [r for r in records if "eval_loss" in r]
    if evaluated:
        ax.plot([r["step"] for r in evaluated], [r["eval_loss"] for r in evaluated], "o--", color="tab:red",
                label="held-out loss")
        ax.legend(loc="upper right")
    ax.set_xlabel("step")
    ax.set_ylabel("loss", color="tab:blue")
    ax.grid(alpha=0.3)
    lr_axis = ax.twinx()
    lr_axis.plot(steps, [r["lr"] for r in records], color="tab:orange", alpha=0.6, label="lr")
    lr_axis.set_ylabel("learning rate", color="tab:orange")
    ax.set_title(title or f"vktrain: steps {steps[0]}..{steps[-1]}")
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png")
    plt.close(fig)
    atomic_write_bytes(path, png.getvalue())
