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
  is joined back into the origin stream (the driver requires it). Work forked onto a
  stream that joined outside aiocuda (another library's wait on an event recorded in the
  capture) and never joined back fails the capture with an error naming the stream
  (:meth:`Capture.end`).
* Ending: whatever happens -- the block raised, the driver invalidated the capture, a
  fork was not joined back -- the capture ends and every stream of it leaves it, checked
  with the driver rather than assumed (:meth:`Capture.end`).
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
  where the capture began (:meth:`Capture.crossing`). "A buffer" is any that orders
  work through ``_used_on``, duck-typed: a pool's ``DeviceBuffer``, and an
  ``OwnedBuffer`` (memory owned elsewhere: imported from another library, managed,
  shared between processes), which the graph keeps with its owner; such a buffer let go
  while its last-use stream captures releases its owner once the capture has ended
  (:meth:`Capture.releasing`).
"""

from __future__ import annotations

import collections
import contextlib
import gc
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .. import memory
from .._driver import CaptureMode, CaptureStatus
from ..errors import CaptureError, CudaError, ResultCode
from ..stream import Stream

if TYPE_CHECKING:
    from .._memory.buffers import OwnedBuffer
    from ..event import Event
    from ..memory import DeviceBuffer, MemoryPool

    Buffer = DeviceBuffer | OwnedBuffer
    """Memory whose uses aiocuda orders (duck-typed: ``_used_on``, ``stream``, ``_ptr``):
    a pool's buffer, or one over memory owned elsewhere (kept with its owner)."""

__all__ = ["Capture"]


