"""Graphs: capture, replay, updates, what cannot be captured, faults and cancellation.

Every test runs on the simulated backend (which records the enqueued operations of a
capture and replays them in order) and on a real GPU where one is present.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Iterator
from typing import Any

import anyio
import numpy as np
import pytest

import aiocuda
from aiocuda import _driver
from aiocuda._driver._doorbell import SemaphoreDoorbell
from aiocuda.array import empty
from aiocuda.errors import (
    ArgumentError,
    CaptureError,
    ContextPoisonedError,
    CudaError,
    GraphUpdateError,
    LaunchError,
    ResultCode,
)
from aiocuda.host import pinned_empty
from aiocuda.kernel import Kernel, register_sim_kernel
from aiocuda.module import Module
from aiocuda.program import Program
from aiocuda.stream import Stream

from ._workload import _kernel, poison_op, slow_op
from .test_completion import run_script

pytestmark = pytest.mark.anyio

SOURCE = r"""
extern "C" __global__ void saxpy(float a, const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
extern "C" __global__ void add_one(float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += 1.0f;
}
"""
N = 1000
BLOCK = 256
GRID = (N + BLOCK - 1) // BLOCK


def _saxpy(launch: Any, a: np.float32, x: np.ndarray, y: np.ndarray, n: np.int32) -> None:
    y[:n] = a * x[:n] + y[:n]


def _add_one(launch: Any, x: np.ndarray, n: np.int32) -> None:
    x[:n] += 1


@pytest.fixture
def module(backend: _driver.Driver, tmp_path: Any) -> Iterator[Module]:
    yield from _compiled(tmp_path)


@pytest.fixture
def sim_module(sim_backend: _driver.Driver, tmp_path: Any) -> Iterator[Module]:
    """``module`` on the simulator alone, for tests that change how its driver behaves."""
    yield from _compiled(tmp_path)


def _compiled(tmp_path: Any) -> Iterator[Module]:
    register_sim_kernel("saxpy", _saxpy)
    register_sim_kernel("add_one", _add_one)
    module = Program(SOURCE, cache=tmp_path).compile()
    for name in ("saxpy", "add_one"):
        module.kernel(name).function(0)  # loaded before capturing: a module cannot load during a capture
    yield module
    register_sim_kernel("saxpy", None)
    register_sim_kernel("add_one", None)


def _pinned(values: Any) -> np.ndarray:
    array = pinned_empty(N, np.float32)
    array[:] = values
    return array


async def _upload_add_one_download(
    add_one: Kernel, s: Stream, host_in: np.ndarray, host_out: np.ndarray
) -> aiocuda.Graph:
    """A capture on ``s`` of: ``host_in`` into graph memory, ``add_one``, into ``host_out``."""
    async with s.capture() as graph:
        x = empty(N, np.float32, stream=s)
        await x.copy_from(host_in, stream=s)
        add_one.launch(GRID, BLOCK, x, N, stream=s)
        await x.to_host(out=host_out, stream=s)
    return graph


async def _device(values: Any, stream: Stream) -> aiocuda.DeviceArray:
    array = empty(N, np.float32, stream=stream)
    await array.copy_from(np.full(N, values, np.float32), stream=stream)
    return array


# -- capture and replay -------------------------------------------------------------------------
async def test_capture_then_replay_with_new_data(module: Module, anyio_backend: object) -> None:
    saxpy = module.kernel("saxpy")
    with Stream(0) as s:
        host_in, host_out = _pinned(0), _pinned(-1)
        y = await _device(1.0, s)
        async with s.capture() as graph:
            x = empty(N, np.float32, stream=s)  # the graph's own memory
            await x.copy_from(host_in, stream=s)  # returns once recorded
            saxpy.launch(GRID, BLOCK, 2.0, x, y, N, stream=s)
            await y.to_host(out=host_out, stream=s)
        assert (host_out == -1).all()  # nothing ran
        assert x.buffer.freed  # allocated and freed by every replay
        kinds = [node.kind for node in graph.nodes]
        assert kinds == ["mem_alloc", "memcpy", "kernel", "memcpy", "mem_free"]
        kernel_node = graph.nodes[2]
        assert kernel_node.kernel is saxpy and kernel_node.dependencies == (1,)
        assert kernel_node.arguments == (2.0, graph.nodes[0].dst, y.ptr, N)
        assert kernel_node.config is not None and kernel_node.config.grid == (GRID, 1, 1)
        expected = np.ones(N, np.float32)
        for value in (1.0, 2.0, 3.0):
            host_in[:] = value
            await graph.launch(s)
            expected = 2 * value + expected
            np.testing.assert_allclose(host_out, expected)
        graph.close()


async def test_plain_with_and_launch_on_another_stream(module: Module, anyio_backend: object) -> None:
    add_one = module.kernel("add_one")
    with Stream(0) as s, Stream(0) as other:
        x = await _device(0.0, s)
        with s.capture() as graph:
            add_one.launch(GRID, BLOCK, x, N, stream=s)
            add_one.launch(GRID, BLOCK, x, N, stream=s)
        graph.launch(other)  # ordered after x's earlier work on s
        await graph.launch(other)
        np.testing.assert_array_equal(await x.to_host(stream=other), 4.0)
        assert repr(graph).startswith("<Graph device=0 ready nodes=2 (2 kernel)")


async def test_streams_that_wait_join_the_capture(module: Module, anyio_backend: object) -> None:
    add_one, saxpy = module.kernel("add_one"), module.kernel("saxpy")
    with Stream(0) as s, Stream(0) as side:
        x, y = await _device(1.0, s), await _device(10.0, s)
        async with s.capture() as graph:
            side.wait(s)  # side joins the capture
            add_one.launch(GRID, BLOCK, x, N, stream=side)  # x moves to side: ordered inside the graph
            saxpy.launch(GRID, BLOCK, 1.0, x, y, N, stream=s)  # waits for side's work
        side.query()  # no CaptureError: side left the capture with the origin
        kernels = [node for node in graph.nodes if node.kind == "kernel"]
        assert [node.kernel for node in kernels] == [add_one, saxpy]
        assert _depends(graph, kernels[1].index, kernels[0].index)  # x's uses are ordered in the graph
        await graph.launch(s)
        np.testing.assert_array_equal(await y.to_host(stream=s), 12.0)
        x.buffer.free()  # the capture left the buffer's own ordering alone: a plain free
        await s


def _depends(graph: aiocuda.Graph, node: int, on: int) -> bool:
    """Whether node ``node`` runs after node ``on`` in ``graph`` (directly or not)."""
    seen, todo = set(), [node]
    while todo:
        for dep in graph.nodes[todo.pop()].dependencies:
            if dep == on:
                return True
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return False


# -- updates ---------------------------------------------------------------------------------------
async def test_kernel_arguments_and_rebind_apply_to_later_replays(module: Module, anyio_backend: object) -> None:
    saxpy = module.kernel("saxpy")
    with Stream(0) as s:
        x, y = await _device(1.0, s), await _device(0.0, s)
        async with s.capture() as graph:
            saxpy.launch(GRID, BLOCK, 2.0, x, y, N, stream=s)
        node = graph.nodes[0]
        graph.set_kernel_args(node, 3.0, x, y, N)
        await graph.launch(s)
        np.testing.assert_array_equal(await y.to_host(stream=s), 3.0)
        assert graph.nodes[0].arguments == (3.0, x.ptr, y.ptr, N)
        x2, y2 = await _device(5.0, s), await _device(100.0, s)
        graph.rebind({x: x2, y: y2})
        await graph.launch(s)
        np.testing.assert_array_equal(await y2.to_host(stream=s), 115.0)
        np.testing.assert_array_equal(await y.to_host(stream=s), 3.0)  # untouched now
        with pytest.raises(LaunchError, match="argument 0"):
            graph.set_kernel_args(node, "three", x, y, N)
        with pytest.raises(GraphUpdateError, match="not memcpy"):
            graph.set_copy(node, dst=y)
        with pytest.raises(GraphUpdateError, match="no node 5"):
            graph.set_kernel_args(5, 1.0, x, y, N)
        with pytest.raises(GraphUpdateError, match="only 400"):
            graph.rebind({x2: empty(100, np.float32, stream=s)})


async def test_copies_move_to_new_host_memory(module: Module, anyio_backend: object) -> None:
    add_one = module.kernel("add_one")
    with Stream(0) as s:
        host_in, host_out = _pinned(1.0), _pinned(0.0)
        graph = await _upload_add_one_download(add_one, s, host_in, host_out)
        upload, download = (node for node in graph.nodes if node.kind == "memcpy")
        other_in, other_out = _pinned(41.0), _pinned(0.0)
        graph.set_copy(upload, src=other_in)
        graph.set_copy(download, dst=other_out)
        await graph.launch(s)
        np.testing.assert_array_equal(other_out, 42.0)
        assert (host_out == 0.0).all()
        with pytest.raises(ArgumentError, match="page-locked"):
            graph.set_copy(upload, src=np.zeros(N, np.float32))
        graph.rebind([(other_out, host_out), (other_in, host_in)])
        await graph.launch(s)
        np.testing.assert_array_equal(host_out, 2.0)


class _Exported:
    """Another library's array over ``inner`` (an aiocuda array), through
    ``__cuda_array_interface__`` or DLPack alone: what ``as_device_array`` imports as
    memory owned elsewhere (an ``OwnedBuffer`` keeping this object), as a CuPy or PyTorch
    tensor is."""

    def __init__(self, inner: aiocuda.DeviceArray, protocol: str, readonly: bool = False) -> None:
        self.inner = inner
        if protocol == "cai":
            # (aiocuda's own export would wait for the array's pending work, blocking the
            # loop: the producer's stream orders the import after it instead)
            self.__cuda_array_interface__ = {
                "shape": inner.shape,
                "typestr": inner.dtype.str,
                "data": (inner.ptr, readonly),
                "version": 3,
                "stream": inner.stream.__cuda_stream__()[1],
            }
        else:
            self.__dlpack__ = inner.__dlpack__
            self.__dlpack_device__ = inner.__dlpack_device__


def _imported(inner: aiocuda.DeviceArray, protocol: str = "cai", readonly: bool = False) -> aiocuda.DeviceArray:
    return aiocuda.interop.as_device_array(_Exported(inner, protocol, readonly))


async def _copy_then_add_one(add_one: Kernel, s: Stream, x: Any, y: Any) -> aiocuda.Graph:
    """A capture on ``s`` of: ``x`` copied into ``y``, then ``add_one`` on ``y``."""
    async with s.capture() as graph:
        await y.copy_from(x, stream=s)
        add_one.launch(GRID, BLOCK, y, N, stream=s)
    return graph


@pytest.mark.parametrize("protocol", ["cai", "dlpack"])
async def test_updates_take_arrays_imported_from_other_libraries(
    module: Module, anyio_backend: object, protocol: str
) -> None:
    """A captured graph replayed on another library's tensors (a serving pattern): rebind,
    set_copy and set_kernel_args refused every imported array (its buffer is no pool
    DeviceBuffer) with "expected a DeviceArray ... not DeviceArray"."""
    add_one = module.kernel("add_one")
    with Stream(0) as s:
        x, y = await _device(1.0, s), await _device(0.0, s)
        graph = await _copy_then_add_one(add_one, s, x, y)
        copy, kernel = graph.nodes
        assert (copy.kind, copy.direction, kernel.kind) == ("memcpy", "dtod", "kernel")
        x2, y2 = await _device(10.0, s), await _device(0.0, s)
        graph.rebind({x: _imported(x2, protocol), y: _imported(y2, protocol)})
        await graph.launch(s)
        np.testing.assert_array_equal(await y2.to_host(stream=s), 11.0)
        np.testing.assert_array_equal(await y.to_host(stream=s), 0.0)  # untouched now
        x3, y3 = await _device(20.0, s), await _device(0.0, s)
        graph.set_copy(copy, dst=_imported(y3, protocol), src=_Exported(x3, protocol))  # (imported by the graph)
        graph.set_kernel_args(kernel, _imported(y3, protocol), N)
        await graph.launch(s)
        np.testing.assert_array_equal(await y3.to_host(stream=s), 21.0)
        assert (graph.nodes[0].dst, graph.nodes[0].src, graph.nodes[1].arguments) == (y3.ptr, x3.ptr, (y3.ptr, N))
        with pytest.raises(TypeError, match="not str"):
            graph.set_copy(copy, dst="y")


async def test_a_read_only_array_is_no_copy_destination(module: Module, anyio_backend: object) -> None:
    """An array its owner exported read-only is refused, naming it, where a copy node
    would write into it (and the graph is unchanged); it is still read by copies and
    given to kernels, as outside graphs."""
    add_one = module.kernel("add_one")
    with Stream(0) as s:
        x, y = await _device(1.0, s), await _device(0.0, s)
        graph = await _copy_then_add_one(add_one, s, x, y)
        copy, kernel = graph.nodes
        target = await _device(0.0, s)
        read_only = _imported(target, readonly=True)
        assert read_only.readonly
        with pytest.raises(ArgumentError, match=r"<DeviceArray .* readonly> is read-only .* copy node 0"):
            graph.set_copy(copy, dst=read_only)
        with pytest.raises(ArgumentError, match="destination of copy node 0"):
            graph.rebind({y: read_only})
        assert graph.nodes == (copy, kernel)
        await graph.launch(s)
        np.testing.assert_array_equal(await y.to_host(stream=s), 2.0)
        source = await _device(5.0, s)
        graph.set_copy(copy, src=_imported(source, readonly=True))  # read: allowed
        graph.set_kernel_args(kernel, _imported(y, readonly=True), N)  # (aiocuda cannot tell what a kernel writes)
        await graph.launch(s)
        np.testing.assert_array_equal(await y.to_host(stream=s), 6.0)
        np.testing.assert_array_equal(await target.to_host(stream=s), 0.0)


@pytest.mark.parametrize("update", ["set_copy", "rebind", "set_kernel_args"])
async def test_a_graph_keeps_an_imported_arrays_owner_while_it_can_replay(
    module: Module, anyio_backend: object, update: str
) -> None:
    """The foreign owner (what keeps another library's memory) lives while a node uses
    its memory; once the node uses other memory, or the graph is closed, it goes after the
    replays already launched."""
    add_one = module.kernel("add_one")
    with Stream(0) as s:
        x, y = await _device(1.0, s), await _device(0.0, s)
        graph = await _copy_then_add_one(add_one, s, x, y)
        copy, kernel = graph.nodes
        target = await _device(0.0, s)
        owner = _Exported(target, "cai")
        imported = aiocuda.interop.as_device_array(owner)
        if update == "set_copy":
            graph.set_copy(copy, dst=imported)
            graph.set_kernel_args(kernel, target, N)
        elif update == "rebind":
            graph.rebind({y: imported})
        else:
            graph.set_copy(copy, dst=target)
            graph.set_kernel_args(kernel, imported, N)
        watched = weakref.ref(owner)
        del owner, imported
        gc.collect()
        assert watched() is not None
        for expected in (2.0, 2.0):
            await graph.launch(s)
            gc.collect()
            assert watched() is not None
            np.testing.assert_array_equal(await target.to_host(stream=s), expected)
        graph.launch(s)
        if update == "rebind":
            graph.close()
        else:  # the node moves on: the replay launched keeps the owner, not the graph
            graph.rebind({target: y})
        for _ in range(50):  # the replay's holds let go, then the imported buffer's own (its owner)
            await s
            gc.collect()
            if watched() is None:
                break
            await anyio.sleep(0.01)
        assert watched() is None


async def _owner_released(watched: weakref.ref[Any], *streams: Stream) -> bool:
    """Whether the object ``watched`` goes once the work of ``streams`` (those the graph
    was launched on) has run: the holds of the replays let go, then the imported buffer's
    own (its owner)."""
    for _ in range(50):
        for stream in streams:
            await stream
        gc.collect()
        if watched() is None:
            return True
        await anyio.sleep(0.01)
    return False


@pytest.mark.parametrize("protocol", ["cai", "dlpack"])
async def test_a_graph_captured_over_an_imported_array_keeps_its_owner_while_it_can_replay(
    module: Module, anyio_backend: object, protocol: str
) -> None:
    """Work captured on memory imported from another library (an OwnedBuffer): the graph
    did not keep it, so a tensor dropped after the capture was released -- its memory
    freed -- while the graph still replayed on it. Its owner now lives while the graph can
    replay, and goes after the replays in flight once the graph is closed, as a pool
    buffer does."""
    add_one = module.kernel("add_one")
    with Stream(0) as s, Stream(0) as request:
        backend = s.device._driver
        x, target = await _device(1.0, s), await _device(0.0, s)
        owner = _Exported(target, protocol)
        imported = aiocuda.interop.as_device_array(owner, stream=s)
        graph = await _copy_then_add_one(add_one, s, x, imported)
        assert imported.buffer.stream is s  # its record of streams is about the work outside the graph
        watched = weakref.ref(owner)
        del owner, imported
        gc.collect()
        assert watched() is not None
        for _ in range(2):
            await target.fill(0.0, stream=s)
            await graph.launch(s)
            gc.collect()
            assert watched() is not None
            np.testing.assert_array_equal(await target.to_host(stream=s), 2.0)
        await target.fill(0.0, stream=s)
        await s
        if backend.name == "sim":
            backend.pause(request.handle)  # type: ignore[attr-defined]
        done = graph.launch(request)  # after s's fill: the replay is ordered after the memory's other work
        graph.close()
        gc.collect()
        if backend.name == "sim":
            assert watched() is not None  # the replay in flight uses it
            assert not done.query()  # type: ignore[attr-defined]
            backend.resume(request.handle)  # type: ignore[attr-defined]
        await done
        np.testing.assert_array_equal(await target.to_host(stream=request), 2.0)
        assert await _owner_released(watched, s, request)


async def test_an_imported_array_last_used_on_another_stream_is_captured_in_order(
    module: Module, anyio_backend: object
) -> None:
    """Memory imported from another library, last used on another stream than the
    capturing one: its first captured use made the capturing stream wait for that stream,
    work outside the capture, which was refused (CaptureError). The capture now orders it
    as a pool buffer's: each replay runs after the memory's other work (here a kernel on
    the other stream, held back), and the buffer keeps its record of streams."""
    add_one, saxpy = module.kernel("add_one"), module.kernel("saxpy")
    with Stream(0) as s, Stream(0) as other:
        backend = s.device._driver
        target = await _device(1.0, s)
        imported = aiocuda.interop.as_device_array(_Exported(target, "cai"), stream=other)
        async with s.capture() as graph:
            add_one.launch(GRID, BLOCK, imported, N, stream=s)  # (was: CaptureError)
        assert imported.buffer.stream is other
        if backend.name == "sim":
            backend.pause(other.handle)  # type: ignore[attr-defined]
        saxpy.launch(GRID, BLOCK, 2.0, imported, imported, N, stream=other)  # y = 3 y, before the replay
        done = graph.launch(s)
        if backend.name == "sim":
            assert not done.query()  # type: ignore[attr-defined]
            backend.resume(other.handle)  # type: ignore[attr-defined]
        await done
        np.testing.assert_array_equal(await target.to_host(stream=s), 4.0)  # (1 + 1) * 3 had it come first
        assert imported.buffer.stream is s  # the launch moved its last use: later work waits for the replay


async def test_imported_memory_is_ordered_across_the_streams_of_a_capture(
    module: Module, anyio_backend: object
) -> None:
    """Captured uses of imported memory on two streams of the capture are ordered inside
    the graph, as a pool buffer's are, and the buffer's own record of streams stays."""
    add_one, saxpy = module.kernel("add_one"), module.kernel("saxpy")
    with Stream(0) as s, Stream(0) as side:
        target = await _device(1.0, s)
        imported = aiocuda.interop.as_device_array(_Exported(target, "cai"), stream=s)
        async with s.capture() as graph:
            side.wait(s)  # side joins the capture
            add_one.launch(GRID, BLOCK, imported, N, stream=side)
            saxpy.launch(GRID, BLOCK, 2.0, imported, imported, N, stream=s)  # waits for side's work
        kernels = [node for node in graph.nodes if node.kind == "kernel"]
        assert [node.kernel for node in kernels] == [add_one, saxpy]
        assert _depends(graph, kernels[1].index, kernels[0].index)
        assert imported.buffer.stream is s
        await graph.launch(s)
        np.testing.assert_array_equal(await target.to_host(stream=s), 6.0)


async def test_imported_memory_let_go_during_a_failed_capture_waits_for_the_work_before_it(
    module: Module, anyio_backend: object
) -> None:
    """An imported array freed inside a capture of its last-use stream: its owner went to
    the capture's holds, dropped at once when the capture failed, while the stream's work
    from before the capture could still use the memory. It is now released once the
    capture has ended, after that work, as a pool buffer's free is."""
    add_one = module.kernel("add_one")
    with Stream(0) as s:
        backend = s.device._driver
        target = await _device(0.0, s)
        owner = _Exported(target, "cai")
        imported = aiocuda.interop.as_device_array(owner, stream=s)
        watched = weakref.ref(owner)
        del owner
        if backend.name == "sim":
            backend.pause(s.handle)  # type: ignore[attr-defined]
        add_one.launch(GRID, BLOCK, imported, N, stream=s)  # before the capture, held back
        with pytest.raises(RuntimeError, match="the block fails"):
            with s.capture():
                imported.buffer.free()
                del imported
                gc.collect()
                raise RuntimeError("the block fails")
        gc.collect()
        if backend.name == "sim":
            assert watched() is not None  # the work before the capture still uses it
            backend.resume(s.handle)  # type: ignore[attr-defined]
        assert await _owner_released(watched, s)
        np.testing.assert_array_equal(await target.to_host(stream=s), 1.0)


@pytest.mark.multi_gpu
async def test_updates_refuse_memory_of_another_device(module: Module, anyio_backend: object) -> None:
    """Memory the graph's node cannot use is refused, saying why: a kernel reaches memory
    of its device (or managed memory), a copy node the devices it was captured with."""
    add_one = module.kernel("add_one")
    with Stream(0) as s, Stream(1) as s1:
        x, y = await _device(1.0, s), await _device(0.0, s)
        graph = await _copy_then_add_one(add_one, s, x, y)
        copy, kernel = graph.nodes
        elsewhere = _imported(await _device(0.0, s1))
        with pytest.raises(GraphUpdateError, match=r"argument 0 <DeviceArray .* device=1> is memory of device 1"):
            graph.set_kernel_args(kernel, elsewhere, N)
        with pytest.raises(
            GraphUpdateError, match=r"dst is memory of device 0; <DeviceArray .*> is memory of device 1"
        ):
            graph.set_copy(copy, dst=elsewhere)
        with pytest.raises(GraphUpdateError, match="rebind to memory of the same device"):
            graph.rebind({y: elsewhere})
        assert graph.nodes == (copy, kernel)
        shared = await aiocuda.managed.zeros(N, np.float32, device=1, stream=s1)
        graph.set_kernel_args(kernel, shared, N)  # every device reaches managed memory
        await graph.launch(s)
        np.testing.assert_array_equal(await shared.to_host(stream=s1), 1.0)


async def test_whole_graph_update_from_another_capture(module: Module, anyio_backend: object) -> None:
    saxpy, add_one = module.kernel("saxpy"), module.kernel("add_one")
    with Stream(0) as s:
        x, y, y2 = await _device(1.0, s), await _device(0.0, s), await _device(10.0, s)

        async def capture(a: float, target: aiocuda.DeviceArray) -> aiocuda.Graph:
            async with s.capture() as graph:
                saxpy.launch(GRID, BLOCK, a, x, target, N, stream=s)
                add_one.launch(GRID, BLOCK, target, N, stream=s)
            return graph

        graph, other = await capture(1.0, y), await capture(3.0, y2)
        graph.update(other)
        other.close()
        await graph.launch(s)
        np.testing.assert_array_equal(await y2.to_host(stream=s), 14.0)
        np.testing.assert_array_equal(await y.to_host(stream=s), 0.0)
        with s.capture() as different:
            add_one.launch(GRID, BLOCK, y, N, stream=s)
        with pytest.raises(GraphUpdateError):
            graph.update(different)
        await graph.launch(s)  # unchanged by the failed update
        np.testing.assert_array_equal(await y2.to_host(stream=s), 18.0)


async def test_an_update_from_an_updated_graph_takes_its_updates_too(module: Module, anyio_backend: object) -> None:
    """The other graph's own updates (a rebind) were reported by ``nodes`` but not
    replayed: the replays used what it had captured."""
    add_one = module.kernel("add_one")
    with Stream(0) as s:
        x, y, y2 = await _device(0.0, s), await _device(0.0, s), await _device(0.0, s)
        graphs = []
        for target in (x, y):
            async with s.capture() as graph:
                add_one.launch(GRID, BLOCK, target, N, stream=s)
            graphs.append(graph)
        graph, other = graphs
        other.rebind({y: y2})
        graph.update(other)
        assert graph.nodes[0].arguments is not None and graph.nodes[0].arguments[0] == y2.ptr
        other.close()
        await graph.launch(s)
        for array, expected in ((x, 0.0), (y, 0.0), (y2, 1.0)):
            np.testing.assert_array_equal(await array.to_host(stream=s), expected)


async def test_a_side_stream_closed_inside_the_capture_block_is_joined(module: Module, anyio_backend: object) -> None:
    """``with Stream() as side:`` inside the block: its work is joined back as it closes
    (the capture failed, closing it destroyed its record of the end); closing the
    capturing stream itself is refused."""
    add_one = module.kernel("add_one")
    with Stream(0) as s:
        x, y = await _device(0.0, s), await _device(0.0, s)
        async with s.capture() as graph:
            add_one.launch(GRID, BLOCK, x, N, stream=s)
            with Stream(0) as side:
                side.wait(s)
                add_one.launch(GRID, BLOCK, y, N, stream=side)
            with pytest.raises(CaptureError, match="close it after its capture block"):
                s.close()
        assert side.closed
        await side  # its work before the capture (none), as any closed stream
        await graph.launch(s)
        np.testing.assert_array_equal(await y.to_host(stream=s), 1.0)
        np.testing.assert_array_equal(await x.to_host(stream=s), 1.0)


async def test_a_cancellation_as_the_capture_block_ends_leaves_a_usable_graph(
    module: Module, anyio_backend: object
) -> None:
    """Cancelled as ``async with`` ends (the instantiation's checkpoint), the graph stayed
    captured and could never be launched."""
    add_one = module.kernel("add_one")
    with Stream(0) as s:
        x = await _device(0.0, s)
        with anyio.CancelScope() as scope:
            async with s.capture() as graph:
                add_one.launch(GRID, BLOCK, x, N, stream=s)
                scope.cancel()
            await anyio.sleep(1)  # (not reached: the cancellation comes after the block)
        assert scope.cancelled_caught
        await graph.launch(s)
        np.testing.assert_array_equal(await x.to_host(stream=s), 1.0)


async def test_other_tasks_allocate_while_an_async_capture_block_awaits(module: Module, anyio_backend: object) -> None:
    """The loop's other tasks share the capturing thread: their page-locked allocations
    failed, and broke the capture, in the default mode of a plain ``with``."""
    add_one = module.kernel("add_one")
    with Stream(0) as s:
        x = await _device(0.0, s)
        got: list[np.ndarray] = []
        done = anyio.Event()

        async def elsewhere() -> None:
            got.append(pinned_empty(16, np.float32))
            done.set()

        async with anyio.create_task_group() as tg, s.capture() as graph:
            add_one.launch(GRID, BLOCK, x, N, stream=s)
            tg.start_soon(elsewhere)
            await done.wait()
        await graph.launch(s)
        np.testing.assert_array_equal(await x.to_host(stream=s), 1.0)


async def test_a_launchs_awaitable_waits_for_its_replay_only(module: Module, anyio_backend: object) -> None:
    """Awaiting a launch waited for whatever the stream held by the time of the await."""
    add_one = module.kernel("add_one")
    with Stream(0) as s, Stream(0) as gate:
        backend = s.device._driver
        if backend.name != "sim":
            pytest.skip("a stream held back at will is the simulator's")
        x = await _device(0.0, s)
        async with s.capture() as graph:
            add_one.launch(GRID, BLOCK, x, N, stream=s)
        done = graph.launch(s)
        backend.pause(gate.handle)  # type: ignore[attr-defined]
        s.wait(gate.record())  # work on s after the replay waits for the paused stream
        with anyio.fail_after(10):
            await done
        backend.resume(gate.handle)  # type: ignore[attr-defined]
        await s


def test_bad_graph_arguments_raise_typed_errors(module: Module) -> None:
    add_one = module.kernel("add_one")
    with Stream(0) as s:
        x = empty(N, np.float32, stream=s)
        with s.capture() as graph:
            add_one.launch(GRID, BLOCK, x, N, stream=s)
            with pytest.raises(CaptureError, match="after its capture block"):
                graph.close()
        for wrong in ("x", 0):
            with pytest.raises(TypeError, match="launched on a Stream"):
                graph.launch(wrong)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="from another Graph"):
            graph.update(None)  # type: ignore[arg-type]
        for node in (0.7, "0", True):
            with pytest.raises(TypeError, match="GraphNode or its index"):
                graph.set_kernel_args(node, x, N)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="pairs"):
            graph.rebind([x])  # type: ignore[list-item]
        graph.close()
        s.synchronize()


