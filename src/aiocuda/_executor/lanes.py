"""Request lanes: long-lived streams with staging memory, leased to one request at a time.

See :mod:`aiocuda.lanes` for the user's view. Invariants the code keeps:

* A lane is handed to a lease only once everything earlier leases enqueued on it has
  finished (:meth:`Lanes._acquire` queries the previous lease's stream, and awaits it in
  the rare case a lease ended without awaiting its work: a cancelled request). So host
  memory the lane owns -- its staging block, the user's ``state`` -- may be written at
  the start of a lease without any ordering.
* Staging regions are handed out bump-style within a lease and recycled once the lane
  has been awaited (every copy that used them has then completed).
* Whatever enqueued work still reads or writes when a lease ends without its await is
  handed to the stream's ``hold`` (host arrays) or freed stream-ordered (device arrays),
  never released early.
* A lane takes work only while it is leased (or while its pool starts it): a stale
  reference cannot reach the next lease's memory.
* A leased lane belongs to its request until the lease ends, whatever the pool does:
  :meth:`Lanes.close` closes the lanes on the free list and each leased one as its
  lease ends (``_hand_over``), so no stream or staging block is released under a request.
* A pool belongs to the event loop that started it: its free list, its waiting requests
  and the events that wake them are that loop's, so a lease from another thread is
  refused (:meth:`Lanes._acquire`); the streams themselves could be awaited anywhere.
* A request never waits for a lane of a pool while it holds one of it: it would wait for
  itself once every lane is leased. Each lease notes the frame of its ``async with``
  block (``Lane._holder``); a lease that has to wait looks for those frames among its
  own callers (:meth:`Lanes._check_not_holding`) and raises instead. (The block's frame
  rather than the task: asyncio's ``current_task()`` cost 0.3 us a lease, a
  ``ContextVar`` set and reset 0.25 and would take a task started inside the block for
  the request itself. A block in an async generator is off the stack while its consumer
  runs, and goes unseen.)
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import math
import sys
import threading
from collections.abc import Callable, Generator, Hashable
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any, Literal, NoReturn

import anyio
import anyio.to_thread
import numpy as np
import numpy.typing as npt

from .._completion.event_pool import EventPool
from .._completion.loops import being_cancelled
from .._memory import copies as _copies
from .._memory import host_copy, library_streams
from .._memory.pinned import host_address
from .._util import at_least, invalid_value
from ..array import DeviceArray, empty
from ..device import Device, _as_device
from ..errors import ClosedError, ContextPoisonedError, CudaError
from ..host import is_pinned, pinned_empty
from ..memory import DeviceBuffer, MemoryPool
from ..stream import Stream
from . import lane_graphs

__all__ = [
    "PRIORITIES",
    "Lane",
    "Lanes",
    "LanesStatistics",
    "Priority",
    "Setup",
    "default_count",
    "stream_priority",
]

Priority = Literal["normal", "high"]
PRIORITIES: tuple[Priority, ...] = ("normal", "high")
"""Request priorities, least urgent first."""

Setup = Callable[["Lane"], Any]
"""``setup(lane)`` (sync or async) prepares one lane at start-up; its result is ``lane.state``."""

_ALIGN = 256
_memmove = host_copy.memmove
_thread_id = threading.get_ident  # a lease from another thread is refused: 0.05 us a lease


def stream_priority(device: Device, priority: Priority) -> int:
    """The stream priority a request priority stands for on ``device``: ``"normal"`` is
    the least urgent the driver has (the default of every stream), ``"high"`` the most."""
    least, greatest = Stream.priority_range(device)
    return greatest if priority == "high" else least


def default_count(device: Device) -> int:
    """Lanes per device when not given: a quarter of the SMs, between 8 and 64."""
    # One lane is one request in flight on the GPU. Kernels of a request rarely fill the
    # device, so several run side by side; a quarter of the SMs (33 on an H100) keeps the
    # device fed while the rest of the requests wait on the host, costing nothing.
    return max(8, min(64, device.multiprocessor_count // 4))


class Lane:
    """One request's stream and memory while it holds a lease (see :mod:`aiocuda.lanes`).

    Attributes:
        stream: the stream to enqueue the request's work on (the lease's priority).
        device: the lane's device.
        index: the lane's position in its :class:`Lanes`.
        state: what the ``setup`` function returned for this lane at start-up (scratch
            arrays, a library's warmed-up objects); ``None`` without one.
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

        Work that cannot be captured (see :mod:`aiocuda.graph`) runs as it is from then
        on, with a warning logged once. Returns at once; ``await lane`` waits.
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
        copy runs in stream order, and ``host`` may be changed right away.

        Pageable ``host`` memory is copied into the lane's page-locked staging first (on
        the calling thread: meant for request-sized data; stage megabytes with
        :func:`aiocuda.to_device` instead). Pinned memory is copied directly and kept
        alive until the lane is awaited.
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
        once the lane has been awaited (``await lane``), not before.

        Pinned ``out`` memory is written by the DMA directly; pageable memory goes
        through the lane's staging and is filled when the await completes.
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
        spill = pinned_empty(nbytes, np.uint8, device=self.device)
        self._keep.append(spill)
        return int(spill.ctypes.data)

    # -- waiting -------------------------------------------------------------------------------
    def __await__(self) -> Generator[Any, Any, None]:
        """Wait for everything enqueued on :attr:`stream` so far, then fill the host
        arrays of :meth:`download`. The one await a request needs."""
        self._check_leased()
        try:
            yield from self.stream.__await__()
        except ContextPoisonedError as exc:
            self._failure = exc
            raise
        self._awaited = True
        self._settle()

    def _settle(self) -> None:
        """Everything enqueued so far has completed: finish downloads, recycle staging."""
        for dst, staged, nbytes in self._copy_outs:
            _memmove(dst, staged, nbytes)
        self._copy_outs.clear()
        self._keep.clear()
        self._staged = 0

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


