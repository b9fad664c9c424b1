"""A plain Starlette app serving GPU work through request lanes.

    pip install starlette uvicorn          # with aiocuda installed (see the README)
    uvicorn --app-dir examples serve_starlette:app        # a real GPU if there is one
    AIOCUDA_BACKEND=sim uvicorn --app-dir examples serve_starlette:app

    python -c "import numpy as np, sys; sys.stdout.buffer.write(np.arange(8, dtype=np.float32).tobytes())" \\
        | curl -s --data-binary @- http://127.0.0.1:8000/affine | python -c \\
        "import numpy as np, sys; print(np.frombuffer(sys.stdin.buffer.read(), np.float32))"

POST /affine takes raw float32 values and returns ``2 x + 1`` of each, computed by a CUDA
kernel; GET /health says whether the GPU works. What to look at:

* the lifespan sets the GPU up once -- kernel compiled off the loop, lanes (streams,
  staging, the completion engine's state) made before the first request -- and on
  shutdown closes them only after uvicorn has let the requests in flight finish;
* a request leases a lane, enqueues its copy in, kernel and copy out, and awaits once;
* a kernel fault poisons the device: every pending request fails with 503 and a clear
  message, /health keeps answering and reports the GPU as failed (restart the worker).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio.to_thread
import numpy as np
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from aiocuda import ClosedError, ContextPoisonedError, Kernel, Lanes, Program, current_backend, register_sim_kernel

SOURCE = r"""
extern "C" __global__ void affine(const float* x, float* y, int n, float a, float b) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + b;
}
"""
BLOCK = 256


def affine_on_the_simulator(launch: object, x: np.ndarray, y: np.ndarray, n: int, a: float, b: float) -> None:
    """What the kernel computes, for the simulated backend (no GPU)."""
    y[:n] = a * x[:n] + b


register_sim_kernel("affine", affine_on_the_simulator)


@dataclass
class GPU:
    """What the lifespan sets up once and every request uses."""

    lanes: Lanes
    affine: Kernel


@contextlib.asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    # Compiling takes tens of milliseconds on a cache miss: never on the loop.
    module = await anyio.to_thread.run_sync(Program(SOURCE, name="affine.cu").compile)
    kernel = module.kernel("affine")
    await kernel.load(0)  # the module loaded off the loop, not by the first request
    async with Lanes(device=0) as lanes:
        app.state.gpu = GPU(lanes, kernel)
        yield
    # uvicorn runs this after the requests in flight have finished; leaving the block
    # awaited the lanes' streams and closed them.


async def affine(request: Request) -> Response:
    gpu: GPU = request.app.state.gpu
    body = await request.body()
    if len(body) % 4:
        return JSONResponse({"error": "the body must be float32 values"}, status_code=400)
    host = np.frombuffer(body, np.float32)
    n = host.size
    async with gpu.lanes.lease() as lane:  # waits while every lane is busy (back-pressure)
        x = lane.upload(host)  # enqueued; request-scoped device memory from the pool
        y = lane.empty(n)
        if n:
            gpu.affine.launch((n + BLOCK - 1) // BLOCK, BLOCK, x, y, n, 2.0, 1.0, stream=lane.stream)
        result = lane.download(y)  # enqueued; filled by the await
        await lane  # the one wait: the loop serves other requests meanwhile
    return Response(result.tobytes(), media_type="application/octet-stream")


async def health(request: Request) -> JSONResponse:
    gpu: GPU = request.app.state.gpu
    stats = gpu.lanes.statistics()
    if gpu.lanes.failure is not None:
        return JSONResponse({"status": "failed", "error": str(gpu.lanes.failure)}, status_code=503)
    backend = current_backend().name
    return JSONResponse(
        {"status": "ok", "backend": backend, "lanes": stats.lanes, "leased": stats.leased, "waiting": stats.waiting}
    )


async def gpu_failed(request: Request, exc: Any) -> JSONResponse:
    return JSONResponse({"error": f"the GPU failed: {exc}"}, status_code=503)


async def shutting_down(request: Request, exc: Any) -> JSONResponse:
    return JSONResponse({"error": "the server is shutting down"}, status_code=503)


app = Starlette(
    routes=[Route("/affine", affine, methods=["POST"]), Route("/health", health)],
    lifespan=lifespan,
    exception_handlers={ContextPoisonedError: gpu_failed, ClosedError: shutting_down},
)

if __name__ == "__main__":
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=8000)
