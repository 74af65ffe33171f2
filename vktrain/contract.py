"""The contract shared by the AOT side (export, partitioner, backend; with torch) and the runtime and
training application (numpy + Vulkan only): names and layouts both sides must agree on.

Torch-free on purpose: this is the one module both sides import for these facts.
"""
from __future__ import annotations

import json
from typing import Mapping

from vktrain.errors import PrecisionPolicyError

# The id the vktrain backend registers with ExecuTorch and records in every .pte's delegate.
BACKEND_ID = "VktrainVulkanBackend"

# ---- the training-step program (vktrain.export.training) --------------------------------------------
# Its inputs, in order: token_ids int64 [B, S], labels int64 [B, S] (< 0 = ignored), hparams float32
# [len(HPARAM_NAMES)], n_valid float32 [] (the loss divisor).
TOKEN_IDS, LABELS, HPARAMS, N_VALID = "token_ids", "labels", "hparams", "n_valid"
STEP_INPUTS = (TOKEN_IDS, LABELS, HPARAMS, N_VALID)

# The .pte's methods: the training step (ExecuTorch's name for a single program) and the eval method
# exported with it (vktrain.export.eval), which takes token_ids, labels and n_valid and returns the loss.
TRAIN_METHOD, EVAL_METHOD = "forward", "eval"
ACCUMULATE_METHOD = "accumulate"  # a --grad-accum export's: forward + backward into optimizer.grad_acc.*
EVAL_INPUTS = (TOKEN_IDS, LABELS, N_VALID)

# Packed documents (`vktrain export --packing documents`): the step and its eval method take one more input,
# positions int64 [B, S], each token's position in its document (0 at a document's first token, then 1, 2,
# ... up to the next start), so attention stays within each document and rope restarts at each start.
POSITIONS = "positions"
PACKING_DOCUMENTS = "documents"
PACKINGS = ("none", PACKING_DOCUMENTS)  # what `vktrain export --packing` takes; none: windows as they are

# Preference tuning (`vktrain export --objective dpo`, vktrain/export/dpo.py): the step takes one pair a call,
# token ids and labels int64 [1, S] per side (labels -100 but on the completion), and n_pairs float32 [] (the
# pairs of the optimizer step, which the loss divides by); beta is baked.
CHOSEN_IDS, CHOSEN_LABELS, REJECTED_IDS, REJECTED_LABELS, N_PAIRS = (
    "chosen_ids", "chosen_labels", "rejected_ids", "rejected_labels", "n_pairs")
DPO_INPUTS = (CHOSEN_IDS, CHOSEN_LABELS, REJECTED_IDS, REJECTED_LABELS, N_PAIRS)
# SimPO (`--objective simpo`, vktrain/export/simpo.py) takes DPO's inputs and each completion's length |y|
# (its number of targets, labels >= 0) as float32 []: the caller counts them (no integer reductions on the GPU).
CHOSEN_LENGTH, REJECTED_LENGTH = "chosen_length", "rejected_length"
SIMPO_INPUTS = DPO_INPUTS + (CHOSEN_LENGTH, REJECTED_LENGTH)
OBJECTIVE_DPO, OBJECTIVE_SIMPO, OBJECTIVE_ORPO = "dpo", "simpo", "orpo"
# ORPO (`--objective orpo`, vktrain/export/orpo.py) takes SimPO's inputs: its odds are of the length-normalised
# probability too. The two steps differ only in their blob metadata (below).
PREFERENCE_INPUTS = {OBJECTIVE_DPO: DPO_INPUTS, OBJECTIVE_SIMPO: SIMPO_INPUTS, OBJECTIVE_ORPO: SIMPO_INPUTS}
OBJECTIVES = ("lm", *PREFERENCE_INPUTS)  # `vktrain export --objective`: next-token cross-entropy, or preferences
# A preference step's objective and its baked settings, JSON: {"objective": "dpo"|"orpo", "beta": b} or
# {"objective": "simpo", "beta": b, "gamma": g} (ORPO's beta is its lambda, as TRL names it); `vktrain eval`
# reads it to tell which pairs the model prefers rightly, `vktrain train` to name the objective.
METADATA_OBJECTIVE = "objective"

# The hparams tensor adamw reads, in this order; the defaults are torch.optim.AdamW's.
HPARAM_NAMES = ("lr", "beta1", "beta2", "eps", "weight_decay")
ADAMW_DEFAULTS = {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 1e-2}


def hparams_values(lr: float, beta1: float = ADAMW_DEFAULTS["beta1"], beta2: float = ADAMW_DEFAULTS["beta2"],
                   eps: float = ADAMW_DEFAULTS["eps"],
                   weight_decay: float = ADAMW_DEFAULTS["weight_decay"]) -> tuple[float, ...]:
    """The hparams tensor's values in HPARAM_NAMES order (callers make the float32 array / tensor)."""
    return lr, beta1, beta2, eps, weight_decay


