"""Shared fixtures: the driver ``backend`` and the async ``anyio_backend`` matrix.

* ``backend``: ``sim`` always (two simulated devices), ``cuda`` where a real GPU is
  present (skipped otherwise, and marked ``gpu`` so ``-m gpu`` selects it).
* ``anyio_backend``: asyncio, asyncio + uvloop and trio, through anyio's pytest plugin.

Without a GPU, the run ends with one line saying that the GPU tests were skipped and how
to run them.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import settings

from aiocuda import _driver
from aiocuda.errors import NoDeviceError

# Property tests run on shared, sometimes slow machines: no per-example deadline.
settings.register_profile("aiocuda", deadline=None, max_examples=60)
settings.load_profile("aiocuda")


@functools.cache
def real_gpu_count() -> int:
    """How many real GPUs the driver reports (0 without a driver)."""
    try:
        from aiocuda._driver.cuda import CudaDriver

        real = CudaDriver()
        real.init()
        return real.device_count()
    except (NoDeviceError, ImportError):
        return 0


def _async_backends() -> list[Any]:
    params: list[Any] = [pytest.param(("asyncio", {"use_uvloop": False}), id="asyncio")]
    uvloop_missing = importlib.util.find_spec("uvloop") is None
    params.append(
        pytest.param(
            ("asyncio", {"use_uvloop": True}),
            id="uvloop",
            marks=pytest.mark.skipif(uvloop_missing, reason="uvloop not installed"),
        )
    )
    trio_missing = importlib.util.find_spec("trio") is None
    params.append(pytest.param("trio", id="trio", marks=pytest.mark.skipif(trio_missing, reason="trio not installed")))
    return params


@pytest.fixture(params=_async_backends())
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    return request.param


@pytest.fixture(
    params=[
        pytest.param("sim", id="sim"),
        pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
    ]
)
def backend(request: pytest.FixtureRequest) -> Iterator[_driver.Driver]:
    """The driver backend under test, freshly selected for each test."""
    if request.param == "cuda":
        if real_gpu_count() == 0:
            pytest.skip("no real GPU")
        yield _driver.use_backend("cuda")
    else:
        yield _driver.use_backend("sim", devices=2)


@pytest.fixture
def sim_backend() -> Iterator[_driver.Driver]:
    """The simulated backend alone, for tests of sim-only controls (pause, faults)."""
    yield _driver.use_backend("sim", devices=2)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Say in one line why the GPU tests were skipped, and how to run them."""
    skipped = terminalreporter.stats.get("skipped", [])
    gpu = [r for r in skipped if "gpu" in r.keywords or "multi_gpu" in r.keywords]
    multi = [r for r in gpu if "multi_gpu" in r.keywords]
    if gpu and real_gpu_count() == 0:
        terminalreporter.write_line(
            f"{len(gpu)} GPU tests skipped: there is no NVIDIA GPU and driver here (the other tests ran on the "
            "simulated backend). On a machine with a GPU, ./aio test runs them too; ./aio test -m gpu runs those alone."
        )
    elif multi and real_gpu_count() == 1:
        terminalreporter.write_line(f"{len(multi)} multi-GPU tests skipped: they need two GPUs, this machine has one.")
