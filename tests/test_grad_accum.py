"""Gradient accumulation (vktrain.export.export_accumulating_methods, TrainingRunner.accumulate): two
micro-batches of B, accumulated on the device, give the update of one batch of 2B; the accumulating step
with nothing accumulated is the plain step bit for bit; the device memory is one micro-batch's."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from _helpers import eager_lora_adamw_training
from vktrain.contract import EXP_AVG_PREFIX, GRAD_ACC_PREFIX, MODEL_PREFIX, hparams_values
from vktrain.export import export_accumulating_methods, export_training_step, lower_methods_to_pte, lower_to_pte
from vktrain.lora import LoRAConfig, apply_lora, lora_modules, lora_parameter_names
from vktrain.models import build_model
from vktrain.runtime.program.accumulation import AccumulateMethod
from vktrain.runtime.program.runner import TrainingRunner, UnsupportedProgramError
from vktrain.train.checkpoint import load_checkpoint
from vktrain.backend.kernel_planning import plan_schedule

MICRO = (2, 16)
VOCAB = 256
LR, BETAS, EPS = 1e-2, (0.9, 0.999), 1e-6
HPARAMS = np.array(hparams_values(LR, BETAS[0], BETAS[1], EPS, 0.0), np.float32)


@pytest.fixture(scope="module")
def model():
    model = build_model("tiny-llama", dim=64, n_layers=2, hidden=192, vocab_size=VOCAB, max_seq_len=64)
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, group_size=32, seed=0))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # lora_B starts at zero; make lora_A's gradient nonzero too
        for adapter in lora_modules(model).values():
            adapter.lora_B.copy_(0.05 * torch.randn(adapter.lora_B.shape, generator=generator))
    return model


@pytest.fixture(scope="module")
def ptes(model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("grad_accum")
    accumulating, plain, big = folder / "accumulating.pte", folder / "micro.pte", folder / "big.pte"
    accumulating.write_bytes(lower_methods_to_pte(export_accumulating_methods(model, MICRO)))
    plain.write_bytes(lower_to_pte(export_training_step(model, MICRO)))
    big.write_bytes(lower_to_pte(export_training_step(model, (2 * MICRO[0], MICRO[1]))))
    return accumulating, plain, big


def _batch():
    generator = torch.Generator().manual_seed(3)
    token_ids = torch.randint(0, VOCAB, (2 * MICRO[0], MICRO[1]), generator=generator)
    labels = torch.randint(0, VOCAB, token_ids.shape, generator=generator)
    labels[0, :5] = -100  # the micro-batches hold different counts: n_valid must be the total, not each one's
    labels[3, 9:] = -100
    return token_ids, labels


def test_two_micro_batches_update_as_one_batch_of_both(model, ptes, vk_device):
    accumulating, _, big = ptes
    token_ids, labels = _batch()
    n_valid = float((labels >= 0).sum())
    tokens, targets = token_ids.numpy(), labels.numpy()
    with TrainingRunner.from_pte(big, vk_device, planner=plan_schedule) as runner:
        loss_big = runner.step(tokens, targets, HPARAMS)
        state_big = runner.state_dict()
    with TrainingRunner.from_pte(accumulating, vk_device, planner=plan_schedule) as runner:
        b = MICRO[0]
        loss_acc = runner.accumulate(tokens[:b], targets[:b], n_valid)
        accumulated = {name: runner.read_state(name) for name in runner.state_names if name.startswith(GRAD_ACC_PREFIX)}
        assert all(np.any(value != 0) for value in accumulated.values())
        loss_acc += runner.step(tokens[b:], targets[b:], HPARAMS, n_valid=n_valid)
        state_acc = runner.state_dict()
    losses, _, _ = eager_lora_adamw_training(model, [(token_ids, labels)], lr=LR, betas=BETAS, eps=EPS,
                                             weight_decay=0.0, dtype=torch.float64)
    # Each micro-batch's loss is its sum over the total n_valid: together, the big batch's mean.
    assert loss_acc == pytest.approx(losses[0], rel=1e-5) and loss_big == pytest.approx(losses[0], rel=1e-5)
    for name in lora_parameter_names(model):  # paths under the model, as the state names them
        assert not np.any(state_acc[GRAD_ACC_PREFIX + name])  # the step consumed the accumulators
        # The first AdamW step stores exp_avg = (1 - beta1) g: the two float32 gradients differ by the
        # summation order over the 2B rows and one rounding of g1 + g2.
        g_acc = state_acc[EXP_AVG_PREFIX + name].astype(np.float64) / (1 - BETAS[0])
        g_big = state_big[EXP_AVG_PREFIX + name].astype(np.float64) / (1 - BETAS[0])
        scale = np.abs(g_big).max()
        np.testing.assert_allclose(g_acc, g_big, rtol=0, atol=1e-5 * scale)
        # The first update is lr g / (|g| + eps) (bias-corrected moments): by the mean value theorem a
        # gradient change dg moves it by at most lr eps |dg| / (min |g| on [g_big, g_acc] + eps)^2, plus
        # the float32 rounding of p - update (an ulp of each, twice).
        dg = np.abs(g_acc - g_big)
        nearest = np.maximum(np.abs(g_big) - dg, 0.0)
        p_acc = state_acc[MODEL_PREFIX + name].astype(np.float64)
        p_big = state_big[MODEL_PREFIX + name].astype(np.float64)
        bound = LR * EPS * dg / (nearest + EPS) ** 2 + 2 * (np.spacing(np.abs(p_big).astype(np.float32))
                                                             + np.spacing(np.float32(LR)))
        assert np.all(np.abs(p_acc - p_big) <= bound), name


def test_accumulating_step_with_nothing_accumulated_is_the_plain_step(ptes, vk_device):
    accumulating, plain, _ = ptes
    token_ids, labels = (array.numpy()[:MICRO[0]] for array in _batch())
    results = []
    for path in (accumulating, plain):
        with TrainingRunner.from_pte(path, vk_device, planner=plan_schedule) as runner:
            loss = runner.step(token_ids, labels, HPARAMS)
            results.append((loss, {name: runner.read_state(name) for name in runner.state_names
                                   if not name.startswith(GRAD_ACC_PREFIX)}))
    (loss_acc, state_acc), (loss_plain, state_plain) = results
    assert loss_acc == loss_plain and state_acc.keys() == state_plain.keys()
    for name in state_plain:
        np.testing.assert_array_equal(state_acc[name], state_plain[name], err_msg=name)


def test_device_memory_is_one_micro_batch_s(ptes, vk_device):
    accumulating, plain, big = ptes
    with TrainingRunner.from_pte(plain, vk_device, planner=plan_schedule) as runner:
        micro_bytes = runner.executor.program_bytes
    with TrainingRunner.from_pte(big, vk_device, planner=plan_schedule) as runner:
        big_bytes = runner.executor.program_bytes
    with TrainingRunner.from_pte(accumulating, vk_device, planner=plan_schedule) as runner:
        accumulators = sum(runner.read_state(name).nbytes for name in runner.state_names
                           if name.startswith(GRAD_ACC_PREFIX))
        step_bytes = runner.executor.program_bytes
        token_ids, labels = (array.numpy()[:MICRO[0]] for array in _batch())
        runner.accumulate(token_ids, labels, 1.0)
        method_bytes = runner._accumulate.executor.owned_bytes  # its own: what the step's activations can't hold
    print(micro_bytes, big_bytes, step_bytes, accumulators, method_bytes)
    assert step_bytes == micro_bytes + accumulators
    assert method_bytes <= micro_bytes < big_bytes


def test_accumulate_reuses_the_step_s_activation_memory_and_computes_the_same(ptes, vk_device):
    accumulating, _, _ = ptes
    token_ids, labels = (array.numpy() for array in _batch())
    n_valid = float((labels >= 0).sum())
    runs = []
    for reuse in (False, True):
        with TrainingRunner.from_pte(accumulating, vk_device, planner=plan_schedule) as runner:
            runner._accumulate = AccumulateMethod(runner.pte, runner.executor, reuse_activations=reuse,
                                                  planner=plan_schedule)
            losses = []
            for _ in range(2):  # two optimizer steps: the step's activations overwritten by accumulate's between
                losses.append(runner.accumulate(token_ids[:MICRO[0]], labels[:MICRO[0]], n_valid))
                losses.append(runner.step(token_ids[MICRO[0]:], labels[MICRO[0]:], HPARAMS, n_valid=n_valid))
            state = {name: runner.read_state(name) for name in runner.state_names}
            step, method = runner.executor, runner._accumulate.executor
            offered = step.transient_buffers()
            transient = {b.key: b.size_bytes for b in method.schedule.buffers if b.role in ("intermediate", "scratch")}
            reused = {key: next((k for k, b in offered.items() if b is method._buffers[key]), None) for key in transient}
            runs.append((losses, state, method.owned_bytes, sum(method.buffer_bytes.values()), transient, reused,
                         {k: b.size for k, b in offered.items()}))
    (losses_own, state_own, own_bytes, _, _, _, _), (losses, state, method_bytes, allocated, transient, reused,
                                                      offered) = runs
    assert losses == losses_own  # bit for bit: the step's activations are dead between calls
    for name in state_own:
        np.testing.assert_array_equal(state[name], state_own[name], err_msg=name)
    # Its intermediates live in the step's (each of the step's at most once, large enough; never its state or
    # outputs); only the excess, with its inputs and loss, is its own, and that is what it counts.
    taken = [theirs for theirs in reused.values() if theirs is not None]
    assert taken and len(taken) == len(set(taken))
    assert all(offered[theirs] >= transient[key] for key, theirs in reused.items() if theirs is not None)
    left = [nbytes for key, nbytes in offered.items() if key not in taken]
    excess = [nbytes for key, nbytes in transient.items() if reused[key] is None]
    assert all(nbytes > max(left, default=0) for nbytes in excess)  # none it could have reused is left unused
    assert method_bytes == allocated == own_bytes - sum(transient.values()) + sum(excess)
    assert method_bytes < own_bytes - max(transient.values())


def test_a_pte_without_the_accumulate_method_is_refused(ptes, vk_device):
    _, plain, _ = ptes
    token_ids, labels = (array.numpy()[:MICRO[0]] for array in _batch())
    with TrainingRunner.from_pte(plain, vk_device, planner=plan_schedule) as runner:
        with pytest.raises(UnsupportedProgramError, match="no 'accumulate' method"):
            runner.accumulate(token_ids, labels, 10.0)


def _cli_train(program, data, out, *extra) -> tuple[int, list[dict]]:
    from vktrain import cli

    code = cli.main(["train", str(program), "--data", str(data), "--no-shuffle", "--lr", "1e-2", "--schedule", "constant",
                     "--no-progress", "--log-every", "0", "--json", str(out), *extra])
    return code, (json.loads(out.read_text()) if code == 0 else [])


def test_train_grad_accum_matches_the_large_batch_and_resumes_exactly(ptes, tmp_path, vk_device):
    accumulating, plain, big = ptes
    data = tmp_path / "tokens.npy"
    np.save(data, np.random.default_rng(7).integers(0, VOCAB, 8 * MICRO[0] * MICRO[1] + 1))
    code, records = _cli_train(accumulating, data, tmp_path / "acc.json", "--steps", "2", "--grad-accum", "2",
                               "--checkpoint", str(tmp_path / "acc.ckpt"))
    assert code == 0
    code, large = _cli_train(big, data, tmp_path / "big.json", "--steps", "2")
    assert code == 0
    # Windows 0-1 then 2-3 as micro-batches, or together as one batch of 4: the same losses (fp32 sums).
    for mine, theirs in zip(records, large, strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
    # Checkpoints fall between optimizer steps (the accumulators are zero there): a resume is exact.
    code, _ = _cli_train(accumulating, data, tmp_path / "first.json", "--steps", "1", "--grad-accum", "2",
                         "--checkpoint", str(tmp_path / "resumed.ckpt"))
    assert code == 0
    code, resumed = _cli_train(accumulating, data, tmp_path / "resumed.json", "--steps", "2", "--grad-accum", "2",
                               "--resume", str(tmp_path / "resumed.ckpt"))
    assert code == 0 and [r["loss"] for r in resumed] == [r["loss"] for r in records]
    whole, split = load_checkpoint(tmp_path / "acc.ckpt"), load_checkpoint(tmp_path / "resumed.ckpt")
    assert split.step == whole.step == 2 and split.data_position == whole.data_position == 4
    for name, tensor in whole.tensors.items():
        np.testing.assert_array_equal(split.tensors[name], tensor, err_msg=name)


def test_train_grad_accum_refusals(ptes, tmp_path, capsys, vk_device):
    accumulating, plain, _ = ptes
    data = tmp_path / "tokens.npy"
    np.save(data, np.random.default_rng(7).integers(0, VOCAB, 4 * MICRO[0] * MICRO[1] + 1))
    assert _cli_train(plain, data, tmp_path / "a.json", "--steps", "1", "--grad-accum", "2")[0] == 2
    assert "has no 'accumulate' method; export it with vktrain export --grad-accum" in capsys.readouterr().err
    assert _cli_train(accumulating, data, tmp_path / "b.json", "--steps", "1", "--grad-accum", "0")[0] == 2
    assert "--grad-accum must be >= 1" in capsys.readouterr().err
    assert _cli_train(accumulating, data, tmp_path / "c.json", "--steps", "1", "--grad-accum", "2",
                      "--checkpoint", str(tmp_path / "c.ckpt"))[0] == 0
    assert _cli_train(accumulating, data, tmp_path / "d.json", "--steps", "2", "--grad-accum", "3",
                      "--resume", str(tmp_path / "c.ckpt"))[0] == 2
    assert "was trained with --grad-accum 2; resume with that" in capsys.readouterr().err


def test_export_grad_accum_writes_the_accumulate_method(tmp_path, capsys):
    from vktrain import cli
    from vktrain.contract import ACCUMULATE_METHOD, EVAL_METHOD, TRAIN_METHOD
    from vktrain.serialization.pte import PteFile

    out = tmp_path / "step.pte"
    assert cli.main(["export", "--model", "tiny-llama", "--lora-rank", "2", "--batch", "1", "--seq", "8",
                     "--calibration-data", "none", "--grad-accum", "--out", str(out)]) == 0
    assert sorted(PteFile.load(out).method_names) == sorted([TRAIN_METHOD, EVAL_METHOD, ACCUMULATE_METHOD])
    assert cli.main(["export", "--model", "tiny-llama", "--program", "forward", "--grad-accum",
                     "--out", str(tmp_path / "forward.pte")]) == 2
    assert "--grad-accum accumulates a training step's gradients; --program is forward" in capsys.readouterr().err


def test_inspect_counts_the_accumulate_method_as_the_runtime_allocates_it(ptes, vk_device, capsys, monkeypatch):
    from vktrain import cli
    from vktrain.runtime.device_profiles import DEVICE_PROFILE_ENV

    accumulating, _, _ = ptes
    monkeypatch.delenv(DEVICE_PROFILE_ENV, raising=False)
    assert cli.main(["inspect", str(accumulating), "--device-profile", "adreno-7xx", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    monkeypatch.setenv(DEVICE_PROFILE_ENV, "adreno-7xx")  # the runtime plans for the same profile
    token_ids, labels = (array.numpy()[:MICRO[0]] for array in _batch())
    with TrainingRunner.from_pte(accumulating, vk_device, planner=plan_schedule) as runner:
        runner.accumulate(token_ids, labels, 10.0)
        step, method = runner.executor.owned_bytes, runner._accumulate.executor.owned_bytes
    accumulate, evaluation = report["accumulate"], report["eval"]
    assert report["step_device_memory_bytes"] == step
    assert accumulate["method"] == "accumulate" and accumulate["device_memory_bytes"] == method < step
    assert report["device_memory_bytes"] == step + method + evaluation["device_memory_bytes"]
    assert cli.main(["inspect", str(accumulating), "--device-profile", "adreno-7xx"]) == 0
    assert "+ accumulate method " in capsys.readouterr().out


def test_federated_clients_accumulate_and_local_steps_count_optimizer_steps(ptes, tmp_path, capsys, vk_device):
    """Two clients holding the same shard, 2 local steps of --grad-accum 2: FedAvg of identical updates is
    one runner's two accumulated steps over the shard's batches 0-1 and 2-3, bit for bit. The settings are
    those `vktrain fleet server ... --grad-accum 2` hands its ServerApp (its run config, read back as
    the deployment reads it), run on the sequential Grid; federate and fleet server refuse a program
    without the accumulate method."""
    from vktrain import cli
    from vktrain.fleet.client import ClientSettings, close_trainers, make_client_app, trained_names
    from vktrain.fleet.deploy import federation_settings
    from vktrain.fleet.deployment import _run_config
    from vktrain.fleet.sequential import SequentialGrid
    from vktrain.fleet.server import FederationServer
    from vktrain.train.data import TokenBatcher
    from vktrain.train.train_loop import AdamWConfig, run_accumulated_step

    accumulating, plain, _ = ptes
    shard = tmp_path / "shard.npy"
    np.save(shard, np.random.default_rng(5).integers(0, VOCAB, 8 * MICRO[0] * MICRO[1] + 1))
    program, shards = str(accumulating), (str(shard),) * 2
    server_args = ["fleet", "server", program, "--nodes", "2", "--rounds", "1", "--local-steps", "2", "--lr", str(LR),
                   "--certificates", str(tmp_path), "--allowed-keys", str(tmp_path)]
    settings = federation_settings(_run_config(cli.build_parser().parse_args([*server_args, "--grad-accum", "2"])))
    assert settings.grad_accum == 2 and settings.train_config()["grad-accum"] == 2
    with TrainingRunner.from_pte(accumulating, vk_device, planner=plan_schedule) as runner:
        try:
            result = FederationServer(settings, runner, progress=False).run(
                SequentialGrid(make_client_app(ClientSettings(program, shards)), 2))
        finally:
            close_trainers()
    batches = TokenBatcher(np.load(shard), *MICRO, seed=0)
    hparams = AdamWConfig().hparams(LR)
    with TrainingRunner.from_pte(accumulating, vk_device, planner=plan_schedule) as alone:
        names = trained_names(alone.state_names)
        initial = {name: alone.read_state(name) for name in names}
        losses = [run_accumulated_step(alone, [batches.batch(2 * j), batches.batch(2 * j + 1)], hparams)
                  for j in range(2)]
        assert sorted(result.arrays) == sorted(names)
        for name in names:
            assert np.array_equal(result.arrays[name], alone.read_state(name)), name
        assert any(not np.array_equal(initial[name], alone.read_state(name)) for name in names)
    assert result.records[1]["client_train_loss"] == {"0": float(np.mean(losses)), "1": float(np.mean(losses))}

    code = cli.main(["federate", str(plain), "--clients", "1", "--rounds", "1", "--local-steps", "1",
                     "--grad-accum", "2", "--data", str(shard), "--engine", "sequential"])
    err = capsys.readouterr().err
    assert code == 2 and "--grad-accum 2" in err and "no 'accumulate' method" in err
    assert cli.main(["federate", str(accumulating), "--clients", "1", "--rounds", "1", "--local-steps", "1",
                     "--grad-accum", "0", "--data", str(shard)]) == 2
    assert "--grad-accum must be >= 1, got 0" in capsys.readouterr().err
    server_args[2] = str(plain)  # refused before the SuperLink starts (no certificates are even looked at)
    assert cli.main([*server_args, "--grad-accum", "2"]) == 2
    err = capsys.readouterr().err
    assert "--grad-accum 2" in err and "no 'accumulate' method" in err