# -- what cannot be captured -------------------------------------------------------------------------
async def test_operations_that_cannot_be_captured_raise_at_the_call(module: Module, anyio_backend: object) -> None:
    add_one = module.kernel("add_one")
    with Stream(0) as s, Stream(0) as outside:
        x = await _device(0.0, s)
        pageable = np.zeros(N, np.float32)
        with s.capture() as earlier:
            add_one.launch(GRID, BLOCK, x, N, stream=s)
        async with s.capture() as graph:
            add_one.launch(GRID, BLOCK, x, N, stream=s)
            with pytest.raises(CaptureError, match="await stream cannot be captured"):
                await s
            with pytest.raises(CaptureError, match="synchronize"):
                s.synchronize()
            with pytest.raises(CaptureError, match="query"):
                s.query()
            with pytest.raises(CaptureError, match="await event"):
                await s.record()
            with pytest.raises(CaptureError, match="pageable host memory"):
                await x.copy_from(pageable, stream=s)
            with pytest.raises(CaptureError, match="to_host"):
                await x.to_host(stream=s)
            with pytest.raises(CaptureError, match="outside the capture"):
                s.wait(outside)
            with pytest.raises(CaptureError, match="launching a graph"):
                earlier.launch(s)
            with pytest.raises(CaptureError, match="still being captured"):
                graph.launch(s)
            add_one.launch(GRID, BLOCK, x, N, stream=s)  # the capture goes on
        assert len(graph.nodes) == 2
        await graph.launch(s)
        np.testing.assert_array_equal(await x.to_host(stream=s), 2.0)


