"""Record a list of Dispatch once into a command buffer, replay it, time it.

`Program(device, dispatches, buffers)` checks every dispatch against its shader (bindings, push
constants, specialization, limits), allocates one descriptor set per dispatch, and records:

    [reset timestamp queries] barrier(host/transfer/compute writes -> compute)
    for each dispatch: [barrier if it depends on an unbarriered earlier write/read]
                       bind pipeline + set, push header+constants, vkCmdDispatch (per split chunk)
                       [timestamp]
    barrier(compute writes -> host/transfer reads)

Bounded submits (`max_dispatches_per_submit` K, a phone profile's field): the same recording cut into
command buffers of at most K vkCmdDispatch each (a split dispatch's chunks count one by one and may
straddle two buffers: they write disjoint groups). Each later buffer starts with a compute -> compute
barrier, so every dependency across the cut is ordered whether or not the barrier plan had one there.
`submit()` submits them in order as separate vkQueueSubmits and waits on the fence after each but the
last: the GPU goes idle between them, so no single submission runs longer than K dispatches, which is
what a watchdog measures (one submit of several command buffers, or semaphores between submits, would
let the driver run them back to back as one job). `submits_per_replay` is their number; `submit_count`
counts vkQueueSubmits of this Program's replays.

`replay()` submits the command buffer(s) again and waits on a fence; new inputs are written into the
same buffers beforehand (Buffer.write). Descriptor sets hold the buffers bound at record time, so a
Program must be rebuilt if a buffer is destroyed or replaced.

Timing (`timing=True`): a timestamp after the initial barrier and after each dispatch; `timings()`
returns, per Dispatch in the list, the seconds between the previous timestamp and its own, i.e. the
time its completion added (dispatches without a barrier between them may overlap, so this is not the
isolated kernel time); under bounded submits each later command buffer starts with a timestamp of its
own, so the idle gap between submits is in no dispatch's time. None when the queue cannot write
timestamps.
"""
from __future__ import annotations

import struct
from typing import Any, Callable, Hashable, Mapping, Sequence

from vktrain.runtime.device_objects import ProgramBase
from vktrain.runtime.vk.errors import BindingRangeError, vk_call
from vktrain.serialization.dispatch import ScheduleError
from vktrain.runtime.vk.memory import Buffer, record_memory_barrier
from vktrain.serialization.dispatch import LOCAL_SIZE_SPEC_IDS, PUSH_HEADER_BYTES, Dispatch
from vktrain.runtime.vk.schedule import (ResolvedAccess, plan_barriers, plan_submits, resolve_binding,
                                       split_groups, timestamp_spans)

DEFAULT_TIMEOUT_S = 600.0


def _begin(vk, cb) -> None:
    begin_info = vk.VkCommandBufferBeginInfo(sType=vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO, flags=0)
    vk_call("vkBeginCommandBuffer", vk.vkBeginCommandBuffer, cb, begin_info)


def _allocate_command_buffer(device):
    vk = device.vk
    alloc_info = vk.VkCommandBufferAllocateInfo(
        sType=vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO, commandPool=device.command_pool,
        level=vk.VK_COMMAND_BUFFER_LEVEL_PRIMARY, commandBufferCount=1)
    return vk_call("vkAllocateCommandBuffers", vk.vkAllocateCommandBuffers, device.handle, alloc_info)[0]


def _create_fence(device):
    vk = device.vk
    fence_info = vk.VkFenceCreateInfo(sType=vk.VK_STRUCTURE_TYPE_FENCE_CREATE_INFO, flags=0)
    return vk_call("vkCreateFence", vk.vkCreateFence, device.handle, fence_info, None)


def _submit(device, cb, fence) -> None:
    vk = device.vk
    command_buffers = [cb]
    submit_info = vk.VkSubmitInfo(sType=vk.VK_STRUCTURE_TYPE_SUBMIT_INFO, commandBufferCount=1,
                                  pCommandBuffers=command_buffers)
    submits = [submit_info]
    vk_call("vkQueueSubmit", vk.vkQueueSubmit, device.queue, 1, submits, fence)


