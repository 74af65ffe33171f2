"""The blob's embedded schedules and shader modules (schema.fbs EmbeddedSchedule, ShaderModule: what `vktrain
export --target` stores, serialization/embedded.py): their flatbuffer tables written and read, for blob.py."""
from __future__ import annotations

import flatbuffers
import numpy as np

from vktrain.serialization.blob_header import BlobFormatError
from vktrain.serialization.device_profile import DeviceProfile, DeviceProfileError
from vktrain.serialization.embedded import CODE_KINDS, EmbeddedSchedule, ModuleBinding, ShaderModule
from vktrain.serialization.flatbuffer_building import numpy_vector, table_vector
from vktrain.serialization.flatbuffer_reading import reading, scalar_vector, text
from vktrain.serialization.generated.vkt_blob import EmbeddedSchedule as FbEmbeddedSchedule
from vktrain.serialization.generated.vkt_blob import ShaderModule as FbShaderModule
from vktrain.serialization.generated.vkt_blob import ShaderModuleBinding as FbShaderModuleBinding
from vktrain.serialization.generated.vkt_blob.BindingAccess import BindingAccess

# Module binding access as schema.fbs BindingAccess stores it ("rw" is READ_WRITE; DECLARED is not used here).
_MODULE_ACCESS = {"r": BindingAccess.READ, "w": BindingAccess.WRITE, "rw": BindingAccess.READ_WRITE}
_MODULE_ACCESS_NAMES = {code: name for name, code in _MODULE_ACCESS.items()}


def build_shader_module(builder: flatbuffers.Builder, module: ShaderModule) -> int:
    name = builder.CreateString(module.name)
    code = builder.CreateNumpyVector(np.frombuffer(module.code, np.uint8))
    bindings = []
    for binding in module.bindings:
        FbShaderModuleBinding.Start(builder)
        FbShaderModuleBinding.AddBinding(builder, binding.binding)
        FbShaderModuleBinding.AddAccess(builder, _MODULE_ACCESS[binding.access])
        bindings.append(FbShaderModuleBinding.End(builder))
    vectors = (table_vector(builder, bindings), numpy_vector(builder, module.spec_ids, np.uint32),
               table_vector(builder, [builder.CreateString(f) for f in module.features]),
               numpy_vector(builder, module.local_size, np.uint32),
               numpy_vector(builder, module.local_size_spec_ids, np.int32))
    FbShaderModule.Start(builder)
    FbShaderModule.AddName(builder, name)
    FbShaderModule.AddKind(builder, CODE_KINDS.index(module.kind))
    FbShaderModule.AddCode(builder, code)
    FbShaderModule.AddBindings(builder, vectors[0])
    FbShaderModule.AddPushConstantBytes(builder, module.push_constant_bytes)
    FbShaderModule.AddPushHeader(builder, module.push_header)
    FbShaderModule.AddSpecIds(builder, vectors[1])
    FbShaderModule.AddFeatures(builder, vectors[2])
    if module.local_size:
        FbShaderModule.AddLocalSize(builder, vectors[3])
        FbShaderModule.AddLocalSizeSpecIds(builder, vectors[4])
    return FbShaderModule.End(builder)


def build_embedded_schedule(builder: flatbuffers.Builder, embedded: EmbeddedSchedule) -> int:
    profile = builder.CreateString(embedded.profile.to_json())
    schedule = builder.CreateNumpyVector(np.frombuffer(embedded.schedule_bytes, np.uint8))
    modules = numpy_vector(builder, embedded.dispatch_modules, np.uint32)
    FbEmbeddedSchedule.Start(builder)
    FbEmbeddedSchedule.AddProfile(builder, profile)
    FbEmbeddedSchedule.AddSchedule(builder, schedule)
    FbEmbeddedSchedule.AddDispatchModules(builder, modules)
    return FbEmbeddedSchedule.End(builder)


def _ubytes(table, field_name: str) -> bytes:
    return bytes(getattr(table, f"{field_name}AsNumpy")().tobytes()) if getattr(table, f"{field_name}Length")() else b""


def read_shader_module(root, index: int) -> ShaderModule:
    with reading(f"VkGraph.shader_modules[{index}]", BlobFormatError):
        table = root.ShaderModules(index)
        kind = table.Kind()
        if kind >= len(CODE_KINDS):
            raise BlobFormatError(f"shader module {index} has unknown code kind {kind} (blob from a newer vktrain?)")
        bindings = []
        for i in range(table.BindingsLength()):
            binding = table.Bindings(i)
            if binding.Access() not in _MODULE_ACCESS_NAMES:
                raise BlobFormatError(f"shader module {index} binding {i} has access {binding.Access()}; expected "
                                      f"READ, WRITE or READ_WRITE")
            bindings.append(ModuleBinding(binding.Binding(), _MODULE_ACCESS_NAMES[binding.Access()]))
        return ShaderModule(text(table.Name()), CODE_KINDS[kind], _ubytes(table, "Code"), tuple(bindings),
                            table.PushConstantBytes(), bool(table.PushHeader()), scalar_vector(table, "SpecIds"),
                            tuple(text(table.Features(i)) for i in range(table.FeaturesLength())),
                            scalar_vector(table, "LocalSize"), scalar_vector(table, "LocalSizeSpecIds"))


def read_embedded_schedule(root, index: int) -> EmbeddedSchedule:
    with reading(f"VkGraph.schedules[{index}]", BlobFormatError):
        table = root.Schedules(index)
        try:
            profile = DeviceProfile.from_json(text(table.Profile()), f"embedded schedule {index}'s device profile")
        except DeviceProfileError as exc:
            raise BlobFormatError(str(exc)) from None
        return EmbeddedSchedule(profile, _ubytes(table, "Schedule"), scalar_vector(table, "DispatchModules"))


__all__ = ["build_embedded_schedule", "build_shader_module", "read_embedded_schedule", "read_shader_module"]
