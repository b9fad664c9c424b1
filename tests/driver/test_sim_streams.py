"""The simulated driver's streams: order within a stream, concurrency across streams, cross-stream
waits, the legacy null stream, raw stream values.

These test the sim itself (its controls have no real-driver counterpart), so they use the
``sim`` fixture (the backend in use) or ``fresh`` (a SimDriver of their own).
"""

from __future__ import annotations

import functools
import gc
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiocuda._driver.sim import SimDriver
from aiocuda.errors import (
    ArgumentError,
    CudaError,
    ResultCode,
)

from ._helpers import WAIT, on_device, recorder, wait_until


# -- streams ----------------------------------------------------------------------------------
def test_operations_on_one_stream_run_in_order(sim: SimDriver) -> None:
    log, op = recorder()
    stream = sim.stream_create(non_blocking=True, priority=0)
    for i in range(200):
        sim.enqueue(stream, op(i), "op")
    sim.stream_synchronize(stream)
    assert log == list(range(200))
    assert sim.stream_query(stream)


def test_streams_run_concurrently(sim: SimDriver) -> None:
    log, op = recorder()
    a = sim.stream_create(non_blocking=True, priority=0)
    b = sim.stream_create(non_blocking=True, priority=0)
    sim.pause(a)
    sim.enqueue(a, op("a"), "op")
    sim.enqueue(b, op("b"), "op")
    sim.stream_synchronize(b)  # would hang if b queued behind a
    assert log == ["b"]
    assert not sim.stream_query(a)
    sim.resume(a)
    sim.stream_synchronize(a)
    assert log == ["b", "a"]


def test_stream_wait_event_orders_across_streams_without_blocking(sim: SimDriver) -> None:
    log, op = recorder()
    a = sim.stream_create(non_blocking=True, priority=0)
    b = sim.stream_create(non_blocking=True, priority=0)
    event = sim.event_create(timing=False, blocking_sync=False)
    sim.pause(a)
    sim.enqueue(a, op("a"), "op")
    sim.event_record(event, a)
    sim.stream_wait_event(b, event)  # a is paused: a host wait here would never end
    sim.enqueue(b, op("b"), "op")
    time.sleep(0.05)
    assert log == [] and not sim.stream_query(b)
    sim.resume(a)
    sim.stream_synchronize(b)
    assert log == ["a", "b"]


def test_stream_wait_event_across_devices(sim: SimDriver) -> None:
    log, op = recorder()
    a = sim.stream_create(non_blocking=True, priority=0)
    event = sim.event_create(timing=False, blocking_sync=False)
    on_device(sim, 1)
    b = sim.stream_create(non_blocking=True, priority=0)
    sim.pause(a)
    sim.enqueue(a, op("a"), "op")
    sim.event_record(event, a)
    sim.stream_wait_event(b, event)
    sim.enqueue(b, op("b"), "op")
    time.sleep(0.02)
    assert log == []
    sim.resume(a)
    sim.stream_synchronize(b)
    assert log == ["a", "b"]


def test_legacy_null_stream_synchronizes_with_blocking_streams(sim: SimDriver) -> None:
    log, op = recorder()
    blocking = sim.stream_create(non_blocking=False, priority=0)
    non_blocking = sim.stream_create(non_blocking=True, priority=0)
    null = sim.stream_from_value(0)
    assert sim.handle_value(null) == 0 and sim.stream_device_ordinal(null) == 0
    sim.pause(blocking)
    sim.pause(non_blocking)
    sim.enqueue(blocking, op("blocking"), "op")
    sim.enqueue(non_blocking, op("non-blocking"), "op")
    sim.enqueue(null, op("null"), "op")
    sim.enqueue(blocking, op("blocking after null"), "op")
    sim.resume(non_blocking)
    sim.stream_synchronize(non_blocking)
    time.sleep(0.02)
    assert log == ["non-blocking"]  # the null stream waits for the paused blocking stream
    sim.resume(blocking)
    sim.stream_synchronize(blocking)
    assert log == ["non-blocking", "blocking", "null", "blocking after null"]


