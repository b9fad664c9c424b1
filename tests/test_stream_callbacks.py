"""Host callbacks in stream order (Stream.call_when_done): when they run, in what order,
on which thread, cancellation, errors, and a poisoned context."""

from __future__ import annotations

import threading
import traceback
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest

import aiocuda
from aiocuda import _driver
from aiocuda.errors import ContextPoisonedError

from ._workload import poison_op, slow_op

pytestmark = pytest.mark.anyio


async def test_callbacks_run_on_the_loop_after_the_work(backend: _driver.Driver, anyio_backend: object) -> None:
    """Each callback runs on the loop's thread, once its point has passed (the event
    recorded just before it has completed), in the order they were scheduled."""
    stream = aiocuda.Stream(0)
    loop_thread = threading.get_ident()
    seen: list[tuple[int, bool, int]] = []
    slow_op(stream, 0.05)
    handles = []
    for i in range(20):
        marker = stream.record()
        handles.append(
            stream.call_when_done(lambda i, m: seen.append((i, m.query(), threading.get_ident())), i, marker)
        )
        if i % 5 == 0:
            slow_op(stream, 0.01)
    assert not handles[0].done()
    assert await handles[-1] is None
    await stream
    assert [i for i, _, _ in seen] == list(range(20))
    assert all(reached for _, reached, _ in seen), "a callback ran before the GPU reached its point"
    assert {thread for _, _, thread in seen} == {loop_thread}
    assert all(h.done() and not h.cancelled() and h.exception() is None for h in handles)


async def test_callbacks_in_order_under_load(backend: _driver.Driver, anyio_backend: object) -> None:
    """Many callbacks on several streams, interleaved with copies and other tasks'
    awaits: each stream's callbacks run in order and after their work."""
    streams = [aiocuda.Stream(0) for _ in range(4)]
    order: dict[int, list[int]] = {k: [] for k in range(len(streams))}
    host = np.arange(1 << 16, dtype=np.float32)

    async def busy(stream: aiocuda.Stream) -> None:
        for _ in range(10):
            await aiocuda.to_device(host, stream=stream)

    async with anyio.create_task_group() as group:
        for stream in streams:
            group.start_soon(busy, stream)
        for n in range(200):
            k = n % len(streams)
            stream = streams[k]
            if n % 7 == 0:
                slow_op(stream, 0.002)
            marker = stream.record()

            def note(k: int, n: int, marker: aiocuda.Event) -> None:
                assert marker.query()
                order[k].append(n)

            stream.call_when_done(note, k, n, marker)
            if n % 13 == 0:
                await anyio.lowlevel.checkpoint()
        for stream in streams:
            await stream.call_when_done(lambda: None)
    for k, calls in order.items():
        assert calls == sorted(calls) and len(calls) == 50, (k, calls)


async def test_cancelled_callbacks_are_skipped(backend: _driver.Driver, anyio_backend: object) -> None:
    stream = aiocuda.Stream(0)
    calls: list[str] = []
    slow_op(stream, 0.05)
    first = stream.call_when_done(calls.append, "first")
    second = stream.call_when_done(calls.append, "second")
    third = stream.call_when_done(calls.append, "third")
    assert second.cancel() and second.cancelled() and second.cancel()
    assert await second is None
    await third
    assert calls == ["first", "third"]
    assert not first.cancel()  # already called


async def test_results_and_errors_reach_the_awaiting_task(backend: _driver.Driver, anyio_backend: object) -> None:
    stream = aiocuda.Stream(0)

    def fails() -> None:
        raise KeyError("from the callback")

    assert await stream.call_when_done(lambda a, b: a + b, 2, 3) == 5
    failing = stream.call_when_done(fails)
    after = stream.call_when_done(lambda: "still runs")
    with pytest.raises(KeyError, match="from the callback"):
        await failing
    assert isinstance(failing.exception(), KeyError)
    assert await after == "still runs"

    class Stop(BaseException):  # (or asyncio.CancelledError from a cancelled future's result())
        pass

    def stops() -> None:
        raise Stop

    stopping = stream.call_when_done(stops)
    after = stream.call_when_done(lambda: "runs too")
    with pytest.raises(Stop):
        await stopping
    assert await after == "runs too"
    with pytest.raises(TypeError, match="callable"):
        stream.call_when_done(42)  # type: ignore[arg-type]

    async def coroutine_function() -> None:
        pass

    with pytest.raises(TypeError, match="plain function"):
        stream.call_when_done(coroutine_function)


