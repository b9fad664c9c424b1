"""Managed memory (aiocuda.managed): prefetches, advice, attachment, host access, kernels,
managed pools, and the refusal to oversubscribe a device."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from typing import Any

import anyio
import numpy as np
import pytest

import aiocuda
from aiocuda import _driver, managed
from aiocuda._memory import managed_budget as _budget
from aiocuda.errors import ArgumentError, CudaError, OversubscriptionError

from ._workload import Gate

pytestmark = pytest.mark.anyio

MiB = 1 << 20

DOUBLE = r"""
extern "C" __global__ void double_all(float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= 2.0f;
}
"""


def _double(launch: Any, x: np.ndarray, n: np.int32) -> None:
    x[: int(n)] *= 2


@pytest.fixture
def double_all(backend: _driver.Driver) -> Iterator[aiocuda.Kernel]:
    aiocuda.register_sim_kernel("double_all", _double)
    try:
        yield aiocuda.Program(DOUBLE, name="double.cu").compile(aiocuda.Device(0)).kernel("double_all")
    finally:
        aiocuda.register_sim_kernel("double_all", None)


async def test_a_managed_array_prefetched_and_read_by_a_kernel(
    backend: _driver.Driver, anyio_backend: object, double_all: aiocuda.Kernel
) -> None:
    n = 4 * MiB // 4  # 4 MiB of float32
    stream = aiocuda.Stream(0)
    array = managed.empty(n, np.float32, device=0, stream=stream)
    assert isinstance(array, managed.ManagedArray) and array.nbytes == 4 * MiB
    values = np.random.default_rng(3).standard_normal(n).astype(np.float32)
    array.host_view()[:] = values  # host code writes managed memory in place
    ready = array.prefetch(0, stream=stream)
    assert isinstance(ready, aiocuda.Event)
    await ready
    double_all.launch((n + 255) // 256, 256, array, n, stream=stream)
    await array.prefetch("host", stream=stream)
    np.testing.assert_array_equal(array.host_view(), values * 2)
    np.testing.assert_array_equal(await array.to_host(stream=stream), values * 2)
    half = array[: n // 2]
    assert isinstance(half, managed.ManagedArray)
    assert repr(half) == f"<ManagedArray shape=({n // 2},) dtype=float32 device=0>"  # (was "<DeviceArray ...")
    await half.prefetch(aiocuda.Device(0), stream=stream)


async def test_advice_and_attachment(backend: _driver.Driver, anyio_backend: object) -> None:
    stream = aiocuda.Stream(0)
    array = await managed.zeros((256, 256), np.int32, stream=stream)
    assert not array.host_view().any()
    array.advise("read_mostly")
    array.advise("read_mostly", unset=True)
    array.advise("preferred_location", 0)
    array.advise("preferred_location", "host")
    array.advise("preferred_location", unset=True, location=0)
    array.advise("accessed_by", aiocuda.Device(0))
    array.advise("accessed_by", 0, unset=True)
    array.attach(stream, "single")
    await stream
    array.host_view()[3] = 7  # attached to an idle stream: the host may use it
    array.attach(stream, "global")
    np.testing.assert_array_equal((await array.to_host(stream=stream))[3], 7)
    with pytest.raises(ArgumentError, match="unknown advice"):
        array.advise("fast")  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="no location"):
        array.advise("read_mostly", 0)
    with pytest.raises(ArgumentError, match="needs a location"):
        array.advise("accessed_by")
    with pytest.raises(ArgumentError, match="scope"):
        array.attach(stream, "everywhere")  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="location"):
        array.prefetch("gpu")  # type: ignore[arg-type]
    with pytest.raises(ArgumentError):
        array.prefetch(99)
    await array.prefetch(np.int64(0), stream=stream)  # a numpy ordinal is an ordinal
    with pytest.raises(TypeError, match="unset"):
        array.advise("read_mostly", unset="yes")  # type: ignore[arg-type]


async def test_a_host_view_keeps_its_memory_after_an_explicit_free(
    backend: _driver.Driver, anyio_backend: object
) -> None:
    """The view's memory was freed by the driver under it (a crash on the next write)."""
    stream = aiocuda.Stream(0)
    array = await managed.zeros(1024, np.int32, stream=stream)
    await stream
    view = array.host_view()
    allocation = weakref.ref(array.buffer.owner)  # what frees the memory when it goes
    array.buffer.free()
    await stream
    for _ in range(3):
        gc.collect()
    assert allocation() is not None
    view[:] = 7  # still the allocation's, kept by the view
    assert int(view.sum()) == 7 * 1024
    del view, array
    await stream  # (the stream lets go of what it held for its work lazily: on awaits)
    gc.collect()
    assert allocation() is None


async def test_managed_arguments_that_contradict_each_other(backend: _driver.Driver, anyio_backend: object) -> None:
    with pytest.raises(TypeError, match="ManagedPool"):  # its memory would not be managed
        managed.empty(4, pool=aiocuda.MemoryPool.for_device(0))  # type: ignore[arg-type]
    if len(aiocuda.devices()) > 1:
        with pytest.raises(ArgumentError, match="device 1 and a stream of device 0"):
            managed.empty(4, device=1, stream=aiocuda.Stream(0))


