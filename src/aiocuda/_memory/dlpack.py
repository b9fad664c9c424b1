"""DLPack capsules: a :class:`DeviceArray`'s export, and reading another library's capsule.

Export (``DeviceArray.__dlpack__``):

* ``stream=s`` is the *consumer's* stream: ``s`` is made to wait, on the GPU, for the
  array's pending work (``None`` means the legacy default stream, 1; ``-1`` asks for no
  synchronisation). The capsule keeps the array -- hence its memory -- alive until the
  consumer's deleter runs, and the memory is freed only after the work the consumer's
  stream had by then (consumers such as PyTorch call the deleter when the host drops the
  tensor, not when their stream's work on it has run).
* ``max_version=(major, minor)`` with ``major >= 1`` gets a DLPack 1.0 versioned
  ``"dltensor_versioned"`` capsule (``DLManagedTensorVersioned``), whose flags carry a
  read-only array's ``READ_ONLY`` bit; without it (or below 1.0) a legacy ``"dltensor"``
  capsule, which has no flags: a read-only array then raises ``BufferError`` (as numpy's
  does), since the consumer would take the memory as writable.
* Nothing is ever copied: ``copy=True`` raises ``BufferError`` (the protocol's answer
  for a producer that cannot copy), ``copy=False`` and ``None`` export the array itself;
  ``dl_device`` may only name the array's own device.

Import (:func:`read_capsule`): both capsule kinds; a versioned capsule's major version
must be 1 (a newer one is refused unconsumed: its own destructor frees it), its
``READ_ONLY`` flag makes the import read-only. A consumed capsule is renamed
``"used_dltensor"`` / ``"used_dltensor_versioned"``, and the producer's deleter runs
once aiocuda no longer needs the memory.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import weakref
from typing import Any, NamedTuple

import numpy as np

from .._util import invalid_value
from ..array import DeviceArray
from ..errors import ArgumentError
from ..stream import Stream

__all__ = [
    "DLPACK_CPU",
    "DLPACK_CUDA",
    "DLPACK_CUDA_HOST",
    "DLPACK_CUDA_MANAGED",
    "DLPACK_VERSION",
    "ForeignTensor",
    "read_capsule",
    "stream_value",
    "to_dlpack",
]

DLPACK_CPU = 1
DLPACK_CUDA = 2
DLPACK_CUDA_HOST = 3
DLPACK_CUDA_MANAGED = 13

DLPACK_VERSION = (1, 0)
"""The versioned capsules' ``DLPackVersion`` made and read here (``dlpack.h`` 1.0)."""

_FLAG_READ_ONLY = 1 << 0  # DLPACK_FLAG_BITMASK_READ_ONLY
_FLAG_IS_COPIED = 1 << 1  # DLPACK_FLAG_BITMASK_IS_COPIED (never set here: nothing is copied)

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


class _DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _DLManagedTensorVersioned(ctypes.Structure):
    pass


_VERSIONED_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensorVersioned))
_DLManagedTensorVersioned._fields_ = [
    ("version", _DLPackVersion),  # first in every major version: read before anything else
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", _VERSIONED_DELETER),
    ("flags", ctypes.c_uint64),
    ("dl_tensor", _DLTensor),
]

_CAPSULE_NAME = b"dltensor"
_USED_CAPSULE_NAME = b"used_dltensor"
_VERSIONED_CAPSULE_NAME = b"dltensor_versioned"
_USED_VERSIONED_CAPSULE_NAME = b"used_dltensor_versioned"

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


# Exported tensors still owned by a capsule or a consumer: address of the managed struct
# (legacy or versioned) -> (struct, shape and strides storage, the array, the consumer's
# stream where it is another than the array's, else None). The entry is what keeps the
# struct and the array alive; whoever owns the tensor ends it exactly once: the consumer
# by the deleter, or, for a capsule never consumed, the capsule's destructor (a capsule
# consumed is renamed first, so its destructor leaves the entry to the deleter).
_exports: dict[int, tuple[Any, ...]] = {}
_exports_lock = threading.Lock()


