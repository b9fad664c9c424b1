"""Freed page-locked blocks, kept for reuse instead of given back to the driver.

Freeing pinned memory waits until the device is idle, holding a driver lock that other
threads' calls need meanwhile, so it would stall an event loop whichever thread frees.
So, like PyTorch's caching host allocator, aiocuda keeps the blocks of collected pinned
arrays and staging slots and hands them to the next allocation of the same size class;
the next allocation also skips pinning new memory.

Blocks come in size classes (powers of two up to 1 MiB, then whole MiB), so a reused
block may be larger than asked. At most :data:`LIMIT` bytes are kept; a block freed
beyond that, and everything :func:`empty` drops, is freed on the off-loop thread
(:mod:`aiocuda._memory.offloop`) -- at the price above if the GPU is busy then.
"""

# Measured on an H100: a cuMemcpyHtoDAsync on the event loop's thread stalled for the
# rest of a 50 ms kernel while another thread freed a pinned block (cuMemFreeHost);
# cuMemHostAlloc takes 1-40 ms per call.

from __future__ import annotations

import os
import threading
from collections import deque
from typing import TYPE_CHECKING, Any

from .. import _driver
from . import offloop

if TYPE_CHECKING:
    from ..device import Device

__all__ = ["LIMIT", "cached_bytes", "empty", "give", "has_room", "holds", "size_class", "take"]

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
    # give() runs in finalisers, which the garbage collector may start on a thread that
    # already holds the lock (inside take(), say): it only queues the block, and whoever
    # holds the lock next files the queue. A blocking acquire there deadlocked.
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.blocks: dict[int, list[tuple[Device, int]]] = {}  # size class -> (device, ptr)
        self.bytes = 0
        self.world: object = None
        self.returned: deque[tuple[Device, int, int]] = deque()
        """Blocks given back and not yet filed: (device, ptr, size)."""

    def take(self, size: int) -> int | None:
        with self.lock:
            overflow = self._file_returned()
            found = self.blocks.get(size)
            ptr = None
            if found:
                self.bytes -= size
                ptr = found.pop()[1]
        _free_blocks(overflow)
        return ptr

    def give(self, device: Device, ptr: int, size: int) -> None:
        self.returned.append((device, ptr, size))
        self.file()

    def file(self) -> None:
        """File the blocks given back, unless this or another thread holds the lock (the
        holder files them, or the next caller does)."""
        if not self.lock.acquire(blocking=False):
            return
        try:
            overflow = self._file_returned()
        finally:
            self.lock.release()
        _free_blocks(overflow)

    def empty(self) -> int:
        with self.lock:
            overflow = self._file_returned()
            dropped, self.blocks, freed = self.blocks, {}, self.bytes
            self.bytes = 0
        _free_blocks(overflow)
        _free_blocks([entry for entries in dropped.values() for entry in entries])
        return freed

    def _file_returned(self) -> list[tuple[Device, int]]:
        """Under the lock: keep the returned blocks that fit, after dropping the blocks
        of another backend; returns the blocks to free."""
        overflow = self._forget_other_worlds()
        returned = self.returned
        while returned:
            device, ptr, size = returned.popleft()
            if self.bytes + size <= LIMIT and _world(device._driver) is self.world:
                self.blocks.setdefault(size, []).append((device, ptr))
                self.bytes += size
            else:
                overflow.append((device, ptr))
        return overflow

    def _forget_other_worlds(self) -> list[tuple[Device, int]]:
        """After a switch to another backend, blocks of the previous one are not handed
        out again (a switch from CUDA to CUDA keeps them: they stay valid); returns them. Chooses no
        backend: a block given back after the simulator was closed is freed."""
        world = _world(_driver.current())
        if world is self.world:
            return []
        self.world = world
        stale, self.blocks, self.bytes = self.blocks, {}, 0
        return [entry for entries in stale.values() for entry in entries]


def _free_blocks(blocks: list[tuple[Device, int]]) -> None:
    for device, ptr in blocks:
        offloop.dispose(device, device._driver.mem_host_free, ptr)


_cache = _Cache()


def _new_cache_in_child() -> None:
    """In a forked child: a cache of its own. The parent's blocks are not the child's
    to pin or free, and its lock may have been held by a thread the child lacks."""
    global _cache
    _cache = _Cache()


os.register_at_fork(after_in_child=_new_cache_in_child)


def take(size: int) -> int | None:
    """A cached block of exactly ``size`` bytes (a size class), or None."""
    return _cache.take(size)


def holds(size: int) -> bool:
    """Whether a block of exactly ``size`` bytes (a size class) is cached."""
    _cache.file()
    return bool(_cache.blocks.get(size))


def has_room(size: int) -> bool:
    """Whether a block of ``size`` bytes given back now would be kept (not freed: the
    cache would stay within :data:`LIMIT`)."""
    _cache.file()
    return _cache.bytes + size <= LIMIT


def give(device: Device, ptr: int, size: int) -> None:
    """Keep a block that nothing references any more, allocated through ``device`` (or
    free it, if that backend is no longer in use or the cache is full)."""
    _cache.give(device, ptr, size)


def empty() -> int:
    """Free every cached block (on the off-loop thread); returns the bytes freed."""
    return _cache.empty()


def cached_bytes() -> int:
    """Bytes of pinned blocks kept for reuse."""
    _cache.file()
    return _cache.bytes
