"""Nothing lost, nothing misleading (issue 24, part A): no output flag of any command replaces one of the
command's inputs, a file vktrain did not write (without --overwrite) or another run's checkpoint; every
output path is checked before anything runs; each error names the flag, the file as typed and the way
out. On the tiny mlp-lora model (exported once for the module), in-process, lavapipe where a run is needed."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from vktrain import cli

MLP = ["--model", "mlp-lora", "--model-arg", "dim=32", "--model-arg", "hidden=64", "--model-arg", "n_layers=1",
       "--lora-rank", "4"]


def run_cli(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    """{name: path} in one directory: step.pte (mlp-lora train-step + eval, batch 2 x 8), forward.pte
    (--program forward), step_only_b4.pte (a training step alone, batch 4 x 8: no eval method, another
    batch), data.txt; run.ckpt, records.json, loss.png and adapters/ from 2 steps of step.pte."""
    pytest.importorskip("torch")
    from _helpers import export_mlp_lora_training_step

    root = tmp_path_factory.mktemp("outputs")
    paths = {name: root / name for name in ("step.pte", "forward.pte", "step_only_b4.pte", "data.txt", "run.ckpt",
                                            "records.json", "loss.png", "adapters")}
    for name, program in (("step.pte", "train-step"), ("forward.pte", "forward")):
        assert cli.main(["export", *MLP, "--batch", "2", "--seq", "8", "--program", program,
                         "--out", str(paths[name])]) == 0
    export_mlp_lora_training_step(paths["step_only_b4.pte"], (4, 8), 256)
    paths["data.txt"].write_text("a few words of byte-level text to train the tiny model on\n" * 4)
    assert cli.main(["train", str(paths["step.pte"]), "--steps", "2", "--data", str(paths["data.txt"]),
                     "--no-progress", "--checkpoint", str(paths["run.ckpt"]), "--json", str(paths["records.json"]),
                     "--plot", str(paths["loss.png"]), "--out-adapters", str(paths["adapters"])]) == 0
    return paths


def _snapshot(paths):
    return {path: path.read_bytes() for path in paths if path.is_file()}


def test_no_output_of_any_command_replaces_one_of_its_inputs(programs, capsys, tmp_path):
    """Each command's output flags, given one of its inputs: refused, naming the flag, the path as typed
    and the input; the input is untouched (was: `train --json step.pte` replaced the program with JSON)."""
    p = programs
    step, data, ckpt, adapters = p["step.pte"], p["data.txt"], p["run.ckpt"], p["adapters"]
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF not really a model")
    cases = [
        (["train", step, "--steps", 1, "--data", data, "--json", step], "--json", step),
        (["train", step, "--steps", 1, "--data", data, "--plot", data], "--plot", data),
        (["train", step, "--steps", 1, "--data", data, "--out-gguf-adapter", data], "--out-gguf-adapter", data),
        (["train", step, "--steps", 1, "--data", data, "--eval-data", ckpt, "--checkpoint", ckpt], "--checkpoint", ckpt),
        (["train", step, "--steps", 1, "--inputs", adapters, "--out-adapters", adapters], "--out-adapters", adapters),
        (["eval", step, "--data", data, "--json", data], "--json", data),
        (["export", "--model", model, "--out", model], "--out", model),
        (["merge", step, "--adapters", adapters, "--out", adapters], "--out", adapters),
        (["adapters", "convert", step, "--checkpoint", ckpt, "--out", ckpt], "--out", ckpt),
        (["generate", "--model", "tiny-llama", "--prompt-ids", "1", "--calibration-data", data, "--json", data],
         "--json", data),
        (["federate", step, "--clients", 1, "--rounds", 1, "--local-steps", 1, "--data", data, "--json", data],
         "--json", data),
    ]
    before = _snapshot([step, data, ckpt, model, adapters / "adapter_config.json"])
    for argv, flag, path in cases:
        code, _, err = run_cli(capsys, *argv)
        assert code == 2 and f"error: {flag} {path} is " in err and "an input of this command" in err, (argv, err)
    assert _snapshot(before) == before


@pytest.mark.parametrize("command, flag", [
    (["train", "{step}", "--steps", 1, "--data", "{data}"], "--json"),
    (["train", "{step}", "--steps", 1, "--data", "{data}"], "--plot"),
    (["train", "{step}", "--steps", 1, "--data", "{data}"], "--out-gguf-adapter"),
    (["train", "{step}", "--steps", 1, "--data", "{data}"], "--checkpoint"),
    (["eval", "{step}", "--data", "{data}"], "--json"),
    (["export", *MLP], "--out"),
    (["adapters", "convert", "{step}", "--checkpoint", "{ckpt}"], "--out"),
    (["generate", "--model", "tiny-llama", "--prompt-ids", "1"], "--json"),
    (["federate", "{step}", "--clients", 1, "--rounds", 1, "--local-steps", 1, "--data", "{data}"], "--json"),
    (["federate", "{step}", "--clients", 1, "--rounds", 1, "--local-steps", 1, "--data", "{data}"], "--plot"),
])
def test_a_file_vktrain_did_not_write_is_refused_unless_overwrite(programs, capsys, tmp_path, command, flag):
    """Every file output onto a user's text file: refused before anything runs (was: overwritten)."""
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    names = {"{step}": programs["step.pte"], "{data}": programs["data.txt"], "{ckpt}": programs["run.ckpt"]}
    argv = [names.get(a, a) if isinstance(a, str) else a for a in command]
    code, _, err = run_cli(capsys, *argv, flag, notes)
    assert code == 2 and f"error: {flag} {notes} exists and is not " in err and "--overwrite" in err, err
    assert notes.read_text() == "my notes\n"


