"""Working with PyTorch, CuPy, Numba and cuda.core: their work on aiocuda's streams, and
their arrays as aiocuda's.

**Their work on our stream, awaited.** A library's kernels go on an aiocuda stream (a
request lane's, say) inside a block that makes it that library's current stream; the
await comes after::

    with aiocuda.interop.torch_stream(lane.stream):     # or cupy_stream(...)
        y = model(x)                                    # enqueued on lane.stream
        out = lane.download(aiocuda.interop.as_device_array(y, stream=lane.stream))
    await lane                                          # the loop runs meanwhile

(``stream=`` says where aiocuda uses the array next: the lane's stream, where ``y`` was
made, so no ordering between streams is needed.)

A stream given to a library is kept alive, with the library's stream object over it,
until the process exits (closing it ends aiocuda's use, never destroys it): the library
keeps state keyed by its handle (PyTorch's cuBLAS workspaces and allocator blocks,
CuPy's memory pool) that outlives any block, and a destroyed stream whose handle is
reused is undefined behaviour. So give libraries
long-lived streams -- request lanes, whose ``setup`` also runs a model once per lane at
start-up so that this per-stream state is made before the first request, not on the
loop under load -- never a stream per request. On the simulated backend both blocks do
nothing (a CPU-only PyTorch model then runs synchronously inside them).

Memory: a tensor allocated inside the block is allocated on that stream, and is safe
to drop at any time, even before the await (the allocator reuses its block only for
later work on the same stream). A tensor made *outside* the block (on the library's
default stream) and used inside it must not be freed before the await, or be marked
with ``tensor.record_stream(the stream the block yields)`` first.

**Our await on their stream.** ``await aiocuda.Stream.wrap(torch.cuda.current_stream())``
(or any object with ``__cuda_stream__``, a CuPy or Numba stream, a raw handle) waits for
work the library enqueued, without owning the stream.

**Raw handles.** ``int(stream)`` (or ``stream.__cuda_stream__()[1]``) is the raw
``CUstream`` as an integer, which is what ``torch.cuda.ExternalStream`` and
``cupy.cuda.ExternalStream`` take; ``stream.handle`` is the backend's handle object, for
aiocuda's own driver calls.

**Arrays.** :func:`as_device_array` wraps another library's device array without a copy
(DLPack first, then ``__cuda_array_interface__``), ordering the producer's pending work
before the stream given; ``torch.from_dlpack(array)`` / ``cupy.from_dlpack(array)`` go
the other way, ordering the array's pending work before the consumer's current stream.
Both directions stay stream-ordered: no host waits. An array exported read-only through
``__cuda_array_interface__`` or a DLPack 1.0 versioned capsule is imported
:attr:`~aiocuda.DeviceArray.readonly` (aiocuda's copies into it raise); a read-only array
exports that flag through both (``torch.from_dlpack`` asks for versioned capsules), and
refuses only legacy DLPack capsules, which cannot carry it.

Neither PyTorch nor CuPy is a dependency: each is imported on first use.
"""

from __future__ import annotations

from ._memory.interop import as_device_array
from ._memory.library_streams import cupy_stream, torch_stream

__all__ = ["as_device_array", "cupy_stream", "torch_stream"]
