"""Awaitable streams and events: waiting, ordering, timing, cancellation, lifetime."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import time
import warnings
import weakref

import anyio
import numpy as np
import pytest

import aiocuda
from aiocuda import _driver
from aiocuda.device import Device
from aiocuda.errors import ArgumentError, BlockingCallWarning, CudaError
from aiocuda.event import Event
from aiocuda.stream import Stream, current_stream, use_stream

from ._workload import Gate, slow_op

pytestmark = pytest.mark.anyio


async def test_await_idle_stream_returns(backend: _driver.Driver, anyio_backend: object) -> None:
    with Stream(0) as s:
        await s
        assert s.query()


async def test_await_waits_for_enqueued_work(backend: _driver.Driver, anyio_backend: object) -> None:
    with Stream(0) as s:
        gate = Gate(s)
        returned = anyio.Event()

        async def waiter() -> None:
            await s
            returned.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            for _ in range(20):  # spin, poll, doorbell: every way of waiting gets its turn
                await anyio.sleep(0.001)
            assert not returned.is_set(), "await returned while the stream's work was pending"
            gate.open()
        assert s.query()


async def test_await_keeps_the_loop_running(backend: _driver.Driver, anyio_backend: object) -> None:
    """Another task runs while one awaits: the GPU's work ends only once it has run 20
    times (were the loop blocked, the gate would end by its own timeout, and too late)."""
    ticks = 0
    with Stream(0) as s:
        gate = Gate(s)
        async with anyio.create_task_group() as tg:

            async def ticker() -> None:
                nonlocal ticks
                for _ in range(20):
                    await anyio.sleep(0.002)
                    ticks += 1
                gate.open()

            tg.start_soon(ticker)
            await s
            done_at = ticks
    assert done_at == 20


async def test_event_await_query_and_timing(backend: _driver.Driver, anyio_backend: object) -> None:
    with Stream(0) as s:
        start = s.record(timing=True)
        slow_op(s, 0.03)
        end = s.record(timing=True)
        plain = s.record()
        assert not plain.query()
        await end
        await plain
        assert plain.query() and end.query()
        assert end.elapsed_ms(since=start) >= 20
        with pytest.raises(ArgumentError):
            plain.elapsed_ms(since=start)


async def test_unrecorded_event_is_complete(backend: _driver.Driver, anyio_backend: object) -> None:
    ev = Event(0)
    assert ev.query()
    await ev
    ev.close()


async def test_wait_orders_streams_on_the_gpu(backend: _driver.Driver, anyio_backend: object) -> None:
    with Stream(0) as producer, Stream(0) as consumer:
        slow_op(producer, 0.08)
        consumer.wait(producer)
        after = consumer.record()
        assert not after.query(), "the consumer must wait for the producer"
        await consumer
        assert producer.query()


async def test_wait_on_event(backend: _driver.Driver, anyio_backend: object) -> None:
    with Stream(0) as producer, Stream(0) as consumer:
        slow_op(producer, 0.05)
        ev = producer.record()
        consumer.wait(ev)
        assert not consumer.query()
        await consumer
        assert ev.query()
        with pytest.raises(TypeError):
            consumer.wait(42)  # type: ignore[arg-type]


async def test_cancel_scope_detaches_and_leaves_work_running(backend: _driver.Driver, anyio_backend: object) -> None:
    with Stream(0) as s:
        with Gate(s):  # the work goes on until the waiter has been cancelled
            with anyio.move_on_after(0.02) as scope:
                await s
            assert scope.cancelled_caught
            assert not s.query(), "cancelling the waiter must not touch the GPU work"
        await s
        assert s.query()


async def test_fail_after_raises_timeout(backend: _driver.Driver, anyio_backend: object) -> None:
    with Stream(0) as s:
        with Gate(s), pytest.raises(TimeoutError), anyio.fail_after(0.02):
            await s
        await s


async def test_many_streams_many_waiters(backend: _driver.Driver, anyio_backend: object) -> None:
    streams = [Stream(0) for _ in range(32)]
    finished = 0

    async def work(i: int, s: Stream) -> None:
        nonlocal finished
        for _ in range(5):
            slow_op(s, 0.001 * (i % 4))
            await s
        finished += 1

    async with anyio.create_task_group() as tg:
        for i, s in enumerate(streams):
            tg.start_soon(work, i, s)
    assert finished == 32
    for s in streams:
        s.close()


async def test_hold_keeps_objects_until_the_work_is_done(backend: _driver.Driver, anyio_backend: object) -> None:
    class Payload:
        pass

    with Stream(0) as s:
        slow_op(s, 0.1)
        payload = Payload()
        ref = weakref.ref(payload)
        s.hold(payload)
        del payload
        gc.collect()
        assert ref() is not None, "held while the GPU may still use it"
        await s
        s.hold()  # releases finished holds
        gc.collect()
        assert ref() is None


async def test_closing_a_stream_keeps_held_objects_alive(backend: _driver.Driver, anyio_backend: object) -> None:
    class Payload:
        pass

    s = Stream(0)
    slow_op(s, 0.1)
    payload = Payload()
    ref = weakref.ref(payload)
    s.hold(payload)
    del payload
    s.close()
    del s
    gc.collect()
    assert ref() is not None
    await anyio.sleep(0.15)
    with Stream(0) as other:
        await other  # sweeps orphaned holds
    gc.collect()
    assert ref() is None


def test_a_closed_stream_takes_no_work_and_says_what_to_do(backend: _driver.Driver) -> None:
    s = Stream(0)
    s.close()
    s.close()  # idempotent
    with pytest.raises(ArgumentError, match=r"closed.*stream="):
        Event(0).record(s)
    with pytest.raises(ArgumentError, match=r"closed.*stream="):
        s.record(timing=True)
    assert "closed" in repr(s)


def test_streams_take_streams_and_int_priorities(backend: _driver.Driver) -> None:
    with pytest.raises(TypeError, match="use_stream takes a Stream, not int"):
        with use_stream(3):  # type: ignore[arg-type]
            pass
    with pytest.raises(TypeError, match="priority is an int, not float"):
        Stream(0, priority=1.5)  # type: ignore[arg-type]
    # (True was taken as 1: the least urgent priority once clamped, not a high one)
    with pytest.raises(TypeError, match="priority is an int, not bool"):
        Stream(0, priority=True)
    with Stream(0, priority=np.int64(0)) as s:  # type: ignore[arg-type]
        assert s.priority == 0


async def test_a_closed_stream_can_still_be_waited_for(backend: _driver.Driver, anyio_backend: object) -> None:
    """Closing never cancels work already enqueued, and what waits for that work keeps
    working: an await, a query, another stream's wait, and an array whose last work ran
    on the stream (its next call orders itself after that work, stream= or not)."""
    with Stream(0) as other:
        s = Stream(0)
        x = await aiocuda.to_device(np.arange(8, dtype=np.float32), stream=s)
        slow_op(s, 0.05)
        s.close()
        assert not s.query()
        other.wait(s)
        assert not other.query(), "the other stream waits for the closed one's work"
        await s
        assert s.query() and s.record() is s.record()
        assert (await x.to_host() == np.arange(8)).all()
        assert (await x.to_host(stream=other) == np.arange(8)).all()


@pytest.mark.parametrize("current", [False, True], ids=["other", "current"])
async def test_a_closed_stream_holds_objects_until_its_work_is_done(
    backend: _driver.Driver, anyio_backend: object, current: bool
) -> None:
    """A closed stream's holds are kept by a live stream of its device, made to wait for
    its end. Inside ``use_stream(s)`` (``current``) that live stream was the task's
    current one, the closed ``s`` itself, which refused them (ArgumentError: closed)."""
    # (How memory owned elsewhere -- managed arrays, a PyTorch tensor's -- is given back
    # after its last stream closed: held until that stream's work is done, not at once.)

    class Kept:
        pass

    s = Stream(0)
    with use_stream(s) if current else contextlib.nullcontext():
        slow_op(s, 0.05)
        s.close()
        kept = Kept()
        alive = weakref.ref(kept)
        s.hold(kept)
        del kept
        gc.collect()
        assert alive() is not None
        await s
    keeper = current_stream(0)
    await keeper  # its hold's event, recorded after s's work, is done once this returns...
    await keeper  # ...and dropped by the next await (an await drops holds done before it starts)
    gc.collect()
    assert alive() is None


def test_record_takes_a_stream_and_an_event(backend: _driver.Driver) -> None:
    """Anything else failed with an AttributeError (``'int' object has no attribute
    'handle'``, or ``'record'``)."""
    with Stream(0) as s:
        array = aiocuda.empty(4, np.float32, stream=s)  # (a device, no handle)
        for foreign in (3, None, type("TorchLike", (), {"device": "cuda:0"})(), array):
            with pytest.raises(TypeError, match=r"Event\.record takes an aiocuda Stream, not"):
                Event(0).record(foreign)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"Stream\.record takes an Event, not int"):
            s.record(3)  # type: ignore[arg-type]
        with pytest.raises(ArgumentError, match="the event given has no timing"):
            s.record(Event(0), timing=True)  # (timing was ignored: elapsed_ms failed later)
        timed = Event(0, timing=True)
        assert s.record(timed, timing=True) is timed
        s.synchronize()


@pytest.mark.multi_gpu
def test_an_event_is_recorded_on_a_stream_of_its_device(backend: _driver.Driver) -> None:
    """The real driver refuses the record with "invalid resource handle"."""
    with Stream(0) as s:
        with pytest.raises(ArgumentError, match=r"an Event of device 1 is recorded on streams of device 1, not 0"):
            Event(1).record(s)
        with pytest.raises(ArgumentError, match=r"an Event of device 1 is recorded on streams of device 1, not 0"):
            s.record(Event(1, timing=True))


CLOSED_AFTER_A_FAULT = """
import anyio
from aiocuda.stream import Stream
from aiocuda.errors import ContextPoisonedError
from _workload import _kernel, poison_op


