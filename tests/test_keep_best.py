"""`vktrain train --keep-best` / `--early-stopping N` on a tiny-llama step trained on one batch of random
tokens at a large constant learning rate, so that its held-out loss on other random tokens goes down and up
(the test asserts its minimum is neither the first nor the last evaluation): the best checkpoint and
adapters are those of the recorded minimum (checked by evaluating them afresh), and early stopping ends
the run exactly where the rule says on the uninterrupted run's held-out losses."""
from __future__ import annotations

import json

import numpy as np
import pytest

from vktrain.contract import EVAL_METHOD, TRAIN_METHOD
from vktrain.export import export_training_and_eval_steps, lower_methods_to_pte
from vktrain.export.training import adapter_metadata_specs
from vktrain.lora import LoRAConfig, apply_lora
from vktrain.models import build_model
from vktrain.partitioner import VktrainPartitioner
from vktrain.runtime.program.runner import TrainingRunner
from vktrain.serialization.peft_adapters import load_adapters
from vktrain.train.checkpoint import load_checkpoint
from vktrain.train.data import TrainingData
from vktrain.train.eval_command import adapter_state, load_adapter_state
from vktrain.train.held_out import evaluate_data
from vktrain.backend.kernel_planning import plan_schedule

BATCH = (2, 16)
LORA_ALPHA = 16.0
STEPS, EVAL_EVERY = 16, 2


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("best")
    model = build_model("tiny-llama", max_seq_len=32)
    apply_lora(model, LoRAConfig(rank=8, alpha=LORA_ALPHA, group_size=32, seed=0))
    methods = dict(zip((TRAIN_METHOD, EVAL_METHOD), export_training_and_eval_steps(model, BATCH)))
    partitioner = VktrainPartitioner(compile_specs=adapter_metadata_specs(model, "tiny-llama"))
    (root / "step.pte").write_bytes(lower_methods_to_pte(methods, {TRAIN_METHOD: partitioner}))
    rng = np.random.default_rng(5)
    np.save(root / "train.npy", rng.integers(0, 256, BATCH[0] * BATCH[1] + 1))  # one batch, seen every step
    held_out = rng.integers(0, 256, 4 * BATCH[1] + 1)
    np.save(root / "held_out.npy", held_out)
    return root, held_out


def _train(root, name, *extra):
    from vktrain import cli

    out = root / name
    code = cli.main(["train", str(root / "step.pte"), "--data", str(root / "train.npy"), "--eval-data",
                     str(root / "held_out.npy"), "--eval-every", str(EVAL_EVERY), "--steps", str(STEPS), "--lr", "3e-1",
                     "--schedule", "constant", "--no-progress", "--log-every", "0", "--json", str(out / "records.json"),
                     *extra])
    records = json.loads((out / "records.json").read_text())
    if "--resume" in extra:  # a resumed run's log holds its checkpoint's steps
        return code, records
    before, *steps = records  # a fresh run's log leads with the held-out loss before training (step 0)
    assert before.keys() == {"step", "eval_loss"} and before["step"] == 0, before
    return code, steps


def test_keep_best_keeps_the_state_of_the_lowest_held_out_loss(setup, capsys):
    root, held_out = setup
    out = root / "keep"
    code, records = _train(root, "keep", "--keep-best", "--checkpoint", str(out / "ck.safetensors"),
                           "--out-adapters", str(out / "adapters"))
    assert code == 0, capsys.readouterr().err
    evaluated = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    assert [step for step, _ in evaluated] == list(range(EVAL_EVERY, STEPS + 1, EVAL_EVERY))
    best_step, best_loss = min(evaluated, key=lambda e: e[1])
    assert best_step not in (evaluated[0][0], STEPS), f"the best must be neither the first nor the last: {evaluated}"

    best = load_checkpoint(out / "ck.best.safetensors")
    assert best.step == best_step and best.records[-1]["eval_loss"] == best_loss
    assert load_checkpoint(out / "ck.safetensors").step == STEPS  # the last state is still checkpointed
    adapters = load_adapters(out / "adapters")
    for module, (lora_a, lora_b) in adapters.items():
        np.testing.assert_array_equal(lora_a, best.tensors[f"model.{module}.lora_A"])
        np.testing.assert_array_equal(lora_b, best.tensors[f"model.{module}.lora_B"])
    with TrainingRunner.from_pte(root / "step.pte", planner=plan_schedule) as fresh:  # the written adapters have the recorded loss
        load_adapter_state(fresh, adapter_state(out / "adapters", list(fresh.lora_state()), LORA_ALPHA))
        assert evaluate_data(fresh, TrainingData(held_out))["loss"] == best_loss
    assert f"best held-out loss {best_loss:.6f} at step {best_step}" in capsys.readouterr().out


