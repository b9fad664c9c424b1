"""The request path's graphs: a lane captures a request's device work once and replays it.

:meth:`aiocuda.lanes.Lane.replay` runs here. Per lane and per ``(work, key)``: the first
call runs ``work(lane)`` as it is (it loads the modules of its kernels and warms up the
libraries it calls, which must not happen during a capture); the second captures it on
the lane's stream and launches the graph; every later call only launches the graph. A
capture that fails leaves that work to run as it is on the lane from then on, logged
once (``aiocuda`` logger). So does work on memory of the request (``lane.empty`` or
``lane.upload`` without ``out=`` during the lease): its lease frees that memory, and a
replay would repeat its addresses for every later request.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

from ..errors import CaptureError
from ..graph import Graph

if TYPE_CHECKING:
    from .lane import Lane

__all__ = ["MAX_WORKS", "Work", "close", "replay"]

_log = logging.getLogger("aiocuda")

Work = Callable[["Lane"], Any]
"""``work(lane)``: enqueue a request's device work on ``lane.stream`` (sync; returns None)."""

_WARMED = "warmed"
_EAGER = "eager"

MAX_WORKS = 64
"""``(work, key)`` pairs a lane keeps graphs for; beyond, the oldest is dropped (and its
graph closed), with a warning: a function made per request is never the same twice."""


def replay(lane: Lane, work: Work, key: Hashable) -> None:
    """Enqueue ``work``'s device work on ``lane.stream``: as it is, captured, or replayed."""
    graphs: dict[Any, Any] = lane._graphs
    slot = (work, key)
    found = graphs.get(slot)
    if isinstance(found, Graph):
        found._enqueue(lane.stream)  # (the lane's await waits: no event for the launch)
        return
    if found is None or found == _EAGER:
        _run(lane, work)
        if found is None:
            _make_room(lane, graphs)
            graphs[slot] = _WARMED
        return
    try:
        with lane.stream.capture() as graph:
            _run(lane, work)
            _check_lane_memory(lane)
    except CaptureError as exc:
        graphs[slot] = _EAGER
        _log.warning("aiocuda: lane %d runs %r as it is: its work could not be captured (%s)", lane.index, work, exc)
        _run(lane, work)
        return
    graphs[slot] = graph
    graph._enqueue(lane.stream)


def _check_lane_memory(lane: Lane) -> None:
    """Raise if the work being captured uses device memory of the current lease (freed
    when it ends; memory the capture allocates itself is the graph's, and fine)."""
    capture = lane.stream._capture
    assert capture is not None
    externals = capture.externals
    if any(id(buffer) in externals for buffer in lane._buffers):
        raise capture.refuse(
            "work on memory of the request",
            "the lease frees it when it ends, and a replay would repeat its addresses for every later request: "
            "keep the arrays that replayed work uses in lane.state (made by setup)",
        )


def _make_room(lane: Lane, graphs: dict[Any, Any]) -> None:
    if len(graphs) < MAX_WORKS:
        return
    oldest = next(iter(graphs))
    dropped = graphs.pop(oldest)
    if isinstance(dropped, Graph):
        dropped.close()
    if not lane._warned_works:
        lane._warned_works = True
        _log.warning(
            "aiocuda: lane %d was given more than %d different (work, key) pairs to replay, and drops the "
            "oldest: pass one long-lived function per kind of work (a function made per request, such as "
            "a closure, is a new one every time and is never replayed); vary the data through lane.state",
            lane.index,
            MAX_WORKS,
        )


def _run(lane: Lane, work: Work) -> None:
    returned = work(lane)
    if inspect.isawaitable(returned):
        close_coroutine = getattr(returned, "close", None)
        if close_coroutine is not None:
            close_coroutine()
        raise TypeError("Lane.replay takes a function that enqueues work (not a coroutine function)")


def close(lane: Lane) -> None:
    """Release the lane's graphs (once the replays already enqueued have run)."""
    for found in lane._graphs.values():
        if isinstance(found, Graph):
            found.close()
    lane._graphs.clear()
