"""Export ONE training step (forward, backward, AdamW) of a module as a single ExportedProgram.

Any nn.Module trains (ExecuTorch's extension/training convention): its `loss(...)` method, or its forward
when it has none, returns the scalar loss (or a tuple whose first item is the loss); the trainable tensors
are its parameters with requires_grad, and frozen parameters and buffers become constants. The built-in
token models (`export_training_step(model, batch_shape)`) are the case loss(token_ids, labels, n_valid).

Program signature (every value a runtime input; nothing about the optimizer is baked into the graph):
    inputs   the loss's inputs, then hparams float32 [5] = [lr, beta1, beta2, eps, weight_decay]; for the
             token models contract.STEP_INPUTS: token_ids int64 [B, S], labels int64 [B, S] (< 0 =
             ignored), hparams, n_valid float32 [] (the loss divisor: the number of labels >= 0 in the
             batch, or in the whole accumulated batch; the caller computes it, which keeps integer
             reductions out of the GPU graph and lets gradient accumulation pick its divisor); with
             packing="documents" the loss takes a last input, contract.POSITIONS int64 [B, S]
    output   loss float32 []
    state    (mutable buffers, updated in place every step)
             model.<path> of each trainable parameter      (the LoRA adapters: model.<layer>.lora_A / lora_B)
             optimizer.exp_avg.<path>...                    AdamW first moments
             optimizer.exp_avg_sq.<path>...                 AdamW second moments
             optimizer.step                                 float32 [], t after the update (1 on the first)
    constants (frozen buffers) model.<path> for everything else (q4gsw weights/scales, embedding, ...)

Route: torch.export the loss -> the joint graph (loss + gradient of every trainable parameter, as
torch.export.experimental._export_forward_backward builds it, but keeping PRESERVED_OPS whole) -> the
step program, written into the joint graph by vktrain/export/step_graph.py (vktrain.adamw per trainable
tensor, the state updates as buffer mutations) instead of a second torch.export of a module calling the
joint graph, which cost minutes for a 30-layer model. (autograd.grad inside a traced forward does not
export; this route does.)
"""
from __future__ import annotations

import copy
import dataclasses
import inspect
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
from vktrain.contract import (EXP_AVG_PREFIX, EXP_AVG_SQ_PREFIX, METADATA_ACTIVATION_CHECKPOINTING,
                              METADATA_BASE_MODEL, METADATA_LORA_ALPHA, METADATA_LORA_LAYERS, METADATA_LORA_RANK,
                              METADATA_LORA_TARGET_MODULES, METADATA_MODEL_CONFIG, METADATA_MODEL_FAMILY,
                              METADATA_SOURCE_MODEL, MODEL_PREFIX, PACKING_DOCUMENTS, PACKINGS, POSITIONS,
                              STEP_STATE as STEP_BUFFER, checkpointing_name, layers_per_segment)
from vktrain.errors import VktrainError
from vktrain.lora import LoRAQ4Linear, lora_modules, lora_parameter_names, replace_torchao_linears
from vktrain.partitioner.op_registry import PRESERVED_OPS, first_refusal

from .recompute import checkpointed_layers, recompute_layers_in_backward
from .step_graph import accumulate_program, eval_program_from_joint, training_step_program


class StepExportError(VktrainError, ValueError):
    """A module or example inputs the training-step export cannot take (what was found, what is expected)."""


