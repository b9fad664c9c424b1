"""Dynamic batching: concurrent requests gathered into one batched stage.

See :mod:`aiocuda.batching` for the user's view. ``concurrency`` *worker* tasks per
batcher take turns gathering: the one holding the gathering lock waits for the first
queued item, keeps gathering until ``max_batch`` items or ``max_delay`` after that first
one, takes the batch, lets go of the lock (the next worker starts gathering the next
batch) and runs it. A request suspends its own task on the loop adapter
(:mod:`aiocuda._completion.loops`) until its batch resolves it; nothing a request does --
being cancelled above all -- reaches a worker. A request cancelled while queued is only
marked withdrawn, and the gathering worker drops it when it comes to it.

A batcher belongs to the event loop that entered it, as asyncio's own queues and locks
do: its queue, its wake-ups and the suspensions of its requests are that loop's, touched
from its thread only. :meth:`Batcher.submit` from another thread refuses before it
touches any of them; from another loop of the same thread (the batcher's own loop is
then stopped) it fails at its await and takes its item back out of the queue.
"""

from __future__ import annotations

import asyncio
import collections
import collections.abc
import copy
import functools
import inspect
import math
import threading
import time
from collections.abc import Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Generic, Literal, TypeVar

import anyio
import anyio.abc
import numpy as np
import numpy.typing as npt

from .._completion.loops import LoopAdapter, current_adapter
from .._util import a_number, at_least
from ..errors import ClosedError, QueueFullError
from .chunk_map import exit_task_group

__all__ = ["BatchFn", "Batcher", "BatcherStatistics"]

T = TypeVar("T")
R = TypeVar("R")

BatchFn = Callable[[list[T]], Awaitable[Sequence[R | BaseException] | npt.NDArray[Any]]]
"""``await run(items)``: the results in item order: a sequence (not a ``str``, ``bytes``,
set or mapping; an exception instance in place of a result fails that item's request
alone) or an array whose rows are the results. With an array, a type checker cannot
tell what one result is: say so, ``Batcher[np.ndarray, np.ndarray]``."""

# Batching exists to cut the host cost per request, so a request is one object and one
# suspension on the loop adapter. Host us per item, 64 tasks submitting to a batch
# function that returns its items (min of 30 interleaved runs, a slow 2-core machine):
# asyncio 7.4 -> 3.1, uvloop 6.5 -> 2.2, trio 8.1 -> 5.6 when this replaced an
# anyio.Event per request, a wake-up of the gatherer (under a new cancel scope) per
# arrival and a task per batch. A bare future per request, resolved 64 at a time, costs
# about 2.3 of asyncio's 3.1.
# Arrival times only say how long the gathering worker sleeps, and a sleep that runs out
# makes its batch due: the loop's clock decides (a test's virtual one, trio's MockClock
# say), and any monotonic clock does for the stamps.
_clock = time.monotonic
# A submit from another loop is refused by its thread on the way in: 0.1 us per item
# (asyncio 3.6 -> 3.7 us, uvloop 2.6 -> 2.7, same benchmark, interleaved runs) where
# comparing the running loop too cost 0.3. Another loop of the same thread (the batcher's
# own is then stopped: a test's loop per test, say) fails at the await, and is told so there.
_running_loop = asyncio._get_running_loop
_thread_id = threading.get_ident


class _Request(Generic[T, R]):
    """One request's item, and how its task learns the outcome: a suspended wait of the
    loop adapter (:class:`~aiocuda._completion.loops.Suspended`)."""

    __slots__ = ("adapter", "arrived", "done", "item", "outcome", "position", "token", "traceback", "withdrawn")

    def __init__(self, item: T, adapter: LoopAdapter, position: int) -> None:
        self.item = item
        self.adapter = adapter
        self.arrived = _clock()
        self.position = position
        """Its place in the order of arrival: it is queued while fewer requests than that
        have been taken off the front of the queue (:attr:`Batcher._taken`)."""
        self.withdrawn = False
        """Cancelled while queued: left in the queue, for the gathering worker to drop."""
        # The result or the exception to raise. It travels on this object, never as the
        # future's exception: a task cancelled just after its future was set would leave
        # that exception unretrieved.
        self.outcome: R | BaseException | None = None
        self.traceback: TracebackType | None = None
        """The outcome's traceback when it was given: one exception may fail a whole
        batch, and each raise of it would otherwise lengthen the traceback the next one
        shows (asyncio's futures keep theirs the same way)."""
        self.token: Any = None
        self.done = False

    def finish(self) -> None:
        self.done = True

    def __await__(self) -> Generator[Any, Any, None]:
        """Suspend the calling task until :meth:`resolve` (or its cancellation)."""
        return self.adapter.suspend(self)

    def resolve(self, outcome: R | BaseException) -> None:
        """Give the request its outcome and wake its task (nothing, if it was cancelled)."""
        self.outcome = outcome
        if isinstance(outcome, BaseException):
            self.traceback = outcome.__traceback__
        self.adapter.resume(self, None)


