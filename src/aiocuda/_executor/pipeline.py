"""One pipeline run: chunks admitted with back-pressure, each sent H2D -> stage -> D2H.

:class:`Pipeline` is what :meth:`aiocuda.executor.Executor.map` returns. Inside its
``async with`` block a feeder task reads the inputs, takes a free slot (at most
``in_flight`` chunks between admission and delivery), waits for a device that accepts
the chunk (:mod:`aiocuda._executor.placement`) and enqueues all of the chunk's GPU work
itself, without waiting (:mod:`aiocuda._executor.eager`); one collector task per download
stream awaits the chunks' downloads -- their only host wait -- and sends each
:class:`ChunkResult` to the consumer, which receives them in input order or as they
complete. The slot is freed when the consumer takes the result.

In graph mode (:mod:`aiocuda._executor.graph_mode`) the feeder enqueues most chunks as
replays of a captured graph, and one collector task per device delivers them.

Cancellation and failure: leaving the block early, cancelling the consumer, or (with
``on_error="raise"``) a failing chunk cancels the collectors and every task. A chunk
cancelled in flight frees its device memory stream-ordered (after the GPU work already
enqueued on it) and its host arrays stay held by their streams until the copies that use
them have finished, so no later run can see torn or reused memory.

The executor closing: every pipeline of an executor shares its :class:`Pipelines`. Once
the executor's block is being left, feeders admit no more chunks (the next one, or one
waiting for room, raises :class:`~aiocuda.errors.ClosedError` into the iteration), and the
executor waits until the chunks already admitted are over -- their results queued for the
consumer, not taken by it -- before it closes the streams they use.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Iterable, Sequence
from types import TracebackType
from typing import Any, TypeVar

import anyio
import numpy.typing as npt

from .._util import NoPublicConstructor
from ..errors import ClosedError, ContextPoisonedError
from .chunk import ChunkResult, ChunkRunner
from .chunk_map import ChunkMap, OnError
from .device_streams import DeviceStreams
from .eager import EagerMode
from .graph_lanes import GraphLanes
from .graph_mode import GraphMode
from .placement import Admission, Loaded, PlacementName

__all__ = ["Pipeline", "Pipelines", "reserve"]

L = TypeVar("L", bound=Loaded)


class _OpenMaps:
    """The maps of an executor whose ``async with`` block is open, over all its openings."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0


class Pipelines:
    """What an executor knows of the pipelines of one opening (one ``async with`` block):
    whether they may still admit chunks and how many of the chunks they admitted are
    running; and how many maps of the executor are running, whichever opening made them.

    :meth:`close` (the executor's block is being left, or it closes) refuses their next
    chunks with :class:`~aiocuda.errors.ClosedError`, those waiting for room included;
    :meth:`drain` then waits until the chunks they had admitted are over. The executor
    entered again starts afresh with :meth:`reopened`.
    """

    __slots__ = ("_idle", "_open_maps", "_waiting", "closed", "running")

    def __init__(self, open_maps: _OpenMaps | None = None) -> None:
        self.closed = False
        self._open_maps = _OpenMaps() if open_maps is None else open_maps
        self.running = 0
        """Chunks admitted to a device and not over yet (:meth:`Pipeline._done`)."""
        self._idle: anyio.Event | None = None
        """Set when ``running`` falls to zero while :meth:`drain` waits."""
        self._waiting: set[anyio.CancelScope] = set()
        """The admissions waiting for room, cancelled by :meth:`close`."""

    def reopened(self) -> Pipelines:
        """The pipelines of the executor's next opening: none of this one's chunks, and
        open to new ones, while this one stays refused; the maps still running from this
        one (or earlier: a map made here whose block another task keeps open, or enters
        later) count on among :attr:`maps` until their block is left."""
        return Pipelines(self._open_maps)

    @property
    def maps(self) -> int:
        """Maps whose ``async with`` block is open, made in this opening of the executor
        or an earlier one (:meth:`entered`, :meth:`left`)."""
        return self._open_maps.count

    def entered(self) -> None:
        """A map's ``async with`` block opened."""
        self._open_maps.count += 1

    def left(self) -> None:
        """A map's ``async with`` block was left."""
        self._open_maps.count -= 1

    def close(self) -> None:
        """Admit no more chunks: the next one, and those waiting for room, raise
        :class:`~aiocuda.errors.ClosedError` in their pipeline's feeder."""
        self.closed = True
        for scope in self._waiting:
            scope.cancel()

    async def drain(self) -> None:
        """Wait until every chunk admitted is over: its GPU work done (or failed) and its
        result queued for its consumer, whether that consumer reads it or not."""
        try:
            while self.running:
                self._idle = anyio.Event()
                await self._idle.wait()
        finally:
            self._idle = None

    async def admit(
        self, admission: Admission, policy: PlacementName, candidates: Sequence[L], nbytes: int, cursor: int
    ) -> tuple[L, int]:
        """``admission.admit(...)``, refused with :class:`~aiocuda.errors.ClosedError`
        when the executor closes while it waits."""
        with anyio.CancelScope() as scope:
            self._waiting.add(scope)
            try:
                placed, cursor = await admission.admit(policy, candidates, nbytes, cursor)
            finally:
                self._waiting.discard(scope)
            if not self.closed:
                return placed, cursor
            # (admitted as it closed: on trio a task already woken is not cancelled)
            admission.release(placed, nbytes)
        raise _closed()

    def over(self) -> None:
        """One of the ``running`` chunks is over."""
        self.running -= 1
        if not self.running and self._idle is not None:
            self._idle.set()