async def test_synchronizing_the_device_during_a_capture_is_refused_at_the_call(
    module: Module, anyio_backend: object
) -> None:
    """The driver refuses to synchronize a context while a stream of it captures, and
    invalidates the capture: aiocuda refuses it first, and the capture goes on."""
    add_one = module.kernel("add_one")
    device = aiocuda.Device(0)
    with Stream(0) as s:
        x = await _device(0.0, s)
        async with s.capture() as graph:
            add_one.launch(GRID, BLOCK, x, N, stream=s)
            with pytest.raises(CaptureError, match="synchronizing the device"):
                await device.synchronize()
            add_one.launch(GRID, BLOCK, x, N, stream=s)
        await device.synchronize()  # after the capture: as usual
        await graph.launch(s)
        np.testing.assert_array_equal(await x.to_host(stream=s), 2.0)


async def test_an_event_recorded_in_a_capture_that_ended_says_so(module: Module, anyio_backend: object) -> None:
    """An event recorded during a capture marks a point in the graph, not in the stream:
    after the capture it is still refused, as the driver refuses it
    (``CUDA_ERROR_CAPTURED_EVENT``), with the reason that holds then, not "being captured"."""
    add_one = module.kernel("add_one")
    with Stream(0) as s, Stream(0) as other:
        x = await _device(0.0, s)
        marker = aiocuda.Event(0)
        async with s.capture() as graph:
            add_one.launch(GRID, BLOCK, x, N, stream=s)
            marker.record(s)
            pooled = s.record()
            with pytest.raises(CaptureError, match="being captured"):
                marker.query()
        refusals = {
            "await event": lambda event: event,
            "event.query()": lambda event: event.query(),
            "event.synchronize()": lambda event: event.synchronize(),
        }
        for event in (marker, pooled):
            for what, use in refusals.items():
                with pytest.raises(CaptureError) as info:
                    await use(event) if what == "await event" else use(event)
                message = str(info.value)
                assert message.startswith(what) and "being captured" not in message, message
                assert "capture that has ended" in message and "graph.launch" in message, message
                assert info.value.name == "CUDA_ERROR_CAPTURED_EVENT"
        with pytest.raises(CaptureError, match="capture that has ended") as waited:
            other.wait(marker)
        assert waited.value.name == "CUDA_ERROR_CAPTURED_EVENT"
        await graph.launch(s)
        marker.record(s)  # recorded again outside a capture: an ordinary event
        await marker
        assert marker.query()
        np.testing.assert_array_equal(await x.to_host(stream=s), 1.0)


