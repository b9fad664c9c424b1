"""Awaitable CUDA events, and the per-device pool that keeps hot paths event-free.

An :class:`Event` marks a point in a stream. ``await event`` resumes once all work
enqueued on that stream before :meth:`Event.record` has finished; ``event.query()`` asks
without waiting. Events made with ``timing=True`` measure GPU time between two points:
``end.elapsed_ms(since=start)``.

Creating a CUDA event costs a driver call; :meth:`Stream.record` and every internal use
(``await stream``, ``stream.hold``) draw timing-less events from :class:`EventPool`
and give them back when done, so steady-state code creates no events at all.
"""

from __future__ import annotations

import weakref
from collections.abc import Generator
from typing import Any, Protocol

from ._completion.engine import current_engine
from ._completion.event_pool import EventPool
from ._completion.loops import warn_if_on_loop
from .device import Device, _as_device
from .errors import ArgumentError, CaptureError, CudaError, ResultCode

__all__ = ["Event"]


class _OnStream(Protocol):
    """Where an event can be recorded: a :class:`~aiocuda.stream.Stream`."""

    @property
    def handle(self) -> Any: ...

    @property
    def device(self) -> Device: ...


def _complete() -> Generator[Any, Any, None]:
    """An await that ends at once."""
    return
    yield


def _dispose(driver: Any, handle: Any) -> None:
    try:
        driver.event_destroy(handle)
    except Exception:  # a poisoned or torn-down context: nothing left to free
        pass


