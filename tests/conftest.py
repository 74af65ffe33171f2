"""Shared fixtures: one Vulkan device per test session, with validation, failing tests that upset it.

`vk_device` is session-scoped (device creation is the slow part). Every test that uses it fails if the
Khronos validation layer reported any warning or error while the test ran; leaks found when the device
is closed at the end of the session fail the session. Where the validation layer is not installed the
device runs without it and a warning says so; where no Vulkan device exists the tests are skipped
with the reason.
"""
from __future__ import annotations

import warnings

import pytest


def _format(messages) -> str:
    return "\n".join(f"  {m}" for m in messages)


@pytest.fixture(scope="session")
def vk_device():
    from vktrain.runtime import Device, ValidationLayerMissingError, VulkanUnavailableError

    try:
        device = Device(validation=True)
    except ValidationLayerMissingError as exc:
        warnings.warn(f"running Vulkan tests WITHOUT validation: {exc}")
        device = Device(validation=False)
    except VulkanUnavailableError as exc:
        pytest.skip(f"no usable Vulkan device: {exc}")
    yield device
    before_close = device.take_validation_messages()
    device.close()
    at_close = device.take_validation_messages()
    if before_close or at_close:
        pytest.fail("Vulkan validation reported at session teardown (leaked objects?):\n"
                    + _format(before_close + at_close), pytrace=False)


@pytest.fixture(autouse=True)
def _fail_on_validation_messages(request):
    """For tests using vk_device: start with no messages, fail if any appeared during the test."""
    if "vk_device" not in request.fixturenames:
        yield
        return
    device = request.getfixturevalue("vk_device")
    stale = device.take_validation_messages()
    if stale:
        warnings.warn(f"validation messages from outside any test were dropped:\n{_format(stale)}")
    yield
    messages = device.take_validation_messages()
    if messages:
        pytest.fail(f"Vulkan validation reported {len(messages)} message(s):\n{_format(messages)}",
                    pytrace=False)
