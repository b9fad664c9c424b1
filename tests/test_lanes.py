"""Request lanes: one await per request, back-pressure, priorities, cancellation, faults,
shutdown, reuse without growth.

Held streams and injected faults (the simulator's deterministic controls) decide what is
in flight; no test depends on how long anything takes.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import threading
import warnings
from types import SimpleNamespace
from typing import Any, Literal

import anyio
import anyio.lowlevel
import anyio.to_thread
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiocuda import _driver
from aiocuda._cli.demo import ScaleStage, scale_reference
from aiocuda._completion.engine import current_engine
from aiocuda._executor import lane as lane_module
from aiocuda._executor import lanes as lanes_module
from aiocuda.device import Device
from aiocuda.errors import ArgumentError, BlockingCallWarning, ClosedError, ContextPoisonedError, OutOfMemoryError
from aiocuda.host import empty_cache, pinned_empty
from aiocuda.interop import as_device_array
from aiocuda.lanes import Lane, Lanes, Priority
from aiocuda.memory import MemoryPool
from aiocuda.stream import Stream

from ._control import checkpoints, reserve_thread_done

pytestmark = pytest.mark.anyio

REPS = 20


def is_closed(lanes: Lanes) -> bool:
    return repr(lanes).startswith(f"<Lanes device={lanes.device.ordinal} closed")


def used_bytes() -> int:
    gc.collect()
    return MemoryPool.for_device(Device(0)).statistics().used_bytes


async def scaled(lanes: Lanes, host: np.ndarray, scale: ScaleStage, **lease: Any) -> np.ndarray:
    """The request path: lease, enqueue upload, kernel and download, one await."""
    async with lanes.lease(**lease) as lane:
        x = lane.upload(host)
        scale.kernel.launch((x.size + 255) // 256, 256, x, x.size, REPS, stream=lane.stream)
        out = lane.download(x)
        await lane
    return out


async def test_requests_on_lanes_compute_and_return_results(backend: Any, anyio_backend: Any) -> None:
    scale = ScaleStage(REPS)
    rng = np.random.default_rng(0)
    inputs = [rng.random(1000 + i, dtype=np.float32) for i in range(12)]
    inputs.append(pinned_empty(500, np.float32))  # pinned input and output: direct DMA
    inputs[-1][:] = 1.5
    results: dict[int, np.ndarray] = {}
    async with Lanes(count=4) as lanes:

        async def one(i: int) -> None:
            results[i] = await scaled(lanes, inputs[i], scale)

        async with anyio.create_task_group() as tg:
            for i in range(len(inputs)):
                tg.start_soon(one, i)
        assert lanes.statistics().leases == len(inputs)
    for i, host in enumerate(inputs):
        np.testing.assert_allclose(results[i], scale_reference(host, REPS), rtol=1e-4)


@pytest.mark.filterwarnings("ignore::aiocuda.errors.BlockingCallWarning")  # (its spill may pin memory)
async def test_download_into_given_arrays_and_upload_into_given_device_array(backend: Any, anyio_backend: Any) -> None:
    host = np.arange(4096, dtype=np.float32)
    pinned_out = pinned_empty(4096, np.float32)
    pageable_out = np.zeros(4096, np.float32)

    def setup(lane: Lane) -> Any:
        return lane.empty(4096, np.float32)  # scratch kept for the lane's life

    async with Lanes(count=2, setup=setup, staging=4096) as lanes:  # staging: one copy's worth
        async with lanes.lease() as lane:
            x = lane.upload(host, out=lane.state)
            assert x is lane.state
            lane.download(x, out=pinned_out)
            lane.download(x, out=pageable_out)  # beyond the staging block: a borrowed pinned one
            assert not pageable_out.any()  # filled by the await, not before
            await lane
        np.testing.assert_array_equal(pinned_out, host)
        np.testing.assert_array_equal(pageable_out, host)
        async with lanes.lease() as lane:
            with pytest.raises(ArgumentError, match="shape"):
                lane.upload(np.zeros(3, np.float32), out=lane.state)
            interface = dict(lane.state.__cuda_array_interface__, data=(lane.state.ptr, True))
            readonly = as_device_array(SimpleNamespace(__cuda_array_interface__=interface))
            with pytest.raises(ArgumentError, match="read-only"):
                lane.upload(host, out=readonly)
            with pytest.raises(ArgumentError, match="C-contiguous and writeable"):
                lane.download(lane.state, out=np.zeros(8192, np.float32)[::2])
            with pytest.raises(TypeError):
                lane.download(host)  # type: ignore[arg-type]
        for _ in range(3):  # setup's memory is the lane's own: it outlives every lease
            async with lanes.lease() as lane:
                pinned_out[:] = 0
                lane.download(lane.upload(host + 1, out=lane.state), out=pinned_out)
                await lane
            np.testing.assert_array_equal(pinned_out, host + 1)


async def test_a_spill_pins_memory_on_the_loop_only_when_the_cache_has_none(backend: Any, anyio_backend: Any) -> None:
    """A lane's copy of pageable memory beyond what is left of its staging goes through a
    block of the pinned cache. When the cache has none of that size, pinning one blocks
    the loop's thread: the copy warns (BlockingCallWarning, at the caller's line), and the
    reserve thread pins a spare, so that the next such copy takes it without pinning."""
    host = np.arange(1 << 14, dtype=np.float32)  # 64 KiB, beyond the staging
    async with Lanes(count=1, staging=4096) as lanes:
        await reserve_thread_done()
        empty_cache()
        async with lanes.lease() as lane:
            with pytest.warns(BlockingCallWarning, match=r"Lanes\(staging=") as caught:
                x = lane.upload(host)
            assert [w.filename for w in caught] == [__file__]
            await reserve_thread_done()  # the spare, pinned off the loop
            with warnings.catch_warnings():
                warnings.simplefilter("error", BlockingCallWarning)
                out = lane.download(x)  # spills too, into the spare
            await lane
        np.testing.assert_array_equal(out, host)


async def test_a_spill_refused_by_an_error_filter_still_pins_a_spare_for_the_next(
    backend: Any, anyio_backend: Any
) -> None:
    """A service that makes BlockingCallWarning an error (as its docstring suggests) gets
    the error for a spill that found no block; the spare was asked for only after the
    warning, so it was never pinned and every later spill of that size raised too."""
    host = np.arange(1 << 14, dtype=np.float32)  # 64 KiB, beyond the staging
    async with Lanes(count=1, staging=4096) as lanes:
        await reserve_thread_done()
        empty_cache()
        with warnings.catch_warnings():
            warnings.simplefilter("error", BlockingCallWarning)
            async with lanes.lease() as lane:
                with pytest.raises(BlockingCallWarning):
                    lane.upload(host)
            await reserve_thread_done()  # the spare, pinned off the loop
            async with lanes.lease() as lane:
                x = lane.upload(host)  # into the spare
                await lane
                np.testing.assert_array_equal(await x.to_host(stream=lane.stream), host)


async def test_request_memory_is_freed_when_the_lease_ends(backend: Any, anyio_backend: Any) -> None:
    async with Lanes(count=2) as lanes:
        baseline = used_bytes()
        async with lanes.lease() as lane:
            lane.empty(1 << 16)
            lane.upload(np.ones(1 << 14, np.float32))
            assert used_bytes() > baseline
            await lane
        await lanes.lanes[0].stream
        assert used_bytes() == baseline


async def test_back_pressure_and_priorities(sim_backend: Any, anyio_backend: Any) -> None:
    order: list[str] = []
    async with Lanes(count=1, priorities=("normal", "high")) as lanes:
        (lane,) = lanes.lanes
        normal, high = lane.streams
        least, greatest = Device(0)._driver.stream_priority_range()
        assert sim_backend._resolve_stream(high.handle).priority == greatest
        assert sim_backend._resolve_stream(normal.handle).priority == least

        async def request(name: str, priority: Any) -> None:
            async with lanes.lease(priority=priority) as leased:
                order.append(name)
                assert leased.stream is (high if priority == "high" else normal)
                await leased

        let_go = anyio.Event()

        async def holder() -> None:
            async with lanes.lease():
                await let_go.wait()

        async with anyio.create_task_group() as tg:
            tg.start_soon(holder)
            await checkpoints()
            tg.start_soon(request, "normal-1", "normal")
            await checkpoints()
            tg.start_soon(request, "high", "high")
            await checkpoints()
            assert lanes.statistics().waiting == 2 and lanes.statistics().leased == 1
            let_go.set()  # the lane goes to the waiting high-priority request first
    assert order == ["high", "normal-1"]
    with pytest.raises(ArgumentError, match="priorities"):
        Lanes(count=1).lease(priority="high")


async def test_cancelled_request_returns_its_lane_and_memory(sim_backend: Any, anyio_backend: Any) -> None:
    async with Lanes(count=1) as lanes:
        (lane,) = lanes.lanes
        baseline = used_bytes()
        sim_backend.pause(lane.stream.handle)
        entered = anyio.Event()
        with anyio.CancelScope() as scope:

            async def cancel_when_entered() -> None:
                await entered.wait()
                await checkpoints()
                scope.cancel()

            async with anyio.create_task_group() as tg:
                tg.start_soon(cancel_when_entered)
                async with lanes.lease() as leased:
                    leased.upload(np.arange(1000, dtype=np.float32))
                    leased.empty(1 << 16)
                    entered.set()
                    await leased  # the stream is held: only the cancellation ends this
        assert scope.cancelled_caught
        assert lanes.statistics().leased == 0  # the lane is back at once

        # The next lease of the lane waits for the cancelled request's work first.
        got_it = anyio.Event()

        async def next_request() -> None:
            async with lanes.lease() as again:
                got_it.set()
                await again

        async with anyio.create_task_group() as tg:
            tg.start_soon(next_request)
            await checkpoints()
            assert not got_it.is_set()
            sim_backend.resume(lane.stream.handle)
        assert got_it.is_set()
        await lane.stream
        assert used_bytes() == baseline


async def test_the_next_lease_waits_for_staging_used_after_the_await(
    sim_backend: Any, anyio_backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lease that awaited its work leaves its lane idle: the next lease asks nothing.
    One that staged a copy after its await has the lane's staging in flight: the next
    lease, which would write that staging, waits for it."""
    async with Lanes(count=1) as lanes:
        (lane,) = lanes.lanes
        queried: list[object] = []
        query = sim_backend.stream_query
        monkeypatch.setattr(sim_backend, "stream_query", lambda stream: queried.append(stream) or query(stream))
        async with lanes.lease() as leased:
            leased.upload(np.arange(100, dtype=np.float32))
            await leased
        queried.clear()
        async with lanes.lease() as leased:
            assert not queried  # awaited: nothing asked
            await leased
            sim_backend.pause(lane.stream.handle)
            leased.upload(np.arange(100, dtype=np.float32))  # staged after the await, in flight
        got_it = anyio.Event()

        async def next_request() -> None:
            async with lanes.lease() as again:
                got_it.set()
                await again

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(next_request)
                await checkpoints()
                assert not got_it.is_set()
                sim_backend.resume(lane.stream.handle)
        finally:
            sim_backend.resume(lane.stream.handle)
        assert got_it.is_set()


