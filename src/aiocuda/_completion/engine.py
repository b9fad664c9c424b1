"""The completion engine: "this point in a stream has finished" -> wake the waiting task.

:meth:`CompletionEngine.wait` is what ``await stream`` and ``await event`` run. A wait
goes through these phases, cheapest first:

1. **Already done.** ``cuEventQuery`` says the point has completed: return at once.
2. **About to finish.** When no other task of the loop waits for the GPU and waits at
   this place have been short, spin on the query for up to :data:`SPIN_MAX`: as fast as
   a blocking synchronize for tiny operations, while blocking the loop for less than a
   scheduling quantum. On asyncio a task that did not spin gives up one loop iteration
   with a bare ``yield`` and queries again: with many tasks in flight that is all most
   waits need. While the loop is busy (that iteration ran other tasks for at least
   :data:`~.poller.IDLE_TURN`) and the wait is predicted to end within two more, it
   goes on so, until it ends or its poll window does: a turn costs the loop a few
   microseconds, a wait handed to the poller several times that.
3. **Poll, park, or ring.** The wait joins its loop's poller (:mod:`.poller`). A wait
   expected to end soon is *active*: queried on every loop iteration. A wait expected to
   end later is *parked* until shortly before then, queried now and then meanwhile; if
   the loop would sleep in the meantime, a long parked wait rings its *doorbell*: on a
   private signal stream (:mod:`.signals`), a wait for the event followed by a host
   function that is libc's ``sem_post`` -- no Python and no GIL on the driver's thread --
   wakes the waker thread (:mod:`.waker`), which wakes the loop. A sleeping task costs
   no CPU. On asyncio a wait with a history -- one predicted at most
   :data:`OWN_TURNS_LONGEST`, or any while at most :data:`OWN_TURNS_FEW` waits are
   pending on the loop -- is parked instead, until its poll window (or a turn and the
   prediction's error before its predicted end, if later); then its task is woken and
   queries it once per iteration by itself, as in phase 2, so that it goes on in the
   iteration that finds the end (a wait the poller finds resumes its task an iteration
   later). On a turn with nothing else to run, querying would spin the loop: if the
   predicted end is still far, the wait is parked again until shortly before it (the
   idle poller's lead), its task to be woken then. If the window passes, the wait goes
   back to the poller.

**Predictions.** How long a wait will take is learnt per stream *and* per place in the
code that awaits it (:class:`~.history.WaitHistory`): the waits after a copy and the
waits after a kernel, at two ``await`` lines, are told apart even on one stream.

**Queued waits.** Waits on one stream finish in the order their points were recorded.
A loop's waits that began right after recording their point form a :class:`_Line` per
stream, oldest first; only the oldest is working on its own part of the stream. A wait
queued behind others is not queried at all until the one before it ends; then its own
part is predicted from that moment, and the history learns only that part. (A queue
expected to drain within the poll window is simply polled.) Each loop queues only behind
its own waits: a wait behind another loop's would be found only once that loop had found
the earlier one, and a loop that is stuck, or stopped with waits pending, would hold it
up for good.

**Errors.** A query that raises fails its wait with the error. A poisoned context never
runs host functions, so doorbells do not ring; the waker's periodic check
(:data:`~.waker.POISON_CHECK`) queries sleeping waits, and every wait of a poisoned device
fails with :class:`~aiocuda.errors.ContextPoisonedError`. Parked waits are queried every
:data:`~.poller.RECHECK` and active ones every iteration, so they fail sooner.

**Cancellation** detaches a wait: it is dropped from the poller and the waker, and
never resumed; the GPU work and the memory it uses are untouched. Loop closed or
interpreter exiting with waits in flight: their wake-ups are dropped silently.
"""

from __future__ import annotations

import atexit
import collections
import functools
import sys
import threading
import time
from collections.abc import Callable, Generator, Hashable
from types import FrameType
from typing import TYPE_CHECKING, Any

from .. import _driver
from ..errors import CudaError
from .history import POLL_WINDOW, PREDICTION_LEAD, SPIN_MAX, WaitHistory
from .loops import LoopAdapter, current_adapter
from .poller import ACTIVE, IDLE_TURN, OWN_TURNS, QUEUED, Poller
from .signals import SignalStreams
from .waker import Batch, Waker

if TYPE_CHECKING:
    from ..device import Device

__all__ = ["CompletionEngine", "Waiter", "current_engine"]

