"""The runtime's tokenizer (vktrain.serialization.tokenizer) and text / chat data (vktrain.train.data) against
transformers: a GGUF-vocabulary tokenizer and a Hugging Face tokenizer.json encode token for token as
transformers' own tokenizers from the same files, chats render and tokenize as apply_chat_template, only
assistant tokens get labels, and a .pte exported from a Hugging Face directory carries its tokenizer so
`vktrain train` reads text. Every tokenizer is trained here (no network)."""
from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import transformers
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from vktrain.contract import NAMED_DATA_TOKENIZER_CONFIG, NAMED_DATA_TOKENIZER_JSON
from vktrain.train.data import DataError, TokenBatcher, load_data
from vktrain.serialization.tokenizer import ModelTokenizer, TokenizerError

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = "<think>"  # an added token that is not special (GGUF token type 4)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are tiny.<|im_end|>\n' }}"
    "{% endif %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CORPUS = ["The quick brown fox jumps over the lazy dog.", "Hello world! 12345 and 678.", "ünïcödé text, 日本語",
          "def f(x):\n    return x ** 2  # squares\n", "What is two plus two? Four.", "I think, therefore I am."] * 4
TEXTS = ["Hello world! 12345", "  leading spaces and\ttabs\r\nCRLF", "ünïcödé 日本語 🤖 unseen bytes",
         "<|im_start|>user\nhi<|im_end|> <think>ok</think>", "numbers 1234567 x<|endoftext|>y", ""]
CHAT = [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "Four."},
        {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "Six, I think."}]


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    """A byte-level BPE trained on CORPUS: ids 0-2 the special tokens, then bytes and merges, then <think>."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=360, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tokenizer.add_tokens([AddedToken(USER_DEFINED, normalized=False, special=False)])
    return tokenizer


def _write_gguf(path, bpe: Tokenizer, pre: str, add_bos: bool, with_tensors: bool = False) -> None:
    """A GGUF holding `bpe` as llama.cpp's converter writes a gpt2 vocabulary (with_tensors: and the
    float32 tensors of a one-layer model of width 32, tied head, so vktrain.models.load reads it)."""
    vocab = bpe.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    merges = json.loads(bpe.to_str())["model"]["merges"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(32)
    writer.add_block_count(1)
    writer.add_feed_forward_length(64)
    writer.add_head_count(2)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 4 if t == USER_DEFINED else 1 for t in tokens])
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(CHAT_TEMPLATE)
    if with_tensors:
        rng = np.random.default_rng(0)
        shapes = {"token_embd.weight": (len(tokens), 32), "output_norm.weight": (32,), "blk.0.attn_norm.weight": (32,),
                  "blk.0.ffn_norm.weight": (32,), "blk.0.ffn_gate.weight": (64, 32), "blk.0.ffn_up.weight": (64, 32),
                  "blk.0.ffn_down.weight": (32, 64),
                  **{f"blk.0.attn_{name}.weight": (32, 32) for name in ("q", "k", "v", "output")}}
        for name, shape in shapes.items():
            writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _gguf_vocab(path) -> tuple[dict, str]:
    reader = gguf.GGUFReader(str(path))
    fields = {name: f.contents() for name, f in reader.fields.items()}
    vocab = {k.removeprefix("tokenizer.ggml."): v for k, v in fields.items() if k.startswith("tokenizer.ggml.")}
    return vocab, fields["tokenizer.chat_template"]


def _hf_chat_ids(reference, messages, **kwargs) -> list[int]:
    out = reference.apply_chat_template(messages, tokenize=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _reference_trained(reference, messages) -> list[bool]:
    """Assistant turn i = the tokens between the rendering of messages[:i] + generation prompt and that of
    messages[:i + 1], counted in transformers' own tokenizations."""
    trained = [False] * len(_hf_chat_ids(reference, messages))
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            lo = len(_hf_chat_ids(reference, messages[:i], add_generation_prompt=True))
            hi = len(_hf_chat_ids(reference, messages[:i + 1]))
            trained[lo:hi] = [True] * (hi - lo)
    return trained


