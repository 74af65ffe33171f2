"""`import vktrain.export` (the Python API) prints nothing into the user's program: torchao's unloadable
CUDA extensions and torch's pytree deprecation notices are dropped, while other warnings still show."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("PYTHONWARNINGS", None)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)


def test_importing_the_python_api_prints_nothing():
    pytest.importorskip("torchao")
    done = _python("import vktrain.export, vktrain.lora, torchao")
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


def test_real_warnings_and_log_messages_still_show():
    pytest.importorskip("torchao")
    done = _python("import logging, warnings, vktrain.export\n"
                   "warnings.warn('a real deprecation', FutureWarning)\n"
                   "logging.getLogger('torchao').warning('Failed to load /x/torchao/kernels.py: a real problem')\n"
                   "logging.getLogger('torch.utils._pytree').warning('something else about pytrees')\n")
    assert done.returncode == 0 and done.stdout == ""
    assert "a real deprecation" in done.stderr and "a real problem" in done.stderr
    assert "something else about pytrees" in done.stderr
