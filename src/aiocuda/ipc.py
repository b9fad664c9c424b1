"""Device memory and events shared between processes on one machine.

A producer shares an array allocated from an IPC pool; the descriptor it gets is small
and picklable, so it travels over ``multiprocessing`` (any start method), a socket or
Ray; the consumer opens it and gets a :class:`~aiocuda.array.DeviceArray` over the same
memory, with its stream ordered after the producer's work on the GPU (the producer's
event travels with the descriptor):

```python
# producer
frame = aiocuda.empty((1080, 1920, 3), np.uint8, pool=aiocuda.ipc.pool(0), stream=stream)
render.launch(grid, block, frame, stream=stream)
queue.put(aiocuda.ipc.share_array(frame))            # no wait: the event says when it is done

# consumer (another process)
frame = await aiocuda.ipc.open_array(queue.get(), stream=stream)
await frame.to_host()                               # after the producer's kernel, on the GPU
```

Lifetimes: a shared allocation stays allocated in the producer -- whatever the
producer does with its own array -- until it has been opened as many times as it was
shared for (``imports``, default 1) and every opened array was freed and its work
finished (dropping it does that). A consumer whose producer process ends gets
:class:`~aiocuda.errors.ExporterLostError` from the opened array instead of using
memory the producer no longer owns; a producer whose consumer ends gets the memory
back.

Events: ``Event(device, interprocess=True)``, shared with :func:`share_event` and opened
with :func:`open_event`, is awaitable, queryable and waitable by streams in the other
process. Keep it alive in the sharing process while others use it.

Both processes must use the same GPU (matched by UUID, whatever its ordinal in each
process) and the same backend. The simulated backend shares memory between processes
through shared memory, so all of this works without a GPU too.
"""

from __future__ import annotations

import secrets
import threading
import weakref
from dataclasses import dataclass

import anyio.to_thread
import numpy as np

from . import _driver
from ._memory.buffers import OwnedBuffer
from ._memory.ipc_service import Request, service
from ._util import invalid_value
from .array import DeviceArray
from .device import Device, _as_device, devices
from .errors import ArgumentError, CudaError, ExporterLostError, ResultCode
from .event import Event
from .memory import DeviceBuffer, MemoryPool
from .stream import Stream, current_stream

__all__ = ["SharedArray", "SharedEvent", "open_array", "open_event", "pool", "share_array", "share_event"]


@dataclass(frozen=True)
class SharedEvent:
    """An interprocess event, described for another process (picklable): open it there
    with :func:`open_event`."""

    handle: bytes
    """The driver's IPC event handle."""
    device: str
    """The UUID of the event's GPU."""
    backend: str
    process: str
    """Which process shared it."""
    key: bytes
    """The event's name in the sharing process."""


@dataclass(frozen=True)
class SharedArray:
    """A device array shared by another process (picklable): open it with
    :func:`open_array`. ``ready`` is the event marking the end of the producer's work."""

    shape: tuple[int, ...]
    dtype: str
    strides: tuple[int, ...]
    offset: int
    """Bytes from the allocation's start to the array's first element."""
    size: int
    """Bytes of the whole allocation."""
    device: str
    """The UUID of the array's GPU."""
    backend: str
    pointer: bytes
    """The driver's export data of the allocation."""
    ready: SharedEvent
    exporter: str
    """Where the sharing process answers (its socket)."""
    token: bytes

    def revoke(self) -> None:
        """In the sharing process: stop waiting for the imports not made yet (those made
        keep the memory until they are freed). Elsewhere: nothing."""
        sharing = service()
        if sharing.address == self.exporter:
            sharing.revoke(self.token)


_POSIX_FILE_DESCRIPTOR = 1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, a bit of mempool_supported_handle_types
_pools: dict[tuple[int, int], MemoryPool] = {}
_pools_lock = threading.Lock()
_local_events: weakref.WeakValueDictionary[bytes, Event] = weakref.WeakValueDictionary()


