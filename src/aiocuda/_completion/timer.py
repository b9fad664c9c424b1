"""A loop timer accurate to tens of microseconds: a Linux ``timerfd`` the loop watches.

The poller of an idle loop parks a wait until shortly before its predicted end and lets
the loop sleep until then. asyncio's own timers cannot wake it that precisely: its
selector rounds every timeout up to a whole millisecond, so the wait is found up to 1 ms
after its end; uvloop rounds delays to the nearest millisecond, and one under half a
millisecond becomes ``call_soon`` -- a spin. A ``timerfd`` armed for the exact moment
makes the loop's ``epoll_wait`` return then, whatever timeout the loop chose.

:meth:`LoopTimer.create` returns None where there is no ``timerfd`` (not Linux) or the
loop cannot watch a file descriptor (asyncio's proactor loop on Windows); the adapter
then falls back to the loop's own ``call_later``.
"""

# Measured on the serve benchmark's open-loop windows (uvicorn, H100, 1 ms kernels, half
# the polling saturation rate), with the loop's own timers: asyncio answered 0.8 ms later
# than a polling loop at the median; uvloop as fast, but it spun where it meant to sleep
# and burnt 0.93-0.98 of the polling loop's CPU per request. With this timer (and waits
# learning the middle of their last interval, engine.py), a lone 5 ms wait repeated
# resumed 10-22 us after a spinning synchronize on asyncio and uvloop, against 617-767 us
# with the loop's own timers (await_latency, the same H200).

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import os
import sys
import time
from collections.abc import Callable

__all__ = ["LoopTimer"]

_CLOCK_MONOTONIC = 1
_TFD_NONBLOCK = os.O_NONBLOCK
_TFD_CLOEXEC = os.O_CLOEXEC


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


def _load() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        create, settime = libc.timerfd_create, libc.timerfd_settime
    except (OSError, AttributeError):
        return None
    create.argtypes, create.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settime.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(_Itimerspec), ctypes.c_void_p]
    settime.restype = ctypes.c_int
    return libc


_libc = _load()
_perf = time.perf_counter

_FIRST_GUESS = 100e-6
"""A new timer's lateness until it has fired a few times (seconds)."""
_DOWN = 0.5
"""Weight of a firing earlier than the estimate: it follows an idle loop's wake-ups at once."""
_UP = 1 / 64
"""Weight of a later firing: one delayed by the loop's other work moves it only a little."""
_MAX_SAMPLE = 0.001

# Why the low end: the lead only has to cover how late an idle loop wakes. A loop busy
# when the moment comes runs the callback after that work whatever the lead, so waking
# earlier buys nothing there, and a lead taught by those firings (a mean of them, before)
# kept every wait querying on each turn for 0.2 ms before its end: a spin. In the serve
# benchmark's open-loop windows (half the polling saturation rate) the loop burnt 0.42 ms
# of CPU per request where its work takes 0.23 (H200, asyncio, 1 ms kernels). Both
# estimates in one run (H200; in-process requests at 2000/s, each with 150 us of other
# host work and a 1 ms kernel): 322 against 339 us of loop CPU per request on asyncio, 372
# against 391 on uvloop, with 5.9 against 8.7 and 7.6 against 10.3 poller passes per
# request; median latency 0.1 ms longer on asyncio, the same on uvloop; with 5 ms kernels
# within the noise (469/454, 343/349 us).


class LoopTimer:
    """One one-shot timer of one asyncio loop (uvloop included): :meth:`arm` it for a
    moment and a callback, re-arm it (the last arming wins), and it runs the callback on
    the loop within tens of microseconds of that moment. Used from the loop's thread only."""

    __slots__ = ("_armed", "_due", "_fd", "_fn", "_lateness", "_loop", "_spec")

    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int) -> None:
        self._loop = loop
        self._fd = fd
        self._fn: Callable[[], None] | None = None
        self._spec = _Itimerspec()
        self._armed = ctypes.byref(self._spec)
        self._due = 0.0
        self._lateness = _FIRST_GUESS

    @property
    def lateness(self) -> float:
        """How late (seconds) the callback of an arming runs when the loop is idle at its
        moment: learnt from the timer's own firings, near the low end of how late they
        ran (a loop busy at the moment runs the callback later, however it was armed)."""
        return self._lateness

    def learn(self, late: float) -> None:
        """Take in one firing that ran ``late`` seconds after its moment."""
        # (a loop busy for long runs it later still: bounded, so that one long callback
        # does not teach it for long)
        late = min(late, _MAX_SAMPLE)
        error = late - self._lateness
        self._lateness += (_DOWN if error < 0 else _UP) * error

    @classmethod
    def create(cls, loop: asyncio.AbstractEventLoop) -> LoopTimer | None:
        """A timer on ``loop``, or None where it cannot have one."""
        if _libc is None:
            return None
        fd = _libc.timerfd_create(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)
        if fd < 0:
            return None
        timer = cls(loop, fd)
        try:
            loop.add_reader(fd, timer._expired)
        except (NotImplementedError, RuntimeError, OSError, ValueError):
            os.close(fd)
            return None
        return timer

    def arm(self, when: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` at ``when`` (``time.perf_counter()`` seconds), instead of what the
        timer was armed for before."""
        self._fn = fn
        self._due = when
        delay = max(1e-9, when - _perf())  # (zero would disarm it)
        value = self._spec.it_value
        value.tv_sec = int(delay)
        value.tv_nsec = int((delay - value.tv_sec) * 1e9) or 1
        if _libc is None or _libc.timerfd_settime(self._fd, 0, self._armed, None) != 0:
            self._loop.call_later(delay, self._expired_late)  # (closed: the loop's own timer)

    def _expired(self) -> None:
        try:
            os.read(self._fd, 8)
        except BlockingIOError:  # re-armed since it expired: that arming is pending
            return
        self.learn(_perf() - self._due)
        self._expired_late()

    def _expired_late(self) -> None:
        fn, self._fn = self._fn, None
        if fn is not None:
            fn()

    def close(self) -> None:
        """Stop watching the descriptor and close it (on the loop's thread, or once the
        loop is closed)."""
        fd, self._fd = self._fd, -1
        if fd < 0:
            return
        if not self._loop.is_closed():
            self._loop.remove_reader(fd)
        os.close(fd)
