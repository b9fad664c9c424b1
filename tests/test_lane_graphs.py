"""The request path's graphs (``Lane.replay``): a request's device work captured once per
lane and replayed per request, on the simulator and on a GPU where there is one."""

from __future__ import annotations

import logging
import warnings
from types import SimpleNamespace
from typing import Any

import anyio
import numpy as np
import pytest

from aiocuda import _driver
from aiocuda._cli.workload import ScaleStage, scale_reference
from aiocuda.errors import BlockingCallWarning
from aiocuda.lanes import Lane, Lanes

pytestmark = pytest.mark.anyio

REPS = 20
N = 4096


def setup(lane: Lane) -> SimpleNamespace:
    """The lane's own memory: what every replay of its graph works on."""
    return SimpleNamespace(x=lane.empty(N, np.float32))


class Model:
    """A request's device work: ``scale`` twice in place on the lane's array."""

    def __init__(self) -> None:
        self.scale = ScaleStage(REPS)
        self.calls = 0

    def __call__(self, lane: Lane) -> None:
        self.calls += 1
        x = lane.state.x
        for _ in range(2):
            self.scale.kernel.launch((N + 255) // 256, 256, x, N, REPS, stream=lane.stream)


async def test_requests_replay_their_lane_graph(backend: _driver.Driver, anyio_backend: Any) -> None:
    model = Model()
    rng = np.random.default_rng(0)
    inputs = [rng.random(N, dtype=np.float32) for _ in range(24)]
    results: dict[int, np.ndarray] = {}

    async def request(i: int, lanes: Lanes) -> None:
        async with lanes.lease() as lane:
            lane.upload(inputs[i], out=lane.state.x)
            lane.replay(model)
            results[i] = lane.download(lane.state.x)
            await lane

    async with Lanes(count=3, setup=setup) as lanes:
        async with anyio.create_task_group() as tg:
            for i in range(len(inputs)):
                tg.start_soon(request, i, lanes)
        graphs = [g for lane in lanes.lanes for g in lane._graphs.values()]
    for i, host in enumerate(inputs):
        np.testing.assert_allclose(results[i], scale_reference(scale_reference(host, REPS), REPS), rtol=1e-4)
    assert model.calls <= 2 * 3  # per lane: once as it is, once captured; the rest replayed
    assert graphs and all(not isinstance(g, str) for g in graphs)


async def test_keys_capture_variants(backend: _driver.Driver, anyio_backend: Any) -> None:
    scale = ScaleStage(REPS)

    def first_half(lane: Lane) -> None:
        x, n = lane.state.x, N // 2
        scale.kernel.launch((n + 255) // 256, 256, x, n, REPS, stream=lane.stream)

    async with Lanes(count=1, setup=setup) as lanes:
        for key in ("a", "a", "a", "b", "b", "b"):
            async with lanes.lease() as lane:
                host = np.ones(N, np.float32)
                lane.upload(host, out=lane.state.x)
                lane.replay(first_half, key=key)
                out = lane.download(lane.state.x)
                await lane
            np.testing.assert_allclose(out[: N // 2], scale_reference(host[: N // 2], REPS), rtol=1e-4)
            np.testing.assert_array_equal(out[N // 2 :], 1.0)
        assert sorted(lanes.lanes[0]._graphs) == [(first_half, "a"), (first_half, "b")]


async def test_work_that_cannot_be_captured_runs_as_it_is(
    backend: _driver.Driver, anyio_backend: Any, caplog: pytest.LogCaptureFixture
) -> None:
    scale = ScaleStage(REPS)

    def synchronizing(lane: Lane) -> None:
        x = lane.state.x
        scale.kernel.launch((N + 255) // 256, 256, x, N, REPS, stream=lane.stream)
        with warnings.catch_warnings():  # the host wait is the point: it cannot be captured
            warnings.simplefilter("ignore", BlockingCallWarning)
            lane.stream.synchronize()

    caplog.set_level(logging.WARNING, logger="aiocuda")
    async with Lanes(count=1, setup=setup) as lanes:
        for _ in range(4):
            async with lanes.lease() as lane:
                host = np.full(N, 2.0, np.float32)
                lane.upload(host, out=lane.state.x)
                lane.replay(synchronizing)
                out = lane.download(lane.state.x)
                await lane
            np.testing.assert_allclose(out, scale_reference(host, REPS), rtol=1e-4)
    assert sum("could not be captured" in record.message for record in caplog.records) == 1


async def test_a_lanes_pageable_copies_in_replayed_work_run_as_they_are(
    backend: _driver.Driver, anyio_backend: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A lane's copy of pageable memory inside the work is not captured (a replay would
    repeat the device half of it, not the host half: every request got the first one's
    data): the work runs as it is, with the usual warning, and each request gets its own."""
    scale = ScaleStage(REPS)

    def copies_inside(lane: Lane) -> None:
        lane.upload(lane.state.host, out=lane.state.x)
        scale.kernel.launch((N + 255) // 256, 256, lane.state.x, N, REPS, stream=lane.stream)
        lane.download(lane.state.x, out=lane.state.out)

    def own_host_arrays(lane: Lane) -> SimpleNamespace:
        return SimpleNamespace(x=lane.empty(N, np.float32), host=np.zeros(N, np.float32), out=np.zeros(N, np.float32))

    caplog.set_level(logging.WARNING, logger="aiocuda")
    async with Lanes(count=1, setup=own_host_arrays) as lanes:
        for i in range(4):
            async with lanes.lease() as lane:
                lane.state.host[:] = i
                lane.replay(copies_inside)
                await lane
                np.testing.assert_allclose(lane.state.out, scale_reference(lane.state.host, REPS), rtol=1e-4)
    assert sum("pageable host memory cannot be captured" in record.message for record in caplog.records) == 1


async def test_a_work_function_made_per_request_is_not_kept_forever(
    backend: _driver.Driver, anyio_backend: Any, caplog: pytest.LogCaptureFixture
) -> None:
    from aiocuda._executor.lane_graphs import MAX_WORKS

    scale = ScaleStage(1)
    caplog.set_level(logging.WARNING, logger="aiocuda")
    async with Lanes(count=1, setup=setup) as lanes:
        for _ in range(MAX_WORKS + 10):
            async with lanes.lease() as lane:

                def per_request(lane: Lane) -> None:  # a new function every time
                    scale.kernel.launch((N + 255) // 256, 256, lane.state.x, N, 1, stream=lane.stream)

                lane.replay(per_request)
                await lane
        assert len(lanes.lanes[0]._graphs) == MAX_WORKS
    assert sum("never replayed" in record.message for record in caplog.records) == 1


async def test_coroutine_functions_are_refused(backend: _driver.Driver, anyio_backend: Any) -> None:
    async def work(lane: Lane) -> None:
        pass

    async with Lanes(count=1, setup=setup) as lanes, lanes.lease() as lane:
        with pytest.raises(TypeError, match="not a coroutine function"):
            lane.replay(work)


async def test_work_on_the_requests_own_memory_runs_as_it_is(
    backend: _driver.Driver, anyio_backend: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Work on memory of the request (``lane.upload`` without ``out=``, ``lane.empty``
    during the lease) is not captured: a replay would repeat the addresses of the request
    captured, memory freed when its lease ends (every later request failed on it). It runs
    as it is, with the usual warning, and each request gets its own result."""
    scale = ScaleStage(REPS)

    def on_request_memory(lane: Lane) -> None:
        scale.kernel.launch((N + 255) // 256, 256, lane.state.current, N, REPS, stream=lane.stream)

    caplog.set_level(logging.WARNING, logger="aiocuda")
    async with Lanes(count=1, setup=setup) as lanes:
        for i in range(4):
            async with lanes.lease() as lane:
                host = np.full(N, float(i + 1), np.float32)
                lane.state.current = lane.upload(host)  # a new array per request
                lane.replay(on_request_memory)
                out = lane.download(lane.state.current)
                await lane
            np.testing.assert_allclose(out, scale_reference(host, REPS), rtol=1e-4)
        assert list(lanes.lanes[0]._graphs.values()) == ["eager"]
    warnings_logged = [record.message for record in caplog.records if "could not be captured" in record.message]
    assert len(warnings_logged) == 1 and "memory of the request" in warnings_logged[0], warnings_logged
