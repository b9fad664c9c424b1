"""Stream-ordered device memory: pools and buffers.

Every device allocation comes from a memory pool on a stream, and goes back to it on
the stream of its *last use*. Both only enqueue: allocating and freeing are ordered with
the work that uses the memory, so neither waits for the GPU, and a buffer dropped while a
kernel or a copy still uses it is freed only after that work.

```python
pool = MemoryPool.for_device(0)
buf = pool.allocate(1 << 20, stream)      # usable by work enqueued on stream from now on
...
buf.free()                                # or let it go: freed after the work using it
```

Lifetime rules (what makes cancellation safe):

* A :class:`DeviceBuffer` is freed when :meth:`DeviceBuffer.free` is called, its
  ``with`` block ends, or the last reference goes away, whichever comes first -- always
  on the stream of its last use by aiocuda (copies, kernel launches, array operations
  record it). Cancelling a task that awaits a copy into a buffer therefore never frees
  memory the copy still writes.
* A buffer used on a second stream is freed only after the work on the first too.
* Host memory that enqueued work reads or writes is kept alive by ``stream.hold``
  (see :mod:`aiocuda.stream`), not by the buffer.

Freed blocks are kept for reuse: a buffer freed on a stream that aiocuda owns goes to
its pool's *spares* (up to :data:`SPARE_BYTES` per pool; none for pools shared with
other processes), and the next allocation of the same size on the same stream takes it
back without a driver call -- stream order makes that safe, as it makes the driver's own
reuse safe. Closing a stream gives its spares back (freed on it, after its work);
:meth:`MemoryPool.trim` and an out-of-memory recovery give every spare back to the
driver first; pool statistics count them as free. A pool keeps the streams it has
spares for alive: a stream dropped without :meth:`~aiocuda.stream.Stream.close` is
collected only once its spares are given back (at the latest when the pool keeps
spares for too many streams).

Out of memory: an allocation that fails trims the pool's cached memory
(:meth:`MemoryPool.trim`) and retries, then trims the device's other pools and retries,
then raises :class:`~aiocuda.errors.OutOfMemoryError` saying what was asked, what the
pool uses and what the device has free. The pool stays usable.
:meth:`MemoryPool.allocate_wait` instead waits, asynchronously and with a timeout, for
memory to be freed: back-pressure for services.
"""

# The allocate/free path is deliberately tiny: the backend hands each pool its bound
# cuMemAllocFromPoolAsync / cuMemFreeAsync (Driver.mem_async_calls), so the pool calls
# the bindings with no seam function in between, reads the stream's handle without a
# property call, and fills a slots object. Allocate plus free must stay within 30 % of
# calling the driver directly (issue 4; benchmarks/memory.py measures it).

from __future__ import annotations

import contextlib
import operator
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn, final

import anyio

from . import _driver
from ._memory import offloop as _offloop
from ._memory.observed_frees import FreedStreams
from ._util import NoPublicConstructor, exiting, format_bytes, invalid_value
from .device import Device, _as_device
from .errors import ArgumentError, CudaError, OutOfMemoryError, ResultCode
from .stream import Stream, _check_stream, current_stream

__all__ = ["DEFAULT_RELEASE_THRESHOLD", "SPARE_BYTES", "DeviceBuffer", "MemoryPool", "PoolStatistics"]

DEFAULT_RELEASE_THRESHOLD = 2**63 - 1
"""Pools keep freed memory cached across synchronisations (like PyTorch and CuPy do);
:meth:`MemoryPool.trim` or an out-of-memory recovery gives it back. A threshold of 0
would return memory to the OS at every synchronisation and make allocation slow."""

SPARE_BYTES = 64 << 20
"""Bytes of freed blocks a pool keeps for reuse on their streams (see the module's text)."""

_SPARE_KEYS = 128
"""(stream, size) pairs a pool keeps lists of spares for. One more drops the empty lists
and, if none is, gives every spare back: streams used once (one per request, say) are
not kept alive for long. Request lanes need one or two a lane (33 lanes on an H100)."""

_last_finaliser_error: BaseException | None = None
"""The last error a buffer's finaliser swallowed (finalisers cannot raise); for debugging."""

_RETRY_FIRST = 0.0005
_RETRY_MAX = 0.02
"""Back-off of :meth:`MemoryPool.allocate_wait` between tries (seconds, doubling)."""


@dataclass(frozen=True, slots=True)
class PoolStatistics:
    """A snapshot of a pool (:meth:`MemoryPool.statistics`).

    Byte figures come from the driver's pool attributes, so they include memory
    allocated from the same pool by other libraries; counts are this process's
    allocations through aiocuda (empty buffers are not counted).
    """

    used_bytes: int
    """Bytes in allocations not yet freed (``used_mem_current``)."""
    used_bytes_peak: int
    """High-water mark of ``used_bytes`` since creation or :meth:`MemoryPool.reset_peaks`."""
    reserved_bytes: int
    """Bytes the pool holds from the device, used or cached (``reserved_mem_current``)."""
    reserved_bytes_peak: int
    """High-water mark of ``reserved_bytes``."""
    allocations: int
    """Successful allocations so far."""
    frees: int
    """Buffers freed so far (explicitly or by collection)."""
    live_buffers: int
    """``allocations - frees``."""
    out_of_memory_recoveries: int
    """Allocations that succeeded only after trimming cached memory."""
    release_threshold: int
    max_size: int
    """The pool's size limit in bytes; 0 for none."""


