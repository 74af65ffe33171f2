"""Export ONE LoRA training step (forward, backward, AdamW) as a single ExportedProgram.

Program signature (every value a runtime input; nothing about the optimizer is baked into the graph):
    inputs   token_ids int64 [B, S], labels int64 [B, S] (< 0 = ignored), hparams float32 [5] =
             [lr, beta1, beta2, eps, weight_decay], n_valid float32 [] (the loss divisor: the number of
             labels >= 0 in the batch, or in the whole accumulated batch; the caller computes it, which
             keeps integer reductions out of the GPU graph and lets gradient accumulation pick its divisor)
    output   loss float32 []
    state    (mutable buffers, updated in place every step)
             model.<layer>.lora_A / lora_B                  the adapters
             optimizer.exp_avg.<layer>.lora_A / ...        AdamW first moments
             optimizer.exp_avg_sq.<layer>.lora_A / ...     AdamW second moments
             optimizer.step                                 float32 [], t after the update (1 on the first)
    constants (frozen buffers) model.<path> for everything else (q4gsw weights/scales, embedding, ...)

Route: torch.export the loss -> the joint graph (loss + gradient of every trainable parameter, as
torch.export.experimental._export_forward_backward builds it, but keeping PRESERVED_OPS whole) -> the
step program, written into the joint graph by vktrain/export/step_graph.py (vktrain.adamw per LoRA
tensor, the state updates as buffer mutations) instead of a second torch.export of a module calling the
joint graph, which cost minutes for a 30-layer model. (autograd.grad inside a traced forward does not
export; this route does.)
"""
from __future__ import annotations

import copy
import dataclasses
import json
from collections import Counter
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn
from torch.export import ExportedProgram
from torch._decomp import core_aten_decompositions
from torch.export.exported_program import _decompose_exported_program
from torch.export.graph_signature import InputKind

import vktrain.ops  # noqa: F401  (registers torch.ops.vktrain.*)
from vktrain.contract import (EXP_AVG_PREFIX, EXP_AVG_SQ_PREFIX, METADATA_BASE_MODEL, METADATA_LORA_ALPHA,
                              METADATA_LORA_LAYERS, METADATA_LORA_RANK, METADATA_LORA_TARGET_MODULES,
                              METADATA_MODEL_CONFIG, METADATA_MODEL_FAMILY, METADATA_SOURCE_MODEL,
                              STEP_STATE as STEP_BUFFER)
from vktrain.lora import LoRAQ4Linear, lora_modules, lora_parameter_names
from vktrain.partitioner.op_registry import PRESERVED_OPS, first_refusal

from .step_graph import eval_program_from_joint, training_step_program


class _LossModule(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, token_ids: torch.Tensor, labels: torch.Tensor, n_valid: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.model.loss(token_ids, labels, n_valid),)


