"""Shared fixtures: the driver ``backend`` and the async ``anyio_backend`` matrix.

* ``backend``: ``sim`` always (two simulated devices), ``cuda`` where a real GPU is
  present, marked ``gpu`` so that ``-m gpu`` selects it.
* ``cuda_backend``: the real driver alone, for tests that mean nothing on the simulator
  (their items are marked ``gpu``).
* ``sim_backend``: the simulator alone, for tests of its controls (pause, faults).
* ``anyio_backend``: asyncio, asyncio + uvloop and trio, through anyio's pytest plugin.

The GPU lane: with ``--require-gpu`` or ``AIOCUDA_BACKEND=cuda``, a real GPU is asked
for, so a missing or broken one fails every test that needs it (with the probe's
reason) instead of skipping it, and the run fails if no ``gpu`` test passed. Without
it the ``cuda`` tests skip where there is no GPU, as on CI, and the run ends with one
line saying that they were skipped and how to run them.

Markers: ``gpu`` (needs the real driver), ``multi_gpu`` (needs two devices: the
simulator has two; on the real driver it skips on a one-GPU machine).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import settings

from aiocuda import _driver

# Property tests run on shared, sometimes slow machines: no per-example deadline.
settings.register_profile("aiocuda", deadline=None, max_examples=60)
settings.load_profile("aiocuda")

_gpu_lane = False  # set from the command line and environment in pytest_configure
_gpu_passed = 0  # gpu-marked tests that passed in this run


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--require-gpu",
        action="store_true",
        help="the GPU lane: a missing or broken GPU fails the tests that need it (not a skip), "
        "and the run fails if no gpu test passed (also set by AIOCUDA_BACKEND=cuda)",
    )


def pytest_configure(config: pytest.Config) -> None:
    global _gpu_lane
    _gpu_lane = bool(config.getoption("--require-gpu")) or os.environ.get("AIOCUDA_BACKEND") == "cuda"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "cuda_backend" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.gpu)


def _on_real_gpu(item: pytest.Item) -> bool:
    """A gpu-marked test, other than the simulator's instance of a ``backend`` test."""
    callspec = getattr(item, "callspec", None)
    on_sim = callspec is not None and callspec.params.get("backend") == "sim"
    return item.get_closest_marker("gpu") is not None and not on_sim


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    global _gpu_passed
    report = yield
    if report.when == "call" and report.passed and _on_real_gpu(item):
        _gpu_passed += 1
    return report


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _gpu_lane and _gpu_passed == 0 and exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """One line on the GPU tests: in the GPU lane how many passed, elsewhere why they
    were skipped and how to run them."""
    if _gpu_lane:
        verdict = "" if _gpu_passed else ": the GPU lane was asked for and no gpu test passed (run fails)"
        terminalreporter.write_line(f"aiocuda GPU lane: {_gpu_passed} gpu tests passed{verdict}")
        return
    skipped = terminalreporter.stats.get("skipped", [])
    marked = [getattr(r, "keywords", {}) for r in skipped]  # a skipped module's report has none
    gpu = [k for k in marked if "gpu" in k or "multi_gpu" in k]
    multi = [k for k in gpu if "multi_gpu" in k]
    count = _probe()[0]
    if gpu and count == 0:
        terminalreporter.write_line(
            f"{len(gpu)} GPU tests skipped: there is no NVIDIA GPU and driver here (the other tests ran on the "
            "simulated backend). On a machine with a GPU, ./aio test runs them too; ./aio test -m gpu runs those alone."
        )
    elif multi and count == 1:
        terminalreporter.write_line(f"{len(multi)} multi-GPU tests skipped: they need two GPUs, this machine has one.")


@functools.cache
def _probe() -> tuple[int, str]:
    """(how many real GPUs the driver reports, why none where it reports none)."""
    try:
        from aiocuda._driver.cuda import CudaDriver

        real = CudaDriver()
        real.init()
        count = real.device_count()
    except Exception as exc:  # no bindings, no driver, a stub library, no device, a broken one
        return 0, f"{type(exc).__name__}: {exc}"
    return count, "" if count else "the driver reports no device"


def real_gpu_count() -> int:
    """How many real GPUs the driver reports. In the GPU lane, none fails the calling
    test with the probe's reason (callers skip on 0 outside it)."""
    count, why = _probe()
    if not count and _gpu_lane:
        pytest.fail(f"the GPU lane needs a real GPU: {why}", pytrace=False)
    return count


def _need_real_gpu(request: pytest.FixtureRequest) -> None:
    count = real_gpu_count()
    if count == 0:
        pytest.skip(f"no real GPU ({_probe()[1][:60]})")
    if count < 2 and request.node.get_closest_marker("multi_gpu") is not None:
        pytest.skip("needs two GPUs; this machine has one")


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
        _need_real_gpu(request)
        yield _driver.use_backend("cuda")
    else:
        sim = _driver.use_backend("sim", devices=2)
        yield sim
        _check_not_poisoned(sim)


def _check_not_poisoned(sim: Any) -> None:
    """Fail a test of both backends that left a simulated device poisoned: on a GPU the
    same test poisons the process's context, and every later test of the GPU lane fails
    with it (a kernel given a NULL pointer did so once). Tests that poison on purpose use
    ``sim_backend`` (or a subprocess on the GPU)."""
    deadline = time.monotonic() + 2.0  # (its last operations may still be running)
    while time.monotonic() < deadline:
        busy = [s for d in sim._devices for s in d.streams() if s.finished < s.submitted and not s._paused]
        if not busy:
            break
        time.sleep(0.001)
    poisoned = [d for d in sim._devices if d.poison is not None]
    if poisoned:
        pytest.fail(
            f"the test left simulated device {poisoned[0].ordinal} poisoned ({poisoned[0].poison}): on a GPU "
            "it would poison the process for every later test; use the sim_backend fixture to poison on purpose",
            pytrace=False,
        )


@pytest.fixture
def cuda_backend(request: pytest.FixtureRequest) -> Iterator[_driver.Driver]:
    """The real driver alone, for tests that mean nothing on the simulator."""
    _need_real_gpu(request)
    yield _driver.use_backend("cuda")


@pytest.fixture
def sim_backend() -> Iterator[_driver.Driver]:
    """The simulated backend alone, for tests of sim-only controls (pause, faults)."""
    yield _driver.use_backend("sim", devices=2)
