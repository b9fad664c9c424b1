"""The completion engine: "this point in a stream has finished" -> wake the waiting task.

An await goes through up to three phases, cheapest first:

1. **Already done.** ``cuEventQuery`` says the recorded point has completed: the await
   returns at once, without suspending.
2. **About to finish.** If no other task on this loop is waiting for the GPU, the task
   spins on the query for a few tens of microseconds (an adaptive budget learned from
   recent waits). That matches a blocking ``cuStreamSynchronize`` for tiny operations
   while blocking the loop for less than a scheduling quantum. On asyncio, a task that
   did not spin first gives up one loop iteration with a bare ``yield`` (the cheapest
   reschedule there is) and queries again: with many tasks in flight that is all most
   waits need.
3. **Poll, then doorbell.** Otherwise the waiter joins the loop's *poller*: one callback
   per loop iteration queries every pending event and resolves the finished ones, so
   many completions in one iteration cost one pass. A waiter still pending after
   ``POLL_WINDOW`` moves to the *doorbell*: a host function enqueued on its stream that
   calls libc ``sem_post`` -- no Python, no GIL on the driver's thread. One waker thread
   sleeps in ``sem_timedwait``; when rung it queries every long waiter and wakes each
   loop once (``call_soon_threadsafe`` / ``TrioToken.run_sync_soon``) with all of that
   loop's finished waiters. A waiting task costs no CPU.

Sticky errors: the driver never runs host functions once a context is poisoned, so a
doorbell would never ring. The waker therefore also wakes every ``POISON_CHECK``
seconds while long waiters exist; a query that raises ``ContextPoisonedError`` fails
that waiter (and the error reaches every other waiter on the context the same way).

Cancellation detaches a waiter: it is dropped from the poller and the waker and its
future is never resolved; the GPU work and the memory it uses are untouched. Loop closed
or interpreter exiting with waits in flight: their wake-ups are dropped silently.
"""

from __future__ import annotations

import asyncio
import atexit
import threading
import time
from collections.abc import Callable, Generator
from typing import Any

from . import _driver
from .errors import CudaError

__all__ = ["POISON_CHECK", "POLL_WINDOW", "CompletionEngine", "engine"]

POLL_WINDOW = 0.002
"""Seconds a waiter stays with the loop's poller before it moves to the doorbell."""

POISON_CHECK = 0.02
"""Seconds between the waker's queries of long waiters when no doorbell rings."""

SPIN_MAX = 50e-6
"""Upper bound of the spin phase (seconds)."""

_perf = time.perf_counter


class _Waiter:
    """One pending await: the event it waits for and how to wake its task."""

    __slots__ = ("adapter", "done", "event", "on_finish", "started", "stream", "token")

    def __init__(self, event: Any, stream: Any, adapter: _LoopAdapter, on_finish: Callable[[Any], None] | None):
        self.event = event
        self.stream = stream
        self.adapter = adapter
        self.on_finish = on_finish
        self.started = _perf()
        self.done = False
        self.token: Any = None

    def finish(self) -> None:
        """Mark finished (exactly once) and give the event back to its pool."""
        if not self.done:
            self.done = True
            if self.on_finish is not None:
                self.on_finish(self.event)


class _LoopAdapter:
    """What the engine needs from an event loop: schedule, suspend, resume."""

    __slots__ = ("pending", "poll_scheduled", "waiting")

    bare_yield = False
    """Whether a bare ``yield`` reschedules the task for one loop iteration (asyncio)."""

    def __init__(self) -> None:
        self.pending: list[_Waiter] = []
        self.poll_scheduled = False
        self.waiting = 0

    def call_soon(self, fn: Callable[[], None]) -> None:
        raise NotImplementedError

    def call_soon_threadsafe(self, fn: Callable[[], None]) -> bool:
        """Schedule from another thread; False when the loop is gone."""
        raise NotImplementedError

    def suspend(self, waiter: _Waiter) -> Generator[Any, Any, None]:
        raise NotImplementedError

    def resume(self, waiter: _Waiter, error: BaseException | None) -> None:
        raise NotImplementedError


