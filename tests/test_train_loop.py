"""The on-device training loop: data, LR schedule, atomic files, checkpoints/resume, NaN stop, JSON log,
PEFT adapters, the `vktrain train` CLI glue (with a numpy fake runner), and one end-to-end run of an
exported .pte on Vulkan."""
from __future__ import annotations

import argparse
import errno
import json
import math
import os
import threading
import re
import struct

import numpy as np
import pytest
import safetensors.numpy

from vktrain import cli
from vktrain.train import adapters as adapters_mod
from vktrain.train import checkpoint as ckpt
from vktrain.train.data import (
    DataError,
    TokenBatcher,
    check_vocab,
    default_dataset_path,
    epoch_order,
    load_tokens,
)
from vktrain.train.lr_schedule import LRSchedule
from vktrain.train.command import add_train_arguments, run_train
from vktrain.train.train_loop import (
    AdamWConfig,
    NonFiniteLossError,
    TrainState,
    describe_program,
    run_config,
    train,
)

from _helpers import assert_import_loads_none
from vktrain.backend.kernel_planning import plan_schedule

# ------------------------------------------------------------------------------------------------
# A numpy fake of TrainingRunner: a real (tiny) LoRA model with real AdamW, so the state that a
# checkpoint must carry (adapters, both moments, the step counter) changes every step and every loss
# depends on all of it and on the batch.
# ------------------------------------------------------------------------------------------------

FAKE_VOCAB, FAKE_DIM, FAKE_RANK = 32, 12, 3


class FakeRunner:
    """logits = E[tokens] @ A.T @ B.T (E a fixed embedding, A [r, D], B [V, r] trained by AdamW)."""

    def __init__(self, batch_shape=(2, 6), *, nan_at_call=None, crash_at_call=None, state_seed=0,
                 overflow_above=None, poison_first_token=None):
        # The frozen embedding is the "program" (always the same); state_seed varies the initial state.
        self.batch_shape = batch_shape
        self.vocab_size = FAKE_VOCAB
        self.embedding = np.random.default_rng(1234).standard_normal((FAKE_VOCAB, FAKE_DIM)).astype(np.float32)
        rng = np.random.default_rng(state_seed)
        self.state = {
            "optimizer.step": np.zeros((), np.float32),
            "model.proj.lora_A": (0.3 * rng.standard_normal((FAKE_RANK, FAKE_DIM))).astype(np.float32),
            "model.proj.lora_B": np.zeros((FAKE_VOCAB, FAKE_RANK), np.float32),
        }
        for name in ("model.proj.lora_A", "model.proj.lora_B"):
            suffix = name.removeprefix("model.")
            self.state["optimizer.exp_avg." + suffix] = np.zeros_like(self.state[name])
            self.state["optimizer.exp_avg_sq." + suffix] = np.zeros_like(self.state[name])
        self.calls = []  # (tokens, labels, hparams) of every step
        # Divergence, as a real program diverges: the loss comes from the state before the step; when it is
        # not finite, the same program's update writes NaN into the state. nan_at_call: at that call;
        # overflow_above: whenever max |lora_B| exceeds it (the logits overflow); poison_first_token: whenever
        # the batch starts with that token (a bad batch).
        self.nan_at_call, self.crash_at_call = nan_at_call, crash_at_call
        self.overflow_above, self.poison_first_token = overflow_above, poison_first_token
        self.closed = False

    # StepRunner -----------------------------------------------------------------------------
    @property
    def state_names(self):
        return list(self.state)

    def read_state(self, name):
        return self.state[name].copy()

    def write_state(self, name, array):
        array = np.asarray(array)
        assert array.shape == self.state[name].shape and array.dtype == self.state[name].dtype
        self.state[name] = array.copy()

    def step(self, tokens, labels, hparams):
        assert tokens.shape == labels.shape == self.batch_shape and tokens.dtype == labels.dtype == np.int64
        assert hparams.dtype == np.float32 and hparams.shape == (5,)
        self.calls.append((tokens.copy(), labels.copy(), hparams.copy()))
        if self.crash_at_call == len(self.calls):
            raise self.crash_exception(len(self.calls))
        lr, beta1, beta2, eps, weight_decay = (float(v) for v in hparams)
        a, b = self.state["model.proj.lora_A"], self.state["model.proj.lora_B"]
        if (self.nan_at_call == len(self.calls)
                or (self.overflow_above is not None and np.abs(b).max() > self.overflow_above)
                or (self.poison_first_token is not None and tokens[0, 0] == self.poison_first_token)):
            self.state["optimizer.step"] = self.state["optimizer.step"] + np.float32(1)
            for name in self.state:
                if name != "optimizer.step":
                    self.state[name] = np.full_like(self.state[name], np.nan)
            return float("inf")
        x = self.embedding[tokens.reshape(-1)]  # [R, D]
        h = x @ a.T  # [R, r]
        logits = h @ b.T  # [R, V]
        shifted = logits - logits.max(axis=1, keepdims=True)
        log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        rows = np.arange(labels.size)
        loss = float(-log_probs[rows, labels.reshape(-1)].mean())
        d_logits = np.exp(log_probs)
        d_logits[rows, labels.reshape(-1)] -= 1.0
        d_logits /= labels.size
        grads = {"model.proj.lora_B": (d_logits.T @ h).astype(np.float32),
                 "model.proj.lora_A": ((d_logits @ b).T @ x).astype(np.float32)}
        t = float(self.state["optimizer.step"]) + 1.0
        self.state["optimizer.step"] = np.float32(t).reshape(())
        for name, grad in grads.items():
            suffix = name.removeprefix("model.")
            m = beta1 * self.state["optimizer.exp_avg." + suffix] + (1 - beta1) * grad
            v = beta2 * self.state["optimizer.exp_avg_sq." + suffix] + (1 - beta2) * grad * grad
            param = self.state[name] * (1 - lr * weight_decay)
            param = param - lr * (m / (1 - beta1 ** t)) / (np.sqrt(v / (1 - beta2 ** t)) + eps)
            self.state[name] = param.astype(np.float32)
            self.state["optimizer.exp_avg." + suffix] = m.astype(np.float32)
            self.state["optimizer.exp_avg_sq." + suffix] = v.astype(np.float32)
        return loss

    # TrainingRunner's surface for run_train ----------------------------------------------------
    def gemm_report(self):
        return "GEMM precision fp32: numpy"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.closed = True


class _SimulatedCrash(Exception):
    pass


FakeRunner.crash_exception = _SimulatedCrash  # what crash_at_call raises


def _stream(n=2000, vocab=FAKE_VOCAB, seed=1):
    """A learnable token stream: mostly next = (3 * current + 1) % vocab, sometimes a random token."""
    rng = np.random.default_rng(seed)
    stream = np.empty(n, np.int64)
    stream[0] = 0
    noise = rng.integers(0, vocab, n)
    for i in range(1, n):
        stream[i] = noise[i] if noise[i] % 8 == 0 else (3 * stream[i - 1] + 1) % vocab
    return stream


# ------------------------------------------------------------------------------------------------
# Data
# ------------------------------------------------------------------------------------------------

def test_text_file_is_byte_level_utf8(tmp_path):
    path = tmp_path / "corpus.txt"
    text = "Hé!\n"
    path.write_bytes(text.encode("utf-8"))
    tokens = load_tokens(path)
    assert tokens.dtype == np.uint8  # stored compactly; batches are int64
    assert tokens.tolist() == [0x48, 0xC3, 0xA9, 0x21, 0x0A]  # é is two UTF-8 bytes, each a token
    tokens_b, labels_b = TokenBatcher(tokens, 1, 4, shuffle=False).batch(0)
    assert tokens_b.dtype == labels_b.dtype == np.int64
    assert tokens_b.tolist() == [[0x48, 0xC3, 0xA9, 0x21]] and labels_b.tolist() == [[0xC3, 0xA9, 0x21, 0x0A]]


def test_npy_and_token_text_files(tmp_path):
    ids = np.array([5, 0, 31, 7, 7], dtype=np.uint16)
    np.save(tmp_path / "ids.npy", ids)
    assert load_tokens(tmp_path / "ids.npy").tolist() == ids.tolist()
    (tmp_path / "ids.tokens.txt").write_text("5 0\n31\t7  7\n")
    assert load_tokens(tmp_path / "ids.tokens.txt").tolist() == ids.tolist()
    # A plain .txt is text, not ids: "5" is byte 0x35.
    (tmp_path / "ids.txt").write_text("5 0")
    assert load_tokens(tmp_path / "ids.txt").tolist() == [0x35, 0x20, 0x30]


