"""The completion engine: "this point in a stream has finished" -> wake the waiting task.

An await goes through these phases, cheapest first:

1. **Already done.** ``cuEventQuery`` says the point has completed: return at once.
2. **About to finish.** When no other task on the loop waits for the GPU and waits on
   this stream have been short, spin on the query for up to :data:`SPIN_MAX`: as fast
   as a blocking ``cuStreamSynchronize`` for tiny operations, while blocking the loop
   for less than a scheduling quantum. On asyncio a task that did not spin gives up one
   loop iteration with a bare ``yield`` (the cheapest reschedule there is) and queries
   again: with many tasks in flight that is all most waits need.
3. **Poll.** The waiter joins the loop's *poller*: one callback per loop iteration
   queries every pending event and resolves the finished ones, so many completions in
   one iteration cost one pass. Polling wakes a task within microseconds, but keeps the
   loop busy, so a waiter polls for at most :data:`POLL_WINDOW`...
4. **Doorbell.** ...then its wait is handed to the *doorbell*: on a private signal
   stream of the device, ``cuStreamWaitEvent`` on the waited event followed by a host
   function that is libc's ``sem_post`` -- no Python and no GIL on the driver's thread.
   One waker thread sleeps on the semaphore, queries the long waiters when rung, and
   wakes each loop once (``call_soon_threadsafe`` / ``run_sync_soon``) for all of that
   loop's finished waiters. A waiting task costs no CPU.

**Predicted waits.** Going to sleep has a price: on the virtual machines GPUs are rented
in, each sleeping thread the wake-up passes through (the driver's callback thread, the
waker, the loop) adds about 100 us, so a doorbell wakes a task 150-450 us after the GPU
finished, where polling takes 5. The engine therefore remembers how long waits on each
stream took (:class:`WaitHistory`). A wait expected to last longer than the poll
window rings its doorbell at once and sleeps, but the waker hands it back to the poller
shortly before its expected end: a repeated long operation (a large copy, a model's
forward pass) is seen finishing within microseconds while costing CPU only for a
narrow window around its end. The window is capped (:data:`MAX_POLL_SHARE`), so a
wrong guess costs bounded CPU, and the doorbell, already enqueued, still wakes the
task if the guess was too early.

**Queued waits.** Waits on one stream finish in the order their points were recorded,
so a wait recorded while earlier ones on the same stream are pending cannot finish
before them: with a pipeline's chunks all awaiting one download stream, the length of
each whole wait says little about when it ends, while the time from the end of the wait
before it (one chunk's download) is steady. So the waits that began right after
recording their point form a :class:`_Line` per stream; the history learns only the
oldest's time since the wait before it ended, and a wait queued behind others sleeps on
its doorbell until it becomes the oldest, then is predicted from that moment. (A queue
expected to drain within the poll window is simply polled, and waits known to take
microseconds skip the line altogether.)

**Sticky errors.** The driver never runs host functions once a context is poisoned, so
a doorbell would never ring. While long waits exist the waker also wakes every
:data:`POISON_CHECK` seconds and queries one waiter per device; a query that raises
:class:`~aiocuda.errors.ContextPoisonedError` fails every long waiter of that device.
(The driver itself reports the fault of an illegal-address kernel some 100-150 ms after
it happens; this check adds at most ``POISON_CHECK`` to that.)

Cancellation detaches a waiter: it is dropped from the poller and the waker and its
future is never resolved; the GPU work and the memory it uses are untouched. Loop
closed or interpreter exiting with waits in flight: their wake-ups are dropped silently.
"""

from __future__ import annotations

import atexit
import collections
import functools
import threading
import time
from collections.abc import Callable, Generator, Hashable
from typing import TYPE_CHECKING, Any

from .. import _driver
from ..errors import CudaError
from .history import POLL_WINDOW, PREDICTION_LEAD, SPIN_MAX, WaitHistory
from .loops import LoopAdapter, current_adapter
from .signals import SignalStreams
from .waker import POISON_CHECK, Waker

if TYPE_CHECKING:
    from ..device import Device

__all__ = ["POISON_CHECK", "CompletionEngine", "Waiter", "current_engine"]

_perf = time.perf_counter