_perf = time.perf_counter

# Why a busy loop's waits query in their own tasks: 64 tasks each launching a 1 ms kernel
# and awaiting it keep an asyncio loop busy for about a millisecond per iteration, so
# the query after the first yield often comes just before the kernel's end. Handing
# every such wait to the poller (a Waiter, its planning, a pass, the resume) cost 28 us
# of loop CPU per await where a polling loop of sleep(0) spent 18.6, and aiocuda served
# 35,600 awaits/s to polling's 54,000 (H200). Finding them by yielding: 17.7 us and
# 56,200 awaits/s against polling's 16.9 and 59,100 in the same run, with 0.025 Waiters
# per await; await_latency's service_1ms_cpu_ratio went from 1.21 / 1.22 to 1.01 / 1.00
# (asyncio / uvloop).
#
# And why parked waits are woken into their tasks (phase 3): a wait the poller finds done
# resumes its task one iteration later (asyncio runs a callback scheduled during an
# iteration in the next one), after all the other work that iteration found -- on a busy
# server up to a millisecond. Behind uvicorn at 1800 requests/s (the serve benchmark's
# open loop, 1 ms kernels, H200, 2 rounds against the poller finding them), the p99 of a
# request's time in its endpoint went from 2.25 to 1.50 ms on asyncio (polling's: 1.25-
# 1.42), and the client's p99 from 3.66 to 2.44 ms; with 5 ms kernels 6.34 -> 6.22. On
# uvloop no change beyond the noise (2.40 -> 2.37, 6.31 -> 6.54 ms). CPU per request
# within the noise (-4% to +4%). (benchmarks/results/logs/own-turns-ab.txt)
# Why only short waits (OWN_TURNS_LONGEST): for all waits, await_latency's service load
# on asyncio with 5 ms kernels (64 tasks whose waits come due together) served 3-7% fewer
# awaits per second than with the poller finding them, in four paired runs on the H100;
# waking tasks at the window's start, only on turns of 200 us or more, or at most 4 at a
# time did not win it back. Limited to waits predicted at 2 ms or less: 1.022 of
# polling's throughput at 5 ms, as before (1.018), where all waits had 0.932; at 1 ms
# 0.950 as with all waits (0.945). For 5 ms kernels the serve benchmark's endpoint p99
# had moved by no more than its noise. (benchmarks/results/logs/service-own-turns-ab.txt)
OWN_TURNS_LONGEST = 0.002
"""Longest predicted wait (seconds) whose task finds its end by itself however many waits
are pending; a longer one's does while few are (:data:`OWN_TURNS_FEW`), else the poller
finds it (see phase 3)."""

# Why the final approach in the task whatever its length and however busy the loop, while
# few waits are pending: a wait the poller finds resumes its task one loop iteration later,
# behind the work queued meanwhile. In the serve benchmark's open-loop windows (H200,
# 1540 requests/s, 5 ms kernels) /lanes answered 0.35-0.45 ms after polling at the median
# (benchmarks/results/logs/w5-open-ab.txt); own turns for long waits left the wait with
# the poller once the loop turned idle (a short iteration), and found only 35-40% of
# them. In scripts/ab model (kernels ending at known moments, the same load), a task
# resumed after its 5 ms kernel's end 0.19 -> 0.07 ms on asyncio (polling 0.06) and
# 0.14 -> 0.05 on uvloop (polling 0.01); at 1 ms 0.15 -> 0.03 and 0.11 -> 0.04; CPU per
# request -3% to +7%. On the H200, paired (benchmarks/results/logs/final-approach-ab.txt):
# the endpoint's median at W = 5 went from 0.37-0.47 to 0.07-0.17 ms over polling's, for
# 14-23% more CPU per request (some 12-21 more queries, each a task step), still 9% under
# polling's; at W = 1 within the noise. Saturated (64 tasks, more than OWN_TURNS_FEW
# pending), unchanged. Most of those queries fell on idle turns: with the wait parked
# again on an idle turn until the lead before its end, 8 queries per request instead of
# 21-33, CPU 9-11% lower (0.76-0.82 of polling's), the median 0.07-0.08 ms later.
OWN_TURNS_FEW = 16
"""While at most this many waits are pending on the loop, the task of any predicted wait
finds its end by itself."""

# Bounds on the engine's dicts: streams come and go, and wrapped foreign streams are never
# forgotten; places that await are few, unless code is generated at run time.
_MAX_STREAMS = 4096
_MAX_PLACES = 64


