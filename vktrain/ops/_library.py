"""The torch.library namespace `vktrain` and the plumbing every op family shares.

Each op is defined twice, as ExecuTorch expects: a functional overload (what torch.export records, one
node per call) and an `.out` overload whose keyword out tensors carry write-alias annotations. ExecuTorch's
`to_out_variant` pairs the two by comparing their schemas with the out arguments stripped, so the
positional part of both schemas must be identical, defaults included.
"""
from __future__ import annotations

from typing import Callable

import torch

NAMESPACE = "vktrain"

# FRAGMENT rather than DEF: other modules may add overloads to the same namespace later.
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")


def define_op_pair(
    functional_schema: str,
    out_schema: str,
    functional_cpu: Callable,
    out_cpu: Callable,
    functional_fake: Callable,
    out_fake: Callable,
) -> None:
    """Define `<name>` and `<name>.out`, each with a CPU kernel and a fake (shape-only) kernel."""
    name = functional_schema.split("(", 1)[0]
    out_name = out_schema.split("(", 1)[0]
    if out_name != f"{name}.out":
        raise AssertionError(f"out schema must define {name}.out, got {out_name}")
    _LIB.define(functional_schema)
    _LIB.define(out_schema)
    _LIB.impl(name, functional_cpu, "CPU")
    _LIB.impl(out_name, out_cpu, "CPU")
    torch.library.register_fake(f"{NAMESPACE}::{name}", functional_fake, lib=_LIB)
    torch.library.register_fake(f"{NAMESPACE}::{out_name}", out_fake, lib=_LIB)


def write_out(out: torch.Tensor, result: torch.Tensor, out_name: str) -> torch.Tensor:
    """Copy a functional result into a caller-provided out tensor (aten's out= convention: resize if
    the shape differs, but never convert dtypes silently)."""
    if out.dtype != result.dtype:
        raise TypeError(f"out tensor '{out_name}' has dtype {out.dtype}, expected {result.dtype}")
    if out.shape != result.shape:
        out.resize_(result.shape)
    out.copy_(result)
    return out


def check_out_like(out: torch.Tensor, expected: torch.Tensor, out_name: str) -> torch.Tensor:
    """Fake-kernel counterpart of write_out: the out tensor must already match the result's metadata."""
    if out.dtype != expected.dtype or out.shape != expected.shape:
        raise ValueError(
            f"out tensor '{out_name}' is {out.dtype} {tuple(out.shape)}, "
            f"expected {expected.dtype} {tuple(expected.shape)}")
    return out