def example_training_inputs(batch_size: int, seq_len: int, vocab_size: int = 256,
                            seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token_ids, labels, hparams, n_valid) of the shapes and dtypes the step program takes."""
    if batch_size <= 0 or seq_len <= 0:
        raise ValueError(f"batch size and sequence length must be positive, got batch={batch_size}, seq={seq_len}")
    gen = torch.Generator().manual_seed(seed)
    token_ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=gen, dtype=torch.int64)
    labels = torch.randint(0, vocab_size, (batch_size, seq_len), generator=gen, dtype=torch.int64)
    hparams = vktrain.ops.adamw_hparams(1e-3)
    n_valid = (labels >= 0).sum().to(torch.float32)
    return token_ids, labels, hparams, n_valid


def decomposition_table() -> dict:
    """What every exported program is decomposed with: core ATen (what the op registry covers, and what
    ExecuTorch's to_edge would decompose to), except PRESERVED_OPS (ops the runtime runs fused)."""
    table = core_aten_decompositions()
    for op in PRESERVED_OPS:
        table.pop(op, None)
    return table


def in_registry_ops(program: ExportedProgram) -> ExportedProgram:
    """`program` (a fresh torch.export) in ops the vktrain registry takes: itself when every node already is
    one (no retrace: a 30-layer forward costs a minute to decompose), else decomposed with
    decomposition_table(), which also functionalises whatever torch.export left in place."""
    if first_refusal(program) is None:
        return program
    return program.run_decompositions(decomposition_table())


def joint_forward_backward(loss_program: ExportedProgram) -> ExportedProgram:
    """The joint graph of a loss program: outputs the loss, then the gradient of every trainable parameter.

    What torch.export.experimental._export_forward_backward does, except that PRESERVED_OPS (activation
    backwards the runtime fuses) are not decomposed."""
    return _decompose_exported_program(loss_program, cia_to_decomp={}, python_decomp_table=decomposition_table(),
                                       joint_loss_index=0, decompose_custom_triton_ops=False)


def check_batch_shape(batch_shape) -> tuple[int, int]:
    """(batch_size, seq_len) of an export's token batch, both positive; ValueError naming the problem."""
    try:
        batch_size, seq_len = (int(d) for d in batch_shape)
    except (TypeError, ValueError):
        raise ValueError(f"batch_shape must be (batch_size, seq_len), got {batch_shape!r}") from None
    if batch_size <= 0 or seq_len <= 0:
        raise ValueError(f"batch_shape must be positive (batch_size, seq_len), got {batch_shape!r}")
    return batch_size, seq_len


def export_training_step(model: nn.Module, batch_shape: tuple[int, int]) -> ExportedProgram:
    """Export one training step of `model` (with LoRA adapters inserted) for token batches of `batch_shape`.

    The model is not modified (it is deep-copied). See the module docstring for the program's signature.
    """
    joint, trainable = _joint_program(model, batch_shape)
    program = training_step_program(joint, trainable)
    drop_unused_constant_inputs(program)
    return program


def export_training_and_eval_steps(model: nn.Module, batch_shape: tuple[int, int], *,
                                   freeze_lora_a: bool = False) -> tuple[ExportedProgram, ExportedProgram]:
    """(the training step, its eval method) from ONE trace: the eval program is the joint graph's forward
    (vktrain/export/eval.py's signature; export_eval_step traces it anew), which saves an export of
    the model's forward (half a minute for a 30-layer model). `freeze_lora_a`: only the lora_B tensors
    train (FFA-LoRA); the lora_A tensors stay frozen constants, so their gradient GEMMs are not exported."""
    joint, trainable = _joint_program(model, batch_shape, freeze_lora_a)
    evaluation = eval_program_from_joint(joint)
    program = training_step_program(joint, trainable)
    for exported in (program, evaluation):
        drop_unused_constant_inputs(exported)
    return program, evaluation


def _joint_program(model: nn.Module, batch_shape: tuple[int, int],
                   freeze_lora_a: bool = False) -> tuple[ExportedProgram, list[str]]:
    """The joint graph of `model`'s loss (a deep copy; LoRA tensors trainable, the rest frozen; with
    `freeze_lora_a` only the lora_B tensors), and the trainable tensors' paths."""
    batch_size, seq_len = check_batch_shape(batch_shape)
    if not lora_parameter_names(model):
        raise ValueError("the model has no LoRA adapters: call vktrain.lora.apply_lora first (nothing to train)")
    model = copy.deepcopy(model)
    trained_suffixes = (".lora_B",) if freeze_lora_a else (".lora_A", ".lora_B")
    for name, param in model.named_parameters():
        param.requires_grad_(name.endswith(trained_suffixes))
    vocab_size = getattr(model, "vocab_size", 256)
    token_ids, labels, _, n_valid = example_training_inputs(batch_size, seq_len, vocab_size)
    loss_program = torch.export.export(_LossModule(model), (token_ids, labels, n_valid))
    trainable = [name for name in lora_parameter_names(model) if name.endswith(trained_suffixes)]
    return joint_forward_backward(loss_program), trainable


def drop_unused_constant_inputs(program: ExportedProgram) -> list[str]:
    """Remove parameter / buffer / constant inputs that no node reads (and nothing mutates) from an
    ExportedProgram, in place; return their names.

    Why: the exported step lists a tied weight under both of its names (model.embed_tokens.weight and
    lm_head.weight) and reads only one, and ExecuTorch serialises the unread one into the .pte as a
    top-level constant: 1 GB of the 1B model's embedding in a file that must stay under 64 MiB.
    """
    signature = program.graph_signature
    mutated = set(signature.buffers_to_mutate.values())
    removed = []
    for node in list(program.graph.nodes):
        if node.op != "placeholder" or node.users:
            continue
        spec = next(s for s in signature.input_specs if s.arg.name == node.name)
        if spec.kind not in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR) or \
                spec.target in mutated:
            continue
        program.graph.erase_node(node)
        signature.input_specs.remove(spec)
        program.state_dict.pop(spec.target, None)
        program.constants.pop(spec.target, None)
        removed.append(spec.target)
    if removed:
        program.graph_module.recompile()
    return removed


