"""The simulated driver's worker threads: a small pool that runs every stream's operations.

A stream with work to do is *scheduled*: it sits in the pool's ready queue, waits in its
timer heap for a simulated latency to pass, or is being run by one worker. A worker takes
a stream from the queue and runs its operations in order until the stream cannot go on
(nothing queued, paused, waiting for another stream's point, in a latency) or has had
its turn; so one stream's operations never run on two threads at once, streams run
concurrently with each other, and a stream costs no thread while it waits.

Nothing in the pool blocks on a stream: a latency is a timer, a cross-stream wait is a
registration with the stream waited for (which schedules the waiter again when it
moves). Only the operations themselves run on the workers -- copies, kernel
implementations -- and those must not wait for other simulated work, as no GPU kernel
may either.

Threads start when work is queued and no worker is idle, one at a time (a new worker
starts the next only if work is still queued when it takes its own), up to
``MAX_WORKERS``, and leave after ``_objects._IDLE_EXIT_S`` without work. One idle worker,
the timekeeper, waits for the earliest latency to end instead, and never leaves while
one is pending.
"""

from __future__ import annotations

import collections
import gc
import heapq
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["MAX_WORKERS", "Schedulable", "Workers"]

MAX_WORKERS = 32
"""Most worker threads one simulated driver runs at once."""


class Schedulable(Protocol):
    """What the pool runs: a stream, one turn at a time."""

    def run_turn(self) -> None:
        """Run operations until the stream cannot go on; reschedule or unschedule it."""


class Workers:
    """What all streams of one driver share: latencies, the stop flag, the thread binding,
    and the worker threads themselves."""

    __slots__ = (
        "_cond",
        "_idle",
        "_keeper",
        "_keeper_cond",
        "_order",
        "_ready",
        "_starting",
        "_threads",
        "_timers",
        "bind_context",
        "idle_exit",
        "latency",
        "stopping",
    )

    def __init__(self, bind_context: Callable[[Any], None], idle_exit: Callable[[], float]) -> None:
        self.latency: dict[str, float] = {}
        """Seconds an operation of that name waits on its stream before it runs."""
        self.stopping = threading.Event()
        """Set by :meth:`stop`: workers leave, streams drop their queues, waits end."""
        self.bind_context = bind_context
        """Makes a context current on the calling (worker) thread."""
        self.idle_exit = idle_exit
        """Seconds an idle worker waits for work before leaving (read at each wait)."""
        # Reentrant: the garbage collector may run finalisers at any allocation made under
        # it, and a collected DeviceBuffer frees itself on its stream, whose scheduling
        # takes this lock again on the same thread.
        lock = threading.RLock()
        self._cond = threading.Condition(lock)  # idle workers wait here
        self._keeper_cond = threading.Condition(lock)  # the timekeeper waits here
        self._keeper = False  # whether a timekeeper waits
        self._ready: collections.deque[Schedulable] = collections.deque()
        self._timers: list[tuple[float, int, Schedulable]] = []
        self._order = itertools.count()  # ties in the timer heap, so streams are never compared
        self._idle = 0
        self._starting = False
        self._threads: set[threading.Thread] = set()

    def __repr__(self) -> str:
        return (
            f"<Workers threads={len(self._threads)} idle={self._idle} ready={len(self._ready)} "
            f"timers={len(self._timers)}>"
        )

    @property
    def thread_count(self) -> int:
        """Worker threads alive now."""
        return len(self._threads)

    def ready(self, stream: Schedulable) -> None:
        """Queue a scheduled stream for the next free worker."""
        with self._cond:
            self._ready.append(stream)
            self._wake_or_start()

    def after(self, due: float, stream: Schedulable) -> None:
        """Queue a scheduled stream once ``time.monotonic()`` reaches ``due``."""
        with self._cond:
            heapq.heappush(self._timers, (due, next(self._order), stream))
            if self._keeper:
                if self._timers[0][2] is stream:
                    self._keeper_cond.notify()  # it must wake sooner
            elif self._idle:
                self._cond.notify()  # one becomes the timekeeper

    def stop(self) -> None:
        """Make every worker leave once its current operation ends; drop timers and queue."""
        self.stopping.set()
        with self._cond:
            self._ready.clear()
            self._timers.clear()
            self._cond.notify_all()
            self._keeper_cond.notify_all()

    def join(self, deadline: float) -> None:
        """Wait until ``time.monotonic()`` reaches ``deadline`` for the workers to leave."""
        with self._cond:
            threads = list(self._threads)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    # -- the worker threads ---------------------------------------------------------------
    def _wake_or_start(self) -> None:
        """(Lock held.) Let an idle worker take queued work, or start one more."""
        if self._idle:
            self._cond.notify()
        elif self._keeper:
            self._keeper_cond.notify()
        elif not self._starting and len(self._threads) < MAX_WORKERS and not self.stopping.is_set():
            self._starting = True
            thread = threading.Thread(target=self._work, name="aiocuda-sim-worker", daemon=True)
            self._threads.add(thread)
            _start_uncollected(thread)

    def _work(self) -> None:
        with self._cond:
            self._starting = False
        while True:
            with self._cond:
                stream = self._take()
                if stream is None:
                    self._threads.discard(threading.current_thread())
                    return
                if self._ready:
                    self._wake_or_start()
            stream.run_turn()

    def _take(self) -> Schedulable | None:
        """(Lock held.) The next stream to run, waiting for one; None when this worker leaves."""
        while not self.stopping.is_set():
            now = time.monotonic()
            while self._timers and self._timers[0][0] <= now:
                self._ready.append(heapq.heappop(self._timers)[2])
            if self._ready:
                return self._ready.popleft()
            if self._timers and not self._keeper:
                self._keeper = True
                try:
                    self._keeper_cond.wait(self._timers[0][0] - now)
                finally:
                    self._keeper = False
                continue
            self._idle += 1
            try:
                woken = self._cond.wait(self.idle_exit())
            finally:
                self._idle -= 1
            if not woken and not self._ready and (self._keeper or not self._timers):
                return None
        return None


def _start_uncollected(thread: threading.Thread) -> None:
    """Start ``thread`` (the pool's lock held) with automatic garbage collection paused."""
    # Thread.start() waits until the new thread runs. Were the collector to run in that
    # thread first (its bootstrap allocates), a collected DeviceBuffer would free itself
    # on its stream, whose scheduling takes the pool's lock, held here by the starter:
    # the suite hung so, about once in 14 runs of test_graph.py. Starting the thread
    # outside the lock instead changed the pool's timing enough to break a completion
    # test under load (session 21), so the collector waits for the start (microseconds).
    enabled = gc.isenabled()
    gc.disable()
    try:
        thread.start()
    finally:
        if enabled:
            gc.enable()
