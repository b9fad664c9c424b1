"""The consumer's side of a running map over chunks, shared by ``Executor.map``
(:mod:`aiocuda._executor.pipeline`) and ``aiocuda.ray.map``.

A :class:`ChunkMap` runs a feeder task in its own task group: it reads the inputs (telling
the subclass of each at once: :meth:`ChunkMap._input_read`), takes a slot (at most
``in_flight`` chunks between admission and delivery) and hands each chunk to the subclass
(:meth:`ChunkMap._start_chunk`: admission to a device or an actor, then a task, a replay,
...). Whatever runs the chunk sends its :class:`ChunkResult` through
:meth:`ChunkMap._send_result`; the consumer receives them in input order or as they
complete, and taking one frees its slot. With ``on_error="raise"`` a failed chunk's error
is raised to the consumer, with a note saying where it ran, and cancels the rest.
"""

from __future__ import annotations

import collections
import contextlib
import sys
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable
from types import TracebackType
from typing import Any, Literal

import anyio
import anyio.abc
import anyio.lowlevel
import anyio.to_thread
import numpy as np
import numpy.typing as npt

from .._memory import staging as _staging
from .chunk import ChunkResult

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

__all__ = ["ChunkMap", "OnError", "as_input", "contiguous", "exit_task_group"]

OnError = Literal["raise", "continue"]


class _InputFailed:
    """Sent by the feeder when iterating the inputs raised, after ``count`` inputs."""

    __slots__ = ("count", "error")

    def __init__(self, error: BaseException, count: int) -> None:
        self.error = error
        self.count = count


_Item = ChunkResult | _InputFailed | None
"""What the chunks and the feeder send the consumer (None: the inputs are exhausted)."""


async def exit_task_group(
    task_group: anyio.abc.TaskGroup,
    exc_type: type[BaseException] | None,
    exc: BaseException | None,
    tb: TracebackType | None,
) -> bool | None:
    """Leave ``task_group`` as an ``async with`` block's ``__aexit__`` would, except that
    the block's own exception comes back as it was, not wrapped in an exception group by
    the task group (its tasks report their errors otherwise, so nothing else is in it)."""
    try:
        return await task_group.__aexit__(exc_type, exc, tb)
    except BaseExceptionGroup as group:
        if exc is not None and group.split(lambda e: e is exc)[1] is None:
            return None
        raise