# ---- state names: the program's mutable buffers and parameters --------------------------------------
MODEL_PREFIX = "model."                          # model parameters / buffers
EXP_AVG_PREFIX = "optimizer.exp_avg."            # + the parameter's name under the model
EXP_AVG_SQ_PREFIX = "optimizer.exp_avg_sq."
GRAD_ACC_PREFIX = "optimizer.grad_acc."          # + the parameter's name: gradients of the micro-batches so far
STEP_STATE = "optimizer.step"                    # float32 [] t, the number of updates done
STATE_PREFIXES = (MODEL_PREFIX, "optimizer.")    # every state name starts with one of these

# ---- delegate-blob metadata (free-form string -> string): the keys vktrain writes ----------------------
METADATA_SOURCE_MODEL = "source_model"
METADATA_BACKEND = "backend"
METADATA_PLANNED_MEMORY_BYTES = "planned_memory_bytes"
METADATA_UNPLANNED_MEMORY_BYTES = "unplanned_memory_bytes"
METADATA_STATE_BYTES = "state_bytes"                  # bytes of the mutable training state
METADATA_REFUSALS = "refusals"                        # JSON list of the partitioner's refusals
METADATA_SYNTHETIC_CONSTANTS = "synthetic_constants"  # benchmark blobs only
# JSON list of the Python floats an et_vk call was traced with (vktrain.export.etvk), now constants of the
# program: [{"node", "op", "scalars": {argument: value}}]
METADATA_BAKED_SCALARS = "baked_scalars"
# What adapters and merged models need, written at export (vktrain.export.training.adapter_metadata) and read
# by `vktrain train --out-adapters` / `--out-gguf-adapter` and `vktrain merge` (JSON where not a plain string):
# METADATA_SOURCE_MODEL above is what `export --model` was given (a preset name or a path).
METADATA_BASE_MODEL = "base_model_name_or_path"     # PEFT's adapter_config.json field: an HF id or a path
METADATA_LORA_RANK = "lora_r"                       # decimal
METADATA_LORA_ALPHA = "lora_alpha"                  # decimal float
METADATA_LORA_TARGET_MODULES = "lora_target_modules"  # JSON list: PEFT's target_modules
METADATA_LORA_LAYERS = "lora_layers"                # JSON list: module paths of every adapted layer
METADATA_MODEL_FAMILY = "model_family"              # llama.cpp's general.architecture ("llama", "qwen2", ...)
METADATA_MODEL_CONFIG = "model_config"              # JSON: the model's config fields (LlamaConfig's)
ADAPTER_METADATA_KEYS = (METADATA_SOURCE_MODEL, METADATA_BASE_MODEL, METADATA_LORA_RANK, METADATA_LORA_ALPHA,
                         METADATA_LORA_TARGET_MODULES, METADATA_LORA_LAYERS, METADATA_MODEL_FAMILY,
                         METADATA_MODEL_CONFIG)

# ---- .pte named data (ExecuTorch Program.named_data: key -> one data segment, stored once) ------------
# The model's tokenizer (a `tokenizers` tokenizer.json, post-processor final) and, as JSON,
# {"special_tokens": {bos_token, eos_token, ...: token string}, "chat_template": string or null}:
# written by export for pretrained models, read by `vktrain train` (vktrain.serialization.tokenizer).
NAMED_DATA_TOKENIZER_JSON = "vktrain.tokenizer.json"
NAMED_DATA_TOKENIZER_CONFIG = "vktrain.tokenizer_config.json"

METADATA_GEMM_PRECISIONS = "gemm_precisions"          # JSON list of the PRECISIONS the program allows
# `vktrain export --activation-checkpointing`: "every-layer" or N (decoder layers per recomputed segment);
# absent when the backward reads the forward's activations (vktrain/export/recompute.py)
METADATA_ACTIVATION_CHECKPOINTING = "activation_checkpointing"
EVERY_LAYER = "every-layer"  # segments of one layer (the same as 1)


def layers_per_segment(value: str | int) -> int:
    """Decoder layers per recomputed segment of an activation checkpointing value: "every-layer" -> 1, a
    positive integer N -> N (segments of N consecutive layers; the last is shorter when N does not divide
    the layers). ValueError naming what was expected."""
    if value == EVERY_LAYER:
        return 1
    text = str(value).strip() if not isinstance(value, bool) else ""
    number = int(text) if text.isdigit() else 0
    if number <= 0:
        raise ValueError(f"activation checkpointing takes {EVERY_LAYER!r} or a positive number N of decoder layers "
                         f"per recomputed segment, got {value!r}")
    return number


