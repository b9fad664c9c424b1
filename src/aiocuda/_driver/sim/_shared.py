"""Memory the simulated driver shares between processes: IPC pools and interprocess events.

A simulated process is one ``SimDriver``; two processes share nothing but what the
operating system shares. So:

* An IPC pool's blocks are carved from a :class:`SharedRegion`: a ``memfd`` mapped
  shared. Exporting the pool hands out a duplicate of that file descriptor; importing
  maps it again (in another process, or in the same one at a second address), so writes
  through one mapping are seen through every other, as device memory is seen by every
  process that imported it. The region's first bytes hold a random tag that exported
  pointers carry, so a pointer imported into the wrong pool is refused.
* An interprocess event owns a slot of :class:`EventSlots`: two counters in a shared
  ``memfd`` -- the generation last recorded, and the generation the stream has reached.
  Its handle names the slot by ``/proc/<pid>/fd/<fd>`` of the exporting process, so the
  memory goes away with that process. An opened event reads the counters: complete once
  the reached generation catches up with the recorded one.

Nothing here waits: a stream waiting for an opened event looks at the counters again
every ``_objects.REMOTE_POLL`` seconds (``_objects.RemotePoint``), and host waits poll too.
"""

from __future__ import annotations

import mmap
import os
import secrets
import struct
import threading
import weakref
from typing import Any

import numpy as np

__all__ = ["SLOTS", "EventSlot", "EventSlots", "SharedRegion", "open_event_slot"]

_ALIGN = 256
_TAG_BYTES = 16
_HEADER = 256  # the tag, then nothing: blocks start at an aligned offset
_REGION_MAGIC = b"aiocuda-sim-pool"
_POINTER = struct.Struct("<16s16sQQ")  # magic, region tag, offset, size (of 64 bytes)
_EVENT_MAGIC = b"aiocuda-sim-evt\0"
_EVENT_HANDLE = struct.Struct("<16s16sQQQ")  # magic, slots tag, pid, fd, slot
SLOTS = 1024
"""Interprocess events one process may have at once in the simulator."""


def _memfd(name: str, size: int) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


