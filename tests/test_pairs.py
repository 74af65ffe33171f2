"""Preference pairs (vktrain/train/pairs.py): TRL's format read into windows, against transformers' own
tokenization of the same pairs (tests/test_tokenizer_data.py's tiny BPE and chat template), and the
refusals of bad rows, each naming the row and what was expected."""
from __future__ import annotations

import json

import numpy as np
import pytest

from vktrain.serialization.tokenizer import ModelTokenizer
from vktrain.train.data import IGNORED_LABEL, DataError
from vktrain.train.pairs import load_pairs

from test_tokenizer_data import _hf_chat_ids, _hf_tokenizer_dir, _named, bpe  # noqa: F401  (bpe: a fixture)

SEQ = 24
PROMPT = [{"role": "user", "content": "What is two plus two?"}]
CHOSEN = [{"role": "assistant", "content": "Four."}]
REJECTED = [{"role": "assistant", "content": "Five, I think."}]


@pytest.fixture()
def tokenizers(tmp_path, bpe):  # noqa: F811
    reference = _hf_tokenizer_dir(tmp_path / "tok", bpe, add_bos=True)
    return ModelTokenizer.from_named_data(_named(tmp_path / "tok"), "step.pte"), reference


def _write(tmp_path, rows, name="pairs.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n", encoding="utf-8")
    return path


def _expected_window(ids, n_prompt, seq_len=SEQ, pad=None):
    tokens = np.full(seq_len, pad, np.int64)
    labels = np.full(seq_len, IGNORED_LABEL, np.int64)
    kept = ids[:seq_len + 1]
    tokens[:min(len(kept), seq_len)] = kept[:seq_len]
    for s in range(len(kept) - 1):
        if s + 1 >= n_prompt:
            labels[s] = kept[s + 1]
    return tokens, labels


def test_text_pairs_are_prompt_then_completion_and_eos(tmp_path, tokenizers):
    ours, reference = tokenizers
    rows = [{"prompt": "numbers 12", "chosen": " x y", "rejected": " hello there"},
            {"prompt": "hi", "chosen": " ok", "rejected": " no"}]
    pairs = load_pairs(_write(tmp_path, rows), ours, SEQ, 400)
    eos = reference.eos_token_id
    assert len(pairs) == 2 and pairs.truncated == 0
    for index, row in enumerate(rows):
        prompt = reference(row["prompt"])["input_ids"]
        assert prompt[0] == reference.bos_token_id
        for key in ("chosen", "rejected"):
            ids = prompt + reference(row[key], add_special_tokens=False)["input_ids"] + [eos]
            tokens, labels = _expected_window(ids, len(prompt), pad=eos)
            np.testing.assert_array_equal(getattr(pairs, f"{key}_tokens")[index], tokens)
            np.testing.assert_array_equal(getattr(pairs, f"{key}_labels")[index], labels)


def test_chat_pairs_train_the_completion_turn_only(tmp_path, tokenizers):
    ours, reference = tokenizers
    earlier = PROMPT + [{"role": "assistant", "content": "Hi."}, {"role": "user", "content": "And 3+3?"}]
    path = _write(tmp_path, [{"prompt": earlier, "chosen": CHOSEN, "rejected": REJECTED}], "pairs.json")
    path.write_text(json.dumps([{"prompt": earlier, "chosen": CHOSEN, "rejected": REJECTED}]), encoding="utf-8")
    pairs = load_pairs(path, ours, 128, 400)
    n_prompt = len(_hf_chat_ids(reference, earlier, add_generation_prompt=True))
    for key, completion in (("chosen", CHOSEN), ("rejected", REJECTED)):
        ids = _hf_chat_ids(reference, earlier + completion)
        tokens, labels = _expected_window(ids, n_prompt, 128, pad=reference.eos_token_id)
        np.testing.assert_array_equal(getattr(pairs, f"{key}_tokens")[0], tokens)
        np.testing.assert_array_equal(getattr(pairs, f"{key}_labels")[0], labels)
        # The earlier assistant turn ("Hi.") is prompt: not a target.
        assert (getattr(pairs, f"{key}_labels")[0] >= 0).sum() == len(ids) - n_prompt


def test_long_completions_are_cut_at_the_window(tmp_path, tokenizers):
    ours, _ = tokenizers
    pairs = load_pairs(_write(tmp_path, [{"prompt": "hi", "chosen": " x" * 40, "rejected": " no"}]), ours, 8, 400)
    assert pairs.truncated == 1 and (pairs.chosen_labels[0, 1:] >= 0).all()  # [0]: the prompt's second token


