"""Sharing device memory and events between processes (aiocuda.ipc).

The two-process tests start a real second process (multiprocessing, spawn) on the same
backend: on the simulator the processes share memory through memfds, on a GPU through
the driver's IPC. Ordering is checked by content, never by timing: the producer's
stream is held back (paused on the simulator, busy behind a slow kernel on a GPU) while
the consumer reads, so a read not ordered after the producer's event would see zeros.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import multiprocessing
import os
import pickle
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import numpy as np
import pytest

import aiocuda
from aiocuda import _driver, ipc
from aiocuda._driver.sim import _shared
from aiocuda._memory import ipc_service, offloop
from aiocuda.errors import ArgumentError, ExporterLostError

from . import _ipc_child
from ._workload import slow_op

pytestmark = pytest.mark.anyio

WAIT = 60.0  # generous: a spawned child imports numpy and aiocuda on a loaded machine


class Child:
    """A spawned process running one of ``_ipc_child``'s functions."""

    def __init__(self, target: Callable[..., None], backend: str) -> None:
        context = multiprocessing.get_context("spawn")
        self.inbox: Any = context.Queue()
        self.outbox: Any = context.Queue()
        self.process = context.Process(target=target, args=(backend, self.inbox, self.outbox), daemon=True)
        self.process.start()

    async def expect(self, tag: str) -> Any:
        got, value = await anyio.to_thread.run_sync(lambda: self.outbox.get(timeout=WAIT))
        if got == "error":
            pytest.fail(f"the other process failed:\n{value}")
        assert got == tag, f"expected {tag!r} from the other process, got {got!r}"
        return value

    def end(self) -> None:
        self.process.join(5.0)  # it has said everything it will say: it ends, or is ended
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


async def _eventually(condition: Callable[[], bool]) -> bool:
    """Whether ``condition()`` holds within WAIT seconds (looked at every 10 ms)."""
    deadline = time.monotonic() + WAIT
    for _ in itertools.count():
        if condition() or time.monotonic() > deadline:
            break
        await anyio.sleep(0.01)
    return condition()


@pytest.fixture
def pool_sharing(backend: _driver.Driver) -> None:
    """Where the driver cannot share pool memory between processes, skip saying why."""
    try:
        aiocuda.ipc.pool(0)
    except aiocuda.errors.CudaError as exc:
        if exc.name != "CUDA_ERROR_NOT_SUPPORTED":
            raise
        pytest.skip(str(exc))


@pytest.fixture
def child_backend(backend: _driver.Driver) -> Iterator[str]:
    yield backend.name


@pytest.fixture(scope="module")
def other_process() -> ipc_service.Service:
    """A second sharing service in this process, standing for another process: what it
    exports is imported through its socket, as from another process (the simulator
    imports a pool into the process that exported it too), and a test stalls it, as a
    stopped process, by holding its lock."""
    return ipc_service.Service()


def _shared_by(sharing: ipc_service.Service, array: aiocuda.DeviceArray, imports: int) -> ipc.SharedArray:
    """``array`` shared by ``sharing`` instead of this process's service."""
    local = ipc.share_array(array)
    event = ipc.open_event(local.ready)  # (in the sharing process: the event itself)
    local.revoke()
    export = sharing.export(array.buffer, event, imports)
    return dataclasses.replace(local, exporter=sharing.address, token=export.token)


IOTA = r"""
extern "C" __global__ void iota(float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = (float)i;
}
"""


def _iota(launch: Any, x: np.ndarray, n: np.int32) -> None:
    x[: int(n)] = np.arange(int(n), dtype=np.float32)


@pytest.fixture
def iota(backend: _driver.Driver) -> Iterator[aiocuda.Kernel]:
    """A kernel writing 0, 1, 2, ...: producer work enqueued without an await."""
    aiocuda.register_sim_kernel("iota", _iota)
    try:
        yield aiocuda.Program(IOTA, name="iota.cu").compile(aiocuda.Device(0)).kernel("iota")
    finally:
        aiocuda.register_sim_kernel("iota", None)


