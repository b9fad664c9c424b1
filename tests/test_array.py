"""DeviceArray: transfers, views, fill, device-to-device and peer copies, cancellation."""

from __future__ import annotations

import gc
import hashlib
import inspect
from typing import Any

import anyio
import numpy as np
import pytest

import aiocuda.array as ga
from aiocuda import _driver, managed
from aiocuda._memory import offloop as _offloop
from aiocuda.errors import ArgumentError
from aiocuda.host import is_pinned, pinned_zeros, register_host
from aiocuda.memory import MemoryPool
from aiocuda.stream import Stream, current_stream, use_stream

from ._workload import Gate, observed, slow_op

pytestmark = pytest.mark.anyio

rng = np.random.default_rng(1234)


def _random(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return rng.integers(0, 2, shape).astype(bool)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, shape, dtype=dt, endpoint=True)
    if dt.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dt)
    return rng.standard_normal(shape).astype(dt)


def _digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int8, np.uint16, np.int64, np.complex64, np.bool_])
async def test_round_trip_dtypes(backend: _driver.Driver, anyio_backend: object, dtype: Any) -> None:
    with Stream(0) as s:
        host = _random((33, 17), dtype)
        dev = await ga.to_device(host, stream=s)
        assert dev.shape == host.shape and dev.dtype == host.dtype and dev.is_c_contiguous
        np.testing.assert_array_equal(await dev.to_host(stream=s), host)


@pytest.mark.parametrize("shape", [(), (0,), (5, 0, 3), (1,), (7, 1, 5)])
async def test_round_trip_odd_shapes(backend: _driver.Driver, anyio_backend: object, shape: tuple[int, ...]) -> None:
    host = _random(shape, np.float32)
    dev = await ga.to_device(host)
    np.testing.assert_array_equal(await dev.to_host(), host)


async def test_registered_host_array(backend: _driver.Driver, anyio_backend: object) -> None:
    host = _random((1 << 17,), np.float64)  # 1 MiB: its own pages (the driver pins whole pages)
    with register_host(host) as reg:
        assert is_pinned(host) and not reg.closed
        with pytest.raises(ArgumentError):
            register_host(host)  # already registered
        dev = await ga.to_device(host)
        out = np.empty_like(host)
        with register_host(out):
            await dev.to_host(out=out)
        np.testing.assert_array_equal(out, host)
    assert reg.closed and not is_pinned(host)
    assert (pinned_zeros((4, 4), np.int32) == 0).all()


async def test_registering_again_right_after_closing(backend: _driver.Driver, anyio_backend: object) -> None:
    """Unpinning runs in the background: pinning the same memory again waits for it."""
    host = _random((1 << 17,), np.float64)
    for _ in range(3):
        with register_host(host):
            assert is_pinned(host)
        assert not is_pinned(host)


async def test_freeing_pinned_memory_does_not_wait_for_the_gpu(backend: _driver.Driver, anyio_backend: object) -> None:
    """The driver frees and unpins page-locked memory only once the device is idle (a
    running kernel included): done on the loop's thread, dropping a pinned array or
    closing a registration would stall the whole loop while the GPU works.

    On the simulated backend the stream is paused, so the GPU never becomes idle: a
    free that waited for it would never return (a watchdog resumes the stream then).
    On a GPU, a 2 s kernel runs meanwhile."""
    with Stream(0) as s:
        pinned = [pinned_zeros(1 << 16, np.uint8)]
        registered = np.ones(1 << 17, np.float64)
        registration = register_host(registered)
        with Gate(s) as gate:  # the GPU works until the frees have returned
            del pinned
            gc.collect()
            registration.close()
            assert not is_pinned(registered) and registration.closed
        await s
        assert not gate.timed_out, "freeing pinned memory waited for the GPU's work to end"
    assert _offloop.drain(timeout=10)


