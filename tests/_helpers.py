"""Helpers shared by several test modules (imported as `from _helpers import ...`: pytest puts tests/ on
sys.path). Only setup and references live here; every assertion about behaviour stays in the tests."""
from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np


def assert_import_loads_none(modules: Sequence[str], forbidden: Sequence[str], timeout: float | None = None) -> None:
    """Import `modules` in a fresh interpreter and fail if any module in `forbidden` (or a submodule of
    one) got loaded along the way: the layering rules (no torch in the runtime, no Vulkan loader on the
    host side) checked where a stray import would actually happen."""
    code = (f"import sys, {', '.join(modules)}; forbidden = {tuple(forbidden)!r}; "
            "bad = sorted(m for m in sys.modules if any(m == f or m.startswith(f + '.') for f in forbidden)); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=timeout)


def export_mlp_lora_training_step(path: Path, batch_shape: tuple[int, int], vocab_size: int):
    """Export the small `mlp-lora` model (2 layers, LoRA rank 4 on every linear) as a training-step .pte
    at `path`; returns the LoRA model it was exported from."""
    from vktrain.export import export_training_step, lower_to_pte
    from vktrain.lora import LoRAConfig, apply_lora
    from vktrain.models import build_model

    model = build_model("mlp-lora", dim=32, hidden=64, vocab_size=vocab_size, n_layers=2, activation="relu")
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets="*", group_size=32, seed=0))
    path.write_bytes(lower_to_pte(export_training_step(model, batch_shape)))
    return model


def eager_lora_adamw_training(model, batches: Iterable, *, lr: float, betas: tuple[float, float], eps: float,
                              weight_decay: float):
    """The eager PyTorch reference of a training run: torch.optim.AdamW over the LoRA tensors of a copy
    of `model` (everything else frozen), one step per (token_ids, labels) batch, n_valid = the labels
    >= 0. Returns (per-step losses, final LoRA tensors, final AdamW first moments), by parameter name."""
    import torch

    from vktrain.lora import lora_parameter_names

    model = copy.deepcopy(model)
    names = lora_parameter_names(model)
    params = dict(model.named_parameters())
    for name, param in params.items():
        param.requires_grad_(name in names)
    optimizer = torch.optim.AdamW([params[n] for n in names], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    losses = []
    for token_ids, labels in batches:
        n_valid = (labels >= 0).sum().to(torch.float32)
        optimizer.zero_grad()
        loss = model.loss(token_ids, labels, n_valid)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    state = {name: params[name].detach().numpy().copy() for name in names}
    exp_avg = {name: optimizer.state[params[name]]["exp_avg"].numpy().copy() for name in names}
    return losses, state, exp_avg


def runner_losses(runner, batches: Iterable, hparams: np.ndarray) -> list[float]:
    """The losses of one TrainingRunner step per (token_ids, labels) torch batch."""
    return [runner.step(token_ids.numpy(), labels.numpy(), hparams) for token_ids, labels in batches]