@dataclass(frozen=True, slots=True)
class BatcherStatistics:
    """A snapshot of a :class:`Batcher` (:meth:`Batcher.statistics`)."""

    queued: int
    """Items waiting for a batch."""
    running: int
    """Batches running now."""
    batches: int
    """Batches finished so far."""
    items: int
    """Items in those batches."""
    rejected: int
    """Submits refused so far because ``max_queue`` items were waiting
    (:class:`~aiocuda.errors.QueueFullError`)."""


class Batcher(Generic[T, R]):
    """Gathers concurrent requests into batches for one batched stage (see
    :mod:`aiocuda.batching`).

    Args:
        run: ``async def run(items: list) -> Sequence | np.ndarray``: one batched
            stage over the items, returning one result per item, in order (an array:
            one row per item). An exception instance in place of a result fails that
            item's request alone; an exception raised by ``run`` fails every request of
            the batch. A plain function that returns an awaitable (a lambda calling an
            ``async def``) does too; a generator function or what cannot be called
            raises ``TypeError`` here, and a function that returns no awaitable fails
            each batch's requests with one.
        max_batch: the most items in one batch.
        max_delay: seconds a batch waits for more items after its first one arrived
            (0: take what is queued at once).
        concurrency: batches running at once, at most (gathering goes on meanwhile).
            A batch function that submits to its own batcher and awaits the result
            holds a worker meanwhile: once every worker does, nothing runs those items.
        max_queue: the most items waiting for a batch (not counting those of running
            batches); a submit beyond raises :class:`~aiocuda.errors.QueueFullError` at
            once. None (the default): no limit.

    Use as ``async with Batcher(...) as batcher:`` (in a lifespan): it runs tasks of its
    own for as long as the block. Submit from the event loop it was entered on (any task
    of it): like asyncio's queues and locks, a batcher belongs to that loop, and
    :meth:`submit` from another loop or thread raises ``RuntimeError``.
    """

    def __init__(
        self,
        run: BatchFn[T, R],
        *,
        max_batch: int,
        max_delay: float,
        concurrency: int = 2,
        max_queue: int | None = None,
    ) -> None:
        _check_batch_function(run)
        max_batch = at_least(max_batch, 1, "max_batch")
        concurrency = at_least(concurrency, 1, "concurrency")
        if max_queue is not None:
            max_queue = at_least(max_queue, 1, "max_queue")
        max_delay = a_number(max_delay, "max_delay", "a number of seconds")
        if not (max_delay >= 0 and math.isfinite(max_delay)):
            raise ValueError(f"max_delay must be a finite number of seconds >= 0, got {max_delay}")
        self._run = run
        self.max_batch = max_batch
        self.max_delay = max_delay
        self.max_queue = max_queue
        self._concurrency = concurrency
        self._queue: collections.deque[_Request[T, R]] = collections.deque()
        # A request cancelled while queued stays in the queue, withdrawn, until the
        # gathering worker drops it: taking it out (deque.remove) scanned the queue, so
        # cancelling n queued requests (clients gone under overload) cost n*n/2 steps on
        # the loop, some seconds for 40,000. Both counts make that check and the number
        # of requests waiting O(1).
        self._taken = 0
        """Requests taken off the front of the queue so far (into batches, or dropped)."""
        self._withdrawn = 0
        """Withdrawn requests in the queue: ``len(self._queue)`` less these wait."""
        self._adapter: LoopAdapter | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        """The running asyncio loop that entered the batcher (None under trio)."""
        self._thread = 0
        """The thread of that loop."""
        self._wakeup: anyio.Event | None = None
        """Set while the gathering worker sleeps: what wakes it."""
        self._gathering = anyio.Lock()
        self._task_group: anyio.abc.TaskGroup | None = None
        self._state: Literal["new", "open", "closing", "closed"] = "new"
        self._running = 0
        self._batches = 0
        self._items = 0
        self._rejected = 0

    # -- lifetime ------------------------------------------------------------------------------
    async def __aenter__(self) -> Batcher[T, R]:
        if self._state != "new":
            raise RuntimeError(f"a Batcher is entered once (this one is {self._state})")
        self._adapter = current_adapter()
        self._loop, self._thread = _running_loop(), _thread_id()
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        self._state = "open"
        for _ in range(self._concurrency):
            self._task_group.start_soon(self._work)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool | None:
        """Graceful: new submits fail with :class:`~aiocuda.errors.ClosedError`; queued
        items run at once (no more waiting for ``max_delay``) and every batch finishes.

        Left with an exception (or cancelled), it stops at once: running batches are
        cancelled, and their requests and the queued ones raise
        :class:`~aiocuda.errors.ClosedError`; the exception comes out as it was."""
        assert self._task_group is not None
        self._state = "closing"
        self._wake()
        try:
            return await exit_task_group(self._task_group, exc_type, exc, tb)
        finally:
            self._state = "closed"
            queue = self._queue
            self._taken += len(queue)
            self._withdrawn = 0
            while queue:
                request = queue.popleft()
                if not request.withdrawn:
                    request.resolve(ClosedError("the batcher closed before this request ran"))

    # -- requests ------------------------------------------------------------------------------
    async def submit(self, item: T) -> R:
        """Queue ``item`` for the next batch and return its result (raise its error).

        With ``max_queue`` items already waiting, raise
        :class:`~aiocuda.errors.QueueFullError` at once instead (answer 503).

        Cancelling the caller takes the item out of the queue if its batch has not
        started, and otherwise leaves the batch running (the result is dropped).

        Call it from the event loop that entered the batcher: from another loop or thread
        it raises ``RuntimeError`` (hand the call to the batcher's loop instead, e.g.
        ``asyncio.run_coroutine_threadsafe(batcher.submit(item), loop)``).
        """
        if self._state != "open":
            if self._state == "new":
                raise RuntimeError("the batcher is not started: enter 'async with batcher:' first (in the lifespan)")
            raise ClosedError(f"the batcher is {self._state}")
        if _thread_id() != self._thread:  # (another loop of this thread: see the except clause)
            raise self._foreign()
        assert self._adapter is not None
        queue = self._queue
        # Refused, not made to wait for room: under overload a queue without bound only
        # lengthens every request's wait (Triton's max_queue_size and Ray Serve's
        # max_queued_requests refuse too), where a 503 lets the client or the balancer
        # go elsewhere or back off. Without max_queue, this costs one comparison.
        max_queue = self.max_queue
        if max_queue is not None and len(queue) - self._withdrawn >= max_queue:
            self._rejected += 1
            raise QueueFullError(
                f"the batcher's queue is full: max_queue={max_queue} items wait for a batch already. "
                "The service is overloaded: answer 503 Service Unavailable (with Retry-After), or retry later"
            )
        request: _Request[T, R] = _Request(item, self._adapter, self._taken + len(queue))
        queue.append(request)
        try:
            # The gathering worker sleeps until the first item arrives (the queue was
            # empty: it drops withdrawn requests before it sleeps), then until the batch
            # is full or due: only those two arrivals wake it.
            if self._wakeup is not None and (len(queue) == 1 or len(queue) - self._withdrawn >= self.max_batch):
                self._wake()
            await request
        except BaseException as exc:
            if request.position >= self._taken:  # still queued (otherwise its batch runs)
                request.withdrawn = True
                self._withdrawn += 1
                del request.item  # (freed now, not when the worker comes to the request)
            if _running_loop() is not self._loop:
                # Another asyncio loop of the batcher's thread (the batcher's own is not
                # running, then): asyncio refused the await of its future, or waking the
                # gathering worker met its closed loop.
                raise self._foreign() from exc
            raise
        outcome = request.outcome
        if isinstance(outcome, BaseException):
            try:
                raise outcome.with_traceback(request.traceback)
            finally:
                # The traceback keeps this frame: with these locals, frame and exception
                # would form a cycle that only the cyclic garbage collector frees.
                del outcome, request
        return outcome  # type: ignore[return-value]

    def _foreign(self) -> RuntimeError:
        """The error for a submit from another event loop than the batcher's."""
        thread = _thread_id()
        where = f"thread {thread}" if thread != self._thread else "another event loop of its thread"
        return RuntimeError(
            f"this Batcher belongs to the event loop that entered it (thread {self._thread}), and submit "
            f"was called from {where}: submit from that loop, or hand the call to it from another thread "
            "(asyncio.run_coroutine_threadsafe(batcher.submit(item), loop); anyio.from_thread.run("
            "batcher.submit, item) in a worker thread of that loop)"
        )

    def _wake(self) -> None:
        wakeup, self._wakeup = self._wakeup, None
        if wakeup is not None:
            wakeup.set()

    async def _sleep(self, seconds: float) -> bool:
        """Sleep until :meth:`_wake` or for ``seconds`` (``math.inf``: until woken); False
        if the time ran out."""
        self._wakeup = wakeup = anyio.Event()
        with anyio.move_on_after(seconds) as timeout:
            await wakeup.wait()
        self._wakeup = None
        return not timeout.cancelled_caught

    # -- batches -------------------------------------------------------------------------------
    async def _work(self) -> None:
        """One worker: gather a batch (one worker at a time), run it; until closed."""
        while True:
            async with self._gathering:
                batch = await self._gather()
            if not batch:
                return  # closing, and nothing left
            await self._run_batch(batch)
            del batch  # (not kept, with its items and results, while the next batch gathers)

    async def _gather(self) -> list[_Request[T, R]]:
        """Wait until a batch is due and take it (nothing: the batcher closed with nothing
        queued)."""
        queue = self._queue
        while True:
            while queue and queue[0].withdrawn:
                queue.popleft()
                self._taken += 1
                self._withdrawn -= 1
            if not queue:
                if self._state != "open":
                    return []
                await self._sleep(math.inf)
                continue
            if len(queue) - self._withdrawn >= self.max_batch or self._state != "open":
                break
            first = queue[0]
            remaining = first.arrived + self.max_delay - _clock()
            if remaining <= 0:
                break
            if not await self._sleep(remaining) and queue and queue[0] is first and not first.withdrawn:
                break  # (max_delay has passed on the loop's clock)
        return self._take(min(len(queue) - self._withdrawn, self.max_batch))

    def _take(self, count: int) -> list[_Request[T, R]]:
        """The first ``count`` requests of the queue that are not withdrawn (dropping the
        withdrawn ones among them)."""
        queue = self._queue
        if not self._withdrawn:
            self._taken += count
            return [queue.popleft() for _ in range(count)]
        batch: list[_Request[T, R]] = []
        while len(batch) < count:
            request = queue.popleft()
            self._taken += 1
            if request.withdrawn:
                self._withdrawn -= 1
            else:
                batch.append(request)
        return batch

    async def _run_batch(self, batch: list[_Request[T, R]]) -> None:
        self._running += 1
        try:
            try:
                pending = self._run([request.item for request in batch])
                if not inspect.isawaitable(pending):  # (a function that is not async def)
                    raise TypeError(
                        f"the batch function returned {type(pending).__name__}, not an awaitable: it must "
                        "return an awaitable of the results (make it an 'async def' function)"
                    )
                results = await pending
                _check_results(results, len(batch))
            except Exception as exc:
                _fail(batch, exc)
                return
            except BaseException as exc:
                if isinstance(exc, anyio.get_cancelled_exc_class()) and anyio.current_effective_deadline() > -math.inf:
                    # the batch function's own (it awaited something cancelled elsewhere):
                    # a failure of this batch, not the end of the worker and the batcher
                    error = RuntimeError(f"the batch function raised {type(exc).__name__} without being cancelled")
                    error.__cause__ = exc
                    _fail(batch, error)
                    return
                if isinstance(exc, anyio.get_cancelled_exc_class()):
                    why, cause = "the batcher was cancelled while this request's batch ran", None
                else:  # (KeyboardInterrupt, SystemExit, ...: it stops the batcher too)
                    why, cause = f"the batch function raised {type(exc).__name__}, which stops the batcher", exc
                for request in batch:
                    closed = ClosedError(why)
                    closed.__cause__ = cause
                    request.resolve(closed)
                raise
            # One exception instance returned for several items ([error] * len(items))
            # would be raised in several tasks: each request after the first gets a copy
            # (as when the batch function raises). About 30 ns per item.
            errors: set[int] = set()
            for request, result in zip(batch, results, strict=True):
                if isinstance(result, BaseException):
                    if id(result) in errors:
                        result = _each_its_own(result, 2)[1]
                    errors.add(id(result))
                request.resolve(result)
        finally:
            self._running -= 1
            self._batches += 1
            self._items += len(batch)
            # A failed batch's traceback keeps this frame, and its requests keep that
            # exception: with this local, the batch (its items) would wait for the cyclic
            # garbage collector.
            del batch

    # -- state ---------------------------------------------------------------------------------
    def statistics(self) -> BatcherStatistics:
        return BatcherStatistics(
            queued=len(self._queue) - self._withdrawn,
            running=self._running,
            batches=self._batches,
            items=self._items,
            rejected=self._rejected,
        )

    def __repr__(self) -> str:
        s = self.statistics()
        bound = "" if self.max_queue is None else f" max_queue={self.max_queue}"
        rejected = "" if self.max_queue is None else f", {s.rejected} rejected"
        return (
            f"<Batcher {self._state} max_batch={self.max_batch} max_delay={self.max_delay}{bound} "
            f"[{s.queued} queued, {s.running} running, {s.batches} done{rejected}]>"
        )


