"""Dynamic batching: gathering, per-request results and errors, cancellation, shutdown,
and a batched GPU stage on request lanes.

Batches are decided by ``max_batch`` with a ``max_delay`` no test can reach, or by
``max_delay=0``; a batch function that waits on an event keeps a batch running for as
long as a test needs. Nothing depends on how long anything takes.
"""

from __future__ import annotations

import collections
import functools
import gc
import math
import pathlib
import traceback
import weakref
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiocuda._cli.demo import ScaleStage, scale_reference
from aiocuda.batching import Batcher
from aiocuda.errors import ClosedError, QueueFullError
from aiocuda.lanes import Lanes

from ._control import checkpoints
from ._mypy import assert_passes_mypy_strict

pytestmark = pytest.mark.anyio

NEVER = 3600.0  # a max_delay no test waits for


class Recorder:
    """A batch function that records its batches and may be held at a gate."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.gate: anyio.Event | None = None

    async def __call__(self, items: list[int]) -> list[int | BaseException]:
        self.batches.append(list(items))
        if self.gate is not None:
            await self.gate.wait()
        return [ValueError(f"bad item {i}") if i < 0 else i * 10 for i in items]


async def test_concurrent_requests_are_gathered_up_to_max_batch(anyio_backend: Any) -> None:
    run = Recorder()
    results: dict[int, int] = {}
    async with Batcher(run, max_batch=4, max_delay=NEVER) as batcher:

        async def one(i: int) -> None:
            results[i] = await batcher.submit(i)

        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(one, i)
    assert sorted(len(b) for b in run.batches) == [4, 4]
    assert sorted(i for b in run.batches for i in b) == list(range(8))
    assert results == {i: i * 10 for i in range(8)}
    assert batcher.statistics().batches == 2 and batcher.statistics().items == 8


async def test_zero_delay_runs_what_is_queued(anyio_backend: Any) -> None:
    run = Recorder()
    async with Batcher(run, max_batch=100, max_delay=0) as batcher:
        assert await batcher.submit(3) == 30
        assert await batcher.submit(4) == 40
    assert run.batches == [[3], [4]]


async def test_errors_reach_only_the_requests_concerned(anyio_backend: Any) -> None:
    run = Recorder()
    outcomes: dict[int, Any] = {}
    async with Batcher(run, max_batch=3, max_delay=NEVER) as batcher:

        async def one(i: int) -> None:
            try:
                outcomes[i] = await batcher.submit(i)
            except ValueError as exc:
                outcomes[i] = exc

        async with anyio.create_task_group() as tg:
            for i in (1, -2, 3):
                tg.start_soon(one, i)
    assert outcomes[1] == 10 and outcomes[3] == 30
    assert isinstance(outcomes[-2], ValueError) and "bad item -2" in str(outcomes[-2])

    async def failing(items: list[int]) -> list[int]:
        if 99 in items:
            raise RuntimeError("the batch failed")
        return items

    failed: list[int] = []
    fine: list[int] = []
    async with Batcher(failing, max_batch=2, max_delay=NEVER) as batcher:

        async def two(i: int) -> None:
            try:
                fine.append(await batcher.submit(i))
            except RuntimeError:
                failed.append(i)

        async with anyio.create_task_group() as tg:
            for i in (99, 1, 2, 3):  # batches [99, 1] and [2, 3]
                tg.start_soon(two, i)
                await checkpoints(5)
    assert sorted(failed) == [1, 99] and sorted(fine) == [2, 3]


async def test_a_failed_batch_shows_each_request_the_same_traceback(anyio_backend: Any) -> None:
    # One exception fails the whole batch: each request raises it with the batch
    # function's traceback, not one that grew with every request raised before it.
    async def failing(items: list[int]) -> list[int]:
        raise RuntimeError("the batch failed")

    depths: list[int] = []
    async with Batcher(failing, max_batch=16, max_delay=NEVER) as batcher:

        async def one(i: int) -> None:
            try:
                await batcher.submit(i)
            except RuntimeError as exc:
                depths.append(len(traceback.extract_tb(exc.__traceback__)))

        async with anyio.create_task_group() as tg:
            for i in range(16):
                tg.start_soon(one, i)
    assert len(depths) == 16 and max(depths) == min(depths), depths


async def test_cancelling_one_request_leaves_its_batch_running(anyio_backend: Any) -> None:
    run = Recorder()
    run.gate = anyio.Event()
    results: dict[int, int] = {}
    async with Batcher(run, max_batch=3, max_delay=NEVER) as batcher:
        async with anyio.create_task_group() as tg:

            async def one(i: int) -> None:
                results[i] = await batcher.submit(i)

            doomed = anyio.CancelScope()

            async def cancellable() -> None:
                with doomed:
                    results[2] = await batcher.submit(2)

            tg.start_soon(cancellable)
            tg.start_soon(one, 0)
            tg.start_soon(one, 1)
            await checkpoints()
            assert batcher.statistics().running == 1
            doomed.cancel()
            await checkpoints()
            run.gate.set()
    assert len(run.batches) == 1 and sorted(run.batches[0]) == [0, 1, 2]  # the cancelled item stayed
    assert results == {0: 0, 1: 10}


async def test_a_request_cancelled_before_its_batch_leaves_the_queue(anyio_backend: Any) -> None:
    run = Recorder()
    run.gate = anyio.Event()
    results: dict[int, int] = {}
    async with Batcher(run, max_batch=1, max_delay=0, concurrency=1) as batcher:
        async with anyio.create_task_group() as tg:

            async def one(i: int) -> None:
                results[i] = await batcher.submit(i)

            tg.start_soon(one, 0)  # runs, held at the gate
            await checkpoints()
            doomed = anyio.CancelScope()

            async def queued() -> None:
                with doomed:
                    await batcher.submit(1)

            tg.start_soon(queued)
            await checkpoints()
            assert batcher.statistics().queued == 1
            doomed.cancel()
            await checkpoints()
            assert batcher.statistics().queued == 0
            tg.start_soon(one, 2)
            await checkpoints()
            run.gate.set()
    assert run.batches == [[0], [2]]
    assert results == {0: 0, 2: 20}


async def test_shutdown_runs_what_is_queued_then_refuses(anyio_backend: Any) -> None:
    run = Recorder()
    results: list[int] = []
    async with anyio.create_task_group() as tg:
        async with Batcher(run, max_batch=100, max_delay=NEVER) as batcher:

            async def one(i: int) -> None:
                results.append(await batcher.submit(i))

            for i in range(3):
                tg.start_soon(one, i)
            await checkpoints()
            assert batcher.statistics().queued == 3  # waiting for more items (max_delay unreachable)
        # leaving the block ran them without waiting for max_delay
    assert sorted(results) == [0, 10, 20]
    with pytest.raises(ClosedError):
        await batcher.submit(5)
    with pytest.raises(RuntimeError, match="not started") as caught:
        await Batcher(run, max_batch=2, max_delay=0).submit(1)
    assert not isinstance(caught.value, ClosedError)


async def test_bad_arguments_and_bad_batch_functions(anyio_backend: Any) -> None:
    with pytest.raises(ValueError):
        Batcher(Recorder(), max_batch=0, max_delay=0)
    with pytest.raises(ValueError):
        Batcher(Recorder(), max_batch=1, max_delay=math.inf)
    with pytest.raises(TypeError, match="max_batch must be an int"):
        Batcher(Recorder(), max_batch=2.5, max_delay=0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="max_delay"):
        Batcher(Recorder(), max_batch=2, max_delay="1ms")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="max_delay"):
        Batcher(Recorder(), max_batch=2, max_delay=True)
    with pytest.raises(TypeError, match="max_batch"):
        Batcher(Recorder(), max_batch=True, max_delay=0)
    assert Batcher(Recorder(), max_batch=2, max_delay=np.float32(0.5)).max_delay == 0.5
    with pytest.raises(ValueError, match="max_queue must be >= 1"):
        Batcher(Recorder(), max_batch=2, max_delay=0, max_queue=0)
    with pytest.raises(TypeError, match="max_queue must be an int"):
        Batcher(Recorder(), max_batch=2, max_delay=0, max_queue=2.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="max_queue must be an int"):
        Batcher(Recorder(), max_batch=2, max_delay=0, max_queue=True)
    assert Batcher(Recorder(), max_batch=2, max_delay=0, max_queue=np.int64(8)).max_queue == 8
    assert Batcher(Recorder(), max_batch=2, max_delay=0).max_queue is None

    async def short(items: list[int]) -> list[int]:
        return items[:-1]

    async with Batcher(short, max_batch=1, max_delay=0) as batcher:
        with pytest.raises(ValueError, match="returned 0 results for 1 items"):
            await batcher.submit(1)

    async def as_a_set(items: list[int]) -> Any:  # the right length, no order: requests would swap results
        return {10 * i for i in items}

    async with Batcher(as_a_set, max_batch=1, max_delay=0) as batcher:
        with pytest.raises(TypeError, match="sequence of results in item order"):
            await batcher.submit(1)


async def test_each_request_of_a_failed_batch_raises_its_own_exception(anyio_backend: Any) -> None:
    """Raised in every request, one exception object carried each request's context (the
    error its handler was handling) into the other requests' tracebacks."""

    async def failing(items: list[str]) -> list[str]:
        raise RuntimeError("the batch failed")

    contexts: dict[str, BaseException | None] = {}
    raised: list[BaseException] = []
    async with Batcher(failing, max_batch=2, max_delay=NEVER) as batcher:

        async def one(user: str) -> None:
            try:
                raise KeyError(f"session of {user}")
            except KeyError:
                try:
                    await batcher.submit(user)
                except RuntimeError as exc:
                    raised.append(exc)
                    await checkpoints(5)  # the other request raises meanwhile
                    contexts[user] = exc.__context__

        async with anyio.create_task_group() as tg:
            tg.start_soon(one, "alice")
            tg.start_soon(one, "bob")
    assert raised[0] is not raised[1] and all(str(e) == "the batch failed" for e in raised)
    assert {user: str(context) for user, context in contexts.items()} == {
        "alice": "'session of alice'",
        "bob": "'session of bob'",
    }


