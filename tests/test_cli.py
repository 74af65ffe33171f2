"""The command line's contract: every bad input or environmental failure ends in ONE line
`vktrain <cmd>: error: ...` and exit 2, Ctrl-C in 130 (SIGTERM 143) without a traceback, an internal bug in one line
saying how to see the traceback; every `vktrain train` argument and output path is checked before the
program is even loaded; Vulkan validation messages are shown; success is quiet."""
from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

from vktrain import cli
from vktrain.runtime.vk.device import ValidationMessage
from vktrain.runtime.vk.errors import VulkanError
from vktrain.train import checkpoint as ckpt

VOCAB, BATCH, SEQ = 16, 2, 4


class TinyRunner:
    """The smallest StepRunner the CLI can train: one state tensor, a loss that depends on it."""

    batch_shape, vocab_size = (BATCH, SEQ), VOCAB

    def __init__(self, messages=()):
        self.state = {"model.w.lora_A": np.ones((2, 3), np.float32), "model.w.lora_B": np.zeros((4, 2), np.float32),
                      "optimizer.step": np.zeros((), np.float32)}
        self.steps = 0
        self.device = _MessageDevice(messages)

    @property
    def state_names(self):
        return list(self.state)

    def read_state(self, name):
        return self.state[name].copy()

    def write_state(self, name, array):
        self.state[name] = np.array(array, copy=True)

    def step(self, tokens, labels, hparams):
        self.steps += 1
        self.state["optimizer.step"] = self.state["optimizer.step"] + np.float32(1)
        loss = float(self.state["model.w.lora_A"].sum())
        self.state["model.w.lora_A"] = self.state["model.w.lora_A"] * np.float32(1 - hparams[0])
        return loss

    def gemm_report(self):
        return "GEMM precision fp32: numpy"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


class _MessageDevice:
    def __init__(self, messages):
        self.messages = list(messages)

    def take_validation_messages(self):
        taken, self.messages = self.messages, []
        return taken


@pytest.fixture
def program(tmp_path, monkeypatch):
    """(pte path, data path, runners made, a dict whose 'load' replaces TrainingRunner.from_pte's body)."""
    from vktrain.runtime.program import runner as runner_mod

    made, behaviour = [], {}

    def from_pte(path, device=None, **options):
        if "load" in behaviour:
            return behaviour["load"]()
        made.append(TinyRunner(behaviour.get("messages", ())))
        return made[-1]

    monkeypatch.setattr(runner_mod.TrainingRunner, "from_pte", staticmethod(from_pte))
    pte = tmp_path / "step.pte"
    pte.write_bytes(b"a stand-in program")
    data = tmp_path / "ids.npy"
    np.save(data, np.arange(200) % VOCAB)
    return pte, data, made, behaviour


