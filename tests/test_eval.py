"""The eval method exported with a training step, and `vktrain eval`: its loss against eager float64, the
adapters it sees (trained in-process, or loaded from PEFT files), the state it leaves alone, and the one
copy of the frozen base a two-method .pte stores."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from _helpers import _cast_floating
from vktrain.contract import EVAL_METHOD, TRAIN_METHOD, hparams_values
from vktrain.errors import VktrainError
from vktrain.export import (export_eval_step, export_training_and_eval_steps, export_training_step, lower_methods_to_pte,
                            lower_to_pte)
from vktrain.lora import LoRAConfig, apply_lora, lora_modules
from vktrain.models import build_model
from vktrain.serialization.pte import PteFile
from vktrain.runtime.program.runner import TrainingRunner, UnsupportedProgramError
from vktrain.runtime.program.summary import summarize_pte
from vktrain.serialization import graph as vk
from vktrain.serialization.blob import BlobFormatError, deserialize_blob, named_constants, serialize_blob
from vktrain.train.adapters import adapters_from_state, save_adapters
from vktrain.train.data import IGNORED_LABEL, TrainingData
from vktrain.train.eval_command import adapter_state, load_adapter_state
from vktrain.train.held_out import eval_batches, evaluate_data
from vktrain.backend.kernel_planning import plan_schedule

BATCH = (2, 16)
VOCAB = 2048  # a large embedding, so constants dominate the .pte (the one-copy test needs them to)
LORA_ALPHA = 8.0
# 4 full rows and a row of 7 targets: the last batch has the partial row and a padding row
HELD_OUT = np.random.default_rng(1).integers(0, VOCAB, 4 * BATCH[1] + 8)
HPARAMS = np.array(hparams_values(1e-2), np.float32)


@pytest.fixture(scope="module")
def model():
    model = build_model("tiny-llama", dim=64, n_layers=2, hidden=192, vocab_size=VOCAB, max_seq_len=64)
    apply_lora(model, LoRAConfig(rank=4, alpha=LORA_ALPHA, group_size=32, seed=0))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # lora_B starts at zero; make the adapters matter from the start
        for adapter in lora_modules(model).values():
            adapter.lora_B.copy_(0.05 * torch.randn(adapter.lora_B.shape, generator=generator))
    return model


@pytest.fixture(scope="module")
def programs(model):
    """The step and its eval method from one trace (what `vktrain export` writes)."""
    return export_training_and_eval_steps(model, BATCH)


@pytest.fixture(scope="module")
def two_method_pte(programs, tmp_path_factory):
    path = tmp_path_factory.mktemp("eval") / "step.pte"
    step, evaluation = programs
    path.write_bytes(lower_methods_to_pte({TRAIN_METHOD: step, EVAL_METHOD: evaluation}))
    return path


@pytest.fixture(scope="module")
def one_method_pte(programs):
    """The training step alone (how vktrain wrote it before the eval method)."""
    return lower_to_pte(programs[0])


def _eager_mean_ce_float64(model, tokens: np.ndarray) -> tuple[float, int]:
    reference = copy.deepcopy(model)
    _cast_floating(reference, torch.float64)
    total, count = 0.0, 0
    with torch.no_grad():
        for token_ids, labels in eval_batches(tokens, *BATCH):
            logits = reference(torch.from_numpy(token_ids)).reshape(-1, VOCAB)
            assert logits.dtype == torch.float64
            flat = torch.from_numpy(labels).reshape(-1)
            valid = flat >= 0
            total += float(-torch.log_softmax(logits[valid], -1).gather(1, flat[valid, None]).sum())
            count += int(valid.sum())
    return total / count, count


def test_eval_batches_cover_every_target_once_and_pad_with_ignored_labels():
    batches = list(eval_batches(HELD_OUT, *BATCH))
    assert len(batches) == 3  # 5 rows, 2 a batch
    labels = np.concatenate([labels.reshape(-1) for _, labels in batches])
    np.testing.assert_array_equal(labels[labels >= 0], HELD_OUT[1:])  # every next-token target, in order, once
    assert set(labels[labels < 0]) == {IGNORED_LABEL}
    last_tokens, last_labels = batches[-1]
    assert (last_labels[1] == IGNORED_LABEL).all() and (last_labels[0] >= 0).sum() == 7  # partial row, pad row
    for token_ids, labels in batches:  # a label is the token after its position (where that is an input)
        rows, cols = np.nonzero((labels[:, :-1] >= 0) & (labels[:, 1:] >= 0))
        np.testing.assert_array_equal(token_ids[rows, cols + 1], labels[rows, cols])


def test_eval_loss_equals_eager_float64_mean_cross_entropy(model, two_method_pte):
    expected, count = _eager_mean_ce_float64(model, HELD_OUT)
    with TrainingRunner.from_pte(two_method_pte, planner=plan_schedule) as runner:
        result = evaluate_data(runner, TrainingData(HELD_OUT))
    assert result["tokens"] == count == HELD_OUT.size - 1
    assert result["loss"] == pytest.approx(expected, rel=1e-5)
    assert result["perplexity"] == pytest.approx(np.exp(expected), rel=1e-4)


def test_max_batches_evaluates_the_first_batches_only(model, two_method_pte):
    """A quick estimate on a slow device: the first batch's targets only, checked as above."""
    first_batch_targets = BATCH[0] * BATCH[1]
    expected, count = _eager_mean_ce_float64(model, HELD_OUT[:first_batch_targets + 1])
    with TrainingRunner.from_pte(two_method_pte, planner=plan_schedule) as runner:
        result = evaluate_data(runner, TrainingData(HELD_OUT), max_batches=1)
    assert result["tokens"] == count == first_batch_targets
    assert result["loss"] == pytest.approx(expected, rel=1e-5)

