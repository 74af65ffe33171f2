"""Shared fixtures: one Vulkan device per test session, with validation, failing tests that upset it.

`vk_device` is session-scoped (device creation is the slow part); so is `webgpu_device`, the WebGPU
device layer's (skipped where wgpu or an adapter is missing; what wgpu logs as errors fails the test). Every test that uses it fails if the
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


@pytest.fixture(scope="session")
def webgpu_device():
    pytest.importorskip("wgpu", reason="the WebGPU runtime needs wgpu (pip install 'vktrain[webgpu]')")
    import os

    from vktrain.runtime.webgpu import Device, WebGPUUnavailableError

    os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")  # wgpu warns without one
    try:
        device = Device()
    except WebGPUUnavailableError as exc:
        pytest.skip(f"no usable WebGPU adapter: {exc}")
    yield device
    messages = device.take_validation_messages()
    device.close()
    if messages:
        pytest.fail("wgpu logged errors at session teardown:\n" + _format(messages), pytrace=False)


@pytest.fixture(autouse=True)
def _fail_on_validation_messages(request):
    """For tests using vk_device / webgpu_device: start with no messages, fail if any appeared during the test."""
    devices = [request.getfixturevalue(name) for name in ("vk_device", "webgpu_device")
               if name in request.fixturenames]
    for device in devices:
        stale = device.take_validation_messages()
        if stale:
            warnings.warn(f"validation messages from outside any test were dropped:\n{_format(stale)}")
    yield
    for device in devices:
        messages = device.take_validation_messages()
        if messages:
            pytest.fail(f"{device.name} validation reported {len(messages)} message(s):\n{_format(messages)}",
                        pytrace=False)