class ChunkMap:
    """A running map: an async context manager whose value is an async iterator of
    :class:`ChunkResult`. Subclasses implement :meth:`_start_chunk` and say in
    :attr:`_ran_on` where a result's chunk ran (for the note on a raised error)."""

    _ran_on = "device"

    def __init__(
        self,
        inputs: Iterable[npt.NDArray[Any]] | AsyncIterable[npt.NDArray[Any]],
        *,
        ordered: bool,
        on_error: OnError,
    ) -> None:
        self._inputs = inputs
        self._ordered = ordered
        self._on_error = on_error
        self._ready: dict[int, ChunkResult] = {}
        self._next = 0
        self._total: int | None = None
        self._input_error: BaseException | None = None
        """What iterating the inputs raised: raised once the results before it are delivered."""
        self.delivered = 0
        self.admitted = 0
        self.peak_in_flight = 0
        self.failures: list[ChunkResult] = []
        self._task_group: anyio.abc.TaskGroup | None = None
        # The first thing __anext__ awaits: before _open, what says to enter the map first.
        self._checkpoint_if_cancelled: Callable[[], Awaitable[None]] = _not_entered

    @property
    def in_flight(self) -> int:
        """Chunks admitted and not yet delivered."""
        return self.admitted - self.delivered

    # -- lifetime ---------------------------------------------------------------------------
    async def _open(self, in_flight: int) -> anyio.abc.TaskGroup:
        """Enter the task group, with ``in_flight`` slots; the feeder starts once the
        caller has set up what :meth:`_start_chunk` needs (:meth:`_feed_soon`)."""
        if self._task_group is not None:
            raise RuntimeError("a map runs once: call map() again for another run")
        # What was sent, in order, and the consumer's wake-up while it waits for more: an
        # unbounded memory object stream, without its ~2.5 us per item of bookkeeping.
        self._arrived: collections.deque[_Item] = collections.deque()
        self._arrival: anyio.Event | None = None
        self._closed = False
        self._checkpoint_if_cancelled = _checkpoint_if_cancelled()
        self._slots = anyio.Semaphore(in_flight)
        self._task_group = task_group = anyio.create_task_group()
        await task_group.__aenter__()
        return task_group

    def _feed_soon(self) -> None:
        assert self._task_group is not None
        self._task_group.start_soon(self._feed)

    async def _close(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        """The consumer is done: stop what is left and leave the task group."""
        assert self._task_group is not None
        self._task_group.cancel_scope.cancel()
        try:
            return await exit_task_group(self._task_group, exc_type, exc, tb)
        finally:
            self._closed = True
            arrival, self._arrival = self._arrival, None
            if arrival is not None:  # another task awaiting a result: it raises ClosedResourceError
                arrival.set()

    # -- the consumer -----------------------------------------------------------------------
    def __aiter__(self) -> AsyncIterator[ChunkResult]:
        return self

    async def __anext__(self) -> ChunkResult:
        await self._checkpoint_if_cancelled()
        arrived = self._arrived
        while True:
            result = self._take_ready()
            if result is not None:
                return self._deliver(result)
            if self._total is not None and self.delivered == self._total:
                error, self._input_error = self._input_error, None
                if error is not None:
                    raise error
                raise StopAsyncIteration
            if self._closed:
                raise anyio.ClosedResourceError(
                    "this map's block has been left, which ended it: read its results inside the block "
                    "(async with ....map(...) as results: async for r in results: ...)"
                )
            if not arrived:  # (results already sent are taken without a trip through the loop)
                if self._arrival is not None:
                    raise RuntimeError("another task is reading these results: one task iterates a map")
                self._arrival = arrival = anyio.Event()
                try:
                    await arrival.wait()
                finally:
                    if self._arrival is arrival:  # (cancelled: no longer waiting)
                        self._arrival = None
                continue
            item = arrived.popleft()
            if isinstance(item, _InputFailed):  # after the results of the inputs before it
                self._total, self._input_error = item.count, item.error
                continue
            if item is not None:
                # The next one (none was ready): delivered as it would be from _ready.
                if not self._ordered or item.index == self._next:
                    return self._deliver(item)
                if item.error is not None and self._on_error == "raise":
                    return self._deliver(item)
                self._ready[item.index] = item

    def _take_ready(self) -> ChunkResult | None:
        if not self._ready:
            return None
        if self._ordered:
            return self._ready.pop(self._next, None)
        return self._ready.pop(next(iter(self._ready)))

    def _deliver(self, result: ChunkResult) -> ChunkResult:
        self.delivered += 1
        if result.index == self._next:
            self._next += 1
        self._slots.release()
        if result.error is not None:
            self.failures.append(result)
            if self._on_error == "raise":
                assert self._task_group is not None
                self._task_group.cancel_scope.cancel()
                error = result.error
                if hasattr(error, "add_note"):
                    error.add_note(f"(in chunk {result.index} on {self._ran_on} {result.device})")
                raise error
        return result

    # -- the producers ----------------------------------------------------------------------
    async def _feed(self) -> None:
        index = 0
        try:
            # Closed when the feeder ends, however it ends: left to the garbage collector
            # (the map ended early, the feeder cancelled between inputs), trio warned
            # "Async generator '..._aiter' was garbage collected before it had been
            # exhausted" and asyncio scheduled a task to close it.
            async with contextlib.aclosing(_aiter(self._inputs)) as inputs:
                async for host in inputs:
                    array = as_input(host)
                    if not array.flags.c_contiguous:
                        array = await contiguous(array)
                    self._input_read(index, array)
                    if not self._take_slot_nowait():
                        await self._slots.acquire()
                    await self._start_chunk(index, array)
                    index += 1
        except Exception as exc:
            self._send_result(_InputFailed(exc, index))
            return
        self._total = index
        self._send_result(None)  # wake a consumer waiting for a result that will not come

    def _take_slot_nowait(self) -> bool:
        """Take a free slot without a checkpoint, if the subclass may (else False: the
        feeder awaits one, a checkpoint either way)."""
        return False

    def _input_read(self, index: int, array: npt.NDArray[Any]) -> None:
        """Input ``index`` was read; the feeder waits for a slot for it next. A subclass may
        start here what needs the input alone (the Ray map's put into the object store),
        so that it overlaps that wait."""

    async def _start_chunk(self, index: int, array: npt.NDArray[Any]) -> None:
        """Admit chunk ``index`` (then call :meth:`_admitted`) and start it; whatever runs
        it sends its result through :meth:`_send_result`."""
        raise NotImplementedError

    def _admitted(self) -> None:
        self.admitted += 1
        in_flight = self.admitted - self.delivered
        if in_flight > self.peak_in_flight:
            self.peak_in_flight = in_flight

    def _send_result(self, item: _Item) -> None:
        """Send the consumer a chunk's result (or, from the feeder, the end of the inputs)."""
        self._arrived.append(item)
        arrival = self._arrival
        if arrival is not None:
            self._arrival = None
            arrival.set()


async def _not_entered() -> None:
    raise RuntimeError("a map's results are read inside its block: async with ....map(...) as results: async for ...")


def _checkpoint_if_cancelled() -> Callable[[], Awaitable[None]]:
    """``anyio.lowlevel.checkpoint_if_cancelled`` of the running loop's backend."""
    # anyio's own finds the backend on every call (~1 us of sniffio and lookups, once per
    # result here); its token has the backend from anyio 4.11 on.
    try:
        return anyio.lowlevel.current_token().backend_class.checkpoint_if_cancelled
    except AttributeError:  # an older anyio
        return anyio.lowlevel.checkpoint_if_cancelled


def as_input(host: Any) -> npt.NDArray[Any]:
    """``host`` as a numeric numpy array (TypeError for Python objects), C-contiguous or
    not: :func:`contiguous` makes a copy of one that is not."""
    array = np.asarray(host)
    if array.dtype.hasobject:
        raise TypeError("pipeline inputs must be numeric numpy arrays, not arrays of Python objects")
    return array


async def contiguous(array: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """A C-contiguous copy of ``array``, made on a worker thread if it is larger than
    ``staging.INLINE_LIMIT`` (as pageable copies are)."""
    # Made on the loop's thread, a 32 MiB chunk of a transposed float32 array took 80 ms
    # (strided rows 15 ms), during which nothing else of the loop ran.
    if array.nbytes <= _staging.INLINE_LIMIT:
        return np.ascontiguousarray(array)
    return await anyio.to_thread.run_sync(np.ascontiguousarray, array)


async def _aiter(inputs: Iterable[Any] | AsyncIterable[Any]) -> AsyncGenerator[Any, None]:
    if isinstance(inputs, AsyncIterable):
        async for item in inputs:
            yield item
    else:
        for item in inputs:
            yield item
