"""The simulated driver's handle objects: devices, contexts, streams, events, stream points.

Every handle has an integer ``value`` (what ``Driver.handle_value`` returns), unique
within the process; :func:`next_handle_value` hands them out, and the other sim mixins
use it for their own handles (pools, modules, functions) too.

Streams
-------

Simulated streams: a queue of operations run in order by the driver's worker pool
(``_workers.py``). A stream holds no thread of its own: while it has runnable work it is
scheduled on the pool, which runs it on one worker at a time; while it waits (paused, a
latency, a ``stream_wait_event`` on another stream's point) it costs nothing. So streams
run concurrently with each other and with the caller, in order within a stream, and
idle streams cost no thread.

One condition variable per stream guards its queue and counters; it is notified when an
operation is finished, when the stream is resumed, and when the device is poisoned or
the driver stops -- so every host wait on a stream (``stream_synchronize``,
``event_synchronize``) wakes for all the reasons it could have to stop waiting.
Operations themselves run outside the lock.

Failure model (what ``SimCore._enqueue`` documents): an operation raising a
:class:`CudaError` with a non-sticky code leaves that error on the device for its next
seam call; a sticky code poisons the device; any other exception (a kernel
implementation's ``IndexError``, a ``pytest.fail()``: any ``BaseException``) poisons it
with ``CUDA_ERROR_ILLEGAL_ADDRESS``.
Once the device is poisoned or the driver stopped, a worker runs nothing more -- host
functions (doorbells) included, as on the real driver.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...errors import STICKY_CODES, CudaError, ResultCode
from ._codes import sim_error
from ._workers import Workers

__all__ = [
    "DEFAULT_LIMITS",
    "HOST_FUNCTION",
    "SHUT_DOWN",
    "Poison",
    "RemotePoint",
    "SimContext",
    "SimDevice",
    "SimEvent",
    "SimPoint",
    "SimStream",
    "StreamWait",
    "new_workers",
    "next_handle_value",
]

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


DEFAULT_LIMITS = {
    "stack_size": 1024,
    "printf_fifo_size": 1 << 20,
    "malloc_heap_size": 8 << 20,
    "dev_runtime_sync_depth": 2,
    "dev_runtime_pending_launch_count": 2048,
    "max_l2_fetch_granularity": 64,
    "persisting_l2_cache_size": 0,
}
"""Each limit's value in a new context (as on an H100)."""


class SimContext:
    """A context: a device's primary context (one per device, never destroyed; retained
    and released) or a user context (``context_create``, until ``context_destroy``).

    ``flags`` are the CUDA context flags; ``limits`` and ``cache_config`` what
    ``context_set_limit`` and ``context_set_cache_config`` set.
    """

    __slots__ = ("cache_config", "destroyed", "device_ordinal", "flags", "limits", "primary", "retain_count", "value")

    def __init__(self, device_ordinal: int, *, primary: bool = True, flags: int = 0) -> None:
        self.value = next_handle_value()
        self.device_ordinal = device_ordinal
        self.primary = primary
        self.flags = flags
        self.retain_count = 0
        self.destroyed = False
        self.limits = dict(DEFAULT_LIMITS)
        self.cache_config = "prefer_none"

    def __repr__(self) -> str:
        kind = f"retained={self.retain_count}" if self.primary else ("destroyed" if self.destroyed else "user")
        return f"<SimContext {self.value:#x} device={self.device_ordinal} {kind}>"


