"""A shared array's descriptor travels through Ray like any object and opens in a worker."""

from __future__ import annotations

from typing import Any

import anyio
import numpy as np

import aiocuda
from aiocuda import _driver, ipc

from ._ipc_task import open_and_read


def test_a_shared_array_opens_in_a_ray_worker(ray_cluster: Any, sim_backend: _driver.Driver) -> None:
    values = np.arange(4096, dtype=np.float64)

    async def share() -> ipc.SharedArray:
        array = await aiocuda.to_device(values, pool=ipc.pool(0))
        return ipc.share_array(array)  # the array goes; the export keeps its memory

    shared = anyio.run(share)
    np.testing.assert_array_equal(ray_cluster.get(open_and_read.remote(shared), timeout=300), values)