def _closed() -> ClosedError:
    return ClosedError("the executor closed while this map ran: it takes no more inputs")


class Pipeline(ChunkMap, metaclass=NoPublicConstructor):
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
        pipelines: Pipelines,
        ordered: bool,
        in_flight: int,
        on_error: OnError,
        placement: PlacementName,
        graph: bool = False,
        graph_lanes: dict[int, GraphLanes] | None = None,
    ) -> None:
        super().__init__(inputs, ordered=ordered, on_error=on_error)
        self._runner = runner
        self._graph = graph
        self._graph_lanes = graph_lanes
        self._graphs: GraphMode | None = None
        self._eager: EagerMode | None = None
        self._device_streams = device_streams
        self._admission = admission
        self._pipelines = pipelines
        self._limit = in_flight
        self._placement = placement
        self._cursor = 0

    # -- lifetime ---------------------------------------------------------------------------
    async def __aenter__(self) -> Pipeline:
        task_group = await self._open(self._limit)
        if self._graph:
            self._graphs = GraphMode(self._runner, self._done, task_group.start_soon, self._graph_lanes)
        else:
            self._eager = EagerMode(self._runner, self._done, task_group.start_soon)
        self._feed_soon()
        self._pipelines.entered()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        try:
            return await self._close(exc_type, exc, tb)
        finally:
            self._pipelines.left()
            if self._graphs is not None:
                self._graphs.close()
            if self._eager is not None:
                self._eager.close()

    # -- the producers ----------------------------------------------------------------------
    def _take_slot_nowait(self) -> bool:
        try:  # chunks enqueued back to back while slots are free
            self._slots.acquire_nowait()
        except anyio.WouldBlock:
            return False
        return True

    async def _start_chunk(self, index: int, array: npt.NDArray[Any]) -> None:
        assert self._task_group is not None
        pipelines = self._pipelines
        if pipelines.closed:
            raise _closed()
        admission, nbytes = self._admission, reserve(array)
        placed, self._cursor = admission.try_admit(self._placement, self._device_streams, nbytes, self._cursor)
        if placed is None:  # no device has room: wait for one (the executor's back-pressure)
            try:
                placed, self._cursor = await pipelines.admit(
                    admission, self._placement, self._device_streams, nbytes, self._cursor
                )
            except ContextPoisonedError as exc:  # every device has failed: so does the chunk
                self._admitted()
                self._send_result(ChunkResult(index, self._device_streams[0].device.ordinal, None, exc))
                return
        pipelines.running += 1  # until _done: what the executor's exit waits for
        self._admitted()
        graphs = self._graphs
        if graphs is None:
            assert self._eager is not None
            self._eager.start(index, array, placed)
            return
        route = graphs.route(index, array, placed)
        while route == "wait":  # the device warms up or is being captured
            try:
                await graphs.settled(placed)
            except BaseException:  # cancelled: the chunk never started
                admission.release(placed, nbytes)
                pipelines.over()
                raise
            route = graphs.route(index, array, placed)
        if route == "capture":
            self._task_group.start_soon(self._capture, index, array, placed)
        elif route == "eager":
            self._task_group.start_soon(self._chunk, index, array, placed)
        # else "replay": enqueued by route()

    async def _chunk(self, index: int, host: npt.NDArray[Any], device_streams: DeviceStreams) -> None:
        """Graph mode: a chunk run eagerly, in a task of its own (it may warm the device up)."""
        assert self._graphs is not None
        output: npt.NDArray[Any] | None = None
        error: Exception | None = None
        try:
            output = await self._runner.run(index, host, device_streams)
        except Exception as exc:
            error = exc
        finally:
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
        device_streams.saw(error)
        self._admission.release(device_streams, reserve(host))
        self._pipelines.over()
        if output is not None or error is not None:
            self._send_result(ChunkResult(index, device_streams.device.ordinal, output, error))


def reserve(host: npt.NDArray[Any]) -> int:
    """Device bytes reserved for a chunk: its input and an output of the same size."""
    return 2 * int(host.nbytes)
