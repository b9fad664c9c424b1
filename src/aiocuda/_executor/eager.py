"""The eager path of a pipeline (``Executor.map`` without ``graph=True``): each chunk's
upload, stage and download enqueued by the feeder itself, without a task per chunk.

:meth:`EagerMode.start` runs a chunk's steps (:meth:`~.chunk.ChunkRunner.steps`) at once,
records an event on the stream of its download, and queues the chunk there. One
collector task per download stream awaits the queued chunks in the order of the stream
-- the order they complete in -- frees their memory and delivers their results. A chunk
whose steps need an await (a pageable input or destination staged through the copier
threads, a stage that is a coroutine) goes on in a task of its own until its download is
enqueued, then joins the queue.

Cancelled (the pipeline is over), a collector leaves the chunks it had queued as a
cancelled chunk task would: memory freed stream-ordered, host memory held by the streams
until the copies are done, admission given back.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import numpy.typing as npt

from .._completion.engine import current_engine
from .._completion.event_pool import EventPool
from ..stream import Stream
from .chunk import ChunkContext, ChunkRunner, Steps, run_steps
from .collectors import Deliveries, EventWait, Finish
from .device_streams import DeviceStreams

if TYPE_CHECKING:
    from .lane import Lane

__all__ = ["EagerMode"]

_Flight = tuple[ChunkContext, DeviceStreams, Any]
"""A chunk whose download is enqueued: its context, where it was admitted, and the event
recorded after the download."""


class EagerMode:
    """The eager path of one pipeline (see the module docstring): ``finish`` is the
    pipeline's end of a chunk, ``start`` its task group's ``start_soon``."""

    def __init__(self, runner: ChunkRunner, finish: Finish, start: Callable[..., object]) -> None:
        self._runner = runner
        self._finish = finish
        self._start = start
        self._queues: dict[Stream, Deliveries[_Flight]] = {}

    def start(self, index: int, host: npt.NDArray[Any], device_streams: DeviceStreams) -> None:
        """Enqueue chunk ``index``, admitted on ``device_streams``; its result comes
        through ``finish``."""
        ctx = self._runner.context(index, host, device_streams)
        steps = self._runner.steps(ctx)
        try:
            awaiting = steps.send(None)
        except StopIteration as end:
            self._enqueued(ctx, device_streams, end.value)
            return
        except Exception as exc:
            ctx._abandon()
            self._finish(index, host, device_streams, None, exc)
            return
        except BaseException:  # (a KeyboardInterrupt in the stage, say: the pipeline is over)
            # Without this the chunk stayed admitted: its device took one chunk fewer, and
            # its bytes fewer, for the rest of the executor's life.
            ctx._abandon()
            self._finish(index, host, device_streams, None, None)
            raise
        self._start(self._go_on, ctx, device_streams, steps, awaiting)

    async def _go_on(self, ctx: ChunkContext, admitted: DeviceStreams, steps: Steps, awaiting: Awaitable[Any]) -> None:
        """Run a chunk's steps on from an await, then queue it."""
        try:
            done = await run_steps(steps, awaiting)
        except Exception as exc:
            ctx._abandon()
            self._finish(ctx.index, ctx.host, admitted, None, exc)
            return
        except BaseException:  # cancelled: the pipeline is over
            ctx._abandon()
            self._finish(ctx.index, ctx.host, admitted, None, None)
            raise
        self._enqueued(ctx, admitted, done)

    def _enqueued(self, ctx: ChunkContext, admitted: DeviceStreams, d2h: Stream | Lane) -> None:
        """The chunk's download is enqueued on ``d2h``: queue it for the stream's collector."""
        assert isinstance(d2h, Stream)  # (steps without a lane end on a stream)
        pool = d2h._pool
        event = pool.acquire()
        try:
            d2h._driver.event_record(event, d2h.handle)
        except Exception as exc:
            pool.release(event)
            ctx._abandon()
            self._finish(ctx.index, ctx.host, admitted, None, exc)
            return
        queue = self._queues.get(d2h)
        if queue is None:
            queue = self._queues[d2h] = Deliveries()
        queue.add((ctx, admitted, event))
        if not queue.collecting:
            queue.collecting = True
            self._start(self._collect, queue, d2h)

    async def _collect(self, queue: Deliveries[_Flight], stream: Stream) -> None:
        """Await the chunks queued on ``stream`` in order; deliver their results."""
        engine = current_engine()
        pool = stream._pool
        finish = self._finish
        pending = queue.pending
        waiting: _Flight | None = None
        try:
            while True:
                if not pending:
                    await queue.arrival()
                ctx, admitted, event = waiting = pending.popleft()
                try:
                    await EventWait(engine, event, stream, pool)  # gives the event back, however it ends
                    output = ctx._complete(idle=True)
                except Exception as exc:
                    waiting = None
                    ctx._abandon()
                    finish(ctx.index, ctx.host, admitted, None, exc)
                    continue
                waiting = None
                finish(ctx.index, ctx.host, admitted, output, None)
        finally:
            # Cancelled: the pipeline is over. Chunks queued later (by the feeder before
            # its next await, or by a chunk's own task) start a collector anew, which
            # leaves them at once.
            queue.collecting = False
            if waiting is not None:
                ctx, admitted, _ = waiting
                ctx._abandon()
                finish(ctx.index, ctx.host, admitted, None, None)
            self._leave(queue, pool)

    def _leave(self, queue: Deliveries[_Flight], pool: EventPool) -> None:
        """Leave the chunks queued: the pipeline is over."""
        pending = queue.pending
        while pending:
            ctx, admitted, event = pending.popleft()
            pool.release(event)  # re-recording a pending event is safe
            ctx._abandon()
            self._finish(ctx.index, ctx.host, admitted, None, None)

    def close(self) -> None:
        """The pipeline's task group is over: leave what no collector has left (chunks
        queued for a collector that never ran)."""
        for stream, queue in self._queues.items():
            self._leave(queue, stream._pool)
