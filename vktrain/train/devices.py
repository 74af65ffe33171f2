"""`vktrain devices [--runtime vulkan|webgpu] [--json] [--builtin|--profiles] [--profile FILE]` (torch-free): the
DeviceProfile of each local device, what kernel planning reads of it (vktrain/serialization/device_profile.py).

Each local device is opened in turn (Vulkan: every physical device; WebGPU: every adapter) and its profile
printed with the built-in profile whose planning fields it matches, if any, and the built-in profiles it can
emulate (train/eval/generate --device-profile). `--builtin` (or `--profiles`)
prints the built-in profiles instead (the names --device-profile takes), `--profile FILE` a profile file (checked: unknown, missing or mistyped fields are refused
by name). `--json` prints a JSON list of profiles, each one a valid profile file.
"""
from __future__ import annotations

import argparse
import json

from vktrain.serialization.device_profile import BUILTIN_PROFILES, DeviceProfile, load_profile
from vktrain.serialization.profile_emulation import EmulationError, intersect


def add_devices_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--runtime", choices=("vulkan", "webgpu"), default="vulkan",
                        help="whose devices to list: vulkan (default, every physical device) or webgpu (every adapter)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--builtin", "--profiles", dest="builtin", action="store_true",
                        help="print the built-in profiles with their sources, opening no device (each a NAME for "
                             "--device-profile of train, eval, generate and inspect)")
    source.add_argument("--profile", metavar="FILE", help="print (and check) a device profile file")
    parser.add_argument("--json", action="store_true", help="print a JSON list of profiles (each a profile file)")
    return parser


def local_profiles(runtime: str) -> list[DeviceProfile]:
    """The profile of every local device of `runtime`, each opened and closed in turn."""
    from vktrain.runtime.device_profiles import profile_of

    if runtime == "webgpu":
        from vktrain.runtime.webgpu.device import Device
    else:
        from vktrain.runtime.vk.device import Device
    profiles = []
    with Device() as first:
        count = len(first.available_devices)
        profiles.append((first.info.index, profile_of(first)))
    for index in range(count):
        if index != profiles[0][0]:
            with Device(index) as device:
                profiles.append((index, profile_of(device)))
    return [profile for _, profile in sorted(profiles, key=lambda item: item[0])]


def matching_builtin(profile: DeviceProfile) -> str | None:
    """The built-in profile with the same planning fields, if any."""
    return next((name for name, builtin in BUILTIN_PROFILES.items()
                 if builtin.planning_fields() == profile.planning_fields()), None)


def emulated_builtins(profile: DeviceProfile) -> list[str]:
    """The built-in profiles a device with `profile` can emulate (--device-profile: `intersect` accepts them)."""
    names = []
    for name, builtin in BUILTIN_PROFILES.items():
        try:
            intersect(profile, builtin)
        except EmulationError:
            continue
        names.append(name)
    return names


def describe(profile: DeviceProfile) -> str:
    p = profile
    coopmat = ", ".join(f"{s.m}x{s.n}x{s.k} {s.a_type}*{s.b_type}+{s.c_type}->{s.result_type} ({s.scope})"
                        for s in p.cooperative_matrix) or "none"
    subgroups = (f"{p.subgroup_size} lanes; {', '.join(p.subgroup_operations) or 'no operations'}"
                 if p.subgroup_size else "none promised")
    submits = (f"at most {p.max_dispatches_per_submit} dispatches each" if p.max_dispatches_per_submit
               else "one per step")
    lines = [
        f"{p.name}",
        f"  api {p.api}, device type {p.device_type}; fp16 {'yes' if p.float16 else 'no'}, "
        f"int64 {'yes' if p.int64 else 'no'}",
        f"  subgroups: {subgroups}",
        f"  cooperative matrices: {coopmat}",
        f"  workgroups: {p.max_shared_memory_bytes} B shared memory, {p.max_workgroup_invocations} invocations, "
        f"size {'x'.join(map(str, p.max_workgroup_size))}, count {'x'.join(map(str, p.max_workgroup_count))}",
        f"  buffers: storage bindings of {p.max_storage_buffer_range} B at offsets aligned to "
        f"{p.min_storage_buffer_offset_alignment}, {p.max_storage_buffers_per_stage} per stage; allocations of "
        f"{p.max_allocation_bytes} B; push constants {p.max_push_constants_bytes} B",
        f"  tuning: {p.min_workgroups} workgroups before the tensor cores pay, split-K to "
        f"{p.split_k_target_workgroups} workgroups, fp32 kernels aim at {p.fp32_target_workgroups}",
        f"  submits: {submits}",
    ]
    if p.source:
        lines.append(f"  source: {p.source}")
    return "\n".join(lines)


def run_devices(args: argparse.Namespace) -> int:
    if args.builtin:
        profiles = list(BUILTIN_PROFILES.values())
    elif args.profile is not None:
        profiles = [load_profile(args.profile)]
    else:
        profiles = local_profiles(args.runtime)
    if args.json:
        print(json.dumps([p.to_dict() for p in profiles], indent=2))
        return 0
    blocks = []
    for profile in profiles:
        block = describe(profile)
        if not args.builtin:
            match = matching_builtin(profile)
            block += f"\n  built-in profile with the same planning fields: {match or 'none'}"
            block += f"\n  can emulate (--device-profile): {', '.join(emulated_builtins(profile)) or 'none'}"
        blocks.append(block)
    print("\n\n".join(blocks))
    return 0
