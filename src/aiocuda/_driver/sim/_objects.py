"""The simulated driver's handle objects: devices, contexts, events, stream points.

Every handle has an integer ``value`` (what ``Driver.handle_value`` returns), unique
within the process; :func:`next_handle_value` hands them out, and the other sim mixins
use it for their own handles (pools, modules, functions) too.
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...errors import CudaError
from ._codes import sim_error

if TYPE_CHECKING:
    from ._worker import SimStream

__all__ = ["Poison", "SimContext", "SimDevice", "SimEvent", "SimPoint", "next_handle_value"]

# Pointer-like, 256-byte aligned, and never 0/1/2 (the null and per-thread stream values).
_handle_values = itertools.count(0x7F00_0000_1000, 0x100)


def next_handle_value() -> int:
    """A fresh handle value (thread-safe: ``next`` on a count is atomic under the GIL)."""
    return next(_handle_values)


@dataclass(frozen=True, slots=True)
class Poison:
    """Why a device's context is unusable: the sticky code, what hit it, and the cause."""

    code: int
    detail: str
    cause: BaseException | None = None


class SimContext:
    """A device's primary context (the sim has exactly one per device, never destroyed)."""

    __slots__ = ("device_ordinal", "retain_count", "value")

    def __init__(self, device_ordinal: int) -> None:
        self.value = next_handle_value()
        self.device_ordinal = device_ordinal
        self.retain_count = 0

    def __repr__(self) -> str:
        return f"<SimContext {self.value:#x} device={self.device_ordinal} retained={self.retain_count}>"


class SimDevice:
    """One simulated GPU and its context's state.

    ``used_bytes`` is device memory in use; the memory mixin keeps it up to date (under
    its own lock) and ``mem_get_info`` reports ``total_mem - used_bytes``. ``peers`` holds
    the ordinals this device's context has enabled peer access to.

    ``poison`` is set once (first sticky error wins) and never cleared; ``async_error``
    holds a non-sticky error from an enqueued operation until the next seam call on the
    device reports it.
    """

    __slots__ = (
        "_lock",
        "_streams",
        "async_error",
        "context",
        "null_stream",
        "ordinal",
        "peers",
        "poison",
        "total_mem",
        "used_bytes",
    )

    null_stream: SimStream
    """The legacy default stream (value 0); set by the core right after construction."""

    def __init__(self, ordinal: int, total_mem: int) -> None:
        self.ordinal = ordinal
        self.total_mem = total_mem
        self.used_bytes = 0
        self.context = SimContext(ordinal)
        self.peers: set[int] = set()
        self.poison: Poison | None = None
        self.async_error: CudaError | None = None
        self._lock = threading.Lock()
        self._streams: weakref.WeakSet[SimStream] = weakref.WeakSet()

    @property
    def value(self) -> int:
        """A device handle's value is its ordinal, as for ``CUdevice``."""
        return self.ordinal

    def __repr__(self) -> str:
        state = f" poisoned={self.poison.code}" if self.poison else ""
        return f"<SimDevice {self.ordinal} used={self.used_bytes}/{self.total_mem}{state}>"

    def add_stream(self, stream: SimStream) -> None:
        """Track ``stream`` so that poisoning can wake whoever waits on it."""
        with self._lock:
            self._streams.add(stream)

    def streams(self) -> list[SimStream]:
        """Every stream of this device still referenced (destroyed ones still draining too)."""
        with self._lock:
            return list(self._streams)

    def poison_with(self, code: int, detail: str, cause: BaseException | None = None) -> None:
        """Poison the context (the first poison wins) and wake every waiter on its streams."""
        with self._lock:
            if self.poison is None:
                self.poison = Poison(code, detail, cause)
        for stream in self.streams():
            stream.wake()

    def record_async_error(self, error: CudaError) -> None:
        """Keep a non-sticky error from an operation for the next seam call (first one wins)."""
        with self._lock:
            if self.async_error is None:
                self.async_error = error

    def take_error(self, call: str) -> CudaError | None:
        """The error a seam call on this device must raise now, if any.

        A poisoned context yields a fresh sticky error every time (chained to what
        poisoned it); a pending asynchronous error is returned once and then cleared.
        """
        poison = self.poison
        if poison is not None:
            sticky = sim_error(poison.code, call, f"device {self.ordinal}'s context is poisoned ({poison.detail})")
            sticky.__cause__ = poison.cause
            return sticky
        with self._lock:
            pending, self.async_error = self.async_error, None
        return pending


class SimPoint:
    """A position in a stream: reached once the stream has finished ``seq`` operations.

    Points made by ``event_record`` also carry ``time``: the ``perf_counter`` reading
    taken when the stream got there (the record's own operation stamps it).
    """

    __slots__ = ("seq", "stream", "time")

    def __init__(self, stream: SimStream, seq: int) -> None:
        self.stream = stream
        self.seq = seq
        self.time: float | None = None

    def reached(self) -> bool:
        return self.stream.finished >= self.seq

    def stamp(self) -> None:
        self.time = time.perf_counter()


class SimEvent:
    """An event: where it was last recorded (``point``), or None if never recorded."""

    __slots__ = ("blocking_sync", "destroyed", "device_ordinal", "point", "timing", "value")

    def __init__(self, device_ordinal: int, timing: bool, blocking_sync: bool) -> None:
        self.value = next_handle_value()
        self.device_ordinal = device_ordinal
        self.timing = timing
        self.blocking_sync = blocking_sync
        self.point: SimPoint | None = None
        self.destroyed = False

    def __repr__(self) -> str:
        if self.point is None:
            state = "never recorded"
        else:
            state = "complete" if self.point.reached() else "pending"
        return f"<SimEvent {self.value:#x} device={self.device_ordinal} {state}>"
