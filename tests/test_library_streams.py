"""PyTorch and CuPy work on aiocuda streams (``aiocuda.interop``), on request lanes.

The simulated backend checks what needs no library: the blocks do nothing there and a
library stream cannot be made over a simulated one. The rest needs a real GPU and the
library (``gpu``-marked; skipped where either is missing): ops on lane streams under
concurrent load with results checked, a lane reused thousands of times without more
threads, streams or memory, DLPack exchange ordered on the GPU, shutdown with requests
in flight, and adopted streams outliving their lanes.
"""

from __future__ import annotations

import gc
import threading
import warnings
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest

from aiocuda import interop
from aiocuda._memory import library_streams
from aiocuda._memory.interop import _producer_stream
from aiocuda.errors import ArgumentError
from aiocuda.lanes import Lane, Lanes
from aiocuda.stream import Stream

from ._workload import slow_op

pytestmark = pytest.mark.anyio


def test_blocks_do_nothing_on_the_simulator(sim_backend: Any) -> None:
    with Stream() as stream:
        with interop.torch_stream(stream) as made:
            assert made is None
        with interop.cupy_stream(stream) as made:
            assert made is None
        with pytest.raises(ArgumentError, match="simulated backend"):
            library_streams.library_stream(stream, "torch")
        assert not library_streams.adopted(stream)


def test_an_adopted_stream_closed_by_its_user_keeps_its_handle(sim_backend: Any, monkeypatch: Any) -> None:
    """A stream handed to a library (faked here: the simulator's streams cannot be) and
    then closed: its handle was destroyed while the library kept state by it, and the
    cached library stream over the dead handle was handed out again."""
    monkeypatch.setattr(library_streams, "on_simulator", lambda stream: False)
    monkeypatch.setattr(library_streams, "_make", lambda stream, library: object())
    with Stream() as stream:
        made = library_streams.library_stream(stream, "torch")
        assert library_streams.library_stream(stream, "torch") is made
    assert stream.closed and library_streams.adopted(stream)
    sim_backend.stream_synchronize(stream._handle)  # not destroyed (else INVALID_HANDLE): the library's
    with pytest.raises(ArgumentError, match="it is closed"):
        library_streams.library_stream(stream, "torch")
    with pytest.raises(ArgumentError, match="it is closed"):
        interop.torch_stream(stream)


@pytest.fixture
def torch(backend: Any) -> Any:
    if backend.name != "cuda":
        pytest.skip("PyTorch runs on aiocuda streams of the real driver only")
    return pytest.importorskip("torch")


@pytest.fixture
def cupy(backend: Any) -> Any:
    if backend.name != "cuda":
        pytest.skip("CuPy runs on aiocuda streams of the real driver only")
    return pytest.importorskip("cupy")


WIDTH = 256


def torch_request(torch: Any, lane: Lane, weight: Any, host: np.ndarray) -> np.ndarray:
    x = lane.upload(host)
    with interop.torch_stream(lane.stream) as s:
        assert torch.cuda.current_stream().cuda_stream == int(lane.stream) == s.cuda_stream
        y = torch.relu(torch.from_dlpack(x) @ weight) + 1.0  # made on the lane's stream
        return lane.download(interop.as_device_array(y, stream=lane.stream))


async def test_torch_ops_on_lanes_under_concurrent_load(torch: Any, anyio_backend: Any) -> None:
    torch.manual_seed(0)
    weight_host = torch.rand(WIDTH, WIDTH)
    weight = weight_host.cuda()
    torch.cuda.synchronize()

    def warm(lane: Lane) -> None:
        torch_request(torch, lane, weight, np.zeros((4, WIDTH), np.float32))

    rng = np.random.default_rng(0)
    inputs = [rng.random((8, WIDTH), dtype=np.float32) for _ in range(64)]
    expected = [(torch.relu(torch.from_numpy(h) @ weight_host) + 1.0).numpy() for h in inputs]
    async with Lanes(count=16, setup=warm) as lanes:
        results: dict[int, np.ndarray] = {}

        async def one(i: int) -> None:
            async with lanes.lease() as lane:
                out = torch_request(torch, lane, weight, inputs[i])
                await lane
            results[i] = out

        for _ in range(3):
            async with anyio.create_task_group() as tg:
                for i in range(len(inputs)):
                    tg.start_soon(one, i)
            for i in range(len(inputs)):
                np.testing.assert_allclose(results[i], expected[i], rtol=1e-2, atol=1e-2)


async def test_a_torch_lane_reused_thousands_of_times_grows_nothing(torch: Any, anyio_backend: Any) -> None:
    weight = torch.rand(WIDTH, WIDTH, device="cuda")
    torch.cuda.synchronize()
    host = np.ones((4, WIDTH), np.float32)
    expected = (torch.relu(torch.from_numpy(host) @ weight.cpu()) + 1.0).numpy()
    async with Lanes(count=4, setup=lambda lane: torch_request(torch, lane, weight, host)) as lanes:

        async def rounds(n: int) -> None:
            for _ in range(n):
                async with lanes.lease() as lane:
                    out = torch_request(torch, lane, weight, host)
                    await lane
            np.testing.assert_allclose(out, expected, rtol=1e-2, atol=1e-2)

        await rounds(50)
        async with lanes.lease() as lane:  # a long wait: the engine's waker thread is running now
            slow_op(lane.stream, 0.05)
            await lane
        gc.collect()
        threads, memory = threading.active_count(), torch.cuda.memory_allocated()
        await rounds(3000)
        gc.collect()
        assert threading.active_count() <= threads
        # Tensors of the last requests may still be held by their streams (dropped at the
        # next await of each): a few requests' worth, where a leak would be thousands.
        assert torch.cuda.memory_allocated() <= memory + (1 << 20)


