"""Preference pairs for DPO, SimPO and ORPO, in TRL's preference format with an explicit prompt, read into fixed
windows.

A pairs file holds one JSON object per line (*.jsonl) or one JSON array of them (*.json), each either
    {"prompt": "text", "chosen": "text", "rejected": "text"}                       (standard)
    {"prompt": [messages], "chosen": [messages], "rejected": [messages]}           (conversational)
with messages as in chat data ({"role", "content"}); a conversational completion holds the assistant turn(s)
that follow the prompt. TRL's implicit-prompt rows ({"chosen", "rejected"} only) are refused: the prompt
must be given apart, since DPO, SimPO and ORPO compare the log-probabilities of the completions alone.

Tokens (the model's tokenizer, as `vktrain train --data` reads documents and chats): a standard row is
the prompt encoded as a document's text is (with the tokenizer's BOS where it adds one), then the
completion encoded without special tokens and ended with EOS; a conversational row is the chat template's
rendering of prompt + completion, whose completion tokens are the assistant turns' tokens past the prompt
rendered with its generation prompt. Each side of a pair becomes one window of S tokens: tokens[s] and
labels[s] = the token at s + 1 when it is a completion token, else -100 (the prompt, the padding); a
completion running past the window is cut there (`PreferencePairs.truncated` counts the sides cut).

Refused, naming the row (file:line, or file[index] in a .json array) and what was expected: a row that is
not an object with exactly the keys prompt / chosen / rejected of one kind (all text or all messages), an
empty prompt or completion (one with no assistant message), a prompt that leaves no room in the window
for one completion token, token ids outside the vocabulary, a file with no pair.

`vktrain train --data pairs.jsonl [--grad-accum N]` on a step exported with `--objective dpo|simpo|orpo` trains on
pair_batches: N pairs a step (the accumulate method N - 1 times, then the step), in file order, cycled.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import numpy as np

from vktrain.contract import (CHOSEN_IDS, CHOSEN_LABELS, CHOSEN_LENGTH, METADATA_OBJECTIVE, N_PAIRS, OBJECTIVE_DPO,
                              OBJECTIVE_ORPO, OBJECTIVE_SIMPO, PREFERENCE_INPUTS, REJECTED_IDS, REJECTED_LABELS,
                              REJECTED_LENGTH)
from vktrain.train.data import IGNORED_LABEL, JSON_SUFFIX, DataError, PathLike, check_vocab
from vktrain.train.input_data import ArrayBatches

if TYPE_CHECKING:
    from vktrain.serialization.tokenizer import ModelTokenizer

PAIR_KEYS = ("prompt", "chosen", "rejected")
COMPLETIONS = ("chosen", "rejected")


@dataclass(frozen=True)
class PreferencePairs:
    """N pairs as windows: chosen / rejected tokens and labels, int64 [N, S] each (module docstring)."""
    chosen_tokens: np.ndarray
    chosen_labels: np.ndarray
    rejected_tokens: np.ndarray
    rejected_labels: np.ndarray
    truncated: int  # completions cut at the window's end

    def __len__(self) -> int:
        return self.chosen_tokens.shape[0]


def _rows(path: Path):
    """(where, row) of every row of a .jsonl or .json pairs file."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: a pairs file is UTF-8 JSON ({exc})") from None
    if path.suffix.lower() == JSON_SUFFIX:
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(rows, list):
            raise DataError(f"{path}: a .json pairs file holds one array of {{\"prompt\", \"chosen\", \"rejected\"}} "
                            f"objects, got a JSON {type(rows).__name__}")
        yield from ((f"{path}[{index}]", row) for index, row in enumerate(rows))
        return
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                yield f"{path}:{number}", json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{number}: not a JSON object ({exc})") from None


