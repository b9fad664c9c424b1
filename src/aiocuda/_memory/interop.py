"""Zero-copy exchange of device arrays: ``__cuda_array_interface__`` v3 and DLPack.

Export (``DeviceArray.__cuda_array_interface__`` / ``__dlpack__``):

* The array interface is exported with ``"stream": None`` and the producer's work
  already finished: consumers that ignore the interface's ``stream`` key (PyTorch's
  ``torch.as_tensor``) would otherwise read before the producer's writes land. When the
  array's last-use stream is idle (the array was awaited) that costs one stream query;
  otherwise the export synchronises that stream, blocking the calling thread -- on an
  event loop's thread it warns (``RuntimeWarning``): await the array's stream first, or
  use DLPack, which orders the consumer's stream on the GPU instead.
* ``__dlpack__(stream=s)`` honours the *consumer's* stream: ``s`` is made to wait, on
  the GPU, for the array's pending work (``None`` means the legacy default stream, 1;
  ``-1`` asks for no synchronisation). The capsule keeps the array -- hence its memory
  -- alive until the consumer's deleter runs, and the memory is freed only after the
  work the consumer's stream had by then (consumers such as PyTorch call the deleter
  when the host drops the tensor, not when their stream's work on it has run). Legacy (unversioned) ``"dltensor"``
  capsules are produced; every consumer accepts them.

Import (:func:`as_device_array`): DLPack first, then the array interface, then Numba's
``__cuda_array_interface__`` via the same path. The foreign memory stays owned by its
library; aiocuda keeps the foreign object alive until work it enqueued on the memory has
completed. An interface with a ``mask``, or naming the stream 0 (which v3 forbids), is
refused.

Read-only memory: an interface whose ``data`` flag says read-only is imported as a
:attr:`~aiocuda.DeviceArray.readonly` array (copies into it and fills raise), and a
read-only array is exported with that flag. Legacy DLPack capsules, the only ones made and
requested here, cannot say read-only: a read-only array's ``__dlpack__`` raises
``BufferError`` (as numpy's does), and a DLPack import is as writable as its producer
exported it.
"""

from __future__ import annotations

import asyncio
import ctypes
import sys
import threading
import time
import warnings
import weakref
from typing import Any

import numpy as np

from .._util import byte_span, c_strides, invalid_value, shape_tuple
from ..array import DeviceArray, _check_dtype, _over_new_buffer, _stream_on
from ..device import Device
from ..errors import ArgumentError
from ..stream import Stream
from . import library_streams
from .buffers import OwnedBuffer

__all__ = ["DLPACK_CUDA", "as_device_array", "cuda_array_interface", "to_dlpack"]

DLPACK_CPU = 1
DLPACK_CUDA = 2
DLPACK_CUDA_HOST = 3
DLPACK_CUDA_MANAGED = 13

_DL_INT, _DL_UINT, _DL_FLOAT, _DL_COMPLEX, _DL_BOOL = 0, 1, 2, 5, 6

# The element types both sides store alike, DLPack ``(code, bits)`` <-> numpy. Numpy's
# other dtypes have no DLPack twin: its longdouble is x87's 80-bit format padded to 16
# bytes (exported as DLPack's 128-bit float, a consumer reads IEEE quads; clongdouble's
# 256 bits did not even fit the field), and DLPack's bfloat16, complex32, float8s and
# sub-byte ints have no numpy dtype (numpy's own DLPack refuses the same ones).
_DL_OF_NUMPY: dict[str, tuple[int, int]] = {
    np.dtype(f"{kind}{size}").str: (code, size * 8)  # (native byte order: DLPack's)
    for kind, code, sizes in (
        ("i", _DL_INT, (1, 2, 4, 8)),
        ("u", _DL_UINT, (1, 2, 4, 8)),
        ("f", _DL_FLOAT, (2, 4, 8)),
        ("c", _DL_COMPLEX, (8, 16)),
        ("b", _DL_BOOL, (1,)),
    )
    for size in sizes
}
_NUMPY_OF_DL = {dl: np.dtype(name) for name, dl in _DL_OF_NUMPY.items()}

