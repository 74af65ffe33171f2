"""vktrain.fleet without a device or Ray: client shards, sampling, the strategies' aggregation against a
numpy reference, the server checkpoint."""
from __future__ import annotations

import io
import json

import numpy as np
import pytest

from vktrain.errors import VktrainError
from vktrain.fleet.partition import PartitionError, PartitionScheme, assign_documents, write_shards


def test_iid_split_deals_every_document_once_in_equal_shares():
    parts = assign_documents(103, 4, PartitionScheme.parse("iid"), seed=7)
    assert sorted(np.concatenate(parts).tolist()) == list(range(103))
    assert sorted(len(p) for p in parts) == [25, 26, 26, 26]
    assert all(np.all(np.diff(p) > 0) for p in parts)  # each shard keeps file order
    again = assign_documents(103, 4, PartitionScheme.parse("iid"), seed=7)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    other = assign_documents(103, 4, PartitionScheme.parse("iid"), seed=8)
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other))


def test_dirichlet_split_skews_shard_sizes_and_keeps_the_minimum():
    scheme = PartitionScheme.parse("dirichlet:0.1")
    assert (scheme.kind, scheme.alpha, str(scheme)) == ("dirichlet", 0.1, "dirichlet:0.1")
    parts = assign_documents(1000, 8, scheme, seed=0, min_documents=5)
    sizes = [len(p) for p in parts]
    assert sum(sizes) == 1000 and sorted(np.concatenate(parts).tolist()) == list(range(1000))
    assert min(sizes) >= 5
    # alpha 0.1 concentrates the data: the largest shard holds far more than the 125 of an even split
    assert max(sizes) > 300
    near_iid = [len(p) for p in assign_documents(1000, 8, PartitionScheme.parse("dirichlet:1000"), seed=0)]
    assert max(near_iid) - min(near_iid) < 60


@pytest.mark.parametrize("text", ["dirichlet", "dirichlet:0", "dirichlet:-1", "dirichlet:nan", "random", "iid:2"])
def test_bad_partition_is_refused_naming_the_flag(text):
    with pytest.raises(PartitionError, match="--partition") as info:
        PartitionScheme.parse(text)
    assert isinstance(info.value, VktrainError)


def test_too_little_data_for_the_clients_is_refused():
    with pytest.raises(PartitionError, match="3 document"):
        assign_documents(3, 2, PartitionScheme.parse("iid"), seed=0, min_documents=2)


def test_shards_keep_jsonl_rows_whole_and_cut_token_streams_into_units(tmp_path):
    rows = [json.dumps({"text": f"document {i}"}) for i in range(10)]
    source = tmp_path / "docs.jsonl"
    source.write_text("\n".join(rows) + "\n\n")
    shards = write_shards(source, tmp_path / "out", 3, PartitionScheme.parse("iid"), 0, vocab_size=256,
                          unit_tokens=8)
    written = [shard.read_text().splitlines() for shard in shards]
    assert sorted(sum(written, [])) == sorted(rows)
    tokens = np.arange(100) % 50
    np.save(tmp_path / "tokens.npy", tokens)
    shards = write_shards(tmp_path / "tokens.npy", tmp_path / "out", 2, PartitionScheme.parse("iid"), 0,
                          vocab_size=50, unit_tokens=8)
    pieces = [np.load(shard) for shard in shards]
    units = sorted(tuple(piece[i:i + 8]) for piece in pieces for i in range(0, piece.size, 8))
    assert units == sorted(tuple(tokens[i:i + 8]) for i in range(0, 96, 8))  # 12 whole units, the tail dropped


def test_max_overlap_counts_clients_running_at_once():
    from vktrain.fleet.strategy import max_overlap

    assert max_overlap([]) == 0
    assert max_overlap([(0, 1), (1, 2), (2, 3)]) == 1  # one after another
    assert max_overlap([(0, 10), (1, 2), (1.5, 3), (2.5, 4)]) == 3


