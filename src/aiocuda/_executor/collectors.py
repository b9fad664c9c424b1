"""What the pipelines' collector tasks share (eager and graph mode): the queue of chunks
one delivers, an await of one recorded event, and the pipeline's end of a chunk."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

import anyio
import numpy.typing as npt

from .._completion.engine import CompletionEngine
from .._completion.event_pool import EventPool
from ..stream import Stream
from .device_streams import DeviceStreams

__all__ = ["Deliveries", "EventWait", "Finish"]

T = TypeVar("T")

Finish = Callable[[int, npt.NDArray[Any], DeviceStreams, "npt.NDArray[Any] | None", "Exception | None"], None]
"""``finish(index, host, device_streams, output, error)``: a chunk is done: the pipeline
releases its admission and delivers its result (none when both are None: the pipeline
is being cancelled)."""


class Deliveries(Generic[T]):
    """Chunks whose GPU work is enqueued, oldest first, for one collector task to deliver;
    ``collecting`` says whether that task runs (its owner starts it, and it clears the
    flag when it ends)."""

    __slots__ = ("collecting", "pending", "wake")

    def __init__(self) -> None:
        self.pending: collections.deque[T] = collections.deque()
        self.wake = anyio.Event()
        self.collecting = False

    def add(self, item: T) -> None:
        """Queue ``item``, waking the collector if it waits."""
        pending = self.pending
        pending.append(item)
        if len(pending) == 1:
            self.wake.set()

    async def arrival(self) -> None:
        """For the collector: return once something is queued."""
        while not self.pending:
            self.wake = anyio.Event()
            await self.wake.wait()


class EventWait:
    """An await of one recorded event: through the completion engine, unless the event
    has completed already. The event goes back to ``pool`` however the await ends."""

    __slots__ = ("_engine", "_event", "_pool", "_stream")

    def __init__(self, engine: CompletionEngine, event: Any, stream: Stream, pool: EventPool) -> None:
        self._engine = engine
        self._event = event
        self._stream = stream
        self._pool = pool

    def __await__(self) -> Any:
        # A chunk is done more often than not when its turn comes (the collector is
        # behind the feeder): one query then, without the engine's planning (~2 us of
        # Python). The engine learns from the waits it runs, as it does whenever other
        # waits are pending; these are the short ones it would merely spin on.
        event, release = self._event, self._pool.release
        try:
            done = self._engine.query(event)
        except BaseException:
            release(event)
            raise
        if done:
            release(event)
            return _DONE
        stream = self._stream
        return self._engine.wait(event, stream._handle, stream.device, release)


_DONE: Iterator[Any] = iter(())
"""What an :class:`EventWait` that is over at once awaits: an iterator with nothing left."""