class MemoryPool(metaclass=NoPublicConstructor):
    """A stream-ordered memory pool on one device.

    Obtain with :meth:`for_device` (the pool aiocuda allocates from by default: the
    device's default pool, configured with :data:`DEFAULT_RELEASE_THRESHOLD`),
    :meth:`default` (the driver's default pool itself) or :meth:`create` (a new pool,
    optionally with a size limit). Pools are shared across threads and event loops.
    """

    _factories = "MemoryPool.for_device(), MemoryPool.default() or MemoryPool.create()"

    __slots__ = (
        "__weakref__",
        "_alloc_call",
        "_allocations",
        "_driver",
        "_fail",
        "_free_call",
        "_free_waiters",
        "_freed_handle",
        "_freed_on",
        "_frees",
        "_handle",
        "_owned",
        "_recoveries",
        "_spare_bytes",
        "_spares",
        "device",
        "exportable",
        "max_size",
    )

    def __init__(self, device: Device, handle: Any, *, owned: bool, max_size: int = 0) -> None:
        self.device = device
        self._driver = device._driver
        self._handle = handle
        self._owned = owned
        self.max_size = max_size
        self.exportable = False
        """Whether other processes may use its memory (:func:`aiocuda.ipc.share_array`)."""
        self._alloc_call, self._free_call, self._fail = self._driver.mem_async_calls()
        self._recoveries = 0
        self._allocations = 0
        self._frees = 0
        self._free_waiters: list[tuple[int, anyio.Event]] = []
        """``allocate_wait`` calls sleeping until the next free: (loop thread, event)."""
        self._freed_on = FreedStreams()
        """Streams with frees the driver has not yet observed: :meth:`trim` makes it."""
        self._spares: dict[tuple[Stream, int], list[Any]] = {}
        """Freed blocks kept for reuse, by (stream freed on, size): see the module's text."""
        self._spare_bytes = 0
        self._freed_handle: Any = None
        """The handle of the stream noted in ``_freed_on`` last, while no
        ``allocate_wait`` call waits (None otherwise): a free on that stream needs
        nothing more, and costs the free path one identity check."""
        with _pools_lock:
            _pools.add(self)

    # -- obtaining pools ----------------------------------------------------------------------
    @classmethod
    def default(cls, device: Device | int | None = None) -> MemoryPool:
        """The driver's default pool of ``device`` (``cuDeviceGetDefaultMemPool``), with
        its release threshold raised to :data:`DEFAULT_RELEASE_THRESHOLD` on first use."""
        dev = _as_device(device)
        pool = _default_pools.get(dev)
        if pool is None:
            dev.make_current()
            pool = cls._create(dev, dev._driver.mempool_default(dev._handle), owned=False)
            pool.release_threshold = DEFAULT_RELEASE_THRESHOLD
            _default_pools[dev] = pool
        return pool

    @classmethod
    def for_device(cls, device: Device | int | None = None) -> MemoryPool:
        """The pool aiocuda allocates from on ``device`` unless told otherwise: the
        default pool, or the one last passed to :meth:`set_for_device`."""
        return _pool_for(_as_device(device))

    @classmethod
    def set_for_device(cls, pool: MemoryPool) -> None:
        """Make ``pool`` the one :meth:`for_device` returns for its device."""
        _current_pools[pool.device] = pool

    @classmethod
    def create(
        cls,
        device: Device | int | None = None,
        *,
        max_size: int = 0,
        release_threshold: int = DEFAULT_RELEASE_THRESHOLD,
        ipc: bool = False,
    ) -> MemoryPool:
        """A new pool (``cuMemPoolCreate``) on ``device``.

        Args:
            max_size: upper bound of the memory the pool may reserve, in bytes (0: the
                device's memory). Allocations beyond it raise OutOfMemoryError.
            release_threshold: cached bytes kept across synchronisations.
            ipc: let other processes use the pool's memory (see :mod:`aiocuda.ipc`;
                :func:`aiocuda.ipc.pool` gives each device one such pool).
        """
        max_size = _byte_count(max_size, "max_size")
        dev = _as_device(device)
        return cls._new(dev, _driver.PoolProps(dev.ordinal, max_size, ipc=ipc), release_threshold)

    @classmethod
    def _new(cls, device: Device, props: _driver.PoolProps, release_threshold: int) -> MemoryPool:
        """Create the driver's pool and its owner (of this class or a subclass)."""
        device.make_current()
        handle = device._driver.mempool_create(props)
        pool = cls._create(device, handle, owned=True, max_size=props.max_size)
        pool.exportable = props.ipc
        weakref.finalize(pool, _destroy_pool, device, handle)
        pool.release_threshold = release_threshold
        return pool

    # -- allocation (the hot path) ----------------------------------------------------------
    def allocate(self, nbytes: int, stream: Stream | None = None) -> DeviceBuffer:
        """Allocate ``nbytes`` stream-ordered on ``stream`` (default: the current stream).

        The memory may be used by work enqueued on ``stream`` after this call. aiocuda's
        own operations on another stream order themselves after it; foreign work on
        another stream needs ``other.wait(stream)`` first. A size of 0 gives an empty
        buffer with a null
        pointer. Raises :class:`OutOfMemoryError` (after trimming cached memory and
        retrying) or :class:`~aiocuda.errors.ArgumentError` (a size that is not a
        non-negative integer below 2**64, or a closed stream).
        """
        if stream is None:
            stream = current_stream(self.device)
        # The stream's slots are read directly: the ``handle`` property (a closed check)
        # would cost a Python call, a fifth of this path's own work.
        try:
            unusual = type(nbytes) is not int or nbytes <= 0 or stream._closed or stream._capture is not None
        except AttributeError:  # (not a Stream: a try costs nothing until it catches)
            _check_stream(stream)
            raise
        if unusual:
            return self._allocate_unusual(nbytes, stream)
        ptr = None
        spares = self._spares
        if spares:
            held = spares.get((stream, nbytes))
            if held:
                try:
                    ptr = held.pop()
                    self._spare_bytes -= nbytes
                except IndexError:  # another thread took the last one meanwhile
                    pass
        if ptr is None:
            # The bound call is read into a local first: called as ``self._alloc_call(...)``
            # it would be looked up as a method, which the interpreter cannot specialise
            # for a function kept in a slot (a generic lookup on every call).
            alloc = self._alloc_call
            try:
                err, ptr = alloc(nbytes, self._handle, stream._handle)
                if err:
                    self._fail(err, "cuMemAllocFromPoolAsync")
            except CudaError as exc:
                ptr = self._allocate_slow(nbytes, stream, exc)
            except OverflowError:  # the bindings' size_t: at least 2**64 bytes
                raise invalid_value(f"cannot allocate {nbytes} bytes: more than a 64-bit size") from None
        self._allocations += 1
        buf = _new_buffer(DeviceBuffer)
        buf._ptr = ptr
        buf.size = nbytes
        buf._pool = self
        buf._stream = stream
        buf._waits = None
        return buf

    def _allocate_unusual(self, nbytes: Any, stream: Stream) -> DeviceBuffer:
        """A closed stream or a bad size (both raise), an integer that is not an ``int``
        (allocated as its value), an empty buffer, or an allocation on a stream being
        captured (the graph's memory: see ``aiocuda.graph``)."""
        stream.handle  # noqa: B018 - raises the stream's own "closed" error
        try:
            size = operator.index(nbytes)
        except TypeError:
            size = None
        if size is None or isinstance(nbytes, bool):
            raise invalid_value(
                f"cannot allocate {nbytes!r} bytes: the size must be an integer, not {type(nbytes).__name__}"
            )
        if size < 0:
            raise invalid_value(f"cannot allocate {size} bytes: the size must not be negative")
        capture = stream._capture
        if capture is not None and size:
            self.device.make_current()
            buf = _new_buffer(DeviceBuffer)
            buf._ptr = self._call_alloc(size, stream)
            self._allocations += 1
            buf.size = size
            buf._pool = self
            buf._stream = stream
            buf._waits = None
            capture.allocated(buf)
            return buf
        if size:
            return self.allocate(size, stream)
        buf = _new_buffer(DeviceBuffer)
        buf._ptr = 0
        buf.size = 0
        buf._pool = self
        buf._stream = stream
        buf._waits = None
        return buf

    def _allocate_slow(self, nbytes: int, stream: Stream, exc: CudaError) -> Any:
        """The first attempt failed: bind the context (the hot path skips it, as the
        stream names the context) and retry; on out of memory, recover or raise."""
        if not isinstance(exc, OutOfMemoryError):
            self.device.make_current()
            try:
                return self._call_alloc(nbytes, stream)
            except OutOfMemoryError as oom:
                exc = oom
        return self._recover(nbytes, stream, exc)

    def _recover(self, nbytes: int, stream: Stream, exc: CudaError) -> Any:
        """Out of memory: give the spares back onto ``stream`` and trim this pool, retry,
        then trim the device's other pools and retry, else raise a clear error."""
        if self._spares:
            self._give_back_spares(onto=stream)
        self.trim(0)
        try:
            ptr = self._call_alloc(nbytes, stream)
        except OutOfMemoryError:
            with _pools_lock:
                others = [pool for pool in _pools if pool.device is self.device and pool is not self]
            for pool in others:
                try:
                    pool.trim(0)
                except CudaError:
                    pass  # e.g. a pool whose context failed: it gives nothing back
            if not others:
                raise self._oom_error(nbytes) from exc
            try:
                ptr = self._call_alloc(nbytes, stream)
            except OutOfMemoryError:
                raise self._oom_error(nbytes) from exc
        self._recoveries += 1
        return ptr

    def _call_alloc(self, nbytes: int, stream: Stream) -> Any:
        err, ptr = self._alloc_call(nbytes, self._handle, stream.handle)
        if err:
            self._fail(err, "cuMemAllocFromPoolAsync")
        return ptr

    def _free_on(self, ptr: Any, stream: Stream, waits: list[Any] | None) -> None:
        """Free ``ptr`` on its last-use ``stream`` after the events in ``waits``: the
        general case of :meth:`DeviceBuffer.free`, which inlines the common one."""
        self.device.make_current()  # a finaliser may run on a thread without the context
        capture = stream._capture
        if capture is not None:  # graph memory is freed where the capture says; other memory after it
            freeing_on = capture.freeing(self, ptr, stream, waits)
            if freeing_on is None:
                return
            stream = freeing_on
        if stream.closed:
            # The device's current stream frees it, after the closed stream's last work
            # (its end event): work enqueued there before it closed may still use it.
            closed, stream = stream, current_stream(self.device)
            if closed._tail is not None:
                stream.wait(closed)
        for event in waits or ():
            stream.wait(event)
        (err,) = self._free_call(ptr, stream.handle)
        if err:
            self._fail(err, "cuMemFreeAsync")
        self._frees += 1
        if stream._handle is not self._freed_handle:
            self._after_free(stream)

    def _spares_for(self, stream: Stream, size: int) -> list[Any]:
        """The list of spares of (``stream``, ``size``), new; with ``_SPARE_KEYS`` lists
        already, the empty ones are dropped first, else every spare goes back to the
        driver."""
        spares = self._spares
        if len(spares) >= _SPARE_KEYS:
            for key in [key for key, kept in spares.items() if not kept]:
                del spares[key]
            if len(spares) >= _SPARE_KEYS:
                self._give_back_spares()
        held: list[Any] = []
        self._spares[stream, size] = held
        # The stream gives its spares back when it closes (Stream.close calls
        # _give_back_spares(of=stream) on the pools listed here). A list's append is
        # atomic, so two threads freeing on the stream lose no entry; at worst one pool
        # is listed twice, and its second give-back finds nothing.
        listed = stream._spare_pools
        if not any(ref() is self for ref in listed):
            listed.append(weakref.ref(self))
        return held

    def _give_back_spares(self, onto: Stream | None = None, of: Stream | None = None) -> None:
        """Free every spare block, or, given ``of``, those kept for that stream: each on
        the stream it was freed on (a closed stream's after the work it had when it
        closed), or, given ``onto``, on ``onto`` where that stream is idle now -- none
        of its work uses the block any more -- so that an allocation on ``onto`` reuses
        the memory at once, in stream order."""
        # The dict and its lists change only between bytecodes that cannot switch
        # threads (no calls into Python): a free of another thread never appends to a
        # list taken here. An allocation of another thread may have found a list before
        # it was taken and pop from it meanwhile: each block is popped, so that it goes
        # either to that allocation or to the driver, and leaves the spare bytes once.
        # Two give-backs (a trim and a stream's close) may take the same list: so too.
        if of is not None and _capturing.depth:
            # This thread captures: a stream-ordered free on another stream now could
            # invalidate its capture (see _defer_frees). Given back when the capture ends.
            closed = _capturing.closed
            assert closed is not None
            closed.append((self, of))
            return
        if of is None:
            spares, self._spares = self._spares, {}
        else:
            # tuple() copies the keys at once (a loop over the dict would fail when a
            # free of another thread adds a key meanwhile); pop() takes each list once.
            kept = self._spares
            spares = {}
            for key in tuple(kept):
                if key[0] is of:
                    held = kept.pop(key, None)
                    if held is not None:
                        spares[key] = held
        query = self._driver.stream_query
        # Over a copy of the items: a stream's close of another thread may pop a key from
        # a dict taken here before the swap.
        for (stream, size), held in tuple(spares.items()):
            waits = None
            if stream._closed:
                waits = [stream._tail] if stream._tail is not None else None
            elif onto is not None and stream is not onto and onto._capture is None and query(stream._handle):
                stream = onto
            while held:
                try:
                    ptr = held.pop()
                except IndexError:  # that allocation took the last one
                    break
                self._spare_bytes -= size
                self._free_on(ptr, stream, waits)
                self._frees -= 1  # counted when it became a spare

    def _after_free(self, stream: Stream) -> None:
        """A free was just enqueued on ``stream``, another than the previous one's, or
        while ``allocate_wait`` calls wait: note the stream for :meth:`trim`, and wake
        them."""
        self._freed_on.note(stream)
        # Set before the waiters are looked at: a waiter of another thread that comes
        # meanwhile clears it after joining (_next_free), so it never stays set while
        # one waits.
        self._freed_handle = stream._handle
        if self._free_waiters:
            self._freed_handle = None
            self._wake_free_waiters()

    def _oom_error(self, nbytes: int) -> OutOfMemoryError:
        stats = self.statistics()
        try:
            free, total = self.device.memory_info()
            device_part = f"{format_bytes(free)} free of {format_bytes(total)} on the device"
        except CudaError:
            device_part = "the device's free memory is unknown"
        limit = f", pool limit {format_bytes(self.max_size)}" if self.max_size else ""
        return OutOfMemoryError(
            f"out of memory on device {self.device.ordinal}: asked for {format_bytes(nbytes)} ({nbytes} bytes); "
            f"the pool has {format_bytes(stats.used_bytes)} in use and {format_bytes(stats.reserved_bytes)} "
            f"reserved in {stats.live_buffers} live buffers{limit}; {device_part}. The cached memory of the "
            f"device's pools was trimmed and the allocation retried; memory freed on streams still running "
            f"comes back once they finish. Free buffers, or await pool.allocate_wait(...) to wait for memory.",
            code=ResultCode.OUT_OF_MEMORY,
            name="CUDA_ERROR_OUT_OF_MEMORY",
            call="cuMemAllocFromPoolAsync",
        )

    async def allocate_wait(
        self,
        nbytes: int,
        stream: Stream | None = None,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - OOM, not Cancelled, on expiry
    ) -> DeviceBuffer:
        """Like :meth:`allocate`, but when memory is short wait for buffers to be freed.

        Tries again whenever a buffer of this pool is freed by a task of the same event
        loop, and otherwise with a growing back-off (0.5 ms, doubling up
        to 20 ms) -- buffers freed on other threads, and memory freed
        stream-ordered that other streams may use only once the free has run -- until the
        allocation succeeds or ``timeout`` seconds have passed (the last try is at the
        deadline); then raises :class:`OutOfMemoryError`, not ``TimeoutError``, so that
        callers handle one type. Cancellable at every wait.
        """
        deadline = None if timeout is None else anyio.current_time() + timeout
        delay = _RETRY_FIRST
        while True:
            try:
                return self.allocate(nbytes, stream)
            except OutOfMemoryError:
                left = None if deadline is None else deadline - anyio.current_time()
                if left is not None and left <= 0:
                    raise
            woken = await self._next_free(delay if left is None else min(delay, left))
            delay = _RETRY_FIRST if woken else min(delay * 2, _RETRY_MAX)

    async def _next_free(self, seconds: float) -> bool:
        """Sleep until a buffer of this pool is freed on this thread (True) or for
        ``seconds`` (False)."""
        freed = anyio.Event()
        entry = (threading.get_ident(), freed)
        self._free_waiters.append(entry)
        self._freed_handle = None  # from now on every free comes to _after_free
        try:
            with anyio.move_on_after(seconds):
                await freed.wait()
        finally:
            self._free_waiters.remove(entry)
        return freed.is_set()

    def _wake_free_waiters(self) -> None:
        """Wake the :meth:`allocate_wait` calls of this thread's event loop. Events are
        not thread-safe, so waiters of other threads are left to their back-off."""
        me = threading.get_ident()
        for thread, freed in tuple(self._free_waiters):
            if thread == me:
                freed.set()

    # -- management ------------------------------------------------------------------------
    @property
    def handle(self) -> Any:
        """The backend's pool handle."""
        return self._handle

    @property
    def release_threshold(self) -> int:
        """Cached bytes the pool keeps across synchronisations before giving memory back."""
        return self._driver.mempool_get_attribute(self._handle, "release_threshold")

    @release_threshold.setter
    def release_threshold(self, value: int) -> None:
        value = _byte_count(value, "release_threshold")
        self._driver.mempool_set_attribute(self._handle, "release_threshold", value)

    def trim(self, keep_bytes: int = 0) -> None:
        """Give cached memory back to the device, keeping at least ``keep_bytes``
        reserved (as ``cuMemPoolTrimTo`` does: the pool reserves memory in blocks, so
        more may stay); memory in use is never given back. Never waits for the GPU.

        Memory freed stream-ordered is given back once its free has run: at once for
        frees on streams that are idle now (e.g. awaited), and, for frees on streams
        still busy (or closed meanwhile), from a background thread once the work
        queued on the device so far has finished. Spare blocks (kept for reuse: see
        :mod:`aiocuda.memory`) are freed on their streams first, and given back so.
        """
        keep_bytes = _byte_count(keep_bytes, "keep_bytes")
        self.device.make_current()
        self._freed_handle = None  # the next free notes its stream again
        if self._spares:
            self._give_back_spares()
        unobserved = self._freed_on.observe(self.device)
        self._driver.mempool_trim_to(self._handle, keep_bytes)
        if unobserved:
            self._freed_on.settle(self.device, self._handle, keep_bytes)

    def statistics(self) -> PoolStatistics:
        """Current and peak usage (see :class:`PoolStatistics`)."""
        get = self._driver.mempool_get_attribute
        h = self._handle
        return PoolStatistics(
            used_bytes=get(h, "used_mem_current") - self._spare_bytes,
            used_bytes_peak=get(h, "used_mem_high"),
            reserved_bytes=get(h, "reserved_mem_current"),
            reserved_bytes_peak=get(h, "reserved_mem_high"),
            allocations=self._allocations,
            frees=self._frees,
            live_buffers=self._allocations - self._frees,
            out_of_memory_recoveries=self._recoveries,
            release_threshold=get(h, "release_threshold"),
            max_size=self.max_size,
        )

    def reset_peaks(self) -> None:
        """Reset ``used_bytes_peak`` and ``reserved_bytes_peak`` to the current values."""
        self._driver.mempool_set_attribute(self._handle, "used_mem_high", 0)
        self._driver.mempool_set_attribute(self._handle, "reserved_mem_high", 0)

    def grant_access(self, peer: Device | int) -> None:
        """Let kernels on ``peer`` read and write this pool's memory
        (``cuMemPoolSetAccess``). Peer copies do not need it."""
        peer_dev = _as_device(peer)
        if peer_dev is self.device:
            return  # the owner always has access (and the driver rejects changing it)
        if not peer_dev.can_access_peer(self.device):
            raise ArgumentError(
                f"device {peer_dev.ordinal} cannot access device {self.device.ordinal}'s memory "
                "(cuDeviceCanAccessPeer says no)",
                code=ResultCode.PEER_ACCESS_UNSUPPORTED,
                name="CUDA_ERROR_PEER_ACCESS_UNSUPPORTED",
            )
        self._driver.mempool_set_access(self._handle, peer_dev.ordinal)

    def has_access(self, device: Device | int) -> bool:
        """Whether kernels on ``device`` may read and write this pool's memory
        (``cuMemPoolGetAccess``); the owner always may."""
        return self._driver.mempool_get_access(self._handle, _as_device(device).ordinal)

    def revoke_access(self, peer: Device | int) -> None:
        """Undo :meth:`grant_access` (``cuMemPoolSetAccess`` with ``PROT_NONE``); nothing to
        undo is no error. The pool's own device keeps its access."""
        peer_dev = _as_device(peer)
        if peer_dev is self.device:
            return  # the driver rejects changing the owner's access
        self._driver.mempool_revoke_access(self._handle, peer_dev.ordinal)

    def __repr__(self) -> str:
        kind = "created" if self._owned else "default"
        try:
            used = format_bytes(
                self._driver.mempool_get_attribute(self._handle, "used_mem_current") - self._spare_bytes
            )
        except CudaError:  # a poisoned or torn-down context
            used = "unknown"
        return (
            f"<MemoryPool {kind} device={self.device.ordinal} used={used} "
            f"live_buffers={self._allocations - self._frees}>"
        )


