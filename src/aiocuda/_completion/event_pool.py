"""Pooled event handles: what awaits and holds record, so hot paths create no events."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

from ..device import Device
from .reserve import run_off_loop

__all__ = ["EventPool", "EventPoolStatistics"]


@dataclass(frozen=True, slots=True)
class EventPoolStatistics:
    free: int
    made: int
    made_by_caller: int
    """Events made on the acquiring thread because the reserve had run dry."""


class EventPool:
    """Reusable timing-less event handles of one device.

    The pool starts with :attr:`RESERVE` events, made when it is created (by the
    device's first stream). Taking one that leaves fewer than half of that asks the
    reserve thread to make more, so the thread that takes events -- an event loop's,
    as a rule -- never calls ``cuEventCreate``, which can wait on a driver lock. The
    reserve grows with the number of events in use; only a burst of takes larger than
    any before it can outrun it, and then the caller makes the missing events itself
    (:meth:`statistics` counts them).

    Not locked: ``list.append``/``pop`` are atomic under the GIL, which is all the pool
    needs (events come back from any thread, and loops in several threads take them:
    an empty list is found by the ``pop`` itself, never by a look before it).
    """

    __slots__ = ("_device", "_free", "_low", "_made", "_made_by_caller", "release")

    RESERVE = 32

    def __init__(self, device: Device) -> None:
        self._device = device
        self._free: list[Any] = []
        self.release = self._free.append
        """Give a handle back (a bound method: cheap on hot paths)."""
        self._made = 0
        self._made_by_caller = 0
        self._low = self.RESERVE // 2
        """Free events below which the reserve thread is asked for more."""
        self._top_up()

    def acquire(self) -> Any:
        """A free handle (recorded or not: record it before use)."""
        free = self._free
        if len(free) <= self._low:
            run_off_loop(self._top_up, key=self)
        try:
            return free.pop()
        except IndexError:  # none left (a loop in another thread may take the last one after any look)
            self._made_by_caller += 1
            return self._make()

    def _make(self) -> Any:
        self._device.make_current()
        self._made += 1
        return self._device._driver.event_create(False, False)

    def _top_up(self) -> None:
        """Make events until the free ones are at least the reserve, or as many as are
        in use, whichever is more."""
        free = self._free
        want = max(self.RESERVE, self._made - len(free))
        self._low = want // 2
        while len(free) < want:
            free.append(self._make())

    def statistics(self) -> EventPoolStatistics:
        return EventPoolStatistics(free=len(self._free), made=self._made, made_by_caller=self._made_by_caller)

    @staticmethod
    def for_device(device: Device) -> EventPool:
        pool = _pools.get(device)
        if pool is None:
            pool = _pools[device] = EventPool(device)
        return pool


_pools: weakref.WeakKeyDictionary[Device, EventPool] = weakref.WeakKeyDictionary()
