"""The simulated driver's graphs: capture, joins across streams, replay, updates and the
errors of what cannot be captured.

These test the sim's seam calls directly; ``tests/test_graph.py`` tests aiocuda's graphs
above the seam on both backends.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import numpy as np
import pytest

from aiocuda._driver import sim_image
from aiocuda._driver._doorbell import SemaphoreDoorbell
from aiocuda._driver._launch import LaunchConfig
from aiocuda._driver.sim import SimDriver
from aiocuda._kernels.signature import parse_signature
from aiocuda.errors import (
    ArgumentError,
    CaptureError,
    ContextPoisonedError,
    CudaError,
    GraphUpdateError,
    ResultCode,
)

from ._helpers import recorder


def _stream(sim: SimDriver) -> Any:
    return sim.stream_create(non_blocking=True, priority=0)


def _capture(sim: SimDriver, stream: Any, *ops: Any, mode: str = "thread_local") -> Any:
    sim.stream_begin_capture(stream, mode)
    for op in ops:
        sim.enqueue(stream, op)
    return sim.stream_end_capture(stream)


# -- capture and replay ----------------------------------------------------------------------
def test_capture_records_and_replay_runs_in_order(sim: SimDriver) -> None:
    stream = _stream(sim)
    log, op = recorder()
    graph = _capture(sim, stream, op("a"), op("b"), op("c"))
    assert log == []  # captured operations do not run
    assert [n.kind for n in sim.graph_nodes(graph)] == ["op", "op", "op"]
    assert [n.dependencies for n in sim.graph_nodes(graph)] == [(), (0,), (1,)]
    gexec = sim.graph_instantiate(graph)
    for _ in range(3):
        sim.graph_launch(gexec, stream)
    sim.stream_synchronize(stream)
    assert log == ["a", "b", "c"] * 3


def test_replays_of_one_executable_graph_run_one_after_another(sim: SimDriver) -> None:
    first, second = _stream(sim), _stream(sim)
    log, op = recorder()
    gexec = sim.graph_instantiate(_capture(sim, first, op("x")))
    sim.pause(first)
    sim.graph_launch(gexec, first)
    sim.graph_launch(gexec, second)  # ordered behind the replay held up on `first`
    sim.enqueue(second, op("after"))
    assert log == []
    sim.resume(first)
    sim.stream_synchronize(second)
    assert log == ["x", "x", "after"]


def test_a_graph_launch_latency_slows_a_replay_once(sim: SimDriver) -> None:
    """``set_latency("graph_launch", s)`` makes a replay as a whole take ``s``; it was
    applied twice, before the replay's nodes and again to its closing operation."""
    stream = _stream(sim)
    log, op = recorder()
    gexec = sim.graph_instantiate(_capture(sim, stream, op("x")))
    start, end = (sim.event_create(timing=True, blocking_sync=False) for _ in range(2))
    sim.set_latency("graph_launch", 0.25)
    sim.event_record(start, stream)
    sim.graph_launch(gexec, stream)
    sim.event_record(end, stream)
    sim.stream_synchronize(stream)
    assert log == ["x"]
    assert 250 <= sim.event_elapsed_ms(start, end) < 400  # twice: 500


def test_doorbell_captured_rings_on_every_replay(sim: SimDriver) -> None:
    stream = _stream(sim)
    bell = SemaphoreDoorbell()
    sim.stream_begin_capture(stream, "thread_local")
    sim.launch_doorbell(stream, bell)
    gexec = sim.graph_instantiate(sim.stream_end_capture(stream))
    assert [n.kind for n in sim.graph_nodes(gexec.graph)] == ["host"]
    for _ in range(3):
        sim.graph_launch(gexec, stream)
        sim.stream_synchronize(stream)
        assert bell.wait(0.0)


