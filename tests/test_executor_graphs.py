"""The executor's graph mode: the same results, order, back-pressure and errors as the eager
path, with chunks replayed from graphs captured once per device and lane.

On the simulator with 1 and 4 devices, and on a real GPU where one is present.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from functools import partial
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import numpy as np
import pytest

from aiocuda import _driver
from aiocuda._cli.workload import ScaleStage, scale_reference
from aiocuda._executor import graph_mode
from aiocuda.array import DeviceArray
from aiocuda.errors import ClosedError, ContextPoisonedError
from aiocuda.executor import ChunkContext, Executor
from aiocuda.host import is_pinned, pinned_empty
from aiocuda.kernel import register_sim_kernel
from aiocuda.program import Program

from ._control import checkpoints, reserve_thread_done
from ._executor_tasks import lifespan, read_map
from ._workload import _kernel, poison_op

pytestmark = pytest.mark.anyio

REPS = 20
N = 1024


@pytest.fixture(params=[1, 4], ids=["1-device", "4-devices"])
def devices(request: pytest.FixtureRequest, backend: Any) -> Iterator[int]:
    """How many devices the executor uses: 1, and 4 simulated ones (on a GPU machine the
    4-device case runs only with 4 GPUs)."""
    wanted: int = request.param
    if backend.name == "sim":
        _driver.use_backend("sim", devices=wanted)
    elif backend.device_count() < wanted:
        pytest.skip(f"needs {wanted} GPUs")
    yield wanted


@pytest.fixture(autouse=True, params=["staged", "pointed"])
def lane_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The chunks here are small: they replay on staged lanes, or, with no chunk small
    enough for those, on pointed lanes (as larger chunks do)."""
    if request.param == "pointed":
        monkeypatch.setattr(graph_mode, "STAGED_LIMIT", 0)
    kind: str = request.param
    return kind


def pinned_chunks(count: int, n: int = N, seed: int = 0) -> np.ndarray:
    inputs = pinned_empty((count, n), np.float32)
    inputs[:] = np.random.default_rng(seed).random((count, n), dtype=np.float32)
    return inputs


class CountingStage:
    """``scale`` in place, counting its calls per device."""

    def __init__(self) -> None:
        self.scale = ScaleStage(REPS)
        self.calls: dict[int, int] = {}
        self.__name__ = "counting"

    def __call__(self, ctx: ChunkContext, x: DeviceArray) -> None:
        self.calls[ctx.device.ordinal] = self.calls.get(ctx.device.ordinal, 0) + 1
        self.scale(ctx, x)


async def test_same_results_and_order_as_eager(devices: int, anyio_backend: Any, lane_kind: str) -> None:
    inputs = pinned_chunks(12 * devices)
    stage = CountingStage()
    async with Executor(list(range(devices)), trace=True) as ex:
        # Two chunks in flight: a device's warm-up chunk has been delivered before its next
        # chunk is admitted, so that one is captured, whatever the machine's speed.
        async with ex.map(stage, inputs, graph=True, in_flight=2) as results:
            got = [r async for r in results]
        async with ex.map(ScaleStage(REPS), inputs, graph=True) as results:  # many in flight
            assert all([r.ok async for r in results])
        eager = await ex.run(ScaleStage(REPS), inputs)
        lanes = {device: len(graphs.lanes) for device, graphs in ex._graph_lanes[stage].items()}
        trace = ex.trace
        assert trace is not None
        spans = trace.spans
    assert [r.index for r in got] == list(range(len(inputs)))
    for r, expected in zip(got, eager, strict=True):
        np.testing.assert_allclose(r.value, expected, rtol=1e-6)
        np.testing.assert_allclose(r.value, scale_reference(inputs[r.index], REPS), rtol=1e-5)
    replays = [s for s in spans if s.unit == "graph" and s.name.startswith("counting")]
    assert replays and all("(graph, " in s.name for s in replays)
    assert {s.device for s in replays} == set(range(devices))
    for device in range(devices):
        # warming up, then capturing every lane; the other chunks were replays or ran
        # eagerly while those were going on
        ran_eagerly = sum(1 for r in got if r.device == device) - sum(1 for s in replays if s.device == device)
        assert stage.calls[device] == ran_eagerly + lanes[device]
    assert not trace.notes
    if lane_kind == "pointed":  # (a staged lane's result is ordinary memory when the pinned cache has none)
        assert all(is_pinned(r.value) for r in got if any(s.chunk == r.index for s in replays))


