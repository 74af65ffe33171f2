"""`vktrain train --eval-data PAIRS` on a preference step (DPO, ORPO): the held-out preference loss and reward
accuracy at each evaluation are what `vktrain eval PREF.pte --data PAIRS` reports of the same adapters (the
checkpoints the run kept, and the .pte's own before training), recorded as eval_loss / eval_reward_accuracy;
`--keep-best` (the lowest loss) and `--keep-best accuracy` (the highest reward accuracy) write the adapters of
the best evaluation, bit for bit those of its step's checkpoint; a bad held-out pairs file is refused before
training, naming its row; --eval-generate is refused on pairs.

The model: tests/test_pairs.py's one-layer GGUF with a tokenizer and a chat template. The training pairs
alternate: the held-out pairs, then the same pairs with chosen and rejected swapped (two pairs a step,
--grad-accum 2, beta1 0 so that each update follows its own gradient), so the held-out loss falls and rises
step by step and the best evaluation is not the last.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from vktrain.train.best import best_so_far
from vktrain.train.checkpoint import load_checkpoint

from test_pairs import CHOSEN, PROMPT, REJECTED, _write
from test_tokenizer_data import _write_gguf, bpe  # noqa: F401  (bpe: a fixture)

HELD_OUT = [{"prompt": "hi", "chosen": " ok", "rejected": " no thanks"},
            {"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED}]
SWAPPED = [{**row, "chosen": row["rejected"], "rejected": row["chosen"]} for row in HELD_OUT]
STEPS = 4


@pytest.fixture(scope="module")
def programs(tmp_path_factory, bpe):  # noqa: F811
    """(folder, {objective: .pte}) of a DPO and an ORPO step with --grad-accum, and the pairs files."""
    from vktrain.cli import main

    root = tmp_path_factory.mktemp("preference_held_out")
    model = root / "tiny.gguf"
    _write_gguf(model, bpe, "smollm", True, with_tensors=True)
    paths = {}
    for objective, beta in (("dpo", "0.5"), ("orpo", "0.5")):
        paths[objective] = root / f"{objective}.pte"
        assert main(["export", "--model", str(model), "--lora-rank", "4", "--seq", "64", "--batch", "1",
                     "--calibration-data", "none", "--objective", objective, "--beta", beta, "--grad-accum",
                     "--out", str(paths[objective])]) == 0
    _write(root, HELD_OUT, "held_out.jsonl")
    _write(root, HELD_OUT + SWAPPED, "train.jsonl")
    return root, paths


def _train(root, pte, name, *extra):
    from vktrain.cli import main

    out = root / name
    code = main(["train", str(pte), "--data", str(root / "train.jsonl"), "--grad-accum", "2", "--steps", str(STEPS),
                 "--lr", "5e-2", "--beta1", "0", "--schedule", "constant", "--eval-data", str(root / "held_out.jsonl"),
                 "--eval-every", "1", "--checkpoint", str(out / "ck.safetensors"), "--checkpoint-every", "1",
                 "--keep-checkpoints", str(STEPS), "--out-adapters", str(out / "adapters"), "--json",
                 str(out / "records.json"), "--no-progress", "--log-every", "0", *extra])
    return code, out


def _vktrain_eval(root, pte, out, adapters=None) -> dict:
    from vktrain.cli import main

    assert main(["eval", str(pte), "--data", str(root / "held_out.jsonl"), "--json", str(out / "eval.json"),
                 "--overwrite"] + (["--adapters", str(adapters)] if adapters else [])) == 0
    return json.loads((out / "eval.json").read_text())


@pytest.mark.parametrize("objective, keep_best, metric", [("dpo", [], "loss"),
                                                          ("orpo", ["accuracy"], "reward_accuracy")])
def test_train_evaluates_held_out_pairs_as_vktrain_eval_and_keeps_the_best(programs, capsys, objective, keep_best,
                                                                           metric):
    root, paths = programs
    code, out = _train(root, paths[objective], objective, "--keep-best", *keep_best)
    assert code == 0, capsys.readouterr().err
    records = json.loads((out / "records.json").read_text())
    evaluated = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evaluated] == list(range(STEPS + 1))
    assert all(0.0 <= r["eval_reward_accuracy"] <= 1.0 for r in evaluated)
    # The loss falls and rises with the alternating pairs (the premise: the best is neither before training
    # nor the last step).
    best_step, best_value, _ = best_so_far(records[1:], metric)
    assert 0 < best_step < STEPS, [(r["step"], r["eval_loss"], r["eval_reward_accuracy"]) for r in evaluated]
    # Each evaluation is vktrain eval's of the same adapters: the .pte's own (step 0), a kept checkpoint.
    for step, adapters in ((0, None), (best_step, out / f"ck.step{best_step}.safetensors"),
                           (STEPS, out / "ck.safetensors")):
        reported = _vktrain_eval(root, paths[objective], out, adapters)
        assert (reported["loss"], reported["reward_accuracy"]) == (
            evaluated[step]["eval_loss"], evaluated[step]["eval_reward_accuracy"]), (step, reported)
    # --keep-best: the best evaluation's adapters, bit for bit its step's checkpoint's, not the last.
    from vktrain.serialization.peft_adapters import load_adapters

    at_best, last = load_checkpoint(out / f"ck.step{best_step}.safetensors"), load_checkpoint(out / "ck.safetensors")
    assert load_checkpoint(out / "ck.best.safetensors").step == best_step
    kept = load_adapters(out / "adapters")
    differs = False
    for module, (lora_a, lora_b) in kept.items():
        for array, suffix in ((lora_a, "lora_A"), (lora_b, "lora_B")):
            np.testing.assert_array_equal(array, at_best.tensors[f"model.{module}.{suffix}"])
            differs |= not np.array_equal(array, last.tensors[f"model.{module}.{suffix}"])
    assert differs
    printed = capsys.readouterr().out
    what = "held-out loss" if metric == "loss" else "held-out reward accuracy"
    assert f"best {what} {best_value:.6f} at step {best_step}" in printed
    assert "eval before training: " + ("DPO" if objective == "dpo" else "ORPO") + " loss" in printed


def test_bad_held_out_pairs_and_generation_are_refused_before_training(programs, capsys):
    from vktrain.cli import main

    root, paths = programs
    bad = _write(root, [HELD_OUT[0], {"prompt": "p", "chosen": " c"}], "bad.jsonl")
    records = root / "refused.json"
    common = ["train", str(paths["dpo"]), "--data", str(root / "train.jsonl"), "--steps", "1", "--no-progress",
              "--json", str(records)]
    capsys.readouterr()
    assert main(common + ["--eval-data", str(bad)]) == 2
    assert f"{bad}:2: missing ['rejected']" in capsys.readouterr().err
    assert main(common + ["--eval-data", str(root / "held_out.jsonl"), "--eval-generate"]) == 2
    assert "--eval-generate decodes answers to held-out chats" in capsys.readouterr().err
    assert not records.exists()
