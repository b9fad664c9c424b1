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

from . import errors
from ._driver import use_backend
from .device import Device, DeviceProperties, device_count, devices
from .errors import (
    ArgumentError,
    ContextPoisonedError,
    CudaError,
    LaunchError,
    NoDeviceError,
    OutOfMemoryError,
)
from .event import Event
from .stream import Stream, current_stream, use_stream

__version__ = "0.1.0"

__all__ = [
    "ArgumentError",
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
