"""Record the TrainingRunner losses (as float hex) and the .pte sha256 of the two parity-test programs
(tests/test_runner_parity.py's MLP-LoRA step, tests/test_llama_parity.py's tiny-llama step), to check
that a refactor leaves them bitwise identical:

    python scripts/record_parity_losses.py before.json /tmp/pte_before   # on the old tree
    python scripts/record_parity_losses.py after.json /tmp/pte_after     # on the new tree; diff the two
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.getcwd())
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import test_llama_parity as llama_test  # noqa: E402
import test_runner_parity as mlp_test  # noqa: E402
from _helpers import export_mlp_lora_training_step, runner_losses  # noqa: E402

from vktrain.export import export_training_step, lower_to_pte  # noqa: E402
from vktrain.lora import LoRAConfig, apply_lora  # noqa: E402
from vktrain.models import build_model  # noqa: E402
from vktrain.runtime import Device  # noqa: E402
from vktrain.runtime.program.runner import TrainingRunner  # noqa: E402


def main(out_json: str, pte_dir: str) -> None:
    pte_dir = Path(pte_dir)
    pte_dir.mkdir(parents=True, exist_ok=True)
    mlp = pte_dir / "mlp.pte"
    export_mlp_lora_training_step(mlp, (mlp_test.BATCH, mlp_test.SEQ), mlp_test.VOCAB)
    model = build_model("tiny-llama")  # as tests/test_llama_parity.py's llama_program fixture
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets="*_proj", group_size=32, seed=0))
    llama = pte_dir / "llama.pte"
    llama.write_bytes(lower_to_pte(export_training_step(model, (llama_test.BATCH, llama_test.SEQ))))
    record = {}
    with Device(validation=False) as device:
        for name, path, test in (("mlp", mlp, mlp_test), ("llama", llama, llama_test)):
            with TrainingRunner.from_pte(path, device) as runner:
                losses = runner_losses(runner, test._batches(test.STEPS), test.HPARAMS)
            record[name] = {"losses": [float(loss).hex() for loss in losses],
                            "pte_sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    Path(out_json).write_text(json.dumps(record, indent=1))
    print(json.dumps({name: (r["losses"][-1], r["pte_sha256"][:12]) for name, r in record.items()}))


if __name__ == "__main__":
    main(*sys.argv[1:3])