@pytest.mark.parametrize("row,message", [
    ({"prompt": "p", "chosen": "c"}, r"pairs.jsonl:2: missing \['rejected'\]; expected \{\"prompt\", \"chosen\", "
                                     r"\"rejected\"\}"),
    ({"chosen": "c", "rejected": "r"}, r"pairs.jsonl:2: no \"prompt\" \(an implicit-prompt pair\)"),
    ({"prompt": "p", "chosen": "c", "rejected": "r", "score": 1}, r"pairs.jsonl:2: unexpected \['score'\]"),
    ({"prompt": "p", "chosen": "", "rejected": "r"}, r"pairs.jsonl:2: \"chosen\" is empty"),
    ({"prompt": "p", "chosen": "c", "rejected": CHOSEN}, r"pairs.jsonl:2: expected .*; got prompt str, chosen str, "
                                                         r"rejected list"),
    ({"prompt": PROMPT, "chosen": PROMPT, "rejected": REJECTED}, r"pairs.jsonl:2: \"chosen\" has no assistant message"),
    ({"prompt": "word " * 30, "chosen": "c", "rejected": "r"}, r"pairs.jsonl:2: the prompt is \d+ tokens; the window "
                                                               r"\(24 tokens, the program's sequence length\) must hold "
                                                               r"it and at least one chosen token"),
    (["p", "c", "r"], r"pairs.jsonl:2: expected \{\"prompt\", \"chosen\", \"rejected\"\}"),
])
def test_bad_rows_are_refused_naming_the_row(tmp_path, tokenizers, row, message):
    ours, _ = tokenizers
    path = _write(tmp_path, [{"prompt": "p", "chosen": "c", "rejected": "r"}, row])
    with pytest.raises(DataError, match=message):
        load_pairs(path, ours, SEQ, 400)


def test_files_without_pairs_or_tokenizer_are_refused(tmp_path, tokenizers):
    ours, _ = tokenizers
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n", encoding="utf-8")
    with pytest.raises(DataError, match="no preference pairs"):
        load_pairs(empty, ours, SEQ, 400)
    with pytest.raises(DataError, match="carries none"):
        load_pairs(_write(tmp_path, [{"prompt": "p", "chosen": "c", "rejected": "r"}]), None, SEQ, 400)
    with pytest.raises(DataError, match="outside the model's vocabulary"):
        load_pairs(_write(tmp_path, [{"prompt": "p", "chosen": "c", "rejected": "r"}]), ours, SEQ, 10)


