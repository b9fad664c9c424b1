"""Exceptions raised by aiocuda.

Every failure reported by the CUDA driver becomes a :class:`CudaError` carrying the
driver's result code (``.code``), its symbolic name (``.name``, e.g.
``"CUDA_ERROR_OUT_OF_MEMORY"``) and the driver's own description. Subclasses exist only
for the situations callers branch on:

* :class:`OutOfMemoryError` -- an allocation could not be satisfied (also a
  :class:`MemoryError`). :class:`OversubscriptionError`, a subclass, is raised before
  asking for managed memory the device does not have.
* :class:`ContextPoisonedError` -- a *sticky* error (illegal address, kernel assert, ...)
  has corrupted a device's context. Every later call on that device fails; the only
  cure is a new process.
* :class:`NoDeviceError` -- no usable driver or no device. The message says what to do.
* :class:`ArgumentError` -- the driver (or aiocuda, before calling it) rejected a value:
  a device ordinal out of range, an unknown handle, a bad size. Also a :class:`ValueError`.
* :class:`LaunchError` -- a kernel could not be launched or failed (too many resources,
  wrong argument count or type, a missing kernel image).
* :class:`CompileError` -- NVRTC rejected a program (``.log`` has its log), or could not
  be loaded.
* :class:`BackendError` -- an unknown backend or a bad setting for one was asked for.
  Also a :class:`ValueError`.
* :class:`ClosedError` -- request lanes or a batcher are shutting down or closed: the
  request was not started (a service answers "unavailable").
* :class:`QueueFullError` -- a batcher already has ``max_queue`` requests waiting: the
  request was refused at once (a service answers "unavailable, retry later").
* :class:`CaptureError` -- an operation cannot be captured into a graph (a wait for the
  GPU, a synchronous call, a pageable copy that needs staging), or the capture it was
  part of failed.
* :class:`GraphUpdateError` -- new parameters or a new capture do not fit an
  instantiated graph (another topology, another kind of node, another device).
* :class:`ExporterLostError` -- memory shared by another process can no longer be used:
  that process ended, or stopped sharing it.

:class:`SimulatedBackendWarning` says that no GPU was found and the simulator runs
instead (see :mod:`aiocuda.backend`).

:class:`BlockingCallWarning` says that a blocking call (``synchronize()``, pinning new
host memory) ran on an event loop's thread.

This module imports nothing from aiocuda so that every layer, the driver seam
included, may raise these.
"""

from __future__ import annotations

from typing import TypeVar

__all__ = [
    "STICKY_CODES",
    "ArgumentError",
    "BackendError",
    "BlockingCallWarning",
    "CaptureError",
    "ClosedError",
    "CompileError",
    "ContextPoisonedError",
    "CudaError",
    "ExporterLostError",
    "GraphUpdateError",
    "LaunchError",
    "NoDeviceError",
    "OutOfMemoryError",
    "OversubscriptionError",
    "QueueFullError",
    "ResultCode",
    "SimulatedBackendWarning",
    "error_for_code",
]


class ResultCode:
    """The CUresult values aiocuda refers to by name (the driver's own numbering)."""

    SUCCESS = 0
    INVALID_VALUE = 1
    OUT_OF_MEMORY = 2
    NOT_INITIALIZED = 3
    DEINITIALIZED = 4
    STUB_LIBRARY = 34
    INSUFFICIENT_DRIVER = 35
    NO_DEVICE = 100
    INVALID_DEVICE = 101
    DEVICE_NOT_LICENSED = 102
    INVALID_IMAGE = 200
    INVALID_CONTEXT = 201
    NO_BINARY_FOR_GPU = 209
    ECC_UNCORRECTABLE = 214
    UNSUPPORTED_LIMIT = 215
    PEER_ACCESS_UNSUPPORTED = 217
    INVALID_PTX = 218
    UNSUPPORTED_PTX_VERSION = 222
    INVALID_SOURCE = 300
    FILE_NOT_FOUND = 301
    INVALID_HANDLE = 400
    ILLEGAL_STATE = 401
    NOT_FOUND = 500
    NOT_READY = 600
    ILLEGAL_ADDRESS = 700
    LAUNCH_OUT_OF_RESOURCES = 701
    LAUNCH_TIMEOUT = 702
    PEER_ACCESS_ALREADY_ENABLED = 704
    PEER_ACCESS_NOT_ENABLED = 705
    CONTEXT_IS_DESTROYED = 709
    ASSERT = 710
    HOST_MEMORY_ALREADY_REGISTERED = 712
    HOST_MEMORY_NOT_REGISTERED = 713
    HARDWARE_STACK_ERROR = 714
    ILLEGAL_INSTRUCTION = 715
    MISALIGNED_ADDRESS = 716
    INVALID_ADDRESS_SPACE = 717
    INVALID_PC = 718
    LAUNCH_FAILED = 719
    COOPERATIVE_LAUNCH_TOO_LARGE = 720
    NOT_PERMITTED = 800
    NOT_SUPPORTED = 801
    STREAM_CAPTURE_UNSUPPORTED = 900
    STREAM_CAPTURE_INVALIDATED = 901
    STREAM_CAPTURE_MERGE = 902
    STREAM_CAPTURE_UNMATCHED = 903
    STREAM_CAPTURE_UNJOINED = 904
    STREAM_CAPTURE_ISOLATION = 905
    STREAM_CAPTURE_IMPLICIT = 906
    CAPTURED_EVENT = 907
    STREAM_CAPTURE_WRONG_THREAD = 908
    GRAPH_EXEC_UPDATE_FAILURE = 910
    UNKNOWN = 999


