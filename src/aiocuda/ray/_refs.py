"""Awaiting Ray object refs from any event loop aiocuda supports (asyncio, uvloop, trio).

Ray's own ``await ref`` works on asyncio only. Here the ref's ``concurrent.futures``
future (completed on one of Ray's threads; any such future: :func:`completed`) wakes the
task through the loop's thread-safe call (:mod:`aiocuda._completion.loops`): Ray's thread
never blocks on the loop, so a loop thread that is itself inside a Ray call cannot
deadlock with it.

``ray.shutdown()`` (from another task, a signal handler) leaves the futures of refs in
flight pending forever, and any Ray call after it starts a new local Ray (Ray's
auto-init): a wait checks every :data:`RUNNING_CHECK` seconds that Ray still runs, and
:func:`check_running` stops what would call Ray.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

import anyio
import ray
import ray.exceptions

from .._completion.loops import current_adapter

__all__ = ["RUNNING_CHECK", "cancel", "check_running", "completed", "result", "unwrap", "value"]

RUNNING_CHECK = 0.5
"""Seconds between checks that Ray still runs, while a ref is awaited."""


async def result(ref: Any) -> Any:
    """The value of ``ref`` once Ray has it; raises what the task raised (as Ray wraps it).

    Cancelling the awaiting task leaves the Ray task alone: see :func:`cancel`.
    """
    return await completed(ref.future())


async def completed(future: concurrent.futures.Future[Any]) -> Any:
    """The result of ``future`` (completed on another thread: Ray's, or one of the map's
    put threads) once it has one; raises what it raised, or ``RaySystemError`` once Ray
    no longer runs. Cancelling the awaiting task leaves the future alone."""
    if not future.done():
        adapter = current_adapter()
        done = anyio.Event()
        future.add_done_callback(lambda _: adapter.call_soon_threadsafe(done.set))
        while not done.is_set():
            with anyio.move_on_after(RUNNING_CHECK):
                await done.wait()
            if not done.is_set():
                check_running()
    return future.result()


def check_running() -> None:
    """Raise ``RaySystemError`` if Ray does not run (``ray.shutdown()`` was called): a
    Ray call would start a new local Ray, and nothing awaited will come."""
    if not ray.is_initialized():
        raise ray.exceptions.RaySystemError("Ray is not running (ray.shutdown() was called): its actors are gone")


async def value(ref: Any) -> Any:
    """:func:`result`, with a remote task's own exception raised as itself
    (:func:`unwrap`)."""
    try:
        return await result(ref)
    except ray.exceptions.RayTaskError as exc:
        raise unwrap(exc) from exc


def cancel(ref: Any) -> None:
    """Ask Ray to cancel the task behind ``ref`` (an async actor's task gets
    ``CancelledError``; a queued one never starts), unless Ray does not run. Never raises."""
    if not ray.is_initialized():  # the task went with Ray
        return
    try:
        ray.cancel(ref)
    except Exception:  # finished, already cancelled, or its actor is gone: nothing to stop
        pass


def unwrap(error: Exception) -> Exception:
    """The exception a remote task raised, out of Ray's ``RayTaskError`` wrapper (which
    holds it as ``cause``), so that callers can branch on its own type; it is chained to
    the wrapper, whose message has the remote traceback."""
    if isinstance(error, ray.exceptions.RayTaskError):
        cause = getattr(error, "cause", None)
        if isinstance(cause, Exception):
            if cause.__cause__ is None:
                cause.__cause__ = error
            return cause
    return error
