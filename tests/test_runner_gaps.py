"""Programs the runner and `vktrain train` used to refuse or mis-handle.

A step written with upstream's et_vk ops (tests/_etvk_lm.py) has no hparams input: its hyper-parameters
are baked. TrainingRunner runs it (the same losses as GraphExecutor running its delegate graph, and the
float64 reference's within LOSS_RTOL); `vktrain train` runs it with checkpoints and --json, says the
schedule is baked and refuses the flags that would change it.

A --freeze-lora-a (FFA-LoRA) program holds lora_A as constants, not state: `train --out-adapters`,
`eval --adapters`, `merge` and `adapters convert` take A from the constants, and refuse adapters whose
lora_A differs from them (the program cannot change A).
"""
from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch

pytest.importorskip("executorch.backends.vulkan.custom_ops_lib")

from _etvk_lm import BATCH, LR, EtvkLoraLM, Float64Ops, training_batches  # noqa: E402
from _helpers import LOSS_RTOL  # noqa: E402
from vktrain.export.etvk import lower_etvk_program  # noqa: E402
from vktrain.runtime.delegate.executor import ExecutorInputError, GraphExecutor  # noqa: E402
from vktrain.serialization.pte import PteFile  # noqa: E402
from vktrain.runtime.program.runner import TrainingRunner  # noqa: E402
from vktrain.serialization.verify import load_delegate_graph  # noqa: E402
from vktrain.contract import MODEL_PREFIX  # noqa: E402
from vktrain.serialization.peft_adapters import AdapterError, load_adapters, peft_name
from vktrain.train.adapters import ProgramAdapters, frozen_lora_tensors, read_program_graph, save_adapters
from vktrain.train.command import add_train_arguments, run_train  # noqa: E402
from vktrain.train.eval_command import add_eval_arguments, run_eval  # noqa: E402
from vktrain.train.merge import merged_state_dict  # noqa: E402
from vktrain.train.data import TokenBatcher  # noqa: E402
from vktrain.train.train_loop import TrainConfigError  # noqa: E402
from vktrain.backend.kernel_planning import plan_schedule
from _helpers import planned

STEPS = 4


@pytest.fixture(scope="module")
def etvk_pte(tmp_path_factory):
    path = tmp_path_factory.mktemp("etvk") / "etvk_step.pte"
    path.write_bytes(lower_etvk_program(torch.export.export(EtvkLoraLM(), training_batches()[0])))
    return path


def _float64_losses(batches) -> list[float]:
    model = EtvkLoraLM(ops=Float64Ops(), dtype=torch.float64)
    with torch.no_grad():
        return [float(model(torch.as_tensor(tokens), torch.as_tensor(labels))) for tokens, labels in batches]


def test_training_runner_runs_a_step_whose_hyper_parameters_are_baked(etvk_pte, vk_device):
    batches = training_batches()[:STEPS]
    program = PteFile.load(etvk_pte)
    _, graph = load_delegate_graph(program, program.execution_plan("forward"))
    with GraphExecutor(vk_device, graph, planned(vk_device, graph)) as executor:
        executor_losses = [float(executor.run(t.numpy(), l.numpy())[0]) for t, l in batches]
    with TrainingRunner.from_pte(etvk_pte, vk_device, planner=plan_schedule) as runner:
        assert not runner.takes_hparams and runner.input_names == ["token_ids", "labels"]
        with pytest.raises(ExecutorInputError, match="baked"):
            runner.step(*batches[0], np.zeros(5, np.float32))
        losses = [runner.step(t.numpy(), l.numpy()) for t, l in batches]
    assert losses == executor_losses
    np.testing.assert_allclose(losses, _float64_losses(batches), rtol=LOSS_RTOL)


def _train_args(*argv: str) -> argparse.Namespace:
    return add_train_arguments(argparse.ArgumentParser()).parse_args([*argv, "--no-progress"])


