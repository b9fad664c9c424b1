"""Copier threads: the host half of large staged copies between pageable memory and GPUs.

The DMA engines reach their full rate only from page-locked memory, and one CPU thread
copying pageable memory reaches a fraction of it. So a large copy is cut into chunks
(a :class:`Job`), and every copier thread runs its own pipeline over its own pinned
slots, taking chunks in turn:

* host -> device: wait until the slot's previous DMA has completed, ``memmove`` the
  chunk into it, enqueue the chunk's DMA, record the slot's fence. While this thread
  copies its next chunk into its other slot, the DMA reads the first.
* device -> host: wait for the slot, enqueue the chunk's DMA into it and record the
  fence; before the slot is reused (or when nothing else is left to do) wait for that
  fence and ``memmove`` the chunk out.

Each thread works whole chunks, so a chunk costs no fan-out and join between threads,
and ``memmove`` of a large chunk runs at the rate of its non-temporal stores. Chunks
shrink towards the end of a copy (guided self-scheduling: a thread takes
``remaining / threads`` bytes, between ``min_chunk`` and the slot size), so that the
threads finish together and the DMAs left after the last host copy -- the tail nothing
overlaps -- are small. The DMAs of one copy are enqueued by several threads, in whatever
order they finish copying; they touch disjoint ranges, and all of them are enqueued
before the job is done, so work enqueued on the stream afterwards sees all the data.

Invariants:

* A slot is reused only after the DMA that last touched it has completed (its fence).
* A chunk's host copy into a slot finishes before its DMA is enqueued.
* A job is done only once no copier thread touches its host memory any more, including
  after a failure: a failed job hands out no new chunk, and waits for the chunks in hand.
* Slots are shared by every device, stream and event loop: a fence is an event of the
  device whose stream last used the slot (one event per slot and device).

``memmove`` (ctypes) and the driver calls release the GIL, so the threads copy in
parallel; only a few microseconds of Python per chunk hold it.
"""

from __future__ import annotations

import ctypes
import threading
from collections import deque
from typing import Any

from ..device import Device
from . import copies
from .pinned import PinnedAllocation

__all__ = ["Copiers", "Job", "Slot"]

_memmove = ctypes.memmove

_ALIGN = 64 * 1024
"""Chunk boundaries: whole pages, for ``memmove`` and the DMA engines alike."""


class Slot:
    """A pinned buffer and the fence of the last DMA that touched it."""

    __slots__ = ("events", "fence", "owner", "pending", "ptr")

    def __init__(self, device: Device, size: int) -> None:
        self.owner = PinnedAllocation(device, size)
        self.ptr: int = self.owner.ptr
        self.events: dict[int, Any] = {}
        self.fence: tuple[Any, Any] | None = None  # (driver, event handle)
        self.pending: tuple[Job, int, int] | None = None
        """A device -> host chunk whose DMA into this slot was enqueued, not yet copied out."""

    def mark(self, device: Device, stream_handle: Any) -> None:
        """Record that a DMA just enqueued on ``stream_handle`` (a stream of ``device``,
        whose context is current) touches this slot."""
        driver = device._driver
        event = self.events.get(device.ordinal)
        if event is None:
            # Blocking sync: a copier thread waiting for a DMA sleeps instead of spinning
            # on a core the other copiers' memmoves need.
            event = self.events[device.ordinal] = driver.event_create(False, True)
        driver.event_record(event, stream_handle)
        self.fence = (driver, event)

    def ready(self) -> bool:
        fence = self.fence
        return fence is None or bool(fence[0].event_query(fence[1]))

    def wait_idle(self) -> None:
        """Block this thread until the slot's last DMA has completed."""
        fence = self.fence
        if fence is not None and not fence[0].event_query(fence[1]):
            fence[0].event_synchronize(fence[1])


class Job:
    """One staged copy, cut into chunks for the copier threads.

    ``to_device``: ``src`` is a host address and ``dst`` an address in ``device``'s
    memory, copied on the stream ``stream_handle``; otherwise the reverse. ``keep`` (the
    host array) is held until the job is done. :meth:`wait` blocks until then and raises
    the first error a chunk met.
    """

    __slots__ = (
        "device",
        "dst",
        "error",
        "finished",
        "in_hand",
        "keep",
        "nbytes",
        "next_offset",
        "src",
        "stream_handle",
        "to_device",
    )

    def __init__(
        self,
        *,
        to_device: bool,
        device: Device,
        stream_handle: Any,
        dst: int,
        src: int,
        nbytes: int,
        keep: Any,
    ) -> None:
        self.to_device = to_device
        self.device = device
        self.stream_handle = stream_handle
        self.dst = dst
        self.src = src
        self.nbytes = nbytes
        self.keep = keep
        self.next_offset = 0
        self.in_hand = 0
        """Chunks handed out and not finished; the job is done when none is, and none is left."""
        self.error: BaseException | None = None
        self.finished = threading.Event()

    def wait(self) -> None:
        """Block until no copier touches the job's memory any more; raise its error."""
        self.finished.wait()
        self.keep = None
        if self.error is not None:
            raise self.error


