"""One map over a pool of GPU actors: the driver's side.

A feeder task reads the inputs, waits for a free slot (``in_flight`` chunks between
admission and delivery, at most) and for an actor with room (``chunks_per_actor``,
placement as in the executor: :mod:`aiocuda._executor.placement`), then starts one task per
chunk. A chunk task puts its input into the object store (off the loop: a large put is
a memory copy; small inputs travel inside the call), calls the actor, and awaits the
result, which it hands to the consumer; the consumer receives them in input order or as
they complete, and frees the slot by taking one.

An actor that dies fails its chunks with Ray's ``RayActorError``: each is placed again
on a live actor (its input is still in the store), up to ``retries`` times, and
otherwise delivered as an :class:`~aiocuda.ray.ActorLostError`; never dropped.
Cancellation (leaving the block early, cancelling the consumer, a chunk's error under
``on_error="raise"``) cancels every chunk task, and each asks Ray to cancel its actor
call: a running call gets ``CancelledError`` on the actor's loop, where the executor
returns the chunk's device memory.
"""

from __future__ import annotations

import math
import sys
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from types import TracebackType
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import anyio.to_thread
import numpy.typing as npt
import ray
import ray.exceptions

from .._executor.chunk import ChunkResult
from .._executor.pipeline import OnError, _aiter, as_input
from .._executor.placement import PlacementName
from .._util import NoPublicConstructor
from . import _refs
from ._pool import ActorLostError, ActorPool, ActorSlot

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

__all__ = ["INLINE_LIMIT", "RayPipeline"]

INLINE_LIMIT = 100 << 10
"""Inputs up to this size travel inside the actor call (as Ray inlines small arguments:
no store round trip); larger ones are put into the object store first, from a worker
thread (a large put is a memory copy), and the call passes the reference."""