def _assert_same_tokenizer(ours: ModelTokenizer, reference) -> None:
    for text in TEXTS + CORPUS[:6]:
        assert ours.encode(text) == reference(text)["input_ids"], text
    assert ours.render_chat(CHAT, add_generation_prompt=True) == \
        reference.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    ids, trained = ours.encode_chat(CHAT)
    assert ids == _hf_chat_ids(reference, CHAT)
    assert trained == _reference_trained(reference, CHAT)
    assert ours.decode([i for i, t in zip(ids, trained) if t]) == "Four.<|im_end|>\nSix, I think.<|im_end|>\n"


@pytest.mark.parametrize("pre, add_bos", [("smollm", False), ("llama-bpe", True)])
def test_gguf_vocabulary_tokenizer_encodes_as_transformers(tmp_path, bpe, pre, add_bos):
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, bpe, pre, add_bos)
    vocab, template = _gguf_vocab(path)
    ours = ModelTokenizer.from_gguf_metadata(vocab, template, source=str(path))
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    _assert_same_tokenizer(ours, reference)
    assert (ours.bos_token_id, ours.eos_token_id) == (0, 2)
    assert (ours.encode("Hello")[0] == 0) == add_bos
    # The named-data copy a .pte carries encodes the same.
    again = ModelTokenizer.from_named_data(ours.to_named_data(), "step.pte")
    assert [again.encode(t) for t in TEXTS] == [ours.encode(t) for t in TEXTS]
    assert (again.chat_template, again.special_tokens) == (ours.chat_template, ours.special_tokens)


def test_models_load_of_a_gguf_builds_the_tokenizer_export_embeds(tmp_path, bpe):
    from vktrain.models import load

    path = tmp_path / "model.gguf"
    _write_gguf(path, bpe, "smollm", False, with_tensors=True)
    built = load(path).tokenizer.build()
    direct = ModelTokenizer.from_gguf_metadata(*_gguf_vocab(path))
    assert built.source == str(path)
    assert built.to_named_data() == direct.to_named_data()
    assert [built.encode(t) for t in TEXTS] == [direct.encode(t) for t in TEXTS]


def _write_sentencepiece_gguf(path, add_bos) -> None:
    """A SentencePiece-style ("llama") GGUF vocabulary: <unk> <s> </s>, the 256 byte tokens, then pieces
    of a BPE trained with "▁" for spaces, scored best first (as llama.cpp writes Llama 2's)."""
    tokenizer = Tokenizer(models.BPE(byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tokenizer.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=200, show_progress=False))
    vocab = tokenizer.get_vocab()
    pieces = sorted(vocab, key=vocab.get)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(pieces))
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    writer.add_chat_template("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}"
                             "{{ eos_token }}{% endfor %}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("add_bos", [None, False])  # None: the file says nothing, and BOS is added
def test_sentencepiece_gguf_vocabulary_tokenizer_encodes_as_transformers(tmp_path, add_bos):
    path = tmp_path / "sp.gguf"
    _write_sentencepiece_gguf(path, add_bos)
    vocab, template = _gguf_vocab(path)
    ours = ModelTokenizer.from_gguf_metadata(vocab, template, source=str(path))
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in TEXTS + CORPUS[:6] + ["hello  world", " x", "a\nb"]:
        assert ours.encode(text) == reference(text)["input_ids"], text
        ids = reference(text)["input_ids"]
        assert ours.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)
    assert (ours.encode("hi")[0] == 1) == (add_bos is None)
    chat = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "the fox"}]
    assert ours.encode_chat(chat)[0] == _hf_chat_ids(reference, chat)


def test_other_gguf_vocabularies_are_refused_naming_what_is_supported():
    with pytest.raises(TokenizerError, match=r"x.gguf: tokenizer.ggml.model 't5' is not supported; supported: "
                                             r"gpt2, llama"):
        ModelTokenizer.from_gguf_metadata({"model": "t5", "tokens": ["<unk>"]}, source="x.gguf")
    with pytest.raises(TokenizerError, match="needs tokenizer.ggml.scores"):
        ModelTokenizer.from_gguf_metadata({"model": "llama", "tokens": ["<unk>"]}, source="x.gguf")


def _hf_tokenizer_dir(tmp_path, bpe: Tokenizer, add_bos: bool):
    reference = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe.__class__.from_str(bpe.to_str()),
                                                     bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                                     add_bos_token=add_bos)
    reference.chat_template = CHAT_TEMPLATE
    reference.save_pretrained(tmp_path)
    return transformers.AutoTokenizer.from_pretrained(tmp_path)


