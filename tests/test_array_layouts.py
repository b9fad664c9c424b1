"""Strided layouts: the copy planner, 2D/3D copies behind DeviceArray reads, writes,
copies and fills of non-contiguous views, and pitched allocations."""

from __future__ import annotations

from typing import Any

import anyio
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import aiocuda
import aiocuda.array as ga
from aiocuda import _driver
from aiocuda._memory import strided
from aiocuda.errors import ArgumentError, ResultCode
from aiocuda.host import pinned_empty
from aiocuda.stream import Stream

rng = np.random.default_rng(20)


# -- the planner, against numpy ------------------------------------------------------------------


@st.composite
def _views(draw: Any, shape: tuple[int, ...], itemsize: int) -> np.ndarray:
    """A view of ``shape`` into a larger byte buffer: steps of either sign, padding, and
    the axes in any order in memory."""
    order = draw(st.permutations(range(len(shape))))
    steps = [draw(st.sampled_from((1, 1, 2, 3, -1, -2))) for _ in shape]
    pads = [draw(st.integers(0, 2)) for _ in shape]
    base_shape = [shape[a] * abs(steps[a]) + pads[a] for a in order]
    base = np.zeros((*base_shape, itemsize), np.uint8)
    index = []
    for a in order:
        step = steps[a]
        start = pads[a] if step > 0 else base_shape[order.index(a)] - 1 - pads[a]
        index.append(slice(start, None, step))
    view = base[tuple(index)]
    view = view[tuple(slice(0, shape[a]) for a in order)]
    inverse = [order.index(a) for a in range(len(shape))]
    return view.transpose((*inverse, len(shape)))


def _flat(view: np.ndarray) -> tuple[np.ndarray, int]:
    """The bytes of the buffer under ``view``, and where its first element is in them."""
    flat = view.base.reshape(-1)
    return flat, view.ctypes.data - flat.ctypes.data


def _run(plan: strided.Plan, dst: np.ndarray, src: np.ndarray) -> None:
    """Carry out ``plan`` between the buffers under ``dst`` and ``src``, row by row."""
    dst_flat, dst_origin = _flat(dst)
    src_flat, src_origin = _flat(src)
    lay = plan.layout
    for dst_offset, src_offset in plan.starts():
        for z in range(lay.depth):
            for y in range(lay.height):
                d = dst_origin + dst_offset + (z * lay.dst_rows + y) * lay.dst_pitch
                s = src_origin + src_offset + (z * lay.src_rows + y) * lay.src_pitch
                dst_flat[d : d + lay.width] = src_flat[s : s + lay.width]


@given(
    shape=st.lists(st.integers(1, 4), min_size=0, max_size=4).map(tuple),
    itemsize=st.sampled_from((1, 2, 4, 8)),
    data=st.data(),
)
def test_plan_copies_what_numpy_copies(shape: tuple[int, ...], itemsize: int, data: Any) -> None:
    """Views carry a trailing axis of the element's bytes; the plan must write exactly
    the destination's elements, with the source's values."""
    src = data.draw(_views(shape, itemsize))
    dst = data.draw(_views(shape, itemsize))
    src[...] = rng.integers(1, 256, src.shape, dtype=np.uint8)
    expected = dst.base.copy()
    _, origin = _flat(dst)
    mirror = np.lib.stride_tricks.as_strided(expected.reshape(-1)[origin:], dst.shape, dst.strides)
    mirror[...] = src
    plan = strided.plan(shape, itemsize, dst.strides[:-1], src.strides[:-1])
    _run(plan, dst, src)
    np.testing.assert_array_equal(dst.base, expected)
    assert all(p >= plan.layout.width for p in (plan.layout.dst_pitch, plan.layout.src_pitch))


