"""The poller's loop timer (``_completion/timer.py``): a Linux ``timerfd`` an asyncio loop
watches, so that an idle loop wakes when a parked wait is due, neither a millisecond late
(asyncio rounds its timeouts up to whole milliseconds) nor early (uvloop runs a delay under
half a millisecond at once: a spin)."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from typing import Any

import pytest

from aiocuda._completion import loops
from aiocuda._completion.loops import AsyncioAdapter, current_adapter
from aiocuda._completion.timer import LoopTimer

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="timerfd is Linux's")


def _loops() -> list[Any]:
    params: list[Any] = [pytest.param(asyncio.new_event_loop, id="asyncio")]
    try:
        import uvloop

        params.append(pytest.param(uvloop.new_event_loop, id="uvloop"))
    except ImportError:
        pass
    return params


@pytest.mark.parametrize("new_loop", _loops())
def test_the_timer_never_fires_early_and_the_last_arming_wins(new_loop: Any) -> None:
    """Armed for 0.3 ms (uvloop's own timer runs that at once), then re-armed: only the
    second callback runs, and not before its time; the first never runs."""
    loop = new_loop()
    fired: list[tuple[str, float]] = []
    try:

        async def main() -> None:
            timer = LoopTimer.create(asyncio.get_running_loop())
            assert timer is not None
            try:
                first = time.perf_counter() + 0.05
                timer.arm(first, lambda: fired.append(("first", time.perf_counter())))
                due = time.perf_counter() + 0.0003
                timer.arm(due, lambda: fired.append(("second", time.perf_counter() - due)))
                while not fired:  # noqa: ASYNC110 - a busy loop, on purpose
                    await asyncio.sleep(0)  # (a busy loop: the reader is checked on every turn)
                await asyncio.sleep(0.08)  # past the first arming's time
            finally:
                timer.close()

        loop.run_until_complete(main())
    finally:
        loop.close()
    assert [name for name, _ in fired] == ["second"]
    assert fired[0][1] >= 0


@pytest.mark.parametrize("new_loop", _loops())
def test_an_idle_loop_sleeps_until_the_timer(new_loop: Any) -> None:
    """With nothing else to do, the loop sleeps in its selector until the timer's moment
    0.3 ms away, and the callback runs then, not before (uvloop's own call_later would
    run it at once)."""
    loop = new_loop()
    try:

        async def main() -> float:
            done = asyncio.get_running_loop().create_future()
            adapter = current_adapter()
            due = time.perf_counter() + 0.0003
            assert adapter.call_at(due, lambda: done.set_result(time.perf_counter()))
            return float(await done) - due

        late = loop.run_until_complete(main())
    finally:
        loop.close()
    assert late >= 0


def test_forgotten_loops_give_their_timers_back() -> None:
    """Adapters of loops long gone are forgotten (beyond 64 loops), and their timers'
    descriptors closed: a process that runs loop after loop does not run out of them."""
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(200):
        loop = asyncio.new_event_loop()

        async def arm() -> None:
            adapter = current_adapter()
            assert isinstance(adapter, AsyncioAdapter)
            adapter.call_at(time.perf_counter() + 60, lambda: None)

        loop.run_until_complete(arm())
        loop.close()
    # each loop's own descriptors are closed with it; at most the 64 remembered adapters'
    # timers stay open
    assert len(os.listdir("/proc/self/fd")) - before <= 65
    assert len(loops._adapters) <= 65


def test_the_lateness_follows_an_idle_loops_wake_ups_not_a_busy_loops() -> None:
    """Firings delayed by the loop's other work (every other one here, 0.8 ms late) barely
    move the lateness, which stays near an idle loop's wake-ups (15 us): the poller's lead
    before a predicted end needs no more. Once every firing is late it follows them, and
    it comes back down within a few idle ones."""
    loop = asyncio.new_event_loop()
    try:
        timer = LoopTimer.create(loop)
        assert timer is not None
        try:
            for _ in range(200):
                timer.learn(15e-6)
                timer.learn(800e-6)
            assert timer.lateness < 70e-6
            for _ in range(200):
                timer.learn(800e-6)
            assert timer.lateness > 700e-6
            for _ in range(3):
                timer.learn(15e-6)
            assert timer.lateness < 150e-6
        finally:
            timer.close()
    finally:
        loop.close()
