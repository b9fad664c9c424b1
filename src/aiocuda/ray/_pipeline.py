"""One map over a pool of GPU actors: the driver's side.

A feeder task reads the inputs, waits for a free slot (``in_flight`` chunks between
admission and delivery, at most) and for an actor with room (``chunks_per_actor``,
placement as in the executor: :mod:`aiocuda._executor.placement`), then starts one task per
chunk. Each large input is put into the object store as soon as the feeder reads it, before
those waits, by the map's put threads (:data:`PUT_THREADS`), in input order: the puts run
while the actor works on earlier chunks, and the first chunk's call waits for one put, not
for all those that fit in flight. A chunk task awaits its put (small inputs travel inside
the call), calls the actor, and awaits the result, which it hands to the consumer; the
consumer receives them in input order or as they complete, and frees the slot by taking
one.

An actor that dies fails its chunks with Ray's ``RayActorError``: each is placed again
on a live actor (its input is still in the store), up to ``retries`` times, and
otherwise delivered as an :class:`~aiocuda.ray.ActorLostError`; never dropped.
Cancellation (leaving the block early, cancelling the consumer, a chunk's error under
``on_error="raise"``) cancels every chunk task, and each asks Ray to cancel its actor
call: a running call gets ``CancelledError`` on the actor's loop, where the executor
returns the chunk's device memory.
"""

from __future__ import annotations

import concurrent.futures
import uuid
from collections.abc import AsyncIterable, Iterable
from types import TracebackType
from typing import Any

import numpy.typing as npt
import ray
import ray.exceptions

from .._executor.chunk import ChunkResult
from .._executor.chunk_map import ChunkMap, OnError
from .._executor.placement import PlacementName
from .._util import NoPublicConstructor
from . import _refs
from ._pool import ActorLostError, ActorPool, ActorSlot

__all__ = ["INLINE_LIMIT", "PUT_THREADS", "RayPipeline"]

INLINE_LIMIT = 100 << 10
"""Inputs up to this size travel inside the actor call (as Ray inlines small arguments:
no store round trip); larger ones are put into the object store first, on one of the
map's put threads (a large put is a memory copy), and the call passes the reference."""

# A put is Ray's own copy into the store (its serializer splits copies over 1 MiB across
# 6 threads, with the GIL released) between round trips to the store (create, seal): a
# second put overlaps those round trips and the serialisation of the next input. More
# only share the copy's memory bandwidth, so that every put of the batch finishes late
# and the first chunk's call waits for all of them. Before, a window's puts all started
# at once (simulated backend, 2 cores, 16 chunks of 16 MiB, one actor: each of 8 puts
# took 26-28 ms where one alone takes 9-12, the first call came at 35-46 ms, and chunk
# k + 8's put finished 19-24 ms after chunk k was delivered); in order on two threads a
# put takes 9-12 ms, the first call comes at 14 ms and chunk k + 8 is in the store 8-11
# ms before chunk k is delivered. 1, 2 and 4 threads were within the noise there.
PUT_THREADS = 2
"""Threads putting one map's inputs into the object store, in input order."""


