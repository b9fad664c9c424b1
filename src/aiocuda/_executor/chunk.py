"""One chunk of a pipeline: its context for the stage, and how it is run.

A chunk is uploaded on its device's ``h2d`` stream, handed to the stage on a compute
stream that waits for the upload on the GPU, and downloaded on the ``d2h`` stream; the
await of that download is its only host wait. :class:`ChunkRunner` does this for
:class:`~aiocuda.executor.Pipeline` chunks and for :meth:`~aiocuda.executor.Executor.submit`.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from .._memory import copies as _copies
from .._memory import staging as _staging
from .._memory.copiers import Slot
from .._util import NoPublicConstructor, invalid_value
from ..array import DeviceArray, empty
from ..device import Device, _as_device
from ..errors import CudaError
from ..host import _cached_pinned_empty
from ..stream import Stream
from ..trace import Trace, _PendingSpan
from .device_streams import DeviceStreams

if TYPE_CHECKING:
    from .lane import Lane

__all__ = ["ChunkContext", "ChunkResult", "ChunkRunner", "OutputFn", "Stage", "Steps", "run_steps"]

PINNED_RESULT_BYTES = 4 << 20
"""``Executor.submit`` returns results too large for its lane's staging, up to this size,
in page-locked memory (blocks of aiocuda's pinned cache, given back when the array is
dropped): the download is one DMA."""
# Why: a pageable result goes through a staging slot or the copier threads and a host
# copy. On the H100 serve benchmark at W = 1 ms, submit spent 0.12-0.21 ms more CPU per
# 64 KiB request than a lane downloading into pinned memory; with pinned results,
# 0.00-0.03 ms more (at W = 5 ms still about 0.1 ms more). A result that fits what is
# left of the lane's staging costs less still: taking a pinned block from the cache and
# giving it back cost 8-15 us (2-core CI machine), copying 64 KiB out of the staging 2 us.

StageResult = DeviceArray | None
Stage = Callable[["ChunkContext", DeviceArray], StageResult | Awaitable[StageResult]]
"""``stage(ctx, x)``: enqueue a chunk's work on ``ctx.stream``; return the array to
download (``None``: ``x``)."""

OutputFn = Callable[[int, DeviceArray], npt.NDArray[Any]]
"""``output(index, device_result)``: the host array chunk ``index`` is downloaded into."""


@dataclass(frozen=True, slots=True)
class ChunkResult:
    """The outcome of one chunk."""

    index: int
    """Position of the chunk's input in ``inputs``."""
    device: int
    """Ordinal of the device the chunk was placed on (the executor's first device when
    every device had failed before it could be placed)."""
    output: npt.NDArray[Any] | None
    """The downloaded result (None when the chunk failed)."""
    error: Exception | None
    """Why the chunk failed (None when it succeeded)."""
    _traceback: TracebackType | None = field(init=False, repr=False, compare=False, default=None)
    """The error's traceback as the chunk failed: each :attr:`value` raises it with this
    one, not with what earlier raises added."""

    def __post_init__(self) -> None:
        if self.error is not None:
            object.__setattr__(self, "_traceback", self.error.__traceback__)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def value(self) -> npt.NDArray[Any]:
        """The result; raises the chunk's error if it failed."""
        if self.error is not None:
            raise self.error.with_traceback(self._traceback)
        assert self.output is not None
        return self.output


