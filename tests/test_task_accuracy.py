"""`vktrain eval --generate`: greedy answers to held-out chats by the model a training .pte holds, scored
against their assistant turns. The reference is an eager greedy decode in torch of the same weights and
adapters (the full forward each token, no KV cache); the number rule is checked on written-out cases."""
from __future__ import annotations

import json
from decimal import Decimal

import numpy as np
import pytest
import torch

from vktrain.contract import EVAL_METHOD, TRAIN_METHOD
from vktrain.export import export_training_and_eval_steps, lower_methods_to_pte
from vktrain.export.training import adapter_metadata_specs
from vktrain.generate.task_accuracy import TaskDataError, last_number, number_within_rounding, read_chats
from vktrain.lora import LoRAConfig, apply_lora, lora_modules
from vktrain.models import build_model
from vktrain.partitioner import VktrainPartitioner
from vktrain.train.adapters import adapters_from_state, save_adapters
from vktrain.serialization.tokenizer import ModelTokenizer

LORA_ALPHA = 8.0
NEWLINE = 10  # the byte tokenizer's EOS: a chat turn ends with it
TEMPLATE = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}a:{% endif %}")
MAX_NEW = 10


def _byte_tokenizer() -> ModelTokenizer:
    """256 byte tokens (id = byte), a chat template, EOS the newline byte: the tiny model's vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda c: _byte_of(c))
    backend = Tokenizer(models.BPE({char: _byte_of(char) for char in alphabet}, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return ModelTokenizer(backend, {"eos_token": _char_of(NEWLINE)}, TEMPLATE, source="byte tokenizer")


def _byte_table() -> dict[int, str]:
    from vktrain.serialization.tokenizer import _bytes_to_unicode  # GPT-2's byte <-> printable character table

    return _bytes_to_unicode()


def _byte_of(char: str) -> int:
    return {c: b for b, c in _byte_table().items()}[char]


def _char_of(byte: int) -> str:
    return _byte_table()[byte]


@pytest.fixture(scope="module")
def step(tmp_path_factory):
    """A tiny-llama training .pte carrying the byte tokenizer, and its model."""
    torch.manual_seed(0)
    model = build_model("tiny-llama", max_seq_len=64)
    apply_lora(model, LoRAConfig(rank=4, alpha=LORA_ALPHA, group_size=32, seed=0))
    tokenizer = _byte_tokenizer()
    assert tokenizer.encode("a:\n", False) == [ord("a"), ord(":"), NEWLINE]
    methods = dict(zip((TRAIN_METHOD, EVAL_METHOD), export_training_and_eval_steps(model, (1, 16))))
    partitioner = VktrainPartitioner(compile_specs=adapter_metadata_specs(model, "tiny-llama"))
    path = tmp_path_factory.mktemp("task") / "step.pte"
    path.write_bytes(lower_methods_to_pte(methods, {TRAIN_METHOD: partitioner}, named_data=tokenizer.to_named_data()))
    return path, model, tokenizer


def _eager_greedy(model, prompt: list[int]) -> tuple[list[int], float]:
    """(new ids up to MAX_NEW or the EOS, the smallest top-1 / top-2 logit gap on the way)."""
    ids, margin = list(prompt), float("inf")
    with torch.no_grad():
        for _ in range(MAX_NEW):
            logits = model(torch.tensor([ids]))[0, -1].double()
            top = torch.topk(logits, 2).values
            margin = min(margin, float(top[0] - top[1]))
            ids.append(int(torch.argmax(logits)))
            if ids[-1] == NEWLINE:
                break
    return ids[len(prompt):], margin


def test_generate_scores_the_greedy_answers_of_the_adapted_model(step, tmp_path, vk_device, capsys):
    from vktrain.cli import build_parser
    from vktrain.train.eval_command import run_eval

    path, model, tokenizer = step
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():  # adapters other than the .pte's initial ones (lora_B = 0): --adapters must apply
        for adapter in lora_modules(model).values():
            adapter.lora_B.copy_(0.3 * torch.randn(adapter.lora_B.shape, generator=generator))
    state = {f"model.{name}.{part}": getattr(layer, part).detach().numpy().copy()
             for name, layer in lora_modules(model).items() for part in ("lora_A", "lora_B")}
    save_adapters(tmp_path / "adapters", adapters_from_state(state), LORA_ALPHA)

    chats, answers = [], []
    for question in ("hi", "what is 2+2?", "name a colour", "count to 3", "ok?", "why", "tell me more"):
        prompt = tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": question}], True), False)
        new, margin = _eager_greedy(model, prompt)
        if margin > 1e-3:  # fp32 on the device and in torch pick the same token only away from near-ties
            answers.append(tokenizer.decode(new[:-1] if new[-1] == NEWLINE else new, skip_special_tokens=True))
            chats.append(question)
        if len(chats) == 3:
            break
    assert len(chats) == 3
    for adapter in lora_modules(model).values():
        adapter.adapter_enabled = False
    base_answers = [_eager_greedy(model, tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": q}], True),
                                                          False))[0] for q in chats]
    for adapter in lora_modules(model).values():
        adapter.adapter_enabled = True
    assert base_answers != [tokenizer.encode(a, False) for a in answers]  # the adapters change what is said
    assert max(map(len, answers)) >= 3
    references = answers[:2] + [answers[2] + " (not what the model says)"]
    data = tmp_path / "held_out.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": r}]})
                            + "\n" for q, r in zip(chats, references)))

    args = build_parser().parse_args(["eval", str(path), "--data", str(data), "--generate", "--max-new-tokens",
                                      str(MAX_NEW), "--adapters", str(tmp_path / "adapters"), "--json",
                                      str(tmp_path / "accuracy.json")])
    assert run_eval(args, vk_device) == 0
    report = json.loads((tmp_path / "accuracy.json").read_text())
    assert [r["answer"] for r in report["results"]] == [a.strip() for a in answers]
    assert [r["exact"] for r in report["results"]] == [True, True, False]
    assert report["exact_match"] == pytest.approx(2 / 3) and report["examples"] == 3
    out = capsys.readouterr().out
    assert "exact match 66.7% of 3 chat(s)" in out


@pytest.mark.parametrize("answer,reference,expected", [
    ("4.2 kilometers = 4,200 meters.", "4.2 kilometers = 4,200 meters.", True),
    ("4.2 kilometers = 4200.4 meters.", "4.2 kilometers = 4,200 meters.", True),    # within 0.5 of 4,200
    ("4.2 kilometers = 4,201 meters.", "4.2 kilometers = 4,200 meters.", False),
    ("= 64.6964 km", "40.2 miles = 64.696 kilometers.", True),                        # within 0.0005
    ("= 64.7 km", "40.2 miles = 64.696 kilometers.", False),
    ("-5 degrees", "23 degrees Fahrenheit = -5 degrees Celsius.", True),
    ("5 degrees", "23 degrees Fahrenheit = -5 degrees Celsius.", False),
    ("about eleven thousand", "4.2 kilometers = 11,200 meters.", False),
    ("11,200", "no number here", None),
])
def test_the_number_is_right_within_half_a_unit_of_the_references_last_digit(answer, reference, expected):
    assert number_within_rounding(answer, reference) is expected


def test_numbers_parse_with_thousands_commas_and_fractions():
    assert last_number("17 megabytes = 17,000 kilobytes.") == Decimal("17000")
    assert last_number("238 gallons = 900.928 liters.") == Decimal("900.928")
    assert last_number("none") is None


def test_chats_without_an_answer_to_compare_are_refused_naming_the_row(tmp_path):
    data = tmp_path / "chats.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}\n'
                    '{"messages": [{"role": "user", "content": "only a question"}]}\n')
    with pytest.raises(TaskDataError, match=r"chats.jsonl:2: the chat needs an assistant turn"):
        read_chats(data)
    assert [chat.reference for chat in read_chats(data, limit=1)] == ["a"]
    data.write_text('{"text": "a document"}\n')
    with pytest.raises(TaskDataError, match=r"chats.jsonl:1: --generate scores chats"):
        read_chats(data)


def test_generate_flags_are_checked_before_anything_runs(step, tmp_path, capsys):
    from vktrain import cli

    path = str(step[0])
    assert cli.main(["eval", path, "--data", "x.jsonl", "--max-examples", "2"]) == 2
    assert "--max-examples applies to --generate" in capsys.readouterr().err
    assert cli.main(["eval", path, "--data", "x.jsonl", "--generate", "--max-new-tokens", "0"]) == 2
    assert "--max-new-tokens must be >= 1" in capsys.readouterr().err
    assert cli.main(["eval", path, "--data", "x.jsonl", "--generate", "--max-batches", "1"]) == 2
    assert "--inputs and --max-batches belong to the loss" in capsys.readouterr().err


def test_a_program_without_a_chat_template_is_refused_naming_it(step, tmp_path, vk_device):
    from vktrain.cli import build_parser
    from vktrain.train.eval_command import run_eval

    path, model, _ = step
    bare = tmp_path / "bare.pte"  # the same step without the tokenizer's named data
    methods = dict(zip((TRAIN_METHOD, EVAL_METHOD), export_training_and_eval_steps(model, (1, 16))))
    bare.write_bytes(lower_methods_to_pte(methods, {TRAIN_METHOD: VktrainPartitioner(
        compile_specs=adapter_metadata_specs(model, "tiny-llama"))}))
    data = tmp_path / "chats.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}\n')
    args = build_parser().parse_args(["eval", str(bare), "--data", str(data), "--generate"])
    with pytest.raises(TaskDataError, match=r"bare.pte carries no tokenizer with a chat template"):
        run_eval(args, vk_device)
