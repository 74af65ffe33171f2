"""`vktrain export --target NAME[,NAME...]`: plan every method of the program for each target device profile
and embed the schedules, with the shader modules they run, in the delegate blobs
(vktrain/serialization/embedded.py; the runtimes pick the schedule the device satisfies at load).

Targets: built-in profile names, profile files (FILE.json, `vktrain devices --json`), `local` (the profile of
this machine's Vulkan device, the one `vktrain train` would open: VKTRAIN_DEVICE picks it), `all` (every
built-in), `portable` (the default: `local` when a Vulkan device opens here, then nvidia-coopmat, desktop-gpu
and adreno-6xx, whose schedule asks only the Vulkan 1.1 required limits and so fits any conformant Vulkan
device), `none` (no schedules: the runtime plans at load, as .pte files from before --target).

Each method's blob gets its own schedule per target: the training step's planned alone, its eval and
accumulate methods with the step's buffers they bind (serialization/program_sharing.py), as the runtime
plans them at load, so the schedule embedded for a profile is the one loading would plan for it, byte for
byte. Schedules are planned with the default GEMM precision policy (auto) and the profile's own binding limit.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from vktrain.contract import TRAIN_METHOD
from vktrain.errors import VktrainError
from vktrain.serialization.blob import read_for_rewrite, serialize_blob
from vktrain.serialization.device_profile import BUILTIN_PROFILES, DeviceProfile, DeviceProfileError, resolve_profile
from vktrain.serialization import graph as g
from vktrain.serialization.embedded import ShaderModule, embed_schedules
from vktrain.serialization.program_sharing import shared_from
from vktrain.serialization.schedule import Schedule
from vktrain.serialization.verify_schedule import check_shader_modules, verify_embedded_schedule

ALL, PORTABLE, NONE, LOCAL = "all", "portable", "none", "local"
DEFAULT_TARGET = PORTABLE
# After the local device's own: NVIDIA's tensor cores (a GPU with them prefers that schedule, serialization/
# embedded.py `_preference`: on an H100 the Llama-3.2-1B step at 4 x 512 ran 102 ms there against 383 ms on the
# fp32 kernels desktop-gpu's schedule runs, bench/results/step_h100_llama-3.2-1b.json), a desktop GPU without
# them, then the Vulkan 1.1 floor (adreno-6xx plans with the required limits: 16 KiB shared memory, 128
# invocations, 256-byte offsets, 128 MiB bindings).
PORTABLE_PROFILES = ("nvidia-coopmat", "desktop-gpu", "adreno-6xx")

Planner = Callable[..., Schedule]  # plan_schedule(graph, profile, *, shared=..., state_guard=...)


class TargetError(VktrainError, ValueError):
    """A --target that names no profile, or one the program cannot be planned for."""


def local_profile() -> DeviceProfile | None:
    """The profile of the Vulkan device `vktrain train` would open here, None when none opens."""
    from vktrain.runtime.device_profiles import profile_of
    from vktrain.runtime.vk.errors import RuntimeErrorBase

    try:
        from vktrain.runtime.vk.device import Device

        with Device() as device:
            return profile_of(device)
    except (RuntimeErrorBase, OSError, ImportError):
        return None


@dataclass(frozen=True)
class Target:
    """A profile to plan for; `optional` when it came from `all` or `portable` (left out, and reported,
    when the program's plan for it does not keep to its limits) rather than by name (refused then)."""

    profile: DeviceProfile
    optional: bool = False


def resolve_targets(spec: str, local: Callable[[], DeviceProfile | None] = local_profile) -> list[Target]:
    """The targets `--target spec` names, in order, each profile once (by name)."""
    targets: list[Target] = []
    names = [part.strip() for part in spec.split(",")]
    if not all(names):
        raise TargetError(f"--target {spec!r}: an empty name; give NAME[,NAME...] (built-in: "
                          f"{', '.join(BUILTIN_PROFILES)}; or {LOCAL}, {PORTABLE}, {ALL}, {NONE}, FILE.json)")
    if NONE in names:
        if names != [NONE]:
            raise TargetError(f"--target {spec!r}: {NONE!r} (no schedules) cannot be combined with other targets")
        return []
    for name in names:
        if name == ALL:
            found = [Target(p, optional=True) for p in BUILTIN_PROFILES.values()]
        elif name == PORTABLE:
            found = [Target(p, optional=True) for p in [local()] if p is not None]
            found += [Target(BUILTIN_PROFILES[n], optional=True) for n in PORTABLE_PROFILES]
        elif name == LOCAL:
            own = local()
            if own is None:
                raise TargetError(f"--target {LOCAL}: no Vulkan device opens on this machine (name a built-in "
                                  f"profile or a FILE.json from `vktrain devices --json` instead)")
            found = [Target(own)]
        else:
            try:
                found = [Target(resolve_profile(name))]
            except DeviceProfileError as exc:
                raise TargetError(f"--target: {exc}; or {LOCAL}, {PORTABLE}, {ALL}, {NONE}") from None
        for target in found:
            same = [i for i, t in enumerate(targets) if t.profile.name == target.profile.name]
            if not same:
                targets.append(target)
            elif not target.optional:  # named as well as implied: named wins (refused, not left out)
                targets[same[0]] = target
    return targets


def _module_for(name: str, profile: DeviceProfile) -> ShaderModule:
    return _module(name, profile.api, profile.float16)


@functools.lru_cache(maxsize=None)
def _module(name: str, api: str, float16: bool) -> ShaderModule:
    """A module depends on the variant, the api and (WGSL) float16 only: built once per export."""
    from vktrain.runtime_shaders.modules import shader_module

    return shader_module(name, _ModuleProfile(api, float16))


@dataclass(frozen=True)
class _ModuleProfile:
    """What shader_module reads of a profile."""

    api: str
    float16: bool


def plan_target(graphs: Mapping[str, Sequence[g.VkGraph]], profile: DeviceProfile, plan: Planner
                ) -> dict[str, list[Schedule]]:
    """Method -> the schedule of each of its delegate graphs for `profile` (module docstring), each checked
    as the runtime checks an embedded one (verify_schedule.py verify_embedded); TargetError naming the method,
    the profile and what is wrong."""
    step = graphs.get(TRAIN_METHOD, [])
    planned: dict[str, list[Schedule]] = {}
    for method in sorted(graphs, key=lambda name: name != TRAIN_METHOD):  # the step first: the others bind it
        planned[method] = []
        for index, graph in enumerate(graphs[method]):
            shared = {}
            if method != TRAIN_METHOD and len(step) == 1:  # what the runtime binds (program_sharing.py)
                shared = shared_from(step[0], planned[TRAIN_METHOD][0], graph)
            try:
                # The step's with its state guard (the runtime's runner plans it so at load too).
                schedule = plan(graph, profile, shared=shared, state_guard=method == TRAIN_METHOD)
                (embedded,), modules = embed_schedules([(profile, schedule)], _module_for, serialize=False)
                check_shader_modules(modules, f"delegate {index}")
                verify_embedded_schedule(schedule, embedded, dataclasses.replace(graph, shader_modules=modules),
                                         f"delegate {index}")
            except VktrainError as exc:
                raise TargetError(f"--target {profile.name}: the {method!r} method cannot be planned for this "
                                  f"profile: {exc}") from None
            planned[method].append(schedule)
    return planned


class TargetEmbedder:
    """The BlobRewriter (vktrain.export.lower) that embeds the schedules of `targets` in every vktrain blob.
    After it ran, `embedded` names the profiles embedded and `left_out` says why each optional target was not."""

    def __init__(self, targets: Sequence[Target], plan: Planner | None = None):
        if plan is None:
            from vktrain.backend.kernel_planning.planner import plan_schedule as plan
        self.targets, self.plan = list(targets), plan
        self.embedded: list[str] = []
        self.left_out: list[str] = []

    def __call__(self, blobs: dict[str, list[bytes]], named_data: Mapping[str, bytes]) -> dict[str, list[bytes]]:
        _module.cache_clear()  # kernels built since the last export are read afresh
        views = {key: memoryview(data) for key, data in named_data.items()}
        read = {method: [read_for_rewrite(blob, views) for blob in group] for method, group in blobs.items()}
        graphs = {method: [graph for graph, _ in group] for method, group in read.items()}
        per_target = []
        for target in self.targets:
            try:
                per_target.append((target.profile, plan_target(graphs, target.profile, self.plan)))
            except TargetError as exc:
                if not target.optional:
                    raise
                self.left_out.append(str(exc))
        if not per_target and self.targets:
            raise TargetError("no target could be planned: " + " | ".join(self.left_out))
        self.embedded = [profile.name for profile, _ in per_target]
        out = {}
        for method, group in read.items():
            out[method] = []
            for index, (graph, named) in enumerate(group):
                planned = [(profile, schedules[method][index]) for profile, schedules in per_target]
                graph.schedules, graph.shader_modules = embed_schedules(planned, _module_for)
                out[method].append(serialize_blob(graph, named))
        return out


__all__ = ["ALL", "DEFAULT_TARGET", "LOCAL", "NONE", "PORTABLE", "PORTABLE_PROFILES", "Target", "TargetEmbedder",
           "TargetError", "local_profile", "plan_target", "resolve_targets"]
