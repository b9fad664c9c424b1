"""Simulated 2D/3D copies and memsets: ``memcpy_pitched_async``, ``memset_2d_async`` and
``memset_d16_async``.

Checked as the driver checks them (every pitch at least the row's bytes, each side's
``rows`` at least ``height`` in a 3D copy, memset addresses and pitches aligned to the
element), and every device side's whole extent -- from its first byte to the last
byte of its last row -- must lie in one live device allocation, at enqueue time and
again when the operation runs (``_operations.py``). Host sides are checked as for 1D
copies: non-null, outside device memory, page-locked during a capture.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._protocol import PitchedCopy
from ._operations import PitchedCopyOp, Set, device_range, extent, invalid

__all__ = ["SimPitched"]

_ELEMENT_SIZES = (1, 2, 4)


class SimPitched:
    """Mixin of SimDriver: pitched copies and memsets (see the module docstring)."""

    # Provided by SimCore and SimMemory.
    _api: Callable[..., None]
    _stream_ordinal: Callable[[Any], int]
    _mem: Callable[[], Any]
    _check_host: Callable[[Any, int, int, str], None]
    _check_size: Callable[[int, str], None]
    _enqueue: Callable[..., None]

    def memcpy_pitched_async(self, copy: PitchedCopy, stream: Any) -> None:
        peer = copy.dst.context is not None and copy.src.context is not None
        call = "cuMemcpy3DPeerAsync" if peer else "cuMemcpy3DAsync" if copy.depth > 1 else "cuMemcpy2DAsync"
        self._api("memcpy_pitched_async", self._stream_ordinal(stream))
        for size in (copy.width, copy.height, copy.depth):
            self._check_size(size, call)
        if not (copy.width and copy.height and copy.depth):
            return
        state = self._mem()
        for side in (copy.dst, copy.src):
            if side.pitch < copy.width:
                raise invalid(call, f"pitch {side.pitch} is less than the row's {copy.width} bytes")
            if copy.depth > 1 and side.rows < copy.height:
                raise invalid(call, f"{side.rows} rows per slice hold fewer than the copy's {copy.height} rows")
            if side.on_host:
                self._check_host(stream, side.address, extent(side, copy), call)
            else:
                device_range(state, side.address, extent(side, copy), call)
        self._enqueue(stream, PitchedCopyOp(state, call, copy), "memcpy_pitched_async")

    def memset_d16_async(self, dst: int, value: int, count: int, stream: Any) -> None:
        self._api("memset_d16_async", self._stream_ordinal(stream))
        self._check_size(count, "cuMemsetD16Async")
        if count == 0:
            return
        if dst % 2:
            raise invalid("cuMemsetD16Async", f"0x{dst:x} is not 2-byte aligned")
        device_range(self._mem(), dst, count * 2, "cuMemsetD16Async")
        word = int(value) & 0xFFFF
        self._enqueue(stream, Set(self._mem(), "cuMemsetD16Async", dst, word, count, 2), "memset_d16_async")

    def memset_2d_async(
        self, dst: int, pitch: int, value: int, element_size: int, width: int, height: int, stream: Any
    ) -> None:
        call = f"cuMemsetD2D{element_size * 8}Async"
        self._api("memset_2d_async", self._stream_ordinal(stream))
        if element_size not in _ELEMENT_SIZES:
            raise invalid(call, f"2D memsets set 1, 2 or 4-byte elements, not {element_size}")
        self._check_size(width, call)
        self._check_size(height, call)
        if not (width and height):
            return
        if dst % element_size or pitch % element_size:
            raise invalid(call, f"address 0x{dst:x} or pitch {pitch} is not {element_size}-byte aligned")
        if pitch < width * element_size:
            raise invalid(call, f"pitch {pitch} is less than the row's {width * element_size} bytes")
        device_range(self._mem(), dst, (height - 1) * pitch + width * element_size, call)
        pattern = int(value) & ((1 << (8 * element_size)) - 1)
        fill = Set(self._mem(), call, dst, pattern, width, element_size, pitch, height)
        self._enqueue(stream, fill, "memset_2d_async")
