"""The simulated driver's handle objects: devices, contexts, streams, events, stream points.

Every handle has an integer ``value`` (what ``Driver.handle_value`` returns), unique
within the process; :func:`next_handle_value` hands them out, and the other sim mixins
use it for their own handles (pools, modules, functions) too.

Streams
-------

Simulated streams: a queue of operations run in order on the stream's own thread.

Each :class:`SimStream` owns a FIFO of ``(fn, name)`` operations and starts a worker
thread lazily, when the first operation arrives; the worker leaves after a short idle
spell (or once the stream is destroyed and drained, or the driver shuts down) and the
next operation starts a new one. So streams run concurrently with each other and with
the caller, in order within a stream, and idle streams cost no thread.

One condition variable per stream guards its queue and counters; it is notified when an
operation is added or finished, when the stream is resumed, and when the device is
poisoned or the driver stops -- so every wait on a stream (``stream_synchronize``,
``event_synchronize``, a ``stream_wait_event`` in another stream's worker) wakes for
all the reasons it could have to stop waiting. Operations themselves run outside the
lock.

Failure model (what ``SimCore._enqueue`` documents): an operation raising a
:class:`CudaError` with a non-sticky code leaves that error on the device for its next
seam call; a sticky code poisons the device; any other exception (a kernel
implementation's ``IndexError``, ...) poisons it with ``CUDA_ERROR_ILLEGAL_ADDRESS``.
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

__all__ = [
    "HOST_FUNCTION",
    "Poison",
    "SimContext",
    "SimDevice",
    "SimEvent",
    "SimPoint",
    "SimStream",
    "Workers",
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
    """An event: where it was last recorded (``point``), or None if never recorded.

    ``captured`` is set while the event was last recorded in a capturing stream: the
    capture and the graph nodes a wait on the event depends on (see ``_graphs.py``).
    """

    __slots__ = ("blocking_sync", "captured", "destroyed", "device_ordinal", "point", "timing", "value")

    def __init__(self, device_ordinal: int, timing: bool, blocking_sync: bool) -> None:
        self.value = next_handle_value()
        self.device_ordinal = device_ordinal
        self.timing = timing
        self.blocking_sync = blocking_sync
        self.point: SimPoint | None = None
        self.captured: tuple[Any, tuple[int, ...]] | None = None
        self.destroyed = False

    def __repr__(self) -> str:
        if self.point is None:
            state = "never recorded"
        else:
            state = "complete" if self.point.reached() else "pending"
        return f"<SimEvent {self.value:#x} device={self.device_ordinal} {state}>"


_IDLE_EXIT_S = 1.0
"""How long an idle worker thread lingers before leaving (a new operation restarts it)."""

Operation = Callable[[], object]

HOST_FUNCTION = "launch_doorbell"
"""The name doorbell operations are enqueued under (they never block and never fail)."""


class Workers:
    """What all stream workers of one driver share: latencies, the stop flag, the thread binding."""

    __slots__ = ("bind_context", "latency", "stopping")

    def __init__(self, bind_context: Callable[[SimContext], None]) -> None:
        self.latency: dict[str, float] = {}
        """Seconds an operation of that name sleeps on its worker before it runs."""
        self.stopping = threading.Event()
        """Set by ``shutdown``: workers drop their queues and leave; waits end."""
        self.bind_context = bind_context
        """Makes a context current on the calling (worker) thread."""


class SimStream:
    """A simulated stream. ``value`` is its handle value (0 for a device's legacy null stream).

    ``submitted`` counts operations ever enqueued and ``finished`` those completed, so
    "everything enqueued so far" is the point ``submitted`` and it is reached once
    ``finished`` gets there.
    """

    __slots__ = (
        "__weakref__",
        "_cond",
        "_ops",
        "_paused",
        "_thread",
        "_workers",
        "capture",
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
        self.non_blocking = non_blocking
        self.priority = priority
        self.destroyed = False
        self.capture: Any = None
        """The capture (``_graphs.SimCapture``) this stream's operations go to, if any."""
        self.submitted = 0
        self.finished = 0
        self._workers = workers
        self._cond = threading.Condition(threading.Lock())
        self._ops: collections.deque[tuple[Operation, str]] = collections.deque()
        self._paused = False
        self._thread: threading.Thread | None = None
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
                raise sim_error(ResultCode.DEINITIALIZED, name, "the simulated driver was shut down")
            self._ops.append((fn, name))
            self.submitted += 1
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"aiocuda-sim-stream-{self.value:#x}", daemon=True
                )
                self._thread.start()
            else:
                self._cond.notify_all()
            return self.submitted

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

    def wake(self) -> None:
        """Wake every thread waiting on this stream so it re-checks why it waits."""
        with self._cond:
            self._cond.notify_all()

    def destroy(self) -> None:
        """Mark destroyed: queued work still runs, then the worker leaves."""
        with self._cond:
            self.destroyed = True
            self._cond.notify_all()

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the worker thread (if any) to leave."""
        with self._cond:
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    # -- the worker thread ----------------------------------------------------------------
    def _run(self) -> None:
        self._workers.bind_context(self.device.context)
        while True:
            with self._cond:
                job = self._next_job()
                if job is None:
                    self._thread = None
                    self._cond.notify_all()
                    return
            if not self._execute(*job):
                continue  # dropped: the device was poisoned or the driver stopped meanwhile
            done = 1
            while (bell := self._doorbell_at(done)) is not None and self._execute(*bell):
                done += 1
            with self._cond:
                for _ in range(done):
                    self._ops.popleft()
                self.finished += done
                self._cond.notify_all()

    def _doorbell_at(self, index: int) -> tuple[Operation, str] | None:
        """The queued operation at ``index`` if it is a doorbell that may run now.

        Doorbells right behind an operation run before that operation is reported
        finished. CUDA leaves the gap between an event completing and the next host
        function running unspecified; on a GPU it is microseconds, while here a waiter
        woken by the event could otherwise run first for a whole GIL switch interval
        and see ``stream_query`` report the stream busy right after ``await stream``.
        """
        with self._cond:
            if self._paused or len(self._ops) <= index or self._ops[index][1] != HOST_FUNCTION:
                return None
            return self._ops[index]

    def _next_job(self) -> tuple[Operation, str] | None:
        """The next operation to run, or None when the worker should leave (lock held)."""
        while True:
            if self._workers.stopping.is_set() or self.device.poison is not None:
                self._ops.clear()
                return None
            if self._ops and not self._paused:
                return self._ops[0]
            if self.destroyed and not self._ops:
                return None
            if not self._cond.wait(_IDLE_EXIT_S) and not self._ops:
                return None

    def _execute(self, fn: Operation, name: str) -> bool:
        """Run one operation after its simulated latency; False if it had to be dropped."""
        delay = self._workers.latency.get(name)
        if delay:
            self._workers.stopping.wait(delay)
        if self.device.poison is not None or self._workers.stopping.is_set():
            return False
        try:
            fn()
        except Exception as exc:  # any failure of an operation is the device's, as on a GPU
            self._fail(name, exc)
        return True

    def _fail(self, name: str, exc: Exception) -> None:
        where = f"operation {name!r} on stream {self.value:#x}"
        if isinstance(exc, CudaError) and exc.code is not None:
            if exc.code not in STICKY_CODES:
                self.device.record_async_error(exc)
                return
            self.device.poison_with(exc.code, f"{where} failed: {exc}", exc)
            return
        self.device.poison_with(ResultCode.ILLEGAL_ADDRESS, f"{where} raised {type(exc).__name__}: {exc}", exc)
