"""The real backend: ``cuda.bindings.driver``."""

from __future__ import annotations

from ._contexts import CudaContexts
from ._core import CudaCore
from ._graphs import CudaGraphs
from ._memory import CudaMemory
from ._modules import CudaModules
from ._profiling import CudaProfiling

__all__ = ["CudaDriver"]


class CudaDriver(CudaCore, CudaMemory, CudaModules, CudaContexts, CudaProfiling, CudaGraphs):
    """The CUDA Driver API behind the seam's protocol."""

    name = "cuda"
