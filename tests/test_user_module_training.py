"""A user module's training step through the front door: TrainingRunner.step_inputs and `vktrain train --inputs`.

README.md's Regressor ("Training any module"), exported with export_training_step, trains ten steps by
named inputs with eager PyTorch + torch.optim.AdamW's losses (LOSS_RTOL against a float64 eager run, as
tests/test_user_modules.py derives it) and exactly the losses of the low-level GraphExecutor; through
`vktrain train --inputs DATA.npz` with a warmup + cosine schedule fed per step, the same; a run
interrupted at step 5 and resumed equals the uninterrupted one bit for bit. Bad inputs (a missing name,
an extra array, a wrong dtype or shape) and token-data flags are refused, naming what is wrong.
A batch whose loss is not finite stops the run or is skipped (--on-nonfinite skip).
`vktrain eval --inputs` gives the eval method's mean loss (eager float64's before training, the trained
runner's own after), and refuses a step without an eval method.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from vktrain.contract import EVAL_METHOD, EXP_AVG_PREFIX, MODEL_PREFIX, TRAIN_METHOD, hparams_values
from vktrain.errors import VktrainError
from vktrain.export import export_training_and_eval_steps, export_training_step, lower_methods_to_pte, lower_to_pte
from vktrain.lora import LoRAConfig, apply_lora
from vktrain.runtime.delegate.executor import ExecutorInputError
from vktrain.serialization.pte import PteFile
from vktrain.runtime.program.runner import TrainingRunner, UnsupportedProgramError
from vktrain.runtime.program.interpreter import check_hparams_input, verify_training_program
from vktrain.train.checkpoint import load_checkpoint
from vktrain.train.command import add_train_arguments, run_train
from vktrain.train.data import DataError
from vktrain.train.lr_schedule import LRSchedule
from vktrain.train.eval_command import add_eval_arguments, run_eval
from vktrain.train.train_loop import NonFiniteLossError, TrainConfigError

from _helpers import (LOSS_RTOL, TrainingReference, _cast_floating, assert_training_matches_reference,
                      readme_snippet)
from test_user_modules import HPARAMS_ARRAY, device_training
from vktrain.backend.kernel_planning import plan_schedule

STEPS = 10
LR, BETAS, EPS, WEIGHT_DECAY = 1e-2, (0.9, 0.999), 1e-8, 0.01
DISTINCT = 3  # batches, cycled over the STEPS steps (as `vktrain train --inputs` cycles a stack of 3)
TRAINABLE = [f"{layer}.lora_{which}" for layer in ("inp", "out") for which in "AB"]


class Regressor(nn.Module):
    """README.md's example: the forward returns the loss."""

    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x, target):
        return ((self.out(torch.relu(self.inp(x))) - target) ** 2).sum() / target.numel()


