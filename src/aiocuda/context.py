"""CUDA contexts: their flags, limits and cache configuration, and making one current.

Every device has a *primary* context, shared by every library in the process (PyTorch,
CuPy, Numba and aiocuda all use it): :attr:`Device.context <aiocuda.Device.context>`.
aiocuda's streams, memory and kernels live there. A *user* context
(:meth:`Device.create_context <aiocuda.Device.create_context>`, ``cuCtxCreate``) is a
separate one on the same device, with flags and limits of its own, for code that drives
CUDA directly; destroy it with :meth:`Context.close`.

::

    device = aiocuda.Device(0)
    device.set_context_flags(schedule="blocking_sync")   # before the context is first used
    device.context.set_limit("malloc_heap_size", 64 << 20)
    with device.context:                                  # current on this thread in the block
        ...                                               # (raw cuda.bindings calls, libraries)
    await device.synchronize()                            # all of the device's work, off the loop

Scheduling flags say how a thread *blocked in the driver* waits for the GPU: in
``cuStreamSynchronize`` (:meth:`Stream.synchronize <aiocuda.Stream.synchronize>`),
``cuCtxSynchronize``, and the driver calls that wait for the device (unloading a
module, freeing pinned memory). ``"spin"`` busy-waits (a whole CPU core for as long as
the GPU works, the lowest wake-up latency), ``"yield"`` spins but yields the core to
other threads, ``"blocking_sync"`` sleeps on an OS primitive (no CPU, some tens of
microseconds more to wake up), and ``"auto"`` (the default) spins while the process has
fewer active contexts than CPUs, which is almost always. ``cuEventSynchronize``
(:meth:`Event.synchronize <aiocuda.Event.synchronize>`) follows the *event's* flag
instead: ``Event(blocking_sync=True)`` sleeps. aiocuda's own awaits never block in the
driver, so the flags do not change them; they matter for synchronous calls, worker
threads, and the libraries sharing the context (PyTorch's ``torch.cuda.synchronize()``
spins a core under ``"auto"``).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args

import anyio.to_thread

from ._util import NoPublicConstructor, invalid_value
from .errors import ArgumentError, CaptureError, ContextPoisonedError, CudaError

if TYPE_CHECKING:
    from .device import Device

__all__ = ["CacheConfig", "Context", "ContextFlags", "Limit", "Schedule"]

Schedule = Literal["auto", "spin", "yield", "blocking_sync"]
"""How a thread blocked in the driver waits for the GPU (see the module docstring)."""

CacheConfig = Literal["prefer_none", "prefer_shared", "prefer_l1", "prefer_equal"]
"""A preferred split of on-chip memory between L1 cache and shared memory."""

Limit = Literal[
    "stack_size",
    "printf_fifo_size",
    "malloc_heap_size",
    "dev_runtime_sync_depth",
    "dev_runtime_pending_launch_count",
    "max_l2_fetch_granularity",
    "persisting_l2_cache_size",
]
"""A context limit (``CU_LIMIT_*``): ``stack_size`` (bytes per GPU thread),
``printf_fifo_size`` and ``malloc_heap_size`` (bytes for device-side ``printf`` and
``malloc``), ``dev_runtime_sync_depth`` and ``dev_runtime_pending_launch_count``
(dynamic parallelism), ``max_l2_fetch_granularity`` (bytes, a hint), and
``persisting_l2_cache_size`` (bytes of L2 set aside for persisting accesses)."""

_SCHEDULES: dict[str, int] = {"auto": 0x0, "spin": 0x1, "yield": 0x2, "blocking_sync": 0x4}
_SCHED_MASK = 0x7
_LMEM_RESIZE_TO_MAX = 0x10


@dataclass(frozen=True, slots=True)
class ContextFlags:
    """A context's flags.

    Attributes:
        schedule: how threads blocked in the driver wait (see the module docstring).
        lmem_resize_to_max: keep local memory at its largest size after a kernel needed
            more (``CU_CTX_LMEM_RESIZE_TO_MAX``; recent drivers always do).
    """

    schedule: Schedule = "auto"
    lmem_resize_to_max: bool = False

    def __post_init__(self) -> None:
        if self.schedule not in _SCHEDULES:
            raise invalid_value(f"schedule must be one of {', '.join(_SCHEDULES)}, got {self.schedule!r}")
        if not isinstance(self.lmem_resize_to_max, bool):
            raise invalid_value(f"lmem_resize_to_max must be True or False, got {self.lmem_resize_to_max!r}")

    @property
    def value(self) -> int:
        """The flags as the driver numbers them (``CU_CTX_*``)."""
        return _SCHEDULES[self.schedule] | (_LMEM_RESIZE_TO_MAX if self.lmem_resize_to_max else 0)

    @classmethod
    def from_value(cls, value: int) -> ContextFlags:
        """The flags of a driver value (bits aiocuda does not name are ignored)."""
        by_value = {v: k for k, v in _SCHEDULES.items()}
        schedule: Any = by_value.get(value & _SCHED_MASK, "auto")
        return cls(schedule, bool(value & _LMEM_RESIZE_TO_MAX))


def _destroy(driver: Any, handle: Any) -> None:
    try:
        driver.context_destroy(handle)
    except Exception:  # a torn-down driver or a poisoned context: nothing left to destroy
        pass


class Context(metaclass=NoPublicConstructor):
    """A CUDA context of one device: the device's primary context
    (:attr:`Device.context <aiocuda.Device.context>`) or a user context
    (:meth:`Device.create_context <aiocuda.Device.create_context>`).

    ``with context:`` makes it current on the calling thread for the block
    (``cuCtxPushCurrent``) and restores what was current before, whoever had made it
    so (``cuCtxPopCurrent``). The context stack is per thread, not per task: in a
    coroutine, do not await inside the block while other tasks of the loop enter
    blocks of their own, or they pop each other's contexts. aiocuda's own calls bind
    the context they need themselves and need no block.

    Reading and setting flags, limits and the cache configuration makes the context
    current for the call only.
    """

    __slots__ = ("__weakref__", "_driver", "_finalizer", "_handle", "device", "primary")
    _factories = "Device.context or Device.create_context()"

    def __init__(self, device: Device, handle: Any, primary: bool) -> None:
        self.device = device
        self.primary = primary
        self._driver = device._driver
        self._handle = handle
        self._finalizer = None if primary else weakref.finalize(self, _destroy, self._driver, handle)

    def __repr__(self) -> str:
        kind = "primary" if self.primary else "user"
        state = " closed" if self.closed else ""
        return f"<Context {kind} device={self.device.ordinal}{state}>"

    # -- identity -----------------------------------------------------------------------------
    @property
    def handle(self) -> Any:
        """The backend's context handle (``int(handle)`` is the raw ``CUcontext``)."""
        if self.closed:
            raise ArgumentError("the context was closed", name="CUDA_ERROR_INVALID_CONTEXT")
        return self._handle

    @property
    def closed(self) -> bool:
        """True once a user context has been destroyed by :meth:`close`."""
        return self._finalizer is not None and not self._finalizer.alive

    def close(self) -> None:
        """Destroy a user context now (``cuCtxDestroy``, which waits for its work);
        the primary context is never destroyed, so this does nothing for it. Blocking:
        in a coroutine, ``await anyio.to_thread.run_sync(context.close)``."""
        if self._finalizer is not None:
            self._finalizer()

    # -- current on this thread ----------------------------------------------------------------
    def __enter__(self) -> Context:
        self._driver.context_push(self.handle)
        return self

    def __exit__(self, *exc: object) -> None:
        self._driver.context_pop()

    def _call(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` with this context current, then whatever was current before."""
        with self:
            return fn(*args)

    # -- flags, limits, cache configuration -----------------------------------------------------
    @property
    def flags(self) -> ContextFlags:
        """The context's flags, as the driver reports them now."""
        return ContextFlags.from_value(self._call(self._driver.context_get_flags))

    def limit(self, name: Limit) -> int:
        """The value of a limit (see :data:`Limit`); ArgumentError for an unknown name."""
        return int(self._call(self._driver.context_get_limit, name))

    def set_limit(self, name: Limit, value: int) -> None:
        """Set a limit (see :data:`Limit`); ArgumentError for an unknown name or a value
        the device refuses. The driver may round a size up: read it back with
        :meth:`limit`. Set ``printf_fifo_size`` and ``malloc_heap_size`` before the
        first kernel that uses ``printf`` or ``malloc``."""
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise invalid_value(f"a limit is an int >= 0, got {value!r}")
        self._call(self._driver.context_set_limit, name, value)

    def limits(self) -> dict[str, int]:
        """Every limit the device supports, by name."""
        names = self._driver.context_limit_names()
        out: dict[str, int] = {}
        with self:
            for name in names:
                try:
                    out[name] = self._driver.context_get_limit(name)
                except ContextPoisonedError:
                    raise
                except CudaError:  # a limit this device or driver does not support
                    continue
        return out

    @property
    def cache_config(self) -> CacheConfig:
        """The preferred split of on-chip memory between L1 and shared memory for the
        context's kernels (a kernel's own setting overrides it)."""
        config: CacheConfig = self._call(self._driver.context_get_cache_config)
        return config

    def set_cache_config(self, config: CacheConfig) -> None:
        """Set :attr:`cache_config`: ``"prefer_none"``, ``"prefer_shared"``,
        ``"prefer_l1"`` or ``"prefer_equal"`` (a preference the driver may not honour)."""
        if config not in get_args(CacheConfig):
            raise invalid_value(f"cache config must be one of {', '.join(get_args(CacheConfig))}, got {config!r}")
        self._call(self._driver.context_set_cache_config, config)

    # -- waiting --------------------------------------------------------------------------------
    async def synchronize(self) -> None:
        """Wait until all work of the context has finished (``cuCtxSynchronize``), on a
        worker thread: the event loop keeps running. That thread waits as the context's
        ``schedule`` flag says (spinning a core under ``"auto"``). Cancelling the wait
        abandons it; the worker returns once the device is idle.

        Refused (:class:`~aiocuda.errors.CaptureError`) while a stream of the context is
        being captured into a graph (:meth:`aiocuda.Stream.capture`): the driver would
        refuse it and fail the capture. Await the streams to wait for instead."""
        if self.primary and self.device._captures:
            raise CaptureError(
                "synchronizing the device's context cannot be done while a stream of it is being captured into "
                "a graph: the driver refuses it and fails the capture; await the streams to wait for, or "
                "synchronize after the capture",
                name="AIOCUDA_NOT_CAPTURABLE",
            )
        await anyio.to_thread.run_sync(self._synchronize_here, abandon_on_cancel=True)

    def _synchronize_here(self) -> None:
        self._call(self._driver.ctx_synchronize)