def test_vktrain_train_runs_it_with_checkpoints_and_json_and_says_the_schedule_is_baked(etvk_pte, tmp_path,
                                                                                       vk_device, capsys):
    # The test batch's rows as a token stream: its two windows of seq + 1 tokens make one batch.
    tokens = training_batches()[0][0].numpy()
    data = tmp_path / "tokens.npy"
    np.save(data, np.concatenate([tokens.reshape(-1), tokens[:1, :1].reshape(-1)]))
    log, checkpoint = tmp_path / "log.json", tmp_path / "run.ckpt"
    args = _train_args(str(etvk_pte), "--data", str(data), "--steps", str(STEPS), "--no-shuffle", "--json", str(log),
                       "--checkpoint", str(checkpoint), "--checkpoint-every", "2")
    assert run_train(args, vk_device) == 0
    out = capsys.readouterr().out
    assert "hyper-parameters and schedule baked into the program (constant)" in out and f"lr={LR!r}" in out
    records = json.loads(log.read_text())
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)) and all(r["lr"] == LR for r in records)

    batcher = TokenBatcher(np.load(data), *BATCH, shuffle=False)
    batches = [batcher.batch(position) for position in range(STEPS)]
    with TrainingRunner.from_pte(etvk_pte, vk_device, planner=plan_schedule) as runner:
        expected = [runner.step(t, l) for t, l in batches]
    assert [r["loss"] for r in records] == expected
    np.testing.assert_allclose(expected, _float64_losses(batches), rtol=LOSS_RTOL)

    # Resuming the step-2 checkpoint reproduces steps 3 and 4.
    resumed_log = tmp_path / "resumed.json"
    kept = tmp_path / "run.step2.ckpt"
    args = _train_args(str(etvk_pte), "--data", str(data), "--steps", "2", "--no-shuffle", "--checkpoint", str(kept))
    assert run_train(args, vk_device) == 0
    args = _train_args(str(etvk_pte), "--data", str(data), "--steps", str(STEPS), "--no-shuffle", "--resume",
                       str(kept), "--json", str(resumed_log))
    assert run_train(args, vk_device) == 0
    assert [r["loss"] for r in json.loads(resumed_log.read_text())] == expected


@pytest.mark.parametrize("flag, value", [("--lr", "0.1"), ("--schedule", "cosine"), ("--warmup", "2"),
                                         ("--beta1", "0.8"), ("--weight-decay", "0")])
def test_vktrain_train_refuses_flags_that_would_change_baked_hyper_parameters(etvk_pte, tmp_path, vk_device, flag,
                                                                              value):
    data = tmp_path / "tokens.npy"
    np.save(data, np.arange(64) % 64)
    args = _train_args(str(etvk_pte), "--data", str(data), "--steps", "3", flag, value)
    with pytest.raises(TrainConfigError, match=f"{flag} cannot apply: the program's hyper-parameters are baked") as info:
        run_train(args, vk_device)
    assert f"lr={LR!r}" in str(info.value) and "weight_decay=" in str(info.value)