# -- export -----------------------------------------------------------------------------------


def stream_value(stream: Stream) -> int:
    """``stream``'s raw handle as DLPack and the array interface name it (never 0)."""
    value = stream.device._driver.handle_value(stream.handle)
    return value or 1  # CAI v3 forbids 0; 1 is the legacy default stream


# The deleters and the capsule destructor are called by C code, also while the
# interpreter tears down its modules (a capsule or consumer collected then): what they
# use is bound as default arguments, which outlive the module's globals, and their ctypes
# thunks are never freed (a capsule destroyed after its destructor's thunk would call
# freed memory). Seen on the GPU machine: "TypeError: 'NoneType' object is not callable"
# in the destructor at the end of the gpu tests.


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


# (one Python function behind both: the two structs differ only in the pointer's type)
_deleter = _immortal(_DELETER(_forget_export))
_versioned_deleter = _immortal(_VERSIONED_DELETER(_forget_export))


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
    _names: tuple[bytes, ...] = (_CAPSULE_NAME, _VERSIONED_CAPSULE_NAME),
    _lock: Any = _exports_lock,
    _exported: Any = _exports,
) -> None:
    # A capsule never consumed still has its name (PyCapsule_IsValid checks it, and sets
    # no error when it differs): its tensor is still ours, and ends here -- what calling
    # our deleter would do, less the consumer's stream, which no consumer named. One
    # renamed "used_..." belongs to its consumer, who calls the deleter.
    for name in _names:
        if _is_valid(capsule_address, name):
            address = _pointer(capsule_address, name)
            with _lock:
                _exported.pop(address, None)
            return


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
    if value == stream_value(producer):
        return None  # the consumer's stream is the producer's: ordered already
    try:
        consumer = Stream.wrap(value, device=array.device)
        consumer.wait(producer)
    except ArgumentError:  # a stream value this backend cannot wrap: wait on the host
        producer.synchronize()
        return None
    return consumer


def _wants_versioned(max_version: Any) -> bool:
    """Whether a consumer's ``max_version`` asks for a versioned capsule (major >= 1)."""
    if max_version is None:
        return False
    try:
        major, _minor = (int(part) for part in max_version)
    except (TypeError, ValueError):
        raise TypeError(f"__dlpack__(max_version=) takes None or a (major, minor) tuple, got {max_version!r}") from None
    # (a consumer names the newest version it reads; ours, 1.0, is never newer than a
    # major >= 1 it names, so it is the one returned, as the protocol asks)
    return major >= 1


