"""`vktrain merge`: a training program's base with its LoRA adapters folded in, as a Hugging Face model
directory (numpy + safetensors; no torch).

    merge_to_hf_directory("step.pte", "merged/", adapters_dir="adapters/")     # or checkpoint="ck.safetensors"

What is merged. The base is the one the adapters were trained through: the program's own constants, i.e.
the dequantized q4gsw weights of every adapted linear (vktrain.quant's layouts) and the float weights of
everything else (embedding, norms, biases, unadapted linears). Each adapted weight becomes
deq(W) + (alpha / r) * B @ A (float64 product, stored float32), so the merged model computes what vktrain's
LoRA model computes, up to float32 rounding. (Merging into the float source weights instead would give a
model the adapters were never trained with.) Everything is written float32.

The directory holds model.safetensors (HF names), config.json (the source checkpoint's, when the program
was exported from a Hugging Face directory that is still there; otherwise built from the recorded model
config), and the source's tokenizer and generation files when it has them.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Mapping, Optional, Union

import numpy as np
import safetensors.numpy

from vktrain.contract import MODEL_PREFIX
from vktrain.errors import VktrainError
from vktrain.quant import Q8_0_CODES_SUFFIX, Q8_0_SCALES_SUFFIX, dequantize, dequantize_q8_0, unpack_w4x8
from vktrain.serialization.peft_adapters import LORA_SUFFIXES
from vktrain.train.adapters import (
    ProgramAdapters, add_program_adapter_arguments, load_program_adapters, read_program_graph
)
from vktrain.train.checkpoint import atomic_write_bytes, atomic_write_json
from vktrain.train.outputs import (Output, OutputKind, add_overwrite_argument, check_outputs, refuse_input,
                                   safetensors_metadata)

PathLike = Union[str, os.PathLike]

MERGED_WEIGHTS = "model.safetensors"
# Files copied from a Hugging Face source directory when present.
SOURCE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                "chat_template.jinja", "generation_config.json")
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_Q4_WEIGHTS, _Q4_SCALES = ".weights", ".scales"  # LoRAQ4Linear's buffers (vktrain.lora.layers)
_SKIPPED = ("rope_cos", "rope_sin")  # functions of the config, rebuilt by transformers
# model.safetensors' metadata: transformers reads "format"; "written_by" tells a merged directory apart
# from any other model directory (which `--out` never replaces without --overwrite).
_WEIGHTS_METADATA = {"format": "pt", "written_by": "vktrain merge"}
MERGED_DIRECTORY = OutputKind(
    "a directory vktrain merge wrote",
    lambda path: safetensors_metadata(path / MERGED_WEIGHTS).get("written_by") == _WEIGHTS_METADATA["written_by"],
    directory=True, writes=(MERGED_WEIGHTS, "config.json", *SOURCE_FILES))


class MergeError(VktrainError, ValueError):
    """A program, adapters or output that cannot make a merged model."""


def _program_constants(program: Path):
    """(graph, {name under the model: value id}) of the program's delegate constants."""
    graph = read_program_graph(program)
    constants = {}
    for value_id, value in enumerate(graph.values):
        # The lora_A of a --freeze-lora-a program are constants too, but adapters, not base weights.
        if (getattr(value, "constant_id", -1) >= 0 and value.name.startswith(MODEL_PREFIX)
                and not value.name.endswith(LORA_SUFFIXES)):
            if graph.is_synthetic(value.constant_id):
                raise MergeError(f"{program}: constant {value.name} is synthetic "
                                 f"(a benchmark program holds no weights)")
            constants[value.name[len(MODEL_PREFIX):]] = value_id
    return graph, constants


