"""The simulated driver's errors: result codes, injected faults, poisoned contexts.

These test the sim itself (its controls have no real-driver counterpart), so they use the
``sim`` fixture (the backend in use) or ``fresh`` (a SimDriver of their own).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from aiocuda._driver.sim import SimDriver
from aiocuda.errors import (
    STICKY_CODES,
    ArgumentError,
    ContextPoisonedError,
    CudaError,
    LaunchError,
    ResultCode,
)

from ._helpers import WAIT, on_device, wait_until


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


def test_sticky_fault_in_a_device_query_poisons_the_current_device_and_every_other(sim: SimDriver) -> None:
    on_device(sim, 1)
    sim.inject_fault(ResultCode.ECC_UNCORRECTABLE, call="device_name")
    with pytest.raises(ContextPoisonedError):
        sim.device_name(sim.device_get(0))
    with pytest.raises(ContextPoisonedError):
        sim.mem_get_info()
    with pytest.raises(ContextPoisonedError, match="sticky error on device 1"):  # as on GPUs: the process's
        on_device(sim, 0)


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


@pytest.mark.parametrize(
    ("call", "counted_as"),
    [
        ("prepare_launch", "launch_kernel"),
        ("mem_async_calls", "mem_alloc_async"),
        ("handle_value", "no driver call"),
        ("graph_exec_copy_setter", "no driver call"),
    ],
)
def test_inject_fault_refuses_a_call_that_is_never_counted(sim: SimDriver, call: str, counted_as: str) -> None:
    """Driver methods whose name no call counts under were accepted, and the fault never fired."""
    with pytest.raises(ValueError, match=f"{call}.*{counted_as}"):
        sim.inject_fault(ResultCode.INVALID_VALUE, call=call)
    assert not sim._faults.armed


def test_inject_fault_refuses_success(sim: SimDriver) -> None:
    """Code 0 used to fail the call with a CudaError saying CUDA_SUCCESS, no error."""
    with pytest.raises(ValueError, match="CUDA_SUCCESS"):
        sim.inject_fault(ResultCode.SUCCESS, call="stream_create")
    assert not sim._faults.armed


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
    sim.pause(stream)
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
    sim.poison(0)  # the stream is paused: only the poisoning can end the waits
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
    sim.resume(stream)
    assert not bell.wait(0.05)  # host functions never run on a poisoned context
    assert sim.device_name(sim.device_get(0))  # device queries need no context
    with pytest.raises(ContextPoisonedError, match="sticky error on device 0"):
        on_device(sim, 1)  # the other device's context too: as on GPUs, the process is done


def test_operation_exception_poisons_with_illegal_address(sim: SimDriver) -> None:
    stream = sim.stream_create(non_blocking=True, priority=0)
    ran: list[int] = []

    def bad_kernel() -> None:
        raise IndexError("index 10 is out of bounds for axis 0 with size 4")

    sim.enqueue(stream, bad_kernel, "bad_kernel")
    sim.enqueue(stream, lambda: ran.append(1), "after")
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

    sim.enqueue(stream, asserting_kernel, "asserting_kernel")
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
    sim.enqueue(stream, failing_copy, "memcpy_dtod_async")
    sim.enqueue(stream, lambda: ran.append(1), "after")
    assert wait_until(lambda: ran == [1])  # the stream goes on
    with pytest.raises(ArgumentError, match="bad range"):
        sim.stream_query(stream)
    assert sim.stream_query(stream)


def test_poison_needs_a_sticky_code_and_a_device(sim: SimDriver) -> None:
    with pytest.raises(ValueError):
        sim.poison(0, code=ResultCode.INVALID_VALUE)
    with pytest.raises(ValueError):
        sim.poison(2)


def test_a_cross_device_wait_fails_when_the_other_device_is_poisoned(sim: SimDriver) -> None:
    source = sim.stream_create(non_blocking=True, priority=0)
    event = sim.event_create(timing=False, blocking_sync=False)
    sim.pause(source)
    sim.event_record(event, source)
    on_device(sim, 1)
    waiting = sim.stream_create(non_blocking=True, priority=0)
    sim.stream_wait_event(waiting, event)
    bell = sim.new_doorbell()
    sim.launch_doorbell(waiting, bell)
    assert not bell.wait(0.02)
    sim.poison(0)
    with pytest.raises(ContextPoisonedError):  # device 1 is poisoned with it: the wait ends, failing
        sim.stream_synchronize(waiting)
    assert not bell.wait(0.05)  # and runs no host function
    with pytest.raises(ContextPoisonedError):
        sim.event_query(event)
