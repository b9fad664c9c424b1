"""The executor: pipelines of copies and kernels that keep the copy units and SMs of every GPU busy.

An :class:`Executor` owns, per device, a small set of streams -- one for host-to-device
copies, one or more for kernels (``compute``), one for device-to-host copies, one for
GPU-to-GPU copies -- and allocates from the device's :class:`~aiocuda.memory.MemoryPool`.
A pipeline (:meth:`Executor.map`) sends each chunk of host input through::

    H2D on the h2d stream -> compute.wait(h2d) -> your stage's kernels on compute
        -> d2h.wait(compute) -> D2H on the d2h stream -> await the D2H (the only host wait)

Steps of one chunk are ordered by events between streams, on the GPU; chunks follow each
other on each stream, so while chunk *i* is computed, chunk *i + 1* is being uploaded and
chunk *i - 1* downloaded: both copy directions and the SMs work at once, on every device.

Example::

    from aiocuda.executor import Executor
    from aiocuda.host import pinned_empty

    def double(ctx, x):                       # runs once per chunk, enqueues only
        kernel.launch(grid, block, x, x.size, stream=ctx.stream)   # in place
        # return None: the result is x itself; or return a new array from ctx.empty(...)

    chunks = pinned_empty((64, 1 << 20))      # pinned: full-speed, truly async copies
    async with Executor() as ex:              # every device
        async with ex.map(double, chunks, in_flight=8) as results:
            async for r in results:           # input order; ordered=False: as completed
                use(r.value)

For request/response code, where many tasks each have one input, ``await
ex.submit(stage, host)`` runs one chunk under the same per-device limits, all on one
stream with one host wait (see also :mod:`aiocuda.lanes`, the request path without an
executor).

Host memory: copies run at full speed and truly asynchronously only from and to *pinned*
memory (:func:`aiocuda.host.pinned_empty`). Pass pinned inputs, and pinned destinations
with ``output=``; pageable arrays work but go through the process's pinned staging pool.

Where the executor serialises (what to watch when scaling to many GPUs):

* one event-loop thread enqueues every chunk of every device and takes every result,
  at a host cost per chunk that ``benchmarks/executor_host.py`` measures. Each GPU
  needs a new chunk every ``max(copy, kernel)``, so with N GPUs the thread has
  ``max(copy, kernel) / N`` per chunk; chunks whose steps take less than the host cost
  leave the GPU waiting for the host: make chunks big (tens of MiB) rather than many;
* one completion engine per process (:mod:`aiocuda._completion`): one poller per loop,
  one waker thread for long waits;
* one feeder task per pipeline reads the inputs and admits chunks in turn;
* one staging pool per process (:mod:`aiocuda._memory.staging`: a few copier threads, each
  with its own pinned slots) for pageable host memory; pinned inputs and outputs
  bypass it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import AsyncIterable, Iterable, Sequence
from typing import Any, Literal

import numpy.typing as npt

from ._completion.loops import being_cancelled
from ._executor.chunk import ChunkContext, ChunkResult, ChunkRunner, OutputFn, Stage
from ._executor.chunk_map import OnError, as_input, contiguous
from ._executor.device_streams import DeviceStreams, DeviceStreamsStatistics
from ._executor.graph_lanes import GraphLanes
from ._executor.lane import PRIORITIES, Priority
from ._executor.lanes import Lanes, default_count
from ._executor.pipeline import Pipeline, Pipelines, reserve
from ._executor.placement import Admission, PlacementName
from ._executor.statistics import ExecutorStatistics, executor_statistics
from ._executor.submits import Submits
from ._util import a_number, at_least
from .device import Device, devices
from .errors import ClosedError, ContextPoisonedError, CudaError
from .peer import enable_peer_access
from .trace import Trace

__all__ = ["ChunkContext", "ChunkResult", "DeviceStreamsStatistics", "Executor", "ExecutorStatistics", "Pipeline"]

_thread_id = threading.get_ident  # submits and maps from another thread are refused: 0.05 us a call

_SUBMIT_STAGING = 1 << 20
"""Page-locked bytes per chunk in flight for :meth:`Executor.submit`'s pageable copies;
larger ones go through the process's staging threads."""


