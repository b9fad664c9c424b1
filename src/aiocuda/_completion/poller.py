"""A loop's poller: the waits it queries, and when it queries them.

One :class:`Poller` per event loop and engine, touched only from the loop's thread. It
holds waits in two places:

* **active** waits are queried on every pass, and a pass runs on every loop iteration
  while any wait is active: a wait expected to end soon is seen ending within
  microseconds. But when the loop turns only for the poller (a pass follows the last
  within :data:`IDLE_TURN`), querying on every turn is a spin that keeps the loop from
  sleeping: an active wait that would sleep at least :data:`IDLE_PARK` is then parked
  until shortly before its predicted end (the lead: how late the loop's timer tends to
  wake it), and the loop sleeps meanwhile.
* **parked** waits are expected to end later. Each is queried again at its *next
  check*: every :data:`RECHECK` seconds (in case it ends early), and from its predicted
  end on it is active -- or, if it was parked to poll in its own task (asyncio:
  ``Waiter.own_turns``), its task is woken then and queries it once per iteration
  itself, until a turn with nothing else to run parks it again
  (:meth:`Poller.idle_wake`). Passes run anyway while the loop turns; when no wait is
  active the poller arms a timer for the next check and the loop may sleep.

A doorbell (a GPU-side wake-up through the waker thread, :mod:`.waker`) costs more CPU
than querying a wait while the loop turns anyway, and wakes a task later than polling
does; it pays off only while the loop would otherwise sleep. So a wait is rung only when
the poller goes idle (no wait active) and the wait is expected to sleep for more than
:data:`RING_AFTER`, or has been *overdue* (pending past its poll window) for that long.
A rung wait is no longer rechecked: its doorbell wakes it, or its predicted end does.

A wait that was never predicted polls for its first poll window; if still pending it is
overdue, and is rechecked every :data:`RECHECK` until it ends or is rung.
"""

from __future__ import annotations

import heapq
import itertools
import time
from typing import TYPE_CHECKING

from ..errors import CudaError

if TYPE_CHECKING:
    from .engine import CompletionEngine, Waiter
    from .loops import LoopAdapter

__all__ = [
    "ACTIVE",
    "ASLEEP",
    "IDLE_LEAD",
    "IDLE_PARK",
    "IDLE_TURN",
    "LEAD_MARGIN",
    "OWN_TURNS",
    "PARKED",
    "QUEUED",
    "RECHECK",
    "RING_AFTER",
    "Poller",
]

RECHECK = 0.001
"""Seconds between queries of a parked wait that has no doorbell (about the resolution of
a loop's timers)."""

RING_AFTER = 0.005
"""A parked wait gets a doorbell, once the loop may sleep, if its next active phase is
further off than this, or if it has been overdue for this long (seconds)."""

IDLE_TURN = 50e-6
"""A pass that follows the previous one within this many seconds found the loop with
nothing else to do: it turns only for the poller."""

IDLE_PARK = 0.0001
"""In a loop that turns only for the poller, an active wait is parked if it would sleep
at least this long (seconds) before the lead ahead of its predicted end."""

IDLE_LEAD = 0.0002
"""The lead (seconds) of a loop whose timer's lateness is not known: a parked wait polls
again this long before its predicted end. A loop's timer (:mod:`.timer`) learns its own
lateness, and the lead is then that plus :data:`LEAD_MARGIN`, at most this."""

LEAD_MARGIN = 50e-6
"""Added to a timer's lateness for the lead: the prediction's error (seconds)."""

# Where a pending wait is (Waiter.where). A doorbell (Waiter.ringing) is orthogonal: a
# rung wait may still be parked until its predicted end, or active.
QUEUED = 0
"""In its stream's line behind earlier waits: nothing queries it until it is the oldest."""
ACTIVE = 1
PARKED = 2
ASLEEP = 3
"""Rung and not in the poller: only its doorbell (or the waker's periodic check) wakes it."""
OWN_TURNS = 4
"""Woken to poll in its own task (asyncio): not in the poller."""

