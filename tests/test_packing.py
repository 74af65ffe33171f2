"""Document-masked packing (`vktrain export --packing documents`): a packed batch computes what its
documents compute one by one.

The reference is transformers' LlamaForCausalLM + PEFT (tests/test_peft_parity.py's checkpoint and setup)
run on each document ALONE, in float64: the summed cross-entropy of all documents over n_valid, its
gradient, torch AdamW. vktrain runs the packed rows on lavapipe (positions restart at each document). The
bounds are tests/_helpers.py's LOSS_RTOL and DELTA_REL_FROB (float32 through the same ops; derived there),
which PyTorch's own float32 run of the per-document reference meets too. The same batches unpacked (rows
attending across documents) give losses ~1e-2 away, far outside the bound: the masks are what is tested.

Also: the batcher's positions and first-token labels against a brute-force construction; the runner's
refusals of malformed positions; `vktrain export --packing documents` + `vktrain train` on a JSONL file.
"""
from __future__ import annotations

import copy
import dataclasses
import json

import numpy as np
import pytest
import torch

from vktrain.backend.kernel_planning import plan_schedule
from vktrain.export import export_training_and_eval_steps, export_training_step, lower_methods_to_pte, lower_to_pte
from vktrain.contract import EVAL_METHOD, TRAIN_METHOD
from vktrain.lora import LoRAConfig, apply_lora
from vktrain.models import build_model, load
from vktrain.partitioner import VktrainPartitioner
from vktrain.runtime.delegate.executor import ExecutorInputError, GraphExecutor
from vktrain.errors import GraphLoweringError
from vktrain.backend.kernel_planning.op_lowering import lowering_for
from vktrain.runtime.program.runner import TrainingRunner
from vktrain.train.data import IGNORED_LABEL, TokenBatcher

from _helpers import DELTA_REL_FROB, LOSS_RTOL, planned, relative_frobenius_error

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
from test_peft_parity import ALPHA, RANK, _hf_checkpoint, peft_lora_state, peft_model  # noqa: E402
from test_webgpu_parity import RUNTIME_LOSS_RTOL  # noqa: E402

BATCH, SEQ, STEPS = 2, 24, 4


def _packed_batches():
    """(token_ids, labels, positions, document lengths per row) of STEPS packed batches: 2-5 documents a row
    (one-token documents too), labels a function of the token and its predecessor with ~15% ignored."""
    rng = np.random.default_rng(11)
    for _ in range(STEPS):
        lengths = []
        for _row in range(BATCH):
            cuts = np.sort(rng.choice(np.arange(1, SEQ), size=rng.integers(1, 5), replace=False))
            lengths.append(np.diff(np.concatenate([[0], cuts, [SEQ]])).tolist())
        token_ids = rng.integers(0, 32, (BATCH, SEQ))
        labels = (token_ids + 3 * np.roll(token_ids, 1, axis=1)) % 32
        labels[rng.random((BATCH, SEQ)) < 0.15] = IGNORED_LABEL
        positions = np.array([np.concatenate([np.arange(n) for n in row]) for row in lengths])
        yield token_ids, labels, positions, lengths


def _documents(lengths):
    """(row, slice) of every document of a batch."""
    for row, row_lengths in enumerate(lengths):
        start = 0
        for n in row_lengths:
            yield row, slice(start, start + n)
            start += n


def _reference(directory, vk_model, dtype, packed=True, steps=STEPS):
    """transformers + PEFT trained on the first `steps` packed batches, each document run alone
    (packed=False: the rows whole, attending across their documents). Returns (per-step losses, trained
    LoRA tensors)."""
    model, peft_layers, optimizer = peft_model(directory, vk_model, dtype)
    losses = []
    for _, (token_ids, labels, _, lengths) in zip(range(steps), _packed_batches()):
        token_ids, labels = torch.from_numpy(token_ids), torch.from_numpy(labels)
        n_valid = int((labels >= 0).sum())
        optimizer.zero_grad()
        pieces = _documents(lengths) if packed else ((row, slice(0, SEQ)) for row in range(BATCH))
        loss = 0
        for row, part in pieces:
            logits = model(input_ids=token_ids[row:row + 1, part]).logits[0]
            loss = loss + torch.nn.functional.cross_entropy(logits, labels[row, part], ignore_index=IGNORED_LABEL,
                                                            reduction="sum")
        loss = loss / n_valid
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, peft_lora_state(peft_layers)


