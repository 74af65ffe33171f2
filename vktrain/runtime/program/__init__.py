"""The ExecuTorch program layer, torch- and executorch-free: the .pte reader (pte.py, over the generated
pte_schema; its parsed objects in pte_objects.py), the load-time verifier (verify.py), the interpreter that
runs a plan's instructions and hands delegate calls to the executor (runner.py, with TrainingRunner on
top), and the mutational fuzzer of that load path (fuzz.py)."""