def test_the_cli_refuses_lr_on_it_with_a_one_line_error_and_exit_code_2(etvk_pte, tmp_path, capsys):
    from vktrain.cli import main

    data = tmp_path / "tokens.npy"
    np.save(data, np.arange(64) % 64)
    assert main(["train", str(etvk_pte), "--data", str(data), "--steps", "1", "--lr", "0.1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--lr cannot apply: the program's hyper-parameters are baked" in err and f"lr={LR!r}" in err

# ------------------------------------------------------------------------------------------------
# FFA-LoRA programs (vktrain export --freeze-lora-a)
# ------------------------------------------------------------------------------------------------

LORA_ALPHA, LORA_RANK = 8.0, 2


@pytest.fixture(scope="module")
def ffa(tmp_path_factory):
    """A tiny-llama --freeze-lora-a step, its training and held-out token streams, and a run of
    `vktrain train` with --eval-data, --checkpoint, --out-adapters and --out-gguf-adapter (its records)."""
    from vktrain.cli import main

    root = tmp_path_factory.mktemp("ffa")
    program = root / "ffa.pte"
    assert main(["export", "--model", "tiny-llama", "--model-arg", "dim=32", "--model-arg", "n_layers=1",
                 "--model-arg", "hidden=64", "--model-arg", "n_heads=2", "--model-arg", "n_kv_heads=1", "--lora-rank", str(LORA_RANK), "--lora-alpha", str(LORA_ALPHA),
                 "--freeze-lora-a", "--batch", "2", "--seq", "16", "--out", str(program)]) == 0
    rng = np.random.default_rng(0)
    stream = np.cumsum(np.where(rng.random(1200) < 0.9, 1, rng.integers(0, 256, 1200))) % 256
    np.save(root / "train.npy", stream[:1000])
    np.save(root / "heldout.npy", stream[1000:])
    return root


@pytest.fixture(scope="module")
def ffa_trained(ffa, vk_device):
    args = _train_args(str(ffa / "ffa.pte"), "--data", str(ffa / "train.npy"), "--steps", "3", "--lr", "1e-2",
                       "--eval-data", str(ffa / "heldout.npy"), "--json", str(ffa / "log.json"),
                       "--checkpoint", str(ffa / "run.ckpt"), "--out-adapters", str(ffa / "adapters"),
                       "--out-gguf-adapter", str(ffa / "trained.gguf"))
    assert run_train(args, vk_device) == 0
    return json.loads((ffa / "log.json").read_text())


def _eval_loss(program, adapters, data, out, device) -> float:
    args = add_eval_arguments(argparse.ArgumentParser()).parse_args(
        [str(program), "--data", str(data), "--adapters", str(adapters), "--json", str(out)])
    assert run_eval(args, device) == 0
    return json.loads(out.read_text())["loss"]


def test_ffa_program_holds_lora_a_as_constants_and_train_writes_them_as_the_adapters_a(ffa, ffa_trained):
    frozen = frozen_lora_tensors(read_program_graph(ffa / "ffa.pte"))
    assert frozen and all(name.endswith(".lora_A") for name in frozen)
    written = load_adapters(ffa / "adapters")
    assert sorted(f"{MODEL_PREFIX}{module}.lora_A" for module in written) == sorted(frozen)
    for module, (lora_a, lora_b) in written.items():
        assert np.array_equal(lora_a, frozen[f"{MODEL_PREFIX}{module}.lora_A"])
        assert np.any(lora_b != 0)  # trained (B starts at zero)


def test_eval_with_the_written_adapters_or_the_checkpoint_reproduces_the_trained_eval_loss(ffa, ffa_trained,
                                                                                        vk_device, tmp_path):
    trained = ffa_trained[-1]["eval_loss"]
    untrained = tmp_path / "zero_b"  # the program's initial adapters: B = 0
    save_adapters(untrained, {m: (a, np.zeros_like(b)) for m, (a, b) in load_adapters(ffa / "adapters").items()},
                  LORA_ALPHA)
    assert _eval_loss(ffa / "ffa.pte", untrained, ffa / "heldout.npy", tmp_path / "eval.json", vk_device) != trained
    for adapters in (ffa / "adapters", ffa / "run.ckpt"):
        assert _eval_loss(ffa / "ffa.pte", adapters, ffa / "heldout.npy", tmp_path / "eval.json", vk_device) == trained


def test_an_adapter_whose_lora_a_differs_from_the_constant_is_refused_naming_the_tensor(ffa, ffa_trained,
                                                                                      vk_device, tmp_path):
    adapters = load_adapters(ffa / "adapters")
    module = sorted(adapters)[0]
    lora_a, lora_b = adapters[module]
    changed = dict(adapters, **{module: (lora_a + np.float32(1e-3), lora_b)})
    save_adapters(tmp_path / "other_a", changed, LORA_ALPHA)
    expected = f"{peft_name(module, 'lora_A')} differs from the program's lora_A of {module}"
    with pytest.raises(AdapterError, match=expected):
        _eval_loss(ffa / "ffa.pte", tmp_path / "other_a", ffa / "heldout.npy", tmp_path / "eval.json", vk_device)
    with pytest.raises(AdapterError, match=expected):
        merged_state_dict(ffa / "ffa.pte", tmp_path / "other_a")


def test_merge_of_an_ffa_program_adds_alpha_over_r_b_a_with_its_constant_a(ffa, ffa_trained, tmp_path):
    merged, _ = merged_state_dict(ffa / "ffa.pte", ffa / "adapters")
    from_checkpoint, _ = merged_state_dict(ffa / "ffa.pte", checkpoint=ffa / "run.ckpt")
    assert merged.keys() == from_checkpoint.keys()
    assert all(np.array_equal(merged[name], from_checkpoint[name]) for name in merged)
    adapters = load_adapters(ffa / "adapters")
    save_adapters(tmp_path / "zero_b", {m: (a, np.zeros_like(b)) for m, (a, b) in adapters.items()}, LORA_ALPHA)
    base, _ = merged_state_dict(ffa / "ffa.pte", tmp_path / "zero_b")
    for module, (lora_a, lora_b) in adapters.items():
        delta = (LORA_ALPHA / LORA_RANK) * (lora_b.astype(np.float64) @ lora_a.astype(np.float64))
        np.testing.assert_allclose(merged[module + ".weight"] - base[module + ".weight"], delta, atol=1e-6)


def _gguf_tensors(path) -> dict[str, np.ndarray]:
    import gguf

    return {t.name: np.array(t.data) for t in gguf.GGUFReader(str(path)).tensors}


def test_gguf_adapters_of_an_ffa_program_hold_its_constant_a_from_train_and_from_convert(ffa, ffa_trained, tmp_path,
                                                                                        capsys):
    from vktrain.cli import main

    assert main(["adapters", "convert", str(ffa / "ffa.pte"), "--checkpoint", str(ffa / "run.ckpt"),
                 "--out", str(tmp_path / "converted.gguf")]) == 0
    assert (tmp_path / "converted.gguf").read_bytes() == (ffa / "trained.gguf").read_bytes()
    from vktrain.train.gguf_adapter import gguf_tensor_name

    graph = read_program_graph(ffa / "ffa.pte")
    tied = bool(ProgramAdapters.from_metadata(graph.metadata, "ffa.pte").model_config.get("tie_embeddings"))
    tensors = _gguf_tensors(ffa / "trained.gguf")
    frozen = frozen_lora_tensors(graph)
    assert len(tensors) == 2 * len(frozen)
    for name, constant in frozen.items():
        module = name.removeprefix(MODEL_PREFIX).removesuffix(".lora_A")
        assert np.array_equal(tensors[f"{gguf_tensor_name(module, tied)}.lora_a"].reshape(constant.shape), constant)
