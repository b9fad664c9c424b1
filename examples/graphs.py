"""CUDA graphs: capture a request's kernels once, replay them with one launch, point the
graph at new memory, and run a pipeline in graph mode.

    python examples/graphs.py                        # a real GPU if there is one
    AIOCUDA_BACKEND=sim python examples/graphs.py    # the simulator, GPU or not

(with aiocuda installed: see the README). What a capture can hold and what raises
``CaptureError`` is in ``aiocuda.graph``'s documentation.
"""

from __future__ import annotations

import asyncio

import numpy as np

import aiocuda
from aiocuda.executor import Executor
from aiocuda.kernel import register_sim_kernel
from aiocuda.program import Program

SOURCE = r"""
extern "C" __global__ void affine(float* x, float a, float b, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = a * x[i] + b;
}
"""
N = 1 << 16
BLOCK = 256
GRID = (N + BLOCK - 1) // BLOCK
LAYERS = 8


def affine_on_the_simulator(launch: object, x: np.ndarray, a: np.float32, b: np.float32, n: int) -> None:
    x[:n] = a * x[:n] + b


register_sim_kernel("affine", affine_on_the_simulator)


def reference(host: np.ndarray) -> np.ndarray:
    out = host.astype(np.float32)
    for _ in range(LAYERS):
        out = np.float32(1.5) * out + np.float32(1.0)
    return out


async def main() -> None:
    module = await asyncio.to_thread(Program(SOURCE).compile)
    affine = module.kernel("affine")
    affine.function(0)  # load the module now: a module cannot be loaded during a capture

    with aiocuda.Stream() as stream:
        host_in = aiocuda.pinned_empty(N, np.float32)  # graphs copy page-locked memory
        host_out = aiocuda.pinned_empty(N, np.float32)

        # Capture: nothing runs; the block's work becomes the graph's nodes.
        async with stream.capture() as graph:
            x = aiocuda.empty(N, np.float32, stream=stream)  # graph memory, at the same address every replay
            await x.copy_from(host_in, stream=stream)  # returns once recorded
            for _ in range(LAYERS):
                affine.launch(GRID, BLOCK, x, 1.5, 1.0, N, stream=stream)
            await x.to_host(out=host_out, stream=stream)  # each replay fills host_out
        print(graph)

        # Replay: one launch for the two copies and the eight kernels.
        for value in (0.0, 1.0, 2.0):
            host_in[:] = value
            await graph.launch(stream)
            np.testing.assert_allclose(host_out, reference(host_in), rtol=1e-5)

        # New memory for later replays: every node that used host_in / host_out moves.
        other_in = aiocuda.pinned_empty(N, np.float32)
        other_in[:] = np.arange(N, dtype=np.float32) % 7
        other_out = aiocuda.pinned_empty(N, np.float32)
        graph.rebind([(host_in, other_in), (host_out, other_out)])
        await graph.launch(stream)
        np.testing.assert_allclose(other_out, reference(other_in), rtol=1e-5)
        graph.close()

    # A pipeline in graph mode: the stage is captured once per device and lane, and
    # every further chunk is a replay with its own addresses.
    def stage(ctx: aiocuda.ChunkContext, chunk: aiocuda.DeviceArray) -> None:
        for _ in range(LAYERS):
            affine.launch(GRID, BLOCK, chunk, 1.5, 1.0, N, stream=ctx.stream)

    chunks = aiocuda.pinned_empty((32, N), np.float32)
    chunks[:] = np.random.default_rng(0).random(chunks.shape, dtype=np.float32)
    async with Executor(trace=True) as ex:
        results = await ex.run(stage, chunks, graph=True)
        assert ex.trace is not None
        replays = sum(1 for span in ex.trace.spans if span.unit == "graph")
    for host, result in zip(chunks, results, strict=True):
        np.testing.assert_allclose(result, reference(host), rtol=1e-5)
    print(f"graph: three replays and a rebind correct; pipeline: {len(chunks)} chunks, {replays} replayed")


if __name__ == "__main__":
    asyncio.run(main())
