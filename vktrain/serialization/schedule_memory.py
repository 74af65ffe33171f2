"""What a Schedule (schedule.py) costs in device memory, and the refusals of one that does not fit a device
profile: facts about a schedule the runtime checks at load and `vktrain inspect` reports, whoever planned it.

    owned_bytes(schedule)                 the bytes it allocates itself (not the buffers another executor owns)
    reused_buffers(schedule, offered)     which transient buffers of another executor it may take instead
    check_allocations(schedule, profile)  no buffer over the profile's max allocation size
    check_memory_budget(schedule, profile, resident_bytes)   the program within the profile's memory budget
"""
from __future__ import annotations

from typing import Mapping

from vktrain.errors import GraphLoweringError
from vktrain.serialization.device_profile import DeviceProfile
from vktrain.serialization.schedule import Schedule


def allocation_refusals(schedule: Schedule, profile: DeviceProfile) -> list[str]:
    """Each buffer of `schedule` over the profile's max allocation size (maxMemoryAllocationSize), one phrase
    each: no kernel splits an allocation."""
    limit = profile.max_allocation_bytes
    return [f"buffer {b.key!r} ({b.role}) needs an allocation of {b.size_bytes} bytes, over the max allocation size of "
            f"{limit} bytes (device profile {profile.name!r})" for b in schedule.buffers if b.size_bytes > limit]


def check_allocations(schedule: Schedule, profile: DeviceProfile) -> None:
    """Refuse a schedule with an allocation over the profile's max allocation size (allocation_refusals)."""
    refusals = allocation_refusals(schedule, profile)
    if refusals:
        raise GraphLoweringError("; ".join(refusals))


def owned_bytes(schedule: Schedule) -> int:
    """The device memory `schedule` allocates itself: every buffer but those another executor of the program
    owns (role "shared": they are counted once, by their owner)."""
    return sum(b.size_bytes for b in schedule.buffers if b.role != "shared")


# The roles of buffers whose contents live only within one call: executors that never run at the same time
# may hold theirs in the same memory (reused_buffers).
TRANSIENT_ROLES = ("intermediate", "scratch")


def reused_buffers(schedule: Schedule, offered: Mapping[str, int]) -> dict[str, str]:
    """Which of `offered` (key -> bytes: another executor's transient buffers) each transient buffer of
    `schedule` takes, key -> offered key: largest first, each into the smallest free one large enough, each
    offered buffer at most once (this schedule's buffers may be live together). Those left out get their own."""
    free = dict(offered)
    taken: dict[str, str] = {}
    for entry in sorted((b for b in schedule.buffers if b.role in TRANSIENT_ROLES), key=lambda b: -b.size_bytes):
        fits = [key for key, nbytes in free.items() if nbytes >= entry.size_bytes]
        if fits:
            key = min(fits, key=lambda k: (free[k], k))
            taken[entry.key] = key
            del free[key]
    return taken


MEMORY_BUDGET_ADVICE = ("export with a smaller --batch or --seq (activations scale with batch x seq) or a smaller "
                        "--lora-rank (the adapters and their AdamW moments); the frozen weights shrink only with "
                        "the model")


def memory_budget_refusal(needed: int, profile: DeviceProfile) -> str | None:
    """The phrase refusing `needed` bytes of device memory over the profile's memory budget, None if within
    (or the profile has no budget)."""
    budget = profile.memory_budget_bytes
    if not budget or needed <= budget:
        return None
    return (f"the program needs {needed} bytes of device memory, over the memory budget of {budget} bytes "
            f"(device profile {profile.name!r})")


def check_memory_budget(schedule: Schedule, profile: DeviceProfile, resident_bytes: int = 0) -> None:
    """Refuse a schedule whose own buffers, with `resident_bytes` the program's other executors hold, exceed
    the profile's memory budget (memory_budget_refusal), saying what to change."""
    refusal = memory_budget_refusal(owned_bytes(schedule) + resident_bytes, profile)
    if refusal:
        raise GraphLoweringError(f"{refusal}: {MEMORY_BUDGET_ADVICE}")


__all__ = ["MEMORY_BUDGET_ADVICE", "TRANSIENT_ROLES", "allocation_refusals", "check_allocations",
           "check_memory_budget", "memory_budget_refusal", "owned_bytes", "reused_buffers"]
