"""Host <-> device copies, through pooled pinned staging chunks for pageable memory.

The driver copies pageable memory at a fraction of the DMA rate (one CPU thread stages
it, and a device-to-host copy into pageable memory blocks the caller until done). So
aiocuda stages pageable arrays itself:

* host -> device: a worker thread copies the array into pinned chunks, several CPU
  threads at a time, and enqueues each chunk's DMA as soon as it is staged, so the host
  copy of chunk *i + 1* overlaps the DMA of chunk *i*. The event loop never blocks.
* device -> host: the worker enqueues the DMA of each chunk into a pinned slot and
  copies slot *i* out while chunk *i + 1* is in flight.
* Up to :data:`INLINE_LIMIT` bytes go through a single ready slot on the loop's thread
  (a host copy of well under a millisecond) to skip the thread hop.
* Pinned memory (see :mod:`aiocuda.host`) is copied directly, holding the pinned owner
  until the DMA completes.

A staging slot is never reused before the DMA that last touched it has completed (each
slot carries a per-device event recorded after its DMA). Slots are shared by every
stream, device and event loop of the process, and are never freed.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anyio.to_thread
import numpy.typing as npt

from . import _driver
from .device import Device
from .host import _PinnedAllocation, pinned_ranges
from .stream import Stream

__all__ = ["CHUNK", "INLINE_LIMIT", "device_to_host", "host_to_device"]

CHUNK = 8 << 20
"""Bytes per staging slot and per pipelined DMA."""

INLINE_LIMIT = 1 << 20
"""Pageable copies up to this size are staged on the calling thread."""

MAX_SLOTS = 16
"""Staging slots in the process at most (``MAX_SLOTS * CHUNK`` bytes pinned)."""

PIPELINE_SLOTS = 4
"""Slots one large copy uses at a time."""

_HOST_COPY_THREADS = max(2, min(8, (os.cpu_count() or 4) // 2))
"""Threads sharing a large host copy: one thread's memcpy reaches only a third of
what the DMA engine does, and pageable copies are bound by it."""
_HOST_COPY_SPLIT = 2 << 20
_memmove = ctypes.memmove


class _Slot:
    """One pinned chunk and the fence of the last DMA that touched it."""

    __slots__ = ("events", "fence", "owner", "ptr")

    def __init__(self, device: Device) -> None:
        self.owner = _PinnedAllocation(device, CHUNK)
        self.ptr = self.owner.ptr
        self.events: dict[int, Any] = {}
        self.fence: tuple[Any, Any] | None = None  # (driver, event handle)

    def mark(self, device: Device, stream_handle: Any) -> None:
        """Record that a DMA just enqueued on ``stream_handle`` touches this slot."""
        event = self.events.get(device.ordinal)
        if event is None:
            event = self.events[device.ordinal] = device._driver.event_create(False, False)
        device._driver.event_record(event, stream_handle)
        self.fence = (device._driver, event)

    def ready(self) -> bool:
        fence = self.fence
        return fence is None or bool(fence[0].event_query(fence[1]))

    def wait_idle(self) -> None:
        """Block this thread until the slot's last DMA has completed."""
        fence = self.fence
        if fence is not None:
            fence[0].event_synchronize(fence[1])


class _StagingPool:
    """The process's staging slots (created on demand, up to MAX_SLOTS)."""

    def __init__(self) -> None:
        self._free: list[_Slot] = []
        self._count = 0
        self._cond = threading.Condition()

    def try_acquire_ready(self, device: Device) -> _Slot | None:
        """A free slot whose last DMA finished, or a new one; None instead of waiting."""
        with self._cond:
            for i, slot in enumerate(self._free):
                if slot.ready():
                    return self._free.pop(i)
            if self._count >= MAX_SLOTS:
                return None
            self._count += 1
        return _Slot(device)

    def acquire(self, device: Device, wanted: int) -> list[_Slot]:
        """Between 1 and ``wanted`` slots, blocking until at least one is free."""
        with self._cond:
            while True:
                creatable = min(wanted - len(self._free), MAX_SLOTS - self._count)
                if self._free or creatable > 0:
                    self._free.sort(key=_Slot.ready, reverse=True)  # idle slots first
                    taken = self._free[:wanted]
                    del self._free[:wanted]
                    new = max(0, min(wanted - len(taken), MAX_SLOTS - self._count))
                    self._count += new
                    break
                self._cond.wait()
        return taken + [_Slot(device) for _ in range(new)]

    def release(self, slots: list[_Slot]) -> None:
        with self._cond:
            self._free.extend(slots)
            self._cond.notify_all()


_pools: dict[int, _StagingPool] = {}
_copiers: ThreadPoolExecutor | None = None
_copiers_lock = threading.Lock()


def _staging_pool() -> _StagingPool:
    """The staging pool of the backend in use (slots hold that backend's memory)."""
    generation = _driver.backend_generation()
    pool = _pools.get(generation)
    if pool is None:
        _pools.clear()
        pool = _pools[generation] = _StagingPool()
    return pool