# Why IDLE_PARK: a service at half its saturation rate (uvicorn, 1 ms kernels, H100) has
# a wait active almost all the time; querying it on every turn spun the loop, and the
# server burnt 0.46 ms of CPU per request where it needs 0.22 at saturation -- as much as
# a polling loop of sleep(0). Under load the loop turns anyway and the passes are free.

_INF = float("inf")
_FAR_PRUNE = 256  # a loop that never goes idle never empties its far list: prune it
_perf = time.perf_counter


def _stale(entry: tuple[float, int, Waiter]) -> bool:
    """Whether a parked entry's wait finished, moved or was re-planned since."""
    when, _, w = entry
    return w.done or w.where != PARKED or when != w.next_check


class Poller:
    """The active and parked waits of one loop (see the module docstring)."""

    __slots__ = (
        "_active",
        "_far",
        "_parked",
        "_passed",
        "_running",
        "_scheduled",
        "_sequence",
        "_spinning",
        "_timer_at",
        "adapter",
        "engine",
    )

    def __init__(self, engine: CompletionEngine, adapter: LoopAdapter) -> None:
        self.engine = engine
        self.adapter = adapter
        self._active: list[Waiter] = []
        self._parked: list[tuple[float, int, Waiter]] = []  # (next check, tie-break, wait)
        self._far: list[Waiter] = []  # parked, not rung, to be rung if the loop goes idle
        self._sequence = itertools.count()
        self._scheduled = False  # a pass is queued for the next loop iteration
        self._running = False  # a pass is running (it decides what comes next itself)
        self._timer_at = _INF  # a timed pass is armed for then
        self._spinning = False  # the next pass was queued by the last one (call_soon)
        self._passed = 0.0  # when the last pass ended

    def __len__(self) -> int:
        return len(self._active) + len(self._parked)

    # -- adding waits -------------------------------------------------------------------------
    def poll(self, waiter: Waiter, until: float) -> None:
        """Query ``waiter`` on every pass from now until ``until`` (then it is overdue)."""
        waiter.poll_until = until
        if waiter.where != ACTIVE:
            waiter.where = ACTIVE
            self._active.append(waiter)
        if not (self._scheduled or self._running):
            self._scheduled = True
            self.adapter.call_soon(self.run)

    def park(self, waiter: Waiter, poll_from: float, poll_until: float) -> None:
        """Query ``waiter`` now and then until ``poll_from``, then on every pass until
        ``poll_until``."""
        now = _perf()
        waiter.poll_from, waiter.poll_until = poll_from, poll_until
        waiter.where = PARKED
        if not waiter.ringing and poll_from - now > RING_AFTER:
            if len(self._far) > _FAR_PRUNE:
                self._far = [w for w in self._far if not (w.done or w.ringing)]
            self._far.append(waiter)
        self._push(waiter, poll_from if waiter.ringing else min(poll_from, now + RECHECK))
        if not (self._scheduled or self._running):
            self._idle(now)

    def _push(self, waiter: Waiter, when: float) -> None:
        waiter.next_check = when
        if when == _INF:
            waiter.where = ASLEEP
        else:
            heapq.heappush(self._parked, (when, next(self._sequence), waiter))

    # -- passes ---------------------------------------------------------------------------------
    def run(self) -> None:
        """One pass: query due parked waits and every active one; resume those finished."""
        self._scheduled = False
        self._running = True
        try:
            now = _perf()
            idle = self._spinning and now - self._passed < IDLE_TURN
            self._check_parked(now)
            self._check_active(now)
            if idle and self._active:
                self._park_far(now)
        finally:
            self._running = False
            self._passed = _perf()
        self._spinning = bool(self._active)
        if self._active:
            self._scheduled = True
            self.adapter.call_soon(self.run)
        else:
            self._idle(now)

    def _check_parked(self, now: float) -> None:
        parked = self._parked
        query = self.engine.query
        while parked and parked[0][0] <= now:
            when, _, w = heapq.heappop(parked)
            if _stale((when, 0, w)):
                continue
            if now >= w.poll_from:
                if w.own_turns:
                    w.where = OWN_TURNS
                    self.adapter.wake(w)
                else:
                    w.where = ACTIVE
                    self._active.append(w)
                continue
            try:
                finished = query(w.event)
            except CudaError as exc:
                self.adapter.resume(w, exc)
                continue
            if finished:
                self.engine.complete(w, now)
            else:
                w.pending_at = now
                self._push(w, w.poll_from if w.ringing else min(w.poll_from, now + RECHECK))

    def _check_active(self, now: float) -> None:
        query = self.engine.query
        still: list[Waiter] = []
        active = self._active
        self._active = still  # waits that become active meanwhile (promoted ones) go here
        for w in active:
            if w.done or w.where != ACTIVE:
                continue
            try:
                finished = query(w.event)
            except CudaError as exc:
                self.adapter.resume(w, exc)
                continue
            if finished:
                self.engine.complete(w, now)
                continue
            w.pending_at = now
            if now < w.poll_until:
                still.append(w)
            elif w.ringing:
                w.where = ASLEEP  # outlasted its window: its doorbell wakes it
            else:  # overdue: rechecked while the loop turns, rung if it goes idle
                w.where = PARKED
                w.poll_from = _INF
                self._far.append(w)
                self._push(w, now + RECHECK)

    def idle_lead(self) -> float:
        """How long before a predicted end an idle loop queries a wait again: how late
        its timer wakes, plus LEAD_MARGIN, at most IDLE_LEAD (seconds)."""
        late = self.adapter.timer_lateness()
        return IDLE_LEAD if late is None else min(IDLE_LEAD, late + LEAD_MARGIN)

    def idle_wake(self, waiter: Waiter, now: float, lead: float) -> float | None:
        """When an idle loop should query ``waiter`` again: ``lead`` (:meth:`idle_lead`)
        before its predicted end, if that is at least IDLE_PARK after ``now``; else None
        (keep querying it)."""
        head = waiter.head_since
        if head is None:
            return None
        history = self.engine._history(waiter)
        if history is None:
            return None
        wake = head + history.expected - lead
        return wake if wake - now >= IDLE_PARK else None

    def _park_far(self, now: float) -> None:
        """The loop turns only for this poller: park the active waits that would sleep
        at least IDLE_PARK until the lead before their predicted end, so that it may."""
        lead = self.idle_lead()
        still: list[Waiter] = []
        for w in self._active:
            wake = self.idle_wake(w, now, lead)
            if wake is None:
                still.append(w)  # no prediction, or its end is near: keep querying it
                continue
            w.poll_from = wake
            w.where = PARKED
            self._push(w, wake if w.ringing else min(wake, now + RECHECK))
        self._active = still

    def _idle(self, now: float) -> None:
        """No wait is active, so the loop may sleep: ring the waits that would sleep long,
        and arm a timer for the next check of the others."""
        far, self._far = self._far, []
        for w in far:
            if w.done or w.ringing or w.where != PARKED:
                continue
            if w.poll_from == _INF:  # overdue since poll_until
                if now - w.poll_until < RING_AFTER:
                    self._far.append(w)  # not for long yet: rechecked, and rung if still pending at a later idle
                    continue
            elif w.poll_from - now <= RING_AFTER:
                continue  # its active phase is near now: the timer is enough
            self.engine.ring(w)
            if w.ringing:
                self._push(w, w.poll_from)
        parked = self._parked
        while parked and _stale(parked[0]):
            heapq.heappop(parked)  # do not wake up for them
        if parked:
            self._arm(parked[0][0])

    # -- timers ---------------------------------------------------------------------------------
    def _arm(self, when: float) -> None:
        if when >= self._timer_at:
            return
        self._timer_at = when
        adapter = self.adapter
        if not adapter.call_at(when, self._timed):
            self.engine.waker.call_at(when, adapter, self._timed)

    def _timed(self) -> None:
        self._timer_at = _INF
        if not (self._scheduled or self._running):
            self.run()