class Copiers:
    """A set of copier threads with their slots, fed from one queue of jobs.

    Threads start on the first job; each creates its ``slots_per_thread`` slots of
    ``slot_size`` bytes as it first needs them. Chunks are at least ``min_chunk`` bytes
    (but the last). :meth:`stop` lets the threads finish the jobs queued so far, then
    end (their slots are freed when collected).
    """

    def __init__(self, threads: int, slots_per_thread: int, slot_size: int, min_chunk: int) -> None:
        if threads < 1 or slots_per_thread < 1 or slot_size < 1 or min_chunk < 1:
            raise ValueError(
                f"bad copier configuration: {threads} threads x {slots_per_thread} slots of {slot_size} bytes, "
                f"chunks of at least {min_chunk}"
            )
        self.threads = threads
        self.slots_per_thread = slots_per_thread
        self.slot_size = slot_size
        self.min_chunk = min(min_chunk, slot_size)
        self._jobs: deque[Job] = deque()
        self._cond = threading.Condition()
        self._started = False
        self._stopping = False

    def submit(self, job: Job) -> None:
        """Queue ``job``; the copier threads start on it at once."""
        with self._cond:
            if self._stopping:
                raise RuntimeError("these copiers were stopped")
            self._jobs.append(job)
            if not self._started:
                self._started = True
                for i in range(self.threads):
                    threading.Thread(target=self._run, name=f"aiocuda-copier-{i}", daemon=True).start()
            self._cond.notify_all()

    def run(self, job: Job) -> None:
        """:meth:`submit` ``job`` and :meth:`Job.wait` for it (blocking)."""
        self.submit(job)
        job.wait()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    # -- the copier threads -------------------------------------------------------------------
    def _take(self, block: bool) -> tuple[Job, int, int] | None:
        """The next chunk ``(job, offset, size)``; None when there is none (and ``block``
        is false, or the copiers are stopping)."""
        with self._cond:
            while True:
                jobs = self._jobs
                while jobs and jobs[0].next_offset >= jobs[0].nbytes:
                    jobs.popleft()
                if jobs:
                    job = jobs[0]
                    offset = job.next_offset
                    left = job.nbytes - offset
                    share = -(-left // self.threads)
                    share += -share % _ALIGN
                    size = min(left, self.slot_size, max(self.min_chunk, share))
                    job.next_offset = offset + size
                    job.in_hand += 1
                    return job, offset, size
                if not block or self._stopping:
                    return None
                self._cond.wait()

    def _finish(self, job: Job, error: BaseException | None = None) -> None:
        """One chunk of ``job`` is over (``error``: it failed)."""
        with self._cond:
            if error is not None and job.error is None:
                job.error = error
                job.next_offset = job.nbytes  # hand out no more chunks
            job.in_hand -= 1
            if job.in_hand == 0 and job.next_offset >= job.nbytes:
                job.finished.set()

    def _run(self) -> None:
        slots: list[Slot] = []
        can_grow = True
        pending: deque[Slot] = deque()  # device -> host chunks in flight, oldest first
        turn = 0
        while True:
            work = self._take(block=not pending)
            if work is None:
                if not pending:
                    return  # stopping, and nothing left
                self._copy_out(pending.popleft())  # nothing new: complete the oldest
                continue
            job, offset, size = work
            if can_grow and len(slots) < self.slots_per_thread:
                # Created when first needed: pinning costs milliseconds, and a small job
                # may never reach this thread's second slot.
                try:
                    job.device.make_current()
                    slots.append(Slot(job.device, self.slot_size))
                except BaseException as exc:
                    if not slots:  # fail this job; the next one tries again
                        self._finish(job, exc)
                        continue
                    can_grow = False  # work with the slots there are
            slot = slots[turn % len(slots)]
            turn += 1
            if slot.pending is not None:
                pending.remove(slot)
                self._copy_out(slot)
            try:
                job.device.make_current()
                slot.wait_idle()
                if job.to_device:
                    _memmove(slot.ptr, job.src + offset, size)
                    copies.dma_to_device(job.device, job.dst + offset, slot.ptr, size, job.stream_handle)
                    slot.mark(job.device, job.stream_handle)
                else:
                    copies.dma_to_host(job.device, slot.ptr, job.src + offset, size, job.stream_handle)
                    slot.mark(job.device, job.stream_handle)
                    slot.pending = (job, offset, size)
                    pending.append(slot)
                    continue
            except BaseException as exc:
                self._finish(job, exc)
                continue
            self._finish(job)

    def _copy_out(self, slot: Slot) -> None:
        """Complete a device -> host chunk: wait for its DMA, copy it to the host."""
        job, offset, size = slot.pending  # type: ignore[misc]
        slot.pending = None
        try:
            if job.error is None:  # a failed job's host memory is not written any more
                slot.wait_idle()
                _memmove(job.dst + offset, slot.ptr, size)
        except BaseException as exc:
            self._finish(job, exc)
            return
        self._finish(job)