async def test_non_contiguous_input_and_output(backend: _driver.Driver, anyio_backend: object) -> None:
    base = _random((20, 30), np.float32)
    dev = await ga.to_device(base[::2, 1::3])
    np.testing.assert_array_equal(await dev.to_host(), base[::2, 1::3])
    out = np.zeros((30, 20), np.float32).T  # Fortran-ordered target
    dev_full = await ga.to_device(base)
    await dev_full.to_host(out=out)
    np.testing.assert_array_equal(out, base)


async def test_views_and_slices_share_memory(backend: _driver.Driver, anyio_backend: object) -> None:
    host = np.arange(4 * 6 * 5, dtype=np.int32).reshape(4, 6, 5)
    dev = await ga.to_device(host)
    cases = [
        (dev[1], host[1]),
        (dev[1:3, ::2], host[1:3, ::2]),
        (dev[..., 3], host[..., 3]),
        (dev[::-1, 2:5, -1], host[::-1, 2:5, -1]),
        (dev[None, 2, :, 1:2], host[None, 2, :, 1:2]),
        (dev[2:2], host[2:2]),
        (dev.reshape(-1, 10)[3], host.reshape(-1, 10)[3]),
        (dev.view(np.uint32)[0, 0], host.view(np.uint32)[0, 0]),
    ]
    for view, expected in cases:
        assert view.buffer is dev.buffer
        assert view.shape == expected.shape
        np.testing.assert_array_equal(await view.to_host(), expected)
    with pytest.raises(IndexError):
        dev[4]
    with pytest.raises(TypeError):
        dev[[0, 1]]
    for mask in (True, False, (0, True)):  # numpy's masks, not the ints 1 and 0
        with pytest.raises(TypeError, match="basic indexing only, not bool"):
            dev[mask]
    with pytest.raises(ArgumentError):
        dev[:, ::2].reshape(-1)
    for shape in ([6, 20], (6.0, 20)):  # ("'list' object cannot be interpreted as an integer")
        with pytest.raises(TypeError, match="reshape takes ints or a tuple of ints"):
            dev.reshape(shape)  # type: ignore[arg-type]
    with pytest.raises(ArgumentError):
        dev.view(np.int16)


async def test_an_array_over_a_buffer_takes_integer_strides_and_offset(
    sim_backend: _driver.Driver, anyio_backend: object
) -> None:
    """A float offset (or stride) was kept: the array's address was a float, and its
    first copy failed only when the simulator ran it, poisoning the device's context
    (every later call on the device failed)."""
    base = await ga.to_device(np.arange(8, dtype=np.float32))
    for strides, offset in (((8.0,), 0), (None, 4.0), (8, 0)):
        with pytest.raises(TypeError, match="strides must be a tuple of ints and offset an int"):
            ga.DeviceArray((2,), np.float32, strides, buffer=base.buffer, offset=offset)  # type: ignore[arg-type]
    view = ga.DeviceArray((2,), np.float32, (np.int64(8),), buffer=base.buffer, offset=np.int64(4))
    assert type(view.ptr) is int and type(view.strides[0]) is int
    np.testing.assert_array_equal(await view.to_host(), [1.0, 3.0])


async def test_iteration_gives_views_along_the_first_axis(backend: _driver.Driver, anyio_backend: object) -> None:
    """A 0-d array iterated as empty (Python's iteration through ``__getitem__`` met its
    IndexError at once), where numpy raises a TypeError."""
    host = np.arange(6, dtype=np.int16).reshape(3, 2)
    dev = await ga.to_device(host)
    rows = list(dev)
    assert [row.shape for row in rows] == [(2,)] * 3 and all(row.buffer is dev.buffer for row in rows)
    for row, expected in zip(rows, host, strict=True):
        np.testing.assert_array_equal(await row.to_host(), expected)
    assert list(dev[:0]) == []
    with pytest.raises(TypeError, match="iteration over a 0-d DeviceArray"):
        iter(dev[1, 1])


