"""Executor pipelines: ordering, back-pressure, cancellation, failures, placement, devices.

Most tests run on the simulator and, where a GPU is present, on it too (``backend``),
on asyncio, uvloop and trio. Chunks are small: the point is ordering and lifetime, not
speed (``benchmarks/pipeline.py`` measures that).
"""

from __future__ import annotations

import gc
import threading
import traceback
import warnings
from collections.abc import AsyncIterator, Iterator
from functools import partial
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import anyio.to_thread
import numpy as np
import pytest

import aiocuda
from aiocuda import _driver
from aiocuda._cli.workload import ScaleStage, scale_reference
from aiocuda.array import DeviceArray
from aiocuda.device import Device
from aiocuda.errors import ClosedError, ContextPoisonedError
from aiocuda.executor import ChunkContext, Executor
from aiocuda.host import pinned_empty
from aiocuda.lanes import default_count
from aiocuda.memory import MemoryPool

from ._control import checkpoints, reserve_thread_done
from ._executor_tasks import lifespan, read_map

pytestmark = pytest.mark.anyio

REPS = 50


def chunks(count: int, n: int = 1000, *, pinned: bool = False, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        host = pinned_empty(n + i, np.float32) if pinned else np.empty(n + i, np.float32)
        host[:] = rng.random(n + i, dtype=np.float32)
        out.append(host)
    return out


def used_bytes() -> list[int]:
    gc.collect()  # buffers of earlier tests, freed on collection, must not land mid-test
    backend = _driver.driver()
    return [MemoryPool.for_device(Device(i)).statistics().used_bytes for i in range(backend.device_count())]


@pytest.fixture
def slow_sim(sim_backend: Any) -> Iterator[Any]:
    """The simulator with copies and kernels taking a little time, so chunks overlap."""
    for op in ("memcpy_htod_async", "launch_kernel", "memcpy_dtoh_async"):
        sim_backend.set_latency(op, 0.002)
    yield sim_backend


async def test_results_in_input_order(backend: Any, anyio_backend: Any) -> None:
    stage = ScaleStage(REPS)
    inputs = chunks(10, pinned=True) + chunks(4, seed=1)  # pinned and pageable
    async with Executor() as ex:
        async with ex.map(stage, inputs) as results:
            got = [r async for r in results]
    assert [r.index for r in got] == list(range(14))
    for r, host in zip(got, inputs, strict=True):
        assert r.ok and r.error is None
        np.testing.assert_allclose(r.value, scale_reference(host, REPS), rtol=1e-5)
    assert {r.device for r in got} == set(range(len(ex.devices)))


async def test_run_returns_values_and_accepts_async_iterables(backend: Any, anyio_backend: Any) -> None:
    inputs = chunks(5)

    async def source() -> AsyncIterator[np.ndarray]:
        for host in inputs:
            await anyio.lowlevel.checkpoint()
            yield host

    scale = ScaleStage(REPS)

    async def stage(ctx: ChunkContext, x: DeviceArray) -> DeviceArray:  # an async stage, a new output
        out = ctx.empty(x.shape, x.dtype)
        ctx.device.make_current()
        ctx.device._driver.memcpy_dtod_async(out.ptr, x.ptr, x.nbytes, ctx.stream.handle)
        scale(ctx, out)
        return out

    async with Executor([0]) as ex:
        values = await ex.run(stage, source())
    for value, host in zip(values, inputs, strict=True):
        np.testing.assert_allclose(value, scale_reference(host, REPS), rtol=1e-5)


async def test_as_completed_yields_finished_chunks_first(slow_sim: Any, anyio_backend: Any) -> None:
    stage = ScaleStage(REPS)
    async with Executor([0, 1]) as ex:
        slow_sim.pause(ex.device_streams[0].d2h.handle)  # device 0 cannot finish anything
        order = []
        async with ex.map(stage, chunks(8), ordered=False) as results:
            async for r in results:
                order.append(r)
                if len(order) == 4:
                    slow_sim.resume(ex.device_streams[0].d2h.handle)
    assert [r.device for r in order[:4]] == [1, 1, 1, 1]
    assert sorted(r.index for r in order) == list(range(8))


async def test_back_pressure_bounds_chunks_in_flight(slow_sim: Any, anyio_backend: Any) -> None:
    limit = 3
    active = 0
    peak = 0
    taken = 0
    stage_impl = ScaleStage(REPS)

    def stage(ctx: ChunkContext, x: DeviceArray) -> None:
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        stage_impl(ctx, x)

    def source() -> Iterator[np.ndarray]:
        nonlocal taken
        for host in chunks(12):
            taken += 1
            yield host

    async with Executor() as ex:
        async with ex.map(stage, source(), in_flight=limit) as results:
            async for r in results:
                active -= 1
                assert taken - r.index <= limit + 1  # the feeder reads at most one input ahead
                await anyio.sleep(0.003)  # a slow consumer
            assert results.peak_in_flight <= limit
    assert peak <= limit
    assert taken == 12


async def test_cancel_mid_pipeline_returns_memory_and_corrupts_nothing(slow_sim: Any, anyio_backend: Any) -> None:
    stage = ScaleStage(REPS)
    baseline = used_bytes()
    async with Executor() as ex:
        seen = 0
        with anyio.CancelScope() as scope:
            async with ex.map(stage, chunks(20, 4096, pinned=True)) as results:
                async for _ in results:
                    seen += 1
                    if seen == 3:
                        scope.cancel()
        assert scope.cancelled_caught and seen == 3
        await ex.synchronize()
        assert used_bytes() == baseline
        assert all(per_device.chunks == 0 and per_device.reserved == 0 for per_device in ex.device_streams)
        inputs = chunks(8, 4096, pinned=True, seed=7)
        values = await ex.run(stage, inputs)
    for value, host in zip(values, inputs, strict=True):
        np.testing.assert_allclose(value, scale_reference(host, REPS), rtol=1e-5)


def sometimes_async(every: int) -> Any:
    """The scale stage, a coroutine for every ``every``-th chunk (which then goes on in
    a task of its own) and a plain function for the others."""
    inner = ScaleStage(REPS)

    def stage(ctx: ChunkContext, x: DeviceArray) -> Any:
        if ctx.index % every:
            return inner(ctx, x)

        async def later() -> None:
            await anyio.lowlevel.checkpoint()
            inner(ctx, x)

        return later()

    return stage


LARGE = (3 << 20) // 4  # floats: 3 MiB chunks, staged through the copier threads when pageable


@pytest.mark.parametrize("ordered", [True, False])
async def test_chunks_that_wait_mix_with_those_that_do_not(sim_backend: Any, ordered: bool, anyio_backend: Any) -> None:
    """Chunks that need an await -- a coroutine stage, a large pageable input or
    destination -- go on in tasks of their own among the chunks enqueued at once:
    every result arrives, right, and every byte comes back."""
    inputs = [
        *chunks(3, pinned=True),
        chunks(1, LARGE, seed=1)[0],
        *chunks(3, seed=2),
        chunks(1, LARGE, pinned=True, seed=3)[0],
        *chunks(2, pinned=True, seed=4),
    ]
    baseline = used_bytes()
    async with Executor([0]) as ex:
        async with ex.map(sometimes_async(3), inputs, ordered=ordered) as results:
            got = [r async for r in results]
        await ex.synchronize()
        assert used_bytes() == baseline
    if ordered:
        assert [r.index for r in got] == list(range(len(inputs)))
    assert sorted(r.index for r in got) == list(range(len(inputs)))
    for r in got:
        np.testing.assert_allclose(r.value, scale_reference(inputs[r.index], REPS), rtol=1e-5)


async def test_cancel_with_chunks_waiting_in_tasks_returns_memory(slow_sim: Any, anyio_backend: Any) -> None:
    baseline = used_bytes()
    inputs = [chunks(1, LARGE, pinned=k % 2 == 0, seed=k)[0] for k in range(12)]
    async with Executor() as ex:
        with anyio.CancelScope() as scope:
            async with ex.map(sometimes_async(2), inputs) as results:
                async for r in results:
                    assert r.ok
                    if r.index == 1:
                        scope.cancel()
        assert scope.cancelled_caught
        await ex.synchronize()
        assert used_bytes() == baseline
        assert all(per_device.chunks == 0 and per_device.reserved == 0 for per_device in ex.device_streams)


async def test_large_inputs_that_are_not_contiguous_are_copied_off_the_loop(
    sim_backend: Any, monkeypatch: pytest.MonkeyPatch, anyio_backend: Any
) -> None:
    """An input that is not C-contiguous is copied into one that is before its upload;
    one larger than an inline copy is copied on a worker thread, as pageable copies
    are: on the loop's thread a 32 MiB chunk of a transposed array held the loop for
    80 ms. Small ones are still copied at once."""
    import threading

    copied_on: list[tuple[int, bool]] = []  # (bytes, on the loop's thread)
    loop_thread = threading.get_ident()
    ascontiguousarray = np.ascontiguousarray

    def watched(array: Any, *args: Any, **kwargs: Any) -> np.ndarray:
        copied_on.append((array.nbytes, threading.get_ident() == loop_thread))
        return ascontiguousarray(array, *args, **kwargs)

    monkeypatch.setattr(np, "ascontiguousarray", watched)
    big = np.arange(2 * LARGE, dtype=np.float32).reshape(-1, 2)  # columns: 3 MiB, strided
    small = np.arange(2000, dtype=np.float32).reshape(-1, 2)
    async with Executor([0]) as ex:
        values = await ex.run(ScaleStage(REPS), [big[:, 0], small[:, 1], big[:, 1]])
        submitted = await ex.submit(ScaleStage(REPS), big[:, 0])
    for value, host in zip(values, [big[:, 0], small[:, 1], big[:, 1]], strict=True):
        np.testing.assert_allclose(value, scale_reference(host.copy(), REPS), rtol=1e-5)
    np.testing.assert_allclose(submitted, values[0], rtol=1e-5)
    large = [on_loop for nbytes, on_loop in copied_on if nbytes == big[:, 0].nbytes]
    assert large == [False, False, False]
    assert (small[:, 1].nbytes, True) in copied_on


async def test_a_result_from_outside_the_chunk_is_downloaded(backend: Any, anyio_backend: Any) -> None:
    """A stage may return an array the chunk did not make (its own, on its own stream):
    downloaded after the stage like any result, and left alone afterwards."""
    inputs = chunks(4, pinned=True)
    async with Executor([0]) as ex:
        with aiocuda.Stream(0) as own:
            kept = await aiocuda.to_device(np.arange(7, dtype=np.float32), stream=own)

            def stage(ctx: ChunkContext, x: DeviceArray) -> DeviceArray:
                return kept

            async with ex.map(stage, inputs) as results:
                got = [r.value async for r in results]
            await ex.synchronize()
            assert not kept.buffer.freed
    for value in got:
        np.testing.assert_array_equal(value, np.arange(7, dtype=np.float32))


async def test_breaking_out_early_cancels_the_rest(slow_sim: Any, anyio_backend: Any) -> None:
    baseline = used_bytes()
    async with Executor() as ex:
        async with ex.map(ScaleStage(REPS), chunks(20)) as results:
            async for _ in results:
                break
        await ex.synchronize()
        assert used_bytes() == baseline


@pytest.mark.parametrize("source", ["list", "async generator"])
async def test_a_map_ended_early_leaves_no_generator_of_its_own_unclosed(
    sim_backend: Any, source: str, anyio_backend: Any
) -> None:
    """The feeder reads the inputs through an async generator of its own; a map ended
    while the feeder waited for a slot left it to the garbage collector, and trio warned
    (ResourceWarning: Async generator '..._aiter' was garbage collected before it had
    been exhausted)."""

    async def generated(inputs: list[np.ndarray]) -> AsyncIterator[np.ndarray]:
        for host in inputs:
            yield host

    async with Executor([0]) as ex:
        inputs = chunks(10)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            async with ex.map(
                ScaleStage(REPS), inputs if source == "list" else generated(inputs), in_flight=2
            ) as results:
                async for _ in results:
                    break
            gc.collect()
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []


class Boom(Exception):
    pass


def failing_at(index: int) -> Any:
    inner = ScaleStage(REPS)

    def stage(ctx: ChunkContext, x: DeviceArray) -> None:
        if ctx.index == index:
            raise Boom(f"chunk {ctx.index}")
        inner(ctx, x)

    return stage


async def test_one_failing_chunk_fails_the_pipeline_cleanly(backend: Any, anyio_backend: Any) -> None:
    baseline = used_bytes()
    async with Executor() as ex:
        with pytest.raises(Boom, match="chunk 4"):
            async with ex.map(failing_at(4), chunks(30)) as results:
                async for r in results:
                    assert r.index < 4 or r.ok
        await ex.synchronize()
        assert used_bytes() == baseline
        assert [len(results.failures)] == [1]


async def test_go_on_mode_reports_the_failure_and_finishes_the_rest(backend: Any, anyio_backend: Any) -> None:
    inputs = chunks(9)
    async with Executor() as ex:
        async with ex.map(failing_at(5), inputs, on_error="continue") as results:
            got = [r async for r in results]
    assert [r.index for r in got] == list(range(9))
    failed = [r for r in got if not r.ok]
    assert [r.index for r in failed] == [5] and results.failures == failed
    assert isinstance(failed[0].error, Boom)
    with pytest.raises(Boom):
        _ = failed[0].value
    for r in got:
        if r.ok:
            np.testing.assert_allclose(r.value, scale_reference(inputs[r.index], REPS), rtol=1e-5)


class Interrupt(BaseException):
    """Not an Exception: what a KeyboardInterrupt raised in a stage's Python looks like."""


async def test_a_stage_raising_a_base_exception_gives_its_chunk_back(sim_backend: Any, anyio_backend: Any) -> None:
    """A plain stage that raises what is not an Exception ends the pipeline with it; the
    chunk stayed admitted, so its device ran one chunk fewer (and reserved its bytes) for
    every later map and submit of the executor."""

    def stage(ctx: ChunkContext, x: DeviceArray) -> None:
        if ctx.index == 2:
            raise Interrupt

    baseline = used_bytes()
    async with Executor([0], chunks_per_device=2) as ex:
        with pytest.raises(BaseException) as caught:
            await ex.run(stage, chunks(5))
        assert caught.type is Interrupt or caught.group_contains(Interrupt)
        await ex.synchronize()
        assert (ex.device_streams[0].chunks, ex.device_streams[0].reserved) == (0, 0)
        assert used_bytes() == baseline


async def test_failing_input_iterable_raises_its_error(sim_backend: Any, anyio_backend: Any) -> None:
    def source() -> Iterator[np.ndarray]:
        yield from chunks(2)
        raise Boom("inputs")

    async with Executor() as ex:
        with pytest.raises(Boom, match="inputs"):
            await ex.run(ScaleStage(REPS), source())


@pytest.mark.parametrize("count", [1, 2, 8])
async def test_one_two_and_eight_devices(count: int, anyio_backend: Any) -> None:
    _driver.use_backend("sim", devices=8)
    stage = ScaleStage(REPS)
    inputs = chunks(3 * count)
    async with Executor(range(count)) as ex:
        async with ex.map(stage, inputs) as results:
            got = [r async for r in results]
    per_device = [sum(r.device == d for r in got) for d in range(count)]
    assert per_device == [3] * count  # round-robin
    for r in got:
        np.testing.assert_allclose(r.value, scale_reference(inputs[r.index], REPS), rtol=1e-5)


@pytest.mark.parametrize("placement", ["round_robin", "least_loaded"])
async def test_placement_skips_a_full_device(placement: Any, slow_sim: Any, anyio_backend: Any) -> None:
    async with Executor(chunks_per_device=2) as ex:
        slow_sim.pause(ex.device_streams[0].h2d.handle)  # device 0 stays full once it has 2 chunks
        devices_seen = []
        async with ex.map(ScaleStage(REPS), chunks(10), ordered=False, placement=placement) as results:
            async for r in results:
                devices_seen.append(r.device)
                if len(devices_seen) == 8:
                    slow_sim.resume(ex.device_streams[0].h2d.handle)
    assert devices_seen[:8] == [1] * 8
    assert sorted(devices_seen) == [0, 0] + [1] * 8


async def test_least_loaded_sends_small_chunks_away_from_a_big_one(sim_backend: Any, anyio_backend: Any) -> None:
    inputs = [np.ones(n, np.float32) for n in (40_000, 100, 100, 100, 100)]
    async with Executor() as ex:
        sim_backend.pause(ex.device_streams[0].h2d.handle)  # the big chunk stays in flight on device 0
        got = []
        async with ex.map(ScaleStage(REPS), inputs, ordered=False, placement="least_loaded") as results:
            async for r in results:
                got.append(r)
                if len(got) == 4:
                    sim_backend.resume(ex.device_streams[0].h2d.handle)
    assert [(r.index, r.device) for r in got[4:]] == [(0, 0)]
    assert {r.device for r in got[:4]} == {1}


async def test_memory_budget_limits_bytes_in_flight(sim_backend: Any, anyio_backend: Any) -> None:
    inputs = chunks(6, 25_000)  # 100 kB each: 200 kB reserved per chunk
    async with Executor([0]) as ex:
        ex.device_streams[0].budget = 450_000  # two chunks fit, not three
        peak = 0

        def stage(ctx: ChunkContext, x: DeviceArray) -> None:
            nonlocal peak
            peak = max(peak, ex.device_streams[0].chunks)

        values = await ex.run(stage, inputs)
    assert peak == 2
    for value, host in zip(values, inputs, strict=True):
        np.testing.assert_array_equal(value, host)


@pytest.fixture
def pool_without_cross_stream_reuse(backend: Any) -> Iterator[MemoryPool]:
    """Device 0's pool told to reuse freed memory only on the stream that freed it. The
    driver often behaves so anyway (it cannot tell that a free on another stream has run,
    and maps new memory); this makes it certain, on the simulator too."""
    pool = MemoryPool.for_device(Device(0))
    driver = pool._driver
    names = ("reuse_allow_opportunistic", "reuse_allow_internal_dependencies")
    saved = {name: driver.mempool_get_attribute(pool._handle, name) for name in names}
    for name in names:
        driver.mempool_set_attribute(pool._handle, name, 0)
    try:
        yield pool
    finally:
        for name, value in saved.items():
            driver.mempool_set_attribute(pool._handle, name, value)


async def test_chunk_memory_is_reused_not_mapped_anew(
    pool_without_cross_stream_reuse: MemoryPool, anyio_backend: Any
) -> None:
    """A chunk's arrays are freed, once its download is awaited, on the streams they were
    allocated on -- where later chunks allocate -- so pipeline after pipeline reuses the
    same memory. (Freed on the download stream, each 32 MiB upload buffer was mapped anew
    on the GPU: hundreds of microseconds on the loop's thread per chunk, and the pool grew
    by gigabytes over a benchmark.)"""
    pool = pool_without_cross_stream_reuse
    n = (4 << 20) // 4 - 64  # just under 4 MiB: a size no other test allocates
    inputs = [pinned_empty(n, np.float32) for _ in range(3)] * 8
    for host in inputs:
        host[:] = 1.0
    scale = ScaleStage(REPS)

    def stage(ctx: ChunkContext, x: DeviceArray) -> DeviceArray:  # in place, then a new output
        scale(ctx, x)
        out = ctx.empty(x.shape, x.dtype)
        out.buffer._used_on(ctx.stream)
        ctx.device._driver.memcpy_dtod_async(out.ptr, x.ptr, x.nbytes, ctx.stream.handle)
        return out

    async with Executor([0]) as ex:
        first = await ex.run(stage, inputs, in_flight=4)
        reserved = pool.statistics().reserved_bytes
        for _ in range(2):
            await ex.run(stage, inputs, in_flight=4)
        grown = pool.statistics().reserved_bytes - reserved
    assert grown <= 4 * n * 4, f"the pool grew by {grown} bytes over two runs of 24 chunks"
    np.testing.assert_allclose(first[-1], scale_reference(inputs[-1], REPS), rtol=1e-5)


@pytest.mark.multi_gpu
async def test_move_copies_between_devices(backend: Any, anyio_backend: Any) -> None:
    stage_impl = ScaleStage(REPS)

    def stage(ctx: ChunkContext, x: DeviceArray) -> DeviceArray:
        stage_impl(ctx, x)  # on the chunk's device
        other = ctx.move(x, 1 - ctx.device.ordinal)
        assert ctx.device.ordinal == other.device.ordinal != x.device.ordinal
        stage_impl(ctx, other)  # then on the other one
        return other

    inputs = chunks(6)
    async with Executor([0, 1], trace=True) as ex:
        values = await ex.run(stage, inputs)
        assert ex.trace is not None
        units = {(s.device, s.unit) for s in ex.trace.spans}
    assert (0, "p2p") in units and (1, "p2p") in units
    for value, host in zip(values, inputs, strict=True):
        np.testing.assert_allclose(value, scale_reference(scale_reference(host, REPS), REPS), rtol=1e-5)


async def test_move_takes_a_device_array_of_the_chunks_device(sim_backend: Any, anyio_backend: Any) -> None:
    """ctx.move refuses what it cannot move, saying why: a numpy array raised an
    AttributeError ('is_c_contiguous'); an array on another device than the chunk's was
    copied with the chunk's device named as the source of the peer copy, or, moved to its
    own device, handed back while the chunk stayed on its device."""
    from aiocuda.errors import ArgumentError

    elsewhere = {ordinal: aiocuda.empty(4, np.float32, device=ordinal) for ordinal in (0, 1)}
    refused: list[str] = []

    def stage(ctx: ChunkContext, x: DeviceArray) -> DeviceArray:
        other = 1 - ctx.device.ordinal
        with pytest.raises(TypeError, match="move\\(\\) takes a DeviceArray, not ndarray"):
            ctx.move(np.ones(4, np.float32), other)  # type: ignore[arg-type]
        for target in (other, ctx.device.ordinal):
            with pytest.raises(ArgumentError, match=f"on the chunk's device {ctx.device.ordinal}, not one on device"):
                ctx.move(elsewhere[other], target)
            refused.append(f"{ctx.index}->{target}")
        return ctx.move(x, other)  # its own array still moves

    inputs = chunks(2)
    async with Executor([0, 1]) as ex:
        values = await ex.run(stage, inputs)
    assert len(refused) == 4
    for value, host in zip(values, inputs, strict=True):
        np.testing.assert_array_equal(value, host)


async def test_stage_returning_a_wrong_type_fails_that_chunk(sim_backend: Any, anyio_backend: Any) -> None:
    async with Executor() as ex:
        with pytest.raises(TypeError, match="DeviceArray or None"):
            await ex.run(lambda ctx, x: 42, chunks(2))  # type: ignore[arg-type, return-value]


async def test_output_destinations_are_used(backend: Any, anyio_backend: Any) -> None:
    inputs = pinned_empty((6, 512), np.float32)
    inputs[:] = np.arange(inputs.size, dtype=np.float32).reshape(inputs.shape)
    out = pinned_empty((6, 512), np.float32)
    async with Executor() as ex:
        values = await ex.run(ScaleStage(REPS), inputs, output=lambda i, result: out[i])
    assert all(v.base is not None and np.shares_memory(v, out) for v in values)
    np.testing.assert_allclose(out, scale_reference(inputs, REPS), rtol=1e-5)


async def test_map_needs_an_open_executor_and_valid_options(sim_backend: Any, anyio_backend: Any) -> None:
    ex = Executor()
    with pytest.raises(RuntimeError, match="not open") as never_opened:
        ex.map(ScaleStage(REPS), [])
    assert not isinstance(never_opened.value, ClosedError)
    async with ex:
        with pytest.raises(ValueError, match="on_error"):
            ex.map(ScaleStage(REPS), [], on_error="ignore")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="placement"):
            ex.map(ScaleStage(REPS), [], placement="random")  # type: ignore[arg-type]
        assert await ex.run(ScaleStage(REPS), []) == []
        assert "in flight" in repr(ex)
    with pytest.raises(ClosedError, match="closed"):  # (a web app's handler: 503, shutting down)
        await ex.submit(ScaleStage(REPS), np.ones(4, np.float32))