def test_plan_folds_common_views_into_one_copy() -> None:
    def count(view: np.ndarray) -> strided.Plan:
        contiguous = np.empty(view.shape, view.dtype)
        return strided.plan(view.shape, view.itemsize, contiguous.strides, view.strides)

    base = np.empty((64, 48, 3), np.float32)
    every_other_row = count(base[::2])
    assert every_other_row.count == 1 and every_other_row.layout.height == 32
    assert every_other_row.layout.width == 48 * 3 * 4
    channel = count(base[..., 0])  # rows of one element, 12 bytes apart: one 2D copy
    assert channel.count == 1 and channel.layout.width == 4 and channel.layout.height == 64 * 48
    channel_tile = count(base[:, :40, 0])  # 40 such rows per slice of 48: one 3D copy
    assert channel_tile.count == 1 and channel_tile.layout.depth == 64 and channel_tile.layout.src_rows == 48
    tile = count(base[8:40, 16:32])
    assert tile.count == 1 and tile.layout.width == 16 * 3 * 4
    flipped = count(base[::-1, ::-1])  # against a forward layout: one copy per element row
    assert flipped.layout.width == 3 * 4 and flipped.count == 64 * 48
    reversed_view = base[::-1, ::-1]
    both_flipped = strided.plan(reversed_view.shape, 4, reversed_view.strides, reversed_view.strides)
    assert both_flipped.layout.contiguous and both_flipped.count == 1
    strided_4d = count(np.empty((5, 6, 7, 8), np.uint8)[:, ::2, ::2, ::2])  # 3D copies, repeated
    assert strided_4d.layout.depth == 4 and strided_4d.count == 5 * 3  # the outer two axes merge
    contiguous = count(base)
    assert contiguous.count == 1 and contiguous.layout.contiguous
    assert count(base[:0]).count == 0


# -- DeviceArray views against numpy ------------------------------------------------------------------

_DTYPES = ("?", "i1", "u1", "i2", "u2", "i4", "u4", "i8", "u8", "f2", "f4", "f8", "c8", "c16")


@st.composite
def _keys(draw: Any, shape: tuple[int, ...]) -> tuple[Any, ...]:
    """A basic index of an array of ``shape``: per axis an int, a slice (steps of either
    sign, bounds past the ends) or the whole axis, new axes, and maybe an ellipsis."""
    key: list[Any] = []
    for n in shape:
        kind = draw(st.sampled_from(("int", "slice", "all", "new axis")))
        if kind == "int" and n:
            key.append(draw(st.integers(-n, n - 1)))
        elif kind == "slice":
            bound = st.none() | st.integers(-n - 2, n + 2)
            step = st.none() | st.sampled_from((1, 2, 3, -1, -2, 7))
            key.append(slice(draw(bound), draw(bound), draw(step)))
        elif kind == "new axis":
            key += [None, slice(None)]
        else:
            key.append(slice(None))
    if key and draw(st.booleans()):
        key = [*key[: draw(st.integers(0, len(key)))], Ellipsis]
    return tuple(key)


@pytest.mark.parametrize("loop", ["asyncio", "trio"])
@settings(max_examples=40)
@given(
    shape=st.lists(st.integers(0, 5), max_size=4).map(tuple),
    dtype=st.sampled_from(_DTYPES),
    order=st.sampled_from("CF"),
    pinned=st.booleans(),
    data=st.data(),
)
def test_views_read_write_fill_and_copy_as_numpy_does(
    loop: str, shape: tuple[int, ...], dtype: str, order: str, pinned: bool, data: Any
) -> None:
    """Any basic index of any array (0-d, empty, Fortran-ordered; every dtype DLPack
    knows) gives the view numpy gives: read into a new array, a page-locked one or one
    laid out in reverse; written from the host or from a device array walked backwards;
    copied onto itself reversed (memory shared by both sides); copied; filled."""
    _driver.use_backend("sim", devices=1)
    host = np.asarray(rng.integers(0, 100, shape)).astype(dtype, order=order)
    key = data.draw(_keys(shape), label="key")
    expected = np.array(host[key])
    update = np.asarray(rng.integers(100, 200, expected.shape)).astype(dtype)
    reverse = (*(slice(None, None, -1),) * expected.ndim, Ellipsis)  # (a 0-d array stays one)

    async def scenario() -> None:
        dev = await ga.to_device(host)
        view = dev[key]
        assert (view.shape, view.dtype) == (expected.shape, expected.dtype)
        np.testing.assert_array_equal(await view.to_host(), expected)
        out = pinned_empty(expected.shape, dtype) if pinned else np.empty(expected.shape, dtype)
        assert await view.to_host(out=out) is out
        np.testing.assert_array_equal(out, expected)
        backwards = np.zeros(expected.shape, dtype)[reverse]
        np.testing.assert_array_equal(await view.to_host(out=backwards), expected)
        await view.copy_from(update)
        host[key] = update
        np.testing.assert_array_equal(await dev.to_host(), host)
        await view.copy_from((await ga.to_device(np.array(update[reverse])))[reverse])
        np.testing.assert_array_equal(await dev.to_host(), host)
        await ga.copy(view, view[reverse])
        host[key] = np.array(np.asarray(host[key])[reverse])
        np.testing.assert_array_equal(await dev.to_host(), host)
        copied = await view.copy()
        assert copied.is_c_contiguous and copied.buffer is not dev.buffer
        np.testing.assert_array_equal(await copied.to_host(), host[key])
        if view.size:
            await view.fill(update.flat[0])
            host[key] = update.flat[0]
            np.testing.assert_array_equal(await dev.to_host(), host)

    anyio.run(scenario, backend=loop)