def pool(device: Device | int | None = None) -> MemoryPool:
    """The IPC pool of ``device``: arrays allocated from it can be shared
    (``aiocuda.empty(..., pool=aiocuda.ipc.pool(0))``). Created on first use; a
    :class:`~aiocuda.errors.CudaError` (``CUDA_ERROR_NOT_SUPPORTED``) where the device
    cannot share pools through file descriptors."""
    dev = _as_device(device)
    key = (_driver.backend_generation(), dev.ordinal)
    with _pools_lock:
        found = _pools.get(key)
        if found is None:
            if not dev.attribute("mempool_supported_handle_types") & _POSIX_FILE_DESCRIPTOR:
                raise CudaError(
                    f"device {dev.ordinal} cannot share memory pools with other processes through file "
                    "descriptors (the driver's mempool_supported_handle_types lacks them)",
                    code=ResultCode.NOT_SUPPORTED,
                    name="CUDA_ERROR_NOT_SUPPORTED",
                )
            created = MemoryPool.create(dev, ipc=True)
            _check_exports(created)
            found = _pools[key] = created
    return found


def _check_exports(created: MemoryPool) -> None:
    """Raise NOT_SUPPORTED where the driver creates shareable pools but refuses to export
    their allocations (an H100 in a virtual machine here: cuMemPoolExportPointer returns
    CUDA_ERROR_INVALID_VALUE for every allocation, through the bindings and libcuda alike)."""
    with Stream(created.device) as stream:
        probe = created.allocate(256, stream)
        try:
            created.device._driver.mempool_export_pointer(probe.ptr)
        except ArgumentError as exc:
            raise CudaError(
                f"the driver refuses to export allocations of device {created.device.ordinal}'s shareable "
                f"pools ({exc}): memory cannot be shared with other processes on this system",
                code=ResultCode.NOT_SUPPORTED,
                name="CUDA_ERROR_NOT_SUPPORTED",
            ) from exc
        finally:
            probe.free()


def share_array(array: DeviceArray, *, stream: Stream | None = None, imports: int = 1) -> SharedArray:
    """Share ``array`` (allocated from an IPC pool) with other processes.

    Records an interprocess event on ``stream`` (default: the stream of the array's last
    operation) after the array's work: openers order their work after it. The
    allocation stays allocated until it has been opened ``imports`` times and every
    opened array was freed (see the module docstring); :meth:`SharedArray.revoke` gives
    up the imports not made. Enqueues only: never waits for the GPU.
    """
    buffer = array.buffer
    if not isinstance(buffer, DeviceBuffer) or not buffer.pool.exportable:
        raise invalid_value(
            "only arrays allocated from an IPC pool can be shared: allocate with pool=aiocuda.ipc.pool(device)"
        )
    if not isinstance(imports, int) or imports < 1:
        raise invalid_value(f"imports must be a positive int, not {imports!r}")
    s = array._stream_for(stream if stream is not None else buffer.stream)
    event = Event(array.device, interprocess=True).record(s)
    driver = array.device._driver
    array.device.make_current()
    pointer = driver.mempool_export_pointer(buffer.ptr)
    export = service().export(buffer, event, imports)
    return SharedArray(
        shape=array.shape,
        dtype=array.dtype.str,
        strides=array.strides,
        offset=array.offset,
        size=buffer.size,
        device=array.device.uuid,
        backend=driver.name,
        pointer=pointer,
        ready=_describe(event),
        exporter=service().address,
        token=export.token,
    )


