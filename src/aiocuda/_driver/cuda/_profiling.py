"""Real-driver profiling: ``cuProfilerStart``/``Stop`` and NVTX ranges (see _driver/_nvtx.py)."""

from __future__ import annotations

from .. import _nvtx
from . import _core
from ._core import check

__all__ = ["CudaProfiling"]


class CudaProfiling:
    """Mixin of CudaDriver: the profiler's capture range and NVTX ranges."""

    def profiler_start(self) -> None:
        check(_core.drv.cuProfilerStart(), "cuProfilerStart")

    def profiler_stop(self) -> None:
        check(_core.drv.cuProfilerStop(), "cuProfilerStop")

    def nvtx_available(self) -> bool:
        return _nvtx.load() is not None

    def nvtx_range_start(self, message: str, color: int | None) -> int:
        nvtx = _nvtx.load()
        return 0 if nvtx is None else nvtx.start(message, color)

    def nvtx_range_end(self, range_id: int) -> None:
        nvtx = _nvtx.load()
        if nvtx is not None:
            nvtx.end(range_id)