class Event:
    """A point in a stream that can be awaited, queried and timed.

    Args:
        device: the device (or ordinal) the event belongs to; default device 0.
        timing: record timestamps so :meth:`elapsed_ms` works (costs a little on record).
        blocking_sync: make :meth:`synchronize` sleep instead of spinning.
        interprocess: let other processes await it (:func:`aiocuda.ipc.share_event`);
            such an event has no timing.

    An event that was never recorded counts as complete, as in CUDA.
    """

    __slots__ = (
        "__weakref__",
        "_capture",
        "_closed",
        "_device",
        "_driver",
        "_finalizer",
        "_handle",
        "_pool",
        "_stream_handle",
        "_waits",
        "blocking_sync",
        "interprocess",
        "timing",
    )

    def __init__(
        self,
        device: Device | int | None = None,
        *,
        timing: bool = False,
        blocking_sync: bool = False,
        interprocess: bool = False,
    ):
        self._pool: EventPool | None = None  # (first: __del__ reads it)
        dev = _as_device(device)
        if interprocess and (timing or blocking_sync):
            raise ArgumentError(
                "an interprocess event has no timing and no blocking synchronisation", name="CUDA_ERROR_INVALID_VALUE"
            )
        dev.make_current()
        self._device = dev
        self._driver = dev._driver
        self.timing = timing
        self.blocking_sync = blocking_sync
        self.interprocess = interprocess
        if interprocess:
            self._handle = self._driver.ipc_event_create()
        else:
            self._handle = self._driver.event_create(timing, blocking_sync)
        self._stream_handle: Any = None
        self._capture: Any = None
        """The capture the event was last recorded in, if any (see ``aiocuda.graph``)."""
        self._closed = False
        self._waits = 0
        self._finalizer: weakref.finalize[Any, Any] | None = weakref.finalize(
            self, _dispose, self._driver, self._handle
        )

    @classmethod
    def _pooled(cls, device: Device, handle: Any, stream_handle: Any, capture: Any, pool: EventPool) -> Event:
        """An Event over a handle of ``pool``, given back when collected (or closed)."""
        # Given back by __del__, not by a weakref.finalize: that cost 2 us of the 5 of
        # each stream.record() (simulator, 2-core development machine), and the executor
        # records two per chunk. Events made by Event() keep theirs: it destroys the
        # handle, which must happen even at interpreter exit.
        self = object.__new__(cls)
        self._pool = pool
        self._finalizer = None
        self._capture = capture
        self._device = device
        self._driver = device._driver
        self.timing = False
        self.blocking_sync = False
        self.interprocess = False
        self._handle = handle
        self._stream_handle = stream_handle
        self._closed = False
        self._waits = 0
        return self

    @classmethod
    def _opened(cls, device: Device, handle: Any) -> Event:
        """An Event over one opened from another process's handle (destroyed when
        collected). Its recording happened there: it counts as recorded here."""
        self = object.__new__(cls)
        self._pool = None
        self._capture = None
        self._device = device
        self._driver = device._driver
        self.timing = False
        self.blocking_sync = False
        self.interprocess = True
        self._handle = handle
        self._stream_handle = handle  # no stream of ours: the handle keys its wait history
        self._closed = False
        self._waits = 0
        self._finalizer = weakref.finalize(self, _dispose, self._driver, handle)
        return self

    @property
    def device(self) -> Device:
        return self._device

    @property
    def handle(self) -> Any:
        """The backend's event handle (``int(event.handle)`` is the raw CUevent)."""
        return self._live()

    def _live(self) -> Any:
        if self._closed:
            raise ArgumentError(
                f"{self!r} is closed: record a new Event (or stream.record()) to mark a point",
                name="CUDA_ERROR_INVALID_HANDLE",
            )
        return self._handle

    def record(self, stream: _OnStream, *, external: bool = False) -> Event:
        """Mark the current end of ``stream``'s work; returns ``self``.

        ``external=True`` records with ``CU_EVENT_RECORD_EXTERNAL``: inside a stream
        capture the record becomes a node of the captured graph, so that each launch of
        the graph records the event (for waits outside the graph); outside a capture it
        is an ordinary record.

        ``stream`` is an aiocuda Stream (``Stream.wrap`` adopts a foreign one) of the
        event's device; one of another device raises
        :class:`~aiocuda.errors.ArgumentError`."""
        try:
            on, stream_handle = stream.device, stream.handle
        except AttributeError:
            on = None
        if on is not self._device:
            raise _not_recordable(self._device, stream)
        if external:
            self._driver.event_record_external(self._live(), stream_handle)
        else:
            self._driver.event_record(self._live(), stream_handle)
        self._stream_handle = stream_handle
        # An external record in a capture is a node: each replay records the event, which
        # can then be awaited like any other; a plain one only marks the capture's work.
        self._capture = None if external else getattr(stream, "_capture", None)
        return self

    def query(self) -> bool:
        """True once the recorded work has finished (raises a poisoned context's error)."""
        if self._capture is not None:
            raise _captured("event.query()", self._capture)
        return self._driver.event_query(self._live())

    def synchronize(self) -> None:
        """Block the calling thread until the event completes. For synchronous code only:
        in a coroutine, ``await event`` instead (on an event loop's thread this warns,
        :class:`~aiocuda.errors.BlockingCallWarning`)."""
        if self._capture is not None:
            raise _captured("event.synchronize()", self._capture)
        warn_if_on_loop("Event.synchronize()")
        self._driver.event_synchronize(self._live())

    def __await__(self) -> Generator[Any, Any, None]:
        if self._capture is not None:
            raise _captured("await event", self._capture)
        handle = self._live()
        if self._stream_handle is None:
            return _complete()  # never recorded: complete, as in CUDA
        self._waits += 1
        return current_engine().wait(handle, self._stream_handle, self._device, self._wait_ended, keep=self)

    def _wait_ended(self, handle: Any) -> None:
        self._waits -= 1
        if self._closed and not self._waits:
            self._give_back()

    def _give_back(self) -> None:
        """Give the handle back to its pool, or destroy it (once)."""
        pool = self._pool
        if pool is not None:
            self._pool = None
            pool.release(self._handle)
        elif self._finalizer is not None:
            self._finalizer()

    def __del__(self) -> None:
        if self._pool is not None:  # a pooled event (see _pooled)
            self._give_back()

    def elapsed_ms(self, since: Event) -> float:
        """GPU milliseconds from ``since`` to this event: two events of one device, made
        with ``timing=True``, recorded, and complete (``await`` this one first).

        Raises :class:`~aiocuda.errors.ArgumentError` for events without timing, of two
        devices, or never recorded, and :class:`~aiocuda.errors.CudaError` (code
        ``NOT_READY``) for one that has not completed yet."""
        if not isinstance(since, Event):
            raise TypeError(f"elapsed_ms takes since=an Event, not {type(since).__name__}")
        start, end = since._live(), self._live()
        # The real driver says only "invalid resource handle" for all but the first of
        # these, and the simulator measured events of two devices.
        if not (self.timing and since.timing):
            raise _invalid_handle("elapsed_ms needs two events created with timing=True")
        if since._device is not self._device:
            raise _invalid_handle(
                f"elapsed_ms: events of device {self._device.ordinal} and device {since._device.ordinal}: the GPU "
                "times events of one device only"
            )
        for event, which in ((self, "this event"), (since, "since=")):
            if event._stream_handle is None:
                raise _invalid_handle(f"elapsed_ms: {which} was never recorded")
        try:
            return self._driver.event_elapsed_ms(start, end)
        except CudaError as exc:
            if exc.code != ResultCode.NOT_READY:
                raise
            which = "since=" if self._driver.event_query(end) else "this event"
            raise CudaError.like(exc, f"elapsed_ms: {which} has not completed yet: await it first") from None

    def close(self) -> None:
        """Release the event now instead of when it is garbage-collected (once awaits of it
        in progress have ended). Using it afterwards raises
        :class:`~aiocuda.errors.ArgumentError`."""
        if not self._closed:
            self._closed = True
            if not self._waits:
                self._give_back()

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        state = "closed" if self._closed else "unrecorded" if self._stream_handle is None else "recorded"
        return f"<Event device={self._device.ordinal} {state} timing={self.timing}>"


