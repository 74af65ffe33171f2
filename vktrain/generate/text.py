"""Prompt text <-> token ids for `vktrain generate` (host side).

A 256-token vocabulary is bytes (UTF-8 in, undecodable bytes shown as U+FFFD out); a Hugging Face
checkpoint's tokenizer.json is read with the `tokenizers` package; a chat prompt is rendered with the
checkpoint's chat template (jinja2, as transformers' apply_chat_template with add_generation_prompt).
A model with neither is refused: give token ids with --prompt-ids instead.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from vktrain.errors import VktrainError

BYTE_VOCAB = 256


class TokenizerError(VktrainError, ValueError):
    """No way to turn the prompt into this model's tokens (or back)."""


@dataclass(frozen=True)
class TextCodec:
    # (text, add_special_tokens) -> ids; a rendered chat already holds its special tokens (e.g. BOS)
    encode: Callable[[str, bool], list[int]]
    decode: Callable[[list[int]], str]
    chat_template: Optional[str]
    special_tokens: dict  # bos_token / eos_token strings for the chat template
    stop_ids: tuple[int, ...]


def _token_text(value: Any) -> str:
    return value.get("content", "") if isinstance(value, dict) else (value or "")


def codec_for(tokenizer_info: Any, vocab_size: int) -> TextCodec:
    """The codec of a LoadedModel's TokenizerInfo (None for a built-in preset)."""
    eos = getattr(tokenizer_info, "eos_token_id", None)
    stop_ids = tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])
    tokenizer_json = getattr(tokenizer_info, "tokenizer_json", None)
    if tokenizer_json is not None:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(tokenizer_json))
        config = tokenizer_info.tokenizer_config
        return TextCodec(lambda text, special: tokenizer.encode(text, add_special_tokens=special).ids,
                         lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                         tokenizer_info.chat_template,
                         {"bos_token": _token_text(config.get("bos_token")),
                          "eos_token": _token_text(config.get("eos_token"))}, stop_ids)
    if vocab_size == BYTE_VOCAB:
        return TextCodec(lambda text, special: list(text.encode("utf-8")),
                         lambda ids: bytes(ids).decode("utf-8", errors="replace"), None, {}, stop_ids)
    source = getattr(tokenizer_info, "source", None)
    raise TokenizerError(f"the model ({vocab_size} tokens) comes with no tokenizer vktrain generate can read "
                         f"({'a GGUF vocabulary is not read yet' if source == 'gguf' else 'no tokenizer.json'}); "
                         f"give the prompt as token ids with --prompt-ids")


def chat_prompt(codec: TextCodec, user_text: str) -> str:
    """One user turn rendered with the chat template, ending where the assistant's answer starts."""
    if not codec.chat_template:
        raise TokenizerError("--chat needs the model's chat template, and this model has none")
    import jinja2

    environment = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message: str):
        raise TokenizerError(f"the chat template refused the conversation: {message}")

    environment.globals["raise_exception"] = raise_exception
    template = environment.from_string(codec.chat_template)
    return template.render(messages=[{"role": "user", "content": user_text}], add_generation_prompt=True,
                           **codec.special_tokens)