def _distinct_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Three batches of a learnable map (ten steps of fresh batches would not show the loss fall)."""
    generator = torch.Generator().manual_seed(21)
    true_map = torch.randn(16, 8, generator=generator) / 4
    batches = []
    for _ in range(DISTINCT):
        x = torch.randn(4, 16, generator=generator)
        batches.append((x, torch.tanh(x @ true_map)))
    return batches


@pytest.fixture(scope="module")
def regressor(tmp_path_factory):
    """(the model with its LoRA init, its step's .pte path, the batch of each of the STEPS steps)."""
    torch.manual_seed(0)
    model = Regressor()
    apply_lora(model, LoRAConfig(rank=4, targets="*", group_size=16, seed=0))
    distinct = _distinct_batches()
    batches = [distinct[step % DISTINCT] for step in range(STEPS)]
    path = tmp_path_factory.mktemp("regressor") / "regressor.pte"
    path.write_bytes(lower_to_pte(export_training_step(model, example_inputs=batches[0])))
    return model, path, batches


def eager_adamw(model: nn.Module, batches, lrs: list[float], dtype=None, *, weight_decay: float = WEIGHT_DECAY):
    """torch.optim.AdamW on a copy of `model`, step t at lrs[t - 1] (what a schedule feeds the program).
    Returns (losses, final trainable tensors, final first moments) by parameter name."""
    model = copy.deepcopy(model)
    if dtype is not None:
        _cast_floating(model, dtype)
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW(params.values(), lr=lrs[0], betas=BETAS, eps=EPS, weight_decay=weight_decay)
    losses = []
    for (x, target), lr in zip(batches, lrs):
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad()
        loss = model(*(t.to(dtype) if dtype is not None else t for t in (x, target)))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    state = {name: p.detach().numpy().copy() for name, p in params.items()}
    exp_avg = {name: optimizer.state[p]["exp_avg"].numpy().copy() for name, p in params.items()}
    return losses, state, exp_avg


def _reference(model, batches, lrs) -> TrainingReference:
    return TrainingReference(*eager_adamw(model, batches, lrs, torch.float64), *eager_adamw(model, batches, lrs))


def _hparams(lr: float) -> np.ndarray:
    return np.array(hparams_values(lr, *BETAS, EPS, WEIGHT_DECAY), np.float32)


def test_step_inputs_trains_the_readme_regressor_like_eager_adamw(regressor, vk_device):
    model, path, batches = regressor
    initial = {name: p.detach().numpy().copy() for name, p in model.named_parameters() if p.requires_grad}
    with TrainingRunner.from_pte(path, vk_device, planner=plan_schedule) as runner:
        assert runner.input_names == ["x", "target", "hparams"] and not runner.is_token_step
        assert {n: (s.shape, str(s.dtype)) for n, s in runner.input_specs.items()} == {
            "x": ((4, 16), "float32"), "target": ((4, 8), "float32")}
        losses = [runner.step_inputs({"target": target.numpy(), "x": x.numpy()}, _hparams(LR))  # any order
                  for x, target in batches]
        state = {name: runner.read_state(MODEL_PREFIX + name) for name in TRAINABLE}
        exp_avg = {name: runner.read_state(EXP_AVG_PREFIX + name) for name in TRAINABLE}
    assert np.mean(losses[-3:]) < np.mean(losses[:3])  # it trains
    assert_training_matches_reference(losses, state, exp_avg, _reference(model, batches, [LR] * STEPS), initial)
    # The front door adds nothing to the program's run: the delegate's own losses (device_training feeds
    # test_user_modules' hparams, these), bit for bit.
    assert HPARAMS_ARRAY.tolist() == _hparams(LR).tolist()
    executor_losses, _, _ = device_training(path.read_bytes(), vk_device, batches, TRAINABLE)
    assert losses == executor_losses


def test_step_inputs_refuses_bad_inputs_naming_them(regressor, vk_device):
    _, path, batches = regressor
    x, target = (t.numpy() for t in batches[0])
    with TrainingRunner.from_pte(path, vk_device, planner=plan_schedule) as runner:
        hparams = _hparams(LR)
        cases = [
            ({"x": x}, r"takes inputs \['x', 'target'\]; missing \['target'\]"),
            ({"x": x, "target": target, "mask": x}, r"not inputs of the program \['mask'\]"),
            ({"x": x.astype(np.float64), "target": target},
             r"input 'x' holds float32, got an array of float64 \(float64 does not convert to float32 exactly"),
            ({"x": x, "target": target.astype(np.int64)}, r"input 'target' holds float32, got an array of int64"),
            ({"x": x[:3], "target": target}, r"input 'x' takes float32\[4, 16\], got float32\[3, 16\]"),
        ]
        before = runner.state_dict()
        for inputs, message in cases:
            with pytest.raises(ExecutorInputError, match=message):
                runner.step_inputs(inputs, hparams)
        with pytest.raises(ExecutorInputError, match=r"takes 2 inputs \['x', 'target'\] .* got a sequence of 1"):
            runner.step_inputs([x], hparams)
        with pytest.raises(ExecutorInputError, match="takes an hparams input .* none was given"):
            runner.step_inputs({"x": x, "target": target})
        with pytest.raises(ExecutorInputError, match=r"step\(\) takes a token model's .* inputs are \['x', 'target', "
                                                     r"'hparams'\]: call step_inputs\(\)"):
            runner.step(x, target, hparams)
        with pytest.raises(AttributeError, match="has no token_ids input"):
            runner.batch_shape
        # Nothing ran: the state is untouched. A sequence in the program's order is the mapping.
        assert all(np.array_equal(before[n], runner.read_state(n)) for n in before)
        by_sequence = runner.step_inputs([x, target], hparams)
        runner.load_state_dict(before)
        assert runner.step_inputs({"x": x, "target": target}, hparams) == by_sequence
    assert issubclass(ExecutorInputError, VktrainError)


def _train_args(*argv: str) -> argparse.Namespace:
    return add_train_arguments(argparse.ArgumentParser()).parse_args([*argv, "--no-progress"])


def _stacked_inputs(path, batches) -> None:
    """The .npz of the distinct batches, stacked (train() cycles them as the batches list does)."""
    distinct = batches[:DISTINCT]
    np.savez(path, x=np.stack([x.numpy() for x, _ in distinct]), target=np.stack([t.numpy() for _, t in distinct]))


def test_vktrain_train_inputs_follows_eager_adamw_and_resumes_exactly(regressor, vk_device, tmp_path):
    model, path, batches = regressor
    data = tmp_path / "batches.npz"
    _stacked_inputs(data, batches)
    schedule = ["--lr", str(LR), "--schedule", "cosine", "--warmup", "2", "--weight-decay", str(WEIGHT_DECAY)]
    whole = tmp_path / "whole"
    args = _train_args(str(path), "--inputs", str(data), "--steps", str(STEPS), *schedule,
                       "--checkpoint", str(whole / "ck.safetensors"), "--json", str(whole / "losses.json"),
                       "--plot", str(whole / "loss.png"))
    assert run_train(args, vk_device) == 0
    records = json.loads((whole / "losses.json").read_text())
    lrs = [LRSchedule("cosine", LR, STEPS, 2).lr(t) for t in range(1, STEPS + 1)]
    assert [r["lr"] for r in records] == lrs and (whole / "loss.png").stat().st_size > 0
    losses = [r["loss"] for r in records]
    assert np.mean(losses[-3:]) < np.mean(losses[:3])
    # The program receives each lr rounded to float32: so does the reference.
    reference = _reference(model, batches, [float(np.float32(lr)) for lr in lrs])
    np.testing.assert_allclose(losses, reference.losses, rtol=LOSS_RTOL)

    # Trained to step 5, then resumed to 10: the same records and state as one run, bit for bit (a
    # constant schedule: a cosine's length is the --steps of the run, which differs between the two).
    checkpoint = tmp_path / "split" / "ck.safetensors"
    constant = ["--lr", str(LR), "--schedule", "constant", "--weight-decay", str(WEIGHT_DECAY)]
    uninterrupted = tmp_path / "uninterrupted.safetensors"
    assert run_train(_train_args(str(path), "--inputs", str(data), "--steps", str(STEPS), *constant,
                                 "--checkpoint", str(uninterrupted)), vk_device) == 0
    assert run_train(_train_args(str(path), "--inputs", str(data), "--steps", "5", *constant,
                                 "--checkpoint", str(checkpoint)), vk_device) == 0
    assert run_train(_train_args(str(path), "--inputs", str(data), "--steps", str(STEPS), *constant,
                                 "--resume", str(checkpoint)), vk_device) == 0
    expected, resumed = load_checkpoint(uninterrupted), load_checkpoint(checkpoint)
    assert resumed.step == expected.step == STEPS
    assert [r["loss"] for r in resumed.records] == [r["loss"] for r in expected.records]
    assert sorted(resumed.tensors) == sorted(expected.tensors)
    for name, tensor in expected.tensors.items():
        assert np.array_equal(resumed.tensors[name], tensor), name


def test_one_batch_without_a_step_axis_feeds_every_step(regressor, vk_device, tmp_path):
    model, path, batches = regressor
    data = tmp_path / "one.npz"
    x, target = batches[0]
    np.savez(data, x=x.numpy(), target=target.numpy())
    args = _train_args(str(path), "--inputs", str(data), "--steps", "4", "--lr", str(LR), "--schedule", "constant",
                       "--weight-decay", str(WEIGHT_DECAY), "--json", str(tmp_path / "losses.json"))
    assert run_train(args, vk_device) == 0
    losses = [r["loss"] for r in json.loads((tmp_path / "losses.json").read_text())]
    reference = _reference(model, [batches[0]] * 4, [LR] * 4)
    np.testing.assert_allclose(losses, reference.losses, rtol=LOSS_RTOL)


def test_vktrain_train_refuses_bad_inputs_and_token_flags(regressor, vk_device, tmp_path):
    _, path, batches = regressor
    x = np.stack([b[0].numpy() for b in batches[:DISTINCT]])
    target = np.stack([b[1].numpy() for b in batches[:DISTINCT]])
    cases = {
        "missing": (dict(x=x), DataError, r"has no array for input\(s\) \['target'\]; the program's inputs are "
                                          r"x float32\[4, 16\], target float32\[4, 8\]"),
        "extra": (dict(x=x, target=target, weights=x), DataError,
                  r"holds array\(s\) \['weights'\] the program does not take"),
        "dtype": (dict(x=x.astype(np.float64), target=target), DataError,
                  r"array 'x' holds float64; input 'x' takes float32 .*save it as float32"),
        "shape": (dict(x=x[:, :, :15], target=target), DataError,
                  r"array 'x' is float32\[3, 4, 15\]; input 'x' takes float32\[4, 16\]: give one batch of that "
                  r"shape or a stack \[N, 4, 16\]"),
        "counts": (dict(x=x, target=target[:2]), DataError, r"different numbers of batches \{'x': 3, 'target': 2\}"),
    }
    for name, (arrays, error, message) in cases.items():
        data = tmp_path / f"{name}.npz"
        np.savez(data, **arrays)
        with pytest.raises(error, match=message):
            run_train(_train_args(str(path), "--inputs", str(data), "--steps", "2"), vk_device)
    good = tmp_path / "good.npz"
    _stacked_inputs(good, batches)
    with pytest.raises(TrainConfigError, match=r"--data, --seed, --no-shuffle cannot apply with --inputs: they "
                                               r"describe token data"):
        run_train(_train_args(str(path), "--inputs", str(good), "--steps", "2", "--data", "x.txt", "--seed", "3",
                              "--no-shuffle"), vk_device)
    with pytest.raises(TrainConfigError, match=r"is not a token model's step \(its inputs are \['x', 'target', "
                                               r"'hparams'\], .*give its input arrays with --inputs DATA.npz"):
        run_train(_train_args(str(path), "--steps", "2"), vk_device)
    checkpoint = tmp_path / "ck.safetensors"
    assert run_train(_train_args(str(path), "--inputs", str(good), "--steps", "1", "--checkpoint",
                                 str(checkpoint)), vk_device) == 0
    other = tmp_path / "other.npz"
    np.savez(other, x=x[::-1].copy(), target=target)
    with pytest.raises(VktrainError, match="was trained on other data .*resume with the same --inputs arrays"):
        run_train(_train_args(str(path), "--inputs", str(other), "--steps", "2", "--resume", str(checkpoint)),
                  vk_device)
    assert issubclass(DataError, VktrainError) and issubclass(TrainConfigError, VktrainError)


def test_the_readmes_vktrain_train_line_follows_eager(vk_device, tmp_path, monkeypatch):
    """README.md's "Training any module": its snippet (TrainingRunner.step_inputs; test_user_modules checks
    its losses) saves the batch it trains on; its `vktrain train --inputs` line, as written, trains that
    .npz with eager PyTorch + AdamW's losses."""
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(readme_snippet("## Training any module"), "README.md", "exec"), namespace)
    line = next(line for line in readme_lines("## Training any module") if line.startswith("vktrain train "))
    argv = line.split("#")[0].split()[2:]
    assert "--inputs" in argv
    assert run_train(_train_args(*argv, "--json", "losses.json"), vk_device) == 0
    losses = [r["loss"] for r in json.loads((tmp_path / "losses.json").read_text())]
    batch = (namespace["x"], namespace["target"])
    lr = float(argv[argv.index("--lr") + 1])
    weight_decay = float(argv[argv.index("--weight-decay") + 1])
    assert argv[argv.index("--schedule") + 1] == "constant" and weight_decay == 0.0
    expected, _, _ = eager_adamw(namespace["model"], [batch] * len(losses), [lr] * len(losses), torch.float64,
                                 weight_decay=weight_decay)
    np.testing.assert_allclose(losses, expected, rtol=LOSS_RTOL)


