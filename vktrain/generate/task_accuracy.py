"""Task accuracy of a training step's adapters (`vktrain eval STEP.pte --data CHATS.jsonl --generate`).

Each held-out chat is split at its last assistant turn: the messages before it, rendered with the chat
template the .pte carries (ending where the assistant's answer starts), are the prompt; the turn's
content is the reference. The answer is decoded greedily (argmax, the lowest id on ties) by the
prefill/decode program exported from the model the .pte holds (vktrain.generate.program_model: the
program's own q4gsw base, with the adapters evaluated), up to --max-new-tokens or the tokenizer's EOS.

Scores, per example:
* exact: the answer equals the reference, both stripped of surrounding whitespace;
* number: the last number of the answer is the last number of the reference within rounding, i.e. within
  half a unit of the reference's last printed digit ("64.696" -> +-0.0005, "28,800" -> +-0.5; exact
  decimal arithmetic). The bundled unit conversions end their answer with the result, so this says
  whether the result is right even when the wording is not. None for a reference without a number.
The accuracies are the fractions of examples scored right (number accuracy over the examples whose
reference has a number).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np

from vktrain.errors import VktrainError

PathLike = Union[str, os.PathLike]
# A decimal number as written in text: an optional minus, digits with optional thousands commas, a fraction.
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")


class TaskDataError(VktrainError, ValueError):
    """Held-out chats that cannot be scored (not chat rows, no assistant turn to compare against)."""


@dataclass(frozen=True)
class HeldOutChat:
    prompt: list[dict]  # the messages before the last assistant turn
    reference: str      # the last assistant turn's content
    where: str          # FILE:LINE, for messages


def read_chats(path: PathLike, limit: Optional[int] = None) -> list[HeldOutChat]:
    """The chats of a JSONL file of {"messages": [...]} rows (the first `limit` of them)."""
    path = Path(path)
    if not path.is_file():
        raise TaskDataError(f"--data {path} does not exist (or is not a file)")
    chats = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        if limit is not None and len(chats) == limit:
            break
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TaskDataError(f"{where}: not a JSON object ({exc})") from None
        messages = row.get("messages") if isinstance(row, dict) else None
        if not isinstance(messages, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                     and isinstance(m.get("content"), str) for m in messages):
            raise TaskDataError(f'{where}: --generate scores chats: expected {{"messages": [{{"role", "content"}}, '
                                f'...]}} with string roles and contents, got {line.strip()[:80]}')
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if not turns or turns[-1] == 0:
            raise TaskDataError(f"{where}: the chat needs an assistant turn after at least one message (the answer "
                                f"to compare against)")
        chats.append(HeldOutChat(messages[:turns[-1]], messages[turns[-1]]["content"], where))
    if not chats:
        raise TaskDataError(f"--data {path}: no chats in the file")
    return chats


def last_number(text: str) -> Optional[Decimal]:
    """The last number written in `text` (thousands commas dropped), None when it has none."""
    found = _NUMBER.findall(text)
    return Decimal(found[-1].replace(",", "")) if found else None


def number_within_rounding(answer: str, reference: str) -> Optional[bool]:
    """Whether the answer's last number is the reference's within half a unit of its last printed digit
    (module docstring); None when the reference has no number."""
    expected = last_number(reference)
    if expected is None:
        return None
    got = last_number(answer)
    if got is None:
        return False
    half_unit = Decimal(5).scaleb(expected.as_tuple().exponent - 1)  # "64.696": 5e-4
    return abs(got - expected) <= half_unit


def score(answer: str, reference: str) -> dict:
    return {"exact": answer.strip() == reference.strip(), "number": number_within_rounding(answer, reference)}


def accuracy(examples: Sequence[Mapping[str, Any]]) -> dict:
    """{"exact_match", "number_accuracy" (None without numbers), "examples", "with_number"} of scored examples."""
    numbered = [e["number"] for e in examples if e["number"] is not None]
    return {"exact_match": sum(e["exact"] for e in examples) / len(examples),
            "number_accuracy": sum(numbered) / len(numbered) if numbered else None,
            "examples": len(examples), "with_number": len(numbered)}


def evaluate_generation(program: PathLike, lora_state: Mapping[str, np.ndarray], tokenizer, chats: Sequence[HeldOutChat],
                        max_new_tokens: int, device, prefill_length: int = 32, max_binding_bytes: Optional[int] = None,
                        log=print) -> dict:
    """Greedy answers to `chats` by `program`'s model with `lora_state` on `device`, scored (module
    docstring): {"exact_match", "number_accuracy", ..., "results": [per example]}."""
    from vktrain.export.decode import export_generation, lower_generation
    from vktrain.generate.program_model import model_from_program
    from vktrain.generate.runner import GenerationRunner
    from vktrain.generate.sampling import Sampler
    from vktrain.serialization.pte import PteFile

    if max_new_tokens < 1:
        raise TaskDataError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if tokenizer is None or tokenizer.chat_template is None:
        raise TaskDataError(f"{program} carries no tokenizer with a chat template: --generate renders each held-out "
                            f"chat's prompt with it (export the step from a model that has one)")
    prompts = [tokenizer.encode(tokenizer.render_chat(chat.prompt, add_generation_prompt=True), False) for chat in chats]
    model = model_from_program(program, lora_state)
    cache_length = max(map(len, prompts)) + max_new_tokens
    if cache_length > model.config.max_seq_len:
        longest = max(range(len(chats)), key=lambda i: len(prompts[i]))
        raise TaskDataError(f"{chats[longest].where}: its prompt of {len(prompts[longest])} tokens + --max-new-tokens "
                            f"{max_new_tokens} exceed the model's {model.config.max_seq_len} positions")
    pte = PteFile.from_bytes(lower_generation(export_generation(model, min(prefill_length, cache_length), cache_length)),
                             source=f"the generation program of {program}")
    stop_ids = () if tokenizer.eos_token_id is None else (tokenizer.eos_token_id,)
    results = []
    with GenerationRunner(pte, device, max_binding_bytes=max_binding_bytes) as runner:
        for chat, prompt in zip(chats, prompts):
            generated = runner.generate(prompt, max_new_tokens, Sampler(), stop_ids)
            tokens = generated.tokens[:-1] if generated.tokens[-1] in stop_ids else generated.tokens
            answer = tokenizer.decode(tokens, skip_special_tokens=True).strip()
            result = {"where": chat.where, "reference": chat.reference, "answer": answer, "tokens": generated.tokens,
                      **score(answer, chat.reference)}
            results.append(result)
            mark = "exact" if result["exact"] else "number ok" if result["number"] else "wrong"
            log(f"  [{mark}] {answer!r} (expected {chat.reference!r})")
    return {**accuracy(results), "max_new_tokens": max_new_tokens, "results": results}


__all__ = ["HeldOutChat", "TaskDataError", "accuracy", "evaluate_generation", "last_number", "number_within_rounding",
           "read_chats", "score"]