def test_sampling_is_seeded_by_round_and_takes_fedavgs_count():
    from vktrain.fleet.strategy import sample_partitions

    picked = sample_partitions(100, 0.1, seed=3, server_round=5, stream=0)
    assert len(picked) == 10 == len(set(picked)) and picked == sorted(picked)
    assert picked == sample_partitions(100, 0.1, seed=3, server_round=5, stream=0)
    assert picked != sample_partitions(100, 0.1, seed=3, server_round=6, stream=0)
    assert sample_partitions(4, 0.01, 0, 1, 0).__len__() == 1  # at least one client
    assert sample_partitions(4, 1.0, 0, 1, 0) == [0, 1, 2, 3]


# ---------------------------------------------------------------------------------------------- aggregation

def _replies(strategy, arrays_by_partition, examples, failed=()):
    """Reply messages as Flower's simulation would deliver them (node ids mapped to partitions)."""
    from flwr.app import ConfigRecord, Error, Message, MessageType, MetricRecord, RecordDict

    from vktrain.fleet.arrays import to_array_record
    from vktrain.fleet.client import ARRAYS, CLIENT, METRICS, NUM_EXAMPLES, PARTITION_ID

    replies = []
    for partition in list(arrays_by_partition) + list(failed):
        node = strategy.node_of_partition[partition]
        instruction = Message(RecordDict(), node, MessageType.TRAIN)
        instruction.metadata.__dict__["_message_id"] = f"m{partition}"
        if partition in failed:
            replies.append(Message(Error(code=2, reason="Traceback ...\nRuntimeError: device lost"),
                                   reply_to=instruction))
            continue
        content = RecordDict({ARRAYS: to_array_record(arrays_by_partition[partition]),
                              METRICS: MetricRecord({NUM_EXAMPLES: examples[partition], "train-loss": 1.0 + partition}),
                              CLIENT: ConfigRecord({PARTITION_ID: partition, "pid": 100 + partition % 2,
                                                    "device": f"[{partition % 2}] GPU {partition % 2} (discrete)",
                                                    "started": 10.0 + partition, "finished": 12.5 + partition})})
        replies.append(Message(content, reply_to=instruction))
    return replies


@pytest.mark.parametrize("strategy_name", ["fedavg", "ffa"])
def test_aggregation_is_the_example_weighted_mean_of_what_the_clients_train(strategy_name):
    """FedAvg over lora_A and lora_B (FedIT), or over lora_B alone (FFA-LoRA: its program trains no A, so
    no A is sent or averaged), against a float64 numpy reference; failed clients are left out and
    recorded; the result does not depend on the order the replies arrive in."""
    from flwr.app import ConfigRecord

    from vktrain.fleet.arrays import from_array_record, to_array_record
    from vktrain.fleet.sequential import SequentialGrid
    from vktrain.fleet.strategy import FleetFedAvg

    rng = np.random.default_rng(0)
    which = ("lora_A", "lora_B") if strategy_name == "fedavg" else ("lora_B",)
    names = [f"model.layers.{i}.{w}" for i in range(3) for w in which]
    arrays = {p: {n: rng.standard_normal((8, 4)).astype(np.float32) for n in names} for p in range(5)}
    examples = {0: 100, 1: 7, 2: 350, 3: 1, 4: 42}

    def aggregate(order):
        SequentialGrid(client_app=None, n_clients=0)  # stamps this process's messages as the server's, as Flower does
        strategy = FleetFedAvg(n_clients=6, fraction_train=1.0, fraction_evaluate=0.0, seed=0)
        strategy.node_of_partition = {p: 1000 + 17 * p for p in range(6)}
        strategy.configure_train(1, to_array_record(arrays[0]), ConfigRecord(), grid=None)
        replies = _replies(strategy, {p: arrays[p] for p in order}, examples, failed=(5,))
        result, metrics = strategy.aggregate_train(1, replies)
        return from_array_record(result), metrics, strategy.rounds[1]

    result, metrics, record = aggregate([3, 0, 4, 1, 2])
    total = sum(examples.values())
    for name in names:
        reference = sum(np.float64(examples[p]) * arrays[p][name] for p in range(5)) / total
        np.testing.assert_allclose(result[name], reference, rtol=2e-6, atol=1e-7)
    assert sorted(result) == sorted(names)
    assert metrics["train-loss"] == pytest.approx(sum(examples[p] * (1.0 + p) for p in range(5)) / total)
    assert list(record["failed"]) == ["5"] and record["failed"]["5"] == "RuntimeError: device lost"
    assert record["client_train_loss"] == {str(p): 1.0 + p for p in range(5)}
    # clients p ran over [10 + p, 12.5 + p]: at most 3 at once (e.g. 2, 3 and 4 over [14, 14.5]), in 2 processes
    assert record["max_concurrent_clients"] == 3 and record["client_processes"] == 2
    assert record["client_seconds"] == {str(p): 2.5 for p in range(5)}
    assert record["client_devices"] == {str(p): f"[{p % 2}] GPU {p % 2} (discrete)" for p in range(5)}
    serialized = io.BytesIO()  # an Array travels as a .npy file: header and data
    np.save(serialized, arrays[0][names[0]], allow_pickle=False)
    assert record["bytes_up"] == 5 * len(names) * len(serialized.getvalue())
    assert record["bytes_down"] == 6 * len(names) * len(serialized.getvalue())
    shuffled, _, _ = aggregate([2, 4, 1, 3, 0])
    assert all(np.array_equal(result[n], shuffled[n]) for n in names)  # partition order, not arrival order