class SimDevice:
    """One simulated GPU and its context's state.

    ``used_bytes`` is device memory in use; the memory mixin keeps it up to date (under
    its own lock) and ``mem_get_info`` reports ``total_mem - used_bytes``. ``peers`` holds
    the ordinals this device's context has enabled peer access to.

    ``poison`` is set once (first sticky error wins) and never cleared: a sticky error
    poisons every device of the process, as on a GPU (the CUDA documentation: "the
    process must be terminated and relaunched"; an illegal address on one H200 made the
    other's stream queries fail with it too). ``async_error`` holds a non-sticky error
    from an enqueued operation until the next seam call on the device reports it.
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
        "process",
        "total_mem",
        "used_bytes",
    )

    null_stream: SimStream
    """The legacy default stream (value 0); set by the core right after construction."""
    process: tuple[SimDevice, ...]
    """Every device of the driver, this one included; set by the core likewise."""

    def __init__(self, ordinal: int, total_mem: int) -> None:
        self.ordinal = ordinal
        self.total_mem = total_mem
        self.used_bytes = 0
        self.context = SimContext(ordinal)
        self.peers: set[int] = set()
        self.poison: Poison | None = None
        self.async_error: CudaError | None = None
        self._lock = threading.RLock()  # (reentrant: see Workers' lock)
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
        """Poison the context, and every other device's (the first poison of each wins),
        and wake every waiter on their streams."""
        for device in self.process:
            where = detail if device is self else f"by a sticky error on device {self.ordinal}: {detail}"
            with device._lock:
                if device.poison is None:
                    device.poison = Poison(code, where, cause)
            for stream in device.streams():
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


class RemotePoint:
    """A point of a stream in another process, seen through an interprocess event's
    shared counters (``_shared.EventSlot``): reached once the counter of reached
    generations gets to ``generation``. It belongs to no stream here, so a stream waiting
    for it looks again on a timer, and a host waits by polling."""

    __slots__ = ("generation", "slot")

    stream = None

    def __init__(self, slot: Any, generation: int) -> None:
        self.slot = slot
        self.generation = generation

    def reached(self) -> bool:
        return bool(self.slot.completed() >= self.generation)


class SimEvent:
    """An event: where it was last recorded (``point``), or None if never recorded.

    ``captured`` is set while the event was last recorded in a capturing stream: the
    capture and the graph nodes a wait on the event depends on (see ``_graphs.py``).
    An interprocess event also has ``shared``, its counters for other processes; an
    event opened from another process's handle has ``remote`` instead (and no point).
    """

    __slots__ = (
        "blocking_sync",
        "captured",
        "destroyed",
        "device_ordinal",
        "point",
        "remote",
        "shared",
        "timing",
        "value",
    )

    def __init__(self, device_ordinal: int, timing: bool, blocking_sync: bool) -> None:
        self.value = next_handle_value()
        self.device_ordinal = device_ordinal
        self.timing = timing
        self.blocking_sync = blocking_sync
        self.point: SimPoint | None = None
        self.captured: tuple[Any, tuple[int, ...]] | None = None
        self.destroyed = False
        self.shared: Any = None
        self.remote: Any = None

    def __repr__(self) -> str:
        if self.point is None:
            state = "never recorded"
        else:
            state = "complete" if self.point.reached() else "pending"
        return f"<SimEvent {self.value:#x} device={self.device_ordinal} {state}>"


SHUT_DOWN = (
    "the simulated driver was shut down (its Simulator closed, or replaced by a later use_simulator() "
    "or use_backend()): what was made with it cannot be used"
)
"""Why a call on a simulated driver's objects fails once it is shut down (DEINITIALIZED)."""

_IDLE_EXIT_S = 1.0
"""How long an idle worker thread lingers before leaving (new work starts one again)."""

REMOTE_POLL = 0.0002
"""Seconds between looks at another process's point (:class:`RemotePoint`)."""

_TURN_OPERATIONS = 64
"""Operations a stream runs before it lets other queued streams have a worker."""

Operation = Callable[[], object]

HOST_FUNCTION = "launch_doorbell"
"""The name doorbell operations are enqueued under (they never block and never fail)."""


def new_workers(bind_context: Callable[[SimContext | None], None]) -> Workers:
    """The worker pool of one simulated driver."""
    return Workers(bind_context, lambda: _IDLE_EXIT_S)


class StreamWait:
    """The operation behind ``stream_wait_event``: the stream goes on once ``point`` is
    reached -- or once the device of ``point``'s stream is poisoned (no further ordering
    is promised then). The pool never blocks on it: the stream registers with the stream
    of ``point`` and is scheduled again when that one moves."""

    __slots__ = ("point",)

    def __init__(self, point: SimPoint | RemotePoint) -> None:
        self.point = point

    def __call__(self) -> None:
        pass  # nothing to do once the point is passed

    def passed(self) -> bool:
        stream = self.point.stream
        return self.point.reached() or (stream is not None and stream.device.poison is not None)


