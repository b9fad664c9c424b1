"""Simulated modules and kernels: Python implementations registered under a kernel's name.

There is no compiler in the sim. A "module image" is one of:

* a sim image (what :class:`aiocuda.Program` produces on the sim backend): the
  ``SIM_IMAGE_MAGIC`` line followed by the kernel names the source defines, one a line;
* PTX text: its ``.entry`` names are the kernels;
* anything else (cubin, fatbin bytes): accepted, defining no names of its own.

``module_get_function(module, name)`` succeeds when the image defines ``name`` or an
implementation is registered under it; launching a function with no registered
implementation raises :class:`~aiocuda.errors.LaunchError` (``CUDA_ERROR_NOT_FOUND``
-- there is nothing to run) before anything is enqueued.

Implementations (:meth:`SimModules.register_kernel`) are process-wide, shared by every
SimDriver, so registering once survives backend switches. An implementation is called on
the stream's worker thread, in stream order, as ``impl(launch, *args)``:

* ``launch`` is a :class:`SimLaunch` (``name`` and ``config``, with ``grid``, ``block``,
  ``shared_mem``, ``cooperative`` and ``cluster`` read from the config);
* a pointer argument arrives as a writable 1-D numpy array of the pointee type (from the
  kernel's signature; ``uint8`` for ``void*``) starting at the pointer and running to the
  end of its allocation -- slice it to the length you need (NULL arrives as ``None``);
* a scalar arrives as a numpy scalar of the declared type.

It computes the whole grid's result at once (vectorised numpy), not per thread. An
``IndexError``/``ValueError`` it raises poisons the device with ``ILLEGAL_ADDRESS``, as
an out-of-bounds access would on a GPU. For a template kernel the implementation is
looked up under the full name expression (``"axpy<float>"``) first, then the bare name.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import LaunchError, ResultCode
from .._launch import LaunchConfig
from ._attributes import H100_ATTRIBUTES
from ._codes import sim_error
from ._objects import next_handle_value

__all__ = ["SIM_IMAGE_MAGIC", "SimFunction", "SimLaunch", "SimModule", "SimModules", "register_kernel"]

SIM_IMAGE_MAGIC = b"AIOCUDA-SIM-MODULE 1\n"

_PTX_ENTRY = re.compile(r"\.entry\s+([\w$]+)")

KernelImpl = Callable[..., object]
_registry: dict[str, KernelImpl] = {}
_registry_lock = threading.Lock()

_FUNCTION_DEFAULTS = {
    "max_threads_per_block": 1024,
    "shared_size_bytes": 0,
    "const_size_bytes": 0,
    "local_size_bytes": 0,
    "num_regs": 32,
    "ptx_version": 90,
    "binary_version": 90,
    "cache_mode_ca": 0,
    "max_dynamic_shared_size_bytes": 49152,
    "preferred_shared_memory_carveout": -1,
    "cluster_size_must_be_set": 0,
    "required_cluster_width": 0,
    "required_cluster_height": 0,
    "required_cluster_depth": 0,
    "non_portable_cluster_size_allowed": 0,
    "cluster_scheduling_policy_preference": 0,
}
_SETTABLE = {
    "max_dynamic_shared_size_bytes",
    "preferred_shared_memory_carveout",
    "required_cluster_width",
    "required_cluster_height",
    "required_cluster_depth",
    "non_portable_cluster_size_allowed",
    "cluster_scheduling_policy_preference",
}


@dataclass(frozen=True, slots=True)
class SimLaunch:
    """What a kernel implementation learns about its launch: the kernel's ``name`` and
    its :class:`~aiocuda.LaunchConfig` (also readable as ``grid``, ``block``,
    ``shared_mem``, ``cooperative`` and ``cluster``)."""

    name: str
    config: LaunchConfig

    @property
    def grid(self) -> tuple[int, int, int]:
        return self.config.grid

    @property
    def block(self) -> tuple[int, int, int]:
        return self.config.block

    @property
    def shared_mem(self) -> int:
        return self.config.shared_mem

    @property
    def cooperative(self) -> bool:
        return self.config.cooperative

    @property
    def cluster(self) -> tuple[int, int, int] | None:
        return self.config.cluster


class SimModule:
    """A loaded module: the kernel names its image defines, on one device."""

    __slots__ = ("device_ordinal", "names", "unloaded", "value")

    def __init__(self, device_ordinal: int, names: frozenset[str]) -> None:
        self.value = next_handle_value()
        self.device_ordinal = device_ordinal
        self.names = names
        self.unloaded = False

    def __repr__(self) -> str:
        return f"<SimModule {self.value:#x} device={self.device_ordinal} kernels={sorted(self.names)}>"


class SimFunction:
    """A kernel handle: its module, name and (settable) attributes."""

    __slots__ = ("attributes", "module", "name", "value")

    def __init__(self, module: SimModule, name: str) -> None:
        self.value = next_handle_value()
        self.module = module
        self.name = name
        self.attributes = dict(_FUNCTION_DEFAULTS)

    def __repr__(self) -> str:
        return f"<SimFunction {self.name!r} device={self.module.device_ordinal}>"


def _image_names(image: bytes) -> frozenset[str]:
    if image.startswith(SIM_IMAGE_MAGIC):
        return frozenset(line for line in image[len(SIM_IMAGE_MAGIC) :].decode().splitlines() if line)
    head = image[:4096]
    if b".entry" in image and (b".version" in head or b".target" in head):
        return frozenset(_PTX_ENTRY.findall(image.decode(errors="replace")))
    return frozenset()


def register_kernel(name: str, impl: KernelImpl | None) -> None:
    """Run ``impl(launch, *args)`` for launches of kernel ``name`` (None unregisters)."""
    with _registry_lock:
        if impl is None:
            _registry.pop(name, None)
        else:
            _registry[name] = impl


def _implementation(name: str) -> KernelImpl | None:
    impl = _registry.get(name)
    if impl is None and "<" in name:
        impl = _registry.get(name.partition("<")[0].strip())
    return impl


class SimModules:
    """Mixin of SimDriver: modules, functions, occupancy and launches (module docstring)."""

    _api: Callable[..., None]
    _enqueue: Callable[..., None]
    _device_of_current: Callable[[], int]
    _stream_ordinal: Callable[[Any], int]
    _mem: Callable[[], Any]

    # -- test control -------------------------------------------------------------------------
    def register_kernel(self, name: str, impl: KernelImpl | None) -> None:
        """Run ``impl(launch, *args)`` for launches of kernel ``name`` (None unregisters).

        Process-wide: every SimDriver sees it. See the module docstring for the calling
        convention.
        """
        register_kernel(name, impl)

    # -- modules ------------------------------------------------------------------------------
    def module_load_data(self, image: bytes) -> SimModule:
        self._api("module_load_data")
        if not image:
            raise sim_error(ResultCode.INVALID_IMAGE, "module_load_data", "empty module image")
        return SimModule(self._device_of_current(), _image_names(bytes(image)))

    def module_unload(self, module: Any) -> None:
        self._api("module_unload", self._module(module, "module_unload").device_ordinal)
        module.unloaded = True

    def module_get_function(self, module: Any, name: str) -> SimFunction:
        mod = self._module(module, "module_get_function")
        self._api("module_get_function", mod.device_ordinal)
        if name not in mod.names and _implementation(name) is None:
            raise sim_error(
                ResultCode.NOT_FOUND,
                "module_get_function",
                f"no kernel named {name!r} in the module (it defines {sorted(mod.names) or 'no names'}) "
                f"and no simulated implementation is registered under it",
            )
        return SimFunction(mod, name)

    def _module(self, module: Any, call: str) -> SimModule:
        if type(module) is not SimModule or module.unloaded:
            raise sim_error(ResultCode.INVALID_HANDLE, call, f"not a loaded simulated module: {module!r}")
        return module

    def _function(self, func: Any, call: str) -> SimFunction:
        if type(func) is not SimFunction or func.module.unloaded:
            raise sim_error(ResultCode.INVALID_HANDLE, call, f"not a function of a loaded module: {func!r}")
        return func

    # -- attributes and occupancy ---------------------------------------------------------------
    def function_get_attribute(self, func: Any, attribute: str) -> int:
        fn = self._function(func, "function_get_attribute")
        self._api("function_get_attribute", fn.module.device_ordinal)
        if attribute not in fn.attributes:
            raise sim_error(ResultCode.INVALID_VALUE, "function_get_attribute", f"unknown attribute {attribute!r}")
        return fn.attributes[attribute]

    def function_set_attribute(self, func: Any, attribute: str, value: int) -> None:
        fn = self._function(func, "function_set_attribute")
        self._api("function_set_attribute", fn.module.device_ordinal)
        if attribute not in _SETTABLE:
            raise sim_error(ResultCode.INVALID_VALUE, "function_set_attribute", f"{attribute!r} cannot be set")
        if attribute == "max_dynamic_shared_size_bytes":
            limit = H100_ATTRIBUTES["max_shared_memory_per_block_optin"] - fn.attributes["shared_size_bytes"]
            if not 0 <= value <= limit:
                raise sim_error(
                    ResultCode.INVALID_VALUE, "function_set_attribute", f"{value} is outside 0..{limit} bytes"
                )
        fn.attributes[attribute] = int(value)

    def occupancy_max_active_blocks(self, func: Any, block_size: int, dynamic_smem: int) -> int:
        fn = self._function(func, "occupancy_max_active_blocks")
        self._api("occupancy_max_active_blocks", fn.module.device_ordinal)
        return _blocks_per_sm(fn, block_size, dynamic_smem)

    def occupancy_max_potential_block_size(self, func: Any, dynamic_smem: int) -> tuple[int, int]:
        fn = self._function(func, "occupancy_max_potential_block_size")
        self._api("occupancy_max_potential_block_size", fn.module.device_ordinal)
        best, best_threads = 32, 0
        for size in range(32, fn.attributes["max_threads_per_block"] + 1, 32):
            threads = _blocks_per_sm(fn, size, dynamic_smem) * size
            if threads >= best_threads:  # ties go to the larger block, as the driver does
                best, best_threads = size, threads
        return _blocks_per_sm(fn, best, dynamic_smem) * H100_ATTRIBUTES["multiprocessor_count"], best

    # -- launches --------------------------------------------------------------------------------
    def launch_kernel(self, func: Any, config: LaunchConfig, stream: Any, params: Any) -> None:
        self._launch(func, config, stream, params)

    def prepare_launch(
        self, func: Any, config: LaunchConfig, stream: Any, params: Any
    ) -> tuple[Callable[..., tuple[int]], tuple[Any, ...], Callable[[Any], None]]:
        """``(fn, args, fail)``: ``fn(*args)`` launches with ``params``' contents at call time.

        The sim raises from ``fn`` itself, so ``fail`` is never called.
        """
        return self._launch_result, (func, config, stream, params), _never

    def _launch_result(self, func: Any, config: LaunchConfig, stream: Any, params: Any) -> tuple[int]:
        self._launch(func, config, stream, params)
        return (0,)

    def _launch(self, func: Any, config: LaunchConfig, stream: Any, params: Any) -> None:
        call = "launch_kernel"
        fn = self._function(func, call)
        ordinal = self._stream_ordinal(stream)
        self._api(call, ordinal)
        if ordinal != fn.module.device_ordinal:
            raise sim_error(
                ResultCode.INVALID_HANDLE,
                call,
                f"kernel {fn.name!r} is loaded on device {fn.module.device_ordinal}, the stream is on device {ordinal}",
            )
        self._enqueue(stream, _KernelRun.make(self._mem(), fn, config, params, call), call)


class _KernelRun:
    """A kernel launch, run on a stream's worker (or as a graph node): the implementation
    called with the arguments as they were when it was enqueued."""

    __slots__ = ("config", "func", "impl", "signature", "state", "values")

    def __init__(
        self,
        state: Any,
        func: SimFunction,
        config: LaunchConfig,
        impl: KernelImpl,
        values: tuple[Any, ...],
        signature: Any,
    ) -> None:
        self.state = state
        self.func = func
        self.config = config
        self.impl = impl
        self.values = values
        self.signature = signature

    @staticmethod
    def make(state: Any, fn: SimFunction, config: LaunchConfig, params: Any, call: str) -> _KernelRun:
        """Check what the driver checks at launch and capture the arguments' current values."""
        _check_config(fn, config, call)
        impl = _implementation(fn.name)
        if impl is None:
            raise LaunchError(
                f"{call}: kernel {fn.name!r} has no simulated implementation: register one with "
                f"SimDriver.register_kernel({fn.name!r}, impl) (or aiocuda.register_sim_kernel)",
                code=ResultCode.NOT_FOUND,
                name="CUDA_ERROR_NOT_FOUND",
                call=call,
            )
        return _KernelRun(state, fn, config, impl, params.values, getattr(params, "signature", None))

    def __call__(self) -> None:
        values, signature = self.values, self.signature
        args = values if signature is None else _typed_arguments(self.state, signature, values, self.func.name)
        self.impl(SimLaunch(self.func.name, self.config), *args)

    def describe(self) -> dict[str, Any]:
        return {"func": self.func, "config": self.config}

    def replaced(self, func: Any, config: LaunchConfig, params: Any) -> _KernelRun:
        """The launch with another function, configuration and arguments (a graph's kernel
        node update): the function must be loaded on the same device."""
        call = "cuGraphExecKernelNodeSetParams"
        if type(func) is not SimFunction or func.module.unloaded:
            raise sim_error(ResultCode.INVALID_HANDLE, call, f"not a function of a loaded module: {func!r}")
        if func.module.device_ordinal != self.func.module.device_ordinal:
            raise sim_error(ResultCode.INVALID_VALUE, call, "the function is loaded on another device")
        return _KernelRun.make(self.state, func, config, params, call)


