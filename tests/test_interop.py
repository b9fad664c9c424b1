"""Interoperability: __cuda_array_interface__ v3, DLPack export/import, CuPy and PyTorch."""

from __future__ import annotations

import ctypes
import gc
import importlib.util
import os
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import aiocuda.array as ga
from aiocuda import _driver
from aiocuda._memory import dlpack as _dlpack
from aiocuda._memory.copies import copy_device
from aiocuda._memory.interop import DLPACK_CUDA, as_device_array
from aiocuda.errors import CaptureError
from aiocuda.stream import Stream

from ._workload import Gate, slow_op

pytestmark = pytest.mark.anyio


class _DLPackOnly:
    """Exposes only the DLPack protocol of the wrapped object."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.streams: list[Any] = []

    def __dlpack__(self, **kwargs: Any) -> Any:
        self.streams.append(kwargs.get("stream"))
        return self.inner.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.inner.__dlpack_device__()  # type: ignore[no-any-return]


class _CAIOnly:
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return self.inner.__cuda_array_interface__  # type: ignore[no-any-return]


async def test_cuda_array_interface_v3(backend: _driver.Driver, anyio_backend: object) -> None:
    with Stream(0) as s:
        host = np.arange(60, dtype=np.float32).reshape(6, 10)
        dev = await ga.to_device(host, stream=s)
        cai = dev.__cuda_array_interface__
        assert cai["version"] == 3 and cai["shape"] == (6, 10) and cai["typestr"] == "<f4"
        assert cai["data"] == (dev.ptr, False) and cai["strides"] is None
        assert cai["stream"] is None  # exported finished: see test_cai_export_waits_for_pending_work
        view = dev[1:5, ::-3]
        vcai = view.__cuda_array_interface__
        assert vcai["strides"] == (40, -12) and vcai["data"][0] == view.ptr


def _pending_write(array: ga.DeviceArray, stream: Stream, word: int) -> None:
    """Enqueue, behind a slow operation, a memset of ``array`` (4-byte elements) to
    ``word``: a write still pending when the next line runs."""
    slow_op(stream, 0.3)
    array.buffer._used_on(stream)
    stream.device._driver.memset_d32_async(array.ptr, word, array.size, stream.handle)


def test_cai_export_waits_for_pending_work(backend: _driver.Driver) -> None:
    """Outside an event loop the export synchronises the array's stream: a consumer that
    ignores the interface's stream still reads the finished data."""
    with Stream(0) as s:
        array = ga.empty(1024, np.uint32, stream=s)
        _pending_write(array, s, 7)
        assert not s.query()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no event loop here: nothing to warn about
            cai = array.__cuda_array_interface__
        assert cai["stream"] is None and s.query()
        assert array.__cuda_array_interface__["stream"] is None  # idle: no wait at all


async def test_cai_export_on_an_event_loop_warns_when_it_waits(backend: _driver.Driver, anyio_backend: object) -> None:
    with Stream(0) as s:
        array = await ga.zeros(1024, np.uint32, stream=s)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert array.__cuda_array_interface__["stream"] is None  # awaited: nothing pending
        _pending_write(array, s, 7)
        with pytest.warns(RuntimeWarning, match=r"await array\.stream"):
            cai = array.__cuda_array_interface__
        assert cai["stream"] is None and s.query()
        assert (await array.to_host(stream=s) == 7).all()


async def test_cai_export_is_refused_while_the_arrays_stream_is_captured(
    backend: _driver.Driver, anyio_backend: object
) -> None:
    with Stream(0) as s:
        array = await ga.zeros(1024, np.uint32, stream=s)
        with pytest.raises(CaptureError, match="__cuda_array_interface__"):
            async with s.capture():
                array.__cuda_array_interface__  # noqa: B018
        await s
        assert array.__cuda_array_interface__["stream"] is None  # after the capture: as before


@pytest.mark.parametrize("stream", [0, -2, 1.0, True, "1"])
async def test_dlpack_refuses_a_stream_the_protocol_does_not_define(
    backend: _driver.Driver, anyio_backend: object, stream: object
) -> None:
    dev = await ga.to_device(np.arange(4, dtype=np.float32))
    with pytest.raises(ValueError, match="stream="):
        dev.__dlpack__(stream=stream)  # type: ignore[arg-type]


async def test_dlpack_export_describes_the_array(backend: _driver.Driver, anyio_backend: object) -> None:
    host = np.arange(24, dtype=np.int16).reshape(4, 6)
    dev = await ga.to_device(host)
    view = dev[:, 1::2]
    assert view.__dlpack_device__() == (DLPACK_CUDA, 0)
    capsule = view.__dlpack__(stream=-1)
    address = ctypes.pythonapi.PyCapsule_GetPointer(ctypes.py_object(capsule), b"dltensor")
    tensor = _dlpack._DLManagedTensor.from_address(address).dl_tensor
    assert tensor.data == view.ptr and tensor.ndim == 2
    assert (tensor.device.device_type, tensor.device.device_id) == (DLPACK_CUDA, 0)
    assert (tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes) == (0, 16, 1)
    assert list(_dlpack._int64s(2).from_address(tensor.shape)) == [4, 3]
    assert list(_dlpack._int64s(2).from_address(tensor.strides)) == [6, 2]  # in elements
    assert len(_dlpack._exports) >= 1
    del capsule, tensor
    gc.collect()
    assert all(entry[2] is not view for entry in _dlpack._exports.values())
    with pytest.raises(BufferError):
        view.__dlpack__(copy=True)
    with pytest.raises(BufferError):
        view.__dlpack__(dl_device=(DLPACK_CUDA, 5))


