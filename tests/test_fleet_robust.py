"""Robust aggregation (vktrain/fleet/robust.py through FleetFedAvg): bad updates screened out against numpy
references, median and trimmed mean against numpy / scipy, and one `vktrain federate` run on tiny-llama
whose poisoned clients (NaN, wrong shape, 1e6 norm) are dropped, the round equal to the mean of the rest."""
from __future__ import annotations

import io
import json
from contextlib import redirect_stderr

import numpy as np
import pytest
from vktrain.backend.kernel_planning import plan_schedule

NAMES = [f"model.layers.{i}.{w}" for i in range(2) for w in ("lora_A", "lora_B")]


def _strategy(n_clients, **options):
    from flwr.app import ConfigRecord

    from vktrain.fleet.arrays import to_array_record
    from vktrain.fleet.sequential import SequentialGrid
    from vktrain.fleet.strategy import FleetFedAvg

    SequentialGrid(client_app=None, n_clients=0)  # stamps this process's messages as the server's, as Flower does
    strategy = FleetFedAvg(n_clients=n_clients, fraction_train=1.0, fraction_evaluate=0.0, seed=0, **options)
    strategy.node_of_partition = {p: 5000 + 11 * p for p in range(n_clients)}
    global_arrays = {n: np.full((6, 4), 0.5, np.float32) for n in NAMES}
    strategy.configure_train(1, to_array_record(global_arrays), ConfigRecord(), grid=None)
    return strategy, global_arrays


def _reply(strategy, partition, arrays, examples, loss=1.0, claimed=None):
    from flwr.app import ConfigRecord, Message, MessageType, MetricRecord, RecordDict

    from vktrain.fleet.arrays import to_array_record
    from vktrain.fleet.client import ARRAYS, CLIENT, METRICS, NUM_EXAMPLES, PARTITION_ID

    instruction = Message(RecordDict(), strategy.node_of_partition[partition], MessageType.TRAIN)
    instruction.metadata.__dict__["_message_id"] = f"m{partition}"
    content = RecordDict({ARRAYS: to_array_record(arrays),
                          METRICS: MetricRecord({NUM_EXAMPLES: examples, "train-loss": loss}),
                          CLIENT: ConfigRecord({PARTITION_ID: partition if claimed is None else claimed, "pid": 1,
                                                "device": "cpu", "started": 0.0, "finished": 1.0})})
    return Message(content, reply_to=instruction)


def _good_updates(global_arrays, partitions, seed=0):
    rng = np.random.default_rng(seed)
    return {p: {n: (a + 0.01 * rng.standard_normal(a.shape)).astype(np.float32) for n, a in global_arrays.items()}
            for p in partitions}


def _aggregate(strategy, replies):
    from vktrain.fleet.arrays import from_array_record

    log = io.StringIO()
    strategy.log = log
    result, _ = strategy.aggregate_train(1, replies)
    return (None if result is None else from_array_record(result)), strategy.rounds[1], log.getvalue()