def test_checkpoint_round_trips_and_refuses_corruption_and_other_settings(tmp_path):
    from vktrain.fleet.checkpoint import (FederationCheckpoint, check_resumable, checkpoint_path,
                                          load_federation_checkpoint, save_federation_checkpoint)
    from vktrain.train.checkpoint import CheckpointError

    arrays = {"model.a.lora_B": np.arange(12, dtype=np.float32).reshape(3, 4)}
    records = [{"round": 0, "global_eval_loss": 2.0}, {"round": 1, "global_eval_loss": 1.5}]
    run = {"strategy": "ffa", "clients": 4, "lr": 0.01}
    save_federation_checkpoint(tmp_path, FederationCheckpoint(1, arrays, "abc", run, records))
    loaded = load_federation_checkpoint(tmp_path)
    assert loaded.round == 1 and loaded.records == records and loaded.run == run
    assert np.array_equal(loaded.arrays["model.a.lora_B"], arrays["model.a.lora_B"])
    check_resumable(loaded, "abc", run, "ck")
    with pytest.raises(CheckpointError, match="another program"):
        check_resumable(loaded, "abd", run, "ck")
    with pytest.raises(CheckpointError, match=r"lr: 0.01 -> 0.02"):
        check_resumable(loaded, "abc", {**run, "lr": 0.02}, "ck")
    data = bytearray(checkpoint_path(tmp_path).read_bytes())
    data[-1] ^= 1  # flip a bit of the last tensor's data
    checkpoint_path(tmp_path).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum"):
        load_federation_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="no federation checkpoint"):
        load_federation_checkpoint(tmp_path / "elsewhere")


def test_clients_exchange_the_lora_tensors_not_their_adamw_moments():
    from vktrain.fleet.client import optimizer_state_names, trained_names

    state = ["model.a.lora_A", "model.a.lora_B", "optimizer.step", "optimizer.exp_avg.a.lora_A",
             "optimizer.exp_avg.a.lora_B", "optimizer.exp_avg_sq.a.lora_A", "optimizer.exp_avg_sq.a.lora_B"]
    assert trained_names(state) == ["model.a.lora_A", "model.a.lora_B"]
    assert sorted(optimizer_state_names(state)) == sorted(state[2:])
    assert trained_names(["model.a.lora_B", "optimizer.exp_avg.a.lora_B"]) == ["model.a.lora_B"]  # FFA-LoRA