def _hold_back(stream: aiocuda.Stream) -> Callable[[], None]:
    """Keep ``stream`` from running what is enqueued next for a while; returns the
    release (the simulator pauses it; a GPU runs a slow kernel first)."""
    backend = stream.device._driver
    if backend.name == "sim":
        backend.pause(stream.handle)  # type: ignore[attr-defined]
        return lambda: backend.resume(stream.handle)  # type: ignore[attr-defined]
    slow_op(stream, 1.0)
    return lambda: None


async def test_two_processes_exchange_a_buffer_and_an_event(
    pool_sharing: None, backend: _driver.Driver, child_backend: str, anyio_backend: object, iota: aiocuda.Kernel
) -> None:
    pool = ipc.pool(0)
    child = Child(_ipc_child.consume, child_backend)
    try:
        stream = aiocuda.Stream(0)
        n = 1 << 16
        values = np.arange(n, dtype=np.float32)
        array = await aiocuda.zeros(n, np.float32, stream=stream, pool=pool)
        release = _hold_back(stream)
        iota.launch((n + 255) // 256, 256, array, n, stream=stream)  # behind the hold
        shared = ipc.share_array(array)  # records the producer's event after the kernel
        child.inbox.put(shared)
        await child.expect("opened")
        release()
        seen, written = await child.expect("seen")
        np.testing.assert_array_equal(seen, values)  # read after the producer's copy
        done = ipc.open_event(written)
        await done  # the consumer's write, awaited in this process
        np.testing.assert_array_equal(await array.to_host(stream=stream), values + 1)
        child.inbox.put("done")
        await child.expect("finished")
    finally:
        child.end()


async def test_memory_outlives_neither_side(
    pool_sharing: None, backend: _driver.Driver, child_backend: str, anyio_backend: object
) -> None:
    """An import whose exporter ends raises ExporterLostError instead of reading memory
    that is no longer the exporter's; a shared array's memory is freed once the exporter
    dropped it and every importer is done, an importer that died included."""
    child = Child(_ipc_child.produce, child_backend)
    try:
        shared = await child.expect("shared")
        stream = aiocuda.Stream(0)
        array = await ipc.open_array(shared, stream=stream)
        np.testing.assert_array_equal(await array.to_host(stream=stream), np.arange(4096, dtype=np.int32))
        with pytest.raises(ExporterLostError, match="every import"):
            await ipc.open_array(shared, stream=stream)  # shared for one import only
        child.inbox.put("exit")
        await anyio.to_thread.run_sync(child.process.join, WAIT)
        assert await _eventually(lambda: array.buffer.freed)
        with pytest.raises(ExporterLostError, match="ended"):
            await array.to_host(stream=stream)
    finally:
        child.end()
    pool = ipc.pool(0)
    before = pool.statistics().used_bytes
    consumer = Child(_ipc_child.consume, child_backend)
    try:
        shared_here = ipc.share_array(await aiocuda.zeros(1 << 16, np.float32, pool=pool))
        consumer.inbox.put(shared_here)
        await consumer.expect("opened")
        await consumer.expect("seen")  # it holds the import now
        assert pool.statistics().used_bytes > before
        consumer.process.kill()  # ended without releasing: its connection's end does
        assert await _eventually(lambda: pool.statistics().used_bytes == before)
    finally:
        consumer.end()


async def test_a_forked_helper_hides_no_ending(
    pool_sharing: None, backend: _driver.Driver, child_backend: str, anyio_backend: object
) -> None:
    """A helper forked by a sharing process keeps none of its connections: an importer
    still sees its exporter end, an exporter still gets back what a dead importer held,
    while the helper lives on; the process that forked goes on sharing."""
    helpers: list[int] = []
    producer = Child(_ipc_child.produce_and_fork, child_backend)
    consumer = Child(_ipc_child.consume_and_fork, child_backend)
    try:
        stream = aiocuda.Stream(0)
        array = await ipc.open_array(await producer.expect("shared"), stream=stream)
        producer.inbox.put("fork")
        helpers.append(await producer.expect("forked"))  # then it ends (a join would wait for the helper)
        assert await _eventually(lambda: array.buffer.freed)
        with pytest.raises(ExporterLostError, match="ended"):
            await array.to_host(stream=stream)
        pool = ipc.pool(0)
        before = pool.statistics().live_buffers
        consumer.inbox.put(ipc.share_array(await aiocuda.zeros(1 << 16, np.float32, pool=pool), imports=2))
        helpers.append(await consumer.expect("forked"))
        consumer.process.kill()
        assert await _eventually(lambda: pool.statistics().live_buffers == before)
    finally:
        for pid in helpers:
            os.kill(pid, signal.SIGKILL)
        producer.end()
        consumer.end()


def _files() -> set[int]:
    """The inodes of what this process's descriptors refer to."""
    found = set()
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # (the listing's own descriptor, gone)
            found.add(os.stat(f"/proc/self/fd/{name}").st_ino)
    return found


async def test_an_ended_exporters_pools_are_let_go(sim_backend: _driver.Driver, anyio_backend: object) -> None:
    """Once an exporter ended and every import from it ended, the pools imported from it
    are destroyed: no descriptor the imports opened stays open (the simulator's: the
    pool's shared memory, mapped here)."""
    producer = Child(_ipc_child.produce, "sim")
    try:
        shared = await producer.expect("shared")
        stream = aiocuda.Stream(0)
        ipc_service.service()  # (its own sockets stay)
        before = _files()
        array = await ipc.open_array(shared, stream=stream)
        opened = _files() - before
        assert opened
        np.testing.assert_array_equal(await array.to_host(stream=stream), np.arange(4096, dtype=np.int32))
        producer.inbox.put("exit")
        assert await _eventually(lambda: array.buffer.freed)  # lost
        array.buffer.free()  # the import ends once the stream lets go of its owner: held
        await stream  # until the work before has completed, let go by the stream's next await
        await stream
        assert await _eventually(lambda: not opened & _files())
    finally:
        producer.end()


async def test_one_allocation_shared_again_and_again(
    pool_sharing: None, backend: _driver.Driver, child_backend: str, anyio_backend: object
) -> None:
    """Each round shares the same allocation anew while the other process drops the
    last round's import: an import ending must never free the next round's."""
    child = Child(_ipc_child.reopen, child_backend)
    try:
        stream = aiocuda.Stream(0)
        array = aiocuda.empty(1024, np.int32, stream=stream, pool=ipc.pool(0))
        for round_ in range(20):
            await array.fill(round_, stream=stream)
            child.inbox.put(ipc.share_array(array))
            assert await child.expect("read") == round_
        child.inbox.put(None)
    finally:
        child.end()


async def test_sharing_in_one_process(pool_sharing: None, backend: _driver.Driver, anyio_backend: object) -> None:
    """The descriptor pickles; opened in the process that shared it, it is the same
    memory; each share allows the imports it was made for; the pool is exportable."""
    pool = ipc.pool(0)
    assert pool.exportable and ipc.pool(0) is pool
    stream = aiocuda.Stream(0)
    array = await aiocuda.to_device(np.arange(64, dtype=np.int64).reshape(8, 8), stream=stream, pool=pool)
    shared = pickle.loads(pickle.dumps(ipc.share_array(array[2:6, ::2], imports=2)))
    assert shared.shape == (4, 4) and shared.strides == (64, 16)
    first = await ipc.open_array(shared, stream=stream)
    second = await ipc.open_array(shared)
    np.testing.assert_array_equal(await second.to_host(), np.arange(64).reshape(8, 8)[2:6, ::2])
    await first.fill(-1, stream=stream)
    assert (await array.to_host(stream=stream))[2:6, ::2].tolist() == [[-1] * 4] * 4
    with pytest.raises(ExporterLostError):
        await ipc.open_array(shared)
    revoked = ipc.share_array(array)
    revoked.revoke()
    with pytest.raises(ExporterLostError, match="revoked"):
        await ipc.open_array(revoked)
    with pytest.raises(ArgumentError, match="IPC pool"):
        ipc.share_array(await aiocuda.zeros(4))
    with pytest.raises(ArgumentError, match="imports"):
        ipc.share_array(array, imports=0)


async def test_an_array_opened_where_it_was_shared_has_its_own_buffer(
    pool_sharing: None, backend: _driver.Driver, anyio_backend: object
) -> None:
    """Opened in the sharing process, a shared array is over a buffer of its own, as in
    another process: freeing it leaves the producer's usable, and the other way round;
    the memory is freed once both are."""
    pool = ipc.pool(0)
    stream = aiocuda.Stream(0)
    before = pool.statistics().live_buffers
    array = await aiocuda.to_device(np.arange(16, dtype=np.int32), stream=stream, pool=pool)
    shared = ipc.share_array(array, imports=2)
    first = await ipc.open_array(shared, stream=stream)
    first.buffer.free()
    np.testing.assert_array_equal(await array.to_host(stream=stream), np.arange(16))
    second = await ipc.open_array(shared, stream=stream)
    array.buffer.free()
    np.testing.assert_array_equal(await second.to_host(stream=stream), np.arange(16))
    second.buffer.free()  # its owner, held until the work before is done,
    await stream  # is let go by the stream's next await
    await stream
    assert await anyio.to_thread.run_sync(offloop.drain, WAIT)
    assert pool.statistics().live_buffers == before


async def test_interprocess_events(backend: _driver.Driver, anyio_backend: object) -> None:
    stream = aiocuda.Stream(0)
    event = aiocuda.Event(0, interprocess=True)
    shared = pickle.loads(pickle.dumps(ipc.share_event(event)))
    assert ipc.open_event(shared) is event  # in the sharing process: the event itself
    release = _hold_back(stream)
    stream.record(event)
    if backend.name == "sim":
        assert not event.query()
    release()
    await ipc.open_event(shared)
    assert event.query()
    with pytest.raises(ArgumentError, match="interprocess"):
        ipc.share_event(aiocuda.Event(0))
    with pytest.raises(ArgumentError, match="timing"):
        aiocuda.Event(0, interprocess=True, timing=True)


async def test_a_shared_allocation_outlives_the_producers_free(
    pool_sharing: None, backend: _driver.Driver, anyio_backend: object
) -> None:
    """The producer freeing its shared buffer leaves the memory to the export: the next
    allocation does not get the block; the free happens once the export is settled."""
    pool = ipc.pool(0)
    stream = aiocuda.Stream(0)
    before = pool.statistics().live_buffers
    array = await aiocuda.to_device(np.arange(1024, dtype=np.int32), stream=stream, pool=pool)
    address = array.ptr
    shared = ipc.share_array(array)
    array.buffer.free()
    with pytest.raises(ArgumentError, match="freed"):
        array.ptr  # noqa: B018 - unusable here at once
    other = aiocuda.empty(1024, np.int32, stream=stream, pool=pool)
    assert other.ptr != address  # the shared block is still allocated
    other.buffer.free()
    shared.revoke()  # settled: the free is carried out now
    assert await anyio.to_thread.run_sync(offloop.drain, WAIT)
    assert pool.statistics().live_buffers == before


async def test_an_exporter_that_does_not_answer_fails_one_request(
    sim_backend: _driver.Driver,
    anyio_backend: object,
    other_process: ipc_service.Service,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An exporter that does not answer in time (stopped, stalled) fails that request
    with TimeoutError and is not taken for gone: what was opened from it stays usable,
    its late grant is undone, and later requests are answered."""
    stream = aiocuda.Stream(0)
    array = await aiocuda.to_device(np.arange(1024, dtype=np.int32), stream=stream, pool=ipc.pool(0))
    shared = _shared_by(other_process, array, imports=2)
    first = await ipc.open_array(shared, stream=stream)
    monkeypatch.setattr(ipc_service, "REPLY_TIMEOUT", 0.01)
    with other_process._lock, pytest.raises(TimeoutError):  # it cannot answer meanwhile
        await ipc.open_array(shared, stream=stream)
    monkeypatch.setattr(ipc_service, "REPLY_TIMEOUT", WAIT)
    assert await _eventually(_answered(other_process))
    np.testing.assert_array_equal(await first.to_host(stream=stream), np.arange(1024))
    second = await ipc.open_array(shared, stream=stream)  # the import the late grant gave back
    np.testing.assert_array_equal(await second.to_host(stream=stream), np.arange(1024))
    with pytest.raises(ExporterLostError, match="every import"):
        await ipc.open_array(shared, stream=stream)


def _answered(sharing: ipc_service.Service) -> Callable[[], bool]:
    """Whether every request to ``sharing`` was answered (and a late grant undone: the
    undo is sent, under the connection's lock, as its request leaves ``waiting``)."""
    connection = ipc_service.service().connection(sharing.address)

    def answered() -> bool:
        with connection.lock:
            return not connection.waiting

    return answered


@pytest.mark.parametrize("retry_at_once", [False, True], ids=["retry-later", "retry-at-once"])
async def test_a_cancelled_open_gives_up_at_once(
    sim_backend: _driver.Driver, anyio_backend: object, other_process: ipc_service.Service, retry_at_once: bool
) -> None:
    """Cancelling an open that waits for the exporter's answer ends it at once (not after
    REPLY_TIMEOUT); the grant that comes later is undone, or goes to an open of the same
    array made before it came, which takes the cancelled one's place."""
    stream = aiocuda.Stream(0)
    array = await aiocuda.to_device(np.arange(1024, dtype=np.int32), stream=stream, pool=ipc.pool(0))
    shared = _shared_by(other_process, array, imports=1)
    connection = ipc_service.service().connection(other_process.address)
    scope = anyio.CancelScope()
    opened: list[aiocuda.DeviceArray] = []

    async def cancel_once_sent() -> None:
        assert await _eventually(lambda: bool(connection.waiting))
        scope.cancel()

    async def open_again() -> None:
        opened.append(await ipc.open_array(shared, stream=stream))

    async with anyio.create_task_group() as tasks:
        with other_process._lock:  # it cannot answer meanwhile
            tasks.start_soon(cancel_once_sent)
            with scope:
                await ipc.open_array(shared, stream=stream)
            assert scope.cancelled_caught and connection.waiting[0].abandoned
            if retry_at_once:  # before the answer: it takes the cancelled request's place
                tasks.start_soon(open_again)
                assert await _eventually(lambda: not connection.waiting[0].abandoned)
    if not retry_at_once:
        assert await _eventually(_answered(other_process))  # granted and undone
        await open_again()
    np.testing.assert_array_equal(await opened[0].to_host(stream=stream), np.arange(1024))  # the one import


async def test_a_simulated_interprocess_event_closed_while_pending_gives_its_slot_back(
    sim_backend: _driver.Driver, anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The simulator's interprocess events take one of its few slots each: an event
    closed while its record is pending gives it back once the record completes."""
    monkeypatch.setattr(_shared, "SLOTS", 4)  # (the backend's slots are made at its first interprocess event)
    stream = aiocuda.Stream(0)
    release = _hold_back(stream)
    for _ in range(_shared.SLOTS):
        event = aiocuda.Event(0, interprocess=True)
        stream.record(event)
        event.close()
    release()
    await stream
    for _ in range(_shared.SLOTS):
        aiocuda.Event(0, interprocess=True).close()  # each finds a slot
