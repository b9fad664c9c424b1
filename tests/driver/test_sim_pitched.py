"""The simulated driver's 2D/3D copies and memsets: results against numpy, and the
checks the driver makes."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from aiocuda._driver import PitchedCopy, PitchedSide
from aiocuda._driver.sim import SimDriver
from aiocuda.errors import ArgumentError, ContextPoisonedError

from ._helpers import on_device


def _device_bytes(sim: SimDriver, stream: object, host: np.ndarray) -> int:
    ptr = sim.mem_alloc_async(host.nbytes, sim.mempool_default(sim.device_get(0)), stream)
    sim.memcpy_htod_async(ptr, host.ctypes.data, host.nbytes, stream)
    return ptr


def _read(sim: SimDriver, stream: object, ptr: int, nbytes: int) -> np.ndarray:
    out = np.empty(nbytes, np.uint8)
    sim.memcpy_dtoh_async(out.ctypes.data, ptr, nbytes, stream)
    sim.stream_synchronize(stream)
    return out


def test_3d_copy_between_device_and_pinned_host(sim: SimDriver) -> None:
    on_device(sim, 0)
    stream = sim.stream_create(True, 0)
    source = np.arange(4 * 6 * 10, dtype=np.uint8).reshape(4, 6, 10)
    src = _device_bytes(sim, stream, source)
    host = sim.mem_host_alloc(4 * 5 * 8)
    # Slices 1..3 of the source, rows 1..5, bytes 2..7, into packed 5x6-byte rows (pitch 8).
    copy = PitchedCopy(
        dst=PitchedSide(host, pitch=8, rows=5, on_host=True),
        src=PitchedSide(src + 60 + 10 + 2, pitch=10, rows=6),
        width=6,
        height=5,
        depth=3,
    )
    sim.memcpy_pitched_async(copy, stream)
    sim.stream_synchronize(stream)
    got = np.ctypeslib.as_array((ctypes.c_uint8 * (4 * 5 * 8)).from_address(host)).reshape(4, 5, 8)
    np.testing.assert_array_equal(got[:3, :, :6], source[1:4, 1:6, 2:8])
    sim.mem_host_free(host)


def test_2d_memsets_touch_only_their_rows(sim: SimDriver) -> None:
    on_device(sim, 0)
    stream = sim.stream_create(True, 0)
    ptr = _device_bytes(sim, stream, np.zeros(64, np.uint8))
    sim.memset_2d_async(ptr + 4, 16, 0xABCD, 2, 3, 4, stream)  # 4 rows of three 16-bit words
    sim.memset_d16_async(ptr + 62, 0x0102, 1, stream)
    expected = np.zeros((4, 16), np.uint8)
    expected[:, 4:10] = np.frombuffer(np.full(3, 0xABCD, np.uint16).tobytes(), np.uint8)
    expected = expected.reshape(-1)
    expected[62:64] = (0x02, 0x01)
    np.testing.assert_array_equal(_read(sim, stream, ptr, 64), expected)


def test_bad_pitched_operations_are_refused(sim: SimDriver) -> None:
    on_device(sim, 0)
    stream = sim.stream_create(True, 0)
    ptr = _device_bytes(sim, stream, np.zeros(256, np.uint8))
    side = PitchedSide(ptr, pitch=16)
    with pytest.raises(ArgumentError, match="pitch 8 is less"):
        sim.memcpy_pitched_async(PitchedCopy(PitchedSide(ptr, pitch=8), side, width=12, height=2), stream)
    with pytest.raises(ArgumentError, match="rows per slice"):
        sim.memcpy_pitched_async(PitchedCopy(PitchedSide(ptr, 16, rows=1), side, 8, height=2, depth=2), stream)
    with pytest.raises(ArgumentError, match="not inside one live device allocation"):
        sim.memcpy_pitched_async(PitchedCopy(side, PitchedSide(ptr + 128, 16), width=16, height=9), stream)
    with pytest.raises(ArgumentError, match="aligned"):
        sim.memset_2d_async(ptr + 1, 16, 0, 4, 2, 2, stream)
    with pytest.raises(ArgumentError, match="1, 2 or 4-byte"):
        sim.memset_2d_async(ptr, 16, 0, 8, 1, 1, stream)
    with pytest.raises(ArgumentError, match="aligned"):
        sim.memset_d16_async(ptr + 1, 0, 4, stream)
    sim.memcpy_pitched_async(PitchedCopy(side, side, width=0, height=5), stream)  # nothing to do


def test_a_pitched_copy_of_freed_memory_poisons_the_context(sim: SimDriver) -> None:
    on_device(sim, 0)
    stream = sim.stream_create(True, 0)
    ptr = _device_bytes(sim, stream, np.zeros(256, np.uint8))
    other = sim.stream_create(True, 0)
    sim.pause(other)
    sim.memcpy_pitched_async(PitchedCopy(PitchedSide(ptr, 32), PitchedSide(ptr + 16, 32), 16, 4), other)
    sim.mem_free_async(ptr, stream)
    sim.stream_synchronize(stream)
    sim.resume(other)
    with pytest.raises(ContextPoisonedError, match="freed device memory"):
        sim.stream_synchronize(other)
