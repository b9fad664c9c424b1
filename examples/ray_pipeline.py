"""The pipeline example on Ray: a GPU actor per GPU, each with its own executor.

    python examples/ray_pipeline.py     # every GPU, or two simulated ones without a GPU

Needs Ray (``pip install aiocuda[ray]``). The stage is a class: each actor makes one
instance, which compiles the kernel once (through the on-disk compile cache, shared by
the actors of a machine), and calls it for every chunk the actor gets. Inputs travel
through Ray's object store; results come back as read-only arrays in it. The same code
runs on a cluster of machines: start Ray there, and ``ray.init(address="auto")``.
"""

from __future__ import annotations

import os

import anyio
import numpy as np
import ray

import aiocuda
import aiocuda.ray
from aiocuda.array import DeviceArray
from aiocuda.executor import ChunkContext
from aiocuda.kernel import register_sim_kernel
from aiocuda.program import Program

SOURCE = r"""
extern "C" __global__ void saxpy(float a, const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + 1.0f;
}
"""


def saxpy_sim(launch: object, a: np.float32, x: np.ndarray, y: np.ndarray, n: np.int32) -> None:
    """What the kernel does, for the simulated backend (used only there)."""
    y[: int(n)] = a * x[: int(n)] + np.float32(1.0)


class Saxpy:
    """``y = a x + 1`` for each chunk; made once per actor."""

    def __init__(self, a: float) -> None:
        register_sim_kernel("saxpy", saxpy_sim)
        self.a = a
        self.kernel = Program(SOURCE).compile().kernel("saxpy")

    def __call__(self, ctx: ChunkContext, x: DeviceArray) -> DeviceArray:
        y = ctx.empty(x.shape, x.dtype)
        self.kernel.launch((x.size + 255) // 256, 256, self.a, x, y, x.size, stream=ctx.stream)
        return y


async def main(actors: int) -> None:
    chunks = np.random.default_rng(0).random((32, 1 << 18), dtype=np.float32)
    async with aiocuda.ray.ActorPool(actors) as pool:  # one GPU each; ended on leaving
        async with aiocuda.ray.map(Saxpy, chunks, actors=pool, stage_args=(2.0,), ordered=False) as results:
            async for r in results:
                assert np.allclose(r.value, 2.0 * chunks[r.index] + 1.0)
                print(f"chunk {r.index:2d} done on actor {r.device}")
        for stats in await pool.statistics():
            assert stats is not None
            print(f"actor pid {stats.pid} on {', '.join(stats.devices)}: {stats.completed} chunks")
    print("ok: results match numpy")


if __name__ == "__main__":
    simulated = aiocuda.use_backend(os.environ.get("AIOCUDA_BACKEND", "auto")).name == "sim"
    # Without a GPU, declare two to Ray: each actor then gets a simulated one.
    ray.init(num_gpus=2 if simulated else None, include_dashboard=False)
    try:
        anyio.run(main, int(ray.cluster_resources()["GPU"]))
    finally:
        ray.shutdown()
