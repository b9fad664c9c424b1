"""Staged copies of pageable memory through the copier threads: data, slot reuse,
cancellation, errors, and several devices, streams and copies at once."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest

import aiocuda.array as ga
from aiocuda import _driver
from aiocuda._memory import offloop as _offloop
from aiocuda._memory import staging as _staging
from aiocuda._memory.copiers import Slot
from aiocuda.errors import ArgumentError, OutOfMemoryError, ResultCode
from aiocuda.host import is_pinned, pinned_empty
from aiocuda.stream import Stream

pytestmark = pytest.mark.anyio

rng = np.random.default_rng(99)

CHUNK = 256 * 1024
THREADS = 2
SLOTS = THREADS * 2


@pytest.fixture
def small_staging(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Small chunks and slots (fast tests of the copier pipelines): two threads with two
    slots each, built afresh from these knobs and dropped afterwards."""
    _staging.reset()
    monkeypatch.setattr(_staging, "CHUNK", CHUNK)
    monkeypatch.setattr(_staging, "MIN_CHUNK", 64 * 1024)
    monkeypatch.setattr(_staging, "COPY_THREADS", THREADS)
    monkeypatch.setattr(_staging, "SLOTS_PER_THREAD", 2)
    monkeypatch.setattr(_staging, "INLINE_LIMIT", 64 * 1024)
    monkeypatch.setattr(_staging, "INLINE_SLOTS", 2)
    yield
    _staging.reset()


def _digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def _random_bytes(n: int) -> np.ndarray:
    return rng.integers(0, 256, n, dtype=np.uint8)


@pytest.mark.parametrize("nbytes", [64 * 1024 + 1, CHUNK - 1, CHUNK, CHUNK + 1, 7 * CHUNK + 12345])
async def test_round_trips_around_chunk_boundaries(
    backend: _driver.Driver, anyio_backend: object, small_staging: None, nbytes: int
) -> None:
    host = _random_bytes(nbytes)
    with Stream(0) as s:
        dev = await ga.to_device(host, stream=s)
        assert _digest(await dev.to_host(stream=s)) == _digest(host)
        out = np.zeros(nbytes, np.uint8)
        await dev.to_host(out=out, stream=s)
        assert _digest(out) == _digest(host)


async def test_large_pageable_and_pinned_round_trips(
    backend: _driver.Driver, anyio_backend: object, small_staging: None
) -> None:
    nbytes = 2 * CHUNK + 12345
    host = _random_bytes(nbytes)
    with Stream(0) as s:
        dev = await ga.to_device(host, stream=s)
        back = await dev.to_host(stream=s)
        assert _digest(back) == _digest(host)
        pinned = pinned_empty(nbytes, np.uint8)
        assert is_pinned(pinned) and not is_pinned(host)
        await dev.to_host(out=pinned, stream=s)
        assert _digest(pinned) == _digest(host)
        dev2 = await ga.to_device(pinned, stream=s)
        assert _digest(await dev2.to_host(stream=s)) == _digest(host)


async def test_concurrent_copies_on_two_devices_and_many_streams(
    backend: _driver.Driver, anyio_backend: object, small_staging: None
) -> None:
    """More chunks in flight than slots, both directions, slots shared across devices."""
    ordinals = [0, 1] if backend.device_count() > 1 else [0]
    nbytes = 3 * CHUNK + 1
    results: dict[int, bool] = {}

    async def round_trip(i: int) -> None:
        host = np.full(nbytes, i + 1, np.uint8)
        host[::4097] = 255 - i
        with Stream(ordinals[i % len(ordinals)]) as s:
            dev = await ga.to_device(host, stream=s)
            back = await dev.to_host(stream=s)
            results[i] = _digest(back) == _digest(host)

    async with anyio.create_task_group() as tg:
        for i in range(8):
            tg.start_soon(round_trip, i)
    assert results == {i: True for i in range(8)}


async def test_a_slot_is_reused_only_after_its_dma_completed(
    sim_backend: Any, anyio_backend: object, small_staging: None
) -> None:
    """On a paused stream no DMA runs: the copy must stop once every slot holds a chunk
    whose DMA is pending, not overwrite one (the DMAs, run on resume, would read it)."""
    host = _random_bytes(3 * SLOTS * CHUNK)
    with Stream(0) as s:
        dev = ga.empty(host.shape, np.uint8, stream=s)
        await s
        sim_backend.pause(s.handle)
        async with anyio.create_task_group() as tg:
            tg.start_soon(dev.copy_from, host)
            await anyio.sleep(0.2)  # every slot filled; the copiers wait for their fences
            sim_backend.resume(s.handle)
        assert _digest(await dev.to_host(stream=s)) == _digest(host)


