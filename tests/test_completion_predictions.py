"""The completion engine's predictions: wait histories, per place and per stream, and
when the poller queries, parks and rings a wait."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Hashable
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiocuda import _driver
from aiocuda._completion import engine as engine_module
from aiocuda._completion import poller as poller_module
from aiocuda._completion import waker as waker_module
from aiocuda._completion.engine import Waiter, current_engine
from aiocuda._completion.history import MAX_POLL_SHARE, POLL_WINDOW, WaitHistory
from aiocuda._completion.loops import current_adapter
from aiocuda._completion.poller import Poller
from aiocuda.device import Device
from aiocuda.errors import ContextPoisonedError
from aiocuda.stream import Stream

from ._control import ControlClock
from ._workload import slow_op


def histories(stream: Stream) -> dict[Hashable, WaitHistory]:
    """The stream's wait histories, by the place that awaited."""
    return current_engine()._histories.get(stream.handle, {})


def _predict(stream: Stream, expected: float, spread: float = 0.001) -> None:
    """Make the stream's histories predict ``expected`` seconds, give or take ``spread``."""
    for history in histories(stream).values():
        history.expected, history.spread = expected, spread


def _open_poll_window(patcher: pytest.MonkeyPatch) -> None:
    """Every poll window opens a millisecond before the predicted end and stays open for
    a minute: a stall of a loaded machine cannot make a wait overdue."""
    patcher.setattr(WaitHistory, "poll_window", lambda self: (self.expected - 0.001, 60.0))


async def steps(stream: Stream, seconds: float, n: int = 1) -> None:
    """``n`` times: enqueue work of ``seconds`` and await it, always at one place (a
    place is the awaiting line and the line that called it)."""
    for _ in range(n):
        await _step(stream, seconds)


async def _step(stream: Stream, seconds: float) -> None:
    slow_op(stream, seconds)
    await stream


# -- the history ------------------------------------------------------------------------------------
def test_wait_history_window_is_bounded_and_brackets_a_steady_duration() -> None:
    steady = WaitHistory(0.005)
    for _ in range(20):
        steady.add(0.005)
    start, end = steady.poll_window()
    assert start < 0.005 < end
    assert 0 < end - start <= max(POLL_WINDOW, MAX_POLL_SHARE * 0.005) + 1e-9

    erratic = WaitHistory(0.2)
    for d in (0.05, 0.4, 0.1, 0.3, 0.02):
        erratic.add(d)
    start, end = erratic.poll_window()
    assert 0 <= start < end
    assert end - start <= max(POLL_WINDOW, MAX_POLL_SHARE * erratic.expected) + 1e-9


@given(durations=st.lists(st.floats(min_value=1e-6, max_value=5.0), min_size=1, max_size=30))
def test_wait_history_window_never_exceeds_its_cpu_cap(durations: list[float]) -> None:
    history = WaitHistory(durations[0])
    for d in durations[1:]:
        history.add(d)
    start, end = history.poll_window()
    assert 0 <= start < end
    assert end - start <= max(POLL_WINDOW, MAX_POLL_SHARE * history.expected) * (1 + 1e-9)


def test_wait_history_restarts_when_the_work_got_much_shorter() -> None:
    history = WaitHistory(0.2)
    history.add(0.0001)
    assert history.expected == 0.0001


def test_one_wait_stalled_far_beyond_its_history_barely_moves_it() -> None:
    """A loop that stalls 40 ms finds one 1 ms wait 40 ms late: learnt as it is, the
    expectation jumped to 11 ms and the next waits were parked past their end."""
    history = WaitHistory(0.001)
    for _ in range(20):
        history.add(0.00105)
    history.add(0.040)
    assert history.expected < 0.0012
    start, _ = history.poll_window()
    assert start < 0.00105


def test_work_that_got_longer_for_good_is_learnt_within_a_few_waits() -> None:
    history = WaitHistory(0.001)
    for _ in range(20):
        history.add(0.001)
    for _ in range(25):
        history.add(0.100)
    assert history.expected == pytest.approx(0.100, rel=0.05)


