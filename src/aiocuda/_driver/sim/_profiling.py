"""Simulated profiling: the profiler's capture state and NVTX ranges, recorded for tests.

``profiler_start``/``profiler_stop`` set :attr:`SimProfiling.profiling` (starting twice
is not an error, as with the driver). NVTX ranges are always "available": each start and
end is appended to a log that :meth:`SimProfiling.nvtx_events` returns, so tests can
check that every range started is ended once, by id, whatever thread or task ends it.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

from ...errors import ResultCode
from ._codes import sim_error

__all__ = ["NvtxEvent", "SimProfiling"]

NvtxEvent = tuple[str, int, str, Any]
"""``("start", range id, message, color)`` or ``("end", range id, "", None)``."""


class SimProfiling:
    """Mixin of SimDriver: profiling (see the module docstring)."""

    _api: Callable[..., None]
    _counted: Callable[[str], None]

    def __init__(self) -> None:
        self._profiling = False
        self._nvtx_lock = threading.Lock()
        self._nvtx_log: list[NvtxEvent] = []
        self._nvtx_open: set[int] = set()
        self._nvtx_ids = itertools.count(1)
        super().__init__()

    # -- test controls -------------------------------------------------------------------------
    @property
    def profiling(self) -> bool:
        """Whether ``profiler_start`` was called more recently than ``profiler_stop``."""
        return self._profiling

    def nvtx_events(self) -> list[NvtxEvent]:
        """Every NVTX range start and end so far, in order (a copy)."""
        with self._nvtx_lock:
            return list(self._nvtx_log)

    # -- the seam ------------------------------------------------------------------------------
    def profiler_start(self) -> None:
        self._api("profiler_start")
        self._profiling = True

    def profiler_stop(self) -> None:
        self._api("profiler_stop")
        self._profiling = False

    def nvtx_available(self) -> bool:
        self._counted("nvtx_available")
        return True

    def nvtx_range_start(self, message: str, color: int | None) -> int:
        self._counted("nvtx_range_start")
        with self._nvtx_lock:
            range_id = next(self._nvtx_ids)
            self._nvtx_open.add(range_id)
            self._nvtx_log.append(("start", range_id, message, color))
        return range_id

    def nvtx_range_end(self, range_id: int) -> None:
        self._counted("nvtx_range_end")
        with self._nvtx_lock:
            if range_id not in self._nvtx_open:
                # NVTX itself ignores a bad id; the sim says so, to catch double ends in tests.
                raise sim_error(ResultCode.INVALID_VALUE, "nvtx_range_end", f"NVTX range {range_id} is not open")
            self._nvtx_open.discard(range_id)
            self._nvtx_log.append(("end", range_id, "", None))
