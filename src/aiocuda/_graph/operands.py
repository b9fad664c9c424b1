"""What a graph's node updates are given (``Graph.set_kernel_args``, ``set_copy``,
``rebind``), resolved to memory: its address and bytes, what the graph keeps alive while a
node uses it, the buffer each launch orders the replay after, and what refuses it.

Device memory is whatever aiocuda orders work on, duck-typed as kernel arguments are
(``_kernels/packing.py``): a pool's ``DeviceBuffer``, an ``OwnedBuffer`` (memory owned
elsewhere: arrays imported from CuPy, PyTorch or Numba, managed memory, memory shared
between processes), the arrays over either, and other libraries' arrays themselves,
imported as ``interop.as_device_array`` does. An imported array's buffer keeps its owner,
so keeping the array keeps the owner; a launch's ``_used_on`` moves the buffer's last use
to the launch stream, so a release after it waits for the replay (as a pool buffer's
stream-ordered free does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .._memory.interop import as_device_array
from .._memory.pinned import pinned_ranges
from .._util import invalid_value
from ..array import DeviceArray
from ..device import Device
from ..errors import GraphUpdateError
from ..managed import ManagedArray

__all__ = ["Bound", "Memory", "check_destination", "check_reach", "is_buffer", "move", "operand", "resolve"]

Bound = tuple[Any, int, int, Any]
"""Memory a node update gave: ``(object to keep, start, end, buffer to order launches after)``:
the buffer is a pool's ``DeviceBuffer`` or an ``OwnedBuffer`` (memory owned elsewhere, its
owner kept with it), None for page-locked host memory."""


@dataclass(frozen=True, slots=True)
class Memory:
    """What a node update was given, resolved (:func:`resolve`)."""

    address: int
    nbytes: int
    host: bool
    """Page-locked host memory (else device memory)."""
    keep: Any
    """What the graph keeps alive while a node uses the memory."""
    buffer: Any
    """The memory's buffer -- a pool's ``DeviceBuffer`` or an ``OwnedBuffer`` (imported,
    managed, shared) -- that each launch orders the replay after; None on the host."""
    device: Device | None
    managed: bool
    """Managed memory: reachable from every device."""
    readonly: bool
    name: str
    """How errors name it."""

    def bound(self) -> Bound:
        """As memory a node update gave (see ``_Replays.bound``)."""
        return (self.keep, self.address, self.address + max(self.nbytes, 1), self.buffer)


def is_buffer(obj: Any) -> bool:
    """Device memory aiocuda orders work on: a pool's ``DeviceBuffer``, or an ``OwnedBuffer``
    (memory owned elsewhere: imported from another library, managed, shared between
    processes). Duck-typed, as kernel arguments are (``_kernels/packing.py``)."""
    cls = type(obj)
    return hasattr(cls, "_used_on") and hasattr(cls, "ptr") and not isinstance(obj, DeviceArray)


def resolve(obj: Any) -> Memory:
    """The memory behind what a node update was given: a device array (aiocuda's own, or
    one over memory imported from another library), a buffer, another library's device
    array (imported as :func:`aiocuda.interop.as_device_array` does: the graph then keeps
    its owner alive while a node uses it), or a page-locked numpy array."""
    if isinstance(obj, np.ndarray):
        address, nbytes = int(obj.ctypes.data), int(obj.nbytes)
        owner = pinned_ranges.owner(address, max(nbytes, 1))
        if owner is None:
            raise invalid_value("a graph copies only page-locked host memory (aiocuda.pinned_empty), not this array")
        return Memory(address, nbytes, True, (owner, obj), None, None, False, False, "a page-locked array")
    if is_buffer(obj):
        return Memory(
            int(obj.ptr),
            int(obj.size),
            False,
            obj,
            obj,
            obj.device,
            False,
            getattr(obj, "readonly", False) is True,
            repr(obj),
        )
    if not isinstance(obj, DeviceArray) and (hasattr(obj, "__cuda_array_interface__") or hasattr(obj, "__dlpack__")):
        obj = as_device_array(obj)  # (the array keeps its OwnedBuffer, which keeps ``obj``)
    if isinstance(obj, DeviceArray):
        buffer = obj.buffer
        if not is_buffer(buffer):
            raise TypeError(
                f"{obj!r} is over a {type(buffer).__name__}, which aiocuda cannot order a replay after: a graph "
                "takes arrays over a pool's buffers or over memory imported with aiocuda.interop.as_device_array"
            )
        return Memory(
            obj.ptr, obj.nbytes, False, obj, buffer, obj.device, isinstance(obj, ManagedArray), obj.readonly, repr(obj)
        )
    raise TypeError(
        "expected a DeviceArray, a DeviceBuffer, another library's device array (__cuda_array_interface__ or "
        f"DLPack) or a page-locked numpy array, not {type(obj).__name__}"
    )


def check_reach(memory: Memory, device: Device, what: str) -> None:
    """GraphUpdateError unless ``memory`` (given for ``what``) can be used by a kernel on
    ``device``: memory of that device, or managed memory (as a launch requires)."""
    if memory.host or memory.managed or memory.device is device or memory.device is None:
        return
    raise GraphUpdateError(
        f"{what} {memory.name} is memory of device {memory.device.ordinal}, and the graph runs on device "
        f"{device.ordinal}: copy it there first (aiocuda.copy_array), or use managed memory (aiocuda.managed)",
        name="AIOCUDA_GRAPH_UPDATE",
    )


def check_destination(memory: Memory, index: int) -> None:
    """ArgumentError if ``memory`` is read-only and would become copy node ``index``'s destination."""
    if memory.readonly:
        raise invalid_value(
            f"{memory.name} is read-only (imported from another library that exported it read-only), and "
            f"would be the destination of copy node {index}: give the node writable memory (`await array.copy()`)"
        )