def _never(err: Any) -> None:
    raise AssertionError(f"the simulated launch reports errors by raising, not {err!r}")


def _blocks_per_sm(fn: SimFunction, block_size: int, dynamic_smem: int) -> int:
    a = H100_ATTRIBUTES
    if block_size <= 0 or block_size > fn.attributes["max_threads_per_block"]:
        return 0
    warps = -(-block_size // 32)
    by_threads = a["max_threads_per_multiprocessor"] // (warps * 32)
    by_regs = a["max_registers_per_multiprocessor"] // max(1, fn.attributes["num_regs"] * warps * 32)
    smem = fn.attributes["shared_size_bytes"] + dynamic_smem + a["reserved_shared_memory_per_block"]
    by_smem = a["max_shared_memory_per_multiprocessor"] // smem
    return max(0, min(a["max_blocks_per_multiprocessor"], by_threads, by_regs, by_smem))


def _check_config(fn: SimFunction, config: LaunchConfig, call: str) -> None:
    """What the driver would refuse: dimensions beyond the device's limits, too many
    threads or too much shared memory for the kernel, a cooperative grid that cannot be
    resident at once, a cluster that does not divide the grid or is too large."""
    a = H100_ATTRIBUTES
    grid, block, shared_mem, cluster = config.grid, config.block, config.shared_mem, config.cluster
    limits_grid = (a["max_grid_dim_x"], a["max_grid_dim_y"], a["max_grid_dim_z"])
    limits_block = (a["max_block_dim_x"], a["max_block_dim_y"], a["max_block_dim_z"])
    if any(g > m for g, m in zip(grid, limits_grid, strict=True)) or any(
        b > m for b, m in zip(block, limits_block, strict=True)
    ):
        raise sim_error(ResultCode.INVALID_VALUE, call, f"grid {grid} / block {block} outside the device's limits")
    threads = block[0] * block[1] * block[2]
    if threads > fn.attributes["max_threads_per_block"]:
        raise sim_error(
            ResultCode.INVALID_VALUE, call, f"{threads} threads per block; this kernel allows at most "
            f"{fn.attributes['max_threads_per_block']}"
        )  # fmt: skip
    if shared_mem > fn.attributes["max_dynamic_shared_size_bytes"]:
        raise sim_error(
            ResultCode.INVALID_VALUE,
            call,
            f"{shared_mem} bytes of dynamic shared memory; the kernel allows "
            f"{fn.attributes['max_dynamic_shared_size_bytes']} (raise max_dynamic_shared_size_bytes)",
        )
    if config.cooperative:
        capacity = _blocks_per_sm(fn, threads, shared_mem) * a["multiprocessor_count"]
        if grid[0] * grid[1] * grid[2] > capacity:
            raise sim_error(
                ResultCode.COOPERATIVE_LAUNCH_TOO_LARGE,
                call,
                f"{grid[0] * grid[1] * grid[2]} blocks cannot all be resident (at most {capacity})",
            )
    if cluster is not None:
        size = cluster[0] * cluster[1] * cluster[2]
        if size > 8 or any(g % c for g, c in zip(grid, cluster, strict=True)):
            raise sim_error(
                ResultCode.INVALID_VALUE,
                call,
                f"cluster {cluster} must divide the grid {grid} and hold at most 8 blocks",
            )


def _typed_arguments(state: Any, signature: Any, values: tuple[Any, ...], kernel: str) -> list[Any]:
    """Pointers -> numpy views of the simulated device memory; scalars -> numpy scalars."""
    out: list[Any] = []
    for param, value in zip(signature, values, strict=True):
        if not param.pointer:
            out.append(param.dtype.type(value))
        elif value == 0:
            out.append(None)
        else:
            out.append(_device_view(state, value, param.dtype, kernel))
    return out


def _device_view(state: Any, ptr: int, dtype: np.dtype, kernel: str) -> np.ndarray:
    block = state.find(ptr, 1)
    if block is None or block.array is None:
        raise sim_error(
            ResultCode.ILLEGAL_ADDRESS,
            "launch_kernel",
            f"kernel {kernel!r} was given 0x{ptr:x}, not device memory",
        )
    offset = ptr - block.start
    usable = (block.size - offset) // dtype.itemsize * dtype.itemsize
    view: np.ndarray = block.array[offset : offset + usable].view(dtype)
    return view
