"""The WebGPU device: adapter choice, limits and features, the wgpu device and queue, host sync.

Adapter choice: wgpu's adapters (one per backend and GPU), OpenGL ones only when nothing else exists
(compute there is limited); then discrete > integrated > virtual > CPU, first listed wins a tie.
`VKTRAIN_DEVICE` (index into that list, or a case-insensitive part of the adapter's name) overrides it,
as for the Vulkan runtime.

Limits: the device asks for the adapter's own compute limits (WebGPU's defaults are far lower, e.g. 8
storage buffers per stage and 128 MiB bindings) and refuses an adapter below vktrain's minimum with
an error naming each limit. `limits={name: value}` asks for less than the adapter has, as a browser
grants (e.g. BROWSER_DEFAULT_LIMITS: 16 KiB of workgroup storage, 256 invocations); `limits` then reports
what the device was granted, and the kernel plans size their tiles by it (OpContext.limits). Optional features (timestamp-query, timestamp-query-inside-passes, shader-f16, subgroup) are enabled
where the adapter has them; `features` lists the enabled WebGPU feature names.

Kernel feature variants: `kernel_features` are the device features whose WGSL bodies the pipelines take
(wgsl.FEATURE_DEFINES: the subgroup reductions; shader-f16: the f16 GEMMs of `--precision fp16-tc`),
chosen here once: by default every one the device has; `kernel_features=()` keeps the browser-valid
defaults (tests run both). `kernel_report()` says which kernels took which bodies (the executor's report
line). The device reports no Vulkan features, no subgroup operations and no cooperative matrices, so the
executor picks the GPU tuning of the fp32 GEMMs; fp16-tc runs the f16 WGSL GEMMs where kernel_features
include shader-f16 (kernels/coopmat.py, _select_webgpu_route), never tensor cores.

Runtime checks: naga compiles WGSL with bounds checks on every storage/workgroup access and a counter in
every loop (ForceLoopBounding). `runtime_checks=False` compiles vktrain's own kernels (the pipeline cache's,
tested against references) as wgpu-native trusted modules without them (shader_modules.py); anything
else (a test's ad hoc WGSL through `handle.create_shader_module`) keeps them. Default: off where
wgpu-native has trusted modules, else on; env VKTRAIN_WEBGPU_RUNTIME_CHECKS=on|off sets it for a run
(the CLI, the bench). Why off: the checks never turn a kernel bug into an error (an out-of-bounds index
is clamped or its write dropped: silently wrong either way); what they add is containment, within one
binding, of a write that would otherwise land in another of this process's buffers, and a GPU that
cannot hang on a runaway loop. vktrain's kernels are its own and tested bit-exact on the edge shapes;
turn the checks on to tell a kernel bug that corrupts other tensors from one that does not.
`runtime_checks=False` where trusted modules do not exist is refused (WebGPUUnavailableError).

Errors: wgpu raises GPUValidationError for a bad call it catches at once; what it only logs (to the
"wgpu" logger) is collected in `validation_messages`, so tests can fail on it as on Vulkan's.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from vktrain.serialization.device_profile import WEBGPU_DEVICE_TYPE
from vktrain.runtime.vk.device import DEVICE_ENV, PhysicalDeviceInfo, ValidationMessage, select_physical_device
from vktrain.runtime.webgpu.errors import INSTALL_HINT, WebGPUError, WebGPUUnavailableError
from vktrain.runtime.webgpu.features import INSIDE_PASS_FEATURE

# wgpu's adapter types as VkPhysicalDeviceType numbers, so selection ranks them as the Vulkan runtime does.
_ADAPTER_TYPES = {"DiscreteGPU": 2, "IntegratedGPU": 1, "VirtualGPU": 3, "CPU": 4}
OPTIONAL_FEATURES = ("timestamp-query", INSIDE_PASS_FEATURE, "shader-f16", "subgroup")
DEVICE_TYPE = WEBGPU_DEVICE_TYPE  # not "cpu", whatever the adapter: WGSL kernels have the GPU-tuning bodies only

# The adapter limits the device asks for, and the least vktrain's kernels need of each.
_REQUIRED_LIMITS = {
    "max-storage-buffer-binding-size": 1 << 27,
    "max-buffer-size": 1 << 28,
    "max-storage-buffers-per-shader-stage": 8,
    "max-uniform-buffer-binding-size": 1 << 14,
    "max-compute-workgroup-storage-size": 16384,
    "max-compute-invocations-per-workgroup": 256,
    "max-compute-workgroup-size-x": 256,
    "max-compute-workgroup-size-y": 256,
    "max-compute-workgroup-size-z": 64,
    "max-compute-workgroups-per-dimension": 65535,
}
# WebGPU's default compute limits, what a browser grants when a page asks for nothing more.
BROWSER_DEFAULT_LIMITS = {"max-compute-workgroup-storage-size": 16384, "max-compute-invocations-per-workgroup": 256}
# Offset alignments are maxima (smaller is better): the adapter's own value is asked for.
_ALIGNMENT_LIMITS = ("min-storage-buffer-offset-alignment", "min-uniform-buffer-offset-alignment")
REUSED_STAGING_BYTES = 16 << 20  # downloads up to this size share one staging buffer (loss, state reads)
RUNTIME_CHECKS_ENV = "VKTRAIN_WEBGPU_RUNTIME_CHECKS"  # on|off: Device(runtime_checks=None) reads it
_RUNTIME_CHECKS_WORDS = {"on": True, "off": False}


def _private_runtime_dir() -> None:
    """Give this process an XDG_RUNTIME_DIR (a private temporary one, removed at exit) when it has none:
    the Vulkan driver's window-system code that wgpu-native loads prints "error: XDG_RUNTIME_DIR is
    invalid or not set in the environment." once per adapter without one, although compute needs no
    display and nothing is wrong."""
    if os.path.isdir(os.environ.get("XDG_RUNTIME_DIR", "")):
        return
    import atexit
    import shutil
    import tempfile

    directory = tempfile.mkdtemp(prefix="vktrain-runtime-")  # mode 0700, as XDG asks
    os.environ["XDG_RUNTIME_DIR"] = directory
    atexit.register(shutil.rmtree, directory, ignore_errors=True)


def load_wgpu():
    """Import and return `wgpu`, or raise WebGPUUnavailableError saying what to install."""
    _private_runtime_dir()
    try:
        import wgpu
    except ImportError as exc:
        raise WebGPUUnavailableError(f"the Python package `wgpu` is not importable ({exc}); {INSTALL_HINT}") from exc
    return wgpu


@dataclass(frozen=True)
class WebGPULimits:
    """The adapter limits the runtime checks against, under the Vulkan layer's names where they agree."""

    max_storage_buffer_range: int  # max-storage-buffer-binding-size
    min_storage_buffer_offset_alignment: int
    max_compute_work_group_count: tuple[int, int, int]
    max_compute_work_group_size: tuple[int, int, int]
    max_compute_work_group_invocations: int
    max_compute_shared_memory_size: int  # max-compute-workgroup-storage-size
    max_per_stage_descriptor_storage_buffers: int
    max_buffer_size: int
    max_uniform_buffer_binding_size: int
    min_uniform_buffer_offset_alignment: int


