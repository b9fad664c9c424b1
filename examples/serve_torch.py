"""A FastAPI app serving a PyTorch model, its ops on aiocuda request lanes, awaited.

    pip install fastapi uvicorn torch      # with aiocuda installed (see the README)
    uvicorn --app-dir examples serve_torch:app            # CUDA torch on a GPU
    AIOCUDA_BACKEND=sim uvicorn --app-dir examples serve_torch:app   # CPU torch

``POST /predict`` takes raw float32 rows of ``WIDTH`` values and returns the model's
output rows (float32). ``GET /health`` as in the other examples.

What it shows (``docs/serving.md`` explains each):

* the model is loaded once in the lifespan, and every lane runs it once there
  (``setup=warm``) on its own stream: PyTorch makes its per-stream state -- cuBLAS
  workspaces, allocator pools -- then, not on the event loop under the first requests;
* a request's PyTorch ops run on its lane's stream inside ``interop.torch_stream``; the
  input goes in with ``lane.upload`` and ``torch.from_dlpack`` (zero copy, ordered on the
  stream), the output out with ``lane.download``; then one ``await lane``: the loop serves
  other requests while the GPU works, and no thread blocks in ``synchronize``;
* once loaded, the start-up heap is frozen (``gc.freeze()``): the garbage collector's
  full collections no longer walk PyTorch's objects, which stalled the loop for about
  100 ms each;
* tensors made inside the block belong to the lane's stream, so dropping them at any
  time is safe; the lanes' streams live as long as the process (PyTorch keeps state for
  them), which is why there is one lane per request in flight, never a stream per request.

On the simulated backend (no GPU) the same code runs the model on the CPU, synchronously.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import torch
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from aiocuda import ClosedError, ContextPoisonedError, Lane, Lanes, current_backend, interop

WIDTH = 1024


def make_model(on_gpu: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH))
    if on_gpu:
        model = model.to("cuda", torch.float16)  # on PyTorch's own stream, once, at start-up
        torch.cuda.synchronize()
    return model.eval()


class Model:
    """The model and the lanes it runs on."""

    def __init__(self) -> None:
        self.lanes = Lanes(device=0, setup=self.warm)
        self.on_gpu = False
        self.model: torch.nn.Module | None = None

    def load(self, on_gpu: bool) -> None:
        self.on_gpu = on_gpu
        self.model = make_model(on_gpu)

    def warm(self, lane: Lane) -> None:
        """Run the model once on the lane's stream at start-up (Lanes awaits it after)."""
        self.forward(lane, np.zeros((1, WIDTH), np.float32))

    def forward(self, lane: Lane, host: np.ndarray) -> np.ndarray:
        """Enqueue the model on ``lane`` (nothing waits); the result is filled by ``await lane``."""
        assert self.model is not None
        with torch.inference_mode():
            if not self.on_gpu:  # the simulated backend: a CPU model, run here and now
                return np.asarray(self.model(torch.from_numpy(host.copy())).numpy(), np.float32)
            x = lane.upload(host)  # an aiocuda DeviceArray, on the lane's stream
            with interop.torch_stream(lane.stream):
                y = self.model(torch.from_dlpack(x).half()).float()  # ops enqueued on the lane's stream
                return lane.download(interop.as_device_array(y, stream=lane.stream))


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    served = Model()
    served.load(on_gpu=not current_backend().simulated)
    async with served.lanes:  # every lane warmed up before the first request
        app.state.served = served
        gc.collect()
        gc.freeze()  # PyTorch's heap out of every later collection (docs/serving.md)
        try:
            yield
        finally:
            gc.unfreeze()  # for a process that goes on after the app (a test's)


app = FastAPI(lifespan=lifespan)


@app.exception_handler(ContextPoisonedError)
async def gpu_failed(request: Request, exc: ContextPoisonedError) -> JSONResponse:
    return JSONResponse({"error": f"the GPU failed: {exc}"}, status_code=503)


@app.exception_handler(ClosedError)
async def shutting_down(request: Request, exc: ClosedError) -> JSONResponse:
    return JSONResponse({"error": "the server is shutting down"}, status_code=503)


@app.post("/predict")
async def predict(request: Request) -> Response:
    served: Model = request.app.state.served
    body = await request.body()
    if len(body) % (4 * WIDTH):
        return JSONResponse({"error": f"the body must be rows of {WIDTH} float32 values"}, status_code=400)
    host = np.frombuffer(body, np.float32).reshape(-1, WIDTH)
    async with served.lanes.lease() as lane:
        result = served.forward(lane, host)
        await lane  # the one wait
    return Response(result.tobytes(), media_type="application/octet-stream")


@app.get("/health")
async def health(request: Request) -> Any:
    served: Model = request.app.state.served
    if served.lanes.failure is not None:
        return JSONResponse({"status": "failed", "error": str(served.lanes.failure)}, status_code=503)
    return {"status": "ok", "device": "cuda" if served.on_gpu else "cpu (simulated backend)"}


if __name__ == "__main__":
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=8000)
