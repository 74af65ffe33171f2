"""Activation checkpointing (`vktrain export --activation-checkpointing`, vktrain/export/recompute.py): the
step whose backward recomputes the decoder layers trains bit for bit as the plain step on lavapipe (the
copies run the same kernels on the same inputs), plans less device memory by at least half the activations
it no longer keeps, records the choice for `vktrain inspect`, and bad values are refused naming the flag."""
from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch

from vktrain.backend.kernel_planning import plan_schedule
from vktrain import cli
from vktrain.contract import METADATA_ACTIVATION_CHECKPOINTING, hparams_values
from vktrain.export import export_accumulating_methods, export_training_step, lower_to_pte
from vktrain.export.recompute import CheckpointingError
from vktrain.lora import LoRAConfig, apply_lora, lora_modules
from vktrain.models import build_model
from vktrain.runtime.program.runner import TrainingRunner
from vktrain.runtime.program.summary import summarize_pte

CONFIG = dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, hidden=192, vocab_size=256, max_seq_len=64)
SHAPE = (2, 16)
CHOICES = (None, "every-layer", 3)  # 3: segments of layers 0-2 and 3 (the last one shorter)
HPARAMS = np.array(hparams_values(1e-2, 0.9, 0.999, 1e-6, 0.01), np.float32)


@pytest.fixture(scope="module")
def model():
    model = build_model("tiny-llama", **CONFIG)
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, group_size=32, seed=0))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # lora_B starts at zero; make every gradient nonzero from the first step
        for adapter in lora_modules(model).values():
            adapter.lora_B.copy_(0.05 * torch.randn(adapter.lora_B.shape, generator=generator))
    return model


@pytest.fixture(scope="module")
def steps(model, tmp_path_factory):
    """choice -> (forward-op counts of the exported step, its .pte path)."""
    folder = tmp_path_factory.mktemp("actckpt")
    result = {}
    for choice in CHOICES:
        program = export_training_step(model, SHAPE, activation_checkpointing=choice)
        counts = Counter(str(node.target) for node in program.graph.nodes if node.op == "call_function")
        path = folder / f"step_{choice}.pte"
        path.write_bytes(lower_to_pte(program))
        result[choice] = counts, path
    return result


def test_the_backward_recomputes_each_segment_s_forward(steps):
    layers = CONFIG["n_layers"]
    linear, attention = "vktrain.lora_linear_q4gsw.default", "vktrain.causal_attention.default"
    plain, _ = steps[None]
    assert plain[linear] == 7 * layers and plain[attention] == layers  # q k v o gate up down per layer
    # A segment recomputes all its projections but its last down_proj, whose output feeds only the segment's
    # output (the residual stream, kept).
    every, _ = steps["every-layer"]
    assert every[linear] == 7 * layers + 6 * layers and every[attention] == 2 * layers
    grouped, _ = steps[3]
    assert grouped[linear] == 7 * layers + (7 * 3 - 1) + (7 * 1 - 1) and grouped[attention] == 2 * layers


def test_checkpointed_steps_train_bit_for_bit_as_the_plain_step(steps, vk_device):
    rng = np.random.default_rng(5)
    batches = [(rng.integers(0, CONFIG["vocab_size"], SHAPE), rng.integers(0, CONFIG["vocab_size"], SHAPE))
               for _ in range(3)]
    batches[1][1][0, :7] = -100  # ignored labels change n_valid's divisor
    runs = {}
    for choice in CHOICES:
        with TrainingRunner.from_pte(steps[choice][1], vk_device, planner=plan_schedule) as runner:
            losses = [runner.step(tokens, labels, HPARAMS, n_valid=float((labels >= 0).sum()))
                      for tokens, labels in batches]
            runs[choice] = losses, runner.state_dict()
    plain_losses, plain_state = runs[None]
    assert len(set(plain_losses)) == 3 and all(np.isfinite(plain_losses))
    for choice in CHOICES[1:]:
        losses, state = runs[choice]
        assert losses == plain_losses, choice
        assert state.keys() == plain_state.keys()
        for name, value in plain_state.items():  # the LoRA deltas, AdamW's moments and step
            np.testing.assert_array_equal(state[name], value, err_msg=f"{choice}: {name}")