async def test_stage_with_its_own_output_and_pageable_memory(devices: int, anyio_backend: Any) -> None:
    scale = ScaleStage(REPS)

    def stage(ctx: ChunkContext, x: DeviceArray) -> DeviceArray:
        out = ctx.empty(x.shape, x.dtype)
        scale.kernel.launch((x.size + 255) // 256, 256, x, x.size, REPS, stream=ctx.stream)
        scale.kernel.launch((x.size + 255) // 256, 256, x, x.size, 0, stream=ctx.stream)
        ctx.stream.wait(ctx.stream)  # a no-op wait, captured too
        return _copy_into(out, x, ctx)

    inputs = [np.random.default_rng(i).random(N, dtype=np.float32) for i in range(8 * devices)]
    outputs = [np.zeros(N, np.float32) for _ in inputs]  # pageable destinations
    async with Executor(list(range(devices))) as ex:
        async with ex.map(stage, inputs, graph=True, output=lambda i, _: outputs[i]) as results:
            got = [r async for r in results]
    for r in got:
        assert r.value is outputs[r.index]
        np.testing.assert_allclose(r.value, scale_reference(inputs[r.index], REPS), rtol=1e-5)


def spy_pinning(
    monkeypatch: pytest.MonkeyPatch, entered: threading.Event | None = None, hold: threading.Event | None = None
) -> list[str]:
    """The names of the threads that pin host memory from now on (the driver's
    ``mem_host_alloc``); with ``entered`` and ``hold``, one off the loop's thread sets
    the first and waits for the second to be set before pinning."""
    threads: list[str] = []
    driver = _driver.driver()
    alloc = driver.mem_host_alloc
    loop_thread = threading.current_thread()

    def noting_alloc(nbytes: int) -> int:
        threads.append(threading.current_thread().name)
        if entered is not None and hold is not None and threading.current_thread() is not loop_thread:
            entered.set()
            hold.wait()
        return alloc(nbytes)

    monkeypatch.setattr(driver, "mem_host_alloc", noting_alloc)
    return threads


@pytest.mark.parametrize("output_kind", ["new", "pageable"])
@pytest.mark.parametrize("input_kind", ["pinned", "pageable"])
async def test_a_map_whose_results_are_kept_pins_no_memory_on_the_loop(
    backend: Any, anyio_backend: Any, lane_kind: str, input_kind: str, output_kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every replay's page-locked arrays (its result, copies of a pageable input or for a
    pageable destination) come from the cache of pinned blocks. Kept results leave it
    empty (here the reserve thread pins no spares either): then no memory is pinned on
    the loop's thread (1-40 ms each there), not at the capture nor for a replay. A
    pointed lane's chunk waits for blocks pinned on a worker thread; a staged lane's
    result is ordinary memory (copied out of the lane's page-locked buffer)."""
    from aiocuda._memory import pinned
    from aiocuda.host import empty_cache

    count = 8
    rng = np.random.default_rng(3)
    inputs = pinned_chunks(count) if input_kind == "pinned" else rng.random((count, N), dtype=np.float32)
    outputs = [np.zeros(N, np.float32) for _ in range(count)]  # pageable destinations
    output = None if output_kind == "new" else (lambda i, _: outputs[i])
    stage = CountingStage()
    async with Executor([0], trace=True) as ex:
        # (the staging's slots that the eager warm-up's copies take: of each size the
        # first are made on the loop's thread, by design)
        await ex.run(ScaleStage(REPS), inputs[:1], output=output)
        await reserve_thread_done()
        gc.collect()  # (arrays of earlier tests, whose blocks would refill the cache meanwhile)
        empty_cache()
        monkeypatch.setattr(pinned, "keep_spare", lambda device, size: None)
        threads = spy_pinning(monkeypatch)
        got = await ex.run(stage, inputs, graph=True, in_flight=1, output=output)
        assert ex.trace is not None
        replays = [s for s in ex.trace.spans if s.unit == "graph"]
    assert threading.current_thread().name not in threads
    assert len(replays) == count - 1  # (chunk 0 warmed the device up)
    for i, value in enumerate(got):
        np.testing.assert_allclose(value, scale_reference(inputs[i], REPS), rtol=1e-5)
        if output is not None:
            assert value is outputs[i]
        elif lane_kind == "pointed" and i > 0:
            assert is_pinned(value)  # (its download one DMA)
    if output is None and lane_kind == "pointed":
        assert threads  # blocks for them, pinned off the loop


async def test_a_block_pinned_for_a_cancelled_chunk_goes_to_the_cache(
    backend: Any, anyio_backend: Any, lane_kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk for a pointed lane that waits for a page-locked block pinned on a worker
    thread, cancelled meanwhile: its admission comes back at once, and the block, made
    after the cancellation, goes to the cache of pinned blocks."""
    from aiocuda._memory import pinned, pinned_cache
    from aiocuda.host import empty_cache

    if lane_kind == "staged":
        pytest.skip("a staged lane's chunk never waits for pinned memory")
    stage = CountingStage()
    inputs = pinned_chunks(4)
    entered, hold, cached = threading.Event(), threading.Event(), threading.Event()
    async with Executor([0]) as ex:
        await ex.run(stage, inputs, graph=True, in_flight=1)  # warmed up and captured
        await reserve_thread_done()
        empty_cache()
        monkeypatch.setattr(pinned, "keep_spare", lambda device, size: None)
        threads = spy_pinning(monkeypatch, entered, hold)
        size = pinned_cache.size_class(inputs[0].nbytes)
        driver = _driver.driver()
        alloc, give = driver.mem_host_alloc, pinned_cache.give
        made: list[int] = []  # (other blocks of that size, given back meanwhile, are not the one)

        def noting_alloc(nbytes: int) -> int:
            ptr = alloc(nbytes)
            made.append(ptr)
            return ptr

        def noting_give(device: Any, ptr: int, nbytes: int) -> None:
            give(device, ptr, nbytes)
            if ptr in made:
                cached.set()

        monkeypatch.setattr(driver, "mem_host_alloc", noting_alloc)

        monkeypatch.setattr(pinned_cache, "give", noting_give)
        try:
            with anyio.fail_after(30):  # (a hang guard)
                with anyio.CancelScope() as scope:
                    async with ex.map(stage, inputs, graph=True) as results:
                        await anyio.to_thread.run_sync(entered.wait)  # the first replay's result, pinned off the loop
                        scope.cancel()
                        async for _ in results:
                            pass
                assert ex.device_streams[0].chunks == 0
                assert not cached.is_set()
                hold.set()
                await anyio.to_thread.run_sync(cached.wait)  # (the block dropped once the abandoned thread is done)
                assert pinned_cache.holds(size)
        finally:
            hold.set()
        assert threading.current_thread().name not in threads
        got = await ex.run(stage, inputs, graph=True)
    for host, value in zip(inputs, got, strict=True):
        np.testing.assert_allclose(value, scale_reference(host, REPS), rtol=1e-5)


def _copy_into(out: DeviceArray, x: DeviceArray, ctx: ChunkContext) -> DeviceArray:
    """Enqueue a device-to-device copy on the chunk's stream (captured with the stage)."""
    ctx.device.make_current()
    ctx.device._driver.memcpy_dtod_async(out.ptr, x.ptr, x.nbytes, ctx.stream.handle)
    out.buffer._used_on(ctx.stream)
    return out


async def test_a_stage_that_cannot_be_captured_runs_eagerly_with_a_note(devices: int, anyio_backend: Any) -> None:
    scale = ScaleStage(REPS)

    async def waits(ctx: ChunkContext, x: DeviceArray) -> None:
        scale(ctx, x)
        await ctx.stream  # cannot be captured: the stage waits for its own work

    inputs = pinned_chunks(6 * devices)
    async with Executor(list(range(devices)), trace=True) as ex:
        got = await ex.run(waits, inputs, graph=True, in_flight=1)  # chunk 1 is captured
        trace = ex.trace
        assert trace is not None
        notes = trace.notes
        assert not any(s.unit == "graph" for s in trace.spans)
    for i, value in enumerate(got):
        np.testing.assert_allclose(value, scale_reference(inputs[i], REPS), rtol=1e-5)
    assert len(notes) == devices
    assert all("runs eagerly" in note and "CaptureError" in note for note in notes)


async def test_back_pressure_and_other_shapes(devices: int, anyio_backend: Any) -> None:
    inputs = list(pinned_chunks(10 * devices)) + [pinned_empty(N // 2, np.float32) for _ in range(3)]
    for extra in inputs[-3:]:
        extra[:] = 1.0
    async with Executor(list(range(devices)), chunks_per_device=3) as ex:
        async with ex.map(ScaleStage(REPS), inputs, graph=True, in_flight=2) as results:
            got = [r async for r in results]
            peak = results.peak_in_flight
    assert peak <= 2
    for r in got:
        np.testing.assert_allclose(r.value, scale_reference(inputs[r.index], REPS), rtol=1e-5)


async def test_a_fault_in_a_replay_fails_the_pipeline(sim_backend: Any, anyio_backend: Any) -> None:
    """A kernel fault inside a replay: the chunks' awaits fail with ContextPoisonedError."""
    faulty = {"armed": False}

    def fault(launch: Any, x: np.ndarray, n: np.int32) -> None:
        if faulty["armed"]:
            raise IndexError("out of bounds")

    register_sim_kernel("touch", fault)
    try:
        kernel = Program('extern "C" __global__ void touch(float* x, int n) {}').compile().kernel("touch")

        def stage(ctx: ChunkContext, x: DeviceArray) -> None:
            kernel.launch(1, 1, x, x.size, stream=ctx.stream)

        inputs = pinned_chunks(30)
        ex = Executor([0], trace=True)
        with pytest.raises(ContextPoisonedError):
            async with ex, ex.map(stage, inputs, graph=True, in_flight=4) as results:
                async for r in results:
                    if r.index == 10:
                        faulty["armed"] = True  # later replays fault
        assert ex.trace is not None
        assert any(s.unit == "graph" for s in ex.trace.spans)
    finally:
        register_sim_kernel("touch", None)


async def test_replays_that_fault_fail_their_chunks(sim_backend: Any, anyio_backend: Any) -> None:
    stage_calls = 0

    def stage(ctx: ChunkContext, x: DeviceArray) -> None:
        nonlocal stage_calls
        stage_calls += 1
        _kernel(ctx.stream, "poison")
        if stage_calls > 1:  # captured: every replay faults
            poison_op(ctx.stream)

    async with Executor([0]) as ex:  # leaving it does not raise again what the chunks reported
        async with ex.map(stage, pinned_chunks(8), graph=True, on_error="continue", in_flight=1) as results:
            got = [r async for r in results]
        assert list(ex.failures) == [0]
    assert len(got) == 8 and got[0].ok  # the eager warm-up
    assert all(isinstance(r.error, ContextPoisonedError) for r in got[1:])


class Interrupt(BaseException):
    """Not an Exception: what a KeyboardInterrupt raised in an ``output()`` looks like."""


async def test_an_output_function_raising_a_base_exception_gives_its_chunk_back(
    sim_backend: Any, anyio_backend: Any
) -> None:
    """output() is called by the feeder for a replay; one that raises what is not an
    Exception ends the pipeline with it, and the chunk stayed admitted: its device ran
    one chunk fewer (its bytes reserved) for every later map and submit of the executor."""
    out = pinned_chunks(8)

    def output(index: int, result: DeviceArray) -> np.ndarray:
        if index == 6:  # a replay: its device warmed up and captured by then
            raise Interrupt
        return out[index]

    stage = ScaleStage(REPS)
    inputs = pinned_chunks(8)
    async with Executor([0], chunks_per_device=2) as ex:
        with pytest.raises(BaseException) as caught:
            await ex.run(stage, inputs, graph=True, in_flight=1, output=output)
        assert caught.type is Interrupt or caught.group_contains(Interrupt)
        assert ex._graph_lanes[stage][0].state == "ready"  # chunk 6 was a replay
        await ex.synchronize()
        assert [(d.chunks, d.reserved) for d in ex.device_streams] == [(0, 0)]
        again = await ex.run(stage, inputs, graph=True)
    for host, value in zip(inputs, again, strict=True):
        np.testing.assert_allclose(value, scale_reference(host, REPS), rtol=1e-5)


async def test_later_pipelines_of_a_stage_replay_its_graphs(devices: int, anyio_backend: Any) -> None:
    stage = CountingStage()
    inputs = pinned_chunks(6 * devices)
    async with Executor(list(range(devices)), trace=True) as ex:
        await ex.run(stage, inputs, graph=True, in_flight=2)
        calls = dict(stage.calls)
        assert ex.trace is not None
        ex.trace.clear()
        again = await ex.run(stage, inputs, graph=True)  # every chunk a replay
        assert stage.calls == calls
        assert len([s for s in ex.trace.spans if s.unit == "graph"]) == len(inputs)
        other = CountingStage()  # another stage object: its own warm-up and captures
        await ex.run(other, inputs, graph=True, in_flight=2)
        assert sum(other.calls.values()) > 0
    for i, value in enumerate(again):
        np.testing.assert_allclose(value, scale_reference(inputs[i], REPS), rtol=1e-5)


async def test_cancelled_pipelines_give_every_admission_back(devices: int, anyio_backend: Any) -> None:
    """Left mid-way, again and again -- with replays enqueued after the device's collector
    has gone, or chunks waiting for a capture -- a pipeline gives back every chunk's
    admission: the executor's devices are as free as before."""
    sim = _driver.driver()
    if sim.name != "sim":
        pytest.skip("the simulator's latencies make chunks overlap")
    for op in ("memcpy_htod_async", "launch_kernel", "memcpy_dtoh_async"):
        sim.set_latency(op, 0.002)  # type: ignore[attr-defined]
    stage = CountingStage()
    async with Executor(list(range(devices))) as ex:
        for trial in range(4):
            with anyio.CancelScope() as scope:
                async with ex.map(stage, pinned_chunks(10 * devices, seed=trial), graph=True) as results:
                    async for r in results:
                        if r.index == 2 * devices:
                            scope.cancel()
            assert scope.cancelled_caught
            await ex.synchronize()
            assert [(d.chunks, d.reserved) for d in ex.device_streams] == [(0, 0)] * devices


async def test_a_cancelled_pipeline_keeps_its_lanes_until_its_replays_have_run(
    sim_backend: Any, anyio_backend: Any, lane_kind: str
) -> None:
    """Leaving a pipeline while its replays wait on the GPU: their chunks' admission comes
    back at once, but a staged lane stays theirs until they have run (chunks meanwhile run
    eagerly); then the lanes replay again, with nothing of the old chunks in the new."""
    stage = CountingStage()
    async with Executor([0], chunks_per_device=4) as ex:
        await ex.run(stage, pinned_chunks(8), graph=True, in_flight=2)  # warmed up and captured
        lanes = ex.device_streams[0].graph_lanes
        for stream in lanes:
            sim_backend.pause(stream.handle)
        with anyio.CancelScope() as scope:
            async with ex.map(stage, pinned_chunks(16), graph=True) as results:
                for _ in range(10_000):  # until every lane has a replay waiting
                    if results.admitted == 4:
                        break
                    await anyio.sleep(0.001)
                scope.cancel()
        assert ex.device_streams[0].chunks == 0
        if lane_kind == "pointed":  # their replays would queue behind the paused ones
            for stream in lanes:
                sim_backend.resume(stream.handle)
        later = pinned_chunks(6, seed=1)
        calls = stage.calls[0]
        with anyio.fail_after(30):  # (a lane taken back too early: the replay waits behind a paused one)
            meanwhile = await ex.run(stage, later, graph=True)
        assert stage.calls[0] == calls + (len(later) if lane_kind == "staged" else 0)
        for stream in lanes:
            sim_backend.resume(stream.handle)
        await ex.synchronize()
        calls = stage.calls[0]
        again = await ex.run(stage, later, graph=True)
        assert stage.calls[0] == calls  # replays
    for values in (meanwhile, again):
        for value, host in zip(values, later, strict=True):
            np.testing.assert_allclose(value, scale_reference(host, REPS), rtol=1e-5)


async def test_leaving_lets_replays_of_a_map_in_another_task_finish(sim_backend: Any, anyio_backend: Any) -> None:
    """Another task's map of a captured stage has its replays waiting on the GPU (the
    lanes paused), its feeder waiting for room, and its reader not reading yet. Leaving
    the executor refuses the map's next inputs and waits for the replays (not for the
    reader) before closing the lanes; the reader then takes their results, and
    ClosedError."""
    stage = CountingStage()
    inputs = pinned_chunks(6)
    reading, leave, exited = anyio.Event(), anyio.Event(), anyio.Event()
    got: list[Any] = []

    async def warm_up(ex: Executor) -> None:  # (the stage captured, its lanes made)
        await ex.run(stage, pinned_chunks(8, seed=1), graph=True, in_flight=2)

    async with anyio.create_task_group() as tg:
        ex = await tg.start(partial(lifespan, leave, exited, warm_up=warm_up, chunks_per_device=2))
        calls = stage.calls[0]
        lanes = ex.device_streams[0].graph_lanes
        handles = [stream.handle for stream in lanes]
        for handle in handles:
            sim_backend.pause(handle)
        tg.start_soon(partial(read_map, ex, stage, inputs, got, reading, graph=True))
        await checkpoints()
        assert ex.device_streams[0].chunks == 2  # (chunk 2 waits for room)
        leave.set()
        await checkpoints()
        assert not exited.is_set() and not any(stream.closed for stream in lanes)
        for handle in handles:
            sim_backend.resume(handle)
        with anyio.fail_after(30):  # (only the hang this prevents reaches it)
            await exited.wait()
        assert [(d.chunks, d.reserved) for d in ex.device_streams] == [(0, 0)]
        reading.set()
    *results, end = got
    assert [r.index for r in results] == [0, 1] and stage.calls[0] == calls  # replays
    for r in results:
        np.testing.assert_allclose(r.value, scale_reference(inputs[r.index], REPS), rtol=1e-5)
    assert isinstance(end, ClosedError)