def _place(frame: FrameType) -> Hashable:
    """Where in the code ``frame`` (the coroutine running ``await``) awaits: its line and
    the line that called it, so that waits awaited through a shared helper are told
    apart by the helper's caller."""
    # ids, not code objects: a code object's hash is computed from its contents on every
    # call. (An id reused by a new code object merely shares a history.)
    caller = frame.f_back
    if caller is None:
        return (id(frame.f_code), frame.f_lasti)
    return (id(frame.f_code), frame.f_lasti, id(caller.f_code), caller.f_lasti)


class Waiter:
    """One pending await: what it waits for, how to wake its task, where it is."""

    __slots__ = (
        "adapter",
        "device",
        "done",
        "error",
        "event",
        "head_since",
        "line",
        "next_check",
        "on_finish",
        "own_turns",
        "pending_at",
        "place",
        "poll_from",
        "poll_until",
        "ringing",
        "started",
        "stream",
        "token",
        "where",
    )

    def __init__(
        self,
        event: Any,
        stream: Hashable,
        place: Hashable,
        device: Device,
        adapter: LoopAdapter,
        on_finish: Callable[[Any], None] | None,
        started: float,
    ) -> None:
        self.event = event
        self.stream = stream
        self.place = place
        self.device = device
        self.adapter = adapter
        self.on_finish = on_finish
        self.started = started  # when its await began
        # Since when the work before its point has been done (None while earlier waits of
        # its line are pending): what its history measures from.
        self.head_since: float | None = started
        # When a query last found it pending (the poller keeps it up to date): its point
        # was passed between then and the query that finds it done.
        self.pending_at = _perf()
        self.line: _Line | None = None
        self.where = QUEUED  # see poller.py
        self.poll_from = 0.0
        self.poll_until = 0.0
        self.next_check = 0.0
        # Whether its doorbell is enqueued (the waker lists it either way, and its periodic
        # check queries those whose doorbell could not be enqueued).
        self.ringing = False
        # Whether the poller wakes it shortly before its predicted end to poll in its own
        # task (asyncio, a busy loop), rather than querying it in its passes.
        self.own_turns = False
        self.done = False
        self.error: BaseException | None = None  # it failed while its task polled by itself
        self.token: Any = None

    @property
    def ordinal(self) -> int:
        return self.device.ordinal

    def finish(self) -> None:
        """Mark finished (exactly once), give the event back to its pool and leave the
        stream's line (the next wait in it then becomes the oldest)."""
        if not self.done:
            self.done = True
            if self.on_finish is not None:
                self.on_finish(self.event)
            line, self.line = self.line, None
            if line is not None:
                line.leave(self)


class _Line:
    """The pending waits on one stream that began as their points were recorded, oldest
    first, a queue per loop (see "Queued waits" in the module docstring)."""

    __slots__ = ("_engine", "_queues")

    def __init__(self, engine: CompletionEngine) -> None:
        self._engine = engine
        # A queue per loop, dropped once empty: nothing keeps a gone loop's adapter.
        self._queues: dict[LoopAdapter, collections.deque[Waiter]] = {}

    def __bool__(self) -> bool:
        return bool(self._queues)

    def join(self, waiter: Waiter) -> int:
        """Queue ``waiter`` behind its loop's waits; returns how many are ahead of it."""
        with self._engine._lock:
            queue = self._queues.get(waiter.adapter)
            if queue is None:
                queue = self._queues[waiter.adapter] = collections.deque()
            queue.append(waiter)
            waiter.line = self
            return len(queue) - 1

    def leave(self, waiter: Waiter) -> None:
        """Drop ``waiter`` (any thread); if it was the oldest of its loop's, the next one's
        own part of the stream begins now."""
        engine = self._engine
        with engine._lock:
            queue = self._queues.get(waiter.adapter)
            if queue is None:
                return
            was_oldest = queue[0] is waiter
            try:
                queue.remove(waiter)
            except ValueError:
                return
            if not queue:
                del self._queues[waiter.adapter]
            following = queue[0] if was_oldest and queue else None
        if following is not None:
            engine._promote(following, _perf())


