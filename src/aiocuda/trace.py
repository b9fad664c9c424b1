"""Timelines of GPU work from event timings: Chrome / Perfetto traces and overlap summaries.

A :class:`Trace` collects *spans*: one operation (a copy, a stage's kernels) on one
unit of one device, with its start and end measured on the GPU by timing events
recorded around it on its stream. The executor records them when created with
``Executor(trace=True)``; :meth:`Trace.span` lets any code do the same.

Units are the parts of a GPU that work concurrently: ``h2d`` and ``d2h`` (the copy
hardware of each direction), ``compute`` (the SMs), ``p2p`` (GPU-to-GPU copies), and
``graph`` for the replays of a captured graph (one span per replay, whatever its nodes
use). Notes (:meth:`Trace.note`) record what a run decided, such as a pipeline's graph
mode falling back to launching each chunk's work. :meth:`Trace.summary` reports, per
device and unit, the busy time (the union of its spans), and compares the wall time
with the *bound*: what a perfect pipeline would take, the busiest unit's busy time plus
one fill and one drain (the mean span of every other unit). ``overlap_ratio = wall /
bound`` is 1.0 for perfect overlap; a single stream doing everything in turn approaches
``serial / bound``.

Pitfalls:

* An event recorded on a stream completes when the stream *reaches* it, so a span's
  start includes time the stream spent waiting (``stream.wait``) for another unit;
  record the start after the wait, as the executor does.
* Times of different devices come from different GPU clocks; they are aligned by the
  host time at which each device's origin event was recorded (accurate to a few
  microseconds on an idle device).
* Timing events cost a record each (about two per span); they are pooled per device, so
  steady-state tracing creates none.
* A trace keeps every span it has read until told otherwise: a long-lived server tracing
  its requests grows by one :class:`Span` per operation. Take the spans out as you go
  with :meth:`Trace.drain`, or keep only the latest with ``Trace(max_spans=N)``
  (:attr:`Trace.dropped` counts the older ones let go).

``Trace(nvtx=True)`` also emits an NVTX range per span (:mod:`aiocuda.profiler`), from
the host's start of the span to its end, named ``"unit name"``: Nsight Systems then
shows each span's host side, and projects it onto the GPU work enqueued within it.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import pathlib
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from .device import Device
from .profiler import NvtxRange
from .stream import Stream

__all__ = ["UNITS", "Span", "Trace", "TraceSummary", "UnitSummary"]

UNITS = ("h2d", "compute", "d2h", "p2p", "graph")
"""Unit names, in the order traces show them."""

# Spans of Trace.span are read when the trace is. A server may trace every request and
# read the trace rarely or never; each unread span holds two timing events, so span()
# reads what has finished itself once this many are pending, and again when their number
# has doubled since (amortised, one event query per span; the pending spans stay about
# as many as are really in flight).
_COLLECT_AT = 256


@dataclass(frozen=True, slots=True)
class Span:
    """One traced operation; times in milliseconds since the trace began."""

    device: int
    unit: str
    track: int
    """Which stream of the unit (several compute streams overlap in time)."""
    name: str
    chunk: int | None
    start_ms: float
    end_ms: float

    @property
    def duration_ms(self) -> float:
        return self.end_ms - self.start_ms


@dataclass(frozen=True, slots=True)
class UnitSummary:
    """Busy time of one unit of one device."""

    device: int
    unit: str
    busy_ms: float
    """Union of the unit's spans: time during which at least one of them ran."""
    spans: int
    mean_ms: float


@dataclass(frozen=True, slots=True)
class TraceSummary:
    """What a trace says about overlap (see the module docstring)."""

    wall_ms: float
    """From the first span's start to the last span's end, over every device."""
    bound_ms: float
    """The slowest device's busiest unit, plus one fill and drain."""
    serial_ms: float
    """Sum of every span: the time with no overlap at all, on one device."""
    overlap_ratio: float
    """``wall_ms / bound_ms``: 1.0 is perfect."""
    units: tuple[UnitSummary, ...]
    devices: tuple[int, ...]
    notes: tuple[str, ...] = ()
    """The trace's notes (:meth:`Trace.note`)."""

    def busy_ms(self, device: int, unit: str) -> float:
        """Busy time of one unit (0.0 when it did nothing)."""
        return next((e.busy_ms for e in self.units if e.device == device and e.unit == unit), 0.0)

    def table(self) -> str:
        """A plain-text table, one row per device and unit, then the totals."""
        lines = [f"{'device':>6} {'unit':<8} {'spans':>6} {'busy ms':>10} {'mean ms':>9} {'busy %':>7}"]
        for e in self.units:
            share = 100.0 * e.busy_ms / self.wall_ms if self.wall_ms else 0.0
            lines.append(f"{e.device:>6} {e.unit:<8} {e.spans:>6} {e.busy_ms:>10.3f} {e.mean_ms:>9.3f} {share:>6.1f}%")
        lines.append(
            f"wall {self.wall_ms:.3f} ms, bound {self.bound_ms:.3f} ms, overlap ratio {self.overlap_ratio:.3f} "
            f"(1.0 is perfect), serial {self.serial_ms:.3f} ms"
        )
        lines.extend(f"note: {note}" for note in self.notes)
        return "\n".join(lines)