def test_memory_copies_kernels_and_graph_allocations(sim: SimDriver) -> None:
    sim.register_kernel("twice", lambda launch, x, n: x.__setitem__(slice(0, int(n)), x[: int(n)] * 2))
    try:
        module, _ = sim.module_load_data(sim_image(["twice"]))
        func = sim.module_get_function(module, "twice")
        stream = _stream(sim)
        pool = sim.mempool_default(sim.device_get(0))
        n = 16
        host_in = sim.mem_host_alloc(4 * n)
        host_out = sim.mem_host_alloc(4 * n)
        src = np.ctypeslib.as_array((ctypes.c_float * n).from_address(host_in))
        dst = np.ctypeslib.as_array((ctypes.c_float * n).from_address(host_out))
        used = sim.mem_get_info()[0]
        sim.stream_begin_capture(stream, "thread_local")
        scratch = sim.mem_alloc_async(4 * n, pool, stream)
        assert sim.mem_get_info()[0] == used - 4 * n  # the graph's memory exists from now on
        sim.memcpy_htod_async(scratch, host_in, 4 * n, stream)
        sim.launch_kernel(func, LaunchConfig(1, n), stream, _Params((scratch, n), "float*, int"))
        sim.memcpy_dtoh_async(host_out, scratch, 4 * n, stream)
        sim.mem_free_async(scratch, stream)
        graph = sim.stream_end_capture(stream)
        kinds = [node.kind for node in sim.graph_nodes(graph)]
        assert kinds == ["mem_alloc", "memcpy", "kernel", "memcpy", "mem_free"]
        copy_in = sim.graph_nodes(graph)[1]
        assert (copy_in.direction, copy_in.dst, copy_in.src, copy_in.size) == ("htod", scratch, host_in, 4 * n)
        gexec = sim.graph_instantiate(graph)
        for k in range(3):
            src[:] = np.arange(n) + k
            sim.graph_launch(gexec, stream)
            sim.stream_synchronize(stream)
            np.testing.assert_array_equal(dst, (np.arange(n) + k) * 2)
        with pytest.raises(ArgumentError, match="one executable graph at a time"):
            sim.graph_instantiate(graph)  # it allocates memory
        sim.graph_exec_destroy(gexec)
        sim.graph_destroy(graph)
        assert sim.mem_get_info()[0] == used
    finally:
        sim.register_kernel("twice", None)


class _Params:
    """Kernel arguments as the kernel layer packs them (values and their signature)."""

    def __init__(self, values: tuple[Any, ...], signature: str) -> None:
        self.values = values
        self.signature = parse_signature(signature)
        self.address = 0


def test_node_updates_affect_later_replays_only(sim: SimDriver) -> None:
    seen: list[int] = []
    sim.register_kernel("record", lambda launch, value: seen.append(int(value)))
    try:
        func = sim.module_get_function(sim.module_load_data(sim_image(["record"]))[0], "record")
        stream = _stream(sim)
        sim.stream_begin_capture(stream, "thread_local")
        sim.launch_kernel(func, LaunchConfig(1, 1), stream, _Params((1,), "int"))
        graph = sim.stream_end_capture(stream)
        node = sim.graph_nodes(graph)[0]
        assert sim.graph_kernel_node_arguments(node, "i") == (1,)
        gexec = sim.graph_instantiate(graph)
        sim.pause(stream)
        sim.graph_launch(gexec, stream)
        sim.graph_exec_kernel_node_set_params(gexec, node, func, LaunchConfig(1, 1), _Params((2,), "int"))
        sim.graph_launch(gexec, stream)
        sim.resume(stream)
        sim.stream_synchronize(stream)
        assert seen == [1, 2]
        assert sim.graph_kernel_node_arguments(node, "i") == (1,)  # the graph itself is unchanged
    finally:
        sim.register_kernel("record", None)


def test_whole_graph_update_checks_the_topology(sim: SimDriver) -> None:
    stream = _stream(sim)
    log, op = recorder()
    gexec = sim.graph_instantiate(_capture(sim, stream, op("a"), op("b")))
    sim.graph_exec_update(gexec, _capture(sim, stream, op("c"), op("d")))
    sim.graph_launch(gexec, stream)
    sim.stream_synchronize(stream)
    assert log == ["c", "d"]
    with pytest.raises(GraphUpdateError, match="1 nodes instead of 2"):
        sim.graph_exec_update(gexec, _capture(sim, stream, op("e")))


