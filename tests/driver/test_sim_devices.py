"""The simulated driver's devices and contexts.

These test the sim itself (its controls have no real-driver counterpart), so they use the
``sim`` fixture (the backend in use) or ``fresh`` (a SimDriver of their own). A few read
the sim's own state where no driver call reports it (a device's peers, the calling
thread's current device).
"""

from __future__ import annotations

import threading

import pytest

from aiocuda import _driver
from aiocuda._driver.sim import SimDriver
from aiocuda.errors import (
    ArgumentError,
    CudaError,
    ResultCode,
)

from ._helpers import on_device


# -- devices and contexts -------------------------------------------------------------------
def test_devices_look_like_h100s(sim: SimDriver) -> None:
    assert sim.driver_version() == 13000
    assert sim.device_count() == 2
    dev = sim.device_get(1)
    assert sim.device_name(dev) == "aiocuda simulated GPU 1"
    assert sim.device_pci_bus_id(dev) == "0000:01:00.0"
    assert sim.device_attribute(dev, "pci_bus_id") == 1
    assert sim.device_total_mem(dev) == 16 << 30
    uuid = sim.device_uuid(dev)
    assert uuid.startswith("GPU-") and len(uuid) == 40
    assert uuid == sim.device_uuid(sim.device_get(1)) != sim.device_uuid(sim.device_get(0))
    assert sim.device_attribute(dev, "multiprocessor_count") == 132
    assert sim.device_attribute(dev, "compute_capability_major") == 9
    assert sim.device_attribute(dev, "max_threads_per_block") == 1024
    assert sim.device_attribute(dev, "warp_size") == 32
    assert sim.device_attribute(dev, "memory_pools_supported") == 1
    for name in sim.device_attribute_names():
        assert isinstance(sim.device_attribute(dev, name), int)


def test_devices_are_found_by_pci_bus_id(sim: SimDriver) -> None:
    assert [sim.device_ordinal_by_pci_bus_id(f) for f in ("0000:00:00.0", "0000:01:00", "01:00.0")] == [0, 1, 1]
    assert sim.device_ordinal_by_pci_bus_id("0000:02:00.0") is None  # well formed, no device there
    assert sim.device_ordinal_by_pci_bus_id("0001:01:00.0") is None
    with pytest.raises(ArgumentError) as info:
        sim.device_ordinal_by_pci_bus_id("01:00")
    assert info.value.code == ResultCode.INVALID_VALUE and info.value.call == "cuDeviceGetByPCIBusId"
    assert "'01:00'" in str(info.value)


def test_attribute_names_are_the_drivers_own() -> None:
    bindings = pytest.importorskip("cuda.bindings.driver")
    real = {m.name.removeprefix("CU_DEVICE_ATTRIBUTE_").lower() for m in bindings.CUdevice_attribute}
    assert set(SimDriver().device_attribute_names()) <= real


def test_bad_ordinal_and_unknown_attribute(sim: SimDriver) -> None:
    with pytest.raises(ArgumentError) as info:
        sim.device_get(2)
    assert info.value.code == ResultCode.INVALID_DEVICE == 101
    assert info.value.name == "CUDA_ERROR_INVALID_DEVICE"
    assert "ordinal 2" in str(info.value) and "2 device(s)" in str(info.value)
    with pytest.raises(ArgumentError):
        sim.device_get(-1)
    with pytest.raises(ArgumentError) as info:
        sim.device_attribute(sim.device_get(0), "flux_capacitance")
    assert info.value.code == ResultCode.INVALID_VALUE
    assert "flux_capacitance" in str(info.value)


def test_eight_devices_and_memory_size() -> None:
    sim = _driver.use_backend("sim", devices=8, total_memory=1 << 30)
    assert isinstance(sim, SimDriver)
    assert sim.device_count() == 8
    assert sim.device_pci_bus_id(sim.device_get(7)) == "0000:07:00.0"
    assert len({sim.device_uuid(sim.device_get(i)) for i in range(8)}) == 8
    on_device(sim, 7)
    assert sim.mem_get_info() == (1 << 30, 1 << 30)
    sim._devices[7].used_bytes = 1000
    assert sim.mem_get_info() == ((1 << 30) - 1000, 1 << 30)


def test_peers_and_contexts(sim: SimDriver) -> None:
    d0, d1 = sim.device_get(0), sim.device_get(1)
    assert sim.device_can_access_peer(d0, d1) and not sim.device_can_access_peer(d0, d0)
    ctx0, ctx1 = sim.primary_context_retain(d0), sim.primary_context_retain(d1)
    assert sim.primary_context_retain(d0) is ctx0
    assert sim.handle_value(ctx0) != sim.handle_value(ctx1)
    sim.set_current(ctx0)
    assert sim.enable_peer_access(ctx1) is True
    assert sim.enable_peer_access(ctx1) is False  # idempotent: CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
    assert sim._devices[0].peers == {1}
    with pytest.raises(ArgumentError):
        sim.enable_peer_access(ctx0)
    sim.disable_peer_access(ctx1)
    assert sim._devices[0].peers == set()
    for ctx in (ctx1, ctx0):  # disabled now; never enabled
        with pytest.raises(CudaError, match="cuCtxDisablePeerAccess") as info:
            sim.disable_peer_access(ctx)
        assert info.value.code == ResultCode.PEER_ACCESS_NOT_ENABLED
    sim.primary_context_release(d0)
    sim.primary_context_release(d0)
    with pytest.raises(ArgumentError):
        sim.primary_context_release(d0)


def test_pool_access_granted_and_revoked(sim: SimDriver) -> None:
    pool = sim.mempool_default(sim.device_get(1))
    assert sim.mempool_get_access(pool, 1) and not sim.mempool_get_access(pool, 0)
    sim.mempool_revoke_access(pool, 0)  # PROT_NONE where there was no access: no error
    sim.mempool_set_access(pool, 0)
    assert sim.mempool_get_access(pool, 0)
    sim.mempool_revoke_access(pool, 0)
    assert not sim.mempool_get_access(pool, 0)
    with pytest.raises(CudaError, match="cuMemPoolSetAccess"):
        sim.mempool_revoke_access(pool, 1)  # the owner's
    assert sim.mempool_get_access(pool, 1)


def test_current_context_is_per_thread(sim: SimDriver) -> None:
    assert sim._device_of_current() == 0  # lenient default
    on_device(sim, 1)
    seen: list[int] = []
    thread = threading.Thread(target=lambda: seen.append(sim._device_of_current()))
    thread.start()
    thread.join()
    assert seen == [0]
    stream = sim.stream_create(non_blocking=True, priority=0)
    assert sim.stream_device_ordinal(stream) == 1
    ran_on: list[int] = []
    sim.enqueue(stream, lambda: ran_on.append(sim._device_of_current()), "probe")
    sim.stream_synchronize(stream)
    assert ran_on == [1]  # workers have their stream's context current