def test_a_destroyed_streams_history_is_forgotten(backend: _driver.Driver) -> None:
    """The driver may give a new stream the handle of a destroyed one: it must not
    inherit that stream's wait histories."""
    engine = current_engine()
    s = Stream(0)
    engine._histories[s.handle] = {None: WaitHistory(0.2)}
    handle = s.handle
    s.close()
    assert handle not in engine._histories


# -- per place ----------------------------------------------------------------------------------------
@pytest.mark.anyio
async def test_waits_are_predicted_per_place_not_only_per_stream(
    sim_backend: _driver.Driver, anyio_backend: object
) -> None:
    """Short waits after copies and long waits after kernels, alternating on one stream
    at two places: each place keeps its own history. (One history per stream restarted
    at every short wait, so every long wait was planned as a short one.)"""

    async def after_copy(s: Stream) -> None:
        slow_op(s, 0.001)
        await s

    async def after_kernel(s: Stream) -> None:
        slow_op(s, 0.03)
        await s

    with Stream(0) as s:
        for _ in range(4):
            await after_copy(s)
            await after_kernel(s)
        expected = sorted(h.expected for h in histories(s).values())
    assert len(expected) == 2, expected
    assert expected[1] > 0.02, expected  # the kernel's: not restarted by the short ones


# -- polling, parking, ringing --------------------------------------------------------------------
@pytest.mark.anyio
async def test_repeated_long_waits_sleep_until_shortly_before_their_predicted_end(
    sim_backend: _driver.Driver, anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once waits at one place are known to take ~100 ms, a wait is parked until shortly
    before its predicted end and, the loop having nothing else to do, rings its doorbell
    and is not queried meanwhile: its end is seen by polling near the prediction (or by
    the doorbell), at no CPU before."""
    engine = current_engine()
    with Stream(0) as s:
        await steps(s, 0.1, 3)  # learn
        planned: dict[Waiter, list[float]] = {}  # per wait, when it is to poll, as a share of its expected length
        queried: list[float] = []  # queries of a parked wait before it was to become active
        current: list[Waiter] = []
        park, query = Poller.park, engine.query

        def recording_park(self: Poller, w: Waiter, poll_from: float, poll_until: float) -> None:
            history = engine._history(w)
            assert history is not None
            planned.setdefault(w, []).append((poll_from - w.started) / history.expected)
            current[:] = [w]
            park(self, w, poll_from, poll_until)

        def recording_query(event: object) -> bool:
            w = current[0] if current else None
            if w is not None and not w.done and event is w.event and time.perf_counter() < w.poll_from:
                queried.append(time.perf_counter() - w.started)
            return query(event)

        monkeypatch.setattr(Poller, "park", recording_park)
        monkeypatch.setattr(engine, "query", recording_query)
        await steps(s, 0.1, 4)
    assert len(planned) == 4 and all(0.5 < share < 1 for shares in planned.values() for share in shares), planned
    # (a wait whose task finds its end by itself may be parked once more, later: see below)
    assert all(shares == sorted(shares) and len(shares) <= 2 for shares in planned.values()), planned
    assert not queried, f"queried while asleep: {queried}"


@pytest.mark.anyio
async def test_a_woken_wait_on_an_idle_loop_sleeps_again_until_the_lead_before_its_end(
    sim_backend: _driver.Driver, anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A task woken to find its wait's end by itself (asyncio), 20 ms before the predicted
    end of a 100 ms wait, finds the loop idle: querying on every turn until then would
    spin it, so the wait is parked again until the lead before its predicted end, and the
    task woken then. (With 20 ms to spare, only a loop stalled that long misses it.)"""
    if not current_adapter().bare_yield:
        pytest.skip("trio has no bare yield: its waits are resumed by the poller")
    engine = current_engine()
    monkeypatch.setattr(engine_module, "IDLE_TURN", float("inf"))  # (every turn counts as idle)
    # (a poll window as wide as the spread asks for: not capped to a share of the wait)
    monkeypatch.setattr(WaitHistory, "poll_window", lambda h: (h.expected - 2 * h.spread, h.expected + 2 * h.spread))
    with Stream(0) as s:
        await steps(s, 0.1)  # the place's history
        _predict(s, 0.1, 0.02)
        parked: list[float] = []  # when the wait is to poll, seconds after it began
        queries: list[float] = []  # its queries between its first wake and its second
        park, query = Poller.park, engine.query

        def recording_park(self: Poller, w: Waiter, poll_from: float, poll_until: float) -> None:
            parked.append(poll_from - w.started)
            park(self, w, poll_from, poll_until)

        def recording_query(event: object) -> bool:
            if len(parked) == 1 and time.perf_counter() - started > parked[0]:
                queries.append(time.perf_counter() - started)
            return query(event)

        monkeypatch.setattr(Poller, "park", recording_park)
        monkeypatch.setattr(engine, "query", recording_query)
        started = time.perf_counter()
        await steps(s, 0.1)
    lead = poller_module.IDLE_LEAD
    assert len(parked) == 2 and parked[0] < 0.085 and parked[1] >= 0.1 - lead - 0.001, parked
    assert len(queries) <= 2, f"spun between its wakes: {len(queries)} queries"


@pytest.mark.anyio
async def test_queued_waits_are_predicted_from_the_end_of_the_one_before(
    sim_backend: _driver.Driver, anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four tasks each enqueue a 50 ms operation on one stream and await it, as a
    pipeline's chunks await their downloads: the waits take 50, 100, 150 and 200 ms, but
    each one's own part is the 50 ms after the one before it ended. The history learns
    that, and each queued wait is planned only once the one before it has ended, to
    become active shortly before its own 50 ms are up (or, parked again by its task as
    the loop idles, later still)."""
    planned: dict[Waiter, float] = {}  # seconds after its own part began at which a wait is to poll first
    park = Poller.park

    def recording(self: Poller, w: Waiter, poll_from: float, poll_until: float) -> None:
        assert w.head_since is not None, "a queued wait was planned before the waits ahead of it ended"
        planned.setdefault(w, poll_from - w.head_since)
        park(self, w, poll_from, poll_until)

    with Stream(0) as s, Stream(0) as solo:
        alone = []  # the control: how long one operation takes on this machine now
        for _ in range(3):
            started = time.perf_counter()
            await steps(solo, 0.05)
            alone.append(time.perf_counter() - started)
        for round_ in range(3):
            if round_ == 2:
                monkeypatch.setattr(Poller, "park", recording)
            async with anyio.create_task_group() as tg:
                for _ in range(4):
                    tg.start_soon(steps, s, 0.05)
        (history,) = histories(s).values()
    one = sorted(alone)[1]
    # Learnt from whole waits, the history would average 2.5 operations, and the last
    # wait would be planned 4 operations after it began.
    assert history.expected < 1.6 * one, (history.expected, alone)
    assert len(planned) == 4 and max(planned.values()) < 1.6 * one, (planned, alone)


@pytest.mark.anyio
async def test_a_wrong_prediction_still_wakes_through_the_doorbell(
    sim_backend: _driver.Driver, anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Waits at a place took 2 s; now one finishes in 20 ms: its doorbell, rung as the
    loop went idle, wakes the task long before the predicted end. (Ticks of a control
    clock of 5 ms: a wait woken at its prediction would last ~400.)"""
    monkeypatch.setattr(waker_module, "POISON_CHECK", 30.0)
    with Stream(0) as s:
        await steps(s, 0.01)  # learnt at this place
        (place,) = histories(s)
        histories(s)[place] = WaitHistory(2.0)
        with ControlClock(0.005) as clock:
            await steps(s, 0.02)
            assert clock.ticks < 100


@pytest.mark.anyio
async def test_waits_near_their_end_are_polled_not_rung(
    sim_backend: _driver.Driver, anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many waits pending, each expected to end within a few milliseconds: they are
    polled and parked, never rung (a doorbell costs the loop more than querying while it
    turns). With ``RING_AFTER`` pushed out, only a wait planned far ahead could ring, so
    the count is exact whatever the machine's load; waits used to ring as soon as they
    were expected to outlast the poll window."""
    monkeypatch.setattr(poller_module, "RING_AFTER", 60.0)
    engine = current_engine()
    streams = [Stream(0) for _ in range(16)]

    try:
        async with anyio.create_task_group() as tg:
            for s in streams:
                tg.start_soon(steps, s, 0.003, 8)
        assert all(histories(s) for s in streams)
    finally:
        for s in streams:
            s.close()
    stats = engine.waker.statistics()
    assert stats.rings == 0 and stats.listed == 0, stats


@pytest.mark.anyio
async def test_an_idle_loop_sleeps_through_a_predicted_wait_instead_of_querying_it(
    sim_backend: Any, anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wait expected to end within the poll window is queried on every turn of the loop
    from its start. When the loop turns only for the poller, that is a spin: the wait is
    parked until shortly before its predicted end instead (queried every RECHECK), and the
    loop sleeps. Counted over the same held wait with idle parking off (the control, in
    the same run); the window and the prediction are stretched to tens of milliseconds so
    that the control spins long enough on a loaded machine too."""
    engine = current_engine()
    monkeypatch.setattr(engine_module, "POLL_WINDOW", 0.06)
    # (no wait's task finds its end by itself: the poller's way is what is measured)
    monkeypatch.setattr(engine_module, "OWN_TURNS_LONGEST", 0.0)
    monkeypatch.setattr(engine_module, "OWN_TURNS_FEW", 0)
    queried = [0]
    query = engine.query

    def counting(event: object) -> bool:
        queried[0] += 1
        return query(event)

    monkeypatch.setattr(engine, "query", counting)

    async def queries(stream: Stream, idle_park: float) -> int:
        """Queries in the first 30 ms of a held wait whose place predicts 40 ms."""
        monkeypatch.setattr(poller_module, "IDLE_PARK", idle_park)
        _predict(stream, 0.04)
        sim_backend.pause(stream.handle)
        queried[0] = 0
        async with anyio.create_task_group() as tg:
            tg.start_soon(steps, stream, 0.0)
            await anyio.sleep(0.03)
            counted = queried[0]
            sim_backend.resume(stream.handle)
        return counted

    idle_park = poller_module.IDLE_PARK
    with Stream(0) as s:
        await steps(s, 0.0)  # the place's history
        spinning = await queries(s, float("inf"))
        parked = await queries(s, idle_park)
    assert parked * 3 < spinning, f"{parked} queries with idle parking, {spinning} without"


@pytest.mark.anyio
async def test_a_busy_loop_finds_a_wait_about_to_end_by_yielding_not_through_the_poller(
    sim_backend: Any, anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While another task keeps every iteration of the loop busy (200 us of work each), a
    wait predicted to end within two iterations queries again after each of its next
    ones instead of going to the poller: no Waiter is made. The control, the same held
    wait on a loop with nothing else to do, is handed to the poller. (The busy case's
    poll window is stretched to a minute: on a loaded machine its 1.7 ms could pass in
    a stall before the held stream is let go, and the wait would rightly go to the
    poller; 1 failure in 30 runs with both cores kept busy.)"""
    if not current_adapter().bare_yield:
        pytest.skip("trio has no bare yield: a wait goes to the poller after its first checkpoint")
    made: list[Waiter] = []

    class Counted(Waiter):
        def __init__(self, *args: Any) -> None:
            made.append(self)
            super().__init__(*args)

    monkeypatch.setattr(engine_module, "Waiter", Counted)

    async def busy_until_resumed(stream: Stream) -> None:
        for turn in itertools.count():
            end = time.perf_counter() + 200e-6
            while time.perf_counter() < end:
                pass
            if turn == 2:
                sim_backend.resume(stream.handle)
                stream._synchronize()  # blocking the loop: this task is its busy work
                return
            await anyio.lowlevel.checkpoint()

    async def waiters_of_a_held_wait(stream: Stream, busy: bool) -> int:
        _predict(stream, 0.0005, 0.0001)
        made.clear()
        sim_backend.pause(stream.handle)
        with monkeypatch.context() as patched:
            if busy:
                _open_poll_window(patched)
            async with anyio.create_task_group() as tg:
                tg.start_soon(steps, stream, 0.0)
                if busy:
                    tg.start_soon(busy_until_resumed, stream)
                else:
                    await anyio.sleep(0.01)
                    sim_backend.resume(stream.handle)
        return len(made)

    with Stream(0) as s:
        await steps(s, 0.0)  # the place's history
        assert await waiters_of_a_held_wait(s, busy=True) == 0
        assert await waiters_of_a_held_wait(s, busy=False) == 1


def _loop_waking(monkeypatch: pytest.MonkeyPatch, on_wake: Callable[[Waiter], object], *, busy: bool = True) -> None:
    """Every turn of the loop counts as ``busy`` (or as idle), a poll window stays open for
    a minute, and ``on_wake`` runs whenever the poller wakes a task to poll its own wait.
    (Real busy work would starve the simulator's threads of the GIL.)"""
    monkeypatch.setattr(engine_module, "IDLE_TURN", 0.0 if busy else float("inf"))
    _open_poll_window(monkeypatch)
    adapter = current_adapter()
    wake = type(adapter).wake

    def waking(self: Any, w: Waiter) -> None:
        on_wake(w)
        wake(self, w)

    monkeypatch.setattr(type(adapter), "wake", waking)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("longest", "few", "busy", "by_task"),
    [(0.05, 16, True, True), (0.002, 16, True, True), (0.002, 16, False, True), (0.002, 0, True, False)],
)
async def test_a_parked_wait_is_woken_to_find_its_end_in_its_own_task(
    sim_backend: Any,
    anyio_backend: object,
    monkeypatch: pytest.MonkeyPatch,
    longest: float,
    few: int,
    busy: bool,
    by_task: bool,
) -> None:
    """A wait predicted to end in 20 ms is parked, its task woken shortly before then, and
    the task finds the end itself: the poller never resumes it (that would cost the task
    one more iteration of the loop, behind whatever was queued meanwhile) -- if it counts
    as short (OWN_TURNS_LONGEST), or if few waits are pending (OWN_TURNS_FEW), on a busy
    loop or an idle one; else the poller finds it. (Each turn of the loop is made to count
    as busy or idle (:func:`_loop_waking`); the held
    stream is let go only once the task was woken, or after 30 ms for a wait the poller
    finds, with the poll window open for as long as it takes and no doorbell, so that a
    loaded machine cannot end the wait some other way.)"""
    adapter = current_adapter()
    if not adapter.bare_yield:
        pytest.skip("trio has no bare yield: its waits are resumed by the poller")
    # (a wait of the default OWN_TURNS_LONGEST is too short to time here: 0.05 makes it short)
    monkeypatch.setattr(engine_module, "OWN_TURNS_LONGEST", longest)
    monkeypatch.setattr(engine_module, "OWN_TURNS_FEW", few)
    # No doorbell: one rung while the loop idled before the wake would resume the wait
    # from the waker thread as the held stream is let go, racing the task's own query.
    monkeypatch.setattr(poller_module, "RING_AFTER", 60.0)
    woken: list[Waiter] = []
    resumed: list[Waiter] = []
    resume = type(adapter).resume

    held = [False]

    def let_go() -> None:
        if held[0]:
            held[0] = False
            sim_backend.resume(stream.handle)

    def woke(w: Waiter) -> None:
        woken.append(w)
        if not busy and adapter.poller.idle_wake(w, time.perf_counter(), adapter.poller.idle_lead()) is not None:
            return  # the loop idles and the end is not near yet: parked again until it is
        asyncio.get_running_loop().call_later(0.002, let_go)

    _loop_waking(monkeypatch, woke, busy=busy)
    monkeypatch.setattr(type(adapter), "resume", lambda self, w, e: (resumed.append(w), resume(self, w, e)))
    with Stream(0) as stream:
        await steps(stream, 0.0)  # the place's history
        _predict(stream, 0.02)
        woken.clear()
        resumed.clear()
        sim_backend.pause(stream.handle)
        held[0] = True
        # (A wait never woken: fail, don't hang. Ten seconds, not one: in the loaded CI
        # run the task had not been woken after one -- a loop starved that long, by the
        # machine or a full collection of the test process -- and the poller found it.)
        release_after = 10.0 if by_task else 0.03
        asyncio.get_running_loop().call_later(release_after, let_go)
        await steps(stream, 0.0)
        if by_task:
            assert woken and all(w is woken[0] for w in woken) and not resumed, (woken, resumed)
            assert woken[0].done
        else:
            assert not woken and len(resumed) == 1, (woken, resumed)


@pytest.mark.anyio
async def test_a_context_poisoned_while_the_task_polls_by_itself_fails_the_wait(
    sim_backend: Any, anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The device fails while a woken task queries its wait by itself: the await raises
    ContextPoisonedError, as a wait the poller queries does."""
    if not current_adapter().bare_yield:
        pytest.skip("trio has no bare yield: its waits are resumed by the poller")
    monkeypatch.setattr(engine_module, "OWN_TURNS_LONGEST", 0.05)
    _loop_waking(monkeypatch, lambda w: asyncio.get_running_loop().call_later(0.002, sim_backend.poison, 0))
    with Stream(0) as stream:
        await steps(stream, 0.0)  # the place's history
        _predict(stream, 0.02)
        sim_backend.pause(stream.handle)
        with anyio.fail_after(10), pytest.raises(ContextPoisonedError):
            await steps(stream, 0.0)


class _Resumed:
    """An adapter stand-in that records what the engine resumes."""

    def __init__(self) -> None:
        self.resumed: list[Any] = []

    def resume(self, waiter: Waiter, error: BaseException | None) -> None:
        waiter.finish()
        self.resumed.append(waiter)


def test_an_error_the_waker_finds_for_a_wait_its_task_polls_is_kept_for_the_task(sim_backend: Any) -> None:
    """The waker's periodic check fails a wait whose task polls it by itself (its future
    already set by the wake): the error stays on the wait, for the task to raise."""
    engine = current_engine()
    waiter = Waiter(None, "a stream", "a place", Device(0), _Resumed(), None, 10.0)  # type: ignore[arg-type]
    waiter.where = poller_module.OWN_TURNS
    error = ContextPoisonedError("poisoned")
    engine._resume_all([(waiter, error)])
    assert waiter.done and waiter.error is error


@pytest.mark.parametrize(("polled", "learnt"), [(True, 0.005), (False, 0.006)])
def test_a_wait_found_late_learns_when_it_ended_not_when_it_was_found(
    sim_backend: Any, polled: bool, learnt: float
) -> None:
    """A parked wait found done 2 ms after a query found it pending ended somewhere in
    between: its history learns the middle, not the find time (which would teach it the
    finding's lateness, park the next wait later, and find it later still). A wait its
    doorbell resumed learns the moment it was resumed."""
    engine = current_engine()
    adapter = _Resumed()
    waiter = Waiter(None, "a stream", "a place", Device(0), adapter, None, 10.0)  # type: ignore[arg-type]
    waiter.head_since, waiter.pending_at = 10.0, 10.004
    engine.complete(waiter, 10.006, polled=polled)
    assert adapter.resumed == [waiter]
    history = engine._histories["a stream"]["a place"]
    assert history.expected == pytest.approx(learnt)
    engine.forget("a stream")
