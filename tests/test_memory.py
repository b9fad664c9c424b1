"""Memory pools and device buffers: allocation, statistics, lifetime, out of memory."""

from __future__ import annotations

import dataclasses
import gc
import threading
import weakref

import anyio
import numpy as np
import pytest

import aiocuda
from aiocuda import _driver, memory
from aiocuda._memory import copies
from aiocuda._memory import offloop as _offloop
from aiocuda.device import Device
from aiocuda.errors import ArgumentError, OutOfMemoryError
from aiocuda.host import pinned_empty
from aiocuda.memory import DEFAULT_RELEASE_THRESHOLD, MemoryPool, PoolStatistics
from aiocuda.stream import Stream, current_stream

from ._workload import observed, slow_op, trimmed

pytestmark = pytest.mark.anyio

MiB = 1 << 20


async def test_allocate_free_and_statistics(backend: _driver.Driver, anyio_backend: object) -> None:
    pool = MemoryPool.for_device(0)
    with Stream(0) as s:
        await s
        before = pool.statistics()
        buf = pool.allocate(MiB, s)
        assert buf.ptr != 0 and buf.size == MiB and buf.device.ordinal == 0 and buf.stream is s
        during = pool.statistics()
        assert during.used_bytes >= before.used_bytes + MiB
        buf.free()
        buf.free()  # idempotent
        await s
        after = pool.statistics()
        assert after.used_bytes == before.used_bytes
        assert after.used_bytes_peak >= before.used_bytes + MiB
        assert after.reserved_bytes >= after.used_bytes
        assert after.release_threshold > 0


async def test_dropping_the_last_reference_frees_stream_ordered(backend: _driver.Driver, anyio_backend: object) -> None:
    pool = MemoryPool.for_device(0)
    gc.collect()  # buffers left by earlier tests are freed now, not inside the count
    await current_stream(0)  # where buffers of closed streams are freed
    with Stream(0) as s:
        await s
        before = pool.statistics()
        for _ in range(50):
            pool.allocate(64 * 1024, s)  # dropped at once
        with pool.allocate(4096, s):
            pass
        gc.collect()
        await s
        assert pool.statistics().used_bytes == before.used_bytes


async def test_statistics_is_a_frozen_dataclass(backend: _driver.Driver, anyio_backend: object) -> None:
    stats = MemoryPool.for_device(0).statistics()
    assert isinstance(stats, PoolStatistics)
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.used_bytes = 1  # type: ignore[misc]


async def test_bad_sizes_and_freed_buffers_raise_typed_errors(backend: _driver.Driver, anyio_backend: object) -> None:
    pool = MemoryPool.for_device(0)
    with Stream(0) as s:
        with pytest.raises(ArgumentError, match="negative"):
            pool.allocate(-1, s)
        for size in (1.5, 2.0, "8", None, True):
            with pytest.raises(ArgumentError, match="must be an integer"):
                pool.allocate(size, s)  # type: ignore[arg-type]
        for size in (2**64, 2**70):
            with pytest.raises(ArgumentError, match="64-bit"):
                pool.allocate(size, s)
        for stream in (s.handle, 0, "s"):  # (an AttributeError of the stream's slots before)
            with pytest.raises(TypeError, match="stream must be an aiocuda Stream"):
                pool.allocate(256, stream)  # type: ignore[arg-type]
        with pytest.raises(ArgumentError, match="negative"):
            pool.trim(-1)
        with pytest.raises(ArgumentError, match="non-negative int"):
            pool.trim(0.5)  # type: ignore[arg-type]
        with pool.allocate(np.int64(256), s) as buf:  # type: ignore[arg-type] # numpy integers are sizes too
            assert buf.size == 256 and type(buf.size) is int
        empty = pool.allocate(0, s)
        assert empty.ptr == 0 and empty.size == 0
        buf = pool.allocate(256, s)
        buf.free()
        assert buf.freed
        with pytest.raises(ArgumentError, match="freed"):
            _ = buf.ptr
        with pytest.raises(ArgumentError):
            MemoryPool.create(0, max_size=-5)
        await s