def checkpointing_name(layers: int) -> str:
    """The canonical activation checkpointing value (the metadata's): "every-layer" for 1, else N."""
    return EVERY_LAYER if layers == 1 else str(layers)

# ---- GEMM precision policies (docs/PRECISION.md): the blob lists those it allows, the runtime picks one
# by device. fp32: every GEMM on the fp32 kernels (the parity reference). fp16-tc: the large GEMMs on
# tensor cores (VK_KHR_cooperative_matrix), fp16 inputs, fp32 accumulation. fp16: the 4-bit base GEMMs and
# the large mm on the SIMT kernels' FP16 variants (no tensor cores: fp16 operands in shared memory, fp32
# products and sums),
# for devices with shaderFloat16 and no cooperative matrices. auto (what the runtime is asked for by
# default; never in a blob): fp16-tc where the program allows it and the device has the tensor-core
# kernels, else fp16 where the device's profile prefers it (phone GPUs), else fp32 -- the fastest policy
# the device runs with a stated accuracy.
PRECISION_FP32 = "fp32"
PRECISION_FP16_TC = "fp16-tc"
PRECISION_FP16 = "fp16"
PRECISIONS = (PRECISION_FP32, PRECISION_FP16_TC, PRECISION_FP16)
PRECISION_AUTO = "auto"
PRECISION_CHOICES = (PRECISION_AUTO, *PRECISIONS)  # what a user may ask the runtime for


def allowed_precisions(metadata: Mapping[str, str], source: str = "the program") -> tuple[str, ...]:
    """The GEMM precision policies a blob allows (its metadata `gemm_precisions`, a JSON list). Blobs
    written before the policy existed do not record it: they allow fp32 only."""
    text = metadata.get(METADATA_GEMM_PRECISIONS)
    if text is None:
        return (PRECISION_FP32,)
    try:
        listed = json.loads(text)
    except json.JSONDecodeError:
        listed = None
    if not isinstance(listed, list) or not listed or not all(p in PRECISIONS for p in listed):
        raise PrecisionPolicyError(f"{source}: blob metadata {METADATA_GEMM_PRECISIONS!r} is {text!r}; expected a "
                                   f"non-empty JSON list of {', '.join(PRECISIONS)}")
    return tuple(listed)

__all__ = ["ACCUMULATE_METHOD", "ADAMW_DEFAULTS", "ADAPTER_METADATA_KEYS", "BACKEND_ID",
           "METADATA_ACTIVATION_CHECKPOINTING", "METADATA_BAKED_SCALARS", "EVAL_INPUTS", "EVAL_METHOD", "EXP_AVG_PREFIX", "GRAD_ACC_PREFIX",
           "EVERY_LAYER", "EXP_AVG_SQ_PREFIX", "HPARAMS", "HPARAM_NAMES", "LABELS", "METADATA_BACKEND", "METADATA_BASE_MODEL",
           "METADATA_GEMM_PRECISIONS", "METADATA_LORA_ALPHA", "METADATA_LORA_LAYERS", "METADATA_LORA_RANK",
           "METADATA_LORA_TARGET_MODULES", "METADATA_MODEL_CONFIG", "METADATA_MODEL_FAMILY",
           "METADATA_PLANNED_MEMORY_BYTES", "METADATA_REFUSALS", "METADATA_SOURCE_MODEL", "METADATA_STATE_BYTES",
           "METADATA_SYNTHETIC_CONSTANTS", "METADATA_UNPLANNED_MEMORY_BYTES", "MODEL_PREFIX",
           "NAMED_DATA_TOKENIZER_CONFIG", "NAMED_DATA_TOKENIZER_JSON", "N_VALID", "PRECISIONS", "PRECISION_AUTO", "PRECISION_CHOICES", "PRECISION_FP16", "PRECISION_FP16_TC",
           "PRECISION_FP32", "CHOSEN_IDS", "CHOSEN_LABELS", "CHOSEN_LENGTH", "DPO_INPUTS", "METADATA_OBJECTIVE", "N_PAIRS",
           "OBJECTIVES", "OBJECTIVE_DPO", "OBJECTIVE_ORPO", "OBJECTIVE_SIMPO", "PREFERENCE_INPUTS", "REJECTED_LENGTH",
           "SIMPO_INPUTS",
           "REJECTED_IDS",
           "REJECTED_LABELS", "PACKINGS", "PACKING_DOCUMENTS", "POSITIONS", "STATE_PREFIXES", "STEP_INPUTS", "STEP_STATE", "TOKEN_IDS", "TRAIN_METHOD",
           "allowed_precisions", "checkpointing_name", "hparams_values", "layers_per_segment"]
