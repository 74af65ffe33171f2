"""Training data: token files, text and chat data tokenized with the model's tokenizer, and a
deterministic, position-addressed batcher.

Data files (`load_data`), chosen by name:
  *.npy          a 1-D integer array of token ids (any integer dtype; memory-mapped, kept in its dtype)
  *.tokens.txt   token ids as whitespace-separated decimal integers
  *.jsonl        one JSON object per line, tokenized with the model's tokenizer (vktrain.serialization.tokenizer):
                 {"text": "..."} a document; {"messages": [{"role", "content"}, ...]} a conversation,
                 rendered with the model's chat template, where only the assistant turns are trained
                 (every other token's label is -100); without a tokenizer (a 256-byte vocabulary) each
                 {"text"} row is read as its UTF-8 bytes and a newline
  *.json         one JSON array of those rows
  anything else  text (UTF-8): with a tokenizer, the whole file is one document; without one, byte-level
                 (every byte one token 0..255), which is only accepted for a vocabulary of 256 bytes
Documents are tokenized as the tokenizer encodes a text (with its own BOS, where it adds one) and each is
followed by the EOS token; conversations follow one another as the template renders them (it delimits
them itself). Everything is packed into one stream, labels alongside: `TrainingData.labels` is None when
every token is a target, else the parallel stream holding each token's id or -100.

Batches (`TokenBatcher`): the stream is cut into windows of S + 1 tokens starting every S tokens
(window w covers tokens [w*S, w*S + S]; consecutive windows share one boundary token), so there are
W = (len - 1) // S windows and a tail shorter than a window is never used. A window gives one row:
    tokens[b] = window[:S]        labels[b] = window[1:]      (the next token at every position)
so every label is a real target, or with a label stream its label at that position (windows whose
every label is -100 train nothing and are left out).

Packed documents (a step exported with `--packing documents`; `TokenBatcher(documents=starts)`, the
stream's document start offsets, TrainingData.starts): a batch is (tokens, labels, positions), positions[b, s]
the token's position in its document counted from the window's start or the document's, whichever is
later, so a row's documents (and the part of a document a window holds) each compute what they compute
alone; a document's first token is no target (its label is -100: nothing of its own document precedes it).

Batch p (p = 0, 1, 2, ..., the "data position") takes windows p*B .. p*B + B - 1 of an endless
sequence of epochs; each epoch visits all W windows once, in an order that depends only on (seed, epoch)
(a splitmix64 hash sort, independent of numpy's RNG streams, so the order is the same on every
machine and numpy version), or in file order with shuffle=False. `batch(p)` is a pure function of p:
a checkpoint records p and a resumed run reads exactly the batches the uninterrupted run would have.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Optional, Union

import numpy as np
from vktrain.errors import VktrainError

if TYPE_CHECKING:
    from vktrain.serialization.tokenizer import ModelTokenizer

PathLike = Union[str, os.PathLike]

BYTE_VOCAB_SIZE = 256
TOKEN_TEXT_SUFFIX = ".tokens.txt"
JSONL_SUFFIX = ".jsonl"
JSON_SUFFIX = ".json"  # one JSON array of the rows a *.jsonl file holds one per line
IGNORED_LABEL = -100  # the label of a token that is no target (the fused cross-entropy ignores labels < 0)
_CHUNK = 1 << 24  # tokens per chunk when scanning or hashing a whole stream


class DataError(VktrainError, ValueError):
    """A data file cannot be used: unreadable, wrong type, too short, or token ids outside the vocabulary."""


# ------------------------------------------------------------------------------------------------
# Loading
# ------------------------------------------------------------------------------------------------

def default_dataset_path() -> Path:
    """The built-in corpus shipped with vktrain (vktrain/data/default_corpus.txt, byte-level text)."""
    from vktrain.data import DEFAULT_CORPUS  # the data package knows its own files

    return Path(DEFAULT_CORPUS)


def _load_npy(path: Path) -> np.ndarray:
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise DataError(f"{path}: not a readable .npy array ({exc})") from None
    if array.dtype.kind not in "iu":
        raise DataError(f"{path}: token ids must be an integer array, got dtype {array.dtype}")
    if array.ndim != 1:
        raise DataError(f"{path}: token ids must be a 1-D array (one stream), got shape {list(array.shape)}; "
                        f"flatten it yourself if rows are meant to be concatenated")
    return array


def _load_token_text(path: Path) -> np.ndarray:
    try:
        words = path.read_text(encoding="utf-8").split()
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: {TOKEN_TEXT_SUFFIX} files are UTF-8 text of integers ({exc})") from None
    ids = []
    for index, word in enumerate(words):
        try:
            ids.append(int(word))
        except ValueError:
            raise DataError(f"{path}: {TOKEN_TEXT_SUFFIX} files hold whitespace-separated integers; word {index} "
                            f"is {word[:40]!r}") from None
    try:
        return np.array(ids, dtype=np.int64)
    except OverflowError:
        raise DataError(f"{path}: a token id does not fit in int64") from None


def is_token_file(path: PathLike) -> bool:
    """Whether the file holds token ids (.npy, *.tokens.txt) rather than text to tokenize."""
    name = Path(path).name.lower()
    return name.endswith(".npy") or name.endswith(TOKEN_TEXT_SUFFIX)


def is_byte_level(path: PathLike, tokenizer: Optional["ModelTokenizer"] = None) -> bool:
    """Whether `load_data` reads this file as byte-level text (every byte one token 0..255)."""
    return tokenizer is None and not is_token_file(path)


def check_byte_level_fits(path: PathLike, vocab_size: int, tokenizer: Optional["ModelTokenizer"] = None) -> None:
    """Text with no tokenizer is read byte-level (token = byte), which is only the model's own tokenization
    when the vocabulary is the 256 bytes: for any other vocabulary (a pretrained model's 32000 or 49152
    tokens) the ids would all be valid and train silently on nonsense, so it is refused (JSON rows too)."""
    if tokenizer is not None or is_token_file(path):
        return
    if vocab_size != BYTE_VOCAB_SIZE:
        raise DataError(f"{path} would be read as byte-level text (token id = byte, 0..255), but this program "
                        f"carries no tokenizer and its vocabulary has {vocab_size} tokens, not the "
                        f"{BYTE_VOCAB_SIZE} bytes: export the program from the model's Hugging Face directory or "
                        f"GGUF file (it then carries the tokenizer), or pass token ids as a 1-D .npy array or a "
                        f"*{TOKEN_TEXT_SUFFIX} file")


def load_tokens(path: PathLike) -> np.ndarray:
    """The token stream of a token file or of byte-level text, as an integer array [N] (module docstring)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {path} does not exist (or is not a file)")
    name = path.name.lower()
    if name.endswith(".npy"):
        tokens = _load_npy(path)
    elif name.endswith(TOKEN_TEXT_SUFFIX):
        tokens = _load_token_text(path)
    else:
        tokens = np.fromfile(path, dtype=np.uint8)
    return tokens


