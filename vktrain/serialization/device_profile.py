"""DeviceProfile: everything kernel planning reads about a device, as data.

The planners (vktrain/backend/kernel_planning: op lowering, kernels/*.py, coopmat tiling, split-K, binding
windows) are a function of the graph, the precision policy, the binding limit and this record. It lives on
the ground floor so that the AOT side can plan for a named target at export (issue 25) and the runtime can
build the same record from the device it opened (vktrain/runtime/device_profiles.py: `profile_of`).

Built-in profiles (BUILTIN_PROFILES), each with its source:
  lavapipe         Mesa's CPU Vulkan (llvmpipe) as the tests run it: queried here (Mesa 22.3.6, LLVM 15).
  nvidia-coopmat   the NVIDIA H200 with VK_KHR_cooperative_matrix (../shared/device/NOTES.md, queried
                   2026-12-01, driver 580.159.04); what the notes do not record is NVIDIA's Linux driver
                   value, cited at the field and not yet queried on the H200.
  desktop-gpu      a generic desktop GPU without cooperative matrices: subgroups of 32, 32 KiB of shared
                   memory, otherwise the Vulkan 1.1 required limits, so it holds on AMD, Intel and NVIDIA.
  adreno-6xx, adreno-7xx, mali-g7x, mali-g7xx
                   phone classes: the vendor's documented subgroup width, the shared memory gpuinfo.org shows
                   for the class, and the Vulkan 1.1 required limits for the rest: conservative, so a plan for
                   the class fits every member; a queried device's own profile (`vktrain devices`) is tighter.
                   Each carries a 4 GB phone's memory budget (PHONE_MEMORY_BUDGET_BYTES, a conservative choice).
  apple-moltenvk, intel-integrated, amd-integrated
                   laptop classes (LAPTOP_PROFILES): the subgroup width and workgroup size the vendor documents and
                   its Vulkan drivers report, 32 KiB of shared memory (the floor gpuinfo.org shows), the Vulkan 1.1
                   required limits otherwise; an 8 GB laptop's memory budget (LAPTOP_MEMORY_BUDGET_BYTES). None of
                   the three was queried on such a device.
A profile file (`vktrain devices --json`, `DeviceProfile.to_json`) holds every field below; reading one
refuses unknown and missing fields by name (`DeviceProfile.from_json`, `load_profile`), except the fields
added after the format was first written (OPTIONAL_FIELDS), which take their default when absent so that older
files keep loading.

`intersect(device, target)` is what a device plans with to run as if it were `target` (--device-profile,
VKTRAIN_DEVICE_PROFILE: vktrain/runtime/device_profiles.py `planning_profile`); `resolve_profile(spec)` reads
a built-in name or a profile file.

The tuning fields (min_workgroups, split_k_target_workgroups, fp32_target_workgroups) were measured on the
H200 (bench/results/step_gemms_h200.json); every other profile keeps those values, unmeasured. The vendor
tuning fields (prefers_fp16, gemm_tiles) come from VENDOR_GEMM_TUNING, a table whose rows cite their sources.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Union

from vktrain.errors import VktrainError

API_VULKAN, API_WEBGPU = "vulkan", "webgpu"
APIS = (API_VULKAN, API_WEBGPU)
# VkPhysicalDeviceType names (what vktrain's Vulkan Device reports as device_type).
DEVICE_TYPES = ("cpu", "discrete", "integrated", "virtual", "other")
# VkSubgroupFeatureFlagBits by bit position (bit i of VkSubgroupProperties.supportedOperations).
SUBGROUP_OPERATIONS = ("basic", "vote", "arithmetic", "ballot", "shuffle", "shuffle_relative", "clustered", "quad")
# Cooperative-matrix component types and scopes, named as vktrain/runtime/vk/coopmat.py names them.
COMPONENT_TYPES = ("float16", "float32", "float64", "bfloat16", "int8", "int16", "int32", "int64",
                   "uint8", "uint16", "uint32", "uint64")
SCOPES = ("subgroup", "workgroup", "device", "queue_family")
COOPMAT_EXTENSION = "VK_KHR_cooperative_matrix"
# What a WebGPU Device reports as its device_type (vktrain/runtime/webgpu/device.py): not "cpu", whatever the
# adapter, since the WGSL kernels have the GPU-tuning bodies only. Planning reads it of a WebGPU profile too.
WEBGPU_DEVICE_TYPE = "webgpu"

# Tuning measured on the H200 (132 SMs). A GEMM takes the tensor cores unsplit when its output has at least
# MIN_WORKGROUPS 64 x 128 tiles (about one per SM), and a smaller one when split-K gives it that many
# workgroups: at M = 128 with the 64 x 64 tilings the gate / up forward (N = 8192, exactly 128 tiles) is as
# fast unsplit as split in 2 (0.045 ms; SIMT 0.123), while N = 2048 outputs run fastest in 8 slices
# (0.021-0.16 ms against 0.043-0.45 unsplit or on SIMT). Split-K aims at ~4 workgroups per SM; the fp32
# kernels at ~2 per SM.
H200_MIN_WORKGROUPS = 128
H200_SPLIT_K_TARGET_WORKGROUPS = 512
H200_FP32_TARGET_WORKGROUPS = 256


class DeviceProfileError(VktrainError, ValueError):
    """A device profile (file or record) that is not a valid DeviceProfile; the message names the field."""


@dataclass(frozen=True)
class CoopmatShape:
    """One cooperative-matrix product the device runs: A is m x k, B k x n, C and the result m x n."""

    m: int
    n: int
    k: int
    a_type: str
    b_type: str
    c_type: str
    result_type: str
    scope: str = "subgroup"


def supports_shape(properties: tuple, *, m: int, n: int, k: int, input_type: str = "float16",
                   accumulator_type: str = "float32") -> bool:
    """Whether cooperative-matrix `properties` (CoopmatShape, or a Vulkan Device's own records with the same
    fields) list subgroup-scope m x n x k products of `input_type` A and B accumulating in `accumulator_type`
    (the combination the coopmat kernels are written for)."""
    return any(p.m == m and p.n == n and p.k == k and p.a_type == p.b_type == input_type
               and p.c_type == p.result_type == accumulator_type and p.scope == "subgroup"
               for p in properties)


@dataclass(frozen=True)
class DeviceProfile:
    """What kernel planning reads about a device (module docstring). Sizes are bytes."""

    name: str
    api: str  # APIS
    device_type: str  # DEVICE_TYPES; a WebGPU adapter's type as Vulkan names it
    subgroup_size: int  # 0: no subgroup size promised (WebGPU's WGSL kernels use none)
    subgroup_operations: tuple[str, ...]  # SUBGROUP_OPERATIONS usable in compute shaders
    float16: bool  # shaderFloat16 (Vulkan) / shader-f16 (WebGPU)
    int64: bool  # shaderInt64
    cooperative_matrix: tuple[CoopmatShape, ...]  # empty: none
    max_shared_memory_bytes: int  # maxComputeSharedMemorySize / max-compute-workgroup-storage-size
    max_workgroup_invocations: int
    max_workgroup_size: tuple[int, int, int]
    max_workgroup_count: tuple[int, int, int]
    max_storage_buffer_range: int  # the largest storage binding (maxStorageBufferRange)
    min_storage_buffer_offset_alignment: int
    max_allocation_bytes: int  # maxMemoryAllocationSize / max-buffer-size
    max_push_constants_bytes: int  # 0 on WebGPU (push constants travel in a uniform buffer)
    max_storage_buffers_per_stage: int
    # Tuning (see the H200_* constants): the coopmat route's size gate and split-K's workgroup target (the
    # executor's GemmRoute reads them from the device's profile), and the workgroups the fp32 kernels aim
    # for (kernels/linear.py and attention.py read the H200's value for every device today).
    min_workgroups: int = H200_MIN_WORKGROUPS
    split_k_target_workgroups: int = H200_SPLIT_K_TARGET_WORKGROUPS
    fp32_target_workgroups: int = H200_FP32_TARGET_WORKGROUPS
    # The most recorded dispatches one vkQueueSubmit / queue.submit runs (0: a step is one submit). A phone's
    # GPU watchdog kills a long submission (device lost); a dispatch count is a proxy for its time.
    max_dispatches_per_submit: int = 0
    # The device memory one program may plan (every buffer of its methods, shared ones once; 0: no budget).
    # Not a Vulkan limit: what the OS leaves an app (phones share RAM with the OS: PHONE_MEMORY_BUDGET_BYTES).
    memory_budget_bytes: int = 0
    # Vendor tuning (VENDOR_GEMM_TUNING): whether `auto` picks the fp16 GEMM policy on this device when it has
    # no tensor-core kernels (docs/PRECISION.md), and the linear family's tiled-GEMM tiles (threads_x,
    # threads_y, bk: kernels/linear.py GemmTiles; empty: the H200-tuned default_gemm_tiles).
    prefers_fp16: bool = False
    gemm_tiles: tuple[int, ...] = ()
    source: str = ""  # where the numbers come from

    def __post_init__(self) -> None:
        problems = _problems(self)
        if problems:
            raise DeviceProfileError(f"device profile {self.name!r}: {'; '.join(problems)}")

    @property
    def is_cpu(self) -> bool:
        return self.device_type == "cpu"

    def has_subgroup_operation(self, name: str) -> bool:
        return name in self.subgroup_operations

    def planning_fields(self) -> dict[str, Any]:
        """The fields planning reads: all but name and source."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("name", "source")}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: tuples as lists, cooperative-matrix shapes as objects."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "cooperative_matrix":
                value = [dataclasses.asdict(shape) for shape in value]
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, data: Any, where: str = "device profile") -> "DeviceProfile":
        """A DeviceProfile from `data` (what to_dict gives); DeviceProfileError naming `where` and each
        unknown, missing or mistyped field."""
        if not isinstance(data, Mapping):
            raise DeviceProfileError(f"{where}: expected a JSON object with the fields {', '.join(_FIELD_NAMES)}, "
                                     f"got {type(data).__name__}")
        unknown = sorted(set(data) - set(_FIELD_NAMES))
        missing = [name for name in _FIELD_NAMES if name not in data and name not in OPTIONAL_FIELDS]
        if unknown or missing:
            parts = ([f"unknown field(s) {', '.join(unknown)}"] if unknown else []) + \
                    ([f"missing field(s) {', '.join(missing)}"] if missing else [])
            raise DeviceProfileError(f"{where}: {'; '.join(parts)} (a profile has exactly the fields "
                                     f"{', '.join(_FIELD_NAMES)})")
        values = dict(data)
        values["cooperative_matrix"] = _coopmat_shapes(values["cooperative_matrix"], where)
        for name in ("subgroup_operations", "max_workgroup_size", "max_workgroup_count", "gemm_tiles"):
            if isinstance(values.get(name), list):
                values[name] = tuple(values[name])
        try:
            return cls(**values)
        except DeviceProfileError as exc:
            raise DeviceProfileError(f"{where}: {exc}") from None

    @classmethod
    def from_json(cls, text: str, where: str = "device profile") -> "DeviceProfile":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DeviceProfileError(f"{where} is not valid JSON: {exc}") from None
        return cls.from_dict(data, where)


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(DeviceProfile))
# Fields newer than the first profile files: absent from a file, they take the record's default.
OPTIONAL_FIELDS = ("max_dispatches_per_submit", "memory_budget_bytes", "prefers_fp16", "gemm_tiles")
_COOPMAT_FIELDS = tuple(f.name for f in dataclasses.fields(CoopmatShape))
_INT_FIELDS = ("subgroup_size", "max_shared_memory_bytes", "max_workgroup_invocations", "max_storage_buffer_range",
               "min_storage_buffer_offset_alignment", "max_allocation_bytes", "max_push_constants_bytes",
               "max_storage_buffers_per_stage", "min_workgroups", "split_k_target_workgroups",
               "fp32_target_workgroups", "max_dispatches_per_submit", "memory_budget_bytes")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _coopmat_shapes(value: Any, where: str) -> tuple[CoopmatShape, ...]:
    if not isinstance(value, (list, tuple)):
        raise DeviceProfileError(f"{where}: cooperative_matrix must be a list of shapes, got {value!r}")
    shapes = []
    for index, item in enumerate(value):
        if isinstance(item, CoopmatShape):
            shapes.append(item)
            continue
        if not isinstance(item, Mapping) or set(item) != set(_COOPMAT_FIELDS):
            got = sorted(item) if isinstance(item, Mapping) else repr(item)
            raise DeviceProfileError(f"{where}: cooperative_matrix[{index}] must have exactly the fields "
                                     f"{', '.join(_COOPMAT_FIELDS)}, got {got}")
        shapes.append(CoopmatShape(**item))
    return tuple(shapes)


