"""The simulated backend: a CUDA driver imitated on the CPU, for tests and CPU-only machines."""

from __future__ import annotations

from ._contexts import SimContexts
from ._core import SimCore
from ._graphs import SimGraphs
from ._ipc import SimSharing
from ._memory import SimMemory
from ._modules import SimModules
from ._pitched import SimPitched
from ._profiling import SimProfiling

__all__ = ["SimDriver"]


class SimDriver(SimCore, SimMemory, SimPitched, SimSharing, SimModules, SimContexts, SimProfiling, SimGraphs):
    """A simulated CUDA driver; see ``_core.SimCore`` for its controls."""

    name = "sim"
