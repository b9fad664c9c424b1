"""aiocuda.ray.map on a local Ray cluster (simulated backend): results, ordering,
back-pressure, failing chunks, dying actors, cancellation.

No test relies on timing: chunks are made to wait by pausing their streams in the
actors (the simulator's control), and the tests wait for states (chunks in flight,
chunks completed) read from the actors.
"""

from __future__ import annotations

from collections.abc import Awaitable, Iterator
from typing import Any

import anyio
import numpy as np
import pytest
import ray

import aiocuda.ray as aray
from aiocuda._cli.demo import ScaleStage, scale_reference
from aiocuda.ray import _refs

from . import _stages
from .conftest import chunks, gone, new_pool, one_loop, reached, until

pytestmark = pytest.mark.anyio


async def completed(pool: Any) -> list[int]:
    return [s.completed if s is not None else -1 for s in await pool.statistics()]


async def in_flight(pool: Any) -> list[int]:
    return [s.in_flight if s is not None else -1 for s in await pool.statistics()]


@pytest.fixture(params=["pool2", "pool4"])
def shared_pool(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue(request.param)


async def test_map_runs_a_class_stage_once_per_actor(shared_pool: Any) -> None:
    pool = shared_pool
    data = np.random.default_rng(0).random((12, 8192), dtype=np.float32)
    for round_ in range(2):
        async with aray.map(ScaleStage, data, actors=pool, stage_args=(7,)) as results:
            got = [r async for r in results]
        assert [r.index for r in got] == list(range(12))
        for r in got:
            assert np.allclose(r.value, scale_reference(data[r.index], 7), rtol=1e-3)
            assert not r.value.flags.writeable  # a view of the object store
        assert {r.device for r in got} == set(range(len(pool.slots)))
        created = [s.stages_created for s in await pool.statistics()]
        if round_ == 0:
            first = created
    assert created == first  # the second map reused each actor's instance


async def test_results_come_in_input_order_whatever_finishes_first(pool2: Any) -> None:
    """Chunk 0 is paused on actor 0, so the chunks on actor 1 finish before it; ordered
    delivery still starts with chunk 0."""
    data = chunks(8, marked=(0,))
    before = await completed(pool2)
    before_reached = sum(await pool2.call(_stages.reached))
    got: list[int] = []
    async with aray.map(_stages.pause_marked, data, actors=pool2) as results:

        async def consume() -> None:
            async for r in results:
                got.append(r.index)

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await until(lambda: _grew(pool2, before, actor=1, by=4))
            await until(lambda: reached(pool2, before_reached + 1))
            assert got == []
            assert sum(await pool2.call(_stages.resume_paused)) >= 1
    assert got == list(range(8))


async def _grew(pool: Any, before: list[int], actor: int, by: int) -> bool:
    return (await completed(pool))[actor] >= before[actor] + by


async def test_as_completed_yields_the_paused_chunk_after_the_others(pool2: Any) -> None:
    data = chunks(8, marked=(0,))
    before_reached = sum(await pool2.call(_stages.reached))
    got: list[tuple[int, int]] = []
    async with aray.map(_stages.pause_marked, data, actors=pool2, ordered=False) as results:
        async for r in results:
            got.append((r.index, r.device))
            if len(got) == 1:
                await until(lambda: reached(pool2, before_reached + 1))  # chunk 0 reached its stage
                assert sum(await pool2.call(_stages.resume_paused)) >= 1
    assert sorted(i for i, _ in got) == list(range(8))
    assert got[0][0] != 0


async def test_back_pressure_bounds_chunks_per_actor_and_inputs_read(ray_cluster: Any) -> None:
    read = 0

    def inputs() -> Iterator[np.ndarray]:
        nonlocal read
        for x in chunks(12):
            read += 1
            yield x

    async with new_pool(2, chunks_per_actor=2) as pool:
        async with aray.map(_stages.pause_all, inputs(), actors=pool) as results:
            await until(lambda: _equal(in_flight(pool), [2, 2]))
            await until(lambda: reached(pool, 4))  # every chunk reached its stage
            assert results.admitted == 4
            assert [slot.chunks for slot in pool.slots] == [2, 2]
            assert read <= 5  # the fifth input waits for an actor with room
            assert sum(await pool.call(_stages.stop_pausing)) >= 2
            got = [r.index async for r in results]
        assert got == list(range(12))
        assert results.peak_in_flight <= 4


async def test_inputs_are_put_while_earlier_chunks_run(ray_cluster: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    put: list[int] = []
    real_put = ray.put

    def recording_put(value: Any, **options: Any) -> Any:
        ref = real_put(value, **options)
        put.append(int(value.flat[0]))
        return ref

    async def three_put() -> bool:
        return len(put) >= 3

    monkeypatch.setattr(ray, "put", recording_put)
    big = chunks(6, size=1 << 16)  # 256 KiB each: past INLINE_LIMIT, put into the store
    async with new_pool(1, chunks_per_actor=2) as pool:
        async with aray.map(_stages.pause_all, big, actors=pool) as results:
            await until(lambda: _equal(in_flight(pool), [2]))
            with anyio.move_on_after(30):  # the third input waits for room, in the store already
                await until(three_put)
            put_while_paused, admitted = list(put), results.admitted
            assert sum(await pool.call(_stages.stop_pausing)) >= 1
            got = [r.index async for r in results]
    # Two put threads: the order in which puts finish is theirs, not the inputs'.
    assert sorted(put_while_paused) == [0, 1, 2]
    assert admitted == 2
    assert got == list(range(6))
    assert sorted(put) == list(range(6))


async def test_in_flight_bounds_chunks_not_yet_taken(pool2: Any) -> None:
    before = await completed(pool2)
    async with aray.map(_stages.identity, chunks(10), actors=pool2, in_flight=3) as results:
        await until(lambda: _total_grew(pool2, before, by=3))
        assert results.admitted == 3  # three done, none taken: no more admitted
        got = [r.index async for r in results]
    assert got == list(range(10))
    assert results.peak_in_flight == 3


async def _total_grew(pool: Any, before: list[int], by: int) -> bool:
    return sum(await completed(pool)) >= sum(before) + by


async def _equal(awaitable: Awaitable[Any], expected: Any) -> bool:
    return bool(await awaitable == expected)


@pytest.mark.parametrize("on_error", ["raise", "continue"])
async def test_a_failing_chunk(pool2: Any, on_error: str) -> None:
    data = chunks(8, marked=(5,))
    if on_error == "raise":
        with pytest.raises(ValueError, match="marked chunk rejected"):
            async with aray.map(_stages.fail_on_marked, data, actors=pool2) as results:
                async for _ in results:
                    pass
        await until(lambda: _equal(in_flight(pool2), [0, 0]))  # the others stopped
        return
    async with aray.map(_stages.fail_on_marked, data, actors=pool2, on_error="continue") as results:
        got = [r async for r in results]
    assert [r.index for r in got] == list(range(8))
    assert [r.index for r in results.failures] == [5]
    assert isinstance(got[5].error, ValueError)
    assert all(r.ok for r in got if r.index != 5)


async def test_chunks_of_an_actor_that_dies_are_run_elsewhere(ray_cluster: Any, tmp_path: Any) -> None:
    data = chunks(10, marked=(4,))
    async with new_pool(2) as pool:
        stage_args = (str(tmp_path / "died"), True)
        async with aray.map(_stages.DieOnMarked, data, actors=pool, stage_args=stage_args) as results:
            got = [r async for r in results]
        assert [r.index for r in got] == list(range(10))
        assert all(np.array_equal(r.value[1:], data[r.index][1:]) for r in got)
        assert results.retried >= 1
        assert len(pool.live) == 1
        assert (tmp_path / "died").exists()


@pytest.mark.parametrize("on_error", ["raise", "continue"])
async def test_chunks_fail_clearly_when_no_actor_is_left(ray_cluster: Any, tmp_path: Any, on_error: str) -> None:
    data = chunks(6, marked=(2,))
    stage_args = (str(tmp_path / "died"), False)
    async with new_pool(1) as pool:
        if on_error == "raise":
            with pytest.raises(aray.ActorLostError, match="Ray actor 0 died"):
                async with aray.map(_stages.DieOnMarked, data, actors=pool, stage_args=stage_args) as results:
                    async for _ in results:
                        pass
            return
        async with aray.map(
            _stages.DieOnMarked, data, actors=pool, stage_args=stage_args, on_error="continue"
        ) as results:
            got = [r async for r in results]
    assert [r.index for r in got] == list(range(6))  # every chunk accounted for
    lost = [r.index for r in got if isinstance(r.error, aray.ActorLostError)]
    assert 2 in lost and lost == sorted(lost) and lost[-1] == 5
    assert all(r.ok for r in got if r.index not in lost)


@one_loop
async def test_a_retry_passes_over_actors_that_died_at_the_same_time(ray_cluster: Any) -> None:
    """Actors 0 and 1 die together (as when a node is lost) while chunk 0 runs on actor
    0. Its retry goes to actor 1, next in turn and not yet known to be gone: found gone
    (it answers no call), it uses up no retry, and the chunk runs on actor 2."""
    async with new_pool(3) as pool:
        first, second, third = pool.slots
        async with aray.map(_stages.pause_all, chunks(1), actors=pool, retries=1) as results:
            await until(lambda: reached(pool, 1))  # chunk 0, paused on actor 0
            await _refs.value(third.actor.call.remote(_stages.stop_pausing))  # actor 2 will run it
            ray.kill(second.actor)
            await until(lambda: gone(second.actor))
            ray.kill(first.actor)
            got = [(r.index, r.device) async for r in results]
        assert got == [(0, 2)]
        assert results.retried == 1
        assert pool.live == [third]


async def test_cancelling_stops_the_actors_work_and_frees_its_memory(ray_cluster: Any) -> None:
    async with new_pool(2, chunks_per_actor=3) as pool:
        with anyio.CancelScope() as scope:
            async with aray.map(_stages.pause_all, chunks(20, size=1 << 16), actors=pool) as results:
                await until(lambda: _equal(in_flight(pool), [3, 3]))
                await until(lambda: reached(pool, 6))  # every chunk reached its stage
                await until(lambda: _all_positive(_used(pool)))  # the chunks hold device memory
                scope.cancel()
                async for _ in results:
                    pass
        assert results.delivered == 0
        await until(lambda: _equal(in_flight(pool), [0, 0]))
        stats = await pool.statistics()
        assert [s.cancelled for s in stats] == [3, 3]
        assert [s.completed for s in stats] == [0, 0]
        assert sum(await pool.call(_stages.stop_pausing)) >= 2
        await until(lambda: _equal(_used_after_sync(pool), [0, 0]))  # freed after the paused work


async def _used(pool: Any) -> list[int]:
    return [s.used_bytes for s in await pool.statistics()]


async def _used_after_sync(pool: Any) -> list[int]:
    """Device memory in use once each actor's executor has synchronised (which is when
    the driver sees stream-ordered frees)."""
    await pool.call(_synchronize)
    return await _used(pool)


async def _synchronize(executor: Any) -> None:
    await executor.synchronize()


async def _all_positive(awaitable: Awaitable[list[int]]) -> bool:
    return all(v > 0 for v in await awaitable)


async def test_register_upload_reads_the_object_store_in_place(ray_cluster: Any) -> None:
    data = np.random.default_rng(1).random((6, 1 << 18), dtype=np.float32)
    async with new_pool(1, upload="register") as pool:
        for _ in range(2):
            async with aray.map(ScaleStage, data, actors=pool, stage_args=(3,)) as results:
                got = [r async for r in results]
            assert all(np.allclose(r.value, scale_reference(data[r.index], 3), rtol=1e-3) for r in got)
        (stats,) = await pool.statistics()
    assert stats.upload == "register"
    assert stats.uploads_direct > 0
    assert stats.uploads_direct + stats.uploads_staged == 12


async def test_each_assigned_gpu_is_a_simulated_device(ray_cluster: Any) -> None:
    async with new_pool(2, num_gpus=2) as pool:
        views = await pool.call(_stages.device_view)
    for backend, count, visible in views:
        assert backend == "sim"
        assert count == 2
        assert len(visible.split(",")) == 2
