"""Zero-copy exchange of device arrays: ``__cuda_array_interface__`` v3 and DLPack.

Export (``DeviceArray.__cuda_array_interface__`` / ``__dlpack__``):

* The array interface is exported with ``"stream": None`` and the producer's work
  already finished: consumers that ignore the interface's ``stream`` key (PyTorch's
  ``torch.as_tensor``) would otherwise read before the producer's writes land. When the
  array's last-use stream is idle (the array was awaited) that costs one stream query;
  otherwise the export synchronises that stream, blocking the calling thread -- on an
  event loop's thread it warns (``RuntimeWarning``): await the array's stream first, or
  use DLPack, which orders the consumer's stream on the GPU instead.
* ``__dlpack__(stream=s)`` honours the *consumer's* stream, on the GPU; a versioned
  capsule where the consumer's ``max_version`` allows it, else a legacy one (see
  :mod:`.dlpack`).

Import (:func:`as_device_array`): DLPack first (asking for a versioned capsule, with a
plain call for producers that predate ``max_version``), then the array interface, then
Numba's ``__cuda_array_interface__`` via the same path. The foreign memory stays owned by
its library; aiocuda keeps the foreign object alive until work it enqueued on the memory
has completed. An interface with a ``mask``, or naming the stream 0 (which v3 forbids), is
refused.

Read-only memory: an interface whose ``data`` flag says read-only, or a versioned DLPack
capsule with the ``READ_ONLY`` flag, is imported as a
:attr:`~aiocuda.DeviceArray.readonly` array (copies into it and fills raise), and a
read-only array is exported with that flag, by the interface and by versioned capsules. A
legacy capsule cannot say read-only: a read-only array's ``__dlpack__`` without
``max_version`` raises ``BufferError`` (as numpy's does), and a legacy import is as
writable as its producer exported it.
"""

from __future__ import annotations

import asyncio
import sys
import time
import warnings
from typing import Any

import numpy as np

from .._util import byte_span, c_strides, invalid_value, shape_tuple
from ..array import DeviceArray, _check_dtype, _over_new_buffer, _stream_on
from ..device import Device
from ..stream import Stream
from . import library_streams
from .buffers import OwnedBuffer
from .dlpack import DLPACK_CUDA, DLPACK_CUDA_MANAGED, DLPACK_VERSION, read_capsule, stream_value

__all__ = ["DLPACK_CUDA", "as_device_array", "cuda_array_interface"]

# -- export -----------------------------------------------------------------------------------


# Why the interface is exported finished, with "stream": None (CAI v3 allows it when the
# producer has synchronised), rather than naming the producer's stream:
# * PyTorch (2.11) ignores the stream key, and read zeros from an array whose upload was
#   still running. CuPy and Numba honour it by synchronising that stream on the host
#   (CUPY_CUDA_ARRAY_INTERFACE_SYNC, NUMBA_CUDA_ARRAY_INTERFACE_SYNC, both on by default),
#   so every CAI consumer waits on the host anyway, or is wrong.
# * Cost, for an array whose work has finished (awaited): one cuStreamQuery, about a
#   microsecond, and CuPy and Numba then skip their own cuStreamSynchronize. For pending
#   work: the same host wait CuPy and Numba make, moved into the export, where an event
#   loop's thread is told about it instead of stalling silently.
# * Consumers that want GPU-side ordering without a host wait use DLPack, which passes
#   the consumer's stream to the producer.


def cuda_array_interface(array: DeviceArray) -> dict[str, Any]:
    """The ``__cuda_array_interface__`` (version 3) of ``array``, whose pending work has
    finished (``"stream": None``; see the module docstring)."""
    _finish_for_export(array.stream)
    return {
        "shape": array.shape,
        "typestr": array.dtype.str,
        "descr": [("", array.dtype.str)],
        "data": (array.ptr, array.readonly),
        "strides": None if array.is_c_contiguous else array.strides,
        "version": 3,
        "stream": None,
    }