class Executor:
    """Runs pipelines over the streams and memory pools of several devices.

    Args:
        devices: the devices to use (``Device`` objects or ordinals); default: all.
        compute_streams: kernel streams per device, used by successive chunks in turn
            (default 2: a chunk's kernels may start while the previous chunk's last
            wave of blocks is still finishing, as with one stream per chunk).
        chunks_per_device: chunks in flight on one device at most (default 8: the
            three units, h2d, compute and d2h, busy with several chunks queued, so that
            the time the host takes to see a chunk finish and admit the next never
            idles the GPU).
        memory_fraction: share of each device's free memory (measured on entering) that
            the chunks in flight may reserve; placement waits beyond it.
        trace: record every step's GPU start and end (:attr:`trace`); costs two event
            records per step.
        priority: the stream priority of the pipelines' streams: ``"normal"`` (the
            default, the least urgent) or ``"high"``. :meth:`submit` chooses its own per
            request, so interactive requests submitted ``priority="high"`` overtake the
            pipelines' kernels on the GPU.

    Use as ``async with Executor(...) as ex``, and call it from the event loop that entered
    it (as asyncio's queues and locks, it belongs to that loop: from another thread,
    :meth:`submit` and :meth:`map` raise ``RuntimeError``). Entering enables peer access
    between every pair of its devices that allows it
    (:func:`aiocuda.peer.enable_peer_access`, verified by a copy), so that
    :meth:`ChunkContext.move` copies GPU to GPU directly. Leaving the block shuts down
    gracefully: new :meth:`submit` and :meth:`map` calls raise
    :class:`~aiocuda.errors.ClosedError`, submits already started (waiting for room, for a
    lane, or running) finish (those of this opening: an executor left and entered again
    does not wait for submits that outlived an earlier opening), then the GPU work the executor enqueued is awaited (on
    devices that have not failed) and its streams are closed. End each map (its ``async
    with``) inside the executor's block; a map that another task still runs when the block
    is left takes no more inputs: its iteration ends with
    :class:`~aiocuda.errors.ClosedError` after the results of the chunks it had admitted.
    Those chunks finish first -- leaving waits for them as for submits, but not for the
    map's reader, which takes their results later or never (their device memory and
    their room on the device are given back either way). Left cancelled, or by an asyncio
    task unwinding from its cancellation, it closes the streams at once: enqueued work
    still runs, and nothing is freed under it, but chunks of maps still running may then
    fail with the closed streams' :class:`~aiocuda.errors.ArgumentError`.

    :meth:`statistics` is one snapshot of the load, for a service's metrics and load
    shedding: submits running, waiting, completed and failed, maps running, and per
    device the chunks in flight, the memory reserved against the budget, the request
    lanes and whether the device failed.
    """

    def __init__(
        self,
        devices: Sequence[Device | int] | None = None,
        *,
        compute_streams: int = 2,
        chunks_per_device: int = 8,
        memory_fraction: float = 0.5,
        trace: bool = False,
        priority: Priority = "normal",
    ) -> None:
        if priority not in PRIORITIES:
            raise ValueError(f"priority must be one of {PRIORITIES}, got {priority!r}")
        compute_streams = at_least(compute_streams, 1, "compute_streams")
        chunks_per_device = at_least(chunks_per_device, 1, "chunks_per_device")
        memory_fraction = a_number(memory_fraction, "memory_fraction")
        if not 0 < memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
        if isinstance(devices, (int, Device, str)):  # (an int raised "'int' object is not iterable")
            raise TypeError(
                f"devices is a sequence of devices or ordinals, e.g. Executor([0]), not {type(devices).__name__}"
            )
        self._requested = None if devices is None else list(devices)
        self._compute_streams = compute_streams
        self._chunks_per_device = chunks_per_device
        self._memory_fraction = memory_fraction
        self._priority: Priority = priority
        self._trace = Trace() if trace else None
        self._device_streams: tuple[DeviceStreams, ...] = ()
        self._by_ordinal: dict[int, DeviceStreams] = {}
        self._admission = Admission()
        self._pipelines = Pipelines()
        """The maps' share of the executor: refused new chunks and awaited on leaving."""
        self._state: Literal["new", "open", "closing", "closed"] = "new"
        self._submits = Submits()
        """This opening's submits: their devices, lanes and counts; what leaving waits for."""
        self._earlier_submits: list[Submits] = []
        """Those of earlier openings that had not all returned when it was entered again."""
        self._thread = 0
        """The thread of the event loop that entered the executor: submits and maps come from it."""
        self._cursor = 0
        self._submitted = 0  # chunks run by submit(), for their index in traces
        self._graph_lanes: weakref.WeakKeyDictionary[Any, dict[int, GraphLanes]] = weakref.WeakKeyDictionary()
        """Graph mode's captured graphs, by stage and device ordinal: every pipeline of a
        stage replays them."""

    # -- lifetime -----------------------------------------------------------------------------
    async def __aenter__(self) -> Executor:
        if self._state in ("open", "closing"):
            raise RuntimeError(f"this Executor is {self._state} already: enter it once, and share it")
        self._open_devices()
        try:
            for a in self.devices:  # GPU-to-GPU copies take the direct path where allowed
                for b in self.devices:
                    await enable_peer_access(a, b)
            for per_device in self._device_streams:  # submit()'s lanes: one stream per chunk on the GPU
                device = per_device.device
                # (at most default_count: lanes beyond the device's hardware queues share them,
                # and each request's wait cost more loop CPU. 64 tasks submitting 64 KiB
                # requests with 1 ms kernels, in-process on the H200: 3-19 us more per request
                # with 64 lanes than with 33 in each of 6 paired rounds, logs/submit-ab.txt; behind
                # uvicorn on the H100 about 35 us by the medians, logs/submit-lanes-h100.txt)
                count = min(self._chunks_per_device, default_count(device))
                lanes = Lanes(device, count=count, priorities=PRIORITIES, staging=_SUBMIT_STAGING)
                self._submits.lanes[device.ordinal] = lanes
                await lanes.start()
        except BaseException:
            self.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._state != "open":
            self.close()
            return
        self._state = "closing"  # new submits and maps are refused from here on
        self._pipelines.close()  # and new chunks of maps still running
        # (This opening's: closed directly meanwhile, the executor may be entered again,
        # and its next opening is not this exit's to wait for or to close.)
        submits, pipelines = self._submits, self._pipelines
        try:
            if not being_cancelled():  # (a task unwinding from its cancellation: no waiting)
                await submits.finished()
                # Chunks of maps that other tasks run are enqueued, awaited and freed on
                # these streams until they are over (not until they are read: a reader
                # that stopped reading holds nothing up).
                await pipelines.drain()
                if self._submits is submits:
                    await self.synchronize()
        except CudaError:
            if exc[0] is None:
                raise
        finally:
            if self._submits is submits:
                self.close()

    def _open_devices(self) -> None:
        chosen = (
            devices()
            if self._requested is None
            else [d if isinstance(d, Device) else Device(d) for d in self._requested]
        )
        if not chosen:
            raise ValueError("an Executor needs at least one device")
        if len({device.ordinal for device in chosen}) < len(chosen):
            raise ValueError(f"an Executor's devices must differ, got {[device.ordinal for device in chosen]}")
        device_streams = []
        for device in chosen:
            free, _ = device.memory_info()
            device_streams.append(
                DeviceStreams(
                    device,
                    compute_streams=self._compute_streams,
                    max_chunks=self._chunks_per_device,
                    budget=int(free * self._memory_fraction),
                    priority=self._priority,
                )
            )
        self._device_streams = tuple(device_streams)
        # (those of an earlier opening stay refused; its maps still open count on)
        self._pipelines = self._pipelines.reopened()
        # (counted afresh, as the devices' are; earlier submits still running count on)
        self._earlier_submits = [earlier for earlier in (*self._earlier_submits, self._submits) if earlier.unfinished]
        self._submits = Submits(self._device_streams)
        self._by_ordinal = {per_device.device.ordinal: per_device for per_device in device_streams}
        self._state = "open"
        self._thread = _thread_id()
        if self._trace is not None:
            for per_device in device_streams:
                self._trace.begin(per_device.h2d)

    async def synchronize(self) -> None:
        """Wait until every stream of the executor is idle (on the devices that have not
        failed: see :attr:`failures`)."""
        if self._state not in ("open", "closing"):
            return
        for per_device in self._device_streams:
            if per_device.failure is not None:  # (its streams can only raise it again)
                continue
            for stream in per_device.streams:
                await stream
            lanes = self._submits.lanes.get(per_device.device.ordinal)
            for lane in lanes.lanes if lanes is not None else ():
                for stream in lane.streams:
                    await stream

    def close(self) -> None:
        """Close the streams (work already enqueued still completes). :attr:`device_streams`
        and :attr:`trace` stay readable. Submits still running keep their lanes until they
        return; those still waiting for room or for a lane raise
        :class:`~aiocuda.errors.ClosedError` when they would start; so do the next chunks of
        maps still running, whose chunks in flight may fail with the closed streams'
        error. Prefer leaving the ``async with`` block, which lets them finish."""
        self._state = "closed"
        self._pipelines.close()
        for per_device in self._device_streams:
            for stream in per_device.streams:
                stream.close()
        for lanes in self._submits.lanes.values():
            lanes.close()
        for per_stage in self._graph_lanes.values():
            for graph_lanes in per_stage.values():
                graph_lanes.close()
        self._graph_lanes.clear()
        if self._trace is not None:
            self._trace.close()

    # -- what it runs -----------------------------------------------------------------------
    def map(
        self,
        stage: Stage,
        inputs: Iterable[npt.NDArray[Any]] | AsyncIterable[npt.NDArray[Any]],
        *,
        ordered: bool = True,
        in_flight: int | None = None,
        on_error: OnError = "raise",
        placement: PlacementName = "round_robin",
        output: OutputFn | None = None,
        name: str | None = None,
        graph: bool = False,
    ) -> Pipeline:
        """A pipeline applying ``stage`` to every host array of ``inputs``; use it as
        ``async with ex.map(...) as results: async for r in results: ...``.

        Args:
            stage: ``stage(ctx, x) -> DeviceArray | None`` (sync or async), called once
                per chunk with ``x`` the chunk on the device (already ordered after its
                upload). It enqueues work on ``ctx.stream`` and returns the array to
                download: ``None`` means ``x`` itself (in place), or an array from
                ``ctx.empty(...)``. It must not wait for the GPU. See
                :class:`ChunkContext`.
            inputs: numpy arrays (a sync or async iterable), read lazily: at most
                ``in_flight`` are taken ahead of the consumer. Each array is copied to the
                device while its chunk runs, after the iterator has moved on: leave it
                unchanged until its result has been delivered (an iterator that refills
                one buffer for every item sends later items' data). An array that is not
                C-contiguous is copied into one that is first (a large one on a worker
                thread); pass C-contiguous, pinned arrays to save the copies. If reading
                them raises, or an item is refused (a ``TypeError`` for one that holds
                Python objects), the results of the inputs before it are delivered, then
                the iteration raises that error, whatever ``on_error`` says (it is no
                chunk's failure).
            ordered: yield results in input order (default) or as they complete.
            in_flight: chunks admitted and not yet taken by the consumer, at most
                (default ``chunks_per_device`` times the number of devices). This is the
                back-pressure: a slow consumer slows the reading of ``inputs``.
            on_error: ``"raise"``: the first failing chunk's exception leaves the
                iteration and every other chunk is cancelled (its memory returned);
                ``"continue"``: failures are yielded as :class:`ChunkResult` with
                ``.error`` set, and listed in ``pipeline.failures``.
            placement: ``"round_robin"`` or ``"least_loaded"`` (fewest bytes in
                flight); both skip devices at their chunk or memory budget.
            output: ``output(index, device_result) -> numpy array`` to download chunk
                ``index`` into: C-contiguous and writable, of the result's dtype and size
                (its shape is the value's); pinned for full speed, e.g. a slice of one
                big pinned array. Another array fails the chunk with an ``ArgumentError``
                saying why. Default: a new pageable array.
            name: the stage's name in traces (default ``stage.__name__``).
            graph: graph mode: capture each chunk's upload, stage and download once per
                device (and per graph lane) into a CUDA graph and replay it for later
                chunks of the same shape and dtype with their own addresses, which costs
                the host a fraction of running the stage. The stage is then called only
                while capturing: use it for stages whose work depends on the chunk's
                shape and dtype, not on ``ctx.index`` or the data. The first chunk of each
                device runs normally (warming up modules and libraries); a stage that
                cannot be captured runs normally, with a note in the trace. The graphs
                are kept for later pipelines of the same stage object until the executor
                closes (a stage whose work changes must be a new object). Results of
                replays are page-locked arrays by default, taken from aiocuda's cache of
                pinned blocks (no memory is pinned on the event loop: when the cache has
                none of their size, a chunk waits for one pinned on a worker thread, or,
                up to 32 KiB, is an ordinary array). Same results, ordering,
                back-pressure and errors as without.
        """
        self._check_open()
        if not callable(stage):
            raise TypeError(f"stage must be callable: stage(ctx, x) -> DeviceArray | None, not {type(stage).__name__}")
        if output is not None and not callable(output):
            raise TypeError(f"output must be callable: output(index, result) -> ndarray, not {type(output).__name__}")
        for flag, value in (("ordered", ordered), ("graph", graph)):
            if not isinstance(value, bool):  # (a truthy "no" or None was taken as its truth value)
                raise TypeError(f"{flag} must be True or False, not {type(value).__name__}")
        if in_flight is None:
            limit = self._chunks_per_device * len(self._device_streams)
        else:  # (a float or numpy integer reached anyio's semaphore: "initial_value must be an integer")
            limit = at_least(in_flight, 1, "in_flight")
        if on_error not in ("raise", "continue"):
            raise ValueError(f"on_error must be 'raise' or 'continue', got {on_error!r}")
        if placement not in ("round_robin", "least_loaded"):
            raise ValueError(f"unknown placement {placement!r}: expected 'round_robin' or 'least_loaded'")
        return Pipeline._create(
            self._runner(stage, output, name),
            inputs,
            device_streams=self._device_streams,
            admission=self._admission,
            pipelines=self._pipelines,
            ordered=ordered,
            in_flight=limit,
            on_error=on_error,
            placement=placement,
            graph=graph,
            graph_lanes=self._graphs_of(stage) if graph else None,
        )

    def _graphs_of(self, stage: Stage) -> dict[int, GraphLanes] | None:
        """The captured graphs of ``stage``, kept for every pipeline of it (None for a
        stage that cannot be referenced weakly: its pipelines capture their own)."""
        try:
            return self._graph_lanes.setdefault(stage, {})
        except TypeError:
            return None

    async def submit(
        self,
        stage: Stage,
        host: npt.NDArray[Any],
        *,
        placement: PlacementName = "least_loaded",
        output: OutputFn | None = None,
        name: str | None = None,
        priority: Priority = "normal",
    ) -> npt.NDArray[Any]:
        """Run one chunk through ``stage`` (upload, stage, download) and return its
        result: for request/response code where many tasks each have one input.

        Without ``output``, the result is a new numpy array: copied out of the lane's
        page-locked staging if it fits there (1 MiB per chunk in flight, shared with the
        upload), else, up to 4 MiB, in page-locked memory taken from aiocuda's cache of
        pinned blocks (the block goes back to the cache when the array is dropped), so that
        its download is a single DMA. Pinning new memory would block the event loop, so
        when the cache has no block of that size the result is ordinary memory, downloaded
        through aiocuda's staging, while a block is pinned in the background for the next.

        Each submit waits for a device with room first (``chunks_per_device`` and the
        memory budget, shared with pipelines), so the executor's limits hold across all
        of them; then the whole chunk runs on one stream of its own (a request lane,
        :mod:`aiocuda.lanes`) with a single host wait, without a pipeline's events between
        streams. A device has as many of these lanes as ``chunks_per_device``, at most
        :func:`~aiocuda.lanes.default_count` (a quarter of its SMs): admitted chunks
        beyond that wait on the host for a lane. Raises the chunk's error; cancelling the
        awaiting task cancels the chunk (memory returned).

        ``priority="high"`` runs the chunk on a stream of the device's greatest priority:
        its kernels overtake those of normal requests and of the executor's pipelines on
        the GPU. It is also admitted first: while it waits for a device with room, normal
        submits and pipeline chunks wait behind it, and it is handed the next free lane
        first. ``placement`` chooses the device as for :meth:`map` (here
        ``"least_loaded"`` by default); ``output`` and ``name`` are :meth:`map`'s.

        Once the executor is closing (its block being left), a new submit raises
        :class:`~aiocuda.errors.ClosedError`; one already started finishes first.
        """
        self._check_open()
        if priority not in PRIORITIES:
            raise ValueError(f"priority must be one of {PRIORITIES}, got {priority!r}")
        array = as_input(host)
        nbytes = reserve(array)
        submits = self._submits  # (this opening's to the end, though the executor be entered again)
        submits.unfinished += 1
        try:
            if not array.flags.c_contiguous:
                array = await contiguous(array)
            placed, self._cursor = await self._admission.admit(
                placement, submits.device_streams, nbytes, self._cursor, urgent=priority == "high"
            )
            index, self._submitted = self._submitted, self._submitted + 1
            try:
                async with submits.lanes[placed.device.ordinal].lease(priority=priority) as lane:
                    return await self._runner(stage, output, name).run(index, array, placed, lane)
            except BaseException as exc:
                placed.saw(exc)
                raise
            finally:
                placed.completed += 1
                self._admission.release(placed, nbytes)
        except BaseException:
            submits.failed += 1
            raise
        finally:
            # (The one counter a submit adds for statistics(): what runs and what waits
            # are read from unfinished and the lanes.)
            submits.completed += 1
            submits.unfinished -= 1
            if submits.drained is not None and not submits.unfinished:
                submits.drained.set()

    def _check_open(self) -> None:
        if self._state != "open" or _thread_id() != self._thread:
            if self._state == "new":
                raise RuntimeError("the executor is not open: use 'async with Executor() as ex'")
            if _thread_id() != self._thread:
                raise RuntimeError(
                    f"this Executor belongs to the event loop that entered it (thread {self._thread}), and was "
                    f"called from thread {_thread_id()}: submit and map from that loop, or give each loop "
                    "(each thread) an executor of its own"
                )
            raise ClosedError(f"the executor is {self._state}")

    def _runner(self, stage: Stage, output: OutputFn | None, name: str | None) -> ChunkRunner:
        return ChunkRunner(
            stage, self._streams_of, self._trace, output, name or str(getattr(stage, "__name__", "stage"))
        )

    async def run(
        self,
        stage: Stage,
        inputs: Iterable[npt.NDArray[Any]] | AsyncIterable[npt.NDArray[Any]],
        *,
        in_flight: int | None = None,
        placement: PlacementName = "round_robin",
        output: OutputFn | None = None,
        name: str | None = None,
        graph: bool = False,
    ) -> list[npt.NDArray[Any]]:
        """Run :meth:`map` to the end and return the results in input order, raising the
        first chunk's error. The options are :meth:`map`'s; for results as they complete,
        or failures delivered rather than raised, use :meth:`map` itself."""
        # (ordered and on_error are not options: run() took them and overrode them, so
        # on_error="continue" still raised and ordered=False still waited for the order.)
        pipeline = self.map(
            stage, inputs, in_flight=in_flight, placement=placement, output=output, name=name, graph=graph
        )
        async with pipeline as results:
            return [r.value async for r in results]

    # -- state ------------------------------------------------------------------------------
    @property
    def devices(self) -> tuple[Device, ...]:
        return tuple(per_device.device for per_device in self._device_streams)

    @property
    def device_streams(self) -> tuple[DeviceStreams, ...]:
        """Each device's streams and load (read-only use)."""
        return self._device_streams

    @property
    def failures(self) -> dict[int, ContextPoisonedError]:
        """The devices whose context a chunk found poisoned, by ordinal, with the error:
        chunks are no longer placed on them, and once every device has failed,
        :meth:`submit` and :meth:`map` raise :class:`~aiocuda.errors.ContextPoisonedError`
        at once. (A failed device stays so until the process restarts.)"""
        return {d.device.ordinal: d.failure for d in self._device_streams if d.failure is not None}

    @property
    def trace(self) -> Trace | None:
        """The trace, when created with ``trace=True``."""
        return self._trace

    def statistics(self) -> ExecutorStatistics:
        """A snapshot of the submits, maps and devices' load (call it from the executor's
        event loop). Counts start when the executor is entered; a closed executor keeps
        its final ones (its devices' and lanes' too); one never entered has no devices
        and counts nothing. Entered again, it counts what is still going on of earlier
        openings with the rest: a map counts as running while its block is open, whichever
        opening made it (its chunks count with that opening's devices), and a submit of an
        earlier opening (one that outlived a cancelled exit or :meth:`close`) as running
        or waiting until it returns; submits completed and failed are those started in
        this opening."""
        return executor_statistics(self._device_streams, self._pipelines, self._submits, self._earlier_submits)

    def _streams_of(self, device: Device) -> DeviceStreams:
        device_streams = self._by_ordinal.get(device.ordinal)
        if device_streams is None:
            raise ValueError(
                f"device {device.ordinal} is not one of this executor's devices {sorted(self._by_ordinal)}"
            )
        return device_streams

    def __repr__(self) -> str:
        s = self.statistics()
        devices = ", ".join(
            f"{d.device}: {'FAILED' if d.failed else f'{d.chunks} in flight'}" for d in s.device_streams
        )
        return (
            f"<Executor {self._state} [submits: {s.submits_running} running, {s.submits_waiting} waiting | "
            f"maps: {s.maps_running} | devices {devices or 'none'}]>"
        )
