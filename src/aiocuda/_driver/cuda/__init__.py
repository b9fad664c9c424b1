"""The real backend: ``cuda.bindings.driver``."""

from __future__ import annotations

from ._contexts import CudaContexts
from ._core import CudaCore
from ._memory import CudaMemory
from ._modules import CudaModules
from ._profiling import CudaProfiling

__all__ = ["CudaDriver"]


class CudaDriver(CudaCore, CudaMemory, CudaModules, CudaContexts, CudaProfiling):
    """The CUDA Driver API behind the seam's protocol."""

    name = "cuda"
