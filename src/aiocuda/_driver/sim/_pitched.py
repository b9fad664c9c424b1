"""Simulated 2D/3D copies and memsets: ``memcpy_pitched_async``, ``memset_2d_async`` and
``memset_d16_async``.

Checked as the driver checks them (every pitch at least the row's bytes, each side's
``rows`` at least ``height`` in a 3D copy, memset addresses and pitches aligned to the
element), and every device side's whole extent -- from its first byte to the last
byte of its last row -- must lie in one live device allocation, at enqueue time and
again when the operation runs (see ``_memory.py``). Host sides are checked only for
being non-null and outside device memory. The copy itself is one numpy assignment
between strided views of the two sides.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import numpy as np

from ...errors import CudaError, ResultCode, error_for_code
from .._protocol import PitchedCopy, PitchedSide

__all__ = ["SimPitched"]

_MEMSET_TYPES = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def _invalid(call: str, description: str) -> CudaError:
    return error_for_code(ResultCode.INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", description, call)


def _raw(address: int, span: int) -> np.ndarray:
    """``span`` bytes at ``address`` as a writable numpy array (no copy)."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * span).from_address(address))


def _extent(side: PitchedSide, copy: PitchedCopy) -> int:
    """Bytes from a side's first byte to the end of its last row."""
    slices = (copy.depth - 1) * side.rows if copy.depth > 1 else 0
    return (slices + copy.height - 1) * side.pitch + copy.width


class SimPitched:
    """Mixin of SimDriver: pitched copies and memsets (see the module docstring)."""

    # Provided by SimCore and SimMemory.
    _api: Callable[..., None]
    _stream_ordinal: Callable[[Any], int]
    _device_range: Callable[[int, int, str], None]
    _host_range: Callable[[int, int, str], None]
    _check_size: Callable[[int, str], None]
    _enqueue_checked: Callable[..., None]

    def memcpy_pitched_async(self, copy: PitchedCopy, stream: Any) -> None:
        peer = copy.dst.context is not None and copy.src.context is not None
        call = "cuMemcpy3DPeerAsync" if peer else "cuMemcpy3DAsync" if copy.depth > 1 else "cuMemcpy2DAsync"
        self._api("memcpy_pitched_async", self._stream_ordinal(stream))
        for size in (copy.width, copy.height, copy.depth):
            self._check_size(size, call)
        if not (copy.width and copy.height and copy.depth):
            return
        ranges = []
        for side in (copy.dst, copy.src):
            if side.pitch < copy.width:
                raise _invalid(call, f"pitch {side.pitch} is less than the row's {copy.width} bytes")
            if copy.depth > 1 and side.rows < copy.height:
                raise _invalid(call, f"{side.rows} rows per slice hold fewer than the copy's {copy.height} rows")
            extent = _extent(side, copy)
            if side.on_host:
                self._host_range(side.address, extent, call)
            else:
                self._device_range(side.address, extent, call)
                ranges.append((side.address, extent))
        shape = (copy.depth, copy.height, copy.width)

        def view(side: PitchedSide) -> np.ndarray:
            strides = (side.rows * side.pitch if copy.depth > 1 else 0, side.pitch, 1)
            return np.lib.stride_tricks.as_strided(_raw(side.address, _extent(side, copy)), shape, strides)

        def run() -> None:
            view(copy.dst)[...] = view(copy.src)

        self._enqueue_checked(stream, "memcpy_pitched_async", call, tuple(ranges), run)

    def memset_d16_async(self, dst: int, value: int, count: int, stream: Any) -> None:
        self._api("memset_d16_async", self._stream_ordinal(stream))
        self._check_size(count, "cuMemsetD16Async")
        if count == 0:
            return
        if dst % 2:
            raise _invalid("cuMemsetD16Async", f"0x{dst:x} is not 2-byte aligned")
        self._device_range(dst, count * 2, "cuMemsetD16Async")
        word = int(value) & 0xFFFF

        def fill() -> None:
            _raw(dst, count * 2).view(np.uint16)[:] = word

        self._enqueue_checked(stream, "memset_d16_async", "cuMemsetD16Async", ((dst, count * 2),), fill)

    def memset_2d_async(
        self, dst: int, pitch: int, value: int, element_size: int, width: int, height: int, stream: Any
    ) -> None:
        call = f"cuMemsetD2D{element_size * 8}Async"
        self._api("memset_2d_async", self._stream_ordinal(stream))
        dtype = _MEMSET_TYPES.get(element_size)
        if dtype is None:
            raise _invalid(call, f"2D memsets set 1, 2 or 4-byte elements, not {element_size}")
        self._check_size(width, call)
        self._check_size(height, call)
        if not (width and height):
            return
        if dst % element_size or pitch % element_size:
            raise _invalid(call, f"address 0x{dst:x} or pitch {pitch} is not {element_size}-byte aligned")
        if pitch < width * element_size:
            raise _invalid(call, f"pitch {pitch} is less than the row's {width * element_size} bytes")
        extent = (height - 1) * pitch + width * element_size
        self._device_range(dst, extent, call)
        pattern = int(value) & ((1 << (8 * element_size)) - 1)

        def fill() -> None:
            words = _raw(dst, extent).view(dtype)  # extent is a multiple of the element size
            np.lib.stride_tricks.as_strided(words, (height, width), (pitch, element_size))[...] = pattern

        self._enqueue_checked(stream, "memset_2d_async", call, ((dst, extent),), fill)