def test_max_batches_must_be_positive(two_method_pte, capsys):
    from vktrain.cli import EXIT_BAD_INPUT, main

    assert main(["eval", str(two_method_pte), "--data", "unused.txt", "--max-batches", "0"]) == EXIT_BAD_INPUT
    assert "--max-batches must be a positive number of batches, got 0" in capsys.readouterr().err


def test_eval_method_traced_on_its_own_computes_the_same_loss(model, programs, tmp_path):
    """export_eval_step traces the loss anew; export_training_and_eval_steps takes it from the joint
    graph: the same loss either way (eager float64 is the reference, as above)."""
    expected, _ = _eager_mean_ce_float64(model, HELD_OUT)
    path = tmp_path / "separate.pte"
    path.write_bytes(lower_methods_to_pte({TRAIN_METHOD: export_training_step(model, BATCH),
                                           EVAL_METHOD: export_eval_step(model, BATCH)}))
    with TrainingRunner.from_pte(path, planner=plan_schedule) as runner:
        assert evaluate_data(runner, TrainingData(HELD_OUT))["loss"] == pytest.approx(expected, rel=1e-5)
    joint_eval = programs[1]
    assert [s.arg.name for s in joint_eval.graph_signature.input_specs if s.kind.name == "USER_INPUT"] == \
        ["token_ids", "labels", "n_valid"]
    assert not any("grad" in str(s.kind).lower() for s in joint_eval.graph_signature.output_specs)


def _train(runner, steps: int) -> None:
    batches = eval_batches(np.random.default_rng(2).integers(0, VOCAB, steps * BATCH[0] * BATCH[1] + 1), *BATCH)
    for token_ids, labels in batches:
        runner.step(token_ids, labels, HPARAMS)


def test_eval_leaves_the_optimizer_state_untouched(two_method_pte):
    with TrainingRunner.from_pte(two_method_pte, planner=plan_schedule) as runner:
        _train(runner, 2)
        before = runner.state_dict()
        assert before["optimizer.step"] == 2.0 and any(np.any(v) for k, v in before.items() if "exp_avg_sq" in k)
        first = evaluate_data(runner, TrainingData(HELD_OUT))
        assert evaluate_data(runner, TrainingData(HELD_OUT)) == first  # nothing eval reads changed
        after = runner.state_dict()
    assert sorted(after) == sorted(before)
    for name in before:
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)


def test_eval_after_training_equals_a_fresh_load_with_the_written_adapters(two_method_pte, tmp_path, capsys):
    from vktrain import cli

    with TrainingRunner.from_pte(two_method_pte, planner=plan_schedule) as runner:
        untrained = evaluate_data(runner, TrainingData(HELD_OUT))["loss"]
        _train(runner, 4)
        trained = evaluate_data(runner, TrainingData(HELD_OUT))
        lora = runner.lora_state()
    assert trained["loss"] != untrained  # eval sees the trained adapters, no stale copy
    save_adapters(tmp_path / "adapters", adapters_from_state(lora), LORA_ALPHA)

    with TrainingRunner.from_pte(two_method_pte, planner=plan_schedule) as fresh:
        load_adapter_state(fresh, adapter_state(tmp_path / "adapters", list(fresh.lora_state()), LORA_ALPHA))
        assert evaluate_data(fresh, TrainingData(HELD_OUT)) == trained

    data = tmp_path / "held_out.npy"
    np.save(data, HELD_OUT)
    code = cli.main(["eval", str(two_method_pte), "--data", str(data), "--adapters", str(tmp_path / "adapters"),
                     "--json", str(tmp_path / "eval.json")])
    assert code == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "eval.json").read_text()) == trained
    assert f"loss {trained['loss']:.6f}" in capsys.readouterr().out