def _problems(p: DeviceProfile) -> list[str]:
    """What is wrong with each field of `p`, by field name."""
    found = []
    if not isinstance(p.name, str) or not p.name:
        found.append(f"name must be a non-empty string, got {p.name!r}")
    if not isinstance(p.source, str):
        found.append(f"source must be a string, got {p.source!r}")
    if p.api not in APIS:
        found.append(f"api must be one of {', '.join(APIS)}, got {p.api!r}")
    if p.device_type not in DEVICE_TYPES:
        found.append(f"device_type must be one of {', '.join(DEVICE_TYPES)}, got {p.device_type!r}")
    for name in _INT_FIELDS:
        value = getattr(p, name)
        least = 0 if name in ("subgroup_size", "max_push_constants_bytes", "max_dispatches_per_submit",
                              "memory_budget_bytes") else 1
        if not _is_int(value) or value < least:
            found.append(f"{name} must be an integer >= {least}, got {value!r}")
    if _is_int(p.subgroup_size) and p.subgroup_size & (p.subgroup_size - 1):
        found.append(f"subgroup_size must be a power of two (or 0: none promised), got {p.subgroup_size}")
    if _is_int(p.min_storage_buffer_offset_alignment) and p.min_storage_buffer_offset_alignment > 0 and \
            p.min_storage_buffer_offset_alignment & (p.min_storage_buffer_offset_alignment - 1):
        found.append(f"min_storage_buffer_offset_alignment must be a power of two, got "
                     f"{p.min_storage_buffer_offset_alignment}")
    tiles = p.gemm_tiles
    if not isinstance(tiles, tuple) or (tiles and (len(tiles) != 3 or not all(_is_int(v) and v >= 1 for v in tiles)
                                                   or tiles[2] % 8)):
        found.append(f"gemm_tiles must be empty (the default tiles) or 3 integers >= 1 (threads_x, threads_y, bk; "
                     f"bk a multiple of 8), got {tiles!r}")
    elif tiles and _is_int(p.max_workgroup_invocations) and tiles[0] * tiles[1] > p.max_workgroup_invocations:
        found.append(f"gemm_tiles {tiles[0]}x{tiles[1]} threads exceed max_workgroup_invocations "
                     f"{p.max_workgroup_invocations}")
    for name in ("float16", "int64", "prefers_fp16"):
        if not isinstance(getattr(p, name), bool):
            found.append(f"{name} must be true or false, got {getattr(p, name)!r}")
    ops = p.subgroup_operations
    if not isinstance(ops, tuple) or any(op not in SUBGROUP_OPERATIONS for op in ops) or len(set(ops)) != len(ops):
        found.append(f"subgroup_operations must be a list of distinct names among {', '.join(SUBGROUP_OPERATIONS)}, "
                     f"got {ops!r}")
    for name in ("max_workgroup_size", "max_workgroup_count"):
        value = getattr(p, name)
        if not isinstance(value, tuple) or len(value) != 3 or not all(_is_int(v) and v >= 1 for v in value):
            found.append(f"{name} must be 3 integers >= 1 (x, y, z), got {value!r}")
    if not isinstance(p.cooperative_matrix, tuple) or not all(isinstance(s, CoopmatShape) for s in p.cooperative_matrix):
        found.append(f"cooperative_matrix must be a list of shapes, got {p.cooperative_matrix!r}")
    else:
        for index, shape in enumerate(p.cooperative_matrix):
            bad = [f"{f} {getattr(shape, f)!r}" for f in ("m", "n", "k") if not _is_int(getattr(shape, f))
                   or getattr(shape, f) < 1]
            bad += [f"{f} {getattr(shape, f)!r}" for f in ("a_type", "b_type", "c_type", "result_type")
                    if getattr(shape, f) not in COMPONENT_TYPES]
            bad += [f"scope {shape.scope!r}"] if shape.scope not in SCOPES else []
            if bad:
                found.append(f"cooperative_matrix[{index}] has an invalid {', '.join(bad)}")
    return found


