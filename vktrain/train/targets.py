"""`vktrain export --target NAME[,NAME...]`: plan every method of the program for each target device profile
and embed the schedules, with the shader modules they run, in the delegate blobs
(vktrain/serialization/embedded.py; the runtimes pick the schedule the device satisfies at load).

Targets: built-in profile names, profile files (FILE.json, `vktrain devices --json`), `local` (the profile of
this machine's Vulkan device, the one `vktrain train` would open: VKTRAIN_DEVICE picks it), `all` (every
built-in), `portable` (the default: `local` when a Vulkan device opens here, then desktop-gpu, then
adreno-6xx, whose schedule asks only the Vulkan 1.1 required limits and so fits any conformant Vulkan
device), `none` (no schedules: the runtime plans at load, as .pte files from before --target).

Each method's blob gets its own schedule per target: the training step's planned alone, its eval and
accumulate methods with the step's buffers they bind (serialization/program_sharing.py), as the runtime
plans them at load, so the schedule embedded for a profile is the one loading would plan for it, byte for
byte. Schedules are planned with the default GEMM precision policy (auto) and the profile's own binding limit.
"""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

from vktrain.contract import TRAIN_METHOD
from vktrain.errors import VktrainError
from vktrain.serialization.blob import read_for_rewrite, serialize_blob
from vktrain.serialization.device_profile import BUILTIN_PROFILES, DeviceProfile, DeviceProfileError, resolve_profile
from vktrain.serialization.embedded import embed_schedules
from vktrain.serialization.program_sharing import shared_from
from vktrain.serialization.schedule import Schedule

ALL, PORTABLE, NONE, LOCAL = "all", "portable", "none", "local"
DEFAULT_TARGET = PORTABLE
# After the local device's own: a desktop GPU without tensor cores, then the Vulkan 1.1 floor (adreno-6xx plans
# with the required limits: 16 KiB shared memory, 128 invocations, 256-byte offsets, 128 MiB bindings).
PORTABLE_PROFILES = ("desktop-gpu", "adreno-6xx")

Planner = Callable[..., Schedule]  # plan_schedule(graph, profile, *, shared=...)


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


def resolve_targets(spec: str, local: Callable[[], DeviceProfile | None] = local_profile) -> list[DeviceProfile]:
    """The profiles `--target spec` names, in order, each once (by name)."""
    profiles: list[DeviceProfile] = []
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
            found = list(BUILTIN_PROFILES.values())
        elif name == PORTABLE:
            found = [p for p in [local()] if p is not None] + [BUILTIN_PROFILES[n] for n in PORTABLE_PROFILES]
        elif name == LOCAL:
            own = local()
            if own is None:
                raise TargetError(f"--target {LOCAL}: no Vulkan device opens on this machine (name a built-in "
                                  f"profile or a FILE.json from `vktrain devices --json` instead)")
            found = [own]
        else:
            try:
                found = [resolve_profile(name)]
            except DeviceProfileError as exc:
                raise TargetError(f"--target: {exc}; or {LOCAL}, {PORTABLE}, {ALL}, {NONE}") from None
        profiles += [p for p in found if p.name not in {q.name for q in profiles}]
    return profiles


def _module_for(name: str, profile: DeviceProfile):
    from vktrain.runtime_shaders.modules import shader_module

    return shader_module(name, profile)


def plan_targets(graphs: Mapping[str, Sequence], profiles: Sequence[DeviceProfile], plan: Planner
                 ) -> dict[str, list[list[tuple[DeviceProfile, Schedule]]]]:
    """Method -> per delegate graph, the (profile, schedule) of each target (module docstring)."""
    step = graphs.get(TRAIN_METHOD, [])
    planned: dict[str, list[list[tuple[DeviceProfile, Schedule]]]] = {}
    for method in sorted(graphs, key=lambda name: name != TRAIN_METHOD):  # the step first: the others bind it
        planned[method] = []
        for index, graph in enumerate(graphs[method]):
            per_target = []
            for profile_index, profile in enumerate(profiles):
                shared = {}
                if method != TRAIN_METHOD and len(step) == 1:  # what the runtime binds (program_sharing.py)
                    shared = shared_from(step[0], planned[TRAIN_METHOD][0][profile_index][1], graph)
                try:
                    per_target.append((profile, plan(graph, profile, shared=shared)))
                except VktrainError as exc:
                    raise TargetError(f"--target {profile.name}: the {method!r} method (delegate {index}) cannot be "
                                      f"planned for this profile: {exc}") from None
            planned[method].append(per_target)
    return planned


def embedding_rewriter(profiles: Sequence[DeviceProfile], plan: Planner | None = None):
    """The BlobRewriter (vktrain.export.lower) that embeds the schedules of `profiles` in every vktrain blob."""
    if plan is None:
        from vktrain.runtime.delegate.planner import plan_schedule as plan

    def rewrite(blobs: dict[str, list[bytes]], named_data: Mapping[str, bytes]) -> dict[str, list[bytes]]:
        named_views = {key: memoryview(data) for key, data in named_data.items()}
        read = {method: [read_for_rewrite(blob, named_views) for blob in group] for method, group in blobs.items()}
        planned = plan_targets({m: [graph for graph, _ in group] for m, group in read.items()}, profiles, plan)
        out = {}
        for method, group in read.items():
            out[method] = []
            for (graph, named), targets in zip(group, planned[method]):
                graph.schedules, graph.shader_modules = embed_schedules(targets, _module_for)
                out[method].append(serialize_blob(graph, named))
        return out
    return rewrite


__all__ = ["ALL", "DEFAULT_TARGET", "LOCAL", "NONE", "PORTABLE", "PORTABLE_PROFILES", "TargetError",
           "embedding_rewriter", "local_profile", "plan_targets", "resolve_targets"]