async def test_graph_memory_exists_only_in_the_graph(module: Module, anyio_backend: object) -> None:
    add_one = module.kernel("add_one")
    with Stream(0) as s, Stream(0) as outside:
        async with s.capture():
            x = empty(N, np.float32, stream=s)
            add_one.launch(GRID, BLOCK, x, N, stream=s)
            with pytest.raises(CaptureError, match="allocated during a capture"):
                add_one.launch(GRID, BLOCK, x, N, stream=outside)
        with pytest.raises(LaunchError, match="freed"):
            add_one.launch(GRID, BLOCK, x, N, stream=s)


async def test_a_block_that_raises_discards_the_capture(module: Module, anyio_backend: object) -> None:
    add_one = module.kernel("add_one")
    with Stream(0) as s:
        x = await _device(0.0, s)
        with pytest.raises(RuntimeError, match="stage bug"):
            async with s.capture() as graph:
                add_one.launch(GRID, BLOCK, x, N, stream=s)
                raise RuntimeError("stage bug")
        with pytest.raises(CaptureError, match="capture failed"):
            graph.launch(s)
        add_one.launch(GRID, BLOCK, x, N, stream=s)  # the stream works as before
        np.testing.assert_array_equal(await x.to_host(stream=s), 1.0)


# -- failed captures with forks: every stream comes out of the capture, usable -----------------------
# What the driver does then is checked above the seam (Capture.end asks each stream's capture
# status), so these tests say the same on the simulator and on a GPU. The CUDA programming
# guide documents that cuStreamEndCapture takes every stream of the capture out of it, even
# for an invalidated capture; the sim_module tests below give the simulated driver the other
# behaviours a driver might have, and check that aiocuda copes with them too.
def _capture_status(stream: Stream) -> str:
    return str(stream.device._driver.stream_capture_status(stream.handle)[0])


