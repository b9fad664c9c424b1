"""A pool of GPU actors: creating them with their Ray resources, opening, closing, and
the per-actor load that placement reads."""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable
from typing import Any

import anyio
import ray
import ray.exceptions

from .._executor.placement import Admission
from .._util import NoPublicConstructor, a_number, at_least
from ..errors import ClosedError
from . import _refs, _transfer
from ._actor import ActorStatistics, GpuActor

__all__ = ["CLOSE_GRACE", "ActorLostError", "ActorPool", "ActorSlot"]

_RemoteGpuActor = ray.remote(GpuActor)

CLOSE_GRACE = 30.0
"""Seconds :meth:`ActorPool.aclose` gives the actors to finish their GPU work, by default."""

_UNLIMITED = 1 << 62
"""An actor's byte budget for placement: its own executor enforces device memory."""


class ActorLostError(RuntimeError):
    """A chunk's GPU actor died (or became unreachable) and the chunk could not be run
    elsewhere: no live actor was left, or it had used up its retries. ``__cause__`` is
    Ray's error, which says why the actor went."""


class ActorSlot(metaclass=NoPublicConstructor):
    """One actor of a pool and its load, as placement sees it (:attr:`ActorPool.slots`)."""

    _factories = "ActorPool"

    __slots__ = ("actor", "budget", "chunks", "completed", "index", "lost", "max_chunks", "reserved")

    failure = None
    """(Placement passes a lost actor over through its ``max_chunks``: see ``lost``.)"""

    def __init__(self, actor: Any, index: int, max_chunks: int) -> None:
        self.actor = actor
        self.index = index
        self.max_chunks = max_chunks
        self.budget = _UNLIMITED
        self.chunks = 0
        """Chunks placed on the actor and not yet finished."""
        self.reserved = 0
        """Bytes of those chunks' inputs."""
        self.completed = 0
        """Chunks finished on the actor (successfully or not)."""
        self.lost: BaseException | None = None
        """Ray's error, once the actor is known to be gone."""

    @property
    def alive(self) -> bool:
        return self.lost is None

    def __repr__(self) -> str:
        state = "lost" if self.lost is not None else f"chunks={self.chunks}/{self.max_chunks}"
        return f"<ActorSlot {self.index} {state} completed={self.completed}>"