class _InputFailed:
    """Sent by the feeder when iterating the inputs raised."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


_Item = ChunkResult | _InputFailed | None


class RayPipeline(metaclass=NoPublicConstructor):
    """A running :func:`aiocuda.ray.map`; an async context manager whose value is an
    async iterator of :class:`~aiocuda.executor.ChunkResult`.

    As with :meth:`aiocuda.executor.Executor.map`, except that ``result.device`` is the
    index of the actor (in the pool) that ran the chunk, and ``result.output`` is a
    read-only array in the object store's shared memory (no copy out of it; copy it to
    change it). Attributes while running: :attr:`in_flight`, :attr:`peak_in_flight`,
    :attr:`delivered`, :attr:`failures`, :attr:`retried` (chunks placed again after
    their actor died).
    """

    _factories = "aiocuda.ray.map()"

    def __init__(
        self,
        stage: Any,
        inputs: Iterable[npt.NDArray[Any]] | AsyncIterable[npt.NDArray[Any]],
        *,
        pool: ActorPool,
        owns_pool: bool,
        stage_args: tuple[Any, ...],
        ordered: bool,
        in_flight: int | None,
        on_error: OnError,
        placement: PlacementName,
        retries: int,
    ) -> None:
        self._stage = stage
        self._stage_args = stage_args
        self._inputs = inputs
        self._pool = pool
        self._owns_pool = owns_pool
        self._ordered = ordered
        self._requested_limit = in_flight
        self._on_error = on_error
        self._placement = placement
        self._retries = retries
        self._key = uuid.uuid4().hex
        self._cursor = 0
        self._ready: dict[int, ChunkResult] = {}
        self._next = 0
        self._total: int | None = None
        self.delivered = 0
        self.admitted = 0
        self.peak_in_flight = 0
        self.retried = 0
        self.failures: list[ChunkResult] = []
        self._task_group: anyio.abc.TaskGroup | None = None

    @property
    def in_flight(self) -> int:
        return self.admitted - self.delivered

    @property
    def pool(self) -> ActorPool:
        """The actors this map runs on."""
        return self._pool

    # -- lifetime ---------------------------------------------------------------------------
    async def __aenter__(self) -> RayPipeline:
        if self._owns_pool or not self._pool.ready:
            await self._pool.wait_ready()
        try:
            prepared = [slot.actor.prepare.remote(self._key, self._stage, self._stage_args) for slot in self._pool.live]
            for ref in prepared:
                await _refs.value(ref)
        except BaseException:
            await self._close_pool()
            raise
        limit = self._requested_limit or self._pool.chunks_per_actor * len(self._pool.live)
        self._send, self._receive = anyio.create_memory_object_stream[_Item](math.inf)
        self._slots = anyio.Semaphore(limit)
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        self._task_group.start_soon(self._feed)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        assert self._task_group is not None
        self._task_group.cancel_scope.cancel()  # the consumer is done: stop what is left
        try:
            return await self._task_group.__aexit__(exc_type, exc, tb)
        except BaseExceptionGroup as group:
            # The block's own exception comes back wrapped by the task group; chunk tasks
            # report their errors as results, so nothing else is in it: unwrap.
            if exc is not None and group.split(lambda e: e is exc)[1] is None:
                return None
            raise
        finally:
            self._send.close()
            self._receive.close()
            for slot in self._pool.live:
                slot.actor.forget.remote(self._key)
            await self._close_pool()

    async def _close_pool(self) -> None:
        if self._owns_pool:
            await self._pool.aclose()

    # -- the consumer -----------------------------------------------------------------------
    def __aiter__(self) -> AsyncIterator[ChunkResult]:
        return self

    async def __anext__(self) -> ChunkResult:
        await anyio.lowlevel.checkpoint_if_cancelled()
        while True:
            result = self._take_ready()
            if result is not None:
                return self._deliver(result)
            if self._total is not None and self.delivered == self._total:
                raise StopAsyncIteration
            item = await self._receive.receive()
            if isinstance(item, _InputFailed):
                raise item.error
            if item is not None:
                if item.error is not None and self._on_error == "raise":
                    return self._deliver(item)
                self._ready[item.index] = item

    def _take_ready(self) -> ChunkResult | None:
        if not self._ready:
            return None
        if self._ordered:
            return self._ready.pop(self._next, None)
        return self._ready.pop(next(iter(self._ready)))

    def _deliver(self, result: ChunkResult) -> ChunkResult:
        self.delivered += 1
        if result.index == self._next:
            self._next += 1
        self._slots.release()
        if result.error is not None:
            self.failures.append(result)
            if self._on_error == "raise":
                assert self._task_group is not None
                self._task_group.cancel_scope.cancel()
                error = result.error
                if hasattr(error, "add_note"):
                    error.add_note(f"(in chunk {result.index} on Ray actor {result.device})")
                raise error
        return result

    # -- the producers ----------------------------------------------------------------------
    async def _feed(self) -> None:
        assert self._task_group is not None
        index = 0
        try:
            async for host in _aiter(self._inputs):
                array = as_input(host)
                await self._slots.acquire()
                slot = await self._admit(array)
                self.admitted += 1
                self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
                self._task_group.start_soon(self._chunk, index, array, slot)
                index += 1
        except Exception as exc:
            self._send.send_nowait(_InputFailed(exc))
            return
        self._total = index
        self._send.send_nowait(None)  # wake a consumer waiting for a result that will not come

    async def _admit(self, array: npt.NDArray[Any]) -> ActorSlot:
        slot, self._cursor = await self._pool.admission.admit(
            self._placement, self._pool.slots, int(array.nbytes), self._cursor
        )
        return slot

    async def _chunk(self, index: int, host: npt.NDArray[Any], slot: ActorSlot) -> None:
        nbytes = int(host.nbytes)
        reserved_on: ActorSlot | None = slot  # the actor this task has a reservation on
        try:
            try:
                arg = await _argument(host)
                attempts = 0
                while True:
                    try:
                        result = ChunkResult(index, slot.index, await self._run(slot, arg), None)
                        break
                    except ActorLostError as lost:
                        if attempts >= self._retries or not self._pool.live:
                            result = ChunkResult(index, slot.index, None, lost)
                            break
                    attempts += 1
                    self.retried += 1
                    self._release(slot, nbytes)
                    reserved_on = None
                    slot = reserved_on = await self._admit(host)
            except Exception as exc:
                result = ChunkResult(index, slot.index, None, _refs.unwrap(exc))
        finally:
            if reserved_on is not None:
                self._release(reserved_on, nbytes)
        self._send.send_nowait(result)

    async def _run(self, slot: ActorSlot, arg: Any) -> npt.NDArray[Any]:
        """The chunk (``arg``: the array, or its reference in the store) run on
        ``slot``'s actor."""
        if slot.lost is not None:
            raise ActorLostError(_lost_message(slot, self._pool)) from slot.lost
        call = slot.actor.run.remote(self._key, arg)
        try:
            value: npt.NDArray[Any] = await _refs.result(call)
        except ray.exceptions.RayActorError as exc:
            self._pool._lose(slot, exc)
            raise ActorLostError(_lost_message(slot, self._pool)) from exc
        except BaseException:
            _refs.cancel(call)  # cancelled here (or the call failed): stop it there too
            raise
        return value

    def _release(self, slot: ActorSlot, nbytes: int) -> None:
        slot.completed += 1
        self._pool.admission.release(slot, nbytes)


async def _argument(host: npt.NDArray[Any]) -> Any:
    """What a chunk's actor calls get for ``host`` (see :data:`INLINE_LIMIT`)."""
    if host.nbytes <= INLINE_LIMIT:
        return host
    return await anyio.to_thread.run_sync(ray.put, host)


def _lost_message(slot: ActorSlot, pool: ActorPool) -> str:
    left = len(pool.live)
    return f"Ray actor {slot.index} died running the chunk ({left} of {len(pool.slots)} actors left)"