@pytest.mark.parametrize("ending", ["unjoined", "invalidated"])
def test_the_driver_takes_every_stream_out_of_a_failed_capture(module: Module, ending: str) -> None:
    """The driver itself, below aiocuda (raw seam calls): the end of a capture with a fork
    not joined back, or of one a synchronize of the forked stream invalidated, fails and
    takes both streams out of capture mode, as the CUDA programming guide documents.
    Capture.end does not rely on it (it checks, and repairs the other outcomes); this
    says which outcome the driver has: ``(code, (origin's status, side's status))``."""
    add_one = module.kernel("add_one")
    with Stream(0) as s, Stream(0) as side:
        driver = s.device._driver
        y = empty(N, np.float32, stream=side)
        fork = driver.event_create(False, False)
        try:
            driver.stream_begin_capture(s.handle, "relaxed")
            driver.event_record(fork, s.handle)
            driver.stream_wait_event(side.handle, fork)
            add_one.launch(GRID, BLOCK, y, N, stream=side)  # (aiocuda does not know: captured all the same)
            if ending == "invalidated":
                with pytest.raises(CaptureError):
                    driver.stream_synchronize(side.handle)
            with pytest.raises(CaptureError) as caught:
                driver.stream_end_capture(s.handle)
            outcome = (caught.value.code, (_capture_status(s), _capture_status(side)))
            code = ResultCode.STREAM_CAPTURE_UNJOINED if ending == "unjoined" else ResultCode.STREAM_CAPTURE_INVALIDATED
            assert outcome == (code, ("none", "none"))
        finally:
            if _capture_status(s) != "none":  # (another outcome: not to break the tests after this one)
                with contextlib.suppress(CudaError):
                    driver.stream_join_capture_sinks(s.handle)
                with contextlib.suppress(CudaError):
                    driver.graph_destroy(driver.stream_end_capture(s.handle))
            driver.event_destroy(fork)
        add_one.launch(GRID, BLOCK, y, N, stream=side)
        side.synchronize()