async def test_cupy_ops_on_lanes_under_concurrent_load(cupy: Any, anyio_backend: Any) -> None:
    rng = np.random.default_rng(1)
    inputs = [rng.random(4096, dtype=np.float32) for _ in range(64)]

    def request(lane: Lane, host: np.ndarray) -> np.ndarray:
        x = lane.upload(host)
        with interop.cupy_stream(lane.stream) as s:
            assert cupy.cuda.get_current_stream().ptr == int(lane.stream) == s.ptr
            y = cupy.sqrt(cupy.from_dlpack(x)) * 2.0
            return lane.download(interop.as_device_array(y, stream=lane.stream))

    async with Lanes(count=8, setup=lambda lane: request(lane, inputs[0])) as lanes:
        results: dict[int, np.ndarray] = {}

        async def one(i: int) -> None:
            async with lanes.lease() as lane:
                out = request(lane, inputs[i])
                await lane
            results[i] = out

        async with anyio.create_task_group() as tg:
            for i in range(len(inputs)):
                tg.start_soon(one, i)
    for i, host in enumerate(inputs):
        np.testing.assert_allclose(results[i], np.sqrt(host) * 2.0, rtol=1e-5)


async def test_a_torch_block_gives_the_previous_stream_back(torch: Any, anyio_backend: Any) -> None:
    async with Lanes(count=2) as lanes:
        async with lanes.lease() as outer, lanes.lease() as inner:
            before = torch.cuda.current_stream()
            with interop.torch_stream(outer.stream):
                with pytest.raises(ZeroDivisionError):
                    with interop.torch_stream(inner.stream):
                        assert torch.cuda.current_stream().cuda_stream == int(inner.stream)
                        raise ZeroDivisionError
                assert torch.cuda.current_stream().cuda_stream == int(outer.stream)
            assert torch.cuda.current_stream() == before
            assert torch.cuda.current_device() == outer.stream.device.ordinal


async def test_dlpack_exchange_is_ordered_on_the_gpu(torch: Any, anyio_backend: Any) -> None:
    async with Lanes(count=1, staging=4 << 20) as lanes:  # (room for the 4 MiB upload)
        async with lanes.lease() as lane:
            slow_op(lane.stream, 0.05)  # the upload below lands only after this
            x = lane.upload(np.full(1 << 20, 2.0, np.float32))
            on_torch_default = torch.from_dlpack(x)  # consumer: PyTorch's current (default) stream
            total = on_torch_default.sum()  # must see the upload: ordered by an event, on the GPU
            assert float(total.item()) == 2.0 * (1 << 20)
            await lane


async def test_a_torch_tensor_comes_to_a_lane_ordered_from_either_stream(torch: Any, anyio_backend: Any) -> None:
    async with Lanes(count=1) as lanes:
        async with lanes.lease() as lane:
            with interop.torch_stream(lane.stream):  # made on the lane's stream: nothing to order
                slow_op(lane.stream, 0.05)
                same = torch.full((1 << 20,), 3.0, device="cuda") * 2
                assert _producer_stream(same, lane.device.ordinal) == int(lane.stream)
                from_same = lane.download(interop.as_device_array(same, stream=lane.stream))
            side = torch.cuda.Stream()
            with torch.cuda.stream(side):  # made on another stream: the lane waits for it on the GPU
                torch.cuda._sleep(int(0.05 * lane.device.attribute("clock_rate") * 1e3))
                other = torch.full((1 << 20,), 5.0, device="cuda") + 1
                assert _producer_stream(other, lane.device.ordinal) != int(lane.stream)
                from_other = lane.download(interop.as_device_array(other, stream=lane.stream))
            await lane
    assert (from_same == 6.0).all() and (from_other == 6.0).all()


async def test_external_stream_takes_the_integer_handle(torch: Any, cupy: Any) -> None:
    with Stream() as stream:
        assert isinstance(int(stream), int) and int(stream) == stream.__cuda_stream__()[1]
        assert torch.cuda.ExternalStream(int(stream)).cuda_stream == int(stream)
        with warnings.catch_warnings():  # CuPy 14 deprecates it (see library_streams._make)
            warnings.filterwarnings("ignore", "ExternalStream is deprecated", DeprecationWarning)
            assert cupy.cuda.ExternalStream(int(stream)).ptr == int(stream)


async def test_shutdown_with_torch_requests_in_flight(torch: Any, anyio_backend: Any) -> None:
    weight = torch.rand(WIDTH, WIDTH, device="cuda")
    torch.cuda.synchronize()
    lanes = Lanes(count=4, setup=lambda lane: torch_request(torch, lane, weight, np.zeros((1, WIDTH), np.float32)))
    await lanes.start()
    done: list[np.ndarray] = []

    async def one() -> None:
        async with lanes.lease() as lane:
            slow_op(lane.stream, 0.02)
            out = torch_request(torch, lane, weight, np.ones((2, WIDTH), np.float32))
            await lane
        done.append(out)

    async with anyio.create_task_group() as tg:
        for _ in range(8):
            tg.start_soon(one)
        await anyio.wait_all_tasks_blocked()  # all eight leased or in line (trio starts them later than asyncio)
        await lanes.aclose()  # lets all eight finish
    assert len(done) == 8
    streams = [s for lane in lanes.lanes for s in lane.streams]
    assert all(library_streams.adopted(s) and not s.closed for s in streams)  # PyTorch may still use them
