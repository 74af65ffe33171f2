"""Export the eval method that travels with a training step: the step's loss, and nothing else.

Program signature (vktrain.contract EVAL_INPUTS):
    inputs   token_ids int64 [B, S], labels int64 [B, S] (< 0 = ignored), n_valid float32 [] (the divisor)
    output   loss float32 [] = (cross-entropy summed over labels >= 0) / n_valid
    constants model.<path> for every tensor of the model, the LoRA tensors included, under the SAME names
             as the training step's state (`model.<layer>.lora_A` / `.lora_B`): the runtime binds the
             eval method's LoRA tensors to the training step's state buffers by these names, so eval sees
             the adapters as trained, and nothing else of the training state (AdamW moments, step).

The runner passes n_valid = 1 to read the loss SUM of a batch, so that a mean over many batches (the last
one padded with ignored labels) divides by the count of every valid label, not per batch.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.export import ExportedProgram

from vktrain.lora import lora_parameter_names

from .training import (check_batch_shape, drop_unused_constant_inputs, example_training_inputs, in_registry_ops,
                       loss_module, traceable_copy)


def export_eval_step(model: nn.Module, batch_shape: tuple[int, int]) -> ExportedProgram:
    """Export `model`'s loss (LoRA adapters inserted) for token batches of `batch_shape`, without gradients.

    The model is not modified (it is deep-copied). See the module docstring for the program's signature."""
    batch_size, seq_len = check_batch_shape(batch_shape)
    if not lora_parameter_names(model):
        raise ValueError("the model has no LoRA adapters: call vktrain.lora.apply_lora first")
    model = traceable_copy(model).eval()  # torchao's int4 linears as frozen linear_q4gsw
    for param in model.parameters():
        param.requires_grad_(False)
    token_ids, labels, _, n_valid = example_training_inputs(batch_size, seq_len, getattr(model, "vocab_size", 256))
    with torch.no_grad():
        program = in_registry_ops(torch.export.export(loss_module(model, (token_ids, labels, n_valid)),
                                                          (token_ids, labels, n_valid)))
    drop_unused_constant_inputs(program)
    return program
