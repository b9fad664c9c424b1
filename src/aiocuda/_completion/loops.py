"""What the completion engine needs from an event loop: suspend a task, resume it, and
schedule callbacks -- for asyncio (uvloop included) and trio.

One :class:`LoopAdapter` exists per running loop (:func:`current_adapter` caches it).
Besides these operations it carries the loop's share of the engine's state: its
*poller* (:mod:`.poller`) and how many of its tasks are waiting.
Everything on an adapter is touched only from its loop's thread, except
:meth:`LoopAdapter.call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import warnings
from collections.abc import Awaitable, Callable, Generator
from typing import Any, Literal, Protocol

from ..errors import BlockingCallWarning
from .timer import LoopTimer

__all__ = ["LoopAdapter", "Suspended", "being_cancelled", "current_adapter", "warn_if_on_loop"]


class Suspended(Protocol):
    """What an adapter needs of a suspended wait (the engine's ``Waiter``)."""

    token: Any
    """The adapter's handle on the suspended task (a future, a trio task)."""

    @property
    def done(self) -> bool: ...

    def finish(self) -> None:
        """Mark the wait over, exactly once."""


class LoopAdapter:
    """The engine's view of one event loop (subclassed per loop library)."""

    __slots__ = ("poller", "thread", "waiting")

    bare_yield = False
    """Whether a bare ``yield`` reschedules the task for one loop iteration (asyncio)."""

    def __init__(self) -> None:
        self.poller: Any = None
        """The completion engine's poller for this loop (made by the engine)."""
        self.thread = threading.get_ident()
        """The loop's thread (adapters are made on it, by :func:`current_adapter`)."""
        self.waiting = 0
        """Tasks of this loop inside an await of GPU work."""

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the loop's next iteration (from the loop's own thread)."""
        raise NotImplementedError

    def call_soon_threadsafe(self, fn: Callable[[], None]) -> bool:
        """Run ``fn`` on the loop, from any thread; False when the loop is gone."""
        raise NotImplementedError

    def call_at(self, when: float, fn: Callable[[], None]) -> bool:
        """Run ``fn`` on the loop at ``when`` (``time.perf_counter()`` seconds), instead
        of what the last call asked for (from the loop's own thread); False when the loop
        has no timers for callbacks (trio): use the waker's."""
        return False

    def timer_lateness(self) -> float | None:
        """How late the callbacks of :meth:`call_at` run, rarely exceeded (seconds);
        None where not known."""
        return None

    def close(self) -> None:
        """Give back what the adapter holds of its loop (from any thread)."""

    def turn(self) -> Awaitable[None]:
        """An awaitable that lets the loop run its other ready tasks once, then resumes
        the current task. On trio a cancellation is not delivered there; on asyncio it
        may be (``CancelledError`` raised from the await): a caller that must finish
        what it started catches it, finishes, and raises it again."""
        raise NotImplementedError

    def suspend(self, waiter: Suspended) -> Generator[Any, Any, None]:
        """Suspend the current task (``yield from`` this in the task) until one of two
        things happens:

        1. :meth:`resume` is called for ``waiter``, on the loop's thread: the task wakes
           and the ``yield from`` returns, or raises the error given to :meth:`resume`.
        2. The task is cancelled first: ``waiter`` is finished (detached) and the
           cancellation propagates; a later :meth:`resume` does nothing.

        Set up everything that may resume ``waiter`` before calling this: a resume from
        another thread arrives through :meth:`call_soon_threadsafe`, after the task has
        suspended.
        """
        raise NotImplementedError

    def resume(self, waiter: Suspended, error: BaseException | None) -> None:
        """Finish ``waiter`` and wake its task (at most once), with ``error`` raised in it
        if given. On the loop's thread."""
        raise NotImplementedError

    def wake(self, waiter: Suspended) -> None:
        """Wake ``waiter``'s task without finishing it: the task then polls the wait by
        itself (adapters with ``bare_yield`` only). On the loop's thread."""
        raise NotImplementedError


class AsyncioAdapter(LoopAdapter):
    __slots__ = ("_timer", "loop")

    bare_yield = True

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self.loop = loop
        self._timer: LoopTimer | Literal[False] | None = None  # made at the first call_at; False: none to be had

    def call_soon(self, fn: Callable[[], None]) -> None:
        self.loop.call_soon(fn)

    def call_soon_threadsafe(self, fn: Callable[[], None]) -> bool:
        try:
            self.loop.call_soon_threadsafe(fn)
        except RuntimeError:  # loop closed
            return False
        return True

    def call_at(self, when: float, fn: Callable[[], None]) -> bool:
        timer = self._timer
        if timer is None:
            timer = self._timer = LoopTimer.create(self.loop) or False
        if timer:
            timer.arm(when, fn)
        else:  # (no timerfd here: the loop's timer, a millisecond coarse)
            self.loop.call_later(max(0.0, when - time.perf_counter()), fn)
        return True

    def timer_lateness(self) -> float | None:
        return self._timer.lateness if self._timer else None

    def close(self) -> None:
        timer, self._timer = self._timer, False
        if not timer:
            return
        if self.loop.is_closed() or self.thread == threading.get_ident():
            timer.close()
            return
        try:
            self.loop.call_soon_threadsafe(timer.close)
        except RuntimeError:  # closed meanwhile
            timer.close()

    def turn(self) -> Awaitable[None]:
        return _ONE_TURN

    def suspend(self, waiter: Suspended) -> Generator[Any, Any, None]:
        future = self.loop.create_future()
        waiter.token = future
        try:
            yield from future
        except BaseException:
            if not waiter.done:  # cancelled: detach
                waiter.finish()
            raise

    def resume(self, waiter: Suspended, error: BaseException | None) -> None:
        future = waiter.token
        waiter.finish()
        if future is not None and not future.done():
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)

    def wake(self, waiter: Suspended) -> None:
        future = waiter.token
        if future is not None and not future.done():
            future.set_result(None)