def test_stream_handles_and_values(sim: SimDriver) -> None:
    stream = sim.stream_create(non_blocking=True, priority=-100)
    value = sim.handle_value(stream)
    assert value not in (0, 1, 2)
    assert sim.stream_from_value(value) is stream
    assert stream.priority == -5  # clamped, as CUDA does
    assert sim.stream_priority_range() == (0, -5)
    on_device(sim, 1)
    assert sim.stream_device_ordinal(sim.stream_from_value(0)) == 1
    with pytest.raises(ArgumentError) as info:
        sim.stream_from_value(12345)
    assert info.value.code == ResultCode.INVALID_HANDLE
    with pytest.raises(ArgumentError):
        sim.stream_destroy(0)


def test_destroyed_stream_finishes_its_work(sim: SimDriver) -> None:
    log, op = recorder()
    stream = sim.stream_create(non_blocking=True, priority=0)
    event = sim.event_create(timing=False, blocking_sync=False)
    sim.set_latency("slow", 0.02)
    sim.enqueue(stream, op(1), "slow")
    sim.event_record(event, stream)
    sim.stream_destroy(stream)
    with pytest.raises(ArgumentError):
        sim.stream_query(stream)
    with pytest.raises(ArgumentError):
        sim.stream_from_value(stream.value)
    sim.event_synchronize(event)
    assert log == [1]


def test_streams_accept_raw_values(sim: SimDriver) -> None:
    log, op = recorder()
    stream = sim.stream_create(non_blocking=True, priority=0)
    sim.enqueue(stream.value, op("by value"), "op")
    sim.enqueue(0, op("null stream"), "op")
    sim.stream_synchronize(stream.value)
    sim.stream_synchronize(0)
    assert sorted(log) == ["by value", "null stream"]
    assert sim.stream_device_ordinal(0) == 0
    sim.enqueue(2, op("per-thread stream"), "op")  # CU_STREAM_PER_THREAD
    sim.stream_synchronize(2)
    assert log[-1] == "per-thread stream"
    with pytest.raises(ArgumentError):
        sim.enqueue("stream", op("nonsense"), "op")


