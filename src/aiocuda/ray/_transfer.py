"""How a GPU actor moves chunks between Ray's object store and its devices.

An input arrives as a read-only numpy view of the object store's shared memory (no copy
out of the store). Two ways to upload it, chosen by :data:`UPLOAD` (one place; an actor
may be told otherwise, as ``benchmarks/ray.py`` does to compare them):

* ``"staging"`` -- the view is ordinary pageable memory to the driver, so aiocuda's
  staging copies it through pinned slots on its copier threads, overlapped with the DMA
  (:mod:`aiocuda._memory.staging`).
* ``"register"`` -- the view's pages are pinned in place (``cuMemHostRegister``) and the
  DMA reads the store directly. Pinning costs far more than a copy (milliseconds per
  MiB), so a range stays pinned for the actor's life and is reused by every later object
  the store places at the same address (it reuses freed space, so same-sized chunks land
  on a few addresses). A chunk that cannot be pinned (past :data:`REGISTER_LIMIT`, or
  partly overlapping a pinned range) is staged.

Outputs are downloaded into pinned blocks (:func:`download_buffer`); returning one to
Ray copies it into the store once, and the block goes back to aiocuda's cache of pinned
blocks when Ray drops the array.
"""

from __future__ import annotations

import ctypes
from typing import Any, Literal

import anyio
import anyio.to_thread
import numpy as np
import numpy.typing as npt

from ..array import DeviceArray
from ..errors import CudaError
from ..host import HostRegistration, is_pinned, pinned_empty, register_host

__all__ = ["REGISTER_LIMIT", "UPLOAD", "StorePins", "UploadName", "download_buffer"]

UploadName = Literal["staging", "register"]

# Measured by benchmarks/ray.py (upload_register_vs_staging, same run, H100): the
# faster of the two is the default. Until a GPU run says otherwise, staging: it needs
# no pinned memory beyond aiocuda's own slots and never touches the store's pages.
UPLOAD: UploadName = "staging"
"""The upload an actor uses unless told otherwise."""

REGISTER_LIMIT = 4 << 30
"""Bytes of object-store memory one actor keeps pinned, at most."""


def download_buffer(index: int, result: DeviceArray) -> npt.NDArray[Any]:
    """A pinned host array for a chunk's result (an ``output=`` function)."""
    return pinned_empty(result.shape, result.dtype)


class StorePins:
    """Object-store ranges pinned in place, kept for the actor's life (``"register"``).

    Only ranges inside the store's main mapping are pinned: the store maps it once and
    keeps it, whereas an object it had to place elsewhere (a fallback file, when the store
    was full) is unmapped when freed, and a range pinned there would go on pointing at
    the old pages after something else is mapped at its address.
    """

    def __init__(self, limit: int = REGISTER_LIMIT) -> None:
        self._limit = limit
        self._registrations: list[HostRegistration] = []
        self._lock = anyio.Lock()
        self._store: tuple[int, int] | None = None
        self.pinned_bytes = 0
        """Bytes pinned so far."""
        self.direct = 0
        """Uploads that read pinned store memory directly."""
        self.staged = 0
        """Uploads that went through staging instead."""

    async def pin(self, array: npt.NDArray[Any]) -> bool:
        """Make ``array``'s memory pinned if it can be; True if it is."""
        if array.nbytes == 0:
            return False
        if is_pinned(array):
            self.direct += 1
            return True
        ptr, size = int(array.ctypes.data), int(array.nbytes)
        async with self._lock:
            if is_pinned(array):  # pinned by a chunk at the same address meanwhile
                self.direct += 1
                return True
            store = self._store or _store_mapping(ptr)
            inside = store is not None and store[0] <= ptr and ptr + size <= store[1]
            if not inside or self.pinned_bytes + size > self._limit:
                self.staged += 1
                return False
            self._store = store
            try:
                # Pinning takes milliseconds: off the loop. The registration covers an
                # array over the raw range, not ``array``, so that it does not keep the
                # object (and with it the store's space) alive.
                registration = await anyio.to_thread.run_sync(register_host, _raw(ptr, size))
            except CudaError:  # part of the range is pinned already, under another object
                self.staged += 1
                return False
            self._registrations.append(registration)
            self.pinned_bytes += size
            self.direct += 1
            return True

    def close(self) -> None:
        """Unpin everything (in the background)."""
        for registration in self._registrations:
            registration.close()
        self._registrations.clear()
        self.pinned_bytes = 0


def _raw(ptr: int, size: int) -> npt.NDArray[np.uint8]:
    return np.frombuffer(memoryview((ctypes.c_char * size).from_address(ptr)), dtype=np.uint8)


def _store_mapping(ptr: int) -> tuple[int, int] | None:
    """``(start, end)`` of the object store's mapping holding ``ptr``: the largest
    mapping of this process whose file is the store's (its name contains ``plasma``),
    or None when ``ptr`` is not inside it."""
    best: tuple[int, int] | None = None
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) < 6 or "plasma" not in fields[5]:
                    continue
                start, end = (int(v, 16) for v in fields[0].split("-"))
                if best is None or end - start > best[1] - best[0]:
                    best = (start, end)
    except OSError:  # not Linux
        return None
    if best is None or not best[0] <= ptr < best[1]:
        return None
    return best