async def test_an_array_has_no_truth_value(backend: _driver.Driver, anyio_backend: object) -> None:
    """Python took len() as the truth value: an empty array was false and a full one
    true, so `if out:` passed for a None check, and a 0-d array raised len()'s error.
    Reading an element would wait for the GPU: every array refuses, saying what to use."""
    for array in (ga.empty(0), ga.empty(3), ga.empty(()), ga.empty((2, 2))[0, :1]):
        with pytest.raises(TypeError, match=r"truth value of a DeviceArray.*array is not None"):
            bool(array)
        with pytest.raises(TypeError, match="truth value of a DeviceArray"):
            _ = array or None


async def test_fill(backend: _driver.Driver, anyio_backend: object) -> None:
    for dtype, value in [
        (np.uint8, 7),
        (np.float32, 1.5),
        (np.int16, -3),
        (np.float64, 0.1),
        (np.int64, 0),
        (np.complex64, 1 + 2j),
    ]:
        dev = ga.empty((37, 3), dtype)
        await dev.fill(value)
        np.testing.assert_array_equal(await dev.to_host(), np.full((37, 3), value, dtype))
    z = await ga.zeros(10, np.float32)
    assert not (await z.to_host()).any()


async def test_device_to_device_copy(backend: _driver.Driver, anyio_backend: object) -> None:
    host = _random((256, 3), np.float32)
    src = await ga.to_device(host)
    dst = ga.empty((256, 3), np.float32)
    await ga.copy(dst, src)
    np.testing.assert_array_equal(await dst.to_host(), host)
    clone = await src.copy()
    assert clone.ptr != src.ptr
    np.testing.assert_array_equal(await clone.to_host(), host)
    await dst.copy_from(host[::-1].copy())
    np.testing.assert_array_equal(await dst.to_host(), host[::-1])


