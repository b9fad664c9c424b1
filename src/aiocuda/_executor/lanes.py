"""The pool of request lanes (free list, leases, priorities, back-pressure, start-up and
close) and the lease context manager; the lane itself is :mod:`aiocuda._executor.lane`.

See :mod:`aiocuda.lanes` for the user's view. Invariants the code keeps:

* A lane is handed to a lease only once everything earlier leases enqueued on it has
  finished (:meth:`Lanes._acquire` queries the previous lease's stream, and awaits it in
  the rare case a lease ended without awaiting its work: a cancelled request). So host
  memory the lane owns -- its staging block, the user's ``state`` -- may be written at
  the start of a lease without any ordering.
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
  the request itself.) A block in an async generator is off the stack while its consumer
  runs: its lease alone also notes its task (``Lanes._in_generators``, a flag test on the
  others), and a lease that has to wait in that task raises too, once the loop has had a
  few turns to close a generator dropped unclosed (its finaliser ends the lease in
  another task). A lease in another task's generator is waited for as any other.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import math
import sys
import threading
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any, Literal, NoReturn

import anyio
import anyio.lowlevel
import anyio.to_thread

from .._completion.event_pool import EventPool
from .._completion.loops import being_cancelled
from .._memory import library_streams
from .._util import at_least, invalid_value
from ..device import Device, _as_device
from ..errors import ClosedError, ContextPoisonedError, CudaError
from ..stream import Stream
from . import lane_graphs
from .lane import PRIORITIES, Lane, Priority, stream_priority

__all__ = ["Lanes", "LanesStatistics", "Setup", "default_count"]

Setup = Callable[["Lane"], Any]
"""``setup(lane)`` (sync or async) prepares one lane at start-up; its result is ``lane.state``."""

_thread_id = threading.get_ident  # a lease from another thread is refused: 0.05 us a lease

_CO_ASYNC_GENERATOR = inspect.CO_ASYNC_GENERATOR

_FINALISER_TURNS = 8
"""Loop turns a lease that would wait, in a task whose async generator holds a lane, gives
the loop to close that generator if it was dropped unclosed, before it raises."""
# A generator dropped unclosed is handed to the loop's finaliser hook at once (refcount),
# which closes it in a task of its own: asyncio and uvloop within 2 turns, trio within 3
# (its entry queue, then a system task). Unclosed and still referenced, it never is.

MAX_COUNT = 1024
"""The most lanes a pool may have."""
# A lane is a request on the GPU at once: a device runs at most 128 kernels at a time
# (compute capability 9.0) over at most 32 hardware queues, so lanes beyond a few hundred
# only cost their streams, events and pinned staging (1 GiB at 1024 of 1 MiB). A count
# of millions (a typo) would pin memory off the loop until the host ran out, not cancellable.


def default_count(device: Device) -> int:
    """Lanes per device when not given: a quarter of the SMs, between 8 and 64."""
    # One lane is one request in flight on the GPU. Kernels of a request rarely fill the
    # device, so several run side by side; a quarter of the SMs (33 on an H100) keeps the
    # device fed while the rest of the requests wait on the host, costing nothing.
    return max(8, min(64, device.multiprocessor_count // 4))


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
        if holder.f_code.co_flags & _CO_ASYNC_GENERATOR:  # off the stack while its consumer runs
            self._lanes._in_generators[lane.index] = anyio.get_current_task().coro
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
                else:
                    warnings.warn(
                        f"a lease of lane {lane.index} ended with downloads not awaited: their arrays were not "
                        "filled (await lane inside the lease's block, before using them)",
                        RuntimeWarning,
                        stacklevel=2,
                    )
        self._lanes._release(lane, exc)


class Lanes:
    """A pool of request lanes on one device (see :mod:`aiocuda.lanes`).

    Args:
        device: a :class:`~aiocuda.device.Device` or ordinal (default 0).
        count: how many lanes, i.e. requests on the GPU at once, at most 1024 (default:
            from the device, :func:`default_count`).
        priorities: the priorities leases may ask for, a tuple: ``("normal",)`` or
            ``("normal", "high")`` (a second stream per lane, of the device's greatest
            priority).
        staging: page-locked bytes per lane for copies of pageable host memory
            (default 1 MiB); a request that needs more borrows cached pinned blocks.
        setup: ``setup(lane)``, a function or an ``async def`` (not a generator), run
            once per lane at start-up on the event loop; its result becomes ``lane.state``.
            The lane is awaited after it. Memory it makes with :meth:`Lane.empty` is the
            lane's own, freed when the lanes close: nothing to tear down.

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
        if count is not None and count > MAX_COUNT:
            raise ValueError(
                f"count must be at most {MAX_COUNT} lanes, got {count}: a lane is a request on the GPU at "
                "once, and requests beyond the lanes wait on the host for one (back-pressure)"
            )
        staging = at_least(staging, 0, "staging (bytes)")
        if isinstance(priorities, str) or not isinstance(priorities, Iterable):
            raise TypeError(
                f"priorities must be a tuple, ('normal',) or ('normal', 'high'), not {type(priorities).__name__} "
                f"{priorities!r}"
            )
        if setup is not None and not callable(setup):
            raise TypeError(f"setup must be a function of the lane (or an async def), not {type(setup).__name__}")
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
        self._in_generators: dict[int, object] = {}
        """Lanes leased by a block in an async generator: the index of each, and the coroutine
        of the task that leased it (identity: a strong reference, so never another task's)."""
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
            raise RuntimeError(f"Lanes.start() runs once, on new lanes: these are {self._state} already")
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
                    elif inspect.isgenerator(state) or inspect.isasyncgen(state):
                        if inspect.isgenerator(state):
                            state.close()
                        else:
                            await state.aclose()
                        raise TypeError(
                            f"setup must return the lane's state, and {self._setup!r} is a generator function (it "
                            "yields): return the state instead. What setup makes with lane.empty() is freed when "
                            "the lanes close"
                        )
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
            for lane in self._lanes:  # what a failed setup made is no lane's own: freed as by a lease
                lane._end()
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
        made: list[Stream] = []
        try:
            for index in range(count):
                streams = {}
                for p in self._priorities:
                    streams[p] = stream = Stream(device, priority=value[p])
                    made.append(stream)
                lanes.append(Lane(index, device, streams, self._staging))
            # Awaits and holds record pooled events: make enough for every lane at once now
            # rather than on the loop under load.
            pool = EventPool.for_device(device)
            events: list[Any] = []
            try:
                for _ in range(4 * count * len(self._priorities)):
                    events.append(pool.acquire())
            finally:
                for event in events:
                    pool.release(event)
        except BaseException:
            # (Out of memory or streams at lane k: the streams made so far would outlive
            # the pool, which never saw them. Nothing is enqueued on them yet; the staging
            # blocks go with their lanes.)
            for stream in made:
                with contextlib.suppress(CudaError):
                    stream.close()
            raise
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
        lane = self._take_free()
        if lane is None:
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

    def _take_free(self) -> Lane | None:
        """A free lane, counted out, or None; refuses a lease the pool cannot take (closed,
        failed, or from another thread)."""
        if self._state != "open" or self.failure is not None or _thread_id() != self._thread:
            self._refuse()
        if self._free:
            self._out += 1
            return self._free.pop()
        return None

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
        lease's block is among the caller's frames (see ``Lane._holder``), else one that
        an async generator of the calling task leased."""
        return self._held_on_stack() or self._held_by_generator_here()

    def _held_on_stack(self) -> Lane | None:
        holders = {lane._holder: lane for lane in self._lanes if lane._holder is not None}
        frame: FrameType | None = sys._getframe(2) if holders else None
        while frame is not None:
            lane = holders.get(frame)
            if lane is not None:
                return lane
            frame = frame.f_back
        return None

    def _held_by_generator_here(self) -> Lane | None:
        """A lane that a block in an async generator of the calling task holds, if any."""
        if not self._in_generators:
            return None
        task = anyio.get_current_task().coro
        for index, owner in self._in_generators.items():
            if owner is task:
                return self._lanes[index]
        return None

    async def _check_not_holding(self) -> bool:
        """Refuse to wait for a lane in a request that holds one of this pool already
        (nested leases): its own lane would never come back. A lane its async generator
        holds may be coming back, if the generator was dropped unclosed: the loop closes
        it within a few turns (``_FINALISER_TURNS``), and then the request may wait.
        Whether the loop turned (the pool may have changed meanwhile)."""
        lane = self._held_on_stack()
        turned = False
        if lane is None and self._held_by_generator_here() is not None:
            turned = True
            for _ in range(_FINALISER_TURNS):
                await anyio.lowlevel.checkpoint()
                lane = self._held_by_generator_here()
                if lane is None:
                    break
        if lane is not None:
            raise RuntimeError(
                f"this request holds lane {lane.index} of these lanes (device {self._device.ordinal}) and "
                "would wait for another: every lane is leased, and requests that wait for a lane while "
                "holding one wait for each other, or for themselves. Do the inner work on the lane "
                "it holds, or lease once per request"
            )
        return turned

    async def _wait_for_lane(self, priority: Priority) -> Lane:
        if await self._check_not_holding():  # the loop turned: the pool may have changed
            lane = self._take_free()  # (the dropped generator's lane came back)
            if lane is not None:
                return lane
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
        if self._in_generators:
            self._in_generators.pop(lane.index, None)
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
