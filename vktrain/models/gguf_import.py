"""GGUF files (llama.cpp's format) -> LlamaForCausalLM, with the `gguf` package's reader.

- Architecture and config from the metadata (`general.architecture`, `<arch>.embedding_length`, ...);
  rope scaling from the `rope_freqs.weight` tensor (llama.cpp's per-frequency divisors, how a Llama 3
  GGUF stores its "llama3" scaling) into LlamaConfig.rope_freq_factors; other scaling is refused.
- Every tensor type gguf.quants.dequantize handles is dequantized to float32.
- llama.cpp's convert script permutes the rows of a llama model's attn_q / attn_k (its rope rotates
  adjacent pairs of rows; HF's rotates dims i and i + D/2 of each head); the permutation is undone here.
  (qwen2 / qwen3 files are written unpermuted.)
- Q4_0 (symmetric, one float16 scale per 32 weights, w = (c - 8) * d) is exactly q4gsw at group size 32:
  code c and scale d are taken as they are (d may be negative: Q4_0 puts the group's largest-magnitude
  weight on c = 0, and q4gsw decodes q * s whatever the sign). The linear weight holds the exact
  dequantized values and carries the codes as a Q4GSWWeight (vktrain.lora.layers) for apply_lora.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from vktrain.gguf_names import GGUF_FAMILIES, GLOBAL_TENSORS, LAYER_TENSORS, PERMUTED_QK_FAMILIES
from vktrain.lora.layers import Q4GSWWeight
from vktrain.quant import pack_flat

from .llama import LlamaConfig
from .loading import LoadedModel, TokenizerInfo, build_loaded_model, check_overrides, context_max_seq_len

# general.architecture values imported: llama (Llama 2/3.x, SmolLM2, TinyLlama, Mistral), qwen2 (q/k/v
# biases) and qwen3 (q/k norms, own head width); names and the q/k permutation: vktrain/gguf_names.py.
GGUF_ARCHITECTURES = GGUF_FAMILIES
Q4_0_GROUP = 32

_ROPE_FREQS = "rope_freqs.weight"


def _require_gguf():
    try:
        import gguf
    except ImportError:  # pragma: no cover - a declared dependency
        raise ValueError("reading GGUF files needs the `gguf` package (pip install gguf)") from None
    return gguf


def read_metadata(reader) -> dict[str, Any]:
    """Every metadata field of a GGUFReader as a Python value (strings, numbers, lists)."""
    return {name: f.contents() for name, f in reader.fields.items() if not name.startswith("GGUF.")}


def unpermute_rows(rows: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo convert_hf_to_gguf's permute on the first axis (output rows) of rows [N, ...], N = n_heads * D:
    theirs is reshape(H, 2, D/2, ...).swapaxes(1, 2); the inverse is reshape(H, D/2, 2, ...).swapaxes(1, 2)."""
    n = rows.shape[0]
    return rows.reshape(n_heads, n // n_heads // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def q4_0_to_q4gsw(raw: np.ndarray, n: int, k: int) -> Q4GSWWeight:
    """Q4_0 blocks uint8 [N, K/32 * 18] (float16 d, then 16 bytes: element j in the low nibble of byte j,
    element j + 16 in the high nibble) -> q4gsw flat codes [N, Kp/2] and scales [G, N], value for value."""
    blocks = np.ascontiguousarray(raw).reshape(n, k // Q4_0_GROUP, 18)
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, G]
    qs = blocks[..., 2:]
    codes = np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(n, k)  # [N, G, 32] in element order
    return Q4GSWWeight(flat=pack_flat(codes.astype(np.int16) - 8), scales=np.ascontiguousarray(d.T), group_size=Q4_0_GROUP)


def _meta(metadata: dict, key: str, where: str, default=None, required: bool = False):
    if key in metadata:
        return metadata[key]
    if required:
        raise ValueError(f"{where}: metadata lacks required field {key!r}")
    return default


def _config(metadata: dict, tensors: dict, where: str, overrides: dict) -> LlamaConfig:
    arch = metadata.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"{where}: general.architecture {arch!r} is not supported; supported: "
                         f"{', '.join(GGUF_ARCHITECTURES)}")

    def get(key, default=None, required=False):
        return _meta(metadata, f"{arch}.{key}", where, default, required)

    if get("expert_count", 0):
        raise ValueError(f"{where}: {arch}.expert_count={get('expert_count')}: mixture-of-experts models are not supported")
    scaling = get("rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise ValueError(f"{where}: {arch}.rope.scaling.type={scaling!r} is not supported (only 'none', or Llama 3 "
                         f"scaling given as the {_ROPE_FREQS} tensor)")
    embed = tensors.get("token_embd.weight")
    if embed is None:
        raise ValueError(f"{where}: no tensor 'token_embd.weight' (the token embedding)")
    vocab_size = get("vocab_size") or len(metadata.get("tokenizer.ggml.tokens") or []) or int(embed.shape[1])
    n_heads = int(get("attention.head_count", required=True))
    values = dict(vocab_size=int(vocab_size), dim=int(get("embedding_length", required=True)),
                  n_layers=int(get("block_count", required=True)), n_heads=n_heads,
                  n_kv_heads=int(get("attention.head_count_kv", n_heads)),
                  hidden=int(get("feed_forward_length", required=True)),
                  norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
                  rope_theta=float(get("rope.freq_base", 10000.0)), tie_embeddings="output.weight" not in tensors,
                  qkv_bias=arch == "qwen2", qk_norm=arch == "qwen3")
    head_dim = int(get("attention.key_length", values["dim"] // n_heads))
    if head_dim * n_heads != values["dim"]:
        values["attn_head_dim"] = head_dim
    for key in ("rope.dimension_count", "attention.value_length"):
        if get(key) is not None and int(get(key)) != head_dim:
            raise ValueError(f"{where}: {arch}.{key}={get(key)} but the head width is {head_dim}: partial rotary "
                             f"or differing key / value widths are not supported")
    if _ROPE_FREQS in tensors:
        values["rope_freq_factors"] = tuple(float(f) for f in _dequantize(tensors[_ROPE_FREQS], where).reshape(-1))
    overrides = context_max_seq_len(get("context_length"), overrides, where)
    try:
        return LlamaConfig(**{**values, **overrides})
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _dequantize(tensor, where: str) -> np.ndarray:
    gguf = _require_gguf()
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists ne0 (the contiguous dim) first
    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise ValueError(f"{where}: tensor {tensor.name!r} has type {tensor.tensor_type.name}, which the gguf package "
                         f"cannot dequantize") from None
    return np.array(values, dtype=np.float32).reshape(shape)  # a copy: the reader's arrays map the file read-only


def _hf_name(name: str, n_layers: int) -> str | None:
    if name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) < n_layers:
        suffix = LAYER_TENSORS.get(parts[2])
        return None if suffix is None else f"model.layers.{parts[1]}.{suffix}"
    return None


def _tokenizer(metadata: dict, where: str) -> TokenizerInfo:
    vocab = {k.removeprefix("tokenizer.ggml."): v for k, v in metadata.items() if k.startswith("tokenizer.ggml.")}
    return TokenizerInfo(source="gguf", chat_template=metadata.get("tokenizer.chat_template"),
                         bos_token_id=vocab.get("bos_token_id"), eos_token_id=vocab.get("eos_token_id"),
                         gguf_vocab=vocab, where=where)


def load_gguf(path, **overrides) -> LoadedModel:
    """A Llama-family model from a GGUF file (module docstring); overrides replace LlamaConfig fields."""
    gguf = _require_gguf()
    path = Path(path)
    where = str(path)
    check_overrides(overrides)
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError) as e:
        raise ValueError(f"{where}: not a readable GGUF file ({e})") from None
    metadata = read_metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    config = _config(metadata, tensors, where, overrides)

    state: dict[str, torch.Tensor] = {}
    prequantized: dict[str, Q4GSWWeight] = {}
    unknown = []
    for name, tensor in tensors.items():
        if name == _ROPE_FREQS:
            continue
        hf = _hf_name(name, config.n_layers)
        if hf is None:
            unknown.append(name)
            continue
        permuted = metadata["general.architecture"] in PERMUTED_QK_FAMILIES
        heads = (config.n_heads if permuted and hf.endswith(("q_proj.weight", "q_proj.bias")) else
                 config.n_kv_heads if permuted and hf.endswith(("k_proj.weight", "k_proj.bias")) else None)
        values = _dequantize(tensor, where)
        if heads is not None:
            if values.shape[0] != heads * config.head_dim:
                raise ValueError(f"{where}: tensor {name!r} has shape {list(values.shape)}, expected "
                                 f"{heads * config.head_dim} rows ({heads} heads of {config.head_dim})")
            values = unpermute_rows(values, heads)
        if tensor.tensor_type == gguf.GGMLQuantizationType.Q4_0 and values.ndim == 2:
            n, k = values.shape
            q = q4_0_to_q4gsw(tensor.data, n, k)
            if heads is not None:
                q = Q4GSWWeight(unpermute_rows(q.flat, heads), np.ascontiguousarray(unpermute_rows(q.scales.T, heads).T),
                                q.group_size)
            prequantized[hf] = q
        state[hf] = torch.from_numpy(values)
    if unknown:
        raise ValueError(f"{where}: tensors with no place in a {metadata['general.architecture']} model of "
                         f"{config.n_layers} layers: {sorted(unknown)[:8]}{' ...' if len(unknown) > 8 else ''}")
    model = build_loaded_model(config, state, where, prequantized)
    scalars = {k: v for k, v in metadata.items() if not isinstance(v, list)}
    return LoadedModel(model=model, config=config, path=path, format="gguf",
                       architecture=metadata["general.architecture"], tokenizer=_tokenizer(metadata, where),
                       metadata=scalars)


__all__ = ["GGUF_ARCHITECTURES", "load_gguf", "q4_0_to_q4gsw", "read_metadata", "unpermute_rows"]
