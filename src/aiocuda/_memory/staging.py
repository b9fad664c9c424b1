"""Host <-> device copies of numpy arrays: direct from pinned memory, staged from pageable.

The driver copies pageable memory at a fraction of the DMA rate (one CPU thread stages
it, and a device-to-host copy into pageable memory blocks the caller until done). So
aiocuda stages pageable arrays itself, through pinned slots:

* Pinned memory (see :mod:`aiocuda.host`) is copied directly by
  :mod:`aiocuda._memory.copies`, which decides pinned or pageable.
* Up to :data:`INLINE_LIMIT` bytes go through one ready slot on the loop's thread (a
  host copy of well under a millisecond), which skips the hop to a thread. An awaited
  copy does its host side in slices of :data:`SLICE` bytes and lets the loop run its
  other tasks between them, so that no single step of the loop is long. A slot has its
  copy's size class (that of the pinned cache), and stays fenced until its DMA is done:
  a download's until the work before it on the stream has run. So the pool grows, off
  the loop, to as many slots as the copies in flight at once need, up to
  :data:`INLINE_BYTES`.
* Larger copies are cut into chunks for the copier threads (:mod:`aiocuda._memory.copiers`):
  each thread copies whole chunks through its own slots, the host copy of one chunk
  overlapping the DMA of the last. The event loop never blocks; the awaiting task waits
  in a worker thread for the job.

Cancellation never leaves aiocuda touching the host array after the await has ended: a
staged copy, once started, finishes its host side before the cancellation takes
effect (host to device: every chunk has been copied into a slot and its DMA enqueued;
device to host: ``host`` holds the data), while the small inline device-to-host copy is
abandoned at its await, ``host`` then not written, and once it has begun to fill ``host``
it completes first. A cancelled inline host-to-device copy enqueues nothing. A small copy
that finds no inline slot ready (all fenced by copies their streams have not reached)
goes through a block of the pinned cache instead, cancelled the same way.

Pitfall: a slot is fenced by the stream of its last DMA, so a staged copy onto a stream
still busy with long work (a kernel enqueued before it) ties up the slots it filled until
that work is done. Copies to other streams go through the other slots meanwhile, but a
large copy onto such a stream can fill them all, and the others then wait. Pinned arrays
(:func:`aiocuda.pinned_empty`) skip staging altogether.

The knobs are module constants, read when the staging resources are built: change them,
then call :func:`reset` (a sweep on a GPU does exactly that). Staging memory is pinned for
good: at most ``COPY_THREADS * SLOTS_PER_THREAD * CHUNK + INLINE_BYTES`` bytes, allocated
as first needed, shared by every device, stream and event loop.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from typing import Any

import anyio.to_thread
import numpy.typing as npt

from .. import _driver
from .._completion.loops import current_adapter
from ..device import Device
from ..stream import Stream
from . import copies as _copies
from . import host_copy, offloop, pinned_cache
from .copiers import Copiers, Job, Slot
from .pinned import host_address, pinned_block

__all__ = [
    "CHUNK",
    "COPY_THREADS",
    "INLINE_BYTES",
    "INLINE_LIMIT",
    "INLINE_SLOTS",
    "MIN_CHUNK",
    "SLICE",
    "SLOTS_PER_THREAD",
    "device_to_host",
    "download_inline",
    "download_staged",
    "host_to_device",
    "landed",
    "release",
    "reset",
    "upload_now",
    "upload_staged",
]


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 4


CHUNK = 16 << 20
"""Largest chunk, and the size of each copier slot. ``memmove`` of chunks well above the
last-level cache share per core runs with non-temporal stores, much faster."""

MIN_CHUNK = 2 << 20
"""Smallest chunk (but a copy's last): chunks shrink from CHUNK towards it as a copy
nears its end, so that the DMAs after the last host copy are short. Equal to CHUNK,
every chunk has that size. Per chunk a copier pays a lock, two driver calls and an event
record, so tiny chunks are wasteful."""

# Host copies from pageable memory scaled to about 8 threads on a 16-core machine and
# got slower beyond (memory bandwidth, and the cores the event loop and the driver need).
COPY_THREADS = max(2, min(8, _usable_cpus() // 2))
"""Copier threads: half the usable CPUs, at least 2 and at most 8."""

SLOTS_PER_THREAD = 2
"""Slots per copier thread: two let a thread copy one chunk while the DMA of its
previous chunk runs (host to device), or copy out one chunk while the next is in flight
(device to host)."""

INLINE_LIMIT = 1 << 20
"""Pageable copies up to this size are staged on the calling thread, one slot each."""

INLINE_SLOTS = 8
"""Inline slots made on the calling thread when a copy needs one, besides the first of
each size class; more are made on the off-loop thread (see :data:`INLINE_BYTES`)."""

INLINE_BYTES = 16 << 20
"""Page-locked bytes the inline slots may take together. A copy that finds no slot of its
size class ready goes through a block of the pinned cache, and has the off-loop thread
make as many more slots of that class as there are (up to this budget) for the next
ones."""

# Why the pool grows: a download holds its slot until the work before it on the stream
# has run, so eight slots of 1 MiB served eight requests in flight. The serve benchmark's
# README-style endpoint (await to_device, a 1 ms kernel, await to_host; 64 KiB each, 64
# connections, 33 lanes) sent the rest through the copier threads: 1300-1350 requests/s
# at 0.92-0.96 ms of CPU each, where the same work through a lane took 0.20. With slots
# of 64 KiB grown to the copies in flight: 3280-3430 requests/s at 0.31-0.32 ms (H200,
# paired, 6 windows each, asyncio and uvloop; benchmarks/results/logs/readme-inline-slots-ab.txt).

SLICE = 128 << 10
"""An awaited inline copy moves at most this many bytes between two turns of the loop."""

# Why SLICE: eight tasks each uploading and downloading 1 MiB of pageable memory in a loop
# (benchmarks/loop_health.py's storm) made every loop step that copied 1 MiB in one go
# about 0.15 ms long, and the loop's iterations (a step of every task) 2-6 ms long: a
# timer on that loop fired that late (p99 13.5 ms on asyncio, H100). In 256 KiB slices
# the p99 was 2.5-2.8 ms on asyncio and 1.5-1.6 on uvloop (H200): asyncio runs a timer
# one iteration later than uvloop, so its steps must be shorter still.

_memmove = host_copy.memmove


_PROBES = 4
"""Idle slots of a size class a copy asks whether their DMA is done, oldest first."""

_log = logging.getLogger("aiocuda")


class _InlineSlots:
    """The slots of inline copies, by size class: the idle ones in the order they came
    back (the oldest is the likeliest done), and how many of each class exist."""

    def __init__(self, limit: int, budget: int, made_here: int) -> None:
        self.limit = limit
        """The largest copy that goes inline."""
        self._budget = budget
        self._made_here = made_here
        self._idle: dict[int, deque[Slot]] = {}
        self._made: dict[int, int] = {}
        """Slots made or being made, by size class."""
        self._growing: set[int] = set()
        self._lock = threading.Lock()

    def try_acquire(self, device: Device, nbytes: int) -> Slot | None:
        """A slot for a copy of ``nbytes`` whose last DMA has finished, or a new one: the
        first of its size class, or one of the first ``made_here``. None rather than
        wait: then the off-loop thread makes as many more of its class as there are."""
        size = pinned_cache.size_class(nbytes)
        with self._lock:
            idle = self._idle.get(size)
            if idle:
                for _ in range(min(_PROBES, len(idle))):
                    if idle[0].ready():
                        return idle.popleft()
                    idle.rotate(-1)
            made = self._made.get(size, 0)
            here = made == 0 or self._made_here > 0
            count = min(1 if here else made, (self._budget - self._reserved()) // size)
            if count < 1 or size in self._growing:
                return None
            self._made[size] = made + count
            if not here:
                self._growing.add(size)
            elif made:
                self._made_here -= 1
        if not here:
            offloop.submit(self._grow, device, size, count)
            return None
        try:
            device.make_current()
            return Slot(device, size)
        except BaseException:
            self._forget(size, 1)
            raise

    def release(self, slot: Slot) -> None:
        with self._lock:
            self._idle.setdefault(slot.size, deque()).append(slot)

    def _grow(self, device: Device, size: int, count: int) -> None:
        """On the off-loop thread: ``count`` more slots of ``size`` for ``device``'s copies."""
        slots: list[Slot] = []
        try:
            device.make_current()
            for _ in range(count):
                slot = Slot(device, size)
                slot.fence_event(device)  # (else made by its first copy, on that thread)
                slots.append(slot)
        except Exception as exc:  # out of page-locked memory, say: grow no more
            self._forget(size, count - len(slots))
            with self._lock:
                self._budget = self._reserved()
            _log.warning("aiocuda: no more inline staging slots (%d bytes made): %s", self._budget, exc)
        with self._lock:
            self._growing.discard(size)
            self._idle.setdefault(size, deque()).extend(slots)

    def _reserved(self) -> int:
        """Bytes of the slots made or being made (under the lock)."""
        return sum(size * count for size, count in self._made.items())

    def _forget(self, size: int, count: int) -> None:
        """``count`` slots of ``size`` reserved were never made."""
        with self._lock:
            self._made[size] -= count


class _Resources:
    """The staging resources of one backend (slots hold that backend's memory) in one
    process (threads do not survive ``fork``)."""

    def __init__(self) -> None:
        self.generation = _driver.backend_generation()
        self.pid = os.getpid()
        self.copiers = Copiers(COPY_THREADS, SLOTS_PER_THREAD, CHUNK, MIN_CHUNK)
        self.inline = _InlineSlots(INLINE_LIMIT, INLINE_BYTES, INLINE_SLOTS)

    def current(self) -> bool:
        return self.generation == _driver.backend_generation() and self.pid == os.getpid()


_resources: _Resources | None = None
_resources_lock = threading.Lock()


def _staging() -> _Resources:
    global _resources
    resources = _resources
    if resources is None or not resources.current():
        with _resources_lock:
            if _resources is not None and not _resources.current():
                _resources.copiers.stop()
                _resources = None
            if _resources is None:
                _resources = _Resources()
            resources = _resources
    return resources


def reset() -> None:
    """Drop the staging resources: copier threads end once their queued copies are done,
    slots are freed when nothing uses them, and the next copy builds new ones from the
    current knob values."""
    global _resources
    with _resources_lock:
        if _resources is not None:
            _resources.copiers.stop()
        _resources = None


async def host_to_device(dst: int, host: npt.NDArray[Any], stream: Stream) -> None:
    """Enqueue the copy of C-contiguous ``host`` to device address ``dst`` on ``stream``.

    Returns once everything is enqueued and ``host`` may be modified again; the DMA may
    still be running (await the stream for that). Pinned sources are held until it ends.
    """
    nbytes = int(host.nbytes)
    if nbytes <= SLICE:
        if not upload_now(dst, host, stream):
            await _upload_elsewhere(dst, host, stream)
        return
    if _copies.upload(dst, host, stream):
        return
    slot = _inline_slot(nbytes, stream)
    if slot is None:
        await _upload_elsewhere(dst, host, stream)
        return
    try:
        # Cancelled between slices: nothing is enqueued, and the slot goes back unused.
        await _host_copy(slot.ptr, host_address(host), nbytes, finish_on_cancel=False)
        stream.device.make_current()  # (a task that ran between the slices may have changed it)
        _enqueue_from(slot, dst, nbytes, stream)
    finally:
        release(slot)


async def _upload_elsewhere(dst: int, host: npt.NDArray[Any], stream: Stream) -> None:
    """An upload that found no inline slot ready: a small one through a block of the
    pinned cache the stream keeps until its DMA is done (through the copier threads, a
    cancelled one waited for slots fenced by busy streams), a larger one staged."""
    nbytes = int(host.nbytes)
    if nbytes > INLINE_LIMIT or stream._capture is not None:
        await upload_staged(dst, host, stream)
        return
    block = await pinned_block(stream.device, nbytes)
    # Cancelled between slices: nothing is enqueued, and the block goes back unused.
    await _host_copy(block.ptr, host_address(host), nbytes, finish_on_cancel=False)
    stream.device.make_current()  # (a task that ran between the slices may have changed it)
    _copies.enqueue_upload(dst, block.ptr, nbytes, stream)
    stream.hold(block)


def upload_now(dst: int, host: npt.NDArray[Any], stream: Stream, keep: list[Any] | None = None) -> bool:
    """:func:`host_to_device` if it needs no wait: ``host`` pinned (kept alive as
    :func:`aiocuda._memory.copies.upload` says, ``keep`` included), or small enough for an
    inline slot and one is ready. True if enqueued; False, with nothing enqueued, for
    :func:`upload_staged`."""
    if _copies.upload(dst, host, stream, keep):
        return True
    nbytes = int(host.nbytes)
    slot = _inline_slot(nbytes, stream)
    if slot is None:
        return False
    try:
        _memmove(slot.ptr, host_address(host), nbytes)
        _enqueue_from(slot, dst, nbytes, stream)
    finally:
        release(slot)
    return True


def _enqueue_from(slot: Slot, dst: int, nbytes: int, stream: Stream) -> None:
    """Enqueue the DMA of an inline slot's first ``nbytes`` to ``dst``; the slot is fenced by it."""
    _copies.enqueue_upload(dst, slot.ptr, nbytes, stream)
    slot.mark(stream.device, stream.handle)


def _inline_slot(nbytes: int, stream: Stream) -> Slot | None:
    """A ready inline slot for a copy of ``nbytes`` on ``stream``, its device made
    current; None when the copy is too large for one, or captured, or none is ready."""
    if stream._capture is not None or nbytes > INLINE_LIMIT:
        return None
    inline = _staging().inline
    if nbytes > inline.limit:
        return None
    device = stream.device
    slot = inline.try_acquire(device, nbytes)
    if slot is not None:
        try:
            device.make_current()
        except BaseException:
            inline.release(slot)
            raise
    return slot


async def upload_staged(dst: int, host: npt.NDArray[Any], stream: Stream) -> None:
    """:func:`host_to_device` of pageable ``host`` through the copier threads (what
    :func:`upload_now` leaves)."""
    if stream._capture is not None:
        raise stream._capture.refuse(
            "a copy of pageable host memory", "it is staged through host threads: copy from aiocuda.pinned_empty memory"
        )
    await _staged(_staging(), True, stream, dst, int(host.ctypes.data), int(host.nbytes), host)


async def device_to_host(host: npt.NDArray[Any], src: int, stream: Stream) -> None:
    """Copy ``host.nbytes`` from device address ``src`` into C-contiguous ``host``,
    after the work already on ``stream``; returns when ``host`` holds the data.

    Cancelled, the copy stops writing into ``host`` before the cancellation takes
    effect: a staged copy completes first, an inline one is abandoned (see the module
    docstring).
    """
    nbytes = int(host.nbytes)
    if nbytes == 0:
        return
    if _copies.download(host, src, stream):
        if stream._capture is None:  # (a captured copy fills ``host`` at each replay)
            await stream.record()
        return
    slot = download_inline(host, src, stream)
    if slot is not None:
        try:
            await stream.record()
            await _host_copy(host_address(host), slot.ptr, nbytes, finish_on_cancel=True)
        finally:
            release(slot)
        return
    if nbytes <= INLINE_LIMIT and stream._capture is None:
        await _download_through_block(host, src, stream)
        return
    await download_staged(host, src, stream)


async def _download_through_block(host: npt.NDArray[Any], src: int, stream: Stream) -> None:
    """A small download that found no inline slot ready (all fenced by copies that
    streams have not reached yet): through a block of the pinned cache, so that it can
    be abandoned at its await as an inline one can. (Through the copier threads, it
    could not: a cancelled request waited for the stream.)"""
    nbytes = int(host.nbytes)
    block = await pinned_block(stream.device, nbytes)
    stream.device.make_current()
    _copies.enqueue_download(block.ptr, src, nbytes, stream)
    try:
        await stream.record()
    except BaseException:
        stream.hold(block)  # (the DMA may still write into it)
        raise
    await _host_copy(host_address(host), block.ptr, nbytes, finish_on_cancel=True)


async def download_staged(host: npt.NDArray[Any], src: int, stream: Stream) -> None:
    """:func:`device_to_host` into pageable ``host`` through the copier threads (what
    :func:`download_inline` leaves)."""
    if stream._capture is not None:
        raise stream._capture.refuse(
            "a copy to pageable host memory", "it is staged through host threads: copy into aiocuda.pinned_empty memory"
        )
    await _staged(_staging(), False, stream, int(host.ctypes.data), src, int(host.nbytes), host)


def download_inline(host: npt.NDArray[Any], src: int, stream: Stream) -> Slot | None:
    """The first half of :func:`device_to_host` of a small pageable ``host``, for a caller
    that awaits the stream itself: the DMA into an inline slot, enqueued. Once the stream
    has passed it, :func:`landed` copies the slot into ``host``; then (or if that never
    comes) :func:`release` gives the slot back. None, with nothing enqueued, when ``host``
    is too large or no slot is ready."""
    nbytes = int(host.nbytes)
    slot = _inline_slot(nbytes, stream)
    if slot is None:
        return None
    try:
        _copies.enqueue_download(slot.ptr, src, nbytes, stream)
        slot.mark(stream.device, stream.handle)
    except BaseException:
        release(slot)
        raise
    return slot


def landed(slot: Slot, host: npt.NDArray[Any]) -> None:
    """Copy what :func:`download_inline` brought into ``slot`` to ``host``, once the DMA
    is done."""
    _memmove(host_address(host), slot.ptr, int(host.nbytes))


async def _host_copy(dst: int, src: int, nbytes: int, *, finish_on_cancel: bool) -> None:
    """``memmove`` of ``nbytes`` in slices of :data:`SLICE`, the loop running its other
    tasks between them. Cancelled between slices, it either copies the rest first
    (``finish_on_cancel``: the destination is never left half written) or stops."""
    done = min(SLICE, nbytes)
    _memmove(dst, src, done)
    if done == nbytes:
        return
    turn = current_adapter().turn
    try:
        while done < nbytes:
            await turn()
            step = min(SLICE, nbytes - done)
            _memmove(dst + done, src + done, step)
            done += step
    except BaseException:
        if finish_on_cancel:
            _memmove(dst + done, src + done, nbytes - done)
        raise


def release(slot: Slot) -> None:
    """Give back a slot of :func:`download_inline` (its DMA may still run: the slot is
    used again only once it is done)."""
    _staging().inline.release(slot)


async def _staged(
    staging: _Resources, to_device: bool, stream: Stream, dst: int, src: int, nbytes: int, host: Any
) -> None:
    job = Job(
        to_device=to_device,
        stream=stream,
        dst=dst,
        src=src,
        nbytes=nbytes,
        keep=host,
    )
    # Submitted from the worker thread: a cancellation that lands before the thread
    # starts must find nothing enqueued (the caller then frees the device memory). Once
    # it runs, it is not abandoned: the copiers must be done with the host array first.
    await anyio.to_thread.run_sync(staging.copiers.run, job)
