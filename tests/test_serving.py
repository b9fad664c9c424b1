"""The examples' web apps under a real uvicorn server on 127.0.0.1, with httpx clients.

Each test runs the server in its own event loop task (asyncio and uvloop: uvicorn does not
run on trio) on the simulated backend, and decides what is in flight with the simulator's
controls: lane streams held (so requests stay on the GPU until released) and a poisoned
device (a kernel fault). Waits for a state ("10 requests hold a lane") poll for it with a
generous bound; no outcome depends on how long anything takes.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import pathlib
import socket
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import numpy as np
import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("httpx")
pytest.importorskip("fastapi")

import httpx
import uvicorn

from aiocuda import current_backend
from aiocuda.device import Device
from aiocuda.lanes import Lanes
from aiocuda.memory import MemoryPool

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"

pytestmark = pytest.mark.anyio


@pytest.fixture(
    params=[
        pytest.param(("asyncio", {"use_uvloop": False}), id="asyncio"),
        pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    if request.param[1]["use_uvloop"]:
        pytest.importorskip("uvloop")
    return request.param


def example(name: str) -> Any:
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    return importlib.import_module(name)


@pytest.fixture(params=["serve_starlette", "serve_fastapi"])
def app_module(request: pytest.FixtureRequest, sim_backend: Any) -> Any:
    return example(request.param)


async def until(condition: Callable[[], bool], what: str) -> None:
    """Poll ``condition`` until it holds (bounded, so a bug fails rather than hangs)."""
    with anyio.fail_after(60):
        while not condition():  # noqa: ASYNC110 - the state lives in another task's objects
            await anyio.sleep(0.002)


class Served:
    """A running server: its URL, the uvicorn server and the app's GPU state."""

    def __init__(self, server: uvicorn.Server, url: str, app: Any) -> None:
        self.server = server
        self.url = url
        self.app = app

    @property
    def lanes(self) -> Lanes:
        lanes: Lanes = self.app.state.gpu.lanes
        return lanes


@contextlib.asynccontextmanager
async def serving(app: Any) -> AsyncIterator[Served]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, lifespan="on", log_level="warning", timeout_graceful_shutdown=None)
    server = uvicorn.Server(config)
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.serve, [sock])
        await until(lambda: server.started, "the server started")
        try:
            yield Served(server, f"http://127.0.0.1:{port}", app)
        finally:
            server.should_exit = True
    sock.close()


def used_bytes() -> int:
    gc.collect()
    return MemoryPool.for_device(Device(0)).statistics().used_bytes


def hold_all(sim: Any, lanes: Lanes) -> None:
    for lane in lanes.lanes:
        for stream in lane.streams:
            sim.pause(stream.handle)


def release_all(sim: Any, lanes: Lanes) -> None:
    for lane in lanes.lanes:
        for stream in lane.streams:
            sim.resume(stream.handle)


async def idle(lanes: Lanes) -> None:
    for lane in lanes.lanes:
        for stream in lane.streams:
            await stream


