"""The simulated driver's events and doorbells.

These test the sim itself (its controls have no real-driver counterpart), so they use the
``sim`` fixture (the backend in use) or ``fresh`` (a SimDriver of their own).
"""

from __future__ import annotations

import pytest

from aiocuda._driver.sim import SimDriver
from aiocuda.errors import (
    ArgumentError,
    CudaError,
    ResultCode,
)

from ._helpers import WAIT, on_device


# -- events -----------------------------------------------------------------------------------
def test_event_record_query_synchronize(sim: SimDriver) -> None:
    stream = sim.stream_create(non_blocking=True, priority=0)
    event = sim.event_create(timing=False, blocking_sync=False)
    assert sim.event_query(event)  # never recorded: complete, as in CUDA
    sim.event_synchronize(event)
    sim.pause(stream)
    sim.event_record(event, stream)
    assert not sim.event_query(event)
    sim.resume(stream)
    sim.event_synchronize(event)
    assert sim.event_query(event)


def test_rerecording_moves_the_event(sim: SimDriver) -> None:
    paused = sim.stream_create(non_blocking=True, priority=0)
    free = sim.stream_create(non_blocking=True, priority=0)
    event = sim.event_create(timing=False, blocking_sync=False)
    sim.pause(paused)
    sim.event_record(event, paused)
    assert not sim.event_query(event)
    sim.event_record(event, free)
    sim.event_synchronize(event)  # the paused record no longer counts
    assert sim.event_query(event)
    sim.event_record(event, paused)
    assert not sim.event_query(event)
    sim.resume(paused)


def test_elapsed_time_covers_latency(sim: SimDriver) -> None:
    stream = sim.stream_create(non_blocking=True, priority=0)
    start = sim.event_create(timing=True, blocking_sync=False)
    end = sim.event_create(timing=True, blocking_sync=False)
    sim.set_latency("kernel", 0.05)
    sim.event_record(start, stream)
    sim.enqueue(stream, lambda: None, "kernel")
    sim.event_record(end, stream)
    sim.event_synchronize(end)
    assert 50.0 <= sim.event_elapsed_ms(start, end) < 1000.0


def test_elapsed_time_errors(sim: SimDriver) -> None:
    stream = sim.stream_create(non_blocking=True, priority=0)
    start = sim.event_create(timing=True, blocking_sync=False)
    end = sim.event_create(timing=True, blocking_sync=False)
    untimed = sim.event_create(timing=False, blocking_sync=False)
    with pytest.raises(ArgumentError):
        sim.event_elapsed_ms(start, end)  # never recorded
    sim.event_record(start, stream)
    sim.event_record(untimed, stream)
    sim.stream_synchronize(stream)
    with pytest.raises(ArgumentError):
        sim.event_elapsed_ms(start, untimed)
    sim.pause(stream)
    sim.event_record(end, stream)
    with pytest.raises(CudaError) as info:
        sim.event_elapsed_ms(start, end)
    assert info.value.code == ResultCode.NOT_READY == 600
    sim.resume(stream)


def test_event_of_another_device_cannot_be_recorded(sim: SimDriver) -> None:
    event = sim.event_create(timing=False, blocking_sync=False)
    on_device(sim, 1)
    stream = sim.stream_create(non_blocking=True, priority=0)
    with pytest.raises(ArgumentError):
        sim.event_record(event, stream)
    assert sim.event_query(event)  # querying from another device is fine
    sim.event_destroy(event)
    with pytest.raises(ArgumentError):
        sim.event_query(event)


# -- doorbells --------------------------------------------------------------------------------
def test_doorbell_rings_from_the_stream(sim: SimDriver) -> None:
    stream = sim.stream_create(non_blocking=True, priority=0)
    bell = sim.new_doorbell()
    sim.pause(stream)
    sim.launch_doorbell(stream, bell)
    assert not bell.wait(0.02)
    sim.resume(stream)
    assert bell.wait(WAIT)


def test_doorbell_behind_an_event_completes_with_it(sim: SimDriver) -> None:
    """``await stream`` records an event then rings: once the event is seen, the stream is idle."""
    stream = sim.stream_create(non_blocking=True, priority=0)
    event = sim.event_create(timing=False, blocking_sync=False)
    bell = sim.new_doorbell()
    for _ in range(50):
        sim.pause(stream)  # all three queued before the worker starts: a loaded machine
        sim.enqueue(stream, lambda: None, "op")  # could otherwise finish the op before the
        sim.event_record(event, stream)  # doorbell is even enqueued
        sim.launch_doorbell(stream, bell)
        sim.resume(stream)
        while not sim.event_query(event):
            pass
        assert sim.stream_query(stream)
    assert bell.wait(0)
