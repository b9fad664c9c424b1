"""The completion engine under adversarial interleavings: several loops sharing one
stream, and waits whose earlier neighbours are never found.

Each interleaving is made deterministic with the simulator's pause and resume and with
thread handshakes; a hang is bounded by a generous ``fail_after`` (a wait that is
resumed at all is resumed within milliseconds)."""

from __future__ import annotations

import asyncio
import functools
import os
import threading
from collections.abc import Callable
from typing import Any

import anyio
import anyio.to_thread
import pytest

import aiocuda
from aiocuda import _driver
from aiocuda._completion.engine import current_engine
from aiocuda._completion.event_pool import EventPool
from aiocuda.device import Device
from aiocuda.stream import Stream

from ._control import forked_outcomes
from .test_completion_predictions import _predict, steps

HANG = 10.0
"""Seconds after which a wait that should have been resumed counts as lost."""


def _lined(stream: Stream) -> int:
    """Waits in ``stream``'s lines (of every loop)."""
    line = current_engine()._lines.get(stream.handle)
    return 0 if line is None else sum(len(queue) for queue in line._queues.values())


def _has_lined(stream: Stream, count: int) -> bool:
    return _lined(stream) == count


async def _until(condition: Callable[[], bool]) -> None:
    while not condition():  # noqa: ASYNC110 - engine state, set by another thread or task
        await anyio.sleep(0.001)


@pytest.mark.anyio
async def test_a_wait_is_not_held_up_by_another_loops_wait_on_the_same_stream(
    sim_backend: _driver.Driver, anyio_backend: object
) -> None:
    """Loop A (in another thread) awaits a stream; then this loop awaits it too, and the
    stream's work finishes. Loop A is stuck (its thread blocks) and so never finds its
    own wait done -- but this loop's wait must resume all the same: a wait used to queue
    behind the earlier waits of every loop on the stream, not being queried at all
    until the one ahead of it ended, so it was never resumed while loop A was stuck."""
    sim = sim_backend
    with Stream(0) as s:
        await steps(s, 0.003, 2)  # a history at steps' place ...
        _predict(s, 0.05)  # ... long enough that a wait queued behind another is not polled
        sim.pause(s.handle)  # type: ignore[attr-defined]
        joined, release = threading.Event(), threading.Event()

        def loop_a() -> None:
            async def other() -> None:
                waiting = asyncio.ensure_future(_await(s))
                await _until_async(lambda: _lined(s) == 1)
                joined.set()
                release.wait()  # the loop's thread is stuck: nothing of this loop runs
                await waiting

            asyncio.run(other())

        thread = threading.Thread(target=loop_a, name="loop A")
        thread.start()
        try:
            await anyio.to_thread.run_sync(joined.wait, HANG)
            with anyio.fail_after(HANG):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(steps, s, 0.0)
                    await _until(lambda: _lined(s) == 2)
                    sim.resume(s.handle)  # type: ignore[attr-defined]
        finally:
            sim.resume(s.handle)  # type: ignore[attr-defined]
            release.set()
            thread.join(HANG)
        assert not thread.is_alive()


async def _await(stream: Stream) -> None:
    await stream


async def _until_async(condition: Callable[[], bool]) -> None:
    """:func:`_until` on a plain asyncio loop (no anyio backend chosen there)."""
    while not condition():  # noqa: ASYNC110 - engine state, set by another thread or task
        await asyncio.sleep(0.001)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_awaits_across_a_fork_fail_with_the_fork_error(backend: _driver.Driver) -> None:
    """A stream and an event made (and awaited) in the parent, awaited in a forked
    child, and an allocation there: each fails at once with the clear fork error. The
    simulator's awaits in the child used to hang (its worker threads do not survive a
    fork, and its calls went on as if they did); the real driver's queries there said
    "done", or hung in the many-threaded test process (a driver lock held at the fork)."""
    s = Stream(0)
    event = s.record()

    async def parent() -> None:
        await s
        await event

    anyio.run(parent)

    def awaited(awaitable: object) -> None:
        async def child() -> None:
            with anyio.fail_after(HANG):
                await awaitable  # type: ignore[misc]

        anyio.run(child)

    outcomes = forked_outcomes(
        lambda: awaited(s),
        lambda: awaited(event),
        lambda: aiocuda.empty(16, stream=s),  # and memory from the parent's pool
    )
    s.close()
    assert len(outcomes) == 3, outcomes
    assert all("forked" in outcome and "spawn" in outcome for outcome in outcomes), outcomes


class _TakenMeanwhile(list[Any]):
    """An event pool's free list whose events another thread takes, once armed
    (``take``), between the pool's look at it and its ``pop``."""

    take = False
    stolen: list[Any]

    def pop(self, index: Any = -1) -> Any:
        if self.take:
            self.take = False
            self.stolen = list(self)  # (what pops by a loop in another thread do, all at once)
            self.clear()
        return super().pop(index)


def test_an_acquire_whose_last_free_event_another_thread_took_makes_one(backend: _driver.Driver) -> None:
    """Two loops in two threads take events of one device's pool. When the other takes
    the last free ones between this acquire's look and its take, this one makes an event
    instead of failing (``await stream`` raised IndexError: pop from empty list)."""
    pool = EventPool(Device(0))
    free = pool._free = _TakenMeanwhile(pool._free)
    pool.release = free.append
    taken = [pool.acquire() for _ in range(len(free) - 1)]
    free.take = True
    taken.append(pool.acquire())
    assert pool.statistics().made_by_caller == 1
    for event in [*taken, *free.stolen]:
        pool.release(event)


@pytest.mark.anyio
async def test_waits_queued_behind_a_cancelled_one_are_resumed(
    sim_backend: _driver.Driver, anyio_backend: object
) -> None:
    """Three waits queue on one stream (none of the later two is queried while the one
    ahead is pending); the oldest is cancelled, then the work finishes: the other two
    are resumed."""
    sim = sim_backend
    with Stream(0) as s:
        await steps(s, 0.003, 2)
        _predict(s, 0.05)  # long enough that queued waits are not polled
        sim.pause(s.handle)  # type: ignore[attr-defined]
        finished: list[int] = []

        async def waits(i: int, scope: anyio.CancelScope) -> None:
            with scope:
                await steps(s, 0.0)
                finished.append(i)

        scopes = [anyio.CancelScope() for _ in range(3)]
        try:
            with anyio.fail_after(HANG):
                async with anyio.create_task_group() as tg:
                    for i, scope in enumerate(scopes):
                        tg.start_soon(waits, i, scope)
                        await _until(functools.partial(_has_lined, s, i + 1))
                    scopes[0].cancel()
                    await _until(lambda: _lined(s) == 2)
                    sim.resume(s.handle)  # type: ignore[attr-defined]
        finally:
            sim.resume(s.handle)  # type: ignore[attr-defined]
        assert sorted(finished) == [1, 2]