async def open_array(shared: SharedArray, *, stream: Stream | None = None) -> DeviceArray:
    """The array another process shared, over the same device memory.

    ``stream`` (default: the current stream of the array's device) waits on the GPU for
    the producer's work before anything enqueued on it later; await it (or any copy of
    the array) to wait on the host. The first array from a process costs a connection
    and the pool's import; each open is one request to the producer, made off the
    event loop's thread. Cancelling the open takes effect at once; the import the
    producer may grant later is given back. Opened in the sharing process itself, the
    array has a buffer of its own over the same memory, counted as an import: freeing
    it, or the producer's, leaves the other usable.

    Raises :class:`~aiocuda.errors.ExporterLostError` when the producer has ended or
    every import it shared the array for was made, and :class:`TimeoutError` when it
    does not answer within ``aiocuda._memory.ipc_service.REPLY_TIMEOUT`` (30) seconds:
    stopped or stalled, it may answer later (arrays already opened from it stay usable).
    """
    device = _device_of(shared.device, shared.backend)
    s = stream if stream is not None else current_stream(device)
    if s.device is not device:
        raise invalid_value(f"the shared array is on device {device.ordinal}; the stream is on {s.device.ordinal}")
    sharing = service()
    if shared.exporter == sharing.address:
        taken = sharing.take_local(shared.token)
        if taken is None:
            raise ExporterLostError(
                "the array is no longer shared: every import was made, or it was revoked", name="AIOCUDA_IPC_REFUSED"
            )
        export, use = taken
        # A buffer of its own, as in another process: freeing it, or the producer's,
        # leaves the other usable.
        buffer = OwnedBuffer(export.ptr, shared.size, device, s, use)
        s.wait(export.event)
    else:
        request = Request(shared.token)
        try:
            buffer, ready = await anyio.to_thread.run_sync(_import, shared, device, s, request, abandon_on_cancel=True)
        except BaseException:  # cancelled: the thread stops waiting (nothing, had it failed)
            request.give_up()
            raise
        s.wait(ready)
    array = DeviceArray(shared.shape, np.dtype(shared.dtype), shared.strides, buffer=buffer, offset=shared.offset)
    array._stream_for(s)
    return array


def _import(shared: SharedArray, device: Device, stream: Stream, request: Request) -> tuple[OwnedBuffer, Event]:
    """The blocking part of :func:`open_array` (a worker thread, abandoned if the caller
    is cancelled: ``request`` is given up then, and an import made all the same goes
    with its buffer, which nobody keeps): acquire the export, import the pool (first
    time) and the pointer, open the producer's event."""
    sharing = service()
    connection = sharing.connection(shared.exporter)
    pool_key = connection.request(request)
    try:
        use = sharing.open_import(connection, pool_key, shared.pointer, shared.token, device)
    except BaseException:
        connection.release(shared.token)
        raise
    buffer = OwnedBuffer(use.imported.ptr, shared.size, device, stream, use)
    use.imported.buffers.add(buffer)
    if connection.lost is not None:
        buffer.lose(connection.lost)
    device.make_current()
    ready = Event._opened(device, device._driver.ipc_open_event(shared.ready.handle))
    return buffer, ready


def share_event(event: Event) -> SharedEvent:
    """Describe an interprocess event (``Event(device, interprocess=True)``) for
    another process; keep the event alive here while others use it."""
    if not event.interprocess:
        raise invalid_value("only an event made with Event(device, interprocess=True) can be shared")
    return _describe(event)


def _describe(event: Event) -> SharedEvent:
    device = event.device
    device.make_current()
    key = secrets.token_bytes(16)
    _local_events[key] = event
    return SharedEvent(
        handle=device._driver.ipc_event_handle(event.handle),
        device=device.uuid,
        backend=device._driver.name,
        process=service().address,
        key=key,
    )


def open_event(shared: SharedEvent) -> Event:
    """The event another process shared: await it, query it, or make a stream wait for
    it (``stream.wait(event)``). In the sharing process itself, the event itself."""
    device = _device_of(shared.device, shared.backend)
    if shared.process == service().address:
        local = _local_events.get(shared.key)
        if local is None:
            raise ExporterLostError("the shared event no longer exists", name="AIOCUDA_IPC_LOST")
        return local
    device.make_current()
    return Event._opened(device, device._driver.ipc_open_event(shared.handle))


def _device_of(uuid: str, backend: str) -> Device:
    """This process's device with that UUID, on the backend in use."""
    current = _driver.driver().name
    if backend != current:
        raise ArgumentError(
            f"shared on the {backend} backend; this process uses the {current} backend",
            code=ResultCode.INVALID_VALUE,
            name="CUDA_ERROR_INVALID_VALUE",
        )
    for device in devices():
        if device.uuid == uuid:
            return device
    raise ArgumentError(
        f"the shared memory is on GPU {uuid}, which this process does not see (CUDA_VISIBLE_DEVICES?)",
        code=ResultCode.INVALID_DEVICE,
        name="CUDA_ERROR_INVALID_DEVICE",
    )