@dataclass(frozen=True, slots=True)
class LanesStatistics:
    """A snapshot of a :class:`Lanes` (:meth:`Lanes.statistics`)."""

    lanes: int
    """Lanes in the pool."""
    leased: int
    """Lanes held by requests now."""
    waiting: int
    """Requests waiting for a lane."""
    leases: int
    """Leases ended so far."""
    failed: bool
    """Whether the device's context was poisoned (see :attr:`Lanes.failure`)."""


class _Waiter:
    __slots__ = ("event", "lane")

    def __init__(self) -> None:
        self.event = anyio.Event()
        self.lane: Lane | None = None


class _Lease:
    """``async with lanes.lease() as lane``: the lane, held for the block."""

    __slots__ = ("_entered", "_lane", "_lanes", "_priority")

    def __init__(self, lanes: Lanes, priority: Priority) -> None:
        self._lanes = lanes
        self._priority = priority
        self._lane: Lane | None = None
        self._entered = False

    async def __aenter__(self) -> Lane:
        if self._entered:
            raise RuntimeError("this lease is in use: call lanes.lease() once per request")
        self._entered = True
        # The block's frame, for Lanes._check_not_holding: 0.02 us.
        holder = sys._getframe(1)
        try:
            self._lane = lane = await self._lanes._acquire(self._priority)
        except BaseException:
            self._entered = False
            raise
        lane._holder = holder
        return lane

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        lane, self._lane = self._lane, None
        self._entered = False
        if lane is None:
            return
        if exc is None and lane._copy_outs:
            # Downloads the block did not await the lane for (it awaited lane.stream, say):
            # filled if their copies are done, rather than lost; never waited for.
            with contextlib.suppress(CudaError):
                if lane.stream.query():
                    lane._settle()
        self._lanes._release(lane, exc)


