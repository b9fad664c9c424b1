"""A request lane: one request's stream, staging memory and scratch while it holds a lease,
and the request priorities its streams serve.

See :mod:`aiocuda.lanes` for the user's view; the pool that leases lanes is
:mod:`aiocuda._executor.lanes`. Invariants the code keeps:

* Staging regions are handed out bump-style within a lease and recycled once the lane
  has been awaited (every copy that used them has then completed).
* Whatever enqueued work still reads or writes when a lease ends without its await is
  handed to the stream's ``hold`` (host arrays) or freed stream-ordered (device arrays),
  never released early.
* A lane takes work only while it is leased (or while its pool starts it): a stale
  reference cannot reach the next lease's memory.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Generator, Hashable
from types import FrameType
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from .._memory import copies as _copies
from .._memory import host_copy
from .._memory.pinned import PinnedAllocation, host_address, take_cached
from .._util import format_bytes, invalid_value, outside_aiocuda
from ..array import DeviceArray, _check_writable, empty
from ..device import Device
from ..errors import BlockingCallWarning, ContextPoisonedError, CudaError
from ..host import is_pinned, pinned_empty
from ..memory import DeviceBuffer, MemoryPool
from ..stream import Stream
from . import lane_graphs

__all__ = ["PRIORITIES", "Lane", "Priority", "stream_priority"]

Priority = Literal["normal", "high"]
PRIORITIES: tuple[Priority, ...] = ("normal", "high")
"""Request priorities, least urgent first."""

_ALIGN = 256
_memmove = host_copy.memmove


def _warn_pinning(nbytes: int, staging: int) -> None:
    warnings.warn(
        f"a lane's copy of {format_bytes(nbytes)} of pageable memory did not fit what was left of its "
        f"{format_bytes(staging)} staging and found no free page-locked block of that size: pinning one "
        "blocked the event loop's thread (1-40 ms). Give Lanes(staging=...) the bytes of a request's copies, "
        "or copy from and to pinned arrays (aiocuda.pinned_empty) made at start-up",
        BlockingCallWarning,
        stacklevel=outside_aiocuda(),
    )


def stream_priority(device: Device, priority: Priority) -> int:
    """The stream priority a request priority stands for on ``device``: ``"normal"`` is
    the least urgent the driver has (the default of every stream), ``"high"`` the most."""
    least, greatest = Stream.priority_range(device)
    return greatest if priority == "high" else least


class Lane:
    """One request's stream and memory while it holds a lease (see :mod:`aiocuda.lanes`).

    Attributes:
        stream: the stream to enqueue the request's work on (the lease's priority).
        device: the lane's device.
        index: the lane's position in its :class:`Lanes`.
        state: what the ``setup`` function returned for this lane at start-up (scratch
            arrays, a library's warmed-up objects); ``None`` without one. It stays with
            the lane from lease to lease: a request that replaces it replaces it for
            every later one, so put only the lane's own memory in it (arrays from
            :meth:`empty` during a lease are freed when the lease ends).
    """

    __slots__ = (
        "_awaited",
        "_buffers",
        "_copy_outs",
        "_failure",
        "_graphs",
        "_holder",
        "_keep",
        "_kept_for_life",
        "_leased",
        "_pool",
        "_settles",
        "_staged",
        "_staging",
        "_staging_ptr",
        "_staging_size",
        "_streams",
        "_warned_works",
        "device",
        "index",
        "state",
        "stream",
    )

    def __init__(self, index: int, device: Device, streams: dict[Priority, Stream], staging: int) -> None:
        self.index = index
        self.device = device
        self._streams = streams
        self.stream: Stream = streams["normal"]
        self.state: Any = None
        self._pool = MemoryPool.for_device(device)
        self._staging = pinned_empty(staging, np.uint8, device=device) if staging else None
        self._staging_ptr = int(self._staging.ctypes.data) if self._staging is not None else 0
        self._staging_size = staging
        self._staged = 0
        """Bytes of the staging block handed out since the lane was last awaited."""
        self._settles = 0
        """How many times the lane's copies were settled (:meth:`_settle`)."""
        self._awaited = False
        """Whether this lease awaited :attr:`stream` and staged nothing since: the stream
        is then idle as far as the lane's own memory goes (see Lanes._acquire)."""
        self._leased = True
        """Whether the lane may be used: during a lease, and while its pool starts it."""
        self._failure: ContextPoisonedError | None = None
        """The error an await of this lease met, if the device failed: for the pool's
        :attr:`Lanes.failure` even when the request handles it."""
        self._buffers: list[DeviceBuffer] = []
        """Device memory of the current lease (:meth:`empty`), freed when it ends."""
        self._kept_for_life: list[DeviceBuffer] = []
        """Device memory ``setup`` made: the lane's own, freed when the lanes close."""
        self._keep: list[Any] = []
        """Host arrays that enqueued copies use, kept until the lane is awaited."""
        self._copy_outs: list[tuple[int, int, int]] = []
        """Downloads through staging to finish once awaited: (host address, staging address, bytes)."""
        self._graphs: dict[Any, Any] = {}
        """What :meth:`replay` knows of each ``(work, key)``: warmed up, its graph, or eager."""
        self._warned_works = False
        self._holder: FrameType | None = None
        """The frame of the ``async with`` block holding the lease (see Lanes._check_not_holding)."""

    # -- graphs --------------------------------------------------------------------------------
    def replay(self, work: Callable[[Lane], object], *, key: Hashable = None) -> None:
        """Enqueue ``work(lane)``'s device work on :attr:`stream`, captured once per lane
        into a graph and replayed per request: whatever ``work`` enqueues, a replay costs
        one launch.

        The first call on the lane (per ``work`` and ``key``) runs ``work`` as it is (it
        loads its kernels' modules and warms up the libraries it calls), the second
        captures it and launches the graph, later ones only launch the graph. So
        ``work`` must enqueue the same work every time, on ``lane.stream``, on the lane's
        own memory (arrays kept in ``lane.state``): a replay repeats the pointers and
        scalars of the capture. Give variants (a batch size, ...) their own ``key``, and
        pass one long-lived function (a closure made per request is a new ``work`` every
        time: never replayed; a lane keeps at most ``MAX_WORKS`` = 64 of them). Copies in
        and out stay around it (a lane's copy of pageable memory cannot be captured)::

            lane.upload(host, out=lane.state.x)      # request data into the lane's array
            lane.replay(model_step)                   # the kernels, one launch
            result = lane.download(lane.state.y)
            await lane

        A replay is not checked against ``work``: an array of ``lane.state`` replaced
        after the capture is not followed (the graph keeps the old one alive and uses
        it); give each new set of arrays its own ``key``. Work that cannot be captured
        (see :mod:`aiocuda.graph`), or that uses memory of the request (:meth:`empty`,
        or :meth:`upload` without ``out=``, during the lease: freed when it ends), runs
        as it is from then on, with a warning logged once. Returns at once; ``await
        lane`` waits.
        """
        self._check_leased()
        lane_graphs.replay(self, work, key)

    # -- memory --------------------------------------------------------------------------------
    def empty(self, shape: int | tuple[int, ...], dtype: npt.DTypeLike = np.float32) -> DeviceArray:
        """A device array for this request, allocated stream-ordered on :attr:`stream` from
        the device's pool and freed (stream-ordered) when the lease ends: as cheap as
        reusing a preallocated one. Keep nothing from it beyond the lease.

        Called from ``setup`` (at start-up), the array is the lane's own instead: it lives
        until the lanes close (keep it in ``lane.state``)."""
        self._check_leased()
        array = empty(shape, dtype, stream=self.stream, pool=self._pool)
        self._buffers.append(array.buffer)
        return array

    def upload(self, host: npt.ArrayLike, out: DeviceArray | None = None) -> DeviceArray:
        """Enqueue the copy of ``host`` to the device on :attr:`stream` and return the
        device array (``out``, or a new one as from :meth:`empty`). Returns at once: the
        copy runs in stream order.

        Pageable ``host`` memory is copied into the lane's page-locked staging first (on
        the calling thread: meant for request-sized data; stage megabytes with
        :func:`aiocuda.to_device` instead), so it may be changed right away. Beyond what
        is left of the staging, a copy takes a free block of aiocuda's pinned cache; if
        there is none of that size, pinning one blocks the loop (1-40 ms) and warns
        (:class:`~aiocuda.errors.BlockingCallWarning`: make ``staging`` larger), and one
        more is pinned in the background for the next such copy. Pinned
        memory (:func:`aiocuda.pinned_empty`) is copied directly by the GPU when the
        stream gets there: leave it unchanged until the lane is awaited (it is kept
        alive until then).
        """
        self._check_leased()
        array = np.asarray(host)
        if array.dtype.hasobject:
            raise invalid_value(f"dtype {array.dtype} holds Python objects and cannot be copied to the device")
        if not array.flags.c_contiguous:
            array = np.ascontiguousarray(array)
        if out is None:
            out = self.empty(array.shape, array.dtype)
        else:
            self._check_device_array(out, array.shape, array.dtype, "out")
            _check_writable(out, "out")
            out.buffer._used_on(self.stream)
        nbytes = array.nbytes
        if not _copies.upload(out.ptr, array, self.stream, keep=self._keep):  # pageable: staged here
            staged = self._stage(nbytes)
            _memmove(staged, host_address(array), nbytes)
            _copies.enqueue_upload(out.ptr, staged, nbytes, self.stream)
        return out

    def download(self, array: DeviceArray, out: npt.NDArray[Any] | None = None) -> npt.NDArray[Any]:
        """Enqueue the copy of ``array`` to the host on :attr:`stream` and return the host
        array (``out``, C-contiguous and writeable, or a new one). Its contents are valid
        once the lane has been awaited (``await lane``), not before; a lease that ends
        with its downloads not done warns (``RuntimeWarning``): they are never filled.

        Pinned ``out`` memory is written by the DMA directly; pageable memory goes
        through the lane's staging (or beyond it, as for :meth:`upload`) and is filled
        when the await completes.
        """
        self._check_leased()
        if not isinstance(array, DeviceArray):
            raise TypeError(f"download takes a DeviceArray, not {type(array).__name__}")
        self._check_device_array(array, array.shape, array.dtype, "array")
        if out is None:
            out = np.empty(array.shape, array.dtype)
        elif not isinstance(out, np.ndarray):
            raise TypeError(f"out must be a numpy array, not {type(out).__name__}")
        elif out.shape != array.shape or out.dtype != array.dtype:
            raise invalid_value(
                f"out has shape {out.shape} and dtype {out.dtype}; expected {array.shape} {array.dtype}"
            )
        elif not (out.flags.c_contiguous and out.flags.writeable):
            raise invalid_value("out must be C-contiguous and writeable")
        array.buffer._used_on(self.stream)
        if not _copies.download(out, array.ptr, self.stream, keep=self._keep):  # pageable: staged here
            self._download_staged(array, out)
        return out

    def _download_new(self, array: DeviceArray) -> npt.NDArray[Any]:
        """:meth:`download` into a new array, for a caller that knows ``array`` to be a
        C-contiguous array of the lane's device, already used on :attr:`stream`, that fits
        what is left of the staging (:meth:`_has_room`): no checks, and no look-up of
        whether the new array is pinned."""
        return self._download_staged(array, np.empty(array.shape, array.dtype))

    def _download_staged(self, array: DeviceArray, out: npt.NDArray[Any]) -> npt.NDArray[Any]:
        """Enqueue the download of ``array`` into the staging; ``out`` is filled from
        there by the lane's await."""
        nbytes = out.nbytes
        staged = self._stage(nbytes)
        _copies.enqueue_download(staged, array.ptr, nbytes, self.stream)
        self._copy_outs.append((host_address(out), staged, nbytes))
        self._keep.append(out)
        return out

    def _check_leased(self) -> None:
        if not self._leased:
            raise RuntimeError(
                f"lane {self.index} is not leased to this request (its lease ended): use a lane, "
                "await included, only inside its 'async with lanes.lease() as lane:' block"
            )

    def _check_device_array(self, array: DeviceArray, shape: tuple[int, ...], dtype: Any, what: str) -> None:
        if not isinstance(array, DeviceArray):
            raise TypeError(f"{what} must be a DeviceArray, not {type(array).__name__}")
        if array.shape != shape or array.dtype != dtype:
            raise invalid_value(f"{what} has shape {array.shape} and dtype {array.dtype}; expected {shape} {dtype}")
        if not array.is_c_contiguous:
            raise invalid_value(f"{what} must be C-contiguous")
        if array.device is not self.device:
            raise invalid_value(f"{what} is on device {array.device.ordinal}, the lane on device {self.device.ordinal}")

    def _fits(self, host: npt.NDArray[Any]) -> bool:
        """Whether a copy of ``host`` goes through the lane without borrowing memory:
        pinned, or small enough for what is left of the staging block."""
        return self._has_room(host.nbytes) or is_pinned(host)

    def _has_room(self, nbytes: int) -> bool:
        """Whether what is left of the staging block takes a copy of ``nbytes``."""
        return self._staged + nbytes <= self._staging_size

    def _stage(self, nbytes: int) -> int:
        """A page-locked region of ``nbytes`` for a copy of this lease: from the lane's
        staging block while it lasts, else a block from the pinned cache kept until the
        lane is awaited."""
        capture = self.stream._capture
        if capture is not None:  # (the host half of the copy would not be replayed)
            raise capture.refuse(
                "a lane's copy of pageable host memory",
                "it goes through the lane's staging on the host when enqueued, which a replay does not "
                "repeat: copy from and to page-locked arrays (aiocuda.pinned_empty) in replayed work",
            )
        self._awaited = False
        start = self._staged
        end = start + nbytes
        if end <= self._staging_size:
            self._staged = end + (-end % _ALIGN)
            return self._staging_ptr + start
        # (its spare for the next spill is asked for here, before the warning, which a
        # service may have made an error: after it, nothing was pinned, and every later
        # spill of that size raised too)
        spill = take_cached(self.device, nbytes)
        if spill is None:
            _warn_pinning(nbytes, self._staging_size)
            spill = PinnedAllocation(self.device, nbytes)
        self._keep.append(spill)
        return spill.ptr

    # -- waiting -------------------------------------------------------------------------------
    def __await__(self) -> Generator[Any, Any, None]:
        """Wait for everything enqueued on :attr:`stream` so far, then fill the host
        arrays of :meth:`download`. The one await a request needs.

        Tasks of one request may share its lane: an await that finds copies enqueued
        by another task while it waited waits for those too."""
        self._check_leased()
        # Its settle needs everything it fills or recycles done: what another task staged
        # meanwhile moved _staged, what it kept (spills, pinned arrays) _keep, and another
        # await's settle _settles.
        staged, kept, settles = self._staged, len(self._keep), self._settles
        while True:
            try:
                yield from self.stream.__await__()
            except ContextPoisonedError as exc:
                self._failure = exc
                raise
            if staged == self._staged and kept == len(self._keep) and settles == self._settles:
                break
            staged, kept, settles = self._staged, len(self._keep), self._settles  # again, for those
        self._awaited = True
        self._settle()

    def _settle(self) -> None:
        """Everything enqueued so far has completed: finish downloads, recycle staging."""
        for dst, staged, nbytes in self._copy_outs:
            _memmove(dst, staged, nbytes)
        self._copy_outs.clear()
        self._keep.clear()
        self._staged = 0
        self._settles += 1

    # -- leases --------------------------------------------------------------------------------
    def _begin(self, priority: Priority) -> None:
        self.stream = self._streams[priority]
        self._awaited = False
        self._leased = True

    def _end(self) -> None:
        """The lease is over: free its device memory stream-ordered, and keep host memory
        that copies not yet awaited use alive until they have run."""
        with contextlib.suppress(CudaError):  # a poisoned context: the GPU will never run them
            for buffer in self._buffers:
                buffer.free()
            if self._keep:
                self.stream.hold(*self._keep)
        self._buffers.clear()
        self._keep.clear()
        self._copy_outs.clear()
        self._staged = 0  # the next lease starts once the stream is idle (Lanes._acquire)
        self._leased = False
        self._holder = None

    @property
    def streams(self) -> tuple[Stream, ...]:
        """The lane's streams, one per priority it serves."""
        return tuple(self._streams.values())

    def __repr__(self) -> str:
        return f"<Lane {self.index} device={self.device.ordinal} staging={self._staging_size}>"
