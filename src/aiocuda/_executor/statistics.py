"""An executor's statistics: the snapshot :meth:`aiocuda.executor.Executor.statistics`
returns, and its assembly from the counters the hot paths keep anyway (the submits'
in :mod:`.submits`).

(:class:`ExecutorStatistics` is public as :class:`aiocuda.executor.ExecutorStatistics`.)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .device_streams import DeviceStreams, DeviceStreamsStatistics
from .pipeline import Pipelines
from .submits import Submits

__all__ = ["ExecutorStatistics", "executor_statistics"]


@dataclass(frozen=True, slots=True)
class ExecutorStatistics:
    """A snapshot of an :class:`~aiocuda.executor.Executor`
    (:meth:`~aiocuda.executor.Executor.statistics`)."""

    submits_running: int
    """Submits whose chunk runs now: admitted to a device and holding one of its lanes.
    Those of an earlier opening of the executor (left and entered again while they ran,
    after a cancelled exit or :meth:`~aiocuda.executor.Executor.close`) included, on the
    lanes of their own opening."""
    submits_waiting: int
    """Submits started and not running yet: waiting for room on a device (its
    ``chunks_per_device`` or memory budget; a non-contiguous input is copied first), or
    admitted and waiting for one of its lanes (that part is each device's
    ``lanes.waiting``). Those of an earlier opening included (they raise
    :class:`~aiocuda.errors.ClosedError` when they would start)."""
    submits_completed: int
    """Submits started in this opening of the executor that have returned so far, with
    their result or an error. (A submit of an earlier opening counts in that opening's
    figures, even when it returns after the executor was entered again.)"""
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
    pipelines: Pipelines,
    submits: Submits,
    earlier_submits: Iterable[Submits],
) -> ExecutorStatistics:
    """The snapshot of an executor's ``device_streams``, ``pipelines`` and the
    ``submits`` of its opening, with the ``earlier_submits`` of its earlier openings that
    may not have returned yet."""
    # Derived from the counters the hot paths keep anyway: a submit's own lease is
    # its lane's (Lanes counts it from the moment admission ends, with no await in
    # between), so what is not leased of an opening's unfinished submits is waiting.
    per_device = []
    running = 0
    for per_device_streams in device_streams:
        lanes = submits.lanes.get(per_device_streams.device.ordinal)
        lanes_statistics = None
        if lanes is not None:
            lanes_statistics = lanes.statistics()
            running += lanes_statistics.leased
        per_device.append(per_device_streams.statistics(lanes_statistics))
    unfinished = submits.unfinished
    for earlier in earlier_submits:  # (on their own opening's lanes, closed or closing)
        running += earlier.leased()
        unfinished += earlier.unfinished
    return ExecutorStatistics(
        submits_running=running,
        submits_waiting=unfinished - running,
        submits_completed=submits.completed,
        submits_failed=submits.failed,
        maps_running=pipelines.maps,
        map_chunks=pipelines.running,
        device_streams=tuple(per_device),
    )
