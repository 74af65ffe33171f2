"""LoRA adapters as a GGUF file for llama.cpp's `--lora` (numpy + the `gguf` package; no torch).

The file follows llama.cpp's convert_lora_to_gguf.py conventions:
  metadata  general.architecture  the base model's (llama, qwen2, qwen3: the program's recorded family)
            general.type "adapter", adapter.type "lora", adapter.lora.alpha float32 (scale = alpha / r)
  tensors   <base tensor>.lora_a  float32 [r, in]   (PEFT's lora_A; GGUF dims ne = [in, r])
            <base tensor>.lora_b  float32 [out, r]  (PEFT's lora_B)
            with <base tensor> llama.cpp's name of the adapted weight, e.g. blk.3.attn_q.weight.
llama.cpp's converter permutes the rows of a llama model's attn_q / attn_k weights (its rope rotates
adjacent row pairs, HF's rotates dims i and i + D/2 of each head). The adapter's delta B @ A must be
permuted the same way to apply to those permuted weights; the permutation acts on output rows only, so it
is applied to lora_b (as the converter does). Qwen2/Qwen3 files are not permuted.
"""
from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Mapping, Union

import numpy as np

from vktrain.gguf_names import GGUF_FAMILIES, LAYER_LINEARS, OUTPUT_HEAD, PERMUTED_QK_FAMILIES
from vktrain.serialization.peft_adapters import AdapterError
from vktrain.train.adapters import (
    ProgramAdapters, add_program_adapter_arguments, load_program_adapters, read_program_graph
)
from vktrain.train.checkpoint import atomic_write_bytes
from vktrain.train.outputs import GGUF_ADAPTER, Output, add_overwrite_argument, check_outputs

PathLike = Union[str, os.PathLike]

# HF module path (after model.layers.N.) -> llama.cpp tensor name (after blk.N.): the adaptable linears.
GGUF_LAYER_LINEARS = {hf: gguf for gguf, hf in LAYER_LINEARS.items()}
_LAYER_PATH = re.compile(r"model\.layers\.(\d+)\.(.+)")