class ActorPool:
    """GPU actors for :func:`aiocuda.ray.map`, each a process with its own event loop and
    an :class:`~aiocuda.executor.Executor` on the GPUs Ray gives it.

    Args:
        actors: how many actors.
        num_gpus: GPUs Ray reserves for each (``CUDA_VISIBLE_DEVICES`` then names them
            in the actor; a fraction shares a GPU between actors). On the simulated
            backend each assigned GPU is a simulated device.
        num_cpus: CPUs Ray reserves for each (for scheduling; an actor's loop thread
            is mostly idle while its GPU works).
        chunks_per_actor: chunks placed on one actor at most: the back-pressure that
            keeps a fast producer from queueing inputs in the object store.
        backend: ``"cuda"``, ``"sim"`` or ``"auto"`` for the actors; default: the
            ``AIOCUDA_BACKEND`` of the driver process (every ``AIOCUDA_*`` variable of
            the driver, the compile cache's ``AIOCUDA_CACHE_DIR`` among them, is passed
            to the actors), else ``auto``.
        setup: a module-level function each actor calls once, after selecting the
            backend and before opening its executor (sync or async).
        executor: keyword arguments of each actor's :class:`~aiocuda.executor.Executor`
            (``compute_streams``, ``chunks_per_device``, ``memory_fraction``).
        upload: how actors upload inputs from the object store (``"staging"`` or
            ``"register"``); default: the measured faster one.
        options: more Ray actor options (``resources``, ``scheduling_strategy``,
            ``runtime_env``, ...).

    Use as ``async with ActorPool(...) as pool`` (which waits until every actor has
    opened its executor, and on leaving waits for their GPU work, 30 s at most: see
    :meth:`aclose`, then ends them), or
    :meth:`start` / :meth:`wait_ready` / :meth:`aclose` for a pool that outlives one
    block. A pool can serve many :func:`~aiocuda.ray.map` calls, one after the other or
    at once (they share ``chunks_per_actor``); its actors keep their compiled kernels
    and memory pools between them. Once ended, a pool does not start again (it raises
    :class:`~aiocuda.errors.ClosedError`): make a new one.
    """

    def __init__(
        self,
        actors: int = 1,
        *,
        num_gpus: float = 1,
        num_cpus: float = 1,
        chunks_per_actor: int = 8,
        backend: str | None = None,
        setup: Callable[[], Any] | None = None,
        executor: dict[str, Any] | None = None,
        upload: _transfer.UploadName | None = None,
        options: dict[str, Any] | None = None,
    ) -> None:
        actors = at_least(actors, 1, "actors")
        if a_number(num_gpus, "num_gpus") <= 0:
            raise ValueError(f"a GPU actor needs num_gpus > 0, got {num_gpus}")
        a_number(num_cpus, "num_cpus")
        chunks_per_actor = at_least(chunks_per_actor, 1, "chunks_per_actor")
        if upload not in (None, "staging", "register"):
            raise ValueError(f"upload must be 'staging' or 'register', got {upload!r}")
        self._count = actors
        self._chunks_per_actor = chunks_per_actor
        self._actor_args = (backend, setup, dict(executor or {}), upload or _transfer.UPLOAD)
        self._options = _actor_options(num_gpus, num_cpus, dict(options or {}))
        self._slots: tuple[ActorSlot, ...] = ()
        self._opening: list[Any] | None = None
        """The actors' ``open`` calls, made once and awaited by every :meth:`wait_ready`."""
        self._waiting = 0
        """Callers of :meth:`wait_ready` awaiting the opening now."""
        self._ready = False
        self._ended = False
        self.admission = Admission()
        """Placement's reservations on the actors, shared by every map over the pool."""

    # -- lifetime -----------------------------------------------------------------------------
    def start(self) -> None:
        """Create the actors (Ray starts their processes in the background). Raises
        ``RuntimeError`` when the Ray cluster has fewer GPUs than the actors take
        together, which Ray would wait for forever; where its autoscaler may add them,
        warns instead. A pool ended (:meth:`aclose`, :meth:`kill`) does not start
        again: :class:`~aiocuda.errors.ClosedError`."""
        if self._ended:
            raise ClosedError(
                "this ActorPool was ended (aclose(), kill(), or its actors failed to open): make a new one"
            )
        if not self._slots:
            if not ray.is_initialized():
                ray.init()  # as Ray's first call would (its auto-init), so that its GPUs can be counted
            _check_gpus(self._count, self._options["num_gpus"])
            remote = _RemoteGpuActor.options(**self._options)
            self._slots = tuple(
                ActorSlot._create(remote.remote(*self._actor_args), i, self._chunks_per_actor)
                for i in range(self._count)
            )

    async def wait_ready(self) -> list[ActorStatistics]:
        """Start the actors if needed and wait until each has opened its executor; raises
        the first actor's error (say, no usable device) after ending them all. Calls made
        at once (maps started together over a new pool) wait for the same opening; so do
        later ones, which return each actor's statistics as it opened."""
        self.start()
        if self._opening is None:
            self._opening = [slot.actor.open.remote() for slot in self._slots]
        self._waiting += 1
        try:
            stats = [await _refs.value(ref) for ref in self._opening]
        except BaseException as exc:
            # An error ends the actors; so does cancelling the last caller still waiting
            # (no one is left to close them). Another caller goes on waiting.
            if isinstance(exc, Exception) or self._waiting == 1:
                self.kill()
            raise
        finally:
            self._waiting -= 1
        self._check_live()
        self._ready = True
        return stats

    async def __aenter__(self) -> ActorPool:
        await self.wait_ready()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self, grace: float = CLOSE_GRACE) -> None:
        """Let each live actor finish its GPU work and close its executor, for ``grace``
        seconds at most, then end every actor (:meth:`kill`). Cancelling the caller ends
        them at once: a kernel that never finishes holds neither the pool nor a map's
        timeout."""
        # With Ray down, its actors went with it (and a call would start a new Ray).
        closing = [(slot, slot.actor.close.remote()) for slot in self.live] if ray.is_initialized() else []
        try:
            with anyio.move_on_after(grace):
                for slot, ref in closing:
                    try:
                        await _refs.result(ref)
                    except ray.exceptions.RayError as exc:
                        slot.lost = slot.lost or exc
        finally:
            self.kill()

    def kill(self) -> None:
        """End every actor now (``ray.kill``), whatever it is doing; the pool does not
        start again."""
        running = ray.is_initialized()  # (if not, the actors went with Ray)
        for slot in self._slots:
            if running:
                try:
                    ray.kill(slot.actor)
                except Exception:  # already gone
                    pass
            slot.lost = slot.lost or ActorLostError(f"actor {slot.index} was ended by the pool")
        self._ready = False
        self._ended = True

    # -- state --------------------------------------------------------------------------------
    @property
    def slots(self) -> tuple[ActorSlot, ...]:
        """Every actor with its load, in creation order (read-only use)."""
        return self._slots

    @property
    def live(self) -> list[ActorSlot]:
        """The actors not known to be gone."""
        return [slot for slot in self._slots if slot.alive]

    @property
    def actors(self) -> list[Any]:
        """The live actors' Ray handles (call their methods as ``handle.run.remote(...)``)."""
        return [slot.actor for slot in self.live]

    @property
    def chunks_per_actor(self) -> int:
        return self._chunks_per_actor

    @property
    def ready(self) -> bool:
        """Whether every actor opened, and since then the pool was not closed nor lost
        its last actor."""
        return self._ready

    async def statistics(self) -> list[ActorStatistics | None]:
        """Each actor's counters (None for one that is gone), in creation order."""
        _refs.check_running()
        refs = [slot.actor.statistics.remote() if slot.alive else None for slot in self._slots]
        out: list[ActorStatistics | None] = []
        for slot, ref in zip(self._slots, refs, strict=True):
            if ref is None:
                out.append(None)
                continue
            try:
                out.append(await _refs.value(ref))
            except ray.exceptions.RayActorError as exc:
                self._lose(slot, exc)
                out.append(None)
        return out

    async def call(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """Run ``fn(executor, *args)`` on every live actor (a module-level function,
        sync or async) and return the results in actor order."""
        _refs.check_running()
        refs = [slot.actor.call.remote(fn, *args) for slot in self.live]
        return [await _refs.value(ref) for ref in refs]

    async def _answers(self, slot: ActorSlot) -> bool:
        """Whether ``slot``'s actor answers a call; one that does not is lost to the pool."""
        _refs.check_running()
        try:
            await _refs.result(slot.actor.statistics.remote())
        except ray.exceptions.RayActorError as exc:
            self._lose(slot, exc)
            return False
        return True

    def _lose(self, slot: ActorSlot, error: BaseException) -> None:
        """Record that ``slot``'s actor is gone: placement skips it from now on, unless
        no actor is left (then chunks are still placed, and fail at once, and the pool is
        no longer :attr:`ready`)."""
        if slot.lost is None:
            slot.lost = error
        live = self.live
        for each in self._slots:
            each.max_chunks = self._chunks_per_actor if (each.alive or not live) else 0
        if not live:
            self._ready = False

    def _check_live(self) -> None:
        """Raise :class:`ActorLostError` if no actor of the pool is left."""
        if not self.live:
            raise ActorLostError(f"all {len(self._slots)} Ray actors of the pool are gone") from self._slots[0].lost

    def __repr__(self) -> str:
        if not self._slots:
            return f"<ActorPool not started actors={self._count}>"
        load = ", ".join("lost" if not s.alive else f"{s.chunks}" for s in self._slots)
        return f"<ActorPool [{len(self.live)}/{len(self._slots)} live | chunks: {load}]>"


def _actor_options(num_gpus: float, num_cpus: float, options: dict[str, Any]) -> dict[str, Any]:
    """Ray options for the pool's actors: resources, no restarts or task retries (a
    chunk whose actor died is placed elsewhere by the map), and the driver's ``AIOCUDA_*``
    environment."""
    forwarded = {k: v for k, v in os.environ.items() if k.startswith("AIOCUDA_")}
    chosen = {"num_gpus": num_gpus, "num_cpus": num_cpus, "max_restarts": 0, "max_task_retries": 0, **options}
    if forwarded:
        runtime_env = dict(chosen.get("runtime_env") or {})
        runtime_env["env_vars"] = {**forwarded, **dict(runtime_env.get("env_vars") or {})}
        chosen["runtime_env"] = runtime_env
    return chosen


def _check_gpus(actors: int, num_gpus: float) -> None:
    """Raise if the Ray cluster cannot give ``actors`` actors ``num_gpus`` GPUs each (Ray
    waits for resources without end); warn if only its autoscaler can."""
    needed = actors * num_gpus
    present = ray.cluster_resources().get("GPU", 0)
    if needed <= present:
        return
    most = _autoscaled_gpus()
    need = f"ActorPool({actors}, num_gpus={num_gpus:g}) needs GPUs: {needed:g}, and the Ray cluster has {present:g}"
    if most >= needed:
        warnings.warn(f"{need}: the pool waits for its autoscaler to add them", RuntimeWarning, stacklevel=3)
        return
    most_text = f" (at most {most:g} with its autoscaler)" if most > present else ""
    raise RuntimeError(
        f"{need}{most_text}: Ray would wait for them forever. Ask for fewer, or, on the simulated"
        " backend (no GPU), declare GPUs to Ray: ray.init(num_gpus=N)"
    )


def _autoscaled_gpus() -> float:
    """The most GPUs the Ray cluster's autoscaler may reach: 0 for a cluster that does not
    autoscale (or whose autoscaler publishes no configuration, as Ray's first one did),
    infinity where Ray cannot say."""
    # Ray's autoscaler (v2) publishes its node groups; Ray Train and Ray Data read them
    # so, through this private call.
    try:
        from ray._private.state import state

        most = state.get_max_resources_from_cluster_config()
    except Exception:  # changed or gone in this Ray: no way to tell, so no error
        return math.inf
    return 0.0 if most is None else float(most.get("GPU", 0))