# -- the per-thread default stream (value 2, CU_STREAM_PER_THREAD) ----------------------------
def in_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` on a new thread (and so with that thread's per-thread streams); its result."""
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(fn()))
    thread.start()
    thread.join(WAIT)
    assert not thread.is_alive() and len(result) == 1
    return result[0]


def test_per_thread_stream_is_the_calling_threads_own(sim: SimDriver) -> None:
    mine = sim.stream_from_value(2)
    assert sim.stream_from_value(2) is mine
    assert sim.handle_value(mine) == 2
    assert sim.stream_device_ordinal(mine) == 0
    assert not sim.stream_is_non_blocking(mine)
    assert mine is not sim.stream_from_value(0)
    other = in_thread(lambda: sim.stream_from_value(2))
    assert other is not mine and sim.handle_value(other) == 2

    def on_device_1() -> Any:
        on_device(sim, 1)
        return sim.stream_from_value(2)

    assert sim.stream_device_ordinal(in_thread(on_device_1)) == 1


def test_per_thread_streams_of_two_threads_are_independent(sim: SimDriver) -> None:
    log, op = recorder()
    sim.pause(2)  # this thread's
    sim.enqueue(2, op("mine"), "op")

    def other_thread() -> bool:
        sim.enqueue(2, op("other"), "op")
        sim.stream_synchronize(2)  # waits for this thread's only: it would never end otherwise
        return sim.stream_query(2)

    try:
        assert in_thread(other_thread)
        assert log == ["other"] and not sim.stream_query(2)
    finally:
        sim.resume(2)
    sim.stream_synchronize(2)
    assert log == ["other", "mine"]


def test_null_stream_waits_for_per_thread_streams(sim: SimDriver) -> None:
    log, op = recorder()
    non_blocking = sim.stream_create(non_blocking=True, priority=0)
    other = in_thread(lambda: sim.stream_from_value(2))  # another thread's, paused from here
    sim.pause(2)
    sim.pause(other)
    try:
        sim.enqueue(2, op("mine"), "op")
        sim.enqueue(other, op("other"), "op")
        sim.enqueue(0, op("null"), "op")
        sim.enqueue(non_blocking, op("non-blocking"), "op")
        sim.stream_synchronize(non_blocking)
        assert log == ["non-blocking"] and not sim.stream_query(0)
        sim.resume(2)
        sim.stream_synchronize(2)
        assert log == ["non-blocking", "mine"] and not sim.stream_query(0)  # still waits for the other thread's
    finally:
        sim.resume(2)
        sim.resume(other)
    sim.stream_synchronize(0)
    assert log == ["non-blocking", "mine", "other", "null"]


def test_per_thread_stream_waits_for_the_null_stream(sim: SimDriver) -> None:
    log, op = recorder()
    non_blocking = sim.stream_create(non_blocking=True, priority=0)
    event = sim.event_create(timing=False, blocking_sync=False)
    sim.pause(0)
    try:
        sim.enqueue(0, op("null"), "op")
        sim.enqueue(2, op("mine"), "op")
        sim.event_record(event, 2)

        def other_thread() -> None:
            sim.enqueue(2, op("other"), "op")

        in_thread(other_thread)
        sim.enqueue(non_blocking, op("non-blocking"), "op")
        sim.stream_synchronize(non_blocking)
        assert log == ["non-blocking"] and not sim.stream_query(2) and not sim.event_query(event)
    finally:
        sim.resume(0)
    sim.event_synchronize(event)
    sim.stream_synchronize(0)
    assert log[:2] == ["non-blocking", "null"] and sorted(log[2:]) == ["mine", "other"]


def test_per_thread_stream_cannot_be_destroyed(sim: SimDriver) -> None:
    mine = sim.stream_from_value(2)
    for handle in (2, mine):
        with pytest.raises(ArgumentError, match="per-thread default stream cannot be destroyed"):
            sim.stream_destroy(handle)
    assert sim.stream_from_value(2) is mine
    sim.stream_synchronize(mine)


def test_a_thread_that_exits_leaves_its_per_thread_stream(fresh: SimDriver) -> None:
    log, op = recorder()

    def other_thread() -> weakref.ref[Any]:
        fresh.enqueue(2, op("queued"), "op")
        return weakref.ref(fresh.stream_from_value(2))

    streams = [in_thread(other_thread) for _ in range(20)]
    fresh.enqueue(0, op("null"), "op")  # after their queued work, which still runs
    fresh.stream_synchronize(0)
    assert log == ["queued"] * 20 + ["null"]
    gc.collect()
    assert wait_until(lambda: all(ref() is None for ref in streams))


def test_shutdown_drops_per_thread_streams_work(fresh: SimDriver) -> None:
    log, op = recorder()
    mine = fresh.stream_from_value(2)
    fresh.pause(mine)
    fresh.enqueue(mine, op("dropped"), "op")

    def wait() -> int | None:
        try:
            fresh.stream_synchronize(mine)  # (waiting, or not yet: either way it must end)
        except CudaError as exc:
            return exc.code
        return None

    waiter: list[int | None] = []
    thread = threading.Thread(target=lambda: waiter.append(wait()))
    thread.start()
    fresh.shutdown()
    thread.join(WAIT)
    assert not thread.is_alive() and waiter == [ResultCode.DEINITIALIZED]
    fresh.resume(mine)
    assert log == []


def test_concurrent_producers_keep_their_own_order(sim: SimDriver) -> None:
    stream = sim.stream_create(non_blocking=True, priority=0)
    log: list[tuple[int, int]] = []

    def produce(producer: int) -> None:
        for i in range(300):
            sim.enqueue(stream, functools.partial(log.append, (producer, i)), "op")

    threads = [threading.Thread(target=produce, args=(p,)) for p in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    sim.stream_synchronize(stream)
    for producer in range(4):
        assert [i for p, i in log if p == producer] == list(range(300))


def test_waiting_host_thread_does_not_starve_the_worker(sim: SimDriver) -> None:
    """A host wait releases the GIL and the stream's lock: the worker keeps running."""
    stream = sim.stream_create(non_blocking=True, priority=0)
    bell = sim.new_doorbell()
    sim.set_latency("kernel", 0.02)
    started = time.perf_counter()  # (before the first latency can start: a loaded machine enqueues slowly)
    for _ in range(5):
        sim.enqueue(stream, lambda: None, "kernel")
    sim.launch_doorbell(stream, bell)
    sim.stream_synchronize(stream)
    assert 0.1 <= time.perf_counter() - started < WAIT
    assert bell.wait(0)


# -- a property: stream order, cross-stream waits and the legacy null stream ------------------
# Streams 0 and 1 are non-blocking, 2 is blocking, 3 is the null stream (value 0).
_STREAMS = 4
_BLOCKING, _NULL = 2, 3
_EVENTS = 2
_actions = st.lists(
    st.one_of(
        st.tuples(st.just("op"), st.integers(0, _STREAMS - 1)),
        st.tuples(st.just("record"), st.integers(0, _STREAMS - 1), st.integers(0, _EVENTS - 1)),
        st.tuples(st.just("wait"), st.integers(0, _STREAMS - 1), st.integers(0, _EVENTS - 1)),
    ),
    min_size=3,
    max_size=24,
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(actions=_actions, resume_order=st.permutations(range(_STREAMS)), running=st.integers(0, _STREAMS))
def test_random_programs_keep_stream_order_and_waits(
    sim: SimDriver, actions: list[Any], resume_order: list[int], running: int
) -> None:
    """Streams in ``resume_order[running:]`` are paused while the program is enqueued, then
    resumed one by one: a missing dependency shows as an op run too early."""
    paused = resume_order[running:]
    streams = [sim.stream_create(non_blocking=True, priority=0) for _ in range(2)]
    streams += [sim.stream_create(non_blocking=False, priority=0), sim.stream_from_value(0)]
    events = [sim.event_create(timing=False, blocking_sync=False) for _ in range(_EVENTS)]
    lock = threading.Lock()
    log: list[int] = []
    # The ops that must have run before the next op on each stream, and before each event.
    frontier: list[frozenset[int]] = [frozenset()] * _STREAMS
    captured: list[frozenset[int]] = [frozenset()] * _EVENTS
    required: dict[int, frozenset[int]] = {}

    def op(op_id: int) -> Callable[[], None]:
        def run() -> None:
            with lock:
                log.append(op_id)

        return run

    def legacy_order(s: int) -> None:
        """Work on the null stream follows blocking streams' work, and vice versa."""
        if s == _NULL:
            frontier[s] |= frontier[_BLOCKING]
        elif s == _BLOCKING:
            frontier[s] |= frontier[_NULL]

    for index in paused:
        sim.pause(streams[index])
    for op_id, action in enumerate(actions):
        kind, s = action[0], action[1]
        legacy_order(s)
        if kind == "op":
            required[op_id] = frontier[s]
            sim.enqueue(streams[s], op(op_id), "op")
            frontier[s] |= {op_id}
        elif kind == "record":
            sim.event_record(events[action[2]], streams[s])
            captured[action[2]] = frontier[s]
        else:
            sim.stream_wait_event(streams[s], events[action[2]])
            frontier[s] |= captured[action[2]]
    for index in paused:
        time.sleep(0.002)  # let whatever can run, run
        sim.resume(streams[index])
    for stream in streams:
        sim.stream_synchronize(stream)
    assert sorted(log) == sorted(required)
    position = {op_id: i for i, op_id in enumerate(log)}
    for op_id, before in required.items():
        assert all(position[b] < position[op_id] for b in before), (op_id, sorted(before), log)
    for stream in streams[:_NULL]:
        sim.stream_destroy(stream)
    for event in events:
        sim.event_destroy(event)
