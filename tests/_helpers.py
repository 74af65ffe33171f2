"""Helpers shared by several test modules (imported as `from _helpers import ...`: pytest puts tests/ on
sys.path). Setup and references live here, plus the one training-parity comparison (its bounds are a
single fact shared by every parity test); every other assertion stays in the tests."""
from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from pathlib import Path
from dataclasses import dataclass
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


def planned(device, graph, **options):
    """The Schedule of `graph` on `device` as the app plans it at load: the AOT side's plan_schedule for the
    device's planning profile (vktrain/runtime/program/schedules.py), with plan_schedule's `options`."""
    from vktrain.backend.kernel_planning import plan_schedule
    from vktrain.runtime.device_profiles import planning_profile

    return plan_schedule(graph, planning_profile(device), **options)


def readme_snippet(section_title: str) -> str:
    """The first Python block of README.md's section `section_title` (tests run README examples as written)."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert section_title in text, f"README.md has no section {section_title!r}"
    section = text[text.index(section_title):]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match, f"README.md's {section_title!r} section has no python block"
    return match.group(1)


REPO = Path(__file__).resolve().parents[1]


def build_native(*flags: str) -> Path:
    """Build the native runtime (native/) with scripts/native_build.sh (cmake rebuilds only what changed) and
    return its build folder: build/native, or build/native-asan with --sanitize. Skips the calling test, with
    the script's reason, only where the toolchain it needs is not installed (scripts/setup.sh installs it)."""
    import pytest

    import fcntl

    env = dict(os.environ, NATIVE_PYTHON=sys.executable)
    (REPO / "build").mkdir(exist_ok=True)
    # Test workers (pytest-xdist) build one at a time: two cmake runs in one build folder corrupt it.
    with open(REPO / "build" / ".native-build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        result = subprocess.run([str(REPO / "scripts" / "native_build.sh"), *flags], cwd=REPO, env=env,
                                capture_output=True, text=True, timeout=900)
    if result.returncode != 0 and "native build: missing" in result.stderr:
        pytest.skip(f"the native build is absent: {result.stderr.strip()}")
    assert result.returncode == 0, f"scripts/native_build.sh {' '.join(flags)} failed:\n{result.stderr}"
    return REPO / "build" / ("native-asan" if flags else "native")


def export_mlp_lora_training_step(path: Path, batch_shape: tuple[int, int], vocab_size: int, target: str | None = None,
                                  dim: int = 32, hidden: int = 64):
    """Export the small `mlp-lora` model (2 layers of `dim` -> `hidden`, LoRA rank 4 on every linear) as a
    training-step .pte at `path`; returns the LoRA model it was exported from. `target`: embed the schedules
    of these device profiles (vktrain export --target's syntax)."""
    from vktrain.export import export_training_step, lower_to_pte
    from vktrain.lora import LoRAConfig, apply_lora
    from vktrain.models import build_model

    model = build_model("mlp-lora", dim=dim, hidden=hidden, vocab_size=vocab_size, n_layers=2, activation="relu")
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets="*", group_size=32, seed=0))
    rewrite = None
    if target is not None:
        from vktrain.train.targets import TargetEmbedder, resolve_targets

        rewrite = TargetEmbedder(resolve_targets(target))
    path.write_bytes(lower_to_pte(export_training_step(model, batch_shape), rewrite_blobs=rewrite))
    return model


