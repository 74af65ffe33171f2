"""WGSL kernels of the WebGPU runtime (vktrain.runtime.webgpu), one `<shader>.wgsl` per Dispatch.shader.

The runtime asks for a kernel by its Dispatch.shader name only, through `wgsl_source(name)`; a name
without a kernel raises WGSLKernelNotFoundError naming it. Every kernel follows the WebGPU side of
the dispatch contract (the GLSL side is vktrain/runtime_shaders/common.glsl):

* Entry point `main`. Dispatch binding i is `@group(0) @binding(i)`, a storage buffer:
  `var<storage, read>` where the GLSL declares it readonly, else `var<storage, read_write>`, in the
  GLSL's order.
* Push constants: a shader whose GLSL has a push block takes it from `@group(0) @binding(B) var<uniform>`,
  B = the number of storage bindings. Its bytes are exactly the GLSL push block: for split shaders the
  16-byte header first (a struct member `vktrain_group_offset: vec4<u32>`, zero when unsplit; global
  group = workgroup_id + vktrain_group_offset.xyz), then the Dispatch's push_constants; the runtime
  zero-pads them to a multiple of 16.
* Specialization constants are `override` declarations with `@id(n)` = the GLSL constant_id; ids 0, 1,
  2 are the local size and feed `@workgroup_size(...)`.
* The default WGSL is valid for browser WebGPU (no native-only features).

Variants: a shader name "base@VARIANT" is looked up as the file named exactly after it
("base@VARIANT.wgsl"); the plain name as "base.wgsl".
"""
from __future__ import annotations

from pathlib import Path

from vktrain.errors import VktrainError

WGSL_DIR = Path(__file__).resolve().parent
WGSL_SUFFIX = ".wgsl"


class WGSLKernelNotFoundError(VktrainError, LookupError):
    """No WGSL kernel exists for a shader name; `shader` is that name."""

    def __init__(self, shader: str, detail: str = ""):
        self.shader = shader
        super().__init__(f"no WGSL kernel for shader {shader!r}" + (f": {detail}" if detail else "")
                         + f" (looked in {WGSL_DIR} for {shader}{WGSL_SUFFIX})")


def wgsl_source(shader_name: str) -> str:
    """The WGSL source of the kernel Dispatch.shader `shader_name` names."""
    if not isinstance(shader_name, str) or not shader_name or "/" in shader_name or shader_name.startswith("."):
        raise WGSLKernelNotFoundError(str(shader_name), "not a shader name")
    path = WGSL_DIR / f"{shader_name}{WGSL_SUFFIX}"
    if not path.is_file():
        raise WGSLKernelNotFoundError(shader_name)
    return path.read_text(encoding="utf-8")


__all__ = ["WGSL_DIR", "WGSLKernelNotFoundError", "wgsl_source"]