class ChunkContext(metaclass=NoPublicConstructor):
    """What a stage gets besides its input: where to enqueue, and chunk-scoped memory.

    Attributes:
        index: the chunk's position in the inputs.
        host: the chunk's host input (read-only use: its upload may still be running).
        stream: the compute stream to enqueue the stage's kernels on. Work on it is
            already ordered after the chunk's upload.

    Pitfalls: a stage must not wait for the GPU (no ``await stream``, no synchronize):
    that would stall the chunk's own pipeline slot for nothing, the download is awaited
    for it. Memory from :meth:`empty` lives until the chunk's download has completed (or
    the chunk failed) and is then freed; keep nothing from it beyond the stage.
    """

    __slots__ = (
        "_arrays",
        "_compute",
        "_keep",
        "_keep_on",
        "_output",
        "_slot",
        "_spans",
        "_streams_of",
        "_trace",
        "device_streams",
        "host",
        "index",
        "name",
        "stream",
    )
    _factories = "the executor (a stage receives one)"

    def __init__(
        self,
        index: int,
        host: npt.NDArray[Any],
        device_streams: DeviceStreams,
        streams_of: Callable[[Device], DeviceStreams],
        trace: Trace | None,
        name: str,
    ) -> None:
        self.index = index
        self.host = host
        self.device_streams = device_streams
        self._streams_of = streams_of
        self._trace = trace
        self.name = name
        self.stream: Stream = device_streams.compute[0]  # set by _begin_compute before the stage runs
        self._arrays: list[tuple[DeviceArray, Stream]] = []
        """The chunk's device arrays, each with the stream it was allocated on."""
        self._compute: _PendingSpan | None = None
        self._spans: list[_PendingSpan] = []
        self._keep: list[Any] = []
        """Host arrays the chunk's copies use, and their pinned memory: kept until the
        chunk's download has been awaited, or held by ``_keep_on`` if it never is."""
        self._keep_on: Stream | None = None
        """A stream ordered after every copy of ``_keep``: that of the last one."""
        self._output: npt.NDArray[Any] | None = None
        """The destination of the chunk's download, once enqueued."""
        self._slot: Slot | None = None
        """The page-locked slot a pageable destination's download goes through."""

    @property
    def device(self) -> Device:
        """The device the chunk is on now."""
        return self.device_streams.device

    def empty(self, shape: int | tuple[int, ...], dtype: npt.DTypeLike = np.float32) -> DeviceArray:
        """A device array for this chunk, allocated stream-ordered on :attr:`stream` from
        the device's pool, freed once the chunk's download has completed."""
        return self._allocate(shape, dtype, self.device_streams, self.stream)

    def move(self, array: DeviceArray, device: Device | int) -> DeviceArray:
        """Copy ``array``, a C-contiguous array on the chunk's device (:attr:`device`), to
        ``device`` (one of the executor's) GPU to GPU and continue the chunk there:
        afterwards :attr:`stream` is that device's compute stream, ordered after the
        copy. Uses the direct peer path where the devices allow it. ``array`` itself when
        ``device`` is the chunk's.

        The copy runs on the source device's ``p2p`` stream, so neither device's compute
        stream stalls for it.
        """
        if not isinstance(array, DeviceArray):  # (a numpy array failed on its missing is_c_contiguous)
            raise TypeError(f"move() takes a DeviceArray, not {type(array).__name__}")
        if array.device is not self.device:
            # (the copy named the chunk's device as the source, and a move to the array's
            # own device returned it while the chunk stayed where it was)
            raise invalid_value(
                f"move() takes an array on the chunk's device {self.device.ordinal}, not one on device "
                f"{array.device.ordinal}"
            )
        target = self._streams_of(_as_device(device))
        if target is self.device_streams:
            return array
        if not array.is_c_contiguous:
            raise invalid_value("move() needs a C-contiguous array")
        source = self.device_streams
        self._end_compute()
        p2p = source.p2p
        array.buffer._used_on(p2p)  # after the stage's kernels; frees the source after the copy
        moved = self._allocate(array.shape, array.dtype, target, target.p2p)
        p2p.wait(target.p2p)  # the allocation on the target is enqueued before the copy
        span = self._trace._start(p2p, "p2p", "p2p", chunk=self.index) if self._trace else None
        _copies.copy_between(moved.ptr, target.device, array.ptr, source.device, array.nbytes, p2p)
        if span is not None:
            Trace._stop(span, p2p)
            self._spans.append(span)
        self.device_streams = target
        self._begin_compute(moved, copied_on=p2p)
        return moved

    # -- for the pipeline ---------------------------------------------------------------------
    def _allocate(
        self, shape: int | tuple[int, ...], dtype: npt.DTypeLike, device_streams: DeviceStreams, stream: Stream
    ) -> DeviceArray:
        """An array of the chunk's, allocated on ``stream`` from ``device_streams``' pool and
        freed with the chunk (on that stream, once the download is done: :meth:`_free_done`)."""
        array = empty(shape, dtype, stream=stream, pool=device_streams.pool)
        self._arrays.append((array, stream))
        return array

    def _begin_compute(
        self, ready: DeviceArray, copied_on: Stream | None = None, *, lane: tuple[int, Stream] | None = None
    ) -> None:
        """Switch to the next compute stream (or to ``lane``'s, ``(track, stream)``),
        ordered (on the GPU) after the work that produced ``ready`` -- and after
        ``copied_on``, for a copy from another device -- then start the compute span: its
        start event must come after those waits."""
        track, self.stream = self.device_streams.next_compute() if lane is None else lane
        if copied_on is not None:
            self.stream.wait(copied_on)
        ready.buffer._used_on(self.stream)
        if self._trace is not None:
            self._compute = self._trace._start(self.stream, "compute", self.name, chunk=self.index, track=track)

    def _end_compute(self) -> None:
        span, self._compute = self._compute, None
        if span is not None:
            Trace._stop(span, self.stream)
            self._spans.append(span)

    def _owns(self, array: DeviceArray) -> bool:
        """Whether ``array`` is one of the chunk's (its upload, or from :meth:`empty`)."""
        buffer = array.buffer
        return any(mine.buffer is buffer for mine, _ in self._arrays)

    def _complete(self, *, idle: bool) -> npt.NDArray[Any]:
        """The chunk's download has been awaited: let its memory go (its arrays freed at
        once where they will be reused, if ``idle``: :meth:`_free_done`), read its trace
        spans, and return its result."""
        output = self._output
        assert output is not None
        slot = self._slot
        if slot is not None:
            self._slot = None
            try:
                _staging.landed(slot, output)
            finally:
                _staging.release(slot)
        self._keep.clear()
        self._keep_on = None
        if idle:
            self._free_done()
        if self._spans:
            assert self._trace is not None
            self._trace._resolve(*self._spans)
            self._spans.clear()
        return output

    def _abandon(self) -> None:
        """The chunk failed or was cancelled, its GPU work maybe still running: free its
        arrays stream-ordered, keep its host memory until its copies are done, give its
        trace spans' events back. Nothing left to do after :meth:`_complete`."""
        if self._compute is not None:
            with contextlib.suppress(CudaError):  # (a poisoned context records nothing more)
                self._end_compute()
        arrays = self._arrays
        if arrays:
            for array, _ in arrays:
                with contextlib.suppress(CudaError):  # a poisoned context: the memory goes with it
                    array.buffer.free()
            arrays.clear()
        slot = self._slot
        if slot is not None:
            self._slot = None
            _staging.release(slot)
        keep, on = self._keep, self._keep_on
        if keep and on is not None:
            with contextlib.suppress(CudaError):  # a poisoned context runs nothing more
                on.hold(*keep)
            keep.clear()
        if self._spans:
            Trace._discard(*self._spans)
            self._spans.clear()

    def _free_done(self) -> None:
        """Free the chunk's arrays once its download has been awaited: each on the stream
        it was allocated on, where the next chunk's allocation reuses it at once (see
        ``DeviceBuffer._free_idle``). Every executor stream a chunk's arrays are used on is
        ordered before the download; an array last used on another stream (a stage's own)
        is not known to be idle, and gets the stream-ordered free."""
        for array, allocated_on in self._arrays:
            buffer = array.buffer
            if buffer.freed:
                continue
            if buffer.stream in self._streams_of(buffer.device).streams:
                buffer._free_idle(allocated_on)
            else:
                buffer.free()
        self._arrays.clear()


