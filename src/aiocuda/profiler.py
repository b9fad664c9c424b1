"""Profiling with Nsight Systems: NVTX ranges that survive task switches, and the
profiler's capture range.

::

    with aiocuda.profiler.nvtx_range("request", color=0x76B900):
        await handle(request)                     # awaits inside are fine

    with aiocuda.profiler.profile():             # nsys profile --capture-range=cudaProfilerApi
        await run_the_interesting_part()

NVTX ranges here are start/end ranges (``nvtxRangeStartEx``/``nvtxRangeEnd`` in an
``aiocuda`` domain), not push/pop ranges: a push/pop range lives on a per-thread stack,
and the tasks of an event loop take turns on one thread, so a range pushed by one task
would be popped by another. A start/end range is ended by its own id, from any task or
thread, and ranges of concurrent requests overlap in the timeline as they did in time.
``aiocuda.Trace(nvtx=True)`` emits one per span as well.

Ranges are opt-in (nothing is emitted unless code asks) and cost a C call each; they
need the NVTX library (``pip install nvidia-nvtx``), without which they do nothing
(:func:`nvtx_available` says which).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from . import _driver
from .device import Device, _as_device

__all__ = ["NvtxRange", "nvtx_available", "nvtx_range", "profile", "start_range"]

# profile() blocks open: the driver's start/stop is a switch, not a count, so the first of
# two nested or overlapping blocks (two requests profiled at once) to end stopped the
# collection for the other. Only the first block starts it and the last stops it. One
# count for the process, whatever the devices: Nsight's capture range (and the
# simulator's flag) is the process's.
_open_blocks = [0]
_profiling_lock = threading.Lock()


def _argb(color: int | None) -> int | None:
    if color is None:
        return None
    if isinstance(color, bool) or not isinstance(color, int) or not 0 <= color <= 0xFFFFFFFF:
        raise ValueError(f"color must be 0xRRGGBB or 0xAARRGGBB, got {color!r}")
    return color if color > 0xFFFFFF else 0xFF000000 | color


class NvtxRange:
    """An NVTX range that has been started; :meth:`end` ends it (once)."""

    __slots__ = ("_driver", "_id", "message")

    def __init__(self, message: str, color: int | None = None) -> None:
        self.message = message
        self._driver = _driver.driver()
        self._id: int | None = self._driver.nvtx_range_start(message, _argb(color))

    @property
    def ended(self) -> bool:
        return self._id is None

    def end(self) -> None:
        """End the range (a second call does nothing)."""
        range_id, self._id = self._id, None
        if range_id is not None:
            self._driver.nvtx_range_end(range_id)

    def __repr__(self) -> str:
        return f"<NvtxRange {self.message!r}{' ended' if self.ended else ''}>"


def start_range(message: str, *, color: int | None = None) -> NvtxRange:
    """Start an NVTX range now; end it with :meth:`NvtxRange.end`, from any task or
    thread. ``color`` is 0xRRGGBB (or 0xAARRGGBB)."""
    return NvtxRange(message, color)


@contextlib.contextmanager
def nvtx_range(message: str, *, color: int | None = None) -> Iterator[NvtxRange]:
    """An NVTX range around the block (ended however the block is left)."""
    span = NvtxRange(message, color)
    try:
        yield span
    finally:
        span.end()


def nvtx_available() -> bool:
    """Whether the NVTX library is loaded, so that ranges reach a profiler that is attached."""
    return _driver.driver().nvtx_available()


@contextlib.contextmanager
def profile(device: Device | int | None = None) -> Iterator[None]:
    """Collect profile data only inside the block (``cuProfilerStart``/``Stop`` for
    ``device``'s context, default 0), for ``nsys profile --capture-range=cudaProfilerApi``.
    Blocks nest and overlap (from several tasks or threads): collection runs from the
    first block's start to the last block's end."""
    dev = _as_device(device)
    with _profiling_lock:
        if not _open_blocks[0]:
            dev.make_current()
            dev._driver.profiler_start()
        _open_blocks[0] += 1
    try:
        yield
    finally:
        with _profiling_lock:
            _open_blocks[0] -= 1
            if not _open_blocks[0]:
                dev.make_current()
                dev._driver.profiler_stop()
