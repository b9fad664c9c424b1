"""How to copy between two strided layouts with as few 2D/3D copies as possible.

A pure planner, with no driver calls: :mod:`aiocuda._memory.copies` enqueues what it
plans. Given a shape, the item size and the byte strides of both sides, :func:`plan`
finds one :class:`Layout` -- ``depth`` slices of ``height`` rows of ``width`` contiguous
bytes, with each side's pitch and rows per slice -- and the byte offsets, relative to
each side's first element, at which to repeat it (one copy per combination of the
dimensions the layout does not cover).

How dimensions are folded, innermost first:

1. Dimensions of length 1 are dropped; a dimension walked backwards on both sides is
   walked forwards instead (from its last element); neighbours that are contiguous with
   each other on both sides are merged.
2. The innermost dimension is the row if it is contiguous on both sides (``width`` is
   its length times the item size); otherwise each element is a row of its own.
3. The next dimension gives the rows if both its strides are at least ``width`` (rows
   of one side never overlap) and at most :data:`MAX_PITCH`.
4. The next gives the slices if both its strides are whole multiples of the pitches
   and at least ``height`` rows.
5. Every other dimension is repeated: one copy per index.

The same plan serves a 2D memset: give the destination's strides for both sides.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["MAX_PITCH", "Layout", "Plan", "plan"]

MAX_PITCH = (1 << 31) - 1
"""Largest row pitch planned into one copy (the ``max_pitch`` device attribute of
current GPUs); a dimension with a larger stride is repeated instead."""


@dataclass(frozen=True, slots=True)
class Layout:
    """One 2D/3D copy's geometry (the offsets it starts at are the plan's)."""

    width: int
    """Bytes per row."""
    height: int
    """Rows per slice."""
    depth: int
    """Slices."""
    dst_pitch: int
    src_pitch: int
    dst_rows: int
    """Rows from one destination slice to the next (``height`` when ``depth`` is 1)."""
    src_rows: int

    @property
    def contiguous(self) -> bool:
        """One run of ``width`` bytes on both sides: a plain 1D copy."""
        return self.height == 1 and self.depth == 1


@dataclass(frozen=True, slots=True)
class Plan:
    """The copies that move one strided layout to another (see the module docstring)."""

    layout: Layout
    repeats: tuple[tuple[int, int, int], ...]
    """``(length, dst_stride, src_stride)`` of each repeated dimension, outermost first."""
    dst_start: int
    """Byte offset of the first copy's destination from the destination's first element."""
    src_start: int

    @property
    def count(self) -> int:
        """How many copies the plan takes (0 when there is nothing to copy)."""
        return math.prod(length for length, _, _ in self.repeats) if self.layout.width else 0

    def starts(self) -> Iterator[tuple[int, int]]:
        """``(dst_offset, src_offset)`` of each copy, in order."""
        if not self.layout.width:
            return
        ranges = [range(length) for length, _, _ in self.repeats]
        for index in itertools.product(*ranges):
            dst = self.dst_start + sum(i * d for i, (_, d, _) in zip(index, self.repeats, strict=True))
            src = self.src_start + sum(i * s for i, (_, _, s) in zip(index, self.repeats, strict=True))
            yield dst, src


_NOTHING = Layout(0, 0, 0, 0, 0, 0, 0)


def plan(shape: tuple[int, ...], itemsize: int, dst_strides: tuple[int, ...], src_strides: tuple[int, ...]) -> Plan:
    """The plan copying elements of ``shape`` between the two layouts (byte strides)."""
    if any(n == 0 for n in shape):
        return Plan(_NOTHING, (), 0, 0)
    dims: list[tuple[int, int, int]] = []
    dst_start = src_start = 0
    for n, d, s in zip(shape, dst_strides, src_strides, strict=True):
        if n == 1:
            continue
        if d < 0 and s < 0:
            dst_start += (n - 1) * d
            src_start += (n - 1) * s
            d, s = -d, -s
        if dims and dims[-1][1] == n * d and dims[-1][2] == n * s:
            dims[-1] = (dims[-1][0] * n, d, s)
        else:
            dims.append((n, d, s))
    width = itemsize
    if dims and dims[-1][1] == itemsize and dims[-1][2] == itemsize:
        width *= dims.pop()[0]
    height, dst_pitch, src_pitch = 1, width, width
    if dims and all(width <= p <= MAX_PITCH for p in dims[-1][1:]):
        height, dst_pitch, src_pitch = dims.pop()
    depth, dst_rows, src_rows = 1, height, height
    if height > 1 and dims:
        n, d, s = dims[-1]
        if d > 0 and s > 0 and d % dst_pitch == 0 and s % src_pitch == 0:
            if d // dst_pitch >= height and s // src_pitch >= height:
                depth, dst_rows, src_rows = n, d // dst_pitch, s // src_pitch
                dims.pop()
    layout = Layout(width, height, depth, dst_pitch, src_pitch, dst_rows, src_rows)
    return Plan(layout, tuple(dims), dst_start, src_start)