Steps = Generator[Awaitable[Any], Any, "Stream | Lane"]
"""A chunk's work being enqueued (:meth:`ChunkRunner.steps`)."""


@dataclass(slots=True)  # not frozen: Executor.submit makes one per call, and frozen fields cost 1 us more to set
class ChunkRunner:
    """How each chunk of a pipeline (or a lone :meth:`~aiocuda.executor.Executor.submit`)
    is processed: its stage, where its results go, and the executor's device_streams and trace."""

    stage: Stage
    streams_of: Callable[[Device], DeviceStreams]
    trace: Trace | None
    output: OutputFn | None
    name: str

    def context(self, index: int, host: npt.NDArray[Any], device_streams: DeviceStreams) -> ChunkContext:
        """A new chunk: ``host`` (input ``index``), admitted on ``device_streams``."""
        return ChunkContext._create(index, host, device_streams, self.streams_of, self.trace, self.name)

    async def run(
        self, index: int, host: npt.NDArray[Any], device_streams: DeviceStreams, lane: Lane | None = None
    ) -> npt.NDArray[Any]:
        """Send one chunk, admitted on ``device_streams``, through upload, stage and download;
        return the host result once it is there. Memory is returned whatever happens.

        With a request ``lane`` (:meth:`~aiocuda.executor.Executor.submit`), every step
        runs on the lane's stream instead of the device's h2d, compute and d2h streams:
        no events between streams, and the download is the only host wait.
        """
        ctx = self.context(index, host, device_streams)
        try:
            if lane is not None and self.trace is None and self.output is None and lane._fits(host):
                done = await self._request(ctx, lane)
            else:
                done = await run_steps(self.steps(ctx, lane))
            await done  # the one host wait (besides staged copies)
            # A lane's chunk leaves its arrays to _abandon: freed on their last-use
            # stream, the lane's, where its next request allocates.
            return ctx._complete(idle=lane is None)
        finally:
            ctx._abandon()

    def steps(self, ctx: ChunkContext, lane: Lane | None = None) -> Steps:
        """Enqueue chunk ``ctx``'s upload, its stage and its download; nothing waits for
        the GPU. A generator: each value it yields must be awaited and the result sent
        back in (:func:`run_steps` does); it returns what to await for the chunk to be done
        (the ``d2h`` stream of the result's device, or the lane), ``ctx._output`` then
        being the destination. Raising, it leaves the clean-up to ``ctx._abandon()``.

        Most chunks yield nothing -- a pinned (or small) input, a stage that is a plain
        function, a pinned destination -- and then run to the end in one ``send``, without
        a task or an await of their own (the pipeline's eager path).
        """
        # (A generator rather than a coroutine: a coroutine cannot be run on without an
        # event loop's task, and a task per chunk cost about 16 us of the loop thread.)
        index, host, device_streams, keep = ctx.index, ctx.host, ctx.device_streams, ctx._keep
        trace = self.trace
        h2d = device_streams.h2d if lane is None else lane.stream
        span = trace._start(h2d, "h2d", "h2d", chunk=index) if trace is not None else None
        if lane is not None and lane._fits(host):
            x = lane.upload(host)  # allocated by the lane (freed when the lease ends), staged: enqueued only
        else:
            x = ctx._allocate(host.shape, host.dtype, device_streams, h2d)
            ctx._keep_on = h2d
            if not _staging.upload_now(x.ptr, host, h2d, keep):
                yield _staging.upload_staged(x.ptr, host, h2d)
        if span is not None:
            Trace._stop(span, h2d)
            ctx._spans.append(span)
        # The compute stream waits for the upload, on the GPU (a lane: it is the same stream).
        ctx._begin_compute(x, lane=None if lane is None else (lane.index, h2d))
        returned = self.stage(ctx, x)
        if not (returned is None or isinstance(returned, DeviceArray)) and inspect.isawaitable(returned):
            returned = yield returned
        result = _stage_result(returned, x)
        ctx._end_compute()
        return (yield from self._download(ctx, x, result, lane))

    async def _request(self, ctx: ChunkContext, lane: Lane) -> Lane | Stream:
        """:meth:`steps` for the common request on a ``lane``, as one coroutine: an input
        the lane takes (:meth:`Lane._fits`), no trace, no ``output`` function."""
        # (Executor.submit's common case, without the generator, its driver and the branches
        # for pipelines: in-process on the simulator, submit's cost beyond a bare lane request
        # went from 19-23 to 15 us; behind uvicorn on the H200 within that machine's noise,
        # benchmarks/results/logs/submit-request-ab.txt.)
        x = lane.upload(ctx.host)  # staged or pinned: enqueued only
        stream = lane.stream
        ctx._begin_compute(x, lane=(lane.index, stream))
        returned = self.stage(ctx, x)
        if not (returned is None or isinstance(returned, DeviceArray)) and inspect.isawaitable(returned):
            returned = await returned
        result = _stage_result(returned, x)
        if result.device is lane.device and lane._has_room(result.nbytes) and (result is x or result.is_c_contiguous):
            result.buffer._used_on(stream)  # the download waits for the stage, on the GPU
            ctx._output = lane._download_new(result)  # filled by the lane's await
            return lane
        return await run_steps(self._download(ctx, x, result, lane))

    def _download(self, ctx: ChunkContext, x: DeviceArray, result: DeviceArray, lane: Lane | None) -> Steps:
        """The end of :meth:`steps`: enqueue the download of the stage's ``result``."""
        index, keep, trace = ctx.index, ctx._keep, self.trace
        h2d = ctx.device_streams.h2d if lane is None else lane.stream
        # (x is C-contiguous, as made)
        on_lane = lane is not None and result.device is lane.device  # (else the stage moved it)
        # A lane's result is copied out of its staging if it fits there, else downloaded into pinned memory.
        pinned = lane is not None and not (on_lane and lane._has_room(result.nbytes))
        # A new array for a result the staging takes is the lane's to make (_download_new).
        staged = on_lane and not pinned and self.output is None and (result is x or result.is_c_contiguous)
        dest = None if staged else self.destination(index, result, contiguous=result is x, pinned=pinned)
        ctx._output = dest
        d2h = h2d if on_lane else self.streams_of(result.device).d2h
        result.buffer._used_on(d2h)  # the download waits for the stage, on the GPU
        span = trace._start(d2h, "d2h", "d2h", chunk=index) if trace is not None else None
        if dest is None:
            assert lane is not None
            ctx._output = lane._download_new(result)  # filled by the lane's await
            done: Stream | Lane = lane
        elif on_lane and lane is not None and lane._fits(dest):
            lane.download(result, out=dest)  # enqueued; filled by the lane's await
            done = lane
        else:
            if keep and result is not x and not ctx._owns(result):
                # A result from elsewhere (not x, nor an array of the chunk's) need not
                # come after the upload on the GPU: the upload's host memory is held by
                # the upload's own stream instead.
                h2d.hold(*keep)
                keep.clear()
            if _copies.download(dest, result.ptr, d2h, keep):
                ctx._keep_on = d2h  # ordered after the upload: both are kept until d2h passes here
            else:  # pageable: through a page-locked slot, copied out once done (_complete)...
                ctx._slot = _staging.download_inline(dest, result.ptr, d2h)
                if ctx._slot is None:  # ...or through the copier threads, awaited
                    yield _staging.download_staged(dest, result.ptr, d2h)
            done = d2h  # the download and those before it on the stream
        if span is not None:
            Trace._stop(span, d2h)
            ctx._spans.append(span)
        return done

    def destination(
        self, index: int, result: DeviceArray, *, contiguous: bool = False, pinned: bool = False
    ) -> npt.NDArray[Any]:
        """The host array chunk ``index``'s ``result`` is downloaded into, checked
        (``contiguous``: the result is known to be C-contiguous). Without ``output``, a
        new array: with ``pinned``, up to :data:`PINNED_RESULT_BYTES`, one in page-locked
        memory if the cache of pinned blocks has one of its size."""
        if not (contiguous or result.is_c_contiguous):
            raise invalid_value("a stage's result must be C-contiguous")
        if self.output is None:
            if pinned and result.nbytes <= PINNED_RESULT_BYTES:
                # Only from the cache: pinning new memory would block the event loop for
                # 1-40 ms. A miss downloads into pageable memory, through the staging.
                dest = _cached_pinned_empty(result.shape, result.dtype, result.device)
                if dest is not None:
                    return dest
            return np.empty(result.shape, result.dtype)
        dest = self.output(index, result)
        if not isinstance(dest, np.ndarray):
            raise TypeError(f"output() returns a numpy array, not {type(dest).__name__}")
        flags = dest.flags
        if dest.nbytes != result.nbytes or dest.dtype != result.dtype or not flags.c_contiguous:
            raise invalid_value(
                f"output() gave a {dest.shape} {dest.dtype} array for a {result.shape} {result.dtype} result "
                "(it must be C-contiguous with the same dtype and size)"
            )
        if not flags.writeable:
            raise invalid_value("output() gave a read-only array")
        return dest


def _stage_result(returned: object, x: DeviceArray) -> DeviceArray:
    """What a stage returned (``None``: its input ``x``), checked."""
    if returned is None:
        return x
    if not isinstance(returned, DeviceArray):
        raise TypeError(f"a stage returns a DeviceArray or None, not {type(returned).__name__}")
    return returned


async def run_steps(steps: Steps, awaiting: Awaitable[Any] | None = None) -> Stream | Lane:
    """Run a chunk's :meth:`~ChunkRunner.steps` to their end, awaiting what they yield
    (first ``awaiting``, when a caller has taken their first step); returns their value."""
    value: Any = None
    while True:
        if awaiting is not None:
            value = await awaiting
        try:
            awaiting = steps.send(value)
        except StopIteration as end:
            done: Stream | Lane = end.value
            return done