async def test_a_device_copy_reversing_an_axis_takes_a_few_driver_copies_not_one_per_row(
    backend: _driver.Driver, anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A DMA copy cannot reverse: an axis walked forwards on one side and backwards on
    the other took one driver copy per row along it, 65536 of them here, enqueued on the
    loop's thread (about a second on the simulator, a minute for 16M elements on a GPU).
    Such a copy goes through the host instead: a handful of copies, whatever the size."""
    calls: list[str] = []
    for name in ("memcpy_dtod_async", "memcpy_pitched_async", "memcpy_htod_async", "memcpy_dtoh_async"):
        real = getattr(backend, name)

        def counted(*args: Any, _real: Any = real, _name: str = name) -> Any:
            calls.append(_name)
            return _real(*args)

        monkeypatch.setattr(backend, name, counted)
    host = np.arange(1 << 16, dtype=np.float32)
    dev = await ga.to_device(host)
    grid = await ga.to_device(host.reshape(256, 256))
    calls.clear()
    flipped = await dev[::-1].copy()
    np.testing.assert_array_equal(await flipped.to_host(), host[::-1])
    await ga.copy(grid[:, ::-1], grid[::-1, :])  # both axes: one backwards on each side
    np.testing.assert_array_equal(await grid.to_host(), host.reshape(256, 256)[::-1, ::-1])
    assert len(calls) <= 12, f"{len(calls)} driver copies"
    rows, source = ga.empty((4, 1 << 14), np.float32), await ga.to_device(host.reshape(4, -1))
    calls.clear()
    await ga.copy(rows, source[::-1])
    assert calls == ["memcpy_dtod_async"] * 4, "four rows reversed: copied row by row on the device"
    np.testing.assert_array_equal(await rows.to_host(), host.reshape(4, -1)[::-1])


async def test_copies_between_views_that_share_memory(
    backend: _driver.Driver, anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``a[1:]`` from ``a[:-1]`` and the like get the source's values as they were, as in
    numpy: ``a[::-1]`` from ``a``, copied row by row, overwrote rows before it read them.
    And no driver copy reads bytes it writes: CUDA's copies may not overlap (a copy
    engine moves chunks in its own order); the simulator's move overlapping bytes as
    memmove does, so its copies are watched."""
    overlapping: list[str] = []
    if backend.name == "sim":

        def watch(name: str, spans: Any) -> None:
            real = getattr(backend, name)

            def watched(*args: Any) -> None:
                (dst, dst_end), (src, src_end) = spans(*args)
                if dst < src_end and src < dst_end:
                    overlapping.append(f"{name}{args[:-1]}")
                real(*args)

            monkeypatch.setattr(backend, name, watched)

        def pitched_span(side: Any, copy: Any) -> tuple[int, int]:
            rows = (copy.depth - 1) * side.rows + copy.height - 1
            return side.address, side.address + rows * side.pitch + copy.width

        watch("memcpy_dtod_async", lambda dst, src, size, stream: ((dst, dst + size), (src, src + size)))
        watch("memcpy_pitched_async", lambda copy, stream: (pitched_span(copy.dst, copy), pitched_span(copy.src, copy)))
    host = np.arange(8 * 64, dtype=np.float32).reshape(8, 64)
    dev = await ga.to_device(host)
    for dst, src in [
        (np.s_[:, 1:], np.s_[:, :-1]),  # one 2D copy whose rows overlap
        (np.s_[1:], np.s_[:-1]),  # one contiguous run
        (np.s_[:-2], np.s_[2:]),
        (np.s_[::-1], np.s_[:]),  # a row per copy, the middle ones onto themselves
        (np.s_[:4, ::2], np.s_[4:, 1::2]),  # disjoint: the same either way
    ]:
        await ga.copy(dev[dst], dev[src])
        host[dst] = host[src]  # (numpy copies overlapping sources first)
        np.testing.assert_array_equal(await dev.to_host(), host, err_msg=f"{dst} from {src}")
    await dev[1:].copy_from(dev[:-1])
    host[1:] = host[:-1].copy()
    np.testing.assert_array_equal(await dev.to_host(), host)
    assert not overlapping, overlapping


@pytest.mark.multi_gpu
async def test_peer_copy_between_devices(backend: _driver.Driver, anyio_backend: object) -> None:
    host = _random((1000,), np.float64)
    on0 = await ga.to_device(host, device=0)
    on1 = await on0.copy(device=1)
    assert on1.device.ordinal == 1
    np.testing.assert_array_equal(await on1.to_host(), host)
    back = ga.empty(1000, np.float64, device=0)
    await ga.copy(back, on1)
    np.testing.assert_array_equal(await back.to_host(), host)


@pytest.mark.multi_gpu
async def test_factories_follow_the_current_streams_device(backend: _driver.Driver, anyio_backend: object) -> None:
    """Inside ``use_stream(s)`` a new array without ``device=`` or ``stream=`` is
    allocated on ``s.device``, stream-ordered on ``s`` (it used to go to device 0 and
    its default stream, where a kernel launched on ``s`` cannot use it)."""
    host = _random((6, 5), np.float32)
    with Stream(1) as s, use_stream(s):
        made = {
            "empty": ga.empty(16),
            "empty_pitched": ga.empty_pitched((3, 5)),
            "empty_pitched 1D": ga.empty_pitched(7),
            "zeros": await ga.zeros((2, 3), np.int32),
            "to_device": await ga.to_device(host),
            "empty device=1": ga.empty(16, device=1),
            "to_device pool": await ga.to_device(host, pool=MemoryPool.for_device(1)),
        }
        for name, array in made.items():
            assert (name, array.device.ordinal, array.buffer.stream) == (name, 1, s)
        np.testing.assert_array_equal(await made["zeros"].to_host(), np.zeros((2, 3), np.int32))
        np.testing.assert_array_equal(await made["to_device"].to_host(), host)
        # An array of another device keeps its own device: copied there, on its stream.
        on0 = await ga.to_device(host, stream=Stream(0))
        again = await on0.copy()
        assert again.device.ordinal == 0
        np.testing.assert_array_equal(await again.to_host(), host)
        # An explicit stream wins over the current one.
        with Stream(0) as s0:
            assert ga.empty(4, stream=s0).buffer.stream is s0


@pytest.mark.multi_gpu
async def test_a_device_that_contradicts_the_current_stream_is_refused(
    backend: _driver.Driver, anyio_backend: object
) -> None:
    """``device=`` (or a pool) of another device than the current stream's: an
    ArgumentError, not work enqueued on a stream of that other device."""
    with Stream(1) as s, use_stream(s):
        with pytest.raises(ArgumentError, match=r"device 0 .*current stream .*device 1"):
            ga.empty(16, device=0)
        with pytest.raises(ArgumentError, match=r"device 0 .*current stream .*device 1"):
            ga.empty_pitched((3, 5), device=0)
        with pytest.raises(ArgumentError, match=r"device 0 .*current stream .*device 1"):
            await ga.zeros(16, device=0)
        with pytest.raises(ArgumentError, match=r"device 0 .*current stream .*device 1"):
            await ga.to_device(np.ones(4), device=0)
        with pytest.raises(ArgumentError, match=r"pool of device 0 .*current stream .*device 1"):
            ga.empty(16, pool=MemoryPool.for_device(0))


async def test_factories_without_a_current_stream_use_the_devices_default(
    backend: _driver.Driver, anyio_backend: object
) -> None:
    default = current_stream(0)
    assert ga.empty(8).buffer.stream is default
    assert (await ga.to_device(np.ones(3))).buffer.stream is default
    with Stream(0) as s, use_stream(s):
        assert ga.empty(8).buffer.stream is s
        assert ga.empty(8, device=0).buffer.stream is s
        assert (await ga.zeros(8)).buffer.stream is s


async def test_bad_input_raises_typed_errors(backend: _driver.Driver, anyio_backend: object) -> None:
    dev = await ga.to_device(np.zeros((4, 4), np.float32))
    with pytest.raises(ArgumentError, match="shape"):
        await dev.to_host(out=np.empty((4, 5), np.float32))
    with pytest.raises(ArgumentError, match="dtype"):
        await dev.to_host(out=np.empty((4, 4), np.float64))
    with pytest.raises(ArgumentError, match="read-only"):
        ro = np.empty((4, 4), np.float32)
        ro.flags.writeable = False
        await dev.to_host(out=ro)
    with pytest.raises(ArgumentError, match="mismatched"):
        await ga.copy(ga.empty(3, np.float32), dev)
    with pytest.raises(ArgumentError):
        ga.empty((-1, 2))
    with pytest.raises(ArgumentError, match="objects"):
        await ga.to_device(np.array([object()]))
    with pytest.raises(ArgumentError, match="64-bit"):
        ga.empty(2**62)  # 2**64 bytes of float32
    with pytest.raises(TypeError):
        ga.empty(1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"to_host\(\)"):
        np.asarray(dev)
    with pytest.raises(TypeError, match=r"to_host\(\)"):
        np.array(dev[1:])
    freed = ga.empty(16, np.uint8)
    freed.buffer.free()
    with pytest.raises(ArgumentError, match="freed"):
        await freed.to_host()


async def test_copy_array_takes_device_arrays_only(backend: _driver.Driver, anyio_backend: object) -> None:
    """A numpy array given to copy_array failed with an error about device ordinals (its
    ``device`` is ``"cpu"``) or an AttributeError: a TypeError that says what to call."""
    x = await ga.to_device(np.zeros(4, np.float32))
    host = np.ones(4, np.float32)
    with pytest.raises(TypeError, match=r"src is a ndarray \(to_device\(\) and copy_from\(\)"):
        await ga.copy(x, host)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dst is a ndarray"):
        await ga.copy(host, x)  # type: ignore[arg-type]
    np.testing.assert_array_equal(await x.to_host(), np.zeros(4, np.float32))


class _ForeignStream:
    """Another library's stream: ``__cuda_stream__``, and a ``device`` of its own."""

    device = "cuda:0"

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, 1)