def _check_batch_function(run: object) -> None:
    """Refuse, with a ``TypeError``, a batch function whose call plainly returns no
    awaitable: what cannot be called, a generator function (of a partial, or a callable
    object's ``__call__``)."""
    # A plain function is not refused, though it is not async def: it may return an
    # awaitable (a lambda calling an async def). _run_batch checks what it returns.
    if not callable(run):
        raise TypeError(f"the batch function must be callable (an 'async def' function), not {type(run).__name__}")
    function: Any = run
    while isinstance(function, functools.partial):
        function = function.func
    if not (inspect.isroutine(function) or isinstance(function, type)):
        function = type(function).__call__  # a callable object: its method
    name = getattr(function, "__qualname__", repr(function))
    if inspect.isasyncgenfunction(function):
        raise TypeError(
            f"the batch function must be an 'async def' function that returns the results, and {name} is an "
            "async generator function (it yields): return the results instead"
        )
    if inspect.isgeneratorfunction(function) and not function.__code__.co_flags & inspect.CO_ITERABLE_COROUTINE:
        raise TypeError(
            f"the batch function must be an 'async def' function that returns the results, and {name} is a "
            "generator function (it yields, and its call returns no awaitable)"
        )


def _check_results(results: object, items: int) -> None:
    scalar_array = isinstance(results, np.ndarray) and results.ndim == 0  # (it has no len())
    if (
        scalar_array
        or isinstance(results, (str, bytes, collections.abc.Set, collections.abc.Mapping))
        or not isinstance(results, (collections.abc.Sequence, np.ndarray))
    ):
        raise TypeError(
            f"the batch function must return a sequence of results in item order (a list, tuple or "
            f"array), not {'a 0-d array' if scalar_array else type(results).__name__}"
        )
    if len(results) != items:
        raise ValueError(f"the batch function returned {len(results)} results for {items} items")