def _wait(device, fence, timeout_s: float) -> None:
    vk = device.vk
    fences = [fence]
    vk_call("vkWaitForFences", vk.vkWaitForFences, device.handle, 1, fences, vk.VK_TRUE,
            int(timeout_s * 1e9), detail=f"waiting up to {timeout_s:g} s for the GPU")


def submit_once(device, record: Callable[[Any], None], *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Record commands with `record(command_buffer)`, submit, wait, free (transfers, fills)."""
    vk = device.vk
    cb = _allocate_command_buffer(device)
    fence = None
    try:
        _begin(vk, cb)
        record(cb)
        vk_call("vkEndCommandBuffer", vk.vkEndCommandBuffer, cb)
        fence = _create_fence(device)
        _submit(device, cb, fence)
        _wait(device, fence, timeout_s)
    finally:
        if fence is not None:
            vk.vkDestroyFence(device.handle, fence, None)
        vk.vkFreeCommandBuffers(device.handle, device.command_pool, 1, [cb])


def max_group_counts(device, max_group_count: int | Sequence[int] | None) -> tuple[int, int, int]:
    """The per-axis group-count limit: the device's, lowered to `max_group_count` where given."""
    limits = device.limits.max_compute_work_group_count
    if max_group_count is None:
        return limits
    wanted = (max_group_count,) * 3 if isinstance(max_group_count, int) else tuple(max_group_count)
    if len(wanted) != 3 or any(not isinstance(v, int) or v < 1 for v in wanted):
        raise ScheduleError(f"max_group_count must be an int >= 1 or 3 of them, got {max_group_count!r}")
    return tuple(min(w, l) for w, l in zip(wanted, limits))  # type: ignore[return-value]


class _Planned:
    """One Dispatch checked and resolved against its shader and buffers."""

    def __init__(self, dispatch: Dispatch, pipeline, buffers: list[tuple[Buffer, int, int, bool, bool]],
                 chunks: list[tuple[tuple[int, int, int], tuple[int, int, int]]], push_prefix: bool):
        self.dispatch = dispatch
        self.pipeline = pipeline
        self.buffers = buffers  # (buffer, offset, range, reads, writes) per binding
        self.chunks = chunks
        self.push_prefix = push_prefix
        self.descriptor_set = None

    def accesses(self) -> list[ResolvedAccess]:
        return [ResolvedAccess(id(buf), offset, offset + size, reads, writes)
                for buf, offset, size, reads, writes in self.buffers]

    def push_bytes(self, group_offset: tuple[int, int, int]) -> bytes:
        if not self.push_prefix:
            return self.dispatch.push_constants
        return struct.pack("<4I", *group_offset, 0) + self.dispatch.push_constants


class Program(ProgramBase):
    """A recorded, replayable list of dispatches (see the module docstring).

    `buffers` maps the keys used in BufferBinding.buffer to Buffer objects (bindings may also hold a
    Buffer directly). `max_group_count` lowers the per-axis group-count limit below the device's
    (tests use it to force split dispatches). `timing` enables timestamp queries. `max_dispatches_per_submit`
    (None or 0: one submit) bounds the recorded dispatches per vkQueueSubmit (module docstring). `modules`
    (shader name -> a ShaderModule embedded in the blob) gives the SPIR-V of those shaders (else the local build).
    A device of another layer (the WebGPU Device) gets that layer's Program, named by its `program_type`.
    """

    def __new__(cls, device, *args, **kwargs):
        other = getattr(device, "program_type", None)
        if cls is Program and other is not None:
            return other(device, *args, **kwargs)
        return super().__new__(cls)

    def __init__(self, device, dispatches: Sequence[Dispatch], buffers: Mapping[Hashable, Buffer] | None = None,
                 *, timing: bool = False, max_group_count: int | Sequence[int] | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, max_dispatches_per_submit: int | None = None,
                 modules: Mapping[str, Any] | None = None):
        self.device = device
        self.dispatches = tuple(dispatches)
        self._modules = modules or {}  # shader name -> embedded ShaderModule: its SPIR-V instead of the local build
        self.timeout_s = timeout_s
        self._descriptor_pool = None
        self._command_buffers: list = []
        self._timestamp_spans: list[tuple[int, int]] = []  # (query before, query after) per Dispatch
        self.submit_count = 0
        self._fence = None
        self._query_pool = None
        self._pending = False
        self._submitted_once = False
        if not self.dispatches:
            raise ScheduleError("a Program needs at least one Dispatch")
        for dispatch in self.dispatches:
            if not isinstance(dispatch, Dispatch):
                raise ScheduleError(f"Program takes Dispatch records, got {type(dispatch).__name__}")
        max_counts = max_group_counts(device, max_group_count)
        planned = [self._plan(i, d, buffers or {}, max_counts) for i, d in enumerate(self.dispatches)]
        self.barriers: list[bool] = plan_barriers([p.accesses() for p in planned])
        self.recorded_dispatch_count = sum(len(p.chunks) for p in planned)
        self._submit_plan = plan_submits([len(p.chunks) for p in planned], max_dispatches_per_submit)
        self.submits_per_replay = len(self._submit_plan)
        # The descriptor sets point at these buffers; replaying after one is freed would be a GPU
        # use-after-free, so submit() checks they are all still alive.
        self._bound_buffers = list({id(b): b for p in planned for b, *_ in p.buffers}.values())
        self.timing_enabled = bool(timing) and device.timestamps_supported
        device._register(self)
        try:
            self._record(planned)
        except BaseException:
            self.destroy()
            raise

    # ------------------------------------------------------------------------------- planning
    def _plan(self, position: int, dispatch: Dispatch, buffers: Mapping[Hashable, Buffer], max_counts
              ) -> _Planned:
        device = self.device
        where = f"dispatch #{position} {dispatch.name!r}"
        module = self._modules.get(dispatch.shader)
        code = module.code if module is not None else None
        interface = device.pipelines.interface(dispatch.shader, code)

        # Bindings: exactly the shader's set-0 bindings, in order 0..n-1.
        expected = interface.binding_numbers
        if expected != tuple(range(len(expected))):
            raise ScheduleError(f"{where}: shader {dispatch.shader!r} declares bindings {list(expected)}; "
                                f"vktrain needs them numbered 0..n-1")
        if len(dispatch.bindings) != len(expected):
            raise ScheduleError(
                f"{where}: shader {dispatch.shader!r} declares {len(expected)} storage buffers (bindings "
                f"{list(expected)}) but the Dispatch binds {len(dispatch.bindings)}; bind a placeholder buffer "
                f"for bindings the shader does not use")
        resolved = []
        limits = device.limits
        for index, (binding, info) in enumerate(zip(dispatch.bindings, interface.bindings)):
            buffer, offset, size = resolve_binding(where, index, binding, buffers, device, Buffer,
                                                   "minStorageBufferOffsetAlignment")
            key = binding.buffer
            if size > limits.max_storage_buffer_range:
                raise BindingRangeError(
                    f"{where}: binding {index} ({key!r}) spans {size} bytes, more than the device's "
                    f"maxStorageBufferRange of {limits.max_storage_buffer_range}; bind a smaller range "
                    f"(offset + size) or split the tensor")
            if binding.access is not None:
                reads, writes = binding.reads, binding.writes
            else:  # not declared: what the shader declares (readonly / writeonly / both)
                reads, writes = not info.writeonly, not info.readonly
            resolved.append((buffer, offset, size, reads, writes))

        # Push constants: the header (when the shader has one) then the kernel's bytes.
        prefix = interface.has_group_offset_header
        push_size = (PUSH_HEADER_BYTES if prefix else 0) + len(dispatch.push_constants)
        if interface.push_constant_size >= 0 and push_size != interface.push_constant_size:
            kernel_bytes = interface.push_constant_size - (PUSH_HEADER_BYTES if prefix else 0)
            raise ScheduleError(
                f"{where}: shader {dispatch.shader!r} expects {kernel_bytes} bytes of push constants"
                f"{' after the 16-byte group-offset header' if prefix else ''}, the Dispatch gives "
                f"{len(dispatch.push_constants)}")

        # Local size must respect the device limits.
        if dispatch.local_size is not None:
            for axis, spec_id in enumerate(LOCAL_SIZE_SPEC_IDS):
                if spec_id not in interface.spec_types and dispatch.local_size[axis] != 1:
                    raise ScheduleError(
                        f"{where}: local_size {dispatch.local_size} but shader {dispatch.shader!r} does not "
                        f"take its local size {'xyz'[axis]} from specialization constant {spec_id}")
            if any(v > m for v, m in zip(dispatch.local_size, limits.max_compute_work_group_size)) or \
                    dispatch.local_size[0] * dispatch.local_size[1] * dispatch.local_size[2] > \
                    limits.max_compute_work_group_invocations:
                raise ScheduleError(
                    f"{where}: local_size {dispatch.local_size} exceeds the device's maxComputeWorkGroupSize "
                    f"{limits.max_compute_work_group_size} / maxComputeWorkGroupInvocations "
                    f"{limits.max_compute_work_group_invocations}")
        specialization = tuple((i, v) for i, v in dispatch.specialization()
                               if not (i in LOCAL_SIZE_SPEC_IDS and i not in interface.spec_types))

        chunks = split_groups(dispatch.groups, max_counts)
        if len(chunks) > 1 and not prefix:
            raise ScheduleError(
                f"{where}: {dispatch.groups} work groups exceed the per-axis limit {max_counts}, and shader "
                f"{dispatch.shader!r} cannot be split because its push-constant block does not start with "
                f"the group-offset header (`uint4 vktrain_group_offset`, common.slangh); add the header or loop "
                f"over the work in the shader")
        pipeline = device.pipelines.get(dispatch.shader, specialization, push_size, code)
        return _Planned(dispatch, pipeline, resolved, chunks, prefix)

    # ------------------------------------------------------------------------------- recording
    def _record(self, planned: list[_Planned]) -> None:
        device = self.device
        vk = device.vk
        total_bindings = sum(len(p.buffers) for p in planned)
        pool_sizes = [vk.VkDescriptorPoolSize(type=vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
                                              descriptorCount=max(total_bindings, 1))]
        pool_info = vk.VkDescriptorPoolCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_DESCRIPTOR_POOL_CREATE_INFO, maxSets=len(planned), poolSizeCount=1,
            pPoolSizes=pool_sizes)
        self._descriptor_pool = vk_call("vkCreateDescriptorPool", vk.vkCreateDescriptorPool, device.handle,
                                        pool_info, None)
        set_layouts = [p.pipeline.set_layout for p in planned]
        alloc_info = vk.VkDescriptorSetAllocateInfo(
            sType=vk.VK_STRUCTURE_TYPE_DESCRIPTOR_SET_ALLOCATE_INFO, descriptorPool=self._descriptor_pool,
            descriptorSetCount=len(planned), pSetLayouts=set_layouts)
        sets = vk_call("vkAllocateDescriptorSets", vk.vkAllocateDescriptorSets, device.handle, alloc_info)
        for index, plan in enumerate(planned):
            plan.descriptor_set = sets[index]
            if not plan.buffers:
                continue
            infos = [vk.VkDescriptorBufferInfo(buffer=buf.handle, offset=offset, range=size)
                     for buf, offset, size, _, _ in plan.buffers]
            writes = []
            for binding, info in enumerate(infos):
                writes.append(vk.VkWriteDescriptorSet(
                    sType=vk.VK_STRUCTURE_TYPE_WRITE_DESCRIPTOR_SET, dstSet=plan.descriptor_set, dstBinding=binding,
                    dstArrayElement=0, descriptorCount=1, descriptorType=vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
                    pBufferInfo=[info]))
            vk.vkUpdateDescriptorSets(device.handle, len(writes), writes, 0, None)

        self._timestamp_spans, query_count = timestamp_spans(self._submit_plan, [len(p.chunks) for p in planned])
        if self.timing_enabled:
            query_info = vk.VkQueryPoolCreateInfo(
                sType=vk.VK_STRUCTURE_TYPE_QUERY_POOL_CREATE_INFO, queryType=vk.VK_QUERY_TYPE_TIMESTAMP,
                queryCount=query_count)
            self._query_pool = vk_call("vkCreateQueryPool", vk.vkCreateQueryPool, device.handle, query_info, None)

        queries = iter(range(query_count))  # in the order timestamp_spans numbers them

        def stamp(cb) -> None:
            query = next(queries)
            if self._query_pool is not None:
                vk.vkCmdWriteTimestamp(cb, vk.VK_PIPELINE_STAGE_BOTTOM_OF_PIPE_BIT, self._query_pool, query)

        compute_rw = vk.VK_ACCESS_SHADER_READ_BIT | vk.VK_ACCESS_SHADER_WRITE_BIT
        for number, runs in enumerate(self._submit_plan):
            cb = _allocate_command_buffer(device)
            self._command_buffers.append(cb)
            _begin(vk, cb)
            if number == 0:
                if self._query_pool is not None:
                    vk.vkCmdResetQueryPool(cb, self._query_pool, 0, query_count)
                # Host writes (Buffer.write), staging copies and an earlier replay must be visible to this one.
                record_memory_barrier(
                    vk, cb,
                    vk.VK_PIPELINE_STAGE_HOST_BIT | vk.VK_PIPELINE_STAGE_TRANSFER_BIT
                    | vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT,
                    vk.VK_ACCESS_HOST_WRITE_BIT | vk.VK_ACCESS_TRANSFER_WRITE_BIT | vk.VK_ACCESS_SHADER_WRITE_BIT,
                    vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT, compute_rw)
            else:  # the earlier submits' writes (a barrier's first scope spans everything submitted before it)
                record_memory_barrier(vk, cb, vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT, compute_rw,
                                      vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT, compute_rw)
            stamp(cb)
            bound_pipeline = None  # pipeline and descriptor bindings do not carry across command buffers
            for position, (index, first, end) in enumerate(runs):
                plan = planned[index]
                if first == 0:
                    if self.barriers[index] and not (number > 0 and position == 0):
                        record_memory_barrier(vk, cb, vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT, compute_rw,
                                              vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT, compute_rw)
                pipeline = plan.pipeline
                if pipeline is not bound_pipeline:
                    vk.vkCmdBindPipeline(cb, vk.VK_PIPELINE_BIND_POINT_COMPUTE, pipeline.handle)
                    bound_pipeline = pipeline
                descriptor_sets = [plan.descriptor_set]
                vk.vkCmdBindDescriptorSets(cb, vk.VK_PIPELINE_BIND_POINT_COMPUTE, pipeline.layout, 0, 1,
                                           descriptor_sets, 0, None)
                for group_offset, counts in plan.chunks[first:end]:
                    push = plan.push_bytes(group_offset)
                    if push:
                        push_data = vk.ffi.new("char[]", push)
                        vk.vkCmdPushConstants(cb, pipeline.layout, vk.VK_SHADER_STAGE_COMPUTE_BIT, 0, len(push),
                                              push_data)
                    vk.vkCmdDispatch(cb, *counts)
                if end == len(plan.chunks):
                    stamp(cb)
            if number == len(self._submit_plan) - 1:
                # Results must be visible to the host (mapped reads) and to transfers (staging downloads).
                record_memory_barrier(
                    vk, cb,
                    vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT,
                    vk.VK_ACCESS_SHADER_WRITE_BIT,
                    vk.VK_PIPELINE_STAGE_HOST_BIT | vk.VK_PIPELINE_STAGE_TRANSFER_BIT,
                    vk.VK_ACCESS_HOST_READ_BIT | vk.VK_ACCESS_TRANSFER_READ_BIT | vk.VK_ACCESS_TRANSFER_WRITE_BIT)
            vk_call("vkEndCommandBuffer", vk.vkEndCommandBuffer, cb)
        self._fence = _create_fence(device)

    # ------------------------------------------------------------------------------- execution
    def submit(self) -> None:
        """Start a replay without waiting (call wait() before touching its buffers)."""
        self._check_alive()
        if self._pending:
            raise ScheduleError("this Program is still running; wait() before submitting it again")
        dead = [b.name for b in self._bound_buffers if not b.alive]
        if dead:
            raise ScheduleError(f"cannot replay: buffers {dead} were destroyed after recording; build a new "
                                f"Program for new buffers")
        vk = self.device.vk
        fences = [self._fence]
        last = len(self._command_buffers) - 1
        for number, cb in enumerate(self._command_buffers):
            vk_call("vkResetFences", vk.vkResetFences, self.device.handle, 1, fences)
            _submit(self.device, cb, self._fence)
            self.submit_count += 1
            if number < last:  # the GPU idles before the next bounded submit (module docstring)
                _wait(self.device, self._fence, self.timeout_s)
        self._pending = True
        self._submitted_once = True

    def wait(self) -> None:
        """Block until the last submit() finished (no-op when nothing is pending)."""
        self._check_alive()
        if self._pending:
            _wait(self.device, self._fence, self.timeout_s)
            self._pending = False

    def timings(self) -> list[float] | None:
        """Seconds per Dispatch of the last replay (see module docstring); None without timestamps."""
        self._check_alive()
        if self._query_pool is None:
            return None
        if not self._submitted_once:
            raise ScheduleError("timings() before the first replay()")
        self.wait()
        vk = self.device.vk
        count = len(self.dispatches) + len(self._command_buffers)
        data = vk.ffi.new("uint64_t[]", count)
        vk_call("vkGetQueryPoolResults", vk.vkGetQueryPoolResults, self.device.handle, self._query_pool, 0, count,
                8 * count, data, 8, vk.VK_QUERY_RESULT_64_BIT | vk.VK_QUERY_RESULT_WAIT_BIT)
        bits = self.device.timestamp_valid_bits
        mask = (1 << bits) - 1 if bits < 64 else (1 << 64) - 1
        period_s = self.device.limits.timestamp_period_ns * 1e-9
        ticks = [int(data[i]) for i in range(count)]
        return [((ticks[end] - ticks[start]) & mask) * period_s for start, end in self._timestamp_spans]

    # ------------------------------------------------------------------------------- lifetime
    @property
    def alive(self) -> bool:
        return bool(self._command_buffers)

    def destroy(self) -> None:
        """Free the command buffers, descriptor sets, fence and queries (idempotent)."""
        device = self.device
        vk = device.vk
        handle = device._device
        if handle is not None:
            if self._pending:
                try:
                    _wait(device, self._fence, self.timeout_s)
                finally:
                    self._pending = False
            if self._command_buffers:
                vk.vkFreeCommandBuffers(handle, device.command_pool, len(self._command_buffers),
                                        self._command_buffers)
            if self._fence is not None:
                vk.vkDestroyFence(handle, self._fence, None)
            if self._query_pool is not None:
                vk.vkDestroyQueryPool(handle, self._query_pool, None)
            if self._descriptor_pool is not None:
                vk.vkDestroyDescriptorPool(handle, self._descriptor_pool, None)
        self._command_buffers = []
        self._fence = self._query_pool = self._descriptor_pool = None
        device._unregister(self)



def run_dispatches(device, dispatches: Sequence[Dispatch], buffers: Mapping[Hashable, Buffer] | None = None,
                   **options) -> None:
    """Record, run once and free: for one-off work where replay does not pay."""
    with Program(device, dispatches, buffers, **options) as program:
        program.replay()