def subgroup_operation_names(flags: int) -> tuple[str, ...]:
    """VkSubgroupFeatureFlags -> the names of its bits (SUBGROUP_OPERATIONS order; unknown bits dropped)."""
    return tuple(name for bit, name in enumerate(SUBGROUP_OPERATIONS) if flags >> bit & 1)


def load_profile(path: Union[str, os.PathLike]) -> DeviceProfile:
    """A DeviceProfile from a JSON file; DeviceProfileError naming the file and the field."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise DeviceProfileError(f"device profile {path}: cannot read it ({exc.strerror or exc})") from None
    return DeviceProfile.from_json(text, f"device profile {path}")


# ---- built-in profiles ------------------------------------------------------------------------------------

# The Vulkan 1.1 required limits (Vulkan specification, "Required Limits" table; maxMemoryAllocationSize:
# VkPhysicalDeviceMaintenance3Properties, at least 2^30): what every conformant device offers.
_VK_REQUIRED = dict(max_shared_memory_bytes=16384, max_workgroup_invocations=128, max_workgroup_size=(128, 128, 64),
                    max_workgroup_count=(65535, 65535, 65535), max_storage_buffer_range=1 << 27,
                    min_storage_buffer_offset_alignment=256, max_allocation_bytes=1 << 30,
                    max_push_constants_bytes=128, max_storage_buffers_per_stage=4)

LAVAPIPE = DeviceProfile(
    name="lavapipe", api=API_VULKAN, device_type="cpu",
    subgroup_size=8,  # the lanes of a 256-bit vector (AVX2)
    subgroup_operations=("basic", "vote", "arithmetic", "ballot", "shuffle", "shuffle_relative", "quad"),
    float16=True, int64=True, cooperative_matrix=(),
    max_shared_memory_bytes=32768, max_workgroup_invocations=1024, max_workgroup_size=(1024, 1024, 1024),
    max_workgroup_count=(65535, 65535, 65535), max_storage_buffer_range=1 << 27,
    min_storage_buffer_offset_alignment=16, max_allocation_bytes=1 << 31, max_push_constants_bytes=128,
    max_storage_buffers_per_stage=32,
    source="queried on the test machine: llvmpipe (Mesa 22.3.6, LLVM 15.0.6, 256 bits), Vulkan 1.3")

NVIDIA_COOPMAT = DeviceProfile(
    name="nvidia-coopmat", api=API_VULKAN, device_type="discrete",
    subgroup_size=32, subgroup_operations=SUBGROUP_OPERATIONS, float16=True, int64=True,
    # The KHR property list at subgroup scope (NOTES.md): f16 inputs with f16 or f32 accumulators at 16x16x16,
    # 16x8x16 and 16x8x8; bf16 16x16x16 into f32; int8 16x16x32 and 16x8x32 into s32 / u32.
    cooperative_matrix=tuple(
        [CoopmatShape(m, n, k, "float16", "float16", acc, acc) for m, n, k in ((16, 16, 16), (16, 8, 16), (16, 8, 8))
         for acc in ("float16", "float32")]
        + [CoopmatShape(16, 16, 16, "bfloat16", "bfloat16", "float32", "float32")]
        + [CoopmatShape(m, n, 32, t, t, acc, acc) for m, n in ((16, 16), (16, 8))
           for t, acc in (("int8", "int32"), ("uint8", "uint32"))]),
    max_shared_memory_bytes=48 * 1024,  # NOTES.md
    max_workgroup_count=(2**31 - 1, 65535, 65535),  # NOTES.md
    # Not in NOTES.md, and not queried on the H200 (`vktrain devices` there prints them): the values NVIDIA's
    # Linux drivers report for its GPUs on gpuinfo.org; maxMemoryAllocationSize 0xffe00000 as vulkaninfo
    # printed it with driver 580.65 (github.com/ggml-org/llama.cpp/issues/15256).
    max_workgroup_invocations=1024, max_workgroup_size=(1024, 1024, 64), max_storage_buffer_range=2**32 - 1,
    min_storage_buffer_offset_alignment=16, max_allocation_bytes=0xFFE00000, max_push_constants_bytes=256,
    max_storage_buffers_per_stage=1048576,
    source="NVIDIA H200, driver 580.159.04, Vulkan 1.4.312 (../shared/device/NOTES.md); limits NOTES.md does not "
           "record are NVIDIA's Linux driver values (gpuinfo.org; llama.cpp issue 15256), not queried on the H200")

# The kernels bind up to 8 storage buffers per dispatch (attention_bwd@DKV 8, adamw 6: the Vulkan-required 4
# holds none of them), and so does the WGSL runtime under WebGPU's default maxStorageBuffersPerShaderStage of 8,
# a limit every WebGPU adapter must offer (WebGPU spec, "Limits"); Chrome's WebGPU runs on Android's Adreno and
# Mali GPUs (Chrome 121) and on Apple, Intel and AMD laptop GPUs. The desktop, phone and laptop classes promise those 8.
_WEBGPU_STORAGE_BUFFERS_PER_STAGE = 8

# Only 2 device names on gpuinfo.org (Adreno 610 / 612) report less than 32 KiB of shared memory (its query in
# github.com/gpuweb/gpuweb/issues/2832), so 32 KiB holds for every class below but Adreno 6xx.
_GPUINFO_SHARED = 32768

DESKTOP_GPU = DeviceProfile(
    name="desktop-gpu", api=API_VULKAN, device_type="discrete",
    # AMD RDNA wave32 and NVIDIA warps are 32; Intel runs SIMD8-32, so no subgroup operation is assumed
    subgroup_size=32, subgroup_operations=("basic",), float16=True, int64=True, cooperative_matrix=(),
    **dict(_VK_REQUIRED, max_shared_memory_bytes=_GPUINFO_SHARED,
           max_storage_buffers_per_stage=_WEBGPU_STORAGE_BUFFERS_PER_STAGE),
    source="a desktop GPU without cooperative matrices (AMD, Intel, older NVIDIA): 32 KiB of shared memory "
           "(gpuweb issue 2832's gpuinfo.org query), subgroups of 32, 8 storage buffers per stage (WebGPU's "
           "default limit), the Vulkan 1.1 required limits otherwise")



# Phone GPUs reset a context whose job runs past a watchdog of a few seconds (Android kgsl on Adreno, Mali's
# job timeout; reports: SaschaWillems/Vulkan issue 445, device lost running compute on Mali-G71/G72; llama.cpp
# issue 21724, a job timeout from the command batch size on an AMD APU). No vendor documents a dispatch count and
# none was measured on a phone: 256 is a conservative choice (a step's kernels are short; a SmolLM2-135M step
# records ~4,600 dispatches, i.e. ~18 submits and fence round trips).
PHONE_MAX_DISPATCHES_PER_SUBMIT = 256

# A phone's GPU shares its RAM with the OS and every other app. Android documents no fixed per-app limit for
# GPU memory: ActivityManager.getMemoryClass() is the Java heap's, and Android 17's Memory Limiter
# (source.android.com/docs/core/perf/memory-limiter) caps a process's memory through cgroup v2 with no number
# published. A 4 GB phone leaves one app roughly 1-1.5 GB it can use; 1 GiB is a conservative choice, not a
# measurement, so that a program within it fits the class's smallest (4 GB) members.
PHONE_MEMORY_BUDGET_BYTES = 1 << 30


# ---- Vendor tuning as data: what `auto` and the GEMM plans read per vendor, each value with its source.
@dataclass(frozen=True)
class VendorGemmTuning:
    """One vendor's row: DeviceProfile.prefers_fp16 and DeviceProfile.gemm_tiles, and where they come from."""

    prefers_fp16: bool
    gemm_tiles: tuple[int, ...]  # (threads_x, threads_y, bk) of kernels/linear.py's tiled body; (): its default
    source: str