@pytest.mark.parametrize("value", [True, 1.5, "8", None, -1, 2**64])
def test_pool_byte_counts_must_be_non_negative_ints(backend: _driver.Driver, value: object) -> None:
    """A pool's limit, release threshold and trim target go to the driver as a size_t: a
    bool, a float (truncated), a string or a size beyond 64 bits was taken as given, or
    failed with an untyped TypeError."""
    pool = MemoryPool.create(0)
    with pytest.raises(ArgumentError, match="max_size must be a non-negative int"):
        MemoryPool.create(0, max_size=value)  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="release_threshold must be a non-negative int"):
        pool.release_threshold = value  # type: ignore[assignment]
    with pytest.raises(ArgumentError, match="keep_bytes must be a non-negative int"):
        pool.trim(value)  # type: ignore[arg-type]
    assert pool.release_threshold == DEFAULT_RELEASE_THRESHOLD


def test_pool_byte_counts_take_numpy_integers(backend: _driver.Driver) -> None:
    pool = MemoryPool.create(0, max_size=np.int64(64 * MiB))  # type: ignore[arg-type]
    assert pool.max_size == 64 * MiB and type(pool.max_size) is int
    pool.release_threshold = np.uint32(MiB)  # type: ignore[assignment]
    assert pool.release_threshold == MiB
    pool.trim(np.int64(0))  # type: ignore[arg-type]


async def test_release_threshold_and_trim(backend: _driver.Driver, anyio_backend: object) -> None:
    pool = MemoryPool.create(0)
    assert pool.release_threshold == DEFAULT_RELEASE_THRESHOLD
    pool.release_threshold = 32 * MiB
    assert pool.release_threshold == 32 * MiB
    with Stream(0) as s:
        pool.allocate(8 * MiB, s).free()
        await s
        assert pool.statistics().reserved_bytes >= 8 * MiB
        await observed(s)
        await trimmed(pool)
        assert pool.statistics().reserved_bytes == 0
        pool.reset_peaks()
        assert pool.statistics().used_bytes_peak == 0


async def test_out_of_memory_trims_cache_then_raises_clearly(backend: _driver.Driver, anyio_backend: object) -> None:
    limit = 256 * MiB
    pool = MemoryPool.create(0, max_size=limit)
    with Stream(0) as s:
        pool.allocate(160 * MiB, s).free()
        await s
        await observed(s)
        second = pool.allocate(128 * MiB, s)  # needs the cached 160 MiB trimmed (sim) or reused
        if backend.name == "sim":
            assert pool.statistics().out_of_memory_recoveries == 1
        with pytest.raises(OutOfMemoryError) as info:
            pool.allocate(200 * MiB, s)
        message = str(info.value)
        assert "asked for 200.0 MiB" in message
        assert "in use" in message and "free" in message and "limit 256.0 MiB" in message
        assert isinstance(info.value, MemoryError) and info.value.name == "CUDA_ERROR_OUT_OF_MEMORY"
        second.free()
        await s
        await observed(s)
        third = pool.allocate(200 * MiB, s)  # the pool is still usable
        third.free()
        await s


async def test_allocate_wait_applies_back_pressure(backend: _driver.Driver, anyio_backend: object) -> None:
    pool = MemoryPool.create(0, max_size=64 * MiB)
    with Stream(0) as s:
        hog = pool.allocate(48 * MiB, s)
        with pytest.raises(OutOfMemoryError):
            await pool.allocate_wait(48 * MiB, s, timeout=0.05)

        freed = False

        async def free_later() -> None:
            nonlocal freed
            await anyio.sleep(0.05)
            freed = True
            hog.free()

        async with anyio.create_task_group() as tg:
            tg.start_soon(free_later)
            got = await pool.allocate_wait(48 * MiB, s, timeout=5)
            assert freed, "allocate_wait returned memory that was still in use"
        got.free()
        await s


