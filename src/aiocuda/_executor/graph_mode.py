"""Graph mode of a pipeline (``Executor.map(..., graph=True)``): a chunk's work captured
once per device and lane, replayed for every chunk with that chunk's data.

Per device, the first chunk runs eagerly: it loads the stage's modules and warms up the
libraries it calls, which must not happen during a capture. Once it has succeeded, the
next chunk is captured on each graph lane of the device (:mod:`.graph_lanes`) -- its
upload from page-locked memory, the stage (called once per lane: the uploaded input and
the stage's ``ctx.empty`` arrays become graph memory) and its download -- and replayed
on the first lane. The executor keeps the captured graphs of a stage
(:class:`~.graph_lanes.GraphLanes`, per device) for its later pipelines of the same
stage object, which replay from their first chunk. Every later chunk of the same shape
and dtype is a replay on the next free lane in turn: a small chunk is copied into the
lane's own page-locked buffer, a larger one is pointed at by the graph's two copies;
then one graph launch and one event recorded; no task of its own and no call of the
stage. One collector task per device awaits the replays in the order they were
launched and delivers their results (copied out of the lane's buffer, for a small
chunk). Lanes replay side by side, so chunks overlap as on the eager path.

A capture that fails -- a stage that waits for the GPU, copies pageable memory, moves the
chunk to another device, or raises -- leaves the device on the eager path for the rest of
the pipeline, with a one-line note in the trace; that chunk then runs eagerly, so its
result or error is the eager path's. Chunks of another shape or dtype, pageable inputs
larger than ``staging.INLINE_LIMIT``, and small chunks that find every lane busy run
eagerly too. Results default to page-locked arrays; a pageable ``output=`` destination
is filled from page-locked memory once the replay is done.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable
from typing import Any, Literal

import anyio
import anyio.to_thread
import numpy as np
import numpy.typing as npt

from .._completion.engine import current_engine
from .._completion.event_pool import EventPool
from .._memory import copies as _copies
from .._memory import staging as _staging
from .._memory.pinned import host_address, pinned_address
from ..array import DeviceArray, empty
from ..errors import CaptureError, CudaError
from ..graph import Graph
from ..host import is_pinned, pinned_empty
from ..stream import Stream
from ..trace import Trace, _PendingSpan
from .chunk import ChunkContext, ChunkRunner
from .collectors import Deliveries, EventWait, Finish
from .device_streams import DeviceStreams
from .graph_lanes import LANES, STAGED_LANES, STAGED_LIMIT, GraphLane, GraphLanes

__all__ = ["GraphMode", "Route"]

_log = logging.getLogger("aiocuda")

Route = Literal["replay", "capture", "eager", "wait"]
"""How :meth:`GraphMode.route` sends a chunk: ``"replay"`` (enqueued by ``route`` itself)
or one the pipeline starts."""


class _Replay:
    """A chunk whose replay is enqueued: what its result needs once the replay is done."""

    __slots__ = ("dest", "event", "host", "index", "keep", "lane", "span", "staged")

    def __init__(
        self,
        index: int,
        host: npt.NDArray[Any],
        dest: npt.NDArray[Any],
        staged: npt.NDArray[Any] | None,
        keep: tuple[Any, ...],
        lane: GraphLane,
        event: Any,
        span: _PendingSpan | None,
    ) -> None:
        self.index = index
        self.host = host
        self.dest = dest
        self.staged = staged
        """The page-locked array the replay downloads into, copied to ``dest`` once it is
        done: the lane's own (staged lanes), or one for a pageable ``dest``."""
        self.keep = keep
        """Host memory the replay reads or writes (kept until it is done)."""
        self.lane = lane
        self.event = event
        self.span = span


class _Queue(Deliveries[_Replay]):
    """One pipeline's replays on one device: the stage's graphs there, the next lane,
    and the replays awaiting delivery."""

    __slots__ = ("lanes", "turn")

    def __init__(self, lanes: GraphLanes) -> None:
        super().__init__()
        self.lanes = lanes
        self.turn = 0