@pytest.mark.parametrize("stream", [0, _ForeignStream()], ids=["raw handle", "foreign stream"])
async def test_a_stream_that_is_not_an_aiocuda_stream_is_refused(
    backend: _driver.Driver, anyio_backend: object, stream: Any
) -> None:
    """A raw handle or another library's stream given as ``stream=`` failed with an
    AttributeError (``'int' object has no attribute 'device'``), or for one with a
    ``device`` of its own with an error about device ordinals: a TypeError that says
    what to pass instead."""
    x = await ga.to_device(np.zeros((2, 3), np.float32))
    host = np.ones((2, 3), np.float32)
    uses = [
        lambda: ga.empty(4, stream=stream),
        lambda: ga.empty(4, stream=stream, pool=MemoryPool.for_device(0)),
        lambda: ga.empty_pitched((2, 3), stream=stream),
        lambda: ga.to_device(host, stream=stream),
        lambda: ga.zeros(4, stream=stream),
        lambda: x.to_host(stream=stream),
        lambda: x.fill(1.0, stream=stream),
        lambda: x.copy_from(host, stream=stream),
        lambda: x.copy_from(x, stream=stream),
        lambda: x.copy(stream=stream),
        lambda: ga.copy(x, x, stream=stream),
        lambda: managed.empty(4, stream=stream),
        lambda: managed.empty(4, device=0).prefetch(0, stream=stream),
    ]
    for use in uses:
        with pytest.raises(TypeError, match=r"stream must be an aiocuda Stream, not .*Stream\.wrap"):
            result = use()
            if inspect.isawaitable(result):
                await result
    np.testing.assert_array_equal(await x.to_host(), np.zeros((2, 3), np.float32))