def test_adapters_travel_as_flowers_own_arrays_and_are_read_without_a_copy():
    """to_array makes Flower's Array(ndarray) field for field (the .npy bytes np.save writes) for every dtype,
    shape and layout; to_numpy gives array.numpy()'s values, as a read-only view of the message's bytes where
    the header is np.save's, and through np.load where it is not (Fortran order, big-endian)."""
    from flwr.app import Array

    from vktrain.fleet.arrays import to_array, to_numpy

    rng = np.random.default_rng(0)
    matrix = rng.standard_normal((8, 12)).astype(np.float32)
    cases = [matrix, matrix[:, ::3], matrix.astype(np.float16), np.arange(5, dtype=np.int64), np.full((), 2.5, np.float32),
             np.zeros((0, 3), np.float32), matrix.astype(">f4"), np.asfortranarray(matrix)]
    for array in cases:
        sent = to_array(array)
        assert sent == Array(np.ascontiguousarray(array)), (array.dtype, array.shape)
        flowers = Array(array)  # a peer's: Fortran order stays in the header
        for message in (sent, flowers):
            received = to_numpy(message)
            reference = message.numpy()
            assert received.dtype == reference.dtype and received.shape == reference.shape
            assert received.tobytes() == reference.tobytes()
    view = to_numpy(to_array(matrix))
    assert not view.flags.writeable and np.shares_memory(view, np.frombuffer(view.base, np.uint8))
    sent = to_array(matrix)
    inflated = Array.inflate(sent.deflate(), sent.children)  # as a Ray worker or a SuperNode receives it
    assert not to_numpy(inflated).flags.writeable and to_numpy(inflated).tobytes() == matrix.tobytes()
    assert to_numpy(Array(np.asfortranarray(matrix))).flags.writeable  # np.load's copy
    truncated = to_array(matrix)
    truncated.data = truncated.data[:-4]
    with pytest.raises(ValueError):
        to_numpy(truncated)  # np.load's error, as before
    for field, claim in (("shape", (-1, 96)), ("shape", ("x",)), ("dtype", "float64"), ("dtype", "no-such-type")):
        lying = to_array(matrix)
        setattr(lying, field, claim)  # a peer's metadata np.load never reads: the header decides, as before
        assert to_numpy(lying).tobytes() == matrix.tobytes(), (field, claim)
    pairs = np.zeros(3, dtype=[("a", "<f4"), ("b", "<i4")])
    assert to_array(pairs) == Array(pairs) and to_numpy(Array(pairs)).tobytes() == pairs.tobytes()


def test_freeze_lora_a_is_refused_for_programs_without_a_training_step(tmp_path, capsys):
    from vktrain.cli import main

    assert main(["export", "--model", "tiny-llama", "--program", "forward", "--freeze-lora-a",
                 "--out", str(tmp_path / "x.pte")]) == 2
    assert "--freeze-lora-a freezes lora_A in a training step; --program is forward" in capsys.readouterr().err
    assert not (tmp_path / "x.pte").exists()


def test_federate_refuses_bad_arguments_before_loading_anything(tmp_path, capsys):
    from vktrain.cli import main

    program = tmp_path / "step.pte"
    program.write_bytes(b"not read")
    for extra, message in ((["--fraction", "0"], "--fraction must be > 0"),
                           (["--fraction-evaluate", "0.5"], "--fraction-evaluate needs --eval-data"),
                           (["--resume"], "--resume needs --checkpoint DIR"),
                           (["--inject-failure", "9:1"], "there are clients 0..3"),
                           (["--inject-failure", "a:b"], "CLIENT:ROUND"),
                           (["--partition", "dirichlet:-2"], "--partition")):
        assert main(["federate", str(program), "--clients", "4", "--rounds", "1", "--local-steps", "1",
                     *extra]) == 2, extra
        assert message in capsys.readouterr().err


def test_the_fleet_runs_without_torch_or_executorch():
    from _helpers import assert_import_loads_none

    assert_import_loads_none(["vktrain.fleet.client", "vktrain.fleet.server", "vktrain.fleet.sequential",
                              "vktrain.fleet.command", "vktrain.fleet.deploy", "vktrain.fleet.deployment"],
                             ["torch", "executorch"], timeout=120)