@pytest.fixture(scope="module")
def packed_program(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf_llama_packed")
    _hf_checkpoint(directory)
    model = load(directory).model
    apply_lora(model, LoRAConfig(rank=RANK, alpha=ALPHA, group_size=32, seed=0, scale_rule="mse"))
    step, evaluation = export_training_and_eval_steps(copy.deepcopy(model), (BATCH, SEQ), packing="documents")
    path = directory / "packed.pte"
    path.write_bytes(lower_methods_to_pte({TRAIN_METHOD: step, EVAL_METHOD: evaluation},
                                          {TRAIN_METHOD: VktrainPartitioner()}))
    return directory, path, model


def test_packed_loss_of_the_model_is_each_document_alone(packed_program):
    """The model's own forward (torch eager, the ops' CPU references, float32) on packed rows with positions
    equals transformers on each document alone (float64) within LOSS_RTOL; without positions it does not."""
    directory, _, model = packed_program
    reference, _, _ = peft_model(directory, model, torch.float64)
    token_ids, labels, positions, lengths = next(_packed_batches())
    n_valid = torch.tensor(float((labels >= 0).sum()))
    with torch.no_grad():
        packed = float(model.loss(torch.from_numpy(token_ids), torch.from_numpy(labels), n_valid,
                                  torch.from_numpy(positions)))
        unpacked = float(model.loss(torch.from_numpy(token_ids), torch.from_numpy(labels), n_valid))
        alone = sum(float(torch.nn.functional.cross_entropy(
            reference(input_ids=torch.from_numpy(token_ids[row:row + 1, part])).logits[0],
            torch.from_numpy(labels[row, part]), ignore_index=IGNORED_LABEL, reduction="sum"))
            for row, part in _documents(lengths)) / float(n_valid)
    assert packed == pytest.approx(alone, rel=LOSS_RTOL)
    assert abs(unpacked - alone) > 1e3 * LOSS_RTOL * alone


def test_packed_steps_match_transformers_peft_on_each_document_alone(vk_device, packed_program):
    directory, path, model = packed_program
    initial = {name: param.detach().double().numpy() for name, param in model.named_parameters()
               if name.endswith(("lora_A", "lora_B"))}
    exact_losses, exact_state = _reference(directory, model, torch.float64)
    single_losses, single_state = _reference(directory, model, torch.float32)
    unpacked_losses, _ = _reference(directory, model, torch.float64, packed=False, steps=1)
    hparams = np.array([1e-2, 0.9, 0.999, 1e-8, 0.01], np.float32)  # test_peft_parity's
    with TrainingRunner.from_pte(path, vk_device, planner=plan_schedule) as runner:
        assert runner.takes_positions
        losses = [runner.step(t, l, hparams, positions=p) for t, l, p, _ in _packed_batches()]
        ours = {name.removeprefix("model."): value for name, value in runner.lora_state().items()}
    assert sorted(ours) == sorted(exact_state)
    # Premise: packing without the masks would be a different computation, far outside the bound.
    assert abs(unpacked_losses[0] - exact_losses[0]) > 1e2 * LOSS_RTOL * exact_losses[0]
    for label, run_losses, run_state in (("vktrain", losses, ours), ("torch float32", single_losses, single_state)):
        np.testing.assert_allclose(run_losses, exact_losses, rtol=LOSS_RTOL,
                                   err_msg=f"{label}: per-step losses vs each document alone (float64)")
        for name in exact_state:
            error = relative_frobenius_error(run_state[name] - initial[name], exact_state[name] - initial[name])
            assert error <= DELTA_REL_FROB, f"{label}: {name}: trained delta off by {error:.2e} (relative)"


def test_packed_eval_and_refusals(vk_device, packed_program):
    """The eval method takes the positions too (its loss sum equals the step's loss times n_valid before
    the update); positions that do not restart or count on are refused naming the entry; a program
    without positions refuses them."""
    _, path, _ = packed_program
    token_ids, labels, positions, _ = next(_packed_batches())
    with TrainingRunner.from_pte(path, vk_device, planner=plan_schedule) as runner:
        loss_sum, count = runner.evaluate(token_ids, labels, positions)
        hparams = np.array([0.0, 0.9, 0.999, 1e-8, 0.0], np.float32)  # lr 0: no update
        assert loss_sum / count == pytest.approx(runner.step(token_ids, labels, hparams, positions=positions),
                                                 rel=1e-6)
        bad = positions.copy()
        bad[1, 5] = bad[1, 4] + 2
        with pytest.raises(ExecutorInputError, match=r"positions\[1, 5\] is .*0 \(a document starts\) or the "
                                                     r"previous one \+ 1"):
            runner.step(token_ids, labels, hparams, positions=bad)
        bad = positions.copy()
        bad[0, 0] = 3
        with pytest.raises(ExecutorInputError, match=r"positions\[0, 0\] is 3.*a row starts with a document"):
            runner.evaluate(token_ids, labels, bad)


def test_batcher_positions_and_document_first_labels():
    """TokenBatcher(documents=...): each row's positions count from its window's start or its document's,
    whichever is later, and a document's first token is no target; brute force over the stream."""
    rng = np.random.default_rng(3)
    starts = np.array([0, 5, 6, 19, 33, 34, 50])
    tokens = rng.integers(0, 100, 61)
    batcher = TokenBatcher(tokens, 2, 8, seed=1, documents=starts)
    plain = TokenBatcher(tokens, 2, 8, seed=1)
    assert plain.fingerprint != batcher.fingerprint and batcher.config()["packing"] == "documents"
    for position in range(6):
        rows, labels, positions = batcher.batch(position)
        plain_rows, plain_labels = plain.batch(position)
        np.testing.assert_array_equal(rows, plain_rows)
        for b, window in enumerate(batcher.window_indices(position)):
            first = window * 8
            for s in range(8):
                offset = first + s
                document = starts[starts <= offset].max()
                assert positions[b, s] == offset - max(document, first)
                target = offset + 1
                expected = IGNORED_LABEL if target in starts else tokens[target]
                assert labels[b, s] == expected == (IGNORED_LABEL if target in starts else plain_labels[b, s])


def test_export_and_train_packed_documents_from_the_command_line(tmp_path):
    """`vktrain export --packing documents` then `vktrain train` on {"text"} rows: the trainer feeds the
    documents' boundaries (it says how many) and the loss falls."""
    from vktrain.cli import main

    pte = tmp_path / "packed.pte"
    assert main(["export", "--model", "tiny-llama", "--lora-rank", "4", "--batch", "2", "--seq", "32",
                 "--packing", "documents", "--out", str(pte)]) == 0
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": f"{'ab' * (i % 7 + 1)} {i % 5}"}) + "\n" for i in range(60)))
    out = tmp_path / "records.json"
    assert main(["train", str(pte), "--data", str(data), "--steps", "12", "--lr", "1e-2", "--no-progress",
                 "--json", str(out)]) == 0
    losses = [record["loss"] for record in json.loads(out.read_text())]
    assert len(losses) == 12 and np.mean(losses[-3:]) < np.mean(losses[:3])


def test_held_out_batches_of_packed_documents():
    """prepare_eval_batches(documents=True): every row's positions count from its start or its document's,
    a document's first token is no target, and without documents the batches are what they always were."""
    from vktrain.train.data import TrainingData
    from vktrain.train.held_out import prepare_eval_batches

    rng = np.random.default_rng(8)
    starts = np.array([0, 3, 4, 15, 22])
    data = TrainingData(rng.integers(0, 50, 30), None, starts)
    plain = prepare_eval_batches(data, (2, 8))
    packed = prepare_eval_batches(data, (2, 8), documents=True)
    assert len(plain) == len(packed) == 2 and all(len(batch) == 2 for batch in plain)
    for index, ((tokens, labels), (packed_tokens, packed_labels, positions)) in enumerate(zip(plain, packed)):
        np.testing.assert_array_equal(tokens, packed_tokens)
        for b in range(2):
            first = (index * 2 + b) * 8
            for s in range(8):
                offset = first + s
                assert positions[b, s] == offset - max(starts[starts <= offset].max(), first)
                masked = offset + 1 in starts and labels[b, s] >= 0
                assert packed_labels[b, s] == (IGNORED_LABEL if masked else labels[b, s])


def test_blobs_from_before_positions_still_load(vk_device, tmp_path):
    """A delegate written before causal_attention(_backward) took positions has one argument fewer per call:
    it plans and runs as a blob with positions None does (same bits), and a call missing a required
    argument is still refused."""
    model = build_model("tiny-llama", n_layers=1)
    apply_lora(model, LoRAConfig(rank=2))
    path = tmp_path / "step.pte"
    path.write_bytes(lower_to_pte(export_training_step(model, (1, 8))))
    with TrainingRunner.from_pte(path, vk_device, planner=plan_schedule, timing=False) as runner:
        graph = runner.graph
        attention = {"vktrain.causal_attention.default": 4, "vktrain.causal_attention_backward.default": 7}
        shortened = [dataclasses.replace(op, args=op.args[:attention[op.name]]) if op.name in attention else op
                     for op in graph.ops]
        assert sum(op.name in attention for op in graph.ops) == 2
        old = dataclasses.replace(graph, ops=shortened)
        rng = np.random.default_rng(0)
        inputs = {"token_ids": rng.integers(0, 256, (1, 8)), "labels": rng.integers(0, 256, (1, 8)),
                  "n_valid": np.float32(8), "hparams": np.array([1e-3, 0.9, 0.999, 1e-8, 0.0], np.float32)}
        arrays = [inputs[name] for name in runner.executor.input_names]
        outputs = []
        for candidate in (graph, old):
            with GraphExecutor(vk_device, candidate, planned(vk_device, candidate), timing=False) as executor:
                outputs.append(executor.run(*arrays))
        for new, before in zip(*outputs):
            np.testing.assert_array_equal(new, before)
        op = next(op for op in graph.ops if op.name in attention)
        with pytest.raises(GraphLoweringError, match="has 3 arguments, its schema has 5"):
            lowering_for(dataclasses.replace(op, args=op.args[:3]), 0)


def test_packed_step_on_webgpu_equals_vulkan(vk_device, webgpu_device, tmp_path):
    """The packed step through the WebGPU runtime (the WGSL DOCUMENTS kernels, per-token rope) gives the
    Vulkan runtime's first loss bit for bit on lavapipe (the same kernels' arithmetic before any update) and
    the next within test_webgpu_parity's RUNTIME_LOSS_RTOL (WGSL's AdamW rounds its bias corrections
    otherwise)."""
    model = build_model("tiny-llama", n_layers=1)
    apply_lora(model, LoRAConfig(rank=2))
    step, evaluation = export_training_and_eval_steps(model, (BATCH, SEQ), packing="documents")
    path = tmp_path / "packed.pte"
    path.write_bytes(lower_methods_to_pte({TRAIN_METHOD: step, EVAL_METHOD: evaluation},
                                          {TRAIN_METHOD: VktrainPartitioner()}))
    hparams = np.array([1e-3, 0.9, 0.999, 1e-8, 0.0], np.float32)
    losses = []
    for device in (vk_device, webgpu_device):
        with TrainingRunner.from_pte(path, device, planner=plan_schedule) as runner:
            losses.append([runner.step(t, l, hparams, positions=p) for t, l, p, _ in list(_packed_batches())[:2]])
    assert losses[0][0] == losses[1][0]
    np.testing.assert_allclose(losses[1], losses[0], rtol=RUNTIME_LOSS_RTOL)
