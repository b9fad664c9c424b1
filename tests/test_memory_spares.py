"""Freed blocks a pool keeps for reuse on their streams (``aiocuda.memory``'s spares)."""

from __future__ import annotations

import gc
import os
import weakref
from collections import Counter
from typing import Any

import numpy as np
import pytest

import aiocuda.array as ga
from aiocuda import _driver, memory
from aiocuda.errors import OutOfMemoryError
from aiocuda.host import pinned_empty
from aiocuda.memory import MemoryPool
from aiocuda.stream import Stream

from ._control import forked_outcomes
from ._workload import trimmed

MiB = 1 << 20


def driver_calls(pool: MemoryPool) -> Counter[str]:
    """Count the pool's cuMemAllocFromPoolAsync and cuMemFreeAsync calls from now on."""
    calls: Counter[str] = Counter()
    alloc, free = pool._alloc_call, pool._free_call

    def counted_alloc(*args: Any) -> Any:
        calls["alloc"] += 1
        return alloc(*args)

    def counted_free(*args: Any) -> Any:
        calls["free"] += 1
        return free(*args)

    pool._alloc_call, pool._free_call = counted_alloc, counted_free
    return calls


async def test_a_block_freed_on_a_stream_serves_its_next_allocation_of_that_size(
    backend: _driver.Driver, anyio_backend: object
) -> None:
    pool = MemoryPool.create(0)
    calls = driver_calls(pool)
    with Stream(0) as s, Stream(0) as t:
        first = ga.empty(MiB // 4, np.float32, stream=s, pool=pool)
        ptr = first.buffer.ptr
        await first.copy_from(np.full(MiB // 4, 1, np.float32), stream=s)
        del first
        again = ga.empty(MiB // 4, np.float32, stream=s, pool=pool)
        assert again.buffer.ptr == ptr
        assert calls == {"alloc": 1}, "served without a driver call"
        await again.copy_from(np.full(MiB // 4, 2, np.float32), stream=s)
        assert (await again.to_host(stream=s) == 2).all()

        other_size = pool.allocate(2 * MiB, s)
        other_stream = pool.allocate(MiB, t)  # never a block freed on s: s may still use it
        assert calls == {"alloc": 3}
        assert pool.statistics().used_bytes == 4 * MiB
        for buffer in (again.buffer, other_size, other_stream):
            buffer.free()
        del again
        await s
        await t
        stats = pool.statistics()
        assert (stats.used_bytes, stats.live_buffers, calls["free"]) == (0, 0, 0)
        await trimmed(pool)
        assert pool.statistics().reserved_bytes == 0
        assert calls["free"] == 3, "trim gave every spare back to the driver"


async def test_spares_are_bounded_in_bytes_and_in_streams(
    backend: _driver.Driver, anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(memory, "SPARE_BYTES", 2 * MiB)
    monkeypatch.setattr(memory, "_SPARE_KEYS", 2)
    pool = MemoryPool.create(0)
    calls = driver_calls(pool)
    with Stream(0) as s:
        buffers = [pool.allocate(MiB, s) for _ in range(3)]
        for buffer in buffers:
            buffer.free()
        assert calls["free"] == 1, "the third MiB is over SPARE_BYTES: freed at once"
        kept = pool.allocate(MiB, s)  # one of the two kept
        pool.allocate(MiB // 2, s).free()  # a second (stream, size): two lists
        assert calls["free"] == 1
        pool.allocate(MiB // 4, s).free()  # a third list: the other two given back first
        assert calls["free"] == 1 + 2
        taken = pool.allocate(MiB // 4, s)  # its list is empty now
        pool.allocate(MiB // 8, s).free()  # a second list
        pool.allocate(MiB // 16, s).free()  # a third: the empty one is dropped, nothing freed
        assert calls["free"] == 3
        taken.free()
        await trimmed(pool)
        assert calls["free"] == 6
        kept.free()
        await s


async def test_blocks_freed_on_a_foreign_or_closed_stream_go_back_to_the_driver(
    backend: _driver.Driver, anyio_backend: object
) -> None:
    """A foreign stream may be destroyed by its owner at any time: nothing is kept for it.
    A closed stream takes no allocation: its spares are freed as it closes, after its
    work, and a block freed on it afterwards is freed at once."""
    pool = MemoryPool.create(0)
    calls = driver_calls(pool)
    with Stream(0) as owner:
        foreign = Stream.wrap(int(owner.__cuda_stream__()[1]))
        pool.allocate(MiB, foreign).free()
        assert calls["free"] == 1
    s = Stream(0)
    pool.allocate(MiB, s).free()
    late = pool.allocate(MiB // 2, s)
    s.close()
    assert calls["free"] == 2
    late.free()
    assert calls["free"] == 3
    assert pool._spare_bytes == 0
    await s
    await trimmed(pool)
    assert pool.statistics().reserved_bytes == 0


async def test_closing_a_stream_gives_its_spares_back_for_other_streams_to_keep(
    backend: _driver.Driver, anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A closed stream's spares stayed in its pool until the next trim: no allocation
    could take them (none is made on a closed stream), yet they counted against
    SPARE_BYTES, so the frees of the streams made after it went to the driver."""
    monkeypatch.setattr(memory, "SPARE_BYTES", 2 * MiB)
    pool = MemoryPool.create(0)
    calls = driver_calls(pool)
    with Stream(0) as t:
        pool.allocate(MiB // 2, t).free()
        s = Stream(0)
        for size in (MiB // 2, MiB):  # two lists of s
            pool.allocate(size, s).free()
        assert (pool._spare_bytes, calls["free"]) == (2 * MiB, 0)
        s.close()
        assert (pool._spare_bytes, calls["free"]) == (MiB // 2, 2), "s's spares freed, t's kept"
        assert all(stream is not s for stream, _ in pool._spares)
        await s
        assert pool.statistics().used_bytes == 0
        with Stream(0) as u:
            for size in (MiB, MiB // 2):
                pool.allocate(size, u).free()
            assert (pool._spare_bytes, calls["free"]) == (2 * MiB, 2), "u keeps what s had"
            kept = pool.allocate(MiB // 2, t)
            assert calls["alloc"] == 5, "t's spare still serves t"
            kept.free()
            await u
        await t
    await trimmed(pool)
    assert pool.statistics().reserved_bytes == 0


async def test_a_closed_streams_spares_are_freed_on_it_after_its_work(
    sim_backend: _driver.Driver, anyio_backend: object
) -> None:
    """Stream order keeps the memory from other streams until the work enqueued on the
    stream before it closed has run; closing waits for none of it."""
    pool = MemoryPool.create(0)
    freed_on: list[Any] = []
    free = pool._free_call

    def spied(ptr: Any, handle: Any) -> Any:
        freed_on.append(handle)
        return free(ptr, handle)

    pool._free_call = spied
    s = Stream(0)
    handle = s.handle
    pool.allocate(MiB, s).free()
    sim_backend.pause(handle)  # type: ignore[attr-defined]
    sim_backend.enqueue(handle, lambda: None)  # work that has not run
    s.close()  # returns at once: nothing waits for the paused stream
    assert freed_on == [handle]
    assert (pool._spare_bytes, pool.statistics().used_bytes) == (0, MiB), "the free waits for the work"
    sim_backend.resume(handle)  # type: ignore[attr-defined]
    await s
    assert pool.statistics().used_bytes == 0
    await trimmed(pool)
    assert pool.statistics().reserved_bytes == 0


def test_a_stream_closed_inside_a_capture_gives_its_spares_back_once_it_ends(sim_backend: _driver.Driver) -> None:
    """A stream joined to a capture and closed inside the block is closed for good when
    the capture ends: its spares are freed then, on it, and never into the graph."""
    pool = MemoryPool.create(0)
    calls = driver_calls(pool)
    with Stream(0) as s:
        side = Stream(0)
        pool.allocate(MiB, side).free()
        with s.capture() as graph:
            side.wait(s)  # joins the capture
            side.close()
            assert (pool._spare_bytes, calls["free"]) == (MiB, 0)
        assert side.closed
        assert (pool._spare_bytes, calls["free"]) == (0, 1)
        graph.close()
        side.synchronize()
        s.synchronize()


@pytest.mark.parametrize("mode", ["global", "thread_local", "relaxed"])
async def test_a_stream_closed_while_another_captures_gives_its_spares_back_and_the_capture_holds(
    backend: _driver.Driver, anyio_backend: object, mode: Any
) -> None:
    """The close's stream-ordered frees are not among the calls a capture forbids to the
    other streams of its thread (allocating or freeing page-locked memory, loading
    modules): the spares are freed and the capture stays valid, in every mode."""
    pool = MemoryPool.create(0)
    calls = driver_calls(pool)
    host_in = pinned_empty(MiB // 4, np.float32)
    host_out = pinned_empty(MiB // 4, np.float32)
    with Stream(0) as s:
        x = ga.empty(MiB // 4, np.float32, stream=s)
        other = Stream(0)
        pool.allocate(MiB, other).free()
        async with s.capture(mode) as graph:
            await x.copy_from(host_in, stream=s)
            other.close()
            await x.to_host(out=host_out, stream=s)
        assert (pool._spare_bytes, calls["free"]) == (0, 1)
        host_in[:] = 3
        await graph.launch(s)
        assert (host_out == 3).all()
        graph.close()
        await other
    await trimmed(pool)
    assert pool.statistics().reserved_bytes == 0


class _TrimmedMeanwhile(dict[Any, list[Any]]):
    """A pool's spares whose first pop, by a stream's close, lets another thread's
    give-back of every spare (a trim) run between the close's look at the keys and its
    take of the list."""

    def __init__(self, pool: MemoryPool) -> None:
        super().__init__(pool._spares)
        self.pool: MemoryPool | None = pool

    def pop(self, key: Any, default: Any = None) -> Any:
        pool, self.pool = self.pool, None
        if pool is not None:
            pool._give_back_spares()
        return super().pop(key, default)


def test_a_spare_given_back_by_a_trim_meanwhile_is_not_freed_again_by_its_streams_close(
    sim_backend: _driver.Driver,
) -> None:
    pool = MemoryPool.create(0)
    calls = driver_calls(pool)
    s = Stream(0)
    for buffer in [pool.allocate(size, s) for size in (MiB, MiB, MiB // 2)]:
        buffer.free()
    assert pool._spare_bytes == 2 * MiB + MiB // 2
    pool._spares = _TrimmedMeanwhile(pool)
    s.close()
    assert (calls["free"], pool._spare_bytes) == (3, 0), "each block freed once"
    stats = pool.statistics()
    assert (stats.allocations, stats.frees, stats.live_buffers) == (3, 3, 0)
    s.synchronize()


def test_a_stream_dropped_with_spares_lives_until_they_are_given_back(backend: _driver.Driver) -> None:
    """The pool keeps the stream (its spares' key) and frees them on it; then it is
    collected as any other."""
    pool = MemoryPool.create(0)
    s = Stream(0)
    pool.allocate(MiB, s).free()
    dropped = weakref.ref(s)
    del s
    gc.collect()
    assert dropped() is not None
    pool.trim()
    gc.collect()
    assert dropped() is None
    assert pool._spare_bytes == 0


async def test_trimming_never_queries_a_foreign_stream(
    backend: _driver.Driver, anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its owner may have destroyed it since the free: a query of its handle would be
    undefined behaviour. Its free is given back all the same."""
    pool = MemoryPool.create(0)
    queried: list[Any] = []
    query = backend.stream_query

    def spied(handle: Any) -> bool:
        queried.append(handle)
        return query(handle)

    monkeypatch.setattr(backend, "stream_query", spied)
    with Stream(0) as owner:
        foreign = Stream.wrap(int(owner.__cuda_stream__()[1]))
        pool.allocate(MiB, foreign).free()
        handle = foreign.handle
    await trimmed(pool)
    assert all(q is not handle for q in queried)
    assert pool.statistics().reserved_bytes == 0


async def test_a_pool_shared_with_other_processes_keeps_no_spares(
    sim_backend: _driver.Driver, anyio_backend: object
) -> None:
    """The driver reuses an exported block only once every importer has let it go."""
    pool = MemoryPool.create(0, ipc=True)
    calls = driver_calls(pool)
    with Stream(0) as s:
        pool.allocate(MiB, s).free()
        pool.allocate(MiB, s).free()
        assert calls == {"alloc": 2, "free": 2}
        await s


async def test_out_of_memory_on_another_stream_takes_a_spare_whose_stream_is_idle(
    sim_backend: _driver.Driver, anyio_backend: object
) -> None:
    """The spare of an idle stream is freed onto the allocating stream, which reuses it
    at once; one of a stream with work still queued cannot be, and the pool is full."""
    pool = MemoryPool.create(0, max_size=MiB)
    with Stream(0) as s, Stream(0) as t:
        pool.allocate(MiB, s).free()
        await s
        pool.allocate(MiB, t).free()  # s is idle: its spare serves t
        sim_backend.pause(t.handle)  # type: ignore[attr-defined]
        sim_backend.enqueue(t.handle, lambda: None)  # t now has work that has not run
        with pytest.raises(OutOfMemoryError):
            pool.allocate(MiB, s)
        sim_backend.resume(t.handle)  # type: ignore[attr-defined]
        await t
        pool.allocate(MiB, s).free()
        await s


class _GivenBackMeanwhile(dict[Any, list[Any]]):
    """A pool's spares whose first lookup lets another thread's give-back (a trim, an
    out-of-memory recovery) run between the allocation's lookup and its take."""

    def __init__(self, pool: MemoryPool) -> None:
        super().__init__(pool._spares)
        self.pool: MemoryPool | None = pool

    def get(self, key: Any, default: Any = None) -> Any:
        pool, self.pool = self.pool, None
        if pool is not None:
            pool._give_back_spares()
        return super().get(key, default)


def test_a_spare_given_back_meanwhile_is_never_also_handed_out(sim_backend: _driver.Driver) -> None:
    """A give-back freed each spare to the driver and left it in its list, where an
    allocation that had found the list took it as well: two live buffers over one block
    (the driver hands the freed block to the next allocation on that stream), and the
    spare bytes went negative."""
    pool = MemoryPool.create(0)
    with Stream(0) as s:
        pool.allocate(MiB, s).free()
        assert pool._spare_bytes == MiB
        pool._spares = _GivenBackMeanwhile(pool)
        first = pool.allocate(MiB, s)
        second = pool.allocate(MiB, s)
        assert first.ptr != second.ptr, "one block handed out twice"
        assert pool._spare_bytes == 0
        stats = pool.statistics()
        assert (stats.allocations, stats.frees, stats.live_buffers) == (3, 1, 2)
        first.free()
        second.free()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_never_takes_its_parents_spares(backend: _driver.Driver) -> None:
    """A spare is the parent's memory, handed out without a driver call: a forked child
    got a buffer over it instead of asking the driver, which gives the clear fork error
    (the simulator's allocation itself does not check for fork: there it allocates)."""
    pool = MemoryPool.create(0)
    with Stream(0) as s:
        pool.allocate(MiB, s).free()
        assert pool._spare_bytes == MiB
        calls = driver_calls(pool)

        def allocate() -> str:
            pool.allocate(MiB, s)
            return f"allocated; driver calls {dict(calls)}"

        [message] = forked_outcomes(allocate)
        assert "forked" in message or message == "allocated; driver calls {'alloc': 1}", message
        assert pool._spare_bytes == MiB  # the parent keeps its spares
