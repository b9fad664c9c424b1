"""The submits of one opening of an executor: the devices and request lanes they run on,
the counters :meth:`aiocuda.executor.Executor.submit` keeps, and the wait of the
executor's exit for them.

An executor can be entered, left and entered again; each opening has its own
:class:`Submits`. A submit keeps the one of the opening that started it to the end, so one
that outlives its opening (its exit cancelled, or the executor closed directly) runs on
that opening's lanes, counts where it started, and is no submit the next opening's exit
waits for.
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio

from .device_streams import DeviceStreams
from .lanes import Lanes

__all__ = ["Submits"]


class Submits:
    """One opening's submits: run on ``device_streams`` and ``lanes`` (the request lanes,
    by device ordinal, filled in as the opening starts them)."""

    # (Slots: submit() reads and writes these on every request, as it did the executor's
    # own attributes, with no allocation per submit.)
    __slots__ = ("completed", "device_streams", "drained", "failed", "lanes", "unfinished")

    def __init__(self, device_streams: Sequence[DeviceStreams] = ()) -> None:
        self.device_streams = device_streams
        self.lanes: dict[int, Lanes] = {}
        self.unfinished = 0
        """Submits started and not yet returned: what leaving the opening waits for."""
        self.completed = 0
        """Submits returned (with their result or an error)."""
        self.failed = 0
        """Those of them that raised."""
        self.drained: anyio.Event | None = None
        """Set by the submit that returns last while :meth:`finished` waits."""

    async def finished(self) -> None:
        """Wait until every submit started in this opening has returned (the opening no
        longer starts new ones)."""
        while self.unfinished:
            if self.drained is None:
                self.drained = anyio.Event()
            await self.drained.wait()
            self.drained = None

    def leased(self) -> int:
        """Submits running now: holding one of this opening's lanes."""
        return sum(lanes.statistics().leased for lanes in self.lanes.values())