def _union_ms(intervals: Iterable[tuple[float, float]]) -> float:
    total = 0.0
    end = float("-inf")
    for lo, hi in sorted(intervals):
        if hi <= end:
            continue
        total += hi - max(lo, end)
        end = hi
    return total


class _Clock:
    """One device's origin event and its pool of timing events."""

    __slots__ = ("closed", "device", "driver", "free", "origin", "origin_host_ms")

    def __init__(self, device: Device, stream: Stream) -> None:
        self.device = device
        self.driver = device._driver
        self.free: list[Any] = []
        self.closed = False
        self.origin = self.acquire()
        self.driver.event_record(self.origin, stream.handle)
        self.origin_host_ms = time.perf_counter() * 1e3

    def acquire(self) -> Any:
        try:
            return self.free.pop()
        except IndexError:
            self.device.make_current()
            return self.driver.event_create(True, False)

    def mark(self, stream: Stream) -> Any:
        handle = self.acquire()
        try:
            self.driver.event_record(handle, stream.handle)
        except BaseException:  # (a closed stream, say: the event goes back)
            self.release(handle)
            raise
        return handle

    def release(self, handle: Any) -> None:
        """Take back a span's event: pooled, or destroyed once the clock is closed (a span
        of work still in flight when its trace closed, given back later)."""
        if not self.closed:
            self.free.append(handle)
            return
        with contextlib.suppress(Exception):
            self.driver.event_destroy(handle)

    def close(self) -> None:
        self.closed = True
        for handle in (*self.free, self.origin):
            with contextlib.suppress(Exception):
                self.driver.event_destroy(handle)
        self.free.clear()


class _PendingSpan:
    """A span whose events may not have completed yet; :meth:`Trace._resolve` reads it."""

    __slots__ = ("chunk", "clock", "end", "name", "nvtx", "start", "track", "unit")

    def __init__(self, clock: _Clock, unit: str, track: int, name: str, chunk: int | None, start: Any) -> None:
        self.clock = clock
        self.unit = unit
        self.track = track
        self.name = name
        self.chunk = chunk
        self.start = start
        self.end: Any = None
        self.nvtx: NvtxRange | None = None


