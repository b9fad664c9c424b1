"""A capture in progress: what aiocuda keeps besides the driver's own record of it.

While a stream is being captured (``Stream.capture()``), its ``_capture`` slot holds a
:class:`Capture`, and so does the slot of every stream that joined it. The layers below
(streams, events, memory) cannot import this module; they call its methods through that
slot, which is ``None`` on every stream outside a capture -- one attribute read on their
paths:

* Waiting for captured work on the host -- ``await stream``, ``synchronize``, ``query``,
  an await of a captured event -- is refused at the call (:meth:`Capture.refuse`): the
  work runs only when the graph is launched. An event keeps its capture until it is
  recorded again, and is refused after the capture too (with ``active`` False, it says
  that the capture has ended), as the driver refuses it.
* ``Stream.hold`` keeps the objects with the graph, for every replay (:meth:`Capture.hold`).
* A stream that waits on captured work joins the capture; a capturing stream cannot wait
  for work outside it (:meth:`Capture.check_wait`). At the end, every stream that joined
  is joined back into the origin stream (the driver requires it).
* Memory: an allocation on a capturing stream is the graph's (:meth:`Capture.allocated`):
  the capture frees it at its end, inside the graph, so every replay allocates and frees
  it, at the same address, and the buffer counts as freed afterwards. Captured uses are
  ordered by the capture itself (:meth:`Capture.use`: a use on another stream of the
  capture waits, inside the graph, for the buffer's previous captured use), leaving the
  buffer's own record of streams -- which is about work outside the graph -- as it was.
  A buffer from outside used by captured work is listed: each launch orders the replay
  after the buffer's other work and the graph keeps it alive. A free of such a buffer
  during the capture is carried out once the capture has ended (:meth:`Capture.freeing`);
  work outside the capture on a buffer last used before it is ordered after the point
  where the capture began (:meth:`Capture.crossing`).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from .. import memory
from .._driver import CaptureMode
from ..errors import CaptureError, CudaError, ResultCode

if TYPE_CHECKING:
    from ..event import Event
    from ..memory import DeviceBuffer, MemoryPool
    from ..stream import Stream

__all__ = ["Capture"]


class Capture:
    """The state of one capture: its streams, the memory and host objects it involves."""

    __slots__ = (
        "_allocated",
        "_before",
        "_deferred",
        "_last_use",
        "_left",
        "active",
        "device",
        "driver",
        "externals",
        "holds",
        "mode",
        "origin",
        "streams",
    )

    def __init__(self, origin: Stream, mode: CaptureMode) -> None:
        self.origin = origin
        self.device = origin.device
        self.driver = origin.device._driver
        self.mode = mode
        self.streams: list[Stream] = [origin]
        """The origin and every stream that joined, in the order they did."""
        self.externals: dict[int, DeviceBuffer] = {}
        """Buffers from outside the capture its work uses, by ``id``."""
        self.holds: list[Any] = []
        """Objects ``Stream.hold`` was given during the capture: kept for every replay."""
        self._allocated: dict[int, DeviceBuffer] = {}
        """The capture's own allocations (graph memory), by address."""
        self._before: dict[Stream, Event] = {}
        """Each stream's last point before it entered the capture."""
        self._deferred: list[tuple[MemoryPool, Any, Stream, Any]] = []
        """Frees of outside buffers asked for during the capture: ``(pool, ptr, stream, waits)``."""
        self._last_use: dict[int, tuple[DeviceBuffer, Stream]] = {}
        """Each buffer's last stream of the capture, by ``id`` (what the next captured use
        on another stream waits for)."""
        self._left: list[Stream] = []
        """Joined streams closed during the capture: closed for good once it ends."""
        self.active = False

    # -- lifetime ------------------------------------------------------------------------------
    def begin(self) -> None:
        origin = self.origin
        if origin._capture is not None:
            raise CaptureError("the stream is already being captured", name="AIOCUDA_NOT_CAPTURABLE")
        self._before[origin] = origin.record()
        self.device.make_current()
        self.driver.stream_begin_capture(origin.handle, self.mode)
        origin._capture = self
        self.active = True
        self.device._captures += 1  # (Context.synchronize is refused meanwhile)
        # A free on this thread while it captures makes the driver invalidate the capture
        # (a flaky STREAM_CAPTURE_INVALIDATED on an H100): buffers the collector finds
        # meanwhile are freed once it ends.
        memory._defer_frees()

    def end(self, *, failed: bool) -> Any:
        """End the capture and return the driver's graph (``None`` when ``failed``: the
        block raised; the driver's graph is then destroyed). Raises the driver's
        :class:`CaptureError` if it refused the capture. The streams leave the capture
        whatever happens."""
        origin = self.origin
        graph = None
        error: BaseException | None = None
        if not failed:
            try:
                self._wrap_up()
            except BaseException as exc:  # the capture is lost, but it must still end
                error, failed = exc, True
        try:
            graph = self.driver.stream_end_capture(origin.handle)
        except CudaError:
            if not failed:
                raise
        finally:
            self.active = False
            self.device._captures -= 1
            for stream in self.streams:
                stream._capture = None
            for stream in self._left:
                stream._close_after_capture()
            for buffer in self._allocated.values():
                buffer._forget()  # its memory is the graph's (or went with a failed capture)
            self._allocated.clear()
            for pool, ptr, stream, waits in self._deferred:
                with contextlib.suppress(CudaError):
                    pool._free_on(ptr, stream, waits)
            self._deferred.clear()
            memory._end_deferral()
        if failed and graph is not None:
            with contextlib.suppress(CudaError):
                self.driver.graph_destroy(graph)
            graph = None
        if error is not None:
            raise error
        return graph

    def _wrap_up(self) -> None:
        """Before the driver's end: free the capture's allocations still in use (free nodes,
        after their last captured use) and join every stream that joined back into the origin."""
        for buffer in list(self._allocated.values()):
            if not buffer.freed:
                buffer.free()  # on the stream of its last use (see freeing())
        for stream in self.streams[1:]:
            if stream not in self._left:  # (those were joined as they closed)
                self.origin.wait(stream)

    def leave(self, stream: Stream) -> None:
        """``stream``, joined, is being closed: join its captured work into the origin now
        (it takes no more); it is closed for good, and destroyed, when the capture ends."""
        self.origin.wait(stream)
        self._left.append(stream)

    # -- hooks of streams, events and memory -----------------------------------------------------
    def refuse(self, what: str, why: str = "") -> CaptureError:
        """The error for an operation that cannot be captured (raised by the caller)."""
        reason = why or (
            "the stream is being captured into a graph, and captured work runs only when the graph is "
            "launched: launch it, then await the launch"
        )
        return CaptureError(f"{what} cannot be captured: {reason}", name="AIOCUDA_NOT_CAPTURABLE")

    def hold(self, objs: tuple[Any, ...]) -> None:
        self.holds.extend(objs)

    def check_wait(self, stream: Stream, theirs: Capture | None) -> None:
        """``stream`` is about to wait on work of capture ``theirs`` (None: outside any):
        join it, or raise."""
        mine: Capture | None = stream._capture
        if theirs is not None and not theirs.active:
            # As the driver refuses it (CUDA_ERROR_CAPTURED_EVENT), and as the event's
            # host waits are refused (aiocuda.event._captured).
            raise CaptureError(
                "the event was recorded during a capture that has ended, so it marks a point in the captured "
                "graph, not in the stream: wait for graph.launch(stream)'s event, or record the event again outside",
                code=ResultCode.CAPTURED_EVENT,
                name="CUDA_ERROR_CAPTURED_EVENT",
            )
        if theirs is mine:
            return
        if mine is None:
            assert theirs is not None
            theirs._join(stream)
            return
        if theirs is None:
            raise mine.refuse(
                "waiting for work outside the capture",
                "a captured graph can only depend on its own work; make the stream the graph is launched "
                "on wait instead (a launch runs after the work already on its stream)",
            )
        raise mine.refuse("waiting for work of another capture", "two captures cannot be merged")

    def _join(self, stream: Stream) -> None:
        self._before[stream] = stream.record()
        self.streams.append(stream)
        stream._capture = self

    def allocated(self, buffer: DeviceBuffer) -> None:
        """``buffer`` was just allocated on a capturing stream: graph memory."""
        self._allocated[int(buffer._ptr)] = buffer

    def use(self, buffer: DeviceBuffer, stream: Stream) -> None:
        """Captured work on ``stream`` is about to use ``buffer``: order it, inside the
        graph, after the buffer's captured work on another stream of the capture. The
        buffer's own record of its streams is left alone (it is about the work outside)."""
        key = id(buffer)
        found = self._last_use.get(key)
        if found is None:
            owner = buffer._stream
            last = owner if owner is not None and owner._capture is self else stream
            if self._allocated.get(int(buffer._ptr)) is not buffer:
                self.externals[key] = buffer
        else:
            last = found[1]
        if last is not stream:
            stream.wait(last.record())
        self._last_use[key] = (buffer, stream)

    def crossing(self, buffer: DeviceBuffer, previous: Stream, stream: Stream) -> Event | None:
        """``buffer``, last used on ``previous`` (outside the capture's work), is about to
        be used on ``stream``, and one of them is capturing: None when the use is
        captured (ordered by :meth:`use`), else the event ``stream`` must wait for."""
        into: Capture | None = stream._capture
        out_of: Capture | None = previous._capture
        if into is not None:
            if out_of is not None and out_of is not into:
                raise into.refuse("using memory another capture uses", "two captures cannot share a buffer")
            into.use(buffer, stream)
            return None
        assert out_of is not None
        if out_of._allocated.get(int(buffer._ptr)) is buffer:
            raise out_of.refuse(
                "using memory allocated during a capture outside it",
                "that memory exists only while the graph runs (it is the graph's, freed at the end of each replay)",
            )
        return out_of._before[previous]

    def freeing(self, pool: MemoryPool, ptr: Any, stream: Stream, waits: Any) -> Stream | None:
        """A free of ``ptr`` asked for on the capturing ``stream``: for the capture's own
        memory, the stream to free it on inside the graph (that of its last captured use);
        for other memory None: it is freed once the capture has ended."""
        buffer = self._allocated.get(int(ptr))
        if buffer is not None:
            found = self._last_use.get(id(buffer))
            return stream if found is None else found[1]
        self._deferred.append((pool, ptr, stream, waits))
        return None
