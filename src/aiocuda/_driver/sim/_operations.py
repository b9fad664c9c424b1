"""Simulated copies and memsets as stream operations (and graph nodes): each checks, when
it runs, that its device ranges are still allocated -- a use after free poisons the
context, as on a GPU -- and a copy can be pointed at other addresses (a graph's memcpy
node update). Also the allocation and free nodes of graph memory, which run nothing."""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import CudaError, ResultCode, error_for_code

if TYPE_CHECKING:
    from ._memory import _MemoryState

__all__ = ["Copy", "GraphAllocation", "GraphFree", "Set", "device_range", "host_range", "invalid", "page_locked"]


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
    if block is not None and block.kind == "device":
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


class Set:
    """A memset of ``count`` elements of ``width`` bytes (1 or 4)."""

    __slots__ = ("call", "count", "dst", "state", "value", "width")

    def __init__(self, state: _MemoryState, call: str, dst: int, value: int, count: int, width: int) -> None:
        self.state = state
        self.call = call
        self.dst = dst
        self.value = value
        self.count = count
        self.width = width

    def __call__(self) -> None:
        _check_live(self.state, ((self.dst, self.count * self.width),), self.call)
        if self.width == 1:
            ctypes.memset(self.dst, self.value, self.count)
        else:
            np.ctypeslib.as_array((ctypes.c_uint32 * self.count).from_address(self.dst))[:] = self.value

    def describe(self) -> dict[str, Any]:
        return {"dst": self.dst, "size": self.count * self.width, "value": self.value, "element_size": self.width}


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
