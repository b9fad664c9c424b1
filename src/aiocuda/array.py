"""``DeviceArray``: an n-dimensional view of device memory, and awaitable copies.

A :class:`DeviceArray` is ``shape``, ``dtype``, byte ``strides`` and an ``offset`` into a
buffer (a :class:`~aiocuda.memory.DeviceBuffer`, or foreign memory imported from CuPy,
PyTorch or Numba). Indexing with integers, slices, ``...`` and ``None`` makes views
without copying; they share (and keep alive) the buffer.

Every operation enqueues on a stream (default: the current stream of the array's device)
and is awaited until *its own* work is done -- or, on a stream being captured into a
graph (:mod:`aiocuda.graph`), until it is recorded (:meth:`DeviceArray.to_host` then
needs a page-locked ``out``, which each replay fills). Cancelling the awaiting task abandons the
wait only: the GPU finishes the copy, the memory it touches stays alive until then
(device memory is freed stream-ordered, host arrays are held by the stream), and the data
is never torn. One exception: a copy of more than 1 MiB of pageable (not page-locked)
host memory goes through copier threads, and a cancelled await of it returns only once
their share is done, which waits for the stream's earlier work; use page-locked arrays
(:func:`~aiocuda.host.pinned_empty`) where large copies must cancel at once. Work on one
array from different streams is ordered automatically: the
new stream waits for the array's previous stream on the GPU.

```python
x = await aiocuda.to_device(np.arange(1 << 20, dtype=np.float32), stream=stream)
kernel.launch(grid, block, x, stream=stream)
result = await x.to_host()
```

Other libraries take a DeviceArray without copying: through DLPack
(``torch.from_dlpack(x)``, ``cupy.from_dlpack(x)``), which orders the consumer's stream
after the array's work on the GPU, or through ``__cuda_array_interface__``
(``torch.as_tensor(x, device="cuda")``, ``cupy.asarray(x)``, ``numba.cuda.as_cuda_array(x)``),
which first waits for the array's pending work: await the array's stream before handing
it over from an event loop. ``np.asarray(x)`` raises ``TypeError``: use ``to_host()``;
so does ``bool(x)``, which would have to read the elements: test ``x is not None`` or
``x.size``.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Awaitable, Iterator
from typing import Any, NoReturn

import numpy as np
import numpy.typing as npt

from . import memory as _memory
from ._memory import copies as _copies
from ._memory import staging as _staging
from ._util import byte_span, c_strides, invalid_value, shape_tuple
from .device import Device, _as_device
from .memory import MemoryPool, _pool_for
from .stream import Stream, _check_stream, _stream_for_new, current_stream

__all__ = ["PITCH_ALIGNMENT", "DeviceArray", "copy", "empty", "empty_pitched", "to_device", "zeros"]

PITCH_ALIGNMENT = 256
"""Default row alignment of :func:`empty_pitched`, in bytes: the alignment of every
device allocation, so each row starts as aligned as the array does."""

_Shape = tuple[int, ...]


def _check_dtype(dtype: npt.DTypeLike) -> np.dtype[Any]:
    """``dtype`` as a numpy dtype that device arrays can have: ArgumentError for one
    holding Python objects, one of no bytes (``str``, ``bytes``, ``"V0"``) and a
    subarray dtype (``(np.float32, (3,))``)."""
    dt = np.dtype(dtype)
    if dt.hasobject:
        raise invalid_value(f"dtype {dt} holds Python objects and cannot live in device memory")
    # numpy makes arrays of the next two with another dtype (an unsized string dtype
    # becomes one of size 1; a subarray dtype becomes its base, the subarray's shape
    # appended), so the host side of every copy would differ from the device array:
    # to_host() copied 16 bytes of a '<U1' out of a '<U0' array's empty memory.
    if dt.itemsize == 0:
        raise invalid_value(f"dtype {dt} has elements of no bytes: give it a size (e.g. 'U8', 'S8', 'V8')")
    if dt.subdtype is not None:
        base, sub = dt.subdtype
        raise invalid_value(
            f"dtype {dt} is a subarray dtype, which numpy arrays do not keep: use dtype {base} and append "
            f"{sub} to the shape"
        )
    return dt


# np.dtype() takes 0.15 to 0.25 us even for a dtype it has seen (the development
# machine): a new array's dtype is checked once and kept here with its item size, keyed
# by what named it: a string, a scalar type (np.float32, float), or the identity of a
# dtype object (equal dtypes may differ in metadata, which np.dtype keeps; the value
# holds the object, so its id stays its own). Other types (whose ``dtype`` attribute
# np.dtype reads) are not kept. Bounded against a program that makes up dtypes.
_known_dtypes: dict[type | str | int, tuple[np.dtype[Any], int]] = {}
_KNOWN_DTYPES_LIMIT = 256


def _dtype_key(dtype: npt.DTypeLike) -> type | str | int:
    kind = type(dtype)
    return dtype if kind is type or kind is str else id(dtype)  # type: ignore[return-value]


def _dtype_and_itemsize(dtype: npt.DTypeLike) -> tuple[np.dtype[Any], int]:
    """``_check_dtype(dtype)`` and its item size."""
    known = _known_dtypes.get(_dtype_key(dtype))
    return known if known is not None else _learn_dtype(dtype)


def _learn_dtype(dtype: npt.DTypeLike) -> tuple[np.dtype[Any], int]:
    """:func:`_dtype_and_itemsize` of a dtype not known yet."""
    dt = _check_dtype(dtype)
    known = (dt, dt.itemsize)
    kind = type(dtype)
    lasting = kind is str or dt is dtype or (kind is type and _is_scalar_type(dtype))
    if lasting and len(_known_dtypes) < _KNOWN_DTYPES_LIMIT:
        _known_dtypes[_dtype_key(dtype)] = known
    return known


def _is_scalar_type(dtype: Any) -> bool:
    return issubclass(dtype, np.generic) or dtype in (bool, int, float, complex)


class DeviceArray:
    """An n-dimensional array in device memory (see the module docstring).

    Create with :func:`to_device`, :func:`empty`, :func:`zeros`, or over an existing
    buffer with ``DeviceArray(shape, dtype, buffer=buf)`` (``strides`` and ``offset``,
    both ints in bytes, place it in the buffer).
    """

    __slots__ = ("__weakref__", "buffer", "dtype", "offset", "shape", "strides")

    def __init__(
        self,
        shape: int | _Shape,
        dtype: npt.DTypeLike,
        strides: _Shape | None = None,
        *,
        buffer: Any,
        offset: int = 0,
    ) -> None:
        self.shape = shape_tuple(shape)
        self.dtype = _check_dtype(dtype)
        # A float offset or stride made a float address, which the simulator's copy
        # rejected only when it ran: the device's context was poisoned. One sum tells
        # whether all are ints (a float or a numpy integer among them makes it another
        # type): views come through here, and converting each costs 0.5 us, this 0.08.
        try:
            self.strides = c_strides(self.shape, self.dtype.itemsize) if strides is None else tuple(strides)
            if type(sum(self.strides, offset)) is not int:
                self.strides = tuple(map(operator.index, self.strides))
                offset = operator.index(offset)
        except TypeError:
            raise TypeError(
                f"strides must be a tuple of ints and offset an int, not {strides!r} and {offset!r}"
            ) from None
        if len(self.strides) != len(self.shape):
            raise invalid_value(f"strides {self.strides} do not match shape {self.shape}")
        self.buffer = buffer
        self.offset = offset
        lo, hi = byte_span(self.shape, self.strides, self.dtype.itemsize)
        if hi > lo and (offset + lo < 0 or offset + hi > buffer.size):
            raise invalid_value(
                f"an array of shape {self.shape} and strides {self.strides} at offset {offset} does not fit "
                f"in a buffer of {buffer.size} bytes"
            )

    # -- description ---------------------------------------------------------------------------
    @property
    def ptr(self) -> int:
        """Device address of the first element (ArgumentError if the buffer was freed)."""
        return int(self.buffer.ptr) + self.offset

    @property
    def device(self) -> Device:
        device: Device = self.buffer.device
        return device

    @property
    def stream(self) -> Stream:
        """The stream of the last operation on the array's memory."""
        stream: Stream = self.buffer.stream
        return stream

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def is_c_contiguous(self) -> bool:
        if self.strides == c_strides(self.shape, self.dtype.itemsize):  # the usual answer, at 40 % of the cost
            return True
        return self.size == 0 or all(
            s == c
            for s, c, d in zip(self.strides, c_strides(self.shape, self.itemsize), self.shape, strict=True)
            if d != 1
        )

    @property
    def readonly(self) -> bool:
        """Whether the memory may only be read: an array imported from another library
        that exported it read-only (``__cuda_array_interface__``'s ``data`` flag, or a
        versioned DLPack capsule's ``READ_ONLY`` flag), and its views. It exports that
        flag through both; a legacy DLPack capsule, which cannot, is refused. Copies
        into it and :meth:`fill` raise ArgumentError; a kernel is still given its address
        (aiocuda cannot tell which parameters a kernel writes).
        ``await array.copy()`` makes a writable copy."""
        # (buffers are duck-typed -- pool buffers, imported memory, managed memory --
        # and only an import's read-only buffer says so; the flag is the memory's, so
        # every view and DeviceArray(..., buffer=) over it shares it)
        return getattr(self.buffer, "readonly", False) is True

    def __bool__(self) -> NoReturn:
        """Refuses, as for any array: its elements are in device memory, and reading
        one waits for the GPU (numpy raises for arrays of more than one element)."""
        # CuPy and PyTorch copy a one-element array to the host here, blocking the
        # thread until the GPU gets there: on an event loop that stalls every task.
        # Without this, Python took len() as the truth value (an empty array false, a
        # 0-d one raising len()'s TypeError), so `if out:` looked like a None check
        # and silently took an empty array for a missing one.
        raise TypeError(
            "the truth value of a DeviceArray is not defined (its elements are in device memory): test "
            "`array is not None`, `array.size` for emptiness, or copy the values first "
            "(`(await array.to_host()).any()`)"
        )

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d DeviceArray")
        return self.shape[0]

    def __iter__(self) -> Iterator[DeviceArray]:
        """The views ``array[0]``, ``array[1]``, ... along the first axis; TypeError for
        a 0-d array, as numpy raises."""
        # (without it Python iterates through __getitem__ until an IndexError, which a
        # 0-d array raises at once: it iterated as empty)
        if not self.shape:
            raise TypeError("iteration over a 0-d DeviceArray")
        return (self[i] for i in range(self.shape[0]))

    def __repr__(self) -> str:
        layout = "" if self.is_c_contiguous else f" strides={self.strides}"
        access = " readonly" if self.readonly else ""
        return (
            f"<{type(self).__name__} shape={self.shape} dtype={self.dtype}{layout} device={self.device.ordinal}"
            f"{access}>"
        )

    # -- views -----------------------------------------------------------------------------------
    def __getitem__(self, key: Any) -> DeviceArray:
        """Basic indexing (ints, slices, ``...``, ``None``) as a view, without copying."""
        keys = key if isinstance(key, tuple) else (key,)
        if any(k is Ellipsis for k in keys):
            at = next(i for i, k in enumerate(keys) if k is Ellipsis)
            consumed = sum(1 for k in keys if k is not None and k is not Ellipsis)
            keys = keys[:at] + (slice(None),) * (self.ndim - consumed) + keys[at + 1 :]
        if sum(1 for k in keys if k is not None) > self.ndim:
            raise IndexError(f"too many indices for an array of {self.ndim} dimension(s)")
        shape: list[int] = []
        strides: list[int] = []
        offset = self.offset
        dim = 0
        for k in keys:
            if k is None:
                shape.append(1)
                strides.append(0)
                continue
            n, stride = self.shape[dim], self.strides[dim]
            dim += 1
            if isinstance(k, slice):
                start, stop, step = k.indices(n)
                length = len(range(start, stop, step))
                offset += start * stride if length else 0
                shape.append(length)
                strides.append(stride * step)
                continue
            try:
                if isinstance(k, bool):  # (an int to Python, a mask to numpy: refused as np.bool_ is)
                    raise TypeError
                i = operator.index(k)
            except TypeError:
                raise TypeError(f"DeviceArray supports basic indexing only, not {type(k).__name__}") from None
            if not -n <= i < n:
                raise IndexError(f"index {i} is out of bounds for axis {dim - 1} with size {n}")
            offset += (i % n) * stride
        shape.extend(self.shape[dim:])
        strides.extend(self.strides[dim:])
        return type(self)(tuple(shape), self.dtype, tuple(strides), buffer=self.buffer, offset=offset)

    def reshape(self, *shape: int | _Shape) -> DeviceArray:
        """A view with a new shape (one dimension may be -1); C-contiguous arrays only."""
        first = shape[0] if len(shape) == 1 else None
        given: tuple[Any, ...] = first if isinstance(first, tuple) else shape
        try:
            dims = [operator.index(d) for d in given]
        except TypeError:  # (operator.index's own message did not say that a shape was meant)
            raise TypeError(f"reshape takes ints or a tuple of ints, not {shape!r}") from None
        if not self.is_c_contiguous:
            raise invalid_value("only a C-contiguous DeviceArray can be reshaped without a copy")
        if dims.count(-1) > 1:
            raise invalid_value("only one dimension can be -1")
        known = math.prod([d for d in dims if d != -1])
        if -1 in dims:
            if known == 0 or self.size % known:
                raise invalid_value(f"cannot reshape an array of size {self.size} into {tuple(dims)}")
            dims[dims.index(-1)] = self.size // known
        if math.prod(dims) != self.size:
            raise invalid_value(f"cannot reshape an array of size {self.size} into {tuple(dims)}")
        return type(self)(tuple(dims), self.dtype, buffer=self.buffer, offset=self.offset)

    def view(self, dtype: npt.DTypeLike) -> DeviceArray:
        """The same memory seen as another dtype of the same item size."""
        dt = _check_dtype(dtype)
        if dt.itemsize != self.itemsize:
            raise invalid_value(f"view needs a dtype of the same item size ({self.itemsize}), not {dt}")
        return type(self)(self.shape, dt, self.strides, buffer=self.buffer, offset=self.offset)

    # -- stream bookkeeping ---------------------------------------------------------------------
    def _stream_for(self, stream: Stream | None, *, any_device: bool = False) -> Stream:
        """The stream to enqueue on, ordered after the array's previous work: of the
        array's device unless ``any_device`` (a stream of another device would leave the
        memory's free unordered after the work: a caller that allows one orders the free
        after its work with :func:`_leave`, as :func:`copy` does)."""
        if any_device:
            if stream is not None:
                _check_stream(stream)
            chosen = stream if stream is not None else current_stream(self.device)
        else:
            chosen = _stream_on(self.device, stream)
        _enter(self.buffer, chosen)
        return chosen

    # -- transfers -------------------------------------------------------------------------------
    def _layout(self) -> _copies.Strided:
        return _copies.Strided(self.ptr, self.strides, self.device)

    def _forward(self) -> tuple[DeviceArray, tuple[slice, ...] | None]:
        """This view walked forwards along every axis, and the index that turns an array
        of the forward view's order back into this one's (None: nothing was reversed).
        DMA copies cannot reverse; numpy on the host can, for free."""
        if all(stride >= 0 for stride in self.strides):
            return self, None
        back = tuple(slice(None, None, -1) if stride < 0 else slice(None) for stride in self.strides)
        return self[back], back

    async def to_host(self, out: npt.NDArray[Any] | None = None, *, stream: Stream | None = None) -> npt.NDArray[Any]:
        """Copy to host memory and return the numpy array (``out`` if given).

        ``out`` must have the same shape and dtype and be writeable; any layout works.
        Pinned ``out`` arrays are written by DMA directly. A non-contiguous view is
        copied by 2D/3D copies, so only its own elements cross to the host (a view of
        narrow rows in a span little larger than itself, such as one channel of an
        image, copies its whole span instead, which is faster there).
        """
        if out is not None:
            if not isinstance(out, np.ndarray):
                raise TypeError(f"out must be a numpy array, not {type(out).__name__}")
            if out.shape != self.shape or out.dtype != self.dtype:
                raise invalid_value(
                    f"out has shape {out.shape} and dtype {out.dtype}; expected {self.shape} and {self.dtype}"
                )
            if not out.flags.writeable:
                raise invalid_value("out is read-only")
        if stream is not None:
            _check_stream(stream)
        chosen = stream if stream is not None else current_stream(self.device)
        if chosen._capture is not None and (out is None or not (out.flags.c_contiguous and self.is_c_contiguous)):
            raise chosen._capture.refuse(
                "to_host() without a page-locked, C-contiguous out= array",
                "a replay can only copy into host memory given to it (aiocuda.pinned_empty)",
            )
        s = self._stream_for(chosen)
        if out is not None and _copies.download(out, self.ptr, s, strides=self.strides):
            await _finished(s)
            return out
        forward, back = self._forward()
        direct = out is not None and back is None and out.flags.c_contiguous
        target = out if direct else np.empty(self.shape, self.dtype)
        assert target is not None
        await forward._download(target, s)
        result = target if back is None else target[back]
        if out is not None:
            if result is not out:
                np.copyto(out, result)
            return out
        return result if back is None else np.ascontiguousarray(result)

    async def _download(self, host: npt.NDArray[Any], stream: Stream) -> None:
        """Copy this view, walked forwards on every axis, into C-contiguous ``host``."""
        if self.is_c_contiguous:
            await _staging.device_to_host(host, self.ptr, stream)
        elif _copies.gathers_span(self.shape, self.strides, self.itemsize):
            lo, hi = byte_span(self.shape, self.strides, self.itemsize)
            span = np.empty(hi - lo, np.uint8)
            await _staging.device_to_host(span, self.ptr + lo, stream)
            np.copyto(host, np.ndarray(self.shape, self.dtype, buffer=span, offset=-lo, strides=self.strides))
        else:
            packed = empty(self.shape, self.dtype, stream=stream)
            try:
                _copies.copy_strided(packed._layout(), self._layout(), self.shape, self.itemsize, stream)
                await _staging.device_to_host(host, packed.ptr, stream)
            finally:
                packed.buffer.free()  # stream-ordered: after the download enqueued above

    async def copy_from(self, source: DeviceArray | npt.NDArray[Any], *, stream: Stream | None = None) -> None:
        """Overwrite this array with ``source`` (a DeviceArray on any device, or a numpy
        array); shapes and dtypes must match, layouts may differ (a non-contiguous side
        is copied with 2D/3D copies). ArgumentError if this array is :attr:`readonly`."""
        _check_writable(self, "the array copied into")
        if isinstance(source, DeviceArray):
            await copy(self, source, stream=stream)
            return
        host = np.asarray(source)
        if host.shape != self.shape or host.dtype != self.dtype:
            raise invalid_value(
                f"source has shape {host.shape} and dtype {host.dtype}; expected {self.shape} and {self.dtype}"
            )
        s = self._stream_for(stream)
        if self.is_c_contiguous:
            await _upload(self.ptr, np.ascontiguousarray(host), s)
        elif _copies.upload(self.ptr, host, s, strides=self.strides):
            await _finished(s)
        else:
            forward, back = self._forward()
            await forward._scatter(np.ascontiguousarray(host if back is None else host[back]), s)

    async def _scatter(self, host: npt.NDArray[Any], stream: Stream) -> None:
        """Write C-contiguous ``host`` into this view (walked forwards on every axis):
        uploaded into a contiguous scratch array, then copied into place on the device."""
        packed = empty(self.shape, self.dtype, stream=stream)
        try:
            await _staging.host_to_device(packed.ptr, host, stream)
            _copies.copy_strided(self._layout(), packed._layout(), self.shape, self.itemsize, stream)
        finally:
            packed.buffer.free()  # stream-ordered: after the copies enqueued above
        await _finished(stream)

    async def copy(self, *, device: Device | int | None = None, stream: Stream | None = None) -> DeviceArray:
        """A new C-contiguous copy, on ``device`` (default: this array's device)."""
        target_device = self.device if device is None else _as_device(device)
        # The target device is given (this array's, or device=): inside use_stream() of
        # another device this is a copy to that device, not a contradiction, so the new
        # array is allocated on the target device's own stream, as copy() uses it.
        dst = empty(self.shape, self.dtype, stream=current_stream(target_device))
        return await _filled(dst, copy(dst, self, stream=stream))

    async def fill(self, value: Any, *, stream: Stream | None = None) -> None:
        """Set every element to ``value``, with memsets where the value's bytes repeat a
        1, 2 or 4-byte word (2D memsets for a non-contiguous view). ArgumentError if
        the array is :attr:`readonly`."""
        _check_writable(self, "the array filled")
        if self.size == 0:
            return
        pattern = np.array(value, dtype=self.dtype)
        s = self._stream_for(stream)
        forward, _ = self._forward()
        if _copies.fill(forward._layout(), self.shape, self.itemsize, pattern.tobytes(), s):
            await _finished(s)
        elif self.is_c_contiguous:
            await _upload(self.ptr, np.full(self.shape, pattern, self.dtype), s)
        else:
            await forward._scatter(np.full(self.shape, pattern, self.dtype), s)

    # -- interoperability ------------------------------------------------------------------------
    def __array__(self, dtype: Any = None, copy: bool | None = None) -> NoReturn:
        """Refuses: the data is in device memory, and copying it to the host waits for
        the GPU. ``await array.to_host()`` does that without blocking."""
        raise TypeError(
            "a DeviceArray lives in device memory and is not converted to a numpy array implicitly "
            "(np.asarray, np.array): copy it with `await array.to_host()`"
        )

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """The CUDA Array Interface (version 3), with the array's pending work finished
        first (``"stream": None``): a wait, which warns on an event loop's thread, unless
        the array's stream is idle."""
        from ._memory.interop import cuda_array_interface

        return cuda_array_interface(self)

    def __dlpack__(
        self,
        *,
        stream: int | None = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any:
        """A DLPack capsule of the array (no copy), ordered before the work on the
        consumer's ``stream``: ``"dltensor_versioned"`` (DLPack 1.0, marked read-only for
        a :attr:`readonly` array) where ``max_version`` is 1.0 or later, else a legacy
        ``"dltensor"``, which a read-only array refuses (``BufferError``). ``copy=True``,
        and a ``dl_device`` other than the array's, raise ``BufferError``."""
        from ._memory.dlpack import to_dlpack

        return to_dlpack(self, stream=stream, max_version=max_version, dl_device=dl_device, copy=copy)

    def __dlpack_device__(self) -> tuple[int, int]:
        from ._memory.dlpack import DLPACK_CUDA

        return (DLPACK_CUDA, self.device.ordinal)


def _check_writable(array: DeviceArray, what: str) -> None:
    """ArgumentError if ``array`` is read-only (see :attr:`DeviceArray.readonly`)."""
    if array.readonly:
        raise invalid_value(
            f"{what} is read-only: its memory was imported from another library that exported it read-only; "
            "write into a copy of it instead (`await array.copy()`)"
        )


def _enter(buffer: Any, stream: Stream) -> None:
    """Order work about to go on ``stream`` after ``buffer``'s previous work."""
    if buffer.device is stream.device:
        buffer._used_on(stream)
    else:
        stream.wait(buffer.stream)


def _leave(buffer: Any, stream: Stream) -> None:
    """After enqueuing on a stream of another device, keep the buffer's own last-use
    stream (where it will be freed) ordered after that work."""
    if buffer.device is not stream.device:
        buffer.stream.wait(stream)


def _stream_on(device: Device, stream: Stream | None) -> Stream:
    """The stream for work on memory of ``device``: ``stream``, which must be of that
    device (ArgumentError otherwise), else the device's current stream."""
    if stream is None:
        return current_stream(device)
    if not isinstance(stream, Stream):  # (the check written out: a call costs 0.05 us)
        _check_stream(stream)
    if stream.device is not device:
        raise invalid_value(
            f"a stream of device {stream.device.ordinal} for an array of device {device.ordinal}: "
            "pass a stream of the array's device (aiocuda.copy_array copies between devices)"
        )
    return stream


def _stream_of_new(device: Device | int | None, pool: MemoryPool | None) -> Stream:
    """The stream a new array is allocated on when no ``stream=`` was given (see
    :func:`empty`): the task's current stream, which must be of ``device`` or of
    ``pool``'s device, else the default stream of that device."""
    if pool is None:
        return _stream_for_new(device)
    return _stream_for_new(pool.device, "a pool of device")


def _check_pool(device: Device | int, pool: MemoryPool) -> None:
    """ArgumentError unless ``device`` (given with ``pool``) is the pool's device."""
    if _as_device(device) is not pool.device:
        raise invalid_value(
            f"device {_as_device(device).ordinal} and a pool of device {pool.device.ordinal} were both given: "
            "pass one, or a pool of that device"
        )


def _device_of(device: Device | int | None, stream: Stream | None) -> Device:
    """The device of a new array: ``stream``'s, which ``device``, if given too, must be."""
    if stream is None:
        return _as_device(device)
    if not isinstance(stream, Stream):
        _check_stream(stream)
    if device is not None and _as_device(device) is not stream.device:
        raise invalid_value(
            f"device {_as_device(device).ordinal} and a stream of device {stream.device.ordinal} "
            "were both given: pass one, or a stream of that device"
        )
    return stream.device


def empty(
    shape: int | _Shape,
    dtype: npt.DTypeLike = np.float32,
    *,
    device: Device | int | None = None,
    stream: Stream | None = None,
    pool: MemoryPool | None = None,
) -> DeviceArray:
    """A new C-contiguous DeviceArray, contents undefined, allocated stream-ordered on
    ``stream`` from ``pool`` (default: the device's pool).

    ``stream`` defaults to the task's current stream (:func:`~aiocuda.use_stream`),
    whose device ``device`` or the pool's must then be (else ArgumentError), and
    without one to the default stream of ``device`` (default 0) or the pool's.
    ``device``, ``stream`` and ``pool``, where more than one is given, must be of one
    device (else ArgumentError).
    """
    if device is not None and pool is not None:
        _check_pool(device, pool)
    # The path of every new array (Lane.empty and Lane.upload too): the helpers' common
    # cases are written out here, as each call costs about 0.05 us.
    kind = type(dtype)
    known = _known_dtypes.get(dtype if kind is type or kind is str else id(dtype))  # type: ignore[arg-type]
    if type(shape) is int and shape >= 0:  # a vector
        dt, itemsize = known if known is not None else _learn_dtype(dtype)
        dims: _Shape = (shape,)
        strides: _Shape = (itemsize,)
        nbytes = shape * itemsize
    else:
        dims = shape_tuple(shape)  # raises before the dtype is checked, as it always has
        dt, itemsize = known if known is not None else _learn_dtype(dtype)
        strides = c_strides(dims, itemsize)
        nbytes = math.prod(dims) * itemsize
    if stream is None:
        # The stream is chosen here rather than by pool.allocate: inside use_stream()
        # the current stream's device is the array's (see _stream_for_new). This is
        # _stream_of_new, written out (the hot path).
        stream = _stream_for_new(device) if pool is None else _stream_for_new(pool.device, "a pool of device")
        on = stream.device
    elif pool is None:
        on = _device_of(device, stream)
    elif not isinstance(stream, Stream):
        _check_stream(stream)
    if pool is None:
        # MemoryPool.for_device. Through the module: Python 3.12 calls a method of a
        # name bound by an import without its method-call shortcut (a bound method each
        # time).
        pool = _memory._current_pools.get(on)
        if pool is None:
            pool = MemoryPool.default(on)
    buffer = pool.allocate(nbytes, stream)
    # _over_new_buffer, written out: this is the allocation hot path, and the call
    # would be a tenth of its remaining Python.
    array = _new_array(DeviceArray)
    array.shape = dims
    array.dtype = dt
    array.strides = strides
    array.buffer = buffer
    array.offset = 0
    return array


def empty_pitched(
    shape: int | _Shape,
    dtype: npt.DTypeLike = np.float32,
    *,
    alignment: int = PITCH_ALIGNMENT,
    device: Device | int | None = None,
    stream: Stream | None = None,
    pool: MemoryPool | None = None,
) -> DeviceArray:
    """A new DeviceArray whose rows (its last axis) each start at a multiple of
    ``alignment`` bytes, as ``cuMemAllocPitch`` lays out images and tiles; contents
    undefined. Allocated stream-ordered like :func:`empty`.

    The padding shows in the strides: ``strides[-2]`` is the row pitch, so the array is
    not C-contiguous when rows are padded, and copies to or from it are 2D copies.
    Kernels take the pitch from ``array.strides``.
    """
    dims = shape_tuple(shape)
    dt, itemsize = _dtype_and_itemsize(dtype)
    if device is not None and pool is not None:
        _check_pool(device, pool)
    if stream is not None:
        _check_stream(stream)
    if alignment <= 0 or alignment & (alignment - 1) or alignment % itemsize:
        raise invalid_value(
            f"alignment must be a power of two and a multiple of the item size ({itemsize}), not {alignment}"
        )
    if len(dims) < 2:
        return empty(dims, dt, device=device, stream=stream, pool=pool)
    pitch = -(-dims[-1] * itemsize // alignment) * alignment
    strides = [itemsize, pitch]
    for n in reversed(dims[1:-1]):
        strides.append(strides[-1] * max(n, 1))
    if stream is None:
        stream = _stream_of_new(device, pool)
    if pool is None:
        pool = _pool_for(_device_of(device, stream))
    buf = pool.allocate(math.prod(dims[:-1]) * pitch if dims[-1] else 0, stream)
    return _over_new_buffer(dims, dt, tuple(reversed(strides)), buf)


def _over_new_buffer(shape: _Shape, dtype: np.dtype[Any], strides: _Shape, buffer: Any, offset: int = 0) -> DeviceArray:
    """A DeviceArray over a buffer just made to hold it (its first element at ``offset``),
    its shape, dtype and strides already checked."""
    # The slots are filled in place: ``__init__``'s conversions and bounds check cost
    # 4 us on the development machine, this 0.2 us.
    array = _new_array(DeviceArray)
    array.shape = shape
    array.dtype = dtype
    array.strides = strides
    array.buffer = buffer
    array.offset = offset
    return array


_new_array = object.__new__


async def zeros(
    shape: int | _Shape,
    dtype: npt.DTypeLike = np.float32,
    *,
    device: Device | int | None = None,
    stream: Stream | None = None,
    pool: MemoryPool | None = None,
) -> DeviceArray:
    """Like :func:`empty`, filled with zeros (awaited)."""
    array = empty(shape, dtype, device=device, stream=stream, pool=pool)
    return await _filled(array, array.fill(0, stream=stream))


async def to_device(
    array: npt.ArrayLike,
    *,
    stream: Stream | None = None,
    device: Device | int | None = None,
    pool: MemoryPool | None = None,
) -> DeviceArray:
    """Copy a host array to a new C-contiguous DeviceArray; returns once the data is there.

    Pageable memory is staged through pinned chunks (the host copy overlapping the DMA);
    pinned memory is copied directly. Non-contiguous input is made contiguous on the host
    first. ``stream`` and the device default as for :func:`empty`.
    """
    host = np.asarray(array)
    _check_dtype(host.dtype)
    if device is not None and pool is not None:
        _check_pool(device, pool)
    if not host.flags.c_contiguous:
        host = np.ascontiguousarray(host)
    if stream is not None:
        _device_of(device, stream)  # raises where they disagree
        s = stream
    else:
        s = _stream_of_new(device, pool)
    result = empty(host.shape, host.dtype, stream=s, pool=pool)
    return await _filled(result, _upload(result.ptr, host, s))


async def _upload(dst: int, host: npt.NDArray[Any], stream: Stream) -> None:
    """Copy C-contiguous ``host`` to device address ``dst`` and await the copy."""
    await _staging.host_to_device(dst, host, stream)
    await _finished(stream)


async def _finished(stream: Stream) -> None:
    """Wait for the work just enqueued on ``stream``; on a stream being captured, that
    work is recorded into a graph, and there is nothing to wait for."""
    if stream._capture is None:
        await stream.record()


async def _filled(array: DeviceArray, filling: Awaitable[None]) -> DeviceArray:
    """``array`` (just allocated) once ``filling`` is done.

    If filling fails or is cancelled, the array's memory is freed at once, stream-ordered
    after whatever was enqueued on it, rather than whenever the last reference goes: the
    exception's traceback references the caller's frames, and whatever keeps the
    exception (a log record, an exception group, a ``__context__`` chain) would keep the
    device memory too.
    """
    try:
        await filling
    except BaseException:
        array.buffer.free()
        raise
    return array


async def copy(dst: DeviceArray, src: DeviceArray, *, stream: Stream | None = None) -> None:
    """Copy ``src`` into ``dst`` (same shape and dtype, any layouts: non-contiguous ones
    with 2D/3D copies), on one device or between two (a peer copy, which needs no peer
    access). A layout that would take very many of those -- an axis walked forwards on
    one side and backwards on the other, as in ``copy(dst, src[::-1])``, takes one per
    row -- goes through the host instead: downloaded, reordered there, uploaded.
    ``stream`` defaults to the current stream of ``src``'s device. Where the
    two share memory (``a[1:]`` from ``a[:-1]``), ``src`` is copied to new memory first,
    so that ``dst`` gets its values as they were before the copy, as numpy does.

    Both must be DeviceArrays (TypeError otherwise): :func:`to_device` and
    :meth:`DeviceArray.copy_from` copy from host arrays, :meth:`DeviceArray.to_host` to them.
    ``dst`` must not be :attr:`~DeviceArray.readonly` (ArgumentError).
    """
    for name, array in (("dst", dst), ("src", src)):
        if not isinstance(array, DeviceArray):
            raise TypeError(
                f"copy_array copies between DeviceArrays; {name} is a {type(array).__name__} (to_device() and "
                "copy_from() copy from the host, to_host() to it; as_device_array() wraps another library's)"
            )
    _check_writable(dst, "dst")
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise invalid_value(f"copy between mismatched arrays: dst {dst.shape} {dst.dtype}, src {src.shape} {src.dtype}")
    if stream is not None:
        _check_stream(stream)
    s = stream if stream is not None else current_stream(src.device)
    if (
        src.size
        and s._capture is None
        and _copies.cheaper_through_host(src.shape, src.itemsize, dst.strides, src.strides)
    ):
        # (65536 elements reversed took 65536 driver copies, enqueued on the loop's
        # thread: about a second on the simulator. The host's copy also reads all of
        # src before dst is written, so views that share memory need nothing more.)
        host = await src.to_host(stream=s)
        await dst.copy_from(host, stream=s if s.device is dst.device else None)
        return
    _enter(src.buffer, s)
    _enter(dst.buffer, s)
    if src.size and _may_overlap(dst, src):
        # A copy of several driver copies overwrote what later ones had yet to read
        # (a[::-1] from a: row by row), and one driver copy must not read bytes it
        # writes either ("the memory areas may not overlap": a copy engine moves chunks
        # in an order of its own; the simulator's move them as memmove does).
        staged = empty(src.shape, src.dtype, stream=s)
        try:
            _copies.copy_strided(staged._layout(), src._layout(), src.shape, src.itemsize, s)
            _copies.copy_strided(dst._layout(), staged._layout(), src.shape, src.itemsize, s)
        finally:
            staged.buffer.free()  # stream-ordered: after the copies enqueued above
    else:
        _copies.copy_strided(dst._layout(), src._layout(), src.shape, src.itemsize, s)
    _leave(src.buffer, s)
    _leave(dst.buffer, s)
    await _finished(s)


def _may_overlap(a: DeviceArray, b: DeviceArray) -> bool:
    """Whether two arrays with elements may share bytes: their byte spans meet (two
    allocations of aiocuda's pools never do)."""
    if a.buffer is not b.buffer and type(a.buffer) is _memory.DeviceBuffer and type(b.buffer) is _memory.DeviceBuffer:
        return False
    a_lo, a_hi = byte_span(a.shape, a.strides, a.itemsize)
    b_lo, b_hi = byte_span(b.shape, b.strides, b.itemsize)
    return a.ptr + a_lo < b.ptr + b_hi and b.ptr + b_lo < a.ptr + a_hi