async def test_a_poisoned_device_fails_pending_and_later_requests(sim_backend: Any, anyio_backend: Any) -> None:
    async with Lanes(count=2) as lanes:
        errors: list[BaseException] = []
        for lane in lanes.lanes:
            sim_backend.pause(lane.stream.handle)

        async def request() -> None:
            try:
                async with lanes.lease() as leased:
                    leased.upload(np.ones(100, np.float32))
                    await leased
            except ContextPoisonedError as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            for _ in range(3):  # two on lanes, one waiting for a lane
                tg.start_soon(request)
            await checkpoints()
            assert lanes.statistics().waiting == 1
            sim_backend.poison(0)
        assert len(errors) == 3
        assert lanes.failure is not None and lanes.statistics().failed
        with pytest.raises(ContextPoisonedError, match="failed earlier"):
            async with lanes.lease():
                pass


async def test_shutdown_lets_requests_in_flight_finish(sim_backend: Any, anyio_backend: Any) -> None:
    scale = ScaleStage(REPS)
    lanes = Lanes(count=1)
    await lanes.start()
    (lane,) = lanes.lanes
    sim_backend.pause(lane.stream.handle)
    host = np.arange(100, dtype=np.float32)
    results: list[np.ndarray] = []
    closed = False

    async def request() -> None:
        results.append(await scaled(lanes, host, scale))

    async def close() -> None:
        nonlocal closed
        await lanes.aclose()
        closed = True

    async with anyio.create_task_group() as tg:
        tg.start_soon(request)  # on the lane
        tg.start_soon(request)  # waiting for it
        await checkpoints()
        tg.start_soon(close)
        await checkpoints()
        assert not closed
        with pytest.raises(ClosedError):
            async with lanes.lease():
                pass
        sim_backend.resume(lane.stream.handle)
    assert closed and len(results) == 2
    for result in results:
        np.testing.assert_allclose(result, scale_reference(host, REPS), rtol=1e-4)
    assert lane.stream.closed