class _LossModule(nn.Module):
    """Holds the model as `model` (so every state name reads model.<path>) and returns its loss alone."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor]:
        result = _loss_function(self.model)(*inputs)
        loss = result[0] if isinstance(result, (tuple, list)) and result else result
        if not isinstance(loss, torch.Tensor) or loss.shape != () or loss.dtype != torch.float32:
            found = f"{loss.dtype} {list(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise StepExportError(f"{type(self.model).__name__}'s loss must be a float32 scalar tensor, got {found}")
        return (loss,)


def _loss_function(model: nn.Module):
    """model.loss when the model has one, else its forward (ExecuTorch's extension/training convention)."""
    loss = getattr(model, "loss", None)
    return loss if callable(loss) else model.forward


def loss_module(model: nn.Module, example_inputs: tuple[torch.Tensor, ...]) -> nn.Module:
    """`model` wrapped so that torch.export traces its loss over `example_inputs`, the program's user
    inputs named as the loss function's parameters (token_ids, labels, n_valid for the token models).

    torch.export names a forward's inputs after its signature, so the wrapper is a class of its own whose
    forward carries the loss function's signature (a plain *inputs would name them inputs_0, ...)."""
    function = _loss_function(model)
    where = f"{type(model).__name__}.{function.__name__}"
    try:
        signature = inspect.signature(function)
        bound = signature.bind(*example_inputs)
    except (TypeError, ValueError) as exc:
        raise StepExportError(f"{where} cannot take the {len(example_inputs)} example input(s): {exc}") from None
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in signature.parameters.values()
           if p.name in bound.arguments):
        raise StepExportError(f"{where} takes *args / **kwargs; the step's inputs need named parameters")
    not_tensors = [name for name, value in bound.arguments.items() if not isinstance(value, torch.Tensor)]
    if not_tensors:
        raise StepExportError(f"example inputs {not_tensors} of {where} are not tensors; every input of the "
                              f"training step is a tensor (fixed values belong in the module)")
    parameter = inspect.Parameter.POSITIONAL_OR_KEYWORD

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor]:
        return _LossModule.forward(self, *inputs)

    forward.__signature__ = inspect.Signature(
        [inspect.Parameter("self", parameter)] + [inspect.Parameter(name, parameter) for name in bound.arguments])
    return type("_LossModule", (_LossModule,), {"forward": forward})(model)


def example_positions(batch_size: int, seq_len: int) -> torch.Tensor:
    """contract.POSITIONS int64 [B, S] of rows that are one document each (0 .. S-1)."""
    return torch.arange(seq_len, dtype=torch.int64).expand(batch_size, seq_len).contiguous()


def check_packing(packing: Optional[str]) -> bool:
    """Whether `packing` asks for packed documents (contract.PACKINGS; None is "none")."""
    if packing is not None and packing not in PACKINGS:
        raise StepExportError(f"packing must be one of {list(PACKINGS)}, got {packing!r}")
    return packing == PACKING_DOCUMENTS


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
    table[torch.ops.aten.mean.default] = _mean_over_every_dim
    return table