def test_dlpack_callbacks_need_no_module_globals() -> None:
    """The capsule destructor and the exported tensor's deleter are called from C, also
    while the interpreter tears modules down (their globals None by then): they use only
    what they were bound to."""
    import dis

    for callback in (_dlpack._destroy_capsule, _dlpack._forget_export):
        loaded = {i.argval for i in dis.get_instructions(callback) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
        assert not loaded, f"{callback.__name__} reads module globals {loaded}"


class _Capsule:
    """Hands over one given DLPack capsule, as a CUDA array of device 0."""

    def __init__(self, capsule: Any) -> None:
        self.capsule = capsule

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self.capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return (DLPACK_CUDA, 0)


async def test_a_dlpack_import_refuses_what_it_cannot_describe(backend: _driver.Driver, anyio_backend: object) -> None:
    """A capsule whose dtype, device or shape aiocuda cannot take is refused with an
    ArgumentError that says which, and a consumed capsule cannot be imported again."""
    from aiocuda.errors import ArgumentError

    dev = await ga.to_device(np.arange(12, dtype=np.float32).reshape(3, 4))

    def exported() -> tuple[Any, Any, Any]:
        capsule = dev.__dlpack__(stream=-1)
        address = ctypes.pythonapi.PyCapsule_GetPointer(ctypes.py_object(capsule), b"dltensor")
        tensor = _dlpack._DLManagedTensor.from_address(address).dl_tensor
        return capsule, tensor, _dlpack._int64s(2).from_address(tensor.shape)

    capsule, tensor, _ = exported()
    tensor.dtype.lanes = 2
    with pytest.raises(ArgumentError, match=r"dtype float32x2 \(code 2, bits 32, lanes 2\)"):
        as_device_array(_Capsule(capsule))
    capsule, tensor, _ = exported()
    tensor.device.device_type = 1  # kDLCPU
    with pytest.raises(ArgumentError, match="device type 1 is not CUDA memory"):
        as_device_array(_Capsule(capsule))
    capsule, _, shape = exported()
    shape[0] = -3
    with pytest.raises(ArgumentError, match="negative dimension"):
        as_device_array(_Capsule(capsule))
    capsule, _, _ = exported()
    imported = as_device_array(_Capsule(capsule))
    assert (imported.shape, imported.strides, imported.ptr) == (dev.shape, dev.strides, dev.ptr)
    with pytest.raises(ArgumentError, match="already consumed"):
        as_device_array(_Capsule(capsule))
    np.testing.assert_array_equal(await imported.to_host(), np.arange(12, dtype=np.float32).reshape(3, 4))


@pytest.mark.parametrize(
    ("code", "bits", "name"),
    [
        (4, 16, "bfloat16"),
        (5, 32, "complex32"),
        (0, 4, "int4"),
        (0, 128, "int128"),
        (2, 8, "float8"),
        (6, 32, "bool32"),
    ],
)
async def test_a_dlpack_import_refuses_dtypes_numpy_lacks(
    backend: _driver.Driver, anyio_backend: object, code: int, bits: int, name: str
) -> None:
    """PyTorch's bfloat16 and complex32, sub-byte and 128-bit ints, float8: an
    ArgumentError naming the type, never numpy's TypeError or an array of another size
    (a 32-bit bool was read as 1-byte bools)."""
    from aiocuda.errors import ArgumentError

    dev = await ga.to_device(np.arange(12, dtype=np.float32))
    capsule = dev.__dlpack__(stream=-1)
    address = ctypes.pythonapi.PyCapsule_GetPointer(ctypes.py_object(capsule), b"dltensor")
    tensor = _dlpack._DLManagedTensor.from_address(address).dl_tensor
    tensor.dtype.code, tensor.dtype.bits = code, bits
    with pytest.raises(ArgumentError, match=rf"DLPack dtype {name} .*no numpy equivalent"):
        as_device_array(_Capsule(capsule))


@pytest.mark.parametrize("dtype", [np.longdouble, np.clongdouble, ">f4", "m8[s]", [("a", "<f4")]])
async def test_a_dlpack_export_refuses_dtypes_dlpack_lacks(
    backend: _driver.Driver, anyio_backend: object, dtype: Any
) -> None:
    """numpy's longdouble (x87's 80 bits, padded: was exported as an IEEE 128-bit float,
    and clongdouble's 256 bits as 0 bits), byte-swapped, time and record dtypes."""
    with pytest.raises(BufferError, match="no DLPack equivalent"):
        ga.empty(4, dtype).__dlpack__(stream=-1)


async def test_a_dlpack_export_refuses_strides_of_part_of_an_element(
    backend: _driver.Driver, anyio_backend: object
) -> None:
    """DLPack counts strides in elements: a stride of 6 bytes between float32 elements
    (an array made over a buffer, or imported from a record array's field) was exported
    as 1, and the consumer read other elements."""
    dev = await ga.to_device(np.arange(8, dtype=np.float32))
    odd = ga.DeviceArray((5,), np.float32, (6,), buffer=dev.buffer)
    with pytest.raises(BufferError, match=r"strides \(6,\) are not whole multiples of the item size \(4"):
        odd.__dlpack__(stream=-1)
    assert (await odd.copy()).__dlpack__(stream=-1) is not None


@pytest.mark.parametrize("dtype", ["?", "i1", "u2", "i4", "u8", "f2", "f4", "f8", "c8", "c16"])
async def test_dlpack_round_trips_every_dtype_it_exchanges(
    backend: _driver.Driver, anyio_backend: object, dtype: str
) -> None:
    host = np.arange(6).astype(dtype)
    dev = await ga.to_device(host)
    imported = as_device_array(_DLPackOnly(dev))
    assert imported.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(await imported.to_host(), host)


@pytest.mark.parametrize("wrapper", [_DLPackOnly, _CAIOnly])
async def test_zero_copy_import_round_trip(backend: _driver.Driver, anyio_backend: object, wrapper: type) -> None:
    host = np.arange(120, dtype=np.float64).reshape(10, 12)
    dev = await ga.to_device(host)
    view = dev[2:9, ::-5]
    with Stream(0) as consumer:
        foreign = wrapper(view)
        imported = as_device_array(foreign, stream=consumer)
        assert imported.ptr == view.ptr and imported.shape == view.shape and imported.strides == view.strides
        np.testing.assert_array_equal(await imported.to_host(stream=consumer), host[2:9, ::-5])
        if isinstance(foreign, _DLPackOnly):
            assert foreign.streams == [int(consumer)]
        del imported
        gc.collect()
        await consumer


@pytest.mark.parametrize("foreign", [False, True], ids=["pool-memory", "foreign-memory"])
async def test_memory_exported_by_dlpack_outlives_the_consumers_stream_work(
    backend: _driver.Driver, anyio_backend: object, foreign: bool
) -> None:
    """PyTorch calls a DLPack tensor's deleter when the host drops the tensor, while its
    stream may still have kernels reading it: the array's memory was freed in order on
    the array's own stream, so the next allocation there could reuse it (pool memory),
    or its owner let it go (foreign memory), under the consumer's reads."""
    n = 1 << 14
    original = np.arange(n, dtype=np.float32)
    with Stream(0) as ours, Stream(0) as consumer:
        x = await ga.to_device(original, stream=ours)
        exported = as_device_array(_CAIOnly(x), stream=ours) if foreign else x
        out = ga.empty(n, np.float32, stream=consumer)
        with Gate(consumer) as gate:  # the consumer's kernels are still to run
            capsule = exported.__dlpack__(stream=int(consumer))
            address = _dlpack._capi.PyCapsule_GetPointer(capsule, b"dltensor")
            managed = _dlpack._DLManagedTensor.from_address(address)
            _dlpack._capi.PyCapsule_SetName(capsule, b"used_dltensor")
            copy_device(out.ptr, managed.dl_tensor.data, 4 * n, consumer)  # the consumer reads it
            managed.deleter(ctypes.pointer(managed))  # ... and drops its tensor at once
            buffer = exported.buffer  # its free, or its owner's release, waits for the consumer:
            after = buffer._state[2:] if foreign else buffer._waits
            assert after and not after[-1].query()
            del x, exported, capsule, managed, buffer, after
            gc.collect()
            ours.hold(object())  # (lets go of what ours held whose work has run)
            reused = ga.empty(n, np.float32, stream=ours)
            ours.device._driver.memset_d32_async(reused.ptr, 0x7FC00000, n, ours.handle)
            gate.open()
            await ours
            np.testing.assert_array_equal(await out.to_host(stream=consumer), original)
        assert not gate.timed_out


async def test_a_foreign_owner_outlives_the_consumers_work_after_its_last_stream_closed(
    backend: _driver.Driver, anyio_backend: object
) -> None:
    """A foreign array's last-use stream closed before the array went, while a DLPack
    consumer's work on it was still to run: its owner's release must wait for that work
    (the closed stream takes no wait of its own, and the release went at once)."""
    n = 1 << 10
    with Stream(0) as ours, Stream(0) as consumer:
        x = await ga.to_device(np.arange(n, dtype=np.float32), stream=ours)
        owner = _CAIOnly(x)
        released = weakref.ref(owner)
        exported = as_device_array(owner, stream=ours)
        with Gate(consumer) as gate:  # the consumer's kernels are still to run
            capsule = exported.__dlpack__(stream=int(consumer))
            address = _dlpack._capi.PyCapsule_GetPointer(capsule, b"dltensor")
            managed = _dlpack._DLManagedTensor.from_address(address)
            _dlpack._capi.PyCapsule_SetName(capsule, b"used_dltensor")
            managed.deleter(ctypes.pointer(managed))  # the consumer drops its tensor at once
            ours.close()
            del x, owner, exported, capsule, managed
            gc.collect()
            assert released() is not None, "the owner went before the consumer's work"
            gate.open()
            await consumer
        assert not gate.timed_out


class _Interface:
    """An object whose ``__cuda_array_interface__`` is the dict given."""

    def __init__(self, interface: dict[str, Any]) -> None:
        self.__cuda_array_interface__ = interface


def _itself(array: ga.DeviceArray) -> ga.DeviceArray:
    return array


@pytest.mark.multi_gpu
@pytest.mark.parametrize("wrapper", [_DLPackOnly, _CAIOnly, _itself])
async def test_an_import_refuses_a_stream_of_another_device(
    backend: _driver.Driver, anyio_backend: object, wrapper: Callable[[ga.DeviceArray], Any]
) -> None:
    """A device-0 array given a device-1 stream was taken, its last use recorded on a
    stream of the other device (what the array's own calls refuse), and an aiocuda array
    was returned as it was, unchecked; a zero-size interface (null pointer) goes to the
    stream's device, not to device 0."""
    from aiocuda.errors import ArgumentError

    on0 = await ga.to_device(np.arange(8, dtype=np.float32), device=0)
    with Stream(1) as s1:
        with pytest.raises(ArgumentError, match="a stream of device 1 for an array of device 0"):
            as_device_array(wrapper(on0), stream=s1)
        empty = as_device_array(
            _Interface({"shape": (0,), "typestr": "<f4", "data": (0, False), "version": 3}), stream=s1
        )
        assert empty.device.ordinal == 1 and empty.buffer.stream is s1
        assert (await empty.to_host(stream=s1)).shape == (0,)


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        ({"mask": _Interface({"shape": (8,), "typestr": "|b1", "data": (8, False), "version": 3})}, "has a mask"),
        ({"stream": 0}, "0 is not allowed"),
        ({"stream": "1"}, "names the stream '1'"),
        ({"strides": (4, 4)}, r"2 strides \(4, 4\) for the 1 dimensions"),  # (was zip()'s ValueError)
    ],
)
async def test_a_cai_import_refuses_what_it_would_get_wrong(
    backend: _driver.Driver, anyio_backend: object, entry: dict[str, Any], match: str
) -> None:
    """A masked array (taken as if every element were valid) and a stream of 0, which
    the interface forbids as ambiguous (taken as no stream: nothing ordered)."""
    from aiocuda.errors import ArgumentError

    dev = await ga.to_device(np.arange(8, dtype=np.float32))
    interface = dict(dev.__cuda_array_interface__, **entry)
    with pytest.raises(ArgumentError, match=match):
        as_device_array(_Interface(interface))
    assert as_device_array(_Interface(dict(interface, mask=None, stream=1, strides=None))).ptr == dev.ptr


