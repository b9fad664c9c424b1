"""GPU pipelines on Ray: an executor per GPU actor, and a map over a pool of them.

Needs Ray (``pip install aiocuda[ray]``); ``import aiocuda`` alone never imports it.

    import aiocuda.ray

    async with aiocuda.ray.map(ScaleStage, chunks, actors=4, stage_args=(800,)) as results:
        async for r in results:             # input order; ordered=False: as completed
            use(r.value)                    # read-only, in the object store's shared memory

Each actor is a process with its own event loop and GIL and an
:class:`~aiocuda.executor.Executor` on the GPUs Ray assigns it (``num_gpus`` per actor,
``CUDA_VISIBLE_DEVICES`` respected; on the simulated backend each assigned GPU is a
simulated device): N actors on an N-GPU machine give each GPU its own host thread, and
the same code spans the machines of a cluster. The contract is that of
:meth:`Executor.map <aiocuda.executor.Executor.map>`: ordered or as completed,
back-pressure (``in_flight``, and ``chunks_per_actor`` on each actor), ``on_error``,
cancellation that stops the actors' work and returns its device memory. An actor that
dies has its chunks placed on the others (``retries``) or failed with
:class:`ActorLostError`, never dropped.

Stages travel to the actors by reference: a module-level function, or a class that each
actor instantiates once (``stage_args``) and keeps, so its kernels compile once per actor
(through the on-disk compile cache, shared by the actors of a machine). See
``docs/ray.md`` for when to use this rather than one :class:`~aiocuda.executor.Executor`.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Iterable
from typing import Any

import numpy.typing as npt

from .._executor.chunk_map import OnError
from .._executor.placement import PlacementName
from .._util import at_least
from ._actor import ActorStatistics, GpuActor
from ._pipeline import RayPipeline
from ._pool import ActorLostError, ActorPool, ActorSlot

__all__ = ["ActorLostError", "ActorPool", "ActorSlot", "ActorStatistics", "GpuActor", "RayPipeline", "map"]


def map(
    stage: Any,
    inputs: Iterable[npt.NDArray[Any]] | AsyncIterable[npt.NDArray[Any]],
    *,
    actors: int | ActorPool = 1,
    stage_args: tuple[Any, ...] = (),
    ordered: bool = True,
    in_flight: int | None = None,
    on_error: OnError = "raise",
    placement: PlacementName = "round_robin",
    retries: int = 1,
    **pool_options: Any,
) -> RayPipeline:
    """A pipeline applying ``stage`` to every host array of ``inputs`` on GPU actors; use
    it as ``async with aiocuda.ray.map(...) as results: async for r in results: ...``.

    Args:
        stage: what each actor runs per chunk, as for :meth:`Executor.map
            <aiocuda.executor.Executor.map>` (``stage(ctx, x)``, enqueueing on
            ``ctx.stream``): a module-level function, or a class whose instance (made
            once per actor from ``stage_args``) is the stage. Ray sends it by reference,
            so its module must be importable on the actors (one defined in ``__main__``
            is sent by value).
        inputs: numpy arrays (a sync or async iterable), read lazily.
        actors: a running :class:`ActorPool`, or how many actors to start for this map
            alone (with ``pool_options`` as :class:`ActorPool` arguments: ``num_gpus``,
            ``backend``, ...), ended when the block is left.
        stage_args: arguments for a class ``stage``.
        ordered: yield results in input order (default) or as they complete.
        in_flight: chunks admitted and not yet taken by the consumer, at most (default
            ``chunks_per_actor`` times the number of actors).
        on_error: ``"raise"``: the first failing chunk's exception (the stage's own,
            raised in the actor) leaves the iteration and every other chunk is
            cancelled; ``"continue"``: failures are yielded as results with ``.error``.
        placement: ``"round_robin"`` or ``"least_loaded"`` (fewest bytes placed); both
            skip actors at ``chunks_per_actor``.
        retries: times a chunk is placed again when its actor dies (it then fails with
            :class:`ActorLostError`).

    Results are :class:`~aiocuda.executor.ChunkResult` whose ``device`` is the index of
    the actor that ran the chunk and whose ``output`` is a read-only array in the object
    store (kept there while referenced). In the stage, ``ctx.index`` counts the actor's
    own chunks, not the position in ``inputs``.
    """
    if not callable(stage):
        raise TypeError(f"stage must be a function or a class, not {type(stage).__name__}")
    if not isinstance(ordered, bool):
        raise TypeError(f"ordered must be True or False, not {ordered!r}")
    if on_error not in ("raise", "continue"):
        raise ValueError(f"on_error must be 'raise' or 'continue', got {on_error!r}")
    if placement not in ("round_robin", "least_loaded"):
        raise ValueError(f"unknown placement {placement!r}: expected 'round_robin' or 'least_loaded'")
    if in_flight is not None:
        in_flight = at_least(in_flight, 1, "in_flight")
    retries = at_least(retries, 0, "retries")
    if stage_args and not isinstance(stage, type):
        raise TypeError("stage_args are for a class stage (instantiated once per actor)")
    if isinstance(actors, ActorPool):
        if pool_options:
            raise TypeError(f"options {sorted(pool_options)} are for a new pool, not a running one")
        pool, owns = actors, False
    else:
        pool, owns = ActorPool(actors, **pool_options), True
    return RayPipeline._create(
        stage,
        inputs,
        pool=pool,
        owns_pool=owns,
        stage_args=tuple(stage_args),
        ordered=ordered,
        in_flight=in_flight,
        on_error=on_error,
        placement=placement,
        retries=retries,
    )
