"""Managed (unified) memory: arrays that host code and every GPU can use.

The driver moves managed pages to wherever they are used. Moving them ahead of time is
what makes managed memory fast: :meth:`ManagedArray.prefetch` migrates the array to a
device (or to host memory) in stream order and returns an awaitable
:class:`~aiocuda.event.Event`; :meth:`ManagedArray.advise` tells the driver how the
memory will be used; :meth:`ManagedArray.attach` limits which streams may use it.

```python
grid = aiocuda.managed.empty((4096, 4096), np.float32, device=0)
grid.host_view()[:] = initial                  # host code writes it in place
await grid.prefetch(0, stream=stream)          # pages on the GPU before the kernel runs
kernel.launch(blocks, threads, grid, stream=stream)
await grid.prefetch("host", stream=stream)     # and back, before the host reads them
print(grid.host_view().sum())
```

Never more than the device has: each allocation is checked against the device's
memory (this process's managed memory there plus the request within its total memory,
the request within its free memory now) and refused with
:class:`~aiocuda.errors.OversubscriptionError` unless ``oversubscribe=True`` says that
exceeding it is meant. Oversubscribed managed memory migrates pages on every access and
can stall the GPU for every process sharing it.

:class:`ManagedPool` allocates managed memory stream-ordered, where the driver offers
managed pools (CUDA 13 on Linux, on GPUs with concurrent managed access).
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from . import _driver
from ._memory import managed_budget as _budget
from ._memory import offloop as _offloop
from ._memory.buffers import OwnedBuffer
from ._util import byte_span, invalid_value, shape_tuple
from .array import DeviceArray, _check_dtype, _device_of, _filled, _leave, _stream_of_new
from .device import Device, _as_device
from .errors import CudaError, ResultCode
from .event import Event
from .memory import DEFAULT_RELEASE_THRESHOLD, DeviceBuffer, MemoryPool
from .stream import Stream, _check_stream, _stream_for_new

__all__ = ["Advice", "Location", "ManagedArray", "ManagedPool", "empty", "zeros"]

Location = Device | int | Literal["host"]
"""Where managed pages go or are meant to be: a :class:`~aiocuda.device.Device`, a
device ordinal, or ``"host"`` (host memory)."""

Advice = Literal["read_mostly", "preferred_location", "accessed_by"]
"""What :meth:`ManagedArray.advise` can tell the driver (``cuMemAdvise``):

