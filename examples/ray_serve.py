"""A Ray Serve deployment whose replicas run requests on the GPU through aiocuda.

    python examples/ray_serve.py        # a GPU, or a simulated one without a GPU

Needs Ray Serve (``pip install "ray[serve]"``). Each replica is a Ray actor given one GPU
(``CUDA_VISIBLE_DEVICES`` names it; without a GPU, a simulated device). The lifespan
rules of aiocuda's web examples hold:

* start-up (the replica's async constructor, which Serve awaits before routing traffic
  to it): compile the kernel and open the :class:`~aiocuda.executor.Executor`, so that no
  request pays for either, and nothing is created at import;
* a request is one ``await executor.submit(stage, x)``: upload, kernel, download on the
  executor's streams, overlapping with the replica's other requests, the loop never
  blocked (Serve runs up to ``max_ongoing_requests`` of them at once on it);
* shut-down (the async ``__del__``, which Serve awaits once the replica's requests are
  drained): close the executor, which waits for the GPU work it enqueued.

The batching request path of ``aiocuda.executor`` is not used here yet: each request is
one chunk through ``Executor.submit``.

This script starts a local Ray, deploys the app on a free local port, sends a few
requests over HTTP, checks the answers and shuts everything down.
"""

from __future__ import annotations

import os
import socket
import urllib.request

import numpy as np
import ray
from ray import serve
from starlette.requests import Request
from starlette.responses import Response

import aiocuda
from aiocuda.array import DeviceArray
from aiocuda.executor import ChunkContext, Executor
from aiocuda.kernel import register_sim_kernel
from aiocuda.program import Program

SOURCE = r"""
extern "C" __global__ void affine(float a, float b, float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = a * x[i] + b;
}
"""


def affine_sim(launch: object, a: np.float32, b: np.float32, x: np.ndarray, n: np.int32) -> None:
    """What the kernel does, for the simulated backend (used only there)."""
    x[: int(n)] = a * x[: int(n)] + b


@serve.deployment(ray_actor_options={"num_gpus": 1, "num_cpus": 0}, max_ongoing_requests=64)
class Affine:
    """``POST`` float32 bytes, get ``a x + b`` back as float32 bytes."""

    async def __init__(self, a: float, b: float) -> None:
        register_sim_kernel("affine", affine_sim)
        self.a, self.b = a, b
        self.kernel = Program(SOURCE, name="affine.cu").compile().kernel("affine")
        self.executor = Executor()  # the GPU Ray gave this replica
        await self.executor.__aenter__()

    def stage(self, ctx: ChunkContext, x: DeviceArray) -> None:
        self.kernel.launch((x.size + 255) // 256, 256, self.a, self.b, x, x.size, stream=ctx.stream)

    async def __call__(self, request: Request) -> Response:
        x = np.frombuffer(await request.body(), dtype=np.float32)
        if x.size == 0:
            return Response("send float32 bytes", status_code=400)
        y = await self.executor.submit(self.stage, x)
        return Response(y.tobytes(), media_type="application/octet-stream")

    async def __del__(self) -> None:
        await self.executor.__aexit__(None, None, None)


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
        serve.run(Affine.bind(2.0, 1.0), route_prefix="/affine")
        rng = np.random.default_rng(0)
        for size in (1, 1000, 1 << 18):
            x = rng.random(size, dtype=np.float32)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/affine", data=x.tobytes(), timeout=60) as reply:
                y = np.frombuffer(reply.read(), dtype=np.float32)
            assert np.allclose(y, 2.0 * x + 1.0), f"wrong answer for {size} floats"
            print(f"{size} floats: ok")
        serve.shutdown()
    finally:
        ray.shutdown()
    print("ok: every answer matches numpy")


if __name__ == "__main__":
    main()
