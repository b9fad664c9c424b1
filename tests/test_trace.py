"""Traces: span bookkeeping, the overlap summary's arithmetic, Chrome JSON, executor traces."""

from __future__ import annotations

import functools
import gc
import json
import pathlib
import threading
import time
from typing import Any

import anyio
import numpy as np
import pytest

from aiocuda._cli.workload import ScaleStage, scale_reference
from aiocuda._memory import offloop as _offloop
from aiocuda.executor import Executor
from aiocuda.host import pinned_empty
from aiocuda.memory import MemoryPool
from aiocuda.stream import Stream
from aiocuda.trace import UNITS, Span, Trace, TraceSummary

from ._workload import Gate

LATENCY_S = 0.004


def test_summary_arithmetic_on_known_spans() -> None:
    trace = Trace()
    # Device 0: h2d 0-2, 2-4; compute 2-5, 5-8 (the busiest: 6 ms); d2h 5-6, 8-9.
    # Device 1: one h2d span that overlaps itself on two tracks: union 1-4 = 3 ms.
    trace.add(
        Span(0, "h2d", 0, "h2d", 0, 0.0, 2.0),
        Span(0, "h2d", 0, "h2d", 1, 2.0, 4.0),
        Span(0, "compute", 0, "k", 0, 2.0, 5.0),
        Span(0, "compute", 0, "k", 1, 5.0, 8.0),
        Span(0, "d2h", 0, "d2h", 0, 5.0, 6.0),
        Span(0, "d2h", 0, "d2h", 1, 8.0, 9.0),
        Span(1, "compute", 0, "k", 2, 1.0, 3.0),
        Span(1, "compute", 1, "k", 3, 2.0, 4.0),
    )
    s = trace.summary()
    assert s.devices == (0, 1)
    assert s.busy_ms(0, "h2d") == pytest.approx(4.0)
    assert s.busy_ms(0, "compute") == pytest.approx(6.0)
    assert s.busy_ms(0, "d2h") == pytest.approx(2.0)
    assert s.busy_ms(1, "compute") == pytest.approx(3.0)
    assert s.busy_ms(1, "p2p") == 0.0
    assert s.wall_ms == pytest.approx(9.0)
    assert s.serial_ms == pytest.approx(2 + 2 + 3 + 3 + 1 + 1 + 2 + 2)
    # bound: device 0's compute (6) + mean h2d (2) + mean d2h (1) = 9; device 1: 3.
    assert s.bound_ms == pytest.approx(9.0)
    assert s.overlap_ratio == pytest.approx(1.0)
    text = s.table()
    assert "overlap ratio 1.000" in text and "compute" in text


def test_empty_trace_summarises_to_zero() -> None:
    s = Trace().summary()
    assert (s.wall_ms, s.bound_ms, s.overlap_ratio, s.units) == (0.0, 0.0, 0.0, ())


