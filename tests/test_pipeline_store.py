"""The on-disk pipeline cache (vktrain/runtime/vk/pipeline_store.py): a second device reads what the first wrote,
a corrupt, cut or foreign file is ignored (and replaced), VKTRAIN_PIPELINE_CACHE=0 turns it off."""
from __future__ import annotations

import struct

import numpy as np
import pytest

from vktrain.runtime.vk.pipeline_store import (PIPELINE_CACHE_ENV, DeviceKey, PipelineStore, frame,
                                               pipeline_cache_folder, unframe)
from vktrain.serialization.dispatch import Dispatch, pack_push

LOCAL = 64


def _axpy_on_a_new_device(alpha: float, x: np.ndarray, y: np.ndarray):
    """y + 2 * alpha * x computed by test_axpy on a Device of its own (what one `vktrain train` opens), and the
    device's store report (read before any pipeline was created); the device is closed (its cache written)."""
    from vktrain.runtime import Buffer, Device, ValidationLayerMissingError, VulkanUnavailableError
    from vktrain.runtime.vk.commands import run_dispatches

    try:
        device = Device(validation=True)
    except ValidationLayerMissingError:
        device = Device(validation=False)
    except VulkanUnavailableError as exc:
        pytest.skip(f"no usable Vulkan device: {exc}")
    try:
        report = device.pipelines.store_report()
        bx, by = Buffer.from_array(device, x), Buffer.from_array(device, y)
        dispatch = Dispatch("test_axpy", groups=len(x) // LOCAL, bindings=["x", "y"],
                            push_constants=pack_push(len(x), alpha), spec_constants={3: 2.0}, local_size=(LOCAL, 1, 1))
        run_dispatches(device, [dispatch], {"x": bx, "y": by})
        out = by.read(np.float32, y.shape)
        created = device.pipelines.created
        bx.destroy()
        by.destroy()
        messages = device.take_validation_messages()
    finally:
        device.close()
    assert not messages + device.take_validation_messages()
    return out, report, created


def _inputs():
    rng = np.random.default_rng(0)
    return rng.standard_normal(256).astype(np.float32), rng.standard_normal(256).astype(np.float32)


def _expected(alpha, x, y):
    return (2.0 * alpha * x.astype(np.float64) + y).astype(np.float32)


def test_a_second_load_reads_the_pipelines_the_first_wrote(tmp_path, monkeypatch):
    monkeypatch.setenv(PIPELINE_CACHE_ENV, str(tmp_path))
    x, y = _inputs()
    out, report, created = _axpy_on_a_new_device(0.5, x, y)
    np.testing.assert_allclose(out, _expected(0.5, x, y), rtol=1e-6)
    assert report["read"] == "no file" and created == 1
    (path,) = tmp_path.iterdir()
    assert report["path"] == str(path)
    payload, why = unframe(path.read_bytes())
    assert payload is not None, why
    size, version, vendor, device_id, uuid = struct.unpack_from("<IIII16s", payload)
    assert size >= 32 and version == 1
    assert path.name == f"{vendor:04x}-{device_id:04x}-" + path.name.split("-")[2] + f"-{uuid.hex()}.bin"

    out, report, _ = _axpy_on_a_new_device(0.5, x, y)
    assert report["read"] == f"read {len(payload)} bytes"  # the header checked, given to the driver
    np.testing.assert_array_equal(out, _axpy_on_a_new_device(0.5, x, y)[0])


@pytest.mark.parametrize("damage", ["garbage", "cut", "flipped payload byte", "foreign device", "other format"])
def test_a_corrupt_or_foreign_cache_file_is_ignored_and_replaced(tmp_path, monkeypatch, damage):
    monkeypatch.setenv(PIPELINE_CACHE_ENV, str(tmp_path))
    x, y = _inputs()
    _axpy_on_a_new_device(1.0, x, y)  # writes this device's file
    (path,) = tmp_path.iterdir()
    good = path.read_bytes()
    payload, _ = unframe(good)
    if damage == "garbage":
        bad = b"\x00\xff" * 100
    elif damage == "cut":
        bad = good[:-7]
    elif damage == "flipped payload byte":
        bad = bytearray(good)
        bad[-1] ^= 0x40
        bad = bytes(bad)
    elif damage == "foreign device":  # a valid frame around another vendor's header: only the header check stops it
        foreign = bytearray(payload)
        struct.pack_into("<I", foreign, 8, 0xDEAD)
        bad = frame(bytes(foreign))
    else:
        bad = bytearray(good)
        struct.pack_into("<I", bad, 8, 99)
        bad = bytes(bad)
    path.write_bytes(bad)
    out, report, created = _axpy_on_a_new_device(1.0, x, y)
    assert report["read"].startswith("ignored: "), report
    assert created == 1
    np.testing.assert_allclose(out, _expected(1.0, x, y), rtol=1e-6)
    assert unframe(path.read_bytes())[0] is not None  # rewritten whole
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left


def test_the_cache_is_off_with_the_environment_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("VKTRAIN_CACHE_DIR", raising=False)
    monkeypatch.delenv(PIPELINE_CACHE_ENV, raising=False)
    assert pipeline_cache_folder() == tmp_path / "vktrain" / "pipelines"
    monkeypatch.setenv(PIPELINE_CACHE_ENV, "0")
    assert pipeline_cache_folder() is None
    x, y = _inputs()
    out, report, _ = _axpy_on_a_new_device(1.0, x, y)
    assert report is None
    np.testing.assert_allclose(out, _expected(1.0, x, y), rtol=1e-6)
    assert not (tmp_path / "vktrain").exists()  # (the validation layer and Mesa keep caches of their own there)


def test_the_store_checks_frame_and_header_without_a_device(tmp_path):
    key = DeviceKey(0x10DE, 0x2330, 0x2345, bytes(range(16)))
    header = struct.pack("<IIII16s", 32, 1, 0x10DE, 0x2330, bytes(range(16)))
    store = PipelineStore(tmp_path, key)
    assert store.read() is None and store.status == "no file"
    assert store.write(header + b"driver data")
    assert store.read() == header + b"driver data" and store.status.startswith("read ")
    for payload, why in [(header[:20], "shorter than a VkPipelineCacheHeaderVersionOne"),
                         (struct.pack("<IIII16s", 32, 2, 0x10DE, 0x2330, bytes(range(16))), "header version 2"),
                         (struct.pack("<IIII16s", 32, 1, 0x10DE, 0x2330, bytes(16)), "not this device's"),
                         (struct.pack("<IIII16s", 64, 1, 0x10DE, 0x2330, bytes(range(16))), "header size 64")]:
        store.write(payload)
        assert store.read() is None and why in store.status
    assert DeviceKey(0x10DE, 0x2331, 0x2345, bytes(range(16))).file_name != key.file_name  # another GPU: own file
    assert DeviceKey(0x10DE, 0x2330, 0x2346, bytes(range(16))).file_name != key.file_name  # another driver
