"""A FastAPI app serving GPU work: request lanes, priorities, deadlines and dynamic batching.

    pip install fastapi uvicorn            # with aiocuda installed (see the README)
    uvicorn --app-dir examples serve_fastapi:app
    AIOCUDA_BACKEND=sim uvicorn --app-dir examples serve_fastapi:app

Endpoints (bodies are raw float32 values; results too):

* ``POST /affine`` -- ``2 x + 1`` on a request lane. ``X-Priority: high`` asks for a
  high-priority lane (served first when lanes are scarce; its kernels overtake normal work
  on the GPU); ``?deadline=0.5`` (seconds, above 0) answers 504 when the GPU has not
  finished in time (the lane goes back at once; its work finishes on the GPU and its
  memory is freed after).
* ``POST /affine/batched`` -- the same, but gathered with concurrent requests into one
  launch of up to 64 requests (``aiocuda.Batcher``): for many small requests. 503 with
  ``Retry-After`` when ``MAX_QUEUE`` requests already wait for a batch (overload).
* ``GET /health`` -- 200 while the GPU works (with the backend: ``cuda``, or ``sim`` where
  no GPU was found), 503 once a kernel fault poisoned it.

See ``serve_starlette.py`` for the plainest form and ``docs/serving.md`` for the why.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

import anyio
import anyio.to_thread
import numpy as np
from fastapi import FastAPI, Header, HTTPException, Query, Request, Response
from fastapi.responses import JSONResponse

from aiocuda import (
    Batcher,
    ClosedError,
    ContextPoisonedError,
    Kernel,
    Lanes,
    Program,
    QueueFullError,
    current_backend,
    register_sim_kernel,
)

SOURCE = r"""
extern "C" __global__ void affine(const float* x, float* y, int n, float a, float b) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + b;
}
"""
BLOCK = 256
MAX_QUEUE = 4096  # requests waiting for a batch before new ones are turned away (503)


def affine_on_the_simulator(launch: object, x: np.ndarray, y: np.ndarray, n: int, a: float, b: float) -> None:
    y[:n] = a * x[:n] + b


register_sim_kernel("affine", affine_on_the_simulator)


class GPU:
    """Everything the lifespan sets up once."""

    def __init__(self, lanes: Lanes, kernel: Kernel) -> None:
        self.lanes = lanes
        self.kernel = kernel
        self.batcher: Batcher[np.ndarray, np.ndarray] = Batcher(
            self.affine_batch, max_batch=64, max_delay=0.002, max_queue=MAX_QUEUE
        )

    async def affine_batch(self, items: list[np.ndarray]) -> list[np.ndarray]:
        """One batched stage: every request's values in one upload, launch and download."""
        sizes = [item.size for item in items]
        flat = np.concatenate(items)
        n = flat.size
        async with self.lanes.lease() as lane:
            x = lane.upload(flat)
            y = lane.empty(n)
            if n:
                self.kernel.launch((n + BLOCK - 1) // BLOCK, BLOCK, x, y, n, 2.0, 1.0, stream=lane.stream)
            out = lane.download(y)
            await lane
        return np.split(out, np.cumsum(sizes)[:-1])


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    module = await anyio.to_thread.run_sync(Program(SOURCE, name="affine.cu").compile)
    kernel = module.kernel("affine")
    await kernel.load(0)  # the module loaded off the loop, not by the first request
    async with Lanes(device=0, priorities=("normal", "high")) as lanes:
        gpu = GPU(lanes, kernel)
        async with gpu.batcher:
            app.state.gpu = gpu
            yield
        # uvicorn has let the requests in flight finish; the batcher ran what was
        # queued, then the lanes awaited and closed their streams.


app = FastAPI(lifespan=lifespan)


@app.exception_handler(ContextPoisonedError)
async def gpu_failed(request: Request, exc: ContextPoisonedError) -> JSONResponse:
    return JSONResponse({"error": f"the GPU failed: {exc}"}, status_code=503)


@app.exception_handler(QueueFullError)
async def overloaded(request: Request, exc: QueueFullError) -> JSONResponse:
    return JSONResponse({"error": "overloaded, retry later"}, status_code=503, headers={"Retry-After": "1"})


@app.exception_handler(ClosedError)
async def shutting_down(request: Request, exc: ClosedError) -> JSONResponse:
    return JSONResponse({"error": "the server is shutting down"}, status_code=503)


def values(body: bytes) -> np.ndarray:
    if len(body) % 4:
        raise HTTPException(400, "the body must be float32 values")
    return np.frombuffer(body, np.float32)


@app.post("/affine")
async def affine(
    request: Request,
    deadline: Annotated[float | None, Query(gt=0)] = None,  # seconds; nan, 0 or less: 422
    x_priority: Annotated[Literal["normal", "high"], Header()] = "normal",
) -> Response:
    gpu: GPU = request.app.state.gpu
    host = values(await request.body())
    n = host.size
    with anyio.move_on_after(deadline if deadline is not None else float("inf")) as scope:
        async with gpu.lanes.lease(priority=x_priority) as lane:
            x = lane.upload(host)
            y = lane.empty(n)
            if n:
                gpu.kernel.launch((n + BLOCK - 1) // BLOCK, BLOCK, x, y, n, 2.0, 1.0, stream=lane.stream)
            result = lane.download(y)
            await lane
    if scope.cancelled_caught:
        return JSONResponse({"error": f"the GPU did not finish within {deadline} s"}, status_code=504)
    return Response(result.tobytes(), media_type="application/octet-stream")


@app.post("/affine/batched")
async def affine_batched(request: Request) -> Response:
    gpu: GPU = request.app.state.gpu
    result = await gpu.batcher.submit(values(await request.body()))
    return Response(result.tobytes(), media_type="application/octet-stream")


@app.get("/health")
async def health(request: Request) -> Any:
    gpu: GPU = request.app.state.gpu
    if gpu.lanes.failure is not None:
        return JSONResponse({"status": "failed", "error": str(gpu.lanes.failure)}, status_code=503)
    stats = gpu.lanes.statistics()
    backend = current_backend().name
    return {"status": "ok", "backend": backend, "lanes": stats.lanes, "leased": stats.leased, "waiting": stats.waiting}


if __name__ == "__main__":
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=8000)