#: Errors after which the context is unusable until the process exits.
STICKY_CODES = frozenset(
    {
        ResultCode.ECC_UNCORRECTABLE,
        ResultCode.ILLEGAL_ADDRESS,
        ResultCode.LAUNCH_TIMEOUT,
        ResultCode.ASSERT,
        ResultCode.HARDWARE_STACK_ERROR,
        ResultCode.ILLEGAL_INSTRUCTION,
        ResultCode.MISALIGNED_ADDRESS,
        ResultCode.INVALID_ADDRESS_SPACE,
        ResultCode.INVALID_PC,
        ResultCode.LAUNCH_FAILED,
        ResultCode.UNKNOWN,
    }
)

_NO_DEVICE_CODES = frozenset(
    {
        ResultCode.NO_DEVICE,
        ResultCode.STUB_LIBRARY,
        ResultCode.INSUFFICIENT_DRIVER,
        ResultCode.DEVICE_NOT_LICENSED,
    }
)

_ARGUMENT_CODES = frozenset(
    {
        ResultCode.INVALID_VALUE,
        ResultCode.INVALID_DEVICE,
        ResultCode.INVALID_HANDLE,
        ResultCode.INVALID_CONTEXT,
        ResultCode.NOT_FOUND,
        ResultCode.UNSUPPORTED_LIMIT,
        ResultCode.PEER_ACCESS_UNSUPPORTED,
        ResultCode.HOST_MEMORY_ALREADY_REGISTERED,
        ResultCode.HOST_MEMORY_NOT_REGISTERED,
    }
)

_LAUNCH_CODES = frozenset(
    {
        ResultCode.LAUNCH_OUT_OF_RESOURCES,
        ResultCode.COOPERATIVE_LAUNCH_TOO_LARGE,
        ResultCode.NO_BINARY_FOR_GPU,
        ResultCode.INVALID_IMAGE,
        ResultCode.INVALID_PTX,
        ResultCode.UNSUPPORTED_PTX_VERSION,
        ResultCode.INVALID_SOURCE,
    }
)


_CAPTURE_CODES = frozenset(
    {
        ResultCode.STREAM_CAPTURE_UNSUPPORTED,
        ResultCode.STREAM_CAPTURE_INVALIDATED,
        ResultCode.STREAM_CAPTURE_MERGE,
        ResultCode.STREAM_CAPTURE_UNMATCHED,
        ResultCode.STREAM_CAPTURE_UNJOINED,
        ResultCode.STREAM_CAPTURE_ISOLATION,
        ResultCode.STREAM_CAPTURE_IMPLICIT,
        ResultCode.CAPTURED_EVENT,
        ResultCode.STREAM_CAPTURE_WRONG_THREAD,
    }
)


_E = TypeVar("_E", bound="CudaError")


class CudaError(Exception):
    """A failure reported by the CUDA driver (or diagnosed by aiocuda on its behalf).

    Attributes:
        code: the CUresult value, or ``None`` when no driver call was involved.
        name: the symbolic name, e.g. ``"CUDA_ERROR_INVALID_VALUE"``.
        description: the driver's own explanation.
        call: the driver entry point that failed (``"cuMemAllocAsync"``), when known.
    """

    def __init__(
        self,
        message: str,
        *,
        code: int | None = None,
        name: str = "",
        description: str = "",
        call: str = "",
    ) -> None:
        super().__init__(message)
        self.code = code
        self.name = name
        self.description = description
        self.call = call

    @classmethod
    def like(cls: type[_E], other: CudaError, message: str) -> _E:
        """A ``cls`` error saying ``message`` for the same failure as ``other``: its code,
        name, description and call (a clearer error where the driver's says too little)."""
        return cls(message, code=other.code, name=other.name, description=other.description, call=other.call)


class OutOfMemoryError(CudaError, MemoryError):
    """Device (or pinned host) memory could not be allocated, even after releasing caches."""


class OversubscriptionError(OutOfMemoryError):
    """Managed memory beyond what the device has was asked for without saying so.

    Oversubscribed managed memory migrates pages back and forth on every access and can
    stall the GPU for every process that shares it, so aiocuda refuses it unless the
    call passes ``oversubscribe=True``.
    """


class ExporterLostError(CudaError):
    """Memory (or an event) shared by another process can no longer be used: that
    process ended, or stopped sharing it, and the memory may already be reused."""


