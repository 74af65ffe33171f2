"""Issue-5 promises that cross the host/device line:
- adapters trained on the Vulkan runner load back into the eager model and reproduce its loss;
- the runner runs a real .pte in a process where torch and executorch cannot be imported.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from vktrain.lora import LoRAConfig, apply_lora, load_adapters, lora_modules
from vktrain.models import build_model
from vktrain.train.adapters import adapters_from_state, save_adapters
from vktrain.runtime.program.runner import TrainingRunner

from _helpers import assert_import_loads_none, export_mlp_lora_training_step
from vktrain.backend.kernel_planning import plan_schedule

BATCH, SEQ, VOCAB = 2, 8, 64
HPARAMS = np.array([2e-2, 0.9, 0.999, 1e-8, 0.0], np.float32)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    path = tmp_path_factory.mktemp("pte") / "step.pte"
    return path, export_mlp_lora_training_step(path, (BATCH, SEQ), VOCAB)


def _batch(seed):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, (BATCH, SEQ))
    return tokens, (5 * tokens + 3) % VOCAB


def test_trained_adapters_reproduce_the_loss_in_eager_pytorch(vk_device, exported, tmp_path):
    path, model = exported
    probe_tokens, probe_labels = _batch(999)
    with TrainingRunner.from_pte(path, vk_device, planner=plan_schedule) as runner:
        for step in range(8):
            runner.step(*_batch(step), HPARAMS)
        lora = {name: runner.read_state(name) for name in runner.state_names if name.endswith((".lora_A", ".lora_B"))}
        save_adapters(tmp_path / "adapters", adapters_from_state(lora), lora_alpha=8.0)
        # The runner's loss is computed with the adapters as they are before this step's update.
        vulkan_loss = runner.step(probe_tokens, probe_labels, HPARAMS)

    eager = build_model("mlp-lora", dim=32, hidden=64, vocab_size=VOCAB, n_layers=2, activation="relu")
    apply_lora(eager, LoRAConfig(rank=4, alpha=8.0, targets="*", group_size=32, seed=0))
    eager.load_state_dict(model.state_dict())  # same frozen base (and initial adapters)
    with torch.no_grad():
        before = float(eager.loss(torch.from_numpy(probe_tokens), torch.from_numpy(probe_labels),
                                  torch.tensor(float(probe_labels.size))))
    loaded = load_adapters(eager, tmp_path / "adapters")
    assert loaded == sorted(lora_modules(eager))
    with torch.no_grad():
        after = float(eager.loss(torch.from_numpy(probe_tokens), torch.from_numpy(probe_labels),
                                 torch.tensor(float(probe_labels.size))))
    assert after == pytest.approx(vulkan_loss, rel=1e-4)
    assert abs(after - before) > 1e-3  # the adapters changed something: the check above is not vacuous


def test_load_adapters_refuses_a_mismatched_model(exported, tmp_path):
    _, model = exported
    other = build_model("mlp-lora", dim=32, hidden=64, vocab_size=VOCAB, n_layers=2, activation="relu")
    apply_lora(other, LoRAConfig(rank=4, alpha=8.0, targets="head", group_size=32, seed=0))
    adapters = {path: (layer.lora_A.detach().numpy(), layer.lora_B.detach().numpy())
                for path, layer in lora_modules(model).items()}
    save_adapters(tmp_path / "a", adapters, lora_alpha=8.0)
    with pytest.raises(ValueError, match="not in the model"):
        load_adapters(other, tmp_path / "a")


def test_runner_runs_a_pte_where_torch_and_executorch_cannot_be_imported(exported):
    path, _ = exported
    tokens, labels = _batch(0)
    script = textwrap.dedent(f"""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("torch", "executorch"):
                    raise ImportError("blocked import of " + name)
        sys.meta_path.insert(0, Block())
        import numpy as np
        from vktrain.backend.kernel_planning import plan_schedule  # kernel planning needs no torch either
        from vktrain.runtime.program.runner import TrainingRunner
        tokens = np.array({tokens.tolist()}); labels = np.array({labels.tolist()})
        hparams = np.array({HPARAMS.tolist()}, np.float32)
        with TrainingRunner.from_pte({str(path)!r}, planner=plan_schedule) as runner:
            losses = [runner.step(tokens, labels, hparams) for _ in range(3)]
        assert all(np.isfinite(losses)) and losses[2] < losses[0], losses
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "executorch"))
        assert not loaded, loaded
        print("ok", losses[0])
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("ok")


def test_host_side_file_formats_do_not_load_the_vulkan_loader():
    """vktrain.lora reads PEFT files through vktrain.train.adapters: that must not need a Vulkan driver."""
    assert_import_loads_none(["vktrain.lora", "vktrain.train.adapters", "vktrain.serialization.pte"],
                             forbidden=["vulkan", "vktrain.runtime.vk.device"], timeout=120)
