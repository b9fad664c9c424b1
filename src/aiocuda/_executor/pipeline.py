"""One pipeline run: chunks admitted with back-pressure, each sent H2D -> stage -> D2H.

:class:`Pipeline` is what :meth:`aiocuda.executor.Executor.map` returns. Inside its
``async with`` block a feeder task reads the inputs, waits for a free slot (at most
``in_flight`` chunks between admission and delivery) and for a device that accepts the
chunk (:mod:`aiocuda._executor.placement`), then starts one task per chunk. A chunk task enqueues
all of its GPU work without waiting -- the only host wait is the await of its final
download -- and sends its :class:`ChunkResult` to the consumer, which receives them in
input order or as they complete. The slot is freed when the consumer takes the result.

In graph mode (:mod:`aiocuda._executor.graph_mode`) the feeder enqueues most chunks itself,
as replays of a captured graph, and one collector task per device delivers them.

Cancellation and failure: leaving the block early, cancelling the consumer, or (with
``on_error="raise"``) a failing chunk cancels every chunk task. A cancelled chunk frees its
device memory stream-ordered (after the GPU work already enqueued on it) and its host
arrays stay held by their streams until the copies that use them have finished, so no
later run can see torn or reused memory.
"""

from __future__ import annotations

import math
import sys
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Sequence
from types import TracebackType
from typing import Any, Literal

import anyio
import anyio.lowlevel
import numpy as np
import numpy.typing as npt

from .._util import NoPublicConstructor
from .chunk import ChunkResult, ChunkRunner
from .device_streams import DeviceStreams
from .graph_mode import GraphLanes, GraphMode
from .placement import Admission, PlacementName

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

__all__ = ["OnError", "Pipeline", "as_input", "reserve"]

OnError = Literal["raise", "continue"]