def test_directories_hold_files_vktrain_did_not_write(programs, capsys, tmp_path):
    """--out-adapters / merge --out / federate --checkpoint: refused where a file they write exists and
    is not theirs."""
    p = programs
    foreign = tmp_path / "mine"
    foreign.mkdir()
    for name in ("adapter_model.safetensors", "model.safetensors", "global.safetensors"):
        (foreign / name).write_bytes(b"not vktrain's")
    for argv in (["train", p["step.pte"], "--steps", 1, "--data", p["data.txt"], "--out-adapters", foreign],
                 ["merge", p["step.pte"], "--checkpoint", p["run.ckpt"], "--out", foreign],
                 ["federate", p["step.pte"], "--clients", 1, "--rounds", 1, "--local-steps", 1, "--checkpoint", foreign]):
        code, _, err = run_cli(capsys, *argv)
        assert code == 2 and f"{foreign} holds files vktrain did not write there" in err and "--overwrite" in err, err
    assert all((foreign / name).read_bytes() == b"not vktrain's" for name in os.listdir(foreign))


def test_outputs_vktrain_wrote_are_rewritten_and_overwrite_replaces_a_foreign_file(programs, capsys, tmp_path):
    """A second identical run rewrites its own records, plot and adapters without --overwrite (they are
    recognised by content); --overwrite lets --json replace a text file."""
    p = programs
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    code, _, err = run_cli(capsys, "train", p["step.pte"], "--steps", 1, "--data", p["data.txt"], "--no-progress",
                           "--json", p["records.json"], "--plot", p["loss.png"], "--out-adapters", p["adapters"])
    assert code == 0, err
    assert [r["step"] for r in json.loads(p["records.json"].read_text())] == [1]
    code, _, err = run_cli(capsys, "train", p["step.pte"], "--steps", 1, "--data", p["data.txt"], "--no-progress",
                           "--json", notes, "--overwrite")
    assert code == 0, err
    assert [r["step"] for r in json.loads(notes.read_text())] == [1]
    # federate (sequential engine, no Ray): a resumed federation rewrites its own --json and --checkpoint.
    federate = ["federate", p["step.pte"], "--clients", 1, "--local-steps", 1, "--data", p["data.txt"], "--engine",
                "sequential", "--json", tmp_path / "rounds.json", "--checkpoint", tmp_path / "federation"]
    for rounds, resume in ((1, []), (2, ["--resume"])):
        code, _, err = run_cli(capsys, *federate, "--rounds", rounds, *resume)
        assert code == 0, err
    assert [r["round"] for r in json.loads((tmp_path / "rounds.json").read_text())["rounds"]] == [0, 1, 2]


