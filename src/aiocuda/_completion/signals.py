"""Signal streams: private streams that doorbells ring on, pooled per device."""

from __future__ import annotations

import collections
import functools
import threading
from typing import TYPE_CHECKING, Any

from .. import _driver
from .reserve import run_off_loop

if TYPE_CHECKING:
    from ..device import Device

__all__ = ["SignalStreams"]


class SignalStreams:
    """Private streams that doorbells ring on, pooled per device.

    A signal stream holds nothing but ``wait(event); sem_post``, so its doorbell rings
    as soon as *that* event completes, whatever was enqueued on the event's own stream
    after it. A ring never shares a busy signal stream: it would then wait for that
    stream's earlier event too, which may never complete.

    Streams that rang before are reused once idle, oldest ring first (the likeliest to
    have rung); when none of the oldest :data:`SCAN` is idle, a spare is taken. Spares
    are made ahead of time by the reserve thread (:mod:`.reserve`), :data:`RESERVE` per
    device once :meth:`prepare` has been called for it, and topped up as they are
    taken; a ring that finds no spare either is enqueued by the reserve thread, after
    it has made one. So the thread that rings never creates a stream.
    """

    # Taking the most recently rung stream first found it busy whenever more than four
    # waits were pending, and created a stream for every ring from then on (while the GPU
    # is busy, cuStreamCreate blocked for milliseconds, on an H100 up to 200 ms).

    SCAN = 4
    """Oldest pooled streams to query for idleness before taking a spare."""

    RESERVE = 4
    """Spare streams kept per device."""

    def __init__(self, backend: _driver.Driver) -> None:
        self._backend = backend
        self._pools: dict[int, collections.deque[Any]] = {}
        self._spares: dict[int, list[Any]] = {}
        self._lock = threading.Lock()  # loops in several threads may ring at once

    def prepare(self, device: Device) -> None:
        """Have the reserve thread make ``device``'s spares (once; cheap after that)."""
        if device.ordinal not in self._spares:
            with self._lock:
                self._spares.setdefault(device.ordinal, [])
            self._top_up_later(device)

    def ring_after(self, device: Device, event: Any, bell: Any) -> None:
        """Enqueue ``bell``'s ring for when ``event`` completes (now, or very soon from the
        reserve thread when no signal stream is at hand)."""
        stream = self._take(device)
        if stream is None:
            run_off_loop(functools.partial(self._ring_off_loop, device, event, bell))
        else:
            self._enqueue(device, stream, event, bell)

    def _ring_off_loop(self, device: Device, event: Any, bell: Any) -> None:
        device.make_current()
        stream = self._take(device)
        if stream is None:
            stream = self._backend.stream_create(True, 0)
        self._enqueue(device, stream, event, bell)

    def _enqueue(self, device: Device, stream: Any, event: Any, bell: Any) -> None:
        try:
            self._backend.stream_wait_event(stream, event)
            self._backend.launch_doorbell(stream, bell)
        finally:
            with self._lock:
                self._pools.setdefault(device.ordinal, collections.deque()).append(stream)

    def _take(self, device: Device) -> Any:
        """An idle pooled stream, else a spare, else None."""
        backend = self._backend
        ordinal = device.ordinal
        with self._lock:
            pool = self._pools.get(ordinal)
            if pool:
                for _ in range(min(self.SCAN, len(pool))):
                    if backend.stream_query(pool[0]):
                        return pool.popleft()
                    pool.rotate(-1)  # busy: look at it again last
            spares = self._spares.setdefault(ordinal, [])
            stream = spares.pop() if spares else None
            low = len(spares) < self.RESERVE // 2
        if low:
            self._top_up_later(device)
        return stream

    def _top_up_later(self, device: Device) -> None:
        run_off_loop(functools.partial(self._top_up, device), key=(id(self), device.ordinal))

    def _top_up(self, device: Device) -> None:
        device.make_current()
        spares = self._spares.setdefault(device.ordinal, [])
        while len(spares) < self.RESERVE:
            stream = self._backend.stream_create(True, 0)
            with self._lock:
                spares.append(stream)

    def count(self, device: Device) -> int:
        """Signal streams made for ``device`` (pooled, busy or idle, and spare)."""
        with self._lock:
            return len(self._pools.get(device.ordinal, ())) + len(self._spares.get(device.ordinal, ()))
