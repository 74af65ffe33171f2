"""vktrain's compute kernels and their build: Slang sources (`*.slang`, compiled to SPIR-V and WGSL by
slangc, slang.py); see build.py for names, variants and the cache, docs/ONE_SOURCE.md for the Slang route.

The runtime asks for shaders by name only: `load_spirv("test_axpy")`, `load_spirv("linear_q4gsw@GEMV")`.
`common.slangh` holds the conventions every shader may include
(push-constant header with the group offset of split dispatches, local size from specialization
constants). `reflect_spirv` reads what the
runtime needs to check a dispatch against a shader (bindings, push-constant block, spec constants).
"""
from .reflect import BindingInfo, ShaderInterface, reflect_spirv

_BUILD_NAMES = ("ShaderBuildError", "ShaderNotFoundError", "all_shader_names", "build_all", "compile_shader",
                "compiler_available", "load_spirv", "parse_shader_name", "spirv_path")

__all__ = ["BindingInfo", "ShaderInterface", "reflect_spirv", *_BUILD_NAMES]


def __getattr__(name):
    # Imported lazily so `python -m vktrain.runtime_shaders.build` does not find build.py already
    # imported by its own package (runpy warns about that).
    if name in _BUILD_NAMES:
        from . import build
        return getattr(build, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