async def test_map_refuses_bad_options_at_the_call_naming_them(sim_backend: Any, anyio_backend: Any) -> None:
    """map() checks its options when called, as the constructor does: a float in_flight
    reached anyio's semaphore ('initial_value must be an integer') on entering, a string
    failed a comparison, a truthy ordered="no" was taken as True, and a stage or output
    that cannot be called failed every chunk with "'NoneType' object is not callable"."""
    inputs = chunks(2)
    async with Executor([0]) as ex:
        for options, error, match in [
            ({"in_flight": 2.5}, TypeError, "in_flight must be an int"),
            ({"in_flight": "3"}, TypeError, "in_flight must be an int"),
            ({"in_flight": True}, TypeError, "in_flight must be an int"),
            ({"in_flight": 0}, ValueError, "in_flight must be >= 1"),
            ({"ordered": "no"}, TypeError, "ordered must be True or False, not str"),
            ({"ordered": None}, TypeError, "ordered must be True or False, not NoneType"),
            ({"output": 5}, TypeError, "output must be callable"),
        ]:
            with pytest.raises(error, match=match):
                ex.map(ScaleStage(REPS), inputs, **options)
        with pytest.raises(TypeError, match="stage must be callable"):
            ex.map(None, inputs)  # type: ignore[arg-type]
        assert len(await ex.run(ScaleStage(REPS), inputs, in_flight=np.int64(1))) == 2