class _LoggedErrors(logging.Handler):
    """Collects what wgpu logs at ERROR level (errors no API call raised) as ValidationMessages."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.messages: list[ValidationMessage] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(ValidationMessage("error", "validation", record.name, record.getMessage()))


def _adapter_info(index: int, adapter) -> PhysicalDeviceInfo:
    info = adapter.info
    name = f"{info.get('device') or info.get('description') or 'adapter'} ({info.get('backend_type', '?')})"
    return PhysicalDeviceInfo(index, name, _ADAPTER_TYPES.get(info.get("adapter_type", ""), 0))


def _timestamp_period_ns(queue) -> float:
    """Nanoseconds per timestamp tick: wgpu-native resolves raw ticks (1 ns on NVIDIA and lavapipe, not
    everywhere), and wgpu-py 0.32 does not expose the period, so it is asked of wgpu-native directly."""
    from wgpu.backends.wgpu_native._api import lib

    return float(lib.wgpuQueueGetTimestampPeriod(queue._internal))


class Device:
    """A wgpu device with its queue (see the module docstring). Use as a context manager or close()."""

    buffer_type: type
    program_type: type

    def __init__(self, selector: str | int | None = None, *, validation: bool | None = None,
                 limits: dict[str, int] | None = None, kernel_features=None, runtime_checks: bool | None = None):
        from vktrain.runtime.webgpu.memory import Buffer
        from vktrain.runtime.webgpu.program import Program

        # Buffer(device, ...) and Program(device, ...) of vktrain.runtime build these for this device.
        self.buffer_type, self.program_type = Buffer, Program
        self.wgpu = load_wgpu()
        self._closed = False
        self._children: dict[int, Any] = {}
        self._sync_source = self._staging = None
        self.validation_enabled = bool(validation)  # wgpu always validates; kept for the Vulkan interface
        self.pipelines = None
        self._errors = _LoggedErrors()
        logging.getLogger("wgpu").addHandler(self._errors)
        try:
            self._open(os.environ.get(DEVICE_ENV) if selector is None else selector, dict(limits or {}))
            self.kernel_features = self._kernel_features(kernel_features)
            self.runtime_checks = self._runtime_checks(runtime_checks)
        except BaseException:
            self.close()
            raise

    def _open(self, selector: str | int | None, limits: dict[str, int]) -> None:
        wgpu = self.wgpu
        try:
            adapters = list(wgpu.gpu.enumerate_adapters_sync())
        except Exception as exc:
            raise WebGPUUnavailableError(f"wgpu cannot list adapters ({exc}); {INSTALL_HINT}") from exc
        native = [a for a in adapters if a.info.get("backend_type") != "OpenGL"]
        adapters = native or adapters
        infos = [_adapter_info(i, a) for i, a in enumerate(adapters)]
        self.available_devices = tuple(infos)
        if not infos:
            raise WebGPUUnavailableError(f"wgpu found no adapter; {INSTALL_HINT}")
        chosen = select_physical_device(infos, selector)
        self.adapter = adapters[chosen]
        self.info = infos[chosen]
        self.adapter_type = self.adapter.info.get("adapter_type", "unknown")
        self.backend = self.adapter.info.get("backend_type", "unknown")
        self._request_device(limits)
        from vktrain.runtime.webgpu.pipelines import PipelineCache
        self.pipelines = PipelineCache(self)

    def _request_device(self, limits: dict[str, int]) -> None:
        adapter_limits = dict(self.adapter.limits)
        short = [f"{key} = {adapter_limits.get(key, 0)} (vktrain needs {least})"
                 for key, least in _REQUIRED_LIMITS.items() if adapter_limits.get(key, 0) < least]
        if short:
            raise WebGPUUnavailableError(f"WebGPU adapter {self.info.describe()} is below vktrain's minimum: "
                                         f"{'; '.join(short)}")
        required = {key: adapter_limits[key] for key in (*_REQUIRED_LIMITS, *_ALIGNMENT_LIMITS)}
        required.update(self._reduced_limits(limits, adapter_limits))
        features = [f for f in OPTIONAL_FEATURES if f in self.adapter.features]
        try:
            self.handle = self.adapter.request_device_sync(label="vktrain", required_features=features,
                                                           required_limits=required)
        except Exception as exc:
            raise WebGPUError(f"requesting a device of {self.info.describe()} with limits {required} and "
                              f"features {features} failed: {exc}") from exc
        self.queue = self.handle.queue
        self.timestamp_period_ns = _timestamp_period_ns(self.queue)
        self.features = frozenset(self.handle.features) & frozenset(OPTIONAL_FEATURES)
        lim = dict(self.handle.limits)
        self.limits = WebGPULimits(
            max_storage_buffer_range=int(lim["max-storage-buffer-binding-size"]),
            min_storage_buffer_offset_alignment=int(lim["min-storage-buffer-offset-alignment"]),
            max_compute_work_group_count=(int(lim["max-compute-workgroups-per-dimension"]),) * 3,
            max_compute_work_group_size=(int(lim["max-compute-workgroup-size-x"]),
                                         int(lim["max-compute-workgroup-size-y"]),
                                         int(lim["max-compute-workgroup-size-z"])),
            max_compute_work_group_invocations=int(lim["max-compute-invocations-per-workgroup"]),
            max_compute_shared_memory_size=int(lim["max-compute-workgroup-storage-size"]),
            max_per_stage_descriptor_storage_buffers=int(lim["max-storage-buffers-per-shader-stage"]),
            max_buffer_size=int(lim["max-buffer-size"]),
            max_uniform_buffer_binding_size=int(lim["max-uniform-buffer-binding-size"]),
            min_uniform_buffer_offset_alignment=int(lim["min-uniform-buffer-offset-alignment"]),
        )

    def _reduced_limits(self, limits: dict[str, int], adapter_limits: dict[str, int]) -> dict[str, int]:
        """`limits` checked: each one vktrain asks for, between vktrain's minimum and the adapter's value."""
        problems = []
        for key, value in limits.items():
            if key not in _REQUIRED_LIMITS:
                problems.append(f"{key!r} is not a limit vktrain asks for (one of {', '.join(_REQUIRED_LIMITS)})")
            elif isinstance(value, bool) or not isinstance(value, int):
                problems.append(f"{key} must be an int, got {value!r}")
            elif not _REQUIRED_LIMITS[key] <= value <= adapter_limits[key]:
                problems.append(f"{key} = {value} is outside [{_REQUIRED_LIMITS[key]} (vktrain's minimum), "
                                f"{adapter_limits[key]} (the adapter's)]")
        if problems:
            raise WebGPUUnavailableError(f"Device(limits=...) for {self.info.describe()}: {'; '.join(problems)}")
        return limits

    def _kernel_features(self, wanted) -> frozenset[str]:
        """The kernel feature variants to use: `wanted` checked against the device's, or all it has."""
        from vktrain.runtime_shaders.wgsl import FEATURE_DEFINES

        if wanted is None:
            return frozenset(FEATURE_DEFINES) & self.features
        wanted = frozenset(wanted)
        unknown = sorted(wanted - FEATURE_DEFINES.keys())
        if unknown:
            raise WebGPUUnavailableError(f"Device(kernel_features=...): {unknown} have no WGSL bodies (known: "
                                         f"{sorted(FEATURE_DEFINES)})")
        missing = sorted(wanted - self.features)
        if missing:
            raise WebGPUUnavailableError(f"Device(kernel_features=...): {self.info.describe()} lacks {missing} "
                                         f"(it has {sorted(self.features)})")
        return wanted

    def _runtime_checks(self, wanted: bool | None) -> bool:
        """Whether vktrain's kernels compile with naga's runtime checks: `wanted`, else the environment's
        RUNTIME_CHECKS_ENV, else off where trusted modules exist (see the module docstring)."""
        from vktrain.runtime.webgpu.shader_modules import trusted_modules_unavailable

        what = "Device(runtime_checks=...)"
        if wanted is None and os.environ.get(RUNTIME_CHECKS_ENV):
            word = os.environ[RUNTIME_CHECKS_ENV].strip().lower()
            if word not in _RUNTIME_CHECKS_WORDS:
                raise WebGPUUnavailableError(f"{RUNTIME_CHECKS_ENV}={os.environ[RUNTIME_CHECKS_ENV]!r}: expected one "
                                             f"of {', '.join(_RUNTIME_CHECKS_WORDS)}")
            wanted, what = _RUNTIME_CHECKS_WORDS[word], f"{RUNTIME_CHECKS_ENV}={word}"
        if wanted is not None and not isinstance(wanted, bool):
            raise WebGPUUnavailableError(f"{what}: expected True, False or None, got {wanted!r}")
        unavailable = trusted_modules_unavailable(self.handle)
        if wanted is False and unavailable is not None:
            raise WebGPUUnavailableError(f"{what} asks for kernels without runtime checks, but {unavailable}; "
                                         "leave the checks on")
        return unavailable is not None if wanted is None else wanted

    def kernel_report(self) -> str:
        """Which WGSL feature bodies the pipelines built so far took (or why none)."""
        from vktrain.runtime_shaders.wgsl import FEATURE_DEFINES

        used = self.pipelines.feature_kernels() if self.pipelines is not None else {}
        parts = [f"{feature} bodies in {', '.join(sorted(used[feature]))}" for feature in sorted(used)]
        absent = sorted(frozenset(FEATURE_DEFINES) - self.kernel_features)
        if absent:
            parts.append(f"{', '.join(absent)}: browser-valid defaults ("
                         + ("not chosen" if frozenset(absent) <= self.features else "the device lacks it") + ")")
        none = "browser-valid defaults (no kernel built so far has a feature body)"
        checks = "runtime checks " + ("on" if self.runtime_checks else "off (wgpu-native trusted modules)")
        return "WGSL kernels: " + ("; ".join(parts) or none) + f"; {checks}"

    # ------------------------------------------------------------------------------ properties
    @property
    def name(self) -> str:
        return self.info.name

    device_type = DEVICE_TYPE
    subgroup_size = 0  # WGSL kernels use no subgroup operations by default
    subgroup_operations = 0
    cooperative_matrix_properties: tuple = ()

    @property
    def timestamps_supported(self) -> bool:
        return "timestamp-query" in self.features

    @property
    def validation_messages(self) -> list[ValidationMessage]:
        return self._errors.messages

    def take_validation_messages(self) -> list[ValidationMessage]:
        taken = list(self._errors.messages)
        self._errors.messages.clear()
        return taken

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"WebGPU via {self.backend}"
        return f"Device({self.info.describe()}, {state})"

    # ------------------------------------------------------------------------------ execution
    def submit(self, command_buffers: list) -> None:
        self._check_open()
        self.queue.submit(command_buffers)

    def download(self, source, offset: int, nbytes: int) -> np.ndarray:
        """Bytes [offset, offset + nbytes) (whole words) of the GPU buffer `source` once the work submitted
        before has run: copied into a MAP_READ staging buffer (one reused for reads up to
        REUSED_STAGING_BYTES), which is then mapped."""
        self._check_open()
        usage = self.wgpu.BufferUsage
        reuse = nbytes <= REUSED_STAGING_BYTES
        if reuse and (self._staging is None or self._staging.size < nbytes):
            if self._staging is not None:
                self._staging.destroy()
            self._staging = self.handle.create_buffer(label="vktrain staging download", size=max(nbytes, 1 << 16),
                                                      usage=usage.COPY_DST | usage.MAP_READ)
        staging = self._staging if reuse else self.handle.create_buffer(
            label="vktrain staging download (large)", size=nbytes, usage=usage.COPY_DST | usage.MAP_READ)
        try:
            encoder = self.handle.create_command_encoder()
            encoder.copy_buffer_to_buffer(source, offset, staging, 0, nbytes)
            self.queue.submit([encoder.finish()])
            staging.map_sync("READ", 0, nbytes)
            data = np.frombuffer(staging.read_mapped(0, nbytes), np.uint8).copy()
            staging.unmap()
        finally:
            if not reuse:
                staging.destroy()
        return data

    def wait_idle(self) -> None:
        """Block until all submitted work finished: a 4-byte download after it (queue order).

        (queue.on_submitted_work_done_sync() is broken in wgpu 0.32.)"""
        self._check_open()
        if self._sync_source is None:
            self._sync_source = self.handle.create_buffer(label="vktrain sync source", size=4,
                                                          usage=self.wgpu.BufferUsage.COPY_SRC)
        self.download(self._sync_source, 0, 4)

    # ------------------------------------------------------------------------------ lifetime
    def _register(self, child: Any) -> None:
        self._check_open()
        self._children[id(child)] = child

    def _unregister(self, child: Any) -> None:
        self._children.pop(id(child), None)

    def _check_open(self) -> None:
        if self._closed:
            raise WebGPUUnavailableError("this WebGPU Device is closed")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Destroy every live Buffer and Program, then the device. Idempotent."""
        if self._closed:
            return
        try:
            for child in list(self._children.values()):
                child.destroy()
            for buffer in (self._sync_source, self._staging):
                if buffer is not None:
                    buffer.destroy()
            if self.pipelines is not None:
                self.pipelines.clear()
            if getattr(self, "handle", None) is not None:
                self.handle.destroy()
        finally:
            self._closed = True
            logging.getLogger("wgpu").removeHandler(self._errors)

    def __enter__(self) -> "Device":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