async def test_allocate_wait_is_cancellable(backend: _driver.Driver, anyio_backend: object) -> None:
    pool = MemoryPool.create(0, max_size=64 * MiB)
    with Stream(0) as s:
        hog = pool.allocate(48 * MiB, s)
        with anyio.move_on_after(0.05) as scope:
            await pool.allocate_wait(48 * MiB, s)
        assert scope.cancelled_caught
        hog.free()
        await s


async def test_free_waits_for_work_on_every_stream_that_used_it(
    sim_backend: _driver.Driver, anyio_backend: object
) -> None:
    pool = MemoryPool.for_device(0)
    a, b = Stream(0), Stream(0)
    await a
    before = pool.statistics().used_bytes
    buf = pool.allocate(MiB, a)
    sim_backend.pause(a.handle)  # type: ignore[attr-defined]
    slow_op(a, 0.0)  # queued behind the pause: "work on a" that uses buf
    buf._used_on(b)
    buf.free()  # enqueued on b, which must wait for a
    await anyio.sleep(0.05)
    assert pool.statistics().used_bytes == before + MiB
    sim_backend.resume(a.handle)  # type: ignore[attr-defined]
    await a
    await b
    assert pool.statistics().used_bytes == before
    a.close()
    b.close()


@pytest.mark.multi_gpu
async def test_pool_per_device_and_peer_access(backend: _driver.Driver, anyio_backend: object) -> None:
    p0, p1 = MemoryPool.for_device(0), MemoryPool.for_device(1)
    assert p0 is not p1 and p0.device.ordinal == 0 and p1.device.ordinal == 1
    assert MemoryPool.for_device(0) is p0
    if p1.device.can_access_peer(p0.device):
        p0.grant_access(1)
    else:
        with pytest.raises(ArgumentError):
            p0.grant_access(1)


async def test_set_for_device_switches_the_pool(backend: _driver.Driver, anyio_backend: object) -> None:
    custom = MemoryPool.create(0)
    MemoryPool.set_for_device(custom)
    try:
        assert MemoryPool.for_device(0) is custom
    finally:
        MemoryPool.set_for_device(MemoryPool.default(0))
    assert MemoryPool.for_device(0) is MemoryPool.default(0)
    assert "MemoryPool" in repr(custom)


@pytest.mark.multi_gpu
async def test_enable_peer_access_checks_with_a_real_copy(backend: _driver.Driver, anyio_backend: object) -> None:
    from aiocuda.device import Device
    from aiocuda.peer import enable_peer_access

    assert await enable_peer_access(0, 0) is False
    allowed = Device(0).can_access_peer(Device(1))
    assert await enable_peer_access(0, 1) is allowed
    assert await enable_peer_access(0, 1) is allowed  # idempotent


async def test_buffer_outliving_its_closed_stream_is_still_freed(
    backend: _driver.Driver, anyio_backend: object
) -> None:
    pool = MemoryPool.create(0)  # used by this test alone
    s = Stream(0)
    await s
    buf = pool.allocate(MiB, s)
    await s
    s.close()
    del buf  # freed on the device's default stream instead
    gc.collect()
    await observed(current_stream(0))
    assert pool.statistics().used_bytes == 0


async def test_a_buffer_freed_after_its_stream_closed_waits_for_that_streams_work(
    sim_backend: _driver.Driver, anyio_backend: object
) -> None:
    # (An executor closed while a map still ran: the chunks' frees came after their
    # streams closed, and went ahead of downloads queued there.)
    s = Stream(0)
    x = await aiocuda.to_device(np.arange(1000, dtype=np.float32), stream=s)
    out = pinned_empty(1000, np.float32)
    sim_backend.set_latency("memcpy_dtoh_async", 0.05)  # type: ignore[attr-defined]
    copies.download(out, x.ptr, s)  # still running when the buffer is freed
    x.buffer._used_on(s)
    s.close()
    del x  # freed on the device's stream: after s's download, not during it
    gc.collect()
    await s
    await current_stream(0)
    np.testing.assert_array_equal(out, np.arange(1000, dtype=np.float32))


