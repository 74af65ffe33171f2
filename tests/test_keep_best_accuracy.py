"""`vktrain train --eval-generate` and `--keep-best accuracy`: every held-out evaluation records the exact-match
accuracy of greedy answers to the held-out chats (a one-layer GGUF model with a tokenizer and a chat
template), the same that `vktrain eval --generate` scores of the written adapters; the best evaluation by
accuracy is the highest, the first of equals (best_so_far, on records where the lowest loss and the highest
accuracy fall at different steps); `--keep-best accuracy` writes the adapters of the best evaluation, not
the last, on a run whose accuracy change is made known; without --eval-generate it is refused, naming it."""
from __future__ import annotations

import json

import numpy as np

from vktrain.train.best import best_so_far

from test_tokenizer_data import _write_gguf, bpe  # noqa: F401  (bpe: a fixture)

CHAT = {"messages": [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "Four."}]}
STEPS, EVAL_EVERY, MAX_NEW_TOKENS = 4, 2, 6


def test_best_by_accuracy_is_the_first_of_the_highest_not_the_lowest_loss():
    records = [{"step": 0, "eval_loss": 3.0, "eval_accuracy": 0.0}, {"step": 2, "loss": 1.0},
               {"step": 2, "eval_loss": 2.0, "eval_accuracy": 0.5}, {"step": 4, "eval_loss": 1.5, "eval_accuracy": 0.75},
               {"step": 6, "eval_loss": 1.0, "eval_accuracy": 0.75}, {"step": 8, "eval_loss": 1.2, "eval_accuracy": 0.5}]
    assert best_so_far(records, "accuracy") == (4, 0.75, 2)
    assert best_so_far(records, "loss") == best_so_far(records) == (6, 1.0, 1)
    assert best_so_far(records[:2], "accuracy") == (0, 0.0, 0) and best_so_far([{"step": 1}], "accuracy") is None


def _generated_answer(main, pte, chats, adapters, result) -> tuple[float, str]:
    """(exact match, the answer) of `vktrain eval --generate` of `adapters` on the one chat of `chats`."""
    assert main(["eval", str(pte), "--data", str(chats), "--generate", "--max-new-tokens", str(MAX_NEW_TOKENS),
                 "--adapters", str(adapters), "--json", str(result), "--overwrite"]) == 0
    scored = json.loads(result.read_text())
    return scored["exact_match"], scored["results"][0]["answer"]


def test_keep_best_accuracy_keeps_the_adapters_of_the_best_evaluation_not_the_last(tmp_path, bpe, capsys):  # noqa: F811
    """The accuracy change is made known: a first run of 2 steps (constant lr: the first 2 steps of any run
    of the seed) gives adapters whose greedy answer becomes the held-out chat's reference; the run with
    --eval-generate --keep-best accuracy then scores 0, 1, 0 at steps 0, 2, 4 (the answer moves on),
    and must write the step-2 adapters, bit for bit those of the first run, which vktrain eval --generate
    scores 1 (the last scored 0). Also: every evaluation records eval_loss too; --keep-best accuracy
    without --eval-generate, and --eval-max-new-tokens 0, are refused naming the flag."""
    from vktrain.cli import main
    from vktrain.serialization.peft_adapters import load_adapters

    model, pte = tmp_path / "tiny.gguf", tmp_path / "step.pte"
    _write_gguf(model, bpe, "smollm", True, with_tensors=True)
    assert main(["export", "--model", str(model), "--lora-rank", "4", "--batch", "1", "--seq", "32",
                 "--calibration-data", "none", "--out", str(pte)]) == 0
    chats, train, result = tmp_path / "chats.jsonl", tmp_path / "train.jsonl", tmp_path / "eval.json"
    chats.write_text(json.dumps(CHAT) + "\n", encoding="utf-8")
    train.write_text((json.dumps(CHAT) + "\n") * 4, encoding="utf-8")
    common = ["train", str(pte), "--data", str(train), "--lr", "5e-2", "--schedule", "constant", "--no-progress",
              "--log-every", "0"]
    capsys.readouterr()
    for flags, message in ((["--keep-best", "accuracy", "--checkpoint", str(tmp_path / "ck.safetensors")],
                            "--keep-best accuracy compares the held-out exact-match accuracy: it needs --eval-generate"),
                           (["--eval-max-new-tokens", "0", "--eval-generate"], "--eval-max-new-tokens must be >= 1")):
        assert main(common + ["--steps", "1", "--eval-data", str(chats), "--eval-every", "1"] + flags) == 2
        assert message in capsys.readouterr().err
    early = tmp_path / "early"
    assert main(common + ["--steps", str(EVAL_EVERY), "--out-adapters", str(early)]) == 0
    _, reference = _generated_answer(main, pte, chats, early, result)
    chats.write_text(json.dumps({"messages": [CHAT["messages"][0], {"role": "assistant", "content": reference}]})
                     + "\n", encoding="utf-8")
    records_path, adapters = tmp_path / "records.json", tmp_path / "adapters"
    assert main(common + ["--steps", str(STEPS), "--eval-data", str(chats), "--eval-every", str(EVAL_EVERY),
                          "--eval-generate", "--eval-max-new-tokens", str(MAX_NEW_TOKENS), "--keep-best", "accuracy",
                          "--checkpoint", str(tmp_path / "ck.safetensors"), "--out-adapters", str(adapters),
                          "--json", str(records_path)]) == 0, capsys.readouterr().err
    records = json.loads(records_path.read_text())
    evaluated = [(r["step"], r["eval_accuracy"]) for r in records if "eval_accuracy" in r]
    assert all("eval_loss" in r for r in records if "eval_accuracy" in r)
    # Premise: the answer of step 2 is neither the base's nor that of the later steps (the reference is
    # not empty: an empty answer would not be a moved one).
    assert reference and evaluated == [(0, 0.0), (2, 1.0), (4, 0.0)], (reference, evaluated)
    assert best_so_far(records, "accuracy") == (2, 1.0, 1)  # one evaluation since
    kept, first = load_adapters(adapters), load_adapters(early)
    assert sorted(kept) == sorted(first) and all(
        np.array_equal(kept[name][i], first[name][i]) for name in first for i in (0, 1))
    assert _generated_answer(main, pte, chats, adapters, result) == (1.0, reference)