@pytest.mark.parametrize("add_bos", [False, True])
def test_hf_tokenizer_json_encodes_as_transformers(tmp_path, bpe, add_bos):
    reference = _hf_tokenizer_dir(tmp_path, bpe, add_bos)
    ours = _ours_from_directory(tmp_path)
    _assert_same_tokenizer(ours, reference)
    assert (ours.encode("Hello")[0] == 0) == add_bos


def test_text_documents_are_packed_with_eos(tmp_path, bpe):
    reference = _hf_tokenizer_dir(tmp_path / "tok", bpe, add_bos=True)
    ours = ModelTokenizer.from_named_data(_named(tmp_path / "tok"), "step.pte")
    eos = reference.eos_token_id
    text = tmp_path / "notes.txt"
    text.write_text(CORPUS[0] + "\n\n" + CORPUS[1], encoding="utf-8")
    data = load_data(text, 400, ours)  # one file, one document (blank lines stay inside it)
    assert data.labels is None
    assert data.tokens.tolist() == reference(text.read_text(encoding="utf-8"))["input_ids"] + [eos]
    rows = tmp_path / "docs.jsonl"
    rows.write_text("\n".join(json.dumps({"text": t}) for t in CORPUS[:3]) + "\n\n", encoding="utf-8")
    data = load_data(rows, 400, ours)
    assert data.tokens.tolist() == sum((reference(t)["input_ids"] + [eos] for t in CORPUS[:3]), [])
    assert data.tokens[0] == reference.bos_token_id  # the tokenizer's own BOS starts each document
    with pytest.raises(DataError, match="outside the model's vocabulary"):
        load_data(rows, 100, ours)


def _named(directory) -> dict:
    """The named data export would write for the tokenizer saved in `directory`."""
    return _ours_from_directory(directory).to_named_data()


def _ours_from_directory(directory) -> ModelTokenizer:
    from vktrain.models.loading import hf_tokenizer_info

    return hf_tokenizer_info(directory, {}).build()


def test_chat_rows_train_only_assistant_tokens(tmp_path, bpe):
    reference = _hf_tokenizer_dir(tmp_path / "tok", bpe, add_bos=False)
    ours = ModelTokenizer.from_named_data(_named(tmp_path / "tok"), "step.pte")
    other = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
             {"role": "assistant", "content": "hello"}]
    rows = tmp_path / "chat.jsonl"
    rows.write_text("\n".join(json.dumps(r) for r in ({"messages": CHAT}, {"text": "plain"}, {"messages": other})),
                    encoding="utf-8")
    data = load_data(rows, 400, ours)
    expected_ids, expected_labels = [], []
    for messages in (CHAT, other):
        ids = _hf_chat_ids(reference, messages)
        expected_ids += ids
        expected_labels += [i if t else -100 for i, t in zip(ids, _reference_trained(reference, messages))]
        if messages is CHAT:
            plain = reference("plain")["input_ids"] + [reference.eos_token_id]
            expected_ids += plain
            expected_labels += plain
    assert data.tokens.tolist() == expected_ids and data.labels.tolist() == expected_labels
    assert data.trained_tokens == sum(label >= 0 for label in expected_labels)
    # Batches: labels are the label stream's next position; windows with no target are left out.
    seq = 4
    batcher = TokenBatcher(data.tokens, 2, seq, labels=data.labels, shuffle=False)
    windows = (data.tokens.size - 1) // seq
    useful = [w for w in range(windows) if any(label >= 0 for label in expected_labels[w * seq + 1:w * seq + seq + 1])]
    assert batcher.n_windows == len(useful) < windows
    tokens, labels = batcher.batch(0)
    for row, w in enumerate(useful[:2]):
        assert tokens[row].tolist() == expected_ids[w * seq:w * seq + seq]
        assert labels[row].tolist() == expected_labels[w * seq + 1:w * seq + seq + 1]
    # The masks are part of what a checkpoint's data must match.
    assert batcher.fingerprint != TokenBatcher(data.tokens, 2, seq, shuffle=False).fingerprint