# -- DeviceArray on both backends -------------------------------------------------------------------


def _views_of(host: np.ndarray) -> list[tuple[str, Any]]:
    return [
        ("every other row", np.s_[::2]),
        ("tile", np.s_[3:17, 5:29]),
        ("columns", np.s_[:, 1::3]),
        ("reversed", np.s_[::-1, ::-2]),
        ("one column", np.s_[:, 7]),
        ("one channel", np.s_[..., 1]),
    ]


@pytest.mark.anyio
async def test_strided_views_download(backend: _driver.Driver, anyio_backend: object) -> None:
    host = rng.standard_normal((20, 30, 3)).astype(np.float32)
    dev = await ga.to_device(host)
    for name, key in _views_of(host):
        view, expected = dev[key], host[key]
        np.testing.assert_array_equal(await view.to_host(), expected, err_msg=name)
        pinned = pinned_empty(expected.shape, np.float32)
        assert await view.to_host(out=pinned) is pinned
        np.testing.assert_array_equal(pinned, expected, err_msg=f"{name}, pinned out")
        fortran = np.empty(expected.shape[::-1], np.float32).T
        np.testing.assert_array_equal(await view.to_host(out=fortran), expected, err_msg=f"{name}, strided out")


@pytest.mark.anyio
async def test_strided_view_download_takes_2d_copies(sim_backend: _driver.Driver, anyio_backend: object) -> None:
    """Every other row goes as a 2D copy (a fault injected into it surfaces), not as the
    whole span; a narrow channel of a small span is gathered whole instead."""
    host = np.arange(64 * 256, dtype=np.float32).reshape(64, 256)
    dev = await ga.to_device(host)
    sim: Any = sim_backend
    sim.inject_fault(ResultCode.INVALID_VALUE, call="memcpy_pitched_async")
    with pytest.raises(ArgumentError, match="fault injected"):
        await dev[::2].to_host()
    channel = await ga.to_device(rng.standard_normal((32, 32, 3)).astype(np.float32))
    sim.inject_fault(ResultCode.INVALID_VALUE, call="memcpy_pitched_async")
    np.testing.assert_array_equal(await channel[..., 2].to_host(), (await channel.to_host())[..., 2])
    with pytest.raises(ArgumentError, match="fault injected"):
        await dev[1::2].to_host()  # the fault was still armed: the channel took no 2D copy