class GraphMode:
    """Graph mode for one pipeline (see the module docstring).

    ``route`` tells the pipeline how to run each admitted chunk: as a replay (enqueued
    by ``route`` itself), a capture (:meth:`capture`, in a task of its own), eagerly
    (``ChunkRunner.run``, which reports to :meth:`warmed`), or not yet: ``"wait"`` while
    the device warms up or is captured (:meth:`settled`), then route it again. ``shared`` holds the
    stage's :class:`GraphLanes` by device ordinal: the executor's for the stage, or None
    for graphs of this pipeline alone.
    """

    def __init__(
        self,
        runner: ChunkRunner,
        finish: Finish,
        start: Callable[..., object],
        shared: dict[int, GraphLanes] | None = None,
        lanes: int = LANES,
    ) -> None:
        self._runner = runner
        self._finish = finish
        self._start = start
        self._lane_count = lanes
        self._own = shared is None
        self._shared: dict[int, GraphLanes] = {} if shared is None else shared
        self._queues: dict[DeviceStreams, _Queue] = {}

    def close(self) -> None:
        """The pipeline's task group is over: a warm-up or capture of its own that did not
        finish is left to the next pipeline, replays no collector has left (queued for
        one that never ran) are left, and graphs of its own are released."""
        for device_streams, queue in self._queues.items():
            self._leave(queue, device_streams, EventPool.for_device(device_streams.device))
        for lanes in self._shared.values():
            if lanes.state == "warming" and lanes.owner[0] is self:
                lanes.settle("new")
            if self._own:
                lanes.close()

    def _queue(self, device_streams: DeviceStreams) -> _Queue:
        """This pipeline's queue on the device (with the stage's graphs there)."""
        found = self._queues.get(device_streams)
        if found is None:
            ordinal = device_streams.device.ordinal
            lanes = self._shared.get(ordinal)
            if lanes is None:
                lanes = self._shared[ordinal] = GraphLanes()
            found = self._queues[device_streams] = _Queue(lanes)
        return found

    def _lanes(self, device_streams: DeviceStreams) -> GraphLanes:
        return self._queue(device_streams).lanes

    # -- routing --------------------------------------------------------------------------------
    def route(self, index: int, host: npt.NDArray[Any], device_streams: DeviceStreams) -> Route:
        queue = self._queue(device_streams)
        lanes = queue.lanes
        state = lanes.state
        if state == "ready":
            fits = host.shape == lanes.shape and host.dtype == lanes.dtype
            if fits and (lanes.staged or host.nbytes <= _staging.INLINE_LIMIT or is_pinned(host)):
                return self._replay(queue, index, host, device_streams)
            return "eager"
        if state == "new":
            lanes.begin("warming", (self, index))
        elif state == "capture":
            lanes.begin("capturing", self)
            return "capture"
        elif state in ("warming", "capturing"):
            return "wait"  # a moment: the device is about to replay
        return "eager"

    async def settled(self, device_streams: DeviceStreams) -> None:
        """Wait until the device's warm-up or capture in progress has ended."""
        settled = self._lanes(device_streams).settled
        if settled is not None:
            await settled.wait()

    def warmed(self, index: int, device_streams: DeviceStreams, ok: bool) -> None:
        """An eager chunk finished: the device may be captured next, if it was warming up."""
        lanes = self._lanes(device_streams)
        if lanes.state == "warming" and lanes.owner == (self, index):
            lanes.settle("capture" if ok else "new")

    # -- capture --------------------------------------------------------------------------------
    async def capture(self, index: int, host: npt.NDArray[Any], device_streams: DeviceStreams) -> npt.NDArray[Any]:
        """Capture the device's lanes with chunk ``index`` and run it as the first replay;
        on failure, note it and run the chunk eagerly (the device stays eager)."""
        lanes = self._lanes(device_streams)
        runner = self._runner
        try:
            dest, staged_in, staged_out = await self._capture_lanes(lanes, index, host, device_streams)
        except Exception as exc:
            lanes.close()
            lanes.settle("eager")
            device = device_streams.device.ordinal
            note = (
                f"graph mode: stage {runner.name!r} on device {device} runs eagerly: its work could not be "
                f"captured ({type(exc).__name__}: {exc})"
            )
            _log.info("aiocuda: %s", note)
            if runner.trace is not None:
                runner.trace.note(note)
            return await runner.run(index, host, device_streams)
        except BaseException:  # cancelled: the next chunk (of any pipeline) captures
            lanes.close()
            lanes.settle("capture")
            raise
        lanes.settle("ready")
        queue = self._queue(device_streams)
        self._collector(queue, device_streams)
        lane = lanes.lanes[0]
        queue.turn = 1 % len(lanes.lanes)
        if lanes.staged:
            assert lane.staged_in is not None
            lane.busy = True
            lane.staged_in[...] = host
        trace = runner.trace
        span = None if trace is None else self._span(trace, lane, index)
        launched = lane.graph.launch(lane.stream)
        if span is not None:
            Trace._stop(span, lane.stream)
        try:
            await launched
        except BaseException:
            with contextlib.suppress(CudaError):  # a poisoned context runs nothing more
                lane.stream.hold(staged_in, staged_out)
                if lanes.staged:
                    lane.abandon()
            raise
        if staged_out is not None:
            await _copy(dest, staged_out)
        lane.busy = False
        if span is not None and trace is not None:
            trace._resolve(span)
        return dest

    async def _capture_lanes(
        self, lanes: GraphLanes, index: int, host: npt.NDArray[Any], device_streams: DeviceStreams
    ) -> tuple[npt.NDArray[Any], npt.NDArray[Any] | None, npt.NDArray[Any] | None]:
        """Capture every lane with chunk ``index``'s addresses (pointed lanes) or their
        own buffers' (staged lanes); ``(dest, staged input, staged output)``: the chunk's
        destination and the page-locked copies its first replay uses."""
        device = device_streams.device
        staged = lanes.staged = host.nbytes <= STAGED_LIMIT
        count = max(1, min(STAGED_LANES if staged else self._lane_count, device_streams.max_chunks))
        if len(device_streams.graph_lanes) < count:
            device_streams.graph_lanes += await anyio.to_thread.run_sync(
                _make_streams, device, count - len(device_streams.graph_lanes), device_streams.h2d.priority
            )
        staged_in = None if staged or is_pinned(host) else await _pin(host)
        dest: npt.NDArray[Any] | None = None
        staged_out: npt.NDArray[Any] | None = None
        for k, stream in enumerate(device_streams.graph_lanes[:count]):
            lane_in = lane_out = None
            if staged:
                source = lane_in = pinned_empty(host.shape, host.dtype, device=device)
            else:
                source = host if staged_in is None else staged_in
            src = host_address(source)
            ctx = ChunkContext._create(index, host, device_streams, self._runner.streams_of, None, self._runner.name)
            ctx.stream = stream
            async with stream.capture(mode="relaxed") as graph:
                x = empty(host.shape, host.dtype, stream=stream)
                x_ptr = x.ptr
                _copies.enqueue_upload(x_ptr, src, host.nbytes, stream)
                returned = self._runner.stage(ctx, x)
                if inspect.isawaitable(returned):
                    returned = await returned
                if returned is not None and not isinstance(returned, DeviceArray):
                    raise TypeError(f"a stage returns a DeviceArray or None, not {type(returned).__name__}")
                result = x if returned is None else returned
                if result.device is not device:
                    raise CaptureError("the stage moved the chunk to another device", name="AIOCUDA_NOT_CAPTURABLE")
                if dest is None:
                    dest = self._destination(index, result, contiguous=False)
                    if not (staged or is_pinned(dest)):
                        staged_out = pinned_empty(dest.shape, dest.dtype, device=device)
                    lanes.template, lanes.shape, lanes.dtype = result, host.shape, host.dtype
                if staged:
                    target = lane_out = pinned_empty(result.shape, result.dtype, device=device)
                else:
                    target = dest if staged_out is None else staged_out
                dst = host_address(target)
                result_ptr = result.ptr
                _copies.enqueue_download(dst, result_ptr, result.nbytes, stream)
            lane = GraphLane(k, stream, graph, x_ptr, result_ptr)
            lanes.lanes.append(lane)
            if staged:
                lane.staged_in, lane.staged_out = lane_in, lane_out
                continue
            lane.set_upload = graph._copy_setter(_copy_node(graph, "htod", x_ptr, src))
            lane.set_download = graph._copy_setter(_copy_node(graph, "dtoh", dst, result_ptr))
            lane.set_upload(x_ptr, src)  # the driver takes these updates: else the device stays eager
            lane.set_download(dst, result_ptr)
        assert dest is not None
        if staged:
            first = lanes.lanes[0]
            return dest, first.staged_in, first.staged_out
        return dest, staged_in, staged_out

    def _destination(self, index: int, result: DeviceArray, *, contiguous: bool = True) -> npt.NDArray[Any]:
        """Where chunk ``index``'s result goes: ``output()``'s array, or a page-locked one.
        ``result`` is the capture's (checked C-contiguous then, when ``contiguous``)."""
        if self._runner.output is None:
            if not (contiguous or result.is_c_contiguous):
                return self._runner.destination(index, result)  # raises its error
            return pinned_empty(result.shape, result.dtype, device=result.device)
        return self._runner.destination(index, result, contiguous=contiguous)

    # -- replays -----------------------------------------------------------------------------------
    def _collector(self, queue: _Queue, device_streams: DeviceStreams) -> None:
        """Start the device's collector, unless it runs."""
        if not queue.collecting:
            queue.collecting = True
            self._start(self._collect, queue, device_streams)

    def _replay(self, queue: _Queue, index: int, host: npt.NDArray[Any], device_streams: DeviceStreams) -> Route:
        """Enqueue chunk ``index`` as a replay on the device's next free lane (a chunk that
        :meth:`route` sends so): ``"replay"``, or ``"eager"`` when every staged lane is
        busy. The device's collector delivers its result."""
        if not queue.collecting:
            self._collector(queue, device_streams)
        lanes = queue.lanes
        every = lanes.lanes
        count = len(every)
        turn = queue.turn
        lane = every[turn]
        if lanes.staged and lane.busy:  # (lanes free up in turn, unless a cancelled pipeline left one)
            for k in range(1, count + 1):
                lane = every[(turn + k) % count]
                if not lane.busy or lane.reclaim():
                    break
            else:
                return "eager"
        queue.turn = (lane.index + 1) % count
        try:
            assert lanes.template is not None
            dest = self._destination(index, lanes.template)
            if lanes.staged:
                staged_in, staged = lane.staged_in, lane.staged_out
                assert staged_in is not None
                keep: tuple[Any, ...] = (staged_in, staged)
                lane.busy = True
                staged_in[...] = host
            else:
                staged, keep = self._point(lane, host, dest)
            stream = lane.stream
            trace = self._runner.trace
            span = None if trace is None else self._span(trace, lane, index)
            lane.graph._enqueue(stream)
            if span is not None:
                Trace._stop(span, stream)
            event = lane.events.acquire()
            lane.record(event, stream._handle)
        except Exception as exc:
            lane.busy = False
            self._finish(index, host, device_streams, None, exc)
            return "replay"
        except BaseException:  # (a KeyboardInterrupt in output(), say: the pipeline is over)
            lane.busy = False  # (else the chunk stayed admitted for the executor's life)
            self._finish(index, host, device_streams, None, None)
            raise
        queue.add(_Replay(index, host, dest, staged, keep, lane, event, span))
        return "replay"

    @staticmethod
    def _point(
        lane: GraphLane, host: npt.NDArray[Any], dest: npt.NDArray[Any]
    ) -> tuple[npt.NDArray[Any] | None, tuple[Any, ...]]:
        """Point a pointed lane's copies at the chunk (through page-locked copies of
        pageable memory); ``(staged output, host memory to keep)``."""
        source = host
        src = pinned_address(host)
        if not src:
            source = pinned_empty(host.shape, host.dtype)
            source[...] = host
            src = host_address(source)
        target, staged = dest, None
        dst = pinned_address(dest)
        if not dst:
            target = staged = pinned_empty(dest.shape, dest.dtype)
            dst = host_address(staged)
        lane.set_upload(lane.x_ptr, src)
        lane.set_download(dst, lane.result_ptr)
        return staged, (source, target)

    def _span(self, trace: Trace, lane: GraphLane, index: int) -> _PendingSpan:
        name = f"{self._runner.name} (graph, {len(lane.graph.nodes)} nodes)"
        return trace._start(lane.stream, "graph", name, chunk=index, track=lane.index)

    async def _collect(self, queue: _Queue, device_streams: DeviceStreams) -> None:
        """Await the device's replays in launch order and deliver their results."""
        engine = current_engine()
        pool = EventPool.for_device(device_streams.device)
        trace = self._runner.trace
        pending = queue.pending
        try:
            while True:
                if not pending:
                    await queue.arrival()
                replay = pending[0]
                stream = replay.lane.stream
                output: npt.NDArray[Any] | None = None
                error: Exception | None = None
                event, replay.event = replay.event, None  # the wait gives it back, however it ends
                try:
                    await EventWait(engine, event, stream, pool)
                    staged = replay.staged
                    if staged is not None and not _copy_inline(replay.dest, staged):
                        await _copy(replay.dest, staged)
                    output = replay.dest
                    if replay.span is not None and trace is not None:
                        trace._resolve(replay.span)
                except Exception as exc:
                    error = exc
                    if replay.span is not None:
                        Trace._discard(replay.span)
                replay.lane.busy = False
                pending.popleft()
                self._finish(replay.index, replay.host, device_streams, output, error)
        finally:
            # Cancelled: the pipeline is over. The feeder may still enqueue replays until
            # its next await: they start a collector anew, which leaves them at once.
            queue.collecting = False
            self._leave(queue, device_streams, pool)

    def _leave(self, queue: _Queue, device_streams: DeviceStreams, pool: EventPool) -> None:
        """Leave the replays queued (the pipeline is over): they still run; keep their
        memory until they have, and give their chunks' admission back."""
        pending = queue.pending
        while pending:
            replay = pending.popleft()
            if replay.event is not None:
                pool.release(replay.event)  # re-recording a pending event is safe
            lane = replay.lane
            with contextlib.suppress(CudaError):  # a poisoned context runs nothing more
                lane.stream.hold(*replay.keep)
                if lane.busy:
                    lane.abandon()
            if replay.span is not None:
                Trace._discard(replay.span)
            self._finish(replay.index, replay.host, device_streams, None, None)


