"""Signal streams: private streams that doorbells ring on, pooled per device."""

from __future__ import annotations

import collections
import threading
from typing import TYPE_CHECKING, Any

from .. import _driver

if TYPE_CHECKING:
    from ..device import Device

__all__ = ["SignalStreams"]


class SignalStreams:
    """Private streams that doorbells ring on, pooled per device, oldest ring first.

    A signal stream holds nothing but ``wait(event); sem_post``, so its doorbell rings
    as soon as *that* event completes, whatever was enqueued on the event's own stream
    after it. Streams are taken in the order their last rings were enqueued (the oldest
    is the likeliest to have rung) and reused once idle; a new one is created only when
    none of the oldest :data:`SCAN` is idle, so the pool settles at about the number of
    long waits in flight at once. Creating a stream can block for milliseconds while the
    device is busy, which is why the order matters: taking the most recent ring first
    found a busy stream whenever more than a few waits were pending, and created a new
    stream for every ring after that. A ring never shares a busy stream: it would then
    wait for that stream's earlier event too, which may never complete.
    """

    SCAN = 4
    """Oldest pooled streams to query for idleness before creating another."""

    def __init__(self, backend: _driver.Driver) -> None:
        self._backend = backend
        self._pools: dict[int, collections.deque[Any]] = {}
        self._lock = threading.Lock()  # loops in several threads may ring at once

    def ring_after(self, device: Device, event: Any, bell: Any) -> None:
        """Enqueue ``bell``'s ring for when ``event`` completes."""
        stream = self._take(device)
        try:
            self._backend.stream_wait_event(stream, event)
            self._backend.launch_doorbell(stream, bell)
        finally:
            with self._lock:
                self._pools[device.ordinal].append(stream)

    def _take(self, device: Device) -> Any:
        backend = self._backend
        with self._lock:
            pool = self._pools.setdefault(device.ordinal, collections.deque())
            for _ in range(min(self.SCAN, len(pool))):
                if backend.stream_query(pool[0]):
                    return pool.popleft()
                pool.rotate(-1)  # busy: look at it again last
        device.make_current()
        return backend.stream_create(True, 0)

    def count(self, device: Device) -> int:
        """Signal streams pooled for ``device`` (idle or not)."""
        with self._lock:
            return len(self._pools.get(device.ordinal, ()))
