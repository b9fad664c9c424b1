"""Page-locked (pinned) host memory: arrays for users, and a registry of pinned ranges.

Copies between the GPU and pinned memory run at full DMA speed and truly asynchronously;
copies from ordinary (pageable) memory are staged by aiocuda through pooled pinned
chunks (:mod:`aiocuda._staging`). Two ways to get pinned numpy arrays:

* :func:`pinned_empty` / :func:`pinned_zeros` -- a new numpy array in ``cuMemHostAlloc``
  memory (portable across devices). The memory is freed when the array and every view
  of it are gone.
* :func:`register_host` -- pin an existing numpy array in place (``cuMemHostRegister``)
  for the life of the returned :class:`HostRegistration` (a context manager).

Pitfalls: pinning is expensive (milliseconds per call: 1.7 ms for 1 MiB, 38 ms for 64
MiB on an H100) and pinned memory is taken from the OS for good while pinned, so pin
big, long-lived buffers, not per request. Freeing and unpinning are worse: the driver
first waits until the device is idle, holding a lock that other threads' driver calls
need meanwhile. So aiocuda keeps the blocks of collected pinned arrays for reuse by
later ones of the same size class (:mod:`aiocuda._pinned_cache`; :func:`empty_cache`
gives them back), and unpins registered arrays on a background thread
(:mod:`aiocuda._offloop`): dropping a pinned array never stalls an event loop.
aiocuda's copies hold a reference to the pinned owner while the DMA is in flight, so
unregistering or dropping an array mid-copy is safe.
"""

from __future__ import annotations

import bisect
import ctypes
import math
import threading
import weakref
from typing import Any, final

import numpy as np
import numpy.typing as npt

from . import _offloop, _pinned_cache
from .device import Device, as_device
from .errors import ArgumentError, CudaError, ResultCode

__all__ = [
    "HostRegistration",
    "cached_bytes",
    "empty_cache",
    "is_pinned",
    "pinned_empty",
    "pinned_zeros",
    "register_host",
]


class _PinnedRanges:
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


pinned_ranges = _PinnedRanges()


class _PinnedAllocation:
    """Owner of one page-locked block; numpy arrays over it keep it alive.

    ``size`` is rounded up to a size class, and the block is taken from (and, once
    collected, given back to) the cache of freed blocks (:mod:`aiocuda._pinned_cache`):
    freeing pinned memory would wait for the GPU.
    """

    __slots__ = ("__weakref__", "ptr", "size")

    def __init__(self, device: Device, size: int) -> None:
        self.size = _pinned_cache.size_class(size)
        ptr = _pinned_cache.take(self.size)
        if ptr is None:
            device.make_current()
            ptr = device._driver.mem_host_alloc(self.size)
        self.ptr = ptr
        pinned_ranges.add(ptr, self.size, self)
        weakref.finalize(self, _release_pinned, device, ptr, self.size)


def _release_pinned(device: Device, ptr: int, size: int) -> None:
    pinned_ranges.remove(ptr)
    _pinned_cache.give(device, ptr, size)