@pytest.mark.parametrize("make, message", [
    (lambda p: np.save(p / "x.npy", np.ones(8, np.float32)), "integer array"),
    (lambda p: np.save(p / "x.npy", np.ones((2, 4), np.int64)), "1-D array"),
    (lambda p: (p / "x.tokens.txt").write_text("1 2 three 4"), "word 2 is 'three'"),
])
def test_bad_token_files_are_refused(tmp_path, make, message):
    make(tmp_path)
    (path,) = [p for p in tmp_path.iterdir()]
    with pytest.raises(DataError, match=message):
        load_tokens(path)
    with pytest.raises(DataError, match="does not exist"):
        load_tokens(tmp_path / "missing.bin")


def test_vocab_check_names_the_first_bad_token():
    tokens = np.array([1, 2, 40, 3, 99], np.int64)
    with pytest.raises(DataError, match=r"token id 40 at position 2 .*\[0, 32\).*2 such token"):
        check_vocab(tokens, 32, "f.npy")
    check_vocab(tokens, 100)
    with pytest.raises(DataError, match="token id -1 at position 0"):
        check_vocab(np.array([-1, 0]), 8)


def test_batches_are_next_token_windows_of_the_stream():
    stream = _stream(500)
    batcher = TokenBatcher(stream, batch_size=3, seq_len=7, seed=4)
    assert batcher.n_windows == (500 - 1) // 7
    for position in (0, 1, 5, 40):
        tokens, labels = batcher.batch(position)
        assert tokens.shape == labels.shape == (3, 7) and tokens.dtype == labels.dtype == np.int64
        for row, window in enumerate(batcher.window_indices(position)):
            start = window * 7
            np.testing.assert_array_equal(tokens[row], stream[start:start + 7])
            np.testing.assert_array_equal(labels[row], stream[start + 1:start + 8])
        assert (labels >= 0).all()  # no ignored labels: every window carries S + 1 tokens


def test_each_epoch_visits_every_window_once_in_a_seeded_order():
    batcher = TokenBatcher(_stream(3 * 5 * 8 + 1), batch_size=3, seq_len=5, seed=11)
    n = batcher.n_windows  # 24 windows = 8 batches per epoch
    assert n == 24
    visited = np.concatenate([batcher.window_indices(p) for p in range(16)])
    first, second = visited[:n], visited[n:]
    assert sorted(first) == list(range(n)) and sorted(second) == list(range(n))
    assert first.tolist() != second.tolist()  # a new order each epoch
    assert first.tolist() != list(range(n))  # shuffled
    other_seed = TokenBatcher(batcher.tokens, 3, 5, seed=12)
    assert other_seed.window_indices(0).tolist() != batcher.window_indices(0).tolist()
    in_order = TokenBatcher(batcher.tokens, 3, 5, shuffle=False)
    assert np.concatenate([in_order.window_indices(p) for p in range(9)]).tolist() == list(range(24)) + [0, 1, 2]
    np.testing.assert_array_equal(epoch_order(24, 11, 0), first)


def test_fingerprint_depends_on_tokens_and_batching_not_on_storage_dtype():
    tokens = _stream(300)
    reference = TokenBatcher(tokens, 2, 5).fingerprint
    assert TokenBatcher(tokens.astype(np.uint8), 2, 5).fingerprint == reference
    changed = tokens.copy()
    changed[-1] += 1
    assert TokenBatcher(changed, 2, 5).fingerprint != reference
    assert TokenBatcher(tokens, 2, 6).fingerprint != reference
    assert TokenBatcher(tokens, 2, 5, shuffle=False).fingerprint != reference


def test_the_runtime_side_never_imports_torch():
    assert_import_loads_none(
        ["vktrain.train.train_loop", "vktrain.train.command", "vktrain.train.data", "vktrain.train.checkpoint",
         "vktrain.train.adapters", "vktrain.train.lr_schedule", "vktrain.data", "vktrain.cli"],
        forbidden=["torch", "executorch"])


def test_batch_is_a_pure_function_of_the_position():
    tokens = _stream(1000)
    reference = TokenBatcher(tokens, 2, 9, seed=3)
    sequential = [b for _, b in zip(range(70), reference.batches())]  # crosses several epochs
    resumed = TokenBatcher(tokens, 2, 9, seed=3)
    for position in (69, 3, 55, 0, 31):  # any order, fresh object: same batches
        np.testing.assert_array_equal(resumed.batch(position)[0], sequential[position][0])
        np.testing.assert_array_equal(resumed.batch(position)[1], sequential[position][1])
    continued = resumed.batches(start=40)
    for position in range(40, 45):
        np.testing.assert_array_equal(next(continued)[0], sequential[position][0])


def test_too_short_data_is_refused_with_the_needed_length():
    TokenBatcher(_stream(4 * 10 + 1), batch_size=4, seq_len=10)  # exactly enough
    with pytest.raises(DataError, match=r"40 tokens make 3 window\(s\).*at least 41 tokens"):
        TokenBatcher(_stream(40), batch_size=4, seq_len=10, source="tiny.npy")
    with pytest.raises(DataError, match="too short"):
        TokenBatcher(np.zeros(0, np.int64), 1, 1)


def test_default_corpus_is_shipped_and_reproducible():
    from vktrain.data.generate_corpus import generate

    path = default_dataset_path()
    data = path.read_bytes()
    assert data == generate().encode("ascii")  # the shipped file is the generator's output
    assert 200_000 < len(data) < 1_000_000
    tokens = load_tokens(path)
    check_vocab(tokens, 128)  # ASCII
    assert len(np.unique(tokens)) > 40  # real text, not a degenerate stream


# ------------------------------------------------------------------------------------------------
# LR schedule
# ------------------------------------------------------------------------------------------------

def _reference_lr(kind, base, total, warmup, floor_ratio, t):
    """The documented formula, written out independently in float64."""
    if warmup and t <= warmup:
        return base * t / warmup
    if kind == "constant":
        return base
    progress = min(1.0, (t - warmup) / (total + 1 - warmup))  # the floor comes after the last step
    floor = base * floor_ratio
    return floor + (base - floor) * (1 + math.cos(math.pi * progress)) / 2


@pytest.mark.parametrize("kind, total, warmup, ratio", [
    ("cosine", 100, 10, 0.0), ("cosine", 37, 0, 0.1), ("cosine", 5, 4, 0.5), ("constant", 50, 7, 0.0),
    ("constant", 10, 0, 0.0)])
def test_schedule_matches_the_float64_formula(kind, total, warmup, ratio):
    schedule = LRSchedule(kind, 3e-3, total, warmup, ratio)
    for t in range(1, total + 6):  # also past the end (held at the floor)
        assert schedule.lr(t) == pytest.approx(_reference_lr(kind, 3e-3, total, warmup, ratio, t), rel=1e-12, abs=1e-18)
    if warmup:
        assert schedule.lr(warmup) == pytest.approx(3e-3)
        assert all(schedule.lr(t) < schedule.lr(t + 1) for t in range(1, warmup))
    if kind == "cosine":
        assert schedule.lr(total) > 3e-3 * ratio  # the last step still trains
        assert schedule.lr(total + 1) == pytest.approx(3e-3 * ratio, abs=1e-15)
        assert all(schedule.lr(t) >= schedule.lr(t + 1) for t in range(warmup + 1, total))


@pytest.mark.parametrize("args, message", [
    (("linear", 1e-3, 10), "one of"), (("cosine", 0.0, 10), "positive"), (("cosine", 1e-3, 0), "steps"),
    (("cosine", 1e-3, 10, 10), "shorter than the run"), (("cosine", 1e-3, 10, -1), "warmup"),
    (("cosine", 1e-3, 10, 0, 1.5), r"\[0, 1\]")])
def test_schedule_refuses_bad_settings(args, message):
    with pytest.raises(ValueError, match=message):
        LRSchedule(*args)
    with pytest.raises(ValueError, match="numbered from 1"):
        LRSchedule("constant", 1e-3, 10).lr(0)


# ------------------------------------------------------------------------------------------------
# Atomic writes and checkpoints
# ------------------------------------------------------------------------------------------------

def test_a_failure_mid_write_leaves_the_old_file_intact(tmp_path):
    path = tmp_path / "state.bin"
    ckpt.atomic_write_bytes(path, b"old contents")

    def half_then_fail(file):
        file.write(b"new, but only ha")
        raise OSError("disk full (simulated)")

    with pytest.raises(ckpt.OutputWriteError, match=f"cannot write {path}: disk full \\(simulated\\)"):
        ckpt.atomic_write(path, half_then_fail)
    assert path.read_bytes() == b"old contents"
    assert os.listdir(tmp_path) == ["state.bin"]  # no temporary file left behind


