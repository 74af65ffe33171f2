"""The ExecuTorch program layer, torch- and executorch-free: the .pte reader (pte.py, over the generated
pte_schema) and the interpreter that runs a plan's instructions and hands delegate calls to the executor
(runner.py, with TrainingRunner on top)."""
