"""Which of a pool's frees the driver has seen complete, and making it see them.

A stream-ordered free returns its memory to the pool for reuse as soon as the GPU runs
it, but ``cuMemPoolTrimTo`` (and the release threshold) give memory back to the device
only once the *host* has observed the free complete through a synchronisation of the
freeing stream or of the context; queries and host functions do not count. So after
every buffer was freed and awaited, a trim alone releases nothing.

A pool therefore remembers the streams it freed memory on (:class:`FreedStreams`).
Before trimming, each of them that is idle is synchronised -- an idle stream's
synchronisation returns at once, so the loop does not wait -- and the driver then sees
its frees. Frees on streams still busy, closed or collected are observed by a context
synchronisation on the off-loop thread, followed by the same trim (:func:`settle`).
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any

from ..errors import CudaError
from . import offloop

if TYPE_CHECKING:
    from ..device import Device
    from ..stream import Stream

__all__ = ["FreedStreams"]

_PRUNE_AT = 64
"""Noted streams beyond which collected ones are dropped (remembering that they were)."""


class FreedStreams:
    """The streams a pool freed memory on since the driver last observed their frees."""

    __slots__ = ("_lock", "_lost", "_settling", "_streams")

    def __init__(self) -> None:
        # Reentrant: a buffer's finaliser frees (and notes its stream) wherever the
        # collector runs, also at an allocation inside note() or observe().
        self._lock = threading.RLock()
        self._streams: dict[int, weakref.ref[Stream]] = {}
        self._lost = False
        """A noted stream was collected before its frees were observed."""
        self._settling = False
        """A context synchronisation and trim are queued on the off-loop thread."""

    def note(self, stream: Stream) -> None:
        """``stream`` has just been given a free."""
        key = id(stream)
        known = self._streams.get(key)
        if known is not None and known() is stream:
            return  # noted already: no lock (a dict read is atomic)
        with self._lock:
            known = self._streams.get(key)
            if known is not None and known() is stream:
                return
            if known is not None:  # a collected stream's id, reused
                self._lost = True
            elif len(self._streams) >= _PRUNE_AT:
                dead = [k for k, ref in self._streams.items() if ref() is None]
                for k in dead:
                    del self._streams[k]
                self._lost = self._lost or bool(dead)
            self._streams[key] = weakref.ref(stream)

    def observe(self, device: Device) -> bool:
        """Make the driver observe every noted free it can without waiting: synchronise
        the noted streams that are idle. True if frees remain unobserved (on streams
        still busy, closed or collected); they are forgotten either way."""
        with self._lock:
            refs = list(self._streams.values())
            self._streams.clear()
            remaining, self._lost = self._lost, False
        driver = device._driver
        for ref in refs:
            stream = ref()
            # Never a foreign stream: its owner may have destroyed it since the free, and
            # a query of a destroyed stream is undefined behaviour (cuStreamQuery crashed
            # the GPU lane so once, SIGSEGV). The context's synchronisation sees to it.
            if stream is None or stream._closed or not stream.owned:
                remaining = True
                continue
            try:
                handle = stream._handle
                if driver.stream_query(handle):
                    driver.stream_synchronize(handle)  # idle: returns at once
                else:
                    remaining = True
            except CudaError:  # a failed context: its memory is not coming back by trimming
                pass
        return remaining

    def settle(self, device: Device, pool_handle: Any, keep_bytes: int) -> None:
        """On the off-loop thread: once everything queued on ``device`` so far has
        finished, let the driver observe every free, then trim ``pool_handle`` to
        ``keep_bytes``. At most one is queued at a time."""
        with self._lock:
            if self._settling:
                return
            self._settling = True
        offloop.submit(self._settle, device, pool_handle, keep_bytes)

    def _settle(self, device: Device, pool_handle: Any, keep_bytes: int) -> None:
        with self._lock:
            self._settling = False
            if device._captures:
                # A context synchronisation while a stream of it captures would invalidate
                # the capture (the driver refuses it): left to the next trim.
                self._lost = True
                return
        try:
            device.make_current()
            device._driver.ctx_synchronize()
            device._driver.mempool_trim_to(pool_handle, keep_bytes)
        except CudaError:
            pass  # the context failed or the backend was switched: nothing to give back