async def test_run_refuses_the_options_it_cannot_honour(sim_backend: Any, anyio_backend: Any) -> None:
    """run() returns values in input order and raises the first error: it took ordered
    and on_error and overrode them, so on_error="continue" raised all the same."""
    async with Executor([0]) as ex:
        for options in ({"on_error": "continue"}, {"ordered": False}):
            with pytest.raises(TypeError, match="unexpected keyword argument"):
                await ex.run(failing_at(1), chunks(3), **options)
        values = await ex.run(ScaleStage(REPS), chunks(3), in_flight=2, placement="least_loaded", name="scale")
    assert len(values) == 3


def test_bad_executor_options_are_refused_when_made_naming_the_option() -> None:
    """Each option's own type and range are checked by the constructor: a float chunk
    count was taken, then refused on entering as the lanes' 'count'."""
    for options, error, match in [
        ({"chunks_per_device": 2.5}, TypeError, "chunks_per_device must be an int"),
        ({"chunks_per_device": True}, TypeError, "chunks_per_device must be an int"),
        ({"chunks_per_device": "8"}, TypeError, "chunks_per_device must be an int"),
        ({"chunks_per_device": 0}, ValueError, "chunks_per_device must be >= 1"),
        ({"compute_streams": 1.5}, TypeError, "compute_streams must be an int"),
        ({"compute_streams": None}, TypeError, "compute_streams must be an int"),
        ({"memory_fraction": "half"}, TypeError, "memory_fraction must be a number"),
        ({"memory_fraction": True}, TypeError, "memory_fraction must be a number"),
        ({"memory_fraction": float("nan")}, ValueError, "memory_fraction must be in"),
        ({"memory_fraction": 0}, ValueError, "memory_fraction must be in"),
        ({"devices": 0}, TypeError, r"devices is a sequence of devices or ordinals, e.g. Executor\(\[0\]\), not int"),
        ({"devices": "01"}, TypeError, "devices is a sequence of devices or ordinals"),
    ]:
        with pytest.raises(error, match=match):
            Executor(**options)
    assert Executor(chunks_per_device=np.int64(3), memory_fraction=np.float32(0.5)) is not None