class CompletionEngine:
    """Per-backend state: signal streams, the waker, wait histories and stream lines."""

    def __init__(self, backend: _driver.Driver) -> None:
        self.backend = backend
        self.query = backend.event_query
        self._signals = SignalStreams(backend)
        self.waker = Waker(backend, self._resume_all)
        self._histories: dict[Hashable, dict[Hashable, WaitHistory]] = {}  # stream -> place -> history
        self._lines: dict[Hashable, _Line] = {}
        self._lock = threading.Lock()

    # -- the await ----------------------------------------------------------------------
    def wait(
        self,
        event: Any,
        stream: Hashable,
        device: Device,
        on_finish: Callable[[Any], None] | None = None,
        *,
        just_recorded: bool = False,
        keep: object = None,
    ) -> Generator[Any, Any, None]:
        """Suspend the current task until ``event`` (recorded on ``stream`` of ``device``)
        completes; raise the driver's error if it fails.

        Return this generator from ``__await__`` itself (not from a generator function
        around it): waits are predicted per stream and per place in the code that
        awaits, found from the frame that drives the generator.

        ``on_finish(event)`` runs exactly once when the wait ends for any reason
        (completion, error, cancellation); streams use it to give pooled events back.
        ``just_recorded`` says the event was recorded an instant ago on ``stream``, after
        everything enqueued before: the wait may then join the stream's line, and the
        first query is skipped where the next step queries anyway. ``keep`` stays
        referenced until the wait ends (an ``Event`` whose collection would give its
        handle back to a pool).
        """
        started = _perf()
        query = self.query
        waiter: Waiter | None = None
        try:
            adapter = current_adapter()
            place: Hashable = None
            history: WaitHistory | None = None
            places = self._histories.get(stream)
            if not adapter.waiting:
                place = _place(sys._getframe(1))
                history = places.get(place) if places is not None else None
                if (history is None or history.expected < SPIN_MAX) and self._spin(event, stream, place, history):
                    return
            elif not (just_recorded and adapter.bare_yield) and query(event):
                return
            adapter.waiting += 1
            try:
                turn = None
                if adapter.bare_yield:
                    # One loop iteration for free: the cheapest reschedule asyncio has.
                    yield
                    if query(event):
                        return
                    turned = _perf()
                    turn = turned - started
                if place is None:
                    place = _place(sys._getframe(1))
                    history = places.get(place) if places is not None else None
                if turn is not None and history is not None:
                    end = started + history.expected
                    if turn >= IDLE_TURN and end <= turned + 2 * turn:
                        # (its history is left as it is if it ends here: a wrong one sends
                        # the next wait to the poller, which learns)
                        turn = yield from self._own_turns(event, None, end, started + history.poll_window()[1], turned)
                        if turn is None:
                            return
                # Measured and predicted from the await's start, not from here: the
                # iterations yielded above last from microseconds to a millisecond on a
                # busy loop, and a history measured after them learnt the kernel's length
                # less that delay.
                waiter = Waiter(event, stream, place, device, adapter, on_finish, started)
                # Waits known to take microseconds are polled whatever is ahead of them:
                # they skip the line's bookkeeping.
                lined = just_recorded and (history is None or history.expected >= SPIN_MAX)
                ahead = self._line(stream).join(waiter) if lined else 0
                if ahead:
                    waiter.head_since = None
                self._schedule(waiter, history, ahead, turn)
                while True:
                    yield from adapter.suspend(waiter)
                    if not waiter.done:  # woken to poll in its own task (see Waiter.own_turns)
                        yield from self._polled_by_task(waiter)
                    if waiter.done:
                        error, waiter.error = waiter.error, None  # (no cycle through the traceback)
                        if error is not None:
                            raise error
                        return
            except BaseException:
                if waiter is not None and not waiter.done:
                    waiter.finish()  # cancelled (or failed) while polling in its own task: detach
                raise
            finally:
                adapter.waiting -= 1
        finally:
            if waiter is None and on_finish is not None:
                on_finish(event)

    def _spin(self, event: Any, stream: Hashable, place: Hashable, history: WaitHistory | None) -> bool:
        """Query in a tight loop for up to SPIN_MAX; True if the event completed."""
        query = self.query
        start = _perf()
        deadline = start + SPIN_MAX
        while True:
            if query(event):
                self._learn(stream, place, history, _perf() - start)
                return True
            if _perf() > deadline:
                return False

    def _own_turns(
        self, event: Any, waiter: Waiter | None, end: float, until: float, turned: float
    ) -> Generator[None, None, float | None]:
        """Query ``event`` once per loop iteration in the waiting task itself (asyncio's
        bare ``yield``), while the loop is busy, the predicted ``end`` is at most two
        turns away and ``until`` has not passed. Returns None once the event completed
        (or ``waiter`` ended meanwhile), else the length of the last turn."""
        query = self.query
        while True:
            yield
            if waiter is not None and waiter.done:
                return None
            if query(event):
                if waiter is not None:
                    self._found(waiter, _perf())
                return None
            now = _perf()
            if waiter is not None:
                waiter.pending_at = now
            turn, turned = now - turned, now
            if turn < IDLE_TURN or end > now + 2 * turn or now > until:
                return turn

    def _polled_by_task(self, waiter: Waiter) -> Generator[None, None, None]:
        """``waiter``'s task was woken shortly before the predicted end of its wait: poll
        it there until its poll window passes, then (overdue) hand it back to the poller.
        When the loop turns only for this task, it is parked again until the lead before
        its predicted end (if that is far enough), its task to be woken then."""
        poller = self._poller(waiter.adapter)
        try:
            if self.query(waiter.event):
                self._found(waiter, _perf())
                return
            waiter.pending_at = now = _perf()
            while True:
                # (its end counts as near from now on: it was woken for it)
                turn = yield from self._own_turns(waiter.event, waiter, now, waiter.poll_until, now)
                if turn is None:
                    return
                now = _perf()
                if now > waiter.poll_until:
                    break
                # an idle turn: sleep, not spin, till near the end
                wake = poller.idle_wake(waiter, now, poller.idle_lead())
                if wake is not None:
                    poller.park(waiter, wake, waiter.poll_until)
                    return
        except CudaError as exc:
            waiter.error = exc
            waiter.finish()
            return
        waiter.own_turns = False
        poller.poll(waiter, waiter.poll_until)

    def _found(self, waiter: Waiter, now: float) -> None:
        """``waiter``'s own task found its event completed at ``now``."""
        self._learn_end(waiter, now, polled=True)
        waiter.finish()

    # -- histories and lines -------------------------------------------------------------------
    def _history(self, waiter: Waiter) -> WaitHistory | None:
        places = self._histories.get(waiter.stream)
        return places.get(waiter.place) if places is not None else None

    def _learn(self, stream: Hashable, place: Hashable, history: WaitHistory | None, duration: float) -> None:
        if history is not None:
            history.add(duration)
            return
        places = self._histories.get(stream)
        if places is None:
            if len(self._histories) > _MAX_STREAMS:
                self._histories.clear()
            places = self._histories[stream] = {}
        elif len(places) > _MAX_PLACES:
            places.clear()
        places[place] = WaitHistory(duration)

    def prepare(self, device: Device) -> None:
        """Have what ``device``'s doorbells need made ahead of time, off the loop (call
        when a stream of the device is made: cheap after the first time)."""
        self._signals.prepare(device)

    def forget(self, stream: Hashable) -> None:
        """Drop ``stream``'s wait histories and line (it is being destroyed)."""
        self._histories.pop(stream, None)
        self._lines.pop(stream, None)

    def _line(self, stream: Hashable) -> _Line:
        """``stream``'s line, kept while the stream lives (an await is the hot path)."""
        line = self._lines.get(stream)
        if line is None:
            with self._lock:
                if len(self._lines) > _MAX_STREAMS:
                    self._lines = {key: kept for key, kept in self._lines.items() if kept}
                line = self._lines.setdefault(stream, _Line(self))
        return line

    # -- planning --------------------------------------------------------------------------------
    def _poller(self, adapter: LoopAdapter) -> Poller:
        poller = adapter.poller
        if poller is None or poller.engine is not self:  # first wait, or the backend was switched
            poller = adapter.poller = Poller(self, adapter)
        return poller  # type: ignore[no-any-return]

    def _schedule(self, waiter: Waiter, history: WaitHistory | None, ahead: int, turn: float | None) -> None:
        """Plan a new wait (on its loop's thread). With ``ahead`` waits queued before it
        that will not all end within the poll window, it waits for its turn
        (:meth:`_promote`). ``turn``: how long the loop's last iteration took, where the
        wait's task can poll by itself (asyncio)."""
        if (
            turn is not None
            and history is not None
            and not ahead
            and (history.expected <= OWN_TURNS_LONGEST or waiter.adapter.waiting <= OWN_TURNS_FEW)
        ):
            # Parked until its poll window, or a turn (and the prediction's error) before
            # its predicted end if that is later, then woken to poll in its own task.
            start, end = history.poll_window()
            start = max(start, history.expected - (history.spread + turn))
            waiter.own_turns = True
            self._poller(waiter.adapter).park(waiter, waiter.started + start, waiter.started + end)
            return
        if history is None or history.expected * (ahead + 1) < POLL_WINDOW:
            self._poller(waiter.adapter).poll(waiter, waiter.started + POLL_WINDOW)
        elif not ahead:
            self._plan(waiter, history, waiter.started)
        # else: queued; its turn comes when the waits ahead of it have ended

    def _plan(self, waiter: Waiter, history: WaitHistory | None, since: float) -> None:
        """Poll or park ``waiter`` around its predicted end, its own part having begun at
        ``since``."""
        if history is None or history.expected < POLL_WINDOW:
            start, end = 0.0, POLL_WINDOW
        else:
            start, end = history.poll_window()
        poller = self._poller(waiter.adapter)
        if start <= PREDICTION_LEAD:
            poller.poll(waiter, max(waiter.poll_until, since + end))
        else:
            poller.park(waiter, since + start, since + end)

    def _promote(self, waiter: Waiter, now: float) -> None:
        """``waiter`` became the oldest wait of its line at ``now`` (any thread)."""
        if waiter.adapter.thread != threading.get_ident():
            waiter.adapter.call_soon_threadsafe(functools.partial(self._promote, waiter, now))
            return
        waiter.head_since = now
        if waiter.done:
            return
        history = self._history(waiter)
        if waiter.where == ACTIVE and (history is None or history.expected < POLL_WINDOW):
            waiter.poll_until = max(waiter.poll_until, now + POLL_WINDOW)
        else:
            self._plan(waiter, history, now)

    # -- ends of waits ---------------------------------------------------------------------------
    def complete(self, waiter: Waiter, now: float, *, polled: bool = True) -> None:
        """Resume a wait whose event completed (on its loop's thread), learning how long
        its own part took: found ``polled`` at ``now``, it ended at some moment since
        the last query found it pending, and the middle is learnt; rung, about ``now``."""
        if waiter.done:
            return
        self._learn_end(waiter, now, polled=polled)
        waiter.adapter.resume(waiter, None)

    def _learn_end(self, waiter: Waiter, now: float, *, polled: bool) -> None:
        """Learn how long ``waiter``'s own part took, found done at ``now``."""
        since = waiter.head_since
        if since is not None:  # (else the waits before it just ended too: no measure)
            # Learning the find time itself would teach the history every lateness of the
            # finding (a parked wait is found at its next check): the next wait would be
            # parked later still, and found later. Measured on the serve benchmark's
            # open-loop windows (H200, 5 ms kernels): answers 0.77 ms later than polling.
            ended = (max(waiter.pending_at, since) + now) / 2 if polled else now
            self._learn(waiter.stream, waiter.place, self._history(waiter), ended - since)

    def _resume_all(self, batch: Batch) -> None:
        """The waker's finished waits of one loop (on that loop's thread)."""
        now = _perf()
        for waiter, error in batch:
            if error is None:
                self.complete(waiter, now, polled=False)
            elif not waiter.done:
                if waiter.where == OWN_TURNS:
                    waiter.error = error  # its task polls by itself, its future set: it raises this
                waiter.adapter.resume(waiter, error)

    def ring(self, waiter: Waiter) -> None:
        """List ``waiter`` with the waker, then enqueue its doorbell."""
        waiter.ringing = True
        self.waker.listen(waiter)
        try:
            self._signals.ring_after(waiter.device, waiter.event, self.waker.bell)
        except CudaError:
            waiter.ringing = False  # poisoned context, most likely: the periodic check queries it

    def stop(self) -> None:
        """Stop the waker thread (interpreter exit, backend switch)."""
        self.waker.stop()


_engine: CompletionEngine | None = None
_engine_generation = -1


def current_engine() -> CompletionEngine:
    """The completion engine of the backend in use."""
    global _engine, _engine_generation
    generation = _driver.backend_generation()
    if _engine is None or _engine_generation != generation:
        backend = _driver.driver()
        if _engine is not None:
            _engine.stop()
        _engine = CompletionEngine(backend)
        _engine_generation = _driver.backend_generation()
    return _engine


@atexit.register
def _stop_at_exit() -> None:
    if _engine is not None:
        _engine.stop()