async def _both_streams_work(add_one: Kernel, s: Stream, side: Stream, x: Any, y: Any, expected: float) -> None:
    """Ordinary work on both streams, then a new capture forking from ``s`` onto ``side``
    and its replay: each step checked on the data."""
    assert (s._capture, side._capture) == (None, None) and s.device._captures == 0
    assert (_capture_status(s), _capture_status(side)) == ("none", "none")
    add_one.launch(GRID, BLOCK, x, N, stream=s)
    add_one.launch(GRID, BLOCK, y, N, stream=side)
    np.testing.assert_array_equal(await x.to_host(stream=s), expected)
    np.testing.assert_array_equal(await y.to_host(stream=side), expected)
    await s
    await side
    async with s.capture() as graph:
        side.wait(s)
        add_one.launch(GRID, BLOCK, y, N, stream=side)
        add_one.launch(GRID, BLOCK, x, N, stream=s)
    assert (_capture_status(s), _capture_status(side)) == ("none", "none")
    for _ in range(2):
        await graph.launch(s)
    np.testing.assert_array_equal(await x.to_host(stream=s), expected + 2)
    np.testing.assert_array_equal(await y.to_host(stream=s), expected + 2)
    graph.close()


@pytest.mark.parametrize("how", ["raises", "invalidates"])
async def test_a_block_that_raises_with_a_side_stream_forked_leaves_both_streams_usable(
    module: Module, anyio_backend: object, how: str
) -> None:
    """The block raises while ``side`` is forked into the capture (not joined back): the
    block's own exception propagates, no graph is made, and both streams leave the
    capture. ``invalidates``: the exception is the driver's, from a call that invalidated
    the capture (synchronizing a captured stream), so the end fails too: that is noted on
    it, never raised instead."""
    add_one = module.kernel("add_one")
    with Stream(0) as s, Stream(0) as side:
        x, y = await _device(0.0, s), await _device(0.0, side)
        raised: list[BaseException] = []
        with pytest.raises(Exception) as caught:
            async with s.capture() as graph:
                add_one.launch(GRID, BLOCK, x, N, stream=s)
                side.wait(s)  # the fork
                add_one.launch(GRID, BLOCK, y, N, stream=side)
                try:
                    if how == "raises":
                        raise RuntimeError("stage bug")
                    s.device._driver.stream_synchronize(side.handle)  # (the raw call: aiocuda refuses it)
                except BaseException as exc:
                    raised.append(exc)
                    raise
        assert raised and caught.value is raised[0]  # the block's own exception, unmasked
        notes = getattr(caught.value, "__notes__", [])
        if how == "invalidates":
            assert isinstance(caught.value, CaptureError)
            assert any("ending the capture failed too" in note for note in notes), notes
        else:
            assert notes == []  # the fork was joined back, so the driver ended the capture cleanly
        with pytest.raises(CaptureError, match="capture failed"):
            graph.launch(s)
        await _both_streams_work(add_one, s, side, x, y, 1.0)  # the captured work never ran


@pytest.mark.parametrize("block", ["with", "async-with"])
async def test_a_fork_left_unjoined_fails_the_capture_naming_its_stream(
    module: Module, anyio_backend: object, block: str
) -> None:
    """``side`` joins the capture behind aiocuda's back (another library's wait on an event
    recorded in it, here the raw driver call) and its work is never joined back: the
    block ends normally, and the capture fails with a CaptureError coded
    STREAM_CAPTURE_UNJOINED that names ``side``; both streams take work again, and what
    ``side`` was given to hold meanwhile is let go."""
    add_one = module.kernel("add_one")
    with Stream(0) as s, Stream(0) as side:
        x, y = await _device(0.0, s), await _device(0.0, side)
        kept = _Kept()
        held = weakref.ref(kept)

        def stage(keep: _Kept) -> None:
            add_one.launch(GRID, BLOCK, x, N, stream=s)
            s.device._driver.stream_wait_event(side.handle, s.record().handle)
            add_one.launch(GRID, BLOCK, y, N, stream=side)  # captured: side is in the capture
            side.hold(keep)  # (aiocuda does not know side is captured: a hold recorded in the graph)

        with pytest.raises(CaptureError, match="not joined back") as caught:
            if block == "with":
                with s.capture() as graph:
                    stage(kept)
            else:
                async with s.capture() as graph:
                    stage(kept)
        assert caught.value.code == ResultCode.STREAM_CAPTURE_UNJOINED
        assert repr(side) in str(caught.value) and "1 kernel node" in str(caught.value)
        with pytest.raises(CaptureError, match="capture failed"):
            graph.launch(s)
        await _both_streams_work(add_one, s, side, x, y, 1.0)
        del kept
        side.hold()  # (holds are let go lazily, by the next hold or await)
        gc.collect()
        assert held() is None