class SimStream:
    """A simulated stream. ``value`` is its handle value (0 for a device's legacy null stream,
    2 for a per-thread default stream).

    ``submitted`` counts operations ever enqueued and ``finished`` those completed, so
    "everything enqueued so far" is the point ``submitted`` and it is reached once
    ``finished`` gets there.
    """

    __slots__ = (
        "__weakref__",
        "_cond",
        "_dependents",
        "_due",
        "_ops",
        "_paused",
        "_scheduled",
        "_workers",
        "capture",
        "context",
        "destroyed",
        "device",
        "finished",
        "non_blocking",
        "priority",
        "submitted",
        "value",
    )

    def __init__(self, workers: Workers, device: SimDevice, value: int, non_blocking: bool, priority: int) -> None:
        self.value = value
        self.device = device
        self.context: SimContext = device.context
        """The context the stream was created in (set by ``stream_create``)."""
        self.non_blocking = non_blocking
        self.priority = priority
        self.destroyed = False
        self.capture: Any = None
        """The capture (``_graphs.SimCapture``) this stream's operations go to, if any."""
        self.submitted = 0
        self.finished = 0
        self._workers = workers
        self._cond = threading.Condition(threading.RLock())  # (reentrant: see Workers' lock)
        self._ops: collections.deque[tuple[Operation, str]] = collections.deque()
        self._paused = False
        self._scheduled = False  # in the pool's queue or timers, or being run by a worker
        self._due: float | None = None  # when the first operation's latency ends, once it started
        self._dependents: list[SimStream] = []  # streams whose first operation waits for this one
        device.add_stream(self)

    def __repr__(self) -> str:
        paused = " paused" if self._paused else ""
        gone = " destroyed" if self.destroyed else ""
        return (
            f"<SimStream {self.value:#x} device={self.device.ordinal} "
            f"done={self.finished}/{self.submitted}{paused}{gone}>"
        )

    # -- called by the core (any thread) ---------------------------------------------------
    def submit(self, fn: Operation, name: str) -> int:
        """Queue ``fn`` after everything before it; returns its sequence number (1-based)."""
        with self._cond:
            if self._workers.stopping.is_set():
                raise sim_error(ResultCode.DEINITIALIZED, name, SHUT_DOWN)
            self._ops.append((fn, name))
            self.submitted += 1
            seq = self.submitted
            start = not self._scheduled
            self._scheduled = True
        if start:
            self._workers.ready(self)
        return seq

    def wait_until(self, done: Callable[[], bool], also: SimDevice | None = None) -> None:
        """Block until ``done()``, this stream's device (or ``also``) is poisoned, or the driver stops.

        ``done`` is evaluated under the stream's lock and must only read this stream's
        state. The caller finds out which of the three happened by looking afterwards.
        """

        def stop_waiting() -> bool:
            return (
                done()
                or self.device.poison is not None
                or (also is not None and also.poison is not None)
                or self._workers.stopping.is_set()
            )

        with self._cond:
            self._cond.wait_for(stop_waiting)

    def pause(self) -> None:
        """Run nothing more (after the operation in progress) until :meth:`resume`."""
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()
        self._kick()

    def wake(self) -> None:
        """Wake every thread waiting on this stream, and the streams waiting for it, so
        that they look again at why they wait (the device was poisoned, the driver stops)."""
        with self._cond:
            self._cond.notify_all()
            dependents, self._dependents = self._dependents, []
        for stream in dependents:
            stream._kick()
        self._kick()

    def destroy(self) -> None:
        """Mark destroyed: queued work still runs."""
        with self._cond:
            self.destroyed = True
            self._cond.notify_all()

    def drop(self) -> None:
        """Forget the queued operations (the driver stops)."""
        with self._cond:
            self._ops.clear()
            self._cond.notify_all()

    # -- scheduling -----------------------------------------------------------------------
    def _kick(self) -> None:
        """Schedule the stream if it has operations and is not scheduled already."""
        with self._cond:
            if self._scheduled or not self._ops:
                return
            self._scheduled = True
        self._workers.ready(self)

    def _wait_for_me(self, stream: SimStream, point: SimPoint) -> bool:
        """Kick ``stream`` when this stream moves; False (and nothing registered) if
        ``point`` on this stream is already passed."""
        with self._cond:
            if point.reached() or self.device.poison is not None:
                return False
            self._dependents.append(stream)
            return True

    def run_turn(self) -> None:
        """Run this stream's operations in order, on a pool worker, until it cannot go on.

        Ends in one of four ways: unscheduled (nothing to run, paused, dropped, or waiting
        for another stream, which kicks it), in the pool's timers (a latency), or back in
        its queue (its turn is over).
        """
        self._workers.bind_context(self.device.context)
        for _ in range(_TURN_OPERATIONS):
            with self._cond:
                job = self._next_job()
                if job is None:
                    self._scheduled = False
                    return
                fn, name = job
                if self._due is None and (delay := self._workers.latency.get(name)):
                    self._due = time.monotonic() + delay
                if self._due is not None and self._due > time.monotonic():
                    self._workers.after(self._due, self)
                    return
                waits_for = fn.point if type(fn) is StreamWait and not fn.passed() else None
                if waits_for is not None:
                    if waits_for.stream is None:  # another process's point: look again soon
                        self._workers.after(time.monotonic() + REMOTE_POLL, self)
                        return
                    self._scheduled = False
            if waits_for is not None:
                if not waits_for.stream._wait_for_me(self, waits_for):
                    self._kick()  # passed meanwhile
                return
            if not self._execute(fn, name):
                continue  # dropped: the next look at the queue clears it
            done = 1
            while (bell := self._doorbell_at(done)) is not None and self._execute(*bell):
                done += 1
            with self._cond:
                if self._workers.stopping.is_set():
                    return  # shut down meanwhile: the queue is gone
                for _ in range(done):
                    self._ops.popleft()
                self.finished += done
                self._due = None
                self._cond.notify_all()
                dependents, self._dependents = self._dependents, []
            for stream in dependents:
                stream._kick()
        self._workers.ready(self)  # turn over: others first; still scheduled

    def _next_job(self) -> tuple[Operation, str] | None:
        """The next operation to run, or None when there is none to run now (lock held)."""
        if self._workers.stopping.is_set() or self.device.poison is not None:
            if self._ops:
                self._ops.clear()
                self._cond.notify_all()
            return None
        if self._paused or not self._ops:
            return None
        return self._ops[0]

    def _doorbell_at(self, index: int) -> tuple[Operation, str] | None:
        """The queued operation at ``index`` if it is a doorbell that may run now.

        Doorbells right behind an operation run before that operation is reported
        finished. CUDA leaves the gap between an event completing and the next host
        function running unspecified; on a GPU it is microseconds, while here a waiter
        woken by the event could otherwise run first for a whole GIL switch interval
        and see ``stream_query`` report the stream busy right after ``await stream``.
        """
        with self._cond:
            if (
                self._paused
                or len(self._ops) <= index
                or self._ops[index][1] != HOST_FUNCTION
                or HOST_FUNCTION in self._workers.latency
                or self.device.poison is not None
                or self._workers.stopping.is_set()
            ):
                return None
            return self._ops[index]

    def _execute(self, fn: Operation, name: str) -> bool:
        """Run one operation (a failure is the device's, as on a GPU); False if it had to
        be dropped instead: the device is poisoned or the driver stops."""
        if self.device.poison is not None or self._workers.stopping.is_set():
            return False
        try:
            fn()
        except BaseException as exc:
            # BaseException too: pytest.fail(), pytest.skip() and sys.exit() in a kernel's
            # implementation raise one, and escaping here it ended the worker thread (the
            # stream still scheduled, so its work and every await of it stayed pending).
            # No signal reaches a worker thread, so this catches no KeyboardInterrupt.
            self._fail(name, exc)
        return True

    def _fail(self, name: str, exc: BaseException) -> None:
        where = f"operation {name!r} on stream {self.value:#x}"
        if isinstance(exc, CudaError) and exc.code is not None:
            if exc.code not in STICKY_CODES:
                self.device.record_async_error(exc)
                return
            self.device.poison_with(exc.code, f"{where} failed: {exc}", exc)
            return
        self.device.poison_with(ResultCode.ILLEGAL_ADDRESS, f"{where} raised {type(exc).__name__}: {exc}", exc)
