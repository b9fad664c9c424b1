"""Dynamic batching: concurrent requests gathered into one batched stage.

See :mod:`aiocuda.batching` for the user's view. One *gatherer* task per batcher waits for
the first queued item, keeps gathering until ``max_batch`` items or ``max_delay`` after
that first one, and starts the batch in a task of its own (at most ``concurrency`` at
once), so that gathering the next batch overlaps running this one. Requests wait on
their own event; nothing a request does -- being cancelled above all -- reaches the
batch's task.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

import anyio
import anyio.abc

from ..errors import ClosedError
from .chunk_map import exit_task_group

__all__ = ["BatchFn", "Batcher", "BatcherStatistics"]

T = TypeVar("T")
R = TypeVar("R")

BatchFn = Callable[[list[T]], Awaitable[Sequence[R | BaseException]]]
"""``await run(items)``: the results in item order (an exception instance in place of a
result fails that item's request alone)."""


class _Pending(Generic[T, R]):
    """One request's item, and how its request learns the outcome."""

    __slots__ = ("arrived", "done", "error", "item", "result", "taken")

    def __init__(self, item: T) -> None:
        self.item = item
        self.arrived = anyio.current_time()
        self.done = anyio.Event()
        self.taken = False
        """Whether a batch took it (a cancelled request is then left in its batch)."""
        self.result: R | None = None
        self.error: BaseException | None = None

    def resolve(self, result: R | BaseException) -> None:
        if isinstance(result, BaseException):
            self.error = result
        else:
            self.result = result
        self.done.set()


@dataclass(frozen=True, slots=True)
class BatcherStatistics:
    """A snapshot of a :class:`Batcher` (:meth:`Batcher.statistics`)."""

    queued: int
    """Items waiting for a batch."""
    running: int
    """Batches running now."""
    batches: int
    """Batches finished so far."""
    items: int
    """Items in those batches."""


class Batcher(Generic[T, R]):
    """Gathers concurrent requests into batches for one batched stage (see
    :mod:`aiocuda.batching`).

    Args:
        run: ``async def run(items: list) -> Sequence``: one batched stage over the
            items, returning one result per item, in order. An exception instance in
            place of a result fails that item's request alone; an exception raised by
            ``run`` fails every request of the batch.
        max_batch: the most items in one batch.
        max_delay: seconds a batch waits for more items after its first one arrived
            (0: take what is queued at once).
        concurrency: batches running at once, at most (gathering goes on meanwhile).

    Use as ``async with Batcher(...) as batcher:`` (in a lifespan): it runs a task of
    its own for as long as the block.
    """

    def __init__(self, run: BatchFn[T, R], *, max_batch: int, max_delay: float, concurrency: int = 2) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if not (max_delay >= 0 and math.isfinite(max_delay)):
            raise ValueError(f"max_delay must be a finite number of seconds >= 0, got {max_delay}")
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self._run = run
        self.max_batch = max_batch
        self.max_delay = max_delay
        self._queue: collections.deque[_Pending[T, R]] = collections.deque()
        self._arrival: anyio.Event | None = None
        self._slots = anyio.Semaphore(concurrency)
        self._task_group: anyio.abc.TaskGroup | None = None
        self._state: Literal["new", "open", "closing", "closed"] = "new"
        self._running = 0
        self._batches = 0
        self._items = 0

    # -- lifetime ------------------------------------------------------------------------------
    async def __aenter__(self) -> Batcher[T, R]:
        if self._state != "new":
            raise RuntimeError(f"a Batcher is entered once (this one is {self._state})")
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        self._state = "open"
        self._task_group.start_soon(self._gather)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool | None:
        """Graceful: new submits fail with :class:`~aiocuda.errors.ClosedError`; queued
        items run at once (no more waiting for ``max_delay``) and every batch finishes."""
        assert self._task_group is not None
        self._state = "closing"
        self._notify()
        try:
            return await exit_task_group(self._task_group, exc_type, exc, tb)
        finally:
            self._state = "closed"
            for pending in self._queue:
                pending.resolve(ClosedError("the batcher closed before this request ran"))
            self._queue.clear()

    # -- requests ------------------------------------------------------------------------------
    async def submit(self, item: T) -> R:
        """Queue ``item`` for the next batch and return its result (raise its error).

        Cancelling the caller takes the item out of the queue if its batch has not
        started, and otherwise leaves the batch running (the result is dropped).
        """
        if self._state != "open":
            raise ClosedError(f"the batcher is {self._state}")
        pending: _Pending[T, R] = _Pending(item)
        self._queue.append(pending)
        self._notify()
        try:
            await pending.done.wait()
        except BaseException:
            if not pending.taken:
                self._queue.remove(pending)
            raise
        if pending.error is not None:
            raise pending.error
        return pending.result  # type: ignore[return-value]

    def _notify(self) -> None:
        arrival, self._arrival = self._arrival, None
        if arrival is not None:
            arrival.set()

    async def _next_arrival(self, deadline: float = math.inf) -> None:
        """Sleep until an item is queued, the batcher closes, or ``deadline``."""
        self._arrival = arrival = anyio.Event()
        with anyio.move_on_after(deadline - anyio.current_time()):
            await arrival.wait()

    # -- batches -------------------------------------------------------------------------------
    async def _gather(self) -> None:
        assert self._task_group is not None
        while True:
            while not self._queue and self._state == "open":
                await self._next_arrival()
            if not self._queue:
                return  # closing, and nothing left
            deadline = self._queue[0].arrived + self.max_delay
            while len(self._queue) < self.max_batch and self._state == "open":
                if anyio.current_time() >= deadline:
                    break
                await self._next_arrival(deadline)
            await self._slots.acquire()
            batch: list[_Pending[T, R]] = []
            while self._queue and len(batch) < self.max_batch:
                pending = self._queue.popleft()
                pending.taken = True
                batch.append(pending)
            if not batch:  # all cancelled while waiting for a slot
                self._slots.release()
                continue
            self._running += 1
            self._task_group.start_soon(self._run_batch, batch)

    async def _run_batch(self, batch: list[_Pending[T, R]]) -> None:
        try:
            try:
                results = await self._run([pending.item for pending in batch])
                if len(results) != len(batch):
                    raise ValueError(f"the batch function returned {len(results)} results for {len(batch)} items")
            except Exception as exc:
                for pending in batch:
                    pending.resolve(exc)
                return
            except BaseException:
                for pending in batch:
                    pending.resolve(ClosedError("the batcher was cancelled while this request's batch ran"))
                raise
            for pending, result in zip(batch, results, strict=True):
                pending.resolve(result)
        finally:
            self._running -= 1
            self._batches += 1
            self._items += len(batch)
            self._slots.release()

    # -- state ---------------------------------------------------------------------------------
    def statistics(self) -> BatcherStatistics:
        return BatcherStatistics(
            queued=len(self._queue), running=self._running, batches=self._batches, items=self._items
        )

    def __repr__(self) -> str:
        s = self.statistics()
        return (
            f"<Batcher {self._state} max_batch={self.max_batch} max_delay={self.max_delay} "
            f"[{s.queued} queued, {s.running} running, {s.batches} done]>"
        )