class Trace:
    """Spans of GPU work on several devices (see the module docstring).

    Args:
        nvtx: also emit an NVTX range per span (:mod:`aiocuda.profiler`).
        max_spans: keep only the latest this many spans read (None: every one); the
            summary and the export then cover those alone.

    Usage outside the executor::

        trace = Trace()
        with trace.span(stream, "compute", "my_kernel"):
            kernel.launch(..., stream=stream)  # work enqueued on the stream in the block
        await stream
        print(trace.summary().table())         # spans are read once their work is done
        trace.write_chrome("trace.json")
    """

    def __init__(self, *, nvtx: bool = False, max_spans: int | None = None) -> None:
        if max_spans is not None and (isinstance(max_spans, bool) or not isinstance(max_spans, int) or max_spans < 1):
            raise ValueError(f"max_spans must be an int >= 1 or None, got {max_spans!r}")
        self.nvtx = nvtx
        """Whether each span is also an NVTX range."""
        # Spans may be recorded and read from several threads (a metrics scraper reading
        # while requests record): reading resolves the finished pending spans, and two
        # readers at once resolved the same ones twice (duplicated spans, an event given
        # back twice, then a read of a recycled one). The lock guards the pending list and
        # the clocks; it is never held across a wait (event queries do not block).
        self._lock = threading.Lock()
        self._clocks: dict[int, _Clock] = {}
        self._spans: collections.deque[Span] = collections.deque(maxlen=max_spans)
        self._dropped = 0
        self._pending: list[_PendingSpan] = []
        self._collect_at = _COLLECT_AT
        self._host_origin_ms: float | None = None
        self._notes: list[str] = []

    # -- recording ------------------------------------------------------------------------
    def begin(self, stream: Stream) -> None:
        """Start the device's clock on ``stream`` (idempotent per device; the first span
        on a device starts it otherwise). Spans are timed from the first device's start:
        the moment ``stream`` reaches this point. Begin on an idle stream: spans of work
        that ran before a busy stream got there have negative times (they are read once
        it has)."""
        ordinal = stream.device.ordinal
        with self._lock:
            if ordinal not in self._clocks:
                clock = self._clocks[ordinal] = _Clock(stream.device, stream)
                if self._host_origin_ms is None:
                    self._host_origin_ms = clock.origin_host_ms

    @contextlib.contextmanager
    def span(self, stream: Stream, unit: str, name: str, *, chunk: int | None = None, track: int = 0) -> Iterator[None]:
        """Time the work enqueued on ``stream`` inside the ``with`` block as one span.

        ``unit`` is one of :data:`UNITS`; ``track`` tells apart streams of one unit that
        overlap in time (compute streams); ``chunk`` labels the span. The span is read
        (its events queried, without waiting) when :attr:`spans`, :meth:`summary` or
        :meth:`to_chrome` is next used after its work has completed: await the stream
        first. A trace that is rarely read also reads its finished spans itself, now and
        then, so that the timing events of unread spans do not pile up. A block left by
        an exception records nothing, nor does a block during which the trace was
        closed (:meth:`close` drops unfinished spans).
        """
        if isinstance(track, bool) or not isinstance(track, int) or track < 0:
            raise ValueError(f"track must be an int >= 0, got {track!r}")
        pending = self._start(stream, unit, name, chunk=chunk, track=track)
        try:
            yield
        except BaseException:
            self._discard(pending)
            raise
        with self._lock:
            # A span open while the trace closed: its clock's origin event is destroyed,
            # so reading it would fail, and every later read of the trace with it.
            if pending.clock.closed:
                self._discard(pending)
                return
            try:
                self._stop(pending, stream)
            except BaseException:  # (the stream closed in the block: its start event went with nothing)
                self._discard(pending)
                raise
            self._pending.append(pending)
            full = len(self._pending) >= self._collect_at
        if full:
            self._collect(reschedule=True)

    def add(self, *spans: Span) -> None:
        """Add finished spans measured elsewhere (another trace, host-side timings).

        Raises ValueError, adding none of them, for a span whose unit is not one of
        :data:`UNITS` or whose device or track is not an int >= 0.
        """
        # Checked here: a bad span once accepted made every later summary() and
        # to_chrome() fail, with errors that did not name it.
        for span in spans:
            if span.unit not in UNITS:
                raise ValueError(f"{span!r}: unknown unit {span.unit!r}; expected one of {UNITS}")
            for field in ("device", "track"):
                value = getattr(span, field)
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ValueError(f"{span!r}: {field} must be an int >= 0, got {value!r}")
        for span in spans:
            self._keep(span)

    def _keep(self, span: Span) -> None:
        spans = self._spans
        if len(spans) == spans.maxlen:
            self._dropped += 1  # (the deque lets the oldest go)
        spans.append(span)

    def note(self, text: str) -> None:
        """Record a one-line note about the run (shown by :meth:`TraceSummary.table` too)."""
        self._notes.append(text)

    @property
    def notes(self) -> tuple[str, ...]:
        """The notes recorded so far, oldest first."""
        return tuple(self._notes)

    # The executor's interface: a span that starts and ends in different places.
    def _start(self, stream: Stream, unit: str, name: str, *, chunk: int | None = None, track: int = 0) -> _PendingSpan:
        """Record the start of an operation about to be enqueued on ``stream``."""
        if unit not in UNITS:
            raise ValueError(f"unknown unit {unit!r}; expected one of {UNITS}")
        clock = self._clocks.get(stream.device.ordinal)
        if clock is None:
            self.begin(stream)
            clock = self._clocks[stream.device.ordinal]
        pending = _PendingSpan(clock, unit, track, name, chunk, clock.mark(stream))
        if self.nvtx:
            pending.nvtx = NvtxRange(f"{unit} {name}" if chunk is None else f"{unit} {name} #{chunk}")
        return pending

    @staticmethod
    def _stop(pending: _PendingSpan, stream: Stream) -> None:
        """Record the end of the operation, on the stream it was enqueued on."""
        pending.end = pending.clock.mark(stream)
        if pending.nvtx is not None:
            pending.nvtx.end()

    def _resolve(self, *pending: _PendingSpan) -> None:
        """Turn spans whose work has completed into :class:`Span` s and recycle their
        events. Call only after awaiting work enqueued after every span's end. Spans of
        a clock closed meanwhile (:meth:`close`) are dropped."""
        for p in pending:
            clock = p.clock
            if p.end is None or clock.closed:  # (a closed clock's origin is destroyed)
                self._discard(p)
                continue
            elapsed = clock.driver.event_elapsed_ms
            shift = clock.origin_host_ms - (self._host_origin_ms or clock.origin_host_ms)
            start = elapsed(clock.origin, p.start) + shift
            end = elapsed(clock.origin, p.end) + shift
            self._keep(Span(clock.device.ordinal, p.unit, p.track, p.name, p.chunk, start, end))
            self._discard(p)

    @staticmethod
    def _discard(*pending: _PendingSpan) -> None:
        """Give the events of spans that will never be resolved (cancelled, failed) back.
        Re-recording a pending event later is safe: the new record replaces the old."""
        for p in pending:
            if p.nvtx is not None:
                p.nvtx.end()
            for handle in (p.start, p.end):
                if handle is not None:
                    p.clock.release(handle)
            p.start = p.end = None

    def _collect(self, *, reschedule: bool = False) -> None:
        """Resolve the spans of :meth:`span` whose work has completed, and whose clock has
        started (its origin may sit on a stream still busy with earlier work); with
        ``reschedule``, set the pending count at which :meth:`span` next does so."""
        with self._lock:
            self._collect_locked()
            if reschedule:
                self._collect_at = max(_COLLECT_AT, 2 * len(self._pending))

    def _collect_locked(self) -> None:
        if self._pending:
            query = self._pending[0].clock.driver.event_query
            # One pass: a list of the done, tested with `in`, made this quadratic (20 000
            # finished spans took 3.4 s to read).
            done: list[_PendingSpan] = []
            waiting: list[_PendingSpan] = []
            for p in self._pending:
                (done if query(p.end) and query(p.clock.origin) else waiting).append(p)
            if done:
                self._pending = waiting
                self._resolve(*done)

    def close(self) -> None:
        """Destroy the timing events (the spans read so far stay readable; spans whose
        work has not completed are dropped)."""
        with self._lock:
            self._collect_locked()
            # Their events go back to their clocks' pools, to be destroyed with them
            # (cuEventDestroy of an event not reached yet releases it once it is).
            self._discard(*self._pending)
            self._pending.clear()
            for clock in self._clocks.values():
                clock.close()
            self._clocks.clear()

    def clear(self) -> None:
        """Forget the spans collected so far (clocks keep running)."""
        self._spans.clear()

    def drain(self) -> tuple[Span, ...]:
        """The spans read so far, oldest first, forgotten by the trace (clocks keep
        running, notes stay): call it now and then in a long run to ship the spans
        elsewhere and keep the trace's memory flat. Spans whose work has not finished
        yet come with a later call."""
        self._collect()
        # popleft, one span at a time: a span the executor adds meanwhile (from the
        # loop's thread) is neither lost nor returned twice.
        out: list[Span] = []
        popleft = self._spans.popleft
        with contextlib.suppress(IndexError):
            while True:
                out.append(popleft())
        return tuple(out)

    @property
    def dropped(self) -> int:
        """How many spans ``max_spans`` has let go, oldest first (0 without a cap)."""
        return self._dropped

    # -- reading --------------------------------------------------------------------------
    @property
    def spans(self) -> tuple[Span, ...]:
        """The spans read so far, in the order they were read."""
        self._collect()
        return tuple(self._spans)

    def summary(self) -> TraceSummary:
        """Busy time per device and unit, wall time, bound and overlap ratio."""
        self._collect()
        spans = self._spans
        if not spans:
            return TraceSummary(0.0, 0.0, 0.0, 0.0, (), (), tuple(self._notes))
        units: list[UnitSummary] = []
        bound = 0.0
        devices = sorted({s.device for s in spans})
        for device in devices:
            mine = [s for s in spans if s.device == device]
            rows = []
            for unit in UNITS:
                own = [s for s in mine if s.unit == unit]
                if own:
                    busy = _union_ms((s.start_ms, s.end_ms) for s in own)
                    mean = sum(s.duration_ms for s in own) / len(own)
                    rows.append(UnitSummary(device, unit, busy, len(own), mean))
            busiest = max(rows, key=lambda e: e.busy_ms)
            fill_drain = sum(e.mean_ms for e in rows if e is not busiest)
            bound = max(bound, busiest.busy_ms + fill_drain)
            units.extend(rows)
        wall = max(s.end_ms for s in spans) - min(s.start_ms for s in spans)
        serial = sum(s.duration_ms for s in spans)
        ratio = wall / bound if bound > 0 else 0.0
        return TraceSummary(wall, bound, serial, ratio, tuple(units), tuple(devices), tuple(self._notes))

    def to_chrome(self) -> dict[str, Any]:
        """The trace in Chrome's trace-event format (JSON-ready; Perfetto reads it):
        one complete event (``"ph": "X"``, microseconds) per span, one process per
        device (``pid`` = ordinal + 1, named ``"GPU <ordinal>"``), one thread per unit
        track, named by metadata events. Times start at 0: spans that began before the
        trace did (see :meth:`begin`) move everything later by as much."""
        self._collect()
        events: list[dict[str, Any]] = []
        tracks: set[tuple[int, str, int]] = set()
        # Perfetto's importer rejects negative timestamps, and treats pid 0 as the
        # kernel's idle process (its maintainers: "avoid using pid = 0", perfetto#394;
        # "negative timestamps will be rejected", perfetto#2048).
        origin_ms = min((s.start_ms for s in self._spans), default=0.0)
        shift_ms = -origin_ms if origin_ms < 0 else 0.0
        for s in self._spans:
            tid = _tid(s.unit, s.track)
            tracks.add((s.device, s.unit, s.track))
            args: dict[str, Any] = {"unit": s.unit}
            if s.chunk is not None:
                args["chunk"] = s.chunk
            events.append(
                {
                    "name": s.name,
                    "cat": s.unit,
                    "ph": "X",
                    "ts": round((s.start_ms + shift_ms) * 1e3, 3),
                    "dur": round(s.duration_ms * 1e3, 3),
                    "pid": s.device + 1,
                    "tid": tid,
                    "args": args,
                }
            )
        for device in sorted({d for d, _, _ in tracks}):
            events.append(
                {"name": "process_name", "ph": "M", "pid": device + 1, "tid": 0, "args": {"name": f"GPU {device}"}}
            )
        for device, unit, track in sorted(tracks):
            label = unit if track == 0 else f"{unit} {track}"
            tid = _tid(unit, track)
            events.append({"name": "thread_name", "ph": "M", "pid": device + 1, "tid": tid, "args": {"name": label}})
            events.append(
                {
                    "name": "thread_sort_index",
                    "ph": "M",
                    "pid": device + 1,
                    "tid": tid,
                    "args": {"sort_index": _sort_index(unit, track)},
                }
            )
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def write_chrome(self, path: str | pathlib.Path) -> pathlib.Path:
        """Write :meth:`to_chrome` as JSON (open it in ui.perfetto.dev or chrome://tracing).
        The file is replaced whole: a write that fails (a full disk, a missing or read-only
        directory) raises OSError naming ``path`` and leaves what was there."""
        target = pathlib.Path(path)
        text = json.dumps(self.to_chrome())
        partial = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.partial")
        try:
            partial.write_text(text)
            os.replace(partial, target)
        except OSError as exc:
            # The error named the hidden temporary file, which the caller never heard of.
            exc.filename, exc.filename2 = str(target), None
            raise
        finally:
            partial.unlink(missing_ok=True)
        return target

    def __repr__(self) -> str:
        return f"<Trace spans={len(self._spans)} devices={sorted(self._clocks)}>"


def _tid(unit: str, track: int) -> int:
    """Track ids, one per unit and track: h2d 1, compute 2, d2h 3, p2p 4, graph 5, and
    for track t the unit's id + 10 t (compute 12, 22, ...; graph 15, 25, ...)."""
    # (Once 10 x unit + track, which gave h2d track 11 and compute track 1 one id: 21.)
    return UNITS.index(unit) + 1 + 10 * track


def _sort_index(unit: str, track: int) -> int:
    """Perfetto's thread order: by unit, then track."""
    return 1000 * (UNITS.index(unit) + 1) + track
