"""Page-locked (pinned) host memory.

Copies between the GPU and pinned memory run at full DMA speed and truly asynchronously;
aiocuda stages copies from ordinary (pageable) memory through pinned chunks of its own.
Two ways to get pinned numpy arrays:

* :func:`pinned_empty` / :func:`pinned_zeros` -- a new numpy array in page-locked
  memory (portable across devices). The memory is freed when the array and every view
  of it are gone.
* :func:`register_host` -- pin an existing numpy array in place for the life of the
  returned :class:`HostRegistration` (a context manager).

```python
out = aiocuda.pinned_empty((1024, 1024), np.float32)
await device_array.to_host(out=out)       # one DMA, no staging
```

Pitfalls: pinning costs milliseconds per call and takes the memory from the OS for as
long as it stays pinned, so pin big, long-lived buffers, not per request. Freeing and
unpinning wait, inside the driver, for the kernels running at the time, and hold every
thread's event records (an event loop's awaits) meanwhile; so aiocuda keeps the blocks
of collected pinned arrays for reuse by later ones of the same size class
(:func:`cached_bytes` counts them, :func:`empty_cache` gives them back), and makes every
free (of a block beyond the cache's limit, or given back) and every unpin of a
registered array on a background thread. aiocuda's copies keep the pinned memory alive
while their DMA is in flight, so closing a registration or dropping an array mid-copy
is safe.
"""

# Measured on an H100: cuMemHostAlloc takes 1.7 ms for 1 MiB and 38 ms for 64 MiB;
# cuMemFreeHost and cuMemHostUnregister return only once a kernel running on any
# stream has finished, holding a driver lock that other threads' event records need
# meanwhile (see aiocuda._memory.pinned_cache and aiocuda._memory.offloop; H200 figures
# in benchmarks/results/logs/driver-stalls.txt).

from __future__ import annotations

import ctypes
import math
import sys
import weakref
from typing import Any, final

import numpy as np
import numpy.typing as npt

from ._memory import offloop, pinned_cache
from ._memory.pinned import PinnedAllocation, pinned_address, pinned_ranges, take_cached
from ._util import invalid_value, shape_tuple
from .device import Device, _as_device
from .errors import CudaError, ResultCode

__all__ = [
    "HostRegistration",
    "cached_bytes",
    "empty_cache",
    "is_pinned",
    "pinned_empty",
    "pinned_zeros",
    "register_host",
]


