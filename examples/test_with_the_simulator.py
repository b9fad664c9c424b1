"""Testing your own GPU code without a GPU: aiocuda.testing in a pytest module.

    python -m pytest examples/test_with_the_simulator.py   # needs pytest (and anyio's plugin)

The code under test (``scale_on_gpu``) is ordinary aiocuda code. The fixture switches to
a fresh simulator for each test and registers what the kernel computes, as numpy; the
tests then use the simulator's controls to check what a GPU would not let them see
reliably: that the request really waits for the GPU, and what happens when a kernel
faults.
"""

from __future__ import annotations

from collections.abc import Iterator

import anyio
import anyio.lowlevel
import numpy as np
import numpy.typing as npt
import pytest

import aiocuda
import aiocuda.testing

SOURCE = r"""
extern "C" __global__ void scale(float* x, float factor, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= factor;
}
"""


async def scale_on_gpu(values: npt.NDArray[np.float32], factor: float, stream: aiocuda.Stream) -> np.ndarray:
    """The code under test: one request, one await for its result."""
    kernel = aiocuda.Program(SOURCE).compile().kernel("scale")
    x = await aiocuda.to_device(values, stream=stream)
    kernel.launch((values.size + 255) // 256, 256, x, factor, values.size, stream=stream)
    return await x.to_host(stream=stream)


def scale(launch: aiocuda.testing.KernelLaunch, x: npt.NDArray[np.float32], factor: np.float32, n: np.int32) -> None:
    """What the kernel computes, for the simulator: pointers arrive as numpy arrays."""
    x[: int(n)] *= factor


@pytest.fixture
def sim() -> Iterator[aiocuda.testing.Simulator]:
    with aiocuda.testing.use_simulator(devices=1) as sim:
        sim.register_kernel("scale", scale)
        yield sim


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_the_request_returns_what_the_kernel_computed(sim: aiocuda.testing.Simulator) -> None:
    values = np.arange(1000, dtype=np.float32)
    with aiocuda.Stream() as stream:
        assert (await scale_on_gpu(values, 2.0, stream) == 2 * values).all()


@pytest.mark.anyio
async def test_the_request_waits_for_the_gpu(sim: aiocuda.testing.Simulator) -> None:
    results: list[np.ndarray] = []
    with aiocuda.Stream() as stream:

        async def request() -> None:
            results.append(await scale_on_gpu(np.ones(10, np.float32), 3.0, stream))

        async with anyio.create_task_group() as tg:
            with sim.paused(stream):  # the "GPU" does nothing until the block ends
                tg.start_soon(request)
                for _ in range(50):
                    await anyio.lowlevel.checkpoint()
                assert results == []  # still waiting, and the loop was free meanwhile
    assert (results[0] == 3).all()


@pytest.mark.anyio
async def test_a_faulting_kernel_fails_the_request(sim: aiocuda.testing.Simulator) -> None:
    with aiocuda.Stream() as stream:
        sim.inject_fault(aiocuda.errors.ResultCode.ILLEGAL_ADDRESS, call="launch_kernel")
        with pytest.raises(aiocuda.ContextPoisonedError):
            await scale_on_gpu(np.ones(10, np.float32), 2.0, stream)
