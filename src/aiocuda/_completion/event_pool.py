"""Pooled event handles: what awaits and holds record, so hot paths create no events."""

from __future__ import annotations

import weakref
from typing import Any

from ..device import Device

__all__ = ["EventPool"]


class EventPool:
    """Reusable timing-less event handles of one device (not thread-safe per call,
    but list ``append``/``pop`` are atomic under the GIL, which is all it needs)."""

    __slots__ = ("_device", "_free", "acquire", "release")

    def __init__(self, device: Device) -> None:
        self._device = device
        self._free: list[Any] = []
        self.release = self._free.append
        """Give a handle back (bound method: cheap on hot paths)."""
        self.acquire = self._acquire

    def _acquire(self) -> Any:
        try:
            return self._free.pop()
        except IndexError:
            self._device.make_current()
            return self._device._driver.event_create(False, False)

    @staticmethod
    def for_device(device: Device) -> EventPool:
        pool = _pools.get(device)
        if pool is None:
            pool = _pools[device] = EventPool(device)
        return pool


_pools: weakref.WeakKeyDictionary[Device, EventPool] = weakref.WeakKeyDictionary()