def _array_over(owner: Any, ptr: int, shape: tuple[int, ...], dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    """A numpy array over ``ptr`` whose base keeps ``owner`` alive."""
    nbytes = math.prod(shape) * dtype.itemsize
    raw = (ctypes.c_char * max(nbytes, 1)).from_address(ptr)
    raw._aiocuda_owner = owner  # type: ignore[attr-defined]
    flat: npt.NDArray[Any] = np.frombuffer(memoryview(raw), dtype=dtype, count=nbytes // dtype.itemsize)
    return flat.reshape(shape)


def _cached_pinned_empty(shape: tuple[int, ...], dtype: np.dtype[Any], device: Device) -> npt.NDArray[Any] | None:
    """:func:`pinned_empty` for an event loop's thread, from the cache of freed blocks
    only: None when it holds none of that size, where pinning new memory would block the
    thread. Either way the cache is topped up off the loop for the next call."""
    nbytes = max(math.prod(shape) * dtype.itemsize, 1)
    owner = take_cached(device, nbytes)
    return None if owner is None else _array_over(owner, owner.ptr, shape, dtype)


def pinned_empty(
    shape: int | tuple[int, ...], dtype: npt.DTypeLike = np.float32, *, device: Device | int | None = None
) -> npt.NDArray[Any]:
    """A new C-contiguous numpy array in page-locked memory (contents undefined).

    ``shape`` and ``dtype`` as :func:`numpy.empty` takes them, but ``shape`` an int or
    a tuple of ints; a subarray dtype such as ``("f4", (2, 2))`` adds its dimensions to
    the shape.

    ``device`` only chooses which context performs the allocation; the memory is
    portable, usable with every device.

    The memory of collected pinned arrays is kept for reuse (up to 2 GiB), and a new
    array of about the same size takes such a block at once. Otherwise the driver pins
    new memory, which
    takes 1-40 ms and blocks the calling thread: in a service, make pinned arrays at
    start-up (a lifespan handler, ``Lanes`` setup), not per request.
    """
    dims = shape_tuple(shape)
    dt = np.dtype(dtype)
    if dt.subdtype is not None:
        # As numpy does: a subarray dtype ("f4", (2, 2)) adds its dimensions to the
        # shape; np.frombuffer would otherwise return more dimensions than asked.
        dt, dims = dt.base, dims + dt.shape
    if dt.hasobject:
        raise invalid_value(f"dtype {dt} holds Python objects and cannot live in pinned memory")
    if dt.itemsize == 0:
        raise invalid_value(f"dtype {dt} has elements of no bytes: give it a size (e.g. 'V8')")
    nbytes = math.prod(dims) * dt.itemsize
    if nbytes > sys.maxsize:
        # (numpy indexes an array's bytes with a signed pointer-sized int; beyond it,
        # numpy and ctypes raised their own ValueError or OverflowError)
        raise invalid_value(
            f"a pinned array of shape {dims} and dtype {dt} would take {nbytes} bytes, "
            f"more than numpy can address ({sys.maxsize})"
        )
    dev = _as_device(device)
    owner = PinnedAllocation(dev, max(nbytes, 1))
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

    Memory already page-locked (a :func:`pinned_empty` array, an array registered and
    not yet closed, or a view of either) is refused with :class:`~aiocuda.errors.ArgumentError`.

    The registration keeps the array alive; do not resize it while registered. The
    driver unpins only once the kernels running at the time have finished, so the
    unpinning itself happens on a background thread; the array is kept alive until it
    is done, and registering the same memory again waits for it.

    Pitfall: while an unpin waits, the driver also holds every other thread's event
    records, and so an event loop's awaits: for a fraction of a millisecond under a
    service's load of short kernels, for the rest of the kernel behind a long one. With
    long kernels, keep registrations for the process's life or close them when idle.
    """

    __slots__ = ("__weakref__", "_finalizer", "array", "ptr", "size")

    def __init__(self, array: npt.NDArray[Any], device: Device | int | None = None) -> None:
        if not isinstance(array, np.ndarray):
            raise TypeError(f"register_host takes a numpy array, not {type(array).__name__}")
        if not array.flags.c_contiguous and not array.flags.f_contiguous:
            raise invalid_value("only a contiguous array can be registered")
        if array.nbytes == 0:
            raise invalid_value("an empty array cannot be registered")
        if pinned_address(array):
            # Refused before the driver: a range it took again would have two owners in
            # pinned_ranges, and its refusal came only after draining the queued unpins.
            raise invalid_value(
                "the array's memory is already page-locked (made by pinned_empty or registered "
                "by an open HostRegistration): use it as it is"
            )
        dev = _as_device(device)
        dev.make_current()
        self.array = array
        self.ptr = int(array.ctypes.data)
        self.size = int(array.nbytes)
        try:
            dev._driver.mem_host_register(self.ptr, self.size)
        except CudaError as exc:
            if exc.code != ResultCode.HOST_MEMORY_ALREADY_REGISTERED:
                raise
            offloop.drain()  # an earlier registration may still be being undone: then retry
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
    offloop.dispose(device, device._driver.mem_host_unregister, ptr, keep=array)


def register_host(array: npt.NDArray[Any], device: Device | int | None = None) -> HostRegistration:
    """Pin ``array``'s memory in place (``cuMemHostRegister``, portable); see
    :class:`HostRegistration`."""
    return HostRegistration(array, device)


def is_pinned(array: npt.NDArray[Any]) -> bool:
    """Whether aiocuda knows ``array``'s memory to be page-locked (allocated by
    :func:`pinned_empty` or registered with :func:`register_host`)."""
    if not isinstance(array, np.ndarray):
        raise TypeError(f"is_pinned takes a numpy array, not {type(array).__name__}")
    return pinned_address(array) != 0


def empty_cache() -> int:
    """Give the page-locked blocks kept for reuse back to the driver; returns their bytes.

    The frees run on a background thread, but the driver performs each only once the
    device is idle and blocks other threads' driver calls (copies among them) until
    then: call this when the GPU has nothing running, e.g. at the end of a batch job.
    """
    return pinned_cache.empty()


def cached_bytes() -> int:
    """Bytes of page-locked blocks kept for reuse by later pinned arrays."""
    return pinned_cache.cached_bytes()