_DL_TYPE_NAMES = {0: "int", 1: "uint", 2: "float", 3: "opaque handle", 4: "bfloat", 5: "complex", 6: "bool"}
_DL_TYPE_NAMES.update(dict.fromkeys(range(7, 15), "float8"))  # (the e4m3, e5m2, ... variants)
_DL_TYPE_NAMES.update({15: "float6", 16: "float6", 17: "float4"})


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.c_void_p),  # int64_t*, set and read as an address
        ("strides", ctypes.c_void_p),  # int64_t* (NULL: C-contiguous)
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]

_CAPSULE_NAME = b"dltensor"
_USED_CAPSULE_NAME = b"used_dltensor"

_capi = ctypes.pythonapi
_capi.PyCapsule_New.restype = ctypes.py_object
_capi.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_capi.PyCapsule_IsValid.restype = ctypes.c_int
_capi.PyCapsule_IsValid.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capi.PyCapsule_GetPointer.restype = ctypes.c_void_p
_capi.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capi.PyCapsule_SetName.restype = ctypes.c_int
_capi.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]

_int64_arrays: dict[int, Any] = {}
"""``ctypes.c_int64 * n`` by ``n`` (a type made once per length)."""


def _int64s(n: int) -> Any:
    kind = _int64_arrays.get(n)
    if kind is None:
        kind = _int64_arrays[n] = ctypes.c_int64 * n
    return kind


# Exported tensors still owned by a capsule or a consumer: address -> (struct, shape
# and strides storage, the array, the consumer's stream where it is another than the
# array's, else None).
_exports: dict[int, tuple[Any, ...]] = {}
_exports_lock = threading.Lock()


# -- export -----------------------------------------------------------------------------------


def _stream_value(stream: Stream) -> int:
    value = stream.device._driver.handle_value(stream.handle)
    return value or 1  # CAI v3 forbids 0; 1 is the legacy default stream


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


# The deleter and the capsule destructor are called by C code, also while the interpreter
# tears down its modules (a capsule or consumer collected then): what they use is bound
# as default arguments, which outlive the module's globals, and their ctypes thunks are
# never freed (a capsule destroyed after its destructor's thunk would call freed memory).
# Seen on the GPU machine: "TypeError: 'NoneType' object is not callable" in the
# destructor at the end of the gpu tests.


def _immortal(thunk: Any) -> Any:
    """Keep a ctypes callback alive for the life of the process."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(thunk))
    return thunk


def _forget_export(
    managed: Any,
    _addressof: Any = ctypes.addressof,
    _lock: Any = _exports_lock,
    _exported: Any = _exports,
    _finalizing: Any = sys.is_finalizing,
    _failure: type[BaseException] = Exception,
) -> None:
    with _lock:
        entry = _exported.pop(_addressof(managed.contents), None)
    if entry is None or entry[3] is None or _finalizing():
        return
    _, _, array, consumer = entry
    # The consumer lets the tensor go when the host drops it, not when its stream's work
    # on it has run: the array's memory is freed only after what that stream has so far
    # (PyTorch's record_stream). Called from C: nothing may raise.
    try:
        consumer.device.make_current()
        array.buffer._free_after(consumer.record())
    except _failure:  # e.g. the consumer's context is gone: nothing left to order
        pass


_deleter = _immortal(_DELETER(_forget_export))


# The capsule destructor receives a capsule that is being deallocated: it must not be
# turned into a Python reference, so these prototypes take the raw address.
_capsule_is_valid_raw = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_IsValid", ctypes.pythonapi)
)
_capsule_pointer_raw = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi)
)


def _destroy_capsule(
    capsule_address: int,
    _is_valid: Any = _capsule_is_valid_raw,
    _pointer: Any = _capsule_pointer_raw,
    _name: bytes = _CAPSULE_NAME,
    _lock: Any = _exports_lock,
    _exported: Any = _exports,
) -> None:
    if _is_valid(capsule_address, _name):  # never consumed: still ours
        address = _pointer(capsule_address, _name)
        with _lock:
            _exported.pop(address, None)


_capsule_destructor = _immortal(ctypes.CFUNCTYPE(None, ctypes.c_void_p)(_destroy_capsule))
_CAPSULE_DESTRUCTOR = ctypes.cast(_capsule_destructor, ctypes.c_void_p).value


def _order_consumer(array: DeviceArray, stream: int | None) -> Stream | None:
    """Make the consumer's ``stream`` (a DLPack stream value) wait for ``array``'s pending
    work; return it, wrapped, where it is another stream than the array's."""
    if stream is not None and (isinstance(stream, bool) or not isinstance(stream, int) or stream == 0 or stream < -1):
        # (the DLPack protocol for CUDA: None or 1 the legacy default stream, 2 the
        # per-thread one, a larger int a stream handle, -1 no ordering; 0 is ambiguous)
        raise ValueError(
            f"__dlpack__(stream=) takes None, -1, 1, 2 or a CUDA stream handle, got {stream!r} "
            "(0 is not allowed: it could mean the legacy or the per-thread default stream)"
        )
    if stream == -1:
        return None
    producer = array.stream
    value = 1 if stream is None else stream
    if value == _stream_value(producer):
        return None  # the consumer's stream is the producer's: ordered already
    try:
        consumer = Stream.wrap(value, device=array.device)
        consumer.wait(producer)
    except ArgumentError:  # a stream value this backend cannot wrap: wait on the host
        producer.synchronize()
        return None
    return consumer


