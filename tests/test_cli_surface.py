"""The command line as a user meets it: every flag of every command in README.md's synopsis of that
command, the defaults in `--help`, `vktrain --version`, `vktrain inspect`'s state summary."""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from vktrain import cli, inspect_command

ROOT = Path(__file__).resolve().parents[1]


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command words, its parser) for `parser` and every subcommand under it."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, path + (name,))


def _long_flags(parser: argparse.ArgumentParser) -> list[str]:
    return [flag for action in parser._actions for flag in action.option_strings
            if flag.startswith("--") and flag != "--help"]


def _synopses(commands: list[str]) -> dict[str, str]:
    """README.md's "## Command line" block, one text per command of `commands` ("", "train", "adapters
    convert", ...): the lines that start `vktrain <command>` and the indented lines that continue them."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Command line\n```bash\n(.*?)```", text, re.DOTALL)
    assert block, "README.md has no '## Command line' bash block"
    synopses: dict[str, str] = {}
    command = None
    for line in block.group(1).splitlines():
        if line.startswith("vktrain"):
            prefixes = {c: " ".join(["vktrain", c, ""]).replace("  ", " ") for c in commands}
            command = max((c for c, prefix in prefixes.items() if f"{line} ".startswith(prefix)), key=len)
        synopses[command] = synopses.get(command, "") + line + "\n"
    return synopses


def test_the_readme_synopsis_of_every_command_names_each_of_its_flags():
    commands = list(_commands(cli.build_parser()))
    synopses = _synopses([" ".join(words) for words, _ in commands])
    missing = []
    for words, parser in commands:
        command = " ".join(words)
        for flag in _long_flags(parser):
            if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", synopses.get(command, "")):
                missing.append(f"vktrain {command} {flag}".replace("  ", " "))
    assert not missing, "README.md's synopses lack: " + ", ".join(missing)


def test_help_shows_every_default():
    """Every option with a default other than none/off says it in --help (argparse's %(default)s, or the
    help's own words)."""
    unexplained = []
    for words, parser in _commands(cli.build_parser()):
        for action in parser._actions:
            trivial = action.default is None or action.default is False or action.default in ([], argparse.SUPPRESS)
            if action.option_strings and not trivial and "default" not in (action.help or ""):
                unexplained.append(f"{' '.join(words)} {action.option_strings[-1]}")
    assert not unexplained, unexplained
    out = subprocess.run([sys.executable, "-m", "vktrain.cli", "export", "--help"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT).stdout
    assert re.search(r"--group-size GROUP_SIZE\s+\(default: 32\)", out), out


def test_version_prints_the_package_version():
    from importlib.metadata import version

    done = subprocess.run([sys.executable, "-m", "vktrain.cli", "--version"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0 and done.stdout == f"vktrain {version('vktrain')}\n"
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'version = "{version("vktrain")}"' in pyproject


def test_inspect_summarises_the_state_by_kind_and_lists_it_with_verbose(tmp_path, capsys):
    """Count and bytes per kind (from the JSON report's own shapes and dtypes), no per-tensor lines unless
    --verbose, which lists every one."""
    pytest.importorskip("torch")
    pte = tmp_path / "step.pte"
    assert cli.main(["export", "--model", "mlp-lora", "--model-arg", "dim=32", "--model-arg", "hidden=64",
                     "--model-arg", "n_layers=1", "--lora-rank", "4", "--batch", "2", "--seq", "8",
                     "--out", str(pte)]) == 0
    capsys.readouterr()
    assert cli.main(["inspect", str(pte), "--json"]) == 0
    state = json.loads(capsys.readouterr().out)["delegates"][0]["mutable_state"]
    assert len(state) > 10
    nbytes = {s["name"]: int(np.prod(s["shape"])) * np.dtype(s["dtype"]).itemsize for s in state}
    kinds = {"lora_A": [n for n in nbytes if n.startswith("model.") and n.endswith(".lora_A")],
             "optimizer.exp_avg_sq of lora_B": [n for n in nbytes if n.startswith("optimizer.exp_avg_sq.")
                                                and n.endswith(".lora_B")]}
    assert all(kinds.values())

    assert cli.main(["inspect", str(pte)]) == 0
    summary = capsys.readouterr().out
    assert f"mutable state: {len(state)} tensor(s), {inspect_command.format_bytes(sum(nbytes.values()))} (each one: --verbose)" \
        in summary
    for kind, names in kinds.items():
        assert f"    {kind}: {len(names)} tensor(s), {inspect_command.format_bytes(sum(nbytes[n] for n in names))}" in summary
    assert not any(name in summary for name in nbytes if "lora" in name)
    assert cli.main(["inspect", str(pte), "--verbose"]) == 0
    listed = capsys.readouterr().out
    assert all(f"    {name} " in listed for name in nbytes)


@pytest.mark.parametrize("words, keep_best", [
    (["--keep-best", "step.pte"], "loss"),  # argparse alone read step.pte as --keep-best's value and refused it
    (["--keep-b", "step.pte"], "loss"),  # an abbreviation argparse accepts
    (["--keep-best", "loss", "step.pte"], "loss"),
    (["--keep-best", "accuracy", "step.pte"], "accuracy"),
    (["--keep-best=accuracy", "step.pte"], "accuracy"),
    (["step.pte", "--keep-best"], "loss"),
    (["step.pte"], None),
])
def test_keep_best_takes_the_next_word_only_when_it_is_loss_or_accuracy(words, keep_best):
    args = cli.build_parser().parse_args(["train", *words, "--steps", "3"])
    assert (args.program, args.keep_best, args.steps) == ("step.pte", keep_best, 3)


def test_a_misspelt_keep_best_value_is_refused_naming_the_choices(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.build_parser().parse_args(["train", "--keep-best", "acuracy", "step.pte", "--steps", "3"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "vktrain train: error: argument --keep-best: invalid choice: 'acuracy' (choose from 'loss', 'accuracy')")
