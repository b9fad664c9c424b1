"""aiocuda.testing: the simulator's controls as users' own tests use them (typed, public)."""

from __future__ import annotations

import math
import pathlib
import re
import subprocess
import sys
import textwrap
import typing
from collections.abc import Iterator

import anyio
import anyio.lowlevel
import numpy as np
import numpy.typing as npt
import pytest

import aiocuda
import aiocuda.testing
from aiocuda.errors import ContextPoisonedError, CudaError, ResultCode

from ._mypy import assert_passes_mypy_strict

SOURCE = r"""
extern "C" __global__ void add_one(float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += 1.0f;
}
"""


def add_one(launch: aiocuda.testing.KernelLaunch, x: npt.NDArray[np.float32], n: np.int32) -> None:
    assert launch.name == "add_one" and launch.block == (64, 1, 1)
    x[: int(n)] += 1


@pytest.fixture
def sim() -> Iterator[aiocuda.testing.Simulator]:
    with aiocuda.testing.use_simulator(devices=2) as sim:
        sim.register_kernel("add_one", add_one)
        yield sim
    sim.register_kernel("add_one", None)


def test_use_simulator_switches_and_describes(sim: aiocuda.testing.Simulator) -> None:
    assert sim.device_count == 2 == aiocuda.device_count()
    assert aiocuda.current_backend().simulated
    assert aiocuda.testing.current_simulator().device_count == 2
    assert repr(sim).startswith("<Simulator [devices=2 ")


@pytest.mark.anyio
async def test_a_paused_stream_keeps_its_awaits_pending(sim: aiocuda.testing.Simulator, anyio_backend: object) -> None:
    kernel = aiocuda.Program(SOURCE).compile().kernel("add_one")
    with aiocuda.Stream() as stream:
        x = await aiocuda.to_device(np.zeros(100, np.float32), stream=stream)
        finished = anyio.Event()

        async def request() -> None:
            kernel.launch(2, 64, x, 100, stream=stream)
            await stream
            finished.set()

        async with anyio.create_task_group() as tg:
            with sim.paused(stream):
                tg.start_soon(request)
                for _ in range(20):
                    await anyio.lowlevel.checkpoint()
                assert not finished.is_set() and not stream.query()
            await finished.wait()
        assert (await x.to_host(stream=stream) == 1).all()
        with sim.paused(stream):  # closed while paused: its queued work still runs after
            kernel.launch(2, 64, x, 100, stream=stream)
            stream.close()
        await stream
        assert (await x.to_host() == 2).all()


@pytest.mark.anyio
async def test_a_kernel_implementation_that_fails_the_test_fails_the_await(
    sim: aiocuda.testing.Simulator, anyio_backend: object
) -> None:
    """pytest.fail() (a BaseException, as are pytest.skip() and sys.exit()) in a kernel's
    implementation reaches the awaiting task as the device's error, with the failure as
    its cause; it used to end the worker thread and leave the await pending forever."""

    def fails(launch: aiocuda.testing.KernelLaunch, x: npt.NDArray[np.float32], n: np.int32) -> None:
        pytest.fail("the kernel saw a wrong argument")

    sim.register_kernel("add_one", fails)
    kernel = aiocuda.Program(SOURCE).compile().kernel("add_one")
    with aiocuda.Stream() as stream:
        x = aiocuda.empty(64, np.float32, stream=stream)
        kernel.launch(1, 64, x, 64, stream=stream)
        with anyio.fail_after(10), pytest.raises(ContextPoisonedError, match="raised Failed: the kernel saw") as info:
            await stream
    assert isinstance(info.value.__cause__, pytest.fail.Exception)


def test_register_kernel_refuses_what_cannot_be_run(sim: aiocuda.testing.Simulator) -> None:
    """Arguments swapped, or an implementation that cannot be called, were accepted: the
    launch then failed far from the mistake (no implementation found, or the device
    poisoned by a TypeError). A launch with none names the calls a user has (it named
    the simulator's internal SimDriver.register_kernel)."""
    with pytest.raises(TypeError, match=r"name.*str, not function"):
        sim.register_kernel(add_one, "add_one")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"register_kernel\('add_one', impl\).*callable.*not int"):
        sim.register_kernel("add_one", 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="callable"):
        aiocuda.register_sim_kernel("add_one", "add_one")  # type: ignore[arg-type]
    kernel = aiocuda.Program(SOURCE).compile().kernel("add_one")
    with aiocuda.Stream() as stream:
        x = aiocuda.empty(64, np.float32, stream=stream)
        kernel.launch(1, 64, x, 64, stream=stream)  # still the fixture's implementation
        stream.synchronize()
    sim.register_kernel("add_one", None)
    with pytest.raises(aiocuda.LaunchError, match=r"aiocuda.register_sim_kernel\('add_one', impl\)"):
        kernel.launch(1, 64, x, 64)


