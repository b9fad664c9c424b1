"""One pipeline run: chunks admitted with back-pressure, each sent H2D -> stage -> D2H.

:class:`Pipeline` is what :meth:`aiocuda.executor.Executor.map` returns. Inside its
``async with`` block a feeder task reads the inputs, waits for a free slot (at most
``in_flight`` chunks between admission and delivery) and for a device that accepts the
chunk (:mod:`aiocuda._placement`), then starts one task per chunk. A chunk task enqueues
all of its GPU work without waiting -- the only host wait is the await of its final
download -- and sends its :class:`ChunkResult` to the consumer, which receives them in
input order or as they complete. The slot is freed when the consumer takes the result.

Cancellation and failure: leaving the block early, cancelling the consumer, or (with
``on_error="raise"``) a failing chunk cancels every chunk task. A cancelled chunk frees its
device memory stream-ordered (after the GPU work already enqueued on it) and its host
arrays stay held by their streams until the copies that use them have finished, so no
later run can see torn or reused memory.
"""

from __future__ import annotations

import inspect
import math
import sys
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

import anyio
import anyio.lowlevel
import numpy as np
import numpy.typing as npt

from . import _staging
from ._placement import Admission, PlacementName
from .array import DeviceArray, empty
from .device import Device, as_device
from .errors import ArgumentError, ResultCode
from .host import pinned_ranges
from .stream import Stream
from .trace import PendingSpan, Trace

if TYPE_CHECKING:
    from .executor import DeviceLanes

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

__all__ = [
    "ChunkContext",
    "ChunkResult",
    "ChunkRunner",
    "OnError",
    "OutputFn",
    "Pipeline",
    "Stage",
    "as_input",
    "reserve",
]

StageResult = DeviceArray | None
Stage = Callable[["ChunkContext", DeviceArray], StageResult | Awaitable[StageResult]]
"""``stage(ctx, x)``: enqueue a chunk's work on ``ctx.stream``; return the array to
download (``None``: ``x``)."""

OutputFn = Callable[[int, DeviceArray], npt.NDArray[Any]]
"""``output(index, device_result)``: the host array chunk ``index`` is downloaded into."""

OnError = Literal["raise", "continue"]


@dataclass(frozen=True, slots=True)
class ChunkResult:
    """The outcome of one chunk."""

    index: int
    """Position of the chunk's input in ``inputs``."""
    device: int
    """Ordinal of the device the chunk was placed on."""
    output: npt.NDArray[Any] | None
    """The downloaded result (None when the chunk failed)."""
    error: Exception | None
    """Why the chunk failed (None when it succeeded)."""

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def value(self) -> npt.NDArray[Any]:
        """The result; raises the chunk's error if it failed."""
        if self.error is not None:
            raise self.error
        assert self.output is not None
        return self.output


