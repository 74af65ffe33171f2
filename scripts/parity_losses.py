"""Record what the parity tests train, to check that a refactor changes no bit of it.

    PYTHONPATH=. python scripts/parity_losses.py before.json   # on the old tree
    PYTHONPATH=. python scripts/parity_losses.py after.json    # on the new tree; then compare the files

Exports the programs of tests/test_runner_parity.py (mlp-lora relu, gelu, silu) and
tests/test_llama_parity.py (tiny-llama), trains each for 20 steps on the tests' batches and writes, per
program: the per-step losses (float.hex, so equality is bitwise), a SHA-256 of the final state and the
executor's buffer bytes (device memory).
"""
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import test_llama_parity as llama_parity  # noqa: E402
import test_runner_parity as runner_parity  # noqa: E402

from vktrain.export import export_training_step, lower_to_pte  # noqa: E402
from vktrain.lora import LoRAConfig, apply_lora  # noqa: E402
from vktrain.models import build_model  # noqa: E402
from vktrain.runtime import Device  # noqa: E402
from vktrain.runtime.program.runner import TrainingRunner  # noqa: E402
from vktrain.backend.kernel_planning import plan_schedule  # noqa: E402


def _programs(folder: Path) -> dict:
    programs = {}
    path = folder / "mlp_relu.pte"
    runner_parity.export_mlp_lora_training_step(path, (runner_parity.BATCH, runner_parity.SEQ), runner_parity.VOCAB)
    programs["mlp_relu"] = (path, runner_parity._batches, runner_parity.HPARAMS)
    for activation in ("gelu", "silu"):  # as test_other_activations_train_like_eager builds them
        model = build_model("mlp-lora", dim=16, hidden=32, vocab_size=runner_parity.VOCAB, n_layers=1,
                            activation=activation)
        apply_lora(model, LoRAConfig(rank=2, alpha=4.0, targets="*", group_size=16, seed=1))
        path = folder / f"mlp_{activation}.pte"
        path.write_bytes(lower_to_pte(export_training_step(model, (runner_parity.BATCH, runner_parity.SEQ))))
        programs[f"mlp_{activation}"] = (path, runner_parity._batches, runner_parity.HPARAMS)
    model = build_model("tiny-llama")
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets="*_proj", group_size=32, seed=0))
    path = folder / "llama.pte"
    path.write_bytes(lower_to_pte(export_training_step(model, (llama_parity.BATCH, llama_parity.SEQ))))
    programs["llama"] = (path, llama_parity._batches, llama_parity.HPARAMS)
    return programs


def main(out: str) -> None:
    folder = Path(out).with_suffix(".programs")
    folder.mkdir(parents=True, exist_ok=True)
    device = Device(validation=False)
    result = {}
    for name, (path, batches, hparams) in _programs(folder).items():
        with TrainingRunner.from_pte(path, device, planner=plan_schedule) as runner:
            losses = [runner.step(t.numpy(), l.numpy(), hparams) for t, l in batches(20)]
            state = runner.state_dict()
            digest = hashlib.sha256()
            for key in sorted(state):
                digest.update(key.encode())
                digest.update(np.ascontiguousarray(state[key]).tobytes())
            result[name] = {"losses": [float(x).hex() for x in losses], "state_sha256": digest.hexdigest(),
                            "buffer_bytes": runner.executor.buffer_bytes}
        print(name, "device bytes", sum(result[name]["buffer_bytes"].values()), "last loss", losses[-1], flush=True)
    device.close()
    Path(out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