class _AsyncioAdapter(_LoopAdapter):
    __slots__ = ("loop",)

    bare_yield = True

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self.loop = loop

    def call_soon(self, fn: Callable[[], None]) -> None:
        self.loop.call_soon(fn)

    def call_soon_threadsafe(self, fn: Callable[[], None]) -> bool:
        try:
            self.loop.call_soon_threadsafe(fn)
        except RuntimeError:  # loop closed
            return False
        return True

    def suspend(self, waiter: _Waiter) -> Generator[Any, Any, None]:
        fut = self.loop.create_future()
        waiter.token = fut
        try:
            yield from fut
        finally:
            if not waiter.done:  # cancelled: detach
                waiter.finish()

    def resume(self, waiter: _Waiter, error: BaseException | None) -> None:
        fut = waiter.token
        waiter.finish()
        if fut is not None and not fut.done():
            if error is None:
                fut.set_result(None)
            else:
                fut.set_exception(error)


class _TrioAdapter(_LoopAdapter):
    __slots__ = ("trio_token",)

    def __init__(self, trio_token: Any) -> None:
        super().__init__()
        self.trio_token = trio_token

    def call_soon(self, fn: Callable[[], None]) -> None:
        self.trio_token.run_sync_soon(fn)

    def call_soon_threadsafe(self, fn: Callable[[], None]) -> bool:
        import trio

        try:
            self.trio_token.run_sync_soon(fn)
        except trio.RunFinishedError:
            return False
        return True

    def suspend(self, waiter: _Waiter) -> Generator[Any, Any, None]:
        import trio

        waiter.token = trio.lowlevel.current_task()

        def abort(_: Any) -> Any:
            waiter.token = None
            waiter.finish()
            return trio.lowlevel.Abort.SUCCEEDED

        return (yield from trio.lowlevel.wait_task_rescheduled(abort).__await__())  # noqa: ASYNC105

    def resume(self, waiter: _Waiter, error: BaseException | None) -> None:
        import outcome
        import trio

        task = waiter.token
        waiter.finish()
        if task is not None:
            waiter.token = None
            trio.lowlevel.reschedule(task, outcome.Value(None) if error is None else outcome.Error(error))


_last_loop: Any = None
_last_adapter: _LoopAdapter | None = None
_adapters: dict[int, tuple[Any, _LoopAdapter]] = {}


def _current_adapter() -> _LoopAdapter:
    """The adapter of the running loop (asyncio, uvloop or trio), cached per loop."""
    global _last_loop, _last_adapter
    loop = asyncio._get_running_loop()
    key: Any = loop
    if loop is None:
        try:
            import trio

            key = trio.lowlevel.current_trio_token()
        except (ImportError, RuntimeError):
            raise RuntimeError("aiocuda awaitables need a running asyncio or trio event loop") from None
    if key is _last_loop and _last_adapter is not None:
        return _last_adapter
    entry = _adapters.get(id(key))
    if entry is None or entry[0] is not key:
        adapter: _LoopAdapter = _AsyncioAdapter(key) if loop is not None else _TrioAdapter(key)
        entry = (key, adapter)
        _adapters[id(key)] = entry
        if len(_adapters) > 64:  # forget loops that are long gone
            for k in [k for k, (obj, _) in _adapters.items() if obj is not key][:32]:
                del _adapters[k]
    _last_loop, _last_adapter = key, entry[1]
    return entry[1]