async def test_a_callback_returning_an_awaitable_fails_and_says_so(
    backend: _driver.Driver, anyio_backend: object
) -> None:
    """An object with an async ``__call__``, or a plain function calling an async one,
    passes the plain-function check; its coroutine was the callback's result, never run
    (Python warned that it was never awaited once it was collected)."""
    stream = aiocuda.Stream(0)
    ran: list[str] = []

    async def work() -> None:
        ran.append("work")

    class Handler:
        async def __call__(self) -> None:
            ran.append("handler")

    for callback in (Handler(), lambda: work()):
        handle = stream.call_when_done(callback)
        with pytest.raises(TypeError, match="returned a coroutine, which call_when_done does not await"):
            await handle
    assert await stream.call_when_done(lambda: "next") == "next"
    assert ran == []


async def test_a_stream_being_captured_calls_nothing_back(backend: _driver.Driver, anyio_backend: object) -> None:
    stream = aiocuda.Stream(0)
    async with stream.capture():
        with pytest.raises(aiocuda.errors.CaptureError, match="call_when_done"):
            stream.call_when_done(print)


def test_a_running_loop_is_needed(sim_backend: _driver.Driver) -> None:
    with pytest.raises(RuntimeError, match="running asyncio or trio event loop"):
        aiocuda.Stream(0).call_when_done(print)


async def test_a_poisoned_context_fails_pending_callbacks(sim_backend: _driver.Driver, anyio_backend: object) -> None:
    """A poisoned context never reaches the callbacks' points: they fail with its error
    at once instead of never running, and are not called."""
    stream = aiocuda.Stream(0)
    calls: list[Any] = []
    sim: Any = sim_backend
    sim.pause(stream.handle)
    handles = [stream.call_when_done(calls.append, i) for i in range(3)]
    poison_op(stream)
    later = stream.call_when_done(calls.append, "later")
    sim.poison(0)
    for handle in [*handles, later]:
        with pytest.raises(ContextPoisonedError):
            await handle
    assert calls == []
    sim.resume(stream.handle)


async def test_each_await_of_a_failed_callback_raises_the_same_traceback(
    sim_backend: _driver.Driver, anyio_backend: object
) -> None:
    """Callbacks failed together (one error for a queue after a poisoning) raise it with
    the traceback it was kept with, however often they are awaited: each raise used to
    add the raising frames to the error, so every await showed all earlier ones'."""
    stream = aiocuda.Stream(0)
    sim: Any = sim_backend
    sim.pause(stream.handle)
    handles = [stream.call_when_done(print, i) for i in range(3)]
    await anyio.sleep(0.01)  # the queue's task awaits the first point
    sim.poison(0)
    lengths = []
    for handle in handles + handles:
        with pytest.raises(ContextPoisonedError) as raised:
            await handle
        lengths.append(len(traceback.extract_tb(raised.value.__traceback__)))
    assert len(set(lengths)) == 1, lengths
    sim.resume(stream.handle)


POISON_SCRIPT = """
import anyio
from aiocuda.stream import Stream
from aiocuda.errors import ContextPoisonedError
from _workload import _kernel, poison_op

called = []


async def main():
    stream = Stream(0)
    _kernel(stream, "poison")  # compiled and loaded before the fault
    poison_op(stream)
    handles = [stream.call_when_done(called.append, i) for i in range(3)]
    for handle in handles:
        try:
            await handle
        except ContextPoisonedError:
            print("FAILED")
    print("CALLED", called)

anyio.run(main, backend="{lib}")
"""


@pytest.mark.gpu
@pytest.mark.parametrize("lib", ["asyncio", "trio"])
def test_a_real_sticky_error_fails_pending_callbacks(lib: str) -> None:
    """On the GPU (in a process of its own: a poisoned context stays poisoned): callbacks
    behind an illegal-address kernel fail with the error and are never called."""
    from .conftest import real_gpu_count
    from .test_completion import run_script

    if real_gpu_count() == 0:
        pytest.skip("no real GPU")
    if lib == "trio":
        pytest.importorskip("trio")
    proc = run_script(POISON_SCRIPT.replace("{lib}", lib), "cuda")
    assert proc.stdout.count("FAILED") == 3 and "CALLED []" in proc.stdout, proc.stdout + proc.stderr