# Rows for the vendors without tensor-core kernels (NVIDIA with VK_KHR_cooperative_matrix takes fp16-tc, and
# the fp32 kernels' tiles measured on the H200: no row). None of these values was measured on the vendor's
# GPU: they are the vendors' published guidance, so a queried or measured profile may override them.
VENDOR_GEMM_TUNING: dict[str, VendorGemmTuning] = {
    # Adreno: fp16 arithmetic at twice the fp32 rate on packed pairs, and half the bytes per operand
    # (developer.android.com/games/optimize/vulkan-reduced-precision; ExecuTorch's Vulkan backend runs its
    # half-precision shaders on Adreno's fp16 ALUs, github.com/pytorch/executorch/pull/19287). Tiles: 16 x 8
    # threads = 128, the Vulkan-required maxComputeWorkGroupInvocations the phone profiles promise (two waves
    # of 64); 64 x 128 outputs per workgroup over bk = 8: 6 KiB of fp32 tiles, 3 KiB fp16, inside the 16 KiB
    # of an Adreno 610.
    "adreno": VendorGemmTuning(True, (16, 8, 8), "Android reduced-precision guide; ExecuTorch PR 19287 (Adreno "
                                                 "fp16 ALU); tiles: 128 threads (Vulkan-required limit), bk 8"),
    # Mali (Valhall): fp16 at twice the fp32 rate where the shader allows it (ExecuTorch PR 19287: Mali-G715
    # runs fp16 packed math once the precision contract permits); Arm's Mali best practices recommend 64
    # threads as the baseline workgroup size and no more (barriers and shared memory keep a workgroup on one
    # core), so 8 x 8 threads, 64 x 64 outputs over bk = 8: 4 KiB of fp32 tiles, 2 KiB fp16.
    "mali": VendorGemmTuning(True, (8, 8, 8), "Android reduced-precision guide; ExecuTorch PR 19287 (Mali-G715 "
                                              "fp16 packed math); tiles: Arm Mali best practices (64-thread "
                                              "workgroups), bk 8"),
    # The laptop classes keep the default 16 x 16-thread tiles (256 threads: 8 SIMD-groups of 32 on Apple, 4
    # waves of 64 on AMD, a multiple of Intel's SIMD8-32; within the 1024 invocations their drivers report;
    # 16 KiB of fp32 tiles, within the profiles' 32 KiB): no vendor publishes a GEMM tile for them.
    # Apple GPUs: 16-bit registers and ALUs, fewer registers and half the bandwidth per operand ("use half
    # wherever possible", WWDC 2016 session 606, Advanced Metal Shader Optimization).
    "apple": VendorGemmTuning(True, (), "WWDC 2016 session 606 (Advanced Metal Shader Optimization: use half); "
                                        "tiles: the default 16 x 16 threads"),
    # Intel Gen11 / Xe-LP EUs run fp16 at twice the fp32 rate (Intel Gen11 and Xe-LP architecture briefs).
    "intel": VendorGemmTuning(True, (), "Intel Gen11 / Xe-LP architecture briefs (fp16 at twice the fp32 rate); "
                                        "tiles: the default 16 x 16 threads"),
    # AMD GCN5 (Vega) and RDNA: packed fp16 math (v_pk_fma_f16) at twice the fp32 rate (AMD RDNA whitepaper;
    # the RDNA ISA reference). Matched by "amd" or "radeon" in the device name.
    "amd": VendorGemmTuning(True, (), "AMD RDNA whitepaper and ISA (packed fp16 at twice the fp32 rate); tiles: "
                                      "the default 16 x 16 threads"),
}
# Device-name words that name a vendor of VENDOR_GEMM_TUNING besides its key (RADV's "AMD Radeon ..." has both).
_VENDOR_ALIASES = {"radeon": "amd"}