async def test_injected_out_of_memory_is_retried_once(sim_backend: _driver.Driver, anyio_backend: object) -> None:
    from aiocuda.errors import ResultCode

    pool = MemoryPool.create(0)
    with Stream(0) as s:
        sim_backend.inject_fault(ResultCode.OUT_OF_MEMORY, at_call=1, call="mem_alloc_async")  # type: ignore[attr-defined]
        buf = pool.allocate(MiB, s)  # first attempt fails, the retry after trimming succeeds
        assert pool.statistics().out_of_memory_recoveries == 1
        buf.free()
        pool.trim(0)  # its block back to the driver, not kept for the next allocation
        for at_call in (1, 2):
            sim_backend.inject_fault(ResultCode.OUT_OF_MEMORY, at_call=at_call, call="mem_alloc_async")  # type: ignore[attr-defined]
        with pytest.raises(OutOfMemoryError, match=r"asked for 1\.0 MiB"):
            pool.allocate(MiB, s)
        pool.allocate(MiB, s).free()  # usable afterwards
        await s


async def test_random_churn_leaks_nothing(backend: _driver.Driver, anyio_backend: object) -> None:
    import random

    import numpy as np

    import aiocuda.array as ga

    rng = random.Random(11)
    pool = MemoryPool.for_device(0)
    host = np.arange(64 * 1024, dtype=np.uint8)
    with Stream(0) as s:
        gc.collect()
        await s
        await observed(s)
        before = pool.statistics().used_bytes
        live = []
        for _ in range(400):
            roll = rng.random()
            if roll < 0.45 or not live:
                live.append(pool.allocate(rng.randint(1, 2 * MiB), s))
            elif roll < 0.8:
                victim = live.pop(rng.randrange(len(live)))
                if rng.random() < 0.5:
                    victim.free()
                del victim
            else:
                with anyio.CancelScope() as scope:
                    scope.cancel()
                    await ga.to_device(host[: rng.randint(1, host.size)], stream=s)
        live.clear()
        gc.collect()
        await s
        await observed(s)
        assert pool.statistics().used_bytes == before


async def test_sim_reuses_memory_freed_on_the_same_stream_at_once(
    sim_backend: _driver.Driver, anyio_backend: object
) -> None:
    """As the driver does: stream order puts the new allocation's work after the free."""
    pool = MemoryPool.create(0, max_size=MiB)
    a, b = Stream(0), Stream(0)
    await a
    sim_backend.pause(a.handle)  # type: ignore[attr-defined]
    sim_backend.enqueue(a.handle, lambda: None)  # work that has not run (a kernel still queued)
    first = pool.allocate(MiB, a)
    ptr = first.ptr
    first.free()  # behind that work
    with pytest.raises(OutOfMemoryError):
        pool.allocate(MiB, b)  # another stream must wait for the free to run
    again = pool.allocate(MiB, a)
    assert again.ptr == ptr
    again.free()
    sim_backend.resume(a.handle)  # type: ignore[attr-defined]
    await a
    assert pool.statistics().used_bytes == 0
    pool.allocate(MiB, b).free()
    await b
    a.close()
    b.close()