@pytest.mark.multi_gpu
async def test_managed_arrays_follow_the_current_streams_device(backend: _driver.Driver, anyio_backend: object) -> None:
    """Inside ``use_stream(s)``, ``device`` defaults to ``s.device`` (it used to be 0,
    with device 0's default stream as the array's stream); another device is refused."""
    with aiocuda.Stream(1) as s, aiocuda.use_stream(s):
        for array in (managed.empty(16, np.float32), await managed.zeros(16, np.float32)):
            assert (array.device.ordinal, array.buffer.stream) == (1, s)
        np.testing.assert_array_equal(await array.to_host(), np.zeros(16, np.float32))
        with pytest.raises(ArgumentError, match=r"device 0 .*current stream .*device 1"):
            managed.empty(16, device=0)


@pytest.mark.multi_gpu
@pytest.mark.parametrize("use", ["prefetch", "attach"])
async def test_work_on_a_stream_of_another_device_comes_before_the_free(
    backend: _driver.Driver, anyio_backend: object, use: str
) -> None:
    """A prefetch or an attach on a stream of another device than the array's left the
    array's own stream, where its memory is freed, unordered after it: the memory could
    be freed while the prefetch still moved it."""
    with aiocuda.Stream(0) as own, aiocuda.Stream(1) as other:
        array = managed.empty(1024, np.float32, device=0, stream=own)
        with Gate(other):  # the other device's stream works until the end of the block
            if use == "prefetch":
                array.prefetch(1, stream=other)
            else:
                array.attach(other, "global")
            after = array.stream.record()  # where a free would go now
            with anyio.move_on_after(0.2) as waiting:
                await after
            assert waiting.cancelled_caught, f"the array's stream is not ordered after the {use}"
        await after


async def test_a_cancelled_zeros_lets_its_memory_go_even_if_the_exception_is_kept(
    backend: _driver.Driver, anyio_backend: object
) -> None:
    """Whatever keeps a cancellation (a log record, an exception group) keeps the frames
    its traceback references: the memory, and its count against the device's managed
    memory, stayed as long as that, as aiocuda.zeros no longer lets happen."""
    device = aiocuda.Device(0)
    kept: list[BaseException] = []
    with aiocuda.Stream(0) as stream:
        await stream
        before = _budget.managed_bytes(device)
        with Gate(stream):  # the fill cannot finish before the cancellation arrives
            with anyio.CancelScope() as scope:
                scope.cancel()
                try:
                    await managed.zeros(MiB, np.uint8, stream=stream)
                except anyio.get_cancelled_exc_class() as exc:
                    kept.append(exc)
                    raise
        assert kept, "zeros was not cancelled"
        await stream
        for _ in range(200):
            stream.hold()  # holds are let go lazily: give the stream a chance
            if _budget.managed_bytes(device) == before:
                break
            await anyio.sleep(0.01)
        else:
            pytest.fail("the cancelled array's managed memory was kept with the exception")


async def test_oversubscription_is_refused_unless_asked_for(backend: _driver.Driver, anyio_backend: object) -> None:
    """Checked before the driver is asked: on a GPU nothing is allocated either."""
    total = aiocuda.Device(0).total_memory
    with pytest.raises(OversubscriptionError, match="oversubscribe=True"):
        managed.empty(total + MiB, np.uint8)
    with pytest.raises(aiocuda.OutOfMemoryError):  # a subclass: OOM handlers catch it too
        managed.empty((total // 4) * 2, np.float32)


@pytest.fixture
def small_sim() -> Iterator[_driver.Driver]:
    """A simulated device of 64 MiB, where oversubscribing costs little host memory."""
    yield _driver.use_backend("sim", devices=1, total_memory=64 * MiB)


async def test_managed_memory_is_counted_until_freed(small_sim: _driver.Driver, anyio_backend: object) -> None:
    stream = aiocuda.Stream(0)
    first = managed.empty(40 * MiB, np.uint8, stream=stream)
    with pytest.raises(OversubscriptionError, match=r"holds 40\.0 MiB"):
        managed.empty(30 * MiB, np.uint8, stream=stream)
    extra = managed.empty(30 * MiB, np.uint8, stream=stream, oversubscribe=True)
    del extra, first
    gc.collect()
    await stream  # the frees wait for the work on the memory; then the budget is back
    for _ in range(200):
        stream.hold()  # holds are let go lazily: give the stream a chance
        try:
            managed.empty(40 * MiB, np.uint8, stream=stream)
            break
        except OversubscriptionError:
            await anyio.sleep(0.01)
    else:
        pytest.fail("freed managed memory was never given back to the budget")


async def test_managed_pool(backend: _driver.Driver, anyio_backend: object, double_all: aiocuda.Kernel) -> None:
    try:
        pool = managed.ManagedPool.create(0)
    except CudaError as exc:
        assert "no managed memory pools" in str(exc)
        pytest.skip(f"the driver offers no managed pools: {exc}")
    stream = aiocuda.Stream(0)
    array = managed.empty(1024, np.float32, pool=pool, stream=stream)
    assert isinstance(array, managed.ManagedArray) and array.buffer.pool is pool
    await array.prefetch("host", stream=stream)
    array.host_view()[:] = 1.5
    await array.prefetch(0, stream=stream)
    double_all.launch(4, 256, array, 1024, stream=stream)
    np.testing.assert_array_equal(await array.to_host(stream=stream), np.full(1024, 3.0, np.float32))
    with pytest.raises(OversubscriptionError):
        pool.allocate(aiocuda.Device(0).total_memory + 1, stream)
    with pytest.raises(ArgumentError, match="pool"):
        array.attach(stream)
    with pytest.raises(ArgumentError, match="oversubscribe"):
        managed.empty(4, pool=pool, oversubscribe=True)
    with pytest.raises(ArgumentError, match="attach applies"):
        managed.empty(4, pool=pool, attach="host")