# Keyed by the Device itself: there is one per backend generation and ordinal (see
# Device.__new__), so a switch of backends finds no stale pool, and for_device costs one
# dict lookup by identity (a key of (backend_generation(), ordinal) cost 0.12 us more on
# the development machine).
_default_pools: dict[Device, MemoryPool] = {}
_pools: weakref.WeakSet[MemoryPool] = weakref.WeakSet()
"""Every pool, for an out-of-memory in one to trim the device's others."""
_pools_lock = threading.Lock()
_current_pools: dict[Device, MemoryPool] = {}


def _forget_spares_in_child() -> None:
    """In a forked child: drop (never free: the driver's state is the parent's) every
    pool's spares, and have its bound driver calls raise the fork error, so that an
    allocation or a free there fails clearly. Hooked here, the hot paths check nothing."""
    forked = _driver.was_forked()
    for pool in list(_pools):
        pool._spares = {}
        pool._spare_bytes = 0
        if forked:  # (the bindings bound before the fork would call the parent's driver)
            pool._alloc_call = pool._free_call = _refused_in_child


def _refused_in_child(*_: object) -> NoReturn:
    raise _driver.fork_error()


os.register_at_fork(after_in_child=_forget_spares_in_child)


def _byte_count(value: object, what: str) -> int:
    """``value`` as a byte count the driver takes (a ``size_t``): an integer, numpy's
    included but not a bool, from 0 to 2**64 - 1; else :class:`ArgumentError` naming
    ``what``."""
    try:
        number = None if isinstance(value, bool) else operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        number = None
    if number is None or not 0 <= number < 1 << 64:
        raise invalid_value(f"{what} must be a non-negative int below 2**64, not {value!r}")
    return number


