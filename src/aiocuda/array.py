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
is never torn. Work on one array from different streams is ordered automatically: the
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
it over from an event loop. ``np.asarray(x)`` raises ``TypeError``: use ``to_host()``.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Awaitable
from typing import Any, NoReturn

import numpy as np
import numpy.typing as npt

from ._memory import copies as _copies
from ._memory import staging as _staging
from ._util import byte_span, c_strides, invalid_value, shape_tuple
from .device import Device, _as_device
from .memory import MemoryPool
from .stream import Stream, current_stream

__all__ = ["DeviceArray", "copy", "empty", "to_device", "zeros"]

_Shape = tuple[int, ...]


def _check_dtype(dtype: npt.DTypeLike) -> np.dtype[Any]:
    dt = np.dtype(dtype)
    if dt.hasobject:
        raise invalid_value(f"dtype {dt} holds Python objects and cannot live in device memory")
    return dt


class DeviceArray:
    """An n-dimensional array in device memory (see the module docstring).

    Create with :func:`to_device`, :func:`empty`, :func:`zeros`, or over an existing
    buffer with ``DeviceArray(shape, dtype, buffer=buf)``.
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
        self.strides = c_strides(self.shape, self.dtype.itemsize) if strides is None else tuple(strides)
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
        return self.size * self.dtype.itemsize

    @property
    def is_c_contiguous(self) -> bool:
        return self.size == 0 or all(
            s == c
            for s, c, d in zip(self.strides, c_strides(self.shape, self.itemsize), self.shape, strict=True)
            if d != 1
        )

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d DeviceArray")
        return self.shape[0]

    def __repr__(self) -> str:
        layout = "" if self.is_c_contiguous else f" strides={self.strides}"
        return f"<DeviceArray shape={self.shape} dtype={self.dtype}{layout} device={self.device.ordinal}>"

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
                i = operator.index(k)
            except TypeError:
                raise TypeError(f"DeviceArray supports basic indexing only, not {type(k).__name__}") from None
            if not -n <= i < n:
                raise IndexError(f"index {i} is out of bounds for axis {dim - 1} with size {n}")
            offset += (i % n) * stride
        shape.extend(self.shape[dim:])
        strides.extend(self.strides[dim:])
        return DeviceArray(tuple(shape), self.dtype, tuple(strides), buffer=self.buffer, offset=offset)

    def reshape(self, *shape: int | _Shape) -> DeviceArray:
        """A view with a new shape (one dimension may be -1); C-contiguous arrays only."""
        first = shape[0] if len(shape) == 1 else None
        given: tuple[Any, ...] = first if isinstance(first, tuple) else shape
        dims = [operator.index(d) for d in given]
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
        return DeviceArray(tuple(dims), self.dtype, buffer=self.buffer, offset=self.offset)

    def view(self, dtype: npt.DTypeLike) -> DeviceArray:
        """The same memory seen as another dtype of the same item size."""
        dt = _check_dtype(dtype)
        if dt.itemsize != self.itemsize:
            raise invalid_value(f"view needs a dtype of the same item size ({self.itemsize}), not {dt}")
        return DeviceArray(self.shape, dt, self.strides, buffer=self.buffer, offset=self.offset)

    # -- stream bookkeeping ---------------------------------------------------------------------
    def _stream_for(self, stream: Stream | None) -> Stream:
        """The stream to enqueue on, ordered after the array's previous work."""
        chosen = stream if stream is not None else current_stream(self.device)
        _enter(self.buffer, chosen)
        return chosen

    # -- transfers -------------------------------------------------------------------------------
    async def to_host(self, out: npt.NDArray[Any] | None = None, *, stream: Stream | None = None) -> npt.NDArray[Any]:
        """Copy to host memory and return the numpy array (``out`` if given).

        ``out`` must have the same shape and dtype and be writeable; any layout works
        (a non-contiguous ``out`` costs one host copy). Pinned ``out`` arrays are written
        by DMA directly. Non-contiguous device views copy their whole byte span.
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
        chosen = stream if stream is not None else current_stream(self.device)
        if chosen._capture is not None and (out is None or not (out.flags.c_contiguous and self.is_c_contiguous)):
            raise chosen._capture.refuse(
                "to_host() without a page-locked, C-contiguous out= array",
                "a replay can only copy into host memory given to it (aiocuda.pinned_empty)",
            )
        s = self._stream_for(chosen)
        if self.is_c_contiguous:
            target = out if out is not None and out.flags.c_contiguous else np.empty(self.shape, self.dtype)
            await _staging.device_to_host(target, self.ptr, s)
        else:
            lo, hi = byte_span(self.shape, self.strides, self.itemsize)
            span = np.empty(hi - lo, np.uint8)
            await _staging.device_to_host(span, self.ptr + lo, s)
            target = np.ndarray(self.shape, self.dtype, buffer=span, offset=-lo, strides=self.strides).copy()
        if out is not None and target is not out:
            np.copyto(out, target)
            return out
        return target

    async def copy_from(self, source: DeviceArray | npt.NDArray[Any], *, stream: Stream | None = None) -> None:
        """Overwrite this array with ``source`` (a DeviceArray on any device, or a numpy
        array); shapes and dtypes must match. Both must be C-contiguous if on device."""
        if isinstance(source, DeviceArray):
            await copy(self, source, stream=stream)
            return
        host = np.asarray(source)
        if host.shape != self.shape or host.dtype != self.dtype:
            raise invalid_value(
                f"source has shape {host.shape} and dtype {host.dtype}; expected {self.shape} and {self.dtype}"
            )
        if not self.is_c_contiguous:
            raise invalid_value("copying into a non-contiguous DeviceArray is not supported")
        await _upload(self.ptr, np.ascontiguousarray(host), self._stream_for(stream))

    async def copy(self, *, device: Device | int | None = None, stream: Stream | None = None) -> DeviceArray:
        """A new C-contiguous copy, on ``device`` (default: this array's device)."""
        if not self.is_c_contiguous:
            raise invalid_value("copy() of a non-contiguous DeviceArray is not supported; use to_host()")
        target_device = self.device if device is None else _as_device(device)
        dst = empty(self.shape, self.dtype, device=target_device)
        return await _filled(dst, copy(dst, self, stream=stream))

    async def fill(self, value: Any, *, stream: Stream | None = None) -> None:
        """Set every element to ``value`` (a memset when the pattern allows it)."""
        if not self.is_c_contiguous:
            raise invalid_value("fill() of a non-contiguous DeviceArray is not supported")
        if self.size == 0:
            return
        pattern = np.array(value, dtype=self.dtype)
        s = self._stream_for(stream)
        if not _copies.fill(self.ptr, self.nbytes, pattern.tobytes(), s):
            await _staging.host_to_device(self.ptr, np.full(self.shape, pattern, self.dtype), s)
        await _finished(s)

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
        from ._memory.interop import to_dlpack

        return to_dlpack(self, stream=stream, dl_device=dl_device, copy=copy)

    def __dlpack_device__(self) -> tuple[int, int]:
        from ._memory.interop import DLPACK_CUDA

        return (DLPACK_CUDA, self.device.ordinal)


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


def empty(
    shape: int | _Shape,
    dtype: npt.DTypeLike = np.float32,
    *,
    device: Device | int | None = None,
    stream: Stream | None = None,
    pool: MemoryPool | None = None,
) -> DeviceArray:
    """A new C-contiguous DeviceArray, contents undefined, allocated stream-ordered on
    ``stream`` (default: the current stream of ``device``) from ``pool`` (default: the
    device's pool)."""
    dims = shape_tuple(shape)
    dt = _check_dtype(dtype)
    if pool is None:
        pool = MemoryPool.for_device(stream.device if stream is not None else _as_device(device))
    buf = pool.allocate(math.prod(dims) * dt.itemsize, stream)
    return DeviceArray(dims, dt, buffer=buf)


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
    first. ``stream`` defaults to the current stream of ``device`` (default 0).
    """
    host = np.asarray(array)
    _check_dtype(host.dtype)
    if not host.flags.c_contiguous:
        host = np.ascontiguousarray(host)
    s = stream if stream is not None else current_stream(_as_device(device))
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
    """Copy ``src`` into ``dst`` (same shape and dtype, both C-contiguous), on one device
    or between two (a peer copy, which needs no peer access). ``stream`` defaults to the
    current stream of ``src``'s device."""
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise invalid_value(f"copy between mismatched arrays: dst {dst.shape} {dst.dtype}, src {src.shape} {src.dtype}")
    if not (dst.is_c_contiguous and src.is_c_contiguous):
        raise invalid_value("copy() needs C-contiguous arrays")
    s = stream if stream is not None else current_stream(src.device)
    _enter(src.buffer, s)
    _enter(dst.buffer, s)
    _copies.copy_between(dst.ptr, dst.device, src.ptr, src.device, src.nbytes, s)
    _leave(src.buffer, s)
    _leave(dst.buffer, s)
    await _finished(s)
