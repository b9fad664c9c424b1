"""Simulated copies and memsets as stream operations (and graph nodes): each checks, when
it runs, that its device ranges are still allocated -- a use after free poisons the
context, as on a GPU -- and a copy can be pointed at other addresses (a graph's memcpy
node update). 1D, 2D and 3D copies; memsets of 8, 16 and 32-bit words, in rows too.
Also the allocation and free nodes of graph memory, which run nothing."""

from __future__ import annotations

import ctypes
import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import CudaError, ResultCode, error_for_code

if TYPE_CHECKING:
    from ._memory import _MemoryState

__all__ = [
    "Copy",
    "GraphAllocation",
    "GraphFree",
    "PitchedCopyOp",
    "Set",
    "device_range",
    "extent",
    "host_range",
    "invalid",
    "page_locked",
]


def invalid(call: str, description: str) -> CudaError:
    """The ``INVALID_VALUE`` error the driver would give ``call`` for ``description``."""
    return error_for_code(ResultCode.INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", description, call)


def device_range(state: _MemoryState, ptr: int, size: int, call: str) -> None:
    block = state.find(ptr, size)
    if block is None or block.kind != "device":
        raise invalid(call, f"[0x{ptr:x}, +{size}) is not inside one live device allocation")


def host_range(state: _MemoryState, ptr: int, size: int, call: str) -> None:
    if not ptr:
        raise invalid(call, "null host pointer")
    block = state.find(ptr, 1)
    if block is not None and block.kind == "device" and not block.managed:  # managed memory is both
        raise invalid(call, f"0x{ptr:x} is device memory, not host memory")


def page_locked(state: _MemoryState, ptr: int, size: int) -> bool:
    block = state.find(ptr, size)
    return block is not None and block.kind in ("host", "registered")


def _check_live(state: _MemoryState, ranges: tuple[tuple[int, int], ...], call: str) -> None:
    """When an operation runs: its device ranges must still be allocated (else it is a
    use after free, which poisons the context)."""
    for ptr, size in ranges:
        block = state.find(ptr, size)
        if block is None or block.kind != "device":
            raise error_for_code(
                ResultCode.ILLEGAL_ADDRESS,
                "CUDA_ERROR_ILLEGAL_ADDRESS",
                f"{call} touched freed device memory [0x{ptr:x}, +{size})",
                call,
            )


class Copy:
    """A copy, run on a stream's worker (or as a graph node): checks that its device
    ranges are still allocated, then moves the bytes."""

    __slots__ = ("call", "direction", "dst", "size", "src", "state")

    def __init__(self, state: _MemoryState, call: str, direction: str, dst: int, src: int, size: int) -> None:
        self.state = state
        self.call = call
        self.direction = direction  # "htod", "dtoh", "dtod" or "peer"
        self.dst = dst
        self.src = src
        self.size = size

    def _device_ranges(self) -> tuple[tuple[int, int], ...]:
        d = self.direction
        ranges = []
        if d != "dtoh":
            ranges.append((self.dst, self.size))
        if d != "htod":
            ranges.append((self.src, self.size))
        return tuple(ranges)

    def __call__(self) -> None:
        _check_live(self.state, self._device_ranges(), self.call)
        ctypes.memmove(self.dst, self.src, self.size)

    def describe(self) -> dict[str, Any]:
        direction = "dtod" if self.direction == "peer" else self.direction
        return {"dst": self.dst, "src": self.src, "size": self.size, "direction": direction}

    def moved(self, dst: int, src: int) -> Copy:
        """The same copy between other addresses (a graph's memcpy node update): checked
        as the driver checks them, the same kinds of memory on the same device."""
        call = "cuGraphExecMemcpyNodeSetParams"
        state, size = self.state, self.size
        sides = ((dst, self.dst, self.direction != "dtoh"), (src, self.src, self.direction != "htod"))
        for ptr, before, on_device in sides:
            if on_device:
                block, old = state.find(ptr, size), state.find(before, 1)
                if block is None or block.kind != "device" or (old is not None and old.ordinal != block.ordinal):
                    raise invalid(call, f"[0x{ptr:x}, +{size}) is not device memory of the node's device")
            elif not page_locked(state, ptr, size):
                raise invalid(call, f"[0x{ptr:x}, +{size}) is not page-locked host memory")
        return Copy(state, self.call, self.direction, dst, src, size)


_WORDS = {1: np.uint8, 2: np.uint16, 4: np.uint32}


class Set:
    """A memset of ``count`` elements of ``width`` bytes (1, 2 or 4) -- in each of
    ``height`` rows ``pitch`` bytes apart, for a 2D memset."""

    __slots__ = ("call", "count", "dst", "height", "pitch", "state", "value", "width")

    def __init__(
        self,
        state: _MemoryState,
        call: str,
        dst: int,
        value: int,
        count: int,
        width: int,
        pitch: int = 0,
        height: int = 1,
    ) -> None:
        self.state = state
        self.call = call
        self.dst = dst
        self.value = value
        self.count = count
        self.width = width
        self.pitch = pitch
        self.height = height

    def __call__(self) -> None:
        extent = (self.height - 1) * self.pitch + self.count * self.width
        _check_live(self.state, ((self.dst, extent),), self.call)
        if self.width == 1 and self.height == 1:
            ctypes.memset(self.dst, self.value, self.count)
            return
        words = np.ctypeslib.as_array((ctypes.c_uint8 * extent).from_address(self.dst)).view(_WORDS[self.width])
        rows = np.lib.stride_tricks.as_strided(words, (self.height, self.count), (self.pitch, self.width))
        rows[...] = self.value

    def describe(self) -> dict[str, Any]:
        size = self.count * self.width * self.height
        return {"dst": self.dst, "size": size, "value": self.value, "element_size": self.width}


class PitchedCopyOp:
    """A 2D or 3D copy (``PitchedCopy``): checks that its device sides are still
    allocated, then assigns between strided views of the two sides."""

    __slots__ = ("call", "copy", "state")

    def __init__(self, state: _MemoryState, call: str, copy: Any) -> None:
        self.state = state
        self.call = call
        self.copy = copy

    def __call__(self) -> None:
        copy = self.copy
        live = tuple((side.address, extent(side, copy)) for side in (copy.dst, copy.src) if not side.on_host)
        _check_live(self.state, live, self.call)
        _rows(copy.dst, copy)[...] = _rows(copy.src, copy)

    def describe(self) -> dict[str, Any]:
        copy = self.copy
        direction = {(False, True): "htod", (True, False): "dtoh", (False, False): "dtod"}.get(
            (copy.dst.on_host, copy.src.on_host), "other"
        )
        size = copy.width * copy.height * copy.depth
        return {"dst": copy.dst.address, "src": copy.src.address, "size": size, "direction": direction}

    def moved(self, dst: int, src: int) -> PitchedCopyOp:
        """The same copy between other first addresses (a graph's memcpy node update)."""
        copy = self.copy
        for side, address in ((copy.dst, dst), (copy.src, src)):
            if not side.on_host:
                device_range(self.state, address, extent(side, copy), "cuGraphExecMemcpyNodeSetParams")
            elif not page_locked(self.state, address, extent(side, copy)):
                raise invalid("cuGraphExecMemcpyNodeSetParams", f"0x{address:x} is not page-locked host memory")
        moved = dataclasses.replace(
            copy, dst=dataclasses.replace(copy.dst, address=dst), src=dataclasses.replace(copy.src, address=src)
        )
        return PitchedCopyOp(self.state, self.call, moved)


def extent(side: Any, copy: Any) -> int:
    """Bytes from a pitched side's first byte to the end of its last row."""
    slices = (copy.depth - 1) * side.rows if copy.depth > 1 else 0
    return int((slices + copy.height - 1) * side.pitch + copy.width)


def _rows(side: Any, copy: Any) -> np.ndarray:
    raw = np.ctypeslib.as_array((ctypes.c_uint8 * extent(side, copy)).from_address(side.address))
    strides = (side.rows * side.pitch if copy.depth > 1 else 0, side.pitch, 1)
    return np.lib.stride_tricks.as_strided(raw, (copy.depth, copy.height, copy.width), strides)


class GraphAllocation:
    """An allocation node: the memory is the graph's for its whole life, nothing to run."""

    __slots__ = ("ptr", "size")

    def __init__(self, ptr: int, size: int) -> None:
        self.ptr = ptr
        self.size = size

    def __call__(self) -> None:
        pass

    def describe(self) -> dict[str, Any]:
        return {"dst": self.ptr, "size": self.size}


class GraphFree:
    """A free node of a graph allocation: nothing to run (the graph keeps the memory)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __call__(self) -> None:
        pass

    def describe(self) -> dict[str, Any]:
        return {"dst": self.ptr}