def test_chrome_json_is_valid_trace_event_format(tmp_path: pathlib.Path) -> None:
    trace = Trace()
    trace.add(Span(0, "h2d", 0, "h2d", 0, 0.5, 1.5), Span(1, "compute", 1, "scale", 3, 1.0, 2.25))
    path = trace.write_chrome(tmp_path / "t.json")
    doc = json.loads(path.read_text())
    complete = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == 2
    for e in complete:
        assert {"name", "ph", "ts", "dur", "pid", "tid"} <= set(e)
        assert isinstance(e["ts"], float | int) and e["dur"] >= 0
    first = next(e for e in complete if e["pid"] == 1)  # GPU 0: Perfetto treats pid 0 as the idle process
    assert (first["ts"], first["dur"], first["args"]) == (500.0, 1000.0, {"unit": "h2d", "chunk": 0})
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert names[(1, first["tid"])] == "h2d"
    assert "compute 1" in names.values()
    assert {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"} == {"GPU 0", "GPU 1"}
    assert all(e["pid"] > 0 for e in doc["traceEvents"])


def test_chrome_json_has_no_negative_timestamps() -> None:
    """Spans of work that ran before the trace began have negative times; Perfetto's
    importer rejects negative timestamps, so the export starts at 0."""
    trace = Trace()
    trace.add(Span(0, "compute", 0, "early", None, -2.0, -1.0), Span(0, "compute", 0, "late", None, 1.0, 3.0))
    complete = {e["name"]: e for e in trace.to_chrome()["traceEvents"] if e["ph"] == "X"}
    assert (complete["early"]["ts"], complete["early"]["dur"]) == (0.0, 1000.0)
    assert (complete["late"]["ts"], complete["late"]["dur"]) == (3000.0, 2000.0)


def test_unknown_unit_is_refused(sim_backend: Any) -> None:
    with Stream(0) as s, pytest.raises(ValueError, match="unknown unit"), Trace().span(s, "tensor", "x"):
        pass


def test_spans_recorded_by_hand(backend: Any) -> None:
    trace = Trace()
    with Stream(0) as s:
        buf = MemoryPool.for_device(s.device).allocate(1 << 16, s)
        with trace.span(s, "compute", "memset", chunk=7):
            s.device._driver.memset_d8_async(buf.ptr, 3, buf.size, s.handle)
        with pytest.raises(RuntimeError), trace.span(s, "compute", "failed"):
            raise RuntimeError  # a block that fails records nothing
        buf.free()
        s.synchronize()
        (span,) = trace.spans
        trace.close()
    assert trace.spans == (span,)
    assert (span.device, span.unit, span.name, span.chunk) == (0, "compute", "memset", 7)
    assert 0.0 <= span.start_ms <= span.end_ms


def test_a_span_is_read_once_its_work_is_done(sim_backend: Any) -> None:
    trace = Trace()
    with Stream(0) as s:
        sim_backend.pause(s.handle)
        with trace.span(s, "compute", "waiting"):
            pass
        assert trace.spans == () and trace.summary().wall_ms == 0.0  # not done: not read yet
        sim_backend.resume(s.handle)
        s.synchronize()
        assert [sp.name for sp in trace.spans] == ["waiting"]
        trace.close()


def test_spans_done_before_their_clock_started_are_read_later_not_lost(sim_backend: Any) -> None:
    """The clock's origin sits on the first span's stream: while that stream was busy, a
    span done elsewhere raised CUDA_ERROR_NOT_READY when read, and was dropped."""
    trace = Trace()
    with Stream(0) as busy, Stream(0) as other:
        sim_backend.pause(busy.handle)
        with trace.span(busy, "h2d", "upload"):
            pass
        with trace.span(other, "compute", "kernel"):
            pass
        other.synchronize()
        assert trace.spans == ()  # not readable yet, and not an error
        sim_backend.resume(busy.handle)
        busy.synchronize()
        assert sorted(sp.name for sp in trace.spans) == ["kernel", "upload"]
        trace.close()


async def gated_run(
    ex: Executor, stage: Any, chunks: np.ndarray, out: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> TraceSummary:
    """Run every chunk through ``ex`` with its upload stream held until all of their work
    is enqueued, and summarise the trace of that run (``ex`` must admit every chunk at
    once: ``chunks_per_device`` at least their number).

    The executor enqueues a chunk's steps without waiting on the host in between (the
    order is kept by events between its streams), so the GPU then runs a schedule the
    host's speed no longer shapes: the overlap measured is that of the executor's stream
    order, whatever the load on the CPU. Were the executor to wait on the host between a
    chunk's steps, its chunks could not all be enqueued behind the held uploads: that
    fails here, after 30 s.
    """
    trace = ex.trace
    assert trace is not None
    trace.clear()
    enqueued = 0
    all_enqueued = anyio.Event()
    stop = Trace._stop

    def counting_stop(pending: Any, stream: Stream) -> None:
        nonlocal enqueued
        stop(pending, stream)
        if pending.unit == "d2h":
            enqueued += 1
            if enqueued == len(chunks):
                all_enqueued.set()

    with monkeypatch.context() as patch, Gate(ex.device_streams[0].h2d) as gate:
        patch.setattr(Trace, "_stop", staticmethod(counting_stop))
        async with anyio.create_task_group() as tg:
            run = functools.partial(ex.run, stage, chunks, output=lambda i, _: out[i], in_flight=len(chunks))
            tg.start_soon(run)
            with anyio.move_on_after(30) as waited:
                await all_enqueued.wait()
            assert not waited.cancelled_caught, (
                f"{enqueued} of {len(chunks)} chunks enqueued their work while the uploads were held: "
                "the executor waits on the host between a chunk's steps"
            )
            gate.open()
    return trace.summary()


@pytest.mark.anyio
async def test_executor_trace_shows_overlap(
    sim_backend: Any, anyio_backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    for op in ("memcpy_htod_async", "launch_kernel", "memcpy_dtoh_async"):
        sim_backend.set_latency(op, LATENCY_S)
    chunks = pinned_empty((8, 256), np.float32)
    out = pinned_empty((8, 256), np.float32)
    async with Executor([0], trace=True, chunks_per_device=len(chunks)) as ex:
        s = await gated_run(ex, ScaleStage(10), chunks, out, monkeypatch)
        assert ex.trace is not None
        spans = ex.trace.spans
    assert sorted(sp.chunk or 0 for sp in spans if sp.unit == "compute") == list(range(8))
    step_ms = LATENCY_S * 1e3
    for unit in ("h2d", "compute", "d2h"):
        assert s.busy_ms(0, unit) >= 8 * step_ms * 0.9
    # Each span starts when its stream gets to it: a chunk's steps never overlap each other.
    by_chunk: dict[int, dict[str, Span]] = {}
    for sp in spans:
        assert sp.chunk is not None
        by_chunk.setdefault(sp.chunk, {})[sp.unit] = sp
    for steps in by_chunk.values():
        assert steps["h2d"].end_ms <= steps["compute"].start_ms + 0.5
        assert steps["compute"].end_ms <= steps["d2h"].start_ms + 0.5
    # Units overlapped: in turn, the 24 steps take 2.4 times the bound of 10 steps.
    tables = s.table()
    assert s.bound_ms >= 8 * step_ms + 2 * step_ms * 0.9, tables
    assert s.overlap_ratio < 1.3, tables
    assert s.wall_ms < 0.7 * s.serial_ms, tables


@pytest.mark.anyio
async def test_executor_trace_on_every_backend(backend: Any, anyio_backend: Any) -> None:
    chunks = pinned_empty((6, 1 << 18), np.float32)
    chunks[:] = 1.0
    async with Executor(trace=True) as ex:
        await ex.run(ScaleStage(100), chunks)
        assert ex.trace is not None
        spans = ex.trace.spans
        s = ex.trace.summary()
    assert len(spans) == 3 * 6
    by_chunk: dict[int, dict[str, Span]] = {}
    for sp in spans:
        assert sp.duration_ms >= 0 and sp.chunk is not None
        by_chunk.setdefault(sp.chunk, {})[sp.unit] = sp
    for steps in by_chunk.values():  # GPU-side order of each chunk's steps
        assert steps["h2d"].end_ms <= steps["compute"].start_ms + 0.5
        assert steps["compute"].end_ms <= steps["d2h"].start_ms + 0.5
    assert s.wall_ms > 0 and s.bound_ms > 0 and s.serial_ms >= s.bound_ms * 0.5
    assert set(s.devices) <= set(range(len(ex.devices)))


@pytest.mark.anyio
async def test_executor_without_trace_has_none(sim_backend: Any, anyio_backend: Any) -> None:
    async with Executor() as ex:
        assert ex.trace is None


@pytest.mark.anyio
async def test_gpu_pipeline_overlaps_its_units(
    cuda_backend: Any, anyio_backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the GPU, with the uploads held until every chunk's work is enqueued (see
    :func:`gated_run`): each step of a 32 MiB chunk takes ~0.6 ms, and perfect overlap
    takes 12 steps plus one fill and drain where the steps in turn take 36. How fast the
    host feeds the GPU is the pipeline benchmark's to measure, not this test's."""
    chunks = pinned_empty((12, 8 << 20), np.float32)
    chunks[:] = 1.0
    out = pinned_empty(chunks.shape, np.float32)
    async with Executor([0], trace=True, chunks_per_device=len(chunks)) as ex:
        stage = ScaleStage(800)
        await ex.run(stage, chunks, output=lambda i, _: out[i])  # warm-up: pool, module
        # Garbage of earlier tests (compiled modules, above all) is unloaded off the loop,
        # but cuModuleUnload waits for an idle device and may hold a driver lock our
        # copies need meanwhile (cuMemFreeHost does): let that happen before the measured
        # run, not in the middle of it.
        gc.collect()
        assert _offloop.drain(timeout=30)
        s = await gated_run(ex, stage, chunks, out, monkeypatch)
    np.testing.assert_allclose(out, scale_reference(chunks, 800), rtol=1e-3)
    tables = s.table()
    assert s.busy_ms(0, "h2d") > 0 and s.busy_ms(0, "d2h") > 0 and s.busy_ms(0, "compute") > 0, tables
    # A schedule that lost one unit's overlap (uploads and downloads in turn, say)
    # takes about twice the bound; the copies' slowdown when both directions run is
    # inside the busy times the bound is built from.
    assert s.overlap_ratio < 1.2, tables
    # (the busiest unit bounds the wall time from below: 0.52 of serial on an H100)
    assert s.wall_ms < 0.8 * s.serial_ms, tables


def test_unread_spans_do_not_pile_up_timing_events(sim_backend: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that traces each request and never reads the trace kept every span
    pending, two timing events each (40 000 events for 20 000 spans), and the first read
    then took seconds (a quadratic pass over them)."""
    created = 0
    create = sim_backend.event_create

    def counting(*args: Any) -> Any:
        nonlocal created
        created += 1
        return create(*args)

    monkeypatch.setattr(sim_backend, "event_create", counting)
    trace = Trace()
    with Stream(0) as s:
        for n in range(5000):
            with trace.span(s, "compute", "request"):
                pass
            if n % 50 == 49:
                s.synchronize()  # the requests' work finishes; nobody reads the trace
        s.synchronize()
        assert created < 2000, f"{created} timing events for 5000 spans of which at most 50 were in flight"
        assert len(trace.spans) == 5000
        trace.close()


def test_two_threads_reading_a_trace_read_each_span_once(sim_backend: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two readers at once (a metrics scraper and a request handler) resolved the same
    finished spans twice: duplicated spans, and then a read of an event already recycled
    (CUDA_ERROR_INVALID_HANDLE)."""
    inside = threading.Event()
    query = sim_backend.event_query

    def slow_first_query(event: Any) -> bool:
        if not inside.is_set():
            inside.set()
            time.sleep(0.2)  # the second reader comes in now
        return bool(query(event))

    monkeypatch.setattr(sim_backend, "event_query", slow_first_query)
    trace = Trace()
    errors: list[BaseException] = []

    def read() -> None:
        try:
            assert len(trace.spans) == 10
        except BaseException as exc:
            errors.append(exc)

    with Stream(0) as s:
        for _ in range(10):
            with trace.span(s, "compute", "request"):
                pass
        s.synchronize()
        first = threading.Thread(target=read)
        first.start()
        assert inside.wait(5)
        read()
        first.join()
        assert errors == []
        assert len(trace.spans) == 10
        trace.close()


def test_a_long_run_can_drain_its_trace_or_keep_only_the_latest_spans(sim_backend: Any) -> None:
    """A trace kept every span it read, with no way to take them out or to cap them: a
    long-lived server tracing its requests grew without bound."""
    trace = Trace()
    latest = Trace(max_spans=3)
    with Stream(0) as s:
        for n in range(5):
            with trace.span(s, "compute", f"r{n}"), latest.span(s, "compute", f"r{n}"):
                pass
        s.synchronize()
        assert [sp.name for sp in trace.drain()] == ["r0", "r1", "r2", "r3", "r4"]
        assert trace.spans == () and trace.drain() == ()
        with trace.span(s, "compute", "r5"):
            pass
        s.synchronize()
        assert [sp.name for sp in trace.drain()] == ["r5"]
        assert [sp.name for sp in latest.spans] == ["r2", "r3", "r4"] and latest.dropped == 2
        assert trace.dropped == 0
        trace.close()
        latest.close()
    with pytest.raises(ValueError, match="max_spans"):
        Trace(max_spans=0)


def test_close_destroys_the_events_of_unfinished_spans(sim_backend: Any) -> None:
    """close() dropped the spans whose work had not finished with their timing events
    still alive: two leaked events per span."""
    with Stream(0) as s:
        before = len(sim_backend._events)
        trace = Trace()
        sim_backend.pause(s.handle)
        for _ in range(10):
            with trace.span(s, "compute", "unfinished"):
                pass
        trace.close()
        assert len(sim_backend._events) == before
        sim_backend.resume(s.handle)
        s.synchronize()
        assert trace.spans == ()


def test_each_unit_track_is_its_own_chrome_thread(sim_backend: Any) -> None:
    """Thread ids were 10 x unit + track: h2d track 11 and compute track 1 were one
    thread (21), their spans drawn on one row under one of the two names."""
    trace = Trace()
    spans = [Span(0, unit, track, f"{unit} {track}", None, 0.0, 1.0) for unit in UNITS for track in range(25)]
    trace.add(*spans)
    events = trace.to_chrome()["traceEvents"]
    tids = {e["name"]: e["tid"] for e in events if e["ph"] == "X"}
    assert len(set(tids.values())) == len(spans)
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names[tids["h2d 11"]] == "h2d 11" and names[tids["compute 1"]] == "compute 1"
    order = sorted((e["args"]["sort_index"], names[e["tid"]]) for e in events if e["name"] == "thread_sort_index")
    assert [name for _, name in order[:3]] == ["h2d", "h2d 1", "h2d 2"]
    with Stream(0) as s, pytest.raises(ValueError, match="track"), trace.span(s, "compute", "k", track=-1):
        pass


def test_a_failed_chrome_write_leaves_the_previous_file(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """write_chrome replaces the file whole: a write that fails midway (a full disk, here
    an OSError from write_text) leaves the previous trace as it was, and no partial file."""
    path = tmp_path / "t.json"
    path.write_text('{"traceEvents": []}')
    trace = Trace()
    trace.add(Span(0, "h2d", 0, "h2d", 0, 0.5, 1.5))

    def full_disk(self: pathlib.Path, text: str) -> int:
        with self.open("w") as f:
            f.write(text[: len(text) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pathlib.Path, "write_text", full_disk)
    with pytest.raises(OSError, match="No space"):
        trace.write_chrome(path)
    monkeypatch.undo()
    assert json.loads(path.read_text()) == {"traceEvents": []}
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]
    assert json.loads(trace.write_chrome(path).read_text())["traceEvents"]


def test_a_span_given_back_after_its_trace_closed_destroys_its_events(sim_backend: Any) -> None:
    """A chunk's spans are its own until it ends: one still in flight when its executor's
    trace closed gave its events back to a closed clock's pool, which nothing destroys."""
    with Stream(0) as s:
        before = len(sim_backend._events)
        trace = Trace()
        pending = trace._start(s, "compute", "in flight")
        Trace._stop(pending, s)
        trace.close()
        Trace._discard(pending)  # (the chunk, cancelled after the close)
        assert len(sim_backend._events) == before


def test_a_span_open_when_its_trace_closed_is_dropped_and_the_trace_stays_readable(sim_backend: Any) -> None:
    """A span whose block ended after its trace closed was kept with the closed clock's
    destroyed origin: every later read of the trace failed (invalid handle), and the
    resolving of an executor's span in flight at the close failed alike."""
    with Stream(0) as s:
        before = len(sim_backend._events)
        trace = Trace()
        in_flight = trace._start(s, "compute", "in flight")
        Trace._stop(in_flight, s)
        with trace.span(s, "compute", "open at the close"):
            trace.close()
        s.synchronize()
        trace._resolve(in_flight)  # (the executor's chunk, done after the close)
        assert trace.spans == ()
        assert len(sim_backend._events) == before
        with trace.span(s, "compute", "after"):  # a closed trace used again starts a new clock
            pass
        s.synchronize()
        assert [sp.name for sp in trace.spans] == ["after"]
        trace.close()
        assert len(sim_backend._events) == before


def test_a_span_whose_stream_closed_in_its_block_gives_its_event_back(sim_backend: Any) -> None:
    """The end's record on the closed stream raises (ArgumentError), and the span's start
    event was kept by nobody, not even close()."""
    from aiocuda.errors import ArgumentError

    def events_left(traced: bool) -> int:
        before = len(sim_backend._events)
        trace = Trace()
        with Stream(0) as keeper:
            trace.begin(keeper)
            s = Stream(0)
            if traced:
                with pytest.raises(ArgumentError, match="closed"), trace.span(s, "compute", "closed inside"):
                    s.close()
            else:
                s.close()
            s.synchronize()
            trace.close()
        return len(sim_backend._events) - before

    events_left(traced=False)  # (the first fills the pools)
    assert events_left(traced=True) == events_left(traced=False)


@pytest.mark.parametrize(
    ("bad", "words"),
    [
        (Span(0, "kernel", 0, "k", None, 0.0, 1.0), "unknown unit 'kernel'"),
        (Span(-1, "h2d", 0, "h2d", None, 0.0, 1.0), "device must be an int >= 0"),
        (Span(0, "h2d", -2, "h2d", None, 0.0, 1.0), "track must be an int >= 0"),
    ],
)
def test_add_refuses_a_span_the_trace_cannot_show(bad: Span, words: str) -> None:
    """add() took any span: one of an unknown unit made every later summary() fail
    ("max() arg is an empty sequence") and to_chrome() too ("x not in tuple")."""
    trace = Trace()
    good = Span(0, "h2d", 0, "h2d", None, 0.0, 1.0)
    with pytest.raises(ValueError, match=words):
        trace.add(good, bad)
    assert trace.spans == ()
    trace.add(good)
    assert trace.summary().busy_ms(0, "h2d") == 1.0 and trace.to_chrome()["traceEvents"]


def test_a_chrome_write_that_fails_names_the_file_asked_for(tmp_path: pathlib.Path) -> None:
    """The OSError of a write to a missing directory named the hidden temporary file
    (``.t.json.<pid>.<thread>.partial``), not the path given."""
    target = tmp_path / "missing" / "t.json"
    with pytest.raises(FileNotFoundError) as failed:
        Trace().write_chrome(target)
    assert failed.value.filename == str(target) and "partial" not in str(failed.value)
    with pytest.raises(IsADirectoryError) as failed:
        Trace().write_chrome(tmp_path)
    assert failed.value.filename == str(tmp_path) and "partial" not in str(failed.value)
    assert list(tmp_path.iterdir()) == []