def test_bad_rows_and_missing_tokenizer_are_refused(tmp_path, bpe):
    ours = ModelTokenizer.from_gguf_metadata(*_tiny_gguf_vocab(tmp_path, bpe))
    rows = tmp_path / "bad.jsonl"
    cases = ((json.dumps({"msgs": []}), r'bad.jsonl:1: expected \{"text": string\}'),
             ("{not json", "bad.jsonl:1: not a JSON object"),
             (json.dumps({"messages": [{"content": "x"}]}), r'messages\[0\] must be an object with a string "role"'),
             (json.dumps({"messages": [{"role": "user", "content": "x"}]}), "has no assistant message"))
    for line, message in cases:
        rows.write_text(line, encoding="utf-8")
        with pytest.raises(DataError, match=message):
            load_data(rows, 400, ours)
    rows.write_text(json.dumps({"messages": CHAT}), encoding="utf-8")
    with pytest.raises(DataError, match="rendered with the model's chat template, but this program carries no "
                                        "tokenizer"):
        load_data(rows, 256, None)  # without a tokenizer only {"text"} rows are read, as bytes
    no_template = ModelTokenizer(ours.backend, ours.special_tokens, None, source="step.pte")
    rows.write_text(json.dumps({"messages": CHAT}), encoding="utf-8")
    with pytest.raises(DataError, match="step.pte has no chat template"):
        load_data(rows, 400, no_template)
    with pytest.raises(TokenizerError, match="named data 'vktrain.tokenizer_config.json' is missing"):
        ModelTokenizer.from_named_data({NAMED_DATA_TOKENIZER_JSON: ours.backend.to_str().encode()}, "step.pte")
    with pytest.raises(TokenizerError, match="'vktrain.tokenizer.json' is not a tokenizers file"):
        ModelTokenizer.from_named_data({NAMED_DATA_TOKENIZER_JSON: b"{", NAMED_DATA_TOKENIZER_CONFIG: b"{}"},
                                       "step.pte")


def _tiny_gguf_vocab(tmp_path, bpe) -> tuple[dict, str]:
    path = tmp_path / "v.gguf"
    _write_gguf(path, bpe, "smollm", False)
    return _gguf_vocab(path)


def test_pte_exported_from_a_hf_directory_carries_its_tokenizer_and_trains_on_text(tmp_path, bpe, vk_device, capsys):
    """export (HF directory with a tokenizer) -> .pte named data -> `vktrain train --data chat.jsonl`."""
    import argparse

    import torch

    from vktrain.export import export_training_step, lower_to_pte
    from vktrain.lora import LoRAConfig, apply_lora
    from vktrain.models import load
    from vktrain.serialization.pte import PteFile
    from vktrain.train.command import add_train_arguments, run_train

    directory = tmp_path / "model"
    reference = _hf_tokenizer_dir(directory, bpe, add_bos=False)
    config = transformers.LlamaConfig(vocab_size=len(reference), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                      max_position_embeddings=64, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    loaded = load(directory)
    apply_lora(loaded.model, LoRAConfig(rank=2))
    pte_path = tmp_path / "step.pte"
    named = loaded.tokenizer.build().to_named_data()
    pte_path.write_bytes(lower_to_pte(export_training_step(loaded.model, (2, 16)), named_data=named))

    carried = PteFile.load(pte_path).named_data
    assert {key: bytes(carried[key]) for key in named} == named  # one copy each, as written
    rows = tmp_path / "chat.jsonl"
    rows.write_text("\n".join(json.dumps({"messages": CHAT}) for _ in range(6)), encoding="utf-8")
    args = add_train_arguments(argparse.ArgumentParser()).parse_args(
        [str(pte_path), "--data", str(rows), "--steps", "2", "--no-progress", "--json", str(tmp_path / "log.json")])
    assert run_train(args, device=vk_device) == 0
    expected = load_data(rows, len(reference), ModelTokenizer.from_named_data(named, "x"))
    assert expected.tokens.tolist() == _hf_chat_ids(reference, CHAT) * 6
    err = capsys.readouterr().err
    assert f"{rows}: {expected.tokens.size} tokens ({expected.trained_tokens} trained)" in err
    losses = [record["loss"] for record in json.loads((tmp_path / "log.json").read_text())]
    assert len(losses) == 2 and all(np.isfinite(losses))