async def _pin(host: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """A page-locked copy of ``host`` (made on a worker thread when large)."""
    copied = pinned_empty(host.shape, host.dtype)
    await _copy(copied, host)
    return copied


def _copy_inline(dst: npt.NDArray[Any], src: npt.NDArray[Any]) -> bool:
    """Copy C-contiguous ``src`` into ``dst``, of the same dtype and size (not always of
    the same shape: ``output()`` chooses its arrays' shape), on this thread if it is at
    most ``staging.INLINE_LIMIT`` bytes; False if it is larger (nothing copied)."""
    if dst.nbytes > _staging.INLINE_LIMIT:
        return False
    dst[...] = src if src.shape == dst.shape else src.reshape(dst.shape)
    return True


async def _copy(dst: npt.NDArray[Any], src: npt.NDArray[Any]) -> None:
    """:func:`_copy_inline`, or on a worker thread."""
    if not _copy_inline(dst, src):
        await anyio.to_thread.run_sync(np.copyto, dst, src.reshape(dst.shape))


def _make_streams(device: Any, count: int, priority: int) -> tuple[Stream, ...]:
    device.make_current()
    return tuple(Stream(device, priority=priority) for _ in range(count))


def _copy_node(graph: Graph, direction: str, dst: int, src: int) -> int:
    """The index of the graph's one memcpy node of ``direction`` from ``src`` to ``dst``."""
    found = [
        node.index
        for node in graph.nodes
        if node.kind == "memcpy" and node.direction == direction and node.dst == dst and node.src == src
    ]
    if len(found) != 1:
        raise CaptureError(
            f"the captured graph has {len(found)} copies of the chunk's {direction} transfer, not one",
            name="AIOCUDA_NOT_CAPTURABLE",
        )
    return found[0]
