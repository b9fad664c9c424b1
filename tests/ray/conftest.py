"""One local Ray cluster for the tests here (ended after the last), on the simulated backend.

The cluster declares more GPUs than the machine has (Ray only counts them): each actor
takes one, and on the simulated backend each becomes a simulated device. CPUs are few
(CI is a loaded 2-core machine) and actors reserve none. Pools of 2 and 4 actors are
shared by the tests that leave them as they found them; tests that pause streams, kill
actors or cancel work make their own.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import anyio
import numpy as np
import pytest

if os.environ.get("AIOCUDA_REQUIRE_RAY"):  # CI: a missing Ray is a failure, not a skip
    import ray

    import aiocuda.ray as aiocuda_ray
else:
    ray = pytest.importorskip("ray")
    aiocuda_ray = pytest.importorskip("aiocuda.ray")

from aiocuda.ray import _refs

from . import _stages

ROOT = pathlib.Path(__file__).resolve().parents[2]
GPUS = 16

one_loop = pytest.mark.parametrize("anyio_backend", ["asyncio"])
"""For a test where the driver's event loop plays no part (what it checks happens in the
actors, or in code that awaits nothing its own way): run once, not on every loop, as
each Ray test costs a second or more."""


@pytest.fixture(scope="package")
def ray_cluster() -> Iterator[Any]:
    """A local Ray cluster whose workers can import ``tests.ray._stages``."""
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "RAY_USAGE_STATS_ENABLED")}
    paths = [str(ROOT), str(ROOT / "src"), *filter(None, [saved["PYTHONPATH"]])]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths)  # the raylet, and so every worker, inherits it
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    try:
        ray.init(
            num_cpus=2,
            num_gpus=GPUS,
            object_store_memory=256 << 20,
            include_dashboard=False,
            configure_logging=False,
        )
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    yield ray
    ray.shutdown()


def new_pool(actors: int, **options: Any) -> Any:
    """A pool of simulated GPU actors reserving no CPU."""
    options.setdefault("backend", "sim")
    options.setdefault("num_cpus", 0)
    return aiocuda_ray.ActorPool(actors, **options)


def chunks(n: int, size: int = 4096, marked: tuple[int, ...] = ()) -> list[np.ndarray]:
    """``n`` float32 chunks, chunk ``i`` filled with ``i``; marked ones start with -1."""
    out = [np.full(size, i, np.float32) for i in range(n)]
    for i in marked:
        out[i][0] = -1
    return out


async def until(condition: Callable[[], Awaitable[bool]]) -> None:
    """Wait until ``condition()`` holds; the test's timeout bounds the wait. (A poll:
    the state is in other processes, with nothing to notify this one.)"""
    while True:
        if await condition():
            return
        await anyio.sleep(0.02)


async def reached(pool: Any, chunks: int) -> bool:
    """Whether ``chunks`` chunks (across the pool's actors) reached their pausing stage."""
    return sum(await pool.call(_stages.reached)) >= chunks


async def gone(actor: Any) -> bool:
    """Whether ``actor`` is gone, asked through its handle (its pool does not learn it)."""
    try:
        await _refs.result(actor.statistics.remote())
    except ray.exceptions.RayActorError:
        return True
    return False


def _shared_pool(actors: int) -> Iterator[Any]:
    pool = new_pool(actors)
    anyio.run(pool.wait_ready)
    yield pool
    pool.kill()  # no waiting: a failed test may have left a stream paused


@pytest.fixture(scope="package")
def pool2(ray_cluster: Any) -> Iterator[Any]:
    yield from _shared_pool(2)


@pytest.fixture(scope="package")
def pool4(ray_cluster: Any) -> Iterator[Any]:
    yield from _shared_pool(4)