@pytest.mark.parametrize(
    ("dtype", "match"),
    [
        (str, "no bytes"),
        (bytes, "no bytes"),
        ("V0", "no bytes"),
        ((np.float32, (3,)), "subarray dtype"),
    ],
)
async def test_dtypes_numpy_arrays_would_not_keep_are_refused(
    backend: _driver.Driver, anyio_backend: object, dtype: Any, match: str
) -> None:
    """numpy makes an array of an unsized string dtype with size 1, and one of a
    subarray dtype with its base and a longer shape: to_host() gave an array unlike the
    DeviceArray, and of the unsized ones copied bytes the device array does not have
    (16 from an empty buffer); ``zeros`` wrote them. A typed error at creation instead."""
    for make in (
        lambda: ga.empty(4, dtype),
        lambda: ga.empty_pitched((2, 3), dtype),  # (a ZeroDivisionError for the unsized ones)
        lambda: managed.empty(4, dtype),
        lambda: ga.DeviceArray(4, dtype, buffer=ga.empty(64, np.uint8).buffer),
    ):
        with pytest.raises(ArgumentError, match=match):
            make()
    with pytest.raises(ArgumentError, match=match):
        await ga.zeros(4, dtype)


async def test_a_device_and_a_stream_of_another_device_are_refused(
    sim_backend: _driver.Driver, anyio_backend: object
) -> None:
    other = Stream(1)
    for make in (lambda: ga.empty(4, device=0, stream=other), lambda: ga.empty_pitched((2, 3), device=0, stream=other)):
        with pytest.raises(ArgumentError, match="device 0 and a stream of device 1"):
            make()
    with pytest.raises(ArgumentError, match="device 0 and a stream of device 1"):
        await ga.to_device(np.zeros(4, np.float32), device=0, stream=other)
    assert ga.empty(4, device=1, stream=other).device.ordinal == 1  # the same device: fine
    # An array's copies and fills on a stream of another device: its free was not
    # ordered after them (a late fill landed in the next array given the memory).
    x = ga.empty(4, np.float32, device=0)
    for use in (
        lambda: x.fill(7.0, stream=other),
        lambda: x.copy_from(np.ones(4, np.float32), stream=other),
        lambda: x.to_host(stream=other),
    ):
        with pytest.raises(ArgumentError, match="a stream of device 1 for an array of device 0"):
            await use()
    await ga.copy(ga.empty(4, np.float32, device=1), x, stream=other)  # between devices: ordered both ways