@pytest.mark.anyio
async def test_writes_into_strided_views(backend: _driver.Driver, anyio_backend: object) -> None:
    """copy_from and fill write only the view's elements, from pageable and pinned
    sources alike; the memory between them keeps its contents."""
    for name, key in _views_of(np.empty(0)):
        host = np.arange(20 * 30 * 3, dtype=np.int16).reshape(20, 30, 3)
        dev = await ga.to_device(host)
        view = dev[key]
        update = (-np.arange(view.size, dtype=np.int16)).reshape(view.shape)
        await view.copy_from(update)
        host[key] = update
        np.testing.assert_array_equal(await dev.to_host(), host, err_msg=f"{name}, pageable")
        pinned = pinned_empty(view.shape, np.int16)
        pinned[...] = update + 7
        await view.copy_from(pinned)
        host[key] = update + 7
        np.testing.assert_array_equal(await dev.to_host(), host, err_msg=f"{name}, pinned")
        await view.copy_from(np.asfortranarray(update) - 3)
        host[key] = update - 3
        np.testing.assert_array_equal(await dev.to_host(), host, err_msg=f"{name}, strided source")


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("dtype", "value"),
    [
        (np.uint8, 7),
        (np.int16, -3),  # a 16-bit memset
        (np.float16, 1.5),
        (np.float32, 2.5),
        (np.float64, 0.1),  # no memset: scattered from the host
        (np.complex64, 1 + 1j),  # a repeated 4-byte word
        (np.int32, 0),
    ],
)
async def test_fill_of_views(backend: _driver.Driver, anyio_backend: object, dtype: Any, value: Any) -> None:
    host = np.arange(24 * 40, dtype=dtype).reshape(24, 40)
    dev = await ga.to_device(host)
    for key in (np.s_[::3], np.s_[2:20, 4:36:2], np.s_[:, 5], np.s_[::-2, ::-1]):
        await dev[key].fill(value)
        host[key] = value
    await dev[5].fill(value)
    host[5] = value
    np.testing.assert_array_equal(await dev.to_host(), host)


@pytest.mark.anyio
async def test_copies_between_views(backend: _driver.Driver, anyio_backend: object) -> None:
    host = rng.standard_normal((16, 24)).astype(np.float64)
    src = await ga.to_device(host)
    target = await ga.zeros((32, 48), np.float64)
    await ga.copy(target[::2, ::2], src)
    expected = np.zeros((32, 48))
    expected[::2, ::2] = host
    np.testing.assert_array_equal(await target.to_host(), expected)
    await target[1::2, 1::2].copy_from(target[::2, ::2])
    expected[1::2, 1::2] = host
    np.testing.assert_array_equal(await target.to_host(), expected)
    packed = await target[1::2, 1::2].copy()
    assert packed.is_c_contiguous
    np.testing.assert_array_equal(await packed.to_host(), host)
    if backend.device_count() > 1:  # strided peer copies, both ways
        far = await target[::-2, 1::2].copy(device=1)
        assert far.device.ordinal == 1
        np.testing.assert_array_equal(await far.to_host(), expected[::-2, 1::2])
        back = await ga.zeros((32, 48), np.float64, device=1)
        await ga.copy(back[1::2, ::2], src)
        await ga.copy(target[::2, 1::2], back[1::2, ::2])
        expected[::2, 1::2] = host
        np.testing.assert_array_equal(await target.to_host(), expected)


@pytest.mark.anyio
async def test_pitched_allocation(backend: _driver.Driver, anyio_backend: object) -> None:
    image = aiocuda.empty_pitched((10, 33), np.float32)
    assert image.strides == (256, 4) and not image.is_c_contiguous
    assert image.buffer.size == 10 * 256
    wide = aiocuda.empty_pitched((2, 3, 100), np.uint8, alignment=512)
    assert wide.strides == (3 * 512, 512, 1)
    host = rng.standard_normal((10, 33)).astype(np.float32)
    await image.copy_from(host)
    np.testing.assert_array_equal(await image.to_host(), host)
    await image.fill(3.0)
    np.testing.assert_array_equal(await image.to_host(), np.full((10, 33), 3.0, np.float32))
    assert aiocuda.empty_pitched(5, np.float64).is_c_contiguous
    with pytest.raises(ArgumentError, match="power of two"):
        aiocuda.empty_pitched((4, 4), np.float64, alignment=12)
    with Stream(0) as s:
        aligned = aiocuda.empty_pitched((4, 64), np.float32, stream=s)
        assert aligned.is_c_contiguous  # 256-byte rows need no padding