def _pool_for(device: Device) -> MemoryPool:
    """:meth:`MemoryPool.for_device` of a Device, for the allocation hot paths."""
    pool = _current_pools.get(device)
    return pool if pool is not None else MemoryPool.default(device)


def _destroy_pool(device: Device, handle: Any) -> None:
    _offloop.dispose(device, device._driver.mempool_destroy, handle)  # off the loop: it may wait for the GPU


@final
class DeviceBuffer(metaclass=NoPublicConstructor):
    """A range of device memory from a :class:`MemoryPool` (:meth:`MemoryPool.allocate`,
    or the buffer behind a :class:`~aiocuda.array.DeviceArray`).

    ``ptr`` (an ``int``) raises :class:`~aiocuda.errors.ArgumentError` once the buffer is
    freed, so a stale pointer is never handed to the GPU. Freed by :meth:`free`, a
    ``with`` block, or when collected; each time stream-ordered on the last-use stream.
    """

    # Why __del__ and not weakref.finalize (the project's usual choice): allocate plus
    # free must stay within 30 % of the bare driver calls, about 0.7 us of Python on the
    # GPU machines. Measured per buffer on top of creating the object (CPython 3.12,
    # development machine): weakref.finalize plus detach() on explicit free 0.87 us, a
    # callback weak reference kept in a registry 0.19 us, __del__ on this slots class
    # 0.05 us (it finds _stream cleared after an explicit free and returns). The class
    # has no __dict__ and no references back to itself, so it never sits in a reference
    # cycle nor is resurrected. The finaliser only enqueues a stream-ordered free,
    # swallows errors (recording the last in _last_finaliser_error) and does nothing once the
    # interpreter is exiting.

    __slots__ = ("_pins", "_pool", "_ptr", "_stream", "_waits", "size")
    _factories = "MemoryPool.allocate() or aiocuda.empty()"

    _ptr: Any  # what the backend's allocation returned: an int or int()-convertible
    _pool: MemoryPool
    _stream: Stream | None
    _waits: list[Any] | None
    size: int
    _pins: _Pins  # set by the first _pin() only: the allocation hot path does not fill it

    @property
    def ptr(self) -> int:
        """The device address (raises ArgumentError after :meth:`free`)."""
        if self._stream is None:
            raise invalid_value("use of a freed DeviceBuffer")
        return int(self._ptr)

    @property
    def pool(self) -> MemoryPool:
        """The pool the buffer came from."""
        return self._pool

    @property
    def device(self) -> Device:
        return self._pool.device

    @property
    def stream(self) -> Stream:
        """The stream of the buffer's last recorded use: where it will be freed."""
        stream = self._stream
        if stream is None:
            raise invalid_value("use of a freed DeviceBuffer")
        return stream

    @property
    def freed(self) -> bool:
        return self._stream is None

    def _used_on(self, stream: Stream) -> None:
        """Record that work about to be enqueued on ``stream`` (same device) uses the buffer.

        Moving to another stream records an event on the previous one and makes
        ``stream`` wait for it on the GPU: work on the buffer stays ordered after the work
        before, and the free -- enqueued later on the last stream -- waits for it too.
        """
        previous = self._stream
        if stream is previous:
            if stream._capture is not None:  # captured work (see aiocuda.graph): the capture orders it
                stream._capture.use(self, stream)
            return
        if previous is None:
            raise invalid_value("use of a freed DeviceBuffer")
        capture = stream._capture or previous._capture
        if capture is not None:  # a capture is involved (see aiocuda.graph)
            crossing = capture.crossing(self, previous, stream)
            if crossing is None:
                return
            event = crossing
        else:
            event = previous.record()
        stream.wait(event)
        self._free_after(event)
        self._stream = stream

    def _free_after(self, event: Any) -> None:
        """Free the memory only once ``event`` has completed, besides the work on the
        last-use stream (the end of another stream's use: a DLPack consumer's)."""
        # Locked: a consumer's deleter may add its event from another thread while the
        # loop's thread prunes the list (an event lost there would free memory early).
        with _waits_lock:
            waits = self._waits
            if waits is None:
                waits = self._waits = []
            elif len(waits) >= 8:
                waits[:] = [e for e in waits if not e.query()]
            waits.append(event)

    def free(self, stream: Stream | None = None) -> None:
        """Free now (stream-ordered): on ``stream`` if given -- which must be ordered after
        every use -- else on the last-use stream. Idempotent. A buffer shared with other
        processes (:func:`aiocuda.ipc.share_array`) is unusable here at once, but its
        memory is freed only once the sharing is settled (see :mod:`aiocuda.ipc`)."""
        last = self._stream
        if last is None:
            return
        if stream is not None and stream is not last:
            self._used_on(stream)
            last = stream
        self._stream = None
        ptr = self._ptr
        if not ptr:
            return
        pool = self._pool
        if self._waits is None and not last._closed and last._capture is None:  # the common case, inlined
            size = self.size
            # Not for a pool shared with other processes: the driver reuses an exported
            # block only once every importer has let it go; a spare would not wait.
            if (
                pool._spare_bytes + size <= SPARE_BYTES
                and last.owned
                and not pool._free_waiters
                and not pool.exportable
            ):
                held = pool._spares.get((last, size))
                if held is None:
                    held = pool._spares_for(last, size)
                held.append(ptr)
                pool._spare_bytes += size
                pool._frees += 1
                return
            free = pool._free_call  # a local, as in MemoryPool.allocate
            try:
                (err,) = free(ptr, last._handle)
                if not err:
                    pool._frees += 1
                    if last._handle is not pool._freed_handle:
                        pool._after_free(last)
                    return
                pool._fail(err, "cuMemFreeAsync")
            except CudaError:
                pass  # e.g. no context bound on this (finaliser's) thread: the general path binds it
        if pool.exportable and self._defer_free(last):
            return
        pool._free_on(ptr, last, self._waits)

    def _pin(self) -> None:
        """Keep the memory allocated, whatever :meth:`free` is called, until as many
        :meth:`_unpin` calls (an export to other processes, which may use the memory
        until the export is settled). A free meanwhile makes the buffer unusable here
        at once and is carried out by the last unpin."""
        if self._stream is None:
            raise invalid_value("use of a freed DeviceBuffer")
        # A pinned buffer must reach _defer_free: no waits (None) takes free()'s
        # inlined path, which does not look at pins; an empty list waits for nothing.
        if self._waits is None:
            self._waits = []
        with _pins_lock:
            pins = getattr(self, "_pins", None)
            if pins is None:
                pins = self._pins = _Pins()
            pins.count += 1

    def _unpin(self) -> None:
        """Undo one :meth:`_pin`; the last one frees the buffer if a free was asked for
        meanwhile (on the stream it was asked on)."""
        pins = self._pins
        with _pins_lock:
            pins.count -= 1
            if pins.count:
                return
            last, pins.freed_on = pins.freed_on, None
        if last is not None:
            self._pool._free_on(self._ptr, last, self._waits)

    def _defer_free(self, last: Stream) -> bool:
        """(free() of an IPC pool's buffer.) Whether the buffer is pinned: then its free
        on ``last`` is left to the last :meth:`_unpin`."""
        pins = getattr(self, "_pins", None)  # unset on a buffer never pinned
        if pins is None:
            return False
        with _pins_lock:
            if pins.count == 0:
                return False
            pins.freed_on = last
        return True

    def _free_idle(self, stream: Stream) -> None:
        """Free on ``stream`` without ordering it after the buffer's uses: only for a
        buffer whose every use the host has seen complete (the executor, once a chunk's
        download has been awaited).

        Why not :meth:`free`: that frees on the last-use stream, and the pool reuses
        memory freed on one stream for an allocation on another only when it can prove
        the free finished -- often it cannot, and maps new memory instead (hundreds of
        microseconds for tens of MiB, and the pool keeps growing). Freed on the stream
        the next allocation will use, the memory is reused at once.
        """
        if self._stream is None:
            return
        # As if last used on ``stream``, with no uses to wait for: freed by free()'s
        # inlined path, which binds no context first (the executor frees each chunk's
        # memory so: one driver call, not two).
        self._stream = stream
        self._waits = None
        self.free()

    def _forget(self) -> None:
        """Count the buffer freed without freeing it: its memory belonged to a captured
        graph, which frees it itself."""
        if self._stream is not None:
            self._stream = None
            self._waits = None
            self._pool._frees += 1

    def __del__(self, _exiting: Callable[[], bool] = exiting) -> None:
        # (bound as a default: a buffer collected in the interpreter's last moments finds
        # this module's globals set to None)
        if self._stream is not None and not _exiting():
            if _threads_capturing and _capturing.collected is not None:
                # Collected while this thread captures a stream: a free now would be a
                # driver call in the capture's way (the driver invalidates the capture).
                _capturing.collected.append(self)
                return
            try:
                self.free()
            except Exception as exc:  # a finaliser cannot raise; see the class docstring
                global _last_finaliser_error
                _last_finaliser_error = exc

    def __enter__(self) -> DeviceBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()

    def __repr__(self) -> str:
        state = "freed" if self.freed else f"ptr={int(self._ptr):#x}"
        return f"<DeviceBuffer {state} size={self.size} device={self._pool.device.ordinal}>"