def test_a_failed_rename_leaves_the_old_file_intact(tmp_path, monkeypatch):
    path = tmp_path / "log.json"
    ckpt.atomic_write_json(path, [1])

    def failing_replace(src, dst):
        raise OSError("rename failed (simulated)")

    monkeypatch.setattr(ckpt.os, "replace", failing_replace)
    with pytest.raises(OSError, match="simulated"):
        ckpt.atomic_write_json(path, [1, 2])
    assert json.loads(path.read_text()) == [1]
    assert os.listdir(tmp_path) == ["log.json"]


def test_atomic_files_get_ordinary_permissions(tmp_path):
    path = tmp_path / "f"
    ckpt.atomic_write_bytes(path, b"x")
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask
    with pytest.raises(ValueError, match="NaN|nan|Out of range"):
        ckpt.atomic_write_json(tmp_path / "g.json", [float("nan")])  # NaN is not JSON


def _sample_records(steps, skipped_at=None):
    records = [{"step": t, "loss": 2.5 - 0.1 * t, "lr": 1e-3, "seconds": 0.01} for t in range(1, steps + 1)]
    if skipped_at is not None:
        records[skipped_at - 1]["skipped"] = [skipped_at - 1]
    return records


def _sample_checkpoint(runner, step=3, program="p" * 64):
    """A consistent checkpoint of `step` whose step 2 followed one skipped batch."""
    runner.state["optimizer.step"] = np.float32(step).reshape(())
    return ckpt.Checkpoint(step=step, data_position=step + 1, program_sha256=program, data_sha256="d" * 64,
                           data_seed=9, tensors=ckpt.capture_state(runner), records=_sample_records(step, 2),
                           config={"lr": 1e-3})


def _without_seconds(records):
    """Records as far as they are reproducible (a step's wall time is not)."""
    return [{key: value for key, value in record.items() if key != "seconds"} for record in records]


def test_checkpoint_round_trip_and_restore(tmp_path):
    runner = FakeRunner()
    runner.step(*TokenBatcher(_stream(), 2, 6).batch(0), AdamWConfig().hparams(1e-2))  # non-trivial state
    saved = _sample_checkpoint(runner, step=3)
    path = tmp_path / "run.ckpt"
    ckpt.save_checkpoint(path, saved)
    loaded = ckpt.load_checkpoint(path)
    assert (loaded.step, loaded.data_position, loaded.program_sha256, loaded.data_sha256, loaded.data_seed) == \
           (3, 4, "p" * 64, "d" * 64, 9)
    assert loaded.records == saved.records and loaded.config == saved.config
    assert sorted(loaded.tensors) == sorted(saved.tensors)
    for name, array in saved.tensors.items():
        assert loaded.tensors[name].shape == array.shape and loaded.tensors[name].dtype == array.dtype
        np.testing.assert_array_equal(loaded.tensors[name], array)
    assert loaded.tensors["optimizer.step"].shape == ()

    fresh = FakeRunner(state_seed=5)
    ckpt.restore_state(fresh, loaded, "p" * 64)
    for name in runner.state_names:
        np.testing.assert_array_equal(fresh.read_state(name), runner.read_state(name))


def test_restore_refuses_checkpoints_of_other_programs(tmp_path):
    runner = FakeRunner()
    saved = _sample_checkpoint(runner)
    before = {name: runner.read_state(name) for name in runner.state_names}
    with pytest.raises(ckpt.CheckpointError, match="different program"):
        ckpt.restore_state(runner, saved, "q" * 64)
    wrong_names = ckpt.Checkpoint(**{**saved.__dict__, "tensors": {**saved.tensors, "model.extra.lora_A": np.zeros(2)}})
    with pytest.raises(ckpt.CheckpointError, match=r"unknown \['model.extra.lora_A'\]"):
        ckpt.restore_state(runner, wrong_names, "p" * 64)
    wrong_shape = dict(saved.tensors)
    wrong_shape["model.proj.lora_A"] = np.zeros((FAKE_RANK + 1, FAKE_DIM), np.float32)
    with pytest.raises(ckpt.CheckpointError, match=r"lora_A.*float32\[4, 12\] in the checkpoint.*float32\[3, 12\]"):
        ckpt.restore_state(runner, ckpt.Checkpoint(**{**saved.__dict__, "tensors": wrong_shape}), "p" * 64)
    inconsistent = ckpt.Checkpoint(**{**saved.__dict__, "step": 7, "data_position": 8,
                                      "records": _sample_records(7, 2)})
    with pytest.raises(ckpt.CheckpointError, match="step counter is 3 but the checkpoint records step 7"):
        ckpt.restore_state(runner, inconsistent, "p" * 64)
    for name, array in before.items():  # nothing was written by the refused restores
        np.testing.assert_array_equal(runner.read_state(name), array)


def test_unreadable_checkpoints_are_refused(tmp_path):
    good = tmp_path / "good.ckpt"
    ckpt.save_checkpoint(good, _sample_checkpoint(FakeRunner()))
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(good.read_bytes()[:100])
    with pytest.raises(ckpt.CheckpointError, match="not a readable safetensors"):
        ckpt.load_checkpoint(truncated)
    foreign = tmp_path / "foreign.safetensors"
    foreign.write_bytes(safetensors.numpy.save({"w": np.zeros(3, np.float32)}, metadata={"format": "pt"}))
    with pytest.raises(ckpt.CheckpointError, match="not a vktrain checkpoint"):
        ckpt.load_checkpoint(foreign)
    with pytest.raises(ckpt.CheckpointError, match="does not exist"):
        ckpt.load_checkpoint(tmp_path / "nope.ckpt")


def test_a_corrupt_or_inconsistent_checkpoint_is_refused(tmp_path):
    path = tmp_path / "run.ckpt"
    runner = FakeRunner()
    saved = _sample_checkpoint(runner)
    ckpt.save_checkpoint(path, saved)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x01  # the last bit of the last tensor's data
    path.write_bytes(bytes(raw))
    with pytest.raises(ckpt.CheckpointError, match=r"run.ckpt: tensor '.*' does not match its checksum"):
        ckpt.load_checkpoint(path)
    fields = saved.__dict__
    with pytest.raises(ckpt.CheckpointError, match=r"data_position 1000000000000 does not match step 3 .*expected 4"):
        ckpt.Checkpoint(**{**fields, "data_position": 10**12})
    with pytest.raises(ckpt.CheckpointError, match="record 1 must be a dict with step 2"):
        ckpt.Checkpoint(**{**fields, "records": [saved.records[0], saved.records[2], saved.records[1]]})
    with pytest.raises(ckpt.CheckpointError, match="'loss' must be a finite number, got nan"):
        ckpt.Checkpoint(**{**fields, "records": [{**saved.records[0], "loss": float("nan")}, *saved.records[1:]]})
    nan_state = {**saved.tensors, "model.proj.lora_B": np.full_like(saved.tensors["model.proj.lora_B"], np.inf)}
    with pytest.raises(ckpt.CheckpointError, match=r"\['model.proj.lora_B'\] hold NaN or infinity"):
        ckpt.Checkpoint(**{**fields, "tensors": nan_state})
    old_version = tmp_path / "v1.ckpt"
    old_version.write_bytes(safetensors.numpy.save(saved.tensors, metadata={"format": "vktrain-checkpoint",
                                                                            "version": "1"}))
    with pytest.raises(ckpt.CheckpointError, match="checkpoint version '1'; this vktrain reads version '2'"):
        ckpt.load_checkpoint(old_version)


def test_the_last_k_checkpoints_are_kept_step_named(tmp_path):
    schedule = LRSchedule("constant", 1e-2, 10)
    runner = FakeRunner()
    path = tmp_path / "run.ckpt"
    train(runner, _batcher(runner), 10, schedule, checkpoint_every=2, checkpoint_path=path, keep_checkpoints=3,
          progress=False)
    assert sorted(os.listdir(tmp_path)) == ["run.ckpt", "run.step6.ckpt", "run.step8.ckpt"]
    assert ckpt.CheckpointSeries(path, 3).kept() == [(str(path), 10), (str(tmp_path / "run.step8.ckpt"), 8),
                                                     (str(tmp_path / "run.step6.ckpt"), 6)]
    for name, step in (("run.ckpt", 10), ("run.step8.ckpt", 8), ("run.step6.ckpt", 6)):
        kept = ckpt.load_checkpoint(tmp_path / name)
        assert (kept.step, kept.data_position) == (step, step)
        _assert_state_equals(kept.tensors, _reference_state_after(step, schedule))