async def test_a_device_and_a_pool_of_another_device_are_refused(
    sim_backend: _driver.Driver, anyio_backend: object
) -> None:
    """``device=`` beside a pool of another device was ignored: the array went to the
    pool's device, not to the one asked for."""
    pool = MemoryPool.for_device(0)
    with Stream(1) as other:
        for make in (
            lambda: ga.empty(4, device=1, pool=pool),
            lambda: ga.empty(4, device=1, stream=other, pool=pool),
            lambda: ga.empty_pitched((2, 3), device=1, pool=pool),
        ):
            with pytest.raises(ArgumentError, match="device 1 and a pool of device 0"):
                make()
        with pytest.raises(ArgumentError, match="device 1 and a pool of device 0"):
            await ga.to_device(np.zeros(4, np.float32), device=1, pool=pool)
        with pytest.raises(ArgumentError, match="device 1 and a pool of device 0"):
            await ga.zeros(4, device=1, pool=pool)
    assert ga.empty(4, device=0, pool=pool).device.ordinal == 0  # the same device: fine


async def test_cancel_mid_copy_keeps_data_and_leaks_nothing(backend: _driver.Driver, anyio_backend: object) -> None:
    pool = MemoryPool.for_device(0)
    host = rng.integers(0, 256, 3 << 20, dtype=np.uint8)
    digest = _digest(host)
    with Stream(0) as s:
        src = await ga.to_device(host, stream=s)
        await s
        await observed(s)
        used_before = pool.statistics().used_bytes
        dst = ga.empty(host.shape, np.uint8, stream=s)
        for _ in range(3):
            # The copies below stay in flight until they are cancelled, whatever the
            # host's speed (a 50 ms slow operation once finished first on a loaded host).
            with Gate(s) as gate:
                with anyio.move_on_after(0.01) as scope:
                    await ga.copy(dst, src, stream=s)
                assert scope.cancelled_caught
                with anyio.move_on_after(0.01) as scope:
                    await ga.to_device(host, stream=s)  # result dropped while in flight
                assert scope.cancelled_caught
            await s
            assert not gate.timed_out
        gc.collect()
        await s
        assert _digest(await dst.to_host(stream=s)) == digest
        assert _digest(await src.to_host(stream=s)) == digest
        del dst
        gc.collect()
        await s
        await observed(s)
        assert pool.statistics().used_bytes == used_before


async def test_cancelled_to_device_frees_its_memory_even_if_the_exception_is_kept(
    backend: _driver.Driver, anyio_backend: object
) -> None:
    """Whatever keeps a cancellation (a log record, an exception group) keeps the frames
    its traceback references: the result's memory must not depend on it."""
    pool = MemoryPool.for_device(0)
    host = np.ones(256 * 1024, np.uint8)
    kept: list[BaseException] = []
    with Stream(0) as s:
        await s
        await observed(s)
        before = pool.statistics().used_bytes
        with Gate(s):  # the copy cannot finish before the cancellation arrives
            with anyio.CancelScope() as scope:
                scope.cancel()
                try:
                    await ga.to_device(host, stream=s)
                except anyio.get_cancelled_exc_class() as exc:
                    kept.append(exc)
                    raise
        assert kept, "to_device was not cancelled"
        await s
        await observed(s)
        assert pool.statistics().used_bytes == before


async def test_work_on_two_streams_is_ordered(backend: _driver.Driver, anyio_backend: object) -> None:
    host = _random((1 << 16,), np.float32)
    a, b = Stream(0), Stream(0)
    dev = ga.empty(host.shape, np.float32, stream=a)
    slow_op(a, 0.05)
    await dev.copy_from(host, stream=a)
    np.testing.assert_array_equal(await dev.to_host(stream=b), host)
    a.close()
    b.close()
