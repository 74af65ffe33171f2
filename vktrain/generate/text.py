"""Prompt text <-> token ids for `vktrain generate` (host side).

The model's own tokenizer (vktrain.serialization.tokenizer.ModelTokenizer: a Hugging Face tokenizer.json or a
GGUF vocabulary, built as transformers builds them) encodes the prompt; a chat prompt is one user turn
rendered with the model's chat template, ending where the assistant's answer starts. A 256-token
vocabulary without a tokenizer is bytes (UTF-8 in, undecodable bytes shown as U+FFFD out). A model with
neither is refused: give token ids with --prompt-ids instead.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from vktrain.serialization.tokenizer import TokenizerError

BYTE_VOCAB = 256

__all__ = ["TextCodec", "TokenizerError", "chat_prompt", "codec_for"]


@dataclass(frozen=True)
class TextCodec:
    # (text, add_special_tokens) -> ids; a rendered chat already holds its special tokens (e.g. BOS)
    encode: Callable[[str, bool], list[int]]
    decode: Callable[[list[int]], str]
    render_chat: Optional[Callable[[list[dict]], str]]  # messages -> text with the generation prompt
    stop_ids: tuple[int, ...]


def codec_for(tokenizer_info: Any, vocab_size: int) -> TextCodec:
    """The codec of a LoadedModel's TokenizerInfo (None for a built-in preset)."""
    eos = getattr(tokenizer_info, "eos_token_id", None)
    stop_ids = tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])
    tokenizer = tokenizer_info.build() if tokenizer_info is not None else None
    if tokenizer is not None:
        if not stop_ids and tokenizer.eos_token_id is not None:
            stop_ids = (tokenizer.eos_token_id,)
        render = None
        if tokenizer.chat_template:
            def render(messages):
                return tokenizer.render_chat(messages, add_generation_prompt=True)
        return TextCodec(lambda text, special: tokenizer.encode(text, add_special_tokens=special),
                         lambda ids: tokenizer.decode(ids, skip_special_tokens=True), render, stop_ids)
    if vocab_size == BYTE_VOCAB:
        return TextCodec(lambda text, special: list(text.encode("utf-8")),
                         lambda ids: bytes(ids).decode("utf-8", errors="replace"), None, stop_ids)
    raise TokenizerError(f"the model ({vocab_size} tokens) comes with no tokenizer vktrain generate can read "
                         f"(no tokenizer.json or GGUF vocabulary); give the prompt as token ids with --prompt-ids")


def chat_prompt(codec: TextCodec, user_text: str) -> str:
    """One user turn rendered with the chat template, ending where the assistant's answer starts."""
    if codec.render_chat is None:
        raise TokenizerError("--chat needs the model's chat template, and this model has none")
    return codec.render_chat([{"role": "user", "content": user_text}])