def test_dpo_from_the_command_line(tmp_path, bpe, capsys):  # noqa: F811
    """`vktrain export --objective dpo --grad-accum` of a GGUF carrying a tokenizer, then `vktrain train --data
    pairs.jsonl --grad-accum 2`: two pairs a step, the loss log 2 at the first step (the adapters start as the
    base: the policy is the reference), then away from it; a DPO export with --batch 2 is refused (exit 2)."""
    from test_tokenizer_data import _write_gguf
    from vktrain.cli import main

    model = tmp_path / "tiny.gguf"
    _write_gguf(model, bpe, "smollm", True, with_tensors=True)
    pte = tmp_path / "dpo.pte"
    common = ["export", "--model", str(model), "--lora-rank", "4", "--seq", "64", "--objective", "dpo",
              "--beta", "0.5", "--calibration-data", "none"]
    assert main(common + ["--batch", "2", "--out", str(pte)]) == 2
    assert "--objective dpo exports a training step" in capsys.readouterr().err
    assert main(common[:-4] + ["--beta", "0", "--calibration-data", "none", "--batch", "1", "--out", str(pte)]) == 2
    assert "--beta must be a finite number > 0" in capsys.readouterr().err
    assert main(common + ["--batch", "1", "--grad-accum", "--out", str(pte)]) == 0
    pairs = _write(tmp_path, [{"prompt": "hi", "chosen": " ok", "rejected": " no"},
                              {"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED}])
    records = tmp_path / "records.json"
    assert main(["train", str(pte), "--data", str(pairs), "--steps", "4", "--lr", "5e-2", "--no-progress",
                 "--grad-accum", "2", "--json", str(records)]) == 0
    losses = [record["loss"] for record in json.loads(records.read_text())]
    assert len(losses) == 4 and losses[0] == pytest.approx(np.log(2), rel=1e-6) and losses[2] != losses[0]


def test_simpo_and_its_preference_eval_from_the_command_line(tmp_path, bpe, capsys):  # noqa: F811
    """`vktrain export --objective simpo --grad-accum`, `vktrain train --data pairs.jsonl --grad-accum 2`, and
    `vktrain eval --data pairs.jsonl` before and after: the eval of the exported adapters is the mean of the
    pairs' losses, which is what the first step (two pairs, each divided by n_pairs 2) reports; the trained
    adapters win both pairs with a lower loss. Bad settings are refused naming the flag (exit 2)."""
    from test_tokenizer_data import _write_gguf
    from vktrain.cli import main

    model = tmp_path / "tiny.gguf"
    _write_gguf(model, bpe, "smollm", True, with_tensors=True)
    pte = tmp_path / "simpo.pte"
    common = ["export", "--model", str(model), "--lora-rank", "4", "--seq", "64", "--calibration-data", "none",
              "--batch", "1", "--out", str(pte)]
    for flags, message in ((["--objective", "simpo", "--beta", "0"], "--beta must be a finite number > 0"),
                           (["--objective", "simpo", "--gamma-beta-ratio", "-1"],
                            "--gamma-beta-ratio must be a finite number >= 0"),
                           (["--objective", "dpo", "--gamma-beta-ratio", "0.5"], "--gamma-beta-ratio is SimPO's"),
                           (["--objective", "orpo", "--gamma-beta-ratio", "0.5"], "--gamma-beta-ratio is SimPO's"),
                           (["--objective", "orpo", "--beta", "-0.1"], "--beta must be a finite number > 0"),
                           (["--beta", "2"], "--beta is DPO's, SimPO's and ORPO's; --objective is lm")):
        assert main(common + flags) == 2
        assert message in capsys.readouterr().err
    assert main(common + ["--objective", "simpo", "--beta", "2.0", "--gamma-beta-ratio", "0.25", "--grad-accum"]) == 0
    pairs = _write(tmp_path, [{"prompt": "hi", "chosen": " ok", "rejected": " no thanks"},
                              {"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED}])
    before, after, records = tmp_path / "before.json", tmp_path / "after.json", tmp_path / "records.json"
    assert main(["eval", str(pte), "--data", str(pairs), "--json", str(before)]) == 0
    assert "SimPO loss" in capsys.readouterr().out
    assert main(["train", str(pte), "--data", str(pairs), "--steps", "6", "--lr", "5e-2", "--no-progress",
                 "--grad-accum", "2", "--json", str(records), "--out-adapters", str(tmp_path / "adapters")]) == 0
    assert main(["eval", str(pte), "--data", str(pairs), "--adapters", str(tmp_path / "adapters"),
                 "--json", str(after)]) == 0
    losses = [record["loss"] for record in json.loads(records.read_text())]
    first, last = json.loads(before.read_text()), json.loads(after.read_text())
    assert first["objective"] == "simpo" and first["pairs"] == 2 and first["ties"] == 0
    assert first["loss"] == pytest.approx(losses[0], rel=1e-5)
    assert last["reward_accuracy"] == 1.0 and last["loss"] < first["loss"] / 2, (first, last)


def test_orpo_and_its_preference_eval_from_the_command_line(tmp_path, bpe, capsys):  # noqa: F811
    """`vktrain export --objective orpo --beta L --grad-accum` records ORPO (its inputs are SimPO's), `vktrain
    train` names it, and `vktrain eval --data pairs.jsonl` before and after: the first step's loss (two pairs,
    each divided by n_pairs 2) is the eval's mean; training on the pairs lowers the loss and wins both."""
    from test_tokenizer_data import _write_gguf
    from vktrain.cli import main

    model = tmp_path / "tiny.gguf"
    _write_gguf(model, bpe, "smollm", True, with_tensors=True)
    pte = tmp_path / "orpo.pte"
    assert main(["export", "--model", str(model), "--lora-rank", "4", "--seq", "64", "--calibration-data", "none",
                 "--batch", "1", "--out", str(pte), "--objective", "orpo", "--beta", "0.5", "--grad-accum"]) == 0
    pairs = _write(tmp_path, [{"prompt": "hi", "chosen": " ok", "rejected": " no thanks"},
                              {"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED}])
    before, after, records = tmp_path / "before.json", tmp_path / "after.json", tmp_path / "records.json"
    assert main(["eval", str(pte), "--data", str(pairs), "--json", str(before)]) == 0
    assert "ORPO loss" in capsys.readouterr().out
    assert main(["train", str(pte), "--data", str(pairs), "--steps", "6", "--lr", "5e-2", "--no-progress",
                 "--grad-accum", "2", "--json", str(records), "--out-adapters", str(tmp_path / "adapters")]) == 0
    assert "ORPO, 2 preference pair(s) a step" in capsys.readouterr().err
    assert main(["eval", str(pte), "--data", str(pairs), "--adapters", str(tmp_path / "adapters"),
                 "--json", str(after)]) == 0
    losses = [record["loss"] for record in json.loads(records.read_text())]
    first, last = json.loads(before.read_text()), json.loads(after.read_text())
    assert first["objective"] == "orpo" and first["pairs"] == 2 and first["ties"] == 0
    assert first["loss"] == pytest.approx(losses[0], rel=1e-5)
    assert last["reward_accuracy"] == 1.0 and last["loss"] < first["loss"] / 2, (first, last)