def vendor_gemm_tuning(device_name: str) -> VendorGemmTuning | None:
    """The VENDOR_GEMM_TUNING row of a queried device, by its name ("Adreno (TM) 740", "Mali-G715"), or None."""
    lowered = device_name.lower()
    words = {**{vendor: vendor for vendor in VENDOR_GEMM_TUNING}, **_VENDOR_ALIASES}
    return next((VENDOR_GEMM_TUNING[vendor] for word, vendor in words.items() if word in lowered), None)


def _phone(name: str, vendor: str, subgroup_size: int, shared: int, source: str) -> DeviceProfile:
    """A phone class: the vendor's documented subgroup width, the shared memory gpuinfo.org shows for the
    class, and the Vulkan 1.1 required limits for the rest (every member has at least those); fp16 yes
    (VK_KHR_shader_float16_int8 on these classes), int64 and subgroup operations beyond basic not assumed;
    bounded submits (PHONE_MAX_DISPATCHES_PER_SUBMIT); a 4 GB phone's memory budget (PHONE_MEMORY_BUDGET_BYTES);
    the vendor's row of VENDOR_GEMM_TUNING."""
    tuning = VENDOR_GEMM_TUNING[vendor]
    return DeviceProfile(name=name, api=API_VULKAN, device_type="integrated", subgroup_size=subgroup_size,
                         subgroup_operations=("basic",), float16=True, int64=False, cooperative_matrix=(),
                         max_dispatches_per_submit=PHONE_MAX_DISPATCHES_PER_SUBMIT,
                         memory_budget_bytes=PHONE_MEMORY_BUDGET_BYTES, prefers_fp16=tuning.prefers_fp16,
                         gemm_tiles=tuning.gemm_tiles,
                         **dict(_VK_REQUIRED, max_shared_memory_bytes=shared,
                                max_storage_buffers_per_stage=_WEBGPU_STORAGE_BUFFERS_PER_STAGE),
                         source=f"{source}; 8 storage buffers per stage (WebGPU's default limit); GEMM tuning: "
                                f"{tuning.source}")


