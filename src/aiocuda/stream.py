"""Awaitable CUDA streams.

``await stream`` resumes the task once everything enqueued on the stream before the
``await`` has finished; the event loop keeps running meanwhile and a waiting task costs
no CPU (see :mod:`aiocuda._completion` for how). Work enqueued by other tasks after the
``await`` began is not waited for.

Ordering between streams is done on the GPU: ``consumer.wait(producer)`` makes the
consumer's future work wait for everything enqueued on the producer so far, without
blocking any host thread.

Lifetime: :meth:`Stream.hold` keeps Python objects (host buffers, arrays) alive until the
work enqueued so far has completed -- even if the stream is closed or collected, or the
awaiting task is cancelled, in the meantime. That is how every aiocuda operation keeps
the memory the GPU still reads or writes.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import gc
import operator
import weakref
from collections import deque
from collections.abc import Callable, Generator, Iterator
from typing import TYPE_CHECKING, Any

from ._completion import callbacks as _callbacks
from ._completion.callbacks import StreamCallback
from ._completion.engine import CompletionEngine, current_engine
from ._completion.event_pool import EventPool
from ._completion.loops import warn_if_on_loop
from ._util import invalid_value
from .device import Device, _as_device
from .errors import ArgumentError, ContextPoisonedError, CudaError
from .event import Event

if TYPE_CHECKING:
    from ._driver import CaptureMode
    from .graph import GraphCapture

__all__ = ["Stream", "StreamCallback", "current_stream", "use_stream"]

_Holds = deque[tuple[Any, tuple[Any, ...]]]

_C_INT_MIN, _C_INT_MAX = -(2**31), 2**31 - 1

# Holds of streams that were closed or collected while work was still in flight.
_orphans: list[tuple[Any, EventPool, _Holds]] = []


def _release_finished(driver: Any, pool: EventPool, holds: _Holds) -> None:
    """Drop the references of holds whose point has completed (they complete in order)."""
    query = driver.event_query
    while holds:
        event = holds[0][0]
        if not query(event):
            return
        holds.popleft()
        pool.release(event)


def _sweep_orphans() -> None:
    for entry in list(_orphans):
        driver, pool, holds = entry
        try:
            _release_finished(driver, pool, holds)
        except CudaError:
            holds.clear()  # poisoned context: the GPU will never touch them again
        if not holds:
            _orphans.remove(entry)


def _retire(driver: Any, engine: CompletionEngine, handle: Any, owned: bool, pool: EventPool, holds: _Holds) -> None:
    if holds:
        _orphans.append((driver, pool, holds))
    engine.forget(handle)  # the driver may hand the same handle to a new stream
    if owned:
        if _collecting:
            # The collector runs weakref callbacks (this finaliser) before the __del__ of
            # objects in the same garbage cycle, among them buffers that free memory on
            # this stream: destroyed now, their cuMemFreeAsync would get a dead handle (a
            # SIGSEGV on the real driver). Destroyed once the collection is over.
            _destroy_after_collection.append((driver, handle))
        else:
            _destroy(driver, handle)


def _destroy(driver: Any, handle: Any) -> None:
    try:
        driver.stream_destroy(handle)  # the driver finishes pending work first
    except CudaError:
        pass


_collecting = False
_destroy_after_collection: list[tuple[Any, Any]] = []


def _on_collection(phase: str, info: dict[str, int]) -> None:
    global _collecting
    _collecting = phase == "start"
    while not _collecting and _destroy_after_collection:
        _destroy(*_destroy_after_collection.pop())


gc.callbacks.append(_on_collection)


def _foreign_handle(obj: Any) -> tuple[int, Any]:
    """(raw handle, owner to keep alive) of a foreign stream object or raw int."""
    if isinstance(obj, int) and not isinstance(obj, bool):
        return obj, None
    proto = getattr(obj, "__cuda_stream__", None)
    if proto is not None:
        return _protocol_handle(obj, proto() if callable(proto) else proto), obj
    # Each library's attribute, only where it holds a stream: other objects' pointers and
    # handles were read as streams (on the real driver, a readable one as a stream object:
    # an aiocuda Event's handle, a pinned buffer's or a CuPy event's ptr).
    value = getattr(obj, "cuda_stream", None)  # PyTorch
    if isinstance(value, int):
        return value, obj
    value = getattr(obj, "ptr", None)  # CuPy: a stream has a device_id beside its ptr
    if isinstance(value, int) and isinstance(getattr(obj, "device_id", None), int):
        return value, obj
    handle: Any = getattr(obj, "handle", None)  # Numba: a ctypes c_void_p or a CUstream
    if isinstance(handle, ctypes.c_void_p):
        return handle.value or 0, obj
    if type(handle).__name__ == "CUstream":
        return int(handle), obj
    raise TypeError(
        f"cannot use {type(obj).__name__} as a CUDA stream: expected an aiocuda Stream, an object "
        f"with __cuda_stream__, a CuPy/PyTorch/Numba stream, or a raw stream handle (int)"
    )


def _protocol_handle(obj: Any, returned: Any) -> int:
    """The raw handle in what ``obj.__cuda_stream__()`` returned: ``(0, handle)``."""
    if isinstance(returned, (tuple, list)) and len(returned) == 2 and returned[0] == 0:
        value = returned[1]
        # (int() took 1.5 for the legacy default stream 1, and "1" too)
        if not isinstance(value, bool) and hasattr(type(value), "__index__"):
            return operator.index(value)
    name = type(obj).__name__
    raise TypeError(
        f"cannot use {name} as a CUDA stream: {name}.__cuda_stream__() returned {returned!r}, not (0, handle) "
        "with an int handle (version 0 of the CUDA stream protocol)"
    )


def _check_wrapped_device(what: object, dev: Device, device: Device | int | None) -> None:
    """ArgumentError unless ``device`` (``Stream.wrap``'s) is None or ``dev``, the
    device of the stream ``what``."""
    if device is not None and _as_device(device) is not dev:
        raise invalid_value(
            f"{what} is a stream of device {dev.ordinal}, not of device {_as_device(device).ordinal} "
            "(a device given names the device of a default stream: 0, 1 or 2)"
        )


def _declared_ordinal(obj: Any) -> int | None:
    """The device a library's stream object says it is of, where it says: PyTorch's
    ``device_index``, CuPy's ``device_id``, cuda.core's ``device.device_id``."""
    for found in (
        getattr(obj, "device_index", None),
        getattr(obj, "device_id", None),
        getattr(getattr(obj, "device", None), "device_id", None),
    ):
        if isinstance(found, int) and not isinstance(found, bool) and found >= 0:
            return found
    return None


class Stream:
    """An ordered queue of GPU work on one device, awaitable from asyncio and trio.

    Args:
        device: a :class:`Device` or ordinal (default 0).
        non_blocking: do not synchronise with the legacy default stream (recommended).
        priority: lower numbers run first when the GPU has a choice; clamped by the
            driver to its range (``Stream.priority_range()``).

    Use as a context manager, or call :meth:`close`, to destroy it promptly; otherwise it
    is destroyed when collected. Closing never cancels work already enqueued. A stream
    whose freed memory a pool keeps for reuse (see :mod:`aiocuda.memory`) is collected
    only once the pool gives that memory back; closing gives it back at once.
    """

    __slots__ = (
        "__weakref__",
        "_capture",
        "_closed",
        "_driver",
        "_engine",
        "_finalizer",
        "_handle",
        "_holds",
        "_owner",
        "_pool",
        "_spare_pools",
        "_tail",
        "_tail_failure",
        "device",
        "owned",
    )

    def __init__(self, device: Device | int | None = None, *, non_blocking: bool = True, priority: int = 0):
        # (a bool was taken as 1: True, the least urgent priority once clamped)
        if isinstance(priority, bool) or not hasattr(type(priority), "__index__"):
            raise TypeError(f"a stream's priority is an int, not {type(priority).__name__}")
        priority = operator.index(priority)
        # The driver clamps to its range, but takes a C int: the bindings raise
        # OverflowError for one beyond it.
        priority = min(max(priority, _C_INT_MIN), _C_INT_MAX)
        dev = _as_device(device)
        dev.make_current()
        self._setup(dev, dev._driver.stream_create(non_blocking, priority), owned=True, owner=None)

    def _setup(self, device: Device, handle: Any, *, owned: bool, owner: Any) -> None:
        self.device = device
        self._driver = device._driver
        self._handle = handle
        self.owned = owned
        self._owner = owner
        self._closed = False
        self._tail: Event | None = None
        self._tail_failure: CudaError | None = None
        """Why the end of the work could not be recorded when the stream closed."""
        self._capture: Any = None
        """The capture (``aiocuda._graph.capture.Capture``) this stream's work goes to, if any."""
        self._pool = EventPool.for_device(device)
        self._spare_pools: list[weakref.ref[Any]] = []
        """Weak references to the memory pools (``aiocuda.memory``) that keep freed blocks
        for reuse on this stream, listed by them: :meth:`close` has them give the blocks
        back (a duck-typed call, as the layers below make on a capture)."""
        self._holds: _Holds = deque()
        self._engine = current_engine()
        self._engine.prepare(device)
        self._set_finalizer(destroy_handle=owned)

    def _set_finalizer(self, *, destroy_handle: bool) -> None:
        """Retire the stream when it is closed or collected (:func:`_retire`): release its
        holds and, with ``destroy_handle``, destroy its handle."""
        self._finalizer = weakref.finalize(
            self, _retire, self._driver, self._engine, self._handle, destroy_handle, self._pool, self._holds
        )

    def _keep_handle(self) -> None:
        """Never destroy the handle, when closed or collected: a library keeps state by it
        (``aiocuda._memory.library_streams``). Holds are released as before."""
        if self.owned and self._finalizer.detach() is not None:
            self._set_finalizer(destroy_handle=False)

    @classmethod
    def wrap(cls, obj: Any, device: Device | int | None = None) -> Stream:
        """Use a foreign stream (CuPy, PyTorch, Numba, cuda.core, ``__cuda_stream__``, or
        a raw handle) without taking ownership: closing the wrapper never destroys it.

        The foreign object is kept alive as long as the wrapper. Prefer passing the
        object to its raw handle: a raw ``int`` other than 0, 1 or 2 (the legacy and
        per-thread default streams) must be the handle of a live ``CUstream`` of this
        process. aiocuda rejects, with :class:`~aiocuda.errors.ArgumentError`, a value
        that cannot be one (out of range, misaligned, not readable memory), but it
        cannot vouch for the rest: the driver reads the handle as a stream object, and
        any other readable address makes it fail or crash the process.

        The device is the stream's; for a default stream (0, 1 or 2: PyTorch's and CuPy's
        default streams among them) it is the device its object names, and a raw 0, 1 or
        2 is device 0's unless ``device`` says otherwise. A ``device`` other than that of
        a stream of its own raises :class:`~aiocuda.errors.ArgumentError`. Such a value
        means the default stream of the context current on the calling thread, so the
        wrapper of a default stream makes its device current whenever it is used.
        """
        if isinstance(obj, Stream):
            _check_wrapped_device(obj, obj.device, device)
            return obj
        value, owner = _foreign_handle(obj)
        if value > 2:
            driver = Device(0)._driver
            handle = driver.stream_from_value(value)
            dev = Device(driver.stream_device_ordinal(handle))
            # (taken as another device, every await, record and hold of the wrapper
            # failed: an event of one device cannot be recorded into another's stream)
            _check_wrapped_device(f"handle {value:#x}", dev, device)
        else:
            if device is None:
                # A default stream's value names no device (PyTorch's default stream is 0
                # on every device; the driver answers for the thread's current context):
                # taken as device 0's, an await on device 1's waited for device 0's work.
                device = _declared_ordinal(owner)
            dev = _as_device(device)
            dev.make_current()  # (the simulator resolves the value now)
            handle = dev._driver.stream_from_value(value)
            cls = _DefaultStream
        self = object.__new__(cls)
        self._setup(dev, handle, owned=False, owner=owner)
        return self

    @staticmethod
    def priority_range(device: Device | int | None = None) -> tuple[int, int]:
        """``(least, greatest)`` priority; numerically lower is more urgent."""
        dev = _as_device(device)
        dev.make_current()
        return dev._driver.stream_priority_range()

    @property
    def priority(self) -> int:
        """The stream's priority as the driver keeps it (clamped to
        :meth:`priority_range`; numerically lower is more urgent)."""
        return self._driver.stream_get_priority(self.handle)

    @property
    def non_blocking(self) -> bool:
        """Whether the stream runs independently of the legacy default stream."""
        return self._driver.stream_is_non_blocking(self.handle)

    @property
    def handle(self) -> Any:
        """The backend handle, for seam calls."""
        if self._closed:
            raise self._closed_error()
        return self._handle

    def _closed_error(self) -> ArgumentError:
        return ArgumentError(
            f"{self!r} is closed: no new work can go on it; pass a live stream (stream=...) to calls that would use it",
            name="CUDA_ERROR_INVALID_HANDLE",
        )

    def _end(self) -> Event:
        """A closed stream's end: the point after the work enqueued before it closed."""
        if self._tail is None:
            # (a poisoned context: the closed stream has no end to wait for, and every
            # later call on the device raises its error, as this does)
            if isinstance(self._tail_failure, ContextPoisonedError):
                raise ContextPoisonedError.earlier(self._tail_failure, f"device {self.device.ordinal}")
            raise self._closed_error()
        return self._tail

    def __cuda_stream__(self) -> tuple[int, int]:
        """The CUDA stream protocol: ``(0, raw CUstream)``."""
        return (0, self._driver.handle_value(self.handle))

    def __int__(self) -> int:
        return self._driver.handle_value(self.handle)

    # -- waiting ----------------------------------------------------------------------------
    def __await__(self) -> Generator[Any, Any, None]:
        if self._capture is not None:
            raise self._capture.refuse("await stream")
        if self._closed:
            return self._end().__await__()
        if self._holds:
            _release_finished(self._driver, self._pool, self._holds)
        if _orphans:
            _sweep_orphans()
        event = self._pool.acquire()
        try:
            self._driver.event_record(event, self.handle)
        except BaseException:
            self._pool.release(event)
            raise
        return self._engine.wait(event, self._handle, self.device, self._pool.release, just_recorded=True)

    def synchronize(self) -> None:
        """Block the calling thread until the stream is idle. For synchronous code only:
        in a coroutine, ``await stream`` instead (on an event loop's thread this warns,
        :class:`~aiocuda.errors.BlockingCallWarning`)."""
        if self._capture is not None:
            raise self._capture.refuse("stream.synchronize()")
        warn_if_on_loop("Stream.synchronize()")
        self._synchronize()

    def _synchronize(self) -> None:
        """:meth:`synchronize` without its warning, for callers that give their own."""
        if self._closed:
            self._driver.event_synchronize(self._end().handle)
            return
        self._driver.stream_synchronize(self.handle)
        if self._holds:
            _release_finished(self._driver, self._pool, self._holds)

    def query(self) -> bool:
        """True when all work enqueued so far has completed."""
        if self._capture is not None:
            raise self._capture.refuse("stream.query()")
        if self._closed:
            return self._end().query()
        return self._driver.stream_query(self.handle)

    # -- ordering and events ----------------------------------------------------------------
    def record(self, event: Event | None = None, *, timing: bool = False) -> Event:
        """Mark the current end of this stream's work and return the Event.

        Without ``event`` a pooled event is used (no driver allocation) unless
        ``timing=True`` asks for a timing event; with an ``event`` made without timing,
        ``timing=True`` raises :class:`~aiocuda.errors.ArgumentError`. On a closed
        stream, ``record()`` returns the end of the work enqueued before it closed (the
        same Event every time); an ``event`` or ``timing=True`` there, which needs a new
        record, raises :class:`~aiocuda.errors.ArgumentError`.
        """
        if event is not None:
            if not isinstance(event, Event):
                raise TypeError(f"Stream.record takes an Event, not {type(event).__name__}")
            if timing and not event.timing:
                raise invalid_value(
                    "timing=True asks for a new timing event, and the event given has no timing: "
                    "make it with Event(timing=True), or leave the event out"
                )
            return event.record(self)
        if self._closed and not timing:
            return self._end()
        if timing:
            return Event(self.device, timing=True).record(self)
        handle = self._pool.acquire()
        self._driver.event_record(handle, self.handle)
        return Event._pooled(self.device, handle, self._handle, self._capture, self._pool)

    def wait(self, other: Event | Stream) -> None:
        """Make this stream's future work wait, on the GPU, for ``other``: an Event, or
        everything enqueued so far on another Stream. No host thread blocks."""
        if isinstance(other, Event):
            if other._capture is not None or self._capture is not None:
                (other._capture or self._capture).check_wait(self, other._capture)
            self._driver.stream_wait_event(self.handle, other.handle)
            return
        if not isinstance(other, Stream):
            raise TypeError(f"Stream.wait takes an Event or a Stream, not {type(other).__name__}")
        if other._capture is not None or self._capture is not None:  # a stream joins a capture, or cannot
            (other._capture or self._capture).check_wait(self, other._capture)
        if other._closed:
            self._driver.stream_wait_event(self.handle, other._end().handle)
            return
        event = other._pool.acquire()
        other._driver.event_record(event, other.handle)
        try:
            self._driver.stream_wait_event(self.handle, event)
        finally:
            # The wait captured the event's current point; re-recording it later cannot
            # affect the wait (CUDA semantics), so the event can be reused at once.
            other._pool.release(event)

    def call_when_done(self, callback: Callable[..., Any], *args: Any) -> StreamCallback:
        """Call ``callback(*args)`` on the running event loop once the work enqueued on
        this stream so far is done, after the callbacks scheduled before it on this
        stream; returns at once with a :class:`StreamCallback` (``cancel()`` it, or
        ``await`` it for what ``callback`` returned).

        ``callback`` is a plain function run on the loop's thread, never on a driver
        thread, so it may use aiocuda; if it returns an awaitable, that is not awaited,
        and the handle fails with a TypeError. If the device's context is poisoned before
        the GPU gets there, it is never called: the handle fails with
        :class:`~aiocuda.errors.ContextPoisonedError` instead.
        """
        return _callbacks.call_when_done(self, callback, args)

    def hold(self, *objs: Any) -> None:
        """Keep ``objs`` alive until all work enqueued on this stream so far completes.

        Costs one pooled event record. References are dropped lazily, on later holds,
        awaits and synchronizes of this stream. While the stream is being captured, the
        objects are kept with the graph instead, for all of its replays. On a closed
        stream, they are kept until the work enqueued before it closed completes.
        """
        if self._capture is not None:
            self._capture.hold(objs)
            return
        if self._closed:  # kept by the device's stream, made to wait for this one's end
            # (not the current stream: inside use_stream(self), that is this closed one)
            keeper = _default_stream(self.device)
            keeper.wait(self)
            keeper.hold(*objs)
            return
        if self._holds:
            _release_finished(self._driver, self._pool, self._holds)
        event = self._pool.acquire()
        self._driver.event_record(event, self.handle)
        self._holds.append((event, objs))

    # -- graphs ----------------------------------------------------------------------------------
    def capture(self, mode: CaptureMode | None = None) -> GraphCapture:
        """Record the work enqueued on this stream into an :class:`~aiocuda.graph.Graph`
        instead of running it: ``with stream.capture() as graph:`` or ``async with``
        (which instantiates the graph off the event loop). See :mod:`aiocuda.graph`.

        ``mode`` says which threads may not make calls that could disturb the capture
        (allocating or freeing page-locked memory, loading modules): the capturing thread
        (``"thread_local"``, the default of ``with``), every thread (``"global"``) or none
        (``"relaxed"``, the default of ``async with``: every task of the loop shares the
        capturing thread, and a block that awaits lets them run, whose page-locked
        allocations and module loads would fail in the other modes).
        """
        from .graph import GraphCapture  # the graph layer builds on this one

        return GraphCapture._create(self, mode)

    # -- lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        """Destroy the stream (if owned). Enqueued work still runs to completion, and
        objects held for it stay alive until it has.

        A closed stream takes no new work, but can still be awaited, queried,
        synchronized, recorded (the same Event: the end of the work enqueued before
        :meth:`close`) and waited for by other streams.
        """
        if not self._closed:
            capture = self._capture
            if capture is not None:
                if capture.origin is self:
                    raise capture.refuse("closing the stream being captured", "close it after its capture block")
                capture.leave(self)  # (a stream joined to the capture is destroyed once it ends)
                self._closed = True
                return
            if self._spare_pools:
                self._give_back_spares()
            try:
                self._tail = self.record()
            except CudaError as exc:
                self._tail_failure = exc  # a poisoned context: waiting on it can only fail anyway
            self._closed = True
            self._finalizer()

    def _give_back_spares(self) -> None:
        """Have the memory pools that keep freed blocks for this stream free them on it."""
        # Freed here, while the stream is open: stream-ordered after its work, with no
        # driver call that waits. Kept, a closed stream's blocks would count against
        # their pool's spare budget (and stay reserved) until its next trim, and no
        # allocation could take them (none can be made on a closed stream). A free of
        # another thread racing this close may still leave one: the pool's next trim
        # frees it after the stream's tail.
        listed, self._spare_pools = self._spare_pools, []
        for ref in listed:
            pool = ref()
            if pool is not None:
                try:
                    pool._give_back_spares(of=self)
                except CudaError:
                    pass  # a poisoned context: its memory goes with it

    def _close_after_capture(self) -> None:
        """Finish a :meth:`close` made while the stream took part in a capture (which has
        ended): the end of its work is recorded and the stream destroyed."""
        self._closed = False
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"handle={self._driver.handle_value(self._handle):#x}"
        kind = "" if self.owned else " foreign"
        return f"<Stream{kind} device={self.device.ordinal} {state} holds={len(self._holds)}>"


class _DefaultStream(Stream):
    """A wrapped default stream: its value (0, 1 or 2) means the default stream of the
    context current on the calling thread when it is used, so each use of its handle
    makes the stream's device current first."""

    __slots__ = ()

    # (with another device's context current, an await, record or hold of it failed: an
    # event of its device recorded into the other device's default stream)
    @property
    def handle(self) -> Any:
        handle = super().handle
        self.device.make_current()
        return handle


_current: contextvars.ContextVar[Stream | None] = contextvars.ContextVar("aiocuda_current_stream", default=None)
# A plain dict: Devices live as long as the process (Device's registry keeps them), and a
# WeakKeyDictionary's get costs a Python call and a weak reference (0.15 us on the
# development machine) on every use of the current stream.
_defaults: dict[Device, Stream] = {}


def _check_stream(stream: object) -> None:
    """TypeError unless ``stream`` (a ``stream=`` given) is an aiocuda :class:`Stream`."""
    if not isinstance(stream, Stream):
        # (a raw handle, or a PyTorch, CuPy or Numba stream: each has a ``device`` of its
        # own, or none, and failed later with an AttributeError or a wrong device)
        foreign = isinstance(stream, int) or hasattr(stream, "__cuda_stream__")
        hint = " (Stream.wrap(obj) adopts a foreign stream or a raw handle)" if foreign else ""
        raise TypeError(f"stream must be an aiocuda Stream, not {type(stream).__name__}{hint}")


def _default_stream(device: Device) -> Stream:
    """``device``'s default aiocuda stream, made on first use and after it was closed."""
    stream = _defaults.get(device)
    if stream is None or stream._closed:
        stream = _defaults[device] = Stream(device)
    return stream


def current_stream(device: Device | int | None = None) -> Stream:
    """The task's current stream (set with :func:`use_stream`) if it is on ``device``;
    otherwise the device's default aiocuda stream (non-blocking, created on first use)."""
    chosen = _current.get()
    if device is None:
        if chosen is not None:
            return chosen
        dev = _as_device(0)
    else:
        # A Device (what the memory hot paths pass) is taken as it is, without a call.
        dev = device if type(device) is Device else _as_device(device)
        if chosen is not None and chosen.device is dev:
            return chosen
    stream = _defaults.get(dev)  # (read here: a call to _default_stream costs the hot paths)
    return stream if stream is not None and not stream._closed else _default_stream(dev)


def _stream_for_new(device: Device | int | None, given: str = "device") -> Stream:
    """The stream a new array goes to when no ``stream=`` was given: the task's current
    stream, whose device ``device`` (a ``device=`` or a pool's, as ``given`` says in
    the error) must be if given; without a current stream, the default stream of
    ``device`` (default 0).

    Unlike :func:`current_stream`, a current stream of another device is an error rather
    than a reason to take that device's default stream: an operation on an existing
    array follows the array's device, but a new array has only the caller's word, and
    inside ``use_stream(s)`` an explicit other device contradicts it (allocated there,
    the array would be unordered with the work on ``s``, which also could not use it).
    """
    chosen = _current.get()
    if chosen is not None:
        if device is not None and _as_device(device) is not chosen.device:
            ordinal = _as_device(device).ordinal
            current = chosen.device.ordinal
            raise invalid_value(
                f"{given} {ordinal} was given while the task's current stream (use_stream) is on device "
                f"{current}: pass stream= a stream of device {ordinal} to allocate there, or allocate on "
                f"device {current} inside this block"
            )
        return chosen
    # current_stream(device)'s lookup of the default stream, written out: this is the
    # allocation hot path, where a call costs about 0.05 us.
    dev = device if type(device) is Device else _as_device(device)
    stream = _defaults.get(dev)
    if stream is None or stream._closed:
        stream = _defaults[dev] = Stream(dev)
    return stream


@contextlib.contextmanager
def use_stream(stream: Stream) -> Iterator[Stream]:
    """Make ``stream`` the current stream of this task inside the block.

    A task started inside the block (``asyncio.create_task``, a task group's or trio
    nursery's ``start_soon``, ``to_thread``) starts with ``stream`` current, and keeps it
    after the block ends: each starts with a copy of its starter's context variables. A
    task started before the block, or elsewhere, is not affected.

    Work given no ``stream=`` goes to ``stream``: kernel launches, and operations on
    arrays of ``stream.device`` (those of another device use that device's default
    stream). New arrays (:func:`~aiocuda.empty`, :func:`~aiocuda.zeros`,
    :func:`~aiocuda.to_device`, managed arrays, module variables) are made on
    ``stream.device`` unless ``stream=`` says otherwise; a ``device=`` or pool of
    another device raises :class:`~aiocuda.errors.ArgumentError`.
    """
    if not isinstance(stream, Stream):
        raise TypeError(f"use_stream takes a Stream, not {type(stream).__name__} (Stream.wrap adopts a handle)")
    token = _current.set(stream)
    try:
        yield stream
    finally:
        _current.reset(token)