async def test_a_cancelled_copy_is_done_with_the_host_array_when_the_await_ends(
    sim_backend: Any, anyio_backend: object, small_staging: None
) -> None:
    host = _random_bytes(3 * SLOTS * CHUNK)
    digest = _digest(host)
    with Stream(0) as s:
        dev = ga.empty(host.shape, np.uint8, stream=s)
        await s
        sim_backend.pause(s.handle)
        ended = anyio.Event()

        async def cancelled_copy(scope: anyio.CancelScope) -> None:
            with scope:
                await dev.copy_from(host, stream=s)
            ended.set()

        async with anyio.create_task_group() as tg:
            scope = anyio.CancelScope()
            tg.start_soon(cancelled_copy, scope)
            await anyio.sleep(0.05)
            scope.cancel()
            await anyio.sleep(0.2)
            assert not ended.is_set()  # the copiers still read host: the await goes on
            sim_backend.resume(s.handle)
            await ended.wait()
        host[:] = 0  # the caller may now reuse the array
        assert _digest(await dev.to_host(stream=s)) == digest


async def test_a_copy_cancelled_before_it_starts_enqueues_nothing_afterwards(
    sim_backend: Any, anyio_backend: object, small_staging: None
) -> None:
    """The cancelled to_device frees its result at once; a copy still queued for the
    copiers would write into that memory after its next allocation took it."""
    busy, victim = Stream(0), Stream(0)
    busy_array = ga.empty(3 * SLOTS * CHUNK, np.uint8, stream=busy)
    await busy
    sim_backend.pause(busy.handle)
    nbytes = 2 * CHUNK
    async with anyio.create_task_group() as tg:
        tg.start_soon(busy_array.copy_from, _random_bytes(busy_array.size))  # occupies every copier
        await anyio.sleep(0.1)
        with anyio.CancelScope() as scope:
            scope.cancel()
            await ga.to_device(np.ones(nbytes, np.uint8), stream=victim)
        reused = ga.empty(nbytes, np.uint8, stream=victim)  # the same memory, in the sim
        await reused.fill(7, stream=victim)
        sim_backend.resume(busy.handle)
    await busy
    await victim
    assert (await reused.to_host(stream=victim) == 7).all()
    busy.close()
    victim.close()


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
async def test_a_failed_chunk_fails_the_copy_and_the_copiers_recover(
    sim_backend: Any, anyio_backend: object, small_staging: None, direction: str
) -> None:
    host = _random_bytes(4 * CHUNK)
    call = "memcpy_htod_async" if direction == "h2d" else "memcpy_dtoh_async"
    with Stream(0) as s:
        dev = await ga.to_device(host, stream=s)
        sim_backend.inject_fault(ResultCode.INVALID_VALUE, at_call=3, call=call)
        with pytest.raises(ArgumentError):
            if direction == "h2d":
                await dev.copy_from(host, stream=s)
            else:
                await dev.to_host(stream=s)
        assert _digest(await dev.to_host(stream=s)) == _digest(host)  # usable afterwards
        await dev.copy_from(host, stream=s)