async def test_an_array_imported_read_only_refuses_writes_and_exports_read_only(
    backend: _driver.Driver, anyio_backend: object
) -> None:
    """The interface's read-only flag (``data[1]``) was dropped: copies and fills wrote
    into memory its owner exported read-only, and the array, its views and arrays over
    its buffer exported it as writable. It is still read, and a copy of it is writable."""
    from aiocuda.errors import ArgumentError

    host = np.arange(8, dtype=np.float32)
    dev = await ga.to_device(host)
    interface = dev.__cuda_array_interface__
    assert interface["data"] == (dev.ptr, False) and not dev.readonly
    imported = as_device_array(_Interface(dict(interface, data=(dev.ptr, True))))
    views = [imported, imported[1:], imported.reshape(2, 4), imported.view(np.int32)]
    views.append(ga.DeviceArray((4,), np.float32, buffer=imported.buffer, offset=16))
    assert all(view.readonly for view in views) and "readonly" in repr(imported)
    writes = [
        lambda target: target.fill(0),
        lambda target: target.copy_from(np.zeros(target.shape, target.dtype)),
        lambda target: target.copy_from(ga.empty(target.shape, target.dtype)),
        lambda target: ga.copy(target, ga.empty(target.shape, target.dtype)),
    ]
    for view in views:
        for write in writes:
            with pytest.raises(ArgumentError, match="read-only"):
                await write(view)
        assert view.__cuda_array_interface__["data"] == (view.ptr, True)
        with pytest.raises(BufferError, match="read-only"):
            view.__dlpack__(stream=-1)
    np.testing.assert_array_equal(await imported.to_host(), host)  # untouched, and readable
    writable = await imported.copy()
    assert not writable.readonly
    await writable.fill(1)
    await ga.copy(dev, imported)  # (a read-only source is fine)
    assert not as_device_array(_Interface(interface)).readonly