class Lanes:
    """A pool of request lanes on one device (see :mod:`aiocuda.lanes`).

    Args:
        device: a :class:`~aiocuda.device.Device` or ordinal (default 0).
        count: how many lanes, i.e. requests on the GPU at once (default: from the
            device, :func:`default_count`).
        priorities: the priorities leases may ask for: ``("normal",)`` or
            ``("normal", "high")`` (a second stream per lane, of the device's greatest
            priority).
        staging: page-locked bytes per lane for copies of pageable host memory
            (default 1 MiB); a request that needs more borrows cached pinned blocks.
        setup: ``setup(lane)``, sync or async, run once per lane at start-up on the event
            loop; its result becomes ``lane.state``. The lane is awaited after it.

    Use as ``async with Lanes(...) as lanes:`` (in a lifespan), or call :meth:`start`
    and :meth:`aclose`.
    """

    def __init__(
        self,
        device: Device | int | None = None,
        *,
        count: int | None = None,
        priorities: tuple[Priority, ...] = ("normal",),
        staging: int = 1 << 20,
        setup: Setup | None = None,
    ) -> None:
        count = None if count is None else at_least(count, 1, "count")
        staging = at_least(staging, 0, "staging (bytes)")
        unknown = [p for p in priorities if p not in PRIORITIES]
        if unknown or "normal" not in priorities:
            raise ValueError(f"priorities must include 'normal' and be among {PRIORITIES}, got {priorities!r}")
        self._device = _as_device(device)
        self._count = count
        self._priorities: tuple[Priority, ...] = tuple(p for p in PRIORITIES if p in priorities)
        self._staging = staging
        self._setup = setup
        self._lanes: tuple[Lane, ...] = ()
        self._free: list[Lane] = []
        self._last: dict[int, Stream] = {}
        """Each lane's stream of its last lease: where earlier work may still be running."""
        self._waiters: dict[Priority, collections.deque[_Waiter]] = {p: collections.deque() for p in PRIORITIES}
        self._state: Literal["new", "starting", "open", "closing", "closed"] = "new"
        self._out = 0
        """Lanes taken from the free list and not yet given back (leased, or being handed over)."""
        self._all_back: anyio.Event | None = None
        """Set when every lane is back (or the pool is closed): what :meth:`aclose` waits on."""
        self._started: anyio.Event | None = None
        self._closed: anyio.Event | None = None
        """Set once :meth:`aclose` has closed the pool: other calls of it wait for it."""
        self._leases = 0
        self._thread = 0
        """The thread of the event loop that started the pool: leases come from it."""
        self.failure: ContextPoisonedError | None = None
        """The error that poisoned the device's context, once a lease has seen one (its
        ``await lane``, handled or not, or the error its block raised); every later lease
        then fails at once with a :class:`ContextPoisonedError`."""

    @property
    def device(self) -> Device:
        return self._device

    @property
    def lanes(self) -> tuple[Lane, ...]:
        """Every lane (read-only use: lease them to use them)."""
        return self._lanes

    # -- lifetime ------------------------------------------------------------------------------
    async def __aenter__(self) -> Lanes:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Create every lane's streams and staging (off the event loop: they are blocking
        driver calls), then run ``setup`` on each lane and await it (on the loop: libraries
        keep per-thread state too)."""
        if self._state != "new":
            raise RuntimeError(f"Lanes.start() called twice (the pool is {self._state})")
        self._state = "starting"
        self._started = anyio.Event()
        self._thread = _thread_id()
        try:
            lanes = await anyio.to_thread.run_sync(self._build)
            self._lanes = lanes
            for lane in lanes:
                for stream in lane.streams:
                    lane.stream = stream
                    await lane  # the engine learns the stream; the event pool is filled
                lane.stream = lane._streams["normal"]
                if self._setup is not None:
                    state = self._setup(lane)
                    if inspect.isawaitable(state):
                        state = await state
                    lane.state = state
                    lane._kept_for_life.extend(lane._buffers)  # setup's memory is the lane's own
                    lane._buffers.clear()
                    for stream in lane.streams:
                        lane.stream = stream
                        await lane
                    lane.stream = lane._streams["normal"]
                self._last[lane.index] = lane.stream
                lane._leased = False
        except BaseException:
            self._free = list(self._lanes)
            self.close()
            raise
        finally:
            self._started.set()
        self._free = list(reversed(lanes))  # lane 0 is leased first
        if self._state == "starting":
            self._state = "open"
        elif self._state == "closed":  # closed at once meanwhile (else aclose() goes on now)
            self.close()

    def _build(self) -> tuple[Lane, ...]:
        device = self._device
        device.make_current()
        count = self._count if self._count is not None else default_count(device)
        value = {p: stream_priority(device, p) for p in self._priorities}
        lanes = []
        for index in range(count):
            streams = {p: Stream(device, priority=value[p]) for p in self._priorities}
            lanes.append(Lane(index, device, streams, self._staging))
        # Awaits and holds record pooled events: make enough for every lane at once now
        # rather than on the loop under load.
        pool = EventPool.for_device(device)
        events = [pool.acquire() for _ in range(4 * count * len(self._priorities))]
        for event in events:
            pool.release(event)
        return tuple(lanes)

    async def aclose(self) -> None:
        """Shut down gracefully: new leases fail with :class:`~aiocuda.errors.ClosedError`;
        requests holding or already waiting for a lane finish; then every lane's stream is
        awaited and closed (except streams PyTorch or CuPy were given: they live until the
        process exits) and the staging memory is released. Called again meanwhile, it
        waits for the first call.

        Cancelled, or called by an asyncio task unwinding from its cancellation (a
        lifespan's exit on uvicorn's second Ctrl+C), it closes the pool at once instead,
        as :meth:`close` does: nothing is freed under work still running on the GPU.
        Called (not cancelled) by a request that holds one of the lanes, it raises
        ``RuntimeError`` (it would wait for that lane) and leaves the pool open.
        """
        if self._state in ("closed", "new"):
            self._state = "closed"
            return
        if being_cancelled():  # a task unwinding from its cancellation: no waiting
            self.close()
            return
        held = self._held_here()
        if held is not None and anyio.current_effective_deadline() > -math.inf:  # (cancelled: it waits for nothing)
            raise RuntimeError(
                f"aclose() was called by a request holding lane {held.index} of these lanes (device "
                f"{self._device.ordinal}): it would wait for that lane to come back. Close them after the "
                "block, or call close(), which leaves each leased lane to its request"
            )
        if self._closed is not None:  # another task is closing the pool: wait for it
            await self._closed.wait()
            return
        self._closed = closed = anyio.Event()
        try:
            starting = self._state == "starting"
            self._state = "closing"
            if starting:  # let start() finish first (it leaves the pool closing)
                assert self._started is not None
                await self._started.wait()
            while self._state == "closing" and (self._out or any(self._waiters.values())):
                self._all_back = anyio.Event()
                await self._all_back.wait()
            for lane in self._lanes if self._state == "closing" else ():
                for stream in lane.streams:
                    with contextlib.suppress(CudaError):
                        await stream
        finally:
            self.close()
            closed.set()

    def close(self) -> None:
        """Close at once: new leases fail, and so do requests waiting for a lane
        (:class:`~aiocuda.errors.ClosedError`); the streams of lanes not leased are closed
        now (work already enqueued still runs) and their staging released once that work
        is done; a lane still leased is closed likewise when its lease ends. Prefer
        :meth:`aclose`."""
        self._state = "closed"
        for queue in self._waiters.values():
            while queue:
                queue.popleft().event.set()  # handed no lane: the request is refused
        for lane in self._free:
            self._close_lane(lane)
        self._free.clear()
        if self._all_back is not None:
            self._all_back.set()

    @staticmethod
    def _close_lane(lane: Lane) -> None:
        lane_graphs.close(lane)  # first: its replays' needs are held by the lane's streams
        with contextlib.suppress(CudaError):
            for buffer in lane._kept_for_life:
                buffer.free()
        lane._kept_for_life.clear()
        for stream in lane.streams:
            if not library_streams.adopted(stream):
                if lane._staging is not None:
                    with contextlib.suppress(CudaError):
                        stream.hold(lane._staging)
                stream.close()
        lane._staging = None

    # -- leases --------------------------------------------------------------------------------
    def lease(self, *, priority: Priority = "normal") -> contextlib.AbstractAsyncContextManager[Lane]:
        """``async with lanes.lease() as lane:`` -- a lane for one request. Waits while
        every lane is leased (back-pressure; waiting ``"high"`` requests are served first).
        ``priority="high"`` needs lanes made with it: ``Lanes(..., priorities=("normal", "high"))``.

        A request that holds a lane of this pool and would have to wait for another (a
        lease inside a lease, which would wait for itself) raises ``RuntimeError``."""
        if priority not in self._priorities:
            raise invalid_value(f"these lanes serve priorities {self._priorities}, not {priority!r}")
        return _Lease(self, priority)

    async def _acquire(self, priority: Priority) -> Lane:
        if self._state != "open" or self.failure is not None or _thread_id() != self._thread:
            self._refuse()
        if self._free:
            lane = self._free.pop()
            self._out += 1
        else:
            lane = await self._wait_for_lane(priority)
        try:
            last = self._last[lane.index]
            # The lane's memory may be reused once the last lease's work is done. A lease
            # that awaited its stream and staged nothing since leaves nothing of the lane's
            # in flight that work on the same stream could overtake, so only a lease that
            # ended otherwise (cancelled, say), or another priority's stream, is asked.
            same_stream = last is lane._streams[priority]
            if not (lane._awaited and same_stream) and not last.query():
                await last
        except BaseException as exc:
            self._release(lane, exc)
            raise
        lane._begin(priority)
        self._last[lane.index] = lane.stream
        return lane

    def _refuse(self) -> NoReturn:
        if self._state not in ("new", "starting") and _thread_id() != self._thread:
            raise RuntimeError(
                f"the request lanes of device {self._device.ordinal} belong to the event loop that started "
                f"them (thread {self._thread}), and were leased from thread {_thread_id()}: lease from "
                "that loop, or give each loop (each thread) Lanes of its own"
            )
        failure = self.failure
        if failure is not None:
            raise ContextPoisonedError.earlier(failure, f"device {self._device.ordinal}")
        if self._state in ("new", "starting"):
            raise RuntimeError(
                f"the request lanes of device {self._device.ordinal} are not started: "
                "enter 'async with lanes:' (or await lanes.start()) first, in the app's lifespan"
            )
        raise ClosedError(f"the request lanes of device {self._device.ordinal} are {self._state}")

    def _held_here(self) -> Lane | None:
        """The lane of this pool that the calling request holds, if any: the lane whose
        lease's block is among the caller's frames (see ``Lane._holder``)."""
        holders = {lane._holder: lane for lane in self._lanes if lane._holder is not None}
        frame: FrameType | None = sys._getframe(2) if holders else None
        while frame is not None:
            lane = holders.get(frame)
            if lane is not None:
                return lane
            frame = frame.f_back
        return None

    def _check_not_holding(self) -> None:
        """Refuse to wait for a lane in a request that holds one of this pool already
        (nested leases): its own lane would never come back."""
        lane = self._held_here()
        if lane is not None:
            raise RuntimeError(
                f"this request holds lane {lane.index} of these lanes (device {self._device.ordinal}) and "
                "would wait for another: every lane is leased, and requests that wait for a lane while "
                "holding one wait for each other, or for themselves. Do the inner work on the lane "
                "it holds, or lease once per request"
            )

    async def _wait_for_lane(self, priority: Priority) -> Lane:
        self._check_not_holding()
        waiter = _Waiter()
        queue = self._waiters[priority]
        queue.append(waiter)
        try:
            await waiter.event.wait()
        except BaseException:
            if waiter.lane is not None:  # handed a lane just as this was cancelled: pass it on
                self._hand_over(waiter.lane)
            else:
                with contextlib.suppress(ValueError):  # (not there: close() woke it)
                    queue.remove(waiter)
                self._check_all_back()
            raise
        if waiter.lane is None:  # woken by close()
            self._refuse()
        if self.failure is not None:
            self._hand_over(waiter.lane)
            self._refuse()
        return waiter.lane

    def _release(self, lane: Lane, exc: BaseException | None) -> None:
        lane._end()
        self._leases += 1
        failure = exc if isinstance(exc, ContextPoisonedError) else lane._failure
        lane._failure = None
        if failure is not None and self.failure is None:
            self.failure = failure
        self._hand_over(lane)

    def _hand_over(self, lane: Lane) -> None:
        """Give a lane back: to the most urgent waiting request, else to the free list
        (or, the pool being closed, close it)."""
        if self._state == "closed":
            self._out -= 1
            self._close_lane(lane)
            self._check_all_back()
            return
        for priority in ("high", "normal"):
            queue = self._waiters[priority]
            if queue:
                waiter = queue.popleft()
                waiter.lane = lane
                waiter.event.set()
                return
        self._free.append(lane)
        self._out -= 1
        self._check_all_back()

    def _check_all_back(self) -> None:
        if self._all_back is not None and not self._out and not any(self._waiters.values()):
            self._all_back.set()

    # -- state ---------------------------------------------------------------------------------
    def statistics(self) -> LanesStatistics:
        """How many lanes are leased, how many requests wait, and whether the GPU failed."""
        count = len(self._lanes)
        return LanesStatistics(
            lanes=count,
            leased=self._out,
            waiting=sum(len(q) for q in self._waiters.values()),
            leases=self._leases,
            failed=self.failure is not None,
        )

    def __repr__(self) -> str:
        s = self.statistics()
        return (
            f"<Lanes device={self._device.ordinal} {self._state} [{s.lanes} lanes: {s.leased} leased, "
            f"{s.waiting} waiting]{' FAILED' if s.failed else ''}>"
        )
