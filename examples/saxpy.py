"""SAXPY end to end: compile a kernel, copy data in, launch, await, copy the result out.

    python examples/saxpy.py                        # a real GPU if there is one
    AIOCUDA_BACKEND=sim python examples/saxpy.py    # the simulator, GPU or not

(with aiocuda installed: see the README). On a machine without a GPU the simulated
backend runs the kernel through the Python implementation registered below -- the same
code path, so this example (and your service's tests, see ``test_with_the_simulator.py``)
run anywhere.

The first run compiles with NVRTC (tens of milliseconds); later runs read the compiled
kernel from the on-disk cache (``~/.cache/aiocuda``).
"""

from __future__ import annotations

import asyncio

import numpy as np

from aiocuda import Stream
from aiocuda.array import empty, to_device
from aiocuda.kernel import register_sim_kernel
from aiocuda.program import Program

SOURCE = r"""
extern "C" __global__ void saxpy(float a, const float* x, const float* y, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a * x[i] + y[i];
}
"""


def saxpy_on_the_simulator(
    launch: object, a: np.float32, x: np.ndarray, y: np.ndarray, out: np.ndarray, n: int
) -> None:
    """What the kernel computes, for the simulated backend: pointers arrive as numpy arrays."""
    out[:n] = a * x[:n] + y[:n]


register_sim_kernel("saxpy", saxpy_on_the_simulator)


async def main() -> None:
    n = 1 << 20
    rng = np.random.default_rng(0)
    x = rng.random(n, dtype=np.float32)
    y = rng.random(n, dtype=np.float32)

    # Compiling blocks for a moment on a cache miss: do it off the event loop.
    module = await asyncio.to_thread(Program(SOURCE).compile)
    saxpy = module.kernel("saxpy")  # signature read from the source: (float, float*, float*, float*, int)

    with Stream() as stream:
        dx = await to_device(x, stream=stream)
        dy = await to_device(y, stream=stream)
        out = empty(n, np.float32, stream=stream)

        _, block = saxpy.suggested_block_size()
        grid = (n + block - 1) // block
        saxpy.launch(grid, block, 2.0, dx, dy, out, n, stream=stream)  # enqueues, returns at once
        await stream  # the loop keeps serving other tasks until the kernel is done

        result = await out.to_host(stream=stream)

    np.testing.assert_allclose(result, np.float32(2.0) * x + y, rtol=1e-6)
    print(f"saxpy on {n:,} floats: correct ({grid} blocks of {block} threads)")


if __name__ == "__main__":
    asyncio.run(main())
