"""A stage's captured graphs on one device (:class:`GraphLanes`): one per *graph lane*, a
stream of the device's that replays chunks, and how a replay is pointed at its chunk.

A lane's graph uploads the chunk's input to graph memory, runs the stage and downloads
its result. Two kinds of lanes point a replay at its chunk differently:

* **pointed** lanes set the two copies' host addresses before each replay (two driver
  calls): the chunk's own page-locked input and destination are copied, nothing more.
  Replays of one lane queue behind each other; :data:`LANES` of them per device.
* **staged** lanes, for chunks of at most :data:`STAGED_LIMIT` bytes, copy from and to
  page-locked buffers of their own, which the host fills before a replay and empties
  after it: no driver call but the launch. A staged lane takes one replay at a time, so
  a device has as many as it admits chunks (up to :data:`STAGED_LANES`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import anyio
import numpy as np
import numpy.typing as npt

from .._completion.event_pool import EventPool
from ..array import DeviceArray
from ..graph import Graph
from ..stream import Stream

__all__ = ["LANES", "STAGED_LANES", "STAGED_LIMIT", "GraphLane", "GraphLanes", "State"]

LANES = 4
"""Pointed lanes per device: streams with a captured graph each, replaying chunks in turn
(at most the executor's ``chunks_per_device``). Three keep a chunk's upload, kernels and
download overlapping those of its neighbours; the fourth absorbs uneven chunks."""

STAGED_LIMIT = 32 * 1024
"""Chunks of at most this many bytes replay on staged lanes."""
# A pointed replay's five driver calls took 21.5 us on the H100 machine, ~4 us each
# (benchmarks/executor_host.py, 4 KiB chunks); copying 32 KiB on the host, in and out,
# takes ~2.5 us in all (numpy, this machine's CPU), less below that.

STAGED_LANES = 32
"""The most staged lanes a device gets: its ``chunks_per_device``, up to this many. A
chunk that finds every staged lane busy (more chunks admitted than lanes, or lanes still
running the replays of a cancelled pipeline) runs eagerly."""

State = Literal["new", "warming", "capture", "capturing", "ready", "eager"]


class GraphLane:
    """One stream with a captured graph, and how to point the graph at a chunk."""

    __slots__ = (
        "abandoned",
        "busy",
        "events",
        "graph",
        "index",
        "query",
        "record",
        "result_ptr",
        "set_download",
        "set_upload",
        "staged_in",
        "staged_out",
        "stream",
        "x_ptr",
    )

    def __init__(self, index: int, stream: Stream, graph: Graph, x_ptr: int, result_ptr: int) -> None:
        self.index = index
        self.stream = stream
        self.graph = graph
        self.events = EventPool.for_device(stream.device)
        self.record = stream.device._driver.event_record
        self.query = stream.device._driver.event_query
        self.x_ptr = x_ptr
        """The chunk's device input: graph memory, at the same address in every replay."""
        self.result_ptr = result_ptr
        """What the download copies from (graph memory, or a buffer the stage returned)."""
        self.set_upload: Callable[[int, int], None] = _not_pointed
        """Pointed lanes: ``set_upload(device input, host source)``."""
        self.set_download: Callable[[int, int], None] = _not_pointed
        """Pointed lanes: ``set_download(host destination, device result)``."""
        self.staged_in: npt.NDArray[Any] | None = None
        """Staged lanes: the page-locked input the graph uploads."""
        self.staged_out: npt.NDArray[Any] | None = None
        """Staged lanes: the page-locked array the graph downloads into."""
        self.busy = False
        """Staged lanes: a replay uses the lane's buffers (until its result is copied out)."""
        self.abandoned: Any = None
        """Staged lanes: an event recorded after the replay of a cancelled pipeline."""

    def reclaim(self) -> bool:
        """Whether a busy staged lane's abandoned replay has finished (the lane is free
        again then)."""
        abandoned = self.abandoned
        if abandoned is None or not self.query(abandoned):
            return False
        self.abandoned = None
        self.events.release(abandoned)
        self.busy = False
        return True

    def abandon(self) -> None:
        """The replay using this staged lane was given up (its pipeline was cancelled):
        the lane is busy until the work on its stream so far has finished."""
        event = self.events.acquire()
        self.record(event, self.stream._handle)
        self.abandoned = event


def _not_pointed(dst: int, src: int) -> None:
    raise AssertionError("a staged lane's copies stay where they were captured")


class GraphLanes:
    """A stage's captured graphs on one device, one per lane, and how far it got: kept
    by the executor for every pipeline of the stage (or by one pipeline)."""

    __slots__ = ("dtype", "lanes", "owner", "settled", "shape", "staged", "state", "template")

    def __init__(self) -> None:
        self.state: State = "new"
        self.owner: Any = None
        """Whose chunk warms the device up, ``(graph mode, index)``, or which graph mode captures."""
        self.settled: anyio.Event | None = None
        """Set when a warm-up or capture in progress ends (chunks wait for it)."""
        self.lanes: list[GraphLane] = []
        self.staged = False
        """Whether the lanes are staged (else pointed)."""
        self.shape: tuple[int, ...] = ()
        self.dtype: np.dtype[Any] = np.dtype(np.uint8)
        self.template: DeviceArray | None = None
        """The stage's result in the capture: shape and dtype for ``output(index, result)``."""

    def close(self) -> None:
        """Release the graphs (once the replays already enqueued have run)."""
        for lane in self.lanes:
            lane.graph.close()
            if lane.abandoned is not None:
                lane.events.release(lane.abandoned)  # re-recording a pending event is safe
        self.lanes.clear()
        if self.state == "ready":
            self.state = "new"

    def begin(self, state: State, owner: Any) -> None:
        """A warm-up or capture starts: chunks for the device wait for its end."""
        self.state, self.owner = state, owner
        self.settled = anyio.Event()

    def settle(self, state: State) -> None:
        """The warm-up or capture in progress ended in ``state``: waiting chunks go on."""
        self.state, self.owner = state, None
        settled, self.settled = self.settled, None
        if settled is not None:
            settled.set()