def training_state_names(program: ExportedProgram) -> dict[str, list[str]]:
    """The program's mutable state by role: {'lora': [...], 'exp_avg': [...], 'exp_avg_sq': [...], 'step': [...]}."""
    mutated = set(program.graph_signature.buffers_to_mutate.values())
    roles: dict[str, list[str]] = {"lora": [], "exp_avg": [], "exp_avg_sq": [], "step": []}
    for name in program.graph_signature.buffers:
        if name not in mutated:
            continue
        if name == STEP_BUFFER:
            roles["step"].append(name)
        elif name.startswith(EXP_AVG_SQ_PREFIX):
            roles["exp_avg_sq"].append(name)
        elif name.startswith(EXP_AVG_PREFIX):
            roles["exp_avg"].append(name)
        else:
            roles["lora"].append(name)
    return roles


# ---- what adapters and merged models need, recorded in the blob's metadata (keys: vktrain.contract) -----------

def _model_family(model: nn.Module) -> Optional[str]:
    """llama.cpp's general.architecture for a LlamaForCausalLM (its config switches tell the variant)."""
    config = getattr(model, "config", None)
    if not hasattr(config, "qk_norm"):
        return None
    return "qwen3" if config.qk_norm else "qwen2" if config.qkv_bias else "llama"


def peft_target_modules(model: nn.Module, adapted: list[str]) -> list[str]:
    """PEFT's target_modules for the adapted layers: their leaf names (`q_proj`, ...) when those pick exactly
    the adapted layers among the model's linears (PEFT matches a name against the end of each module path),
    else the full module paths."""
    linears = [name for name, module in model.named_modules() if isinstance(module, (nn.Linear, LoRAQ4Linear))]
    leaves = sorted({path.rpartition(".")[2] for path in adapted})
    picked = [path for path in linears if path.rpartition(".")[2] in leaves]
    return leaves if sorted(picked) == sorted(adapted) else sorted(adapted)


def _base_model_name(source: str, loaded: Any) -> str:
    """base_model_name_or_path: the HF directory (absolute), the HF repository a GGUF names as its source,
    else the GGUF file or preset name as given."""
    if loaded is None:
        return source
    if loaded.format == "hf":
        return str(Path(loaded.path).absolute())
    repository = loaded.metadata.get("general.source.huggingface.repository")
    return repository if isinstance(repository, str) and repository else str(Path(loaded.path).absolute())


def adapter_metadata(model: nn.Module, source: str, loaded: Any = None) -> dict[str, str]:
    """The blob metadata describing `model`'s adapters and what they adapt (vktrain.contract's
    ADAPTER_METADATA_KEYS): `source` is what the model was made from (a preset name or a path), `loaded`
    the vktrain.models.LoadedModel when it was loaded from a checkpoint. Rank and alpha are the layers'
    own; layers of differing rank or alpha are refused (one r and lora_alpha describe them all)."""
    layers = lora_modules(model)
    if not layers:
        raise ValueError("the model has no LoRA adapters: call vktrain.lora.apply_lora first")
    settings = Counter((layer.rank, layer.alpha) for layer in layers.values())
    if len(settings) > 1:
        raise ValueError(f"LoRA layers differ in (rank, alpha): {dict(settings)}; the adapter files record one of each")
    (rank, alpha), = settings
    adapted = list(layers)
    metadata = {
        METADATA_SOURCE_MODEL: str(source),
        METADATA_BASE_MODEL: _base_model_name(str(source), loaded),
        METADATA_LORA_RANK: str(rank),
        METADATA_LORA_ALPHA: repr(float(alpha)),
        METADATA_LORA_TARGET_MODULES: json.dumps(peft_target_modules(model, adapted)),
        METADATA_LORA_LAYERS: json.dumps(adapted),
    }
    family = _model_family(model)
    if family is not None:
        metadata[METADATA_MODEL_FAMILY] = family
    config = getattr(model, "config", None)
    if dataclasses.is_dataclass(config):
        metadata[METADATA_MODEL_CONFIG] = json.dumps(dataclasses.asdict(config))
    return metadata


def adapter_metadata_specs(model: nn.Module, source: str, loaded: Any = None) -> list:
    """adapter_metadata as compile specs for VktrainPartitioner(compile_specs=...)."""
    from vktrain.backend.preprocess import metadata_spec

    return [metadata_spec(key, value) for key, value in adapter_metadata(model, source, loaded).items()]
