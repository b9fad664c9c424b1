"""PyTorch and CuPy work on aiocuda streams: each library's stream object over ours, and
the aiocuda stream kept alive for as long as that library may use its handle.

Both libraries keep per-stream state keyed by the raw handle -- PyTorch its cuBLAS
workspaces and the caching allocator's blocks (a block freed on a stream is reused by the
next allocation on that stream, and blocks used on other streams record events on them
when freed), CuPy its stream-ordered memory pool arenas -- and neither is told when a
foreign stream goes away. A destroyed stream whose handle the driver hands to a new one,
or an event recorded on a destroyed stream, is undefined behaviour. So a stream once
handed to one of them is *adopted*: this module keeps it (and the library's stream
object) alive until the process exits, its handle is never destroyed (closing it only
stops aiocuda from enqueuing on it; the library can no longer be given it), and
:class:`aiocuda.lanes.Lanes` does not close adopted streams when it closes. Adopt
long-lived streams (request lanes), not one per request.

The libraries are imported on first use only; neither is a dependency of aiocuda.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import threading
import warnings
from collections.abc import Iterator
from typing import Any

from ..errors import ArgumentError, ResultCode
from ..stream import Stream

__all__ = ["adopted", "cupy_stream", "library_stream", "on_simulator", "torch_current_stream", "torch_stream"]

_adopted: dict[int, tuple[Stream, dict[str, Any]]] = {}
"""``id(stream)`` -> (the stream, its library stream objects by library name). Entries are
never removed: the stream's id cannot be reused while it is kept here."""
_lock = threading.Lock()


def _import(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise ImportError(f"aiocuda.interop needs {name}, which is not installed: pip install {name}") from exc


def _make(stream: Stream, library: str) -> Any:
    ordinal = stream.device.ordinal
    handle = int(stream)  # the raw CUstream as an int: what both libraries' constructors take
    if library == "torch":
        torch = _import("torch")
        return torch.cuda.ExternalStream(handle, device=torch.device("cuda", ordinal))
    cupy = _import("cupy")
    # CuPy 14 deprecates ExternalStream for Stream.from_external(obj), which makes a
    # cupy.cuda.Stream: its finaliser destroys the handle (our stream) when collected,
    # and it takes the device from CuPy's current one. ExternalStream never destroys.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "ExternalStream is deprecated", DeprecationWarning)
        return cupy.cuda.ExternalStream(handle, device_id=ordinal)


def on_simulator(stream: Stream) -> bool:
    """Whether ``stream`` belongs to the simulated backend, whose streams no library can use."""
    return bool(stream.device._driver.name != "cuda")


def library_stream(stream: Stream, library: str) -> Any:
    """``library``'s (``"torch"`` or ``"cupy"``) stream object over ``stream``, made once;
    adopts ``stream`` (see the module docstring)."""
    # (closed first: a cached library stream of a closed stream would hand the library a
    # handle that takes no more work)
    entry = _adopted.get(id(stream)) if not stream.closed else None
    found = entry[1].get(library) if entry is not None else None
    if found is not None:
        return found
    if stream.closed or on_simulator(stream):
        why = "is closed" if stream.closed else "belongs to the simulated backend"
        raise ArgumentError(
            f"{library} cannot use this stream: it {why}",
            code=ResultCode.INVALID_HANDLE,
            name="CUDA_ERROR_INVALID_HANDLE",
        )
    made = _make(stream, library)
    stream._keep_handle()  # closing it must not destroy what the library keeps state for
    with _lock:
        objects = _adopted.setdefault(id(stream), (stream, {}))[1]
        return objects.setdefault(library, made)


def adopted(stream: Stream) -> bool:
    """Whether PyTorch or CuPy has been given ``stream`` (it then lives until exit)."""
    return id(stream) in _adopted


@functools.cache
def _torch_c() -> Any:
    """``torch._C``, imported on first use."""
    return _import("torch")._C


def torch_current_stream(ordinal: int) -> int:
    """The raw handle of PyTorch's current stream on device ``ordinal``."""
    return int(_torch_c()._cuda_getCurrentRawStream(ordinal))


class _TorchBlock:
    """What :func:`torch_stream` returns: entering makes the stream PyTorch's current one
    on its device, leaving gives each device touched its stream from before back."""

    __slots__ = ("_external", "_restore")

    def __init__(self, external: Any) -> None:
        self._external = external
        self._restore: tuple[tuple[int, int, int], ...] = ()

    def __enter__(self) -> Any:
        external = self._external
        if external is None:
            return None
        # torch.cuda.stream() makes two torch.cuda.Stream objects per block, each under a
        # device guard: 18 us a block on the H200, where the C calls it makes underneath,
        # made here directly, take 4.
        torch_c = _torch_c()
        index = external.device_index
        current = torch_c._cuda_getDevice()
        before = torch_c._cuda_getCurrentStream(index)
        # (Setting a stream also makes its device current: the current device's own
        # stream goes back last, and with it the current device.)
        self._restore = (before,) if current == index else (before, torch_c._cuda_getCurrentStream(current))
        torch_c._cuda_setStream(stream_id=external.stream_id, device_index=index, device_type=external.device_type)
        return external

    def __exit__(self, *exc: object) -> None:
        restore, self._restore = self._restore, ()
        if restore:
            set_stream = _torch_c()._cuda_setStream
            for stream_id, device_index, device_type in restore:
                set_stream(stream_id=stream_id, device_index=device_index, device_type=device_type)


def torch_stream(stream: Stream) -> contextlib.AbstractContextManager[Any]:
    """A block (``with torch_stream(stream) as s:``) in which ``stream`` is PyTorch's
    current stream on its device, ``s`` its ``torch.cuda.ExternalStream``; the device's
    previous current stream (and the current device) come back at its end. Enqueue only
    inside: an ``await`` in the block would leave the stream current for the loop's other
    tasks. On the simulated backend the block does nothing (``s`` is None)."""
    return _TorchBlock(None if on_simulator(stream) else library_stream(stream, "torch"))


@contextlib.contextmanager
def cupy_stream(stream: Stream) -> Iterator[Any]:
    """Make ``stream`` CuPy's current stream (and its device CuPy's current device)
    inside the block; on the simulated backend, do nothing (yield None)."""
    if on_simulator(stream):
        yield None
        return
    external = library_stream(stream, "cupy")
    cupy = _import("cupy")
    with cupy.cuda.Device(stream.device.ordinal), external:
        yield external