def test_adapters_that_do_not_match_the_program_are_refused(two_method_pte, tmp_path):
    with TrainingRunner.from_pte(two_method_pte, planner=plan_schedule) as runner:
        lora = runner.lora_state()
        names = list(lora)
    partial = {name: array for name, array in lora.items() if ".layers.1." not in name}
    assert len(partial) < len(lora)
    save_adapters(tmp_path / "partial", adapters_from_state(partial), LORA_ALPHA)
    with pytest.raises(VktrainError, match=r"does not match the program's adapters: missing \['model\.\S*layers\.1\."):
        adapter_state(tmp_path / "partial", names, LORA_ALPHA)
    save_adapters(tmp_path / "alpha", adapters_from_state(lora), 2 * LORA_ALPHA)
    with pytest.raises(VktrainError, match="lora_alpha is 16.0, the program was exported with 8"):
        adapter_state(tmp_path / "alpha", names, LORA_ALPHA)


def test_two_methods_store_the_frozen_base_once(one_method_pte, two_method_pte):
    one = one_method_pte
    constants = summarize_pte(one)["delegates"][0]["constants"]["deduplicated_bytes"]
    assert constants > 0.6 * len(one)  # so a second copy would make the file >= 1.6x
    two = two_method_pte.read_bytes()
    assert len(two) - len(one) < 0.2 * len(one), (len(one), len(two))
    pte = PteFile.from_bytes(two)
    assert sorted(pte.method_names) == [EVAL_METHOD, TRAIN_METHOD]
    assert sum(v.nbytes for v in pte.named_data.values()) > 0.6 * constants
    with TrainingRunner.from_pte(two_method_pte, planner=plan_schedule) as runner:  # and once on the device
        runner.evaluate(*next(eval_batches(HELD_OUT, *BATCH)))
        own_constants = {k: n for k, n in runner._eval.executor.buffer_bytes.items() if k.startswith("constant")}
    embedding_bytes = VOCAB * 64 * 4
    assert sum(own_constants.values()) < 0.1 * embedding_bytes, own_constants  # the base is bound, not uploaded


def test_a_program_without_an_eval_method_is_refused_by_name(one_method_pte, tmp_path):
    path = tmp_path / "step_only.pte"
    path.write_bytes(one_method_pte)
    with TrainingRunner.from_pte(path, planner=plan_schedule) as runner, pytest.raises(UnsupportedProgramError, match="has no 'eval' method"):
        runner.evaluate(*next(eval_batches(HELD_OUT, *BATCH)))


def test_named_constants_need_the_named_data_they_name():
    graph = vk.VkGraph()
    weight = graph.add_constant_tensor(np.arange(512, dtype=np.float32), name="weight")
    graph.inputs.append(graph.add_value(vk.TensorValue(vk.DType.FLOAT32, (512,), name="x")))
    out = graph.add_value(vk.TensorValue(vk.DType.FLOAT32, (512,), name="y"))
    graph.ops.append(vk.OpCall("aten.add.Tensor", (graph.inputs[0], weight, graph.add_value(vk.IntValue(1))), (out,)))
    graph.outputs.append(out)
    named = named_constants(graph, 1024)
    ((key, data),) = named.values()
    blob = serialize_blob(graph, named)
    assert len(blob) < data.nbytes  # the bytes are not in the blob
    parsed = deserialize_blob(blob, named_data={key: data})
    np.testing.assert_array_equal(parsed.constant_array(weight), np.arange(512, dtype=np.float32))
    with pytest.raises(BlobFormatError, match="no named data was given"):
        deserialize_blob(blob)
    with pytest.raises(BlobFormatError, match=f"names data '{key}', which the .pte does not hold"):
        deserialize_blob(blob, named_data={})
    corrupt = bytearray(data)
    corrupt[0] ^= 1
    with pytest.raises(BlobFormatError, match="crc32"):
        deserialize_blob(blob, named_data={key: memoryview(bytes(corrupt))})


