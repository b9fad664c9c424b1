"""Kernels: attributes, occupancy and launches.

::

    saxpy = module.kernel("saxpy")                     # signature read from the source
    saxpy.launch(blocks, 256, a, x, y, n, stream=s)    # one-off launch
    go = saxpy.bind(blocks, 256, stream=s)             # prepared launcher: the fast path
    go(a, x, y, n); go(a, x2, y2, n)
    saxpy[blocks, 256, s](a, x, y, n)                  # numba-style, same as bind()
    config = LaunchConfig(blocks, 256, shared_mem=1024)
    saxpy.launch(config, a, x, y, n, stream=s)         # each form also takes a LaunchConfig
    await s                                            # wait for the kernels

The launch configuration (grid, block, dynamic shared memory, cluster, cooperative) is
checked by :class:`LaunchConfig`, whichever form gives it. Arguments are checked against
the kernel's signature before anything reaches the driver; a wrong count or type raises
:class:`~aiocuda.errors.LaunchError` naming the argument. Scalars: Python
``int``/``float``/``bool`` and numpy scalars that fit the declared type (no silent
truncation: ``1.5`` for an ``int`` fails, ``2**40`` for an ``int`` fails). Pointers:
``DeviceArray``, ``DeviceBuffer``, objects with ``__cuda_array_interface__``, ``int``
addresses, ``None``; an array must have the declared element type (a ``float64`` array
for a ``float*`` fails), except for ``void*`` and byte pointers, which take any, must be
C-contiguous (a kernel gets its first element's address only: a strided view fails), and
must be on the kernel's device unless it is managed memory (:mod:`aiocuda.managed`).

Cost: :meth:`Kernel.bind` builds, once, a function specialised for the signature and
the launch configuration (see :mod:`aiocuda._kernels.packing`), so calling it costs one
``struct`` pack and the driver call. :meth:`Kernel.launch` and ``kernel[...]`` look up
such a launcher in a small per-kernel cache first (and the current stream when none is
given), which costs a little more. Launches only enqueue: await the stream (or an
event) for the results.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio.to_thread

from . import _driver
from ._driver import Dim3, LaunchConfig
from ._graph import kernels as _graph_kernels
from ._kernels.packing import ParamBuffer, build_launcher
from ._kernels.signature import Signature
from ._util import NoPublicConstructor
from .context import CacheConfig
from .device import Device, _as_device
from .errors import ArgumentError, CudaError, LaunchError, ResultCode
from .module import Module
from .stream import Stream, current_stream

__all__ = ["Kernel", "KernelAttributes", "LaunchConfig", "register_sim_kernel"]

_LAUNCHER_CACHE_SIZE = 512
"""Launchers a kernel keeps (each spelling of a configuration is an entry): room for two
spellings on each stream of 64 lanes at three priorities."""
_CONFIG: Any = object()
"""``launch``'s ``block`` when not given: the first argument is a :class:`LaunchConfig`."""


@dataclass(frozen=True, slots=True)
class KernelAttributes:
    """A kernel's compiled properties on one device (``cuFuncGetAttribute``)."""

    num_regs: int
    shared_size_bytes: int
    const_size_bytes: int
    local_size_bytes: int
    max_threads_per_block: int
    ptx_version: int
    binary_version: int
    max_dynamic_shared_size_bytes: int


def _config(
    grid: Dim3 | LaunchConfig, block: Any, shared_mem: int, cooperative: bool, cluster: Dim3 | None
) -> LaunchConfig:
    """The launch configuration of a ``bind``/``launch``/subscript call, checked."""
    if isinstance(grid, LaunchConfig):
        defaults = shared_mem.__class__ is int and not shared_mem and cooperative is False and cluster is None
        if (block is not None and block is not _CONFIG) or not defaults:
            raise LaunchError(
                "a LaunchConfig carries block, shared_mem, cooperative and cluster: pass them to it",
                name="AIOCUDA_BAD_CONFIG",
            )
        return grid
    if block is None or block is _CONFIG:
        raise LaunchError("give the block dimensions too (or one LaunchConfig)", name="AIOCUDA_BAD_CONFIG")
    return LaunchConfig(grid, block, shared_mem=shared_mem, cooperative=cooperative, cluster=cluster)


