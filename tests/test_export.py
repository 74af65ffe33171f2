"""export_training_step / export_forward / lower_to_pte, and the CLI (export + inspect) end to end."""
from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch
from torch.export.graph_signature import InputKind

from vktrain.export import (HPARAM_NAMES, LoweringError, STEP_BUFFER, example_training_inputs, export_forward, export_training_step,
                            lower_to_pte, training_state_names)
from vktrain.runtime.program.summary import read_pte, summarize_pte
from vktrain.lora import LoRAConfig, apply_lora, lora_parameter_names
from vktrain.models import build_model
from vktrain.ops import adamw_hparams
from vktrain.partitioner import VktrainPartitioner

from _helpers import DELTA_REL_FROB, relative_frobenius_error

BATCH = (2, 8)


def _lora_model():
    model = build_model("mlp-lora", dim=32, hidden=64, n_layers=2, seed=1)
    apply_lora(model, LoRAConfig(rank=4, alpha=8, group_size=32))
    torch.manual_seed(3)
    with torch.no_grad():  # B = 0 would zero lora_A's first gradient; make every gradient non-trivial
        for name, param in model.named_parameters():
            if name.endswith("lora_B"):
                param.normal_(std=0.05)
    return model


@pytest.fixture(scope="module")
def model():
    return _lora_model()


@pytest.fixture(scope="module")
def step_program(model):
    return export_training_step(model, BATCH)


def _batches(n, seed=10):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        ids = torch.randint(0, 256, BATCH, generator=gen)
        labels = torch.randint(0, 256, BATCH, generator=gen)
        labels[0, :3] = -100  # ignored positions
        yield ids, labels, (labels >= 0).sum().to(torch.float32)


def test_step_program_signature(step_program, model):
    sig = step_program.graph_signature
    user_inputs = [s for s in sig.input_specs if s.kind == InputKind.USER_INPUT]
    assert [s.arg.name for s in user_inputs] == ["token_ids", "labels", "hparams", "n_valid"]
    placeholders = {n.name: n.meta["val"] for n in step_program.graph.nodes if n.op == "placeholder"}
    assert (placeholders["token_ids"].dtype, tuple(placeholders["token_ids"].shape)) == (torch.int64, BATCH)
    assert (placeholders["hparams"].dtype, tuple(placeholders["hparams"].shape)) == (torch.float32, (5,))
    assert (placeholders["n_valid"].dtype, tuple(placeholders["n_valid"].shape)) == (torch.float32, ())
    assert HPARAM_NAMES == ("lr", "beta1", "beta2", "eps", "weight_decay")

    lora = lora_parameter_names(model)
    roles = training_state_names(step_program)
    assert sorted(roles["lora"]) == sorted(f"model.{p}" for p in lora)
    assert sorted(roles["exp_avg"]) == sorted(f"optimizer.exp_avg.{p}" for p in lora)
    assert sorted(roles["exp_avg_sq"]) == sorted(f"optimizer.exp_avg_sq.{p}" for p in lora)
    assert roles["step"] == [STEP_BUFFER]
    mutated = set(sig.buffers_to_mutate.values())
    assert mutated == {name for names in roles.values() for name in names}
    # The frozen base is constant: nothing else is mutated, and no parameter is trainable.
    assert "model.layers.0.weights" in sig.buffers and "model.layers.0.weights" not in mutated
    assert not sig.parameters