def permute_rows(rows: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's q/k permutation of the first axis (output rows) of rows [N, ...], N = n_heads * D: each
    head's rows (first half, second half) are interleaved: reshape(H, 2, D/2, ...).swapaxes(1, 2)."""
    n = rows.shape[0]
    if n % (2 * n_heads):
        raise AdapterError(f"cannot permute {n} rows into {n_heads} heads of an even width")
    return rows.reshape(n_heads, 2, n // n_heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def gguf_tensor_name(module: str, tie_embeddings: bool) -> str:
    """The llama.cpp name of the weight an HF module path adapts: model.layers.3.self_attn.q_proj ->
    blk.3.attn_q.weight; lm_head -> output.weight (untied heads only)."""
    if module == "lm_head":
        if tie_embeddings:
            raise AdapterError("lm_head is adapted but tied to the embedding: llama.cpp has no separate output "
                               "tensor to apply it to (export with the default targets, which leave the head out)")
        return f"{OUTPUT_HEAD}.weight"
    match = _LAYER_PATH.fullmatch(module)
    if match is None or match.group(2) not in GGUF_LAYER_LINEARS:
        raise AdapterError(f"adapted module {module!r} has no llama.cpp tensor name; adaptable: lm_head and "
                           f"model.layers.N.{{{', '.join(GGUF_LAYER_LINEARS)}}}")
    return f"blk.{match.group(1)}.{GGUF_LAYER_LINEARS[match.group(2)]}.weight"


def check_gguf_adapter_program(recorded: ProgramAdapters, where: str) -> tuple[int, int, bool]:
    """(n_heads, n_kv_heads, tied head) of a program whose adapters can be written as a GGUF adapter (every
    recorded adapted layer has a llama.cpp name); an AdapterError naming `where` otherwise. Called before
    training, so that a run never ends in a refusal."""
    refusal = recorded.family_refusal(GGUF_FAMILIES, where, "a GGUF adapter")
    if refusal:
        raise AdapterError(refusal)
    config = recorded.model_config
    try:
        n_heads, n_kv_heads = int(config["n_heads"]), int(config["n_kv_heads"])
        tied = bool(config["tie_embeddings"])
    except (KeyError, TypeError, ValueError):
        raise AdapterError(f"{where}: the recorded model config lacks n_heads / n_kv_heads / tie_embeddings") from None
    for module in recorded.layers or ():
        gguf_tensor_name(module, tied)
    return n_heads, n_kv_heads, tied


def gguf_adapter_tensors(adapters: Mapping[str, tuple[np.ndarray, np.ndarray]],
                         recorded: ProgramAdapters, where: str) -> dict[str, np.ndarray]:
    """{llama.cpp tensor name: float32 array} of the adapters (module docstring); `recorded` is the
    program's metadata (family and model config), `where` names it in errors."""
    n_heads, n_kv_heads, tied = check_gguf_adapter_program(recorded, where)
    heads = {"attn_q": n_heads, "attn_k": n_kv_heads} if recorded.family in PERMUTED_QK_FAMILIES else {}
    tensors = {}
    for module, (lora_a, lora_b) in sorted(adapters.items()):
        name = gguf_tensor_name(module, tied)
        kind = name.split(".")[-2]
        lora_b = np.asarray(lora_b, dtype=np.float32)
        if kind in heads:
            lora_b = permute_rows(lora_b, heads[kind])
        tensors[f"{name}.lora_a"] = np.ascontiguousarray(lora_a, dtype=np.float32)
        tensors[f"{name}.lora_b"] = np.ascontiguousarray(lora_b)
    return tensors


def save_gguf_adapter(path: PathLike, adapters: Mapping[str, tuple[np.ndarray, np.ndarray]], lora_alpha: float,
                      recorded: ProgramAdapters, where: str) -> Path:
    """Write the adapters as a llama.cpp LoRA GGUF at `path` (atomically)."""
    import gguf

    tensors = gguf_adapter_tensors(adapters, recorded, where)
    path = Path(path)
    # GGUFWriter writes to a path; a private temporary file, whose name no error shows (atomic_write's do).
    fd, temp_name = tempfile.mkstemp(prefix="vktrain-gguf-")
    os.close(fd)
    temp = Path(temp_name)
    writer = gguf.GGUFWriter(str(temp), recorded.family)
    try:
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(lora_alpha))
        if recorded.base_model:
            writer.add_string(gguf.Keys.General.NAME, Path(recorded.base_model).name + " LoRA")
        for name, array in tensors.items():
            writer.add_tensor(name, array)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        atomic_write_bytes(path, temp.read_bytes())
    finally:
        temp.unlink(missing_ok=True)
    return path


def add_convert_arguments(parser):
    """`vktrain adapters convert` (run it with `run_convert`)."""
    add_program_adapter_arguments(parser)
    parser.add_argument("--out", required=True, metavar="FILE.gguf", help="the llama.cpp LoRA GGUF to write")
    add_overwrite_argument(parser)
    return parser


def run_convert(args) -> int:
    """`vktrain adapters convert`: a program's adapters (directory or checkpoint) as a llama.cpp LoRA GGUF."""
    check_outputs([Output("--out", args.out, GGUF_ADAPTER)], overwrite=args.overwrite,
                  inputs=[("the program", args.program), ("--adapters", args.adapters), ("--checkpoint", args.checkpoint)])
    recorded = ProgramAdapters.from_metadata(read_program_graph(args.program).metadata, args.program)
    check_gguf_adapter_program(recorded, args.program)
    adapters, alpha = load_program_adapters(args.program, recorded, args.adapters, args.checkpoint)
    save_gguf_adapter(args.out, adapters, alpha, recorded, args.program)
    print(f"wrote {args.out}: {len(adapters)} adapted layer(s), lora_alpha {alpha:g} (llama.cpp: --lora {args.out})")
    return 0


__all__ = ["GGUF_FAMILIES", "GGUF_LAYER_LINEARS", "PERMUTED_QK_FAMILIES", "add_convert_arguments",
           "check_gguf_adapter_program", "gguf_adapter_tensors", "gguf_tensor_name", "permute_rows", "run_convert",
           "save_gguf_adapter"]