def _not_recordable(device: Device, stream: object) -> Exception:
    """The error for recording an event of ``device`` on ``stream``, which is not a
    Stream of that device."""
    from .stream import Stream  # (stream.py imports this module)

    if not isinstance(stream, Stream):
        return TypeError(
            f"Event.record takes an aiocuda Stream, not {type(stream).__name__} (Stream.wrap adopts a foreign "
            "stream or a raw handle)"
        )
    # (the real driver refuses it with "invalid resource handle")
    on = stream.device.ordinal
    return _invalid_handle(
        f"an Event of device {device.ordinal} is recorded on streams of device {device.ordinal}, not {on}: "
        f"make the event with Event({on})"
    )


def _invalid_handle(message: str) -> ArgumentError:
    """The error for events the driver would refuse as ``CUDA_ERROR_INVALID_HANDLE``."""
    return ArgumentError(message, code=ResultCode.INVALID_HANDLE, name="CUDA_ERROR_INVALID_HANDLE")


def _captured(what: str, capture: Any) -> CaptureError:
    """The refusal of a host wait (``what``) on an event last recorded in a stream
    being captured into a graph by ``capture`` (``aiocuda._graph.capture.Capture``)."""
    if capture.active:
        return CaptureError(
            f"{what}: the event was recorded in a stream being captured into a graph, where work does not run "
            "until the graph is launched; await the launch instead",
            name="AIOCUDA_NOT_CAPTURABLE",
        )
    # The event keeps the capture until it is recorded again, and is refused after the
    # capture too, as the driver refuses it (CUDA_ERROR_CAPTURED_EVENT: not permitted on
    # an event last recorded in a capturing stream, whether or not the capture has ended):
    # the record marked a point among the graph's nodes, which no stream reaches, so there
    # is nothing to wait for -- treating it as complete would end waits before replays do.
    return CaptureError(
        f"{what}: the event was recorded during a capture that has ended, so it marks a point in the captured "
        "graph, not in the stream, and cannot be waited for: await graph.launch(stream) (or an event recorded "
        "on that stream after the launch), or record the event with external=True inside the capture for every "
        "replay to record it",
        code=ResultCode.CAPTURED_EVENT,
        name="CUDA_ERROR_CAPTURED_EVENT",
    )