class ContextPoisonedError(CudaError):
    """A sticky error has poisoned the device's context; nothing more will run on it.

    Raised for the failing operation itself and for every later call or pending await on
    the same device. Restarting the process is the only way to use the device again.
    """

    @classmethod
    def earlier(cls, failure: ContextPoisonedError, what: str) -> ContextPoisonedError:
        """The error refusing new work because ``what`` (``"device 0"``) failed earlier
        with ``failure``: its code, name and call, and a message that says to restart."""
        return cls.like(failure, f"{what} failed earlier and cannot run anything more (restart the process): {failure}")


class NoDeviceError(CudaError):
    """No CUDA driver could be loaded, or it reports no usable device."""


class ArgumentError(CudaError, ValueError):
    """A value was rejected: an out-of-range ordinal, a stale handle, a bad size."""


class LaunchError(CudaError):
    """A kernel could not be launched, or its arguments do not match its signature."""


class CompileError(CudaError):
    """A program failed to compile or link; ``log`` holds NVRTC's or the linker's full
    log (also in the message).

    Also raised, with an empty log, when NVRTC or nvJitLink itself cannot be loaded (the
    message says which package to install).
    """

    def __init__(self, message: str, *, log: str = "", name: str = "AIOCUDA_COMPILE_ERROR") -> None:
        super().__init__(message, name=name)
        self.log = log


class BackendError(CudaError, ValueError):
    """An unknown driver backend was asked for, or a bad setting for one
    (``AIOCUDA_BACKEND``, ``AIOCUDA_SIM_DEVICES``, :func:`aiocuda.use_backend`). Also a
    :class:`ValueError`."""

    def __init__(self, message: str) -> None:
        super().__init__(message, name="AIOCUDA_UNKNOWN_BACKEND")


class CaptureError(CudaError):
    """An operation cannot be captured into a graph, or the capture failed.

    Raised at the call that cannot be captured -- awaiting or synchronizing a stream that
    is being captured (captured work does not run until the graph is launched), a copy
    of pageable host memory (it needs staging through host threads), a wait on work
    outside the capture -- and when ending a capture that the driver invalidated.
    """


class GraphUpdateError(CudaError):
    """New parameters or a new capture do not fit an instantiated graph: another
    topology, another kind of node, another device, or arguments its kernel does not
    take. The graph is unchanged; capture it again instead."""


class ClosedError(RuntimeError):
    """Request lanes (:class:`aiocuda.lanes.Lanes`), a batcher
    (:class:`aiocuda.batching.Batcher`), an executor (:class:`aiocuda.executor.Executor`)
    or a Ray actor pool (:class:`aiocuda.ray.ActorPool`) are shutting down or closed, so
    a new request was not started. Requests already
    started finish normally. (One that was never started raises a plain ``RuntimeError``
    that says so.)"""


class QueueFullError(RuntimeError):
    """A batcher (:class:`aiocuda.batching.Batcher`) made with ``max_queue`` already had
    that many requests waiting for a batch, so a new one was refused at once rather than
    queued: the service is overloaded. Nothing of the request ran. A web service answers
    503 (Service Unavailable), with a ``Retry-After`` header; a client retries later,
    backing off."""


class BlockingCallWarning(RuntimeWarning):
    """A call that blocks the calling thread ran on the thread of a running event loop,
    stalling every task of the loop: waiting until the GPU is done (``synchronize()``:
    await instead), or pinning new host memory for a lane's copy that did not fit its
    staging (1-40 ms: give ``Lanes(staging=...)`` the bytes of a request's copies). A
    warning category, so that a service can turn it into an error
    (``warnings.simplefilter("error", aiocuda.BlockingCallWarning)``) or silence it."""


class SimulatedBackendWarning(UserWarning):
    """``AIOCUDA_BACKEND=auto`` (the default) found no usable GPU and chose the simulator.

    Also logged on the ``aiocuda`` logger where logging is configured. A service that
    must never run without a GPU sets ``AIOCUDA_BACKEND=cuda``: the first use then raises
    :class:`NoDeviceError` instead. Turning this warning into an error does the same:
    ``warnings.simplefilter("error", aiocuda.SimulatedBackendWarning)`` before first use.
    """


def error_for_code(code: int, name: str, description: str, call: str = "") -> CudaError:
    """Build the most specific :class:`CudaError` subclass for a driver result code."""
    cls: type[CudaError]
    if code == ResultCode.OUT_OF_MEMORY:
        cls = OutOfMemoryError
    elif code in STICKY_CODES:
        cls = ContextPoisonedError
    elif code in _NO_DEVICE_CODES:
        cls = NoDeviceError
    elif code in _ARGUMENT_CODES:
        cls = ArgumentError
    elif code in _LAUNCH_CODES:
        cls = LaunchError
    elif code in _CAPTURE_CODES:
        cls = CaptureError
    elif code == ResultCode.GRAPH_EXEC_UPDATE_FAILURE:
        cls = GraphUpdateError
    else:
        cls = CudaError
    where = f"{call}: " if call else ""
    message = f"{where}{name} ({code}): {description}" if description else f"{where}{name} ({code})"
    return cls(message, code=code, name=name, description=description, call=call)