async def test_an_executor_or_a_map_is_entered_once(sim_backend: Any, anyio_backend: Any) -> None:
    with pytest.raises(ValueError, match="devices must differ"):
        await Executor([0, 0]).__aenter__()
    async with Executor([0]) as ex:
        with pytest.raises(RuntimeError, match="open already"):
            await ex.__aenter__()
        with pytest.raises(TypeError, match="graph must be True or False"):
            ex.map(ScaleStage(REPS), [], graph="yes")  # type: ignore[arg-type]
        pipeline = ex.map(ScaleStage(REPS), chunks(2))
        async with pipeline as results:
            assert len([r async for r in results]) == 2
        with pytest.raises(RuntimeError, match="a map runs once"):
            async with pipeline:
                pass


async def test_one_task_reads_a_maps_results(slow_sim: Any, anyio_backend: Any) -> None:
    errors: list[BaseException] = []
    async with Executor([0]) as ex:
        d2h = ex.device_streams[0].d2h
        slow_sim.pause(d2h.handle)  # no chunk can finish: both readers wait
        try:
            async with ex.map(ScaleStage(REPS), chunks(4), ordered=False) as results:

                async def reader() -> None:
                    try:
                        await results.__anext__()
                    except RuntimeError as exc:
                        errors.append(exc)

                async with anyio.create_task_group() as tg:
                    tg.start_soon(reader)
                    while results._arrival is None:
                        await anyio.lowlevel.checkpoint()
                    tg.start_soon(reader)
                    while not errors:
                        await anyio.lowlevel.checkpoint()
                    tg.cancel_scope.cancel()
        finally:
            slow_sim.resume(d2h.handle)
    assert len(errors) == 1 and "one task iterates a map" in str(errors[0])


async def test_reading_a_map_after_its_block_says_the_block_was_left(sim_backend: Any, anyio_backend: Any) -> None:
    """Results left when the block ended are gone: reading them raises an error that says
    why (it was anyio's ClosedResourceError with no message); a map read to its end
    simply ends again."""
    async with Executor([0]) as ex:
        async with ex.map(ScaleStage(REPS), chunks(4)) as left_early:
            await left_early.__anext__()
        with pytest.raises(anyio.ClosedResourceError, match="block has been left"):
            await left_early.__anext__()
        async with ex.map(ScaleStage(REPS), chunks(2)) as read_through:
            assert len([r async for r in read_through]) == 2
        assert [r async for r in read_through] == []


async def test_an_input_error_comes_after_the_results_before_it(sim_backend: Any, anyio_backend: Any) -> None:
    async def inputs() -> Any:
        for array in chunks(3):
            yield array
        raise KeyError("bad input")

    async with Executor([0]) as ex, ex.map(ScaleStage(REPS), inputs(), on_error="continue") as results:
        got = [(await results.__anext__()).index for _ in range(3)]
        with pytest.raises(KeyError, match="bad input"):
            await results.__anext__()
        with pytest.raises(StopAsyncIteration):  # the end, not a wait for more
            await results.__anext__()
    assert got == [0, 1, 2]


async def test_a_device_failing_mid_map_fails_its_chunks_in_go_on_mode(sim_backend: Any, anyio_backend: Any) -> None:
    async with Executor([0]) as ex:
        async with ex.map(ScaleStage(REPS), chunks(20), on_error="continue") as results:
            seen = []
            async for r in results:
                seen.append(r)
                if r.index == 3:
                    sim_backend.poison(0)
        assert len(seen) == 20 and not seen[0].error and isinstance(seen[-1].error, ContextPoisonedError)
        assert ex.device_streams[0].chunks == 0 and ex.device_streams[0].reserved == 0  # admission given back
        depths = set()
        for _ in range(3):  # raised again and again, with the chunk's own traceback
            with pytest.raises(ContextPoisonedError) as caught:
                seen[-1].value  # noqa: B018
            depths.add(len(traceback.extract_tb(caught.value.__traceback__)))
        assert len(depths) == 1
        ex.close()


async def test_after_a_fault_each_device_fails_once_then_submits_fail_at_once(
    sim_backend: Any, anyio_backend: Any
) -> None:
    """A sticky error ends the process's use of every GPU (CUDA's rule, and the
    simulator's): each device is found failed by one chunk, and from then on submits fail
    at once (least_loaded kept choosing the failed device, whose chunks failed at once,
    and leaving the executor raised again what the chunks had reported)."""
    x = np.arange(8, dtype=np.float32)
    async with Executor([0, 1]) as ex:
        await ex.submit(ScaleStage(1), x)
        sim_backend.poison(0)
        errors = []
        for _ in range(4):
            with pytest.raises(ContextPoisonedError) as caught:
                await ex.submit(ScaleStage(1), x)
            errors.append("failed earlier" in str(caught.value))
        assert errors == [False, False, True, True]
        assert sorted(ex.failures) == [0, 1] and "FAILED" in repr(ex)
        assert [d.completed for d in ex.device_streams] in ([2, 1], [1, 2])  # one chunk each found it


async def test_once_every_device_failed_chunks_fail_at_once(sim_backend: Any, anyio_backend: Any) -> None:
    x = np.arange(8, dtype=np.float32)
    async with Executor([0]) as ex:
        sim_backend.poison(0)
        with pytest.raises(ContextPoisonedError):  # the chunk that finds it
            await ex.submit(ScaleStage(1), x)
        with pytest.raises(ContextPoisonedError, match="failed earlier"):  # at once: admission
            await ex.submit(ScaleStage(1), x)
        assert ex.device_streams[0].completed == 1
        async with ex.map(ScaleStage(1), chunks(5), on_error="continue") as results:
            got = [r async for r in results]
        assert [r.index for r in got] == list(range(5))
        assert all(isinstance(r.error, ContextPoisonedError) and r.device == 0 for r in got)
        with pytest.raises(ContextPoisonedError, match="failed earlier"):
            await ex.run(ScaleStage(1), chunks(5))


FAILED_DEVICE_SCRIPT = """
import anyio
import numpy as np
from aiocuda.errors import ContextPoisonedError
from aiocuda.executor import Executor
from _workload import _kernel, poison_op

def fault(ctx, x):
    poison_op(ctx.stream)

async def main():
    async with Executor([0]) as ex:
        for stream in ex.device_streams[0].compute:
            _kernel(stream, "poison")  # (loaded before the fault)
        try:
            await ex.submit(fault, np.zeros(4, np.float32))
        except ContextPoisonedError as exc:
            print("CHUNK FAILED", exc.name)
        with anyio.fail_after(5):
            try:
                await ex.submit(fault, np.zeros(4, np.float32))
            except ContextPoisonedError as exc:
                print("REFUSED", "failed earlier" in str(exc), list(ex.failures))
    print("LEFT")

anyio.run(main)
"""


