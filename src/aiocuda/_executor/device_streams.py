"""Each device's streams, memory pool and load, as an executor's pipelines use them.

(Not to be confused with request lanes, :mod:`aiocuda.lanes`: one stream each, leased
per request.)
"""

from __future__ import annotations

from dataclasses import dataclass

from ..device import Device
from ..errors import ContextPoisonedError
from ..memory import MemoryPool
from ..stream import Stream
from .lane import Priority, stream_priority
from .lanes import LanesStatistics

__all__ = ["DeviceStreams", "DeviceStreamsStatistics"]


@dataclass(frozen=True, slots=True)
class DeviceStreamsStatistics:
    """A snapshot of one device's load in an executor (part of
    :meth:`aiocuda.executor.Executor.statistics`)."""

    device: int
    """The device's ordinal."""
    chunks: int
    """Chunks admitted to the device and not finished yet, maps' and submits'."""
    max_chunks: int
    """The most it admits at once (the executor's ``chunks_per_device``)."""
    reserved: int
    """Device bytes reserved for those chunks (twice each one's input)."""
    budget: int
    """The bytes the chunks in flight may reserve (``memory_fraction`` of the device's
    free memory when the executor was entered); admission waits beyond it."""
    completed: int
    """Chunks finished on the device so far, successfully or not."""
    failed: bool
    """Whether a chunk found the device's context poisoned (see
    :attr:`~aiocuda.executor.Executor.failures`): no more chunks are placed there."""
    lanes: LanesStatistics | None
    """The device's request lanes, on which submits run (None until the executor has
    made them, as it is entered)."""


class DeviceStreams:
    """One device's streams, pool and load, as an executor uses them.

    Every stream has the stream priority of the executor's ``priority``.

    ``h2d``, ``d2h`` and ``p2p`` are single streams (a GPU copies each direction
    on its own hardware, so more streams would not add bandwidth); ``compute`` holds
    ``compute_streams`` streams used in turn by successive chunks (more than one lets
    small kernels of different chunks run side by side). ``graph_lanes`` are the streams
    graph mode replays chunks on (made when a pipeline first needs them).
    """

    __slots__ = (
        "_turn",
        "budget",
        "chunks",
        "completed",
        "compute",
        "d2h",
        "device",
        "failure",
        "graph_lanes",
        "h2d",
        "max_chunks",
        "p2p",
        "pool",
        "reserved",
    )

    def __init__(
        self, device: Device, *, compute_streams: int, max_chunks: int, budget: int, priority: Priority = "normal"
    ) -> None:
        device.make_current()
        self.device = device
        self.pool = MemoryPool.for_device(device)
        value = stream_priority(device, priority)
        self.h2d = Stream(device, priority=value)
        self.compute = tuple(Stream(device, priority=value) for _ in range(compute_streams))
        self.d2h = Stream(device, priority=value)
        self.p2p = Stream(device, priority=value)
        self.graph_lanes: tuple[Stream, ...] = ()
        self._turn = 0
        self.max_chunks = max_chunks
        self.budget = budget
        self.chunks = 0
        """Chunks admitted here and not yet finished."""
        self.reserved = 0
        """Device bytes reserved for those chunks."""
        self.completed = 0
        """Chunks finished here (successfully or not)."""
        self.failure: ContextPoisonedError | None = None
        """The error that poisoned the device's context, once a chunk here met it:
        placement passes the device over from then on."""

    def saw(self, error: BaseException | None) -> None:
        """A chunk here ended with ``error``: a :class:`ContextPoisonedError` becomes
        :attr:`failure`. (A sticky error poisons every device of the process, as CUDA
        has it: each device is found failed by the next chunk placed there.)"""
        if self.failure is None and isinstance(error, ContextPoisonedError):
            self.failure = error

    def next_compute(self) -> tuple[int, Stream]:
        """``(track, stream)``: the compute stream for the next chunk, in turn."""
        track = self._turn
        self._turn = (track + 1) % len(self.compute)
        return track, self.compute[track]

    def statistics(self, lanes: LanesStatistics | None) -> DeviceStreamsStatistics:
        """A snapshot of the load, with the statistics of the device's request ``lanes``."""
        return DeviceStreamsStatistics(
            device=self.device.ordinal,
            chunks=self.chunks,
            max_chunks=self.max_chunks,
            reserved=self.reserved,
            budget=self.budget,
            completed=self.completed,
            failed=self.failure is not None,
            lanes=lanes,
        )

    @property
    def streams(self) -> tuple[Stream, ...]:
        return (self.h2d, *self.compute, self.d2h, self.p2p, *self.graph_lanes)

    def __repr__(self) -> str:
        return (
            f"<DeviceStreams device={self.device.ordinal} chunks={self.chunks}/{self.max_chunks} "
            f"reserved={self.reserved} completed={self.completed}{' FAILED' if self.failure else ''}>"
        )