@pytest.fixture
def one_copier(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """One copier thread with two slots, and every pageable copy staged through it (no
    inline slots): what a test sees does not depend on which slots happen to be free."""
    _staging.reset()
    monkeypatch.setattr(_staging, "CHUNK", CHUNK)
    monkeypatch.setattr(_staging, "MIN_CHUNK", CHUNK)
    monkeypatch.setattr(_staging, "COPY_THREADS", 1)
    monkeypatch.setattr(_staging, "SLOTS_PER_THREAD", 2)
    monkeypatch.setattr(_staging, "INLINE_LIMIT", 0)
    yield
    _staging.reset()


async def _until_work_is_queued(stream: Stream) -> None:
    """Return once ``stream`` (paused) has work queued: the copier enqueued its DMA."""
    with anyio.fail_after(10):
        while stream.query():  # noqa: ASYNC110 - a driver state, with no event to await
            await anyio.sleep(0.001)


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
async def test_a_copy_never_waits_for_another_streams_staged_copy(
    sim_backend: Any, anyio_backend: object, one_copier: None, direction: str
) -> None:
    """One copier thread, two slots: a chunk whose DMA waits on a paused stream fills one
    slot; copies on another stream (of another device) go through the other slot, again
    and again, and finish while the first stream stays paused."""
    other_device = 1 if sim_backend.device_count() > 1 else 0
    paused, other = Stream(0), Stream(other_device)
    stuck_host = _random_bytes(CHUNK)
    stuck = await ga.to_device(stuck_host, stream=paused)
    free_host = _random_bytes(3 * CHUNK)  # three chunks: the free slot is reused
    free = await ga.to_device(free_host, stream=other)
    await paused
    sim_backend.pause(paused.handle)
    stuck_back = np.zeros_like(stuck_host)
    watchdog_fired = False

    async def watchdog(scope: anyio.CancelScope) -> None:
        # A copy that waits for the paused stream would never finish (and a thread's
        # wait cannot be cancelled): resume the stream instead of hanging the test.
        nonlocal watchdog_fired
        with scope:
            await anyio.sleep(30)
            watchdog_fired = True
            sim_backend.resume(paused.handle)

    async with anyio.create_task_group() as tg:
        if direction == "d2h":
            tg.start_soon(functools.partial(stuck.to_host, out=stuck_back, stream=paused))
        else:
            tg.start_soon(functools.partial(stuck.copy_from, np.flip(stuck_host), stream=paused))
        await _until_work_is_queued(paused)
        watch = anyio.CancelScope()
        tg.start_soon(watchdog, watch)
        for _ in range(2):
            if direction == "d2h":
                assert _digest(await free.to_host(stream=other)) == _digest(free_host)
            else:
                free_host = np.flip(free_host)
                await free.copy_from(free_host, stream=other)
                assert _digest(await free.to_host(stream=other)) == _digest(free_host)
        watch.cancel()
        assert not watchdog_fired, "a copy on another stream waited for the paused stream"
        assert not paused.query()  # the first copy still waits for its stream
        sim_backend.resume(paused.handle)
    if direction == "d2h":
        assert _digest(stuck_back) == _digest(stuck_host)
    else:
        assert _digest(await stuck.to_host(stream=paused)) == _digest(np.flip(stuck_host))
    paused.close()
    other.close()


class _SliceWatch:
    """Counts a busy task's turns and notes how many had passed at each host copy of
    staging (``_memmove``); ``cancel_at_first_copy(scope, test)`` cancels ``scope`` at the
    first copy for which ``test(dst, src)`` holds, before that copy."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.turns = 0
        self.seen: list[tuple[int, int]] = []  # (destination address, turns so far)
        self.running = True
        self._cancel: tuple[anyio.CancelScope, Callable[[int, int], bool]] | None = None
        self.cancelled = False
        memmove = _staging._memmove

        def watched(dst: int, src: int, n: int) -> Any:
            self.seen.append((dst, self.turns))
            if self._cancel is not None and self._cancel[1](dst, src):
                self._cancel[0].cancel()
                self._cancel, self.cancelled = None, True
            return memmove(dst, src, n)

        monkeypatch.setattr(_staging, "_memmove", watched)

    def cancel_at_first_copy(self, scope: anyio.CancelScope, test: Callable[[int, int], bool]) -> None:
        self._cancel = (scope, test)

    async def busy(self) -> None:
        while self.running:
            self.turns += 1
            await anyio.lowlevel.checkpoint()


async def test_an_awaited_inline_copy_lets_the_loop_run_between_slices(
    backend: _driver.Driver, anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 64 KiB pageable copy, inline (under INLINE_LIMIT) with 16 KiB slices, is four
    host copies each way, and another ready task runs while they go on: between each
    two on asyncio; at least once in every three on trio (which runs each ready task
    once per batch, in a shuffled order)."""
    monkeypatch.setattr(_staging, "SLICE", 16 * 1024)
    watch = _SliceWatch(monkeypatch)
    host = _random_bytes(64 * 1024)
    out = np.zeros_like(host)
    with Stream(0) as s:
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch.busy)
            dev = await ga.to_device(host, stream=s)
            uploads = [turns for _, turns in watch.seen]
            watch.seen.clear()
            await dev.to_host(out=out, stream=s)
            start = out.ctypes.data
            downloads = [turns for dst, turns in watch.seen if start <= dst < start + out.nbytes]
            watch.running = False
    assert len(uploads) == 4 and len(downloads) == 4
    for turns in (uploads, downloads):
        assert all(a < b for a, b in zip(turns, turns[2:], strict=False)), turns
    assert _digest(out) == _digest(host)