def program_weights(program: PathLike, needs: str = "rebuilding the model from the program"
                    ) -> tuple[dict[str, np.ndarray], dict[str, tuple[np.ndarray, np.ndarray]], ProgramAdapters]:
    """(float32 frozen weights by HF name: every constant of the model but the q4gsw bases, Q8_0 matrices
    dequantized; {adapted module: (W_4X8 words, float32 scales [G, N])} of the q4gsw bases, as stored
    (unpack_w4x8 with the layer's N and K gives the flat codes); the program's recorded adapter facts)."""
    program = Path(program)
    graph, constants = _program_constants(program)
    recorded = ProgramAdapters.from_metadata(graph.metadata, str(program))
    refusal = recorded.family_refusal(tuple(HF_ARCHITECTURES), str(program), needs)
    if refusal:
        raise MergeError(refusal)
    bases = {name.removesuffix(_Q4_WEIGHTS): (np.asarray(graph.constant_array(value_id)),
                                              np.asarray(graph.constant_array(constants[name.removesuffix(_Q4_WEIGHTS)
                                                                                        + _Q4_SCALES]), np.float32))
             for name, value_id in constants.items()
             if name.endswith(_Q4_WEIGHTS) and name.removesuffix(_Q4_WEIGHTS) + _Q4_SCALES in constants}
    quantized = {module + suffix for module in bases for suffix in (_Q4_WEIGHTS, _Q4_SCALES)}
    tied = bool(recorded.model_config.get("tie_embeddings"))
    weights: dict[str, np.ndarray] = {}
    for name, value_id in constants.items():
        if name in quantized or name in _SKIPPED or name.endswith(Q8_0_SCALES_SUFFIX):
            continue
        if name.endswith(Q8_0_CODES_SUFFIX):  # a frozen matrix held as Q8_0 codes and scales (vktrain.quant.q8_0)
            name = name.removesuffix(Q8_0_CODES_SUFFIX)
            value = dequantize_q8_0(graph.constant_array(value_id),
                                    graph.constant_array(constants[name + Q8_0_SCALES_SUFFIX]))
        else:
            value = np.array(graph.constant_array(value_id), dtype=np.float32)
        if tied and name == "lm_head.weight":  # the tied weight may be listed under the head's name
            name = "model.embed_tokens.weight"
        weights[name] = value
    return weights, bases, recorded


