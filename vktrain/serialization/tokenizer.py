"""A model's tokenizer and chat template on the runtime side (the `tokenizers` package and jinja2; no torch,
no transformers).

Sources, each built to encode exactly as transformers' tokenizer loaded from the same files does:
- a Hugging Face directory: tokenizer.json (+ tokenizer_config.json: special tokens, add_bos_token /
  add_eos_token, chat_template; or chat_template.jinja) - `ModelTokenizer.from_hf_files`;
- a GGUF file's vocabulary: tokenizer.ggml.model "gpt2" (byte-level BPE: tokens, merges, token types,
  special token ids, add_bos/add_eos flags, the pre-tokenizer name) or "llama" (SentencePiece BPE: merges
  from the scores, byte fallback, BOS added unless the file says otherwise) and tokenizer.chat_template -
  `ModelTokenizer.from_gguf_metadata`. Other vocabularies are refused, naming what is supported;
- a .pte: the two named-data entries export wrote (`ModelTokenizer.to_named_data` / `from_named_data`;
  keys in vktrain.contract), so a program carries what its data needs.

transformers' rule for the special tokens a plain encode adds, followed here: when the tokenizer config
states add_bos_token / add_eos_token, or tokenizer.json has no post-processor, the post-processor becomes
`[bos] $A [eos]` by those flags (both default off); otherwise tokenizer.json's own post-processor stays.
The stored tokenizer.json is the final one, so a .pte needs no flags.

Chats render as transformers' apply_chat_template does (a sandboxed jinja2 environment with trim_blocks
and lstrip_blocks, the special tokens as variables) and tokenize without added special tokens.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from vktrain.contract import NAMED_DATA_TOKENIZER_CONFIG, NAMED_DATA_TOKENIZER_JSON
from vktrain.errors import VktrainError

SUPPORTED_GGUF_VOCABS = ("gpt2", "llama")  # byte-level BPE; SentencePiece BPE (Llama 2, TinyLlama, Mistral)
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4  # llama.cpp's token types

# transformers' splits for GGUF tokenizer.ggml.pre names (integrations/gguf/gguf_tokenizer_mapping.py);
# any other name keeps ByteLevel's own GPT-2 split, as transformers does.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
GGUF_PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT),
}


class TokenizerError(VktrainError, ValueError):
    """A tokenizer or chat template that cannot be built or used, or a conversation it cannot render."""


def _tokenizers():
    try:
        import tokenizers
    except ImportError:  # pragma: no cover - a declared dependency
        raise TokenizerError("tokenizing text needs the `tokenizers` package (pip install tokenizers)") from None
    return tokenizers


def _token_content(value: Any) -> Optional[str]:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict {"content": ...}."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the alphabet byte-level BPE vocabularies are spelled in)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in chars)))


def _bos_eos_post_processor(backend, bos: Optional[str], eos: Optional[str], add_bos: bool, add_eos: bool):
    """transformers' TokenizersBackend.update_post_processor: `[bos:0] $A:0 [eos:0]` by the flags."""
    processors = _tokenizers().processors
    add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
    single = f"{(bos + ':0 ') if add_bos else ''}$A:0{(' ' + eos + ':0') if add_eos else ''}"
    pair = f"{single}{(' ' + bos + ':1') if add_bos else ''} $B:1{(' ' + eos + ':1') if add_eos else ''}"
    special = [(token, backend.token_to_id(token)) for token, on in ((bos, add_bos), (eos, add_eos)) if on]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _add_missing_special_tokens(backend, special_tokens: Mapping[str, str]) -> None:
    """Named special tokens the backend does not know yet become special added tokens (as transformers does)."""
    AddedToken = _tokenizers().AddedToken
    missing = [token for token in dict.fromkeys(special_tokens.values()) if backend.token_to_id(token) is None]
    if missing:
        backend.add_tokens([AddedToken(token, special=True) for token in missing])


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: Optional[str], source: str):
    """A byte-level BPE over a GGUF vocabulary, as transformers' GPT2Tokenizer (with the split of `pre`)."""
    tk = _tokenizers()
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    # A token the file spells in plain text (not the byte alphabet) is looked up by its bytes' spelling.
    spelled = {token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
               for index, token in enumerate(tokens)}
    try:
        pairs = [tuple(merge.split(" ")) for merge in merges]
        backend = tk.Tokenizer(tk.models.BPE(vocab=spelled, merges=pairs, dropout=None, continuing_subword_prefix="",
                                             end_of_word_suffix="", fuse_unk=False))
    except Exception as exc:  # tokenizers raises bare Exceptions
        raise TokenizerError(f"{source}: tokenizer.ggml.tokens / merges do not make a BPE model ({exc})") from None
    split = GGUF_PRE_TOKENIZER_SPLITS.get(pre)
    if split is None:
        backend.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = tk.pre_tokenizers.Sequence([
            tk.pre_tokenizers.Split(tk.Regex(split), behavior="isolated"),
            tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = tk.decoders.ByteLevel()
    return backend


def _generate_merges(vocab: Mapping[str, int], scores: Mapping[str, float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece vocabulary implies, best score first (transformers' generate_merges)."""
    merges = []
    for piece, score in scores.items():
        local = [(piece[:i], piece[i:], score) for i in range(1, len(piece))
                 if piece[:i] in vocab and piece[i:] in vocab]
        merges += sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _sentencepiece_bpe(tokens: list[str], scores: Optional[list], merges: Optional[list], source: str):
    """A SentencePiece BPE over a GGUF vocabulary, as transformers' LlamaTokenizer (byte fallback, "▁" for
    spaces prepended to the first word)."""
    tk = _tokenizers()
    vocab = {token: index for index, token in enumerate(tokens)}
    if merges is not None:
        pairs = [tuple(merge.split(" ")) for merge in merges]
    elif isinstance(scores, list) and len(scores) == len(tokens):
        pairs = _generate_merges(vocab, dict(zip(tokens, scores)))
    else:
        raise TokenizerError(f"{source}: a llama (SentencePiece) vocabulary needs tokenizer.ggml.scores, one per "
                             f"token, or tokenizer.ggml.merges")
    try:
        backend = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=pairs, fuse_unk=True, byte_fallback=True,
                                             dropout=None))
    except Exception as exc:  # tokenizers raises bare Exceptions
        raise TokenizerError(f"{source}: tokenizer.ggml.tokens / scores do not make a BPE model ({exc})") from None
    backend.pre_tokenizer = tk.pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    backend.decoder = tk.decoders.Sequence([tk.decoders.Replace("\u2581", " "), tk.decoders.ByteFallback(),
                                            tk.decoders.Fuse(), tk.decoders.Strip(content=" ", left=1)])
    return backend


@dataclass
class ModelTokenizer:
    """A `tokenizers.Tokenizer` with the model's special tokens and chat template.

    `special_tokens`: bos_token / eos_token / unk_token / pad_token strings where the model has them (the
    chat template sees them as variables). `eos_token_id` separates packed documents."""
    backend: Any  # tokenizers.Tokenizer
    special_tokens: dict[str, str] = field(default_factory=dict)
    chat_template: Optional[str] = None
    source: str = "tokenizer"

    # -- facts ------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_id(self, name: str) -> Optional[int]:
        token = self.special_tokens.get(name)
        return None if token is None else self.backend.token_to_id(token)

    @property
    def eos_token_id(self) -> Optional[int]:
        return self.token_id("eos_token")

    @property
    def bos_token_id(self) -> Optional[int]:
        return self.token_id("bos_token")

    # -- encoding ---------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False) -> str:
        """The conversation as the chat template renders it (as transformers' apply_chat_template, untokenized)."""
        if self.chat_template is None:
            raise TokenizerError(f"{self.source} has no chat template: chat data ({{\"messages\": ...}}) cannot be "
                                 f"rendered; use {{\"text\": ...}} rows or plain text")
        try:
            return _compiled_template(self.chat_template).render(
                messages=list(messages), add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except _jinja2().TemplateError as exc:
            raise TokenizerError(f"{self.source}: the chat template failed on this conversation: {exc}") from None

    def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> tuple[list[int], list[bool]]:
        """(token ids of the rendered conversation, for each token whether it belongs to an assistant turn).

        Assistant turn i spans the characters between the rendering of messages[:i] with the generation
        prompt and the rendering of messages[:i + 1] (its content and whatever the template closes the turn
        with, e.g. the end-of-turn token); a token is trained when it starts inside such a span. The template
        must render each conversation prefix as a prefix of the whole, as chat templates do."""
        full = self.render_chat(messages)
        spans = []
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            prompt = self.render_chat(messages[:i], add_generation_prompt=True) if i else ""
            turn = self.render_chat(messages[:i + 1])
            if not (turn.startswith(prompt) and full.startswith(turn)):
                raise TokenizerError(f"{self.source}: the chat template does not render conversation prefixes as "
                                     f"prefixes of the whole conversation (at message {i}), so the assistant "
                                     f"turns cannot be located")
            spans.append((len(prompt), len(turn)))
        encoding = self.backend.encode(full, add_special_tokens=False)
        trained = [any(lo <= start < hi for lo, hi in spans) for start, _ in encoding.offsets]
        return encoding.ids, trained

    # -- building ---------------------------------------------------------------------------------
    @classmethod
    def from_hf_files(cls, tokenizer_json: Path, tokenizer_config: Mapping[str, Any],
                      chat_template: Optional[str] = None, eos_token_id: Optional[int] = None) -> "ModelTokenizer":
        """From a Hugging Face tokenizer.json and the parsed tokenizer_config.json (module docstring);
        `eos_token_id` (config.json's) names the EOS token where tokenizer_config.json names none."""
        tokenizer_json = Path(tokenizer_json)
        try:
            backend = _tokenizers().Tokenizer.from_file(str(tokenizer_json))
        except Exception as exc:  # tokenizers raises a bare Exception on malformed files
            raise TokenizerError(f"{tokenizer_json}: not a readable tokenizers file ({exc})") from None
        special = {name: _token_content(tokenizer_config.get(name)) for name in SPECIAL_TOKEN_NAMES}
        special = {name: token for name, token in special.items() if token is not None}
        if "eos_token" not in special and eos_token_id is not None and backend.id_to_token(eos_token_id) is not None:
            special["eos_token"] = backend.id_to_token(eos_token_id)
        _add_missing_special_tokens(backend, special)
        flags = ("add_bos_token" in tokenizer_config or "add_eos_token" in tokenizer_config)
        if flags or backend.post_processor is None:
            backend.post_processor = _bos_eos_post_processor(
                backend, special.get("bos_token"), special.get("eos_token"),
                bool(tokenizer_config.get("add_bos_token", False)), bool(tokenizer_config.get("add_eos_token", False)))
        template = tokenizer_config.get("chat_template", chat_template)
        if template is not None and not isinstance(template, str):
            raise TokenizerError(f"{tokenizer_json.parent / 'tokenizer_config.json'}: chat_template must be one "
                                 f"template string, got {type(template).__name__} (named templates are not supported)")
        return cls(backend, special, template, source=str(tokenizer_json))

    @classmethod
    def from_gguf_metadata(cls, vocab: Mapping[str, Any], chat_template: Optional[str] = None,
                           source: str = "GGUF") -> "ModelTokenizer":
        """From a GGUF's tokenizer.ggml.* fields (keys without that prefix: "model", "tokens", "merges", ...),
        as transformers builds its tokenizer from the same file (module docstring)."""
        kind = vocab.get("model")
        if kind not in SUPPORTED_GGUF_VOCABS:
            raise TokenizerError(f"{source}: tokenizer.ggml.model {kind!r} is not supported; supported: "
                                 f"{', '.join(SUPPORTED_GGUF_VOCABS)} (byte-level BPE, as Llama 3, SmolLM2 and Qwen "
                                 f"use)")
        tokens, merges = vocab.get("tokens"), vocab.get("merges")
        if not isinstance(tokens, list) or not tokens:
            raise TokenizerError(f"{source}: tokenizer.ggml.tokens is missing or empty")
        types = vocab.get("token_type") or []
        tk = _tokenizers()
        if kind == "gpt2":
            if not isinstance(merges, list):
                raise TokenizerError(f"{source}: tokenizer.ggml.merges is missing (a gpt2 vocabulary lists its merges)")
            backend = _byte_level_bpe(tokens, merges, vocab.get("pre"), source)
            alphabet = set(_bytes_to_unicode().values())
        else:
            backend = _sentencepiece_bpe(tokens, vocab.get("scores"), merges, source)
            alphabet = None
        # A control token spelled outside the byte alphabet is a llama.cpp mislabel transformers skips.
        control = [tk.AddedToken(token, normalized=False, special=True) for token, kind_ in zip(tokens, types)
                   if kind_ == _GGUF_CONTROL and (alphabet is None or set(token) <= alphabet)]
        if control:
            backend.add_special_tokens(control)
        known = backend.get_vocab(with_added_tokens=True)
        user = [tk.AddedToken(token, normalized=False, special=False) for token, kind_ in zip(tokens, types)
                if kind_ == _GGUF_USER_DEFINED and token in known]
        if user:
            backend.add_tokens(user)
        special = {}
        for name, key in zip(SPECIAL_TOKEN_NAMES, ("bos_token_id", "eos_token_id", "unknown_token_id",
                                                   "padding_token_id")):
            index = vocab.get(key)
            if index is not None:
                if not 0 <= int(index) < len(tokens):
                    raise TokenizerError(f"{source}: tokenizer.ggml.{key} = {index} is outside the "
                                         f"{len(tokens)}-token vocabulary")
                special[name] = tokens[int(index)]
        _add_missing_special_tokens(backend, special)
        backend.post_processor = _bos_eos_post_processor(backend, special.get("bos_token"), special.get("eos_token"),
                                                         # llama.cpp adds BOS to a SentencePiece vocabulary
                                                         # that does not say otherwise
                                                         bool(vocab.get("add_bos_token", kind == "llama")),
                                                         bool(vocab.get("add_eos_token", False)))
        return cls(backend, special, chat_template, source=source)

    # -- the .pte's copy ----------------------------------------------------------------------------
    def to_named_data(self) -> dict[str, bytes]:
        """The named-data entries a .pte carries this tokenizer in (keys in vktrain.contract)."""
        config = {"special_tokens": self.special_tokens, "chat_template": self.chat_template}
        return {NAMED_DATA_TOKENIZER_JSON: self.backend.to_str().encode("utf-8"),
                NAMED_DATA_TOKENIZER_CONFIG: json.dumps(config).encode("utf-8")}

    @classmethod
    def from_named_data(cls, named_data: Mapping[str, Any], source: str) -> Optional["ModelTokenizer"]:
        """The tokenizer a .pte's named data carries (`source`: the file, for messages); None when it has none."""
        if NAMED_DATA_TOKENIZER_JSON not in named_data:
            return None
        where = f"{source}: named data {NAMED_DATA_TOKENIZER_JSON!r}"
        try:
            backend = _tokenizers().Tokenizer.from_str(bytes(named_data[NAMED_DATA_TOKENIZER_JSON]).decode("utf-8"))
        except Exception as exc:
            raise TokenizerError(f"{where} is not a tokenizers file ({exc})") from None
        where = f"{source}: named data {NAMED_DATA_TOKENIZER_CONFIG!r}"
        if NAMED_DATA_TOKENIZER_CONFIG not in named_data:
            raise TokenizerError(f"{where} is missing (it goes with {NAMED_DATA_TOKENIZER_JSON!r})")
        try:
            config = json.loads(bytes(named_data[NAMED_DATA_TOKENIZER_CONFIG]).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise TokenizerError(f"{where} is not JSON ({exc})") from None
        special, template = config.get("special_tokens") if isinstance(config, dict) else None, \
            config.get("chat_template") if isinstance(config, dict) else None
        if not isinstance(special, dict) or not all(isinstance(v, str) for v in special.values()) or \
                not (template is None or isinstance(template, str)):
            raise TokenizerError(f"{where}: expected {{\"special_tokens\": {{name: token}}, \"chat_template\": "
                                 f"string or null}}, got {str(config)[:120]}")
        return cls(backend, special, template, source=source)


def program_tokenizer(runner: Any, source: str) -> Optional[ModelTokenizer]:
    """The tokenizer a loaded program's .pte carries (`runner.pte`, a PteFile), None when it carries none or
    the runner has no parsed .pte (as a runner with no `graph` gets its facts elsewhere in describe_program)."""
    named_data = getattr(getattr(runner, "pte", None), "named_data", None) or {}
    return ModelTokenizer.from_named_data(named_data, source)


def _jinja2():
    try:
        import jinja2
        import jinja2.ext
        import jinja2.nodes
        import jinja2.sandbox
    except ImportError:  # pragma: no cover - a declared dependency
        raise TokenizerError("rendering chat templates needs the `jinja2` package (pip install jinja2)") from None
    return jinja2


@functools.lru_cache(maxsize=8)
def _compiled_template(template: str):
    """The template compiled as transformers compiles chat templates (sandboxed; its filters and globals)."""
    jinja2 = _jinja2()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class GenerationBlocks(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask markers) render their body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[GenerationBlocks, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise TokenizerError(f"the chat template is not valid jinja2 ({exc})") from None


__all__ = ["GGUF_PRE_TOKENIZER_SPLITS", "ModelTokenizer", "SPECIAL_TOKEN_NAMES",
           "SUPPORTED_GGUF_VOCABS", "TokenizerError", "program_tokenizer"]