def body(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random(n, dtype=np.float32)


def decoded(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    return np.frombuffer(response.content, np.float32)


@pytest.fixture(params=["serve_starlette", "serve_fastapi"])
def any_backend_app(request: pytest.FixtureRequest, backend: Any) -> Any:
    return example(request.param)


async def test_concurrent_requests_and_health(any_backend_app: Any, anyio_backend: Any) -> None:
    async with serving(any_backend_app.app) as served, httpx.AsyncClient(base_url=served.url) as client:
        inputs = [body(100 + 37 * i, seed=i) for i in range(24)]
        results: dict[int, np.ndarray] = {}

        async def one(i: int) -> None:
            results[i] = decoded(await client.post("/affine", content=inputs[i].tobytes()))

        async with anyio.create_task_group() as tg:
            for i in range(len(inputs)):
                tg.start_soon(one, i)
        for i, host in enumerate(inputs):
            np.testing.assert_allclose(results[i], 2 * host + 1, rtol=1e-6)
        health = (await client.get("/health")).json()
        assert health["status"] == "ok" and health["leased"] == 0
        assert health["backend"] == current_backend().name  # (sim: say so, not "ok" alone)
        torn = await client.post("/affine", content=b"\0" * 10)  # not float32 values
        assert torn.status_code == 400 and "float32" in torn.text


async def test_a_client_disconnecting_mid_request_leaks_nothing(
    app_module: Any, sim_backend: Any, anyio_backend: Any
) -> None:
    async with serving(app_module.app) as served, httpx.AsyncClient(base_url=served.url) as client:
        await client.post("/affine", content=body(64).tobytes())  # warm: pools settle
        await idle(served.lanes)
        baseline = used_bytes()
        hold_all(sim_backend, served.lanes)
        with anyio.CancelScope() as scope:

            async def gone_when_on_gpu() -> None:
                await until(lambda: served.lanes.statistics().leased == 1, "the request holds a lane")
                scope.cancel()  # the client goes away: its connection closes

            async with httpx.AsyncClient(base_url=served.url) as leaving, anyio.create_task_group() as tg:
                tg.start_soon(gone_when_on_gpu)
                await leaving.post("/affine", content=body(1000).tobytes())
        assert scope.cancelled_caught
        release_all(sim_backend, served.lanes)
        await until(lambda: served.lanes.statistics().leased == 0, "the lane came back")
        await idle(served.lanes)
        assert used_bytes() == baseline
        host = body(10)
        np.testing.assert_allclose(decoded(await client.post("/affine", content=host.tobytes())), 2 * host + 1)


async def test_a_request_cancelled_by_its_deadline_returns_its_lane(sim_backend: Any, anyio_backend: Any) -> None:
    app = example("serve_fastapi").app
    async with serving(app) as served, httpx.AsyncClient(base_url=served.url) as client:
        await client.post("/affine", content=body(64).tobytes())
        await idle(served.lanes)
        baseline = used_bytes()
        hold_all(sim_backend, served.lanes)  # the GPU never finishes in time
        response = await client.post("/affine", params={"deadline": 0.05}, content=body(1000).tobytes())
        assert response.status_code == 504 and "did not finish" in response.json()["error"]
        assert served.lanes.statistics().leased == 0  # back at once, its work still queued
        release_all(sim_backend, served.lanes)
        await idle(served.lanes)
        assert used_bytes() == baseline
        high = await client.post("/affine", headers={"X-Priority": "high"}, content=body(8).tobytes())
        np.testing.assert_allclose(decoded(high), 2 * body(8) + 1)


async def test_a_deadline_that_is_not_a_positive_number_is_refused(sim_backend: Any, anyio_backend: Any) -> None:
    app = example("serve_fastapi").app
    async with serving(app) as served, httpx.AsyncClient(base_url=served.url) as client:
        for deadline in ("nan", "0", "-1"):  # nan was a 500 (anyio refuses a NaN deadline)
            response = await client.post("/affine", params={"deadline": deadline}, content=body(8).tobytes())
            assert response.status_code == 422, (deadline, response.text)
        assert served.lanes.statistics().leased == 0
        ok = await client.post("/affine", params={"deadline": "inf"}, content=body(8).tobytes())
        np.testing.assert_allclose(decoded(ok), 2 * body(8) + 1)


async def test_a_kernel_fault_fails_pending_requests_and_health_reports_it(
    app_module: Any, sim_backend: Any, anyio_backend: Any
) -> None:
    async with serving(app_module.app) as served, httpx.AsyncClient(base_url=served.url) as client:
        hold_all(sim_backend, served.lanes)
        responses: list[httpx.Response] = []

        async def one(i: int) -> None:
            responses.append(await client.post("/affine", content=body(100, seed=i).tobytes()))

        async with anyio.create_task_group() as tg:
            for i in range(10):
                tg.start_soon(one, i)
            await until(lambda: served.lanes.statistics().leased == 10, "ten requests on the GPU")
            sim_backend.poison(0)  # a kernel fault: the context is poisoned
        assert len(responses) == 10
        for response in responses:
            assert response.status_code == 503
            assert "the GPU failed" in response.json()["error"]
        health = await client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "failed"
        later = await client.post("/affine", content=body(10).tobytes())
        assert later.status_code == 503 and "failed earlier" in later.json()["error"]


async def test_shutdown_lets_requests_in_flight_finish(app_module: Any, sim_backend: Any, anyio_backend: Any) -> None:
    inputs = [body(200, seed=i) for i in range(5)]
    results: dict[int, np.ndarray] = {}
    async with serving(app_module.app) as served, httpx.AsyncClient(base_url=served.url) as client:
        lanes = served.lanes
        hold_all(sim_backend, lanes)

        async def one(i: int) -> None:
            results[i] = decoded(await client.post("/affine", content=inputs[i].tobytes()))

        async with anyio.create_task_group() as tg:
            for i in range(len(inputs)):
                tg.start_soon(one, i)
            await until(lambda: lanes.statistics().leased == len(inputs), "every request on the GPU")
            served.server.should_exit = True  # as on SIGTERM: stop accepting, let these finish
            await anyio.sleep(0.2)  # uvicorn is now shutting down and waiting for them
            assert lanes.statistics().leased == len(inputs) and not results
            release_all(sim_backend, lanes)
    for i, host in enumerate(inputs):
        np.testing.assert_allclose(results[i], 2 * host + 1, rtol=1e-6)
    assert all(stream.closed for lane in lanes.lanes for stream in lane.streams)


async def test_batched_endpoint_gathers_concurrent_requests(sim_backend: Any, anyio_backend: Any) -> None:
    app = example("serve_fastapi").app
    async with serving(app) as served, httpx.AsyncClient(base_url=served.url) as client:
        inputs = [body(10 + i, seed=i) for i in range(20)]
        results: dict[int, np.ndarray] = {}

        async def one(i: int) -> None:
            results[i] = decoded(await client.post("/affine/batched", content=inputs[i].tobytes()))

        async with anyio.create_task_group() as tg:
            for i in range(len(inputs)):
                tg.start_soon(one, i)
        for i, host in enumerate(inputs):
            np.testing.assert_allclose(results[i], 2 * host + 1, rtol=1e-6)
        batcher = served.app.state.gpu.batcher
        assert batcher.statistics().items == len(inputs)


async def test_the_torch_example_serves_its_model(backend: Any, anyio_backend: Any) -> None:
    torch = pytest.importorskip("torch")  # CPU-only PyTorch on the simulator, CUDA on a GPU
    module = example("serve_torch")
    async with serving(module.app) as served, httpx.AsyncClient(base_url=served.url) as client:
        assert gc.get_freeze_count() > 0  # the start-up heap, out of the collector's way
        model = served.app.state.served.model
        rng = np.random.default_rng(0)
        inputs = [rng.random((1 + i % 4, module.WIDTH), dtype=np.float32) for i in range(16)]
        results: dict[int, np.ndarray] = {}

        async def one(i: int) -> None:
            results[i] = decoded(await client.post("/predict", content=inputs[i].tobytes()))

        async with anyio.create_task_group() as tg:
            for i in range(len(inputs)):
                tg.start_soon(one, i)
        with torch.inference_mode():
            for i, host in enumerate(inputs):
                x = torch.from_numpy(host)
                if served.app.state.served.on_gpu:
                    x = x.to("cuda", torch.float16)
                expected = model(x).float().cpu().numpy()
                np.testing.assert_allclose(results[i].reshape(expected.shape), expected, rtol=2e-2, atol=2e-2)
        assert (await client.get("/health")).json()["status"] == "ok"
    assert gc.get_freeze_count() == 0  # given back at shut-down


async def test_the_batched_endpoint_turns_requests_away_once_its_queue_is_full(
    sim_backend: Any, anyio_backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Overload: with both batches on a stalled GPU and MAX_QUEUE requests waiting, the
    next one is answered 503 with Retry-After at once; those waiting are served later."""
    module = example("serve_fastapi")
    monkeypatch.setattr(module, "MAX_QUEUE", 3)
    async with serving(module.app) as served, httpx.AsyncClient(base_url=served.url) as client:
        batcher = served.app.state.gpu.batcher
        hold_all(sim_backend, served.lanes)
        inputs = [body(10 + i, seed=i) for i in range(5)]
        results: dict[int, np.ndarray] = {}

        async def one(i: int) -> None:
            results[i] = decoded(await client.post("/affine/batched", content=inputs[i].tobytes()))

        async with anyio.create_task_group() as tg:
            for i, (field, count) in enumerate([("running", 1), ("running", 2), ("queued", 1), ("queued", 2)]):
                tg.start_soon(one, i)
                await until(lambda f=field, c=count: getattr(batcher.statistics(), f) == c, f"{field} {count}")
            tg.start_soon(one, 4)
            await until(lambda: batcher.statistics().queued == 3, "three waiting")
            refused = await client.post("/affine/batched", content=body(8).tobytes())
            assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
            assert "overloaded" in refused.json()["error"] and batcher.statistics().rejected == 1
            release_all(sim_backend, served.lanes)
        for i, host in enumerate(inputs):
            np.testing.assert_allclose(results[i], 2 * host + 1, rtol=1e-6)