def _checked(config: Any) -> LaunchConfig:
    if not isinstance(config, LaunchConfig):
        raise LaunchError(f"give a LaunchConfig, not {type(config).__name__}", name="AIOCUDA_BAD_CONFIG")
    return config


def _stream(stream: Any) -> Stream:
    """``stream``, or the current stream for None; LaunchError for anything but a Stream."""
    if stream is None:
        return current_stream()
    if not isinstance(stream, Stream):
        hint = " (wrap a foreign stream with aiocuda.Stream.wrap(obj))" if hasattr(stream, "__cuda_stream__") else ""
        raise LaunchError(
            f"stream must be an aiocuda Stream, got {type(stream).__name__} {stream!r}{hint}",
            name="AIOCUDA_BAD_CONFIG",
        )
    return stream


def _exact_dims(*dims: Any) -> bool:
    """True when each of ``dims`` is an int or a tuple of ints: a cache key that no float
    or bool can equal."""
    for value in dims:
        cls = value.__class__
        if cls is not int:
            if cls is not tuple:
                return False
            for d in value:  # loops, not all(...): no generator to create on this path
                if d.__class__ is not int:
                    return False
    return True


def _plain(grid: Any, block: Any, shared_mem: Any, cooperative: Any, cluster: Any) -> bool:
    """Whether ``launch``'s cache key holds only exact ints and bools (or a LaunchConfig)."""
    if grid.__class__ is LaunchConfig:
        return True
    if shared_mem.__class__ is not int or cooperative.__class__ is not bool:
        return False
    return _exact_dims(grid, block) if cluster is None else _exact_dims(grid, block, cluster)


def _plain_subscript(parts: tuple[Any, ...]) -> bool:
    """Whether a subscript names its stream and holds only exact ints (or a LaunchConfig):
    the subscripts cached under themselves."""
    if parts[0].__class__ is LaunchConfig:
        return len(parts) == 2 and isinstance(parts[1], Stream)
    return (
        3 <= len(parts) <= 4
        and isinstance(parts[2], Stream)
        and _exact_dims(parts[0], parts[1])
        and (len(parts) == 3 or parts[3].__class__ is int)
    )


def _subscript_stream(parts: tuple[Any, ...]) -> Stream:
    """The stream of a subscript, or of any key of a kernel's launcher cache."""
    stream: Stream = parts[1] if parts[0].__class__ is LaunchConfig else parts[2]
    return stream