class Waiter:
    """One pending await: what it waits for, how to wake its task, and its phase."""

    __slots__ = (
        "adapter",
        "device",
        "done",
        "event",
        "head_since",
        "line",
        "on_finish",
        "poll_until",
        "polling",
        "ringing",
        "started",
        "stream",
        "token",
    )

    def __init__(
        self,
        event: Any,
        stream: Any,
        device: Device,
        adapter: LoopAdapter,
        on_finish: Callable[[Any], None] | None,
    ) -> None:
        self.event = event
        self.stream = stream
        self.device = device
        self.adapter = adapter
        self.on_finish = on_finish
        self.started = _perf()
        self.head_since: float | None = self.started
        """Since when the work before its point has finished (None while waits recorded
        before it on its stream are pending): what the stream's history measures from."""
        self.line: _Line | None = None
        self.poll_until = 0.0
        self.polling = False
        """Whether it is in its loop's poller."""
        self.ringing = False
        """Whether its doorbell is enqueued (the waker lists every waiter given to it, and
        queries those whose doorbell could not be enqueued on each periodic check)."""
        self.done = False
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
    first (see "Queued waits" in the module docstring). Only the oldest is working on its
    own part of the stream; when it leaves, for whatever reason, the next one's own part
    begins and :meth:`CompletionEngine._promote` predicts it from then."""

    __slots__ = ("_engine", "_waiters")

    def __init__(self, engine: CompletionEngine) -> None:
        self._engine = engine
        self._waiters: collections.deque[Waiter] = collections.deque()

    def join(self, waiter: Waiter) -> int:
        """Queue ``waiter``; returns how many waits are ahead of it."""
        with self._engine._lock:
            self._waiters.append(waiter)
            waiter.line = self
            return len(self._waiters) - 1

    def leave(self, waiter: Waiter) -> None:
        engine = self._engine
        with engine._lock:
            waiters = self._waiters
            was_oldest = bool(waiters) and waiters[0] is waiter
            try:
                waiters.remove(waiter)
            except ValueError:
                return
            following = waiters[0] if was_oldest and waiters else None
        if following is not None:
            engine._promote(following, _perf())


class CompletionEngine:
    """Per-backend state: the doorbell, the waker thread, its long waiters and the
    wait histories of streams."""

    def __init__(self, backend: _driver.Driver) -> None:
        self.backend = backend
        self._query = backend.event_query
        self._signals = SignalStreams(backend)
        self._waker = Waker(backend, self._resume_all)
        self._histories: dict[Hashable, WaitHistory] = {}
        self._lines: dict[Hashable, _Line] = {}
        self._lock = threading.Lock()

    # -- the await ----------------------------------------------------------------------
    def wait(
        self,
        event: Any,
        stream: Any,
        device: Device,
        on_finish: Callable[[Any], None] | None = None,
        *,
        just_recorded: bool = False,
    ) -> Generator[Any, Any, None]:
        """Suspend the current task until ``event`` (recorded on ``stream`` of ``device``)
        completes.

        ``on_finish(event)`` runs exactly once when the wait ends for any reason
        (completion, error, cancellation); streams use it to give pooled events back.
        ``just_recorded`` says the event was recorded an instant ago, so that the first
        query can be skipped where the next step queries anyway.
        """
        query = self._query
        waiter: Waiter | None = None
        try:
            adapter = current_adapter()
            history = self._histories.get(stream)
            if not adapter.waiting and (history is None or history.expected < SPIN_MAX):
                if self._spin(event, stream, history):
                    return
            elif not (just_recorded and adapter.bare_yield) and query(event):
                return
            adapter.waiting += 1
            try:
                if adapter.bare_yield:
                    # One loop iteration for free: the cheapest reschedule asyncio has.
                    yield
                    if query(event):
                        return
                waiter = Waiter(event, stream, device, adapter, on_finish)
                # Waits known to take microseconds are polled whatever is ahead of them:
                # they skip the line's bookkeeping.
                lined = just_recorded and (history is None or history.expected >= SPIN_MAX)
                ahead = self._line(stream).join(waiter) if lined else 0
                if ahead:
                    waiter.head_since = None
                self._schedule(waiter, history, ahead)
                yield from adapter.suspend(waiter)
            finally:
                adapter.waiting -= 1
        finally:
            if waiter is None and on_finish is not None:
                on_finish(event)

    def _spin(self, event: Any, stream: Any, history: WaitHistory | None) -> bool:
        """Query in a tight loop for up to SPIN_MAX; True if the event completed."""
        query = self._query
        start = _perf()
        deadline = start + SPIN_MAX
        while True:
            if query(event):
                self._learn(stream, history, _perf() - start)
                return True
            if _perf() > deadline:
                return False

    def _learn(self, stream: Any, history: WaitHistory | None, duration: float) -> None:
        if history is not None:
            history.add(duration)
            return
        if len(self._histories) > 4096:  # streams come and go: forget the old ones
            self._histories.clear()
        self._histories[stream] = WaitHistory(duration)

    def prepare(self, device: Device) -> None:
        """Have what ``device``'s doorbells need made ahead of time, off the loop (call
        when a stream of the device is made: cheap after the first time)."""
        self._signals.prepare(device)

    def forget(self, stream: Any) -> None:
        """Drop ``stream``'s wait history and line (it is being destroyed)."""
        self._histories.pop(stream, None)
        self._lines.pop(stream, None)

    def _line(self, stream: Hashable) -> _Line:
        """``stream``'s line, kept while the stream lives (an await is the hot path)."""
        line = self._lines.get(stream)
        if line is None:
            with self._lock:
                if len(self._lines) > 4096:  # foreign streams are never forgotten: bound them
                    self._lines = {key: kept for key, kept in self._lines.items() if kept._waiters}
                line = self._lines.setdefault(stream, _Line(self))
        return line

    def _schedule(self, waiter: Waiter, history: WaitHistory | None, ahead: int) -> None:
        """Poll a wait expected to end soon; ring a long one's doorbell and have the
        waker bring it back to the poller just before its expected end. A wait with
        ``ahead`` waits queued before it that will not all end within the poll window
        sleeps on its doorbell until it is the oldest (:meth:`_promote`)."""
        if history is None or history.expected * (ahead + 1) < POLL_WINDOW:
            waiter.poll_until = waiter.started + POLL_WINDOW
            self._join_poller(waiter.adapter, [waiter])
            return
        if ahead:
            self._ring(waiter)
            return
        start, end = history.poll_window()
        waiter.poll_until = waiter.started + end
        self._ring(waiter)
        if start <= PREDICTION_LEAD:
            self._join_poller(waiter.adapter, [waiter])
        else:
            self._hand_over_at(waiter, waiter.started + start)

    def _promote(self, waiter: Waiter, now: float) -> None:
        """``waiter`` became the oldest wait of its stream's line at ``now``: the work
        before its point is done, so predict its end from here (any thread)."""
        waiter.head_since = now
        history = self._histories.get(waiter.stream)
        if history is None or history.expected < POLL_WINDOW:
            start, end = 0.0, POLL_WINDOW
        else:
            start, end = history.poll_window()
        waiter.poll_until = max(waiter.poll_until, now + end)
        if waiter.polling or waiter.done:
            return
        if start > PREDICTION_LEAD:
            self._hand_over_at(waiter, now + start)
        elif waiter.adapter.thread == threading.get_ident():
            self._join_poller(waiter.adapter, [waiter])
        else:
            waiter.adapter.call_soon_threadsafe(functools.partial(self._join_poller, waiter.adapter, [waiter]))

    # -- the loop's poller --------------------------------------------------------------------
    def _join_poller(self, adapter: LoopAdapter, waiters: list[Waiter]) -> None:
        """Add ``waiters`` to ``adapter``'s poller (on the loop's thread)."""
        for w in waiters:
            if not (w.done or w.polling):
                w.polling = True
                adapter.pending.append(w)
        if adapter.pending and not adapter.poll_scheduled:
            adapter.poll_scheduled = True
            adapter.call_soon(functools.partial(self._poll, adapter))

    def _poll(self, adapter: LoopAdapter) -> None:
        adapter.poll_scheduled = False
        now = _perf()
        still: list[Waiter] = []
        query = self._query
        for w in adapter.pending:
            if w.done:
                w.polling = False
                continue
            try:
                finished = query(w.event)
            except CudaError as exc:
                w.polling = False
                adapter.resume(w, exc)
                continue
            if finished:
                w.polling = False
                self._complete(w, now)
            elif now < w.poll_until:
                still.append(w)
            else:
                w.polling = False
                if not w.ringing:
                    self._ring(w)
                # else: its doorbell is enqueued; stop polling
        adapter.pending = still
        if still:
            adapter.poll_scheduled = True
            adapter.call_soon(functools.partial(self._poll, adapter))

    def _complete(self, waiter: Waiter, now: float) -> None:
        """Resume a waiter whose event completed (on its loop's thread), learning how long
        the wait took."""
        if waiter.done:
            return
        if waiter.head_since is not None:  # (else the waits before it just ended too: no measure)
            self._learn(waiter.stream, self._histories.get(waiter.stream), now - waiter.head_since)
        waiter.adapter.resume(waiter, None)

    # -- the doorbell and the waker thread -------------------------------------------------------
    def _ring(self, waiter: Waiter) -> None:
        """List ``waiter`` with the waker, then enqueue its doorbell."""
        waiter.ringing = True
        self._waker.listen(waiter)
        try:
            self._signals.ring_after(waiter.device, waiter.event, self._waker.bell)
        except CudaError:
            waiter.ringing = False  # poisoned context, most likely: the periodic check queries it

    def _hand_over_at(self, waiter: Waiter, poll_at: float) -> None:
        """Have ``waiter`` (rung already) join its loop's poller at ``poll_at``."""
        adapter = waiter.adapter
        self._waker.call_at(poll_at, adapter, functools.partial(self._join_poller, adapter, [waiter]))

    def _resume_all(self, batch: list[tuple[Waiter, BaseException | None]]) -> None:
        now = _perf()
        for waiter, error in batch:
            if error is None:
                self._complete(waiter, now)
            elif not waiter.done:
                waiter.adapter.resume(waiter, error)

    def stop(self) -> None:
        """Stop the waker thread (interpreter exit, backend switch)."""
        self._waker.stop()


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