def test_a_checkpoint_is_never_replaced_by_another_run(programs, capsys, tmp_path):
    """An existing --checkpoint without --resume: refused, naming --resume PATH and --overwrite, the file
    untouched (was: a fresh 1-step run replaced the 2-step checkpoint); --resume continues it."""
    from vktrain.train.checkpoint import load_checkpoint

    p = programs
    ckpt = tmp_path / "run.ckpt"
    ckpt.write_bytes(p["run.ckpt"].read_bytes())
    before = ckpt.read_bytes()
    code, _, err = run_cli(capsys, "train", p["step.pte"], "--steps", 1, "--data", p["data.txt"], "--checkpoint", ckpt)
    assert code == 2 and f"--checkpoint {ckpt} already holds a vktrain checkpoint of another run" in err
    assert f"--resume {ckpt}" in err and "--overwrite" in err
    assert ckpt.read_bytes() == before
    code, _, err = run_cli(capsys, "train", p["step.pte"], "--steps", 3, "--data", p["data.txt"], "--no-progress",
                           "--resume", ckpt, "--checkpoint", ckpt)
    assert code == 0, err
    assert load_checkpoint(ckpt).step == 3
    other = tmp_path / "other.ckpt"
    other.write_bytes(before)  # --resume one checkpoint, --checkpoint another run's: refused too
    code, _, err = run_cli(capsys, "train", p["step.pte"], "--steps", 4, "--data", p["data.txt"], "--resume", ckpt,
                           "--checkpoint", other)
    assert code == 2 and f"--checkpoint {other} already holds" in err and other.read_bytes() == before
    from vktrain.fleet.checkpoint import FederationCheckpoint, save_federation_checkpoint

    federation = tmp_path / "fed"
    save_federation_checkpoint(federation, FederationCheckpoint(0, {"x": np.zeros(2, np.float32)}, "", {}, [{"round": 0}]))
    code, _, err = run_cli(capsys, "federate", p["step.pte"], "--clients", 1, "--rounds", 1, "--local-steps", 1,
                           "--checkpoint", federation)
    assert code == 2 and f"--checkpoint {federation} already holds a federation checkpoint of another run" in err


def test_output_paths_are_checked_before_anything_runs(programs, capsys, tmp_path, monkeypatch):
    """export --out DIR, generate --json DIR: refused before the model is even opened (was: after the
    export / the generation); a parent that is a file is named as typed (was: "File exists" and an
    absolute path); a failed run leaves no empty --out-adapters directory."""
    import vktrain.models

    def never(*args, **kwargs):
        raise AssertionError("the model was opened before the output paths were checked")

    monkeypatch.setattr(vktrain.models, "open_model", never)
    monkeypatch.chdir(tmp_path)
    Path("a-dir").mkdir()
    Path("a-file").write_text("x")
    for argv, message in (
            (["export", *MLP, "--out", "a-dir"], "--out a-dir is a directory; expected a file name"),
            (["generate", "--model", "tiny-llama", "--prompt-ids", "1", "--json", "a-dir"],
             "--json a-dir is a directory; expected a file name"),
            (["generate", "--model", "tiny-llama", "--prompt-ids", "1", "--program-cache", "a-file"],
             "--program-cache a-file is a file; expected a directory"),
            (["train", programs["step.pte"], "--steps", 1, "--json", "a-file/x.json"],
             "--json a-file/x.json: cannot write there (a-file is a file, not a directory)"),
            (["merge", programs["step.pte"], "--checkpoint", programs["run.ckpt"], "--out", "a-file/merged"],
             "--out a-file/merged: cannot write there (a-file is a file, not a directory)"),
            (["adapters", "convert", programs["step.pte"], "--checkpoint", programs["run.ckpt"], "--out", "a-file/a.gguf"],
             "--out a-file/a.gguf: cannot write there (a-file is a file, not a directory)")):
        code, _, err = run_cli(capsys, *argv)
        assert code == 2 and message in err and str(tmp_path) not in err, (argv, err)
    code, _, err = run_cli(capsys, "train", programs["step.pte"], "--steps", 1, "--data", "missing.txt",
                           "--out-adapters", "new/adapters")
    assert code == 2 and "missing.txt does not exist" in err
    assert not Path("new").exists()