class _LegacyDLPack(_DLPackOnly):
    """A producer older than DLPack 1.0: its ``__dlpack__`` takes no ``max_version``."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.calls: list[dict[str, Any]] = []

    def __dlpack__(self, *, stream: Any = None) -> Any:  # type: ignore[override]
        self.calls.append({"stream": stream})
        return super().__dlpack__(stream=stream)


async def test_an_array_refusing_dlpack_as_read_only_is_imported_through_its_interface(
    backend: _driver.Driver, anyio_backend: object
) -> None:
    """A read-only array's legacy ``__dlpack__`` raises BufferError (numpy's rule, and
    aiocuda's own): the import, DLPack first, raised it instead of using the array
    interface, which says read-only, so an exporter with both could not be imported."""

    class _LegacyBoth(_LegacyDLPack):
        @property
        def __cuda_array_interface__(self) -> dict[str, Any]:
            return self.inner.__cuda_array_interface__  # type: ignore[no-any-return]

    host = np.arange(8, dtype=np.float32)
    dev = await ga.to_device(host)
    readonly = as_device_array(_Interface(dict(dev.__cuda_array_interface__, data=(dev.ptr, True))))
    imported = as_device_array(_LegacyBoth(readonly))
    assert imported.readonly and imported.ptr == dev.ptr
    np.testing.assert_array_equal(await imported.to_host(), host)
    assert not as_device_array(_LegacyBoth(dev)).readonly  # (through DLPack)
    with pytest.raises(BufferError, match="read-only"):
        as_device_array(_LegacyDLPack(readonly))  # (no interface to fall back to)


# -- DLPack 1.0: versioned capsules and the read-only flag --------------------------------------


def _versioned(capsule: Any) -> Any:
    """The ``DLManagedTensorVersioned`` of an unconsumed versioned capsule."""
    address = _dlpack._capi.PyCapsule_GetPointer(ctypes.py_object(capsule), b"dltensor_versioned")
    return _dlpack._DLManagedTensorVersioned.from_address(address)


def _capsule_name(capsule: Any) -> bytes:
    get_name = ctypes.pythonapi.PyCapsule_GetName
    get_name.restype, get_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
    return get_name(capsule)  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("max_version", "name"),
    [(None, b"dltensor"), ((0, 8), b"dltensor"), ((1, 0), b"dltensor_versioned"), ((1, 3), b"dltensor_versioned")],
)
async def test_dlpack_export_is_versioned_where_the_consumer_asks(
    backend: _driver.Driver, anyio_backend: object, max_version: Any, name: bytes
) -> None:
    """``max_version`` 1.0 or later gets a DLPack 1.0 ``DLManagedTensorVersioned``
    (never a newer version than asked), without it or below 1.0 a legacy capsule."""
    dev = await ga.to_device(np.arange(24, dtype=np.int16).reshape(4, 6))
    view = dev[:, 1::2]
    capsule = view.__dlpack__(stream=-1, max_version=max_version)
    assert _capsule_name(capsule) == name
    if name == b"dltensor_versioned":
        managed = _versioned(capsule)
        assert (managed.version.major, managed.version.minor) == (1, 0)
        assert managed.flags == 0 and not managed.manager_ctx
        tensor = managed.dl_tensor
        assert tensor.data == view.ptr and tensor.ndim == 2
        assert (tensor.device.device_type, tensor.device.device_id) == (DLPACK_CUDA, 0)
        assert list(_dlpack._int64s(2).from_address(tensor.shape)) == [4, 3]
        assert list(_dlpack._int64s(2).from_address(tensor.strides)) == [6, 2]
    imported = as_device_array(_Capsule(capsule))
    assert (imported.ptr, imported.shape, imported.strides, imported.readonly) == (
        view.ptr,
        view.shape,
        view.strides,
        False,
    )
    assert _capsule_name(capsule) == b"used_" + name
    np.testing.assert_array_equal(await imported.to_host(), await view.to_host())
    with pytest.raises(BufferError, match="copy=True"):
        view.__dlpack__(max_version=(1, 0), copy=True)
    assert view.__dlpack__(max_version=(1, 0), copy=False, dl_device=(DLPACK_CUDA, 0)) is not None
    with pytest.raises(BufferError, match="cannot export to DLPack device"):
        view.__dlpack__(max_version=(1, 0), dl_device=(1, 0))
    with pytest.raises(TypeError, match="max_version"):
        view.__dlpack__(max_version=1)  # type: ignore[arg-type]


async def test_a_read_only_array_exports_a_read_only_versioned_capsule(
    backend: _driver.Driver, anyio_backend: object
) -> None:
    """A read-only array's ``__dlpack__`` raised BufferError for every consumer, legacy
    capsules having no read-only flag: a consumer asking for a versioned capsule gets one
    flagged ``READ_ONLY``, and aiocuda's own import of it is read-only again; a legacy
    request is still refused."""
    from aiocuda.errors import ArgumentError

    host = np.arange(8, dtype=np.float32)
    dev = await ga.to_device(host)
    readonly = as_device_array(_Interface(dict(dev.__cuda_array_interface__, data=(dev.ptr, True))))
    with pytest.raises(BufferError, match="read-only"):
        readonly.__dlpack__(stream=-1)
    capsule = readonly.__dlpack__(stream=-1, max_version=(1, 0))
    assert _versioned(capsule).flags == 1  # DLPACK_FLAG_BITMASK_READ_ONLY, not IS_COPIED
    imported = as_device_array(_Capsule(capsule))
    assert imported.readonly and imported.ptr == dev.ptr
    with pytest.raises(ArgumentError, match="read-only"):
        await imported.fill(0)
    np.testing.assert_array_equal(await imported.to_host(), host)
    via_protocol = as_device_array(_DLPackOnly(readonly))  # (aiocuda asks for max_version=(1, 0))
    assert via_protocol.readonly and via_protocol.ptr == dev.ptr


async def test_a_dlpack_import_asks_for_versioned_capsules_and_falls_back_for_old_producers(
    backend: _driver.Driver, anyio_backend: object
) -> None:
    """The import passes ``max_version=(1, 0)`` and the stream; a producer whose
    ``__dlpack__`` takes no ``max_version`` (TypeError) is asked again without it."""
    dev = await ga.to_device(np.arange(6, dtype=np.float64))
    seen: list[dict[str, Any]] = []

    class _Recording(_DLPackOnly):
        def __dlpack__(self, **kwargs: Any) -> Any:
            seen.append(kwargs)
            return self.inner.__dlpack__(**kwargs)

    assert as_device_array(_Recording(dev)).ptr == dev.ptr
    assert seen[-1]["max_version"] == (1, 0) and "stream" in seen[-1]
    old = _LegacyDLPack(dev)
    imported = as_device_array(old)
    assert imported.ptr == dev.ptr and not imported.readonly
    assert len(old.calls) == 1  # (the call with max_version failed before reaching it)
    np.testing.assert_array_equal(await imported.to_host(), np.arange(6, dtype=np.float64))


class _ForeignTensor:
    """A producer's own ``DLManagedTensorVersioned`` over an aiocuda array's memory, with a
    deleter that counts its calls (what PyTorch or CuPy would hand over)."""

    def __init__(self, array: ga.DeviceArray, *, flags: int = 0, major: int = 1) -> None:
        self.array = array
        self.deleted: list[int] = []
        self.shape = (ctypes.c_int64 * 1)(array.size)
        self.managed = _dlpack._DLManagedTensorVersioned(
            _dlpack._DLPackVersion(major, 0),
            None,
            _dlpack._VERSIONED_DELETER(lambda managed: self.deleted.append(ctypes.addressof(managed.contents))),
            flags,
            _dlpack._DLTensor(
                array.ptr,
                _dlpack._DLDevice(DLPACK_CUDA, 0),
                1,
                _dlpack._DLDataType(2, 32, 1),
                ctypes.addressof(self.shape),
                None,
                0,
            ),
        )
        self.address = ctypes.addressof(self.managed)

    def capsule(self) -> Any:
        # (no destructor: the test drives the deleter's calls itself)
        return _dlpack._capi.PyCapsule_New(self.address, b"dltensor_versioned", None)


@pytest.mark.parametrize("flags", [0, 1, 2, 3], ids=["writable", "read-only", "copied", "read-only-copied"])
async def test_a_foreign_versioned_capsule_is_imported_with_its_flag_and_deleted_once(
    backend: _driver.Driver, anyio_backend: object, flags: int
) -> None:
    """A producer's versioned tensor: its READ_ONLY flag makes the import read-only
    (IS_COPIED changes nothing), the capsule is renamed consumed, and the producer's
    deleter runs once, when the import is gone."""
    dev = await ga.to_device(np.arange(5, dtype=np.float32))
    producer = _ForeignTensor(dev, flags=flags)
    capsule = producer.capsule()
    imported = as_device_array(_Capsule(capsule))
    assert imported.readonly == bool(flags & 1) and imported.ptr == dev.ptr and imported.shape == (5,)
    assert _capsule_name(capsule) == b"used_dltensor_versioned"
    np.testing.assert_array_equal(await imported.to_host(), np.arange(5, dtype=np.float32))
    assert producer.deleted == []
    view = imported[1:]
    del imported, capsule
    gc.collect()
    assert producer.deleted == []  # (a view still uses the memory)
    stream = view.stream
    del view
    gc.collect()
    await stream  # (the memory's last-use stream lets its owners go on its next await)
    assert producer.deleted == [producer.address]
    gc.collect()
    await stream
    assert producer.deleted == [producer.address]


async def test_a_versioned_capsule_of_another_major_version_is_refused_unconsumed(
    backend: _driver.Driver, anyio_backend: object
) -> None:
    """DLPack: a consumer must not read a tensor of another major version (its layout may
    differ); the capsule is left as it was, for its producer's destructor."""
    dev = await ga.to_device(np.arange(5, dtype=np.float32))
    producer = _ForeignTensor(dev, major=2)
    capsule = producer.capsule()
    with pytest.raises(BufferError, match=r"version 2\.0"):
        as_device_array(_Capsule(capsule))
    assert _capsule_name(capsule) == b"dltensor_versioned" and producer.deleted == []