class _Kept:
    """Something to hold."""


@pytest.mark.parametrize("block", ["raises", "ends"])
async def test_an_end_the_driver_refuses_and_keeps_going_is_ended_again(
    sim_module: Module, sim_backend: Any, anyio_backend: object, block: str
) -> None:
    """A driver that answers the end with STREAM_CAPTURE_UNJOINED and keeps the capture
    going (as it does for an end from the wrong thread, and as ROCm's HIP did for an
    unjoined fork; CUDA documents ending it): the streams still leave the capture."""
    add_one = sim_module.kernel("add_one")
    with Stream(0) as s, Stream(0) as side:
        x, y = await _device(0.0, s), await _device(0.0, side)
        sim_backend.inject_fault(ResultCode.STREAM_CAPTURE_UNJOINED, call="stream_end_capture")
        with pytest.raises(Exception) as caught:
            async with s.capture():
                side.wait(s)
                add_one.launch(GRID, BLOCK, y, N, stream=side)
                add_one.launch(GRID, BLOCK, x, N, stream=s)
                if block == "raises":
                    raise RuntimeError("stage bug")
        if block == "raises":
            assert isinstance(caught.value, RuntimeError)
            assert any("ending the capture failed too" in note for note in caught.value.__notes__)
        else:
            assert isinstance(caught.value, CaptureError)
            assert caught.value.code == ResultCode.STREAM_CAPTURE_UNJOINED
        await _both_streams_work(add_one, s, side, x, y, 1.0)