def run_cli(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def test_an_8_byte_file_is_a_clean_error_in_train_and_inspect(tmp_path, capsys):
    bad = tmp_path / "bad.pte"
    bad.write_bytes(b"\0\0\0\0ET12")  # was: KeyError in train, TypeError in inspect
    code, _, err = run_cli(capsys, "train", bad, "--steps", 1, "--no-progress")
    assert code == 2 and err.startswith(f"vktrain train: error: {bad} has no execution plan 'forward'")
    assert err.count("\n") == 1
    code, _, err = run_cli(capsys, "inspect", bad)
    assert code == 2 and err == f"vktrain inspect: error: {bad}: expected a .pte with one method, found 0 ([])\n"


def test_a_malformed_model_arg_is_a_clean_error(tmp_path, capsys):
    code, _, err = run_cli(capsys, "export", "--model", "mlp-lora", "--model-arg", "dim", "--out", tmp_path / "x.pte")
    assert code == 2 and err == "vktrain export: error: --model-arg expects KEY=VALUE, got 'dim'\n"


def test_export_refuses_a_head_dim_the_attention_kernels_cannot_run(tmp_path, capsys):
    from vktrain.backend.kernel_planning.kernels.attention import SUPPORTED_HEAD_DIMS

    out = tmp_path / "x.pte"  # tiny-llama has 4 heads: dim=32 gives D=8, which `vktrain train` refused at load
    code, _, err = run_cli(capsys, "export", "--model", "tiny-llama", "--model-arg", "dim=32", "--out", out)
    assert code == 2 and err.startswith("vktrain export: error: --model tiny-llama: head dim dim / n_heads = 32 / 4 = 8 "
                                        f"is not supported; the attention kernels take head dims {SUPPORTED_HEAD_DIMS}")
    assert "--model-arg dim=" in err and not out.exists()


def test_an_internal_error_is_one_line_that_says_how_to_get_the_traceback(program, capsys, monkeypatch):
    pte, data, made, behaviour = program

    def buggy():
        raise KeyError("plan value 7")

    behaviour["load"] = buggy
    monkeypatch.delenv(cli.TRACEBACK_ENV, raising=False)
    code, _, err = run_cli(capsys, "train", pte, "--steps", 1, "--data", data)
    assert code == cli.EXIT_INTERNAL
    assert err == ("vktrain train: internal error: KeyError: 'plan value 7' (a bug in vktrain; run with "
                   "VKTRAIN_TRACEBACK=1 for the traceback)\n")
    monkeypatch.setenv(cli.TRACEBACK_ENV, "1")
    with pytest.raises(KeyError, match="plan value 7"):
        cli.main(["train", str(pte), "--steps", "1", "--data", str(data)])


@pytest.mark.parametrize("failure, message", [
    (MemoryError(), "vktrain train: error: out of host memory\n"),
    (VulkanError("vkAllocateMemory", -2, "VK_ERROR_OUT_OF_DEVICE_MEMORY"),
     "vktrain train: error: vkAllocateMemory failed with VK_ERROR_OUT_OF_DEVICE_MEMORY (-2)\n"),
    (KeyboardInterrupt(), "\nvktrain train: interrupted (SIGINT)\n"),  # Ctrl-C while loading: exit 130, one line
])
def test_environmental_failures_while_loading(program, capsys, failure, message):
    pte, data, made, behaviour = program

    def fail():
        raise failure

    behaviour["load"] = fail
    code, _, err = run_cli(capsys, "train", pte, "--steps", 1, "--data", data)
    assert code == (130 if isinstance(failure, KeyboardInterrupt) else 2)
    assert err.startswith(message) and (message or err == "")


def test_a_full_disk_names_the_file_being_written(program, capsys, monkeypatch):
    pte, data, made, _ = program

    def no_space(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ckpt.os, "fsync", no_space)
    out = pte.parent / "run.ckpt"
    code, _, err = run_cli(capsys, "train", pte, "--steps", 2, "--data", data, "--checkpoint", out, "--no-progress")
    assert code == 2 and err.splitlines()[-1] == f"vktrain train: error: cannot write {out}: No space left on device"
    assert sorted(p.name for p in pte.parent.iterdir()) == ["ids.npy", "step.pte"]  # no temporary file left


@pytest.mark.parametrize("flags, message", [
    (["--lora-alpha", "-3"], "--lora-alpha must be a positive number, got -3.0"),
    (["--eps", "1e-50"], "AdamW eps must be a positive finite float32, got 1e-50 (float32: 0.0)"),
    (["--lr", "1e39"], "the learning rate must be a positive finite float32, got 1e+39 (float32: inf)"),
    (["--lr", "1e-50"], "the learning rate must be a positive finite float32, got 1e-50 (float32: 0.0)"),
    (["--weight-decay", "1e39"], "AdamW weight decay must be a finite float32 >= 0, got 1e+39"),
    (["--lr", "1e20", "--weight-decay", "1e20"], "learning rate 1e+20 x weight decay 1e+20 overflows float32"),
    (["--beta2", "0.9999999999"], "AdamW beta2 must lie in [0, 1) in float32, got 0.9999999999 (rounds to 1.0"),
    (["--steps", str(2**24 + 1)], "at most 16777216 (AdamW's step counter is float32)"),
    (["--keep-checkpoints", "0"], "--keep-checkpoints must be >= 1, got 0"),
    (["--log-every", "-1"], "--log-every must be >= 0, got -1"),
    (["--seed", "-1"], "--seed must lie in [0, 2**32), got -1"),
])
def test_arguments_are_checked_as_float32_before_the_program_loads(program, capsys, flags, message):
    pte, data, made, _ = program
    argv = ["train", pte, "--steps", 3, "--data", data, *flags]
    if "--steps" in flags:
        del argv[2:4]
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and err.startswith("vktrain train: error: ") and message in err, err
    assert not made


def test_output_paths_are_checked_before_the_program_loads(program, capsys, tmp_path):
    pte, data, made, _ = program
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    (tmp_path / "a-dir").mkdir()
    cases = [
        (["--out-adapters", a_file], f"--out-adapters {a_file} is a file; expected a directory"),
        (["--out-adapters", a_file / "sub"], f"--out-adapters {a_file / 'sub'}: cannot write there"),
        (["--json", tmp_path / "a-dir"], f"--json {tmp_path / 'a-dir'} is a directory; expected a file name"),
        (["--plot", a_file / "loss.png"], f"--plot {a_file / 'loss.png'}: cannot write there"),
        (["--checkpoint", a_file / "run.ckpt"], f"--checkpoint {a_file / 'run.ckpt'}: cannot write there"),
    ]
    if os.path.isdir("/proc/self"):  # a directory nobody can create files in, root included
        cases.append((["--json", "/proc/self/vktrain.json"], "--json /proc/self/vktrain.json: cannot write there"))
    for flags, message in cases:
        code, _, err = run_cli(capsys, "train", pte, "--steps", 2, "--data", data, *flags)
        assert code == 2 and message in err, (flags, err)
    assert not made
    # Missing parents are created (before training, too).
    nested = tmp_path / "new" / "deeper"
    code, _, err = run_cli(capsys, "train", pte, "--steps", 2, "--data", data, "--json", nested / "log.json",
                         "--out-adapters", nested / "adapters", "--lora-alpha", 4, "--no-progress")
    assert code == 0, err
    assert (nested / "log.json").is_file() and (nested / "adapters" / "adapter_config.json").is_file()


def test_malformed_checkpoints_are_refused_before_the_program_loads(program, capsys, tmp_path):
    pte, data, made, _ = program
    good = tmp_path / "run.ckpt"
    assert run_cli(capsys, "train", pte, "--steps", 3, "--data", data, "--checkpoint", good, "--no-progress")[0] == 0
    made.clear()
    original = ckpt.load_checkpoint(good)
    header = {key: value for key, value in _metadata(good).items()}

    def rewritten(name, **changes):
        path = tmp_path / name
        import safetensors.numpy
        path.write_bytes(safetensors.numpy.save(original.tensors, metadata={**header, **changes}))
        return path

    cases = {
        rewritten("far.ckpt", data_position=str(10**12)): "data_position 1000000000000 does not match step 3",
        rewritten("records.ckpt", records='{"step": 1}'): "records must be a list of one record per step 1..3",
        rewritten("loss.ckpt", records='[{"step": 1, "loss": "x", "lr": 1}]'): "records must be a list",
        rewritten("json.ckpt", config="{"): "checkpoint metadata 'config' is not valid JSON",
        rewritten("nosums.ckpt", checksums="{}"): "'checksums' must list every tensor",
    }
    raw = bytearray(good.read_bytes())
    raw[-3] ^= 0x10  # one bit of tensor data
    flipped = tmp_path / "flipped.ckpt"
    flipped.write_bytes(bytes(raw))
    cases[flipped] = "does not match its checksum (the file is corrupt)"
    for path, message in cases.items():
        code, _, err = run_cli(capsys, "train", pte, "--steps", 5, "--data", data, "--resume", path)
        assert code == 2 and message in err and str(path) in err, (path, err)
    assert not made


def _metadata(path):
    import safetensors

    with safetensors.safe_open(str(path), framework="numpy") as file:
        return file.metadata()


def test_validation_messages_are_printed_and_errors_fail_the_run(program, capsys):
    pte, data, made, behaviour = program
    warning = ValidationMessage("warning", "performance", "BestPractices-x", "a slow path")
    error = ValidationMessage("error", "validation", "VUID-vkCmdDispatch-00001", "descriptor out of range")
    behaviour["messages"] = [warning]
    code, _, err = run_cli(capsys, "train", pte, "--steps", 2, "--data", data, "--no-progress")
    assert code == 0 and f"vktrain train: vulkan validation: {warning}\n" in err
    behaviour["messages"] = [warning, error]
    code, _, err = run_cli(capsys, "train", pte, "--steps", 2, "--data", data, "--no-progress")
    assert code == 2 and f"vulkan validation: {error}" in err
    assert "error: the Vulkan validation layer reported 1 error(s)" in err


def test_silencing_drops_exactly_the_known_import_noise(caplog):
    cli._silence_known_import_noise()
    with caplog.at_level(logging.WARNING):
        logging.getLogger("torchao").warning("Failed to load /x/site-packages/torchao/_C_mxfp8.abi3.so: no CUDA")
        logging.getLogger("torchao").warning("Failed to load /x/site-packages/torchao/kernels.py: real problem")
        logging.getLogger("torch.utils._pytree").warning(
            "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by torch.compile ...")
        logging.getLogger("torch.utils._pytree").warning("something else about pytrees")
    assert [r.getMessage()[:40] for r in caplog.records] == ["Failed to load /x/site-packages/torchao/",
                                                             "something else about pytrees"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        cli._silence_known_import_noise()
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use ...", FutureWarning)
        warnings.warn("a real deprecation", FutureWarning)
    assert [str(w.message) for w in caught] == ["a real deprecation"]


def test_export_and_inspect_print_nothing_on_stderr(tmp_path):
    pytest.importorskip("torch")
    path = tmp_path / "step.pte"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def run(*argv):
        return subprocess.run([sys.executable, "-m", "vktrain.cli", *argv], capture_output=True, text=True,
                              timeout=300, cwd=root)

    exported = run("export", "--model", "mlp-lora", "--model-arg", "dim=32", "--model-arg", "hidden=64",
                   "--model-arg", "n_layers=1", "--lora-rank", "4", "--batch", "2", "--seq", "8", "--out", str(path))
    assert exported.returncode == 0 and exported.stderr == "" and exported.stdout.splitlines()[-1].startswith(f"wrote {path}")
    inspected = run("inspect", str(path))
    assert inspected.returncode == 0 and inspected.stderr == ""
    assert f"{path}: " in inspected.stdout and "delegate 0: VktrainVulkanBackend" in inspected.stdout

    # inspect needs neither torch nor executorch (one torch-free .pte reader): the same report with both
    # unimportable.
    blocked = ("import sys, importlib.abc\n"
               "class Block(importlib.abc.MetaPathFinder):\n"
               "    def find_spec(self, name, path=None, target=None):\n"
               "        if name.split('.')[0] in ('torch', 'executorch', 'torchao'):\n"
               "            raise ImportError(f'{name} is blocked')\n"
               "sys.meta_path.insert(0, Block())\n"
               "from vktrain import cli\n"
               f"sys.exit(cli.main(['inspect', {str(path)!r}]))\n")
    torch_free = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True, timeout=120, cwd=root)
    assert torch_free.returncode == 0 and torch_free.stderr == "", torch_free.stderr
    assert torch_free.stdout == inspected.stdout


def test_text_is_refused_for_a_vocabulary_other_than_bytes(program, capsys, tmp_path):
    """Byte-level text with a 49152-token model would train on byte ids without any error (issue 9's
    trap): refused, naming the file, the vocabulary and what to pass instead."""
    pte, _, made, _ = program
    assert VOCAB != 256
    text = tmp_path / "notes.txt"
    text.write_text("some text for a model with its own tokenizer\n" * 20)
    code, _, err = run_cli(capsys, "train", pte, "--steps", 1, "--data", text, "--no-progress")
    assert code == 2 and err.startswith(f"vktrain train: error: {text} would be read as byte-level text")
    assert f"vocabulary has {VOCAB} tokens" in err and ".npy" in err
    assert all(runner.steps == 0 for runner in made)  # refused before any step


def test_adapted_layer_paths_are_summarized_by_block_pattern():
    from vktrain.cli import summarize_layer_paths
    paths = [f"model.layers.{i}.{name}" for i in range(30) for name in ("self_attn.q_proj", "mlp.up_proj")]
    assert summarize_layer_paths(paths) == "model.layers.{0..29}.self_attn.q_proj, model.layers.{0..29}.mlp.up_proj"
    assert summarize_layer_paths(["m.blocks.0.fc", "m.blocks.2.fc", "head"]) == "m.blocks.{0,2}.fc, head"
    assert summarize_layer_paths(["model.layers.0.mlp.down_proj", "layers.0"]) == "model.layers.0.mlp.down_proj, layers.0"


def test_exports_with_one_seed_are_the_same_program_and_another_seed_changes_the_adapters(tmp_path):
    pytest.importorskip("torch")

    def export(name, *seed):
        path = tmp_path / name
        assert cli.main(["export", "--model", "mlp-lora", "--model-arg", "dim=32", "--model-arg", "hidden=64",
                         "--model-arg", "n_layers=1", "--lora-rank", "4", "--batch", "2", "--seq", "8",
                         *seed, "--out", str(path)]) == 0
        return path.read_bytes()

    first = export("a.pte")
    # Whatever drew from torch's global RNG in between (imports do), the seed fixes the program.
    import torch

    torch.rand(17)
    assert export("b.pte") == first
    other = export("c.pte", "--seed", "1")
    assert other != first and len(other) == len(first)  # the same program, other initial adapters