@pytest.mark.parametrize("max_version", [None, (1, 0)], ids=["legacy", "versioned"])
async def test_an_exported_tensor_is_released_exactly_once(
    backend: _driver.Driver, anyio_backend: object, max_version: Any
) -> None:
    """Whoever owns an exported tensor ends it once: the capsule's destructor when it is
    dropped unconsumed, the deleter when a consumer took it (the destructor of the
    renamed capsule then leaves it alone); the array lives exactly as long."""
    dev = await ga.to_device(np.arange(4, dtype=np.float32))
    name = b"dltensor" if max_version is None else b"dltensor_versioned"

    def exported(array: ga.DeviceArray) -> list[int]:
        return [address for address, entry in _dlpack._exports.items() if entry[2] is array]

    # Dropped unconsumed: the destructor ends it.
    capsule = dev.__dlpack__(stream=-1, max_version=max_version)
    assert len(exported(dev)) == 1
    del capsule
    gc.collect()
    assert exported(dev) == []
    # Consumed: renamed, and the deleter (through the import's keeper) ends it.
    capsule = dev.__dlpack__(stream=-1, max_version=max_version)
    (address,) = exported(dev)
    imported = as_device_array(_Capsule(capsule))
    assert _capsule_name(capsule) == b"used_" + name
    stream = imported.stream
    del capsule
    gc.collect()
    assert exported(dev) == [address]  # (the renamed capsule's destructor left it to the consumer)
    del imported
    gc.collect()
    await stream
    assert exported(dev) == []
    # The array itself is kept by the export alone.
    tracked = weakref.ref(dev)
    capsule = dev.__dlpack__(stream=-1, max_version=max_version)
    del dev
    gc.collect()
    assert tracked() is not None
    del capsule
    gc.collect()
    assert tracked() is None