def test_a_checkpoint_path_holding_something_else_is_refused_before_the_first_step(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("my notes, not a checkpoint")
    runner = FakeRunner()
    with pytest.raises(ckpt.CheckpointError, match="notes.txt is not a readable safetensors checkpoint"):
        train(runner, _batcher(runner), 4, LRSchedule("constant", 1e-2, 4), checkpoint_every=2,
              checkpoint_path=path, progress=False)
    assert not runner.calls and path.read_text() == "my notes, not a checkpoint"
    older = tmp_path / "v1.ckpt"  # a checkpoint of an older vktrain is a checkpoint: replaced as usual
    older.write_bytes(safetensors.numpy.save({"w": np.zeros(2, np.float32)},
                                             metadata={"format": "vktrain-checkpoint", "version": "1", "step": "3"}))
    train(runner, _batcher(runner), 4, LRSchedule("constant", 1e-2, 4), checkpoint_path=older, progress=False)
    assert ckpt.load_checkpoint(older).step == 4


def test_temp_files_left_by_a_kill_during_a_write_are_removed(tmp_path):
    path = tmp_path / "run.ckpt"
    stale = [tmp_path / ".run.ckpt.k2j3h4.tmp", tmp_path / ".run.step40.ckpt.x8y7.tmp",
             tmp_path / ".run.step40.ckpt.link.tmp"]
    unrelated = [tmp_path / ".other.ckpt.abc.tmp", tmp_path / "run.ckpt.tmp", tmp_path / ".run.ckpt.notes"]
    for file in stale + unrelated:
        file.write_bytes(b"half a checkpoint")
    runner = FakeRunner()
    train(runner, _batcher(runner), 2, LRSchedule("constant", 1e-2, 2), checkpoint_path=path, progress=False)
    assert sorted(os.listdir(tmp_path)) == sorted(["run.ckpt"] + [file.name for file in unrelated])
    log_stale = tmp_path / ".log.json.abc.tmp"
    log_stale.write_bytes(b"[")
    assert ckpt.remove_stale_temp_files(tmp_path / "log.json") == [log_stale] and not log_stale.exists()


# ------------------------------------------------------------------------------------------------
# The loop
# ------------------------------------------------------------------------------------------------

OPTIMIZER = AdamWConfig(beta1=0.8, beta2=0.99, eps=1e-7, weight_decay=0.01)


def _batcher(runner):
    return TokenBatcher(_stream(), *runner.batch_shape, seed=7)


def test_hparams_are_fed_per_step_and_records_are_exact(tmp_path):
    runner = FakeRunner()
    schedule = LRSchedule("cosine", 5e-2, 12, warmup_steps=3, min_lr_ratio=0.1)
    batches = _batcher(runner)
    log = tmp_path / "log.json"
    state = train(runner, batches, 12, schedule, OPTIMIZER, json_path=log, progress=False)
    assert (state.step, state.data_position) == (12, 12)
    for step, (tokens, labels, hparams) in enumerate(runner.calls, 1):
        expected = np.array([schedule.lr(step), 0.8, 0.99, 1e-7, 0.01], np.float32)
        np.testing.assert_array_equal(hparams, expected)
        np.testing.assert_array_equal(tokens, batches.batch(step - 1)[0])
        np.testing.assert_array_equal(labels, batches.batch(step - 1)[1])
    records = json.loads(log.read_text())
    assert records == state.records
    assert [r["step"] for r in records] == list(range(1, 13))
    assert all(set(r) == {"step", "loss", "lr", "seconds"} and isinstance(r["step"], int)
               and isinstance(r["loss"], float) and 0 < r["seconds"] < 10 for r in records)
    assert [r["lr"] for r in records] == [schedule.lr(t) for t in range(1, 13)]
    # The recorded losses are the runner's: replaying the batches on a fresh fake gives the same numbers.
    replay = FakeRunner()
    expected_losses = [replay.step(t, l, h) for t, l, h in runner.calls]
    assert [r["loss"] for r in records] == expected_losses
    assert records[-1]["loss"] < records[0]["loss"]  # the fake model learns


def _safetensors_parts(path):
    """(header, data bytes) of a safetensors file: its header's JSON is a hash map's (the order of its
    keys varies between writes), the rest must match byte for byte."""
    raw = path.read_bytes()
    size = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + size]), raw[8 + size:]


def test_a_checkpoint_is_written_beside_the_next_steps_and_equals_a_synchronous_write(tmp_path, monkeypatch):
    runner = FakeRunner()
    schedule, batches = LRSchedule("constant", 5e-2, 6), _batcher(runner)
    states, step5 = {}, threading.Event()

    def after_step(step):
        states[step] = {name: runner.read_state(name) for name in runner.state_names}
        if step == 5:
            step5.set()
        return {}

    real_save = ckpt.safetensors.numpy.save

    def save_once_the_loop_is_at_step5(tensors, metadata):  # step 3's write can only end beside steps 4-5
        assert threading.current_thread() is not threading.main_thread()
        assert step5.wait(timeout=20), "the loop waited for the checkpoint write"
        return real_save(tensors, metadata=metadata)

    monkeypatch.setattr(ckpt.safetensors.numpy, "save", save_once_the_loop_is_at_step5)
    path = tmp_path / "run.ckpt"
    state = train(runner, batches, 6, schedule, OPTIMIZER, checkpoint_every=3, checkpoint_path=path,
                  keep_checkpoints=2, program_sha256="ab" * 32, progress=False, after_step=after_step)
    monkeypatch.undo()
    assert state.last_checkpoint == (str(path), 6)
    config = run_config(schedule, OPTIMIZER, batches)
    for step, written in ((3, tmp_path / "run.step3.ckpt"), (6, path)):  # the state at that step, byte for byte
        reference = tmp_path / f"reference{step}.ckpt"
        ckpt.save_checkpoint(reference, ckpt.Checkpoint(step, step, "ab" * 32, batches.fingerprint, batches.seed,
                                                        states[step], state.records[:step], config))
        assert _safetensors_parts(written) == _safetensors_parts(reference)