def _fail(batch: list[_Request[Any, Any]], exc: BaseException) -> None:
    """Fail every request of ``batch`` with ``exc``, each with its own copy of it."""
    for request, error in zip(batch, _each_its_own(exc, len(batch)), strict=True):
        request.resolve(error)


def _each_its_own(exc: BaseException, count: int) -> list[BaseException]:
    """``exc`` for a batch's first request and a copy of it for each other one: one object
    raised in several tasks would carry each task's context (``__context__``: the error
    its handler was handling) and the notes each adds into the others' tracebacks."""
    out = [exc]
    notes = getattr(exc, "__notes__", None)
    for _ in range(count - 1):
        try:
            twin = copy.copy(exc)
        except Exception:  # (an exception type that cannot be rebuilt from its args)
            twin = exc
        if type(twin) is not type(exc):
            twin = exc
        elif twin is not exc:
            # copy.copy calls the class with exc.args: a class that writes its message
            # from its arguments writes it again ("error code error code 7"), so the
            # args are put back; it shares exc's attributes, the list of notes included.
            twin.args = exc.args
            if isinstance(notes, list):
                twin.__notes__ = list(notes)  # type: ignore[attr-defined]
            twin.__cause__, twin.__suppress_context__ = exc.__cause__, exc.__suppress_context__
            twin.__context__, twin.__traceback__ = exc.__context__, exc.__traceback__
        out.append(twin)
    return out
