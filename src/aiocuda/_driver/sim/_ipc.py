"""Simulated managed memory and sharing between processes.

Managed memory (``mem_alloc_managed``) is host memory the simulator owns, in the
allocation table as device memory that host code may use too. Prefetches are enqueued
operations that check their range and do nothing else (every byte is always "here");
advice and attachments are checked and remembered nowhere. The simulator does not count
managed memory against a device's memory, as the driver does not until it is touched.

Sharing between processes works between real processes, each with its own simulated
driver, through the memory the operating system shares (``_shared.py``): an IPC pool's
blocks live in a shared ``memfd`` whose descriptor is what ``mempool_export_fd`` hands
out, and an interprocess event's progress is two shared counters. Importing into the
exporting process itself works too: the pool is mapped a second time, at another
address, as a second process would see it. Departures from the driver: an opened event
cannot be recorded into, a simulated process has at most ``_shared.SLOTS`` interprocess
events at once, and an IPC pool holds at most ``_memory.IPC_POOL_BYTES``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ...errors import CudaError, ResultCode
from ._codes import sim_error
from ._memory import SimPool, _aligned_bytes, _Block
from ._objects import SimDevice, SimEvent
from ._shared import EventSlots, SharedRegion, open_event_slot

__all__ = ["SimSharing"]

_ADVICE = frozenset(
    f"{verb}_{what}" for verb in ("set", "unset") for what in ("read_mostly", "preferred_location", "accessed_by")
)
_ATTACH = frozenset({"global", "host", "single"})


def _invalid(call: str, detail: str) -> CudaError:
    return sim_error(ResultCode.INVALID_VALUE, call, detail)


class SimSharing:
    """Mixin of SimDriver: managed memory and IPC (see the module docstring)."""

    # Provided by SimCore and SimMemory.
    _api: Callable[..., None]
    _device_of_current: Callable[[], int]
    _devices: tuple[SimDevice, ...]
    _events: dict[int, SimEvent]
    _event: Callable[[Any], SimEvent]
    _enqueue: Callable[..., None]
    _stream_ordinal: Callable[[Any], int]
    _mem: Callable[[], Any]
    _check_pool: Callable[[Any, str], None]
    _event_slots: EventSlots | None = None

    # -- managed memory ---------------------------------------------------------------------
    def mem_alloc_managed(self, size: int, attach: str) -> int:
        self._api("mem_alloc_managed")
        if size <= 0:
            raise _invalid("cuMemAllocManaged", f"size must be > 0, got {size}")
        if attach not in ("global", "host"):
            raise _invalid("cuMemAllocManaged", f"attach must be 'global' or 'host', not {attach!r}")
        array = _aligned_bytes(size)
        block = _Block(array.ctypes.data, size, array, "device", self._device_of_current(), None)
        block.managed = True
        state = self._mem()
        with state.lock:
            state.insert(block)
        return int(block.start)

    def mem_free(self, ptr: int) -> None:
        self._api("mem_free")
        state = self._mem()
        with state.lock:
            block = state.blocks.get(ptr)
            if block is None or block.kind != "device" or not (block.managed or block.imported) or block.pool:
                raise _invalid("cuMemFree", f"0x{ptr:x} is not a managed allocation nor an imported pointer")
            if block.free_token is not None:
                raise _invalid("cuMemFree", f"0x{ptr:x} is being freed already")
            state.remove(ptr)

    def _managed_range(self, ptr: int, size: int, call: str) -> None:
        block = self._mem().find(ptr, max(size, 1))
        if block is None or not block.managed:
            raise _invalid(call, f"[0x{ptr:x}, +{size}) is not inside one managed allocation")

    def _location(self, device_ordinal: int | None, call: str) -> None:
        if device_ordinal is not None and not 0 <= device_ordinal < len(self._devices):
            raise sim_error(ResultCode.INVALID_DEVICE, call, f"no device {device_ordinal}")

    def mem_prefetch_async(self, ptr: int, size: int, device_ordinal: int | None, stream: Any) -> None:
        self._api("mem_prefetch_async", self._stream_ordinal(stream))
        self._location(device_ordinal, "cuMemPrefetchAsync")
        self._managed_range(ptr, size, "cuMemPrefetchAsync")
        self._enqueue(stream, lambda: None, "mem_prefetch_async")

    def mem_advise(self, ptr: int, size: int, advice: str, device_ordinal: int | None) -> None:
        self._api("mem_advise")
        if advice not in _ADVICE:
            raise _invalid("cuMemAdvise", f"unknown advice {advice!r}")
        self._location(device_ordinal, "cuMemAdvise")
        self._managed_range(ptr, size, "cuMemAdvise")

    def stream_attach_mem_async(self, stream: Any, ptr: int, attach: str) -> None:
        self._api("stream_attach_mem_async", self._stream_ordinal(stream))
        if attach not in _ATTACH:
            raise _invalid("cuStreamAttachMemAsync", f"unknown attach {attach!r}")
        block = self._mem().blocks.get(ptr)
        if block is None or not block.managed or block.pool is not None:
            raise _invalid("cuStreamAttachMemAsync", f"0x{ptr:x} is not the start of a managed allocation")
        self._enqueue(stream, lambda: None, "stream_attach_mem_async")

    # -- events shared with other processes ---------------------------------------------------
    def ipc_event_create(self) -> SimEvent:
        ordinal = self._device_of_current()
        self._api("ipc_event_create", ordinal)
        if self._event_slots is None:
            self._event_slots = EventSlots()
        slot = self._event_slots.take()
        if slot is None:
            raise sim_error(
                ResultCode.OUT_OF_MEMORY, "ipc_event_create", "the simulator's interprocess event slots are all in use"
            )
        event = SimEvent(ordinal, timing=False, blocking_sync=False)
        event.shared = slot
        self._events[event.value] = event
        return event

    def ipc_event_handle(self, event: Any) -> bytes:
        ev = self._event(event)
        self._api("ipc_event_handle", ev.device_ordinal)
        if ev.shared is None or self._event_slots is None:
            raise sim_error(
                ResultCode.INVALID_HANDLE, "ipc_event_handle", "the event was not created for interprocess use"
            )
        return self._event_slots.handle(ev.shared)

    def ipc_open_event(self, handle: bytes) -> SimEvent:
        ordinal = self._device_of_current()
        self._api("ipc_open_event", ordinal)
        slot = open_event_slot(bytes(handle))
        if slot is None:
            raise _invalid("cuIpcOpenEventHandle", "the handle names no live interprocess event")
        event = SimEvent(ordinal, timing=False, blocking_sync=False)
        event.remote = slot
        self._events[event.value] = event
        return event

    # -- pools shared with other processes -----------------------------------------------------
    def mempool_export_fd(self, pool: Any) -> int:
        self._check_pool(pool, "cuMemPoolExportToShareableHandle")
        self._api("mempool_export_fd", pool.ordinal)
        if pool.region is None or pool.imported:
            raise _invalid("cuMemPoolExportToShareableHandle", "the pool was not created exportable")
        return os.dup(pool.region.fd)

    def mempool_import_fd(self, fd: int) -> Any:
        ordinal = self._device_of_current()
        self._api("mempool_import_fd", ordinal)
        try:
            region = SharedRegion.open(fd)
        except (OSError, ValueError) as exc:
            raise _invalid("cuMemPoolImportFromShareableHandle", f"not a simulated pool's descriptor: {exc}") from None
        pool = SimPool(ordinal, 0, is_default=False)
        pool.region = region
        pool.imported = True
        state = self._mem()
        with state.lock:
            state.pools.append(pool)  # a live pool, as mempool_destroy expects
        return pool

    def mempool_export_pointer(self, ptr: int) -> bytes:
        self._api("mempool_export_pointer")
        block = self._mem().blocks.get(ptr)
        if block is None or block.pool is None or block.pool.region is None:
            raise _invalid("cuMemPoolExportPointer", f"0x{ptr:x} is not an allocation of an exportable pool")
        return bytes(block.pool.region.pointer_data(ptr, block.size))

    def mempool_import_pointer(self, pool: Any, data: bytes) -> int:
        self._check_pool(pool, "cuMemPoolImportPointer")
        self._api("mempool_import_pointer", pool.ordinal)
        if not pool.imported:
            raise _invalid("cuMemPoolImportPointer", "pointers are imported from an imported pool")
        located = pool.region.locate(bytes(data))
        if located is None:
            raise _invalid("cuMemPoolImportPointer", "the data names no allocation of this pool")
        address, size = located
        offset = address - pool.region.base
        state = self._mem()
        with state.lock:
            if address in state.blocks:
                raise _invalid("cuMemPoolImportPointer", f"0x{address:x} is imported already")
            block = _Block(address, size, pool.region.bytes[offset : offset + size], "device", pool.ordinal, None)
            block.imported = True
            state.insert(block)
        return int(address)