class SharedRegion:
    """The memory of one simulated IPC pool (see the module docstring): blocks carved at
    aligned offsets, freed ranges reused for blocks of the same rounded size.

    Its descriptor is closed once it is collected (its pool destroyed and let go); the
    mapping goes once the blocks carved from it, views of it, are gone too."""

    def __init__(self, fd: int, *, owner: bool) -> None:
        self.fd = fd
        weakref.finalize(self, os.close, fd)
        self.size = os.fstat(fd).st_size
        self._map = mmap.mmap(fd, self.size)
        self.bytes = np.frombuffer(self._map, np.uint8)
        self.base = int(self.bytes.ctypes.data)
        if owner:
            self.bytes[:_TAG_BYTES] = np.frombuffer(secrets.token_bytes(_TAG_BYTES), np.uint8)
        self.tag = bytes(self.bytes[:_TAG_BYTES])
        self._top = _HEADER
        self._free: dict[int, list[int]] = {}
        self._lock = threading.Lock()

    @classmethod
    def create(cls, size: int) -> SharedRegion:
        return cls(_memfd("aiocuda-sim-ipc-pool", _HEADER + size), owner=True)

    @classmethod
    def open(cls, fd: int) -> SharedRegion:
        """Map another process's region from a file descriptor (the caller's: the region
        has its own duplicate)."""
        return cls(os.dup(fd), owner=False)

    def carve(self, size: int) -> np.ndarray | None:
        """A block of ``size`` bytes, or None when the region is full."""
        rounded = -(-size // _ALIGN) * _ALIGN
        with self._lock:
            reusable = self._free.get(rounded)
            if reusable:
                offset = reusable.pop()
            elif self._top + rounded <= self.size:
                offset, self._top = self._top, self._top + rounded
            else:
                return None
        block = self.bytes[offset : offset + size]
        block[:] = 0
        return block

    def release(self, block: np.ndarray) -> None:
        """Give a carved block's range back for reuse."""
        rounded = -(-len(block) // _ALIGN) * _ALIGN
        with self._lock:
            self._free.setdefault(rounded, []).append(int(block.ctypes.data) - self.base)

    def pointer_data(self, ptr: int, size: int) -> bytes:
        """The 64 bytes that name the block at ``ptr`` to an importer of this region."""
        return _POINTER.pack(_REGION_MAGIC, self.tag, ptr - self.base, size).ljust(64, b"\0")

    def locate(self, data: bytes) -> tuple[int, int] | None:
        """``(address, size)`` in this mapping of the block ``data`` names, or None when
        ``data`` names no block of this region."""
        if len(data) < _POINTER.size:
            return None
        magic, tag, offset, size = _POINTER.unpack_from(data)
        if magic != _REGION_MAGIC or tag != self.tag or offset < _HEADER or offset + size > self.size:
            return None
        return self.base + offset, size


class EventSlot:
    """The two shared counters of one interprocess event (see the module docstring)."""

    __slots__ = ("_words", "given_back", "index", "slots")

    def __init__(self, slots: EventSlots | _OpenedSlots, index: int) -> None:
        self.slots = slots
        self.index = index
        self._words = slots.words[2 * index : 2 * index + 2]
        self.given_back = False

    @property
    def recorded(self) -> int:
        return int(self._words[0])

    def completed(self) -> int:
        return int(self._words[1])

    def record(self) -> int:
        """A new generation, recorded now; the caller enqueues :meth:`reach` for it."""
        generation = int(self._words[0]) + 1
        self._words[0] = generation
        return generation

    def reach(self, generation: int) -> None:
        self._words[1] = generation

    def done(self) -> bool:
        return int(self._words[1]) >= int(self._words[0])

    def reset(self) -> None:
        self._words[:] = 0


class EventSlots:
    """This process's interprocess event counters: one shared ``memfd`` of
    :data:`SLOTS` slots, handed out and taken back."""

    def __init__(self) -> None:
        self.fd = _memfd("aiocuda-sim-ipc-events", _TAG_BYTES + 16 * SLOTS)
        self._map = mmap.mmap(self.fd, _TAG_BYTES + 16 * SLOTS)
        raw = np.frombuffer(self._map, np.uint8)
        raw[:_TAG_BYTES] = np.frombuffer(secrets.token_bytes(_TAG_BYTES), np.uint8)
        self.tag = bytes(raw[:_TAG_BYTES])
        self.words = raw[_TAG_BYTES:].view(np.uint64)
        self._free = list(range(SLOTS - 1, -1, -1))
        self._lock = threading.Lock()

    def take(self) -> EventSlot | None:
        with self._lock:
            if not self._free:
                return None
            slot = EventSlot(self, self._free.pop())
        slot.reset()
        return slot

    def give_back(self, slot: EventSlot) -> None:
        """Take ``slot`` back (once: the destroy of its event and the completion of the
        event's pending record may both give it back)."""
        with self._lock:
            if not slot.given_back:
                slot.given_back = True
                self._free.append(slot.index)

    def handle(self, slot: EventSlot) -> bytes:
        return _EVENT_HANDLE.pack(_EVENT_MAGIC, self.tag, os.getpid(), self.fd, slot.index).ljust(64, b"\0")


class _OpenedSlots:
    """Another process's (or this one's) event counters, mapped from a handle."""

    def __init__(self, words: np.ndarray, keep: Any) -> None:
        self.words = words
        self._keep = keep


def open_event_slot(handle: bytes) -> EventSlot | None:
    """The counters an interprocess event handle names, or None if it names none (a
    process that has ended, a handle of another kind)."""
    if len(handle) < _EVENT_HANDLE.size:
        return None
    magic, tag, pid, fd, index = _EVENT_HANDLE.unpack_from(handle)
    if magic != _EVENT_MAGIC or index >= SLOTS:
        return None
    try:
        own = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        mapping = mmap.mmap(own, _TAG_BYTES + 16 * SLOTS)
    except (OSError, ValueError):
        return None
    finally:
        os.close(own)
    raw = np.frombuffer(mapping, np.uint8)
    if bytes(raw[:_TAG_BYTES]) != tag:
        return None
    return EventSlot(_OpenedSlots(raw[_TAG_BYTES:].view(np.uint64), mapping), index)