def test_exported_step_matches_eager_adamw_for_three_steps(step_program, model):
    lr, betas, eps, wd = 3e-2, (0.8, 0.95), 1e-6, 0.1
    hparams = adamw_hparams(lr, betas[0], betas[1], eps, wd)
    program_module = copy.deepcopy(step_program).module()
    eager = copy.deepcopy(model)
    params = [eager.get_parameter(p) for p in lora_parameter_names(eager)]
    initial_lora = {p: eager.get_parameter(p).detach().numpy().copy() for p in lora_parameter_names(eager)}
    optimizer = torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=wd)

    for ids, labels, n_valid in _batches(3):
        loss = program_module(ids, labels, hparams, n_valid)
        optimizer.zero_grad()
        eager_loss = eager.loss(ids, labels, n_valid)
        eager_loss.backward()
        optimizer.step()
        torch.testing.assert_close(loss, eager_loss.detach(), rtol=1e-5, atol=1e-6)

    assert program_module.get_buffer(STEP_BUFFER).item() == 3.0
    # Per tensor, in relative Frobenius norm (elementwise AdamW state is ill-conditioned: see _helpers).
    for path in lora_parameter_names(eager):
        initial = initial_lora[path]
        delta = program_module.get_buffer(f"model.{path}").numpy() - initial
        assert relative_frobenius_error(delta, eager.get_parameter(path).detach().numpy() - initial) <= DELTA_REL_FROB
        state = optimizer.state[eager.get_parameter(path)]
        for moment in ("exp_avg", "exp_avg_sq"):
            actual = program_module.get_buffer(f"optimizer.{moment}.{path}").numpy()
            assert relative_frobenius_error(actual, state[moment].numpy()) <= DELTA_REL_FROB, (path, moment)
    # The step really trained: the adapters moved away from the initial ones.
    assert not torch.allclose(program_module.get_buffer("model.head.lora_A"), model.head.lora_A)


def test_hparams_are_runtime_inputs(step_program, model):
    program_module = copy.deepcopy(step_program).module()
    ids, labels, n_valid = next(_batches(1))
    before = program_module.get_buffer("model.head.lora_B").clone()
    program_module(ids, labels, adamw_hparams(0.0, weight_decay=0.0), n_valid)  # lr = 0: no change
    torch.testing.assert_close(program_module.get_buffer("model.head.lora_B"), before, rtol=0, atol=0)
    assert program_module.get_buffer(STEP_BUFFER).item() == 1.0
    assert program_module.get_buffer("optimizer.exp_avg.head.lora_B").abs().sum() > 0
    program_module(ids, labels, adamw_hparams(1e-2), n_valid)
    assert not torch.equal(program_module.get_buffer("model.head.lora_B"), before)


