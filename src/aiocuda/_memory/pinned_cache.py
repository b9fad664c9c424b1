"""Freed page-locked blocks, kept for reuse instead of given back to the driver.

``cuMemFreeHost`` waits until the device is idle, and while it waits it holds a driver
lock that other threads' calls need: measured on an H100, a ``cuMemcpyHtoDAsync`` on the
event loop's thread stalled for the rest of a 50 ms kernel while another thread freed a
pinned block. Freeing pinned memory while the GPU works therefore stalls the loop
whichever thread frees it. So, like PyTorch's caching host allocator, aiocuda keeps the
blocks of collected pinned arrays and staging slots and hands them to the next
allocation of the same size class; ``cuMemHostAlloc`` (1-40 ms per call) is skipped too.

Blocks come in size classes (powers of two up to 1 MiB, then whole MiB), so a reused
block may be larger than asked. At most :data:`LIMIT` bytes are kept; a block freed
beyond that, and everything :func:`empty` drops, is freed on the off-loop thread
(:mod:`aiocuda._memory.offloop`) -- at the price above if the GPU is busy then.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from .. import _driver
from . import offloop

if TYPE_CHECKING:
    from ..device import Device

__all__ = ["LIMIT", "cached_bytes", "empty", "give", "size_class", "take"]

LIMIT = 2 << 30
"""Bytes of freed pinned blocks kept for reuse, at most."""

_MiB = 1 << 20


def size_class(nbytes: int) -> int:
    """The block size an allocation of ``nbytes`` gets: the next power of two from 4 KiB
    up to 1 MiB, then the next whole MiB."""
    if nbytes <= _MiB:
        return max(4096, 1 << (max(nbytes, 1) - 1).bit_length())
    return -(-nbytes // _MiB) * _MiB


def _world(driver: Any) -> object:
    """What a block's memory belongs to: the process's CUDA driver (whose primary
    contexts, and so pinned blocks, outlive a backend switch), or one simulator (None:
    no backend is in use)."""
    return "cuda" if driver is not None and driver.name == "cuda" else driver


class _Cache:
    def __init__(self) -> None:
        # Re-entrant: give() runs from finalizers, which the garbage collector may call on
        # a thread inside take() or give() already (any allocation can start a collection).
        self.lock = threading.RLock()
        self.blocks: dict[int, list[tuple[Device, int]]] = {}  # size class -> (device, ptr)
        self.bytes = 0
        self.world: object = None

    def take(self, size: int) -> int | None:
        with self.lock:
            self._forget_other_worlds()
            found = self.blocks.get(size)
            if not found:
                return None
            self.bytes -= size
            return found.pop()[1]

    def give(self, device: Device, ptr: int, size: int) -> None:
        with self.lock:
            self._forget_other_worlds()
            if self.bytes + size <= LIMIT and _world(device._driver) is self.world:
                self.blocks.setdefault(size, []).append((device, ptr))
                self.bytes += size
                return
        offloop.dispose(device, device._driver.mem_host_free, ptr)

    def empty(self) -> int:
        with self.lock:
            dropped, self.blocks, freed = self.blocks, {}, self.bytes
            self.bytes = 0
        _free_all(dropped)
        return freed

    def _forget_other_worlds(self) -> None:
        """After a switch to another backend, blocks of the previous one are not handed
        out again (a switch from CUDA to CUDA keeps them: they stay valid). Chooses no
        backend: a block given back after the simulator was closed is freed."""
        world = _world(_driver.current())
        if world is not self.world:
            self.world = world
            stale, self.blocks, self.bytes = self.blocks, {}, 0
            _free_all(stale)


def _free_all(blocks: dict[int, list[tuple[Device, int]]]) -> None:
    for entries in blocks.values():
        for device, ptr in entries:
            offloop.dispose(device, device._driver.mem_host_free, ptr)


_cache = _Cache()


def take(size: int) -> int | None:
    """A cached block of exactly ``size`` bytes (a size class), or None."""
    return _cache.take(size)


def give(device: Device, ptr: int, size: int) -> None:
    """Keep a block that nothing references any more, allocated through ``device`` (or
    free it, if that backend is no longer in use or the cache is full)."""
    _cache.give(device, ptr, size)


def empty() -> int:
    """Free every cached block (on the off-loop thread); returns the bytes freed."""
    return _cache.empty()


def cached_bytes() -> int:
    """Bytes of pinned blocks kept for reuse."""
    return _cache.bytes