@dataclass(frozen=True)
class TrainingData:
    """A packed token stream [N] and, when some tokens are not targets, its label stream [N] (id or -100);
    `starts`: the offsets where its documents and conversations start, ascending from 0 (None for token
    files, which carry no boundaries)."""
    tokens: np.ndarray
    labels: Optional[np.ndarray] = None
    starts: Optional[np.ndarray] = None

    @property
    def trained_tokens(self) -> int:
        return self.tokens.size if self.labels is None else int(np.count_nonzero(self.labels >= 0))


class _Packer:
    """Documents and conversations appended to one token stream with their labels."""

    def __init__(self, tokenizer: "ModelTokenizer", source: str) -> None:
        self.tokenizer, self.source = tokenizer, source
        self.tokens: list[int] = []
        self.labels: list[int] = []
        self.starts: list[int] = []
        self.masked = False

    def document(self, text: str, where: str) -> None:
        self.starts.append(len(self.tokens))
        eos = self.tokenizer.eos_token_id
        if eos is None:
            raise DataError(f"{where}: the tokenizer ({self.tokenizer.source}) has no EOS token to end documents with")
        ids = self.tokenizer.encode(text)
        if not ids or ids[-1] != eos:  # a tokenizer that adds EOS itself (add_eos_token) gets no second one
            ids.append(eos)
        self.tokens += ids
        self.labels += ids

    def conversation(self, messages: list, where: str) -> None:
        from vktrain.serialization.tokenizer import TokenizerError

        try:
            ids, trained = self.tokenizer.encode_chat(messages)
        except TokenizerError as exc:
            raise DataError(f"{where}: {exc}") from None
        if not any(trained):
            raise DataError(f"{where}: the conversation has no assistant message (nothing would be trained)")
        self.starts.append(len(self.tokens))
        self.tokens += ids
        self.labels += [i if t else IGNORED_LABEL for i, t in zip(ids, trained)]
        self.masked = True

    def result(self) -> TrainingData:
        if not self.tokens:
            raise DataError(f"{self.source}: no documents or conversations in the file")
        tokens = np.array(self.tokens, dtype=np.int64)
        return TrainingData(tokens, np.array(self.labels, dtype=np.int64) if self.masked else None,
                            np.array(self.starts, dtype=np.int64))