def test_export_forward_with_and_without_adapters(model):
    ids = torch.randint(0, 256, BATCH, generator=torch.Generator().manual_seed(5))
    with_adapters = export_forward(model, BATCH, with_adapters=True)
    base_only = export_forward(model, BATCH, with_adapters=False)
    expected = model(ids).detach()
    torch.testing.assert_close(with_adapters.module()(ids), expected, rtol=1e-5, atol=1e-5)
    base = copy.deepcopy(model)
    with torch.no_grad():
        for name, param in base.named_parameters():
            if name.endswith("lora_B"):
                param.zero_()
    torch.testing.assert_close(base_only.module()(ids), base(ids).detach(), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(base_only.module()(ids), expected, atol=1e-4)
    assert all(model.get_submodule(p).adapter_enabled for p in ("layers.0", "head"))  # caller's model untouched


def test_forward_lowers_into_one_delegate(model):
    pte = lower_to_pte(export_forward(model, BATCH))
    contents = read_pte(pte)
    assert contents.delegate_calls == 1 and contents.kernel_calls == 0 and contents.operators == []
    summary = summarize_pte(pte)["delegates"][0]
    assert summary["mutable_state"] == []
    assert summary["op_histogram"]["vktrain.linear_q4gsw.default"] == 3


@pytest.mark.parametrize("blocked, message", [
    # The optimizer ends up in a second delegate whose outputs are unused: ExecuTorch would drop it.
    ("getitem", "delegate\\(s\\) were dropped"),
    # The state is read by a delegate and updated outside it.
    ("vktrain.adamw.default", "executorch failed to lower"),
])
def test_lowering_never_silently_loses_the_optimizer_state(blocked, message):
    model = build_model("mlp-lora", dim=16, hidden=16, n_layers=1)
    apply_lora(model, LoRAConfig(rank=2, group_size=16))
    program = export_training_step(model, (1, 4))
    with pytest.raises(LoweringError, match=message):
        lower_to_pte(program, VktrainPartitioner(operator_blocklist=[blocked]))


def test_bad_arguments():
    with pytest.raises(ValueError, match="no LoRA adapters"):
        export_training_step(build_model("mlp-lora", dim=8, hidden=8), BATCH)
    with pytest.raises(ValueError, match="batch_shape must be"):
        export_training_step(_lora_model(), (2,))
    with pytest.raises(ValueError, match="batch_shape must be positive"):
        export_forward(_lora_model(), (0, 4))
    with pytest.raises(ValueError, match="must be positive"):
        example_training_inputs(0, 3)


# ---------------------------------------------------------------------------------------------------
# CLI


def _cli(*args, check=True):
    result = subprocess.run([sys.executable, "-m", "vktrain.cli", *args], capture_output=True, text=True, timeout=300)
    if check and result.returncode != 0:
        raise AssertionError(f"vktrain {' '.join(args)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return result


def test_cli_export_and_inspect(tmp_path):
    out = tmp_path / "step.pte"
    result = _cli("export", "--model", "mlp-lora", "--model-arg", "dim=32", "--model-arg", "hidden=32",
                  "--model-arg", "n_layers=1", "--lora-rank", "2", "--group-size", "16", "--targets", "layers.*",
                  "--batch", "1", "--seq", "4", "--out", str(out))
    assert "adapting 1 layer(s) with LoRA rank 2" in result.stdout and result.stdout.splitlines()[0].endswith(": layers.0")
    assert "(LoRA on 1 layer(s), listed above; 1 delegate(s), 0 refused node(s))" in result.stdout
    assert out.exists() and [p.name for p in tmp_path.iterdir()] == ["step.pte"]  # no temp file left behind

    report = json.loads(_cli("inspect", str(out), "--json").stdout)
    assert report["delegate_calls"] == 1 and report["kernel_calls"] == 0 and report["operators"] == []
    (delegate,) = report["delegates"]
    assert delegate["backend_id"] == "VktrainVulkanBackend"
    assert delegate["op_histogram"]["vktrain.adamw.default"] == 2  # lora_A and lora_B of layers.0
    assert delegate["constants"]["tensor_layouts"]["Q4GSW_W4X8"] == 1
    assert 0 < delegate["memory"]["planned_bytes"] < delegate["memory"]["unplanned_bytes"]
    assert {s["name"] for s in delegate["mutable_state"]} == {
        "model.layers.0.lora_A", "model.layers.0.lora_B", "optimizer.exp_avg.layers.0.lora_A",
        "optimizer.exp_avg.layers.0.lora_B", "optimizer.exp_avg_sq.layers.0.lora_A",
        "optimizer.exp_avg_sq.layers.0.lora_B", "optimizer.step"}
    assert report["refusals"] == []

    text = _cli("inspect", str(out)).stdout
    for fragment in ("1 delegate call(s), 0 kernel call(s)", "operator table: (empty)", "vktrain.fused_ce.default",
                     "planned GPU memory:", "mutable state: 7 tensor(s)", "refused nodes: 0"):
        assert fragment in text


def test_cli_errors(tmp_path):
    result = _cli("export", "--model", "no-such-model", "--out", str(tmp_path / "x.pte"), check=False)
    assert result.returncode == 2 and "unknown model 'no-such-model'" in result.stderr
    result = _cli("export", "--model", "mlp-lora", "--targets", "nothing*", "--out", str(tmp_path / "x.pte"),
                  check=False)
    assert result.returncode == 2 and "nothing to train" in result.stderr
    assert not (tmp_path / "x.pte").exists()
    result = _cli("inspect", str(tmp_path / "missing.pte"), check=False)
    assert result.returncode == 2 and "cannot read" in result.stderr


def test_tied_weight_is_not_carried_twice_into_the_program():
    """A tied LM head left without LoRA is listed under two names; the unread copy must not stay an input
    (ExecuTorch would serialise it into the .pte as a second full-size constant)."""
    from torch.export.graph_signature import InputKind

    from vktrain.export import export_training_step
    from vktrain.lora import LoRAConfig, apply_lora
    from vktrain.models import build_model

    model = build_model("tiny-llama")
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets="*_proj", group_size=32, seed=0))
    program = export_training_step(model, (1, 8))
    weight_kinds = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    unread = [s.target for s in program.graph_signature.input_specs
              if s.kind in weight_kinds and not placeholders[s.arg.name].users]
    assert unread == []
    embedding = model.model.embed_tokens.weight
    same_storage = [name for name, t in program.state_dict.items()
                    if t.shape == embedding.shape and torch.equal(t, embedding.detach())]
    assert len(same_storage) == 1, same_storage
