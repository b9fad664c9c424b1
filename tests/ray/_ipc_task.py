"""A Ray task for tests/ray/test_ipc.py: open a shared array in a Ray worker process."""

from __future__ import annotations

from typing import Any

import anyio
import numpy as np
import ray


@ray.remote(num_cpus=0)
def open_and_read(shared: Any) -> np.ndarray:
    """The shared array's contents, read in this worker (on the simulated backend)."""
    from aiocuda import _driver, ipc

    _driver.use_backend("sim", devices=2)

    async def read() -> np.ndarray:
        array = await ipc.open_array(shared)
        return await array.to_host()

    return anyio.run(read)