# -- forks and joins ---------------------------------------------------------------------------
def test_streams_join_a_capture_through_events(sim: SimDriver) -> None:
    origin, side = _stream(sim), _stream(sim)
    log, op = recorder()
    fork, join = sim.event_create(False, False), sim.event_create(False, False)
    sim.stream_begin_capture(origin, "thread_local")
    sim.enqueue(origin, op("first"))
    sim.event_record(fork, origin)
    sim.stream_wait_event(side, fork)  # side joins the capture
    sim.enqueue(side, op("side"))
    sim.enqueue(origin, op("origin"))
    sim.event_record(join, side)
    sim.stream_wait_event(origin, join)
    sim.enqueue(origin, op("last"))
    graph = sim.stream_end_capture(origin)
    assert [n.dependencies for n in sim.graph_nodes(graph)] == [(), (0,), (0,), (1, 2)]
    sim.enqueue(side, op("side again"))  # side left the capture with the origin
    sim.stream_synchronize(side)
    sim.graph_launch(sim.graph_instantiate(graph), origin)
    sim.stream_synchronize(origin)
    assert log == ["side again", "first", "side", "origin", "last"]


def test_unjoined_fork_fails_at_the_end(sim: SimDriver) -> None:
    origin, side = _stream(sim), _stream(sim)
    _, op = recorder()
    fork = sim.event_create(False, False)
    sim.stream_begin_capture(origin, "thread_local")
    sim.event_record(fork, origin)
    sim.stream_wait_event(side, fork)
    sim.enqueue(side, op("lost"))
    with pytest.raises(CaptureError) as caught:
        sim.stream_end_capture(origin)
    assert caught.value.code == ResultCode.STREAM_CAPTURE_UNJOINED
    sim.enqueue(side, op("fine"))  # both streams left the capture
    sim.stream_synchronize(side)


def test_capture_status_and_ids(sim: SimDriver) -> None:
    """cuStreamGetCaptureInfo: a capture's id is shared by every stream in it and unique in
    the process; the streams are out of it once the origin ends it, even unjoined."""
    origin, side, other = _stream(sim), _stream(sim), _stream(sim)
    _, op = recorder()
    assert sim.stream_capture_status(origin) == ("none", 0)
    sim.stream_begin_capture(origin, "thread_local")
    sim.stream_begin_capture(other, "relaxed")
    status, ident = sim.stream_capture_status(origin)
    assert status == "active" and ident and sim.stream_capture_status(other)[1] not in (0, ident)
    fork = sim.event_create(False, False)
    sim.event_record(fork, origin)
    sim.stream_wait_event(side, fork)
    sim.enqueue(side, op("lost"))
    assert sim.stream_capture_status(side) == ("active", ident)
    with pytest.raises(CaptureError):
        sim.stream_end_capture(origin)  # unjoined
    assert sim.stream_capture_status(origin) == sim.stream_capture_status(side) == ("none", 0)
    sim.stream_end_capture(other)


def test_joining_a_captures_sinks_lets_it_end(sim: SimDriver) -> None:
    """cuStreamUpdateCaptureDependencies with the nodes nothing depends on: the forks that
    were not joined back are joined, and the end succeeds."""
    origin, side = _stream(sim), _stream(sim)
    log, op = recorder()
    fork = sim.event_create(False, False)
    sim.stream_begin_capture(origin, "thread_local")
    sim.enqueue(origin, op("first"))
    sim.event_record(fork, origin)
    sim.stream_wait_event(side, fork)
    sim.enqueue(side, op("side"))
    sim.enqueue(origin, op("origin"))
    assert sim.stream_join_capture_sinks(origin) == ("op",)
    assert sim.stream_join_capture_sinks(origin) == ()  # nothing left to join
    sim.enqueue(origin, op("last"))
    graph = sim.stream_end_capture(origin)
    assert [n.dependencies for n in sim.graph_nodes(graph)] == [(), (0,), (0,), (1, 2)]
    sim.graph_launch(sim.graph_instantiate(graph), origin)
    sim.stream_synchronize(origin)
    assert log == ["first", "side", "origin", "last"]
    with pytest.raises(CudaError) as caught:
        sim.stream_join_capture_sinks(origin)
    assert caught.value.code == ResultCode.ILLEGAL_STATE


