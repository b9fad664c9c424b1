"""Controls for tests of timing and of races that must hold on a loaded CI machine.

A test that asserts "within 20 ms" breaks when the machine is busy: every thread then
runs late. :class:`ControlClock` is a thread that ticks every ``period`` seconds of
*sleep*, so it runs late exactly as the threads under test do; a bound counted in its
ticks stretches with the load instead of breaking.

A race test makes another thread act at one exact point and then waits until that thread
has finished or is blocked: :class:`WatchedLock` tells the second, with no sleep.
"""

from __future__ import annotations

import threading
import time
from types import TracebackType


class ControlClock:
    """A thread that counts ``time.sleep(period)`` calls; use as a context manager."""

    def __init__(self, period: float) -> None:
        self.period = period
        self.ticks = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="control-clock", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            time.sleep(self.period)
            self.ticks += 1

    def __enter__(self) -> ControlClock:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


class WatchedLock:
    """A lock that sets ``blocked`` when a thread has to wait for it."""

    def __init__(self, blocked: threading.Event) -> None:
        self._lock = threading.Lock()
        self._blocked = blocked

    def __enter__(self) -> None:
        if not self._lock.acquire(blocking=False):
            self._blocked.set()
            self._lock.acquire()

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self._lock.release()