class RayPipeline(ChunkMap, metaclass=NoPublicConstructor):
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
    _ran_on = "Ray actor"

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
        super().__init__(inputs, ordered=ordered, on_error=on_error)
        self._stage = stage
        self._stage_args = stage_args
        self._pool = pool
        self._owns_pool = owns_pool
        self._requested_limit = in_flight
        self._placement = placement
        self._retries = retries
        self._key = uuid.uuid4().hex
        self._cursor = 0
        self._putter: concurrent.futures.ThreadPoolExecutor | None = None
        self._puts: dict[int, concurrent.futures.Future[Any]] = {}
        self.retried = 0

    @property
    def pool(self) -> ActorPool:
        """The actors this map runs on."""
        return self._pool

    # -- lifetime ---------------------------------------------------------------------------
    async def __aenter__(self) -> RayPipeline:
        if self._owns_pool or not self._pool.ready:
            await self._pool.wait_ready()
        try:
            await self._prepare()
        except BaseException:
            await self._close_pool()
            raise
        limit = self._requested_limit or self._pool.chunks_per_actor * len(self._pool.live)
        self._putter = concurrent.futures.ThreadPoolExecutor(PUT_THREADS, thread_name_prefix="aiocuda-ray-put")
        await self._open(limit)
        self._feed_soon()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        try:
            return await self._close(exc_type, exc, tb)
        finally:
            if self._putter is not None:  # a put already running ends in its thread, its ref dropped
                self._putter.shutdown(wait=False, cancel_futures=True)
            self._puts.clear()
            if ray.is_initialized():  # (else the actors went with Ray, and a call would start a new one)
                for slot in self._pool.live:
                    slot.actor.forget.remote(self._key)
            await self._close_pool()

    async def _prepare(self) -> None:
        """Prepare the stage on every live actor. One found gone is lost to the pool and
        the map runs on the others; when none is left, raises :class:`ActorLostError`.
        Another error (the stage class raised, say) is raised once every actor has
        answered (each answer read: Ray reports an error never read as unhandled)."""
        _refs.check_running()
        live = self._pool.live
        calls = [slot.actor.prepare.remote(self._key, self._stage, self._stage_args) for slot in live]
        error: Exception | None = None
        for slot, call in zip(live, calls, strict=True):
            try:
                await _refs.value(call)
            except ray.exceptions.RayActorError as exc:
                self._pool._lose(slot, exc)
            except Exception as exc:
                error = error or exc
        if error is not None:
            raise error
        self._pool._check_live()

    async def _close_pool(self) -> None:
        if self._owns_pool:
            await self._pool.aclose()

    # -- the producers ----------------------------------------------------------------------
    def _input_read(self, index: int, array: npt.NDArray[Any]) -> None:
        if array.nbytes > INLINE_LIMIT:
            assert self._putter is not None
            self._puts[index] = self._putter.submit(_put, array)

    async def _start_chunk(self, index: int, array: npt.NDArray[Any]) -> None:
        assert self._task_group is not None
        slot = await self._admit(array)
        self._admitted()
        self._task_group.start_soon(self._chunk, index, array, self._puts.pop(index, None), slot)

    async def _admit(self, array: npt.NDArray[Any]) -> ActorSlot:
        slot, self._cursor = await self._pool.admission.admit(
            self._placement, self._pool.slots, int(array.nbytes), self._cursor
        )
        return slot

    async def _admit_again(self, array: npt.NDArray[Any]) -> ActorSlot:
        """An actor for a chunk placed again after its actor died: one that answers a
        call first, so that actors that died with it (a node lost) but are not yet known
        to be gone do not use up its retries. With no live actor left, any (the chunk
        then fails at once)."""
        nbytes = int(array.nbytes)
        while True:
            slot = await self._admit(array)
            keep = False
            try:
                keep = slot.lost is not None or await self._pool._answers(slot)
            finally:
                if not keep:  # gone (or this task cancelled, or Ray down): its place given back
                    self._pool.admission.release(slot, nbytes)
            if keep:
                return slot

    async def _chunk(
        self, index: int, host: npt.NDArray[Any], put: concurrent.futures.Future[Any] | None, slot: ActorSlot
    ) -> None:
        """Run chunk ``index`` (its put into the store, None for one that travels inside
        the call) on ``slot``'s actor, placed again if the actor dies; send the result."""
        nbytes = int(host.nbytes)
        reserved_on: ActorSlot | None = slot  # the actor this task has a reservation on
        try:
            try:
                arg = host if put is None else await _refs.completed(put)
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
                    slot = reserved_on = await self._admit_again(host)
            except Exception as exc:
                result = ChunkResult(index, slot.index, None, _refs.unwrap(exc))
        finally:
            if reserved_on is not None:
                self._release(reserved_on, nbytes)
        self._send_result(result)

    async def _run(self, slot: ActorSlot, arg: Any) -> npt.NDArray[Any]:
        """The chunk (``arg``: the array, or its reference in the store) run on
        ``slot``'s actor."""
        if slot.lost is not None:
            raise ActorLostError(_lost_message(slot, self._pool)) from slot.lost
        _refs.check_running()
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


def _put(array: npt.NDArray[Any]) -> Any:
    """``array`` put into the object store (on a put thread), unless Ray does not run."""
    _refs.check_running()
    return ray.put(array)


def _lost_message(slot: ActorSlot, pool: ActorPool) -> str:
    left = len(pool.live)
    return f"Ray actor {slot.index} died running the chunk ({left} of {len(pool.slots)} actors left)"
