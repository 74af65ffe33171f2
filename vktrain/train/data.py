"""Training data: token files and a deterministic, position-addressed batcher.

Token files (`load_tokens`), chosen by name; the stream keeps its file's integer dtype (uint8 for
text, the array's dtype for .npy, memory-mapped) so a large corpus costs no int64 copy; batches are int64:
  *.npy          a 1-D integer array of token ids (any integer dtype)
  *.tokens.txt   token ids as whitespace-separated decimal integers
  anything else  byte-level text: every byte of the file is one token id in 0..255 (a UTF-8 text file
                 gives its UTF-8 bytes, so non-ASCII characters become several tokens). No decoding and
                 no normalisation: the file's bytes are the stream.

Batches (`TokenBatcher`): the stream is cut into windows of S + 1 tokens starting every S tokens
(window w covers tokens [w*S, w*S + S]; consecutive windows share one boundary token), so there are
W = (len - 1) // S windows and a tail shorter than a window is never used. A window gives one row:
    tokens[b] = window[:S]        labels[b] = window[1:]      (the next token at every position)
so every label is a real target; none is ignored (-100 is never produced).

Batch p (p = 0, 1, 2, ..., the "data position") takes windows p*B .. p*B + B - 1 of an endless
sequence of epochs; each epoch visits all W windows once, in an order that depends only on (seed, epoch)
(a splitmix64 hash sort, independent of numpy's RNG streams, so the order is the same on every
machine and numpy version), or in file order with shuffle=False. `batch(p)` is a pure function of p:
a checkpoint records p and a resumed run reads exactly the batches the uninterrupted run would have.
"""
from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path
from typing import Iterator, Union

import numpy as np
from vktrain.errors import VktrainError

PathLike = Union[str, os.PathLike]

BYTE_VOCAB_SIZE = 256
TOKEN_TEXT_SUFFIX = ".tokens.txt"
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


def is_byte_level(path: PathLike) -> bool:
    """Whether `load_tokens` reads this file as byte-level text (every byte one token 0..255)."""
    name = Path(path).name.lower()
    return not (name.endswith(".npy") or name.endswith(TOKEN_TEXT_SUFFIX))


def check_byte_level_fits(path: PathLike, vocab_size: int) -> None:
    """Byte-level text means token = byte, which is only the model's own tokenization when the vocabulary
    is the 256 bytes: for any other vocabulary (a pretrained model's 32000 or 49152 tokens) the ids would
    all be valid and train silently on nonsense, so it is refused."""
    if is_byte_level(path) and vocab_size != BYTE_VOCAB_SIZE:
        raise DataError(f"{path} would be read as byte-level text (token id = byte, 0..255), but this program's "
                        f"vocabulary has {vocab_size} tokens, not the {BYTE_VOCAB_SIZE} bytes: tokenize the text "
                        f"with the model's tokenizer and pass the ids as a 1-D .npy array or a "
                        f"*{TOKEN_TEXT_SUFFIX} file")


def load_tokens(path: PathLike) -> np.ndarray:
    """The token stream of a data file as an integer array [N] (see the module docstring for the formats)."""
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


class TokenBatcher:
    """Deterministic (tokens, labels) int64 [B, S] batches addressed by position (module docstring)."""

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, *, seed: int = 0, shuffle: bool = True,
                 source: str = "data") -> None:
        if batch_size <= 0 or seq_len <= 0:
            raise DataError(f"batch size and sequence length must be positive, got {batch_size} x {seq_len}")
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise DataError(f"{source}: tokens must be a 1-D integer array, got {tokens.dtype}{list(tokens.shape)}")
        if not 0 <= seed < 2**32:
            raise DataError(f"the data seed must be in [0, 2**32), got {seed}")
        self.tokens = tokens  # kept in its own dtype (a memory map stays one); batches are int64
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.shuffle = shuffle
        self.source = source
        self.n_windows = (self.tokens.size - 1) // seq_len if self.tokens.size else 0
        if self.n_windows < batch_size:
            raise DataError(
                f"{source} is too short for one batch: {self.tokens.size} tokens make {self.n_windows} window(s) of "
                f"{seq_len} + 1 tokens, a batch of {batch_size} x {seq_len} needs {batch_size} windows "
                f"(at least {batch_size * seq_len + 1} tokens)")
        self._order_cache: tuple[int, np.ndarray] | None = None

    @property
    def batches_per_epoch(self) -> float:
        return self.n_windows / self.batch_size

    @functools.cached_property
    def fingerprint(self) -> str:
        """sha256 of the token stream and the batching parameters: what a checkpoint's data must match."""
        digest = hashlib.sha256()
        digest.update(f"vktrain-batcher:B={self.batch_size}:S={self.seq_len}:shuffle={int(self.shuffle)}:".encode())
        for start in range(0, self.tokens.size, _CHUNK):  # as int64, so the storage dtype does not matter
            digest.update(self.tokens[start:start + _CHUNK].astype("<i8").tobytes())
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
            indices[row] = self._order(epoch)[within]
        return indices

    def batch(self, position: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, labels), both int64 [B, S], of batch number `position` (0-based)."""
        starts = self.window_indices(position) * self.seq_len
        rows = self.tokens[starts[:, None] + np.arange(self.seq_len + 1)[None, :]].astype(np.int64)
        return np.ascontiguousarray(rows[:, :-1]), np.ascontiguousarray(rows[:, 1:])

    def batches(self, start: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Batches start, start + 1, ... (endless)."""
        position = start
        while True:
            yield self.batch(position)
            position += 1


__all__ = ["BYTE_VOCAB_SIZE", "DataError", "TOKEN_TEXT_SUFFIX", "TokenBatcher", "check_byte_level_fits",
           "check_vocab", "default_dataset_path", "epoch_order", "is_byte_level", "load_tokens"]
