"""The completion engine under adversarial interleavings: several loops sharing one
stream, and waits whose earlier neighbours are never found.

Each interleaving is made deterministic with the simulator's pause and resume and with
thread handshakes; a hang is bounded by a generous ``fail_after`` (a wait that is
resumed at all is resumed within milliseconds)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import anyio
import anyio.to_thread
import pytest

from aiocuda import _driver
from aiocuda._completion.engine import current_engine
from aiocuda.stream import Stream

from .test_completion_predictions import _predict, steps

HANG = 10.0
"""Seconds after which a wait that should have been resumed counts as lost."""


def _lined(stream: Stream) -> int:
    """Waits in ``stream``'s lines (of every loop)."""
    line = current_engine()._lines.get(stream.handle)
    return 0 if line is None else sum(len(queue) for queue in line._queues.values())


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
