"""Copier threads: the host half of large staged copies between pageable memory and GPUs.

The DMA engines reach their full rate only from page-locked memory, and one CPU thread
copying pageable memory reaches a fraction of it. So a large copy is cut into chunks
(a :class:`Job`), and every copier thread runs its own pipeline over its own pinned
slots, taking chunks in turn:

* host -> device: take a chunk into a slot whose last DMA has completed, ``memmove``
  the chunk into it, enqueue the chunk's DMA, record the slot's fence. While this
  thread copies its next chunk into its other slot, the DMA reads the first.
* device -> host: take a chunk into a free slot, enqueue the chunk's DMA into it and
  record the fence; once that fence has passed, ``memmove`` the chunk out.

A thread never waits for one stream while work of another is ready: it copies out
whichever download has finished first, takes a new chunk only into a slot that is
free, and when it has nothing to do but wait, it sleeps until the first of its DMAs
completes or a new job arrives (a doorbell of its own, rung by the GPU through a
per-slot signal stream and by :meth:`Copiers.submit`). When every slot waits on the
same stream, their DMAs complete in order and the thread simply waits for the oldest.

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
* A thread's doorbell outlives every ring it armed: a thread that ends first waits for
  its slots' DMAs and signal streams.

``memmove`` (ctypes) and the driver calls release the GIL, so the threads copy in
parallel; only a few microseconds of Python per chunk hold it.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any

from .._driver import Doorbell
from ..device import Device
from ..errors import CudaError
from . import copies, offloop
from .pinned import PinnedAllocation

if TYPE_CHECKING:
    from ..stream import Stream

__all__ = ["Copiers", "Job", "Slot"]

_memmove = ctypes.memmove

_ALIGN = 64 * 1024
"""Chunk boundaries: whole pages, for ``memmove`` and the DMA engines alike."""

_POLL = 0.01
"""Longest sleep of a thread waiting for a DMA (seconds): its doorbell is never rung
once the device's context has failed, and the fence query then reports the failure."""

_IDLE = 60.0
"""Longest sleep of a thread with nothing in flight; a new job or :meth:`Copiers.stop`
rings it at once."""


class Slot:
    """A pinned buffer and the fence of the last DMA that touched it."""

    __slots__ = ("__weakref__", "_armed", "_signals", "events", "fence", "owner", "pending", "ptr", "seq")

    def __init__(self, device: Device, size: int) -> None:
        self.owner = PinnedAllocation(device, size)
        self.ptr: int = self.owner.ptr
        self.events: dict[Device, Any] = {}
        """The fence event of each device whose stream used the slot."""
        self.fence: tuple[Device, Any, Any] | None = None
        """(device, event, stream handle) of the last DMA that touched the slot."""
        self.seq = 0
        """Counts the DMAs marked: among slots fenced by one stream, the lowest completes first."""
        self.pending: tuple[Job, int, int] | None = None
        """A device -> host chunk whose DMA into this slot was enqueued, not yet copied out."""
        self._signals: dict[Device, Any] = {}
        """Per device, a stream that rings a copier's doorbell once the fence has passed."""
        self._armed = False
        """Whether a ring is enqueued for the current fence."""
        weakref.finalize(self, _destroy_slot_objects, self.events, self._signals)

    @property
    def size(self) -> int:
        """The slot's bytes (a size class of the pinned cache)."""
        return self.owner.size

    def fence_event(self, device: Device) -> Any:
        """The slot's fence event on ``device`` (whose context is current), made on first use."""
        event = self.events.get(device)
        if event is None:
            # Blocking sync: a copier thread waiting for a DMA sleeps instead of spinning
            # on a core the other copiers' memmoves need.
            event = self.events[device] = device._driver.event_create(False, True)
        return event

    def mark(self, device: Device, stream_handle: Any) -> None:
        """Record that a DMA just enqueued on ``stream_handle`` (a stream of ``device``,
        whose context is current) touches this slot."""
        event = self.fence_event(device)
        device._driver.event_record(event, stream_handle)
        self.fence = (device, event, stream_handle)
        self.seq += 1
        self._armed = False

    def ready(self) -> bool:
        """Whether the slot's last DMA has completed (raises the device's CudaError)."""
        fence = self.fence
        return fence is None or bool(fence[0]._driver.event_query(fence[1]))

    def wait_idle(self) -> None:
        """Block this thread until the slot's last DMA has completed."""
        fence = self.fence
        if fence is not None and not fence[0]._driver.event_query(fence[1]):
            fence[0]._driver.event_synchronize(fence[1])

    def arm(self, bell: Doorbell) -> None:
        """Have ``bell`` rung once the slot's last DMA has completed (once per fence)."""
        fence = self.fence
        if fence is None or self._armed:
            return
        device, event, _ = fence
        driver = device._driver
        device.make_current()
        signal = self._signals.get(device)
        if signal is None:
            signal = self._signals[device] = driver.stream_create(True, 0)
        driver.stream_wait_event(signal, event)
        driver.launch_doorbell(signal, bell)
        self._armed = True

    def settle(self) -> None:
        """Block until the slot's DMA and any ring armed for it are over; errors of a
        failed device are ignored (its work never runs again)."""
        with contextlib.suppress(CudaError):
            self.wait_idle()
        for device, signal in self._signals.items():
            with contextlib.suppress(CudaError):
                device.make_current()
                device._driver.stream_synchronize(signal)


