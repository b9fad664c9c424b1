"""Page-locked host blocks, and the registry of the address ranges known to be pinned.

:class:`PinnedAllocation` owns one block taken from (and given back to) the cache of
freed blocks (:mod:`.pinned_cache`); :data:`pinned_ranges` maps addresses to the object
that keeps their pinned memory alive, so that copies can tell pinned from pageable.
"""

from __future__ import annotations

import bisect
import threading
import weakref
from typing import TYPE_CHECKING, Any

from . import pinned_cache

if TYPE_CHECKING:
    from ..device import Device

__all__ = ["PinnedAllocation", "PinnedRanges", "pinned_ranges"]


class PinnedRanges:
    """Address ranges known to be page-locked, each with the object that owns it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._entries: dict[int, tuple[int, weakref.ref[Any]]] = {}

    def add(self, start: int, size: int, owner: Any) -> None:
        with self._lock:
            bisect.insort(self._starts, start)
            self._entries[start] = (size, weakref.ref(owner))

    def remove(self, start: int) -> None:
        with self._lock:
            if self._entries.pop(start, None) is not None:
                del self._starts[bisect.bisect_left(self._starts, start)]

    def owner(self, ptr: int, size: int) -> Any:
        """The owner of a pinned range wholly containing ``[ptr, ptr + size)``, or None."""
        with self._lock:
            i = bisect.bisect_right(self._starts, ptr) - 1
            if i < 0:
                return None
            start = self._starts[i]
            extent, ref = self._entries[start]
            if ptr + size <= start + extent:
                return ref()
            return None


pinned_ranges = PinnedRanges()


class PinnedAllocation:
    """Owner of one page-locked block; numpy arrays over it keep it alive.

    ``size`` is rounded up to a size class, and the block is taken from (and, once
    collected, given back to) the cache of freed blocks (:mod:`aiocuda._memory.pinned_cache`):
    freeing pinned memory would wait for the GPU.
    """

    __slots__ = ("__weakref__", "ptr", "size")

    def __init__(self, device: Device, size: int) -> None:
        self.size = pinned_cache.size_class(size)
        ptr = pinned_cache.take(self.size)
        if ptr is None:
            device.make_current()
            ptr = device._driver.mem_host_alloc(self.size)
        self.ptr = ptr
        pinned_ranges.add(ptr, self.size, self)
        weakref.finalize(self, _free_pinned, device, ptr, self.size)


def _free_pinned(device: Device, ptr: int, size: int) -> None:
    pinned_ranges.remove(ptr)
    pinned_cache.give(device, ptr, size)
