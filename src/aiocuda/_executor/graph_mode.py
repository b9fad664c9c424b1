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

No memory is pinned on the event loop's thread (``cuMemHostAlloc`` takes 1-40 ms). A
replay's page-locked arrays -- its result, and the copies of a pageable input or for a
pageable destination -- are blocks of aiocuda's cache of pinned blocks, each take asking
the reserve thread for a spare of its size (:func:`~aiocuda._memory.pinned.take_cached`).
When the cache has none, a staged lane's result is ordinary memory (the replay downloads
into the lane's own buffer anyway), and a pointed lane's chunk waits in the feeder
(``"wait"``) while :meth:`GraphMode.settled` pins what it lacks on a worker thread. A
capture's page-locked buffers are made the same way, once per lane.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
from collections.abc import Callable
from typing import Any, Literal

import anyio
import anyio.to_thread
import numpy as np
import numpy.typing as npt

from .._completion.engine import current_engine
from .._completion.event_pool import EventPool
from .._memory import copies as _copies
from .._memory import pinned_cache
from .._memory import staging as _staging
from .._memory.pinned import PinnedAllocation, host_address, pinned_address, pinned_block, take_cached
from ..array import DeviceArray, empty
from ..device import Device
from ..errors import CaptureError, CudaError
from ..graph import Graph
from ..host import _array_over, _cached_pinned_empty, is_pinned
from ..stream import Stream
from ..trace import Trace, _PendingSpan
from .chunk import ChunkContext, ChunkRunner
from .collectors import Deliveries, EventWait, Finish
from .device_streams import DeviceStreams
from .graph_lanes import LANES, STAGED_LANES, STAGED_LIMIT, GraphLane, GraphLanes

__all__ = ["GraphMode", "Route"]

_log = logging.getLogger("aiocuda")

Route = Literal["replay", "capture", "eager", "wait"]
"""How :meth:`GraphMode.route` sends a chunk: ``"replay"`` (enqueued by ``route`` itself),
one the pipeline starts, or ``"wait"``: route it again after :meth:`GraphMode.settled`."""


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


class _Waiting:
    """A chunk for a pointed lane that found no page-locked block of some size in the
    cache: what it has, and what :meth:`GraphMode.settled` pins for it off the loop."""

    __slots__ = ("blocks", "dest", "error", "index", "missing")

    def __init__(
        self, index: int, dest: npt.NDArray[Any] | None, blocks: list[PinnedAllocation], missing: list[int]
    ) -> None:
        self.index = index
        self.dest = dest
        """``output()``'s array (called once per chunk), or None."""
        self.blocks = blocks
        """The blocks it took (from the cache) and those pinned for it."""
        self.missing = missing
        """Bytes of each block still to pin."""
        self.error: Exception | None = None
        """Why they could not be pinned (the chunk fails with it)."""


class _Queue(Deliveries[_Replay]):
    """One pipeline's replays on one device: the stage's graphs there, the next lane,
    the replays awaiting delivery, and a chunk waiting for page-locked memory."""

    __slots__ = ("lanes", "turn", "waiting")

    def __init__(self, lanes: GraphLanes) -> None:
        super().__init__()
        self.lanes = lanes
        self.turn = 0
        self.waiting: _Waiting | None = None


