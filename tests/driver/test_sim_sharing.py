"""The simulated driver's managed memory and IPC, within one process (the library's
tests start second processes): a pool imported again is a second mapping of the same
memory, an opened event follows the original's progress, bad use is refused."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from aiocuda._driver import PoolProps
from aiocuda._driver.sim import SimDriver
from aiocuda.errors import ArgumentError, CudaError

from ._helpers import WAIT, on_device


def test_an_imported_pool_is_the_same_memory_seen_again(sim: SimDriver) -> None:
    on_device(sim, 0)
    stream = sim.stream_create(True, 0)
    pool = sim.mempool_create(PoolProps(0, ipc=True))
    ptr = sim.mem_alloc_async(1024, pool, stream)
    data = sim.mempool_export_pointer(ptr)
    fd = sim.mempool_export_fd(pool)
    try:
        imported_pool = sim.mempool_import_fd(fd)
    finally:
        os.close(fd)
    seen = sim.mempool_import_pointer(imported_pool, data)
    assert seen != ptr  # a second mapping, as another process would have
    host = np.arange(256, dtype=np.int32)
    sim.memcpy_htod_async(ptr, host.ctypes.data, 1024, stream)
    out = np.zeros(256, np.int32)
    sim.memcpy_dtoh_async(out.ctypes.data, seen, 1024, stream)
    sim.stream_synchronize(stream)
    np.testing.assert_array_equal(out, host)
    with pytest.raises(ArgumentError, match="imported already"):
        sim.mempool_import_pointer(imported_pool, data)
    with pytest.raises(ArgumentError, match="allocates nothing"):
        sim.mem_alloc_async(64, imported_pool, stream)
    sim.mem_free_async(seen, stream)  # the import ends; the exporter's allocation lives on
    sim.stream_synchronize(stream)
    with pytest.raises(ArgumentError):
        sim.memcpy_dtoh_async(out.ctypes.data, seen, 1024, stream)
    sim.mem_free_async(ptr, stream)
    with pytest.raises(ArgumentError, match="exportable"):
        sim.mempool_export_fd(sim.mempool_create(PoolProps(0)))
    with pytest.raises(ArgumentError, match="exportable pool"):
        sim.mempool_export_pointer(sim.mem_alloc_managed(64, "global"))
    with pytest.raises(ArgumentError, match="names no allocation"):
        sim.mempool_import_pointer(imported_pool, bytes(64))


def test_an_opened_event_follows_the_original(sim: SimDriver) -> None:
    on_device(sim, 0)
    producer = sim.stream_create(True, 0)
    consumer = sim.stream_create(True, 0)
    event = sim.ipc_event_create()
    opened = sim.ipc_open_event(sim.ipc_event_handle(event))
    assert sim.event_query(opened)  # never recorded: complete
    sim.pause(producer)
    sim.event_record(event, producer)
    assert not sim.event_query(opened)
    sim.stream_wait_event(consumer, opened)  # a wait on another process's point
    order: list[str] = []
    sim.enqueue(consumer, lambda: order.append("consumer"))
    waited = threading.Event()
    waiter = threading.Thread(target=lambda: (sim.event_synchronize(opened), waited.set()))
    waiter.start()
    sim.enqueue(producer, lambda: order.append("producer"))  # after the record: not waited for
    assert not sim.stream_query(consumer)
    sim.resume(producer)
    waiter.join(WAIT)
    assert waited.is_set()
    sim.stream_synchronize(consumer)
    assert "consumer" in order
    with pytest.raises(CudaError, match="does not record"):
        sim.event_record(opened, consumer)
    with pytest.raises(ArgumentError, match="interprocess"):
        sim.ipc_event_handle(sim.event_create(False, False))
    with pytest.raises(ArgumentError, match="no live interprocess event"):
        sim.ipc_open_event(bytes(64))


def test_managed_memory_is_checked(sim: SimDriver) -> None:
    on_device(sim, 0)
    stream = sim.stream_create(True, 0)
    ptr = sim.mem_alloc_managed(4096, "global")
    sim.mem_prefetch_async(ptr, 4096, 0, stream)
    sim.mem_prefetch_async(ptr + 1024, 1024, None, stream)
    sim.mem_advise(ptr, 4096, "set_read_mostly", None)
    sim.stream_attach_mem_async(stream, ptr, "single")
    sim.stream_synchronize(stream)
    host = np.ones(16, np.uint8)
    sim.memcpy_htod_async(ptr, host.ctypes.data, 16, stream)  # a device copy into managed memory
    sim.memcpy_dtoh_async(ptr + 16, ptr, 16, stream)  # managed memory is host memory too
    sim.stream_synchronize(stream)
    with pytest.raises(ArgumentError, match="managed allocation"):
        sim.mem_prefetch_async(ptr, 8192, 0, stream)
    with pytest.raises(ArgumentError, match="no device"):
        sim.mem_prefetch_async(ptr, 16, 7, stream)
    with pytest.raises(ArgumentError, match="unknown advice"):
        sim.mem_advise(ptr, 16, "set_fast", 0)
    with pytest.raises(ArgumentError, match="unknown attach"):
        sim.stream_attach_mem_async(stream, ptr, "nowhere")
    with pytest.raises(ArgumentError, match="free it with cuMemFree"):
        sim.mem_free_async(ptr, stream)
    with pytest.raises(ArgumentError, match="no size limit"):
        sim.mempool_create(PoolProps(0, max_size=1 << 20, managed=True))
    sim.mem_free(ptr)
    with pytest.raises(ArgumentError):
        sim.mem_free(ptr)