async def test_a_stream_the_driver_leaves_in_a_capture_is_named(
    sim_module: Module, sim_backend: Any, anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A driver that ends the capture on the origin but leaves a stream that joined it in
    an invalidated capture, which no end releases (CUDA documents otherwise): the block's
    exception propagates and notes which stream cannot take work; the origin can."""
    add_one = sim_module.kernel("add_one")
    end = type(sim_backend).stream_end_capture

    def leaving_side(self: Any, stream: Any) -> Any:
        capture = stream.capture
        try:
            return end(self, stream)
        finally:
            for member in capture.tails:
                if member is not capture.origin:
                    member.capture = capture  # still in it, invalidated
                    capture.error = capture.error or RuntimeError("left behind")

    with Stream(0) as s, Stream(0) as side:
        x = await _device(0.0, s)
        monkeypatch.setattr(type(sim_backend), "stream_end_capture", leaving_side)
        with pytest.raises(RuntimeError, match="stage bug") as caught:
            async with s.capture():
                side.wait(s)
                raise RuntimeError("stage bug")
        monkeypatch.undo()
        (note,) = [note for note in caught.value.__notes__ if "in capture mode after the capture ended" in note]
        assert repr(side) in note and "(invalidated)" in note
        assert _capture_status(s) == "none"
        add_one.launch(GRID, BLOCK, x, N, stream=s)
        np.testing.assert_array_equal(await x.to_host(stream=s), 1.0)


async def test_buffers_used_by_a_graph_stay_ordered_and_alive(module: Module, anyio_backend: object) -> None:
    add_one = module.kernel("add_one")
    pool = aiocuda.MemoryPool.for_device(0)
    with Stream(0) as s, Stream(0) as other:
        x = await _device(0.0, s)
        async with s.capture() as graph:
            add_one.launch(GRID, BLOCK, x, N, stream=s)
        await x.fill(5.0, stream=other)  # a replay on s must come after it
        await graph.launch(s)
        np.testing.assert_array_equal(await x.to_host(stream=s), 6.0)
        live = pool.statistics().live_buffers
        del x
        gc.collect()
        assert pool.statistics().live_buffers == live  # the graph keeps it
        await graph.launch(s)
        graph.close()
        await s
        await s  # the replays are done: what they used goes
        gc.collect()
        assert pool.statistics().live_buffers == live - 1
        z = await _device(0.0, s)
        async with s.capture() as graph:
            add_one.launch(GRID, BLOCK, z, N, stream=s)
        z.buffer.free()
        with pytest.raises(ArgumentError, match="freed"):
            graph.launch(s)


async def test_buffers_collected_during_a_capture_are_freed_after_it(module: Module, anyio_backend: object) -> None:
    # On an H100 a free on the capturing thread invalidated the capture now and then.
    add_one = module.kernel("add_one")
    pool = aiocuda.MemoryPool.for_device(0)
    with Stream(0) as s, Stream(0) as other:
        x = await _device(0.0, s)
        dropped = await _device(0.0, other)
        live = pool.statistics().live_buffers
        async with s.capture() as graph:
            add_one.launch(GRID, BLOCK, x, N, stream=s)
            del dropped
            gc.collect()  # its free waits for the capture's end (the pool cannot be asked
            # how many buffers live while a stream captures: the driver refuses the call)
        assert pool.statistics().live_buffers == live - 1
        await graph.launch(s)
        np.testing.assert_array_equal(await x.to_host(stream=s), 1.0)


# -- doorbells ---------------------------------------------------------------------------------------
class _OneShotDoorbell(SemaphoreDoorbell):
    """A host function that frees its data after the first call, as cuda-bindings' wrapper
    of cuLaunchHostFunc does: captured into a graph, it rings on the first replay only."""

    __slots__ = ("_spent",)

    def __init__(self) -> None:
        super().__init__()
        self._spent = False

    def ring(self) -> None:
        if not self._spent:
            self._spent = True
            super().ring()


@pytest.mark.parametrize(
    "bell_type",
    [
        pytest.param(SemaphoreDoorbell, id="sem_post"),
        pytest.param(_OneShotDoorbell, id="one-shot", marks=pytest.mark.xfail(strict=True, reason="rings once")),
    ],
)
async def test_captured_doorbell_rings_on_every_replay(
    backend: _driver.Driver, bell_type: type[SemaphoreDoorbell], anyio_backend: object
) -> None:
    if bell_type is _OneShotDoorbell and backend.name != "sim":
        pytest.skip("the one-shot host function is the simulator's model of cuda-bindings' wrapper")
    bell = bell_type()
    with Stream(0) as s:
        async with s.capture() as graph:
            backend.launch_doorbell(s.handle, bell)
        assert [node.kind for node in graph.nodes] == ["host"]
        rung = []
        for _ in range(3):
            await graph.launch(s)  # a replay is done once its host nodes have run
            rung.append(bell.wait(0.0))
        assert rung == [True, True, True]


# -- faults and cancellation ---------------------------------------------------------------------------
async def test_a_fault_inside_a_replay_fails_its_await(sim_backend: _driver.Driver, anyio_backend: object) -> None:
    with Stream(0) as s, Stream(0) as other:
        _kernel(s, "poison")
        async with s.capture() as graph:
            poison_op(s)
        with pytest.raises(ContextPoisonedError):
            await graph.launch(s)
        with pytest.raises(ContextPoisonedError):
            await other.record()


FAULT_SCRIPT = """
import anyio
from aiocuda.stream import Stream
from aiocuda.errors import ContextPoisonedError
from _workload import _kernel, poison_op

async def main():
    s, other = Stream(0), Stream(0)
    _kernel(s, "poison")
    async with s.capture() as graph:
        poison_op(s)
    other.wait(s)
    try:
        await graph.launch(s)
    except ContextPoisonedError as exc:
        print("REPLAY FAILED", exc.name)
    try:
        await other.record()
    except ContextPoisonedError as exc:
        print("OTHER FAILED", exc.name)

anyio.run(main, backend="{lib}")
"""


@pytest.mark.gpu
@pytest.mark.parametrize("lib", ["asyncio", "trio"])
def test_real_fault_inside_a_replay_fails_its_await(lib: str) -> None:
    """On the GPU, in a process of its own: an illegal address in a replayed kernel fails
    the await of the replay and later calls with ContextPoisonedError."""
    from .conftest import real_gpu_count

    if real_gpu_count() == 0:
        pytest.skip("no real GPU")
    if lib == "trio":
        pytest.importorskip("trio")
    proc = run_script(FAULT_SCRIPT.replace("{lib}", lib), "cuda")
    assert "REPLAY FAILED" in proc.stdout, proc.stdout + proc.stderr
    assert "OTHER FAILED" in proc.stdout, proc.stdout + proc.stderr


async def test_a_graph_closed_after_its_launch_stream_keeps_what_the_replay_uses(
    module: Module, anyio_backend: object
) -> None:
    """A replay on a per-request stream, the stream closed and the graph closed before the
    replay ran: the page-locked arrays it copies from and to stay alive until it has (they
    went back to the pinned cache, to be handed to other arrays while the replay still
    wrote into them)."""
    add_one = module.kernel("add_one")
    s = Stream(0)
    backend = s.device._driver
    host_in, host_out = _pinned(5.0), _pinned(0.0)
    graph = await _upload_add_one_download(add_one, s, host_in, host_out)
    request = Stream(0)
    handle = request.handle
    if backend.name == "sim":
        backend.pause(handle)  # type: ignore[attr-defined]
    else:
        slow_op(request, 0.5)
    graph.launch(request)
    request.close()
    watched = [weakref.ref(host_in), weakref.ref(host_out)]
    graph.close()
    del graph, host_in, host_out
    gc.collect()
    assert all(ref() is not None for ref in watched)  # the pending replay uses them
    if backend.name == "sim":
        backend.resume(handle)  # type: ignore[attr-defined]
    await request
    np.testing.assert_array_equal(watched[1](), 6.0)  # type: ignore[misc]
    s.close()


async def test_a_graph_forgets_the_finished_streams_it_was_launched_on(module: Module, anyio_backend: object) -> None:
    add_one = module.kernel("add_one")
    with Stream(0) as s:
        x = await _device(0.0, s)
        async with s.capture() as graph:
            add_one.launch(GRID, BLOCK, x, N, stream=s)
        kept = []
        for _ in range(20):  # a stream per request, closed as the request ends
            with Stream(0) as request:
                await graph.launch(request)
            kept.append(weakref.ref(request))
        del request
        gc.collect()
        assert sum(ref() is not None for ref in kept) <= 2
        graph.close()
        await s
        np.testing.assert_array_equal(await x.to_host(stream=s), 20.0)


async def test_a_cancelled_await_leaves_the_replay_and_its_memory(module: Module, anyio_backend: object) -> None:
    add_one = module.kernel("add_one")
    backend = Stream(0).device._driver
    with Stream(0) as s:
        host_in, host_out = _pinned(1.0), _pinned(0.0)
        graph = await _upload_add_one_download(add_one, s, host_in, host_out)
        watched = weakref.ref(host_in)
        if backend.name == "sim":
            backend.pause(s.handle)  # type: ignore[attr-defined]
        else:
            slow_op(s, 0.5)
        with anyio.CancelScope() as scope:
            scope.cancel()
            await graph.launch(s)
        assert scope.cancelled_caught
        graph.close()
        del graph, host_in
        gc.collect()
        assert watched() is not None  # the replay still reads it
        if backend.name == "sim":
            backend.resume(s.handle)  # type: ignore[attr-defined]
        await s
        np.testing.assert_array_equal(host_out, 2.0)


async def test_replays_run_one_after_another(sim_backend: _driver.Driver, anyio_backend: object) -> None:
    log: list[str] = []
    with Stream(0) as s, Stream(0) as t:
        async with s.capture() as graph:
            sim_backend.enqueue(s.handle, lambda: log.append("replay"))  # type: ignore[attr-defined]
        sim_backend.pause(s.handle)  # type: ignore[attr-defined]
        graph.launch(s)
        done = graph.launch(t)  # waits for the replay held up on s
        sim_backend.enqueue(t.handle, lambda: log.append("after"))  # type: ignore[attr-defined]
        assert log == []
        sim_backend.resume(s.handle)  # type: ignore[attr-defined]
        await done
        await t
        assert log == ["replay", "replay", "after"]


def test_unknown_capture_mode(backend: _driver.Driver) -> None:
    with Stream(0) as s, pytest.raises(ArgumentError, match="unknown capture mode"):
        s.capture("loose")  # type: ignore[arg-type]


async def test_kernel_nodes_of_unknown_kernels_are_replayed_not_read(module: Module, anyio_backend: object) -> None:
    """A kernel aiocuda did not launch (here: its registration dropped) has no arguments
    to read; its node is replayed as captured."""
    add_one = module.kernel("add_one")
    with Stream(0) as s:
        x = await _device(0.0, s)
        async with s.capture() as graph:
            add_one.launch(GRID, BLOCK, x, N, stream=s)
        assert isinstance(graph.nodes[0].kernel, Kernel)
        from aiocuda._graph import kernels as registry

        registry._kernels.clear()
        async with s.capture() as unknown:
            add_one.launch(GRID, BLOCK, x, N, stream=s)
        node = unknown.nodes[0]
        assert node.kernel is None and node.arguments is None
        with pytest.raises(GraphUpdateError, match="did not launch"):
            unknown.set_kernel_args(node, x, N)
        await unknown.launch(s)
        np.testing.assert_array_equal(await x.to_host(stream=s), 1.0)


async def test_an_external_event_record_is_recorded_by_every_replay(module: Module, anyio_backend: object) -> None:
    add_one = module.kernel("add_one")
    with Stream(0) as s:
        x = await _device(0.0, s)
        done = aiocuda.Event(0)
        async with s.capture() as graph:
            add_one.launch(GRID, BLOCK, x, N, stream=s)
            done.record(s, external=True)
        assert [node.kind for node in graph.nodes] == ["kernel", "event_record"]
        for expected in (1.0, 2.0):
            graph.launch(s)
            await done  # recorded by the replay
            np.testing.assert_array_equal(await x.to_host(stream=s), expected)