def test_bad_updates_are_dropped_and_the_round_equals_the_mean_of_the_good_ones():
    """NaN, inf, a wrong shape, a missing tensor, a 1e6-norm update, a non-finite loss, a reply claiming
    another client's partition: each dropped, logged with its node and reason; the result is bit for bit
    the float64 num-examples-weighted mean of the good clients (numpy), and what the good replies alone give."""
    from vktrain.fleet.faults import NAN, NORM, SHAPE, corrupt
    from vktrain.fleet.robust import update_norm

    strategy, global_arrays = _strategy(12)
    good = _good_updates(global_arrays, (0, 2, 5, 9, 11))
    examples = {p: 10 + 37 * p for p in range(12)}
    base = _good_updates(global_arrays, (1, 3, 4, 6, 7, 8), seed=1)
    bad = {1: corrupt(NAN, base[1], global_arrays), 3: corrupt(SHAPE, base[3], global_arrays),
           4: corrupt(NORM, base[4], global_arrays), 6: {n: a for n, a in base[6].items() if n != NAMES[2]},
           7: {**base[7], NAMES[1]: np.full((6, 4), np.inf, np.float32)}}
    assert update_norm(bad[4], global_arrays) == pytest.approx(1e6, rel=1e-6)
    replies = [_reply(strategy, p, a, examples[p]) for p, a in {**good, **bad}.items()]
    replies.append(_reply(strategy, 8, base[8], examples[8], loss=float("nan")))
    replies.append(_reply(strategy, 10, good[0], examples[10], claimed=0))  # node 10 pretending to be client 0
    result, record, log = _aggregate(strategy, replies[::-1])

    total = sum(examples[p] for p in good)
    for name in NAMES:
        reference = sum(np.float64(examples[p]) * good[p][name].astype(np.float64) for p in sorted(good)) / total
        np.testing.assert_array_equal(result[name], reference.astype(np.float32), err_msg=name)
    assert record["dropped"].keys() == {"1", "3", "4", "6", "7", "8", "10"}
    assert "non-finite" in record["dropped"]["1"] and "non-finite" in record["dropped"]["7"]
    assert "[5, 4], the global tensor float32[6, 4]" in record["dropped"]["3"]
    assert "missing ['model.layers.1.lora_A']" in record["dropped"]["6"]
    assert "exceeds 10 x the round's median update norm" in record["dropped"]["4"]
    assert "train-loss" in record["dropped"]["8"] and "claims partition 0" in record["dropped"]["10"]
    for p in record["dropped"]:
        assert f"client {p} (node {5000 + 11 * int(p)})" in log
    assert record["client_train_loss"].keys() == {str(p) for p in good} and record["aggregated"]
    assert not record["failed"]
    alone, _, _ = _aggregate(_strategy(12)[0], [_reply(strategy, p, a, examples[p]) for p, a in good.items()])
    assert all(np.array_equal(result[n], alone[n]) for n in NAMES)


def test_the_norm_bound_uses_the_lower_median_and_can_be_lifted():
    """Of two clients, one with a 1e6-norm update: the lower median is the honest norm, so the huge one is
    dropped; --max-update-norm-ratio inf (None) keeps both; a bound of 1 keeps those at or under the median."""
    from vktrain.fleet.faults import NORM, corrupt
    from vktrain.fleet.robust import parse_norm_ratio

    strategy, global_arrays = _strategy(2)
    good = _good_updates(global_arrays, (0, 1))
    replies = [_reply(strategy, 0, good[0], 5), _reply(strategy, 1, corrupt(NORM, good[1], global_arrays), 5)]
    result, record, _ = _aggregate(strategy, replies)
    assert list(record["dropped"]) == ["1"] and all(np.array_equal(result[n], good[0][n]) for n in NAMES)
    assert record["median_update_norm"] == pytest.approx(record["update_norms"]["0"])
    unbounded, _ = _strategy(2, max_norm_ratio=parse_norm_ratio("inf"))
    _, record, _ = _aggregate(unbounded, replies)
    assert not record["dropped"]
    tight, _ = _strategy(3, max_norm_ratio=1.0)
    three = _good_updates(global_arrays, (0, 1, 2), seed=3)
    _, record, _ = _aggregate(tight, [_reply(tight, p, a, 1) for p, a in three.items()])
    norms = record["update_norms"]
    assert set(record["dropped"]) == {max(norms, key=norms.get)}  # above the median of three: dropped


def test_the_mean_has_the_bits_of_the_float64_stack_it_no_longer_builds():
    """Aggregation('mean').combine sums without stacking the updates: bit for bit the previous
    `(stack * w).sum(axis=0) / w.sum()` over the float64 stack, for 9 clients (numpy sums a one-element
    tensor's stack pairwise past 8) with fractional weights, signed zeros and subnormals; float64 updates,
    so no rounding to float32 hides a different order of the sums."""
    from vktrain.fleet.robust import Aggregation

    rng = np.random.default_rng(5)
    shapes = {"a": (6, 4), "one": (1,), "scalar": (), "column": (5, 1), "row": (1, 7)}
    updates = [{n: rng.standard_normal(s) * 10.0 ** rng.integers(-4, 4) for n, s in shapes.items()} for _ in range(9)]
    for update in updates:
        update["a"].reshape(-1)[:3] = [0.0, -0.0, 1e-310]
    weights = list(rng.random(9) * 1000)
    result = Aggregation.parse("mean").combine(updates, weights)
    w = np.asarray(weights, dtype=np.float64)
    for name, shape in shapes.items():
        stack = np.stack([u[name] for u in updates]).astype(np.float64)
        previous = (stack * w.reshape((-1,) + (1,) * len(shape))).sum(axis=0) / w.sum()
        assert result[name].dtype == np.float64 and result[name].tobytes() == previous.tobytes(), name


