"""The simulated driver's life: shutdown, its pool of worker threads, switching backends.

These test the sim itself (its controls have no real-driver counterpart), so they use the
``sim`` fixture (the backend in use) or ``fresh`` (a SimDriver of their own).
"""

from __future__ import annotations

import threading
import time

import pytest

from aiocuda import _driver
from aiocuda._driver.sim import SimDriver
from aiocuda.errors import (
    CudaError,
    ResultCode,
)

from ._helpers import WAIT, on_device, recorder, wait_until


# -- lifecycle --------------------------------------------------------------------------------
def test_shutdown_stops_worker_threads() -> None:
    baseline = threading.active_count()
    sim = SimDriver(devices=2)
    sim.init()
    streams = []
    for ordinal in (0, 1):
        on_device(sim, ordinal)
        for _ in range(3):
            stream = sim.stream_create(non_blocking=True, priority=0)
            sim.enqueue(stream, lambda: None, "op")
            streams.append(stream)
    sim.pause(streams[0])
    sim.enqueue(streams[0], lambda: None, "op")
    sim.set_latency("slow", 10.0)
    sim.enqueue(streams[1], lambda: None, "slow")
    assert threading.active_count() > baseline
    started = time.perf_counter()
    sim.shutdown()
    assert time.perf_counter() - started < WAIT  # the slow operation alone takes 10 s
    assert threading.active_count() == baseline
    with pytest.raises(CudaError) as info:
        sim.stream_query(streams[2])
    assert info.value.code == ResultCode.DEINITIALIZED


def test_shutdown_wakes_host_waits(fresh: SimDriver) -> None:
    stream = fresh.stream_create(non_blocking=True, priority=0)
    fresh.pause(stream)
    fresh.enqueue(stream, lambda: None, "op")
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            fresh.stream_synchronize(stream)
        except CudaError as exc:
            errors.append(exc)

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.02)
    fresh.shutdown()
    thread.join(WAIT)
    assert not thread.is_alive()
    assert [getattr(e, "code", None) for e in errors] == [ResultCode.DEINITIALIZED]


def test_idle_workers_leave_and_come_back(fresh: SimDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    from aiocuda._driver.sim import _objects

    monkeypatch.setattr(_objects, "_IDLE_EXIT_S", 0.01)
    baseline = threading.active_count()
    stream = fresh.stream_create(non_blocking=True, priority=0)
    log, op = recorder()
    fresh.enqueue(stream, op(1), "op")
    fresh.stream_synchronize(stream)
    assert wait_until(lambda: threading.active_count() == baseline)
    fresh.enqueue(stream, op(2), "op")
    fresh.stream_synchronize(stream)
    assert log == [1, 2]


def test_switching_backend_shuts_the_old_one_down() -> None:
    old = _driver.use_backend("sim", devices=1)
    stream = old.stream_create(non_blocking=True, priority=0)
    old.pause(stream)  # type: ignore[attr-defined]
    old.launch_doorbell(stream, old.new_doorbell())
    _driver.use_backend("sim", devices=1)
    with pytest.raises(CudaError):
        old.stream_query(stream)


# -- the worker pool ----------------------------------------------------------------------------
def test_many_streams_share_a_few_worker_threads(fresh: SimDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    """500 per-request streams, each given work at once: the pool runs them on at most
    MAX_WORKERS threads (not one per stream), and every worker leaves once idle."""
    from aiocuda._driver.sim import _objects, _workers

    monkeypatch.setattr(_objects, "_IDLE_EXIT_S", 0.01)
    streams = [fresh.stream_create(non_blocking=True, priority=0) for _ in range(500)]
    peak = 0

    def op() -> None:
        nonlocal peak
        peak = max(peak, fresh._workers.thread_count)

    for stream in streams:
        fresh.enqueue(stream, op)
    for stream in streams:
        fresh.stream_synchronize(stream)
        fresh.stream_destroy(stream)
    assert 1 <= peak <= _workers.MAX_WORKERS
    assert wait_until(lambda: fresh._workers.thread_count == 0)


@pytest.mark.parametrize("where", ["_bootstrap_inner", "start"])
def test_a_collection_while_a_worker_starts_may_enqueue_work(
    fresh: SimDriver, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """The garbage collector may run at any allocation and run finalisers that enqueue
    work (a collected DeviceBuffer frees itself on its stream), which takes the pool's
    lock. A worker is started under that lock, and ``Thread.start()`` waits until the
    new thread runs: an automatic collection in the new thread before it says so
    (``_bootstrap_inner``) hung the test suite now and then; one in the starter itself
    (``start``, the lock held by the same thread) would hang it too."""
    import gc

    queued, idle = (fresh.stream_create(non_blocking=True, priority=0) for _ in range(2))

    class FreedWhenCollected:
        def __init__(self) -> None:
            self.cycle = self

        def __del__(self) -> None:
            fresh.enqueue(idle, lambda: None, "free")  # (a stream not scheduled yet)

    original = getattr(threading.Thread, where)

    def collecting_first(thread: threading.Thread) -> None:
        monkeypatch.setattr(threading.Thread, where, original)  # (once)
        if where == "start" or gc.isenabled():  # (the new thread's: as an automatic one)
            gc.collect()
        original(thread)

    go = threading.Event()

    def enqueue() -> None:  # (its work starts the pool's first worker)
        go.wait()
        fresh.enqueue(queued, lambda: None, "op")

    enqueuer = threading.Thread(target=enqueue, daemon=True)
    enqueuer.start()
    FreedWhenCollected()  # garbage, for the collection
    monkeypatch.setattr(threading.Thread, where, collecting_first)
    go.set()
    enqueuer.join(30)  # (only a hang reaches the limit)
    assert not enqueuer.is_alive()
    gc.collect()  # (the garbage, where no collection ran while the worker started)
    fresh.stream_synchronize(queued)
    fresh.stream_synchronize(idle)


def test_waiting_streams_hold_no_thread(fresh: SimDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    """Streams in a latency or waiting for another stream's event cost no worker: once
    idle, all workers leave but the one that keeps time for the latencies."""
    from aiocuda._driver.sim import _objects

    monkeypatch.setattr(_objects, "_IDLE_EXIT_S", 0.01)
    gate = fresh.stream_create(non_blocking=True, priority=0)
    fresh.pause(gate)
    fresh.enqueue(gate, lambda: None)
    event = fresh.event_create(timing=False, blocking_sync=False)
    fresh.event_record(event, gate)
    fresh.set_latency("slow", 30.0)
    waiting = [fresh.stream_create(non_blocking=True, priority=0) for _ in range(100)]
    delayed = [fresh.stream_create(non_blocking=True, priority=0) for _ in range(100)]
    for stream in waiting:
        fresh.stream_wait_event(stream, event)
    for stream in delayed:
        fresh.enqueue(stream, lambda: None, "slow")
    assert wait_until(lambda: len(fresh._workers._timers) == len(delayed))
    assert wait_until(lambda: len(gate._dependents) == len(waiting))
    assert wait_until(lambda: fresh._workers.thread_count == 1)
    fresh.resume(gate)
    for stream in waiting:
        fresh.stream_synchronize(stream)  # resumed: every waiting stream went on
    assert not any(fresh.stream_query(s) for s in delayed)
