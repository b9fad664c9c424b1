"""A pipeline over every GPU: upload chunks, run a kernel on each, download the results.

    python examples/pipeline.py [TRACE.json]   # every GPU, or the simulator without one

(with aiocuda installed: see the README). The trace goes to TRACE.json, by default
``aiocuda-pipeline-trace.json`` in the system's temporary folder; open it in
https://ui.perfetto.dev to see the copies and kernels of every device overlap.

The stage is a plain function: it gets a context (``ctx.stream``: where to enqueue;
``ctx.empty``: chunk-scoped device memory) and the chunk already on the device, enqueues
kernels, and returns the array to download (or None: the input, changed in place). The
executor orders upload -> stage -> download with events between streams, keeps a bounded
number of chunks in flight, and yields the results here as they arrive.
"""

from __future__ import annotations

import pathlib
import sys
import tempfile

import anyio
import numpy as np

from aiocuda.array import DeviceArray
from aiocuda.executor import ChunkContext, Executor
from aiocuda.host import pinned_empty
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


async def main(trace_file: pathlib.Path) -> None:
    register_sim_kernel("saxpy", saxpy_sim)
    saxpy = Program(SOURCE).compile().kernel("saxpy")

    def stage(ctx: ChunkContext, x: DeviceArray) -> DeviceArray:
        y = ctx.empty(x.shape, x.dtype)  # freed for us once the chunk's download has completed
        saxpy.launch((x.size + 255) // 256, 256, 2.0, x, y, x.size, stream=ctx.stream)
        return y

    chunks, n = 16, 1 << 18
    inputs = pinned_empty((chunks, n), np.float32)  # pinned: full-speed, truly async copies
    inputs[:] = np.random.default_rng(0).random((chunks, n), dtype=np.float32)
    outputs = pinned_empty((chunks, n), np.float32)

    async with Executor(trace=True) as ex:
        async with ex.map(stage, inputs, output=lambda i, _: outputs[i], ordered=False) as results:
            async for r in results:
                print(f"chunk {r.index:2d} done on device {r.device}")
        assert ex.trace is not None
        print(ex.trace.summary().table())
        ex.trace.write_chrome(trace_file)
    assert np.allclose(outputs, 2.0 * inputs + 1.0)
    print(f"ok: results match numpy; trace in {trace_file}")


if __name__ == "__main__":
    default = pathlib.Path(tempfile.gettempdir(), "aiocuda-pipeline-trace.json")
    anyio.run(main, pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else default)