def _check_messages(messages, where: str) -> list:
    if not isinstance(messages, list) or not messages:
        raise DataError(f'{where}: "messages" must be a non-empty list of {{"role", "content"}} objects, got '
                        f"{str(messages)[:80]}")
    for i, message in enumerate(messages):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str) and "content" in message):
            raise DataError(f'{where}: messages[{i}] must be an object with a string "role" and a "content", got '
                            f"{str(message)[:80]}")
    return messages


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: text data must be UTF-8 ({exc})") from None


class _BytePacker(_Packer):
    """Rows of a program without a tokenizer (a vocabulary of the 256 bytes): each {"text"} document's
    UTF-8 bytes followed by a newline, as the lines of a text file are read; chats need a chat template."""

    def __init__(self, source: str) -> None:
        self.source, self.tokens, self.labels, self.starts, self.masked = source, [], [], [], False

    def document(self, text: str, where: str) -> None:
        self.starts.append(len(self.tokens))
        ids = list((text + "\n").encode("utf-8"))
        self.tokens += ids
        self.labels += ids

    def conversation(self, messages: list, where: str) -> None:
        raise DataError(f'{where}: a {{"messages"}} chat is rendered with the model\'s chat template, but this '
                        f"program carries no tokenizer (export it from a Hugging Face directory or a GGUF file, "
                        f'which carry theirs); without one only {{"text"}} rows are read, as bytes')


def _add_row(row, where: str, packer: _Packer) -> None:
    if isinstance(row, dict) and isinstance(row.get("text"), str):
        packer.document(row["text"], where)
    elif isinstance(row, dict) and "messages" in row:
        packer.conversation(_check_messages(row["messages"], where), where)
    else:
        raise DataError(f'{where}: expected {{"text": string}} or {{"messages": [...]}}, got {json.dumps(row)[:80]}')


def _load_jsonl(path: Path, packer: _Packer) -> None:
    for number, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: not a JSON object ({exc})") from None
        _add_row(row, where, packer)


def _load_json(path: Path, packer: _Packer) -> None:
    """A .json file: one JSON array of the rows a *.jsonl file holds one per line."""
    try:
        rows = json.loads(_read_text(path))
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(rows, list):
        raise DataError(f'{path}: a .json data file holds one array of rows ({{"text"}} or {{"messages"}} objects), '
                        f"got a JSON {type(rows).__name__}; for one row per line use *{JSONL_SUFFIX}")
    for index, row in enumerate(rows):
        _add_row(row, f"{path}[{index}]", packer)