class ChunkContext:
    """What a stage gets besides its input: where to enqueue, and chunk-scoped memory.

    Attributes:
        index: the chunk's position in the inputs.
        host: the chunk's host input (read-only use: its upload may still be running).
        stream: the compute stream to enqueue the stage's kernels on. Work on it is
            already ordered after the chunk's upload.

    Pitfalls: a stage must not wait for the GPU (no ``await stream``, no synchronize):
    that would stall the chunk's own pipeline slot for nothing, the download is awaited
    for it. Memory from :meth:`empty` lives until the chunk's download has completed (or
    the chunk failed) and is then freed; keep nothing from it beyond the stage.
    """

    __slots__ = ("_arrays", "_compute", "_lanes_of", "_spans", "_trace", "host", "index", "lanes", "name", "stream")

    def __init__(
        self,
        index: int,
        host: npt.NDArray[Any],
        lanes: DeviceLanes,
        lanes_of: Callable[[Device], DeviceLanes],
        trace: Trace | None,
        name: str,
    ) -> None:
        self.index = index
        self.host = host
        self.lanes = lanes
        self._lanes_of = lanes_of
        self._trace = trace
        self.name = name
        self.stream: Stream = lanes.compute[0]  # set by _begin_compute before the stage runs
        self._arrays: list[tuple[DeviceArray, Stream]] = []
        """The chunk's device arrays, each with the stream it was allocated on."""
        self._compute: PendingSpan | None = None
        self._spans: list[PendingSpan] = []

    @property
    def device(self) -> Device:
        """The device the chunk is on now."""
        return self.lanes.device

    def empty(self, shape: int | tuple[int, ...], dtype: npt.DTypeLike = np.float32) -> DeviceArray:
        """A device array for this chunk, allocated stream-ordered on :attr:`stream` from
        the device's pool, freed once the chunk's download has completed."""
        return self._allocate(shape, dtype, self.lanes, self.stream)

    def move(self, array: DeviceArray, device: Device | int) -> DeviceArray:
        """Copy ``array`` to ``device`` (one of the executor's) GPU to GPU and continue
        the chunk there: afterwards :attr:`stream` is that device's compute stream,
        ordered after the copy. Uses the direct peer path where the devices allow it.

        The copy runs on the source device's ``p2p`` stream, so neither device's compute
        stream stalls for it.
        """
        target = self._lanes_of(as_device(device))
        if target is self.lanes:
            return array
        if not array.is_c_contiguous:
            raise ArgumentError("move() needs a C-contiguous array", code=ResultCode.INVALID_VALUE)
        source = self.lanes
        self._end_compute()
        p2p = source.p2p
        array.buffer._used_on(p2p)  # after the stage's kernels; frees the source after the copy
        moved = self._allocate(array.shape, array.dtype, target, target.p2p)
        p2p.wait(target.p2p)  # the allocation on the target is enqueued before the copy
        span = self._trace.start(p2p, "p2p", "p2p", chunk=self.index) if self._trace else None
        source.device.make_current()
        source.device._driver.memcpy_peer_async(
            moved.ptr, target.device._context, array.ptr, source.device._context, array.nbytes, p2p.handle
        )
        if span is not None:
            Trace.stop(span, p2p)
            self._spans.append(span)
        self.lanes = target
        self._begin_compute(moved, copied_on=p2p)
        return moved

    # -- for the pipeline ---------------------------------------------------------------------
    def _allocate(
        self, shape: int | tuple[int, ...], dtype: npt.DTypeLike, lanes: DeviceLanes, stream: Stream
    ) -> DeviceArray:
        """An array of the chunk's, allocated on ``stream`` from ``lanes``' pool and
        freed with the chunk (on that stream, once the download is done: :meth:`_free_done`)."""
        array = empty(shape, dtype, stream=stream, pool=lanes.pool)
        self._arrays.append((array, stream))
        return array

    def _begin_compute(self, ready: DeviceArray, copied_on: Stream | None = None) -> None:
        """Switch to the next compute stream, ordered (on the GPU) after the work that
        produced ``ready`` -- and after ``copied_on``, for a copy from another device --
        then start the compute span: its start event must come after those waits."""
        track, self.stream = self.lanes.next_compute()
        if copied_on is not None:
            self.stream.wait(copied_on)
        ready.buffer._used_on(self.stream)
        if self._trace is not None:
            self._compute = self._trace.start(self.stream, "compute", self.name, chunk=self.index, track=track)

    def _end_compute(self) -> None:
        span, self._compute = self._compute, None
        if span is not None:
            Trace.stop(span, self.stream)
            self._spans.append(span)

    def _free(self) -> None:
        """Free the chunk's arrays stream-ordered, each after its last use: for a chunk
        that failed or was cancelled, whose GPU work may still be running."""
        for array, _ in self._arrays:
            array.buffer.free()
        self._arrays.clear()

    def _free_done(self) -> None:
        """Free the chunk's arrays once its download has been awaited: each on the stream
        it was allocated on, where the next chunk's allocation reuses it at once (see
        ``DeviceBuffer._free_idle``). Every executor stream a chunk's arrays are used on is
        ordered before the download; an array last used on another stream (a stage's own)
        is not known to be idle, and gets the stream-ordered free."""
        for array, allocated_on in self._arrays:
            buffer = array.buffer
            if buffer.freed:
                continue
            if buffer.stream in self._lanes_of(buffer.device).streams:
                buffer._free_idle(allocated_on)
            else:
                buffer.free()
        self._arrays.clear()


