"""Operator schema strings (torch's `native_functions.yaml` grammar) parsed into data, torch-free.

    rms_norm(Tensor x, Tensor weight, float eps) -> (Tensor y, Tensor rstd)
    sum.dim_IntList(Tensor self, int[1]? dim, bool keepdim=False, *, ScalarType? dtype=None) -> Tensor

Every consumer (the torch op library, the partitioner, the runtime's lowerings, the verifier) reads an
op's argument names, order, defaults and outputs from its `Schema`, parsed once from the one string.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from vktrain.errors import VktrainError


class SchemaError(VktrainError, ValueError):
    """A schema string does not follow the grammar."""


@dataclass(frozen=True)
class Argument:
    name: str
    type: str                  # as written, without the alias annotation: "Tensor", "Tensor?", "int[1]?"
    default: str | None = None  # the default as written ("None", "False", "1"), None when required
    kwarg_only: bool = False
    alias: str | None = None   # "a!" for an out tensor written in place

    @property
    def optional(self) -> bool:
        return self.type.endswith("?")

    @property
    def base_type(self) -> str:
        """The type without `?` and list suffixes: "Tensor", "int", "float", "Scalar", ..."""
        return re.sub(r"(\[\d*\])?\??$", "", self.type)

    @property
    def is_list(self) -> bool:
        return bool(re.search(r"\[\d*\]\??$", self.type))

    @property
    def is_tensor(self) -> bool:
        return self.base_type == "Tensor" and not self.is_list

    @property
    def is_tensor_list(self) -> bool:
        return self.base_type == "Tensor" and self.is_list

    @property
    def default_value(self):
        """The default as a Python value (None, bool, int, float, str, tuple of numbers); None if required."""
        text = self.default
        if text is None or text == "None":
            return None
        if text in ("True", "False"):
            return text == "True"
        if text.startswith("[") and text.endswith("]"):
            return tuple(_number(item.strip()) for item in text[1:-1].split(",") if item.strip())
        if text[0] in "'\"":
            return text[1:-1]
        return _number(text)

    def render(self) -> str:
        written = self.type if self.alias is None else f"{self.base_type}({self.alias}){self.type[len(self.base_type):]}"
        text = f"{written} {self.name}"
        return text if self.default is None else f"{text}={self.default}"


@dataclass(frozen=True)
class Return:
    type: str
    name: str | None = None
    alias: str | None = None

    @property
    def default_value(self):
        """The default as a Python value (None, bool, int, float, str, tuple of numbers); None if required."""
        text = self.default
        if text is None or text == "None":
            return None
        if text in ("True", "False"):
            return text == "True"
        if text.startswith("[") and text.endswith("]"):
            return tuple(_number(item.strip()) for item in text[1:-1].split(",") if item.strip())
        if text[0] in "'\"":
            return text[1:-1]
        return _number(text)

    def render(self) -> str:
        written = self.type if self.alias is None else f"{self.type}({self.alias})"
        return written if self.name is None else f"{written} {self.name}"


@dataclass(frozen=True)
class Schema:
    """One overload: `namespace.name.overload` is its key everywhere (registries, blob op names)."""
    namespace: str
    name: str
    overload: str
    arguments: tuple[Argument, ...]
    returns: tuple[Return, ...]

    @property
    def key(self) -> str:
        return f"{self.namespace}.{self.name}.{self.overload}"

    @property
    def arg_names(self) -> tuple[str, ...]:
        """Every argument name in schema order (keyword-only ones included): the blob's argument order."""
        return tuple(a.name for a in self.arguments)

    @property
    def output_names(self) -> tuple[str, ...]:
        """The outputs' names: the returns' own, or `out` for a single unnamed one (aten's convention)."""
        if len(self.returns) == 1 and self.returns[0].name is None:
            return ("out",)
        if any(r.name is None for r in self.returns):
            raise SchemaError(f"{self.key}: name every return of a multi-output op")
        return tuple(r.name for r in self.returns)

    def argument(self, name: str) -> Argument:
        for arg in self.arguments:
            if arg.name == name:
                return arg
        raise SchemaError(f"{self.key} has no argument {name!r}; its arguments: {', '.join(self.arg_names)}")

    def render(self) -> str:
        """The schema string (without the namespace), as torch.library.define takes it."""
        pieces, kwarg_only = [], False
        for arg in self.arguments:
            if arg.kwarg_only and not kwarg_only:
                pieces.append("*")
                kwarg_only = True
            pieces.append(arg.render())
        returns = [r.render() for r in self.returns]
        returned = returns[0] if len(returns) == 1 and self.returns[0].name is None else f"({', '.join(returns)})"
        overload = "" if self.overload == "default" else f".{self.overload}"
        return f"{self.name}{overload}({', '.join(pieces)}) -> {returned}"

    @classmethod
    def parse(cls, namespace: str, text: str) -> "Schema":
        match = re.fullmatch(r"\s*([A-Za-z_][\w]*)(?:\.([\w]+))?\((.*)\)\s*->\s*(.+?)\s*", text)
        if match is None:
            raise SchemaError(f"schema {text!r} is not of the form 'name[.overload](args) -> returns'")
        name, overload, args_text, returns_text = match.groups()
        arguments, kwarg_only = [], False
        for piece in _split_top_level(args_text):
            if piece == "*":
                kwarg_only = True
                continue
            arguments.append(_parse_argument(piece, kwarg_only, text))
        return cls(namespace, name, overload or "default", tuple(arguments), _parse_returns(returns_text, text))


_TYPE_WITH_ALIAS = re.compile(r"^([A-Za-z]\w*)(\(([a-z!]+)\))?((?:\[\d*\])?\??)$")


def _parse_type(written: str, schema: str) -> tuple[str, str | None]:
    match = _TYPE_WITH_ALIAS.match(written)
    if match is None:
        raise SchemaError(f"schema {schema!r}: cannot parse the type {written!r}")
    base, _, alias, suffix = match.groups()
    return base + suffix, alias


def _parse_argument(piece: str, kwarg_only: bool, schema: str) -> Argument:
    declaration, _, default = piece.partition("=")
    parts = declaration.split()
    if len(parts) != 2:
        raise SchemaError(f"schema {schema!r}: argument {piece!r} is not 'Type name[=default]'")
    type_, alias = _parse_type(parts[0], schema)
    return Argument(parts[1], type_, default.strip() or None, kwarg_only, alias)


def _parse_returns(text: str, schema: str) -> tuple[Return, ...]:
    text = text.strip()
    if text.startswith("(") and text.endswith(")"):
        text = text[1:-1]
    returns = []
    for piece in _split_top_level(text):
        parts = piece.split()
        type_, alias = _parse_type(parts[0], schema)
        returns.append(Return(type_, parts[1] if len(parts) > 1 else None, alias))
    return tuple(returns)


def _number(text: str) -> int | float:
    try:
        return int(text)
    except ValueError:
        return float(text)


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets/parentheses (defaults such as `int[1] dim=[0, 1]` hold commas)."""
    pieces, depth, current = [], 0, ""
    for char in text:
        if char in "([":
            depth += 1
        elif char in ")]":
            depth -= 1
        if char == "," and depth == 0:
            pieces.append(current.strip())
            current = ""
        else:
            current += char
    if current.strip():
        pieces.append(current.strip())
    return pieces


__all__ = ["Argument", "Return", "Schema", "SchemaError"]