ADRENO_6XX = _phone("adreno-6xx", "adreno", 64, 16384, "phone class Adreno 6xx: waves of 64 fibers (Qualcomm Adreno GPU "
                    "docs), 16 KiB shared memory (Adreno 610 / 612 report less than 32 KiB: gpuweb issue 2832), "
                    "the Vulkan 1.1 required limits otherwise")
ADRENO_7XX = _phone("adreno-7xx", "adreno", 64, _GPUINFO_SHARED, "phone class Adreno 7xx: waves of 64 fibers (Qualcomm "
                    "Adreno GPU docs), 32 KiB shared memory (gpuweb issue 2832's gpuinfo.org query), the Vulkan "
                    "1.1 required limits otherwise")
MALI_G7X = _phone("mali-g7x", "mali", 16, _GPUINFO_SHARED, "phone class Mali-G77 / G78 (Valhall): warps of 16 threads "
                  "(Arm Mali GPU best practices; the Bifrost G71-G76 run 4 or 8: not this profile), 32 KiB shared "
                  "memory (gpuweb issue 2832's gpuinfo.org query), the Vulkan 1.1 required limits otherwise")
MALI_G7XX = _phone("mali-g7xx", "mali", 16, _GPUINFO_SHARED, "phone class Mali-G710 / G715 / G720: warps of 16 threads "
                   "(Arm Mali GPU best practices), 32 KiB shared memory (gpuweb issue 2832's gpuinfo.org query), "
                   "the Vulkan 1.1 required limits otherwise")