def to_dlpack(
    array: DeviceArray, *, stream: int | None = None, dl_device: tuple[int, int] | None = None, copy: bool | None = None
) -> Any:
    """A ``"dltensor"`` capsule for ``array``, ordered before work on the consumer's stream."""
    if copy:
        raise BufferError("aiocuda exports device arrays without copying (copy=True is not supported)")
    if dl_device is not None and tuple(dl_device) != (DLPACK_CUDA, array.device.ordinal):
        raise BufferError(
            f"cannot export to DLPack device {dl_device}: the array is on {(DLPACK_CUDA, array.device.ordinal)}"
        )
    dl_type = _DL_OF_NUMPY.get(array.dtype.str)
    if dl_type is None:
        raise BufferError(
            f"dtype {array.dtype} ({array.dtype.str}) has no DLPack equivalent: DLPack exchanges bool, "
            "ints of 1 to 8 bytes, IEEE float16/32/64 and complex64/128, in native byte order"
        )
    itemsize = array.dtype.itemsize
    if any(step % itemsize for step in array.strides):
        # (DLPack counts strides in elements: such a stride was rounded down, and the
        # consumer read other elements than the array's)
        raise BufferError(
            f"strides {array.strides} are not whole multiples of the item size ({itemsize} bytes), which "
            "DLPack cannot describe: copy the array first (array.copy())"
        )
    if array.readonly:
        # (a legacy capsule has no read-only flag, and consumers write what they get;
        # DLPack 1.0's versioned capsules carry one, but aiocuda makes legacy ones only)
        raise BufferError(
            "a read-only array cannot be exported through DLPack, whose (legacy) capsules cannot mark it "
            "read-only: export a copy (`await array.copy()`), or use __cuda_array_interface__, which can"
        )
    consumer = _order_consumer(array, stream)
    # One constructor call per struct and one int64 array for the shape and strides:
    # setting the fields one by one, with a ctypes.cast for each pointer, took 13 us on
    # the development machine, this 8.5 (a PyTorch request through a lane crosses DLPack
    # twice).
    shape = array.shape
    ndim = len(shape)
    storage = _int64s(2 * ndim or 1)(*shape, *(s // itemsize for s in array.strides))
    dims = ctypes.addressof(storage)
    tensor = _DLTensor(
        array.ptr,
        _DLDevice(DLPACK_CUDA, array.device.ordinal),
        ndim,
        _DLDataType(*dl_type, 1),
        dims,
        dims + 8 * ndim,
        0,
    )
    managed = _DLManagedTensor(tensor, None, _deleter)
    address = ctypes.addressof(managed)
    with _exports_lock:
        _exports[address] = (managed, storage, array, consumer)
    return _capi.PyCapsule_New(address, _CAPSULE_NAME, _CAPSULE_DESTRUCTOR)


# -- import -----------------------------------------------------------------------------------


_dtypes: dict[tuple[int, int, int], np.dtype[Any]] = {}
"""DLPack ``(code, bits, lanes)`` -> numpy dtype, for those seen."""


def _dtype_of(code: int, bits: int, lanes: int) -> np.dtype[Any]:
    dtype = _dtypes.get((code, bits, lanes))
    if dtype is None:
        found = _NUMPY_OF_DL.get((code, bits)) if lanes == 1 else None
        if found is None:
            name = f"{_DL_TYPE_NAMES.get(code, 'unknown type')}{bits}" + (f"x{lanes}" if lanes != 1 else "")
            raise invalid_value(
                f"unsupported DLPack dtype {name} (code {code}, bits {bits}, lanes {lanes}): it has no numpy "
                "equivalent; convert it first (PyTorch: tensor.float() for bfloat16, tensor.cfloat() for "
                "complex32, or tensor.view(torch.int16) to move the bits unchanged)"
            )
        dtype = _dtypes[code, bits, lanes] = found
    return dtype


def _from_capsule(capsule: Any, owner: Any, stream: Stream) -> DeviceArray:
    try:
        address = _capi.PyCapsule_GetPointer(capsule, _CAPSULE_NAME)
    except (ValueError, TypeError):  # another name (a consumed capsule's), or no capsule
        address = None
    if not address:
        raise invalid_value("not a DLPack capsule (or one already consumed)")
    managed = _DLManagedTensor.from_address(address)
    tensor = managed.dl_tensor
    device = tensor.device
    if device.device_type not in (DLPACK_CUDA, DLPACK_CUDA_MANAGED):
        raise invalid_value(f"DLPack device type {device.device_type} is not CUDA memory")
    dl_dtype = tensor.dtype
    dtype = _dtype_of(dl_dtype.code, dl_dtype.bits, dl_dtype.lanes)
    ndim = tensor.ndim
    shape: tuple[int, ...] = tuple(_int64s(ndim).from_address(tensor.shape)) if ndim else ()
    if shape and min(shape) < 0:
        raise invalid_value(f"negative dimension in DLPack shape {shape}")
    at = tensor.strides
    strides = tuple(s * dtype.itemsize for s in _int64s(ndim).from_address(at)) if at and ndim else None
    _capi.PyCapsule_SetName(capsule, _USED_CAPSULE_NAME)
    keeper = _CapsuleKeeper(address, managed.deleter)
    ptr = (tensor.data or 0) + tensor.byte_offset
    return _wrap(ptr, shape, dtype, strides, Device(device.device_id), stream, (owner, keeper))


class _CapsuleKeeper:
    """Calls a consumed DLPack tensor's deleter when aiocuda no longer needs it."""

    __slots__ = ("__weakref__",)

    def __init__(self, address: int, deleter: Any) -> None:
        # A finalizer, not __del__: it runs at exit, before the interpreter tears down
        # modules -- a keeper collected later called PyTorch's deleter after PyTorch was
        # gone, and the process crashed on exit (GPU machine, the gpu tests).
        weakref.finalize(self, _call_deleter, address, deleter)


def _call_deleter(address: int, deleter: Any) -> None:
    if deleter:
        deleter(ctypes.cast(address, ctypes.POINTER(_DLManagedTensor)))


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


def as_device_array(obj: Any, *, stream: Stream | None = None) -> DeviceArray:
    """A zero-copy :class:`DeviceArray` over another library's device array.

    Accepts anything exporting ``__dlpack__`` with a CUDA device (PyTorch, CuPy, JAX,
    cuda.core) or ``__cuda_array_interface__`` (CuPy, Numba, PyTorch). ``stream`` (default:
    the current stream of the object's device) is where aiocuda's subsequent work on the
    array will go, a stream of the array's device (else ArgumentError); the producer is
    told to order its pending work before it. An array its producer exported read-only
    (through ``__cuda_array_interface__``) is :attr:`~aiocuda.DeviceArray.readonly`; one
    whose ``__dlpack__`` raises ``BufferError`` (a read-only array's refusal) is imported
    through that interface, where it has one.
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
            value = _stream_value(target)
            if _producer_stream(obj, device.ordinal) == value:
                value = -1  # its pending work is on ``target`` already: DLPack's "no synchronisation"
            try:
                capsule = obj.__dlpack__(stream=value)
            except BufferError:
                # (what a read-only array's export raises, as numpy's and aiocuda's do: the
                # array interface can say read-only, so the import goes through it)
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