class _OneTurn:
    """A bare ``yield``: asyncio's Task runs the rest of the loop's ready callbacks, then
    steps the task again (what ``asyncio.sleep(0)`` does, without the coroutine)."""

    __slots__ = ()

    def __await__(self) -> Generator[None, None, None]:
        yield


_ONE_TURN = _OneTurn()


class TrioAdapter(LoopAdapter):
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

    def turn(self) -> Awaitable[None]:
        import trio

        checkpoint: Awaitable[None] = trio.lowlevel.cancel_shielded_checkpoint()  # noqa: ASYNC105 - the caller awaits it
        return checkpoint

    def suspend(self, waiter: Suspended) -> Generator[Any, Any, None]:
        import trio

        waiter.token = trio.lowlevel.current_task()

        def abort(_: Any) -> Any:
            waiter.token = None
            waiter.finish()
            return trio.lowlevel.Abort.SUCCEEDED

        yield from trio.lowlevel.wait_task_rescheduled(abort).__await__()  # noqa: ASYNC105

    def resume(self, waiter: Suspended, error: BaseException | None) -> None:
        import outcome
        import trio

        task = waiter.token
        waiter.finish()
        if task is not None:
            waiter.token = None
            trio.lowlevel.reschedule(task, outcome.Value(None) if error is None else outcome.Error(error))


_last_loop: Any = None
_last_adapter: LoopAdapter | None = None
_adapters: dict[int, tuple[Any, LoopAdapter]] = {}


def current_adapter() -> LoopAdapter:
    """The adapter of the running loop (asyncio, uvloop or trio), cached per loop.

    Raises RuntimeError outside a running loop.
    """
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
        adapter: LoopAdapter = AsyncioAdapter(key) if loop is not None else TrioAdapter(key)
        entry = (key, adapter)
        _adapters[id(key)] = entry
        if len(_adapters) > 64:  # forget loops that are long gone
            for k in [k for k, (obj, _) in _adapters.items() if obj is not key][:32]:
                _adapters.pop(k)[1].close()
    _last_loop, _last_adapter = key, entry[1]
    return entry[1]


def warn_if_on_loop(call: str) -> None:
    """Warn (:class:`~aiocuda.errors.BlockingCallWarning`, once per calling line with
    the default filters) when the blocking ``call`` runs on a running event loop's thread.
    Call it from the public method itself: the warning names its caller's line."""
    on_loop = asyncio._get_running_loop() is not None
    if not on_loop and "trio" in sys.modules:
        on_loop = sys.modules["trio"].lowlevel.in_trio_run()
    if on_loop:
        warnings.warn(
            f"{call} blocks the event loop's thread until the GPU is done, and every task of "
            f"the loop with it; in a coroutine, await the stream or event instead",
            BlockingCallWarning,
            stacklevel=3,
        )


def being_cancelled() -> bool:
    """Whether the calling asyncio task was cancelled and is unwinding (its clean-up code
    running). asyncio delivers a task's cancellation once, so awaits in that clean-up are
    not cancelled again (uvicorn's forced exit cancels the lifespan so); trio and anyio
    cancel scopes cancel every such await by themselves."""
    task = asyncio.current_task() if asyncio._get_running_loop() is not None else None
    cancelling = getattr(task, "cancelling", None)  # (Python 3.11 and newer)
    return cancelling is not None and cancelling() > 0
