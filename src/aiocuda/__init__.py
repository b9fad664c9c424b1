"""aiocuda: await NVIDIA GPU work from asyncio, uvloop and trio without blocking the loop.

    import anyio, aiocuda

    async def main():
        stream = aiocuda.Stream()
        ...                      # enqueue copies and kernels on the stream
        await stream             # the loop keeps running; the task resumes when the GPU is done

    anyio.run(main)

Backends: the real CUDA driver where a GPU exists, a simulated driver otherwise
(``AIOCUDA_BACKEND=cuda|sim|auto``, or :func:`use_backend`; :func:`current_backend`
says which runs). :mod:`aiocuda.testing` drives the simulator in your own tests.
"""

from __future__ import annotations

from . import errors, interop, ipc, managed, profiler
from ._driver import JitOptions, LaunchConfig
from ._memory.interop import as_device_array
from .array import DeviceArray, empty, empty_pitched, to_device, zeros
from .array import copy as copy_array
from .backend import Backend, current_backend, use_backend
from .batching import Batcher
from .context import Context, ContextFlags
from .device import Device, DeviceProperties, PeerAttributes, device_count, devices
from .errors import (
    ArgumentError,
    BackendError,
    BlockingCallWarning,
    CaptureError,
    ClosedError,
    CompileError,
    ContextPoisonedError,
    CudaError,
    ExporterLostError,
    GraphUpdateError,
    LaunchError,
    NoDeviceError,
    OutOfMemoryError,
    OversubscriptionError,
    QueueFullError,
    SimulatedBackendWarning,
)
from .event import Event
from .executor import ChunkContext, ChunkResult, Executor, Pipeline
from .graph import Graph, GraphCapture, GraphNode
from .host import HostRegistration, is_pinned, pinned_empty, pinned_zeros, register_host
from .kernel import Kernel, KernelAttributes, register_sim_kernel
from .lanes import Lane, Lanes
from .memory import DeviceBuffer, MemoryPool, PoolStatistics
from .module import Module
from .peer import enable_peer_access
from .program import Program, ProgramOptions
from .stream import Stream, StreamCallback, current_stream, use_stream
from .trace import Trace, TraceSummary

__version__ = "0.1.0"  # the one place the version is written (pyproject.toml reads it)

__all__ = [
    "ArgumentError",
    "Backend",
    "BackendError",
    "Batcher",
    "BlockingCallWarning",
    "CaptureError",
    "ChunkContext",
    "ChunkResult",
    "ClosedError",
    "CompileError",
    "Context",
    "ContextFlags",
    "ContextPoisonedError",
    "CudaError",
    "Device",
    "DeviceArray",
    "DeviceBuffer",
    "DeviceProperties",
    "Event",
    "Executor",
    "ExporterLostError",
    "Graph",
    "GraphCapture",
    "GraphNode",
    "GraphUpdateError",
    "HostRegistration",
    "JitOptions",
    "Kernel",
    "KernelAttributes",
    "Lane",
    "Lanes",
    "LaunchConfig",
    "LaunchError",
    "MemoryPool",
    "Module",
    "NoDeviceError",
    "OutOfMemoryError",
    "OversubscriptionError",
    "PeerAttributes",
    "Pipeline",
    "PoolStatistics",
    "Program",
    "ProgramOptions",
    "QueueFullError",
    "SimulatedBackendWarning",
    "Stream",
    "StreamCallback",
    "Trace",
    "TraceSummary",
    "as_device_array",
    "copy_array",
    "current_backend",
    "current_stream",
    "device_count",
    "devices",
    "empty",
    "empty_pitched",
    "enable_peer_access",
    "errors",
    "interop",
    "ipc",
    "is_pinned",
    "managed",
    "pinned_empty",
    "pinned_zeros",
    "profiler",
    "register_host",
    "register_sim_kernel",
    "to_device",
    "use_backend",
    "use_stream",
    "zeros",
]