async def test_a_lane_is_refused_outside_its_lease(sim_backend: Any, anyio_backend: Any) -> None:
    # (An `await lane` one indent too far out, or a task keeping the lane: the lane is
    # another request's soon, and would settle that one's downloads.)
    async with Lanes(count=1) as lanes:
        async with lanes.lease() as lane:
            x = lane.upload(np.ones(4, np.float32))
            await lane
        for use in (lambda: lane.upload(np.ones(4, np.float32)), lambda: lane.empty(4), lambda: lane.download(x)):
            with pytest.raises(RuntimeError, match="lane 0 is not leased"):
                use()
        with pytest.raises(RuntimeError, match="lane 0 is not leased"):
            await lane
        async with lanes.lease() as again:  # the next lease has it
            assert again is lane
            np.testing.assert_array_equal(await scaled_copy(again, np.full(4, 2, np.float32)), 2)


async def scaled_copy(lane: Lane, host: np.ndarray) -> np.ndarray:
    out = lane.download(lane.upload(host))
    await lane
    return out


async def test_tasks_of_one_request_sharing_its_lane_each_get_their_downloads(
    sim_backend: Any, anyio_backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two tasks of a request copy through its lane and await it (asyncio.gather of two
    helpers, say). The second enqueues its copies while the first waits, behind a
    kernel still running when the first one's copies are done: the first await must
    not fill the second's download from the staging (not written yet) nor recycle the
    staging under its copies. It waits for them too, and each task gets its data."""
    gates = [threading.Event(), threading.Event()]  # two slow kernels, one per task
    woken = anyio.Event()  # the first task's wait is over: it returned, or waits again
    watching = False
    loop_thread = threading.get_ident()
    record = sim_backend.event_record

    def noting_record(event: Any, stream: Any) -> Any:
        if watching and threading.get_ident() == loop_thread:  # (a wait begins: an event recorded)
            woken.set()
        return record(event, stream)

    monkeypatch.setattr(sim_backend, "event_record", noting_record)
    results: dict[str, np.ndarray] = {}
    first_waits = anyio.Event()
    async with Lanes(count=1) as lanes:
        (lane,) = lanes.lanes

        async def first() -> None:
            sim_backend.enqueue(lane.stream.handle, gates[0].wait)
            out = lane.download(lane.upload(np.full(1000, 1, np.float32)))
            first_waits.set()
            await lane
            results["first"] = out
            woken.set()

        async def second() -> None:
            await first_waits.wait()
            sim_backend.enqueue(lane.stream.handle, gates[1].wait)
            out = lane.download(lane.upload(np.full(1000, 2, np.float32)))
            await lane
            results["second"] = out

        try:
            with anyio.fail_after(30):  # (only a hang reaches it)
                async with lanes.lease(), anyio.create_task_group() as tg:
                    tg.start_soon(first)
                    tg.start_soon(second)
                    await checkpoints()
                    watching = True
                    gates[0].set()  # the first task's copies run; the second's wait
                    await woken.wait()
                    gates[1].set()
        finally:
            for gate in gates:
                gate.set()
    np.testing.assert_array_equal(results["first"], 1)
    np.testing.assert_array_equal(results["second"], 2)


async def test_downloads_of_a_lease_that_awaited_its_stream_are_filled(sim_backend: Any, anyio_backend: Any) -> None:
    # `await lane.stream` instead of `await lane`: the copies are done when the lease ends,
    # which fills the downloads from the staging instead of dropping them.
    async with Lanes(count=1) as lanes:
        for i in range(10):
            host = np.full(256, 1000.5 + i, np.float32)
            async with lanes.lease() as lane:
                out = lane.download(lane.upload(host))
                await lane.stream
            np.testing.assert_array_equal(out, host)


async def test_a_lease_that_ends_with_its_downloads_not_done_warns(sim_backend: Any, anyio_backend: Any) -> None:
    """A block that forgot ``await lane`` got arrays never filled, without a word; it
    gets a RuntimeWarning pointing at the block. Downloads whose copies are done by the
    lease's end are filled, silently."""
    async with Lanes(count=1) as lanes:
        host = np.arange(256, dtype=np.float32)
        with pytest.warns(RuntimeWarning, match="not awaited: their arrays were not filled") as caught:
            async with lanes.lease() as lane:
                sim_backend.pause(lane.stream.handle)
                lane.download(lane.upload(host))
        assert caught[0].filename == __file__
        sim_backend.resume(lane.stream.handle)
        async with lanes.lease() as lane:
            out = lane.download(lane.upload(host))
            await lane.stream
        np.testing.assert_array_equal(out, host)


async def test_closing_the_pool_at_once_leaves_leased_lanes_to_their_requests(
    sim_backend: Any, anyio_backend: Any
) -> None:
    lanes = Lanes(count=1)
    await lanes.start()
    host = np.arange(1000, dtype=np.float32)
    refused: list[BaseException] = []

    async def waiting() -> None:
        try:
            async with lanes.lease():
                pass
        except ClosedError as exc:
            refused.append(exc)

    async with anyio.create_task_group() as tg:
        async with lanes.lease() as lane:
            tg.start_soon(waiting)
            await checkpoints()
            assert lanes.statistics().waiting == 1
            x = lane.upload(host)
            out = lane.download(x)  # through the lane's staging
            lanes.close()  # (a forced shutdown from another task)
            await checkpoints()
            assert len(refused) == 1  # a request in line is refused, not handed a closed lane
            await Stream()  # another stream's await releases what finished streams hold
            pinned_empty(1 << 20, np.uint8)[:] = 0xFF  # someone else's page-locked memory
            lane.upload(host, out=x)  # the lease goes on
            await lane
            assert not lane.stream.closed
        assert lane.stream.closed  # closed as its lease ended
    np.testing.assert_array_equal(out, host)
    assert lanes.statistics().leased == 0


async def test_every_aclose_returns_whatever_the_pool_is_doing(sim_backend: Any, anyio_backend: Any) -> None:
    # Two at once (a lifespan's exit and a signal handler), one after a forced close(),
    # and one while start() still runs setup.
    lanes = Lanes(count=2)
    await lanes.start()
    finished: list[str] = []

    async def aclose(name: str) -> None:
        await lanes.aclose()
        finished.append(name)

    async with anyio.create_task_group() as tg:
        async with lanes.lease():
            tg.start_soon(aclose, "first")
            tg.start_soon(aclose, "second")
            await checkpoints()
            assert finished == []
            lanes.close()
        await checkpoints()
    assert sorted(finished) == ["first", "second"]

    started = anyio.Event()

    async def setup(lane: Lane) -> None:
        started.set()
        await checkpoints()

    lanes = Lanes(count=2, setup=setup)
    async with anyio.create_task_group() as tg:
        tg.start_soon(lanes.start)
        await started.wait()
        await lanes.aclose()
    assert is_closed(lanes) and all(lane.stream.closed for lane in lanes.lanes)


async def test_a_cancelled_aclose_closes_at_once_and_frees_nothing_under_the_gpu(
    sim_backend: Any, anyio_backend: Any
) -> None:
    # A server's second Ctrl+C: stop waiting for the GPU, leave it its memory.
    lanes = Lanes(count=2)
    await lanes.start()
    host = np.arange(1000, dtype=np.float32)
    async with lanes.lease() as lane:
        out = lane.download(lane.upload(host))
        sim_backend.pause(lane.stream.handle)
        with anyio.CancelScope() as scope:
            scope.cancel()
            await lanes.aclose()
        assert is_closed(lanes)
        sim_backend.resume(lane.stream.handle)
        await lane
    np.testing.assert_array_equal(out, host)
    assert all(stream.closed for lane in lanes.lanes for stream in lane.streams)
    await lanes.aclose()  # (and again: nothing to do)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="asyncio tasks tell their cancelling state from 3.11")
async def test_an_asyncio_task_unwinding_from_its_cancellation_does_not_wait_in_aclose(
    sim_backend: Any, anyio_backend: Any
) -> None:
    # uvicorn's forced exit cancels the lifespan task once; its exit then calls aclose()
    # in a finally, where asyncio would let a wait for the GPU run to the end.
    if anyio_backend[0] != "asyncio":
        pytest.skip("asyncio's one-shot cancellation")
    lanes = Lanes(count=1)
    await lanes.start()
    holding, release = asyncio.Event(), asyncio.Event()

    async def request() -> None:
        async with lanes.lease() as lane:
            lane.upload(np.ones(8, np.float32))
            holding.set()
            await release.wait()
            await lane

    async def lifespan() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            await lanes.aclose()

    requester, life = asyncio.ensure_future(request()), asyncio.ensure_future(lifespan())
    await holding.wait()
    life.cancel()
    with pytest.raises(asyncio.CancelledError):
        await life  # returns although the request still holds its lane
    assert is_closed(lanes)
    release.set()
    await requester
    assert all(lane.stream.closed for lane in lanes.lanes)


async def test_a_lease_serves_one_request_at_a_time(sim_backend: Any, anyio_backend: Any) -> None:
    async with Lanes(count=4) as lanes:
        shared = lanes.lease()
        errors: list[BaseException] = []

        async def request() -> None:
            try:
                async with shared as lane:
                    await scaled_copy(lane, np.ones(8, np.float32))
            except RuntimeError as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(request)
        assert len(errors) == 2 and "call lanes.lease() once per request" in str(errors[0])
        assert lanes.statistics().leased == 0
        async with shared as lane:  # one after the other is fine
            await scaled_copy(lane, np.ones(8, np.float32))


async def test_a_lease_inside_a_lease_of_the_same_lanes_raises_instead_of_waiting_for_itself(
    sim_backend: Any, anyio_backend: Any
) -> None:
    """A request that holds the only lane and leases again would wait for itself for
    ever: it raises, directly nested or from a function it calls, and its own lease
    goes on. A task the request starts is another request: it waits for the lane."""

    async def lease_again(lanes: Lanes) -> None:
        async with lanes.lease():
            pass

    async with Lanes(count=1) as lanes, anyio.create_task_group() as tg:
        got_it = anyio.Event()

        async def other_request() -> None:
            async with lanes.lease() as lane:
                await scaled_copy(lane, np.ones(8, np.float32))
                got_it.set()

        with anyio.fail_after(30):  # (only the hang this prevents reaches it)
            async with lanes.lease() as lane:
                with pytest.raises(RuntimeError, match="holds lane 0 of these lanes"):
                    async with lanes.lease():
                        pass
                with pytest.raises(RuntimeError, match="holds lane 0 of these lanes"):
                    await lease_again(lanes)
                tg.start_soon(other_request)
                await checkpoints()
                assert lanes.statistics().waiting == 1 and not got_it.is_set()
                np.testing.assert_array_equal(await scaled_copy(lane, np.full(8, 3, np.float32)), 3)
            await got_it.wait()
    assert lanes.statistics().leased == 0


async def test_a_lease_inside_a_lease_an_async_generator_holds_raises_instead_of_waiting_for_itself(
    sim_backend: Any, anyio_backend: Any
) -> None:
    """An async generator's lease block is off the stack while its consumer runs the
    body of its loop (or the block of an asynccontextmanager around it): a lease there,
    in the same task, would wait for itself all the same. It raises; the generator's
    lease goes on and ends as the generator closes."""
    from contextlib import asynccontextmanager

    async def yields_in_the_block(lanes: Lanes) -> Any:
        async with lanes.lease() as lane:
            yield lane

    @asynccontextmanager
    async def lane_of(lanes: Lanes) -> Any:
        async with lanes.lease() as lane:
            yield lane

    async with Lanes(count=1) as lanes:
        with anyio.fail_after(30):  # (only the hang this prevents reaches it)
            agen = yields_in_the_block(lanes)
            async for lane in agen:
                with pytest.raises(RuntimeError, match="holds lane 0 of these lanes"):
                    async with lanes.lease():
                        pass
                np.testing.assert_array_equal(await scaled_copy(lane, np.full(8, 3, np.float32)), 3)
            assert lanes.statistics().leased == 0 and not lanes._in_generators
            async with lane_of(lanes) as lane:
                with pytest.raises(RuntimeError, match="holds lane 0 of these lanes"):
                    async with lanes.lease():
                        pass
                with pytest.raises(RuntimeError, match="called by a request holding lane 0"):
                    await lanes.aclose()
                np.testing.assert_array_equal(await scaled_copy(lane, np.full(8, 4, np.float32)), 4)
            assert lanes.statistics().leased == 0 and not lanes._in_generators
            async with lanes.lease() as lane:  # the record went with the lease
                np.testing.assert_array_equal(await scaled_copy(lane, np.full(8, 5, np.float32)), 5)


async def test_a_lease_another_tasks_async_generator_holds_is_waited_for(sim_backend: Any, anyio_backend: Any) -> None:
    """A lane another request holds in its async generator comes back when that request
    goes on: a request of its own waits for it, as for any lease."""

    async def lane_of(lanes: Lanes) -> Any:
        async with lanes.lease() as lane:
            yield lane

    async with Lanes(count=1) as lanes, anyio.create_task_group() as tg:
        holding, go_on, got_it = anyio.Event(), anyio.Event(), anyio.Event()

        async def generator_request() -> None:
            agen = lane_of(lanes)
            async for lane in agen:
                holding.set()
                await go_on.wait()
                await scaled_copy(lane, np.ones(8, np.float32))
            await agen.aclose()

        async def other_request() -> None:
            async with lanes.lease() as lane:
                await scaled_copy(lane, np.ones(8, np.float32))
                got_it.set()

        with anyio.fail_after(30):  # (only the hang this prevents reaches it)
            tg.start_soon(generator_request)
            await holding.wait()
            tg.start_soon(other_request)
            await checkpoints()
            assert lanes.statistics().waiting == 1 and not got_it.is_set()
            go_on.set()
            await got_it.wait()
    assert lanes.statistics().leased == 0 and not lanes._in_generators


async def test_a_lane_of_an_async_generator_dropped_unclosed_comes_back_to_its_task(
    sim_backend: Any, anyio_backend: Any
) -> None:
    """A generator left unclosed while it holds a lane (a break out of its loop) is
    closed by the loop's finaliser, in a task of its own: a lease of the same request
    that has to wait meanwhile gets the lane, as it did before generators were watched."""

    async def lane_of(lanes: Lanes) -> Any:
        async with lanes.lease() as lane:
            yield lane

    async with Lanes(count=1) as lanes:
        with anyio.fail_after(30):  # (only the hang this prevents reaches it)
            async for _lane in lane_of(lanes):
                break
            gc.collect()  # (dropped at once under reference counting; else by the collector)
            async with lanes.lease() as lane:
                np.testing.assert_array_equal(await scaled_copy(lane, np.full(8, 6, np.float32)), 6)
        assert lanes.statistics().leased == 0 and not lanes._in_generators


async def test_aclose_from_a_request_holding_a_lane_raises_instead_of_waiting_for_it(
    sim_backend: Any, anyio_backend: Any
) -> None:
    """aclose() waits for every leased lane to come back: called by a request that holds
    one, it would wait for itself. It raises and leaves the pool open; closed after the
    block, the pool closes as usual."""
    lanes = Lanes(count=2)
    await lanes.start()
    with anyio.fail_after(30):  # (only the hang this prevents reaches it)
        async with lanes.lease() as lane:
            with pytest.raises(RuntimeError, match="called by a request holding lane 0"):
                await lanes.aclose()
            np.testing.assert_array_equal(await scaled_copy(lane, np.full(8, 5, np.float32)), 5)
        async with lanes.lease():
            pass
        await lanes.aclose()
    assert is_closed(lanes) and lane.stream.closed


@pytest.mark.parametrize("other_loop", ["asyncio", "trio"])
async def test_a_lease_from_another_threads_loop_is_refused(
    sim_backend: Any, anyio_backend: Any, other_loop: str
) -> None:
    """Lanes belong to the loop that started them: their free list, the requests waiting
    for a lane and the wake-ups between them are that loop's. A lease from a loop in
    another thread raises at once -- here with every lane leased, where it waited for the
    lane's release, which would come from the wrong thread, unseen by its own loop -- and
    the pool serves its own loop on."""
    outcome: list[BaseException | str] = []

    async def lease_there(lanes: Lanes) -> None:
        with anyio.fail_after(30):  # (only the hang this prevents reaches it)
            try:
                async with lanes.lease():
                    outcome.append("leased")
            except RuntimeError as exc:
                outcome.append(exc)

    async with Lanes(count=1) as lanes:
        async with lanes.lease():
            await anyio.to_thread.run_sync(lambda: anyio.run(lease_there, lanes, backend=other_loop))
        (error,) = outcome
        assert isinstance(error, RuntimeError) and "belong to the event loop that started them" in str(error)
        async with lanes.lease() as lane:
            np.testing.assert_array_equal(await scaled_copy(lane, np.full(8, 2, np.float32)), 2)
        stats = lanes.statistics()
        assert (stats.leased, stats.waiting) == (0, 0)


async def test_lanes_not_started_say_so(sim_backend: Any, anyio_backend: Any) -> None:
    lanes = Lanes(count=1)
    with pytest.raises(RuntimeError, match="not started") as caught:
        async with lanes.lease():
            pass
    assert not isinstance(caught.value, ClosedError)  # (a handler maps that to 503 "shutting down")
    with pytest.raises(TypeError, match="count must be an int"):
        Lanes(count=2.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="staging"):
        Lanes(staging="1M")  # type: ignore[arg-type]


async def test_bad_arguments_are_refused_with_what_was_wrong(sim_backend: Any, anyio_backend: Any) -> None:
    """A count of millions would pin memory until the host ran out; a str or None for
    priorities, a setup that cannot be called or that yields (a teardown expected after
    it) only failed later, with Python's own words or not at all."""
    with pytest.raises(ValueError, match="count must be at most 1024 lanes, got 10000000"):
        Lanes(count=10_000_000)
    for priorities in ("normal", None):
        with pytest.raises(TypeError, match="priorities must be a tuple"):
            Lanes(priorities=priorities)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="setup must be a function of the lane"):
        Lanes(setup=5)  # type: ignore[arg-type]

    def scratch(lane: Lane) -> Any:
        yield lane.empty(8)

    async def async_scratch(lane: Lane) -> Any:
        yield lane.empty(8)

    for setup in (scratch, async_scratch):
        lanes = Lanes(count=2, setup=setup)
        with pytest.raises(TypeError, match="is a generator function"):
            await lanes.start()
        assert is_closed(lanes)
        with pytest.raises(RuntimeError, match="runs once, on new lanes: these are closed"):
            await lanes.start()