class Capture:
    """The state of one capture: its streams, the memory and host objects it involves."""

    __slots__ = (
        "_allocated",
        "_before",
        "_deferred",
        "_last_use",
        "_left",
        "_strangers",
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
        self.externals: dict[int, Buffer] = {}
        """Buffers from outside the capture its work uses, by ``id`` (pool buffers, and
        memory owned elsewhere, which keeps its owner)."""
        self.holds: list[Any] = []
        """Objects ``Stream.hold`` was given during the capture: kept for every replay."""
        self._allocated: dict[int, DeviceBuffer] = {}
        """The capture's own allocations (graph memory), by address."""
        self._before: dict[Stream, Event] = {}
        """Each stream's last point before it entered the capture."""
        self._deferred: list[Callable[[], None]] = []
        """What is let go during the capture and carried out once it has ended: frees of
        outside pool buffers, releases of the owners of memory owned elsewhere."""
        self._last_use: dict[int, tuple[Buffer, Stream]] = {}
        """Each buffer's last stream of the capture, by ``id`` (what the next captured use
        on another stream waits for)."""
        self._left: list[Stream] = []
        """Joined streams closed during the capture: closed for good once it ends."""
        self._strangers: list[Stream] = []
        """Streams found in the capture at its end that joined it outside aiocuda."""
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

    def end(self, *, failed: bool, cause: BaseException | None = None) -> Any:
        """End the capture and return the driver's graph (``None`` when ``failed``: the
        block raised ``cause``; the driver's graph is then destroyed). Raises the driver's
        :class:`CaptureError` if it refused the capture, and one coded
        ``STREAM_CAPTURE_UNJOINED`` naming the streams when work forked onto streams that
        joined outside aiocuda was not joined back. The streams leave the capture
        whatever happens (:meth:`_settle`); what goes wrong on the way while the block's
        own exception propagates is added to that exception as a note, never raised
        instead of it."""
        origin = self.origin
        graph = None
        error: BaseException | None = None  # raised instead of returning the graph
        if failed:
            # Joined back even though the graph is discarded: the end then fails only if
            # the capture was invalidated (which, documented, still ends it for every
            # stream), never because of the block's forks.
            self._join_back(quietly=True)
            with contextlib.suppress(CudaError):  # (and forks onto streams aiocuda does not know)
                self.driver.stream_join_capture_sinks(origin.handle)
        else:
            try:
                self._wrap_up()
                error = self._unjoined()
            except BaseException as exc:  # the capture is lost, but it must still end
                error = exc
        lost = failed or error is not None
        told = cause if failed else error  # the exception that propagates: it notes what else went wrong
        try:
            try:
                graph = self.driver.stream_end_capture(origin.handle)
            except CudaError as exc:
                if lost:
                    _note(told, f"aiocuda: ending the capture failed too: {exc}")
                else:
                    error = told = exc
                lost = True
            if lost:
                stuck = self._settle()
                if stuck:
                    _note(told, _stuck_message(stuck))
        finally:
            self.active = False
            self.device._captures -= 1
            for stream in self.streams:
                stream._capture = None
            for stream in self._left:
                stream._close_after_capture()
            for stream in self._strangers:
                self._record_holds_again(stream)
            for buffer in self._allocated.values():
                buffer._forget()  # its memory is the graph's (or went with a failed capture)
            self._allocated.clear()
            deferred, self._deferred = self._deferred, []
            for release in deferred:
                with contextlib.suppress(CudaError):
                    release()
            memory._end_deferral()
        if lost and graph is not None:
            with contextlib.suppress(CudaError):
                self.driver.graph_destroy(graph)
            graph = None
        if error is not None:
            raise error
        return graph

    def _record_holds_again(self, stream: Stream) -> None:
        """Holds taken while the driver captured ``stream`` behind aiocuda's back were
        recorded in the graph, where an event never completes: recorded again, they let go
        once the stream's real work has run. (A method of its own: the frame of
        :meth:`end`, kept by the traceback of what it raises, keeps no held object.)"""
        for event in [entry[0] for entry in stream._holds]:
            with contextlib.suppress(CudaError):
                self.driver.event_record(event, stream._handle)

    def _wrap_up(self) -> None:
        """Before the driver's end: free the capture's allocations still in use (free nodes,
        after their last captured use) and join every stream that joined back into the origin."""
        for buffer in list(self._allocated.values()):
            if not buffer.freed:
                buffer.free()  # on the stream of its last use (see freeing())
        self._join_back()

    def _join_back(self, *, quietly: bool = False) -> None:
        """Join every stream that joined back into the origin (``quietly``: as far as the
        driver lets, for a capture that is lost anyway). Those closed during the capture
        were joined as they closed."""
        for stream in self.streams[1:]:
            if stream in self._left:
                continue
            try:
                self.origin.wait(stream)
            except CudaError:
                if not quietly:
                    raise

    def _unjoined(self) -> CaptureError | None:
        """Before the driver's end of a capture whose block ended: work forked onto
        streams that joined the capture outside aiocuda -- another library's wait on an
        event recorded in it, a raw driver call -- and never joined back. It is joined,
        so that the capture ends cleanly whatever the driver would make of an unjoined
        end, and the error naming those streams is returned (None when there is none)."""
        driver, origin = self.driver, self.origin
        try:
            kinds = driver.stream_join_capture_sinks(origin.handle)
            if not kinds:
                return None
            _, capture_id = driver.stream_capture_status(origin.handle)
        except CudaError:
            return None  # (an invalidated capture: the end says so)
        self._strangers = self._find_strangers(capture_id)
        counts = collections.Counter(kinds)
        work = ", ".join(f"{n} {kind} node{'s' if n > 1 else ''}" for kind, n in counts.items())
        several = len(self._strangers) > 1
        if self._strangers:
            names = ", ".join(repr(stream) for stream in self._strangers)
            where = f"{'streams' if several else 'stream'} {names}"
        else:
            where = "a stream aiocuda does not know (another library's)"
        return CaptureError(
            f"work forked onto {where} was not joined back into the capturing stream ({work}): every stream "
            "that waits on captured work must be waited for by the capturing stream before the capture ends. "
            f"aiocuda joins back the streams that wait through Stream.wait; {'these' if several else 'this one'} "
            "joined outside it (another library's wait on an event recorded in the capture, or a raw driver "
            "call). The capture is discarded and its streams take work again",
            code=ResultCode.STREAM_CAPTURE_UNJOINED,
            name="CUDA_ERROR_STREAM_CAPTURE_UNJOINED",
        )

    def _find_strangers(self, capture_id: int) -> list[Stream]:
        """aiocuda's open streams of the device that are in this capture without having
        joined it through aiocuda (an error path: every object is looked at). Wrappers of
        a raw foreign handle are left out: nothing keeps their stream alive, and the
        driver reads a destroyed stream's handle as a stream all the same."""
        driver = self.driver
        seen = {driver.handle_value(stream._handle) for stream in self.streams}
        found: list[Stream] = []
        for obj in gc.get_objects():
            if not isinstance(obj, Stream) or obj.device is not self.device or obj._closed:
                continue
            if not obj.owned and obj._owner is None:
                continue
            value = driver.handle_value(obj._handle)
            if value in seen:
                continue
            seen.add(value)
            try:
                status, ident = driver.stream_capture_status(obj._handle)
            except CudaError:
                continue
            if status == "active" and ident == capture_id:
                found.append(obj)
        return found

    def _settle(self) -> list[tuple[Stream, CaptureStatus]]:
        """After the end of a capture that failed: make sure that no stream is left in it,
        asking the driver rather than trusting it.

        The CUDA programming guide says that the end takes every stream of the capture
        out of it, invalidated or not, and the simulator does so. Two other outcomes are
        handled too: the origin still capturing (the driver refused the end and kept the
        capture, as it does for an end from the wrong thread, and as ROCm's HIP did for
        an unjoined fork): everything is joined and the capture ended again; and a
        stream that joined still in a capture once the origin's has ended: the capture
        is ended on that stream. Returns the streams left in one all the same."""
        origin = self.origin
        if self._status(origin) != "none":
            self._join_back(quietly=True)
            with contextlib.suppress(CudaError):
                self.driver.stream_join_capture_sinks(origin._handle)
            self._end_quietly(origin)
        stuck: list[tuple[Stream, CaptureStatus]] = []
        for stream in (origin, *self.streams[1:], *self._strangers):
            status = self._status(stream)
            if status != "none" and stream is not origin:
                self._end_quietly(stream)
                status = self._status(stream)
            if status != "none":
                stuck.append((stream, status))
        return stuck

    def _status(self, stream: Stream) -> CaptureStatus:
        try:
            return self.driver.stream_capture_status(stream._handle)[0]
        except CudaError:  # (a poisoned context: nothing runs on the stream any more anyway)
            return "none"

    def _end_quietly(self, stream: Stream) -> None:
        """End a capture on ``stream`` as far as the driver lets, discarding its graph."""
        try:
            graph = self.driver.stream_end_capture(stream._handle)
        except CudaError:
            return
        with contextlib.suppress(CudaError):
            self.driver.graph_destroy(graph)

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

    def use(self, buffer: Buffer, stream: Stream) -> None:
        """Captured work on ``stream`` is about to use ``buffer``: order it, inside the
        graph, after the buffer's captured work on another stream of the capture. The
        buffer's own record of its streams is left alone (it is about the work outside).
        A buffer from outside the capture is listed (:attr:`externals`)."""
        key = id(buffer)
        found = self._last_use.get(key)
        if found is None:
            owner = buffer.stream  # (the last recorded use: not freed, its _used_on checked)
            last = owner if owner._capture is self else stream
            if self._allocated.get(int(buffer._ptr)) is not buffer:
                self.externals[key] = buffer
        else:
            last = found[1]
        if last is not stream:
            stream.wait(last.record())
        self._last_use[key] = (buffer, stream)

    def crossing(self, buffer: Buffer, previous: Stream, stream: Stream) -> Event | None:
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
        self._deferred.append(lambda: pool._free_on(ptr, stream, waits))
        return None

    def releasing(self, release: Callable[[], None]) -> None:
        """Memory owned elsewhere (an ``OwnedBuffer``), last used on a stream of the capture,
        is let go during it (freed, or collected): ``release``, which hands its owner to
        that stream, is called once the capture has ended -- after the stream's work from
        before the capture, as :meth:`freeing` does for a pool buffer (a hold now would be
        the graph's, dropped at once if the capture fails)."""
        self._deferred.append(release)


def _note(exc: BaseException | None, text: str) -> None:
    """Add ``text`` to the notes of ``exc``, which propagates (Python 3.11 and later show them)."""
    if exc is not None and hasattr(exc, "add_note"):
        exc.add_note(text)


def _stuck_message(stuck: list[tuple[Stream, CaptureStatus]]) -> str:
    streams = ", ".join(f"{stream!r} ({status})" for stream, status in stuck)
    return (
        f"aiocuda: the driver left {streams} in capture mode after the capture ended, and ending it there "
        "did not release it: work enqueued there fails; close the stream and use another"
    )
