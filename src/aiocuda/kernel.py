"""Kernels: attributes, occupancy and launches.

::

    saxpy = module.kernel("saxpy")                     # signature read from the source
    saxpy.launch(blocks, 256, a, x, y, n, stream=s)    # one-off launch
    go = saxpy.bind(blocks, 256, stream=s)             # prepared launcher: the fast path
    go(a, x, y, n); go(a, x2, y2, n)
    saxpy[blocks, 256, s](a, x, y, n)                  # numba-style, same as bind()
    await s                                            # wait for the kernels

Arguments are checked against the kernel's signature before anything reaches the
driver; a wrong count or type raises :class:`~aiocuda.errors.LaunchError` naming the
argument. Scalars: Python ``int``/``float``/``bool`` and numpy scalars that fit the
declared type (no silent truncation: ``1.5`` for an ``int`` fails, ``2**40`` for an
``int`` fails). Pointers: ``DeviceArray``, ``DeviceBuffer``, objects with
``__cuda_array_interface__``, ``int`` addresses, ``None``.

Cost: :meth:`Kernel.bind` builds, once, a function specialised for the signature and
the launch configuration (see :mod:`aiocuda._kernels.packing`), so calling it costs one
``struct`` pack and the driver call. :meth:`Kernel.launch` looks up such a launcher in a
small per-kernel cache first (and the current stream when none is given), which costs a
little more. Launches only enqueue: await the stream (or an event) for the results.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import _driver
from ._kernels.packing import ParamBuffer, build_launcher
from ._kernels.signature import Signature
from .device import Device, as_device
from .errors import LaunchError, ResultCode
from .module import Module
from .stream import Stream, current_stream

__all__ = ["Kernel", "KernelAttributes", "register_sim_kernel"]

Dim3 = int | tuple[int] | tuple[int, int] | tuple[int, int, int]
_LAUNCHER_CACHE_SIZE = 64


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


def _dim3(value: Dim3, what: str) -> tuple[int, int, int]:
    dims = (value,) if not isinstance(value, tuple) else value
    if not 1 <= len(dims) <= 3 or any(isinstance(d, bool) or not isinstance(d, int) for d in dims):
        raise LaunchError(f"{what} must be an int or a tuple of 1 to 3 ints, got {value!r}", name="AIOCUDA_BAD_CONFIG")
    if any(d < 1 for d in dims):
        raise LaunchError(f"{what} dimensions must be >= 1, got {value!r}", name="AIOCUDA_BAD_CONFIG")
    return (*dims, 1, 1)[:3]


class Kernel:
    """A ``__global__`` function of a :class:`~aiocuda.module.Module`, on any device.

    Obtain with ``module.kernel(name)``. The driver function is looked up lazily on each
    device the kernel is launched on (the device of the launch's stream).
    """

    __slots__ = ("__weakref__", "_functions", "_launchers", "_lock", "module", "name", "signature")

    def __init__(self, module: Module, name: str, signature: Signature | None = None) -> None:
        self.module = module
        self.name = name
        self.signature = signature if signature is not None else module.signatures.get(name)
        self._functions: dict[tuple[int, int], Any] = {}
        self._launchers: dict[tuple[Any, ...], Callable[..., None]] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        params = "?" if self.signature is None else ", ".join(p.describe() for p in self.signature)
        return f"<Kernel {self.name}({params})>"

    def _forget(self) -> None:
        """Drop functions and launchers (their module was unloaded)."""
        with self._lock:
            self._functions.clear()
            self._launchers.clear()

    # -- driver function and attributes ---------------------------------------------------------
    def function(self, device: Device | int | None = None) -> Any:
        """The driver's function handle on ``device`` (default 0), loading the module there."""
        dev = as_device(device)
        key = (_driver.backend_generation(), dev.ordinal)
        func = self._functions.get(key)
        if func is None:
            handle = self.module.handle(dev)
            dev.make_current()
            func = self._functions[key] = dev._driver.module_get_function(handle, self.module.symbol(self.name))
        return func

    def attribute(self, name: str, device: Device | int | None = None) -> int:
        """A ``CU_FUNC_ATTRIBUTE_*`` value by lowercase suffix (``"num_regs"``)."""
        dev = as_device(device)
        return dev._driver.function_get_attribute(self.function(dev), name)

    def set_attribute(self, name: str, value: int, device: Device | int | None = None) -> None:
        """Set a settable attribute, e.g. ``"max_dynamic_shared_size_bytes"`` before launching
        with more than 48 KiB of dynamic shared memory. ArgumentError where not allowed."""
        dev = as_device(device)
        dev.make_current()
        dev._driver.function_set_attribute(self.function(dev), name, int(value))

    def attributes(self, device: Device | int | None = None) -> KernelAttributes:
        """Registers, static shared/constant/local memory, limits and versions on ``device``."""
        get = self.attribute
        return KernelAttributes(**{field: get(field, device) for field in KernelAttributes.__dataclass_fields__})

    def max_active_blocks(self, block_size: int, shared_mem: int = 0, device: Device | int | None = None) -> int:
        """Occupancy: how many blocks of ``block_size`` threads fit on one multiprocessor."""
        dev = as_device(device)
        dev.make_current()
        return dev._driver.occupancy_max_active_blocks(self.function(dev), block_size, shared_mem)

    def suggested_block_size(self, shared_mem: int = 0, device: Device | int | None = None) -> tuple[int, int]:
        """``(min_grid_size, block_size)`` maximising occupancy (``cuOccupancyMaxPotentialBlockSize``):
        launch at least ``min_grid_size`` blocks of ``block_size`` threads to fill the GPU."""
        dev = as_device(device)
        dev.make_current()
        return dev._driver.occupancy_max_potential_block_size(self.function(dev), shared_mem)

    # -- launching ----------------------------------------------------------------------------------
    def bind(
        self,
        grid: Dim3,
        block: Dim3,
        *,
        stream: Stream | None = None,
        shared_mem: int = 0,
        cooperative: bool = False,
        cluster: Dim3 | None = None,
    ) -> Callable[..., None]:
        """A launcher: a plain function ``launch(*args)`` with this configuration fixed.

        The fastest way to launch the same kernel repeatedly. ``stream`` defaults to the
        current stream (resolved now, not per call); do not use the launcher after
        closing that stream. ``cooperative`` needs a grid whose
        blocks can all be resident at once; ``cluster`` (thread-block cluster dimensions,
        compute capability 9.0+) must divide the grid. Safe to call from several threads.
        """
        grid3, block3 = _dim3(grid, "grid"), _dim3(block, "block")
        cluster3 = None if cluster is None else _dim3(cluster, "cluster")
        if shared_mem < 0:
            raise LaunchError(f"shared_mem must be >= 0, got {shared_mem}", name="AIOCUDA_BAD_CONFIG")
        s = stream if stream is not None else current_stream()
        signature = self._require_signature()
        device = s.device
        func = self.function(device)
        device.make_current()
        backend = device._driver
        handle = s.handle

        def prepare(buffer: ParamBuffer) -> Any:
            return backend.prepare_launch(
                func, grid3, block3, shared_mem, handle, buffer, cooperative=cooperative, cluster=cluster3
            )

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
        grid: Dim3,
        block: Dim3,
        *args: Any,
        stream: Stream | None = None,
        shared_mem: int = 0,
        cooperative: bool = False,
        cluster: Dim3 | None = None,
    ) -> None:
        """Enqueue one launch on ``stream`` (default: the current stream). See :meth:`bind`."""
        s = stream if stream is not None else current_stream()
        key = (grid, block, s, shared_mem, cooperative, cluster)
        launcher = self._launchers.get(key)
        if launcher is None or s._closed:  # a closed stream's handle may be reused: never launch on it
            launcher = self.bind(grid, block, stream=s, shared_mem=shared_mem, cooperative=cooperative, cluster=cluster)
            self._remember(key, launcher)
        launcher(*args)

    def __getitem__(self, config: tuple[Any, ...]) -> Callable[..., None]:
        """``kernel[grid, block]``, ``kernel[grid, block, stream]`` or
        ``kernel[grid, block, stream, shared_mem]``: a cached launcher (see :meth:`bind`)."""
        try:
            launcher = self._launchers.get(config)  # keyed by the subscript itself when it names a stream
        except TypeError:  # unhashable: reported below
            launcher = None
        if launcher is not None and len(config) <= 4 and not config[2]._closed:
            return launcher
        if not isinstance(config, tuple) or not 2 <= len(config) <= 4:
            raise LaunchError(
                "use kernel[grid, block], kernel[grid, block, stream] or kernel[grid, block, stream, shared_mem]",
                name="AIOCUDA_BAD_CONFIG",
            )
        grid, block, *rest = config
        explicit = bool(rest) and rest[0] is not None
        s = rest[0] if explicit else current_stream()
        shared_mem = rest[1] if len(rest) > 1 else 0
        key = (grid, block, s, shared_mem, False, None)
        launcher = self._launchers.get(key)
        if launcher is None or s._closed:
            launcher = self.bind(grid, block, stream=s, shared_mem=shared_mem)
            self._remember(key, launcher)
        if explicit:
            self._remember(config, launcher)
        return launcher

    def _remember(self, key: tuple[Any, ...], launcher: Callable[..., None]) -> None:
        with self._lock:
            if len(self._launchers) >= _LAUNCHER_CACHE_SIZE:
                self._launchers.clear()
            self._launchers[key] = launcher

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

    An ``IndexError`` or ``ValueError`` it raises poisons the device with
    ``CUDA_ERROR_ILLEGAL_ADDRESS``, as an out-of-bounds access would on a GPU. For the
    simulator's other controls in your tests (pausing a stream, latencies, faults), see
    :mod:`aiocuda.testing`.
    """
    _driver.register_sim_kernel(name, impl)