def test_latency_makes_operations_take_time(sim: aiocuda.testing.Simulator) -> None:
    kernel = aiocuda.Program(SOURCE).compile().kernel("add_one")
    sim.set_latency("launch_kernel", 0.05)
    with aiocuda.Stream() as stream:
        x = aiocuda.empty(64, np.float32, stream=stream)
        start = stream.record(timing=True)
        kernel.launch(1, 64, x, 64, stream=stream)
        end = stream.record(timing=True)
        stream.synchronize()
        assert end.elapsed_ms(since=start) >= 50.0


@pytest.mark.parametrize("seconds", [-1.0, math.inf, math.nan, 1e300])
@pytest.mark.anyio
async def test_a_latency_that_cannot_be_waited_is_refused(
    sim: aiocuda.testing.Simulator, seconds: float, anyio_backend: object
) -> None:
    """An infinite (or too long to wait) latency used to end the worker thread that timed
    it, and then every worker after it: every stream stalled. NaN meant none at all."""
    with pytest.raises(ValueError, match="latency"):
        sim.set_latency("memcpy_htod_async", seconds)
    with aiocuda.Stream() as stream, anyio.fail_after(10):
        x = await aiocuda.to_device(np.ones(4, np.float32), stream=stream)
        assert (await x.to_host(stream=stream) == 1).all()


def test_a_latency_names_an_operation_the_simulator_runs(sim: aiocuda.testing.Simulator) -> None:
    """A misspelt name used to be kept and slow nothing down."""
    with pytest.raises(ValueError, match=r"set_latency\('launch_kernal'\).*launch_kernel"):
        sim.set_latency("launch_kernal", 0.01)  # type: ignore[arg-type]
    for operation in typing.get_args(aiocuda.testing.Operation):
        sim.set_latency(operation, 0.01)
        sim.set_latency(operation, 0)


def test_an_injected_fault_fails_that_call(sim: aiocuda.testing.Simulator) -> None:
    kernel = aiocuda.Program(SOURCE).compile().kernel("add_one")
    with aiocuda.Stream() as stream:
        x = aiocuda.empty(64, np.float32, stream=stream)
        sim.inject_fault(ResultCode.LAUNCH_OUT_OF_RESOURCES, call="launch_kernel")
        with pytest.raises(aiocuda.LaunchError):
            kernel.launch(1, 64, x, 64, stream=stream)
        kernel.launch(1, 64, x, 64, stream=stream)  # only the first one fails
        stream.synchronize()
    with pytest.raises(ValueError, match="launch_kernal"):
        sim.inject_fault(ResultCode.UNKNOWN, call="launch_kernal")


def test_poison_fails_every_later_call_on_every_device(sim: aiocuda.testing.Simulator) -> None:
    sim.poison(aiocuda.Device(1))
    with pytest.raises(ContextPoisonedError):
        aiocuda.Stream(1)
    with pytest.raises(ContextPoisonedError, match="sticky error on device 1"):
        aiocuda.Stream(0)  # as on GPUs: a sticky error ends the process's use of CUDA


def test_the_controls_of_a_replaced_simulator_refuse_to_act() -> None:
    """use_simulator() blocks do not nest: the inner one shuts the outer one down. The
    outer one's controls used to act on that dead simulator: a fault, a latency or a
    poison set through them did nothing, silently."""
    with aiocuda.testing.use_simulator(devices=2) as outer:
        with aiocuda.testing.use_simulator(devices=1) as inner:
            stream = aiocuda.Stream()
            for control in (
                lambda: outer.inject_fault(ResultCode.UNKNOWN, call="stream_create"),
                lambda: outer.set_latency("launch_kernel", 0.1),
                lambda: outer.poison(0),
                lambda: outer.pause(stream),
            ):
                with pytest.raises(aiocuda.BackendError, match=r"shut down.*later use_simulator\(\)"):
                    control()
            inner.resume(stream)  # (resuming does nothing harmful: nothing to refuse)
            aiocuda.Stream().close()  # nothing was armed or poisoned
        with pytest.raises(aiocuda.BackendError, match="closed"):
            inner.inject_fault(ResultCode.UNKNOWN)