* ``"read_mostly"``: mostly read; each device reading it gets a copy of the pages.
* ``"preferred_location"``: keep the pages at the given location where possible.
* ``"accessed_by"``: keep the pages mapped for the given device, wherever they are.
"""

_ATTACH = ("single", "global", "host")


class ManagedArray(DeviceArray):
    """A :class:`~aiocuda.array.DeviceArray` in managed memory (see the module docstring).

    Everything a DeviceArray does works; views are ManagedArrays too. Create with
    :func:`empty` or :func:`zeros`.
    """

    __slots__ = ()

    def _span(self) -> tuple[int, int]:
        lo, hi = byte_span(self.shape, self.strides, self.itemsize)
        return self.ptr + lo, hi - lo

    def prefetch(self, location: Location, *, stream: Stream | None = None) -> Event:
        """Enqueue moving the array's pages to ``location`` (a device, or ``"host"``) on
        ``stream`` (default: the current stream of the array's device), after the
        array's earlier work; returns the :class:`~aiocuda.event.Event` at its end:
        ``await array.prefetch(0)`` waits for it, while work enqueued after it on the
        same stream is ordered after it without waiting."""
        target = _ordinal(location)
        s = self._stream_for(stream, any_device=True)
        start, nbytes = self._span()
        if nbytes:
            s.device.make_current()
            s.device._driver.mem_prefetch_async(start, nbytes, target, s.handle)
            _leave(self.buffer, s)  # (on another device's stream: the free waits for it)
        return s.record()

    def advise(self, advice: Advice, location: Location | None = None, *, unset: bool = False) -> None:
        """Tell the driver how the array's memory will be used (``cuMemAdvise``), or with
        ``unset=True`` take that back. ``"preferred_location"`` and ``"accessed_by"``
        need a ``location``; ``"read_mostly"`` takes none. Takes effect at once; it
        orders nothing."""
        if advice not in ("read_mostly", "preferred_location", "accessed_by"):
            raise invalid_value(f"unknown advice {advice!r}: one of read_mostly, preferred_location, accessed_by")
        if not isinstance(unset, bool):
            raise TypeError(f"unset must be a bool, not {type(unset).__name__}")
        if advice == "read_mostly":
            if location is not None:
                raise invalid_value("read_mostly applies to every device: give no location")
            target = None
        elif location is None:
            raise invalid_value(f"{advice} needs a location: a device, its ordinal or 'host'")
        else:
            target = _ordinal(location)
        start, nbytes = self._span()
        if nbytes:
            device = self.device
            device.make_current()
            device._driver.mem_advise(start, nbytes, f"{'unset' if unset else 'set'}_{advice}", target)

    def attach(self, stream: Stream, scope: Literal["single", "global", "host"] = "single") -> None:
        """Say which streams may use the memory (``cuStreamAttachMemAsync``), in
        ``stream``'s order: ``"single"`` this stream only (host code may then use the
        memory whenever this stream is idle), ``"global"`` any stream, ``"host"`` host
        code only. For arrays from :func:`empty` or :func:`zeros` without a pool; it
        attaches the whole allocation, whatever view it is called on."""
        if scope not in _ATTACH:
            raise invalid_value(f"scope must be one of {', '.join(_ATTACH)}, not {scope!r}")
        buffer = self.buffer
        if not isinstance(buffer, OwnedBuffer) or not isinstance(buffer.owner, _ManagedAllocation):
            raise invalid_value("only managed memory allocated without a pool can be attached to a stream")
        s = self._stream_for(stream, any_device=True)
        s.device.make_current()
        s.device._driver.stream_attach_mem_async(s.handle, buffer.ptr, scope)
        _leave(buffer, s)

    def host_view(self) -> npt.NDArray[Any]:
        """The array's memory as a numpy array, without copying: host code reads and
        writes the managed memory itself. Await the work on the array (its stream, or a
        prefetch to ``"host"``) before reading what the GPU wrote, and do not write it
        while GPU work uses it. The view keeps the memory alive (for an array from a
        :class:`ManagedPool`, until its buffer is freed explicitly)."""
        start, nbytes = self._span()
        buffer = self.buffer
        # (the allocation itself, not the buffer: an explicit free() lets go of it, and the
        # driver freed the memory under the view)
        keep = buffer.owner if isinstance(buffer, OwnedBuffer) else buffer
        window = np.asarray(_HostWindow(start, nbytes, keep))
        lo = start - self.ptr
        view: npt.NDArray[Any] = np.ndarray(self.shape, self.dtype, buffer=window, offset=-lo, strides=self.strides)
        return view


class _HostWindow:
    """Managed memory seen by numpy; keeps the buffer alive as long as an array over it."""

    def __init__(self, address: int, nbytes: int, keep: Any) -> None:
        self.__array_interface__ = {"data": (address, False), "shape": (nbytes,), "typestr": "|u1", "version": 3}
        self._keep = keep


class _ManagedAllocation:
    """Owner of one ``cuMemAllocManaged`` allocation: freed (off the loop: ``cuMemFree``
    may wait for the device) once the buffer over it is freed and the work enqueued on
    it has completed. At interpreter exit the process's memory goes with it."""

    def __init__(self, device: Device, ptr: int, nbytes: int) -> None:
        self.device = device
        self.ptr = ptr
        self.nbytes = nbytes
        weakref.finalize(self, _free_managed, device, ptr, nbytes).atexit = False


def _free_managed(device: Device, ptr: int, nbytes: int) -> None:
    _budget.release(device, nbytes)
    _offloop.dispose(device, device._driver.mem_free, ptr)


def _ordinal(location: Location) -> int | None:
    """The device ordinal of a location, None for host memory."""
    if location == "host":
        return None
    if isinstance(location, Device):
        return location.ordinal
    if isinstance(location, (int, np.integer)) and not isinstance(location, bool):
        return _as_device(int(location)).ordinal
    raise invalid_value(f"a location is a Device, a device ordinal or 'host', not {location!r}")