async def test_import_rejects_non_device_objects(backend: _driver.Driver, anyio_backend: object) -> None:
    with pytest.raises(TypeError):
        as_device_array(np.zeros(3))
    dev = ga.empty(4, np.float32)
    assert as_device_array(dev) is dev


# -- real libraries, on the GPU machine ---------------------------------------------------------

_have_cupy = importlib.util.find_spec("cupy") is not None
_have_torch = importlib.util.find_spec("torch") is not None


@pytest.mark.skipif(not _have_torch, reason="PyTorch not installed")
async def test_torch_round_trips(cuda_backend: _driver.Driver, anyio_backend: object) -> None:
    import torch

    host = np.random.default_rng(0).standard_normal((64, 33)).astype(np.float32)
    dev = await ga.to_device(host)
    via_dlpack = torch.from_dlpack(dev)
    assert via_dlpack.data_ptr() == dev.ptr
    np.testing.assert_array_equal(via_dlpack.cpu().numpy(), host)
    via_cai = torch.as_tensor(dev, device="cuda")
    np.testing.assert_array_equal(via_cai.cpu().numpy(), host)

    t = torch.arange(1000, device="cuda", dtype=torch.float64).reshape(40, 25)[:, ::2]
    imported = as_device_array(t)
    assert imported.ptr == t.data_ptr()
    np.testing.assert_array_equal(await imported.to_host(), t.cpu().numpy())
    imported2 = as_device_array(_CAIOnly(t))
    np.testing.assert_array_equal(await imported2.to_host(), t.cpu().numpy())
    contiguous = as_device_array(torch.zeros(100, device="cuda", dtype=torch.int32))
    await contiguous.fill(7)
    torch.cuda.synchronize()
    assert int(torch.from_dlpack(contiguous).sum()) == 700