@pytest.mark.parametrize("text, n_cut", [("median", None), ("trimmed-mean", 1), ("trimmed-mean:0.4", 2),
                                         ("trimmed-mean:0", 0)])
def test_median_and_trimmed_mean_are_coordinate_wise_as_numpy_and_scipy(text, n_cut):
    """Over 6 clients, weights ignored: np.median, scipy.stats.trim_mean (FRACTION 0.2 of 6 trims one each end)."""
    from scipy.stats import trim_mean

    from vktrain.fleet.robust import Aggregation

    aggregation = Aggregation.parse(text)
    strategy, global_arrays = _strategy(6, aggregation=aggregation, max_norm_ratio=None)
    updates = _good_updates(global_arrays, range(6), seed=7)
    result, record, _ = _aggregate(strategy, [_reply(strategy, p, a, 1 + 100 * p) for p, a in updates.items()])
    for name in NAMES:
        stack = np.stack([updates[p][name] for p in range(6)]).astype(np.float64)
        if n_cut is None:
            reference = np.median(stack, axis=0)
        else:
            reference = trim_mean(stack, aggregation.trim_fraction, axis=0)
            assert record["trimmed_per_side"] == n_cut
        np.testing.assert_allclose(result[name], reference.astype(np.float32), rtol=0, atol=1e-7)
    assert record["aggregation"] == str(aggregation)


def test_a_round_with_too_few_accepted_updates_keeps_the_global_adapters():
    from vktrain.fleet.faults import NAN, corrupt

    strategy, global_arrays = _strategy(3, min_clients=2)
    good = _good_updates(global_arrays, (0, 1))
    result, record, _ = _aggregate(strategy, [_reply(strategy, 0, good[0], 1),
                                              _reply(strategy, 1, corrupt(NAN, good[1], global_arrays), 1)])
    assert result is None and record["aggregated"] is False and "fewer than the 2 required" in record["not_aggregated"]
    assert record["failed"] == {"2": "no reply before the timeout"}


@pytest.mark.parametrize("extra, message", [
    (["--aggregation", "mode"], "mean, median or trimmed-mean[:FRACTION]"),
    (["--aggregation", "trimmed-mean:0.5"], "must lie in [0, 0.5)"),
    (["--max-update-norm-ratio", "0.5"], "a number >= 1 (or inf)"),
    (["--min-clients", "0"], "--min-clients must be >= 1"),
    (["--inject-failure", "1:1:melt"], "KIND must be one of raise, kill, nan, shape, norm"),
    (["--inject-failure", "1:1", "--local-steps", "1"], "needs --local-steps >= 2")])
def test_federate_refuses_bad_robustness_flags_before_loading_anything(tmp_path, capsys, extra, message):
    from vktrain.cli import main

    program = tmp_path / "step.pte"
    program.write_bytes(b"not read")
    assert main(["federate", str(program), "--clients", "4", "--rounds", "1", "--local-steps", "2", *extra]) == 2
    assert message in capsys.readouterr().err


