"""How much managed memory this process has asked for, per device, and the check that
keeps it within what the device has.

Managed memory is allocated lazily by the driver and can exceed the device's memory;
pages then migrate on every access, and on a GPU shared by several processes that can
stall the device for all of them. So every managed allocation -- ``cuMemAllocManaged``
and allocations from managed pools -- is checked first: the process's managed memory
on the device plus the request must fit in the device's total memory, and the request
in its free memory now, unless the caller said ``oversubscribe=True``.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING

from .._util import format_bytes
from ..errors import OversubscriptionError, ResultCode

if TYPE_CHECKING:
    from ..device import Device
    from ..memory import MemoryPool

__all__ = ["check", "managed_bytes", "note_pool", "release", "reserve"]

_lock = threading.Lock()
_reserving = threading.Lock()  # a check and its count, one allocation at a time
_allocated: dict[Device, int] = {}
"""Bytes of live ``cuMemAllocManaged`` allocations, by the device they were made for."""
_pools: weakref.WeakSet[MemoryPool] = weakref.WeakSet()
"""Managed pools: their memory in use counts too."""


def note_pool(pool: MemoryPool) -> None:
    """Count ``pool``'s memory in use as managed memory of its device from now on."""
    with _lock:
        _pools.add(pool)


def managed_bytes(device: Device) -> int:
    """Managed memory this process holds for ``device``: allocations and pools' use."""
    with _lock:
        pools = [pool for pool in _pools if pool.device is device]
        allocated = _allocated.get(device, 0)
    return allocated + sum(pool.statistics().used_bytes for pool in pools)


def check(device: Device, nbytes: int) -> None:
    """Raise :class:`~aiocuda.errors.OversubscriptionError` unless ``nbytes`` more
    managed memory fits ``device`` (see the module docstring)."""
    held = managed_bytes(device)
    free, total = device.memory_info()
    if held + nbytes <= total and nbytes <= free:
        return
    raise OversubscriptionError(
        f"{format_bytes(nbytes)} of managed memory for device {device.ordinal} would oversubscribe it: this "
        f"process holds {format_bytes(held)} of managed memory there, the device has {format_bytes(total)} in "
        f"all and {format_bytes(free)} free now. Migrating pages of oversubscribed memory can stall the GPU for "
        "every process using it; pass oversubscribe=True to allocate anyway.",
        code=ResultCode.OUT_OF_MEMORY,
        name="AIOCUDA_MANAGED_OVERSUBSCRIBED",
    )


def reserve(device: Device, nbytes: int, *, oversubscribe: bool) -> None:
    """Check (unless ``oversubscribe``) and count an allocation of ``nbytes``."""
    with _reserving:
        if not oversubscribe:
            check(device, nbytes)
        with _lock:
            _allocated[device] = _allocated.get(device, 0) + nbytes


def release(device: Device, nbytes: int) -> None:
    """An allocation counted by :func:`reserve` was freed."""
    with _lock:
        left = _allocated.get(device, 0) - nbytes
        if left > 0:
            _allocated[device] = left
        else:
            _allocated.pop(device, None)
