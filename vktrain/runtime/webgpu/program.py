"""A list of Dispatch records on a WebGPU device: checked and prepared once, re-encoded per replay.

`Program(device, dispatches, buffers)` checks every dispatch against its WGSL kernel and the device's
limits before anything reaches wgpu (a wgpu panic kills the process): a kernel for every shader (all
missing ones named at once), bindings, offset alignment, binding sizes against
max-storage-buffer-binding-size (naming the tensor), storage buffers per stage, params bytes, override
constants, local size and workgroup memory, split group counts. It then builds the pipelines, the
bind groups (one per dispatch, one per chunk of a split dispatch) and one uniform buffer holding every
dispatch's params at 256-byte-aligned offsets, written once.

WebGPU command buffers are single-use (submitting one twice aborts the process), so every replay
submits a fresh encoding of the whole list into one compute pass (one per bounded submit, below), from the
prepared pipelines and bind groups. Each submit() encodes the next replay's command buffer right after submitting, so encoding
overlaps the GPU's work instead of adding to it (`last_encode_s`: the host seconds one encoding took);
wait() waits through a buffer read (Device.wait_idle). WebGPU orders storage accesses between dispatches itself; the barrier plan is
still computed (`barriers`, the same data as on Vulkan).

Bounded submits (`max_dispatches_per_submit`, as on Vulkan: vk/commands.py): a replay is encoded into one
command buffer per submit of at most that many dispatches (split chunks counted one by one), and submit()
hands them to queue.submit one at a time, waiting for the queue to drain between them (`submits_per_replay`,
`submit_count`).

Timing (`timing=True`, adapters with timestamp-query): where the adapter also has native wgpu's
timestamp-query-inside-passes, the one pass gets a timestamp before the first dispatch and after each,
and `timings()` returns, per Dispatch, the time its completion added (as on Vulkan); otherwise (browser
WebGPU) each Dispatch gets a pass of its own timed at both ends, and `timings()` returns its own time.
None without timestamp queries. Setting `timing_enabled = False` afterwards encodes the next replays
into one pass, untimed. A query set holds at most QUERY_SET_CAPACITY queries (WebGPU's limit), so the
timestamps of a longer list (a 30-layer step: 4,600 dispatches) go to several sets, resolved into one
buffer.
"""
from __future__ import annotations

import struct
import time
from typing import Hashable, Mapping, Sequence

import numpy as np

from vktrain.runtime.device_objects import ProgramBase
# run_dispatches is the Vulkan layer's: its Program(device, ...) builds this layer's Program for a WebGPU device.
from vktrain.runtime.vk.commands import max_group_counts, run_dispatches  # noqa: F401  (re-exported)
from vktrain.runtime.vk.errors import BindingRangeError, format_bytes
from vktrain.serialization.dispatch import ScheduleError
from vktrain.serialization.dispatch import LOCAL_SIZE_SPEC_IDS, PUSH_HEADER_BYTES, Dispatch, ceil_div
from vktrain.runtime.vk.schedule import (ResolvedAccess, plan_barriers, plan_submits, resolve_binding, split_groups,
                                         timestamp_spans)
from vktrain.runtime.webgpu.features import INSIDE_PASS_FEATURE, UNIFORM_SLOT_ALIGNMENT
from vktrain.runtime.webgpu.errors import MissingKernelsError, WebGPUError
from vktrain.runtime.webgpu.memory import Buffer


QUERY_SET_CAPACITY = 4096  # WebGPU's most queries in one QuerySet; a multiple of 32 keeps resolve offsets 256-aligned


def write_timestamp(compute_pass, query_set, index: int) -> None:
    """A timestamp inside a compute pass (native wgpu only; wgpu imported when a Program needs it)."""
    from wgpu.backends.wgpu_native.extras import write_timestamp as native_write_timestamp

    native_write_timestamp(compute_pass, query_set, index)


def missing_kernels(device, shaders) -> list[str]:
    """The shader names among `shaders` that have no WGSL kernel, sorted."""
    from vktrain.runtime_shaders.wgsl import WGSLKernelNotFoundError

    missing = []
    for shader in sorted(set(shaders)):
        try:
            device.pipelines.source(shader)
        except WGSLKernelNotFoundError:
            missing.append(shader)
    return missing