def move(old: Any, new: Any) -> tuple[int, int, int, Memory]:
    """``(start, end, target, new memory)``: addresses in ``old``'s bytes go to ``target``
    and on."""
    was, memory = resolve(old), resolve(new)
    if was.host != memory.host:
        raise GraphUpdateError(
            "memory can only be rebound to memory of the same side (device or host)", name="AIOCUDA_GRAPH_UPDATE"
        )
    if memory.nbytes < was.nbytes:
        raise GraphUpdateError(f"rebinding {was.nbytes} bytes to only {memory.nbytes}", name="AIOCUDA_GRAPH_UPDATE")
    if not memory.host and not memory.managed and memory.device is not was.device:
        # (a copy node takes memory of the contexts it was captured with only, and a kernel
        # memory its device reaches)
        raise GraphUpdateError(
            f"{memory.name} is memory of device {memory.device.ordinal if memory.device else '?'}, the memory it "
            f"replaces ({was.name}) of device {was.device.ordinal if was.device else '?'}: rebind to memory of "
            "the same device",
            name="AIOCUDA_GRAPH_UPDATE",
        )
    return was.address, was.address + was.nbytes, memory.address, memory


def operand(obj: Any, current: int, size: int, host: bool, what: str) -> tuple[int, Memory | None]:
    """The address ``obj`` gives a copy's ``what`` side, and the memory it is (None for
    an int address, or for ``None``: the current address kept)."""
    if obj is None:
        return current, None
    if isinstance(obj, int):
        return obj, None
    memory = resolve(obj)
    if memory.host != host:
        side = "host" if host else "device"
        raise GraphUpdateError(f"the copy's {what} is {side} memory", name="AIOCUDA_GRAPH_UPDATE")
    if memory.nbytes < size:
        raise GraphUpdateError(f"the copy moves {size} bytes; {what} has {memory.nbytes}", name="AIOCUDA_GRAPH_UPDATE")
    return memory.address, memory