def test_a_failed_background_write_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    real_write, checkpoints = ckpt.atomic_write_bytes, []

    def disk_full_at_the_second_checkpoint(path, data):  # half of step 6's file is written, then the disk is full
        def half_then_full(file):
            file.write(data[:len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        if path.name == "run.ckpt":
            checkpoints.append(threading.current_thread())
            if len(checkpoints) == 2:
                return ckpt.atomic_write(path, half_then_full)
        return real_write(path, data)

    monkeypatch.setattr(ckpt, "atomic_write_bytes", disk_full_at_the_second_checkpoint)
    runner, path, log = FakeRunner(), tmp_path / "run.ckpt", tmp_path / "log.json"
    with pytest.raises(ckpt.OutputWriteError, match=f"cannot write {re.escape(str(path))}: No space left on device"):
        train(runner, _batcher(runner), 12, LRSchedule("constant", 5e-2, 12), OPTIMIZER, checkpoint_every=3,
              checkpoint_path=path, json_path=log, progress=False)
    assert 6 <= len(runner.calls) <= 9  # stopped once the write had failed, by the next checkpoint at the latest
    assert ckpt.load_checkpoint(path).step == 3  # the last good one, whole
    assert sorted(os.listdir(tmp_path)) == ["log.json", "run.ckpt"]  # nothing half-written
    assert len(json.loads(log.read_text())) == len(runner.calls)
    assert threading.main_thread() not in checkpoints


def test_resume_from_step_10_reproduces_steps_11_to_20_exactly(tmp_path):
    schedule = LRSchedule("cosine", 5e-2, 20, warmup_steps=4)
    uninterrupted = FakeRunner()
    full_log = tmp_path / "full.json"
    full = train(uninterrupted, _batcher(uninterrupted), 20, schedule, OPTIMIZER, json_path=full_log,
                 checkpoint_every=5, checkpoint_path=tmp_path / "full.ckpt", program_sha256="a" * 64, progress=False)

    # The same run, crashing during step 13: the checkpoint of step 10 is the last one written.
    crashing = FakeRunner(crash_at_call=13)
    path, log = tmp_path / "run.ckpt", tmp_path / "run.json"
    with pytest.raises(_SimulatedCrash):
        train(crashing, _batcher(crashing), 20, schedule, OPTIMIZER, checkpoint_every=5, checkpoint_path=path,
              json_path=log, program_sha256="a" * 64, progress=False)
    assert [r["step"] for r in json.loads(log.read_text())] == list(range(1, 13))  # steps that completed
    checkpoint = ckpt.load_checkpoint(path)
    assert (checkpoint.step, checkpoint.data_position) == (10, 10)

    resumed_runner = FakeRunner(state_seed=99)  # other initial state: everything must come from the checkpoint
    ckpt.restore_state(resumed_runner, checkpoint, "a" * 64)
    resumed = train(resumed_runner, _batcher(resumed_runner), 20, schedule, OPTIMIZER,
                    state=TrainState.from_checkpoint(checkpoint, path), checkpoint_every=5, checkpoint_path=path,
                    json_path=log, program_sha256="a" * 64, progress=False)
    assert len(resumed_runner.calls) == 10  # steps 11..20 only
    # Steps 1-10 restored (their times too), 11-20 recomputed: identical losses and lr.
    assert resumed.records[:10] == checkpoint.records
    assert _without_seconds(resumed.records) == _without_seconds(full.records)
    assert json.loads(log.read_text()) == resumed.records
    for name in uninterrupted.state_names:
        np.testing.assert_array_equal(resumed_runner.read_state(name), uninterrupted.read_state(name))
    final, reference = ckpt.load_checkpoint(path), ckpt.load_checkpoint(tmp_path / "full.ckpt")
    assert final.step == reference.step == 20 and _without_seconds(final.records) == _without_seconds(reference.records)
    for name, array in reference.tensors.items():
        np.testing.assert_array_equal(final.tensors[name], array)


def _reference_state_after(steps, schedule):
    reference = FakeRunner()
    train(reference, _batcher(reference), steps, schedule, progress=False)
    return {name: reference.read_state(name) for name in reference.state_names}


def _assert_state_equals(actual, expected):
    assert sorted(actual) == sorted(expected)
    for name, array in expected.items():
        np.testing.assert_array_equal(actual[name], array, err_msg=name)


def test_a_non_finite_loss_keeps_the_state_before_the_update_that_caused_it(tmp_path):
    # lr 0.5 grows max|lora_B| past 2.0 with step 6's update (see the numbers below); step 7's loss, computed
    # from that state, overflows. The state after step 6 is finite but useless: resuming it with ANY lr
    # gives the same loss at step 7. The state to resume from is the one before step 6's update (step 5).
    big, small = LRSchedule("constant", 0.5, 12), LRSchedule("constant", 0.01, 12)
    probe = FakeRunner()
    train(probe, _batcher(probe), 6, big, progress=False)
    assert np.abs(probe.state["model.proj.lora_B"]).max() > 2.0  # the premise of this test
    path = tmp_path / "run.ckpt"
    runner = FakeRunner(overflow_above=2.0)
    with pytest.raises(NonFiniteLossError, match=r"loss became inf at step 7 .*made by step 6's update.*"
                                                 r"last good checkpoint is .*run\.step5\.ckpt \(step 5\)") as info:
        train(runner, _batcher(runner), 12, big, checkpoint_every=3, checkpoint_path=path, program_sha256="a" * 64,
              json_path=tmp_path / "log.json", progress=False)
    assert info.value.resume_from == (str(tmp_path / "run.step5.ckpt"), 5) and len(runner.calls) == 7
    _assert_state_equals(runner.state, _reference_state_after(6, big))  # the failed update was undone
    periodic = ckpt.load_checkpoint(path)  # the last periodic checkpoint is untouched
    assert periodic.step == 6
    _assert_state_equals(periodic.tensors, _reference_state_after(6, big))
    kept = ckpt.load_checkpoint(tmp_path / "run.step5.ckpt")
    assert (kept.step, kept.data_position, len(kept.records)) == (5, 5, 5)
    _assert_state_equals(kept.tensors, _reference_state_after(5, big))
    assert [r["step"] for r in json.loads((tmp_path / "log.json").read_text())] == list(range(1, 7))

    def resume(checkpoint_path, schedule):
        resumed = FakeRunner(overflow_above=2.0)
        checkpoint = ckpt.load_checkpoint(checkpoint_path)
        ckpt.restore_state(resumed, checkpoint, "a" * 64)
        return train(resumed, _batcher(resumed), 12, schedule, state=TrainState.from_checkpoint(checkpoint, path),
                     progress=False)

    assert resume(tmp_path / "run.step5.ckpt", small).step == 12  # a smaller lr gets past step 7
    with pytest.raises(NonFiniteLossError, match="at step 7"):  # what the old rollback kept: no lr helps
        resume(path, small)


def test_a_full_disk_at_divergence_names_an_older_checkpoint(tmp_path, monkeypatch, capsys):
    real_fsync = os.fsync

    def no_space(fd):  # on the loop's thread: step 6's checkpoint, written on the writer's, still lands
        if threading.current_thread() is not threading.main_thread():
            return real_fsync(fd)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    class DiskFillsAtStep7(FakeRunner):
        def step(self, tokens, labels, hparams):
            if len(self.calls) == 6:
                monkeypatch.setattr(ckpt.os, "fsync", no_space)
            return super().step(tokens, labels, hparams)

    runner = DiskFillsAtStep7(overflow_above=2.0)  # as above: step 7's loss overflows, step 5 is to be kept
    path = tmp_path / "run.ckpt"
    with pytest.raises(NonFiniteLossError, match=r"at step 7 .*last good checkpoint is .*run\.step3\.ckpt \(step 3\)"):
        train(runner, _batcher(runner), 12, LRSchedule("constant", 0.5, 12), checkpoint_every=3, checkpoint_path=path,
              keep_checkpoints=3, progress=False)
    assert (f"the state of step 5 was not kept: cannot write {tmp_path / 'run.step5.ckpt'}: No space left on device"
            in capsys.readouterr().err)
    assert sorted(os.listdir(tmp_path)) == ["run.ckpt", "run.step3.ckpt"]  # nothing half-written


def test_a_finite_loss_whose_update_leaves_nan_keeps_the_state_before_that_step(tmp_path):
    schedule = LRSchedule("constant", 1e-2, 20)

    class NanUpdateFiniteLoss(FakeRunner):  # the update goes NaN while the loss it reports is finite
        def step(self, tokens, labels, hparams):
            loss = super().step(tokens, labels, hparams)
            if len(self.calls) == 8:
                self.state["model.proj.lora_A"][0, 0] = np.nan
            return loss

    runner = NanUpdateFiniteLoss()
    path = tmp_path / "run.ckpt"
    with pytest.raises(NonFiniteLossError, match=r"state held NaN/inf after step 8 .*run\.step7\.ckpt \(step 7\)"):
        train(runner, _batcher(runner), 20, schedule, checkpoint_every=4, checkpoint_path=path, progress=False)
    assert ckpt.load_checkpoint(path).step == 4
    _assert_state_equals(ckpt.load_checkpoint(tmp_path / "run.step7.ckpt").tensors, _reference_state_after(7, schedule))


def test_without_host_copies_a_non_finite_state_is_never_written(tmp_path):
    schedule = LRSchedule("constant", 1e-2, 20)
    runner = FakeRunner(nan_at_call=8)
    path = tmp_path / "run.ckpt"
    with pytest.raises(NonFiniteLossError, match=r"at step 8 .*last good checkpoint is .*run.ckpt \(step 5\)"):
        train(runner, _batcher(runner), 20, schedule, checkpoint_every=5, checkpoint_path=path, progress=False,
              last_good_state_limit=0)  # every state counts as "large": no per-step host copy
    assert ckpt.load_checkpoint(path).step == 5 and sorted(os.listdir(tmp_path)) == ["run.ckpt"]
    _assert_state_equals(ckpt.load_checkpoint(path).tensors, _reference_state_after(5, schedule))

    # A finite loss over a NaN state is found when the checkpoint is due; nothing is written.
    class NanUpdate(FakeRunner):
        def step(self, tokens, labels, hparams):
            loss = super().step(tokens, labels, hparams)
            if len(self.calls) == 10:
                self.state["model.proj.lora_A"][0, 0] = np.nan
            return loss

    silent = NanUpdate()
    with pytest.raises(NonFiniteLossError, match=r"state held NaN/inf after step 10 .*run.ckpt \(step 5\)"):
        train(silent, _batcher(silent), 20, schedule, checkpoint_every=5, checkpoint_path=path, progress=False,
              last_good_state_limit=0)
    assert ckpt.load_checkpoint(path).step == 5

    no_checkpoint = FakeRunner(nan_at_call=2)
    with pytest.raises(NonFiniteLossError, match="at step 2 .*no kept checkpoint is from before that"):
        train(no_checkpoint, _batcher(no_checkpoint), 5, schedule, progress=False)
    with pytest.raises(ValueError, match="skipping non-finite batches needs a copy of the state"):
        train(FakeRunner(), _batcher(no_checkpoint), 5, schedule, on_nonfinite="skip", last_good_state_limit=0,
              progress=False)


class _SkippingBatcher:
    """Batches of `batcher` without the positions in `skip`: what a run that skipped them trained on."""

    def __init__(self, batcher, skip):
        self.inner, self.skip = batcher, set(skip)
        for name in ("batch_size", "seq_len", "shuffle", "seed", "fingerprint", "config"):
            setattr(self, name, getattr(batcher, name))

    def batch(self, position):
        kept = [p for p in range(position + len(self.skip) + 1) if p not in self.skip]
        return self.inner.batch(kept[position])


def test_skip_drops_bad_batches_and_trains_as_if_they_were_not_there(tmp_path):
    schedule = LRSchedule("constant", 1e-2, 12)
    batches = _batcher(FakeRunner())
    poison = 28  # batches starting with this token give a non-finite loss: positions 9 and 10 of this stream
    bad = [p for p in range(14) if batches.batch(p)[0][0, 0] == poison]
    assert bad == [9, 10]
    runner = FakeRunner(poison_first_token=poison)
    path = tmp_path / "run.ckpt"
    state = train(runner, batches, 12, schedule, checkpoint_path=path, on_nonfinite="skip", progress=False)
    assert (state.step, state.data_position) == (12, 14)
    assert state.records[9]["skipped"] == [9, 10] and sum("skipped" in r for r in state.records) == 1
    reference = FakeRunner()  # trained on the same stream without batches 9 and 10
    reference_state = train(reference, _SkippingBatcher(batches, bad), 12, schedule, progress=False)
    _assert_state_equals(runner.state, reference.state)
    assert [r["loss"] for r in state.records] == [r["loss"] for r in reference_state.records]
    resumed = ckpt.load_checkpoint(path)  # consistent: data position = step + skipped batches
    assert (resumed.step, resumed.data_position) == (12, 14)

    always_bad = FakeRunner(overflow_above=0.0)  # the state overflows on every batch: skipping cannot help
    with pytest.raises(NonFiniteLossError,
                       match=r"loss became inf at step 2 \(lr 0.01\) on 9 batches in a row \(8 skipped"):
        train(always_bad, batches, 12, schedule, on_nonfinite="skip", progress=False)
    assert len(always_bad.calls) == 1 + 9  # step 1, then step 2 on 9 batches


def test_train_refuses_inconsistent_arguments(tmp_path):
    runner = FakeRunner()
    schedule = LRSchedule("constant", 1e-2, 10)
    with pytest.raises(ValueError, match="needs a checkpoint path"):
        train(runner, _batcher(runner), 10, schedule, checkpoint_every=2, progress=False)
    with pytest.raises(ValueError, match="already at step 12"):
        train(runner, _batcher(runner), 10, schedule, state=TrainState(step=12, data_position=12), progress=False)
    with pytest.raises(ValueError, match="beta1"):
        AdamWConfig(beta1=1.0)


def test_describe_program_reads_the_delegate_graph():
    from vktrain.serialization import graph as vk

    class GraphRunner:
        def __init__(self):
            self.graph = vk.VkGraph()
            g = self.graph
            g.values = [vk.TensorValue(vk.DType.INT64, (4, 16), name="token_ids"),
                        vk.TensorValue(vk.DType.FLOAT32, (64, 100), name="logits"),
                        vk.TensorValue(vk.DType.INT64, (64,), name="labels")]
            g.inputs = [0]
            g.ops = [vk.OpCall("vktrain.fused_ce.default", (1, 2), ())]
            g.metadata = {"lora_alpha": "8"}

    info = describe_program(GraphRunner())
    assert (info.batch_size, info.seq_len, info.vocab_size) == (4, 16, 100)
    assert info.metadata["lora_alpha"] == "8"
    assert describe_program(FakeRunner(batch_shape=(3, 5))).vocab_size == FAKE_VOCAB
    with pytest.raises(ValueError, match="cannot tell the program's batch shape"):
        describe_program(object())


# ------------------------------------------------------------------------------------------------
# Adapters
# ------------------------------------------------------------------------------------------------

def test_adapters_are_saved_with_peft_names_and_config(tmp_path):
    from vktrain.lora.inject import peft_name as torch_side_peft_name

    rng = np.random.default_rng(0)
    state = {
        "model.layers.0.lora_A": rng.standard_normal((4, 32)).astype(np.float32),
        "model.layers.0.lora_B": rng.standard_normal((64, 4)).astype(np.float32),
        "model.head.lora_A": rng.standard_normal((8, 64)).astype(np.float32),
        "model.head.lora_B": rng.standard_normal((256, 8)).astype(np.float32),
        "model.layers.1.lora_A": rng.standard_normal((4, 64)).astype(np.float32),
        "model.layers.1.lora_B": rng.standard_normal((64, 4)).astype(np.float32),
        "optimizer.exp_avg.head.lora_A": np.zeros((8, 64), np.float32),
        "optimizer.step": np.zeros((), np.float32),
    }
    adapters = adapters_mod.adapters_from_state(state)
    assert sorted(adapters) == ["head", "layers.0", "layers.1"]
    out = tmp_path / "adapter"
    adapters_mod.save_adapters(out, adapters, lora_alpha=16, base_model="mlp-lora")
    assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors"]

    raw = (out / "adapter_model.safetensors").read_bytes()
    header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
    assert header.pop("__metadata__") == {"format": "pt"}
    expected_names = {torch_side_peft_name(f"{m}.{p}") for m in adapters for p in ("lora_A", "lora_B")}
    assert set(header) == expected_names
    assert "base_model.model.layers.0.lora_A.weight" in header
    tensors = safetensors.numpy.load(raw)
    np.testing.assert_array_equal(tensors["base_model.model.head.lora_B.weight"], state["model.head.lora_B"])

    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert config["r"] == 4 and config["lora_alpha"] == 16.0
    assert config["rank_pattern"] == {"head": 8}  # PEFT's way of stating a layer's different rank
    assert config["target_modules"] == ["head", "layers.0", "layers.1"]
    assert config["base_model_name_or_path"] == "mlp-lora"

    loaded = adapters_mod.load_adapters(out)
    assert sorted(loaded) == sorted(adapters)
    for module, (a, b) in adapters.items():
        np.testing.assert_array_equal(loaded[module][0], a)
        np.testing.assert_array_equal(loaded[module][1], b)
    assert adapters_mod.load_adapter_config(out) == config


def test_bad_adapters_are_refused(tmp_path):
    with pytest.raises(adapters_mod.AdapterError, match=r"module 'l' has \['lora_A'\] but no \['lora_B'\]"):
        adapters_mod.adapters_from_state({"model.l.lora_A": np.zeros((2, 4), np.float32)})
    with pytest.raises(adapters_mod.AdapterError, match="same r"):
        adapters_mod.adapters_from_state({"model.l.lora_A": np.zeros((2, 4), np.float32),
                                          "model.l.lora_B": np.zeros((4, 3), np.float32)})
    with pytest.raises(adapters_mod.AdapterError, match="no LoRA tensors"):
        adapters_mod.adapters_from_state({"optimizer.step": np.zeros(())})
    out = tmp_path / "a"
    out.mkdir()
    (out / "adapter_model.safetensors").write_bytes(safetensors.numpy.save({"l.weight": np.zeros((2, 2), np.float32)}))
    with pytest.raises(adapters_mod.AdapterError, match=r"'l.weight' is not named base_model.model.<module>"):
        adapters_mod.load_adapters(out)
    with pytest.raises(adapters_mod.AdapterError, match="lora_alpha must be a positive number"):
        adapters_mod.save_adapters(out, {"l": (np.zeros((2, 4)), np.zeros((4, 2)))}, lora_alpha=0)


# ------------------------------------------------------------------------------------------------
# CLI glue (TrainingRunner replaced by the fake)
# ------------------------------------------------------------------------------------------------

def _parse(*argv):
    parser = argparse.ArgumentParser(prog="vktrain train")
    add_train_arguments(parser)
    return parser.parse_args([str(a) for a in argv])


@pytest.fixture
def fake_program(tmp_path, monkeypatch):
    """A .pte path whose 'program' is a FakeRunner; returns (pte path, data path, list of runners made)."""
    from vktrain.runtime.program import runner as runner_mod

    made = []

    def from_pte(path, device=None, **options):
        fake = FakeRunner(**made_options)
        made.append(fake)
        return fake

    made_options: dict = {}
    monkeypatch.setattr(runner_mod.TrainingRunner, "from_pte", staticmethod(from_pte))
    pte = tmp_path / "step.pte"
    pte.write_bytes(b"a stand-in program")
    data = tmp_path / "ids.npy"
    np.save(data, _stream())
    return pte, data, made, made_options


def test_cli_trains_resumes_and_writes_adapters(tmp_path, fake_program, capsys):
    pte, data, made, _ = fake_program
    common = ["--data", data, "--lr", "0.05", "--warmup", "2", "--schedule", "cosine", "--weight-decay", "0.01",
              "--no-progress"]
    assert run_train(_parse(pte, "--steps", 12, *common, "--json", tmp_path / "full.json")) == 0
    assert run_train(_parse(pte, "--steps", 6, *common, "--checkpoint", tmp_path / "c6")) == 0
    capsys.readouterr()
    # A shorter run has another cosine schedule: resuming it to step 12 warns that it will not match.
    assert run_train(_parse(pte, "--steps", 12, *common, "--resume", tmp_path / "c6",
                            "--json", tmp_path / "resumed.json", "--out-adapters", tmp_path / "ad",
                            "--lora-alpha", "8")) == 0
    out, err = capsys.readouterr()
    assert "warning: resuming with settings that differ" in err and "schedule.total_steps: 6 -> 12" in err
    assert len(made[-1].calls) == 6
    assert "trained steps 7..12" in out
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    assert [r["step"] for r in resumed] == list(range(1, 13))
    loaded = adapters_mod.load_adapters(tmp_path / "ad")
    np.testing.assert_array_equal(loaded["proj"][1], made[-1].read_state("model.proj.lora_B"))
    assert adapters_mod.load_adapter_config(tmp_path / "ad")["lora_alpha"] == 8.0
    assert ckpt.load_checkpoint(tmp_path / "c6").step == 12  # --resume alone: checkpoints go back to that file


def test_cli_resume_of_an_interrupted_constant_run_matches(tmp_path, fake_program, capsys):
    pte, data, made, options = fake_program
    common = ["--data", data, "--lr", "0.05", "--schedule", "constant", "--no-progress"]
    assert run_train(_parse(pte, "--steps", 10, *common, "--json", tmp_path / "full.json")) == 0
    assert run_train(_parse(pte, "--steps", 4, *common, "--checkpoint", tmp_path / "c")) == 0
    capsys.readouterr()
    assert run_train(_parse(pte, "--steps", 10, *common, "--resume", tmp_path / "c",
                            "--json", tmp_path / "resumed.json")) == 0
    assert "warning" not in capsys.readouterr().err  # a constant schedule's length is no difference
    resumed, full = (json.loads((tmp_path / name).read_text()) for name in ("resumed.json", "full.json"))
    assert _without_seconds(resumed) == _without_seconds(full)


def test_cli_divergence_names_a_checkpoint_that_a_smaller_lr_resumes_past(tmp_path, fake_program, capsys):
    pte, data, made, options = fake_program
    options["overflow_above"] = 2.0  # lr 0.5 grows max|lora_B| past it within a few steps
    path = tmp_path / "run.ckpt"
    common = [pte, "--data", data, "--schedule", "constant", "--no-progress", "--checkpoint", path]
    code = cli.main([str(a) for a in ["train", *common, "--steps", 12, "--lr", 0.5, "--checkpoint-every", 3]])
    err = capsys.readouterr().err
    found = re.search(r"loss became inf at step (\d+) .*last good checkpoint is (\S+) \(step (\d+)\)", err)
    assert code == cli.EXIT_DIVERGED and found, err
    bad_step, kept, kept_step = int(found[1]), found[2], int(found[3])
    assert kept_step == bad_step - 2 and kept == str(tmp_path / f"run.step{kept_step}.ckpt")
    code = cli.main([str(a) for a in ["train", *common, "--steps", 12, "--lr", 0.01, "--resume", kept]])
    captured = capsys.readouterr()
    assert code == 0 and f"trained steps {kept_step + 1}..12" in captured.out, captured.err
    assert ckpt.load_checkpoint(path).step == 12


def test_cli_errors_are_clear(tmp_path, fake_program, capsys, monkeypatch):
    pte, data, made, options = fake_program

    def error_of(*argv):
        code = cli.main(["train", *map(str, argv), "--no-progress"])
        return code, capsys.readouterr().err

    code, err = error_of(tmp_path / "missing.pte", "--steps", 3)
    assert code == 2 and "missing.pte does not exist" in err
    code, err = error_of(pte, "--steps", 3, "--checkpoint-every", 2)
    assert code == 2 and "--checkpoint-every needs --checkpoint PATH" in err
    (tmp_path / "a-file").write_text("not a directory")
    code, err = error_of(pte, "--steps", 3, "--data", data, "--json", tmp_path / "a-file" / "log.json")
    assert code == 2 and "--json" in err and "cannot write there" in err and not made  # refused before loading
    code, err = error_of(pte, "--steps", 3, "--data", data, "--out-adapters", tmp_path / "ad")
    assert code == 2 and "pass --lora-alpha" in err
    code, err = error_of(pte, "--steps", 3)  # the default corpus is byte-level text; the fake's vocab is 32
    assert code == 2 and "would be read as byte-level text" in err and "vocabulary has 32 tokens" in err
    too_large = tmp_path / "large.tokens.txt"
    too_large.write_text(" ".join(["1"] * 50 + ["40"] + ["2"] * 50))
    code, err = error_of(pte, "--steps", 3, "--data", too_large)
    assert code == 2 and "token id 40 at position 50 is outside the model's vocabulary [0, 32)" in err
    short = tmp_path / "short.tokens.txt"
    short.write_text("1 2 3")
    code, err = error_of(pte, "--steps", 3, "--data", short)
    assert code == 2 and "too short for one batch" in err
    code, err = error_of(pte, "--steps", 3, "--data", data, "--warmup", 3)
    assert code == 2 and "warmup" in err

    assert run_train(_parse(pte, "--steps", 4, "--data", data, "--checkpoint", tmp_path / "c", "--no-progress")) == 0
    other_pte = tmp_path / "other.pte"
    other_pte.write_bytes(b"another program")
    code, err = error_of(other_pte, "--steps", 6, "--data", data, "--resume", tmp_path / "c")
    assert code == 2 and "different program" in err
    other_data = tmp_path / "other.npy"
    np.save(other_data, _stream(seed=2))
    code, err = error_of(pte, "--steps", 6, "--data", other_data, "--resume", tmp_path / "c")
    assert code == 2 and "other data" in err
    code, err = error_of(pte, "--steps", 6, "--data", data, "--resume", tmp_path / "c", "--seed", 5)
    assert code == 2 and "--seed 5 differs from the checkpoint's data seed 0" in err

    options["nan_at_call"] = 3
    code, err = error_of(pte, "--steps", 6, "--data", data)
    assert code == 1 and "loss became inf at step 3" in err

    options.clear()
    options["crash_at_call"] = 6
    monkeypatch.setattr(FakeRunner, "crash_exception", KeyboardInterrupt)  # Ctrl-C during step 6
    code, err = error_of(pte, "--steps", 9, "--data", data, "--checkpoint-every", 2, "--checkpoint", tmp_path / "k")
    assert code == 130 and "interrupted after step 5 (SIGINT, stopping at once); the last checkpoint is" in err
    assert "(step 4); resume with: vktrain train " in err


# ------------------------------------------------------------------------------------------------
# End to end: an exported mlp-lora training step on Vulkan
# ------------------------------------------------------------------------------------------------

E2E_BATCH, E2E_SEQ = 2, 16


@pytest.fixture(scope="module")
def mlp_step_program(tmp_path_factory):
    torch = pytest.importorskip("torch")
    from vktrain.export import export_training_step, lower_to_pte
    from vktrain.lora import LoRAConfig, apply_lora
    from vktrain.models import build_model

    model = build_model("mlp-lora", dim=32, hidden=64, n_layers=1)
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets="*", group_size=32, seed=0))
    path = tmp_path_factory.mktemp("e2e") / "step.pte"
    path.write_bytes(lower_to_pte(export_training_step(model, (E2E_BATCH, E2E_SEQ))))
    return path, model, torch