def merged_state_dict(program: PathLike, adapters_dir: Optional[PathLike] = None,
                      checkpoint: Optional[PathLike] = None) -> tuple[dict[str, np.ndarray], ProgramAdapters]:
    """({HF tensor name: float32 array}, the program's recorded adapter facts) of the merged model."""
    program = Path(program)
    state, bases, recorded = program_weights(program, "merging")
    adapters, alpha = load_program_adapters(program, recorded, adapters_dir, checkpoint)
    for module, (lora_a, lora_b) in adapters.items():
        if module not in bases:
            raise MergeError(f"{program}: adapted layer {module!r} has no q4gsw base ({module}{_Q4_WEIGHTS}, "
                             f"{module}{_Q4_SCALES}) among the program's constants")
        words, scales = bases[module]
        rank, k = lora_a.shape
        n = scales.shape[1]
        if lora_b.shape != (n, rank) or k % scales.shape[0]:
            raise MergeError(f"adapters of {module}: A {list(lora_a.shape)}, B {list(lora_b.shape)} do not fit its "
                             f"base of {n} outputs with scales {list(scales.shape)}")
        base = dequantize(unpack_w4x8(words, n, k), scales, k // scales.shape[0], k).astype(np.float64)
        delta = (alpha / rank) * (lora_b.astype(np.float64) @ lora_a.astype(np.float64))
        state[module + ".weight"] = (base + delta).astype(np.float32)
    unadapted = sorted(set(bases) - set(adapters))
    if unadapted:
        raise MergeError(f"{program}: q4gsw bases without adapters: {unadapted[:4]}")
    _check_complete(state, recorded.model_config, str(program))
    return state, recorded


def _expected_names(config: Mapping) -> set[str]:
    per_layer = ["input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
                 "mlp.up_proj.weight", "mlp.down_proj.weight"]
    per_layer += [f"self_attn.{p}_proj.weight" for p in "qkvo"]
    if config.get("qkv_bias"):
        per_layer += [f"self_attn.{p}_proj.bias" for p in "qkv"]
    if config.get("qk_norm"):
        per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    names = {f"model.layers.{i}.{suffix}" for i in range(int(config["n_layers"])) for suffix in per_layer}
    names |= {"model.embed_tokens.weight", "model.norm.weight"}
    if not config.get("tie_embeddings"):
        names.add("lm_head.weight")
    return names


def _check_complete(state: Mapping[str, np.ndarray], config: Mapping, where: str) -> None:
    expected = _expected_names(config)
    missing, unknown = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unknown:
        raise MergeError(f"{where}: the program's weights do not form the recorded model: missing {missing[:8]}, "
                         f"unexpected {unknown[:8]}")


def hf_config(config: Mapping, family: str) -> dict:
    """A transformers config.json for a recorded LlamaConfig (vktrain.models.llama) of `family`."""
    if config.get("rope_freq_factors") is not None:
        raise MergeError("the model's rope scaling came as llama.cpp rope_freqs factors, which a Hugging Face "
                         "config.json cannot express; merge a program exported from a Hugging Face directory")
    head_dim = config.get("attn_head_dim") or config["dim"] // config["n_heads"]
    rope = {"rope_type": "default", "rope_theta": config["rope_theta"]}
    if config.get("rope_scaling"):
        rope = {"rope_type": "llama3", "rope_theta": config["rope_theta"], **config["rope_scaling"]}
    return {
        "architectures": [HF_ARCHITECTURES[family]], "model_type": family, "vocab_size": config["vocab_size"],
        "hidden_size": config["dim"], "intermediate_size": config["hidden"], "num_hidden_layers": config["n_layers"],
        "num_attention_heads": config["n_heads"], "num_key_value_heads": config["n_kv_heads"], "head_dim": head_dim,
        "hidden_act": "silu", "rms_norm_eps": config["norm_eps"], "max_position_embeddings": config["max_seq_len"],
        "tie_word_embeddings": bool(config["tie_embeddings"]), "rope_parameters": rope,
        "attention_bias": False, "mlp_bias": False, "dtype": "float32",
    }


def _source_directory(recorded: ProgramAdapters) -> Optional[Path]:
    for candidate in (recorded.base_model, recorded.source_model):
        if candidate and (Path(candidate) / "config.json").is_file():
            return Path(candidate)
    return None


def merge_to_hf_directory(program: PathLike, out_dir: PathLike, adapters_dir: Optional[PathLike] = None,
                          checkpoint: Optional[PathLike] = None) -> Path:
    """Write the merged model (module docstring) into `out_dir` (created if needed); returns it."""
    state, recorded = merged_state_dict(program, adapters_dir, checkpoint)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise MergeError(f"--out {out} is a file; expected a directory (it will hold the merged model)")
    source = _source_directory(recorded)
    if source is not None:
        refuse_input(Output("--out", str(out_dir), MERGED_DIRECTORY), "the model directory the program was exported "
                     "from:", str(source))
    out.mkdir(parents=True, exist_ok=True)
    if source is not None:
        config = json.loads((source / "config.json").read_text(encoding="utf-8"))
        config.pop("torch_dtype", None)
        config["dtype"] = "float32"
    else:
        config = hf_config(recorded.model_config, recorded.family)
    atomic_write_bytes(out / MERGED_WEIGHTS, safetensors.numpy.save(state, metadata=_WEIGHTS_METADATA))
    atomic_write_json(out / "config.json", config)
    for name in SOURCE_FILES if source is not None else ():
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)
    return out


def add_merge_arguments(parser):
    """The `vktrain merge` arguments (the subcommand's parser; run it with `run_merge`)."""
    add_program_adapter_arguments(parser)
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="Hugging Face model directory to write (config.json, model.safetensors, tokenizer files)")
    add_overwrite_argument(parser)
    return parser


def run_merge(args) -> int:
    """`vktrain merge`: 0 on success; bad input raises a VktrainError (the CLI's one-line error)."""
    check_outputs([Output("--out", args.out, MERGED_DIRECTORY)], overwrite=args.overwrite,
                  inputs=[("the program", args.program), ("--adapters", args.adapters), ("--checkpoint", args.checkpoint)])
    out = merge_to_hf_directory(args.program, args.out, adapters_dir=args.adapters, checkpoint=args.checkpoint)
    print(f"wrote {out}: {args.program}'s dequantized q4gsw base with the adapters of "
          f"{args.adapters or args.checkpoint} merged in (float32)")
    return 0


__all__ = ["MERGED_WEIGHTS", "MergeError", "SOURCE_FILES", "add_merge_arguments", "hf_config", "merge_to_hf_directory",
           "merged_state_dict", "program_weights", "run_merge"]