def test_messages_name_the_program_and_the_way_out(programs, capsys, tmp_path):
    p = programs
    cases = [
        # A forward program given to train / eval / merge: not a training step (was: "expected the loss").
        (["train", p["forward.pte"], "--steps", 1, "--data", p["data.txt"]], f"{p['forward.pte']} is not a training step"),
        (["eval", p["forward.pte"], "--data", p["data.txt"]], "--program train-step"),
        (["merge", p["forward.pte"], "--checkpoint", p["run.ckpt"], "--out", tmp_path / "m"], "is not a training step"),
        # Resuming onto another export (batch 4): a different program (was: "trained on other data").
        (["train", p["step_only_b4.pte"], "--steps", 3, "--data", p["data.txt"], "--resume", p["run.ckpt"],
          "--checkpoint", tmp_path / "b4.ckpt"], "was written by a run of a different program"),
        # --eval-every with --inputs: the flag does not apply (was: "needs --eval-data", refused with --inputs).
        (["train", p["step.pte"], "--steps", 1, "--inputs", p["data.txt"], "--eval-every", 2],
         "--eval-every cannot apply with --inputs"),
        # No eval method: export both (was: "re-export the training step with this vktrain").
        (["eval", p["step_only_b4.pte"], "--data", p["data.txt"]], "export_training_and_eval_steps"),
        # mlp-lora has no Llama family: no "re-export" that cannot help.
        (["merge", p["step.pte"], "--checkpoint", p["run.ckpt"], "--out", tmp_path / "m"],
         "exported from 'mlp-lora', of family None (not a Llama-family language model)"),
        (["train", p["step.pte"], "--steps", 1, "--data", p["data.txt"], "--out-gguf-adapter", tmp_path / "a.gguf"],
         "a GGUF adapter needs a language model of family llama"),
        # Beyond the KV cache: --cache-length (was: "export it with a longer cache"), before any export.
        (["generate", "--model", "tiny-llama", "--prompt-ids", "1,2", "--max-new-tokens", 300, "--cache-length", 64],
         "--cache-length is 64: pass --cache-length 302"),
        # inspect names the file (was: "<bytes>").
        (["inspect", p["data.txt"]], f"{p['data.txt']}: "),
    ]
    for argv, message in cases:
        code, _, err = run_cli(capsys, *argv)
        assert code == 2 and message in err and "re-export" not in err and "<bytes>" not in err, (argv, err)
    assert not (tmp_path / "m").exists()


def test_values_that_were_accepted_silently_are_refused(programs, capsys):
    p = programs
    code, _, err = run_cli(capsys, "train", p["step.pte"], "--steps", 1, "--data", p["data.txt"], "--checkpoint",
                           p["step.pte"].parent / "every0.ckpt", "--checkpoint-every", 0)
    assert code == 2 and "--checkpoint-every must be >= 1, got 0" in err
    code, _, err = run_cli(capsys, "train", p["step.pte"], "--steps", 1, "--data", p["data.txt"], "--no-progress",
                           "--max-binding-mib", 1 << 30)
    assert code == 2 and "is above the device's max storage binding size" in err, err


def test_json_rows_are_read_as_rows_and_as_bytes_without_a_tokenizer(tmp_path):
    """*.jsonl {"text"} rows for a program without a tokenizer (vocabulary 256): each row's UTF-8 bytes
    and a newline (was: refused); a .json array of rows reads the same (was: its JSON text as bytes);
    a .json that is no array is refused."""
    from vktrain.train.data import DataError, load_data

    rows = [{"text": "héllo"}, {"text": "wörld"}]
    expected = list("héllo\nwörld\n".encode("utf-8"))
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "d.json").write_text(json.dumps(rows))
    assert load_data(tmp_path / "d.jsonl", 256).tokens.tolist() == expected
    assert load_data(tmp_path / "d.json", 256).tokens.tolist() == expected
    (tmp_path / "o.json").write_text(json.dumps({"text": "x"}))
    with pytest.raises(DataError, match=r"o.json: a .json data file holds one array of rows"):
        load_data(tmp_path / "o.json", 256)


def test_generate_refuses_a_model_that_is_not_a_language_model_it_can_run(capsys):
    code, _, err = run_cli(capsys, "generate", "--model", "mlp-lora", "--prompt-ids", "1")
    assert code == 2 and err.startswith("vktrain generate: error: --model mlp-lora is not a Llama-family language "
                                        "model (MLPLanguageModel)"), err


def test_a_gguf_adapter_is_told_apart_from_a_gguf_model(tmp_path):
    """--out-gguf-adapter / convert --out replace a LoRA adapter GGUF, never a model GGUF."""
    import gguf

    from vktrain.train.outputs import GGUF_ADAPTER

    for name, kind in (("adapter.gguf", gguf.GGUFType.ADAPTER), ("model.gguf", gguf.GGUFType.MODEL)):
        writer = gguf.GGUFWriter(str(tmp_path / name), "llama")
        writer.add_type(kind)
        writer.add_tensor("t", np.zeros(4, np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    assert GGUF_ADAPTER.recognise(tmp_path / "adapter.gguf")
    assert not GGUF_ADAPTER.recognise(tmp_path / "model.gguf")