_new_buffer = object.__new__


class _Pins:
    """The pins of one :class:`DeviceBuffer` (see ``DeviceBuffer._pin``): how many, and
    the stream of a free asked for while pinned."""

    __slots__ = ("count", "freed_on")

    def __init__(self) -> None:
        self.count = 0
        self.freed_on: Stream | None = None


_waits_lock = threading.Lock()
"""Guards :attr:`DeviceBuffer._waits` as it grows (:meth:`DeviceBuffer._free_after`)."""
_pins_lock = threading.Lock()
"""Orders pins, unpins and deferred frees, which come from any thread (an export settles
on the sharing service's thread, a buffer is freed on a loop's or a finaliser's)."""


class _Captures(threading.local):
    """This thread's captures: ``depth`` (how many are in progress) and ``collected`` (the
    buffers collected meanwhile, freed when the last one ends)."""

    # Defaults as class attributes: a missing attribute of a thread-local, read with
    # getattr and a default, raises and catches an AttributeError (0.45 to 0.85 us on
    # the development machine, against 0.05 us for this read).
    depth = 0
    collected: list[DeviceBuffer] | None = None
    closed: list[tuple[MemoryPool, Stream]] | None = None
    """Streams closed meanwhile, with a pool that keeps spares for each: given back then too."""


