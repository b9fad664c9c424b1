"""A Ray Serve deployment whose replicas serve GPU work through aiocuda's request path.

    python examples/ray_serve.py        # a GPU, or a simulated one without a GPU

Needs Ray Serve (``pip install "ray[serve]"``). Each replica is a Ray actor given one GPU
(``CUDA_VISIBLE_DEVICES`` names it; without a GPU, a simulated device) running the
FastAPI app below, as ``serve_fastapi.py`` runs it under uvicorn, with the same lifespan
rules: Serve runs the app's lifespan in the replica, so

* start-up (before Serve routes traffic to the replica): compile the kernel off the
  loop, make the request lanes and start the batcher, so that no request pays for them;
* ``POST /affine``: a request leases a lane, enqueues its copy in, kernel and copy out,
  and awaits once; ``POST /affine/batched``: concurrent requests are gathered into one
  launch (``aiocuda.Batcher``); a body that is not float32 values is answered 400;
* shut-down (once Serve has drained the replica's requests): the batcher runs what is
  queued, then the lanes await their streams and close.

This script starts a local Ray, deploys the app on a free local port, sends requests
over HTTP (some at once, to fill a batch; some it refuses), checks the answers and shuts
everything down.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import socket
import urllib.error
import urllib.request
from collections.abc import AsyncIterator

import anyio.to_thread
import numpy as np
import ray
from fastapi import FastAPI, HTTPException, Request, Response
from ray import serve

import aiocuda
from aiocuda import Batcher, Kernel, Lanes, Program, register_sim_kernel

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


class GPU:
    """Everything the lifespan sets up once, in the replica."""

    def __init__(self, lanes: Lanes, kernel: Kernel) -> None:
        self.lanes = lanes
        self.kernel = kernel
        self.batcher: Batcher[np.ndarray, np.ndarray] = Batcher(self.affine_batch, max_batch=64, max_delay=0.002)

    async def affine(self, host: np.ndarray) -> np.ndarray:
        n = host.size
        async with self.lanes.lease() as lane:  # waits while every lane is busy
            x = lane.upload(host)
            y = lane.empty(n)
            if n:
                self.kernel.launch((n + BLOCK - 1) // BLOCK, BLOCK, x, y, n, 2.0, 1.0, stream=lane.stream)
            result = lane.download(y)
            await lane  # the one wait
        return result

    async def affine_batch(self, items: list[np.ndarray]) -> list[np.ndarray]:
        """Every request of the batch in one upload, launch and download."""
        out = await self.affine(np.concatenate(items))
        return np.split(out, np.cumsum([item.size for item in items])[:-1])


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    register_sim_kernel("affine", affine_on_the_simulator)
    module = await anyio.to_thread.run_sync(Program(SOURCE, name="affine.cu").compile)
    kernel = module.kernel("affine")
    await kernel.load(0)  # the module loaded off the loop, not by the first request
    async with Lanes(device=0) as lanes:  # device 0: the GPU Ray gave this replica
        gpu = GPU(lanes, kernel)
        async with gpu.batcher:
            app.state.gpu = gpu
            yield


app = FastAPI(lifespan=lifespan)


def values(body: bytes) -> np.ndarray:
    if len(body) % 4:
        raise HTTPException(400, "the body must be float32 values")
    return np.frombuffer(body, np.float32)


@app.post("/affine")
async def affine(request: Request) -> Response:
    result = await request.app.state.gpu.affine(values(await request.body()))
    return Response(result.tobytes(), media_type="application/octet-stream")


@app.post("/affine/batched")
async def affine_batched(request: Request) -> Response:
    result = await request.app.state.gpu.batcher.submit(values(await request.body()))
    return Response(result.tobytes(), media_type="application/octet-stream")


@serve.deployment(ray_actor_options={"num_gpus": 1, "num_cpus": 0}, max_ongoing_requests=128)
@serve.ingress(app)
class Affine:
    """A replica: the app above on one GPU."""


def post(url: str, x: np.ndarray) -> np.ndarray:
    with urllib.request.urlopen(url, data=x.tobytes(), timeout=60) as reply:
        return np.frombuffer(reply.read(), dtype=np.float32)


def refused(url: str, body: bytes) -> tuple[int, str]:
    """The status and message answered to a POST of ``body``, which the app refuses."""
    try:
        with urllib.request.urlopen(url, data=body, timeout=60) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    simulated = aiocuda.use_backend(os.environ.get("AIOCUDA_BACKEND", "auto")).name == "sim"
    ray.init(num_gpus=1 if simulated else None, include_dashboard=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(Affine.bind(), route_prefix="/")
        rng = np.random.default_rng(0)
        for size in (1, 1000, 1 << 18):
            x = rng.random(size, dtype=np.float32)
            assert np.allclose(post(f"http://127.0.0.1:{port}/affine", x), 2.0 * x + 1.0)
            print(f"/affine, {size} floats: ok")
        xs = [rng.random(int(n), dtype=np.float32) for n in rng.integers(1, 2000, 32)]
        with concurrent.futures.ThreadPoolExecutor(16) as pool:  # at once: batches fill
            ys = list(pool.map(lambda x: post(f"http://127.0.0.1:{port}/affine/batched", x), xs))
        assert all(np.allclose(y, 2.0 * x + 1.0) for x, y in zip(xs, ys, strict=True))
        print(f"/affine/batched, {len(xs)} requests at once: ok")
        for route in ("/affine", "/affine/batched"):
            status, message = refused(f"http://127.0.0.1:{port}{route}", b"abc")
            assert status == 400 and "float32" in message, (status, message)
        print("a body that is not float32 values: 400")
        serve.shutdown()
    finally:
        ray.shutdown()
    print("ok: every answer matches numpy")


if __name__ == "__main__":
    main()