def to_dlpack(
    array: DeviceArray,
    *,
    stream: int | None = None,
    max_version: tuple[int, int] | None = None,
    dl_device: tuple[int, int] | None = None,
    copy: bool | None = None,
) -> Any:
    """A DLPack capsule for ``array``, ordered before work on the consumer's ``stream``:
    ``"dltensor_versioned"`` (version 1.0, with the read-only flag) where ``max_version``
    allows it, else a legacy ``"dltensor"``."""
    versioned = _wants_versioned(max_version)
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
    readonly = array.readonly
    if readonly and not versioned:
        # (a legacy capsule has no read-only flag, and consumers write what they get)
        raise BufferError(
            "a read-only array cannot be exported in a legacy DLPack capsule, which cannot mark it read-only: "
            "ask for a versioned one (__dlpack__(max_version=(1, 0)), which torch and numpy >= 2.1's "
            "from_dlpack do), export a copy (`await array.copy()`), or use __cuda_array_interface__"
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
    managed: Any
    if versioned:
        flags = _FLAG_READ_ONLY if readonly else 0
        managed = _DLManagedTensorVersioned(_DLPackVersion(*DLPACK_VERSION), None, _versioned_deleter, flags, tensor)
        name = _VERSIONED_CAPSULE_NAME
    else:
        managed = _DLManagedTensor(tensor, None, _deleter)
        name = _CAPSULE_NAME
    # (manager_ctx stays NULL: the struct's address keys the _exports entry that owns it)
    address = ctypes.addressof(managed)
    with _exports_lock:
        _exports[address] = (managed, storage, array, consumer)
    return _capi.PyCapsule_New(address, name, _CAPSULE_DESTRUCTOR)


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


class ForeignTensor(NamedTuple):
    """What a consumed capsule describes: ``ptr`` (the first element), ``shape``,
    ``dtype``, byte ``strides`` (None: C-contiguous), the device's ``ordinal``,
    ``readonly`` (its producer's flag), and ``keeper``, which calls the producer's deleter
    when collected: whatever uses the memory keeps it."""

    ptr: int
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    strides: tuple[int, ...] | None
    ordinal: int
    readonly: bool
    keeper: Any


def _capsule_pointer(capsule: Any, name: bytes) -> int | None:
    if not _capi.PyCapsule_IsValid(capsule, name):  # (any object, no error set, unlike GetPointer)
        return None
    return _capi.PyCapsule_GetPointer(capsule, name) or None


def read_capsule(capsule: Any) -> ForeignTensor:
    """Consume a ``"dltensor_versioned"`` or ``"dltensor"`` capsule of CUDA memory:
    ArgumentError (the capsule left unconsumed) if it cannot be described as a
    :class:`DeviceArray`, BufferError for a versioned one of a major version other than 1."""
    address = _capsule_pointer(capsule, _VERSIONED_CAPSULE_NAME)
    if address is not None:
        versioned = _DLManagedTensorVersioned.from_address(address)
        version = versioned.version
        if version.major != DLPACK_VERSION[0]:
            # (only the version may be read: a new major version changes the layout. The
            # capsule is left unconsumed; its destructor calls the producer's deleter)
            raise BufferError(
                f"the DLPack capsule has version {version.major}.{version.minor}; aiocuda reads major version "
                f"{DLPACK_VERSION[0]} only"
            )
        tensor = versioned.dl_tensor
        readonly = bool(versioned.flags & _FLAG_READ_ONLY)
        deleter: Any = versioned.deleter
        pointer_type: Any = ctypes.POINTER(_DLManagedTensorVersioned)
        used_name = _USED_VERSIONED_CAPSULE_NAME
    else:
        address = _capsule_pointer(capsule, _CAPSULE_NAME)
        if address is None:  # another name (a consumed capsule's), or no capsule
            raise invalid_value("not a DLPack capsule (or one already consumed)")
        legacy = _DLManagedTensor.from_address(address)
        tensor = legacy.dl_tensor
        readonly = False  # (a legacy capsule cannot say; numpy's rule: writable)
        deleter = legacy.deleter
        pointer_type = ctypes.POINTER(_DLManagedTensor)
        used_name = _USED_CAPSULE_NAME
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
    ptr = (tensor.data or 0) + tensor.byte_offset
    # Consumed from here on: renamed, so that the capsule's destructor leaves the tensor
    # to the keeper, which calls the deleter exactly once.
    _capi.PyCapsule_SetName(capsule, used_name)
    keeper = _CapsuleKeeper(address, deleter, pointer_type)
    return ForeignTensor(ptr, shape, dtype, strides, device.device_id, readonly, keeper)


class _CapsuleKeeper:
    """Calls a consumed DLPack tensor's deleter when aiocuda no longer needs it."""

    __slots__ = ("__weakref__",)

    def __init__(self, address: int, deleter: Any, pointer_type: Any) -> None:
        # A finalizer, not __del__: it runs at exit, before the interpreter tears down
        # modules -- a keeper collected later called PyTorch's deleter after PyTorch was
        # gone, and the process crashed on exit (GPU machine, the gpu tests).
        weakref.finalize(self, _call_deleter, address, deleter, pointer_type)


def _call_deleter(address: int, deleter: Any, pointer_type: Any) -> None:
    if deleter:  # (a NULL deleter: the producer has nothing to free)
        deleter(ctypes.cast(address, pointer_type))