def _check_row(row, where: str) -> bool:
    """Whether the row is conversational (messages) rather than standard (text); DataError when it is neither."""
    expected = '{"prompt", "chosen", "rejected"}, each a string or each a list of {"role", "content"} messages'
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected {expected}, got {json.dumps(row)[:80]}")
    missing = [key for key in PAIR_KEYS if key not in row]
    if missing == ["prompt"]:
        raise DataError(f"{where}: no \"prompt\" (an implicit-prompt pair); give the prompt apart from the "
                        f"completions: {expected}")
    if missing or set(row) - set(PAIR_KEYS):
        what = f"missing {missing}" if missing else f"unexpected {sorted(set(row) - set(PAIR_KEYS))}"
        raise DataError(f"{where}: {what}; expected {expected}")
    kinds = {key: str if isinstance(row[key], str) else list if isinstance(row[key], list) else None
             for key in PAIR_KEYS}
    if None in kinds.values() or len(set(kinds.values())) != 1:
        found = ", ".join(f"{key} {type(row[key]).__name__}" for key in PAIR_KEYS)
        raise DataError(f"{where}: expected {expected}; got {found}")
    for key in PAIR_KEYS:
        if not row[key] or (isinstance(row[key], str) and not row[key].strip()):
            raise DataError(f"{where}: \"{key}\" is empty; a pair needs a prompt and two non-empty completions")
        for i, message in enumerate(row[key] if kinds[key] is list else ()):
            if not (isinstance(message, dict) and isinstance(message.get("role"), str) and "content" in message):
                raise DataError(f"{where}: {key}[{i}] must be an object with a string \"role\" and a \"content\", "
                                f"got {str(message)[:80]}")
    if kinds["chosen"] is list:
        for key in COMPLETIONS:
            if not any(message["role"] == "assistant" for message in row[key]):
                raise DataError(f"{where}: \"{key}\" has no assistant message (its completion is the assistant "
                                f"turn(s) after the prompt)")
    return kinds["prompt"] is list


def _text_side(tokenizer: "ModelTokenizer", prompt: str, completion: str, where: str) -> tuple[list[int], int]:
    """(token ids of prompt + completion, number of prompt tokens) of a standard row."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError(f"{where}: the tokenizer ({tokenizer.source}) has no EOS token to end completions with")
    prompt_ids = tokenizer.encode(prompt)
    completion_ids = tokenizer.encode(completion, add_special_tokens=False)
    if not completion_ids or completion_ids[-1] != eos:
        completion_ids.append(eos)
    return prompt_ids + completion_ids, len(prompt_ids)


def _chat_side(tokenizer: "ModelTokenizer", prompt: list, completion: list, where: str
               ) -> tuple[list[int], list[bool], int]:
    """(token ids of the rendered prompt + completion, which are assistant tokens, number of prompt tokens)."""
    from vktrain.serialization.tokenizer import TokenizerError

    try:
        ids, trained = tokenizer.encode_chat(prompt + completion)
        rendered_prompt = tokenizer.render_chat(prompt, add_generation_prompt=True)
    except TokenizerError as exc:
        raise DataError(f"{where}: {exc}") from None
    prompt_length = len(tokenizer.backend.encode(rendered_prompt, add_special_tokens=False).ids)
    return ids, trained, prompt_length


def _window(ids: list[int], targets: list[bool], seq_len: int, pad: int) -> tuple[np.ndarray, np.ndarray, bool]:
    """(tokens [S], labels [S], whether the sequence was cut) of one side: labels[s] = ids[s + 1] where that
    token is a target, -100 elsewhere and on padding."""
    tokens = np.full(seq_len, pad, np.int64)
    labels = np.full(seq_len, IGNORED_LABEL, np.int64)
    kept = min(len(ids), seq_len + 1)
    tokens[:min(kept, seq_len)] = ids[:min(kept, seq_len)]
    for s in range(kept - 1):
        if targets[s + 1]:
            labels[s] = ids[s + 1]
    return tokens, labels, len(ids) > seq_len + 1


def load_pairs(path: PathLike, tokenizer: Optional["ModelTokenizer"], seq_len: int, vocab_size: int) -> PreferencePairs:
    """The pairs of a TRL preference file as windows of `seq_len` tokens (module docstring)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"pairs file {path} does not exist (or is not a file)")
    if tokenizer is None:
        raise DataError(f"{path}: preference pairs are text or chats, tokenized with the model's tokenizer, but this "
                        f"program carries none (export it from the model's Hugging Face directory or GGUF file)")
    if seq_len < 2:
        raise DataError(f"{path}: a window of {seq_len} token(s) cannot hold a prompt and a completion")
    sides: dict[str, list] = {key: [] for key in COMPLETIONS}
    truncated = 0
    pad = tokenizer.eos_token_id or 0
    for where, row in _rows(path):
        conversational = _check_row(row, where)
        for key in COMPLETIONS:
            if conversational:
                ids, trained, prompt_length = _chat_side(tokenizer, row["prompt"], row[key], where)
                targets = [t and i >= prompt_length for i, t in enumerate(trained)]
            else:
                ids, prompt_length = _text_side(tokenizer, row["prompt"], row[key], where)
                targets = [i >= prompt_length for i in range(len(ids))]
            if prompt_length >= seq_len + 1 or not any(targets[:seq_len + 1]):
                raise DataError(f"{where}: the prompt is {prompt_length} tokens; the window ({seq_len} tokens, the "
                                f"program's sequence length) must hold it and at least one {key} token")
            tokens, labels, cut = _window(ids, targets, seq_len, pad)
            truncated += cut
            sides[key].append((tokens, labels))
    if not sides["chosen"]:
        raise DataError(f"{path}: no preference pairs in the file")
    pairs = PreferencePairs(*(np.stack([side[i] for side in sides[key]]) for key in COMPLETIONS for i in (0, 1)),
                            truncated=truncated)
    for name in ("chosen_tokens", "rejected_tokens"):
        check_vocab(getattr(pairs, name).reshape(-1), vocab_size, f"{path} ({name})")
    return pairs


