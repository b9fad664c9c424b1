"""The simulated driver's core: devices, streams, events, doorbells, faults, poisoning.

These test the sim itself (its controls have no real-driver counterpart), so they use
the ``sim_backend`` fixture or build a ``SimDriver`` directly.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiocuda import _driver
from aiocuda._driver.sim import SimDriver
from aiocuda.errors import (
    STICKY_CODES,
    ArgumentError,
    ContextPoisonedError,
    CudaError,
    LaunchError,
    ResultCode,
)

WAIT = 5.0  # generous bound for things that should take milliseconds


@pytest.fixture
def sim(sim_backend: Any) -> SimDriver:
    assert isinstance(sim_backend, SimDriver)
    return sim_backend


@pytest.fixture
def fresh() -> Iterator[SimDriver]:
    """A SimDriver outside ``use_backend`` (for thread accounting and odd configurations)."""
    driver = SimDriver(devices=2)
    driver.init()
    yield driver
    driver.shutdown()


def on_device(sim: SimDriver, ordinal: int) -> None:
    sim.set_current(sim.primary_context_retain(sim.device_get(ordinal)))


def recorder() -> tuple[list[Any], Callable[[Any], Callable[[], None]]]:
    log: list[Any] = []

    def op(tag: Any) -> Callable[[], None]:
        return lambda: log.append(tag)

    return log, op


def wait_until(predicate: Callable[[], bool], timeout: float = WAIT) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


# -- devices and contexts -------------------------------------------------------------------
def test_devices_look_like_h100s(sim: SimDriver) -> None:
    assert sim.driver_version() == 13000
    assert sim.device_count() == 2
    dev = sim.device_get(1)
    assert sim.device_name(dev) == "aiocuda simulated GPU 1"
    assert sim.device_pci_bus_id(dev) == "0000:01:00.0"
    assert sim.device_attribute(dev, "pci_bus_id") == 1
    assert sim.device_total_mem(dev) == 16 << 30
    uuid = sim.device_uuid(dev)
    assert uuid.startswith("GPU-") and len(uuid) == 40
    assert uuid == sim.device_uuid(sim.device_get(1)) != sim.device_uuid(sim.device_get(0))
    assert sim.device_attribute(dev, "multiprocessor_count") == 132
    assert sim.device_attribute(dev, "compute_capability_major") == 9
    assert sim.device_attribute(dev, "max_threads_per_block") == 1024
    assert sim.device_attribute(dev, "warp_size") == 32
    assert sim.device_attribute(dev, "memory_pools_supported") == 1
    for name in sim.device_attribute_names():
        assert isinstance(sim.device_attribute(dev, name), int)


def test_attribute_names_are_the_drivers_own() -> None:
    bindings = pytest.importorskip("cuda.bindings.driver")
    real = {m.name.removeprefix("CU_DEVICE_ATTRIBUTE_").lower() for m in bindings.CUdevice_attribute}
    assert set(SimDriver().device_attribute_names()) <= real


def test_bad_ordinal_and_unknown_attribute(sim: SimDriver) -> None:
    with pytest.raises(ArgumentError) as info:
        sim.device_get(2)
    assert info.value.code == ResultCode.INVALID_DEVICE == 101
    assert info.value.name == "CUDA_ERROR_INVALID_DEVICE"
    assert "ordinal 2" in str(info.value) and "2 device(s)" in str(info.value)
    with pytest.raises(ArgumentError):
        sim.device_get(-1)
    with pytest.raises(ArgumentError) as info:
        sim.device_attribute(sim.device_get(0), "flux_capacitance")
    assert info.value.code == ResultCode.INVALID_VALUE
    assert "flux_capacitance" in str(info.value)


def test_eight_devices_and_memory_size() -> None:
    sim = _driver.use_backend("sim", devices=8, total_memory=1 << 30)
    assert isinstance(sim, SimDriver)
    assert sim.device_count() == 8
    assert sim.device_pci_bus_id(sim.device_get(7)) == "0000:07:00.0"
    assert len({sim.device_uuid(sim.device_get(i)) for i in range(8)}) == 8
    on_device(sim, 7)
    assert sim.mem_get_info() == (1 << 30, 1 << 30)
    sim._devices[7].used_bytes = 1000
    assert sim.mem_get_info() == ((1 << 30) - 1000, 1 << 30)


def test_peers_and_contexts(sim: SimDriver) -> None:
    d0, d1 = sim.device_get(0), sim.device_get(1)
    assert sim.device_can_access_peer(d0, d1) and not sim.device_can_access_peer(d0, d0)
    ctx0, ctx1 = sim.primary_context_retain(d0), sim.primary_context_retain(d1)
    assert sim.primary_context_retain(d0) is ctx0
    assert sim.handle_value(ctx0) != sim.handle_value(ctx1)
    sim.set_current(ctx0)
    sim.enable_peer_access(ctx1)
    sim.enable_peer_access(ctx1)  # idempotent
    assert sim._devices[0].peers == {1}
    with pytest.raises(ArgumentError):
        sim.enable_peer_access(ctx0)
    sim.primary_context_release(d0)
    sim.primary_context_release(d0)
    with pytest.raises(ArgumentError):
        sim.primary_context_release(d0)


def test_current_context_is_per_thread(sim: SimDriver) -> None:
    assert sim._device_of_current() == 0  # lenient default
    on_device(sim, 1)
    seen: list[int] = []
    thread = threading.Thread(target=lambda: seen.append(sim._device_of_current()))
    thread.start()
    thread.join()
    assert seen == [0]
    stream = sim.stream_create(non_blocking=True, priority=0)
    assert sim.stream_device_ordinal(stream) == 1
    ran_on: list[int] = []
    sim._enqueue(stream, lambda: ran_on.append(sim._device_of_current()), "probe")
    sim.stream_synchronize(stream)
    assert ran_on == [1]  # workers have their stream's context current


# -- streams ----------------------------------------------------------------------------------
def test_operations_on_one_stream_run_in_order(sim: SimDriver) -> None:
    log, op = recorder()
    stream = sim.stream_create(non_blocking=True, priority=0)
    for i in range(200):
        sim._enqueue(stream, op(i), "op")
    sim.stream_synchronize(stream)
    assert log == list(range(200))
    assert sim.stream_query(stream)


def test_streams_run_concurrently(sim: SimDriver) -> None:
    log, op = recorder()
    a = sim.stream_create(non_blocking=True, priority=0)
    b = sim.stream_create(non_blocking=True, priority=0)
    sim.hold(a)
    sim._enqueue(a, op("a"), "op")
    sim._enqueue(b, op("b"), "op")
    sim.stream_synchronize(b)  # would hang if b queued behind a
    assert log == ["b"]
    assert not sim.stream_query(a)
    sim.release(a)
    sim.stream_synchronize(a)
    assert log == ["b", "a"]


def test_stream_wait_event_orders_across_streams_without_blocking(sim: SimDriver) -> None:
    log, op = recorder()
    a = sim.stream_create(non_blocking=True, priority=0)
    b = sim.stream_create(non_blocking=True, priority=0)
    event = sim.event_create(timing=False, blocking_sync=False)
    sim.hold(a)
    sim._enqueue(a, op("a"), "op")
    sim.event_record(event, a)
    sim.stream_wait_event(b, event)  # a is held: a host wait here would never end
    sim._enqueue(b, op("b"), "op")
    time.sleep(0.05)
    assert log == [] and not sim.stream_query(b)
    sim.release(a)
    sim.stream_synchronize(b)
    assert log == ["a", "b"]


def test_stream_wait_event_across_devices(sim: SimDriver) -> None:
    log, op = recorder()
    a = sim.stream_create(non_blocking=True, priority=0)
    event = sim.event_create(timing=False, blocking_sync=False)
    on_device(sim, 1)
    b = sim.stream_create(non_blocking=True, priority=0)
    sim.hold(a)
    sim._enqueue(a, op("a"), "op")
    sim.event_record(event, a)
    sim.stream_wait_event(b, event)
    sim._enqueue(b, op("b"), "op")
    time.sleep(0.02)
    assert log == []
    sim.release(a)
    sim.stream_synchronize(b)
    assert log == ["a", "b"]


def test_legacy_null_stream_synchronizes_with_blocking_streams(sim: SimDriver) -> None:
    log, op = recorder()
    blocking = sim.stream_create(non_blocking=False, priority=0)
    non_blocking = sim.stream_create(non_blocking=True, priority=0)
    null = sim.stream_from_value(0)
    assert sim.handle_value(null) == 0 and sim.stream_device_ordinal(null) == 0
    sim.hold(blocking)
    sim.hold(non_blocking)
    sim._enqueue(blocking, op("blocking"), "op")
    sim._enqueue(non_blocking, op("non-blocking"), "op")
    sim._enqueue(null, op("null"), "op")
    sim._enqueue(blocking, op("blocking after null"), "op")
    sim.release(non_blocking)
    sim.stream_synchronize(non_blocking)
    time.sleep(0.02)
    assert log == ["non-blocking"]  # the null stream waits for the held blocking stream
    sim.release(blocking)
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
    sim._enqueue(stream, op(1), "slow")
    sim.event_record(event, stream)
    sim.stream_destroy(stream)
    with pytest.raises(ArgumentError):
        sim.stream_query(stream)
    with pytest.raises(ArgumentError):
        sim.stream_from_value(stream.value)
    sim.event_synchronize(event)
    assert log == [1]


# -- events -----------------------------------------------------------------------------------
def test_event_record_query_synchronize(sim: SimDriver) -> None:
    stream = sim.stream_create(non_blocking=True, priority=0)
    event = sim.event_create(timing=False, blocking_sync=False)
    assert sim.event_query(event)  # never recorded: complete, as in CUDA
    sim.event_synchronize(event)
    sim.hold(stream)
    sim.event_record(event, stream)
    assert not sim.event_query(event)
    sim.release(stream)
    sim.event_synchronize(event)
    assert sim.event_query(event)


def test_rerecording_moves_the_event(sim: SimDriver) -> None:
    held = sim.stream_create(non_blocking=True, priority=0)
    free = sim.stream_create(non_blocking=True, priority=0)
    event = sim.event_create(timing=False, blocking_sync=False)
    sim.hold(held)
    sim.event_record(event, held)
    assert not sim.event_query(event)
    sim.event_record(event, free)
    sim.event_synchronize(event)  # the held record no longer counts
    assert sim.event_query(event)
    sim.event_record(event, held)
    assert not sim.event_query(event)
    sim.release(held)


def test_elapsed_time_covers_latency(sim: SimDriver) -> None:
    stream = sim.stream_create(non_blocking=True, priority=0)
    start = sim.event_create(timing=True, blocking_sync=False)
    end = sim.event_create(timing=True, blocking_sync=False)
    sim.set_latency("kernel", 0.05)
    sim.event_record(start, stream)
    sim._enqueue(stream, lambda: None, "kernel")
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
    sim.hold(stream)
    sim.event_record(end, stream)
    with pytest.raises(CudaError) as info:
        sim.event_elapsed_ms(start, end)
    assert info.value.code == ResultCode.NOT_READY == 600
    sim.release(stream)


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
    sim.hold(stream)
    sim.launch_doorbell(stream, bell)
    assert not bell.wait(0.02)
    sim.release(stream)
    assert bell.wait(WAIT)


def test_doorbell_behind_an_event_completes_with_it(sim: SimDriver) -> None:
    """``await stream`` records an event then rings: once the event is seen, the stream is idle."""
    stream = sim.stream_create(non_blocking=True, priority=0)
    event = sim.event_create(timing=False, blocking_sync=False)
    bell = sim.new_doorbell()
    for _ in range(50):
        sim._enqueue(stream, lambda: None, "op")
        sim.event_record(event, stream)
        sim.launch_doorbell(stream, bell)
        while not sim.event_query(event):
            pass
        assert sim.stream_query(stream)
    assert bell.wait(0)


# -- error codes ------------------------------------------------------------------------------
def test_errors_read_like_the_drivers() -> None:
    from aiocuda._driver.sim._codes import code_name, sim_error

    assert code_name(ResultCode.ILLEGAL_ADDRESS) == "CUDA_ERROR_ILLEGAL_ADDRESS"
    assert code_name(ResultCode.SUCCESS) == "CUDA_SUCCESS"
    assert code_name(12345) == "CUresult 12345"
    error = sim_error(ResultCode.ILLEGAL_ADDRESS, "launch_kernel", "kernel 'k' read past the end")
    assert isinstance(error, ContextPoisonedError)
    assert error.call == "cuLaunchKernel"
    assert str(error) == (
        "cuLaunchKernel: CUDA_ERROR_ILLEGAL_ADDRESS (700): "
        "an illegal memory access was encountered: kernel 'k' read past the end"
    )
    assert sim_error(ResultCode.NOT_READY, "my_call").description == "device not ready"
    for code, value in vars(ResultCode).items():
        if isinstance(value, int) and value:
            assert sim_error(value, "x").description, code  # every named code is described


def test_sticky_fault_in_a_device_query_poisons_the_current_device(sim: SimDriver) -> None:
    on_device(sim, 1)
    sim.inject_fault(ResultCode.ECC_UNCORRECTABLE, call="device_name")
    with pytest.raises(ContextPoisonedError):
        sim.device_name(sim.device_get(0))
    with pytest.raises(ContextPoisonedError):
        sim.mem_get_info()
    on_device(sim, 0)
    assert sim.mem_get_info()[1] == 16 << 30


# -- faults -----------------------------------------------------------------------------------
def test_inject_fault_at_the_nth_call(sim: SimDriver) -> None:
    stream = sim.stream_create(non_blocking=True, priority=0)
    sim.inject_fault(ResultCode.INVALID_VALUE, at_call=3)
    sim.stream_query(stream)
    sim.stream_query(stream)
    with pytest.raises(ArgumentError) as info:
        sim.stream_query(stream)
    assert info.value.code == ResultCode.INVALID_VALUE and info.value.call == "cuStreamQuery"
    assert sim.stream_query(stream)  # fired once, then gone


def test_inject_fault_counts_only_the_named_call(sim: SimDriver) -> None:
    stream = sim.stream_create(non_blocking=True, priority=0)
    event = sim.event_create(timing=False, blocking_sync=False)
    sim.inject_fault(ResultCode.LAUNCH_OUT_OF_RESOURCES, at_call=2, call="event_record")
    sim.event_record(event, stream)
    for _ in range(5):
        sim.stream_query(stream)
        sim.event_query(event)
    with pytest.raises(LaunchError):
        sim.event_record(event, stream)
    sim.event_record(event, stream)
    sim.event_synchronize(event)


def test_sticky_injected_fault_poisons_the_device(sim: SimDriver) -> None:
    stream = sim.stream_create(non_blocking=True, priority=0)
    bell = sim.new_doorbell()
    sim.inject_fault(ResultCode.ILLEGAL_ADDRESS, call="launch_doorbell")
    with pytest.raises(ContextPoisonedError):
        sim.launch_doorbell(stream, bell)
    with pytest.raises(ContextPoisonedError) as info:
        sim.stream_query(stream)
    assert info.value.code == ResultCode.ILLEGAL_ADDRESS
    assert not bell.wait(0.02)


def test_inject_fault_validates_its_arguments(sim: SimDriver) -> None:
    with pytest.raises(ValueError):
        sim.inject_fault(ResultCode.INVALID_VALUE, at_call=0)
    with pytest.raises(ValueError, match="cuLaunchKernel"):
        sim.inject_fault(ResultCode.INVALID_VALUE, call="cuLaunchKernel")
    sim.inject_fault(ResultCode.INVALID_VALUE, call="launch_kernel")  # a seam name of another mixin


def test_two_faults_due_on_the_same_call_fire_one_after_the_other(sim: SimDriver) -> None:
    stream = sim.stream_create(non_blocking=True, priority=0)
    sim.inject_fault(ResultCode.INVALID_VALUE)
    sim.inject_fault(ResultCode.NOT_SUPPORTED)
    with pytest.raises(CudaError) as first:
        sim.stream_query(stream)
    with pytest.raises(CudaError) as second:
        sim.stream_query(stream)
    assert (first.value.code, second.value.code) == (ResultCode.INVALID_VALUE, ResultCode.NOT_SUPPORTED)
    assert sim.stream_query(stream)


# -- poisoning --------------------------------------------------------------------------------
def test_poison_fails_calls_and_pending_waits_fast(sim: SimDriver) -> None:
    stream = sim.stream_create(non_blocking=True, priority=0)
    event = sim.event_create(timing=False, blocking_sync=False)
    bell = sim.new_doorbell()
    sim.hold(stream)
    sim.event_record(event, stream)
    sim.launch_doorbell(stream, bell)
    errors: list[BaseException] = []

    def waiter(wait: Callable[[], None]) -> None:
        try:
            wait()
        except CudaError as exc:
            errors.append(exc)

    waiters = [
        threading.Thread(target=waiter, args=(lambda: sim.event_synchronize(event),)),
        threading.Thread(target=waiter, args=(lambda: sim.stream_synchronize(stream),)),
    ]
    for thread in waiters:
        thread.start()
    time.sleep(0.02)
    sim.poison(0)  # the stream is held: only the poisoning can end the waits
    for thread in waiters:
        thread.join(WAIT)
    assert len(errors) == 2 and all(isinstance(e, ContextPoisonedError) for e in errors)
    for call in (
        lambda: sim.event_query(event),
        lambda: sim.stream_query(stream),
        lambda: sim.stream_synchronize(stream),
        lambda: sim.stream_create(non_blocking=True, priority=0),
        lambda: sim.mem_get_info(),
    ):
        with pytest.raises(ContextPoisonedError):
            call()
    sim.release(stream)
    assert not bell.wait(0.05)  # host functions never run on a poisoned context
    assert sim.device_name(sim.device_get(0))  # device queries need no context
    on_device(sim, 1)  # the other device is unaffected
    other = sim.stream_create(non_blocking=True, priority=0)
    other_bell = sim.new_doorbell()
    sim.launch_doorbell(other, other_bell)
    assert other_bell.wait(WAIT)


def test_operation_exception_poisons_with_illegal_address(sim: SimDriver) -> None:
    stream = sim.stream_create(non_blocking=True, priority=0)
    ran: list[int] = []

    def bad_kernel() -> None:
        raise IndexError("index 10 is out of bounds for axis 0 with size 4")

    sim._enqueue(stream, bad_kernel, "bad_kernel")
    sim._enqueue(stream, lambda: ran.append(1), "after")
    with pytest.raises(ContextPoisonedError) as info:
        sim.stream_synchronize(stream)
    assert info.value.code == ResultCode.ILLEGAL_ADDRESS
    assert "bad_kernel" in str(info.value) and "IndexError" in str(info.value)
    assert isinstance(info.value.__cause__, IndexError)
    assert ran == []


def test_sticky_cuda_error_from_an_operation_poisons_with_its_code(sim: SimDriver) -> None:
    from aiocuda._driver.sim._codes import sim_error

    stream = sim.stream_create(non_blocking=True, priority=0)

    def asserting_kernel() -> None:
        raise sim_error(ResultCode.ASSERT, "launch_kernel", "assertion failed in kernel")

    sim._enqueue(stream, asserting_kernel, "asserting_kernel")
    with pytest.raises(ContextPoisonedError) as info:
        sim.stream_synchronize(stream)
    assert info.value.code == ResultCode.ASSERT
    assert ResultCode.ASSERT in STICKY_CODES


def test_non_sticky_operation_error_surfaces_once_at_the_next_call(sim: SimDriver) -> None:
    from aiocuda._driver.sim._codes import sim_error

    stream = sim.stream_create(non_blocking=True, priority=0)

    def failing_copy() -> None:
        raise sim_error(ResultCode.INVALID_VALUE, "memcpy_dtod_async", "bad range")

    ran: list[int] = []
    sim._enqueue(stream, failing_copy, "memcpy_dtod_async")
    sim._enqueue(stream, lambda: ran.append(1), "after")
    assert wait_until(lambda: ran == [1])  # the stream goes on
    with pytest.raises(ArgumentError, match="bad range"):
        sim.stream_query(stream)
    assert sim.stream_query(stream)


def test_poison_needs_a_sticky_code_and_a_device(sim: SimDriver) -> None:
    with pytest.raises(ValueError):
        sim.poison(0, code=ResultCode.INVALID_VALUE)
    with pytest.raises(ValueError):
        sim.poison(2)


def test_cross_device_wait_ends_when_the_other_device_is_poisoned(sim: SimDriver) -> None:
    source = sim.stream_create(non_blocking=True, priority=0)
    event = sim.event_create(timing=False, blocking_sync=False)
    sim.hold(source)
    sim.event_record(event, source)
    on_device(sim, 1)
    waiting = sim.stream_create(non_blocking=True, priority=0)
    sim.stream_wait_event(waiting, event)
    bell = sim.new_doorbell()
    sim.launch_doorbell(waiting, bell)
    assert not bell.wait(0.02)
    sim.poison(0)
    assert bell.wait(WAIT)  # device 1 is healthy and goes on
    sim.stream_synchronize(waiting)
    with pytest.raises(ContextPoisonedError):
        sim.event_query(event)


def test_streams_accept_raw_values(sim: SimDriver) -> None:
    log, op = recorder()
    stream = sim.stream_create(non_blocking=True, priority=0)
    sim._enqueue(stream.value, op("by value"), "op")
    sim._enqueue(0, op("null stream"), "op")
    sim.stream_synchronize(stream.value)
    sim.stream_synchronize(0)
    assert sorted(log) == ["by value", "null stream"]
    assert sim._stream_ordinal(0) == 0
    with pytest.raises(ArgumentError):
        sim._enqueue(2, op("per-thread stream"), "op")  # CU_STREAM_PER_THREAD: not simulated
    with pytest.raises(ArgumentError):
        sim._enqueue("stream", op("nonsense"), "op")


def test_concurrent_producers_keep_their_own_order(sim: SimDriver) -> None:
    stream = sim.stream_create(non_blocking=True, priority=0)
    log: list[tuple[int, int]] = []

    def produce(producer: int) -> None:
        for i in range(300):
            sim._enqueue(stream, functools.partial(log.append, (producer, i)), "op")

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
    for _ in range(5):
        sim._enqueue(stream, lambda: None, "kernel")
    sim.launch_doorbell(stream, bell)
    started = time.perf_counter()
    sim.stream_synchronize(stream)
    assert 0.1 <= time.perf_counter() - started < WAIT
    assert bell.wait(0)


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
            sim._enqueue(stream, lambda: None, "op")
            streams.append(stream)
    sim.hold(streams[0])
    sim._enqueue(streams[0], lambda: None, "op")
    sim.set_latency("slow", 10.0)
    sim._enqueue(streams[1], lambda: None, "slow")
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
    fresh.hold(stream)
    fresh._enqueue(stream, lambda: None, "op")
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
    fresh._enqueue(stream, op(1), "op")
    fresh.stream_synchronize(stream)
    assert wait_until(lambda: threading.active_count() == baseline)
    fresh._enqueue(stream, op(2), "op")
    fresh.stream_synchronize(stream)
    assert log == [1, 2]


def test_switching_backend_shuts_the_old_one_down() -> None:
    old = _driver.use_backend("sim", devices=1)
    stream = old.stream_create(non_blocking=True, priority=0)
    old.hold(stream)  # type: ignore[attr-defined]
    old.launch_doorbell(stream, old.new_doorbell())
    _driver.use_backend("sim", devices=1)
    with pytest.raises(CudaError):
        old.stream_query(stream)


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
@given(actions=_actions, release_order=st.permutations(range(_STREAMS)), unheld=st.integers(0, _STREAMS))
def test_random_programs_keep_stream_order_and_waits(
    sim: SimDriver, actions: list[Any], release_order: list[int], unheld: int
) -> None:
    """Streams in ``release_order[unheld:]`` are held while the program is enqueued, then
    released one by one: a missing dependency shows as an op run too early."""
    held = release_order[unheld:]
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

    for index in held:
        sim.hold(streams[index])
    for op_id, action in enumerate(actions):
        kind, s = action[0], action[1]
        legacy_order(s)
        if kind == "op":
            required[op_id] = frontier[s]
            sim._enqueue(streams[s], op(op_id), "op")
            frontier[s] |= {op_id}
        elif kind == "record":
            sim.event_record(events[action[2]], streams[s])
            captured[action[2]] = frontier[s]
        else:
            sim.stream_wait_event(streams[s], events[action[2]])
            frontier[s] |= captured[action[2]]
    for index in held:
        time.sleep(0.002)  # let whatever can run, run
        sim.release(streams[index])
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