def load_data(path: PathLike, vocab_size: int, tokenizer: Optional["ModelTokenizer"] = None) -> TrainingData:
    """The training data of a file (module docstring): tokenized with `tokenizer` when it is text, checked
    against the vocabulary (ids in [0, vocab_size); text without a tokenizer only for 256 tokens)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {path} does not exist (or is not a file)")
    check_byte_level_fits(path, vocab_size, tokenizer)
    rows = {JSONL_SUFFIX: _load_jsonl, JSON_SUFFIX: _load_json}.get(path.suffix.lower())
    if is_token_file(path) or (tokenizer is None and rows is None):
        data = TrainingData(load_tokens(path))
    else:
        packer = _Packer(tokenizer, str(path)) if tokenizer is not None else _BytePacker(str(path))
        if rows is not None:
            rows(path, packer)
        else:
            packer.document(_read_text(path), str(path))
        data = packer.result()
    check_vocab(data.tokens, vocab_size, str(path))
    return data


def check_vocab(tokens: np.ndarray, vocab_size: int, source: str = "data") -> None:
    """Refuse token ids outside [0, vocab_size), naming the first offending position and value."""
    if vocab_size <= 0:
        raise DataError(f"vocab_size must be positive, got {vocab_size}")
    first, count = None, 0
    for start in range(0, tokens.size, _CHUNK):  # chunks: no full-size temporaries for a large corpus
        chunk = tokens[start:start + _CHUNK]
        bad = np.flatnonzero((chunk < 0) | (chunk >= vocab_size))
        if bad.size and first is None:
            first = start + int(bad[0])
        count += bad.size
    if first is not None:
        raise DataError(f"{source}: token id {int(tokens[first])} at position {first} is outside the model's "
                        f"vocabulary [0, {vocab_size}) ({count} such token(s)); the program's embedding has "
                        f"{vocab_size} rows" + (" (byte-level text needs a vocabulary of 256)"
                                                if vocab_size < BYTE_VOCAB_SIZE else ""))


# ------------------------------------------------------------------------------------------------
# Batching
# ------------------------------------------------------------------------------------------------

def _splitmix64(values: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 (wrapping arithmetic): a well-mixed, platform-independent hash."""
    with np.errstate(over="ignore"):
        z = values + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def epoch_order(n_windows: int, seed: int, epoch: int) -> np.ndarray:
    """The window order of one epoch: a permutation of range(n_windows) determined by (seed, epoch)."""
    base = _splitmix64(np.array([(seed & 0xFFFFFFFF) << 32 | (epoch & 0xFFFFFFFF)], dtype=np.uint64))[0]
    with np.errstate(over="ignore"):
        keys = _splitmix64(np.arange(n_windows, dtype=np.uint64) ^ base)
    return np.argsort(keys, kind="stable")


def document_labels(tokens: np.ndarray, labels: Optional[np.ndarray], starts: np.ndarray) -> np.ndarray:
    """The label stream of packed documents: `labels` (or the tokens, each its own label) with a document's
    first token no target (-100): nothing of its own document precedes it."""
    labels = (tokens if labels is None else labels).astype(np.int64)  # a copy
    labels[starts] = IGNORED_LABEL
    return labels