def pair_batches(pairs: PreferencePairs, specs, source: str, pairs_per_step: int = 1) -> ArrayBatches:
    """The ArrayBatches of a preference step (contract.PREFERENCE_INPUTS): pair t of the file (cycled) at
    batch position t, n_pairs = pairs_per_step (the loss's divisor: train's grad_accum runs that many
    positions a step); a SimPO or ORPO step's completion lengths too (the number of each side's targets)."""
    arrays = {CHOSEN_IDS: pairs.chosen_tokens, CHOSEN_LABELS: pairs.chosen_labels, REJECTED_IDS: pairs.rejected_tokens,
              REJECTED_LABELS: pairs.rejected_labels}
    stacked = {name: array[:, None, :] for name, array in arrays.items()}  # [N, 1, S]: one pair a batch
    if CHOSEN_LENGTH in specs:
        stacked[CHOSEN_LENGTH] = (pairs.chosen_labels >= 0).sum(axis=1).astype(np.float32)  # [N]
        stacked[REJECTED_LENGTH] = (pairs.rejected_labels >= 0).sum(axis=1).astype(np.float32)
    batches = ArrayBatches({**stacked, N_PAIRS: np.float32(pairs_per_step)}, specs, source)
    batches.accumulates = True
    return batches


OBJECTIVE_NAMES = {OBJECTIVE_DPO: "DPO", OBJECTIVE_SIMPO: "SimPO", OBJECTIVE_ORPO: "ORPO"}


def preference_objective(runner) -> Optional[str]:
    """contract's OBJECTIVE_DPO / _SIMPO / _ORPO when the step takes that objective's pair inputs, else None;
    SimPO and ORPO, whose inputs are alike, told apart by the objective the blob records."""
    names = set(getattr(runner, "input_specs", ()))
    matching = [objective for objective, inputs in PREFERENCE_INPUTS.items() if names == set(inputs)]
    if len(matching) > 1:
        metadata = getattr(getattr(runner, "graph", None), "metadata", None) or {}
        try:
            recorded = json.loads(metadata.get(METADATA_OBJECTIVE, "{}")).get("objective")
        except (ValueError, AttributeError):
            recorded = None
        if recorded in matching:
            return recorded
    return matching[0] if matching else None


def load_program_pairs(runner, path: PathLike, program: str) -> tuple[PreferencePairs, int]:
    """(the pairs of `path` in the windows of `runner`'s preference step, its window length), tokenized with
    the tokenizer the .pte carries and checked against its vocabulary."""
    from vktrain.serialization.tokenizer import program_tokenizer

    seq_len = runner.input_specs[CHOSEN_IDS].shape[1]
    limits = runner.executor.index_limits
    vocab = min(limits[name] for name in (CHOSEN_IDS, REJECTED_IDS) if name in limits)
    return load_pairs(path, program_tokenizer(runner, program), seq_len, vocab), seq_len


__all__ = ["COMPLETIONS", "OBJECTIVE_NAMES", "PAIR_KEYS", "PreferencePairs", "load_pairs", "load_program_pairs",
           "pair_batches", "preference_objective"]
