"""A fleet client opens the GPU Ray assigned it: Ray's NVML index -> UUID / PCI address (pynvml or nvidia-smi)
-> the Vulkan device reporting them (vktrain/fleet/gpus.py, vktrain/runtime/vk/device_identity.py).

No GPU here: the NVML side is fake nvidia-smi output, the Vulkan side fake PhysicalDeviceInfo lists in
other enumeration orders, and the real Vulkan query runs on lavapipe (one device, a UUID, no PCI bus info)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from vktrain.fleet.gpus import DeviceChoice, NvidiaGpu, client_device_choice, parse_nvidia_smi
from vktrain.runtime.vk.device import DEVICE_ENV, PhysicalDeviceInfo, select_physical_device
from vktrain.runtime.vk.device_identity import GpuIdentity, PciAddress, format_uuid, parse_pci_address, parse_uuid
from vktrain.runtime.vk.errors import DeviceSelectionError
from vktrain.errors import VktrainError

DISCRETE = 2
N_GPUS = 4


def _uuid(i: int) -> bytes:
    return bytes(range(16 * i, 16 * i + 16))


def _bus(i: int) -> int:
    return 0x1B + 0x20 * i  # PCI order follows NVML's index here, as it does on NVIDIA by default


def _nvidia_smi_text(n: int = N_GPUS) -> str:
    """What `nvidia-smi --query-gpu=index,uuid,pci.bus_id --format=csv,noheader` prints for GPUs 0..n-1."""
    return "".join(f"{i}, {format_uuid(_uuid(i))}, 00000000:{_bus(i):02X}:00.0\n" for i in range(n))


def _vulkan_devices(order, *, with_uuid=True, with_pci=True) -> list[PhysicalDeviceInfo]:
    """Vulkan's list when it enumerates NVML's GPUs `order[0], order[1], ...`; a lavapipe device last."""
    devices = [PhysicalDeviceInfo(v, f"NVIDIA H200 #{g}", DISCRETE, 1 << 22 | 3 << 12,
                                  _uuid(g) if with_uuid else None, PciAddress(0, _bus(g), 0, 0) if with_pci else None)
               for v, g in enumerate(order)]
    return devices + [PhysicalDeviceInfo(len(order), "llvmpipe", 4, 1 << 22 | 3 << 12, b"mesa22.3.6" + bytes(6))]


def _nvidia():
    return parse_nvidia_smi(_nvidia_smi_text()), "nvidia-smi"


def _chosen_index(devices, ray_ids, list_nvidia=_nvidia) -> int:
    choice = client_device_choice({}, ray_ids, list_nvidia)
    return select_physical_device(devices, choice.selector)


def test_nvidia_smi_output_parses_to_index_uuid_and_pci_address():
    gpus = parse_nvidia_smi("0, GPU-1b2c3d4e-0001-0203-0405-060708090a0b, 00000000:3B:00.0\n\n"
                            "1, GPU-ffffffff-0000-1111-2222-333344445555, 00000001:DB:1F.7\n")
    assert gpus == [NvidiaGpu(0, bytes.fromhex("1b2c3d4e000102030405060708090a0b"), PciAddress(0, 0x3B, 0, 0)),
                    NvidiaGpu(1, bytes.fromhex("ffffffff000011112222333344445555"), PciAddress(1, 0xDB, 0x1F, 7))]
    assert format_uuid(gpus[0].uuid) == "GPU-1b2c3d4e-0001-0203-0405-060708090a0b"
    assert parse_uuid("1B2C3D4E000102030405060708090A0B") == gpus[0].uuid  # prefix and dashes optional
    assert parse_pci_address("3b:00.0") == PciAddress(0, 0x3B, 0, 0) and str(PciAddress(1, 0xDB, 0x1F, 7)) == "0001:db:1f.7"
    for bad in ("0, GPU-12, 00000000:3B:00.0", "0, GPU-1b2c3d4e-0001-0203-0405-060708090a0b", "x, y, z"):
        with pytest.raises(DeviceSelectionError, match="expected"):
            parse_nvidia_smi(bad)
    with pytest.raises(VktrainError, match="3B:00"):
        parse_pci_address("3B:00")


@pytest.mark.parametrize("order", [(0, 1, 2, 3), (3, 2, 1, 0), (2, 0, 3, 1)])
def test_each_ray_gpu_id_opens_the_vulkan_device_with_that_gpus_uuid(order):
    """Vulkan lists the GPUs in its own order; Ray's id k (NVML index k) must open the device Vulkan lists
    at position order.index(k), whatever that is."""
    devices = _vulkan_devices(order)
    for k in range(N_GPUS):
        assert _chosen_index(devices, [str(k)]) == order.index(k)


def test_pci_address_decides_where_a_vulkan_device_reports_no_uuid():
    order = (1, 3, 0, 2)
    devices = _vulkan_devices(order, with_uuid=False)
    assert [_chosen_index(devices, [str(k)]) for k in range(N_GPUS)] == [order.index(k) for k in range(N_GPUS)]
    without_either = _vulkan_devices(order, with_uuid=False, with_pci=False)
    with pytest.raises(DeviceSelectionError) as error:
        _chosen_index(without_either, ["2"])
    message = str(error.value)
    assert "Ray GPU id 2 (nvidia-smi index 2)" in message and format_uuid(_uuid(2)) in message
    assert "matches no Vulkan device" in message and "NVIDIA H200 #3" in message and "no uuid, no pci" in message


def test_fractional_shares_of_one_gpu_open_the_same_device_and_several_ids_take_the_first():
    """--client-gpus 0.25: Ray hands the same id to four workers; each resolves it the same way. A worker
    reserving two GPUs (ids "2,3") opens the first."""
    devices = _vulkan_devices((3, 1, 2, 0))
    assert {_chosen_index(devices, ["1"]) for _ in range(4)} == {1}
    choice = client_device_choice({}, ["2", "3"], _nvidia)
    assert "first of 2, 3" in choice.reason and select_physical_device(devices, choice.selector) == 2


def test_a_ray_id_nothing_can_match_is_an_error_naming_the_id_and_the_devices_seen():
    with pytest.raises(DeviceSelectionError) as error:
        client_device_choice({}, ["5"], _nvidia)
    assert "Ray GPU id 5 is not a GPU nvidia-smi lists" in str(error.value) and "3 (0000:7b:00.0)" in str(error.value)
    # NVML knows it, Vulkan does not list it (e.g. the Vulkan driver hides it): refused, nothing opened
    devices = _vulkan_devices((0, 1, 2))
    with pytest.raises(DeviceSelectionError) as error:
        _chosen_index(devices, ["3"])
    message = str(error.value)
    assert message.startswith("Ray GPU id 3 (nvidia-smi index 3): uuid " + format_uuid(_uuid(3)))
    assert all(f"NVIDIA H200 #{g}" in message for g in range(3)) and "llvmpipe" in message
    with pytest.raises(DeviceSelectionError, match="MIG instance"):
        client_device_choice({}, ["MIG-4d2c1b3e-0001-0203-0405-060708090a0b"], _nvidia)


def test_a_uuid_ray_id_needs_no_nvml_and_precedence_keeps_todays_behaviour_elsewhere():
    def no_tools():
        raise AssertionError("NVML asked although nothing needed it")

    devices = _vulkan_devices((2, 0, 1, 3))
    # the node was started with CUDA_VISIBLE_DEVICES=GPU-...: Ray's ids are those UUIDs
    assert _chosen_index(devices, [format_uuid(_uuid(1))], no_tools) == 2
    assert client_device_choice({DEVICE_ENV: "1"}, ["3"], no_tools) == DeviceChoice(
        None, f"{DEVICE_ENV}=1 (explicit; wins over Ray's GPU assignment)")
    assert client_device_choice({}, [], no_tools).selector is None  # CPU clients, the sequential engine
    fallback = client_device_choice({}, ["3"], lambda: (None, ""))  # an AMD/Intel host: no NVML, no nvidia-smi
    assert fallback.selector is None and "Ray GPU id 3 cannot be named" in fallback.reason
    assert select_physical_device(devices, fallback.selector) == 0  # the default ranking, as before


def test_lavapipe_reports_a_16_byte_uuid_that_selects_it(vk_device):
    from vktrain.runtime.vk.device import Device

    info = vk_device.info
    assert len(info.uuid) == 16 and any(info.uuid) and info.uuid == vk_device.available_devices[info.index].uuid
    if "llvmpipe" in info.name:
        assert info.uuid.startswith(b"mesa") and info.pci is None  # lavapipe: "mesa<version>", no VK_EXT_pci_bus_info
    with Device(GpuIdentity("a test's identity", uuid=info.uuid), validation=vk_device.validation_enabled) as device:
        assert device.info == info and device.validation_messages == []  # the pNext chain is valid usage
    with pytest.raises(DeviceSelectionError, match="a test's identity: uuid GPU-00000000-.*llvmpipe"):
        Device(GpuIdentity("a test's identity", uuid=bytes(16)))


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    from test_fleet import _export  # the fleet tests' tiny LoRA MLP step

    root = tmp_path_factory.mktemp("fleet_devices")
    _export(root / "step.pte", freeze_lora_a=False)
    rng = np.random.default_rng(0)
    np.save(root / "train.npy", rng.integers(0, 64, 2000))
    return root


def _ray_assigns(monkeypatch, gpu_id: str, nvml_uuid: bytes):
    """This process is a Ray worker given GPU `gpu_id`, which NVML says has `nvml_uuid`."""
    import vktrain.fleet.gpus as gpus

    monkeypatch.delenv(DEVICE_ENV, raising=False)
    monkeypatch.setattr(gpus, "ray_gpu_ids", lambda: [gpu_id])
    monkeypatch.setattr(gpus, "nvidia_gpus", lambda: ([NvidiaGpu(int(gpu_id), nvml_uuid, PciAddress(0, 0x3B, 0, 0))],
                                                      "nvidia-smi"))


def test_the_fleet_client_opens_the_device_ray_assigned(program, vk_device, monkeypatch, capsys):
    from vktrain.fleet.client import ClientSettings, LocalTrainer

    settings = ClientSettings(str(program / "step.pte"), (str(program / "train.npy"),))
    _ray_assigns(monkeypatch, "0", vk_device.info.uuid)
    trainer = LocalTrainer(settings)
    try:
        assert trainer.device.info.uuid == vk_device.info.uuid and trainer.runner.device is trainer.device
    finally:
        trainer.close()
    assert trainer.device.closed
    log = capsys.readouterr().err
    assert f"{vk_device.info.describe()}: Ray GPU id 0, matched through nvidia-smi's UUID / PCI address" in log

    _ray_assigns(monkeypatch, "0", bytes(16))  # Ray's GPU is not this Vulkan's: no silent fallback to it
    with pytest.raises(DeviceSelectionError, match="Ray GPU id 0 .*matches no Vulkan device.*llvmpipe"):
        LocalTrainer(settings)
    monkeypatch.setenv(DEVICE_ENV, "0")  # ... unless the user says which device
    trainer = LocalTrainer(settings)
    trainer.close()
    assert f"{DEVICE_ENV}=0 (explicit" in capsys.readouterr().err


def test_a_sequential_federation_runs_as_before_and_records_each_clients_device(program, vk_device, monkeypatch,
                                                                               tmp_path, capsys):
    from vktrain.cli import main

    monkeypatch.delenv(DEVICE_ENV, raising=False)
    json_path = tmp_path / "rounds.json"
    assert main(["federate", str(program / "step.pte"), "--clients", "2", "--rounds", "1", "--local-steps", "1",
                 "--data", str(program / "train.npy"), "--engine", "sequential", "--json", str(json_path)]) == 0
    rounds = json.loads(json_path.read_text())["rounds"]
    assert rounds[1]["client_devices"] == {"0": vk_device.info.describe(), "1": vk_device.info.describe()}
    # the sequential engine runs no Ray worker: the log says so, not that Ray assigned no GPU
    assert "not a Ray worker (--engine sequential, or a fleet node): vktrain's default ranking" in \
        capsys.readouterr().err
