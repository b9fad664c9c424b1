"""ActorPool's lifetime on a local Ray cluster (simulated backend): opening once, however
many ask at once; actors gone between maps; closing within a grace period, or at once
when cancelled; Ray shut down under a map; clusters without the GPUs a pool asks for.

No test relies on timing: actors are held where a test needs them by events or paused
streams, and the tests wait for states.
"""

from __future__ import annotations

import asyncio
import functools
import pathlib
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
import ray
import ray.exceptions

import aiocuda.ray as aray
from aiocuda.ray import _pool
from aiocuda.ray._actor import GpuActor

from . import _stages
from .conftest import GPUS, chunks, gone, new_pool, one_loop, reached, until

pytestmark = pytest.mark.anyio


# The actor's loop is asyncio (Ray's async actor), whatever the driver's.
@one_loop
async def test_an_actor_opened_by_calls_at_once_opens_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray runs an async actor's calls at once: a second ``open`` while the first is in
    its setup waits for it (it selected the backend again, shutting the first's driver
    down under it)."""
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [0])  # in the actor, Ray's answer
    release = asyncio.Event()
    setups = 0

    async def setup() -> None:
        nonlocal setups
        setups += 1
        await release.wait()

    actor = GpuActor("sim", setup, {}, "staging")
    opens = [asyncio.ensure_future(actor.open()) for _ in range(2)]
    await anyio.wait_all_tasks_blocked()  # both calls made, the first in its setup
    release.set()
    first, second = await asyncio.gather(*opens)
    try:
        assert setups == 1
        assert len(first.devices) == 1
        assert second.devices == first.devices
    finally:
        await actor.close()


@one_loop
async def test_maps_started_together_share_the_opening(ray_cluster: Any, tmp_path: pathlib.Path) -> None:
    calls = tmp_path / "setups"
    pool = new_pool(2, setup=functools.partial(_stages.record_setup, str(calls)))
    got: list[list[int]] = []

    async def one_map() -> None:
        async with aray.map(_stages.identity, chunks(6), actors=pool) as results:
            got.append([r.index async for r in results])

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(one_map)
            tg.start_soon(one_map)
        assert got == [list(range(6))] * 2
        pids = calls.read_text().split()
        assert len(pids) == len(set(pids)) == 2  # one setup per actor
    finally:
        await pool.aclose()


@one_loop
async def test_a_map_over_a_pool_whose_actors_are_all_gone_fails_at_once(ray_cluster: Any) -> None:
    async with new_pool(1) as pool:
        ray.kill(pool.slots[0].actor)
        await until(lambda: _lost(pool, 0))
        assert not pool.ready
        with pytest.raises(aray.ActorLostError, match="all 1 Ray actors of the pool are gone"):
            async with aray.map(_stages.identity, chunks(2), actors=pool) as results:
                [r async for r in results]


async def _lost(pool: Any, index: int) -> bool:
    """Whether the pool knows that actor ``index`` is gone (asking it learns that)."""
    return (await pool.statistics())[index] is None


@one_loop
async def test_an_actor_gone_between_maps_leaves_the_next_to_the_others(ray_cluster: Any) -> None:
    """Killed outside the pool (as a crash would), so the pool learns it as the next map
    starts: that map runs on the other actor, and once that one is gone too, the map
    after it raises ActorLostError."""
    async with new_pool(2) as pool:
        first, second = pool.slots
        ray.kill(first.actor)
        await until(lambda: gone(first.actor))
        async with aray.map(_stages.identity, chunks(6), actors=pool) as results:
            got = [(r.index, r.device) async for r in results]
        assert got == [(i, 1) for i in range(6)]
        assert pool.live == [second] and pool.ready
        ray.kill(second.actor)
        await until(lambda: gone(second.actor))
        with pytest.raises(aray.ActorLostError, match="all 2 Ray actors of the pool are gone"):
            async with aray.map(_stages.identity, chunks(2), actors=pool) as results:
                [r async for r in results]
        assert not pool.ready


async def test_cancelling_a_map_ends_its_own_pool_whatever_the_gpu_does(ray_cluster: Any) -> None:
    """A chunk whose GPU work never finishes (its stream paused) does not hold the
    caller's cancellation (a timeout): the map's own pool ends its actor at once."""
    with anyio.CancelScope() as scope:
        async with aray.map(_stages.pause_all, chunks(2), actors=1, backend="sim", num_cpus=0) as results:
            pool = results.pool
            await until(lambda: reached(pool, 1))
            scope.cancel()
            [r async for r in results]
    assert scope.cancelled_caught
    assert not pool.live
    await until(lambda: gone(pool.slots[0].actor))  # (ray.kill is asynchronous: a call right after it may be answered)


@one_loop
async def test_closing_a_pool_ends_it_after_the_grace_period(ray_cluster: Any) -> None:
    pool = new_pool(1)
    await pool.wait_ready()
    async with aray.map(_stages.pause_all, chunks(2), actors=pool) as results:
        await until(lambda: reached(pool, 1))
    assert results.delivered == 0
    await pool.aclose(grace=0)  # the paused chunk's work would keep its actor's close waiting
    assert not pool.live
    await until(lambda: gone(pool.slots[0].actor))  # (ray.kill is asynchronous: a call right after it may be answered)


async def test_ray_shut_down_under_a_map_fails_its_chunks_clearly(
    ray_cluster: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ray.shutdown()`` leaves the refs in flight pending forever, and any Ray call
    after it would start a new local Ray. Simulated on the shared cluster by Ray saying
    it is not initialised: then any Ray call that would start Ray raises (it is
    connected already), so none may come."""
    pool = new_pool(1)
    await pool.wait_ready()
    shut_down = anyio.Event()
    big = chunks(2, size=1 << 16)  # past INLINE_LIMIT: each put into the store on a put thread

    async def inputs() -> AsyncIterator[Any]:
        yield big[0]
        await shut_down.wait()
        yield big[1]  # its put comes after the shutdown

    try:
        async with aray.map(_stages.pause_all, inputs(), actors=pool, on_error="continue") as results:
            await until(lambda: reached(pool, 1))
            monkeypatch.setattr(ray, "is_initialized", lambda: False)
            shut_down.set()
            got = [r async for r in results]
        assert [type(r.error) for r in got] == [ray.exceptions.RaySystemError] * 2
        assert all("Ray is not running" in str(r.error) for r in got)
        await pool.aclose()  # nothing to close or end: the actors went with Ray
        assert not pool.live
    finally:
        monkeypatch.undo()
        pool.kill()


def test_a_pool_the_cluster_has_not_the_gpus_for_is_refused(ray_cluster: Any) -> None:
    """Ray would wait for the GPUs forever (the simulator has as many as ray.init declares)."""
    pool = new_pool(2, num_gpus=GPUS)
    with pytest.raises(RuntimeError, match=r"needs GPUs: 32, and the Ray cluster has 16.*ray\.init\(num_gpus=N\)"):
        pool.start()
    assert pool.slots == ()


def test_a_pool_an_autoscaler_may_find_the_gpus_for_is_warned_of(
    ray_cluster: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_pool, "_autoscaled_gpus", lambda: 4.0 * GPUS)
    with pytest.warns(RuntimeWarning, match="waits for its autoscaler"):
        _pool._check_gpus(2, GPUS)
    with pytest.raises(RuntimeError, match=r"at most 64 with its autoscaler"):
        _pool._check_gpus(8, GPUS)