def test_train_records_the_held_out_loss_of_the_adapters_it_writes(two_method_pte, tmp_path, capsys, monkeypatch):
    from vktrain import cli
    from vktrain.train.plot import loss_series
    from vktrain.train import held_out

    made, real_batches = [], held_out.eval_batches
    monkeypatch.setattr(held_out, "eval_batches", lambda *args: made.append(args) or real_batches(*args))

    train_data, held_out = tmp_path / "train.npy", tmp_path / "held_out.npy"
    np.save(train_data, np.random.default_rng(3).integers(0, VOCAB, 200))
    np.save(held_out, HELD_OUT)
    records = tmp_path / "records.json"
    code = cli.main(["train", str(two_method_pte), "--steps", "3", "--data", str(train_data), "--eval-data",
                     str(held_out), "--eval-every", "2", "--json", str(records), "--no-progress",
                     "--out-adapters", str(tmp_path / "adapters"), "--lora-alpha", str(LORA_ALPHA)])
    assert code == 0, capsys.readouterr().err
    assert len(made) == 1  # the held-out batches, made once for the three evals (before, step 2, step 3)
    log = json.loads(records.read_text())
    assert log[0].keys() == {"step", "eval_loss"} and log[0]["step"] == 0  # the loss before training leads
    steps = log[1:]
    assert ["eval_loss" in record for record in steps] == [False, True, True]  # step 2, and the last step
    assert loss_series(log)["held-out loss"][0] == [0, 2, 3]  # what --plot draws: step 0 included
    with TrainingRunner.from_pte(two_method_pte, planner=plan_schedule) as fresh:
        before = evaluate_data(fresh, TrainingData(HELD_OUT))["loss"]
        assert log[0]["eval_loss"] == before
        load_adapter_state(fresh, adapter_state(tmp_path / "adapters", list(fresh.lora_state()), LORA_ALPHA))
        assert evaluate_data(fresh, TrainingData(HELD_OUT))["loss"] == steps[-1]["eval_loss"]
    assert f"eval before training: loss {before:.6f}" in capsys.readouterr().out

    code = cli.main(["train", str(two_method_pte), "--steps", "1", "--eval-every", "2"])
    assert code == 2 and "--eval-every needs --eval-data" in capsys.readouterr().err


def test_the_eval_method_binds_the_steps_synthetic_constants_without_generating_them(programs, tmp_path, monkeypatch):
    """A benchmark .pte's eval method finds the step's frozen base by the synthetic records (graph.same_stored_bytes):
    its load generates only the constants it uploads itself, not both copies of every shared one to compare them
    (which made the 1B's eval load 8 s on an H100)."""
    from vktrain.backend import synthetic_constants_spec
    from vktrain.partitioner import VktrainPartitioner
    from vktrain.serialization.synthetic import SyntheticConstant

    path = tmp_path / "synthetic.pte"
    step, evaluation = programs
    specs = synthetic_constants_spec(min_bytes=1024, seed=5)
    path.write_bytes(lower_methods_to_pte({TRAIN_METHOD: step, EVAL_METHOD: evaluation},
                                          {name: VktrainPartitioner(compile_specs=specs)
                                           for name in (TRAIN_METHOD, EVAL_METHOD)}))
    generated = []
    materialize = SyntheticConstant.materialize
    monkeypatch.setattr(SyntheticConstant, "materialize", lambda self: generated.append(self) or materialize(self))
    with TrainingRunner.from_pte(path, planner=plan_schedule) as runner:
        generated.clear()
        method = runner.eval_method()
        loaded = len(generated)
        executor = method.executor
        own = {executor.storage_of(v) for v, value in enumerate(method.graph.values)
               if isinstance(value, vk.TensorValue) and value.constant_id >= 0
               and method.graph.is_synthetic(value.constant_id) and executor.storage_of(v) in executor.buffer_bytes}
        shared = [name for name in runner.executor.constants_matching(method.graph)
                  if method.graph.is_synthetic(next(v.constant_id for v in method.graph.values
                                                    if isinstance(v, vk.TensorValue) and v.name == name))]
        assert len(shared) >= 4  # the embedding, the head and the q4 linears' codes and scales
        assert loaded <= len(own), (loaded, len(own))
        loss, count = runner.evaluate(*next(eval_batches(HELD_OUT, *BATCH)))
        assert np.isfinite(loss) and count > 0