@pytest.mark.skipif(not _have_torch, reason="PyTorch not installed")
async def test_torch_reads_a_read_only_array_and_exports_versioned_capsules(
    cuda_backend: _driver.Driver, anyio_backend: object
) -> None:
    """PyTorch (2.11) asks for versioned capsules: a read-only aiocuda array, which a
    legacy capsule cannot carry, reaches ``torch.from_dlpack``; and aiocuda's import of a
    PyTorch tensor gets a versioned capsule (no fallback call), writable."""
    import torch

    host = np.arange(64, dtype=np.float32)
    dev = await ga.to_device(host)
    readonly = as_device_array(_Interface(dict(dev.__cuda_array_interface__, data=(dev.ptr, True))))
    assert readonly.readonly
    tensor = torch.from_dlpack(readonly)
    assert tensor.data_ptr() == dev.ptr
    np.testing.assert_array_equal(tensor.cpu().numpy(), host)

    source = torch.arange(12, device="cuda", dtype=torch.float32).reshape(3, 4)
    calls: list[dict[str, Any]] = []

    class _Recording(_DLPackOnly):
        def __dlpack__(self, **kwargs: Any) -> Any:
            calls.append(kwargs)
            return self.inner.__dlpack__(**kwargs)

    imported = as_device_array(_Recording(source))
    assert [call.get("max_version") for call in calls] == [(1, 0)]  # accepted: no legacy retry
    assert imported.ptr == source.data_ptr() and not imported.readonly
    np.testing.assert_array_equal(await imported.to_host(), source.cpu().numpy())


class _Consumer:
    """A library that reads aiocuda arrays by DLPack on a stream of its own: PyTorch or CuPy."""

    def __init__(self, name: str) -> None:
        self.lib = pytest.importorskip(name)
        self.torch = name == "torch"
        self.side = self.lib.cuda.Stream() if self.torch else self.lib.cuda.Stream(non_blocking=True)

    def current(self) -> Any:
        """Make ``side`` the library's current stream (a context manager)."""
        return self.lib.cuda.stream(self.side) if self.torch else self.side

    def doubled(self, array: Any) -> Any:
        return self.lib.from_dlpack(array) * 2

    def to_host(self, array: Any) -> np.ndarray:
        self.side.synchronize()
        return array.cpu().numpy() if self.torch else self.lib.asnumpy(array)  # type: ignore[no-any-return]


@pytest.mark.parametrize("library", ["torch", "cupy"])
async def test_a_library_reads_an_array_it_dropped_before_its_stream_ran(
    cuda_backend: _driver.Driver, anyio_backend: object, library: str
) -> None:
    """A tensor from ``from_dlpack``, dropped at once with its kernels still queued on the
    library's stream: the array's memory, dropped too and reallocated on its own stream,
    is not overwritten before those kernels read it."""
    consumer = _Consumer(library)
    n = 1 << 20
    original = np.arange(n, dtype=np.float32)
    # (The libraries load a kernel's module on its first launch, which waits for the
    # device's running kernels -- here the gate: each kernel is launched once before it.)
    with consumer.current():
        consumer.to_host(consumer.doubled(await ga.to_device(original)))
    with Stream(0) as ours, Gate(Stream.wrap(consumer.side)) as gate, consumer.current():
        x = await ga.to_device(original, stream=ours)
        doubled = consumer.doubled(x)  # ordered on the library's stream, behind the gate
        del x
        gc.collect()
        reused = ga.empty(n, np.float32, stream=ours)
        ours.device._driver.memset_d32_async(reused.ptr, 0x7FC00000, n, ours.handle)
        gate.open()
        await ours
        np.testing.assert_array_equal(consumer.to_host(doubled), 2 * original)
    assert not gate.timed_out


_KEPT_TO_EXIT = """
import numpy as np, torch
from aiocuda._memory.interop import as_device_array
KEPT = [as_device_array(torch.ones(256, device="cuda")) for _ in range(64)]
KEPT.append(torch.from_dlpack(KEPT[0]))
print("ok", float(KEPT[-1].sum()))
"""


@pytest.mark.skipif(not _have_torch, reason="PyTorch not installed")
def test_torch_arrays_kept_until_exit_let_the_process_end_cleanly(cuda_backend: _driver.Driver) -> None:
    """Imported PyTorch tensors still alive when the interpreter exits: their deleters
    run before PyTorch is torn down (a deleter called during the teardown crashed the
    process, exit code 139)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _KEPT_TO_EXIT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok 256.0" and "Exception ignored" not in done.stderr


_RELEASED_AT_EXIT = """
import numpy as np
import aiocuda
from aiocuda import _driver
from aiocuda._memory.interop import as_device_array
from aiocuda._util import exiting

base = aiocuda.empty(16, np.float32)


class Producer:
    def __init__(self):
        self.__cuda_array_interface__ = {
            "shape": (16,), "typestr": "<f4", "data": (base.ptr, False), "version": 3, "stream": None
        }

    def __del__(self):
        print("owner released", flush=True)