def _kept_activation_bytes() -> int:
    """Bytes of the decoder layers' intermediates the plain step keeps from its forward for its backward (the
    layer inputs aside, which the checkpointed step keeps too), from what each backward kernel reads, per
    token: rms_norm x2 (normed output dim, rstd 1), attention (rotated q H*D and k KV*D, v KV*D, output H*D,
    log-sum-exp H), the residual between the blocks (dim), swiglu (gate, up and output: hidden each)."""
    c = CONFIG
    head = c["dim"] // c["n_heads"]
    per_token = (2 * (c["dim"] + 1) + 2 * c["n_heads"] * head + 2 * c["n_kv_heads"] * head + c["n_heads"]
                 + c["dim"] + 3 * c["hidden"])
    return c["n_layers"] * SHAPE[0] * SHAPE[1] * per_token * 4


def _planned_bytes(path) -> int:
    return summarize_pte(path.read_bytes())["delegates"][0]["memory"]["planned_bytes"]


def test_planned_memory_drops_by_at_least_half_the_kept_activations(steps):
    plain = _planned_bytes(steps[None][1])
    activations = _kept_activation_bytes()
    assert activations < plain
    layers = CONFIG["n_layers"]
    for choice, per_segment in (("every-layer", 1), (3, 3)):
        saved = plain - _planned_bytes(steps[choice][1])
        print(f"{choice}: planned {plain} -> {plain - saved} bytes, kept activations {activations}")
        # A segment's activations are live again during its backward: a segment of N layers gives back at most
        # (L - N) / L of them; the greedy planner (vktrain/backend/memory_planning.py) is granted half of that.
        assert saved >= activations * (layers - per_segment) // layers // 2, choice
    assert plain - _planned_bytes(steps["every-layer"][1]) >= activations // 2  # the criterion


def test_bad_values_and_models_are_refused(model, tmp_path, capsys):
    out = tmp_path / "x.pte"
    for value in ("0", "-2", "two", "1.5", ""):
        with pytest.raises(SystemExit) as exited:
            cli.main(["export", "--model", "tiny-llama", "--out", str(out), "--activation-checkpointing", value])
        err = capsys.readouterr().err
        assert exited.value.code == 2 and "--activation-checkpointing" in err and "'every-layer' or a positive" in err
    code = cli.main(["export", "--model", "tiny-llama", "--out", str(out), "--activation-checkpointing", "5"])
    err = capsys.readouterr().err
    assert code == 2 and "--activation-checkpointing 5" in err and "has 4; give at most 4" in err
    code = cli.main(["export", "--model", "tiny-llama", "--out", str(out), "--program", "forward",
                     "--activation-checkpointing", "every-layer"])
    assert code == 2 and "--program is forward" in capsys.readouterr().err
    assert not out.exists()
    with pytest.raises(CheckpointingError, match="nn.ModuleList named 'layers'; _Regression has none"):
        export_training_step(_Regression(), example_inputs=(torch.ones(2, 3),), activation_checkpointing="every-layer")
    with pytest.raises(ValueError, match="got 0"):
        export_accumulating_methods(model, SHAPE, activation_checkpointing=0)


def test_export_records_the_choice_and_inspect_shows_it(tmp_path, capsys):
    out = tmp_path / "step.pte"
    code = cli.main(["export", "--model", "tiny-llama", "--batch", "2", "--seq", "16", "--grad-accum",
                     "--activation-checkpointing", "2", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    capsys.readouterr()
    assert cli.main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "activation checkpointing: 2 (the backward recomputes each segment of 2 decoder layers" in text
    assert cli.main(["inspect", "--json", str(out)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["delegates"][0]["metadata"][METADATA_ACTIVATION_CHECKPOINTING] == "2"
    for method in ("accumulate", "eval"):  # tiny-llama: 4 layers; the eval method has no backward to recompute
        histogram = report["other_methods"][method]["delegates"][0]["op_histogram"]
        assert histogram["vktrain.causal_attention.default"] == (8 if method == "accumulate" else 4), method


class _Regression(torch.nn.Module):
    """A module with no decoder layers."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.linear(x) ** 2).sum()
