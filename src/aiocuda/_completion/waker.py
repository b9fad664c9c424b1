"""The waker: one thread that sleeps on the doorbell and wakes loops for finished waits.

Waits that sleep are *listed* with the waker (:meth:`Waker.listen`) and have a doorbell
enqueued on the GPU, which posts the waker's semaphore when their event completes. The
waker thread then has two reasons to wake up:

1. **Rings.** The doorbell's :meth:`~aiocuda._driver._doorbell.SemaphoreDoorbell.wait`
   returns how many posts it drained. Some of them may be *pokes*: posts made by Python
   code to make the waker plan again (a new listed wait, an earlier timed call). The
   waker counts off exactly as many pokes as were made; any post left over is a ring,
   and a ring makes it query every listed wait.
2. **The clock.** While waits are listed it wakes at least every :data:`POISON_CHECK`
   seconds. A context with a sticky error never runs host functions, so its doorbells
   never ring: the periodic check queries one wait per device (a poisoned context's
   query raises, and the error then fails every listed wait of that device), every wait
   whose doorbell could not be enqueued, and :data:`FALLBACK_QUERIES` more in rotation,
   so that no wait can stay asleep behind one that never completes. It also runs timed
   calls (:meth:`Waker.call_at`) for loops that have no timers of their own.

Finished waits are handed to their loop in one batch per loop and wake-up
(``call_soon_threadsafe`` / ``run_sync_soon``); a loop that is gone drops them.
"""

from __future__ import annotations

import copy
import functools
import heapq
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import CudaError

if TYPE_CHECKING:
    from .loops import LoopAdapter

__all__ = ["FALLBACK_QUERIES", "POISON_CHECK", "Listed", "Waker", "WakerStatistics"]

POISON_CHECK = 0.01
"""Longest time (seconds) the waker sleeps while waits are listed with it."""

FALLBACK_QUERIES = 32
"""Listed waits queried on each periodic check besides one per device, in rotation."""

_IDLE_SLEEP = 3600.0  # nothing listed, nothing timed: a poke wakes it
_perf = time.perf_counter

Batch = list[tuple[Any, BaseException | None]]
"""Finished waits of one loop, each with the error it failed with (None: completed)."""


class Listed(Protocol):
    """What the waker needs of a listed wait (the engine's ``Waiter``)."""

    event: Any
    ringing: bool
    """Whether its doorbell is enqueued (else only the periodic check can find it)."""

    @property
    def done(self) -> bool: ...

    @property
    def adapter(self) -> LoopAdapter: ...

    @property
    def ordinal(self) -> int:
        """Its device's ordinal."""

    def finish(self) -> None: ...


@dataclass(frozen=True, slots=True)
class WakerStatistics:
    """Counts since the waker was made (for tests and benchmarks)."""

    listed: int
    """Waits listed now."""
    wakeups: int
    rings: int
    """Posts of the doorbell by the GPU (drained posts that were not pokes)."""
    pokes: int
    sweeps: int
    """Wake-ups that queried every listed wait (a ring was among the posts)."""
    periodic_checks: int


