"""Split a data file into one shard per client (numpy only): i.i.d. or Dirichlet over documents.

The unit of a split is a document: a row of a `*.jsonl` file (a `{"text"}` document or a `{"messages"}`
chat), which keeps chats whole and their label masks (only assistant turns train) as `vktrain train`
makes them; any other file (text, `.npy`, `*.tokens.txt`) is read as `vktrain train --data` reads it and
cut into consecutive pieces of `unit_tokens` tokens, each piece a document. A client's shard is its
documents in file order, written in the source's own form (JSONL rows, or a `.npy` token array), so
each client reads it exactly as `vktrain train --data` would.

  iid              documents shuffled by the seed, then dealt into N shards of equal size (+-1)
  dirichlet:ALPHA  client proportions p ~ Dirichlet(ALPHA, ..., ALPHA), each document goes to client k with
                   probability p_k: shard sizes are skewed (small ALPHA: a few clients hold most of the
                   data; large ALPHA: near i.i.d.). Documents carry no class, so the skew is in quantity;
                   drawn again (same seed stream) until every client holds at least `min_documents`.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import numpy as np

from vktrain.errors import VktrainError
from vktrain.train.data import JSONL_SUFFIX, load_data

PathLike = Union[str, os.PathLike]

IID = "iid"
DIRICHLET = "dirichlet"
# Dirichlet draws tried before a split that leaves a client too little data is refused.
MAX_DIRICHLET_DRAWS = 1000


class PartitionError(VktrainError, ValueError):
    """A data split that cannot work: a bad --partition, or too little data for the clients."""


@dataclass(frozen=True)
class PartitionScheme:
    kind: str  # IID or DIRICHLET
    alpha: Optional[float] = None  # the Dirichlet concentration

    @classmethod
    def parse(cls, text: str) -> "PartitionScheme":
        """`iid` or `dirichlet:ALPHA` (ALPHA a positive number)."""
        if text == IID:
            return cls(IID)
        kind, sep, value = text.partition(":")
        if kind == DIRICHLET and sep:
            try:
                alpha = float(value)
            except ValueError:
                alpha = math.nan
            if math.isfinite(alpha) and alpha > 0:
                return cls(DIRICHLET, alpha)
        raise PartitionError(f"--partition {text!r}: expected 'iid' or 'dirichlet:ALPHA' with ALPHA > 0 "
                             f"(e.g. dirichlet:0.5)")

    def __str__(self) -> str:
        return IID if self.kind == IID else f"{DIRICHLET}:{self.alpha:g}"


def assign_documents(n_documents: int, n_clients: int, scheme: PartitionScheme, seed: int,
                     min_documents: int = 1) -> list[np.ndarray]:
    """The document indices of each client (ascending), by `scheme` (module docstring)."""
    if n_clients < 1:
        raise PartitionError(f"the number of clients must be >= 1, got {n_clients}")
    if n_documents < n_clients * min_documents:
        raise PartitionError(f"{n_documents} document(s) cannot give {n_clients} clients {min_documents} each")
    rng = np.random.default_rng(seed)
    if scheme.kind == IID:
        return [np.sort(part) for part in np.array_split(rng.permutation(n_documents), n_clients)]
    for _ in range(MAX_DIRICHLET_DRAWS):
        proportions = rng.dirichlet(np.full(n_clients, scheme.alpha))
        owner = rng.choice(n_clients, size=n_documents, p=proportions)
        if np.bincount(owner, minlength=n_clients).min() >= min_documents:
            return [np.flatnonzero(owner == client) for client in range(n_clients)]
    raise PartitionError(f"--partition {scheme}: no split of {n_documents} documents in {MAX_DIRICHLET_DRAWS} draws "
                         f"gives each of {n_clients} clients {min_documents} document(s); use a larger ALPHA, fewer "
                         f"clients or more data")


def _jsonl_rows(path: Path) -> list[str]:
    try:
        return [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except UnicodeDecodeError as exc:
        raise PartitionError(f"{path}: JSONL data must be UTF-8 ({exc})") from None


def write_shards(path: PathLike, out_dir: PathLike, n_clients: int, scheme: PartitionScheme, seed: int, *,
                 vocab_size: int, tokenizer=None, unit_tokens: int, min_documents: int = 1,
                 prefix: str = "train") -> list[Path]:
    """Split `path` into `n_clients` shard files in `out_dir` (`<prefix>.<client>.jsonl|npy`); returns them
    in client order. `unit_tokens`: the size of a document cut from a token stream."""
    path, out_dir = Path(path), Path(out_dir)
    if not path.is_file():
        raise PartitionError(f"data file {path} does not exist (or is not a file)")
    out_dir.mkdir(parents=True, exist_ok=True)
    shards = []
    if path.name.lower().endswith(JSONL_SUFFIX):
        rows = _jsonl_rows(path)
        for client, indices in enumerate(assign_documents(len(rows), n_clients, scheme, seed, min_documents)):
            shard = out_dir / f"{prefix}.{client}{JSONL_SUFFIX}"
            shard.write_text("".join(rows[i] + "\n" for i in indices), encoding="utf-8")
            shards.append(shard)
        return shards
    tokens = load_data(path, vocab_size, tokenizer).tokens
    n_units = tokens.size // unit_tokens
    for client, indices in enumerate(assign_documents(n_units, n_clients, scheme, seed, min_documents)):
        shard = out_dir / f"{prefix}.{client}.npy"
        pieces = [tokens[i * unit_tokens:(i + 1) * unit_tokens] for i in indices]
        np.save(shard, np.concatenate(pieces).astype(np.int64))
        shards.append(shard)
    return shards


__all__ = ["DIRICHLET", "IID", "PartitionError", "PartitionScheme", "assign_documents", "write_shards"]