stream = aiocuda.Stream(0)
KEPT = as_device_array(Producer(), stream=stream)
KEPT.fill(1.0, stream=stream)
stream.close()  # (its release waits for the closed stream's end event, made after it)
driver = _driver.driver()
for name in ("stream_wait_event", "event_record"):
    def spy(*args, _call=getattr(driver, name), _name=name):
        if exiting():
            print("driver call at exit:", _name, flush=True)
        return _call(*args)
    setattr(driver, name, spy)
print("ok", flush=True)
"""


def test_an_imported_array_kept_until_exit_is_let_go_without_driver_calls(sim_backend: Any) -> None:
    """An imported array alive at exit lets its owner go at once: the finalisers that
    ran before its own at exit may have destroyed the events a release would wait for
    (on the GPU, waiting for a closed stream's destroyed end event crashed the process
    at exit, code 139)."""
    import subprocess
    import sys

    env = dict(os.environ, AIOCUDA_BACKEND="sim")
    done = subprocess.run(
        [sys.executable, "-c", _RELEASED_AT_EXIT], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["ok", "owner", "released"], (done.stdout, done.stderr[-2000:])
    assert "Exception ignored" not in done.stderr, done.stderr[-2000:]


@pytest.mark.skipif(not _have_cupy, reason="CuPy not installed")
async def test_cupy_round_trips(cuda_backend: _driver.Driver, anyio_backend: object) -> None:
    import cupy

    host = np.arange(3000, dtype=np.int32).reshape(60, 50)
    dev = await ga.to_device(host)
    via_cai = cupy.asarray(dev)
    assert via_cai.data.ptr == dev.ptr
    np.testing.assert_array_equal(cupy.asnumpy(via_cai), host)
    via_dlpack = cupy.from_dlpack(dev)
    np.testing.assert_array_equal(cupy.asnumpy(via_dlpack), host)
    strided = cupy.arange(500, dtype=cupy.float32).reshape(20, 25)[::3, 1::4]
    imported = as_device_array(strided)
    np.testing.assert_array_equal(await imported.to_host(), cupy.asnumpy(strided))


_have_numba = importlib.util.find_spec("numba") is not None and importlib.util.find_spec("numba.cuda") is not None
_CONSUMERS = {"torch": _have_torch, "cupy": _have_cupy, "numba": _have_numba}


def _read_through_cai(consumer: str, array: ga.DeviceArray) -> np.ndarray:
    """``array``'s data as ``consumer`` sees it through ``__cuda_array_interface__``."""
    if consumer == "torch":
        import torch

        return torch.as_tensor(array, device="cuda").cpu().numpy()  # type: ignore[no-any-return]
    if consumer == "cupy":
        import cupy

        return cupy.asnumpy(cupy.asarray(array))  # type: ignore[no-any-return]
    from numba import cuda

    return cuda.as_cuda_array(array).copy_to_host()  # type: ignore[no-any-return]


@pytest.mark.parametrize("consumer", sorted(_CONSUMERS))
def test_cai_consumers_read_data_whose_write_was_pending(cuda_backend: _driver.Driver, consumer: str) -> None:
    """A consumer reading through the array interface right after aiocuda enqueued a
    write (behind 0.3 s of other work) sees the write: PyTorch ignores the interface's
    stream and read the old zeros when the export named the producer's stream."""
    if not _CONSUMERS[consumer]:
        pytest.skip(f"{consumer} not installed")
    with Stream(0) as s:
        array = ga.empty(1 << 20, np.uint32, stream=s)
        s.device._driver.memset_d32_async(array.ptr, 0, array.size, s.handle)
        s.synchronize()
        _pending_write(array, s, 0x01010101)
        assert (_read_through_cai(consumer, array) == 0x01010101).all()


@pytest.mark.parametrize("consumer", sorted(_CONSUMERS))
async def test_cai_consumers_on_an_event_loop(
    cuda_backend: _driver.Driver, anyio_backend: object, consumer: str
) -> None:
    """The same on an event loop's thread: the data is right, and the wait is reported;
    after an await there is nothing to wait for and nothing to report."""
    if not _CONSUMERS[consumer]:
        pytest.skip(f"{consumer} not installed")
    with Stream(0) as s:
        array = await ga.zeros(1 << 20, np.uint32, stream=s)
        _pending_write(array, s, 0x01010101)
        with pytest.warns(RuntimeWarning, match="blocked the event loop"):
            assert (_read_through_cai(consumer, array) == 0x01010101).all()
        await array.fill(0x02020202, stream=s)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="__cuda_array_interface__ blocked")
            assert (_read_through_cai(consumer, array) == 0x02020202).all()


@pytest.mark.skipif(not _have_numba, reason="numba-cuda not installed")
async def test_numba_round_trips(cuda_backend: _driver.Driver, anyio_backend: object) -> None:
    """Numba reads an aiocuda array through ``__cuda_array_interface__`` and aiocuda
    imports a Numba device array the same way, views included."""
    from numba import cuda as numba_cuda

    host = np.arange(2000, dtype=np.float32).reshape(40, 50)
    dev = await ga.to_device(host)
    seen = numba_cuda.as_cuda_array(dev)
    assert seen.device_ctypes_pointer.value == dev.ptr and seen.shape == host.shape
    np.testing.assert_array_equal(seen.copy_to_host(), host)

    theirs = numba_cuda.to_device(np.arange(600, dtype=np.int64).reshape(20, 30))
    numba_cuda.synchronize()
    imported = as_device_array(theirs)
    assert imported.ptr == theirs.device_ctypes_pointer.value
    np.testing.assert_array_equal(await imported.to_host(), theirs.copy_to_host())
    view = as_device_array(theirs[::2, 3:])
    np.testing.assert_array_equal(await view.to_host(), theirs.copy_to_host()[::2, 3:])
