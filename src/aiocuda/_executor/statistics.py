"""An executor's statistics: the snapshot :meth:`aiocuda.executor.Executor.statistics`
returns, and its assembly from the counters the hot paths keep anyway.

(:class:`ExecutorStatistics` is public as :class:`aiocuda.executor.ExecutorStatistics`.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .device_streams import DeviceStreams, DeviceStreamsStatistics
from .lanes import Lanes
from .pipeline import Pipelines

__all__ = ["ExecutorStatistics", "executor_statistics"]


@dataclass(frozen=True, slots=True)
class ExecutorStatistics:
    """A snapshot of an :class:`~aiocuda.executor.Executor`
    (:meth:`~aiocuda.executor.Executor.statistics`)."""

    submits_running: int
    """Submits whose chunk runs now: admitted to a device and holding one of its lanes."""
    submits_waiting: int
    """Submits started and not running yet: waiting for room on a device (its
    ``chunks_per_device`` or memory budget; a non-contiguous input is copied first), or
    admitted and waiting for one of its lanes (that part is each device's
    ``lanes.waiting``)."""
    submits_completed: int
    """Submits that have returned so far, with their result or an error."""
    submits_failed: int
    """Those of them that raised: the chunk's error, a cancellation, or a refusal while
    they waited (:class:`~aiocuda.errors.ClosedError`,
    :class:`~aiocuda.errors.ContextPoisonedError`)."""
    maps_running: int
    """Maps (pipelines) whose ``async with`` block is open, a map of an earlier opening
    of the executor (left and entered again) included."""
    map_chunks: int
    """Chunks of maps admitted to a device and not over yet (their share of the devices'
    ``chunks``)."""
    device_streams: tuple[DeviceStreamsStatistics, ...]
    """Each device's load, in the order of :attr:`~aiocuda.executor.Executor.devices`."""


def executor_statistics(
    device_streams: Sequence[DeviceStreams],
    request_lanes: Mapping[int, Lanes],
    pipelines: Pipelines,
    *,
    submitting: int,
    submits_completed: int,
    submits_failed: int,
) -> ExecutorStatistics:
    """The snapshot of an executor's ``device_streams``, its submits' ``request_lanes`` (by
    device ordinal) and ``pipelines``, with ``submitting`` submits started and not yet
    returned, of which ``submits_completed`` and ``submits_failed`` so far."""
    # Derived from the counters the hot paths keep anyway: a submit's own lease is
    # its lane's (Lanes counts it from the moment admission ends, with no await in
    # between), so what is not leased of submitting is waiting.
    per_device = []
    running = 0
    for per_device_streams in device_streams:
        lanes = request_lanes.get(per_device_streams.device.ordinal)
        lanes_statistics = None
        if lanes is not None:
            lanes_statistics = lanes.statistics()
            running += lanes_statistics.leased
        per_device.append(per_device_streams.statistics(lanes_statistics))
    return ExecutorStatistics(
        submits_running=running,
        submits_waiting=submitting - running,
        submits_completed=submits_completed,
        submits_failed=submits_failed,
        maps_running=pipelines.maps,
        map_chunks=pipelines.running,
        device_streams=tuple(per_device),
    )
