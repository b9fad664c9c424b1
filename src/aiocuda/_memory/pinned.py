"""Page-locked host blocks, and the registry of the address ranges known to be pinned.

:class:`PinnedAllocation` owns one block taken from (and given back to) the cache of
freed blocks (:mod:`.pinned_cache`); :data:`pinned_ranges` maps addresses to the object
that keeps their pinned memory alive, so that copies can tell pinned from pageable.
"""

from __future__ import annotations

import bisect
import ctypes
import threading
import weakref
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import anyio.to_thread
import numpy.typing as npt

from .._completion.reserve import run_off_loop
from .._util import byte_span
from . import pinned_cache

if TYPE_CHECKING:
    from ..device import Device

__all__ = [
    "PinnedAllocation",
    "PinnedRanges",
    "host_address",
    "keep_spare",
    "pinned_address",
    "pinned_block",
    "pinned_ranges",
    "take_cached",
]

_Range = tuple[int, int, "weakref.ref[Any]"]
"""``(start, end, owner)`` of a pinned range."""


class PinnedRanges:
    """Address ranges known to be page-locked, each with the object that owns it."""

    RECENT = 4
    """Ranges found last, looked at before the sorted list."""

    def __init__(self) -> None:
        # Reentrant: the collector may run a pinned array's finaliser (which removes its
        # range) on a thread inside add() or owner(), at an allocation there; a plain
        # lock hung a GPU run so.
        self._lock = threading.RLock()
        self._starts: list[int] = []
        self._entries: dict[int, tuple[int, weakref.ref[Any]]] = {}
        # A pipeline's chunks come from one or two arrays (inputs, outputs): a lookup
        # among the few ranges found last takes a third of the locked bisection's
        # ~0.8 us. Replaced whole (a reader without the lock sees one tuple or the
        # other), emptied by every removal.
        self._recent: tuple[_Range, ...] = ()

    def add(self, start: int, size: int, owner: Any) -> None:
        with self._lock:
            bisect.insort(self._starts, start)
            self._entries[start] = (size, weakref.ref(owner))

    def remove(self, start: int) -> None:
        with self._lock:
            if self._entries.pop(start, None) is not None:
                del self._starts[bisect.bisect_left(self._starts, start)]
                self._recent = ()

    def owner(self, ptr: int, size: int) -> Any:
        """The owner of a pinned range wholly containing ``[ptr, ptr + size)``, or None."""
        end = ptr + size
        for start, stop, ref in self._recent:
            if start <= ptr and end <= stop:
                return ref()
        with self._lock:
            i = bisect.bisect_right(self._starts, ptr) - 1
            if i < 0:
                return None
            start = self._starts[i]
            extent, ref = self._entries[start]
            if end > start + extent:
                return None
            self._recent = ((start, start + extent, ref), *self._recent[: self.RECENT - 1])
            return ref()


pinned_ranges = PinnedRanges()

_from_buffer: Callable[[Any], ctypes.c_char] = ctypes.c_char.from_buffer
_addressof = ctypes.addressof


def host_address(array: npt.NDArray[Any]) -> int:
    """The address of ``array``'s first element."""
    # Through the buffer protocol in 0.3 us, where ``array.ctypes.data`` takes 1.2 us
    # (it makes numpy's ctypes helper object); that protocol gives a writable,
    # C-contiguous, non-empty array only. A read-only array (a request body through
    # np.frombuffer) is not tried: the refusal cost 1.5 us more than the helper.
    if array.flags.writeable:
        try:
            return _addressof(_from_buffer(array))
        except (TypeError, ValueError):
            pass
    return int(array.ctypes.data)


def pinned_address(array: npt.NDArray[Any]) -> int:
    """``array``'s address if it lies in memory known to be page-locked, else 0."""
    ptr = host_address(array)
    if array.flags.c_contiguous:
        return ptr if pinned_ranges.owner(ptr, array.nbytes or 1) is not None else 0
    lo, hi = byte_span(array.shape, array.strides, array.itemsize)  # (a reversed view starts at its top)
    return ptr if pinned_ranges.owner(ptr + lo, max(hi - lo, 1)) is not None else 0


class PinnedAllocation:
    """Owner of one page-locked block; numpy arrays over it keep it alive.

    ``size`` is rounded up to a size class, and the block is taken from (and, once
    collected, given back to) the cache of freed blocks (:mod:`aiocuda._memory.pinned_cache`):
    freeing pinned memory would wait for the GPU.
    """

    __slots__ = ("__weakref__", "ptr", "size")

    def __init__(self, device: Device, size: int, ptr: int | None = None) -> None:
        self.size = pinned_cache.size_class(size)
        if ptr is None:
            ptr = pinned_cache.take(self.size)
        if ptr is None:
            device.make_current()
            ptr = device._driver.mem_host_alloc(self.size)
        self.ptr = ptr
        pinned_ranges.add(ptr, self.size, self)
        weakref.finalize(self, _free_pinned, device, ptr, self.size)

    @classmethod
    def cached(cls, device: Device, size: int) -> PinnedAllocation | None:
        """A block from the cache of freed ones, or None when it holds none of that size
        class: no driver call (allocating one waits for the driver)."""
        ptr = pinned_cache.take(pinned_cache.size_class(size))
        return None if ptr is None else cls(device, size, ptr)


async def pinned_block(device: Device, nbytes: int) -> PinnedAllocation:
    """A block of the pinned cache, made on a worker thread if the cache has none (1-40
    ms: never on the event loop's)."""
    block = PinnedAllocation.cached(device, nbytes)
    if block is None:  # (abandoned if cancelled: the block then goes back to the cache)
        block = await anyio.to_thread.run_sync(PinnedAllocation, device, nbytes, abandon_on_cancel=True)
    return block


def take_cached(device: Device, size: int) -> PinnedAllocation | None:
    """:meth:`PinnedAllocation.cached` for an event loop's thread, where pinning new
    memory would block it: unless the cache still holds a block of that size class
    afterwards, one is pinned off the loop for the next call (:func:`keep_spare`)."""
    block = PinnedAllocation.cached(device, size)
    if block is None or not pinned_cache.holds(block.size):
        keep_spare(device, size)
    return block


def keep_spare(device: Device, size: int) -> None:
    """Have a block of ``size``'s class ready in the cache for the next allocation of that
    class: unless the cache holds one, the reserve thread pins one (off the event loop:
    it takes 1-40 ms) and files it there."""
    size = pinned_cache.size_class(size)
    run_off_loop(partial(_pin_spare, device, size), key=("pinned spare", size))


def _pin_spare(device: Device, size: int) -> None:
    # (not one the full cache would free at once: pinning it, then freeing it, which
    # waits for the GPU under a lock the loop's driver calls need, would stall for nothing)
    if not pinned_cache.holds(size) and pinned_cache.has_room(size):
        PinnedAllocation(device, size)  # dropped at once: its finaliser files the block in the cache


def _free_pinned(device: Device, ptr: int, size: int) -> None:
    pinned_ranges.remove(ptr)
    pinned_cache.give(device, ptr, size)