# An integrated laptop GPU shares the laptop's RAM with the OS and every app, as a phone's does: macOS gives
# Metal a working set below the RAM (MTLDevice.recommendedMaxWorkingSetSize), Windows lets an integrated GPU
# share at most half of it (WDDM's shared system memory), Linux's amdgpu / i915 take it from system RAM. An
# 8 GB laptop (the smallest Apple-silicon Mac; common Windows ones) leaves one app a few GB: 2 GiB is a
# conservative choice, not a measurement.
LAPTOP_MEMORY_BUDGET_BYTES = 2 << 30
# A laptop's compositor shares the GPU, and a long submission trips a watchdog here too: Windows resets a GPU
# whose packet runs past 2 s (TDR, TdrDelay's default), Metal aborts a command buffer that starves the display
# (kIOGPUCommandBufferCallbackErrorImpactingInteractivity), llama.cpp issue 21724 is a job timeout on an AMD
# APU. The phones' dispatch bound, the same conservative choice.
LAPTOP_MAX_DISPATCHES_PER_SUBMIT = PHONE_MAX_DISPATCHES_PER_SUBMIT
# What the three laptop vendors' Vulkan drivers report alike (gpuinfo.org's reports for Apple M1-M3 through
# MoltenVK, Intel UHD / Iris Xe through ANV and Intel's Windows driver, AMD Radeon 680M / 780M through RADV and
# AMD's driver; not queried on such a device here): 1024 invocations per workgroup, 1024 x 1024 x 64 of them
# at most (z: Vulkan's required 64, which is below every report). Shared memory: Apple's 32 KiB of threadgroup
# memory (Metal feature set tables); Intel's and AMD's drivers report up to 64 KiB, of which the profile
# promises the 32 KiB gpuinfo.org shows for every device but Adreno 610 / 612 (gpuweb issue 2832).
_LAPTOP_LIMITS = dict(_VK_REQUIRED, max_shared_memory_bytes=_GPUINFO_SHARED, max_workgroup_invocations=1024,
                      max_workgroup_size=(1024, 1024, 64), max_storage_buffers_per_stage=_WEBGPU_STORAGE_BUFFERS_PER_STAGE)