class _InputFailed:
    """Sent by the feeder when iterating the inputs raised."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


_Item = ChunkResult | _InputFailed | None
"""What chunk tasks and the feeder send the consumer (None: the inputs are exhausted)."""


class Pipeline(metaclass=NoPublicConstructor):
    """A running :meth:`~aiocuda.executor.Executor.map`; an async context manager whose
    value is an async iterator of :class:`ChunkResult`.

    Attributes while running: :attr:`in_flight` (chunks admitted and not yet delivered),
    :attr:`peak_in_flight`, :attr:`delivered`, :attr:`failures`.

    The ``async with`` block is a cancel scope, as a task group's body is: once a chunk's
    error has been raised (``on_error="raise"``), awaits left in the block are cancelled
    and the block ends there.
    """

    _factories = "Executor.map()"

    def __init__(
        self,
        runner: ChunkRunner,
        inputs: Iterable[npt.NDArray[Any]] | AsyncIterable[npt.NDArray[Any]],
        *,
        device_streams: Sequence[DeviceStreams],
        admission: Admission,
        ordered: bool,
        in_flight: int,
        on_error: OnError,
        placement: PlacementName,
        graph: bool = False,
        graph_lanes: dict[int, GraphLanes] | None = None,
    ) -> None:
        self._runner = runner
        self._graph = graph
        self._graph_lanes = graph_lanes
        self._graphs: GraphMode | None = None
        self._inputs = inputs
        self._device_streams = device_streams
        self._admission = admission
        self._ordered = ordered
        self._limit = in_flight
        self._on_error = on_error
        self._placement = placement
        self._ready: dict[int, ChunkResult] = {}
        self._next = 0
        self._total: int | None = None
        self.delivered = 0
        self.admitted = 0
        self.peak_in_flight = 0
        self.failures: list[ChunkResult] = []
        self._task_group: anyio.abc.TaskGroup | None = None

    @property
    def in_flight(self) -> int:
        return self.admitted - self.delivered

    # -- lifetime ---------------------------------------------------------------------------
    async def __aenter__(self) -> Pipeline:
        self._send, self._receive = anyio.create_memory_object_stream[_Item](math.inf)
        self._slots = anyio.Semaphore(self._limit)
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        if self._graph:
            self._graphs = GraphMode(self._runner, self._done, self._task_group.start_soon, self._graph_lanes)
        self._task_group.start_soon(self._feed)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        assert self._task_group is not None
        self._task_group.cancel_scope.cancel()  # the consumer is done: stop what is left
        try:
            return await self._task_group.__aexit__(exc_type, exc, tb)
        except BaseExceptionGroup as group:
            # The block's own exception (a chunk's error the consumer raised) comes back
            # wrapped by the task group; chunk tasks report their errors as results, so
            # there is nothing else in the group: let the original go on, unwrapped.
            if exc is not None and group.split(lambda e: e is exc)[1] is None:
                return None
            raise
        finally:
            self._send.close()
            self._receive.close()
            if self._graphs is not None:
                self._graphs.close()

    # -- the consumer -----------------------------------------------------------------------
    def __aiter__(self) -> AsyncIterator[ChunkResult]:
        return self

    async def __anext__(self) -> ChunkResult:
        await anyio.lowlevel.checkpoint_if_cancelled()
        while True:
            result = self._take_ready()
            if result is not None:
                return self._deliver(result)
            if self._total is not None and self.delivered == self._total:
                raise StopAsyncIteration
            try:  # results already sent are taken without a trip through the event loop
                item = self._receive.receive_nowait()
            except anyio.WouldBlock:
                item = await self._receive.receive()
            if isinstance(item, _InputFailed):
                raise item.error
            if item is not None:
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
                    error.add_note(f"(in chunk {result.index} on device {result.device})")
                raise error
        return result

    # -- the producers ----------------------------------------------------------------------
    async def _feed(self) -> None:
        assert self._task_group is not None
        index = 0
        cursor = 0
        try:
            async for host in _aiter(self._inputs):
                array = as_input(host)
                if self._graphs is None:
                    await self._slots.acquire()
                else:  # graph mode: replays enqueued back to back while slots are free
                    try:
                        self._slots.acquire_nowait()
                    except anyio.WouldBlock:
                        await self._slots.acquire()
                placed, cursor = await self._admission.admit(
                    self._placement, self._device_streams, reserve(array), cursor
                )
                self.admitted += 1
                self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
                graphs = self._graphs
                route = "eager" if graphs is None else graphs.route(index, array, placed)
                while route == "wait":  # graph mode: the device warms up or is being captured
                    assert graphs is not None
                    await graphs.settled(placed)
                    route = graphs.route(index, array, placed)
                if route == "replay":
                    assert graphs is not None
                    graphs.replay(index, array, placed)
                elif route == "capture":
                    self._task_group.start_soon(self._capture, index, array, placed)
                else:
                    self._task_group.start_soon(self._chunk, index, array, placed)
                index += 1
        except Exception as exc:
            self._send.send_nowait(_InputFailed(exc))
            return
        self._total = index
        self._send.send_nowait(None)  # wake a consumer waiting for a result that will not come

    async def _chunk(self, index: int, host: npt.NDArray[Any], device_streams: DeviceStreams) -> None:
        output: npt.NDArray[Any] | None = None
        error: Exception | None = None
        try:
            output = await self._runner.run(index, host, device_streams)
        except Exception as exc:
            error = exc
        finally:
            if self._graphs is not None:
                self._graphs.warmed(index, device_streams, output is not None)
            self._done(index, host, device_streams, output, error)

    async def _capture(self, index: int, host: npt.NDArray[Any], device_streams: DeviceStreams) -> None:
        """Graph mode: capture the device's graphs with this chunk, then run it as a replay."""
        assert self._graphs is not None
        output: npt.NDArray[Any] | None = None
        error: Exception | None = None
        try:
            output = await self._graphs.capture(index, host, device_streams)
        except Exception as exc:
            error = exc
        finally:
            self._done(index, host, device_streams, output, error)

    def _done(
        self,
        index: int,
        host: npt.NDArray[Any],
        device_streams: DeviceStreams,
        output: npt.NDArray[Any] | None,
        error: Exception | None,
    ) -> None:
        """A chunk is over: give its admission back and deliver its result (none when it
        has neither: it was cancelled)."""
        device_streams.completed += 1
        self._admission.release(device_streams, reserve(host))
        if output is not None or error is not None:
            self._send.send_nowait(ChunkResult(index, device_streams.device.ordinal, output, error))


def reserve(host: npt.NDArray[Any]) -> int:
    """Device bytes reserved for a chunk: its input and an output of the same size."""
    return 2 * int(host.nbytes)


def as_input(host: Any) -> npt.NDArray[Any]:
    array = np.asarray(host)
    if array.dtype.hasobject:
        raise TypeError("pipeline inputs must be numeric numpy arrays, not arrays of Python objects")
    return array if array.flags.c_contiguous else np.ascontiguousarray(array)


async def _aiter(inputs: Iterable[Any] | AsyncIterable[Any]) -> AsyncIterator[Any]:
    if isinstance(inputs, AsyncIterable):
        async for item in inputs:
            yield item
    else:
        for item in inputs:
            yield item