def test_early_stopping_ends_the_run_after_n_evaluations_without_improvement(setup, capsys):
    root, _ = setup
    code, full = _train(root, "full")
    assert code == 0, capsys.readouterr().err
    losses = [(r["step"], r["eval_loss"]) for r in full if "eval_loss" in r]
    patience = 2
    expected_stop = None
    for i in range(len(losses)):  # the rule, on the uninterrupted run's losses
        best_index = min(range(i + 1), key=lambda j: losses[j][1])
        if i - best_index >= patience:
            expected_stop = losses[i][0]
            break
    assert expected_stop is not None and expected_stop < STEPS

    code, stopped = _train(root, "stopped", "--early-stopping", str(patience))
    assert code == 0, capsys.readouterr().err
    assert stopped == [{**r, "seconds": s["seconds"]} for r, s in zip(full[:expected_stop], stopped)]
    assert f"early stopping after step {expected_stop}: {patience} held-out evaluation(s)" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["--keep-best", "--checkpoint", "ck.safetensors"], "--keep-best compares held-out losses: it needs --eval-data FILE "
                                                        "and --eval-every N"),
    (["--early-stopping", "3", "--eval-data", "h.npy"], "--early-stopping compares held-out losses: it needs"),
    (["--early-stopping", "0", "--eval-data", "h.npy", "--eval-every", "2"], "--early-stopping must be >= 1"),
    (["--keep-best", "--eval-data", "h.npy", "--eval-every", "2"], "--keep-best needs --checkpoint PATH"),
])
def test_keep_best_and_early_stopping_refuse_what_they_cannot_do(setup, argv, message, capsys):
    from vktrain import cli

    root, _ = setup
    assert cli.main(["train", str(root / "step.pte"), "--steps", "2", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_resumed_run_keeps_the_best_of_the_whole_run(setup, capsys):
    root, _ = setup
    whole, resumed = root / "whole", root / "resumed"
    code, records = _train(root, "whole", "--keep-best", "--checkpoint", str(whole / "ck.safetensors"))
    assert code == 0, capsys.readouterr().err
    code, _ = _train(root, "resumed", "--keep-best", "--checkpoint", str(resumed / "ck.safetensors"),
                     "--checkpoint-every", "2", "--steps", str(STEPS // 2))  # the later --steps wins
    assert code == 0, capsys.readouterr().err
    code, again = _train(root, "resumed", "--keep-best", "--resume", str(resumed / "ck.safetensors"),
                         "--out-adapters", str(resumed / "adapters"))
    assert code == 0, capsys.readouterr().err
    assert [r["eval_loss"] for r in again if "eval_loss" in r] == [r["eval_loss"] for r in records if "eval_loss" in r]
    best, kept = load_checkpoint(whole / "ck.best.safetensors"), load_checkpoint(resumed / "ck.best.safetensors")
    assert kept.step == best.step <= STEPS // 2  # found before the resume: the adapters come from the file
    for name, array in best.tensors.items():
        np.testing.assert_array_equal(kept.tensors[name], array, err_msg=name)
    for module, (lora_a, lora_b) in load_adapters(resumed / "adapters").items():  # from the best, whichever run
        np.testing.assert_array_equal(lora_b, best.tensors[f"model.{module}.lora_B"])
