"""Fault injection for the simulated driver: fail the Nth seam call with a given code."""

from __future__ import annotations

import threading
from dataclasses import dataclass

__all__ = ["FaultPlan"]


@dataclass(slots=True)
class _Fault:
    code: int
    remaining: int
    call: str | None


class FaultPlan:
    """The faults armed by ``SimDriver.inject_fault`` and not yet fired.

    Every seam call is counted against every armed fault whose ``call`` filter matches
    (``None`` matches all calls); a fault fires on the call that brings its count to
    zero and is then forgotten. Faults count independently: if two fall due on the same
    call, the one armed first fires and the other fires on its next matching call.

    ``armed`` is read without the lock on every seam call so that the common case (no
    fault armed) costs one attribute read.
    """

    __slots__ = ("_faults", "_lock", "armed")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._faults: list[_Fault] = []
        self.armed = False

    def add(self, code: int, at_call: int, call: str | None) -> None:
        """Arm a fault: the ``at_call``-th matching call from now fails with ``code``."""
        if at_call < 1:
            raise ValueError(f"at_call must be >= 1 (1 is the next call), got {at_call}")
        with self._lock:
            self._faults.append(_Fault(code, at_call, call))
            self.armed = True

    def take(self, call: str) -> int | None:
        """Count one call named ``call``; the code to fail it with, or None."""
        with self._lock:
            fired: int | None = None
            for fault in list(self._faults):
                if fault.call is not None and fault.call != call:
                    continue
                fault.remaining -= 1
                if fault.remaining > 0:
                    continue
                if fired is None:
                    fired = fault.code
                    self._faults.remove(fault)
                else:
                    fault.remaining = 1
            self.armed = bool(self._faults)
            return fired