def test_an_invalidated_capture_refuses_waits_and_joins(sim: SimDriver) -> None:
    """Once invalidated, "further use of any streams which are being captured or captured
    events associated with the graph is invalid and will return an error" (the programming
    guide): a stream of the capture cannot wait, another stream cannot join it, and its
    streams report the invalidated status until the origin ends it."""
    origin, side, idle = _stream(sim), _stream(sim), _stream(sim)
    fork, join = sim.event_create(False, False), sim.event_create(False, False)
    sim.stream_begin_capture(origin, "relaxed")
    sim.event_record(fork, origin)
    sim.stream_wait_event(side, fork)
    with pytest.raises(CaptureError):
        sim.stream_synchronize(side)  # invalidates
    assert sim.stream_capture_status(side) == ("invalidated", 0)
    with pytest.raises(CaptureError) as member:
        sim.stream_wait_event(origin, fork)
    assert member.value.code == ResultCode.STREAM_CAPTURE_INVALIDATED
    with pytest.raises(CudaError) as outsider:
        sim.stream_wait_event(idle, fork)
    assert outsider.value.code == ResultCode.INVALID_VALUE
    assert sim.stream_capture_status(idle) == ("none", 0)  # it did not join
    with pytest.raises(CaptureError) as joining:
        sim.event_record(join, side)
    assert joining.value.code == ResultCode.STREAM_CAPTURE_INVALIDATED
    with pytest.raises(CaptureError) as sinks:
        sim.stream_join_capture_sinks(origin)
    assert sinks.value.code == ResultCode.STREAM_CAPTURE_INVALIDATED
    with pytest.raises(CaptureError) as ended:
        sim.stream_end_capture(origin)
    assert ended.value.code == ResultCode.STREAM_CAPTURE_INVALIDATED
    assert sim.stream_capture_status(origin) == sim.stream_capture_status(side) == ("none", 0)
    sim.stream_synchronize(side)  # usable again


def test_the_null_streams_status_while_a_blocking_stream_captures(sim: SimDriver) -> None:
    """cuStreamGetCaptureInfo on the legacy stream while a blocking stream of its context
    captures: CUDA_ERROR_STREAM_CAPTURE_IMPLICIT (the capture goes on)."""
    blocking = sim.stream_create(non_blocking=False, priority=0)
    sim.stream_begin_capture(blocking, "relaxed")
    with pytest.raises(CudaError) as caught:
        sim.stream_capture_status(0)
    assert caught.value.code == ResultCode.STREAM_CAPTURE_IMPLICIT
    sim.stream_end_capture(blocking)
    assert sim.stream_capture_status(0) == ("none", 0)


# -- what cannot be captured -----------------------------------------------------------------------
def test_waiting_for_a_capturing_stream_invalidates_the_capture(sim: SimDriver) -> None:
    stream = _stream(sim)
    sim.stream_begin_capture(stream, "thread_local")
    with pytest.raises(CaptureError) as caught:
        sim.stream_synchronize(stream)
    assert caught.value.code == ResultCode.STREAM_CAPTURE_UNSUPPORTED
    with pytest.raises(CaptureError) as later:
        sim.enqueue(stream, lambda: None)
    assert later.value.code == ResultCode.STREAM_CAPTURE_INVALIDATED
    with pytest.raises(CaptureError) as ended:
        sim.stream_end_capture(stream)
    assert ended.value.code == ResultCode.STREAM_CAPTURE_INVALIDATED
    assert sim.stream_query(stream)  # out of capture mode again


def test_synchronizing_the_context_of_a_capture_invalidates_it(sim: SimDriver) -> None:
    """As the driver: a context (or device) is a broader handle than the capturing stream,
    and synchronizing it is refused in every capture mode, invalidating the capture."""
    stream = _stream(sim)  # on device 0, the calling thread's device
    sim.stream_begin_capture(stream, "relaxed")
    with pytest.raises(CaptureError) as caught:
        sim.ctx_synchronize()
    assert caught.value.code == ResultCode.STREAM_CAPTURE_UNSUPPORTED
    with pytest.raises(CaptureError) as ended:
        sim.stream_end_capture(stream)
    assert ended.value.code == ResultCode.STREAM_CAPTURE_INVALIDATED
    sim.ctx_synchronize()  # no capture any more


