"""aiocuda: await NVIDIA GPU work from asyncio, uvloop and trio without blocking the loop."""

from __future__ import annotations

from . import errors
from ._driver import use_backend
from .errors import (
    ArgumentError,
    ContextPoisonedError,
    CudaError,
    LaunchError,
    NoDeviceError,
    OutOfMemoryError,
)

__version__ = "0.1.0"

__all__ = [
    "ArgumentError",
    "ContextPoisonedError",
    "CudaError",
    "LaunchError",
    "NoDeviceError",
    "OutOfMemoryError",
    "errors",
    "use_backend",
]