def document_positions(starts: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """int64 positions of the tokens at stream `offsets` [B, S] (each row consecutive) in packed documents
    starting at `starts`: the distance from the start of the token's document or of its row, whichever is
    later (offsets past the stream go on counting in the last document)."""
    document_start = starts[np.searchsorted(starts, offsets, side="right") - 1]
    return offsets - np.maximum(document_start, offsets[:, :1])


class TokenBatcher:
    """Deterministic (tokens, labels) int64 [B, S] batches addressed by position (module docstring).

    `labels`: None (every next token is a target) or a stream as long as `tokens` holding each token's
    label (its id, or -100 where it is not a target); a window whose labels are all -100 is left out.
    `documents`: the document start offsets (packed documents: batches are (tokens, labels, positions))."""

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, *, seed: int = 0, shuffle: bool = True,
                 source: str = "data", labels: Optional[np.ndarray] = None,
                 documents: Optional[np.ndarray] = None) -> None:
        if batch_size <= 0 or seq_len <= 0:
            raise DataError(f"batch size and sequence length must be positive, got {batch_size} x {seq_len}")
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise DataError(f"{source}: tokens must be a 1-D integer array, got {tokens.dtype}{list(tokens.shape)}")
        if labels is not None:
            labels = np.asarray(labels)
            if labels.shape != tokens.shape or labels.dtype.kind not in "iu":
                raise DataError(f"{source}: labels must be an integer array shaped like the tokens "
                                f"{list(tokens.shape)}, got {labels.dtype}{list(labels.shape)}")
        if not 0 <= seed < 2**32:
            raise DataError(f"the data seed must be in [0, 2**32), got {seed}")
        self.documents = None
        if documents is not None:
            self.documents = np.asarray(documents, dtype=np.int64)
            if self.documents.ndim != 1 or (self.documents.size and (
                    self.documents[0] != 0 or np.any(np.diff(self.documents) <= 0)
                    or self.documents[-1] >= tokens.size)):
                raise DataError(f"{source}: document starts must ascend from 0 within the {tokens.size} tokens")
            labels = document_labels(tokens, labels, self.documents)
        self.tokens = tokens  # kept in its own dtype (a memory map stays one); batches are int64
        self.labels = labels
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.shuffle = shuffle
        self.source = source
        windows = (self.tokens.size - 1) // seq_len if self.tokens.size else 0
        self._windows = np.arange(windows)  # the stream's windows that train something, in file order
        if labels is not None and windows:
            targets = labels[1:windows * seq_len + 1].reshape(windows, seq_len)
            self._windows = np.flatnonzero((targets >= 0).any(axis=1))
        self.n_windows = self._windows.size
        if self.n_windows < batch_size:
            trained = "" if labels is None else f" with a target (of {windows})"
            raise DataError(
                f"{source} is too short for one batch: {self.tokens.size} tokens make {self.n_windows} window(s) of "
                f"{seq_len} + 1 tokens{trained}, a batch of {batch_size} x {seq_len} needs {batch_size} windows "
                f"(at least {batch_size * seq_len + 1} tokens)")
        self._order_cache: tuple[int, np.ndarray] | None = None

    @property
    def batches_per_epoch(self) -> float:
        return self.n_windows / self.batch_size

    def config(self) -> dict:
        """What decides the batches beyond the token stream (run_config records it in checkpoints)."""
        config = {"batch_size": self.batch_size, "seq_len": self.seq_len, "shuffle": self.shuffle}
        return config if self.documents is None else {**config, "packing": "documents"}

    @functools.cached_property
    def fingerprint(self) -> str:
        """sha256 of the token stream and the batching parameters: what a checkpoint's data must match."""
        digest = hashlib.sha256()
        digest.update(f"vktrain-batcher:B={self.batch_size}:S={self.seq_len}:shuffle={int(self.shuffle)}:".encode())
        if self.documents is not None:  # a stream without documents keeps the fingerprint it always had
            digest.update(b":documents:" + self.documents.astype("<i8").tobytes())
        for start in range(0, self.tokens.size, _CHUNK):  # as int64, so the storage dtype does not matter
            digest.update(self.tokens[start:start + _CHUNK].astype("<i8").tobytes())
        if self.labels is not None:  # a stream with no label stream keeps the fingerprint it always had
            digest.update(b":labels:")
            for start in range(0, self.labels.size, _CHUNK):
                digest.update(self.labels[start:start + _CHUNK].astype("<i8").tobytes())
        return digest.hexdigest()

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.n_windows)
        if self._order_cache is None or self._order_cache[0] != epoch:
            self._order_cache = (epoch, epoch_order(self.n_windows, self.seed, epoch))
        return self._order_cache[1]

    def window_indices(self, position: int) -> np.ndarray:
        """The windows batch `position` is made of, as indices into the stream's windows."""
        if position < 0:
            raise DataError(f"data position must be >= 0, got {position}")
        indices = np.empty(self.batch_size, dtype=np.int64)
        for row in range(self.batch_size):
            epoch, within = divmod(position * self.batch_size + row, self.n_windows)
            indices[row] = self._windows[self._order(epoch)[within]]
        return indices

    def batch(self, position: int) -> tuple[np.ndarray, ...]:
        """(tokens, labels), both int64 [B, S], of batch number `position` (0-based); with documents,
        (tokens, labels, positions) (module docstring)."""
        starts = self.window_indices(position) * self.seq_len
        offsets = starts[:, None] + np.arange(self.seq_len + 1)[None, :]
        rows = self.tokens[offsets].astype(np.int64)
        labels = rows if self.labels is None else self.labels[offsets].astype(np.int64)
        batch = np.ascontiguousarray(rows[:, :-1]), np.ascontiguousarray(labels[:, 1:])
        if self.documents is None:
            return batch
        return batch + (document_positions(self.documents, offsets[:, :-1]),)

    def batches(self, start: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Batches start, start + 1, ... (endless)."""
        position = start
        while True:
            yield self.batch(position)
            position += 1


__all__ = ["BYTE_VOCAB_SIZE", "DataError", "IGNORED_LABEL", "document_labels", "document_positions", "JSONL_SUFFIX", "TOKEN_TEXT_SUFFIX", "TokenBatcher",
           "TrainingData", "check_byte_level_fits", "check_vocab", "default_dataset_path", "epoch_order",
           "is_byte_level", "is_token_file", "load_data", "load_tokens"]
