"""`vktrain train --eval-generate` and `--keep-best accuracy`: every held-out evaluation records the exact-match
accuracy of greedy answers to the held-out chats (a one-layer GGUF model with a tokenizer and a chat
template), the same that `vktrain eval --generate` scores of the written adapters; the best evaluation by
accuracy is the highest, the first of equals (best_so_far, on records where the lowest loss and the highest
accuracy fall at different steps); `--keep-best accuracy` without --eval-generate is refused, naming it."""
from __future__ import annotations

import json

from vktrain.train.best import best_so_far

from test_tokenizer_data import _write_gguf, bpe  # noqa: F401  (bpe: a fixture)

CHAT = {"messages": [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "Four."}]}
STEPS, EVAL_EVERY = 4, 2


def test_best_by_accuracy_is_the_first_of_the_highest_not_the_lowest_loss():
    records = [{"step": 0, "eval_loss": 3.0, "eval_accuracy": 0.0}, {"step": 2, "loss": 1.0},
               {"step": 2, "eval_loss": 2.0, "eval_accuracy": 0.5}, {"step": 4, "eval_loss": 1.5, "eval_accuracy": 0.75},
               {"step": 6, "eval_loss": 1.0, "eval_accuracy": 0.75}, {"step": 8, "eval_loss": 1.2, "eval_accuracy": 0.5}]
    assert best_so_far(records, "accuracy") == (4, 0.75, 2)
    assert best_so_far(records, "loss") == best_so_far(records) == (6, 1.0, 1)
    assert best_so_far(records[:2], "accuracy") == (0, 0.0, 0) and best_so_far([{"step": 1}], "accuracy") is None


def test_eval_generate_records_the_accuracy_eval_scores(tmp_path, bpe, capsys):  # noqa: F811
    from vktrain.cli import main

    model, pte = tmp_path / "tiny.gguf", tmp_path / "step.pte"
    _write_gguf(model, bpe, "smollm", True, with_tensors=True)
    assert main(["export", "--model", str(model), "--lora-rank", "4", "--batch", "1", "--seq", "32",
                 "--calibration-data", "none", "--out", str(pte)]) == 0
    chats, train = tmp_path / "chats.jsonl", tmp_path / "train.jsonl"
    chats.write_text(json.dumps(CHAT) + "\n", encoding="utf-8")
    train.write_text((json.dumps(CHAT) + "\n") * 4, encoding="utf-8")
    common = ["train", str(pte), "--data", str(train), "--eval-data", str(chats), "--eval-every", str(EVAL_EVERY),
              "--steps", str(STEPS), "--lr", "5e-2", "--no-progress", "--log-every", "0"]
    capsys.readouterr()
    for flags, message in ((["--keep-best", "accuracy", "--checkpoint", str(tmp_path / "ck.safetensors")],
                            "--keep-best accuracy compares the held-out exact-match accuracy: it needs --eval-generate"),
                           (["--eval-max-new-tokens", "0", "--eval-generate"], "--eval-max-new-tokens must be >= 1")):
        assert main(common + flags) == 2
        assert message in capsys.readouterr().err
    records_path, adapters = tmp_path / "records.json", tmp_path / "adapters"
    assert main(common + ["--eval-generate", "--eval-max-new-tokens", "6", "--keep-best", "accuracy",
                          "--checkpoint", str(tmp_path / "ck.safetensors"), "--out-adapters", str(adapters),
                          "--json", str(records_path)]) == 0, capsys.readouterr().err
    records = json.loads(records_path.read_text())
    evaluated = [(r["step"], r["eval_accuracy"]) for r in records if "eval_accuracy" in r]
    assert [step for step, _ in evaluated] == list(range(0, STEPS + 1, EVAL_EVERY)), evaluated
    assert all("eval_loss" in r for r in records if "eval_accuracy" in r)
    best_step, best, _ = best_so_far(records, "accuracy")
    result = tmp_path / "eval.json"
    assert main(["eval", str(pte), "--data", str(chats), "--generate", "--max-new-tokens", "6",
                 "--adapters", str(adapters), "--json", str(result)]) == 0
    if best_step > 0:  # a best found during the run: its adapters are the ones written
        assert json.loads(result.read_text())["exact_match"] == best
    else:  # none better than before training: the last adapters are written, scored as recorded last
        assert json.loads(result.read_text())["exact_match"] == evaluated[-1][1]