class _Planned:
    """One Dispatch checked against its kernel: pipeline, resolved bindings, chunks and their params."""

    def __init__(self, dispatch: Dispatch, pipeline, group_layout, bindings, chunks, params: list[bytes]):
        self.dispatch = dispatch
        self.pipeline = pipeline
        self.group_layout = group_layout
        self.bindings = bindings  # (buffer, offset, size, reads, writes) per storage binding
        self.chunks = chunks  # (group offset, group counts)
        self.params = params  # the params bytes of each chunk (empty list: no params block)
        self.bind_groups: list = []

    def accesses(self) -> list[ResolvedAccess]:
        return [ResolvedAccess(id(buf), offset, offset + size, reads, writes)
                for buf, offset, size, reads, writes in self.bindings]


class Program(ProgramBase):
    """A checked, replayable list of dispatches on a WebGPU Device (see the module docstring).

    Same signature as the Vulkan Program: `buffers` maps BufferBinding keys to Buffers,
    `max_group_count` lowers the per-axis group limit (tests force splits with it), `timing` turns on
    per-dispatch timestamps where the adapter has them, `max_dispatches_per_submit` bounds a submit, `modules` (shader name -> an embedded ShaderModule) gives those kernels' WGSL. `timeout_s` is accepted for that signature only:
    WebGPU waits by mapping a buffer, which has no timeout.
    """

    def __init__(self, device, dispatches: Sequence[Dispatch], buffers: Mapping[Hashable, Buffer] | None = None,
                 *, timing: bool = False, max_group_count: int | Sequence[int] | None = None,
                 timeout_s: float | None = None, max_dispatches_per_submit: int | None = None,
                 modules: Mapping[str, object] | None = None):
        self.device = device
        # shader name -> WGSL text of a module embedded in the blob (else the local source)
        self._codes = {name: module.text for name, module in (modules or {}).items()}
        self.submit_count = 0
        self.dispatches = tuple(dispatches)
        self._alive = False
        self._params_buffer = self._query_set = self._query_resolve = None
        self._query_sets: list = []
        self._inside_pass = False
        self._pending = False
        self._submitted_once = False
        self.last_encode_s: float | None = None  # host seconds the last encoding took
        self._encoded = None  # (command buffers, timed) encoded ahead for the next submit()
        if not self.dispatches:
            raise ScheduleError("a Program needs at least one Dispatch")
        for dispatch in self.dispatches:
            if not isinstance(dispatch, Dispatch):
                raise ScheduleError(f"Program takes Dispatch records, got {type(dispatch).__name__}")
        missing = missing_kernels(device, (d.shader for d in self.dispatches if d.shader not in self._codes))
        if missing:
            raise MissingKernelsError(missing)
        max_counts = max_group_counts(device, max_group_count)
        planned = [self._plan(i, d, buffers or {}, max_counts) for i, d in enumerate(self.dispatches)]
        self.barriers: list[bool] = plan_barriers([p.accesses() for p in planned])
        self.recorded_dispatch_count = sum(len(p.chunks) for p in planned)
        self._submit_plan = plan_submits([len(p.chunks) for p in planned], max_dispatches_per_submit)
        self.submits_per_replay = len(self._submit_plan)
        # Inside one pass: (query before, query after) per Dispatch (vk/schedule.py timestamp_spans).
        self._timestamp_spans, inside_pass_queries = timestamp_spans(self._submit_plan,
                                                                     [len(p.chunks) for p in planned])
        self._inside_pass_queries = inside_pass_queries
        self._bound_buffers = list({id(b): b for p in planned for b, *_ in p.bindings}.values())
        self.timing_enabled = bool(timing) and device.timestamps_supported
        self._planned = planned
        device._register(self)
        self._alive = True
        try:
            self._prepare(planned)
        except BaseException:
            self.destroy()
            raise

    # ------------------------------------------------------------------------------- checking
    def _plan(self, position: int, dispatch: Dispatch, buffers: Mapping[Hashable, Buffer], max_counts) -> _Planned:
        device = self.device
        limits = device.limits
        where = f"dispatch #{position} {dispatch.name!r}"
        code = self._codes.get(dispatch.shader)
        interface = device.pipelines.interface(dispatch.shader, code)
        declared = len(interface.storage)
        if len(dispatch.bindings) != declared:
            raise ScheduleError(
                f"{where}: WGSL kernel {dispatch.shader!r} declares {declared} storage buffers but the Dispatch "
                f"binds {len(dispatch.bindings)}")
        if declared > limits.max_per_stage_descriptor_storage_buffers:
            raise ScheduleError(
                f"{where}: WGSL kernel {dispatch.shader!r} binds {declared} storage buffers, more than the "
                f"device's max-storage-buffers-per-shader-stage of {limits.max_per_stage_descriptor_storage_buffers}")
        resolved = []
        for index, (binding, info) in enumerate(zip(dispatch.bindings, interface.storage)):
            buffer, offset, size = resolve_binding(where, index, binding, buffers, device, Buffer,
                                                   "min-storage-buffer-offset-alignment")
            if size % 4:
                raise BindingRangeError(f"{where}: binding {index} ({buffer.name!r}) spans {size} bytes; WebGPU "
                                        f"storage bindings are whole 4-byte words")
            if size > limits.max_storage_buffer_range:
                raise BindingRangeError(
                    f"{where}: binding {index} binds tensor {buffer.name!r} over {format_bytes(size)}, more than "
                    f"the WebGPU device's max-storage-buffer-binding-size of "
                    f"{format_bytes(limits.max_storage_buffer_range)}")
            if binding.access is not None:
                reads, writes = binding.reads, binding.writes
            else:
                reads, writes = True, not info.readonly
            resolved.append((buffer, offset, size, reads, writes))

        prefix = interface.has_group_offset_header
        params_size = (PUSH_HEADER_BYTES if prefix else 0) + len(dispatch.push_constants)
        if interface.params is None:
            if dispatch.push_constants:
                raise ScheduleError(f"{where}: WGSL kernel {dispatch.shader!r} has no params block, the Dispatch "
                                    f"gives {len(dispatch.push_constants)} bytes of push constants")
        elif interface.params_bytes is not None and params_size != interface.params_bytes:
            kernel_bytes = interface.params_bytes - (PUSH_HEADER_BYTES if prefix else 0)
            raise ScheduleError(
                f"{where}: WGSL kernel {dispatch.shader!r} expects {kernel_bytes} bytes of push constants"
                f"{' after the 16-byte group-offset header' if prefix else ''}, the Dispatch gives "
                f"{len(dispatch.push_constants)}")
        if params_size > limits.max_uniform_buffer_binding_size:
            raise ScheduleError(f"{where}: {params_size} params bytes exceed the device's "
                                f"max-uniform-buffer-binding-size of {limits.max_uniform_buffer_binding_size}")

        if dispatch.local_size is not None:
            for axis, spec_id in enumerate(LOCAL_SIZE_SPEC_IDS):
                if spec_id not in interface.spec_types and dispatch.local_size[axis] != 1:
                    raise ScheduleError(
                        f"{where}: local_size {dispatch.local_size} but WGSL kernel {dispatch.shader!r} does not "
                        f"take its workgroup size {'xyz'[axis]} from override @id({spec_id})")
            x, y, z = dispatch.local_size
            if any(v > m for v, m in zip(dispatch.local_size, limits.max_compute_work_group_size)) or \
                    x * y * z > limits.max_compute_work_group_invocations:
                raise ScheduleError(
                    f"{where}: local_size {dispatch.local_size} exceeds the device's max-compute-workgroup-size "
                    f"{limits.max_compute_work_group_size} / max-compute-invocations-per-workgroup "
                    f"{limits.max_compute_work_group_invocations}")
        specialization = tuple((i, v) for i, v in dispatch.specialization()
                               if not (i in LOCAL_SIZE_SPEC_IDS and i not in interface.spec_types))
        unmet = interface.unmet_requirements(dict(specialization))
        if unmet:
            raise ScheduleError(f"{where}: WGSL kernel {dispatch.shader!r} cannot run these constants "
                                f"{dict(specialization)}: {'; '.join(unmet)}")
        shared = interface.workgroup_memory_bytes(dict(specialization))
        if shared is not None and shared > limits.max_compute_shared_memory_size:
            raise ScheduleError(f"{where}: WGSL kernel {dispatch.shader!r} needs {shared} bytes of workgroup memory "
                                f"with these constants, more than the device's max-compute-workgroup-storage-size "
                                f"of {limits.max_compute_shared_memory_size}")

        chunks = split_groups(dispatch.groups, max_counts)
        if len(chunks) > 1 and not prefix:
            raise ScheduleError(
                f"{where}: {dispatch.groups} work groups exceed the per-axis limit {max_counts}, and WGSL kernel "
                f"{dispatch.shader!r} cannot be split because its params block does not start with "
                f"vktrain_group_offset; add the header or loop over the work in the kernel")
        params = []
        if interface.params is not None:
            for group_offset, _ in chunks:
                header = struct.pack("<4I", *group_offset, 0) if prefix else b""
                data = header + dispatch.push_constants
                size = ceil_div(max(len(data), interface.params_struct_bytes or 0, 16), 16) * 16
                params.append(data + bytes(size - len(data)))
        pipeline = device.pipelines.get(dispatch.shader, specialization, code)
        group_layout = device.pipelines.layout(dispatch.shader, code)[0]
        return _Planned(dispatch, pipeline, group_layout, resolved, chunks, params)

    # ------------------------------------------------------------------------------- preparing
    def _prepare(self, planned: list[_Planned]) -> None:
        device = self.device
        wgpu = device.wgpu
        alignment = max(UNIFORM_SLOT_ALIGNMENT, device.limits.min_uniform_buffer_offset_alignment)
        slots, total = [], 0
        for plan in planned:
            for data in plan.params:
                slots.append((total, data))
                total = ceil_div(total + len(data), alignment) * alignment
        if slots:
            self._params_buffer = device.handle.create_buffer(
                label="vktrain params", size=total, usage=wgpu.BufferUsage.UNIFORM | wgpu.BufferUsage.COPY_DST)
            image = np.zeros(total, np.uint8)
            for offset, data in slots:
                image[offset:offset + len(data)] = np.frombuffer(data, np.uint8)
            device.queue.write_buffer(self._params_buffer, 0, image)
        slot_iter = iter(slots)
        for position, plan in enumerate(planned):
            storage = [{"binding": i, "resource": {"buffer": buf.handle, "offset": offset, "size": size}}
                       for i, (buf, offset, size, _, _) in enumerate(plan.bindings)]
            for _ in range(len(plan.chunks) if plan.params else 1):
                entries = list(storage)
                if plan.params:
                    offset, data = next(slot_iter)
                    entries.append({"binding": len(storage), "resource": {
                        "buffer": self._params_buffer, "offset": offset, "size": len(data)}})
                try:
                    plan.bind_groups.append(device.handle.create_bind_group(
                        label=plan.dispatch.name, layout=plan.group_layout, entries=entries))
                except Exception as exc:
                    raise WebGPUError(f"dispatch #{position} {plan.dispatch.name!r}: wgpu refused its bind "
                                      f"group: {exc}") from exc
        if self.timing_enabled:
            # Inside one pass (native wgpu's timestamp-query-inside-passes): a timestamp before the first
            # dispatch and after each. Otherwise (browser WebGPU): a pass per Dispatch, timed at both ends.
            self._inside_pass = INSIDE_PASS_FEATURE in device.features
            count = self._inside_pass_queries if self._inside_pass else 2 * len(planned)
            self._query_sets = [device.handle.create_query_set(type=wgpu.QueryType.timestamp,
                                                               count=min(QUERY_SET_CAPACITY, count - first))
                                for first in range(0, count, QUERY_SET_CAPACITY)]
            self._query_set = self._query_sets[0]
            self._query_resolve = device.handle.create_buffer(
                size=8 * count, usage=wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC)

    def _query(self, index: int):
        """(query set, index in it) of timestamp `index` of the whole list."""
        return self._query_sets[index // QUERY_SET_CAPACITY], index % QUERY_SET_CAPACITY

    # ------------------------------------------------------------------------------- execution
    def _encode(self, timed: bool) -> list:
        """Command buffers running every dispatch once, one per bounded submit (timestamped when `timed`)."""
        start = time.perf_counter()
        per_pass = timed and not self._inside_pass
        command_buffers = []
        queries = iter(range(self._inside_pass_queries))  # inside one pass: timestamp_spans's numbering
        for number, runs in enumerate(self._submit_plan):
            encoder = self.device.handle.create_command_encoder()
            compute_pass = None if per_pass else encoder.begin_compute_pass()
            if timed and not per_pass:
                write_timestamp(compute_pass, *self._query(next(queries)))
            bound = None
            for index, first, end in runs:
                plan = self._planned[index]
                finished = end == len(plan.chunks)
                if per_pass:
                    # A Dispatch cut by a submit boundary: its first part's pass writes the start, its last the end.
                    query_set, begin = self._query(2 * index)  # an even capacity keeps both ends in one set
                    writes = {"query_set": query_set}
                    if first == 0:
                        writes["beginning_of_pass_write_index"] = begin
                    if finished:
                        writes["end_of_pass_write_index"] = begin + 1
                    compute_pass = encoder.begin_compute_pass(timestamp_writes=writes)
                    bound = None
                if plan.pipeline is not bound:
                    compute_pass.set_pipeline(plan.pipeline)
                    bound = plan.pipeline
                single = len(plan.bind_groups) == 1
                if single:
                    compute_pass.set_bind_group(0, plan.bind_groups[0])
                for chunk in range(first, end):
                    if not single:
                        compute_pass.set_bind_group(0, plan.bind_groups[chunk])
                    compute_pass.dispatch_workgroups(*plan.chunks[chunk][1])
                if per_pass:
                    compute_pass.end()
                elif timed and finished:
                    write_timestamp(compute_pass, *self._query(next(queries)))
            if not per_pass:
                compute_pass.end()
            if timed and number == len(self._submit_plan) - 1:
                for set_number, query_set in enumerate(self._query_sets):
                    encoder.resolve_query_set(query_set, 0, query_set.count, self._query_resolve,
                                              8 * QUERY_SET_CAPACITY * set_number)
            command_buffers.append(encoder.finish())
        self.last_encode_s = time.perf_counter() - start
        return command_buffers

    def submit(self) -> None:
        """Encode and submit the dispatches without waiting (wait() before touching their buffers)."""
        self._check_alive()
        if self._pending:
            raise ScheduleError("this Program is still running; wait() before submitting it again")
        dead = [b.name for b in self._bound_buffers if not b.alive]
        if dead:
            raise ScheduleError(f"cannot replay: buffers {dead} were destroyed after the Program was built; "
                                f"build a new Program for new buffers")
        timed = self.timing_enabled and self._query_set is not None
        command_buffers, encoded_timed = self._encoded or (None, None)
        if encoded_timed != timed:
            command_buffers = self._encode(timed)
        self._encoded = None
        for number, command_buffer in enumerate(command_buffers):
            self.device.submit([command_buffer])
            self.submit_count += 1
            if number < len(command_buffers) - 1:  # the queue drains before the next bounded submit
                self.device.wait_idle()
        self._pending = True
        self._submitted_once = True
        # The next replay runs the same commands: encode them now, while the GPU runs these.
        self._encoded = (self._encode(timed), timed)

    def wait(self) -> None:
        """Block until the last submit() finished (no-op when nothing is pending)."""
        self._check_alive()
        if self._pending:
            self.device.wait_idle()
            self._pending = False

    def timings(self) -> list[float] | None:
        """Seconds per Dispatch of the last replay (see module docstring); None without timestamps."""
        self._check_alive()
        if self._query_set is None or not self.timing_enabled:
            return None
        if not self._submitted_once:
            raise ScheduleError("timings() before the first replay()")
        self.wait()
        ticks = np.frombuffer(self.device.queue.read_buffer(self._query_resolve), np.uint64).astype(np.int64)
        period_s = self.device.timestamp_period_ns * 1e-9
        spans = self._timestamp_spans if self._inside_pass else [(2 * i, 2 * i + 1)
                                                                 for i in range(len(self.dispatches))]
        return [max(int(ticks[end] - ticks[start]), 0) * period_s for start, end in spans]

    # ------------------------------------------------------------------------------- lifetime
    @property
    def alive(self) -> bool:
        return self._alive

    def destroy(self) -> None:
        """Free the params buffer and queries (idempotent); bind groups go with the Program."""
        if self._pending and not self.device.closed:
            self.device.wait_idle()
        self._pending = False
        for resource in (self._params_buffer, self._query_resolve, *self._query_sets):
            if resource is not None:
                resource.destroy()
        self._params_buffer = self._query_set = self._query_resolve = None
        self._query_sets = []
        self._encoded = None
        self._planned = []
        self._alive = False
        self.device._unregister(self)