async def test_allocate_wait_wakes_up_when_a_buffer_is_freed(
    backend: _driver.Driver, anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A free on the waiter's loop retries at once, whatever the back-off has grown to."""
    from aiocuda import memory

    monkeypatch.setattr(memory, "_RETRY_FIRST", 30.0)
    monkeypatch.setattr(memory, "_RETRY_MAX", 30.0)
    pool = MemoryPool.create(0, max_size=64 * MiB)
    with Stream(0) as s:
        hog = pool.allocate(48 * MiB, s)
        got: list[object] = []

        async def wait_for_memory() -> None:
            got.append(await pool.allocate_wait(48 * MiB, s, timeout=60))

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(wait_for_memory)
                await anyio.sleep(0.05)
                assert not got
                hog.free()  # same stream: the memory is reusable at once
        got.clear()
        await s


def test_statistics_count_allocations_and_frees(backend: _driver.Driver) -> None:
    pool = MemoryPool.create(0)
    with Stream(0) as s:
        kept = pool.allocate(4096, s)
        for _ in range(3):
            pool.allocate(1024, s).free()
        dropped = pool.allocate(2048, s)
        del dropped  # freed by collection
        pool.allocate(0, s)  # empty: no memory, not counted
        stats = pool.statistics()
        assert (stats.allocations, stats.frees, stats.live_buffers) == (5, 4, 1)
        assert "live_buffers=1" in repr(pool)
        kept.free()
        s.synchronize()


async def _offloop_done() -> None:
    """Wait, off the loop, for what the off-loop thread has queued (a trim's settling)."""
    assert await anyio.to_thread.run_sync(_offloop.drain, 60)


async def test_the_driver_trims_only_frees_the_host_has_observed(
    backend: _driver.Driver, anyio_backend: object
) -> None:
    """The driver's own rule, which the simulated backend models: after a free has run
    (and was awaited), ``cuMemPoolTrimTo`` keeps its memory until a synchronisation of
    the freeing stream lets the host observe it."""
    pool = MemoryPool.create(0)
    with Stream(0) as s:
        backend.mem_free_async(backend.mem_alloc_async(8 * MiB, pool.handle, s.handle), s.handle)
        await s
        backend.mempool_trim_to(pool.handle, 0)
        assert pool.statistics().reserved_bytes >= 8 * MiB, "the driver gave back a free it had not observed"
        backend.stream_synchronize(s.handle)
        backend.mempool_trim_to(pool.handle, 0)
        assert pool.statistics().reserved_bytes == 0


async def test_trim_gives_back_memory_whose_free_was_awaited(backend: _driver.Driver, anyio_backend: object) -> None:
    pool = MemoryPool.create(0)
    with Stream(0) as s, Stream(0) as t:
        pool.allocate(8 * MiB, s).free()
        pool.allocate(4 * MiB, t).free()
        await s
        await t
        await trimmed(pool)
        assert pool.statistics().reserved_bytes == 0
        pool.allocate(2 * MiB, s).free()
        await s
        await trimmed(pool, MiB)  # keeps at least 1 MiB: the block holding the 2 MiB stays
        assert pool.statistics().reserved_bytes >= MiB
        await trimmed(pool)
        assert pool.statistics().reserved_bytes == 0


async def test_trim_never_waits_for_a_busy_stream_and_gives_back_later(
    backend: _driver.Driver, anyio_backend: object
) -> None:
    """A free still queued behind work (a paused simulated stream, a 1 s kernel on a GPU)
    is given back once that work is done, by the off-loop thread; trim returns at once."""
    pool = MemoryPool.create(0)
    with Stream(0) as s:
        await s
        if backend.name == "sim":
            backend.pause(s.handle)  # type: ignore[attr-defined]
        else:
            slow_op(s, 1.0)
        pool.allocate(8 * MiB, s).free()
        pool.trim(0)  # the loop's thread: returns without waiting for the stream
        assert not s.query()
        assert pool.statistics().reserved_bytes >= 8 * MiB  # the free has not run
        if backend.name == "sim":
            backend.resume(s.handle)  # type: ignore[attr-defined]
        await s
        await _offloop_done()
        assert pool.statistics().reserved_bytes == 0


async def test_trim_gives_back_frees_of_a_closed_stream(backend: _driver.Driver, anyio_backend: object) -> None:
    pool = MemoryPool.create(0)
    with Stream(0) as s:
        pool.allocate(8 * MiB, s).free()
        await s
    pool.trim(0)
    await _offloop_done()
    assert pool.statistics().reserved_bytes == 0


async def test_trim_gives_back_frees_of_a_collected_stream(backend: _driver.Driver, anyio_backend: object) -> None:
    pool = MemoryPool.create(0)
    s = Stream(0)
    pool.allocate(8 * MiB, s).free()
    await s
    del s
    gc.collect()
    pool.trim(0)
    await _offloop_done()
    assert pool.statistics().reserved_bytes == 0


async def test_out_of_memory_in_one_pool_trims_the_devices_other_pools(
    backend: _driver.Driver, anyio_backend: object
) -> None:
    """Memory freed into one pool's cache is given to another pool that runs out."""
    if backend.name == "sim":
        _driver.use_backend("sim", devices=1, total_memory=1 << 30)
    device = Device(0)
    free, _ = device.memory_info()
    big = int(free * 0.6) // MiB * MiB
    first, second = MemoryPool.create(0), MemoryPool.create(0)
    with Stream(0) as s:
        first.allocate(big, s).free()
        await s  # freed into the first pool's cache, which keeps it (no release threshold)
        assert first.statistics().reserved_bytes >= big
        buffer = second.allocate(big, s)  # would not fit beside the first pool's cache
        assert second.statistics().out_of_memory_recoveries == 1
        assert first.statistics().reserved_bytes < big
        buffer.free()
        await s
        second.trim(0)


def test_the_off_loop_thread_lets_go_of_what_a_call_kept(sim_backend: _driver.Driver) -> None:
    """Objects a disposal keeps alive go once it ran, not when the next call comes (an
    IPC export's buffer is let go this way, and nothing else may follow for a while)."""

    class Kept:
        pass

    kept = Kept()
    gone = threading.Event()
    weakref.finalize(kept, gone.set)
    _offloop.dispose(Device(0), lambda: None, keep=kept)
    del kept
    assert gone.wait(30), "the off-loop thread still holds what its last call kept"


async def test_a_buffer_collected_in_one_cycle_with_its_stream_is_freed(
    backend: _driver.Driver, anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cyclic garbage collection runs weakref callbacks (the stream's finaliser, which
    destroys it) before ``__del__`` methods (the buffer's free, on that stream): the free
    must not meet a destroyed stream (on the real driver a SIGSEGV in cuMemFreeAsync)."""
    pool = MemoryPool.create(0)
    # Only this pool's frees count: a collection here may also finalise a buffer an
    # earlier test left in a cycle, whose simulated driver is shut down by now (its
    # finaliser swallows that error too, into memory._last_finaliser_error).
    errors: list[BaseException] = []
    free = memory.DeviceBuffer.free

    def recorded_free(buffer: memory.DeviceBuffer, stream: Stream | None = None) -> None:
        try:
            free(buffer, stream)
        except Exception as exc:
            if buffer._pool is pool:
                errors.append(exc)
            raise

    monkeypatch.setattr(memory.DeviceBuffer, "free", recorded_free)

    class Holder:
        pass

    for _ in range(4):
        holder = Holder()
        holder.stream = Stream(0)  # type: ignore[attr-defined]
        holder.buffer = pool.allocate(MiB, holder.stream)  # type: ignore[attr-defined]
        holder.me = holder  # type: ignore[attr-defined]  # a cycle: only the collector frees it
        del holder
        gc.collect()
    with Stream(0) as s:
        await s
    assert pool.statistics().used_bytes == 0
    assert errors == []


async def test_a_trim_settled_while_a_stream_of_the_device_captures_leaves_the_capture_valid(
    backend: _driver.Driver, anyio_backend: object
) -> None:
    """A trim hands frees on busy streams to the off-loop thread, which synchronised the
    whole context: while a stream of it captures, the driver refuses that and invalidates
    the capture. The settling is left to the next trim instead."""
    pool = MemoryPool.default(0)
    held = threading.Event()
    with Stream(0) as busy, Stream(0) as capturing:
        _offloop.submit(held.wait, 10.0)  # the off-loop thread reaches the settling in the capture
        buf = pool.allocate(1 << 20, stream=busy)
        slow_op(busy, 0.05)
        buf.free()
        pool.trim()  # the free is on a busy stream: settled off the loop
        with capturing.capture() as graph:  # (ends with CaptureError if it was invalidated)
            held.set()
            assert _offloop.drain(10.0)
        await graph.launch(capturing)
        await busy
