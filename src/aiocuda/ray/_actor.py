"""The GPU actor: one process, its event loop, and an :class:`~aiocuda.executor.Executor`
on the GPUs Ray assigned to it.

Ray starts the actor's process with ``CUDA_VISIBLE_DEVICES`` naming its GPUs, so the
driver shows it those devices only, numbered from 0; the executor uses all of them. On
the simulated backend each assigned GPU becomes one simulated device. Methods are
coroutines run on the actor's asyncio loop, many at once (Ray's async actor): each chunk
is one :meth:`GpuActor.run` call, and concurrent calls overlap on the executor's streams
as a pipeline's chunks do.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import os
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import numpy.typing as npt
import ray

from .. import _driver
from ..device import Device
from ..executor import Executor
from ..memory import MemoryPool
from . import _transfer

__all__ = ["ActorStatistics", "GpuActor", "assigned_devices"]

_STAGE_CACHE = 16
"""Stage instances an actor keeps for reuse by later pipelines, at most."""


@dataclass(frozen=True, slots=True)
class ActorStatistics:
    """A snapshot of one GPU actor (:meth:`aiocuda.ray.ActorPool.statistics`)."""

    pid: int
    """The actor's process id."""
    backend: str
    """``"cuda"`` or ``"sim"``."""
    devices: tuple[str, ...]
    """Names of the devices its executor uses."""
    in_flight: int
    """Chunks it is running now."""
    completed: int
    """Chunks it ran to the end."""
    failed: int
    """Chunks whose stage or copies raised."""
    cancelled: int
    """Chunks cancelled while running (their device memory returned)."""
    used_bytes: int
    """Device memory in use in its executor's pools, all devices together."""
    upload: str
    """How it uploads inputs: ``"staging"`` or ``"register"``."""
    uploads_direct: int
    """Uploads read straight from pinned object-store memory (``"register"``)."""
    uploads_staged: int
    """Uploads copied through pinned staging."""
    stages_created: int
    """Stage objects it has made (a class stage is instantiated once per actor)."""


def assigned_devices(gpu_ids: list[Any], visible: int) -> list[Device] | None:
    """The devices an actor given ``gpu_ids`` by Ray should use, when it sees ``visible``
    devices: all of them where Ray restricted visibility to its GPUs (the usual case),
    otherwise the devices whose ordinals Ray assigned. None means every device."""
    if visible == len(gpu_ids):
        return None
    try:
        return [Device(int(i)) for i in gpu_ids]
    except ValueError:  # GPU ids given as UUIDs: only visibility can select them
        return None


class GpuActor:
    """A Ray actor owning an :class:`~aiocuda.executor.Executor` (use through
    :class:`aiocuda.ray.ActorPool`, which creates, opens and closes it)."""

    def __init__(
        self,
        backend: str | None,
        setup: Callable[[], Any] | None,
        executor: dict[str, Any],
        upload: _transfer.UploadName,
    ) -> None:
        self._backend = backend
        self._setup = setup
        self._executor_options = executor
        self._upload = upload
        self._executor: Executor | None = None
        self._opening: asyncio.Future[None] | None = None
        self._pins = _transfer.StorePins()
        self._stages: dict[str, Any] = {}
        self._instances: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()
        self._stages_created = 0
        self._in_flight = 0
        self._completed = 0
        self._failed = 0
        self._cancelled = 0

    async def open(self) -> ActorStatistics:
        """Select the backend, run the setup function, open the executor: once, however
        many calls come (Ray runs an async actor's calls at once: those that come while
        it opens await the same opening, and share its error)."""
        if self._opening is None:
            self._opening = asyncio.ensure_future(self._open())
        # Shielded: a caller cancelled by Ray leaves the opening to the others.
        await asyncio.shield(self._opening)
        return self._statistics()

    async def _open(self) -> None:
        gpu_ids = ray.get_gpu_ids()
        if not gpu_ids:
            raise RuntimeError("a GPU actor needs num_gpus > 0: Ray assigned it no GPU")
        name = self._backend or os.environ.get("AIOCUDA_BACKEND", "auto").strip().lower() or "auto"
        # Options reach only the simulator: one simulated device per assigned GPU.
        backend = _driver.use_backend(name, devices=len(gpu_ids))
        if self._setup is not None:
            done = self._setup()
            if inspect.isawaitable(done):
                await done
        chosen = assigned_devices(gpu_ids, backend.device_count())
        executor = Executor(chosen, **self._executor_options)
        await executor.__aenter__()
        self._executor = executor

    async def close(self) -> None:
        """Wait for the executor's GPU work, close it, unpin the store's pages."""
        executor, self._executor = self._executor, None
        if executor is not None:
            await executor.__aexit__(None, None, None)
        self._pins.close()

    async def prepare(self, key: str, stage: Any, stage_args: tuple[Any, ...]) -> None:
        """Make ``stage`` ready under ``key``: a class is instantiated with
        ``stage_args`` (once per actor for equal classes and arguments), anything else is
        the stage itself."""
        if not inspect.isclass(stage):
            self._stages[key] = stage
            return
        try:
            identity: Hashable | None = (stage, stage_args)
            hash(identity)
        except TypeError:  # unhashable arguments: no reuse
            identity = None
        instance = self._instances.get(identity) if identity is not None else None
        if instance is None:
            instance = stage(*stage_args)
            self._stages_created += 1
            if identity is not None:
                self._instances[identity] = instance
                if len(self._instances) > _STAGE_CACHE:
                    self._instances.popitem(last=False)
        elif identity is not None:
            self._instances.move_to_end(identity)
        self._stages[key] = instance

    async def forget(self, key: str) -> None:
        """Drop the stage prepared under ``key`` (a cached instance stays for reuse)."""
        self._stages.pop(key, None)

    async def run(self, key: str, host: npt.NDArray[Any]) -> npt.NDArray[Any]:
        """Run one chunk through the stage prepared under ``key``; return its result."""
        executor = self._open_executor()
        stage = self._stages[key]
        self._in_flight += 1
        try:
            if self._upload == "register":
                await self._pins.pin(host)
            else:
                self._pins.staged += 1
            output = await executor.submit(stage, host, output=_transfer.download_buffer)
        except asyncio.CancelledError:
            self._cancelled += 1
            raise
        except Exception:
            self._failed += 1
            raise
        finally:
            self._in_flight -= 1
        self._completed += 1
        return output

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(executor, *args)`` on the actor's loop (awaited if it returns an
        awaitable) and return its result."""
        done = fn(self._open_executor(), *args)
        if inspect.isawaitable(done):
            done = await done
        return done

    async def statistics(self) -> ActorStatistics:
        """The actor's counters now."""
        return self._statistics()

    def _statistics(self) -> ActorStatistics:
        executor = self._executor
        used = 0
        names: tuple[str, ...] = ()
        if executor is not None:
            names = tuple(d.name for d in executor.devices)
            used = sum(MemoryPool.for_device(d).statistics().used_bytes for d in executor.devices)
        return ActorStatistics(
            pid=os.getpid(),
            backend=_driver.driver().name if executor is not None else "",
            devices=names,
            in_flight=self._in_flight,
            completed=self._completed,
            failed=self._failed,
            cancelled=self._cancelled,
            used_bytes=used,
            upload=self._upload,
            uploads_direct=self._pins.direct,
            uploads_staged=self._pins.staged,
            stages_created=self._stages_created,
        )

    def _open_executor(self) -> Executor:
        if self._executor is None:
            raise RuntimeError("the GPU actor is not open (ActorPool opens its actors)")
        return self._executor