def test_the_cli_trains_a_real_program_with_validation_on_and_reports_nothing(mlp_step_program, tmp_path, capsys,
                                                                             monkeypatch):
    path, _, _ = mlp_step_program
    monkeypatch.setenv("VKTRAIN_VALIDATION", "1")  # the runner's own device, with the validation layer
    code = cli.main(["train", str(path), "--steps", "3", "--no-progress", "--json", str(tmp_path / "log.json")])
    err = capsys.readouterr().err
    assert code == 0 and "vulkan validation" not in err and "error" not in err
    assert [r["step"] for r in json.loads((tmp_path / "log.json").read_text())] == [1, 2, 3]


def test_end_to_end_train_resume_and_adapters_on_vulkan(vk_device, mlp_step_program, tmp_path):
    path, model, torch = mlp_step_program
    common = [path, "--lr", "1e-2", "--schedule", "constant", "--warmup", "2", "--no-progress"]

    def run(*extra):
        return run_train(_parse(*common, *extra), device=vk_device)

    assert run("--steps", 16, "--json", tmp_path / "full.json", "--out-adapters", tmp_path / "ad",
               "--lora-alpha", "8", "--checkpoint", tmp_path / "full.ckpt") == 0
    assert run("--steps", 8, "--checkpoint-every", 4, "--checkpoint", tmp_path / "c") == 0
    assert run("--steps", 16, "--resume", tmp_path / "c", "--json", tmp_path / "resumed.json") == 0

    records = json.loads((tmp_path / "full.json").read_text())
    losses = [r["loss"] for r in records]
    assert len(records) == 16 and all(math.isfinite(x) for x in losses)
    assert np.mean(losses[-4:]) < losses[0] - 0.5  # the default corpus is learnable; the adapters train
    resumed_records = json.loads((tmp_path / "resumed.json").read_text())
    assert _without_seconds(resumed_records) == _without_seconds(records)  # bitwise resume: the same losses
    resumed, full = ckpt.load_checkpoint(tmp_path / "c"), ckpt.load_checkpoint(tmp_path / "full.ckpt")
    for name, array in full.tensors.items():
        np.testing.assert_array_equal(resumed.tensors[name], array)

    # Step 1's loss is the exported model's loss on batch 0 of the default corpus (eager PyTorch):
    # the batcher feeds the program what the model expects (next-token labels, all valid).
    tokens, labels = TokenBatcher(load_tokens(default_dataset_path()), E2E_BATCH, E2E_SEQ, seed=0).batch(0)
    with torch.no_grad():
        eager = model.loss(torch.from_numpy(tokens), torch.from_numpy(labels), torch.tensor(float(labels.size)))
    assert losses[0] == pytest.approx(float(eager), rel=1e-4)

    adapters = adapters_mod.load_adapters(tmp_path / "ad")
    assert sorted(adapters) == ["head", "layers.0"]
    for module, (a, b) in adapters.items():
        np.testing.assert_array_equal(a, full.tensors[f"model.{module}.lora_A"])
        np.testing.assert_array_equal(b, full.tensors[f"model.{module}.lora_B"])
        assert a.shape[0] == b.shape[1] == 4
    config = adapters_mod.load_adapter_config(tmp_path / "ad")
    assert (config["r"], config["lora_alpha"]) == (4, 8.0)