def eager_lora_adamw_training(model, batches: Iterable, *, lr: float, betas: tuple[float, float], eps: float,
                              weight_decay: float, dtype=None):
    """The eager PyTorch reference of a training run: torch.optim.AdamW over the LoRA tensors of a copy
    of `model` (everything else frozen), one step per (token_ids, labels) batch, n_valid = the labels
    >= 0. With dtype=torch.float64 the copy computes in float64 (the frozen q4gsw codes and scales stay
    as they are: dequantization is exact in either precision), which makes it the CPU-independent
    reference: its rounding is ~1e-16, far below what any float32 run can resolve. Returns (per-step
    losses, final LoRA tensors, final AdamW first moments), by parameter name, as numpy arrays."""
    import torch

    from vktrain.lora import lora_parameter_names

    model = copy.deepcopy(model)
    if dtype is not None:
        _cast_floating(model, dtype)
    names = lora_parameter_names(model)
    params = dict(model.named_parameters())
    for name, param in params.items():
        param.requires_grad_(name in names)
    optimizer = torch.optim.AdamW([params[n] for n in names], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    losses = []
    for token_ids, labels in batches:
        n_valid = (labels >= 0).sum().to(torch.float32)  # a count: exact in float32
        optimizer.zero_grad()
        loss = model.loss(token_ids, labels, n_valid)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    state = {name: params[name].detach().numpy().copy() for name in names}
    exp_avg = {name: optimizer.state[params[name]]["exp_avg"].numpy().copy() for name in names}
    return losses, state, exp_avg


def _cast_floating(model, dtype) -> None:
    """Cast every floating parameter and buffer of `model` to `dtype`, except q4gsw scales (the op
    contract fixes them at float32; the dequantized weight is cast to the activations' dtype)."""
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and param.is_floating_point():
                param.data = param.data.to(dtype)
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_floating_point() and name != "scales":
                module._buffers[name] = buffer.to(dtype)


def relative_frobenius_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """||actual - expected||_F / ||expected||_F, in float64."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def runner_losses(runner, batches: Iterable, hparams: np.ndarray) -> list[float]:
    """The losses of one TrainingRunner step per (token_ids, labels) torch batch."""
    return [runner.step(token_ids.numpy(), labels.numpy(), hparams) for token_ids, labels in batches]


@dataclass(frozen=True)
class TrainingReference:
    """One eager training run in float64 (the reference) and the same run in float32 (what PyTorch
    users get; the bounds must hold for it too, or they measure luck rather than correctness)."""
    losses: list[float]
    state: dict[str, np.ndarray]
    exp_avg: dict[str, np.ndarray]
    float32_losses: list[float]
    float32_state: dict[str, np.ndarray]
    float32_exp_avg: dict[str, np.ndarray]


def eager_float64_and_float32_training(model, batches: Iterable, **hyper) -> TrainingReference:
    import torch

    batches = list(batches)
    exact = eager_lora_adamw_training(model, batches, dtype=torch.float64, **hyper)
    single = eager_lora_adamw_training(model, batches, **hyper)
    return TrainingReference(*exact, *single)


# Why these quantities and bounds (they must hold on every CPU and Vulkan driver):
# - Elementwise agreement of AdamW-trained tensors is ill-conditioned: where a coordinate's gradient is
#   at rounding level, m/sqrt(v) turns last-bit differences (CPU kernels differ by ISA, lavapipe by
#   vector width) into steps of full size lr. So no element is compared on its own.
# - The loss is insensitive, to first order, to exactly those coordinates (their gradient is ~0), so the
#   per-step loss stays well conditioned: float32 rounding through a few dozen GEMMs with K <= 384 and a
#   log-sum-exp over V gives ~1e-6 relative (torch's own float32 run measures ~8e-7 against float64);
#   LOSS_RTOL leaves 10x of that.
# - What training did to a tensor, delta = final - initial, compared in relative Frobenius norm: the
#   few ill-conditioned coordinates (each off by at most lr per step) weigh little against the whole
#   update. float32 runs measure ~1e-4 against float64 on tiny-llama; DELTA_REL_FROB leaves 10x.
LOSS_RTOL = 1e-5
DELTA_REL_FROB = 1e-3


def assert_training_matches_reference(losses: Sequence[float], state: dict[str, np.ndarray],
                                      exp_avg: dict[str, np.ndarray], reference: TrainingReference,
                                      initial: dict[str, np.ndarray]) -> None:
    """The run (per-step losses; final LoRA tensors and AdamW first moments by parameter name) follows
    the float64 reference within the bounds above, and so does PyTorch's own float32 run."""
    for label, run_losses, run_state, run_exp_avg in (
            ("vktrain", losses, state, exp_avg),
            ("torch float32", reference.float32_losses, reference.float32_state, reference.float32_exp_avg)):
        np.testing.assert_allclose(run_losses, reference.losses, rtol=LOSS_RTOL,
                                   err_msg=f"{label}: per-step losses vs the float64 reference")
        assert sorted(run_state) == sorted(reference.state) and sorted(run_exp_avg) == sorted(reference.state)
        errors = {}
        for name in reference.state:
            errors[f"{name} (delta)"] = relative_frobenius_error(run_state[name] - initial[name],
                                                                 reference.state[name] - initial[name])
            errors[f"exp_avg of {name}"] = relative_frobenius_error(run_exp_avg[name], reference.exp_avg[name])
        worst = sorted(errors.items(), key=lambda item: -item[1])[:3]
        assert worst[0][1] <= DELTA_REL_FROB, (
            f"{label}: relative Frobenius error vs the float64 reference above {DELTA_REL_FROB}: "
            + ", ".join(f"{name} {error:.2e}" for name, error in worst))


def ptes_with_and_without(graph_pass, model, batch_shape: tuple[int, int], folder: Path) -> tuple[Path, Path]:
    """The model's training step lowered twice, every backend pass the same but `graph_pass` left out of the
    second (a pass's bit-identity tests): (with, without)."""
    import pytest
    import vktrain.backend.passes as backend_passes
    from vktrain.export import export_training_step, lower_to_pte

    program = export_training_step(model, batch_shape)
    paths = {}
    for fused in (True, False):
        passes = backend_passes.PASSES if fused else tuple(p for p in backend_passes.PASSES if p is not graph_pass)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(backend_passes, "PASSES", passes)
            paths[fused] = folder / f"step_{'fused' if fused else 'unfused'}.pte"
            paths[fused].write_bytes(lower_to_pte(program))
    return paths[True], paths[False]


def next_token_batches(batch_shape: tuple[int, int], vocab: int, steps: int, seed: int) -> list:
    """`steps` random (token_ids, labels) batches, labels the next token (-1 past the end)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        token_ids = torch.randint(0, vocab, batch_shape, generator=generator)
        labels = torch.roll(token_ids, -1, dims=1)
        labels[:, -1] = -1
        out.append((token_ids.numpy(), labels.numpy()))
    return out


def train_recorded(path: Path, device, batches: Iterable, hparams: np.ndarray, planner=None, **options):
    """Train `batches` from the .pte planned at load: (op names, (shader, label) per dispatch, losses, state)."""
    from vktrain.backend.kernel_planning import plan_schedule
    from vktrain.runtime.program.runner import TrainingRunner

    with TrainingRunner.from_pte(path, device, planner=planner or plan_schedule, **options) as runner:
        ops = [op.name for op in runner.executor.ops]
        dispatches = [(d.shader, d.label) for d in runner.executor.dispatches]
        losses = [runner.step(token_ids, labels, hparams) for token_ids, labels in batches]
        state = {name: np.array(array, copy=True) for name, array in runner.state_dict().items()}
    return ops, dispatches, losses, state