@pytest.mark.parametrize("backend", ["sim", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_device_that_failed_refuses_later_chunks(backend: str) -> None:
    """In a process of its own (a poisoned context is not recovered), on the GPU too: the
    chunk that meets the fault fails with it, the next submit fails at once, and leaving
    the executor does not raise it again."""
    from .conftest import real_gpu_count
    from .test_completion import run_script

    if backend == "cuda" and real_gpu_count() == 0:
        pytest.skip("no real GPU")
    proc = run_script(FAILED_DEVICE_SCRIPT, backend)
    out = proc.stdout + proc.stderr
    assert "CHUNK FAILED" in out and "REFUSED True [0]" in out and "LEFT" in out, out


EVERY_DEVICE_SCRIPT = """
import anyio
import numpy as np
from aiocuda.errors import ContextPoisonedError
from aiocuda.executor import Executor
from _workload import _kernel, poison_op

def fault(ctx, x):
    poison_op(ctx.stream)

async def main():
    async with Executor([0, 1]) as ex:
        for per_device in ex.device_streams:
            _kernel(per_device.compute[0], "poison")  # (loaded before the fault)
        outcomes = []
        for stage in (fault, None, None, None):
            try:
                await ex.submit(stage or (lambda ctx, x: None), np.zeros(4, np.float32), placement="round_robin")
                outcomes.append("ok")
            except ContextPoisonedError as exc:
                outcomes.append("refused" if "failed earlier" in str(exc) else "failed")
        print("OUTCOMES", outcomes, sorted(ex.failures))
    print("LEFT")

anyio.run(main)
"""


@pytest.mark.parametrize("backend", ["sim", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_fault_on_one_device_fails_the_others_too(backend: str) -> None:
    """On two real GPUs as on the simulator: an illegal address on device 0 made device
    1's calls fail with it (CUDA's documented rule: the process must be relaunched). The
    other device's next chunk finds it; then submits are refused at once."""
    from .conftest import real_gpu_count
    from .test_completion import run_script

    if backend == "cuda" and real_gpu_count() < 2:
        pytest.skip("needs two GPUs; this machine has fewer")
    proc = run_script(EVERY_DEVICE_SCRIPT, backend)
    out = proc.stdout + proc.stderr
    assert "OUTCOMES ['failed', 'failed', 'refused', 'refused'] [0, 1]" in out and "LEFT" in out, out


async def test_a_driver_error_fails_only_its_chunk_in_go_on_mode(sim_backend: Any, anyio_backend: Any) -> None:
    from aiocuda.errors import CudaError, ResultCode

    baseline = used_bytes()
    inputs = chunks(6, pinned=True)
    async with Executor([0]) as ex:
        sim_backend.inject_fault(ResultCode.INVALID_VALUE, at_call=3, call="memcpy_dtoh_async")
        async with ex.map(ScaleStage(REPS), inputs, on_error="continue") as results:
            got = [r async for r in results]
        await ex.synchronize()
        assert used_bytes() == baseline
    assert [r.index for r in got if not r.ok] == [2]
    assert isinstance(got[2].error, CudaError)
    for r in got:
        if r.ok:
            np.testing.assert_allclose(r.value, scale_reference(inputs[r.index], REPS), rtol=1e-5)


async def test_pipelines_share_an_executor_concurrently(slow_sim: Any, anyio_backend: Any) -> None:
    a, b = chunks(6, seed=1), chunks(6, seed=2)
    found: dict[str, list[np.ndarray]] = {}
    async with Executor(chunks_per_device=2) as ex:

        async def run(name: str, inputs: list[np.ndarray], reps: int) -> None:
            found[name] = await ex.run(ScaleStage(reps), inputs)

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "a", a, REPS)
            tg.start_soon(run, "b", b, 2 * REPS)
        assert all(per_device.chunks == 0 for per_device in ex.device_streams)
    for value, host in zip(found["a"], a, strict=True):
        np.testing.assert_allclose(value, scale_reference(host, REPS), rtol=1e-5)
    for value, host in zip(found["b"], b, strict=True):
        np.testing.assert_allclose(value, scale_reference(host, 2 * REPS), rtol=1e-5)


async def test_catching_a_chunk_error_inside_the_block_leaks_no_cancellation(
    sim_backend: Any, anyio_backend: Any
) -> None:
    caught = reached = False
    async with Executor() as ex:
        async with ex.map(failing_at(1), chunks(5)) as results:
            try:
                async for _ in results:
                    pass
            except Boom:
                caught = True
            await anyio.lowlevel.checkpoint()  # the pipeline's scope is cancelled: the block ends here
            reached = True
        assert caught and not reached
        assert len(await ex.run(ScaleStage(REPS), chunks(3))) == 3  # still usable
    await anyio.lowlevel.checkpoint()  # and this task was not cancelled


async def test_submit_from_many_tasks_respects_the_device_limits(slow_sim: Any, anyio_backend: Any) -> None:
    inputs = chunks(10)
    found: dict[int, np.ndarray] = {}
    peak = 0
    scale = ScaleStage(REPS)
    async with Executor(chunks_per_device=2) as ex:

        def stage(ctx: ChunkContext, x: DeviceArray) -> None:
            nonlocal peak
            peak = max(peak, *(per_device.chunks for per_device in ex.device_streams))
            scale(ctx, x)

        async def one(i: int) -> None:
            found[i] = await ex.submit(stage, inputs[i])

        async with anyio.create_task_group() as tg:
            for i in range(10):
                tg.start_soon(one, i)
        assert sum(per_device.completed for per_device in ex.device_streams) == 10
        assert min(per_device.completed for per_device in ex.device_streams) >= 3  # least loaded: both devices work
    assert peak == 2
    for i, host in enumerate(inputs):
        np.testing.assert_allclose(found[i], scale_reference(host, REPS), rtol=1e-5)


async def test_submit_runs_on_at_most_the_default_lanes_of_a_device(slow_sim: Any, anyio_backend: Any) -> None:
    lanes = default_count(Device(0))
    inputs = chunks(2 * lanes)
    streams: set[int] = set()
    found: dict[int, np.ndarray] = {}
    scale = ScaleStage(REPS)
    async with Executor([0], chunks_per_device=2 * lanes) as ex:

        def stage(ctx: ChunkContext, x: DeviceArray) -> None:
            streams.add(id(ctx.stream))
            scale(ctx, x)

        async def one(i: int) -> None:
            found[i] = await ex.submit(stage, inputs[i])

        async with anyio.create_task_group() as tg:  # all admitted at once; half wait for a lane
            for i in range(len(inputs)):
                tg.start_soon(one, i)
    assert len(streams) == lanes
    for i, host in enumerate(inputs):
        np.testing.assert_allclose(found[i], scale_reference(host, REPS), rtol=1e-5)


async def test_leaving_cancelled_closes_at_once(sim_backend: Any, anyio_backend: Any) -> None:
    """Work that does not end (a paused stream) does not hold a cancelled exit: the
    executor closes its streams at once (the work runs on when the stream resumes), in an
    anyio scope and in an asyncio task unwinding from its cancellation."""
    ex = Executor([0])
    with anyio.CancelScope() as scope:
        async with ex:
            h2d = ex.device_streams[0].h2d
            handle = h2d.handle
            sim_backend.pause(handle)
            await ex.submit(ScaleStage(1), np.ones(8, np.float32))
            h2d.record()  # (pending behind the pause)
            scope.cancel()
            await anyio.sleep_forever()
    assert scope.cancelled_caught and h2d.closed
    sim_backend.resume(handle)
    await h2d

    if anyio_backend != "asyncio":
        return
    import asyncio

    started = anyio.Event()

    async def unwinding() -> None:
        async with Executor([0]) as inner:
            h2d = inner.device_streams[0].h2d
            held.append((h2d, h2d.handle))
            sim_backend.pause(h2d.handle)
            h2d.record()
            started.set()
            await anyio.sleep_forever()

    held: list[Any] = []
    task = asyncio.ensure_future(unwinding())
    await started.wait()
    task.cancel()
    with anyio.fail_after(5), pytest.raises(asyncio.CancelledError):
        await task
    h2d, handle = held[0]
    assert h2d.closed
    sim_backend.resume(handle)


async def test_cancelled_submit_returns_its_memory(slow_sim: Any, anyio_backend: Any) -> None:
    baseline = used_bytes()
    async with Executor([0]) as ex:
        with anyio.move_on_after(0.003) as scope:
            await ex.submit(ScaleStage(REPS), chunks(1, 50_000)[0])
        assert scope.cancelled_caught
        await ex.synchronize()
        assert used_bytes() == baseline and ex.device_streams[0].chunks == 0

        def boom(ctx: ChunkContext, x: DeviceArray) -> None:
            raise Boom("submitted")

        with pytest.raises(Boom, match="submitted"):
            await ex.submit(boom, chunks(1)[0])
        value = await ex.submit(ScaleStage(REPS), chunks(1)[0])
    np.testing.assert_allclose(value, scale_reference(chunks(1)[0], REPS), rtol=1e-5)


async def test_statistics_count_a_running_submit_and_one_waiting_for_room(
    backend: _driver.Driver, anyio_backend: Any
) -> None:
    """The device's one chunk is a submit held in its stage, a second waits for room:
    one running on a lane, one waiting, the device full; once both return, none runs or
    waits and both completed."""
    gate = anyio.Event()
    host = np.arange(64, dtype=np.float32)

    async def held(ctx: ChunkContext, x: DeviceArray) -> None:
        await gate.wait()

    async with Executor([0], chunks_per_device=1) as ex:
        async with anyio.create_task_group() as tg:
            tg.start_soon(ex.submit, held, host)
            await checkpoints()
            tg.start_soon(ex.submit, lambda ctx, x: None, host)
            await checkpoints()
            s = ex.statistics()
            assert (s.submits_running, s.submits_waiting, s.submits_completed, s.submits_failed) == (1, 1, 0, 0)
            (device,) = s.device_streams
            assert (device.device, device.chunks, device.max_chunks, device.completed) == (0, 1, 1, 0)
            assert device.reserved == 2 * host.nbytes and device.budget == ex.device_streams[0].budget > 0
            assert not device.failed and device.lanes is not None
            assert (device.lanes.lanes, device.lanes.leased, device.lanes.waiting) == (1, 1, 0)
            assert "1 running, 1 waiting" in repr(ex)
            gate.set()
        s = ex.statistics()
    assert (s.submits_running, s.submits_waiting, s.submits_completed, s.submits_failed) == (0, 0, 2, 0)
    (device,) = s.device_streams
    assert (device.chunks, device.reserved, device.completed) == (0, 0, 2)


async def test_statistics_count_submits_waiting_for_a_lane(backend: _driver.Driver, anyio_backend: Any) -> None:
    """A device admits one chunk more than it has lanes: with every lane held in its
    stage, one admitted submit waits for a lane (its device's lanes say so) and one more
    waits for room; all of them wait, none runs beyond the lanes."""
    lanes = default_count(Device(0))
    gate = anyio.Event()
    host = np.arange(64, dtype=np.float32)

    async def held(ctx: ChunkContext, x: DeviceArray) -> None:
        await gate.wait()

    async with Executor([0], chunks_per_device=lanes + 1) as ex:
        async with anyio.create_task_group() as tg:
            for _ in range(lanes + 2):
                tg.start_soon(ex.submit, held, host)
                await checkpoints(5)
            await checkpoints()
            s = ex.statistics()
            assert (s.submits_running, s.submits_waiting) == (lanes, 2)
            (device,) = s.device_streams
            assert device.chunks == lanes + 1 and device.lanes is not None
            assert (device.lanes.lanes, device.lanes.leased, device.lanes.waiting) == (lanes, lanes, 1)
            gate.set()
        s = ex.statistics()
    assert (s.submits_running, s.submits_waiting, s.submits_completed, s.submits_failed) == (0, 0, lanes + 2, 0)


async def test_statistics_count_failed_and_cancelled_submits(backend: _driver.Driver, anyio_backend: Any) -> None:
    """A submit whose stage raises and one cancelled while held in its stage both count
    as completed and failed; the device did not fail."""
    host = np.arange(64, dtype=np.float32)

    def boom(ctx: ChunkContext, x: DeviceArray) -> None:
        raise Boom("submitted")

    async def held(ctx: ChunkContext, x: DeviceArray) -> None:
        await anyio.sleep_forever()

    async with Executor([0]) as ex:
        np.testing.assert_array_equal(await ex.submit(lambda ctx, x: None, host), host)
        with pytest.raises(Boom, match="submitted"):
            await ex.submit(boom, host)
        s = ex.statistics()
        assert (s.submits_running, s.submits_waiting, s.submits_completed, s.submits_failed) == (0, 0, 2, 1)
        async with anyio.create_task_group() as tg:
            tg.start_soon(ex.submit, held, host)
            await checkpoints()
            assert ex.statistics().submits_running == 1
            tg.cancel_scope.cancel()
        s = ex.statistics()
    assert (s.submits_running, s.submits_waiting, s.submits_completed, s.submits_failed) == (0, 0, 3, 2)
    (device,) = s.device_streams
    assert device.completed == 3 and device.chunks == 0 and not device.failed


async def test_statistics_count_a_running_map_and_its_chunks(sim_backend: Any, anyio_backend: Any) -> None:
    """A map whose chunks cannot finish (its download stream paused) counts as running,
    with the device's two chunks its own; once it is read to the end and its block left,
    none runs."""
    inputs = chunks(4, pinned=True)
    async with Executor([0], chunks_per_device=2) as ex:
        d2h = ex.device_streams[0].d2h
        sim_backend.pause(d2h.handle)
        async with ex.map(lambda ctx, x: None, inputs) as results:
            await checkpoints()
            s = ex.statistics()
            assert (s.maps_running, s.map_chunks, s.submits_running, s.submits_waiting) == (1, 2, 0, 0)
            assert s.device_streams[0].chunks == 2 and s.device_streams[0].reserved == 2 * (
                inputs[0].nbytes + inputs[1].nbytes
            )
            assert "maps: 1" in repr(ex)
            sim_backend.resume(d2h.handle)
            assert len([r async for r in results]) == 4
        s = ex.statistics()
        assert (s.maps_running, s.map_chunks, s.submits_completed) == (0, 0, 0)
        assert s.device_streams[0].completed == 4


async def test_statistics_of_a_new_and_a_closed_executor(backend: _driver.Driver, anyio_backend: Any) -> None:
    """Before it is entered an executor has no devices and counts nothing; once closed it
    keeps its final counts, its lanes' included, and refuses submits without counting them."""
    ex = Executor([0])
    s = ex.statistics()
    assert s.device_streams == () and (s.submits_completed, s.maps_running) == (0, 0)
    assert repr(ex).startswith("<Executor new")
    host = np.arange(64, dtype=np.float32)
    async with ex:
        await ex.submit(lambda ctx, x: None, host)
        await ex.run(lambda ctx, x: None, [host])
    with pytest.raises(ClosedError):
        await ex.submit(lambda ctx, x: None, host)
    s = ex.statistics()
    assert (s.submits_running, s.submits_waiting, s.submits_completed, s.submits_failed) == (0, 0, 1, 0)
    assert (s.maps_running, s.map_chunks) == (0, 0)
    (device,) = s.device_streams
    assert (device.chunks, device.reserved, device.completed, device.failed) == (0, 0, 2, False)
    assert device.lanes is not None and (device.lanes.leased, device.lanes.leases) == (0, 1)
    assert repr(ex).startswith("<Executor closed") and "0: 0 in flight" in repr(ex)


async def test_statistics_count_maps_of_an_earlier_opening_until_their_block_is_left(
    backend: _driver.Driver, anyio_backend: Any
) -> None:
    """An executor left and entered again: a map whose block another task keeps open from
    the earlier opening still counts as running (once; its chunks are over, so none of
    them counts), and so does a map made then and entered now (refused: ClosedError); each
    stops counting when its block is left, and the counts never go below zero."""
    ex = Executor([0])
    inputs = chunks(2)
    read, leave_map, left = anyio.Event(), anyio.Event(), anyio.Event()

    async def reader() -> None:
        async with ex.map(lambda ctx, x: None, inputs) as results:
            assert len([r async for r in results]) == 2
            read.set()
            await leave_map.wait()
        left.set()

    async with anyio.create_task_group() as tg:
        async with ex:
            tg.start_soon(reader)
            await read.wait()
            made_early = ex.map(lambda ctx, x: None, inputs)
            assert ex.statistics().maps_running == 1
        assert (ex.statistics().maps_running, ex.statistics().map_chunks) == (1, 0)
        async with ex:
            s = ex.statistics()
            assert (s.maps_running, s.map_chunks) == (1, 0)
            async with made_early as results:
                assert ex.statistics().maps_running == 2
                with pytest.raises(ClosedError):
                    [r async for r in results]
            assert ex.statistics().maps_running == 1
            leave_map.set()
            await left.wait()
            s = ex.statistics()
            assert (s.maps_running, s.map_chunks) == (0, 0)
            async with ex.map(lambda ctx, x: None, inputs) as results:
                assert ex.statistics().maps_running == 1
                assert len([r async for r in results]) == 2
            s = ex.statistics()
            assert (s.maps_running, s.map_chunks) == (0, 0)
            assert s.device_streams[0].completed == 2


@pytest.mark.parametrize("left_by", ["close", "cancelled exit"])
async def test_statistics_count_submits_of_an_earlier_opening_where_they_started(
    backend: _driver.Driver, anyio_backend: Any, left_by: str
) -> None:
    """Submits held in their stage outlive their opening (the executor closed directly, or
    its exit cancelled) and the executor is entered again: they count as running there
    (on their own opening's lanes), not as waiting; once they return, one with its result
    and one with its error, none runs or waits and neither counts as this opening's
    completed or failed submit."""
    gate = anyio.Event()
    host = np.arange(64, dtype=np.float32)

    async def held(ctx: ChunkContext, x: DeviceArray) -> None:
        await gate.wait()

    async def held_then_boom(ctx: ChunkContext, x: DeviceArray) -> None:
        await gate.wait()
        raise Boom("held")

    returned = [anyio.Event(), anyio.Event()]

    async def submit_held() -> None:
        try:
            await ex.submit(held, host)
        finally:
            returned[0].set()

    async def submit_expecting_boom() -> None:
        try:
            with pytest.raises(Boom, match="held"):
                await ex.submit(held_then_boom, host)
        finally:
            returned[1].set()

    ex = Executor([0])
    async with anyio.create_task_group() as tg:
        try:
            with anyio.CancelScope() as scope:
                async with ex:
                    tg.start_soon(submit_held)
                    tg.start_soon(submit_expecting_boom)
                    await checkpoints()
                    assert ex.statistics().submits_running == 2
                    if left_by == "close":
                        ex.close()
                    else:
                        scope.cancel()
                        await anyio.lowlevel.checkpoint()
            assert repr(ex).startswith("<Executor closed")
            async with ex:
                try:
                    s = ex.statistics()
                    assert (s.submits_running, s.submits_waiting, s.submits_completed, s.submits_failed) == (2, 0, 0, 0)
                    assert s.device_streams[0].lanes is not None and s.device_streams[0].lanes.leased == 0
                finally:
                    gate.set()  # (before leaving, which may wait for them)
                for event in returned:  # (their downloads run on the simulated GPU: no fixed number of turns)
                    await event.wait()
                s = ex.statistics()
                assert (s.submits_running, s.submits_waiting, s.submits_completed, s.submits_failed) == (0, 0, 0, 0)
                await ex.submit(lambda ctx, x: None, host)
                s = ex.statistics()
                assert (s.submits_running, s.submits_waiting, s.submits_completed, s.submits_failed) == (0, 0, 1, 0)
        finally:
            gate.set()  # (the held submits return, whatever failed above)


async def test_leaving_waits_for_the_submits_of_its_own_opening_only(
    backend: _driver.Driver, anyio_backend: Any
) -> None:
    """An exit waits for a submit held in its stage; the executor is closed directly and
    entered again meanwhile. Leaving the new opening does not wait for the earlier
    opening's submit, and the earlier exit, once that submit returns, ends without
    waiting for the next opening's submits or closing it."""
    gate = anyio.Event()
    host = np.arange(64, dtype=np.float32)
    first_left = anyio.Event()

    async def held(ctx: ChunkContext, x: DeviceArray) -> None:
        await gate.wait()

    async def first_opening(task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with ex:
            tg.start_soon(ex.submit, held, host)
            await checkpoints()
            task_status.started()
        first_left.set()

    ex = Executor([0])
    async with anyio.create_task_group() as tg:
        await tg.start(first_opening)
        await checkpoints()
        assert repr(ex).startswith("<Executor closing")  # (waiting for the held submit)
        ex.close()
        with anyio.fail_after(60):  # (only a wait for the wrong submits reaches it)
            async with ex:  # the second opening, left while the first's submit is held
                await ex.submit(lambda ctx, x: None, host)
        assert not first_left.is_set()
        async with ex:  # the third, open while the first's exit ends
            gate.set()
            with anyio.fail_after(60):  # (only a wait for the wrong submits reaches it)
                await first_left.wait()
            assert repr(ex).startswith("<Executor open")
            np.testing.assert_array_equal(await ex.submit(lambda ctx, x: None, host), host)
            s = ex.statistics()
            assert (s.submits_running, s.submits_waiting, s.submits_completed, s.submits_failed) == (0, 0, 1, 0)


@pytest.mark.parametrize("traced", [False, True])
async def test_submit_runs_every_kind_of_stage_and_returns_its_memory(
    backend: Any, anyio_backend: Any, traced: bool
) -> None:
    """A submit's chunk runs on a request lane: in place or into a new array, sync or
    async stages, pageable or pinned input, an input beyond the lane's staging, a given
    output; traced like a pipeline's chunk, or untraced; and every byte it allocated is
    returned."""
    scale = ScaleStage(REPS)

    async def into_new(ctx: ChunkContext, x: DeviceArray) -> DeviceArray:
        out = ctx.empty(x.shape, x.dtype)
        ctx.device.make_current()
        ctx.device._driver.memcpy_dtod_async(out.ptr, x.ptr, x.nbytes, ctx.stream.handle)
        scale(ctx, out)
        return out

    pageable = chunks(1)[0]
    inputs = [pageable, chunks(1, pinned=True, seed=1)[0], chunks(1, (3 << 20) // 4, seed=2)[0]]  # 3 MiB: > staging
    out = pinned_empty(pageable.shape, np.float32)
    baseline = used_bytes()
    async with Executor([0], trace=traced) as ex:
        for host in inputs:
            for stage in (scale, into_new):
                np.testing.assert_allclose(await ex.submit(stage, host), scale_reference(host, REPS), rtol=1e-5)
        assert await ex.submit(scale, pageable, output=lambda i, result: out) is out
        with pytest.raises(TypeError, match="DeviceArray or None"):
            await ex.submit(lambda ctx, x: 42, pageable)  # type: ignore[arg-type, return-value]
        await ex.synchronize()
        assert used_bytes() == baseline and ex.device_streams[0].chunks == 0
        units = {span.unit for span in ex.trace.spans} if ex.trace is not None else set()
    assert {"h2d", "compute", "d2h"} <= units if traced else not units
    np.testing.assert_allclose(out, scale_reference(pageable, REPS), rtol=1e-5)


async def test_submit_returns_results_through_the_lanes_staging_or_pinned_memory(
    backend: Any, anyio_backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A submit's result that fits the lane's staging is copied out of it into a plain
    array; a larger one, up to PINNED_RESULT_BYTES, is a page-locked array from the
    cache of pinned blocks (its download one DMA), or, when the cache has none, a plain
    one, no memory being pinned on the loop's thread for it (1-40 ms there) but one
    block off the loop for the next; above that, or with a pipeline's map, a plain one."""
    from aiocuda import executor
    from aiocuda._executor import chunk
    from aiocuda.host import empty_cache, is_pinned

    scale = ScaleStage(REPS)
    host = chunks(1)[0]
    expected = scale_reference(host, REPS)
    async with Executor([0]) as ex:
        small = await ex.submit(scale, host)
        assert not is_pinned(small)
        np.testing.assert_allclose(small, expected, rtol=1e-5)
        half = await ex.submit(lambda ctx, x: ctx.empty((2, x.size // 2))[1:], host)  # a C-contiguous view
        assert half.shape == (1, host.size // 2)
        with pytest.raises(aiocuda.errors.ArgumentError, match="C-contiguous"):
            await ex.submit(lambda ctx, x: ctx.empty((x.size // 2, 2))[:, 0], host)
        assert ex.device_streams[0].chunks == 0
    # A result beyond the staging's copy-out slots (INLINE_LIMIT): in ordinary memory it
    # is downloaded through the copier threads, so nothing of it is pinned on the loop.
    big = np.random.default_rng(7).random(1 << 19, dtype=np.float32)  # 2 MiB
    monkeypatch.setattr(executor, "_SUBMIT_STAGING", big.nbytes)  # room for the upload only
    pinning_threads = []
    driver = _driver.driver()
    alloc = driver.mem_host_alloc

    def noting_alloc(nbytes: int) -> int:
        pinning_threads.append(threading.current_thread().name)
        return alloc(nbytes)

    async with Executor([0]) as ex:
        await reserve_thread_done()
        empty_cache()
        monkeypatch.setattr(driver, "mem_host_alloc", noting_alloc)
        plain = await ex.submit(scale, big)
        assert not is_pinned(plain)
        np.testing.assert_allclose(plain, scale_reference(big, REPS), rtol=1e-5)
        assert threading.current_thread().name not in pinning_threads
        await reserve_thread_done()
        assert "aiocuda-reserve" in pinning_threads  # a block for the next result, pinned off the loop
        monkeypatch.setattr(executor, "_SUBMIT_STAGING", host.nbytes)
    async with Executor([0]) as ex:
        # (the block the next result takes, made here: other pinned memory of its size,
        # the staging's copy-out slots, may take the reserve thread's spares first)
        pinned_empty(host.shape, host.dtype)  # dropped at once: its block goes to the cache
        pinned = await ex.submit(scale, host)
        assert is_pinned(pinned)
        np.testing.assert_allclose(pinned, expected, rtol=1e-5)
        monkeypatch.setattr(chunk, "PINNED_RESULT_BYTES", host.nbytes - 1)
        large = await ex.submit(scale, host)
        assert not is_pinned(large)
        np.testing.assert_allclose(large, expected, rtol=1e-5)
        mapped = await ex.run(scale, [host])
        assert not is_pinned(mapped[0])


@pytest.mark.multi_gpu
async def test_submit_with_a_stage_that_moves_its_chunk(backend: Any, anyio_backend: Any) -> None:
    scale = ScaleStage(REPS)

    def stage(ctx: ChunkContext, x: DeviceArray) -> DeviceArray:
        return ctx.move(x, 1 - ctx.device.ordinal)  # downloaded from the other device, not the lane's

    host = chunks(1)[0]
    baseline = used_bytes()
    async with Executor([0, 1]) as ex:
        for _ in range(3):  # on both devices (least loaded, then the cursor's order)
            np.testing.assert_allclose(await ex.submit(stage, host), host)
        np.testing.assert_allclose(await ex.submit(scale, host), scale_reference(host, REPS), rtol=1e-5)
        await ex.synchronize()
        assert used_bytes() == baseline


@pytest.mark.anyio
async def test_submit_and_pipeline_priorities(backend: _driver.Driver, anyio_backend: Any) -> None:
    from aiocuda.stream import Stream

    least, greatest = Stream.priority_range(0)
    seen: list[int] = []

    def stage(ctx: ChunkContext, x: DeviceArray) -> None:
        seen.append(ctx.stream.priority)

    host = np.zeros(256, np.float32)
    async with Executor([0], chunks_per_device=2) as ex:
        await ex.submit(stage, host)
        await ex.submit(stage, host, priority="high")
        assert all(stream.priority == least for stream in ex.device_streams[0].streams)
        with pytest.raises(ValueError, match="priority"):
            await ex.submit(stage, host, priority="urgent")  # type: ignore[arg-type]
    assert seen == [least, greatest]
    async with Executor([0], priority="high") as ex:
        assert all(stream.priority == greatest for stream in ex.device_streams[0].streams)
        await ex.run(stage, [host])
    assert seen[-1] == greatest
    with pytest.raises(ValueError, match="priority"):
        Executor(priority="low")  # type: ignore[arg-type]


async def test_a_high_priority_submit_is_admitted_before_the_work_waiting_ahead_of_it(
    backend: _driver.Driver, anyio_backend: Any
) -> None:
    """The device's one chunk is held in its stage; normal submits and a pipeline's chunk
    wait for room, then a high-priority submit: the high one is admitted next, the others
    after it."""
    order: list[str] = []
    gate = anyio.Event()
    host = np.zeros(256, np.float32)

    def stage_of(tag: str) -> Any:
        def stage(ctx: ChunkContext, x: DeviceArray) -> None:
            order.append(tag)

        return stage

    async def held(ctx: ChunkContext, x: DeviceArray) -> None:
        order.append("held")
        await gate.wait()

    async with Executor([0], chunks_per_device=1) as ex:

        async def submit(tag: str, priority: Any = "normal") -> None:
            await ex.submit(stage_of(tag), host, priority=priority)

        async def pipeline() -> None:
            assert len(await ex.run(stage_of("pipeline"), [host])) == 1

        async with anyio.create_task_group() as tg:
            tg.start_soon(ex.submit, held, host)
            await checkpoints()
            for start in (partial(submit, "normal 1"), pipeline, partial(submit, "normal 2")):
                tg.start_soon(start)
                await checkpoints()
            tg.start_soon(submit, "high", "high")
            await checkpoints()
            assert order == ["held"] and ex.device_streams[0].chunks == 1
            gate.set()
    assert order[:2] == ["held", "high"]
    assert sorted(order[2:]) == ["normal 1", "normal 2", "pipeline"]


async def test_leaving_lets_submits_in_flight_finish_and_refuses_new_ones(
    backend: _driver.Driver, anyio_backend: Any
) -> None:
    """A lifespan leaves its executor while one submit runs (held in its stage) and one
    waits for room: new submits and maps are refused with ClosedError, both started ones
    finish with their results, and only then is the block left."""
    gate, leave, exited = anyio.Event(), anyio.Event(), anyio.Event()
    results: dict[str, Any] = {}
    hosts = {name: np.arange(64, dtype=np.float32) + i for i, name in enumerate(("running", "waiting", "new"))}

    async def held(ctx: ChunkContext, x: DeviceArray) -> None:
        await gate.wait()

    def plain(ctx: ChunkContext, x: DeviceArray) -> None:
        pass

    async def submit(ex: Executor, name: str, stage: Any) -> None:
        try:
            results[name] = await ex.submit(stage, hosts[name])
        except ClosedError as exc:
            results[name] = exc

    async with anyio.create_task_group() as tg:
        ex = await tg.start(partial(lifespan, leave, exited, chunks_per_device=1))
        tg.start_soon(submit, ex, "running", held)
        await checkpoints()
        tg.start_soon(submit, ex, "waiting", plain)
        await checkpoints()
        leave.set()
        await checkpoints()
        tg.start_soon(submit, ex, "new", plain)
        await checkpoints()
        assert not exited.is_set() and set(results) == {"new"}
        assert isinstance(results["new"], ClosedError) and "closing" in str(results["new"])
        with pytest.raises(ClosedError, match="closing"):
            ex.map(plain, [hosts["new"]])
        gate.set()
    assert exited.is_set()
    for name in ("running", "waiting"):
        np.testing.assert_array_equal(results[name], hosts[name])


async def test_leaving_lets_chunks_of_a_map_in_another_task_finish_and_refuses_its_next_inputs(
    backend: _driver.Driver, anyio_backend: Any
) -> None:
    """A lifespan leaves its executor while another task reads a map: chunks 0 and 1 are
    held in their stage, the feeder waits for room for chunk 2. The map admits nothing
    more; leaving waits for chunks 0 and 1, which finish on open streams (no closed
    stream's ArgumentError); the reader takes their results, then ClosedError; the
    device's memory and admission are idle again."""
    gate, leave, exited = anyio.Event(), anyio.Event(), anyio.Event()
    got: list[Any] = []
    inputs = chunks(6)
    baseline = used_bytes()

    async def held(ctx: ChunkContext, x: DeviceArray) -> None:
        await gate.wait()

    async with anyio.create_task_group() as tg:
        ex = await tg.start(partial(lifespan, leave, exited, chunks_per_device=2))
        tg.start_soon(read_map, ex, held, inputs, got)
        await checkpoints()
        assert ex.device_streams[0].chunks == 2  # (chunk 2 waits for room)
        leave.set()
        await checkpoints()
        assert not exited.is_set() and ex.device_streams[0].chunks == 2
        gate.set()
    assert exited.is_set()
    *results, end = got
    assert [r.index for r in results] == [0, 1]
    for r in results:
        np.testing.assert_array_equal(r.value, inputs[r.index])
    assert isinstance(end, ClosedError) and "closed while this map ran" in str(end)
    assert used_bytes() == baseline
    assert (ex.device_streams[0].chunks, ex.device_streams[0].reserved) == (0, 0)


async def test_leaving_does_not_wait_for_a_map_reader_that_stopped_reading(
    sim_backend: Any, anyio_backend: Any
) -> None:
    """A map's reader has stopped reading while its chunks are on the GPU (its download
    stream paused) and its feeder waits for room. Leaving waits for those chunks, not for
    the reader: once the stream resumes, the block is left with the device's memory and
    admission idle, the results waiting for the reader, who takes them later and then
    ClosedError."""
    reading, leave, exited = anyio.Event(), anyio.Event(), anyio.Event()
    got: list[Any] = []
    inputs = chunks(6, pinned=True)
    baseline = used_bytes()

    async with anyio.create_task_group() as tg:
        ex = await tg.start(partial(lifespan, leave, exited, chunks_per_device=2))
        d2h = ex.device_streams[0].d2h
        handle = d2h.handle
        sim_backend.pause(handle)
        tg.start_soon(read_map, ex, lambda ctx, x: None, inputs, got, reading)
        await checkpoints()
        assert ex.device_streams[0].chunks == 2  # (chunk 2 waits for room)
        leave.set()
        await checkpoints()
        assert not exited.is_set() and not d2h.closed
        sim_backend.resume(handle)
        with anyio.fail_after(30):  # (only the hang this prevents reaches it)
            await exited.wait()
        assert used_bytes() == baseline
        assert (ex.device_streams[0].chunks, ex.device_streams[0].reserved) == (0, 0)
        assert not got
        reading.set()
    *results, end = got
    assert [r.index for r in results] == [0, 1]
    for r in results:
        np.testing.assert_array_equal(r.value, inputs[r.index])
    assert isinstance(end, ClosedError)


async def test_leaving_cancelled_closes_at_once_under_a_running_map(sim_backend: Any, anyio_backend: Any) -> None:
    """Left cancelled, the executor does not wait for the chunks of a map that another
    task reads (on the GPU behind a paused stream): it closes its streams at once, and the
    map admits nothing more. Once the stream resumes, the map ends with ClosedError after
    its chunks' results, and their admission is given back."""
    got: list[Any] = []
    inputs = chunks(6, pinned=True)

    async with anyio.create_task_group() as tg:
        ex = Executor([0], chunks_per_device=2)
        with anyio.CancelScope() as scope:
            async with ex:
                d2h = ex.device_streams[0].d2h
                handle = d2h.handle
                sim_backend.pause(handle)
                tg.start_soon(read_map, ex, lambda ctx, x: None, inputs, got)
                await checkpoints()
                assert ex.device_streams[0].chunks == 2
                scope.cancel()
                await anyio.sleep_forever()
        assert scope.cancelled_caught and d2h.closed
        assert ex.device_streams[0].chunks == 2  # (not waited for)
        sim_backend.resume(handle)
    *results, end = got
    assert [r.index for r in results] == [0, 1]
    assert isinstance(end, ClosedError)
    assert (ex.device_streams[0].chunks, ex.device_streams[0].reserved) == (0, 0)


@pytest.mark.parametrize("other_loop", ["asyncio", "trio"])
async def test_a_submit_from_another_threads_loop_is_refused(
    sim_backend: Any, anyio_backend: Any, other_loop: str
) -> None:
    """An executor belongs to the loop that entered it: its admission's waits and wake-ups
    are that loop's. A submit from a loop in another thread raises at once -- here with
    the device full, where it waited for a wake-up that the executor's loop would send from
    the wrong thread -- and the executor serves its own loop on."""
    gate = anyio.Event()
    outcome: list[BaseException | np.ndarray] = []
    host = np.arange(8, dtype=np.float32)

    async def held(ctx: ChunkContext, x: DeviceArray) -> None:
        await gate.wait()

    async def submit_there(ex: Executor) -> None:
        with anyio.fail_after(30):  # (only the hang this prevents reaches it)
            try:
                outcome.append(await ex.submit(lambda ctx, x: None, host))
            except RuntimeError as exc:
                outcome.append(exc)

    async with Executor([0], chunks_per_device=1) as ex:
        async with anyio.create_task_group() as tg:
            tg.start_soon(ex.submit, held, host)
            await checkpoints()
            await anyio.to_thread.run_sync(lambda: anyio.run(submit_there, ex, backend=other_loop))
            gate.set()
        (error,) = outcome
        assert isinstance(error, RuntimeError) and "belongs to the event loop that entered it" in str(error)
        np.testing.assert_array_equal(await ex.submit(lambda ctx, x: None, host), host)