def _laptop(name: str, vendor: str, subgroup_size: int, source: str) -> DeviceProfile:
    """A laptop class with an integrated GPU: the subgroup width its drivers report, _LAPTOP_LIMITS and the
    Vulkan 1.1 required limits for the rest (their drivers report larger binding ranges and allocations;
    the required ones hold for every member and keep the profile emulable on lavapipe); fp16 yes, int64 and
    subgroup operations beyond basic not assumed (no kernel needs them off the CPU bodies); bounded submits
    (LAPTOP_MAX_DISPATCHES_PER_SUBMIT); an 8 GB laptop's budget (LAPTOP_MEMORY_BUDGET_BYTES); the vendor's row
    of VENDOR_GEMM_TUNING."""
    tuning = VENDOR_GEMM_TUNING[vendor]
    return DeviceProfile(name=name, api=API_VULKAN, device_type="integrated", subgroup_size=subgroup_size,
                         subgroup_operations=("basic",), float16=True, int64=False, cooperative_matrix=(),
                         max_dispatches_per_submit=LAPTOP_MAX_DISPATCHES_PER_SUBMIT,
                         memory_budget_bytes=LAPTOP_MEMORY_BUDGET_BYTES, prefers_fp16=tuning.prefers_fp16,
                         gemm_tiles=tuning.gemm_tiles, **_LAPTOP_LIMITS,
                         source=f"{source}; 8 storage buffers per stage (WebGPU's default limit); not queried on "
                                f"such a device; GEMM tuning: {tuning.source}")


APPLE_MOLTENVK = _laptop("apple-moltenvk", "apple", 32, "laptop class Apple M1-M3 through MoltenVK: SIMD-groups of "
                         "32 threads (Metal's threadExecutionWidth), 32 KiB threadgroup memory and 1024 threads per "
                         "threadgroup (Metal feature set tables), the Vulkan 1.1 required limits otherwise")
INTEL_INTEGRATED = _laptop("intel-integrated", "intel", 32, "laptop class Intel UHD / Iris Xe (Gen9-Gen12 "
                           "integrated): subgroupSize 32 as ANV and Intel's Windows driver report it (the compiler "
                           "may run a shader at SIMD8 or 16: no subgroup operation assumed), 1024 invocations "
                           "(gpuinfo.org), 32 KiB shared memory (gpuweb issue 2832's floor; the drivers report "
                           "64 KiB), the Vulkan 1.1 required limits otherwise")
AMD_INTEGRATED = _laptop("amd-integrated", "amd", 64, "laptop class AMD Radeon integrated (Vega / RDNA2 / RDNA3 "
                         "APUs, e.g. 680M / 780M): waves of 64 as RADV and AMD's driver report subgroupSize, 1024 "
                         "invocations (gpuinfo.org), 32 KiB shared memory (gpuweb issue 2832's floor; the drivers "
                         "report up to 64 KiB), the Vulkan 1.1 required limits otherwise")

PHONE_PROFILES = (ADRENO_6XX, ADRENO_7XX, MALI_G7X, MALI_G7XX)
LAPTOP_PROFILES = (APPLE_MOLTENVK, INTEL_INTEGRATED, AMD_INTEGRATED)
BUILTIN_PROFILES: dict[str, DeviceProfile] = {p.name: p for p in (LAVAPIPE, NVIDIA_COOPMAT, DESKTOP_GPU, *PHONE_PROFILES,
                                                                   *LAPTOP_PROFILES)}


def builtin_profile(name: str) -> DeviceProfile:
    """The built-in profile `name`; DeviceProfileError listing the names otherwise."""
    profile = BUILTIN_PROFILES.get(name)
    if profile is None:
        raise DeviceProfileError(f"no built-in device profile {name!r}; built-in: {', '.join(BUILTIN_PROFILES)}")
    return profile


def resolve_profile(spec: str) -> DeviceProfile:
    """A built-in profile by name, or a profile file (a path ending in .json, or any existing file)."""
    if spec in BUILTIN_PROFILES:
        return BUILTIN_PROFILES[spec]
    if spec.endswith(".json") or Path(spec).is_file():
        return load_profile(spec)
    raise DeviceProfileError(f"device profile {spec!r} is neither a built-in profile ({', '.join(BUILTIN_PROFILES)}) "
                             f"nor a profile file (FILE.json: `vktrain devices --json` writes one)")