def _array_over(owner: Any, ptr: int, shape: tuple[int, ...], dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    """A numpy array over ``ptr`` whose base keeps ``owner`` alive."""
    nbytes = math.prod(shape) * dtype.itemsize
    raw = (ctypes.c_char * max(nbytes, 1)).from_address(ptr)
    raw._aiocuda_owner = owner  # type: ignore[attr-defined]
    flat: npt.NDArray[Any] = np.frombuffer(memoryview(raw), dtype=dtype, count=nbytes // dtype.itemsize)
    return flat.reshape(shape)


def _shape_tuple(shape: int | tuple[int, ...]) -> tuple[int, ...]:
    dims = (shape,) if isinstance(shape, int) else tuple(int(d) for d in shape)
    if any(d < 0 for d in dims):
        raise ArgumentError(f"negative dimension in shape {dims}", code=ResultCode.INVALID_VALUE)
    return dims


def pinned_empty(
    shape: int | tuple[int, ...], dtype: npt.DTypeLike = np.float32, *, device: Device | int | None = None
) -> npt.NDArray[Any]:
    """A new C-contiguous numpy array in page-locked memory (contents undefined).

    ``device`` only chooses which context performs the allocation; the memory is
    portable, usable with every device.
    """
    dims = _shape_tuple(shape)
    dt = np.dtype(dtype)
    nbytes = math.prod(dims) * dt.itemsize
    dev = as_device(device)
    owner = _PinnedAllocation(dev, max(nbytes, 1))
    return _array_over(owner, owner.ptr, dims, dt)


def pinned_zeros(
    shape: int | tuple[int, ...], dtype: npt.DTypeLike = np.float32, *, device: Device | int | None = None
) -> npt.NDArray[Any]:
    """Like :func:`pinned_empty`, filled with zeros."""
    array = pinned_empty(shape, dtype, device=device)
    array.fill(0)
    return array


@final
class HostRegistration:
    """An existing host array pinned in place; unpinned by :meth:`close`, on leaving a
    ``with`` block, or when collected.

    The registration keeps the array alive; do not resize it while registered. The
    driver unpins only once the device is idle, so the unpinning itself happens on a
    background thread (:mod:`aiocuda._offloop`), never blocking the event loop; the
    array is kept alive until it is done, and registering the same memory again waits
    for it.
    """

    __slots__ = ("__weakref__", "_finalizer", "array", "ptr", "size")

    def __init__(self, array: npt.NDArray[Any], device: Device | int | None = None) -> None:
        if not isinstance(array, np.ndarray):
            raise TypeError(f"register_host takes a numpy array, not {type(array).__name__}")
        if not array.flags.c_contiguous and not array.flags.f_contiguous:
            raise ArgumentError("only a contiguous array can be registered", code=ResultCode.INVALID_VALUE)
        if array.nbytes == 0:
            raise ArgumentError("an empty array cannot be registered", code=ResultCode.INVALID_VALUE)
        dev = as_device(device)
        dev.make_current()
        self.array = array
        self.ptr = int(array.ctypes.data)
        self.size = int(array.nbytes)
        try:
            dev._driver.mem_host_register(self.ptr, self.size)
        except CudaError as exc:
            if exc.code != ResultCode.HOST_MEMORY_ALREADY_REGISTERED:
                raise
            _offloop.drain()  # an earlier registration may still be being undone: then retry
            dev._driver.mem_host_register(self.ptr, self.size)
        pinned_ranges.add(self.ptr, self.size, self)
        self._finalizer = weakref.finalize(self, _unregister, dev, self.ptr, array)

    def close(self) -> None:
        """Unpin (in the background; :func:`is_pinned` is False at once). Await the
        copies that use the array first: unlike dropping the last reference (which
        in-flight copies prevent), closing does not wait for them."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> HostRegistration:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"ptr={self.ptr:#x}"
        return f"<HostRegistration {state} size={self.size}>"


def _unregister(device: Device, ptr: int, array: npt.NDArray[Any]) -> None:
    pinned_ranges.remove(ptr)
    # The driver waits for an idle device: unpin off the loop, keeping the array (whose
    # memory must not go back to its allocator while still registered) until then.
    _offloop.release(device, "mem_host_unregister", ptr, keep=array)


def register_host(array: npt.NDArray[Any], device: Device | int | None = None) -> HostRegistration:
    """Pin ``array``'s memory in place (``cuMemHostRegister``, portable); see
    :class:`HostRegistration`."""
    return HostRegistration(array, device)


def is_pinned(array: npt.NDArray[Any]) -> bool:
    """Whether aiocuda knows ``array``'s memory to be page-locked (allocated by
    :func:`pinned_empty` or registered with :func:`register_host`)."""
    return pinned_ranges.owner(int(array.ctypes.data), max(int(array.nbytes), 1)) is not None


def empty_cache() -> int:
    """Give the page-locked blocks kept for reuse back to the driver; returns their bytes.

    The frees run on a background thread, but the driver performs each only once the
    device is idle and blocks other threads' driver calls (copies among them) until
    then: call this when the GPU has nothing running, e.g. at the end of a batch job.
    """
    return _pinned_cache.empty()


def cached_bytes() -> int:
    """Bytes of page-locked blocks kept for reuse by later pinned arrays."""
    return _pinned_cache.cached_bytes()