async def main():
    stream = Stream(0)
    if stream.device._driver.name != "sim":
        _kernel(stream, "poison")  # compiled and loaded before the fault
    poison_op(stream)
    try:
        await stream
    except ContextPoisonedError:
        pass
    stream.close()
    for name, call in [("query", stream.query), ("synchronize", stream.synchronize), ("record", stream.record)]:
        try:
            call()
        except ContextPoisonedError:
            print("POISONED", name)
    try:
        await stream
    except ContextPoisonedError:
        print("POISONED await")

anyio.run(main, backend="{lib}")
"""


@pytest.mark.parametrize("lib", ["asyncio", "trio"])
def test_a_closed_stream_of_a_poisoned_context_says_so(backend: _driver.Driver, lib: str) -> None:
    """Closed after a fault, a stream has no end to wait for (its record failed): an
    await, query, synchronize or record of it raised ArgumentError (closed), where every
    later call on a poisoned device raises ContextPoisonedError (in a process of its own:
    on the GPU a poisoned context stays poisoned)."""
    from .test_completion import run_script

    if lib == "trio":
        pytest.importorskip("trio")
    proc = run_script(CLOSED_AFTER_A_FAULT.replace("{lib}", lib), backend.name)
    poisoned = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("POISONED")]
    assert poisoned == ["query", "synchronize", "record", "await"], proc.stdout + proc.stderr


def test_a_closed_event_says_so(backend: _driver.Driver) -> None:
    with Stream(0) as s:
        for event in (Event(0).record(s), s.record()):
            event.close()
            with pytest.raises(ArgumentError, match="closed"):
                event.query()
            assert "closed" in repr(event)


def test_a_recorded_event_gives_its_pooled_handle_back_once(backend: _driver.Driver) -> None:
    """``stream.record()`` draws from the device's event pool; the handle goes back when
    the Event is closed or collected, and only once."""
    from aiocuda._completion.event_pool import EventPool

    free = EventPool.for_device(Device(0))._free  # (the reserve thread may add to it meanwhile)
    with Stream(0) as s:
        closed, dropped = s.record(), s.record()
        handles = [closed._handle, dropped._handle]
        assert not any(h in free for h in handles)
        closed.close()
        closed.close()
        assert free.count(handles[0]) == 1
        del dropped
        gc.collect()
        assert free.count(handles[1]) == 1
        del closed
        gc.collect()
        assert [free.count(h) for h in handles] == [1, 1]


async def test_closing_an_event_while_it_is_awaited(sim_backend: _driver.Driver, anyio_backend: object) -> None:
    """Its handle is destroyed (or given back to the pool) only once the await has ended:
    a pooled handle given back mid-wait would be recorded elsewhere and end the wait early."""
    with Stream(0) as s, Stream(0) as other:
        sim_backend.pause(s.handle)  # type: ignore[attr-defined]
        slow_op(s, 0.001)
        event = s.record()
        done = False

        async def waiter() -> None:
            nonlocal done
            await event
            done = True

        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await anyio.sleep(0.02)
            event.close()
            for _ in range(8):
                await other
            await anyio.sleep(0.05)
            assert not done
            sim_backend.resume(s.handle)  # type: ignore[attr-defined]
        assert done


async def test_blocking_calls_on_a_loop_thread_warn(backend: _driver.Driver, anyio_backend: object) -> None:
    with Stream(0) as s:
        with pytest.warns(BlockingCallWarning, match=r"Stream\.synchronize\(\) blocks the event loop"):
            s.synchronize()
        with pytest.warns(BlockingCallWarning, match=r"Event\.synchronize\(\)"):
            s.record().synchronize()


def test_blocking_calls_off_a_loop_do_not_warn(backend: _driver.Driver) -> None:
    with Stream(0) as s, warnings.catch_warnings():
        warnings.simplefilter("error", BlockingCallWarning)
        s.synchronize()
        s.record().synchronize()


@pytest.mark.multi_gpu
def test_wrap_takes_a_library_default_streams_device(backend: _driver.Driver) -> None:
    """A library's default stream has the value 0 (PyTorch) or 1 on every device: the
    device is the one its object names, not device 0 (an await on PyTorch's default
    stream of device 1 waited for device 0's work)."""

    class TorchLike:  # torch.cuda.Stream
        def __init__(self, value: int) -> None:
            self.cuda_stream, self.device_index = value, 1

    class CupyLike:  # cupy.cuda.Stream
        ptr, device_id = 0, 1

    class CoreLike:  # cuda.core's Stream
        device = type("Device", (), {"device_id": 1})()

        def __cuda_stream__(self) -> tuple[int, int]:
            return (0, 1)

    Stream(0).close()  # device 0 current on this thread
    for foreign in (TorchLike(0), TorchLike(1), CupyLike(), CoreLike()):
        assert Stream.wrap(foreign).device is Device(1), foreign
    assert Stream.wrap(CupyLike(), device=0).device is Device(0)  # device= still decides
    assert Stream.wrap(1).device is Device(0) and Stream.wrap(1, device=1).device is Device(1)
    assert Stream.wrap(2).device is Device(0) and Stream.wrap(2, device=1).device is Device(1)
    with Stream(1) as s1:  # a handle of its own names its device: the driver's answer stands
        assert Stream.wrap(TorchLike(int(s1))).device is Device(1)


@pytest.mark.multi_gpu
async def test_a_wrapped_default_stream_is_its_devices_whatever_is_current(
    backend: _driver.Driver, anyio_backend: object
) -> None:
    """A default stream's value (0, 1 or 2) means the default stream of the context current
    on the calling thread. The wrapper of device 1's, used while device 0's context was
    current, failed to await, record and hold (an event of device 1 recorded into device
    0's stream), and its query asked about device 0's stream."""
    Stream(0).close()  # device 0 current on this thread
    for value in (0, 1, 2):
        wrapped = Stream.wrap(value, device=1)
        with Gate(wrapped):
            Stream(0).close()
            assert not wrapped.query(), "device 1's default stream is busy"
            event = wrapped.record()
            wrapped.hold(object())
            Stream(0).close()
        await wrapped
        await event
        assert wrapped.query()


async def test_a_wrapped_per_thread_default_stream_orders_work(backend: _driver.Driver, anyio_backend: object) -> None:
    """``Stream.wrap(2)`` (``CU_STREAM_PER_THREAD``, PyTorch's and CuPy's per-thread
    default stream) is the calling thread's own default stream: a blocking stream, so the
    legacy default stream waits for its work and it waits for the legacy stream's; another
    thread's per-thread stream does not wait for it. (The simulator refused the value.)"""
    Stream(0).close()  # device 0 current on this thread
    wrapped = Stream.wrap(2)
    assert int(wrapped) == 2 and wrapped.device is Device(0)
    legacy = Stream.wrap(1)
    with Gate(wrapped) as gate:
        assert not wrapped.query(), "the per-thread stream is busy"
        event = wrapped.record()

        def on_another_thread() -> None:
            Stream.wrap(2).record().synchronize()  # that thread's own: not held by the gate

        await anyio.to_thread.run_sync(on_another_thread)
        # (before it: work on the legacy stream makes every blocking stream wait, the other
        # thread's per-thread stream too)
        after = legacy.record()  # the legacy stream waits for the per-thread stream's work
        assert not event.query() and not after.query()
    await wrapped
    await event
    await after
    assert not gate.timed_out
    with Gate(legacy) as gate:
        event = wrapped.record()  # waits for the legacy stream's earlier work
        assert not event.query()
    await event
    await legacy
    assert not gate.timed_out


@pytest.mark.multi_gpu
def test_wrap_refuses_a_device_the_stream_is_not_of(backend: _driver.Driver) -> None:
    """``device=`` names the device of a default stream (0, 1, 2), which the value does
    not; a stream of its own is of the device the driver says. Taken as another device,
    every await, record and hold of the wrapper failed with the driver's error for an
    event of one device recorded into a stream of another."""
    with Stream(1) as s1:
        for foreign in (int(s1), s1):
            with pytest.raises(ArgumentError, match="is a stream of device 1, not of device 0"):
                Stream.wrap(foreign, device=0)
        assert Stream.wrap(int(s1), device=1).device is Device(1)
        assert Stream.wrap(s1, device=Device(1)) is s1


def test_wrap_foreign_stream_without_ownership(backend: _driver.Driver) -> None:
    owner = Stream(0)
    raw = owner.__cuda_stream__()[1]
    foreign = Stream.wrap(raw)
    assert not foreign.owned
    assert foreign.device is Device(0)
    assert foreign.__cuda_stream__() == (0, raw)
    foreign.close()
    owner.record().synchronize()  # the original still works
    wrapped_proto = Stream.wrap(owner)
    assert wrapped_proto is owner

    class Foreign:
        def __cuda_stream__(self) -> tuple[int, int]:
            return (0, raw)

    assert int(Stream.wrap(Foreign(), device=0)) == raw
    with pytest.raises(TypeError):
        Stream.wrap("not a stream")
    owner.close()


@pytest.mark.parametrize(
    "returned",
    [None, (0,), (0, 1, 2), (0, 1.5), (0, None), (0, "1"), (0, True), (3, 1), 1],
    ids=["None", "one", "three", "float", "no-handle", "str", "bool", "version-3", "int"],
)
def test_wrap_refuses_what_is_not_the_cuda_stream_protocol(backend: _driver.Driver, returned: object) -> None:
    """``__cuda_stream__()`` returns ``(0, handle)``. Anything else failed with an
    unpacking error naming no stream, or, for (0, 1.5), wrapped the legacy default stream
    (``int(1.5)``) instead of failing; an unknown version was taken as version 0."""

    class Foreign:
        def __cuda_stream__(self) -> object:
            return returned

    with pytest.raises(TypeError, match=r"Foreign.__cuda_stream__\(\) returned .*, not \(0, handle\)"):
        Stream.wrap(Foreign())


def test_wrap_refuses_objects_that_are_no_streams(backend: _driver.Driver) -> None:
    """A ``.handle`` is a stream's for a Numba stream only (a ctypes ``c_void_p`` or a
    ``CUstream``), a ``.ptr`` for a CuPy stream only (which has a ``device_id``). Others
    were read as stream handles: an aiocuda Event's handle, an array's or a CuPy event's
    pointer (on the real driver, one in readable host memory passed the handle checks
    and was read as a stream object), a str's digits, 1.5 as the legacy default stream."""

    class Handled:
        def __init__(self, handle: object) -> None:
            self.handle = handle

    class CupyEventLike:
        ptr = 0x1000

    with Stream(0) as s:
        array = aiocuda.empty(4, np.float32, stream=s)
        for obj in (Event(0), array, CupyEventLike(), Handled("abc"), Handled("123"), Handled(1.5)):
            with pytest.raises(TypeError, match=f"cannot use {type(obj).__name__} as a CUDA stream"):
                Stream.wrap(obj)
        assert int(Stream.wrap(Handled(ctypes.c_void_p(int(s))))) == int(s)  # a Numba stream's


def test_current_stream_is_task_local(backend: _driver.Driver) -> None:
    default = current_stream()
    assert current_stream(0) is default
    with Stream(0) as s:
        with use_stream(s):
            assert current_stream() is s
        assert current_stream() is default


async def test_tasks_started_inside_use_stream_keep_it(backend: _driver.Driver, anyio_backend: object) -> None:
    """As use_stream's docstring says: the current stream is a context variable, so a
    task started inside the block has it, after the block too; the starter does not."""
    seen: list[Stream] = []
    go_on = anyio.Event()

    async def child() -> None:
        await go_on.wait()
        seen.append(current_stream())

    with Stream(0) as s:
        async with anyio.create_task_group() as tg:
            with use_stream(s):
                tg.start_soon(child)
            assert current_stream() is not s
            go_on.set()
        assert seen == [s]


def test_priority_range_and_synchronize(backend: _driver.Driver) -> None:
    least, greatest = Stream.priority_range(0)
    assert greatest <= least
    with Stream(0, priority=greatest) as s:
        slow_op(s, 0.01)
        s.synchronize()
        assert s.query()


async def test_awaiting_a_temporary_event_keeps_its_handle(sim_backend: _driver.Driver, anyio_backend: object) -> None:
    """``await stream.record()``: nothing else references the Event while it is awaited.
    Collected then, it would give its pooled handle back, the next await would record it
    elsewhere, and this await would end early (data read before the GPU wrote it)."""
    with Stream(0) as held, Stream(0) as other:
        sim_backend.pause(held.handle)  # type: ignore[attr-defined]
        slow_op(held, 0.001)
        done = False

        async def waiter() -> None:
            nonlocal done
            await held.record()
            done = True

        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await anyio.sleep(0.02)
            gc.collect()
            for _ in range(8):  # pooled handles are reused, most recently returned first
                await other
            await anyio.sleep(0.05)  # the waiter, on its doorbell by now, is checked periodically
            assert not done, "the await ended before the work it waits for"
            sim_backend.resume(held.handle)  # type: ignore[attr-defined]
        assert done


async def test_hold_keeps_objects_while_the_work_is_pending(sim_backend: _driver.Driver, anyio_backend: object) -> None:
    """Every path that drops held objects -- a later hold, an await of another stream
    (which sweeps closed streams' holds), closing the stream -- keeps them while the work
    they were held for is pending: the simulated stream is paused, so it stays pending
    for as long as the test needs. Pinned copies rely on this to keep host memory alive
    during a DMA."""

    class Payload:
        pass

    sim = sim_backend
    s, other = Stream(0), Stream(0)
    sim.pause(s.handle)  # type: ignore[attr-defined]
    slow_op(s, 0.001)
    payload = Payload()
    ref = weakref.ref(payload)
    s.hold(payload)
    del payload
    s.hold()  # releases the holds whose work finished: none has
    gc.collect()
    assert ref() is not None, "released by a later hold while its work was pending"
    await other
    gc.collect()
    assert ref() is not None, "released by an await while its work was pending"
    handle = s.handle
    s.close()  # the held objects outlive the stream until the work is done
    await other
    gc.collect()
    assert ref() is not None, "released when the stream was closed, with its work pending"
    sim.resume(handle)  # type: ignore[attr-defined]
    await anyio.sleep(0.01)
    for _ in range(100):  # the work is done at once now; an await sweeps the closed stream's holds
        await other
        gc.collect()
        if ref() is None:
            break
        await anyio.sleep(0.01)
    assert ref() is None
    other.close()


async def test_elapsed_ms_is_the_drivers_figure(backend: _driver.Driver, anyio_backend: object) -> None:
    """``end.elapsed_ms(since=start)`` is the driver's own figure for the two events (the
    control, read through the seam in the same run), and lies within the host's view of
    the interval: after the work it measures was enqueued, before its end was awaited."""
    with Stream(0) as s:
        started = time.perf_counter()
        start = s.record(timing=True)
        slow_op(s, 0.05)
        end = s.record(timing=True)
        await end
        host_ms = (time.perf_counter() - started) * 1e3
        elapsed = end.elapsed_ms(since=start)
        assert elapsed == backend.event_elapsed_ms(start.handle, end.handle)
        assert 45 <= elapsed <= host_ms, (elapsed, host_ms)


def test_elapsed_ms_says_what_is_wrong(backend: _driver.Driver) -> None:
    """An event never recorded, or not yet complete, or no Event at all: the real driver
    says only "invalid resource handle" or "device not ready", and a ``since`` that is no
    Event was told it needs timing=True."""
    with Stream(0) as s:
        start, end, never = (Event(0, timing=True) for _ in range(3))
        start.record(s)
        with Gate(s):
            end.record(s)
            with pytest.raises(CudaError, match=r"elapsed_ms: this event has not completed yet: await it"):
                end.elapsed_ms(since=start)
        end.synchronize()
        with pytest.raises(ArgumentError, match=r"elapsed_ms: since= was never recorded"):
            end.elapsed_ms(since=never)
        with pytest.raises(ArgumentError, match=r"elapsed_ms: this event was never recorded"):
            never.elapsed_ms(since=start)
        with pytest.raises(TypeError, match="elapsed_ms takes since=an Event, not int"):
            end.elapsed_ms(since=3)  # type: ignore[arg-type]
        assert end.elapsed_ms(since=start) >= 0


@pytest.mark.multi_gpu
def test_elapsed_ms_refuses_events_of_two_devices(backend: _driver.Driver) -> None:
    """The real driver fails cuEventElapsedTime for events of two devices (with "invalid
    resource handle"); the simulator measured them."""
    with Stream(0) as s0, Stream(1) as s1:
        start, end = Event(0, timing=True).record(s0), Event(1, timing=True).record(s1)
        start.synchronize()
        end.synchronize()
        with pytest.raises(ArgumentError, match="events of device 1 and device 0"):
            end.elapsed_ms(since=start)


def test_priority_and_flags_getters(backend: _driver.Driver) -> None:
    least, greatest = Stream.priority_range(0)
    with Stream(0, priority=greatest) as urgent, Stream(0, non_blocking=False) as blocking:
        assert urgent.priority == greatest and urgent.non_blocking
        assert blocking.priority == least and not blocking.non_blocking
        wrapped = Stream.wrap(int(urgent))  # a foreign handle reports what the driver keeps
        assert wrapped.priority == greatest
    with Stream(0, priority=greatest - 100) as clamped:
        assert clamped.priority == greatest


def test_priorities_beyond_a_c_int_are_clamped_too(backend: _driver.Driver) -> None:
    """The driver takes a C int: a larger priority raised the bindings' OverflowError on
    the real driver (the simulator clamped it) instead of being clamped as documented."""
    least, greatest = Stream.priority_range(0)
    with Stream(0, priority=-(2**40)) as urgent, Stream(0, priority=2**63) as lax:
        assert (urgent.priority, lax.priority) == (greatest, least)


@pytest.mark.anyio
async def test_external_event_records_complete_like_others(backend: _driver.Driver, anyio_backend: object) -> None:
    with Stream(0) as s:
        slow_op(s, 0.01)
        event = Event(0).record(s, external=True)
        await event
        assert event.query()