class Waker:
    """The waker thread and what it watches: listed waits and timed calls.

    ``resume(batch)`` is called on a loop's thread with that loop's finished waits.
    """

    def __init__(self, backend: Any, resume: Callable[[Batch], None]) -> None:
        self.bell = backend.new_doorbell()
        self._query = backend.event_query
        self._resume = resume
        self._lock = threading.Lock()
        self._listed: list[Listed] = []
        self._rotation = 0
        self._timed: list[tuple[float, int, LoopAdapter, Callable[[], None]]] = []
        self._sequence = itertools.count()
        # All under _lock: when the thread wakes up next on its own, and when the next
        # periodic check is due (inf while nothing is listed).
        self._wakes_at = float("inf")
        self._next_check = float("inf")
        # Posts made to make the thread plan again that it has not counted off yet. A poke
        # is counted before it is posted, so a drain may count a ring as a poke: the poke's
        # own post then comes right after and is counted as the ring. The total is exact.
        self._pokes = 0
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._counts = dict.fromkeys(("wakeups", "rings", "pokes", "sweeps", "periodic_checks"), 0)

    # -- called from loops' threads ------------------------------------------------------
    def listen(self, waiter: Listed) -> None:
        """List ``waiter``; call *before* enqueuing its doorbell (a ring swept before the
        waiter is listed would find nothing to wake)."""
        with self._lock:
            if not self._listed:
                self._next_check = _perf() + POISON_CHECK
            self._listed.append(waiter)
            self._wake_by(self._next_check)

    def call_at(self, when: float, adapter: LoopAdapter, fn: Callable[[], None]) -> None:
        """Run ``fn`` on ``adapter``'s loop at ``when`` (a ``perf_counter`` reading)."""
        with self._lock:
            heapq.heappush(self._timed, (when, next(self._sequence), adapter, fn))
            self._wake_by(when)

    def _wake_by(self, when: float) -> None:
        """Make sure the thread wakes up by ``when`` (``_lock`` held)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="aiocuda-waker", daemon=True)
            self._thread.start()
        if when < self._wakes_at:
            self._wakes_at = when
            self._pokes += 1
            self._counts["pokes"] += 1
            self.bell.ring()

    def statistics(self) -> WakerStatistics:
        with self._lock:
            return WakerStatistics(listed=len(self._listed), **self._counts)

    def stop(self) -> None:
        """Stop the thread (interpreter exit, backend switch)."""
        self._stopping = True
        self.bell.ring()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=1.0)

    # -- the thread -------------------------------------------------------------------------
    def _run(self) -> None:
        bell = self.bell
        counts = self._counts
        while not self._stopping:
            drained = bell.wait(self._plan())
            if self._stopping:
                break
            with self._lock:
                pokes = min(drained, self._pokes)
                self._pokes -= pokes
                counts["wakeups"] += 1
                counts["rings"] += drained - pokes
            now = _perf()
            rung = drained > pokes
            periodic = now >= self._next_check
            if rung or periodic:
                self._sweep(everyone=rung, periodic=periodic)
            if self._timed and self._timed[0][0] <= now:
                self._run_due(now)

    def _plan(self) -> float:
        """Seconds to sleep: until the next periodic check or timed call."""
        with self._lock:
            wake_at = self._next_check
            if self._timed:
                wake_at = min(wake_at, self._timed[0][0])
            self._wakes_at = wake_at
            if wake_at == float("inf"):
                return _IDLE_SLEEP
            return max(0.0, wake_at - _perf())

    def _sweep(self, *, everyone: bool, periodic: bool) -> None:
        """Resume listed waits that finished or failed.

        Rung: query them all. A periodic check: one per device, those whose doorbell
        could not be enqueued, and the next :data:`FALLBACK_QUERIES` in rotation.
        """
        with self._lock:
            waiters, self._listed = self._listed, []
            if periodic:
                self._next_check = float("inf")
                self._counts["periodic_checks"] += 1
            if everyone:
                self._counts["sweeps"] += 1
        count = len(waiters)
        first = self._rotation % count if count else 0
        if periodic and not everyone:
            self._rotation = first + FALLBACK_QUERIES
        batches: dict[int, tuple[LoopAdapter, Batch]] = {}
        keep: list[Listed] = []
        failed: dict[int, BaseException] = {}
        probed: set[int] = set()
        query = self._query
        for index, w in enumerate(waiters):
            if w.done:
                continue
            ordinal = w.ordinal
            error = failed.get(ordinal)
            if error is not None:
                error = _own_copy(error)
            finished = error is not None
            if not finished and (
                everyone or not w.ringing or ordinal not in probed or 0 <= (index - first) % count < FALLBACK_QUERIES
            ):
                probed.add(ordinal)
                try:
                    finished = query(w.event)
                except CudaError as exc:
                    finished, error = True, exc
                    failed[ordinal] = exc
            if finished:
                batches.setdefault(id(w.adapter), (w.adapter, []))[1].append((w, error))
            else:
                keep.append(w)
        with self._lock:
            if keep:
                self._listed[:0] = keep  # before any listed meanwhile: the rotation stays fair
            if self._listed and self._next_check == float("inf"):
                self._next_check = _perf() + POISON_CHECK
        for adapter, batch in batches.values():
            if not adapter.call_soon_threadsafe(functools.partial(self._resume, batch)):
                for w, _ in batch:  # the loop is gone: nobody is left to wake
                    w.finish()

    def _run_due(self, now: float) -> None:
        """Send timed calls that are due to their loops, one batch per loop."""
        due: dict[int, tuple[LoopAdapter, list[Callable[[], None]]]] = {}
        with self._lock:
            while self._timed and self._timed[0][0] <= now:
                _, _, adapter, fn = heapq.heappop(self._timed)
                due.setdefault(id(adapter), (adapter, []))[1].append(fn)
        for adapter, fns in due.values():
            adapter.call_soon_threadsafe(functools.partial(_run_all, fns))


def _own_copy(error: BaseException) -> BaseException:
    """A copy of ``error`` (one query's) for one more wait of the device it fails."""
    # One exception object raised in several tasks gathers each task's frames: a raise
    # adds the raising frames to the object's traceback, and trio's outcome does not put
    # the old one back as asyncio's futures do (four waits failed by one poisoning: 23
    # frames in the last task's traceback, from all four tasks, against 6 on asyncio).
    # Its context would be the last handler's, too. So each wait gets its own, which
    # starts from the query's traceback (raising extends a traceback, never changes it).
    try:
        twin = copy.copy(error)
    except Exception:  # (an exception type that cannot be rebuilt from its args)
        return error
    if type(twin) is not type(error) or twin is error:
        return error
    twin.__cause__, twin.__suppress_context__ = error.__cause__, error.__suppress_context__
    twin.__context__, twin.__traceback__ = error.__context__, error.__traceback__
    return twin


def _run_all(fns: list[Callable[[], None]]) -> None:
    for fn in fns:
        fn()
