"""AOT export: one LoRA training step or the inference forward as an ExportedProgram, and lowering to .pte."""
from .eval import export_eval_step
from .inference import export_forward
from .lower import LoweringError, lower_methods_to_pte, lower_to_pte, to_edge_lowered, to_edge_lowered_methods
from vktrain.contract import EXP_AVG_PREFIX, EXP_AVG_SQ_PREFIX, HPARAM_NAMES, MODEL_PREFIX, STEP_STATE as STEP_BUFFER

from .training import (
    example_training_inputs,
    export_accumulating_methods,
    export_training_and_eval_steps,
    export_training_step,
    training_state_names,
)

__all__ = [
    "LoweringError", "EXP_AVG_PREFIX", "EXP_AVG_SQ_PREFIX", "HPARAM_NAMES", "MODEL_PREFIX", "STEP_BUFFER",
    "example_training_inputs", "export_eval_step", "export_accumulating_methods", "export_forward", "export_training_and_eval_steps", "export_training_step", "lower_methods_to_pte",
    "lower_to_pte", "to_edge_lowered", "to_edge_lowered_methods",
    "training_state_names",
]