async def test_a_failure_handled_inside_the_lease_is_still_the_pools(sim_backend: Any, anyio_backend: Any) -> None:
    async with Lanes(count=2) as lanes:
        async with lanes.lease() as lane:
            lane.upload(np.ones(10, np.float32))
            sim_backend.poison(0)
            with pytest.raises(ContextPoisonedError):
                await lane  # a handler turning it into a 500
        assert lanes.failure is not None and lanes.statistics().failed


async def test_a_lane_reused_many_times_creates_nothing_new(backend: Any, anyio_backend: Any) -> None:
    scale = ScaleStage(REPS)
    host = np.arange(2048, dtype=np.float32)
    expected = scale_reference(host, REPS)
    signals = current_engine()._signals  # the engine's doorbell streams: its own business

    def streams_besides_signals() -> int:
        return len(getattr(_driver.driver(), "_streams", ())) - signals.count(Device(0))

    async with Lanes(count=2) as lanes:

        async def settled_bytes() -> int:
            for lane in lanes.lanes:
                await lane.stream  # the frees of the last leases have run
            return used_bytes()

        for _ in range(5):  # warm: pools, histories, staging slots
            await scaled(lanes, host, scale)
        baseline = await settled_bytes()
        streams_before = streams_besides_signals()
        for _ in range(300):
            np.testing.assert_allclose(await scaled(lanes, host, scale), expected, rtol=1e-4)
        assert await settled_bytes() == baseline
        assert streams_besides_signals() == streams_before
        assert lanes.statistics().leases == 305