def test_loss_plot_marks_the_held_out_loss(tmp_path):
    pytest.importorskip("matplotlib")
    from vktrain.train.plot import plot_losses

    records = [{"step": s, "loss": 2.0 / s, "lr": 1e-3} for s in range(1, 9)]
    with_eval = [dict(r, eval_loss=1.5 / r["step"]) if r["step"] % 4 == 0 else r for r in records]
    plain, marked = tmp_path / "plain.png", tmp_path / "marked.png"
    plot_losses(records, plain)
    plot_losses(with_eval, marked)
    for path in (plain, marked):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plain.read_bytes() != marked.read_bytes()  # the held-out points (and their legend) are drawn


class _Injecting:
    """A TrainingRunner whose state gets a NaN written into it around one step (a divergence on demand); it
    counts the state tensors read to the host."""

    def __init__(self, runner, *, nan_after_call=None, nan_before_call=None):
        self.runner, self.calls, self.reads = runner, 0, 0
        self.nan_after_call, self.nan_before_call = nan_after_call, nan_before_call
        self.batch_shape, self.vocab_size = runner.batch_shape, runner.vocab_size
        self.state_names, self.state_guard, self.state_nbytes = runner.state_names, runner.state_guard, runner.state_nbytes

    def _poison(self):
        name = next(n for n in self.state_names if n.endswith("lora_B"))
        self.runner.write_state(name, np.full_like(self.runner.read_state(name), np.nan))

    def step(self, tokens, labels, hparams):
        self.calls += 1
        if self.calls == self.nan_before_call:
            self._poison()
        loss = self.runner.step(tokens, labels, hparams)
        if self.calls == self.nan_after_call:
            self._poison()
        return loss

    def read_state(self, name):
        self.reads += 1
        return self.runner.read_state(name)

    def write_state(self, name, array):
        self.runner.write_state(name, array)