class ManagedPool(MemoryPool):
    """A stream-ordered pool of managed memory (``CU_MEM_ALLOCATION_TYPE_MANAGED``):
    allocations prefer its device and are checked against the device's memory like
    every managed allocation. Create with :meth:`ManagedPool.create`; allocate through
    :func:`empty` (``pool=``), which gives a :class:`ManagedArray`, or
    :meth:`allocate`."""

    __slots__ = ("oversubscribe",)
    _factories = "ManagedPool.create()"

    oversubscribe: bool
    """Whether allocations may exceed the device's memory."""

    @classmethod
    def create(  # type: ignore[override]
        cls,
        device: Device | int | None = None,
        *,
        oversubscribe: bool = False,
        release_threshold: int = DEFAULT_RELEASE_THRESHOLD,
    ) -> ManagedPool:
        """A new managed pool on ``device``. Raises :class:`~aiocuda.errors.CudaError`
        (``CUDA_ERROR_NOT_SUPPORTED``) where the driver offers none. ``oversubscribe``
        lets its allocations exceed the device's memory."""
        dev = _as_device(device)
        try:
            pool = cls._new(dev, _driver.PoolProps(dev.ordinal, managed=True), release_threshold)
        except CudaError as exc:
            if exc.code not in (ResultCode.NOT_SUPPORTED, ResultCode.INVALID_VALUE):
                raise
            raise CudaError.like(
                exc,
                f"this driver offers no managed memory pools ({exc}); they need CUDA 13 on Linux and a GPU with "
                "concurrent managed access. Use aiocuda.managed.empty() without a pool instead.",
            ) from exc
        assert isinstance(pool, ManagedPool)
        pool.oversubscribe = oversubscribe
        _budget.note_pool(pool)
        return pool

    def allocate(self, nbytes: int, stream: Stream | None = None) -> DeviceBuffer:
        """Like :meth:`MemoryPool.allocate`, after checking the device's memory (see the
        module docstring)."""
        if not self.oversubscribe and isinstance(nbytes, int) and nbytes > 0:
            _budget.check(self.device, nbytes)
        return super().allocate(nbytes, stream)


def empty(
    shape: int | tuple[int, ...],
    dtype: npt.DTypeLike = np.float32,
    *,
    device: Device | int | None = None,
    attach: Literal["global", "host"] = "global",
    pool: ManagedPool | None = None,
    stream: Stream | None = None,
    oversubscribe: bool = False,
) -> ManagedArray:
    """A new C-contiguous :class:`ManagedArray`, contents undefined.

    Without ``pool`` it is a ``cuMemAllocManaged`` allocation for ``device`` (default:
    the current stream's device, else 0), usable by every stream (``attach="global"``)
    or by host code only until attached to a stream (``attach="host"``); with ``pool``
    it is allocated stream-ordered on ``stream`` (default: the current stream) from
    that :class:`ManagedPool`. Raises
    :class:`~aiocuda.errors.OversubscriptionError` when the device's memory would be
    exceeded, unless ``oversubscribe=True``.
    """
    dims = shape_tuple(shape)
    dt = _check_dtype(dtype)
    nbytes = math.prod(dims) * dt.itemsize
    if pool is not None:
        if not isinstance(pool, ManagedPool):  # (its memory is the device's alone: no host view, no attach)
            raise TypeError(f"pool must be a ManagedPool (aiocuda.managed.ManagedPool.create()), not {pool!r}")
        if device is not None and _as_device(device) is not pool.device:
            raise invalid_value(f"device {_as_device(device).ordinal} and a pool of device {pool.device.ordinal}")
        if attach != "global":
            raise invalid_value("attach applies to managed memory allocated without a pool")
        if oversubscribe and not pool.oversubscribe:
            raise invalid_value("the pool refuses to oversubscribe: create it with oversubscribe=True")
        if stream is None:
            stream = _stream_of_new(None, pool)
        else:
            _check_stream(stream)
        return ManagedArray(dims, dt, buffer=pool.allocate(nbytes, stream))
    if attach not in ("global", "host"):
        raise invalid_value(f"attach must be 'global' or 'host', not {attach!r}")
    if stream is None:
        stream = _stream_for_new(device)  # inside use_stream(), its device is the default
    dev = _device_of(device, stream)
    size = max(nbytes, 1)  # the driver allocates nothing for 0 bytes
    _budget.reserve(dev, size, oversubscribe=oversubscribe)
    try:
        dev.make_current()
        ptr = dev._driver.mem_alloc_managed(size, attach)
    except BaseException:
        _budget.release(dev, size)
        raise
    owner = _ManagedAllocation(dev, ptr, size)
    buffer = OwnedBuffer(ptr, size, dev, stream, owner)
    return ManagedArray(dims, dt, buffer=buffer)


async def zeros(
    shape: int | tuple[int, ...],
    dtype: npt.DTypeLike = np.float32,
    *,
    device: Device | int | None = None,
    pool: ManagedPool | None = None,
    stream: Stream | None = None,
    oversubscribe: bool = False,
) -> ManagedArray:
    """Like :func:`empty`, filled with zeros on the GPU (awaited). If the fill fails or
    is cancelled, the memory is let go at once, as by :func:`aiocuda.zeros`."""
    array = empty(shape, dtype, device=device, pool=pool, stream=stream, oversubscribe=oversubscribe)
    await _filled(array, array.fill(0, stream=stream))
    return array