async def test_setup_runs_once_per_lane_at_start(sim_backend: Any, anyio_backend: Any) -> None:
    seen: list[int] = []

    async def setup(lane: Lane) -> str:
        await anyio.lowlevel.checkpoint()
        seen.append(lane.index)
        return f"state {lane.index}"

    async with Lanes(count=3, setup=setup) as lanes:
        assert seen == [0, 1, 2]
        assert [lane.state for lane in lanes.lanes] == ["state 0", "state 1", "state 2"]
        assert "3 lanes: 0 leased" in repr(lanes)
    with pytest.raises(ClosedError):
        async with lanes.lease():
            pass


@pytest.mark.parametrize("failing", ["stream", "staging"])
async def test_a_start_that_runs_out_of_memory_leaves_no_stream_behind(
    backend: Any, anyio_backend: Any, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    """The driver refuses the third lane's high-priority stream, or its staging block:
    start() raises that error, the pool is closed, and every stream made for it before
    is closed too (they were made off the loop, before the pool had any lane)."""
    made: list[Stream] = []

    def make_stream(*args: Any, **kwargs: Any) -> Stream:
        if failing == "stream" and len(made) == 4:
            raise OutOfMemoryError("out of memory (injected)")
        made.append(Stream(*args, **kwargs))
        return made[-1]

    def staging(*args: Any, **kwargs: Any) -> np.ndarray:
        if len(made) == 6:
            raise OutOfMemoryError("out of memory (injected)")
        return pinned_empty(*args, **kwargs)

    monkeypatch.setattr(lanes_module, "Stream", make_stream)
    if failing == "staging":
        monkeypatch.setattr(lane_module, "pinned_empty", staging)
    lanes = Lanes(count=4, priorities=("normal", "high"))
    with pytest.raises(OutOfMemoryError, match="injected"):
        await lanes.start()
    assert is_closed(lanes) and len(made) == {"stream": 4, "staging": 6}[failing]
    assert all(stream.closed for stream in made)
    with pytest.raises(ClosedError):
        async with lanes.lease():
            pass


@pytest.mark.parametrize("raises", ["sync", "async"])
async def test_a_setup_that_raises_fails_the_start_and_frees_what_it_made(
    backend: Any, anyio_backend: Any, raises: str
) -> None:
    """The second lane's setup allocates its scratch, then runs out of memory (or
    raises, after an await): start() raises that error, the pool is closed, and the
    memory every setup made -- the failing one's too -- is freed with it."""
    baseline = used_bytes()

    def make_scratch(lane: Lane) -> Any:
        scratch = lane.empty(1 << 16, np.uint8)
        if lane.index == 1:
            lane.empty(2 * lane.device.total_memory, np.uint8)
        return scratch

    async def make_scratch_then_fail(lane: Lane) -> Any:
        scratch = lane.empty(1 << 16, np.uint8)
        await anyio.lowlevel.checkpoint()
        if lane.index == 1:
            raise ValueError("setup failed")
        return scratch

    setup = make_scratch if raises == "sync" else make_scratch_then_fail
    lanes = Lanes(count=3, setup=setup)
    with pytest.raises(OutOfMemoryError if raises == "sync" else ValueError):
        await lanes.start()
    assert is_closed(lanes) and all(lane.stream.closed for lane in lanes.lanes)
    for lane in lanes.lanes:
        await lane.stream  # (closed: the frees enqueued before it closed have run)
    assert used_bytes() == baseline


async def test_default_count_comes_from_the_device(sim_backend: Any, anyio_backend: Any) -> None:
    async with Lanes() as lanes:
        sms = Device(0).multiprocessor_count
        assert lanes.statistics().lanes == max(8, min(64, sms // 4))


async def test_high_priority_requests_overtake_normal_work_on_the_gpu(backend: Any, anyio_backend: Any) -> None:
    if backend.name != "cuda":
        pytest.skip("the simulator records stream priorities but does not schedule by them")
    from ._workload import _kernel

    device = Device(0)
    # One normal-priority kernel of 40 waves of full blocks (2 x 1024 threads fill an SM),
    # 5 ms each: about 200 ms. Without priorities the urgent kernel, launched after it,
    # would be dispatched only once all of its blocks had been; with them, at the next wave.
    blocks = 2 * device.multiprocessor_count * 40
    cycles = int(0.005 * device.attribute("clock_rate") * 1e3)
    async with Lanes(count=2, priorities=("normal", "high")) as lanes:
        async with lanes.lease() as normal:
            _kernel(normal.stream, "spin").launch(blocks, 1024, cycles, stream=normal.stream)
            async with lanes.lease(priority="high") as urgent:
                _kernel(urgent.stream, "spin").launch(1, 32, cycles, stream=urgent.stream)
                await urgent
                assert not normal.stream.query()  # the urgent kernel did not wait for the backlog
            await normal


Fate = Literal["done", "abandoned", "cancelled"]
"""What becomes of one request in :func:`test_any_mix_of_requests_loses_no_lane_and_no_memory`:
it awaits its work, ends its lease without awaiting it, or is cancelled (in line for a
lane, or awaiting its work, as the requests before it have it)."""


@pytest.mark.filterwarnings("ignore:a lease of lane:RuntimeWarning")  # (the abandoned requests')
@pytest.mark.parametrize("loop", ["asyncio", "trio"])
@settings(max_examples=30)
@given(
    count=st.integers(1, 3),
    requests=st.lists(
        st.tuples(st.sampled_from(("normal", "high")), st.sampled_from(("done", "abandoned", "cancelled"))),
        min_size=1,
        max_size=10,
    ),
    cancel_together=st.booleans(),
    close_early=st.booleans(),
)
def test_any_mix_of_requests_loses_no_lane_and_no_memory(
    loop: str, count: int, requests: list[tuple[Priority, Fate]], cancel_together: bool, close_early: bool
) -> None:
    """Requests of both priorities, often more than there are lanes, all in
    flight at once (the lanes' streams held), each meeting its fate; the cancellations
    one by one or all at once (a lane given back then goes to a request cancelled before
    it could take it), and the pool maybe told to shut down before the streams go on.
    Whatever the mix: every request that finished has its own data back, every lane
    comes back, the pool's memory returns to what it was, and the shutdown completes."""
    sim = _driver.use_backend("sim", devices=1)
    host = [np.full(256, i, np.float32) for i in range(len(requests))]

    async def scenario() -> None:
        lanes = Lanes(count=count, priorities=("normal", "high"))
        await lanes.start()
        baseline = used_bytes()
        streams = [stream for lane in lanes.lanes for stream in lane.streams]
        for stream in streams:
            sim.pause(stream.handle)
        results: dict[int, np.ndarray] = {}
        scopes = [anyio.CancelScope() for _ in requests]

        async def request(i: int, priority: Priority, fate: Fate) -> None:
            with scopes[i]:
                async with lanes.lease(priority=priority) as lane:
                    x = lane.upload(host[i])
                    lane.empty(1024)  # memory of the request's own, freed when the lease ends
                    out = lane.download(x)
                    if fate == "abandoned":
                        return
                    await lane
                    results[i] = out

        async with anyio.create_task_group() as tg:
            for i, (priority, fate) in enumerate(requests):
                tg.start_soon(request, i, priority, fate)
                await checkpoints()
            for i, (_, fate) in enumerate(requests):
                if fate == "cancelled":
                    scopes[i].cancel()
                    if not cancel_together:
                        await checkpoints()
            await checkpoints()
            if close_early:
                tg.start_soon(lanes.aclose)
                await checkpoints()
            stats = lanes.statistics()
            assert stats.leased <= count and stats.leased + stats.waiting <= len(requests)
            for stream in streams:
                sim.resume(stream.handle)
        stats = lanes.statistics()
        assert (stats.leased, stats.waiting) == (0, 0)
        for i, (_, fate) in enumerate(requests):
            if fate == "done":
                np.testing.assert_array_equal(results[i], host[i])
            else:
                assert i not in results
        for stream in streams:
            await stream  # the frees the leases enqueued have run
        assert used_bytes() == baseline
        await lanes.aclose()
        assert all(stream.closed for stream in streams)

    async def guarded() -> None:
        with anyio.fail_after(60):  # (a lost lane would hang the shutdown: fail instead)
            await scenario()

    anyio.run(guarded, backend=loop)