def _finish_for_export(stream: Stream) -> None:
    """Return once the work on ``stream`` has finished, synchronising if it has not."""
    if stream._capture is not None:
        raise stream._capture.refuse("exporting an array through __cuda_array_interface__")
    if stream.device._driver.stream_query(stream.handle):
        return
    started = time.perf_counter()
    stream._synchronize()  # the warning below says more than synchronize()'s own
    if _on_event_loop():
        waited_ms = (time.perf_counter() - started) * 1e3
        warnings.warn(
            f"__cuda_array_interface__ blocked the event loop for {waited_ms:.1f} ms, waiting for GPU work "
            "still pending on the array's stream (consumers such as PyTorch ignore the interface's stream, "
            "so the export waits for it): `await array.stream` before handing the array over, or use DLPack "
            "(e.g. torch.from_dlpack), which orders the consumer after the array on the GPU",
            RuntimeWarning,
            stacklevel=4,
        )


def _on_event_loop() -> bool:
    """Whether the calling thread runs an asyncio or trio event loop."""
    if asyncio._get_running_loop() is not None:
        return True
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            trio.lowlevel.current_trio_token()
            return True
        except RuntimeError:
            pass
    return False


class _ReadOnlyBuffer(OwnedBuffer):
    """Foreign memory its owner exported read-only: arrays over it are
    :attr:`~aiocuda.DeviceArray.readonly`."""

    __slots__ = ()
    readonly = True


def _wrap(
    ptr: int,
    shape: tuple[int, ...],
    dtype: np.dtype[Any],
    strides: tuple[int, ...] | None,
    device: Device,
    stream: Stream,
    owner: Any,
    *,
    readonly: bool = False,
) -> DeviceArray:
    """A DeviceArray over foreign memory at ``ptr`` (its first element), ``shape`` and
    ``dtype`` valid (non-negative dimensions, no Python objects); ``readonly`` where its
    owner exported it so."""
    byte_strides = strides if strides is not None else c_strides(shape, dtype.itemsize)
    lo, hi = byte_span(shape, byte_strides, dtype.itemsize)
    kind = _ReadOnlyBuffer if readonly else OwnedBuffer
    buffer = kind(ptr + lo, hi - lo, device, stream, owner)
    return _over_new_buffer(shape, dtype, byte_strides, buffer, -lo)


def _from_cai(obj: Any, stream: Stream | None) -> DeviceArray:
    cai = obj.__cuda_array_interface__
    if cai.get("mask") is not None:  # (the interface says a consumer without masks must refuse them)
        raise invalid_value(
            f"the __cuda_array_interface__ of {type(obj).__name__} has a mask: aiocuda does not take masked arrays"
        )
    foreign = cai.get("stream")
    if foreign is not None and (isinstance(foreign, bool) or not isinstance(foreign, int) or foreign == 0):
        raise invalid_value(
            f"the __cuda_array_interface__ of {type(obj).__name__} names the stream {foreign!r}: it must be None "
            "or a stream handle (1 the legacy default stream, 2 the per-thread one); 0 is not allowed, being "
            "ambiguous (the producer's work would go unordered)"
        )
    ptr, readonly = cai["data"]
    dtype = _check_dtype(cai["typestr"])
    shape = shape_tuple(tuple(int(d) for d in cai["shape"]))
    strides = tuple(int(s) for s in cai["strides"]) if cai.get("strides") else None
    if strides is not None and len(strides) != len(shape):
        raise invalid_value(
            f"the __cuda_array_interface__ of {type(obj).__name__} has {len(strides)} strides {strides} for "
            f"the {len(shape)} dimensions of shape {shape}"
        )
    if ptr:
        probe_driver = Device(0)._driver
        device = Device(probe_driver.pointer_device_ordinal(int(ptr)))
    else:  # a zero-size array (CAI's null pointer): on no device, so on the stream's
        device = stream.device if stream is not None else Device(0)
    target = _stream_on(device, stream)
    if foreign is not None:  # the producer's stream: order our work after its pending writes
        target.wait(Stream.wrap(int(foreign), device=device))
    # The flag is kept rather than the import refused: a read-only array is mostly read
    # (a kernel's input, a download), which a refusal would forbid too; the flag makes
    # aiocuda's own writes into it raise, and travels on to consumers of its exports.
    return _wrap(int(ptr), shape, dtype, strides, device, target, obj, readonly=bool(readonly))


