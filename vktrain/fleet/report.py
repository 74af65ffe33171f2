"""Loss per round of a federation (matplotlib, headless), written atomically like every output."""
from __future__ import annotations

import io
from pathlib import Path
from typing import Sequence

import numpy as np

from vktrain.train.checkpoint import atomic_write_bytes


def plot_rounds(records: Sequence[dict], path: str | Path, title: str = "") -> None:
    """records (vktrain federate's, round 0 first) -> a PNG of the global held-out loss and the mean of
    the clients' local training losses per round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    evaluated = [r for r in records if r.get("global_eval_loss") is not None]
    if evaluated:
        ax.plot([r["round"] for r in evaluated], [r["global_eval_loss"] for r in evaluated], "o-", color="tab:red",
                label="global held-out loss")
    trained = [r for r in records if r.get("client_train_loss")]
    if trained:
        ax.plot([r["round"] for r in trained], [np.mean(list(r["client_train_loss"].values())) for r in trained],
                "s--", color="tab:blue", label="mean client training loss")
    ax.set_xlabel("round")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    ax.set_title(title)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png")
    plt.close(fig)
    atomic_write_bytes(path, png.getvalue())