def _mean_over_every_dim(x: torch.Tensor, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """x.mean() as the registry's aten.mean.dim over every dim (core ATen keeps aten.mean.default, which the
    backend has no kernel for: a user's `loss.mean()` left the step half delegated)."""
    return torch.ops.aten.mean.dim(x, list(range(x.dim())), dtype=dtype)


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


def export_training_step(model: nn.Module, batch_shape: Optional[tuple[int, int]] = None, *,
                         example_inputs: Optional[tuple[torch.Tensor, ...]] = None,
                         activation_checkpointing: str | int | None = None,
                         packing: Optional[str] = None) -> ExportedProgram:
    """Export one training step of `model`: a token model (LoRA adapters inserted) for token batches of
    `batch_shape`, or any module for its loss over `example_inputs` (one of the two).
    `activation_checkpointing`: "every-layer" or N, the backward recomputes the decoder layers' forward in
    segments of 1 or N layers instead of keeping their activations (vktrain/export/recompute.py). `packing`
    "documents": the token model's step takes contract.POSITIONS too (packed documents).

    The model is not modified (it is deep-copied). See the module docstring for the program's signature.
    """
    joint, trainable = _joint_program(model, _loss_inputs(model, batch_shape, example_inputs, packing),
                                      activation_checkpointing)
    program = training_step_program(joint, trainable)
    drop_unused_constant_inputs(program)
    return program


def export_training_and_eval_steps(model: nn.Module, batch_shape: Optional[tuple[int, int]] = None, *,
                                   example_inputs: Optional[tuple[torch.Tensor, ...]] = None,
                                   freeze_lora_a: bool = False, activation_checkpointing: str | int | None = None,
                                   packing: Optional[str] = None) -> tuple[ExportedProgram, ExportedProgram]:
    """(the training step, its eval method) from ONE trace: the eval program is the joint graph's forward
    (vktrain/export/eval.py's signature; the loss's inputs for any module; export_eval_step traces it
    anew), which saves an export of the model's forward (half a minute for a 30-layer model).
    `freeze_lora_a`: only the lora_B tensors train (FFA-LoRA); the lora_A tensors stay frozen constants,
    so their gradient GEMMs are not exported. `activation_checkpointing`, `packing`: see export_training_step."""
    if freeze_lora_a:
        model = _with_lora_a_frozen(model)
    joint, trainable = _joint_program(model, _loss_inputs(model, batch_shape, example_inputs, packing),
                                      activation_checkpointing)
    evaluation = eval_program_from_joint(joint)
    program = training_step_program(joint, trainable)
    for exported in (program, evaluation):
        drop_unused_constant_inputs(exported)
    return program, evaluation


def export_accumulating_methods(model: nn.Module, batch_shape: Optional[tuple[int, int]] = None, *,
                                example_inputs: Optional[tuple[torch.Tensor, ...]] = None,
                                freeze_lora_a: bool = False,
                                activation_checkpointing: str | int | None = None,
                                packing: Optional[str] = None) -> dict[str, ExportedProgram]:
    """The methods of a gradient-accumulating .pte, from ONE trace: contract.TRAIN_METHOD, the step whose
    AdamW reads gradient + optimizer.grad_acc.<path> and then zeroes grad_acc; contract.ACCUMULATE_METHOD,
    forward + backward adding the gradient into grad_acc (the same inputs as the eval method, no hparams);
    and contract.EVAL_METHOD. N micro-batches: N - 1 accumulate calls, then one step, each given n_valid
    summed over the N (the loss divides by it), so the update is that of one batch of all N.
    `activation_checkpointing`: see export_training_step (both backward methods recompute)."""
    from vktrain.contract import ACCUMULATE_METHOD, EVAL_METHOD, TRAIN_METHOD

    if freeze_lora_a:
        model = _with_lora_a_frozen(model)
    joint, trainable = _joint_program(model, _loss_inputs(model, batch_shape, example_inputs, packing),
                                      activation_checkpointing)
    methods = {EVAL_METHOD: eval_program_from_joint(joint), ACCUMULATE_METHOD: accumulate_program(joint, trainable)}
    methods[TRAIN_METHOD] = training_step_program(joint, trainable, grad_accum=True)
    for exported in methods.values():
        drop_unused_constant_inputs(exported)
    return {name: methods[name] for name in (TRAIN_METHOD, EVAL_METHOD, ACCUMULATE_METHOD)}


def _with_lora_a_frozen(model: nn.Module) -> nn.Module:
    """A copy of `model` whose lora_A tensors do not require grad (FFA-LoRA: only lora_B trains)."""
    model = copy.deepcopy(model)
    for name, param in model.named_parameters():
        if name.endswith(".lora_A"):
            param.requires_grad_(False)
    return model


def _loss_inputs(model: nn.Module, batch_shape: Optional[tuple[int, int]],
                 example_inputs: Optional[tuple[torch.Tensor, ...]], packing: Optional[str] = None
                 ) -> tuple[torch.Tensor, ...]:
    """The loss's example inputs: `example_inputs` as given, or a token model's (token_ids, labels,
    n_valid[, positions]) for `batch_shape`. A token model trains LoRA adapters (its .pte describes PEFT
    adapters)."""
    if (batch_shape is None) == (example_inputs is None):
        raise StepExportError("give the step's batch_shape (a token model) or its example_inputs (any module), "
                              "exactly one of the two")
    documents = check_packing(packing)
    if example_inputs is not None:
        if documents:
            raise StepExportError("packing applies to a token model's step (batch_shape); a module's own loss "
                                  "takes whatever inputs its example_inputs give it")
        return tuple(example_inputs)
    batch_size, seq_len = check_batch_shape(batch_shape)
    if not lora_parameter_names(model):
        raise StepExportError("the model has no LoRA adapters: call vktrain.lora.apply_lora first (nothing to train)")
    token_ids, labels, _, n_valid = example_training_inputs(batch_size, seq_len, getattr(model, "vocab_size", 256))
    if documents:
        if POSITIONS not in inspect.signature(_loss_function(model)).parameters:
            raise StepExportError(f"packing {PACKING_DOCUMENTS!r}: {type(model).__name__}'s loss takes no "
                                  f"{POSITIONS!r} input (the Llama family's does)")
        return token_ids, labels, n_valid, example_positions(batch_size, seq_len)
    return token_ids, labels, n_valid


def trainable_parameter_names(model: nn.Module) -> list[str]:
    """Paths of the parameters with requires_grad (the step's trainable tensors), in module order; each
    must be float32 (the AdamW kernel's)."""
    names = [name for name, param in model.named_parameters() if param.requires_grad]
    if not names:
        raise StepExportError(f"no parameter of {type(model).__name__} requires grad: nothing to train "
                              f"(vktrain.lora.apply_lora adds trainable adapters)")
    wrong = {name: str(param.dtype) for name, param in model.named_parameters()
             if param.requires_grad and param.dtype != torch.float32}
    if wrong:
        raise StepExportError(f"trainable parameters must be float32, got {wrong}")
    return names


def traceable_copy(model: nn.Module) -> nn.Module:
    """A deep copy of `model` as every export traces it: its torchao int4 linears fused into frozen q4gsw
    linears over torchao's codes and scales (vktrain/lora/torchao_weights.py), which lower to linear_q4gsw
    (traced as they are, torchao's weights would dequantize into a dense float matmul)."""
    model = copy.deepcopy(model)
    replace_torchao_linears(model)
    return model


def _joint_program(model: nn.Module, example_inputs: tuple[torch.Tensor, ...],
                   activation_checkpointing: str | int | None = None) -> tuple[ExportedProgram, list[str]]:
    """The joint graph of `model`'s loss over `example_inputs` (traceable_copy: torchao's linears fused),
    its backward recomputing the decoder layers when `activation_checkpointing` is given, and the
    trainable parameters' paths."""
    trainable = trainable_parameter_names(model)
    # a bad value, or a model without decoder layers, is refused before the trace
    layers = None if activation_checkpointing is None else checkpointed_layers(model, activation_checkpointing)
    model = traceable_copy(model)
    wrapped = loss_module(model, example_inputs)
    loss_program = torch.export.export(wrapped, tuple(example_inputs))
    try:
        joint = joint_forward_backward(loss_program)
    except AssertionError as exc:  # torch's words for a bad input: a trainable tensor the loss ignores
        if "did not receive a gradient" not in str(exc):
            raise
        unused = _parameters_without_gradient(wrapped, example_inputs)
        raise StepExportError(f"trainable parameters {unused} of {type(model).__name__} do not affect the loss; "
                              f"freeze them (requires_grad_(False)) or use them") from None
    # The step runs as ONE delegate (its state lives there): an op the backend cannot run would split it and
    # fail at lowering with a GraphError about the state, so name the op now.
    refusal = first_refusal(joint)
    if refusal is not None:
        raise StepExportError(f"the training step of {type(model).__name__} (its loss and that loss's backward) "
                              f"uses an op the vktrain backend cannot run: {refusal}; write the loss with ops it "
                              f"runs (e.g. sum, mean, matmul, elementwise ops)")
    if layers is not None:
        recompute_layers_in_backward(joint, *layers)
    return joint, trainable


def _parameters_without_gradient(wrapped: nn.Module, example_inputs: tuple[torch.Tensor, ...]) -> list[str]:
    """Paths (under the model) of the trainable parameters the loss's gradient does not reach (one eager
    forward + backward: only on the failure path)."""
    params = {name.removeprefix(MODEL_PREFIX): p for name, p in wrapped.named_parameters() if p.requires_grad}
    (loss,) = wrapped(*example_inputs)
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    return [name for name, grad in zip(params, grads) if grad is None]


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


def activation_checkpointing_spec(value: str | int):
    """The compile spec recording an activation_checkpointing choice in the blob's metadata (what `vktrain
    inspect` shows), in its canonical spelling."""
    from vktrain.backend.preprocess import metadata_spec

    return metadata_spec(METADATA_ACTIVATION_CHECKPOINTING, checkpointing_name(layers_per_segment(value)))


def adapter_metadata_specs(model: nn.Module, source: str, loaded: Any = None) -> list:
    """adapter_metadata as compile specs for VktrainPartitioner(compile_specs=...)."""
    from vktrain.backend.preprocess import metadata_spec

    return [metadata_spec(key, value) for key, value in adapter_metadata(model, source, loaded).items()]