class Kernel(metaclass=NoPublicConstructor):
    """A ``__global__`` function of a :class:`~aiocuda.module.Module`, on any device.

    Obtain with ``module.kernel(name)``. The driver function is looked up lazily on each
    device the kernel is launched on (the device of the launch's stream).
    """

    __slots__ = ("__weakref__", "_functions", "_launchers", "_lock", "_unloads", "module", "name", "signature")
    _factories = "Module.kernel(name)"

    def __init__(self, module: Module, name: str, signature: Signature | None = None) -> None:
        self.module = module
        self.name = name
        self.signature = signature if signature is not None else module.signatures.get(name)
        self._functions: dict[tuple[int, int], Any] = {}
        self._launchers: dict[tuple[Any, ...], Callable[..., None]] = {}
        self._lock = threading.Lock()
        # How many times the module was unloaded: a launcher made (or found) before an
        # unload and remembered after it would hold the unloaded module's function.
        self._unloads = 0

    def __repr__(self) -> str:
        params = "?" if self.signature is None else ", ".join(p.describe() for p in self.signature)
        return f"<Kernel {self.name}({params})>"

    def _forget(self) -> None:
        """Drop functions and launchers (their module was unloaded)."""
        with self._lock:
            self._functions.clear()
            self._launchers.clear()
            self._unloads += 1

    # -- driver function and attributes ---------------------------------------------------------
    def function(self, device: Device | int | None = None) -> Any:
        """The driver's function handle on ``device`` (default 0), loading the module there."""
        dev = _as_device(device)
        key = (_driver.backend_generation(), dev.ordinal)
        func = self._functions.get(key)
        if func is None:
            func = self._look_up(dev, key)
        return func

    def _look_up(self, device: Device, key: tuple[int, int]) -> Any:
        """:meth:`function` when ``key`` is not cached: the function looked up in the
        module loaded on ``device``, and cached."""
        module = self.module
        # Under the module's lock, from the module's handle to the function's place in
        # the cache, as Module.get_global does: an unload() on another thread in between
        # forgot this kernel's functions before this one joined them, so the function of
        # the unloaded module stayed cached and every later launch used it.
        with module._lock:
            func = self._functions.get(key)
            if func is not None:  # (another thread looked it up meanwhile)
                return func
            handle = module._handle_locked(device)
            device.make_current()
            try:
                func = device._driver.module_get_function(handle, module.symbol(self.name))
            except ArgumentError as exc:
                if exc.code != ResultCode.NOT_FOUND:
                    raise
                missing = exc
            else:
                self._functions[key] = func
                _graph_kernels.register(device._driver, func, self)  # so that graphs can read its nodes
                return func
        raise self._not_found(device, missing) from missing  # (unlocked: listing the kernels takes the lock)

    def _not_found(self, device: Device, exc: ArgumentError) -> ArgumentError:
        """The error for a kernel its module does not define, listing those it does."""
        # The driver says only "named symbol not found": a misspelling, a template
        # compiled without its name expression and a mangled name look alike there.
        try:
            defined: str = str(self.module.kernel_names(device))
        except CudaError:  # (cuModuleEnumerateFunctions needs a CUDA 12.4 driver)
            defined = "kernels that could not be listed"
        hint = ""
        if "<" in self.name and self.name not in self.module.lowered_names:
            hint = f"; compile it with Program(..., name_expressions=[{self.name!r}])"
        module = self.module.name or self.module.kind
        return ArgumentError.like(exc, f"module {module!r} has no kernel {self.name!r}: it defines {defined}{hint}")

    async def load(self, device: Device | int | None = None) -> None:
        """Load the kernel's module on ``device`` (default 0) and look the kernel up, on a
        worker thread: ``await kernel.load(device)`` at a service's start-up.

        The first launch on a device does this otherwise, on the launching thread -- in a
        coroutine, the event loop's -- where the driver makes it wait for kernels already
        running on the device. On the worker thread the wait still holds other threads'
        event records (a loop's awaits) meanwhile: load before long kernels run."""
        dev = _as_device(device)
        if (_driver.backend_generation(), dev.ordinal) not in self._functions:
            await anyio.to_thread.run_sync(self.function, dev)

    def attribute(self, name: str, device: Device | int | None = None) -> int:
        """A ``CU_FUNC_ATTRIBUTE_*`` value by lowercase suffix (``"num_regs"``)."""
        dev = _as_device(device)
        return dev._driver.function_get_attribute(self.function(dev), name)

    def set_attribute(self, name: str, value: int, device: Device | int | None = None) -> None:
        """Set a settable attribute, e.g. ``"max_dynamic_shared_size_bytes"`` before launching
        with more than 48 KiB of dynamic shared memory. ArgumentError where not allowed."""
        dev = _as_device(device)
        dev.make_current()
        dev._driver.function_set_attribute(self.function(dev), name, int(value))

    def attributes(self, device: Device | int | None = None) -> KernelAttributes:
        """Registers, static shared/constant/local memory, limits and versions on ``device``."""
        get = self.attribute
        return KernelAttributes(**{field: get(field, device) for field in KernelAttributes.__dataclass_fields__})

    def set_cache_config(self, config: CacheConfig, device: Device | int | None = None) -> None:
        """The kernel's preferred split of on-chip memory between L1 and shared memory
        (``cuFuncSetCacheConfig``): ``"prefer_none"``, ``"prefer_shared"``,
        ``"prefer_l1"`` or ``"prefer_equal"``. A preference; it overrides the context's
        (:meth:`aiocuda.Context.set_cache_config`) for this kernel."""
        dev = _as_device(device)
        dev.make_current()
        dev._driver.function_set_cache_config(self.function(dev), config)

    def max_active_blocks(
        self,
        block_size: int,
        shared_mem: int = 0,
        device: Device | int | None = None,
        *,
        caching_override: bool = True,
    ) -> int:
        """Occupancy: how many blocks of ``block_size`` threads fit on one multiprocessor.

        ``caching_override=False`` asks what fits when the global caching setting does
        not override the kernel's own cache configuration
        (``CU_OCCUPANCY_DISABLE_CACHING_OVERRIDE``)."""
        dev = _as_device(device)
        dev.make_current()
        return dev._driver.occupancy_max_active_blocks(self.function(dev), block_size, shared_mem, not caching_override)

    def suggested_block_size(
        self,
        shared_mem: int = 0,
        device: Device | int | None = None,
        *,
        max_block_size: int = 0,
        caching_override: bool = True,
    ) -> tuple[int, int]:
        """``(min_grid_size, block_size)`` maximising occupancy (``cuOccupancyMaxPotentialBlockSize``):
        launch at least ``min_grid_size`` blocks of ``block_size`` threads to fill the GPU.
        ``max_block_size`` caps the block size (0: the kernel's limit)."""
        dev = _as_device(device)
        dev.make_current()
        return dev._driver.occupancy_max_potential_block_size(
            self.function(dev), shared_mem, max_block_size, not caching_override
        )

    def available_shared_memory(self, blocks_per_sm: int, block_size: int, device: Device | int | None = None) -> int:
        """Dynamic shared memory per block, in bytes, that still lets ``blocks_per_sm``
        blocks of ``block_size`` threads run on one multiprocessor at once
        (``cuOccupancyAvailableDynamicSMemPerBlock``); 0 when they cannot fit anyway."""
        dev = _as_device(device)
        dev.make_current()
        return dev._driver.occupancy_available_dynamic_smem(self.function(dev), blocks_per_sm, block_size)

    def max_active_clusters(self, config: LaunchConfig, device: Device | int | None = None) -> int:
        """How many thread-block clusters of ``config.cluster`` (and its block and shared
        memory) can be resident on the device at once (``cuOccupancyMaxActiveClusters``)."""
        dev = _as_device(device)
        dev.make_current()
        return dev._driver.occupancy_max_active_clusters(self.function(dev), _checked(config))

    def max_cluster_size(self, config: LaunchConfig, device: Device | int | None = None) -> int:
        """The largest cluster size (blocks) this kernel can launch with ``config``'s
        block and shared memory (``cuOccupancyMaxPotentialClusterSize``); above 8 needs
        the ``non_portable_cluster_size_allowed`` attribute set."""
        dev = _as_device(device)
        dev.make_current()
        return dev._driver.occupancy_max_potential_cluster_size(self.function(dev), _checked(config))

    # -- launching ----------------------------------------------------------------------------------
    def bind(
        self,
        grid: Dim3 | LaunchConfig,
        block: Dim3 | None = None,
        *,
        stream: Stream | None = None,
        shared_mem: int = 0,
        cooperative: bool = False,
        cluster: Dim3 | None = None,
    ) -> Callable[..., None]:
        """A launcher: a plain function ``launch(*args)`` with this configuration fixed.

        ``kernel.bind(grid, block, ...)`` or ``kernel.bind(config, stream=...)`` with a
        :class:`LaunchConfig` (see it for what each option means). The fastest way to
        launch the same kernel repeatedly. ``stream`` defaults to the current stream
        (resolved now, not per call); do not use the launcher after closing that stream.
        Safe to call from several threads.
        """
        config = _config(grid, block, shared_mem, cooperative, cluster)
        s = _stream(stream)
        signature = self._require_signature()
        device = s.device
        func = self.function(device)
        device.make_current()
        backend = device._driver
        handle = s.handle

        def prepare(buffer: ParamBuffer) -> Any:
            return backend.prepare_launch(func, config, handle, buffer)

        raise_error = prepare(ParamBuffer(signature))[2]

        def fail(err: Any, args: tuple[Any, ...]) -> None:
            if int(err) == ResultCode.INVALID_CONTEXT:  # first use on a thread without the context
                device.make_current()
                buffer = ParamBuffer(signature)
                buffer.pack(args, s)
                fn, fn_args, _ = prepare(buffer)
                err = fn(*fn_args)[0]
                if not err:
                    return
            raise_error(err)

        return build_launcher(self.name, signature, prepare, s, fail)

    def launch(
        self,
        grid: Dim3 | LaunchConfig,
        block: Any = _CONFIG,
        *args: Any,
        stream: Stream | None = None,
        shared_mem: int = 0,
        cooperative: bool = False,
        cluster: Dim3 | None = None,
    ) -> None:
        """Enqueue one launch on ``stream`` (default: the current stream):
        ``kernel.launch(grid, block, *args, ...)`` or ``kernel.launch(config, *args, ...)``.
        See :meth:`bind`."""
        s = stream if stream is not None else current_stream()
        if grid.__class__ is LaunchConfig:  # then ``block`` is the first kernel argument
            if block is not _CONFIG:
                args = (block, *args)
            block = None
            if shared_mem.__class__ is not int or shared_mem or cooperative is not False or cluster is not None:
                _config(grid, block, shared_mem, cooperative, cluster)  # raises: the config has them
            key: tuple[Any, ...] = (grid, s)
        else:
            key = (grid, block, s, shared_mem, cooperative, cluster)
        try:
            launcher = self._launchers.get(key)
        except TypeError:  # unhashable: bind() reports it
            launcher = None
        # A cached launcher serves only the exact ints it was made for: 1.0 == 1 and
        # True == 1 would otherwise find it, where bind() refuses them.
        if (
            launcher is None
            or s._closed
            or not (
                (
                    grid.__class__ is int
                    and block.__class__ is int
                    and shared_mem.__class__ is int
                    and cluster is None
                    and (cooperative is False or cooperative is True)
                )
                or _plain(grid, block, shared_mem, cooperative, cluster)
            )
        ):
            plain = _plain(grid, block, shared_mem, cooperative, cluster)
            launcher = self._launcher(_config(grid, block, shared_mem, cooperative, cluster), _stream(s), plain, key)
        launcher(*args)

    def __getitem__(self, config: Any) -> Callable[..., None]:
        """A cached launcher (see :meth:`bind`): ``kernel[grid, block]``,
        ``kernel[grid, block, stream]``, ``kernel[grid, block, stream, shared_mem]``,
        ``kernel[config]`` or ``kernel[config, stream]``."""
        try:
            launcher = self._launchers.get(config)  # keyed by the subscript itself when it names a stream
        except TypeError:  # unhashable: reported below
            launcher = None
        if launcher is not None:  # config is a tuple: only tuples are cached
            if len(config) == 3 and config[0].__class__ is int and config[1].__class__ is int:
                if not config[2]._closed:
                    return launcher
            elif _plain_subscript(config) and not _subscript_stream(config)._closed:
                return launcher
        parts = config if isinstance(config, tuple) else (config,)
        if isinstance(parts[0], LaunchConfig) and len(parts) <= 2:
            launch_config, rest = parts[0], parts[1:]
        elif 2 <= len(parts) <= 4:
            shared_mem = parts[3] if len(parts) > 3 else 0
            launch_config, rest = _config(parts[0], parts[1], shared_mem, False, None), parts[2:3]
        else:
            raise LaunchError(
                "use kernel[grid, block], kernel[grid, block, stream], kernel[grid, block, stream, shared_mem], "
                "kernel[config] or kernel[config, stream]",
                name="AIOCUDA_BAD_CONFIG",
            )
        explicit = bool(rest) and rest[0] is not None
        s = _stream(rest[0] if explicit else None)
        return self._launcher(launch_config, s, explicit and _plain_subscript(parts), parts)

    def _launcher(
        self, config: LaunchConfig, stream: Stream, remember: bool = False, spelling: tuple[Any, ...] = ()
    ) -> Callable[..., None]:
        """The cached launcher of ``config`` on ``stream``, made now if needed: the cache
        every call form shares, whatever spelling of the configuration it was given.
        With ``remember``, it is cached under the call form's ``spelling`` too."""
        unloads = self._unloads  # (first: see _remember)
        key = (config, stream)
        launcher = self._launchers.get(key)
        if launcher is None or stream._closed:
            launcher = self.bind(config, stream=stream)
            self._remember(key, launcher, unloads)
        if remember:
            self._remember(spelling, launcher, unloads)
        return launcher

    def _remember(self, key: tuple[Any, ...], launcher: Callable[..., None], unloads: int) -> None:
        """Cache ``launcher`` under ``key``, unless the module was unloaded since the
        kernel had ``unloads`` (the launcher may hold the unloaded module's function)."""
        with self._lock:
            if self._unloads != unloads:
                return
            launchers = self._launchers
            if len(launchers) >= _LAUNCHER_CACHE_SIZE:
                # Room: first the launchers of closed streams, else the oldest entry (a
                # cache emptied at once was rebuilt on every round over a service's lanes).
                for old in [k for k in launchers if _subscript_stream(k)._closed]:
                    del launchers[old]
                if len(launchers) >= _LAUNCHER_CACHE_SIZE:
                    del launchers[next(iter(launchers))]
            launchers[key] = launcher

    def _pack(self, args: tuple[Any, ...]) -> ParamBuffer:
        """``args`` packed for this kernel's signature (a graph's kernel node update);
        LaunchError naming a bad argument."""
        buffer = ParamBuffer(self._require_signature())
        buffer.pack(args, None)
        return buffer

    def _require_signature(self) -> Signature:
        if self.signature is None:
            raise LaunchError(
                f"the parameters of kernel {self.name!r} are unknown (not parsed from its source or PTX): "
                f"declare them, e.g. module.kernel({self.name!r}, signature='const float*, float*, int')",
                name="AIOCUDA_NO_SIGNATURE",
            )
        return self.signature