_capturing = _Captures()

# Every collected buffer asks whether its thread captures; while no thread does (nearly
# always), this global answers, for 0.05 us less than a read of the thread-local.
_threads_capturing = 0
_threads_capturing_lock = threading.Lock()


def _defer_frees() -> None:
    """For the graph layer, when this thread begins a capture: buffers collected on it
    from now on are freed by :func:`_end_deferral`, not inside the capture."""
    global _threads_capturing
    depth = _capturing.depth
    if depth == 0:
        _capturing.collected = []
        _capturing.closed = []
        with _threads_capturing_lock:
            _threads_capturing += 1
    _capturing.depth = depth + 1


def _end_deferral() -> None:
    """When a capture of this thread ends: after the last one, free what was collected."""
    global _threads_capturing
    _capturing.depth -= 1
    if _capturing.depth == 0:
        with _threads_capturing_lock:
            _threads_capturing -= 1
        collected, _capturing.collected = _capturing.collected or [], None
        closed, _capturing.closed = _capturing.closed or [], None
        for buffer in collected:
            buffer.__del__()  # the allocation hot path fills the slots itself (see _util)
        for pool, stream in closed:
            with contextlib.suppress(CudaError):  # a poisoned context: its memory goes with it
                pool._give_back_spares(of=stream)