async def test_an_inline_download_cancelled_between_slices_fills_the_host_array_first(
    backend: _driver.Driver, anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled as its first slice is copied out, the download copies the rest before
    the cancellation takes effect: ``out`` is never left half written."""
    monkeypatch.setattr(_staging, "SLICE", 16 * 1024)
    watch = _SliceWatch(monkeypatch)
    host = _random_bytes(64 * 1024)
    out = np.zeros_like(host)
    with Stream(0) as s:
        dev = await ga.to_device(host, stream=s)
        with anyio.CancelScope() as scope:
            watch.cancel_at_first_copy(scope, lambda dst, src: dst == out.ctypes.data)
            await dev.to_host(out=out, stream=s)
    assert watch.cancelled
    assert _digest(out) == _digest(host)


async def test_an_inline_upload_cancelled_between_slices_enqueues_nothing(
    backend: _driver.Driver, anyio_backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled as its first slice is copied in, an upload enqueues no DMA where the
    cancellation arrives between the slices (asyncio; trio delivers it at a later
    checkpoint, once the copy is enqueued, if any): the device array is untouched, never
    torn."""
    monkeypatch.setattr(_staging, "SLICE", 16 * 1024)
    watch = _SliceWatch(monkeypatch)
    host = _random_bytes(64 * 1024) | 1  # no zero byte
    with Stream(0) as s:
        dev = ga.empty(host.shape, np.uint8, stream=s)
        await dev.fill(0, stream=s)
        with anyio.CancelScope() as scope:
            watch.cancel_at_first_copy(scope, lambda dst, src: src == host.ctypes.data)
            await dev.copy_from(host, stream=s)
        assert watch.cancelled
        back = await dev.to_host(stream=s)
    if anyio_backend == "trio":  # (and with no checkpoint left, maybe not cancelled at all)
        assert not back.any() or _digest(back) == _digest(host)
    else:
        assert scope.cancelled_caught and not back.any()


def test_the_loop_threads_host_copies_hold_the_gil() -> None:
    """Staging a request's data and copying a download out happen on the loop's thread
    and keep the GIL through copies up to HOLD_GIL_BYTES (ctypes.memmove would hand it
    over and take it back, a round trip through the kernel when another thread waits for
    it); larger copies, and the copier threads' copies, release it."""
    import ctypes

    from aiocuda._executor import lane
    from aiocuda._memory import copiers, host_copy

    assert lane._memmove is host_copy.memmove and _staging._memmove is host_copy.memmove
    assert host_copy._memmove_holding_gil._flags_ & ctypes._FUNCFLAG_PYTHONAPI  # type: ignore[attr-defined]
    assert copiers._memmove is ctypes.memmove
    for nbytes in (1 << 16, host_copy.HOLD_GIL_BYTES + 1):
        src = np.arange(nbytes, dtype=np.uint8)
        dst = np.zeros_like(src)
        host_copy.memmove(int(dst.ctypes.data) + 1, int(src.ctypes.data), nbytes - 1)
        np.testing.assert_array_equal(dst[1:], src[:-1])


@pytest.fixture
def few_inline_slots(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Inline staging built afresh with two slots of a size class made on the calling
    thread (the first, and one more); yields the sizes of the downloads that found no
    slot ready and went through a block of the pinned cache instead."""
    _staging.reset()
    monkeypatch.setattr(_staging, "INLINE_SLOTS", 1)
    elsewhere: list[int] = []
    through_block = _staging._download_through_block

    async def counted(host: np.ndarray, src: int, stream: Stream) -> None:
        elsewhere.append(int(host.nbytes))
        await through_block(host, src, stream)

    monkeypatch.setattr(_staging, "_download_through_block", counted)
    yield elsewhere
    _staging.reset()


async def _downloads_behind_held_streams(sim: Any, arrays: list[ga.DeviceArray], streams: list[Stream]) -> None:
    """One pageable download per stream, each held in flight (its slot fenced) until all
    have begun, then let go; checks what arrived."""
    results: dict[int, np.ndarray] = {}
    for s in streams:
        sim.pause(s.handle)

    async def download(i: int) -> None:
        results[i] = await arrays[i].to_host(stream=streams[i])

    async with anyio.create_task_group() as tg:
        for i in range(len(streams)):
            tg.start_soon(download, i)
            for _ in range(20):  # (no time involved: the download reaches its await)
                await anyio.lowlevel.checkpoint()
            _offloop.drain()  # the slots it asked the off-loop thread for are made
        for s in streams:
            sim.resume(s.handle)
    for i, array in enumerate(arrays):
        np.testing.assert_array_equal(results[i], np.full(array.shape, i, np.float32))


async def test_the_inline_slots_grow_to_the_copies_in_flight(
    sim_backend: Any, anyio_backend: object, few_inline_slots: list[int]
) -> None:
    """Small downloads behind busy streams each hold an inline slot until their stream
    gets to them. The third finds none and goes through a pinned block, and has two more slots
    of its size class made off the loop; the sixth, four more. Six such downloads again
    then all go inline."""
    streams = [Stream(0) for _ in range(6)]
    arrays = [ga.empty(16384, np.float32, stream=s) for s in streams]  # 64 KiB each
    for i, (array, s) in enumerate(zip(arrays, streams, strict=True)):
        await array.fill(i, stream=s)
    await _downloads_behind_held_streams(sim_backend, arrays, streams)
    assert few_inline_slots == [64 * 1024, 64 * 1024]
    await _downloads_behind_held_streams(sim_backend, arrays, streams)
    assert len(few_inline_slots) == 2
    small = ga.empty(1024, np.float32, stream=streams[0])  # 4 KiB: a size class of its own
    await small.fill(7, stream=streams[0])
    np.testing.assert_array_equal(await small.to_host(stream=streams[0]), np.full(1024, 7, np.float32))
    assert len(few_inline_slots) == 2
    for s in streams:
        s.close()


async def test_small_copies_that_find_no_slot_are_still_abandoned_when_cancelled(
    sim_backend: Any, anyio_backend: object, few_inline_slots: list[int]
) -> None:
    """Cancelled small downloads behind a held stream fence every inline slot; the next
    ones went to the copier threads, which cannot be abandoned: a cancelled request then
    waited for the stream. Through pinned blocks they end at once, as uploads do."""
    s = Stream(0)
    array = ga.empty(16384, np.float32, stream=s)
    await array.fill(3, stream=s)
    sim_backend.pause(s.handle)
    with anyio.fail_after(30):  # (a guard against a hang, not a measurement)
        for _ in range(6):
            for copy in (
                lambda: array.to_host(stream=s),
                lambda: array.copy_from(np.ones(16384, np.float32), stream=s),
            ):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(copy)
                    for _ in range(20):  # (no time involved: the copy reaches its await)
                        await anyio.lowlevel.checkpoint()
                    tg.cancel_scope.cancel()
    assert few_inline_slots  # some went around the slots
    sim_backend.resume(s.handle)
    np.testing.assert_array_equal(await array.to_host(stream=s), 1.0)  # the last upload, in order
    s.close()


async def test_the_inline_slots_stay_within_their_budget(
    sim_backend: Any, anyio_backend: object, few_inline_slots: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With room for three 64 KiB slots, the third download in flight has one more made
    (all the budget left) and goes through a pinned block, the fourth takes that slot, and
    the fifth, finding none, goes through one too; from then on, two of five every time."""
    monkeypatch.setattr(_staging, "INLINE_BYTES", 3 * 64 * 1024)
    streams = [Stream(0) for _ in range(5)]
    arrays = [ga.empty(16384, np.float32, stream=s) for s in streams]
    for i, (array, s) in enumerate(zip(arrays, streams, strict=True)):
        await array.fill(i, stream=s)
    await _downloads_behind_held_streams(sim_backend, arrays, streams)
    assert len(few_inline_slots) == 2
    await _downloads_behind_held_streams(sim_backend, arrays, streams)
    assert len(few_inline_slots) == 4
    for s in streams:
        s.close()


async def test_inline_slots_that_cannot_be_made_leave_the_copies_to_pinned_blocks(
    sim_backend: Any,
    anyio_backend: object,
    few_inline_slots: list[int],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Out of page-locked memory off the loop: a warning, no more growth, and the copies
    that find no slot go through blocks of the pinned cache, their data intact."""
    made: list[Any] = []

    def slot(device: Any, size: int) -> Any:
        if len(made) == 2:
            raise OutOfMemoryError("no page-locked memory left", code=ResultCode.OUT_OF_MEMORY)
        made.append(Slot(device, size))
        return made[-1]

    monkeypatch.setattr(_staging, "Slot", slot)
    streams = [Stream(0) for _ in range(4)]
    arrays = [ga.empty(16384, np.float32, stream=s) for s in streams]
    for i, (array, s) in enumerate(zip(arrays, streams, strict=True)):
        await array.fill(i, stream=s)
    await _downloads_behind_held_streams(sim_backend, arrays, streams)
    await _downloads_behind_held_streams(sim_backend, arrays, streams)
    assert len(made) == 2 and len(few_inline_slots) == 4  # each time: two inline, two not
    assert "no more inline staging slots" in caplog.text
    for s in streams:
        s.close()