def register_sim_kernel(name: str, impl: Callable[..., object] | None) -> None:
    """Register a Python implementation of kernel ``name`` for the simulated backend
    (``None`` removes it).

    Works whichever backend is in use (the registry is process-wide and only the
    simulated backend reads it), so an application can register its fallbacks
    unconditionally. For a template kernel, register the name expression
    (``"axpy<float>"``) or the bare name.

    ``impl(launch, *args)`` runs on the stream's worker thread, in stream order, and
    computes the whole grid at once (vectorised numpy):

    * ``launch`` has ``grid``, ``block``, ``shared_mem``, ``name``, ``cooperative`` and
      ``cluster``;
    * a pointer argument arrives as a writable 1-D numpy array of the pointee type
      (``uint8`` for ``void*``) from the pointer to the end of its allocation: slice
      it to the length you need (NULL arrives as ``None``);
    * a scalar arrives as a numpy scalar of the declared type.

    Anything it raises (an ``IndexError`` of an out-of-bounds index, a failed assert, a
    ``pytest.fail()``) poisons the device with ``CUDA_ERROR_ILLEGAL_ADDRESS``, as an
    out-of-bounds access would on a GPU; the awaiting task gets
    :class:`~aiocuda.errors.ContextPoisonedError` with that exception as its cause. For the
    simulator's other controls in your tests (pausing a stream, latencies, faults), see
    :mod:`aiocuda.testing`.
    """
    _driver.register_sim_kernel(name, impl)