def _producer_stream(obj: Any, ordinal: int) -> int | None:
    """The raw handle of the stream ``obj``'s library enqueues its work on now, where that
    is cheap to know (a PyTorch tensor: PyTorch's current stream of the device); else None."""
    # Why: told a consumer stream, PyTorch's __dlpack__ makes two torch.cuda.Stream objects
    # to compare it with its current one, each under a device guard, even when they are the
    # same stream -- the common case, a model run inside interop.torch_stream(lane.stream)
    # whose output the lane then downloads. A block with that import: 104 us -> 48-58 (H200).
    torch = sys.modules.get("torch")  # (not imported: obj is no tensor of its)
    if torch is None or not isinstance(obj, torch.Tensor):
        return None
    return library_streams.torch_current_stream(ordinal)


def _dlpack_capsule(obj: Any, stream: int) -> Any:
    """``obj``'s DLPack capsule for a consumer on ``stream``: a versioned one where ``obj``
    makes them, else (a producer older than DLPack 1.0, whose ``__dlpack__`` takes no
    ``max_version``: TypeError) a legacy one."""
    try:
        return obj.__dlpack__(stream=stream, max_version=DLPACK_VERSION)
    except TypeError:
        return obj.__dlpack__(stream=stream)


def _from_capsule(capsule: Any, owner: Any, stream: Stream) -> DeviceArray:
    """A DeviceArray over what ``capsule`` (consumed here) describes, owned by ``owner``
    and the capsule's keeper, ``stream`` its stream."""
    tensor = read_capsule(capsule)
    return _wrap(
        tensor.ptr,
        tensor.shape,
        tensor.dtype,
        tensor.strides,
        Device(tensor.ordinal),
        stream,
        (owner, tensor.keeper),
        readonly=tensor.readonly,
    )


def as_device_array(obj: Any, *, stream: Stream | None = None) -> DeviceArray:
    """A zero-copy :class:`DeviceArray` over another library's device array.

    Accepts anything exporting ``__dlpack__`` with a CUDA device (PyTorch, CuPy, JAX,
    cuda.core) or ``__cuda_array_interface__`` (CuPy, Numba, PyTorch). ``stream`` (default:
    the current stream of the object's device) is where aiocuda's subsequent work on the
    array will go, a stream of the array's device (else ArgumentError); the producer is
    told to order its pending work before it. An array its producer exported read-only
    (through ``__cuda_array_interface__``, or a versioned DLPack capsule's flag) is
    :attr:`~aiocuda.DeviceArray.readonly`; one whose ``__dlpack__`` raises ``BufferError``
    (a read-only array's refusal of a legacy capsule) is imported through that interface,
    where it has one.
    """
    if isinstance(obj, DeviceArray):
        if stream is not None:
            _stream_on(obj.device, stream)  # (checked as for another library's array)
        return obj
    dlpack_device = getattr(obj, "__dlpack_device__", None)
    if dlpack_device is not None and hasattr(obj, "__dlpack__"):
        device_type, device_id = dlpack_device()
        if int(device_type) in (DLPACK_CUDA, DLPACK_CUDA_MANAGED):
            device = Device(int(device_id))
            target = _stream_on(device, stream)
            value = stream_value(target)
            if _producer_stream(obj, device.ordinal) == value:
                value = -1  # its pending work is on ``target`` already: DLPack's "no synchronisation"
            try:
                capsule = _dlpack_capsule(obj, value)
            except BufferError:
                # (what a read-only array's legacy export raises, as numpy's and aiocuda's
                # do, from producers without versioned capsules: the array interface can say
                # read-only, so the import goes through it)
                if not hasattr(obj, "__cuda_array_interface__"):
                    raise
            else:
                return _from_capsule(capsule, obj, target)
    if hasattr(obj, "__cuda_array_interface__"):
        return _from_cai(obj, stream)
    raise TypeError(
        f"cannot use {type(obj).__name__} as a device array: it has neither a CUDA __dlpack__ nor "
        "__cuda_array_interface__"
    )