def test_on_the_gpu_the_loop_reads_no_state_per_step_and_undoes_non_finite_steps(vk_device, mlp_step_program, tmp_path):
    from vktrain.runtime.program.runner import TrainingRunner

    path, _, _ = mlp_step_program
    schedule = LRSchedule("constant", 1e-2, 20)
    with TrainingRunner.from_pte(path, vk_device, planner=plan_schedule) as runner:
        def states_of_a_clean_run(steps):
            runner.executor.reset_state()
            train(runner, _batcher(runner), steps, schedule, progress=False)
            return ckpt.capture_state(runner)

        reference = {step: states_of_a_clean_run(step) for step in (4, 5)}
        runner.executor.reset_state()
        counted = _Injecting(runner)
        state = train(counted, _batcher(counted), 6, schedule, progress=False)
        assert state.step == 6 and counted.reads == 0  # no state crossed to the host: the copies stay on the device

        # A finite loss whose update left NaN (step 6): S[5] is put back and written as the state to resume from.
        runner.executor.reset_state()
        nan_update = _Injecting(runner, nan_after_call=6)
        with pytest.raises(NonFiniteLossError, match=r"state held NaN/inf after step 6 .*run\.step5\.ckpt \(step 5\)"):
            train(nan_update, _batcher(nan_update), 10, schedule, checkpoint_path=tmp_path / "run.ckpt", progress=False)
        _assert_state_equals(ckpt.load_checkpoint(tmp_path / "run.step5.ckpt").tensors, reference[5])
        _assert_state_equals(ckpt.capture_state(runner), reference[5])

        # A non-finite loss at step 6 (the state it ran on went bad): S[5] is put back, S[4] is the one to resume.
        runner.executor.reset_state()
        nan_loss = _Injecting(runner, nan_before_call=6)
        with pytest.raises(NonFiniteLossError, match=r"loss became nan at step 6 .*run\.step4\.ckpt \(step 4\)"):
            train(nan_loss, _batcher(nan_loss), 10, schedule, checkpoint_path=tmp_path / "run.ckpt", progress=False)
        _assert_state_equals(ckpt.load_checkpoint(tmp_path / "run.step4.ckpt").tensors, reference[4])
        _assert_state_equals(ckpt.capture_state(runner), reference[5])


def test_on_the_gpu_a_skipped_batch_is_undone_as_if_never_seen(vk_device, mlp_step_program):
    from vktrain.runtime.program.runner import TrainingRunner

    path, _, _ = mlp_step_program
    schedule = LRSchedule("constant", 1e-2, 8)
    with TrainingRunner.from_pte(path, vk_device, planner=plan_schedule) as runner:
        batches = _batcher(runner)
        reference_state = train(runner, _SkippingBatcher(batches, [3]), 8, schedule, progress=False)
        reference = ckpt.capture_state(runner)
        runner.executor.reset_state()
        poisoned = _Injecting(runner, nan_before_call=4)  # step 4's first batch (position 3) meets a NaN state
        state = train(poisoned, batches, 8, schedule, on_nonfinite="skip", progress=False)
        assert (state.step, state.data_position, state.records[3]["skipped"]) == (8, 9, [3])
        _assert_state_equals(ckpt.capture_state(runner), reference)  # the NaN was undone on the device
        assert _without_seconds([{k: v for k, v in r.items() if k != "skipped"} for r in state.records]) == \
            _without_seconds(reference_state.records)
