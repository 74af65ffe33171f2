"""WGSL compute pipelines by shader name, cached per (shader, specialization).

The bind-group layout is explicit, from the kernel's declarations (reflect.py): its storage buffers
(read-only-storage or storage) at bindings 0..n-1 and its params block as a uniform buffer at n.
("auto" layouts would drop bindings a kernel declares but does not use, and a Dispatch binds all.)
Specialization constants become pipeline-overridable constants keyed by their @id.
Modules compile with or without naga's runtime checks as the device's `runtime_checks` says (device.py).
"""
from __future__ import annotations

from typing import Any

from vktrain.serialization.dispatch import ScheduleError
from vktrain.serialization.dispatch import SpecValue
from vktrain.runtime.webgpu.errors import WebGPUError
from vktrain.runtime.webgpu.reflect import ENTRY_POINT, WGSLInterface, reflect_wgsl
from vktrain.runtime.webgpu.shader_modules import create_trusted_wgsl_module


def override_constants(shader: str, interface: WGSLInterface, values: tuple[tuple[int, SpecValue], ...]
                       ) -> dict[str, float]:
    """Pipeline constants ({"<id>": value}) of these (id, value) pairs, checked against the kernel's overrides."""
    constants = {}
    for spec_id, value in values:
        kind = interface.spec_types.get(spec_id)
        if kind is None:
            known = ", ".join(f"{i}: {t}" for i, t in sorted(interface.spec_types.items())) or "none"
            raise ScheduleError(f"WGSL kernel {shader!r} has no override constant with @id({spec_id}) "
                                f"(it declares {known})")
        if kind == "float":
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ScheduleError(f"WGSL kernel {shader!r}: override {spec_id} is float, got {value!r}")
        elif isinstance(value, float):
            raise ScheduleError(f"WGSL kernel {shader!r}: override {spec_id} is {kind}, got the float {value!r}")
        elif kind == "uint" and not 0 <= int(value) < 2**32:
            raise ScheduleError(f"WGSL kernel {shader!r}: override {spec_id} is uint, got {value}")
        elif kind == "int" and not -(2**31) <= int(value) < 2**31:
            raise ScheduleError(f"WGSL kernel {shader!r}: override {spec_id} is int, got {value}")
        constants[str(spec_id)] = float(value)
    return constants


class PipelineCache:
    """Creates and owns the shader modules, layouts and pipelines of one WebGPU Device."""

    def __init__(self, device):
        self.device = device
        self._interfaces: dict[str, WGSLInterface] = {}
        self._sources: dict[str, str] = {}
        self._modules: dict[str, Any] = {}
        self._layouts: dict[str, tuple[Any, Any]] = {}  # shader -> (bind-group layout, pipeline layout)
        self._pipelines: dict[tuple[str, tuple], Any] = {}

    def source(self, name: str, code: str | None = None) -> str:
        """The kernel's WGSL: `code` (a module embedded in a blob), else the local source
        (WGSLKernelNotFoundError when it has none) with the feature bodies of the device's `kernel_features`
        (the one place they are chosen)."""
        if code is not None:
            return code
        if name not in self._sources:
            from vktrain.runtime_shaders.wgsl import wgsl_source
            self._sources[name] = wgsl_source(name, self.device.kernel_features)
        return self._sources[name]

    def feature_kernels(self) -> dict[str, set[str]]:
        """{feature: the kernels looked up so far that have a body for it, taken}."""
        from vktrain.runtime_shaders.build import parse_shader_name
        from vktrain.runtime_shaders.wgsl import declared_wgsl_features

        used: dict[str, set[str]] = {}
        for name in self._sources:
            base = parse_shader_name(name).base
            for feature in declared_wgsl_features(base) & self.device.kernel_features:
                used.setdefault(feature, set()).add(name)
        return used

    def interface(self, name: str, code: str | None = None) -> WGSLInterface:
        key = name if code is None else (name, code)
        if key not in self._interfaces:
            self._interfaces[key] = reflect_wgsl(name, self.source(name, code))
        return self._interfaces[key]

    def _module(self, name: str, code: str | None = None):
        key = name if code is None else (name, code)
        if key not in self._modules:
            try:
                if self.device.runtime_checks:
                    module = self.device.handle.create_shader_module(label=name, code=self.source(name, code))
                else:
                    module = create_trusted_wgsl_module(self.device.handle, name, self.source(name, code))
                self._modules[key] = module
            except Exception as exc:
                raise WebGPUError(f"wgpu rejected the WGSL of kernel {name!r}: {exc}") from exc
        return self._modules[key]

    def layout(self, name: str, code: str | None = None) -> tuple[Any, Any]:
        """(bind-group layout, pipeline layout) of kernel `name` (its WGSL `code`, else the local source)."""
        key = name if code is None else (name, code)
        if key not in self._layouts:
            wgpu = self.device.wgpu
            interface = self.interface(name, code)
            entries = [{"binding": b.binding, "visibility": wgpu.ShaderStage.COMPUTE,
                        "buffer": {"type": wgpu.BufferBindingType.read_only_storage if b.readonly
                                   else wgpu.BufferBindingType.storage}} for b in interface.storage]
            if interface.params is not None:
                entries.append({"binding": interface.params.binding, "visibility": wgpu.ShaderStage.COMPUTE,
                                "buffer": {"type": wgpu.BufferBindingType.uniform}})
            handle = self.device.handle
            group_layout = handle.create_bind_group_layout(label=name, entries=entries)
            pipeline_layout = handle.create_pipeline_layout(label=name, bind_group_layouts=[group_layout])
            self._layouts[key] = (group_layout, pipeline_layout)
        return self._layouts[key]

    def get(self, shader: str, specialization: tuple[tuple[int, SpecValue], ...], code: str | None = None):
        """The GPUComputePipeline of `shader` (its WGSL `code`, else the local source) with these (id, value)
        override constants."""
        key = (shader, tuple(specialization), code)
        if key not in self._pipelines:
            constants = override_constants(shader, self.interface(shader, code), key[1])
            compute = {"module": self._module(shader, code), "entry_point": ENTRY_POINT}
            if constants:
                compute["constants"] = constants
            try:
                self._pipelines[key] = self.device.handle.create_compute_pipeline(
                    label=shader, layout=self.layout(shader, code)[1], compute=compute)
            except Exception as exc:
                raise WebGPUError(f"wgpu could not build the pipeline of kernel {shader!r} with constants "
                                  f"{constants}: {exc}") from exc
        return self._pipelines[key]

    def __len__(self) -> int:
        return len(self._pipelines)

    def clear(self) -> None:
        self._pipelines.clear()
        self._layouts.clear()
        self._modules.clear()