def readme_lines(section_title: str) -> list[str]:
    """The lines of README.md's section `section_title`."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text.split(section_title + "\n", 1)[1].split("\n## ", 1)[0]
    return [line.strip() for line in section.splitlines()]


def _eval_args(*argv: str) -> argparse.Namespace:
    return add_eval_arguments(argparse.ArgumentParser()).parse_args(list(argv))


def test_vktrain_eval_inputs_needs_the_eval_method_and_refuses_token_data(regressor, vk_device, tmp_path):
    _, path, batches = regressor  # exported without an eval method
    data = tmp_path / "held_out.npz"
    _stacked_inputs(data, batches)
    with pytest.raises(UnsupportedProgramError, match=r"has no 'eval' method"):
        run_eval(_eval_args(str(path), "--inputs", str(data)), vk_device)
    text = tmp_path / "tokens.txt"
    text.write_text("some held-out text")
    with pytest.raises(TrainConfigError, match=r"is not a token model's step \(its inputs are \['x', 'target', "
                                               r"'hparams'\]\): evaluate it on its input arrays with --inputs"):
        run_eval(_eval_args(str(path), "--data", str(text)), vk_device)
    with pytest.raises(TrainConfigError, match="--data FILE .* or --inputs DATA.npz .*, exactly one of the two"):
        run_eval(_eval_args(str(path), "--data", str(text), "--inputs", str(data)), vk_device)


def test_vktrain_eval_inputs_gives_the_mean_eval_loss_before_and_after_training(regressor, vk_device, tmp_path):
    model, _, batches = regressor
    step, evaluation = export_training_and_eval_steps(model, example_inputs=batches[0])
    path = tmp_path / "with_eval.pte"
    path.write_bytes(lower_methods_to_pte({TRAIN_METHOD: step, EVAL_METHOD: evaluation}))
    data = tmp_path / "batches.npz"
    _stacked_inputs(data, batches)
    assert run_eval(_eval_args(str(path), "--inputs", str(data), "--json", str(tmp_path / "before.json")),
                    vk_device) == 0
    before = json.loads((tmp_path / "before.json").read_text())
    exact = copy.deepcopy(model)
    _cast_floating(exact, torch.float64)
    with torch.no_grad():
        expected = np.mean([exact(x.double(), target.double()).item() for x, target in batches[:DISTINCT]])
    assert before["batches"] == DISTINCT
    np.testing.assert_allclose(before["loss"], expected, rtol=LOSS_RTOL)

    # After 5 steps of `vktrain train --inputs`, eval of its checkpoint is the trained runner's own eval.
    checkpoint = tmp_path / "ck.safetensors"
    constant = ["--lr", str(LR), "--schedule", "constant", "--weight-decay", str(WEIGHT_DECAY)]
    assert run_train(_train_args(str(path), "--inputs", str(data), "--steps", "5", *constant,
                                 "--checkpoint", str(checkpoint)), vk_device) == 0
    assert run_eval(_eval_args(str(path), "--inputs", str(data), "--adapters", str(checkpoint), "--json",
                               str(tmp_path / "after.json")), vk_device) == 0
    after = json.loads((tmp_path / "after.json").read_text())
    with TrainingRunner.from_pte(path, vk_device, planner=plan_schedule) as runner:
        for step in range(5):
            runner.step_inputs(dict(zip(("x", "target"), (t.numpy() for t in batches[step]))), _hparams(LR))
        trained = [runner.evaluate_inputs({"x": x.numpy(), "target": t.numpy()}) for x, t in batches[:DISTINCT]]
    assert after["loss"] == math.fsum(trained) / DISTINCT and after["loss"] < before["loss"]


def test_a_batch_with_a_non_finite_loss_is_skipped_or_stops_the_run(regressor, vk_device, tmp_path):
    model, path, batches = regressor
    distinct = batches[:DISTINCT]
    x = np.stack([b[0].numpy() for b in distinct])
    x[1, 0, 0] = np.inf  # batch 1's loss is not finite
    data = tmp_path / "bad.npz"
    np.savez(data, x=x, target=np.stack([b[1].numpy() for b in distinct]))
    constant = ["--lr", str(LR), "--schedule", "constant", "--weight-decay", str(WEIGHT_DECAY)]
    with pytest.raises(NonFiniteLossError, match="the loss became (inf|nan) at step 2"):
        run_train(_train_args(str(path), "--inputs", str(data), "--steps", "4", *constant), vk_device)
    # skip: data positions 1 and 4 (batch 1 each time round) are skipped; steps 1..4 train on 0, 2, 0, 2.
    records_path = tmp_path / "losses.json"
    assert run_train(_train_args(str(path), "--inputs", str(data), "--steps", "4", *constant, "--on-nonfinite", "skip",
                                 "--json", str(records_path)), vk_device) == 0
    records = json.loads(records_path.read_text())
    assert [r.get("skipped") for r in records] == [None, [1], None, [4]]
    reference = _reference(model, [distinct[0], distinct[2], distinct[0], distinct[2]], [LR] * 4)
    np.testing.assert_allclose([r["loss"] for r in records], reference.losses, rtol=LOSS_RTOL)


def test_an_hparams_input_that_is_not_adamws_is_refused_at_load(regressor):
    """A program's `hparams` input is what adamw reads, float32 [5]; another shape is refused, named."""
    _, path, _ = regressor
    pte = PteFile.load(path)
    plan = pte.execution_plan(TRAIN_METHOD)
    names = verify_training_program(pte).input_names
    check_hparams_input(pte, plan, names)
    position = plan.inputs[names.index("hparams")]
    values = list(plan.values)
    values[position] = dataclasses.replace(values[position], sizes=(3,))
    with pytest.raises(UnsupportedProgramError, match=r"input 'hparams' is float32\[3\]; expected float32\[5\] "
                                                      r"\(lr, beta1, beta2, eps, weight_decay\)"):
        check_hparams_input(pte, dataclasses.replace(plan, values=tuple(values)), names)
