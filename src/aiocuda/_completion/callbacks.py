"""Host callbacks in stream order: what ``Stream.call_when_done`` is made of.

A callback is a point in a stream -- a pooled event recorded when it is scheduled --
and a function to call on the event loop that scheduled it, once the GPU has passed
that point. The callbacks of one stream and one loop form a :class:`_Queue` served by
one task of that loop (an asyncio task; a trio system task): it awaits the oldest
callback's event, then calls it, then the next. The await is an ordinary one, so a long
wait sleeps on the completion engine's doorbell -- libc's ``sem_post`` run by the driver,
no Python on the driver's thread -- and a short one is polled. Callbacks therefore run
in the order they were scheduled, on their loop's thread, never on a driver thread.

There are three ways a callback ends:

1. It is called, with the arguments it was given; what it returns, or raises, is kept
   on its :class:`StreamCallback` (``await`` the handle for it).
2. It is cancelled before it was called (:meth:`StreamCallback.cancel`): never called.
3. Its context is poisoned before the GPU passed its point: the driver will never get
   there, so it is failed with the :class:`~aiocuda.errors.ContextPoisonedError`
   instead of being called, and so is every callback queued behind it.

An error nobody looked at (an exception the function raised, or the poisoning) is
logged on the ``aiocuda`` logger when the handle is collected, as asyncio logs a
future's exception that was never retrieved.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import logging
import threading
import weakref
from collections.abc import Callable, Generator
from types import TracebackType
from typing import Any

import anyio

from ..errors import CudaError

__all__ = ["StreamCallback", "call_when_done"]

_log = logging.getLogger("aiocuda")


class StreamCallback:
    """A function scheduled to run when a stream's work so far is done
    (:meth:`aiocuda.Stream.call_when_done`); ``await`` it for what the function returned.

    Awaiting raises what failed it: the function's own exception, or the
    :class:`~aiocuda.errors.ContextPoisonedError` of a context that was poisoned before
    the GPU got there. A cancelled callback's await returns None at once.
    """

    __slots__ = ("_args", "_error", "_event", "_finished", "_fn", "_result", "_retrieved", "_state", "_traceback")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], event: Any) -> None:
        self._fn = fn
        self._args = args
        self._event = event  # the stream's point: an awaitable Event
        self._state = "pending"  # then "called", "failed" or "cancelled"
        self._result: Any = None
        self._error: BaseException | None = None
        # The error's traceback when it was kept: each raise of the error adds the raising
        # frames to it, so awaits of failed callbacks (all of a queue's, after a poisoning,
        # share one error) showed every earlier await's frames; asyncio's futures keep
        # theirs the same way.
        self._traceback: TracebackType | None = None
        self._retrieved = False
        self._finished = anyio.Event()

    def cancel(self) -> bool:
        """Do not call the function; True if it had not been called (nor failed) yet."""
        if self._state != "pending":
            return self._state == "cancelled"
        self._state = "cancelled"
        self._finished.set()
        return True

    def cancelled(self) -> bool:
        return self._state == "cancelled"

    def done(self) -> bool:
        """Called, failed or cancelled."""
        return self._state != "pending"

    def exception(self) -> BaseException | None:
        """What failed it (None while pending, when called without error, or cancelled)."""
        self._retrieved = True
        return self._error

    def __await__(self) -> Generator[Any, Any, Any]:
        yield from self._finished.wait().__await__()
        self._retrieved = True
        if self._error is not None:
            raise self._error.with_traceback(self._traceback)
        return self._result

    def _call(self) -> None:
        if self._state != "pending":
            return
        self._state = "called"
        try:
            result = self._fn(*self._args)
        except BaseException as exc:  # (any: it must not stop the task serving the stream's queue)
            self._error, self._traceback = exc, exc.__traceback__
        else:
            # (an object with an async __call__, or a lambda calling an async function,
            # passes call_when_done's check: its coroutine was the result, never run)
            if result is not None and inspect.isawaitable(result):
                self._error = _not_awaited(self._fn, result)
            else:
                self._result = result
        finally:
            self._fn = self._args = None  # type: ignore[assignment]
            self._finished.set()

    def _fail(self, error: BaseException) -> None:
        if self._state == "pending":
            self._state = "failed"
            self._error, self._traceback = error, error.__traceback__
            self._fn = self._args = None  # type: ignore[assignment]
            self._finished.set()

    def __del__(self) -> None:
        if self._error is not None and not self._retrieved:
            _log.error("aiocuda: a stream callback failed and nobody awaited it", exc_info=self._error)

    def __repr__(self) -> str:
        return f"<StreamCallback {self._state}>"


def _not_awaited(fn: Callable[..., Any], result: Any) -> TypeError:
    """The error of a callback ``fn`` that returned the awaitable ``result``."""
    if inspect.iscoroutine(result):
        result.close()  # (never to run: no "never awaited" warning when it is collected)
    kind = "a coroutine" if inspect.iscoroutine(result) else f"an awaitable ({type(result).__name__})"
    return TypeError(
        f"{fn!r} returned {kind}, which call_when_done does not await: it calls a plain function; start "
        "async work from it (asyncio.create_task, a nursery), or await the stream in a task instead"
    )


class _Queue:
    """The pending callbacks of one stream on one loop, oldest first (see the module
    docstring); ``loop`` is the asyncio loop or trio token whose task serves them."""

    __slots__ = ("items", "loop", "serving")

    def __init__(self, loop: Any) -> None:
        self.loop = loop
        self.items: collections.deque[StreamCallback] = collections.deque()
        self.serving = False

    async def serve(self) -> None:
        try:
            while self.items:
                head = self.items[0]
                if head._state == "pending":
                    try:
                        await head._event
                    except CudaError as exc:  # a poisoned context never gets there
                        for callback in self.items:
                            callback._fail(exc)
                        self.items.clear()
                        return
                self.items.popleft()
                head._call()
        finally:
            self.serving = False


_queues: weakref.WeakKeyDictionary[Any, dict[int, _Queue]] = weakref.WeakKeyDictionary()
"""By stream, then by the thread whose loop scheduled the callbacks."""
_lock = threading.Lock()
_tasks: set[asyncio.Task[None]] = set()  # asyncio keeps only weak references to tasks


def call_when_done(stream: Any, fn: Callable[..., Any], args: tuple[Any, ...]) -> StreamCallback:
    """Schedule ``fn(*args)`` on the running loop for when ``stream``'s work enqueued so
    far is done (see :meth:`aiocuda.Stream.call_when_done`)."""
    if not callable(fn):
        raise TypeError(f"call_when_done needs a callable, not {type(fn).__name__}")
    if inspect.iscoroutinefunction(fn):
        raise TypeError("call_when_done calls a plain function; start async work from it, or await the stream")
    capture = getattr(stream, "_capture", None)
    if capture is not None:
        raise capture.refuse("call_when_done()")
    loop: Any = asyncio._get_running_loop()
    if loop is None:
        try:
            import trio

            loop = trio.lowlevel.current_trio_token()
        except (ImportError, RuntimeError):
            raise RuntimeError("call_when_done needs a running asyncio or trio event loop") from None
    callback = StreamCallback(fn, args, stream.record())
    thread = threading.get_ident()
    with _lock:
        by_thread = _queues.setdefault(stream, {})
        queue = by_thread.get(thread)
        if queue is None or queue.loop is not loop:
            queue = by_thread[thread] = _Queue(loop)
    queue.items.append(callback)
    if not queue.serving:
        queue.serving = True
        _spawn(queue)
    return callback


def _spawn(queue: _Queue) -> None:
    if isinstance(queue.loop, asyncio.AbstractEventLoop):
        task = queue.loop.create_task(queue.serve())
        _tasks.add(task)
        task.add_done_callback(_tasks.discard)
        return
    import trio

    trio.lowlevel.spawn_system_task(queue.serve, name="aiocuda stream callbacks")
