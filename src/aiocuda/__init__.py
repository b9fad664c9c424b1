"""aiocuda: await NVIDIA GPU work from asyncio, uvloop and trio without blocking the loop.

    import anyio, aiocuda

    async def main():
        stream = aiocuda.Stream()
        ...                      # enqueue copies and kernels on the stream
        await stream             # the loop keeps running; the task resumes when the GPU is done

    anyio.run(main)

Backends: the real CUDA driver where a GPU exists, a simulated driver otherwise
(``AIOCUDA_BACKEND=cuda|sim|auto``, or :func:`use_backend`).
"""

from __future__ import annotations

from . import errors, interop
from ._driver import use_backend
from ._memory.interop import as_device_array
from .array import DeviceArray, empty, to_device, zeros
from .array import copy as copy_array
from .batching import Batcher
from .device import Device, DeviceProperties, device_count, devices
from .errors import (
    ArgumentError,
    ClosedError,
    ContextPoisonedError,
    CudaError,
    LaunchError,
    NoDeviceError,
    OutOfMemoryError,
)
from .event import Event
from .executor import ChunkContext, ChunkResult, Executor, Pipeline
from .host import HostRegistration, is_pinned, pinned_empty, pinned_zeros, register_host
from .kernel import Kernel, KernelAttributes, register_sim_kernel
from .lanes import Lane, Lanes
from .memory import DeviceBuffer, MemoryPool, PoolStatistics
from .module import Module
from .peer import enable_peer_access
from .program import CompileError, Program, ProgramOptions
from .stream import Stream, current_stream, use_stream
from .trace import Trace, TraceSummary

__version__ = "0.1.0"

__all__ = [
    "ArgumentError",
    "Batcher",
    "ChunkContext",
    "ChunkResult",
    "ClosedError",
    "CompileError",
    "DeviceArray",
    "DeviceBuffer",
    "Executor",
    "HostRegistration",
    "Kernel",
    "KernelAttributes",
    "Lane",
    "Lanes",
    "MemoryPool",
    "Module",
    "Pipeline",
    "PoolStatistics",
    "Program",
    "ProgramOptions",
    "Trace",
    "TraceSummary",
    "as_device_array",
    "copy_array",
    "empty",
    "enable_peer_access",
    "interop",
    "is_pinned",
    "pinned_empty",
    "pinned_zeros",
    "register_host",
    "register_sim_kernel",
    "to_device",
    "zeros",
    "ContextPoisonedError",
    "CudaError",
    "Device",
    "DeviceProperties",
    "Event",
    "LaunchError",
    "NoDeviceError",
    "OutOfMemoryError",
    "Stream",
    "current_stream",
    "device_count",
    "devices",
    "errors",
    "use_backend",
    "use_stream",
]