def test_captured_events_cannot_be_queried(sim: SimDriver) -> None:
    stream = _stream(sim)
    event = sim.event_create(False, False)
    sim.stream_begin_capture(stream, "thread_local")
    sim.event_record(event, stream)
    with pytest.raises(CaptureError) as caught:
        sim.event_query(event)
    assert caught.value.code == ResultCode.CAPTURED_EVENT
    with pytest.raises(CaptureError):
        sim.stream_end_capture(stream)
    with pytest.raises(CaptureError):
        sim.event_synchronize(event)  # still last recorded in the capture
    sim.event_record(event, stream)
    sim.event_synchronize(event)


def test_waiting_on_work_outside_the_capture_is_refused(sim: SimDriver) -> None:
    stream, other = _stream(sim), _stream(sim)
    outside = sim.event_create(False, False)
    sim.event_record(outside, other)
    sim.stream_begin_capture(stream, "thread_local")
    with pytest.raises(CaptureError) as caught:
        sim.stream_wait_event(stream, outside)
    assert caught.value.code == ResultCode.STREAM_CAPTURE_ISOLATION
    with pytest.raises(CaptureError):
        sim.stream_end_capture(stream)


def test_pageable_copies_and_foreign_frees_cannot_be_captured(sim: SimDriver) -> None:
    stream = _stream(sim)
    pool = sim.mempool_default(sim.device_get(0))
    outside = sim.mem_alloc_async(64, pool, stream)
    pageable = np.zeros(64, np.uint8)
    sim.stream_begin_capture(stream, "thread_local")
    with pytest.raises(CaptureError, match="pageable"):
        sim.memcpy_htod_async(outside, pageable.ctypes.data, 64, stream)
    with pytest.raises(CaptureError):
        sim.stream_end_capture(stream)
    sim.stream_begin_capture(stream, "thread_local")
    with pytest.raises(ArgumentError, match="not an allocation of this capture"):
        sim.mem_free_async(outside, stream)
    with pytest.raises(CaptureError):
        sim.stream_end_capture(stream)
    sim.mem_free_async(outside, stream)


@pytest.mark.parametrize(
    ("mode", "other_thread_fails"), [("global", True), ("thread_local", False), ("relaxed", False)]
)
def test_capture_modes_forbid_unsafe_calls(sim: SimDriver, mode: str, other_thread_fails: bool) -> None:
    stream = _stream(sim)
    sim.stream_begin_capture(stream, mode)
    outcome: list[BaseException | int] = []

    def pin() -> None:
        try:
            outcome.append(sim.mem_host_alloc(64))
        except CudaError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=pin)
    thread.start()
    thread.join()
    assert isinstance(outcome[0], CaptureError) == other_thread_fails
    if mode == "relaxed":
        sim.mem_host_free(sim.mem_host_alloc(64))
    else:
        with pytest.raises(CaptureError, match="mem_host_alloc is not permitted"):
            sim.mem_host_alloc(64)
    if mode == "relaxed":
        sim.stream_end_capture(stream)
    else:
        with pytest.raises(CaptureError):
            sim.stream_end_capture(stream)


def test_a_fault_inside_a_replay_poisons_the_device_and_stops_it(sim: SimDriver) -> None:
    stream = _stream(sim)
    log, op = recorder()
    bell = SemaphoreDoorbell()

    def fault() -> None:
        raise IndexError("out of bounds")

    sim.stream_begin_capture(stream, "thread_local")
    sim.enqueue(stream, op("before"))
    sim.enqueue(stream, fault)
    sim.launch_doorbell(stream, bell)
    gexec = sim.graph_instantiate(sim.stream_end_capture(stream))
    sim.graph_launch(gexec, stream)
    with pytest.raises(ContextPoisonedError):
        sim.stream_synchronize(stream)
    assert log == ["before"]
    assert not bell.wait(0.0)  # the rest of the replay never ran
