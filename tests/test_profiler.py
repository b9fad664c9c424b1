"""Profiling: NVTX start/end ranges across task switches, traces that emit them, and the
profiler's capture range. The simulated driver logs every range, so the tests check
that each range started is ended once, by its own id, whichever task ends it."""

from __future__ import annotations

import os
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest

import aiocuda
from aiocuda import _driver
from aiocuda._driver import _nvtx
from aiocuda.profiler import NvtxRange, nvtx_available, nvtx_range, profile, start_range
from aiocuda.stream import Stream
from aiocuda.trace import Trace

from ._control import forked_while_held


def _pairs(sim: Any) -> dict[int, list[str]]:
    """Range id -> the kinds of its events, in order (["start", "end"] when well formed)."""
    out: dict[int, list[str]] = {}
    for kind, range_id, _, _ in sim.nvtx_events():
        out.setdefault(range_id, []).append(kind)
    return out


@pytest.mark.anyio
async def test_ranges_of_interleaved_tasks_end_by_id(sim_backend: Any, anyio_backend: object) -> None:
    """Two tasks' ranges overlap and end in the other order: push/pop would mis-nest."""
    first_open, second_done = anyio.Event(), anyio.Event()

    async def first() -> None:
        with nvtx_range("first", color=0x76B900):
            first_open.set()
            await second_done.wait()  # the second task's range starts and ends meanwhile

    async def second() -> None:
        await first_open.wait()
        with nvtx_range("second"):
            await anyio.lowlevel.checkpoint()
        second_done.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(first)
        tg.start_soon(second)
    events = sim_backend.nvtx_events()
    order = [(kind, message) for kind, _, message, _ in events if kind == "start"]
    assert order == [("start", "first"), ("start", "second")]
    starts = {range_id: message for kind, range_id, message, _ in events if kind == "start"}
    ends = [starts[range_id] for kind, range_id, _, _ in events if kind == "end"]
    assert ends == ["second", "first"]
    assert all(kinds == ["start", "end"] for kinds in _pairs(sim_backend).values())
    assert events[0][3] == 0xFF76B900  # 0xRRGGBB gets an opaque alpha


def test_a_range_ends_once_from_anywhere(sim_backend: Any) -> None:
    span = start_range("request")
    assert isinstance(span, NvtxRange) and not span.ended
    span.end()
    span.end()
    assert span.ended and "ended" in repr(span)
    assert list(_pairs(sim_backend).values()) == [["start", "end"]]
    assert nvtx_available()
    with pytest.raises(ValueError, match="color"):
        start_range("bad", color=-1)


@pytest.mark.anyio
async def test_trace_spans_are_nvtx_ranges(sim_backend: Any, anyio_backend: object) -> None:
    trace = Trace(nvtx=True)
    with Stream(0) as s:
        with trace.span(s, "compute", "kernel"):
            await aiocuda.to_device(np.zeros(16), stream=s)
        with pytest.raises(RuntimeError), trace.span(s, "h2d", "failed"):
            raise RuntimeError("the block failed")
        await s
    messages = [message for kind, _, message, _ in sim_backend.nvtx_events() if kind == "start"]
    assert messages == ["compute kernel", "h2d failed"]
    assert all(kinds == ["start", "end"] for kinds in _pairs(sim_backend).values())
    assert [span.name for span in trace.spans] == ["kernel"]
    plain = Trace()
    with Stream(0) as s, plain.span(s, "compute", "quiet"):
        pass
    assert len(sim_backend.nvtx_events()) == 4  # nothing more without nvtx=True


def test_profile_starts_and_stops_the_profiler(backend: _driver.Driver) -> None:
    with profile(0):
        if backend.name == "sim":
            assert backend.profiling  # type: ignore[attr-defined]
    if backend.name == "sim":
        assert not backend.profiling  # type: ignore[attr-defined]


def test_ranges_on_the_real_driver(backend: _driver.Driver) -> None:
    """Without Nsight attached NVTX calls do nothing, with or without the library."""
    with nvtx_range("outer"):
        start_range("inner", color=0x112233).end()


def test_the_simulator_reports_profiling() -> None:
    from aiocuda.testing import use_simulator

    with use_simulator() as sim:
        with profile():
            assert sim.profiling
            with nvtx_range("typed"):
                pass
        assert not sim.profiling
        assert [event[0] for event in sim.nvtx_events()] == ["start", "end"]


def test_profile_blocks_nest(sim_backend: Any) -> None:
    """The first profile() block to end stopped the collection, while an outer block
    (or another task's) was still open."""
    with profile():
        with profile(0):
            assert sim_backend.profiling
        assert sim_backend.profiling
        with profile(1):
            pass
        assert sim_backend.profiling
    assert not sim_backend.profiling


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_forked_while_another_thread_loads_nvtx_loads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fork while another thread was inside the NVTX loader left its lock held in the
    child, where no thread would release it: a load() there waited forever. aiocuda's
    API does not call it in such a child (a forked child is refused the driver before
    it starts a range, and a range started before the fork found NVTX loaded), so this
    keeps the loader as fork-safe as NVRTC's: the child loads NVTX (or finds none) at
    once."""
    monkeypatch.setattr(_nvtx, "_loaded", [])  # (not loaded yet: load() takes the lock)
    assert forked_while_held(_nvtx._lock, _nvtx.load), "the child's load() waited for a lock no thread would release"