class GraphMode:
    """Graph mode for one pipeline (see the module docstring).

    ``route`` tells the pipeline how to run each admitted chunk: as a replay (enqueued
    by ``route`` itself), a capture (:meth:`capture`, in a task of its own), eagerly
    (``ChunkRunner.run``, which reports to :meth:`warmed`), or not yet: ``"wait"`` while
    the device warms up or is captured, or while page-locked memory for the chunk's
    replay is pinned off the loop (:meth:`settled`), then route it again. ``shared`` holds the
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
            queue.waiting = None  # (its blocks go back to the cache when collected)
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
        """Wait until the device's warm-up or capture in progress has ended, and until the
        page-locked blocks a chunk found none of in the cache are pinned, on a worker
        thread (1-40 ms each: never on the loop's)."""
        queue = self._queue(device_streams)
        settled = queue.lanes.settled
        if settled is not None:
            await settled.wait()
        waiting = queue.waiting
        if waiting is not None and waiting.missing:
            missing, waiting.missing = waiting.missing, []
            try:
                # Abandoned if cancelled: blocks pinned after it are collected into the cache.
                waiting.blocks += await anyio.to_thread.run_sync(
                    _pin_blocks, device_streams.device, missing, abandon_on_cancel=True
                )
            except Exception as exc:  # (out of page-locked memory, say: the chunk fails with it)
                waiting.error = exc

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
        staged_in = None if staged or is_pinned(host) else await _pin(host, device)
        dest: npt.NDArray[Any] | None = None
        staged_out: npt.NDArray[Any] | None = None
        for k, stream in enumerate(device_streams.graph_lanes[:count]):
            lane_in = lane_out = None
            if staged:
                source = lane_in = await _pinned_array(host.shape, host.dtype, device)
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
                    if dest is None:  # (a spare for the replays' results is being pinned)
                        dest = await _pinned_array(result.shape, result.dtype, device)
                    if not (staged or is_pinned(dest)):
                        staged_out = await _pinned_array(dest.shape, dest.dtype, device)
                    lanes.template, lanes.shape, lanes.dtype = result, host.shape, host.dtype
                if staged:
                    target = lane_out = await _pinned_array(result.shape, result.dtype, device)
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

    def _destination(self, index: int, result: DeviceArray, *, contiguous: bool = True) -> npt.NDArray[Any] | None:
        """Where chunk ``index``'s result goes: ``output()``'s array, or a page-locked one
        from the cache of pinned blocks (a spare asked for off the loop), None when it
        has none of its size. ``result`` is the capture's (checked C-contiguous then, when
        ``contiguous``)."""
        if self._runner.output is None:
            if not (contiguous or result.is_c_contiguous):
                return self._runner.destination(index, result)  # raises its error
            return _cached_pinned_empty(result.shape, result.dtype, result.device)
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
        try:
            template = lanes.template
            assert template is not None
            if lanes.staged:
                dest = self._destination(index, template)
                if dest is None:  # no cached block: the replay downloads into the lane's own anyway
                    dest = np.empty(template.shape, template.dtype)
                staged_in, staged = lane.staged_in, lane.staged_out
                assert staged_in is not None
                keep: tuple[Any, ...] = (staged_in, staged)
                lane.busy = True
                staged_in[...] = host
            else:
                pointed = self._point(queue, lane, index, host, template)
                if pointed is None:
                    return "wait"  # for page-locked blocks pinned off the loop (settled())
                dest, staged, keep = pointed
            queue.turn = (lane.index + 1) % count
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

    def _point(
        self, queue: _Queue, lane: GraphLane, index: int, host: npt.NDArray[Any], template: DeviceArray
    ) -> tuple[npt.NDArray[Any], npt.NDArray[Any] | None, tuple[Any, ...]] | None:
        """Point a pointed lane's copies at the chunk (through page-locked copies of
        pageable memory); ``(destination, staged output, host memory to keep)``, or None
        when the cache of pinned blocks lacks one it needs (``queue.waiting`` says which:
        :meth:`settled` pins them)."""
        device = template.device
        blocks: list[PinnedAllocation] = []
        dest: npt.NDArray[Any] | None = None
        waiting = queue.waiting
        if waiting is not None:  # (this chunk again, once its blocks are pinned)
            queue.waiting = None
            if waiting.index == index:
                if waiting.error is not None:
                    raise waiting.error
                blocks, dest = waiting.blocks, waiting.dest
        missing: list[int] = []
        dest_block = out_block = None
        if self._runner.output is None:
            dest_block = _take(blocks, device, template.nbytes, missing)
            dst = 0
        else:
            if dest is None:
                dest = self._runner.destination(index, template, contiguous=True)
            dst = pinned_address(dest)
            if not dst:
                out_block = _take(blocks, device, dest.nbytes, missing)
        src = pinned_address(host)
        in_block = None if src else _take(blocks, device, host.nbytes, missing)
        if missing:
            blocks += [block for block in (dest_block, out_block, in_block) if block is not None]
            queue.waiting = _Waiting(index, dest, blocks, missing)
            return None
        if dest_block is not None:
            dest = _array_over(dest_block, dest_block.ptr, template.shape, template.dtype)
            dst = dest_block.ptr
        assert dest is not None
        target, staged = dest, None
        if out_block is not None:
            target = staged = _array_over(out_block, out_block.ptr, dest.shape, dest.dtype)
            dst = out_block.ptr
        source = host
        if in_block is not None:
            source = _array_over(in_block, in_block.ptr, host.shape, host.dtype)
            source[...] = host
            src = in_block.ptr
        lane.set_upload(lane.x_ptr, src)
        lane.set_download(dst, lane.result_ptr)
        return dest, staged, (source, target)

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


async def _pin(host: npt.NDArray[Any], device: Device) -> npt.NDArray[Any]:
    """A page-locked copy of ``host`` (copied on a worker thread when large)."""
    copied = await _pinned_array(host.shape, host.dtype, device)
    await _copy(copied, host)
    return copied


async def _pinned_array(shape: tuple[int, ...], dtype: np.dtype[Any], device: Device) -> npt.NDArray[Any]:
    """A page-locked array (a capture's, once per lane): a block of the pinned cache, or
    one pinned on a worker thread (1-40 ms: never on the loop's)."""
    block = await pinned_block(device, max(math.prod(shape) * dtype.itemsize, 1))
    return _array_over(block, block.ptr, shape, dtype)


def _take(blocks: list[PinnedAllocation], device: Device, nbytes: int, missing: list[int]) -> PinnedAllocation | None:
    """A page-locked block for ``nbytes``: one of ``blocks`` of its size class, else one
    of the pinned cache (a spare asked for off the loop); None, with ``nbytes`` added to
    ``missing``, when neither has one."""
    nbytes = max(nbytes, 1)
    if blocks:
        size = pinned_cache.size_class(nbytes)
        for k, block in enumerate(blocks):
            if block.size == size:
                return blocks.pop(k)
    cached = take_cached(device, nbytes)
    if cached is None:
        missing.append(nbytes)
    return cached


def _pin_blocks(device: Device, sizes: list[int]) -> list[PinnedAllocation]:
    """On a worker thread: a page-locked block for each of ``sizes`` (from the cache, or
    pinned: the driver's ``cuMemHostAlloc``)."""
    return [PinnedAllocation(device, size) for size in sizes]


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