@dataclass(frozen=True, slots=True)
class ChunkRunner:
    """How each chunk of a pipeline (or a lone :meth:`~aiocuda.executor.Executor.submit`)
    is processed: its stage, where its results go, and the executor's lanes and trace."""

    stage: Stage
    lanes_of: Callable[[Device], DeviceLanes]
    trace: Trace | None
    output: OutputFn | None
    name: str

    async def run(self, index: int, host: npt.NDArray[Any], lanes: DeviceLanes) -> npt.NDArray[Any]:
        """Send one chunk, admitted on ``lanes``, through upload, stage and download;
        return the host result once it is there. Memory is returned whatever happens."""
        trace = self.trace
        ctx = ChunkContext(index, host, lanes, self.lanes_of, trace, self.name)
        try:
            h2d = lanes.h2d
            x = ctx._allocate(host.shape, host.dtype, lanes, h2d)
            span = trace.start(h2d, "h2d", "h2d", chunk=index) if trace else None
            await _staging.host_to_device(x.ptr, host, h2d)
            if span is not None:
                Trace.stop(span, h2d)
                ctx._spans.append(span)
            ctx._begin_compute(x)  # the compute stream waits for the upload, on the GPU
            returned = self.stage(ctx, x)
            if inspect.isawaitable(returned):
                returned = await returned
            if returned is not None and not isinstance(returned, DeviceArray):
                raise TypeError(f"a stage returns a DeviceArray or None, not {type(returned).__name__}")
            result = x if returned is None else returned
            ctx._end_compute()
            dest = self.destination(index, result)
            d2h = self.lanes_of(result.device).d2h
            result.buffer._used_on(d2h)  # the download waits for the stage, on the GPU
            span = trace.start(d2h, "d2h", "d2h", chunk=index) if trace else None
            pinned = pinned_ranges.owner(int(dest.ctypes.data), max(dest.nbytes, 1)) is not None
            if pinned and dest.nbytes:
                d2h.device.make_current()
                d2h.device._driver.memcpy_dtoh_async(int(dest.ctypes.data), result.ptr, dest.nbytes, d2h.handle)
                d2h.hold(dest)
            else:
                await _staging.device_to_host(dest, result.ptr, d2h)
            if span is not None:
                Trace.stop(span, d2h)
                ctx._spans.append(span)
            await d2h  # the download and those before it on the stream
            ctx._free_done()
            if trace is not None:
                trace.resolve(*ctx._spans)
                ctx._spans.clear()
            return dest
        finally:
            ctx._end_compute()
            ctx._free()
            if trace is not None and ctx._spans:
                trace.discard(*ctx._spans)

    def destination(self, index: int, result: DeviceArray) -> npt.NDArray[Any]:
        """The host array chunk ``index``'s ``result`` is downloaded into, checked."""
        if not result.is_c_contiguous:
            raise ArgumentError("a stage's result must be C-contiguous", code=ResultCode.INVALID_VALUE)
        if self.output is None:
            return np.empty(result.shape, result.dtype)
        dest = self.output(index, result)
        if not isinstance(dest, np.ndarray):
            raise TypeError(f"output() returns a numpy array, not {type(dest).__name__}")
        if dest.nbytes != result.nbytes or dest.dtype != result.dtype or not dest.flags.c_contiguous:
            raise ArgumentError(
                f"output() gave a {dest.shape} {dest.dtype} array for a {result.shape} {result.dtype} result "
                "(it must be C-contiguous with the same dtype and size)",
                code=ResultCode.INVALID_VALUE,
            )
        if not dest.flags.writeable:
            raise ArgumentError("output() gave a read-only array", code=ResultCode.INVALID_VALUE)
        return dest


class _InputFailed:
    """Sent by the feeder when iterating the inputs raised."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


_Item = ChunkResult | _InputFailed | None
"""What chunk tasks and the feeder send the consumer (None: the inputs are exhausted)."""


class Pipeline:
    """A running :meth:`~aiocuda.executor.Executor.map`; an async context manager whose
    value is an async iterator of :class:`ChunkResult`.

    Attributes while running: :attr:`in_flight` (chunks admitted and not yet delivered),
    :attr:`peak_in_flight`, :attr:`delivered`, :attr:`failures`.

    The ``async with`` block is a cancel scope, as a task group's body is: once a chunk's
    error has been raised (``on_error="raise"``), awaits left in the block are cancelled
    and the block ends there.
    """

    def __init__(
        self,
        runner: ChunkRunner,
        inputs: Iterable[npt.NDArray[Any]] | AsyncIterable[npt.NDArray[Any]],
        *,
        lanes: Sequence[DeviceLanes],
        admission: Admission,
        ordered: bool,
        in_flight: int,
        on_error: OnError,
        placement: PlacementName,
    ) -> None:
        self._runner = runner
        self._inputs = inputs
        self._lanes = lanes
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
                await self._slots.acquire()
                lane, cursor = await self._admission.admit(self._placement, self._lanes, reserve(array), cursor)
                self.admitted += 1
                self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
                self._task_group.start_soon(self._chunk, index, array, lane)
                index += 1
        except Exception as exc:
            self._send.send_nowait(_InputFailed(exc))
            return
        self._total = index
        self._send.send_nowait(None)  # wake a consumer waiting for a result that will not come

    async def _chunk(self, index: int, host: npt.NDArray[Any], lanes: DeviceLanes) -> None:
        try:
            output = await self._runner.run(index, host, lanes)
            result = ChunkResult(index, lanes.device.ordinal, output, None)
        except Exception as exc:
            result = ChunkResult(index, lanes.device.ordinal, None, exc)
        finally:
            lanes.completed += 1
            self._admission.release(lanes, reserve(host))
        self._send.send_nowait(result)


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