async def test_a_cancelled_error_of_the_batch_functions_own_fails_only_its_batch(anyio_backend: Any) -> None:
    """A batch function that awaits something cancelled elsewhere raises the loop's
    cancellation without being cancelled: its batch fails, the batcher serves on (it
    tore down the batcher and cancelled its host)."""
    if anyio_backend != "asyncio":
        pytest.skip("a cancellation exception raised outside a cancelled scope is asyncio's")
    import asyncio

    async def run(items: list[int]) -> list[int]:
        if 0 in items:
            future = asyncio.get_running_loop().create_future()
            future.cancel()
            await future
        return items

    reached_the_end = False
    async with Batcher(run, max_batch=1, max_delay=0) as batcher:
        with pytest.raises(RuntimeError, match="without being cancelled"):
            await batcher.submit(0)
        assert await batcher.submit(1) == 1
        reached_the_end = True
    assert reached_the_end


async def test_a_batched_gpu_stage_on_lanes(backend: Any, anyio_backend: Any) -> None:
    reps = 10
    scale = ScaleStage(reps)
    rng = np.random.default_rng(1)
    inputs = [rng.random(256, dtype=np.float32) for _ in range(16)]

    async with Lanes(count=2) as lanes:

        async def stage(items: list[np.ndarray]) -> list[np.ndarray]:
            batch = np.stack(items)
            async with lanes.lease() as lane:
                x = lane.upload(batch)
                scale.kernel.launch((x.size + 255) // 256, 256, x, x.size, reps, stream=lane.stream)
                out = lane.download(x)
                await lane
            return list(out)

        results: dict[int, np.ndarray] = {}
        async with Batcher(stage, max_batch=8, max_delay=NEVER) as batcher:

            async def one(i: int) -> None:
                results[i] = await batcher.submit(inputs[i])

            async with anyio.create_task_group() as tg:
                for i in range(16):
                    tg.start_soon(one, i)
        assert batcher.statistics().batches == 2
    for i, host in enumerate(inputs):
        np.testing.assert_allclose(results[i], scale_reference(host, reps), rtol=1e-4)


async def test_a_partial_batch_starts_once_max_delay_has_passed(anyio_backend: Any) -> None:
    run = Recorder()
    results: list[int] = []
    with anyio.fail_after(10):  # max_delay is 10 ms: only a lost timer waits this long
        async with Batcher(run, max_batch=100, max_delay=0.01) as batcher:

            async def one(i: int) -> None:
                results.append(await batcher.submit(i))

            async with anyio.create_task_group() as tg:
                for i in range(3):
                    tg.start_soon(one, i)
    assert sorted(results) == [0, 10, 20]
    assert sorted(i for b in run.batches for i in b) == [0, 1, 2]


async def test_the_next_batch_gathers_while_one_runs(anyio_backend: Any) -> None:
    run = Recorder()
    run.gate = anyio.Event()
    results: dict[int, int] = {}
    async with Batcher(run, max_batch=2, max_delay=NEVER, concurrency=2) as batcher:
        async with anyio.create_task_group() as tg:

            async def one(i: int) -> None:
                results[i] = await batcher.submit(i)

            for i in range(6):
                tg.start_soon(one, i)
            await checkpoints()
            stats = batcher.statistics()
            assert (stats.running, stats.queued) == (2, 2)  # two batches held at the gate, one waiting
            run.gate.set()
    assert [len(b) for b in run.batches] == [2, 2, 2]  # (trio starts the tasks in any order)
    assert results == {i: i * 10 for i in range(6)}


@pytest.mark.parametrize("loop", ["asyncio", "trio"])
@settings(max_examples=40)
@given(
    items=st.lists(st.integers(-3, 20), min_size=1, max_size=16),
    doomed=st.sets(st.integers(0, 15)),
    max_batch=st.integers(1, 5),
    concurrency=st.integers(1, 3),
    zero_delay=st.booleans(),
)
def test_any_mix_of_requests_and_cancellations_keeps_every_promise(
    loop: str, items: list[int], doomed: set[int], max_batch: int, concurrency: int, zero_delay: bool
) -> None:
    """Requests, some for items the batch function fails, are gathered while the batches
    already taken are held running; then some requests are cancelled, the held batches
    let go, and the batcher closed (which runs what is still queued). Whatever the mix:
    no batch is larger than ``max_batch``, every request not cancelled gets its own result
    or its own error, and a cancelled request's item runs only if its batch had been
    taken before the cancellation -- and then once."""
    cancelled = {i for i in doomed if i < len(items)}

    async def scenario() -> None:
        run = Recorder()
        run.gate = anyio.Event()
        outcomes: dict[int, Any] = {}
        scopes = [anyio.CancelScope() for _ in items]
        delay = 0 if zero_delay else NEVER
        async with anyio.create_task_group() as tg:
            async with Batcher(run, max_batch=max_batch, max_delay=delay, concurrency=concurrency) as batcher:

                async def one(i: int) -> None:
                    with scopes[i]:
                        try:
                            outcomes[i] = await batcher.submit(items[i])
                        except ValueError as exc:
                            outcomes[i] = exc

                for i in range(len(items)):
                    tg.start_soon(one, i)
                    await checkpoints()
                taken = [item for batch in run.batches for item in batch]  # (running: held at the gate)
                for i in sorted(cancelled):
                    scopes[i].cancel()
                await checkpoints()
                run.gate.set()
        assert all(len(batch) <= max_batch for batch in run.batches)
        for i, item in enumerate(items):
            if i in cancelled:
                assert i not in outcomes
            elif item < 0:
                assert isinstance(outcomes[i], ValueError) and f"bad item {item}" in str(outcomes[i])
            else:
                assert outcomes[i] == item * 10
        ran = [item for batch in run.batches for item in batch]
        for i in range(len(items)):
            if i not in cancelled:
                ran.remove(items[i])  # (raises if it never ran)
        for item in ran:  # what is left: cancelled requests' items
            taken.remove(item)  # (raises unless its batch was taken before the cancellation)
        assert batcher.statistics().items == sum(len(batch) for batch in run.batches)

    anyio.run(scenario, backend=loop)


@pytest.mark.parametrize("other_loop", ["asyncio", "trio"])
async def test_a_submit_from_another_threads_loop_is_refused_and_changes_nothing(
    anyio_backend: Any, other_loop: str
) -> None:
    """A batcher belongs to the loop that entered it: its queue, wake-ups and the
    suspensions of its requests are that loop's. A submit from a loop in another thread
    raises at once, queues nothing, and the batcher goes on serving its own loop."""
    run = Recorder()
    outcome: list[BaseException | int] = []

    async def submit_there(batcher: Batcher[int, int]) -> None:
        with anyio.fail_after(30):  # (only a hang, the defect, reaches this)
            try:
                outcome.append(await batcher.submit(1))
            except RuntimeError as exc:
                outcome.append(exc)

    async with Batcher(run, max_batch=1, max_delay=0) as batcher:
        await anyio.to_thread.run_sync(lambda: anyio.run(submit_there, batcher, backend=other_loop))
        (error,) = outcome
        assert isinstance(error, RuntimeError) and "belongs to the event loop that entered it" in str(error)
        assert batcher.statistics().queued == 0
        assert await batcher.submit(2) == 20
    assert run.batches == [[2]]


def test_a_submit_from_another_loop_of_the_same_thread_is_refused() -> None:
    """The batcher entered in one asyncio loop, that loop stopped with the batcher open
    (a fixture's loop, say), and a submit from a second loop of the same thread: a
    ``RuntimeError`` that says what happened, not asyncio's about a future, and nothing
    left in the queue. The first loop then closes the batcher as usual."""
    import asyncio

    run = Recorder()
    home = asyncio.new_event_loop()
    try:
        holder: list[Batcher[int, int]] = []
        entered, leave = asyncio.Event(), asyncio.Event()

        async def lifespan() -> None:
            async with Batcher(run, max_batch=4, max_delay=NEVER) as batcher:
                holder.append(batcher)
                entered.set()
                await leave.wait()

        task = home.create_task(lifespan())
        home.run_until_complete(entered.wait())
        (batcher,) = holder

        async def elsewhere() -> None:
            with pytest.raises(RuntimeError, match="another event loop of its thread"):
                await batcher.submit(1)

        asyncio.run(elsewhere())
        assert batcher.statistics().queued == 0
        home.call_soon(leave.set)
        home.run_until_complete(task)
    finally:
        home.close()
    assert run.batches == []


class Payload:
    """An item or result a weak reference can watch."""

    def __init__(self, value: int) -> None:
        self.value = value


async def test_a_finished_batch_keeps_no_item_or_result_alive(anyio_backend: Any) -> None:
    """Once its requests have their results, nothing of a batch stays referenced while the
    batcher waits for the next one (the items may be large arrays or GPU buffers)."""

    async def run(items: list[Payload]) -> list[Payload]:
        return [Payload(item.value * 10) for item in items]

    watched: list[weakref.ref[Payload]] = []
    async with Batcher(run, max_batch=4, max_delay=NEVER) as batcher:

        async def one(i: int) -> None:
            item = Payload(i)
            result = await batcher.submit(item)
            assert result.value == i * 10
            watched.extend([weakref.ref(item), weakref.ref(result)])

        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(one, i)
        await checkpoints()
        gc.collect()
        assert [ref() for ref in watched if ref() is not None] == []  # (the batcher is open, idle)


async def test_a_failed_batch_is_freed_without_the_cyclic_garbage_collector(anyio_backend: Any) -> None:
    """The items of a failed batch -- raised by the batch function, or an exception in
    place of one result, or with a request cancelled while its batch ran -- are freed as
    soon as the requests let go of their errors, not at some later collection."""

    async def run(items: list[Payload]) -> list[Payload | BaseException]:
        await gate.wait()
        if any(item.value < 0 for item in items):
            raise RuntimeError("the batch failed")
        return [ValueError(f"bad item {item.value}") for item in items]

    watched: list[weakref.ref[Payload]] = []
    gc.collect()
    gc.disable()
    try:
        for values in ([-1, 1, 2], [1, 2, 3]):
            gate = anyio.Event()
            async with Batcher(run, max_batch=3, max_delay=NEVER) as batcher:

                async def one(value: int, scope: anyio.CancelScope) -> None:
                    item = Payload(value)
                    watched.append(weakref.ref(item))
                    with scope, pytest.raises((RuntimeError, ValueError)):
                        await batcher.submit(item)

                async with anyio.create_task_group() as tg:
                    doomed = anyio.CancelScope()
                    for value in values:
                        tg.start_soon(one, value, doomed if value == 2 else anyio.CancelScope())
                    await checkpoints()
                    doomed.cancel()  # (its batch runs: the request lets go, the batch goes on)
                    await checkpoints()
                    gate.set()
                await checkpoints()
                assert [ref().value for ref in watched if ref() is not None] == []  # type: ignore[union-attr]
    finally:
        gc.enable()


class CodeError(Exception):
    """An error that writes its message from its arguments, as many do."""

    def __init__(self, code: int) -> None:
        super().__init__(f"error code {code}")
        self.code = code


async def test_each_request_of_a_failed_batch_sees_the_error_as_raised(anyio_backend: Any) -> None:
    """Every request of a failed batch raises the batch function's error with its message,
    attributes and notes as they were raised; a note one request adds (a handler saying
    which request it was) stays on that request's error."""

    async def failing(items: list[str]) -> list[str]:
        error = CodeError(7)
        error.add_note("(on device 0)")
        raise error

    seen: dict[str, tuple[str, int, list[str]]] = {}
    async with Batcher(failing, max_batch=3, max_delay=NEVER) as batcher:

        async def one(user: str) -> None:
            try:
                await batcher.submit(user)
            except CodeError as exc:
                exc.add_note(f"(the request of {user})")
                await checkpoints(5)  # the other requests add theirs meanwhile
                seen[user] = (str(exc), exc.code, exc.__notes__)

        async with anyio.create_task_group() as tg:
            for user in ("alice", "bob", "carol"):
                tg.start_soon(one, user)
    assert seen == {
        user: ("error code 7", 7, ["(on device 0)", f"(the request of {user})"]) for user in ("alice", "bob", "carol")
    }


def test_max_delay_is_measured_on_the_event_loops_clock() -> None:
    """Under trio's MockClock (a test's virtual time, jumping ahead whenever every task
    sleeps) a partial batch starts once ``max_delay`` has passed on that clock, as the
    loop's own timeouts do."""
    trio = pytest.importorskip("trio")
    mock_clock = pytest.importorskip("trio.testing").MockClock

    run = Recorder()

    async def scenario() -> float:
        async with Batcher(run, max_batch=100, max_delay=0.5) as batcher:
            start = trio.current_time()
            assert await batcher.submit(1) == 10
            return float(trio.current_time() - start)

    waited = trio.run(scenario, clock=mock_clock(autojump_threshold=0))
    assert 0.4 < waited < 0.6, waited  # (it jumped ahead some thousand times, half a second each)
    assert run.batches == [[1]]


async def test_a_zero_dimensional_array_for_results_is_refused_with_the_batchers_message(anyio_backend: Any) -> None:
    """An array of no dimension (a reduction where a stacked result was meant) is no
    sequence of results: the requests are told what the batch function must return,
    not numpy's ``len() of unsized object``."""

    async def reduced(items: list[int]) -> Any:
        return np.array(sum(items))

    async with Batcher(reduced, max_batch=1, max_delay=0) as batcher:
        with pytest.raises(TypeError, match=r"sequence of results in item order.*not a 0-d array"):
            await batcher.submit(1)


class Abort(BaseException):
    """A BaseException that is not a cancellation (as KeyboardInterrupt and SystemExit are)."""


async def test_a_batch_function_raising_a_base_exception_stops_the_batcher_and_says_so(anyio_backend: Any) -> None:
    """A batch function that raises a BaseException other than a cancellation stops the
    batcher (it leaves the ``async with`` block with it); the requests of that batch are
    told what happened, not that the batcher was cancelled."""

    async def run(items: list[int]) -> list[int]:
        raise Abort("stop serving")

    errors: list[BaseException] = []
    entered = anyio.Event()
    holder: list[Batcher[int, int]] = []

    async def lifespan() -> None:
        with pytest.raises(BaseException) as stopped:  # (in an exception group)
            async with Batcher(run, max_batch=2, max_delay=NEVER) as batcher:
                holder.append(batcher)
                entered.set()
                await anyio.sleep_forever()
        assert stopped.group_contains(Abort, depth=None)

    async def one(i: int) -> None:
        try:
            await holder[0].submit(i)
        except ClosedError as exc:
            errors.append(exc)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(lifespan)
            await entered.wait()
            tg.start_soon(one, 1)
            tg.start_soon(one, 2)
    assert len(errors) == 2
    for error in errors:
        assert "the batch function raised Abort" in str(error) and isinstance(error.__cause__, Abort), error


async def test_leaving_the_block_with_an_exception_stops_at_once(anyio_backend: Any) -> None:
    """A lifespan that ends with an exception (or is cancelled) does not drain: the running
    batch is cancelled, and its requests and the queued ones raise ``ClosedError``; the
    block's exception comes out as it was."""
    run = Recorder()
    run.gate = anyio.Event()  # (never set: the batch runs until cancelled)
    errors: dict[int, str] = {}
    entered, crash = anyio.Event(), anyio.Event()
    holder: list[Batcher[int, int]] = []

    async def lifespan() -> None:
        with pytest.raises(LookupError, match="the lifespan failed"):
            async with Batcher(run, max_batch=2, max_delay=NEVER, concurrency=1) as batcher:
                holder.append(batcher)
                entered.set()
                await crash.wait()
                raise LookupError("the lifespan failed")

    async def one(i: int) -> None:
        try:
            await holder[0].submit(i)
        except ClosedError as exc:
            errors[i] = str(exc)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(lifespan)
            await entered.wait()
            for i in range(5):  # [0, 1] runs, [2, 3] and 4 queued
                tg.start_soon(one, i)
                await checkpoints(5)
            await checkpoints()
            assert (holder[0].statistics().running, holder[0].statistics().queued) == (1, 3)
            crash.set()
    assert [sorted(batch) for batch in run.batches] == [[0, 1]]
    assert errors == {
        **{i: "the batcher was cancelled while this request's batch ran" for i in (0, 1)},
        **{i: "the batcher closed before this request ran" for i in (2, 3, 4)},
    }


async def test_one_exception_returned_for_several_items_is_each_requests_own(anyio_backend: Any) -> None:
    """A batch function may fail several items with one exception instance (``[error] *
    len(items)``): each request still raises an exception of its own, whose context and
    traceback another request's raise does not change."""
    overloaded = RuntimeError("overloaded")

    async def run(items: list[str]) -> list[BaseException]:
        return [overloaded] * len(items)

    raised: dict[str, BaseException] = {}
    contexts: dict[str, str] = {}
    depths: dict[str, int] = {}
    async with Batcher(run, max_batch=3, max_delay=NEVER) as batcher:

        async def one(user: str) -> None:
            try:
                raise KeyError(f"session of {user}")
            except KeyError:
                try:
                    await batcher.submit(user)
                except RuntimeError as exc:
                    raised[user] = exc
                    await checkpoints(5)  # the other requests raise meanwhile
                    contexts[user] = str(exc.__context__)
                    depths[user] = len(traceback.extract_tb(exc.__traceback__))

        async with anyio.create_task_group() as tg:
            for user in ("alice", "bob", "carol"):
                tg.start_soon(one, user)
    assert len({id(exc) for exc in raised.values()}) == 3
    assert all(str(exc) == "overloaded" for exc in raised.values())
    assert contexts == {user: f"'session of {user}'" for user in ("alice", "bob", "carol")}
    assert len(set(depths.values())) == 1, depths


class ScanCountingQueue(collections.deque[Any]):
    """A batcher's queue that counts the entries its searches walk (``remove``, ``index``,
    ``in``, iteration): work that grows with the queue, per call."""

    scanned = 0

    def remove(self, value: Any) -> None:
        self.scanned += len(self)
        super().remove(value)

    def index(self, value: Any, *args: Any) -> int:
        self.scanned += len(self)
        return super().index(value, *args)

    def __contains__(self, value: object) -> bool:
        self.scanned += len(self)
        return super().__contains__(value)

    def __iter__(self) -> Any:
        self.scanned += len(self)
        return super().__iter__()


async def test_cancelling_queued_requests_does_not_search_the_queue(anyio_backend: Any) -> None:
    """Cancelling each of n queued requests (clients gone while the service is overloaded)
    costs the same whatever is queued: the queue is not searched for the request, which
    made cancelling them all cost n*n/2 steps on the loop (seconds for 40,000). Counted,
    not timed: the queue counts what its searches walk. The requests queued after them
    are batched as if the cancelled ones had never come."""
    run = Recorder()
    n = 2000
    batcher = Batcher(run, max_batch=n + 1, max_delay=NEVER, concurrency=1)
    queue = batcher._queue = ScanCountingQueue()
    results: list[int] = []
    async with anyio.create_task_group() as tg:
        async with batcher:
            doomed = [anyio.CancelScope() for _ in range(n)]

            async def queued(i: int) -> None:
                with doomed[i]:
                    await batcher.submit(i)

            async def one(i: int) -> None:
                results.append(await batcher.submit(i))

            for i in range(n):
                tg.start_soon(queued, i)
            await checkpoints()
            assert batcher.statistics().queued == n
            for scope in doomed:
                scope.cancel()
            await checkpoints()
            assert batcher.statistics().queued == 0
            assert queue.scanned <= n, queue.scanned  # (no search per cancellation: n*n/2 were)
            tg.start_soon(one, n)
            tg.start_soon(one, n + 1)
            await checkpoints()
            assert batcher.statistics().queued == 2
        # (leaving the block ran what was queued)
    assert [sorted(batch) for batch in run.batches] == [[n, n + 1]]
    assert sorted(results) == [10 * n, 10 * (n + 1)]
    assert queue.scanned <= n and batcher.statistics().items == 2


async def test_a_request_cancelled_while_queued_does_not_count_toward_max_batch(anyio_backend: Any) -> None:
    """A batch is full with ``max_batch`` requests that were not cancelled."""
    run = Recorder()
    async with Batcher(run, max_batch=3, max_delay=NEVER, concurrency=1) as batcher:
        async with anyio.create_task_group() as tg:
            doomed = anyio.CancelScope()

            async def one(i: int, scope: anyio.CancelScope) -> None:
                with scope:
                    await batcher.submit(i)

            tg.start_soon(one, 0, anyio.CancelScope())
            await checkpoints()
            tg.start_soon(one, 1, doomed)
            await checkpoints()
            doomed.cancel()
            await checkpoints()
            tg.start_soon(one, 2, anyio.CancelScope())
            await checkpoints()
            assert run.batches == [] and batcher.statistics().queued == 2
            tg.start_soon(one, 3, anyio.CancelScope())
            await checkpoints()
            assert run.batches == [[0, 2, 3]]


async def test_a_full_queue_refuses_new_requests_at_once(anyio_backend: Any) -> None:
    """With ``max_queue`` items waiting for a batch, a submit raises ``QueueFullError`` at
    once, saying the limit and what to answer, and is counted; the items of a running
    batch and the requests cancelled while queued do not count toward the limit."""
    run = Recorder()
    run.gate = anyio.Event()
    results: dict[int, int] = {}
    async with anyio.create_task_group() as tg:
        async with Batcher(run, max_batch=2, max_delay=NEVER, concurrency=1, max_queue=3) as batcher:
            assert "max_queue=3" in repr(batcher)
            scopes = {i: anyio.CancelScope() for i in range(8)}

            async def one(i: int) -> None:
                with scopes[i]:
                    results[i] = await batcher.submit(i)

            for i in range(5):  # [0, 1] runs (held at the gate); 2, 3 and 4 wait
                tg.start_soon(one, i)
                await checkpoints(5)
            await checkpoints()
            assert (batcher.statistics().running, batcher.statistics().queued) == (1, 3)
            with pytest.raises(QueueFullError, match=r"max_queue=3.*503") as refused:
                await batcher.submit(5)
            assert isinstance(refused.value, RuntimeError)
            assert (batcher.statistics().queued, batcher.statistics().rejected) == (3, 1)
            assert "1 rejected" in repr(batcher)
            scopes[3].cancel()
            await checkpoints()
            tg.start_soon(one, 6)  # room again: 3 was withdrawn
            await checkpoints()
            assert (batcher.statistics().queued, batcher.statistics().rejected) == (3, 1)
            with pytest.raises(QueueFullError):
                await batcher.submit(7)
            run.gate.set()
        # (leaving the block ran what was queued)
    assert results == {i: 10 * i for i in (0, 1, 2, 4, 6)}
    assert batcher.statistics().rejected == 2


async def test_without_max_queue_nothing_is_refused(anyio_backend: Any) -> None:
    run = Recorder()
    results: list[int] = []
    async with anyio.create_task_group() as tg:
        async with Batcher(run, max_batch=1000, max_delay=NEVER) as batcher:

            async def one(i: int) -> None:
                results.append(await batcher.submit(i))

            for i in range(500):
                tg.start_soon(one, i)
            await checkpoints()
            assert batcher.statistics().queued == 500
    assert len(results) == 500 and batcher.statistics().rejected == 0


class AsyncCallable:
    """A batch function that is an object with an ``async def __call__``."""

    async def __call__(self, items: list[int]) -> list[int]:
        return [10 * i for i in items]


async def scaled(factor: int, items: list[int]) -> list[int]:
    return [factor * i for i in items]


def test_a_batch_function_that_plainly_returns_no_awaitable_is_refused_at_once() -> None:
    """What cannot return an awaitable is refused when the batcher is made, with a
    ``TypeError`` that says what a batch function must be; a generator function is the
    one kind of plain ``def`` told apart (a ``types.coroutine`` one is awaitable)."""

    def generator(items: list[int]) -> Any:
        yield from items

    async def async_generator(items: list[int]) -> Any:
        for item in items:
            yield item

    class YieldingCall:
        async def __call__(self, items: list[int]) -> Any:
            yield items

    with pytest.raises(TypeError, match=r"must be callable \(an 'async def' function\), not int"):
        Batcher(42, max_batch=2, max_delay=0)  # type: ignore[arg-type]
    for run in (generator, functools.partial(generator)):
        with pytest.raises(TypeError, match=r"'async def' function that returns the results, and .*generator\b"):
            Batcher(run, max_batch=2, max_delay=0)
    for run in (async_generator, functools.partial(async_generator), YieldingCall()):
        with pytest.raises(TypeError, match=r"async generator function \(it yields\): return the results instead"):
            Batcher(run, max_batch=2, max_delay=0)


async def test_batch_functions_that_return_an_awaitable_are_accepted(anyio_backend: Any) -> None:
    """``async def`` functions, methods, callable objects and partials, and plain functions
    (lambdas included) that return an awaitable, all serve."""
    import types

    @types.coroutine
    def iterable_coroutine(items: list[int]) -> Any:
        yield from anyio.lowlevel.checkpoint().__await__()
        return [10 * i for i in items]

    def returns_a_coroutine(items: list[int]) -> Any:
        return scaled(10, items)

    runs: list[Any] = [
        Recorder(),
        AsyncCallable(),
        functools.partial(scaled, 10),
        lambda items: scaled(10, items),
        returns_a_coroutine,
        iterable_coroutine,
    ]
    for run in runs:
        async with Batcher(run, max_batch=1, max_delay=0) as batcher:
            assert await batcher.submit(3) == 30, run


async def test_a_batch_function_returning_no_awaitable_fails_its_batch_and_says_so(anyio_backend: Any) -> None:
    """A plain function that returns its results (not an awaitable of them) cannot be told
    at once: each batch's requests fail with a ``TypeError`` that says what it returned
    and what it must return, not Python's "can't be used in 'await' expression"."""

    def synchronous(items: list[int]) -> list[int]:
        return [10 * i for i in items]

    class SynchronousCall:
        def __call__(self, items: list[int]) -> tuple[int, ...]:
            return tuple(items)

    for run, returned in ((synchronous, "list"), (SynchronousCall(), "tuple")):
        async with Batcher(run, max_batch=1, max_delay=0) as batcher:  # type: ignore[arg-type]
            for item in (1, 2):
                with pytest.raises(TypeError, match=rf"returned {returned}, not an awaitable.*'async def'"):
                    await batcher.submit(item)
        assert batcher.statistics().batches == 2


USER_CODE = """
from __future__ import annotations

import numpy as np
import numpy.typing as npt

from aiocuda import Batcher

Vector = npt.NDArray[np.float32]


async def stacked(items: list[Vector]) -> Vector:
    return np.stack(items) * 2


async def listed(items: list[int]) -> list[int | ValueError]:
    return [ValueError("negative") if i < 0 else i * 2 for i in items]


async def tupled(items: list[str]) -> tuple[str, ...]:
    return tuple(items)


async def serve() -> None:
    rows: Batcher[Vector, Vector] = Batcher(stacked, max_batch=8, max_delay=0)
    doubled = Batcher(listed, max_batch=8, max_delay=0, max_queue=64)
    same = Batcher(tupled, max_batch=8, max_delay=0)
    async with rows, doubled, same:
        row: Vector = await rows.submit(np.zeros(3, np.float32))
        n: int = await doubled.submit(1)
        text: str = await same.submit("a")
        print(row, n + 1, text.upper(), doubled.statistics().rejected)
"""


@pytest.mark.slow
def test_batch_functions_returning_what_the_batcher_takes_pass_mypy_strict(tmp_path: pathlib.Path) -> None:
    """``BatchFn`` says what the batcher takes: a batch function returning an array, a
    list (exceptions in it included) or a tuple passes ``mypy --strict``."""
    assert_passes_mypy_strict(tmp_path, "user_service.py", USER_CODE)