class CompletionEngine:
    """Per-backend state: the doorbell, the waker thread and its long waiters."""

    def __init__(self, backend: _driver.Driver) -> None:
        self.backend = backend
        self._query = backend.event_query
        self._bell = backend.new_doorbell()
        self._long: list[_Waiter] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.spin_budget = 20e-6
        self._ewma_wait = 10e-6

    # -- the await ----------------------------------------------------------------------
    def wait(
        self, event: Any, stream: Any, on_finish: Callable[[Any], None] | None = None
    ) -> Generator[Any, Any, None]:
        """Suspend the current task until ``event`` (recorded on ``stream``) completes.

        ``on_finish(event)`` runs exactly once when the wait ends for any reason
        (completion, error, cancellation); streams use it to give pooled events back.
        """
        query = self._query
        waiter: _Waiter | None = None
        try:
            if query(event):
                return
            adapter = _current_adapter()
            if not adapter.waiting and self._spin(event):
                return
            adapter.waiting += 1
            try:
                if adapter.bare_yield:
                    # One loop iteration for free: the cheapest reschedule asyncio has.
                    yield
                    if query(event):
                        return
                waiter = _Waiter(event, stream, adapter, on_finish)
                if self._ewma_wait > POLL_WINDOW:
                    self._to_doorbell(waiter)
                else:
                    adapter.pending.append(waiter)
                    if not adapter.poll_scheduled:
                        adapter.poll_scheduled = True
                        adapter.call_soon(lambda: self._poll(adapter))
                yield from adapter.suspend(waiter)
            finally:
                adapter.waiting -= 1
        finally:
            if waiter is None and on_finish is not None:
                on_finish(event)

    def _spin(self, event: Any) -> bool:
        """Query in a tight loop for up to the spin budget; True if the event completed."""
        query = self._query
        start = _perf()
        deadline = start + self.spin_budget
        while True:
            if query(event):
                self._learn(_perf() - start)
                return True
            if _perf() > deadline:
                return False

    def _learn(self, waited: float) -> None:
        self._ewma_wait += 0.125 * (waited - self._ewma_wait)
        self.spin_budget = SPIN_MAX if self._ewma_wait < 0.7 * SPIN_MAX else 5e-6

    # -- phase 3a: the loop's poller --------------------------------------------------------
    def _poll(self, adapter: _LoopAdapter) -> None:
        adapter.poll_scheduled = False
        now = _perf()
        still: list[_Waiter] = []
        query = self._query
        for w in adapter.pending:
            if w.done:
                continue
            try:
                finished = query(w.event)
            except CudaError as exc:
                adapter.resume(w, exc)
                continue
            if finished:
                self._learn(now - w.started)
                adapter.resume(w, None)
            elif now - w.started > POLL_WINDOW:
                self._learn(now - w.started)
                self._to_doorbell(w)
            else:
                still.append(w)
        adapter.pending = still
        if still:
            adapter.poll_scheduled = True
            adapter.call_soon(lambda: self._poll(adapter))

    # -- phase 3b: doorbell and waker thread ---------------------------------------------------
    def _to_doorbell(self, waiter: _Waiter) -> None:
        # Register the waiter *before* enqueuing its doorbell: a stream already past the
        # event rings at once, and a ring swept before the waiter is listed would be lost
        # (the waiter then waits for the periodic POISON_CHECK query).
        with self._lock:
            self._long.append(waiter)
            if self._thread is None:
                self._thread = threading.Thread(target=self._waker, name="aiocuda-waker", daemon=True)
                self._thread.start()
        try:
            self.backend.launch_doorbell(waiter.stream, self._bell)
        except CudaError:
            pass  # stream gone or context poisoned: the waker's periodic query still sees it

    def _waker(self) -> None:
        bell = self._bell
        while not self._stopping:
            with self._lock:
                idle = not self._long
            bell.wait(1.0 if idle else POISON_CHECK)
            if self._stopping:
                break
            self._sweep()

    def _sweep(self) -> None:
        with self._lock:
            waiters, self._long = self._long, []
        if not waiters:
            return
        by_adapter: dict[int, tuple[_LoopAdapter, list[tuple[_Waiter, BaseException | None]]]] = {}
        keep: list[_Waiter] = []
        query = self._query
        for w in waiters:
            if w.done:
                continue
            try:
                finished = query(w.event)
                error: BaseException | None = None
            except CudaError as exc:
                finished, error = True, exc
            if finished:
                by_adapter.setdefault(id(w.adapter), (w.adapter, []))[1].append((w, error))
            else:
                keep.append(w)
        if keep:
            with self._lock:
                self._long.extend(keep)
        for adapter, batch in by_adapter.values():
            if not adapter.call_soon_threadsafe(lambda a=adapter, b=batch: _resume_all(a, b)):
                for w, _ in batch:  # the loop is gone: nobody is left to wake
                    w.finish()

    def stop(self) -> None:
        """Stop the waker thread (interpreter exit, backend switch)."""
        self._stopping = True
        self._bell.ring()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=1.0)


def _resume_all(adapter: _LoopAdapter, batch: list[tuple[_Waiter, BaseException | None]]) -> None:
    for waiter, error in batch:
        if not waiter.done:
            adapter.resume(waiter, error)


_engine: CompletionEngine | None = None
_engine_generation = -1


def engine() -> CompletionEngine:
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