def test_federate_drops_poisoned_clients_and_averages_the_others(tmp_path, vk_device):
    """`vktrain federate` on tiny-llama (sequential engine), 5 clients x 1 round x 1 local step; clients 1, 2
    and 3 reply a NaN, a wrong-shape and a 1e6-norm update: all three dropped and reported, and the global
    adapters are bit for bit the float64 num-examples-weighted mean of clients 0 and 4's single steps, each
    taken here with a TrainingRunner on the same shard's first batch."""
    from vktrain.cli import main
    from vktrain.fleet.checkpoint import load_federation_checkpoint
    from vktrain.fleet.client import optimizer_state_names, trained_names
    from vktrain.fleet.command import prepare_shards
    from vktrain.fleet.partition import PartitionScheme
    from vktrain.runtime.program.runner import TrainingRunner
    from vktrain.train.data import TokenBatcher, load_data
    from vktrain.train.train_loop import AdamWConfig

    program = tmp_path / "step.pte"
    assert main(["export", "--model", "tiny-llama", "--model-arg", "dim=32", "--model-arg", "n_layers=1",
                 "--model-arg", "hidden=64", "--model-arg", "n_heads=2", "--model-arg", "n_kv_heads=1",
                 "--lora-rank", "2", "--batch", "2", "--seq", "16", "--out", str(program)]) == 0
    rng = np.random.default_rng(0)
    np.save(tmp_path / "train.npy", np.cumsum(np.where(rng.random(1500) < 0.9, 1, rng.integers(0, 256, 1500))) % 256)
    lr = 1e-2
    stderr = io.StringIO()
    with redirect_stderr(stderr):
        assert main(["federate", str(program), "--clients", "5", "--rounds", "1", "--local-steps", "1", "--lr", str(lr),
                     "--data", str(tmp_path / "train.npy"), "--engine", "sequential", "--checkpoint",
                     str(tmp_path / "fed"), "--json", str(tmp_path / "rounds.json"), "--inject-failure", "1:1:nan",
                     "--inject-failure", "2:1:shape", "--inject-failure", "3:1:norm"]) == 0
    record = json.loads((tmp_path / "rounds.json").read_text())["rounds"][1]
    assert record["dropped"].keys() == {"1", "2", "3"} and record["client_train_loss"].keys() == {"0", "4"}
    assert "non-finite" in record["dropped"]["1"] and "the global tensor" in record["dropped"]["2"]
    assert "update norm 1e+06 exceeds" in record["dropped"]["3"]
    assert "3 update(s) dropped (client 1, client 2, client 3)" in stderr.getvalue()
    assert "dropped the update of client 3 (node 1003)" in stderr.getvalue()
    got = load_federation_checkpoint(tmp_path / "fed").arrays

    updates, weights = [], []
    with TrainingRunner.from_pte(program, vk_device, planner=plan_schedule) as runner:
        shards, _ = prepare_shards(runner, tmp_path / "train.npy", None, 5, PartitionScheme.parse("iid"), 0,
                                   tmp_path / "shards")
        names = trained_names(runner.state_names)
        initial = {n: runner.read_state(n) for n in names + optimizer_state_names(runner.state_names)}
        for p in (0, 4):
            for name, array in initial.items():
                runner.write_state(name, array)
            data = load_data(shards[p], runner.vocab_size)
            runner.step(*TokenBatcher(data.tokens, 2, 16, seed=0).batch(0), AdamWConfig().hparams(lr))
            updates.append({n: runner.read_state(n) for n in names})
            weights.append(data.trained_tokens)
    assert sorted(got) == sorted(names)
    for name in names:
        reference = sum(np.float64(w) * u[name].astype(np.float64) for w, u in zip(weights, updates)) / sum(weights)
        np.testing.assert_array_equal(got[name], reference.astype(np.float32), err_msg=name)
    assert any(not np.array_equal(got[n], initial[n]) for n in names)


def test_a_checkpoint_from_before_screening_resumes_only_with_its_settings(tmp_path):
    """A checkpoint whose run record predates --aggregation/--max-update-norm-ratio/--min-clients ran with
    the mean, no norm bound and one client: it resumes with those, and is refused under the new default."""
    from vktrain.fleet.checkpoint import FederationCheckpoint, check_resumable
    from vktrain.fleet.server import FederationSettings
    from vktrain.train.checkpoint import CheckpointError

    settings = FederationSettings(program="p.pte", strategy="fedavg", n_clients=2, rounds=1, local_steps=1)
    old_run = {k: v for k, v in settings.run_config().items()
               if k not in ("aggregation", "max_update_norm_ratio", "min_clients")}
    old = FederationCheckpoint(1, {}, "sha", old_run, [])
    check_resumable(old, "sha", FederationSettings(**{**settings.__dict__, "max_norm_ratio": None}).run_config(), "ck")
    with pytest.raises(CheckpointError, match=r"max_update_norm_ratio: None -> 10.0"):
        check_resumable(old, "sha", settings.run_config(), "ck")