def _host_copy(dst: int, src: int, nbytes: int) -> None:
    """memmove, split over several threads for large ranges (ctypes releases the GIL)."""
    global _copiers
    if nbytes < 2 * _HOST_COPY_SPLIT:
        _memmove(dst, src, nbytes)
        return
    if _copiers is None:
        with _copiers_lock:
            if _copiers is None:
                _copiers = ThreadPoolExecutor(_HOST_COPY_THREADS, thread_name_prefix="aiocuda-staging")
    part = -(-nbytes // _HOST_COPY_THREADS)
    part += -part % 4096
    futures = [
        _copiers.submit(_memmove, dst + off, src + off, min(part, nbytes - off)) for off in range(0, nbytes, part)
    ]
    for future in futures:
        future.result()


def _pipeline_h2d(device: Device, stream_handle: Any, dst: int, src: int, nbytes: int, slots: list[_Slot]) -> None:
    driver = device._driver
    device.make_current()
    for i, off in enumerate(range(0, nbytes, CHUNK)):
        slot = slots[i % len(slots)]
        n = min(CHUNK, nbytes - off)
        slot.wait_idle()
        _host_copy(slot.ptr, src + off, n)
        driver.memcpy_htod_async(dst + off, slot.ptr, n, stream_handle)
        slot.mark(device, stream_handle)


def _pipeline_d2h(device: Device, stream_handle: Any, dst: int, src: int, nbytes: int, slots: list[_Slot]) -> None:
    driver = device._driver
    device.make_current()
    in_flight: deque[tuple[_Slot, int, int]] = deque()
    try:
        for i, off in enumerate(range(0, nbytes, CHUNK)):
            if len(in_flight) == len(slots):
                _drain_one(in_flight, dst)
            slot = slots[i % len(slots)]
            n = min(CHUNK, nbytes - off)
            slot.wait_idle()
            driver.memcpy_dtoh_async(slot.ptr, src + off, n, stream_handle)
            slot.mark(device, stream_handle)
            in_flight.append((slot, off, n))
        while in_flight:
            _drain_one(in_flight, dst)
    finally:
        in_flight.clear()


def _drain_one(in_flight: deque[tuple[_Slot, int, int]], dst: int) -> None:
    slot, off, n = in_flight.popleft()
    slot.wait_idle()
    _host_copy(dst + off, slot.ptr, n)


async def host_to_device(dst: int, host: npt.NDArray[Any], stream: Stream) -> None:
    """Enqueue the copy of C-contiguous ``host`` to device address ``dst`` on ``stream``.

    Returns once everything is enqueued and ``host`` may be modified again; the DMA may
    still be running (await the stream for that). Pinned sources are held until it ends.
    """
    nbytes = int(host.nbytes)
    if nbytes == 0:
        return
    device = stream.device
    src = int(host.ctypes.data)
    owner = pinned_ranges.owner(src, nbytes)
    if owner is not None:
        device.make_current()
        device._driver.memcpy_htod_async(dst, src, nbytes, stream.handle)
        stream.hold(owner, host)
        return
    if nbytes <= INLINE_LIMIT:
        pool = _staging_pool()
        slot = pool.try_acquire_ready(device)
        if slot is not None:
            try:
                device.make_current()
                _memmove(slot.ptr, src, nbytes)
                device._driver.memcpy_htod_async(dst, slot.ptr, nbytes, stream.handle)
                slot.mark(device, stream.handle)
            finally:
                pool.release([slot])
            return
    await _in_worker(_pipeline_h2d, device, stream, dst, src, nbytes)


async def device_to_host(host: npt.NDArray[Any], src: int, stream: Stream) -> None:
    """Copy ``host.nbytes`` from device address ``src`` into C-contiguous ``host``,
    after the work already on ``stream``; returns when ``host`` holds the data.

    If the awaiting task is cancelled, the copy still completes into ``host`` (which is
    kept alive until then); only the wait is abandoned.
    """
    nbytes = int(host.nbytes)
    if nbytes == 0:
        return
    device = stream.device
    dst = int(host.ctypes.data)
    owner = pinned_ranges.owner(dst, nbytes)
    if owner is not None:
        device.make_current()
        device._driver.memcpy_dtoh_async(dst, src, nbytes, stream.handle)
        stream.hold(owner, host)
        await stream.record()
        return
    if nbytes <= INLINE_LIMIT:
        pool = _staging_pool()
        slot = pool.try_acquire_ready(device)
        if slot is not None:
            try:
                device.make_current()
                device._driver.memcpy_dtoh_async(slot.ptr, src, nbytes, stream.handle)
                slot.mark(device, stream.handle)
                await stream.record()
                _memmove(dst, slot.ptr, nbytes)
            finally:
                pool.release([slot])
            return
    await _in_worker(_pipeline_d2h, device, stream, dst, src, nbytes)


async def _in_worker(pipeline: Any, device: Device, stream: Stream, dst: int, src: int, nbytes: int) -> None:
    wanted = min(PIPELINE_SLOTS, -(-nbytes // CHUNK))
    pool = _staging_pool()
    slots = await anyio.to_thread.run_sync(pool.acquire, device, wanted)
    try:
        # Not abandoned on cancellation: the thread must finish touching the host array.
        await anyio.to_thread.run_sync(pipeline, device, stream.handle, dst, src, nbytes, slots)
    finally:
        pool.release(slots)