def _destroy_slot_objects(events: dict[Device, Any], signals: dict[Device, Any]) -> None:
    """A collected slot's events and signal streams, destroyed off the loop."""
    if events or signals:
        offloop.submit(_destroy_now, list(events.items()), list(signals.items()))


def _destroy_now(events: list[tuple[Device, Any]], signals: list[tuple[Device, Any]]) -> None:
    for device, event in events:
        with contextlib.suppress(CudaError):
            device.make_current()
            device._driver.event_destroy(event)
    for device, signal in signals:
        with contextlib.suppress(CudaError):
            device.make_current()
            device._driver.stream_destroy(signal)


class Job:
    """One staged copy, cut into chunks for the copier threads.

    ``to_device``: ``src`` is a host address and ``dst`` an address in the memory of
    ``stream``'s device, copied on ``stream``; otherwise the reverse. ``keep`` (the host
    array) is held until the job is done. :meth:`wait` blocks until then and raises the
    first error a chunk met.
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
        "stream",
        "stream_handle",
        "to_device",
    )

    def __init__(self, *, to_device: bool, stream: Stream, dst: int, src: int, nbytes: int, keep: Any) -> None:
        self.to_device = to_device
        self.stream = stream
        self.device: Device = stream.device
        self.stream_handle: Any = stream.handle
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
        self._lock = threading.Lock()
        self._bells: list[Doorbell] = []
        """Each thread's doorbell: rung for a new job, and by the GPU for armed fences."""
        self._stopping = False

    def submit(self, job: Job) -> None:
        """Queue ``job``; the copier threads start on it at once."""
        with self._lock:
            if self._stopping:
                raise RuntimeError("these copiers were stopped")
            self._jobs.append(job)
            if not self._bells:
                for i in range(self.threads):
                    bell = job.device._driver.new_doorbell()
                    self._bells.append(bell)
                    threading.Thread(target=self._run, args=(bell,), name=f"aiocuda-copier-{i}", daemon=True).start()
        self._ring_all()

    def run(self, job: Job) -> None:
        """:meth:`submit` ``job`` and :meth:`Job.wait` for it (blocking)."""
        self.submit(job)
        job.wait()

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
        self._ring_all()

    def _ring_all(self) -> None:
        for bell in self._bells:
            bell.ring()

    # -- the copier threads -------------------------------------------------------------------
    def _take(self) -> tuple[Job, int, int] | None:
        """The next chunk ``(job, offset, size)``, or None when there is none."""
        with self._lock:
            jobs = self._jobs
            while jobs and jobs[0].next_offset >= jobs[0].nbytes:
                jobs.popleft()
            if not jobs:
                return None
            job = jobs[0]
            offset = job.next_offset
            left = job.nbytes - offset
            share = -(-left // self.threads)
            share += -share % _ALIGN
            size = min(left, self.slot_size, max(self.min_chunk, share))
            job.next_offset = offset + size
            job.in_hand += 1
            return job, offset, size

    def _finish(self, job: Job, error: BaseException | None = None) -> None:
        """One chunk of ``job`` is over (``error``: it failed)."""
        with self._lock:
            if error is not None and job.error is None:
                job.error = error
                job.next_offset = job.nbytes  # hand out no more chunks
            job.in_hand -= 1
            if job.in_hand == 0 and job.next_offset >= job.nbytes:
                job.finished.set()

    def _run(self, bell: Doorbell) -> None:
        slots: list[Slot] = []
        can_grow = True
        while True:
            self._copy_out_finished(slots)
            slot = self._free_slot(slots)
            if slot is None and not (can_grow and len(slots) < self.slots_per_thread):
                self._wait_for_a_slot(slots, bell)
                continue
            work = self._take()
            if work is None:
                pending = [s for s in slots if s.pending is not None]
                if pending:
                    self._wait_for_first(pending, bell)
                elif self._stopping:
                    for s in slots:
                        s.settle()  # their memory goes back to the pinned cache when collected
                    return
                else:
                    bell.wait(_IDLE)
                continue
            job, offset, size = work
            if slot is None:
                # Created when first needed: pinning costs milliseconds, and a small job
                # may never reach this thread's second slot.
                try:
                    job.device.make_current()
                    slot = Slot(job.device, self.slot_size)
                    slots.append(slot)
                except BaseException as exc:
                    if not slots:  # fail this job; the next one tries again
                        self._finish(job, exc)
                        continue
                    can_grow = False  # work with the slots there are
                    slot = self._wait_for_free_slot(slots, bell)
            try:
                job.device.make_current()
                if job.to_device:
                    _memmove(slot.ptr, job.src + offset, size)
                    copies.enqueue_upload(job.dst + offset, slot.ptr, size, job.stream)
                    slot.mark(job.device, job.stream_handle)
                else:
                    copies.enqueue_download(slot.ptr, job.src + offset, size, job.stream)
                    slot.mark(job.device, job.stream_handle)
                    slot.pending = (job, offset, size)
                    continue
            except BaseException as exc:
                self._finish(job, exc)
                continue
            self._finish(job)

    @staticmethod
    def _free_slot(slots: list[Slot]) -> Slot | None:
        """A slot with no download to copy out whose last DMA has completed."""
        for slot in slots:
            if slot.pending is None:
                try:
                    if slot.ready():
                        return slot
                except CudaError:
                    slot.fence = None  # its device failed: no DMA of it touches the slot again
                    return slot
        return None

    def _wait_for_free_slot(self, slots: list[Slot], bell: Doorbell) -> Slot:
        """A free slot, once there is one (for a chunk already taken)."""
        while True:
            self._copy_out_finished(slots)
            slot = self._free_slot(slots)
            if slot is not None:
                return slot
            self._wait_for_a_slot(slots, bell)

    def _copy_out_finished(self, slots: list[Slot]) -> None:
        """Complete every download whose DMA has finished, whatever order they began in."""
        for slot in slots:
            if slot.pending is None:
                continue
            try:
                done = slot.ready()
            except CudaError as exc:
                slot.fence = None  # its device failed: the DMA will never write the slot
                job = slot.pending[0]
                slot.pending = None
                self._finish(job, exc)
                continue
            if done:
                self._copy_out(slot)

    def _copy_out(self, slot: Slot) -> None:
        """Complete a device -> host chunk whose DMA is done: copy it to the host."""
        job, offset, size = slot.pending  # type: ignore[misc]
        slot.pending = None
        try:
            if job.error is None:  # a failed job's host memory is not written any more
                _memmove(job.dst + offset, slot.ptr, size)
        except BaseException as exc:
            self._finish(job, exc)
            return
        self._finish(job)

    def _wait_for_a_slot(self, slots: list[Slot], bell: Doorbell) -> None:
        """Every slot waits for a DMA: sleep until one of them has completed."""
        fenced = [slot for slot in slots if slot.fence is not None]
        if not fenced:
            return
        device, _, stream = fenced[0].fence  # type: ignore[misc]
        if all(slot.fence[0] is device and slot.fence[2] is stream for slot in fenced):  # type: ignore[index]
            # One stream: its DMAs complete in order, so the oldest is the first.
            with contextlib.suppress(CudaError):  # reported by the next fence query
                min(fenced, key=lambda slot: slot.seq).wait_idle()
            return
        self._wait_for_first(fenced, bell)

    @staticmethod
    def _wait_for_first(slots: list[Slot], bell: Doorbell) -> None:
        """Sleep until the first of ``slots``' DMAs completes or a new job arrives."""
        for slot in slots:
            with contextlib.suppress(CudaError):  # a failed device: the fence query reports it
                slot.arm(bell)
        bell.wait(_POLL)