def test_pause_says_what_is_wrong_with_the_stream() -> None:
    """A stream of another backend (made before this simulator) was paused on its own dead
    simulator, silently; something not a Stream failed with an AttributeError."""
    with aiocuda.testing.use_simulator(devices=1):
        stale = aiocuda.Stream()
    with aiocuda.testing.use_simulator(devices=1) as fresh:
        with pytest.raises(aiocuda.BackendError, match="another backend"):
            fresh.pause(stale)
        with pytest.raises(TypeError, match="aiocuda Stream, not int"):
            fresh.pause(3)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="aiocuda Stream, not int"):
            fresh.resume(3)  # type: ignore[arg-type]


def test_close_lets_the_next_call_choose_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOCUDA_BACKEND", "sim")
    monkeypatch.setenv("AIOCUDA_SIM_DEVICES", "3")
    sim = aiocuda.testing.use_simulator(devices=1)
    stream = aiocuda.Stream()
    sim.close()
    with pytest.raises(CudaError):
        stream.synchronize()  # the old simulator is gone
    assert aiocuda.device_count() == 3  # chosen again from the environment


@pytest.mark.anyio
async def test_what_was_made_on_a_replaced_simulator_says_why_it_fails(anyio_backend: object) -> None:
    """Objects made before a switch used to fail with only 'the simulated driver was shut
    down', not saying that a later use_simulator() (or close) was the cause."""
    with aiocuda.testing.use_simulator(devices=1):
        stream = aiocuda.Stream()
        x = aiocuda.empty(4, np.float32, stream=stream)
        with aiocuda.testing.use_simulator(devices=1):
            why = "shut down.*later use_simulator"
            with pytest.raises(CudaError, match=why):
                await stream
            with pytest.raises(CudaError, match=why):
                await x.to_host(stream=stream)
            with pytest.raises(CudaError, match=why):
                aiocuda.Stream(stream.device)


@pytest.mark.slow
def test_the_modules_example_runs(tmp_path: pathlib.Path) -> None:
    """The module docstring's example is a pytest module that passes, on asyncio and
    trio. (It was a sketch: placeholders, and a task's done() to look at, which trio has
    not and which an asyncio task not yet started answers False to anyway.)"""
    after = (aiocuda.testing.__doc__ or "").split("::\n\n", 1)[1]
    block = re.split(r"\n(?=\S)", after, maxsplit=1)[0]  # up to the first line not indented
    user = tmp_path / "test_example.py"
    user.write_text(
        textwrap.dedent(block)
        + '\n\n@pytest.fixture(params=["asyncio", "trio"])\ndef anyio_backend(request):\n    return request.param\n'
    )
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "error", str(user)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and "2 passed" in done.stdout, done.stdout + done.stderr


USER_CODE = """
from __future__ import annotations

import numpy as np
import numpy.typing as npt

import aiocuda
import aiocuda.testing


def double(launch: aiocuda.testing.KernelLaunch, x: npt.NDArray[np.float32], n: np.int32) -> None:
    x[: int(n)] *= 2


def test_service() -> None:
    with aiocuda.testing.use_simulator(devices=2) as sim:
        sim.register_kernel("double", double)
        sim.set_latency("launch_kernel", 0.001)
        sim.inject_fault(aiocuda.errors.ResultCode.OUT_OF_MEMORY, at_call=3, call="mem_alloc_async")
        stream = aiocuda.Stream()
        with sim.paused(stream):
            pass
        sim.pause(stream)
        sim.resume(stream)
        sim.poison(aiocuda.Device(1))
        backend: aiocuda.Backend = aiocuda.current_backend()
        assert backend.simulated and sim.device_count == 2
"""


@pytest.mark.slow
def test_user_code_passes_mypy_strict(tmp_path: pathlib.Path) -> None:
    """The testing API is typed: a user's test module using it passes ``mypy --strict``."""
    assert_passes_mypy_strict(tmp_path, "test_user_service.py", USER_CODE)
