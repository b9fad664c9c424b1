"""Simulated modules and kernels: Python implementations registered under a kernel's name.

There is no compiler in the sim. A "module image" is one of:

* a sim image (what :class:`aiocuda.Program` produces on the sim backend): the
  ``SIM_IMAGE_MAGIC`` line followed by the kernel names the source defines, one a line,
  and its ``__device__``/``__constant__`` variables, one a line as
  ``@global NAME BYTES DTYPE`` (``DTYPE`` a numpy type string, or ``-`` when unknown);
* PTX text: its ``.entry`` names are the kernels (its variables are not simulated);
* anything else (cubin, fatbin bytes): accepted, defining no names of its own.

Loading a module allocates its variables in simulated device memory (zeroed, freed at
unload): ``module_get_global`` returns their addresses, so copies to and from them work
as with any device memory. ``JitOptions`` are checked and recorded; ``max_registers``
caps the ``num_regs`` attribute of the module's functions and ``log_verbose`` yields a
one-line info log. ``link`` merges sim images (and PTX entry names): every kernel and
variable of every input, each defined once.

``module_get_function(module, name)`` succeeds when the image defines ``name`` or an
implementation is registered under it; launching a function with no registered
implementation raises :class:`~aiocuda.errors.LaunchError` (``CUDA_ERROR_NOT_FOUND``
-- there is nothing to run) before anything is enqueued.

Implementations (:meth:`SimModules.register_kernel`) are process-wide, shared by every
SimDriver, so registering once survives backend switches. An implementation is called on
the stream's worker thread, in stream order, as ``impl(launch, *args)``:

* ``launch`` is a :class:`SimLaunch` (``name`` and ``config``, with ``grid``, ``block``,
  ``shared_mem``, ``cooperative`` and ``cluster`` read from the config, and ``globals``:
  the module's variables as writable numpy arrays, by name);
* a pointer argument arrives as a writable 1-D numpy array of the pointee type (from the
  kernel's signature; ``uint8`` for ``void*``) starting at the pointer and running to the
  end of its allocation -- slice it to the length you need (NULL arrives as ``None``);
* a scalar arrives as a numpy scalar of the declared type; a struct or vector argument
  as a numpy record (``np.void``) of its dtype (fields by name: ``v["x"]``).

It computes the whole grid's result at once (vectorised numpy), not per thread.
Whatever it raises (an ``IndexError``, as an out-of-bounds access would on a GPU; any
``BaseException``) poisons the device with ``ILLEGAL_ADDRESS``, chained to it. For a
template kernel the implementation is looked up under the full name expression
(``"axpy<float>"``) first, then the bare name.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...errors import CompileError, LaunchError, ResultCode
from .._jit import JitOptions, LinkInput
from .._launch import LaunchConfig
from ._attributes import H100_ATTRIBUTES
from ._codes import sim_error
from ._contexts import CACHE_CONFIGS
from ._objects import next_handle_value

__all__ = [
    "SIM_IMAGE_MAGIC",
    "SimFunction",
    "SimLaunch",
    "SimModule",
    "SimModules",
    "build_image",
    "register_kernel",
]

SIM_IMAGE_MAGIC = b"AIOCUDA-SIM-MODULE 1\n"
_VARIABLE = "@global"

_PTX_ENTRY = re.compile(r"\.entry\s+([\w$]+)")
Variables = dict[str, tuple[int, str]]
"""A module's variables: name -> (bytes, numpy type string or ``"-"``)."""

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
    ``shared_mem``, ``cooperative`` and ``cluster``), and ``globals``: the module's
    ``__device__``/``__constant__`` variables as writable numpy arrays by name."""

    name: str
    config: LaunchConfig
    globals: Mapping[str, np.ndarray] = field(default_factory=dict)

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
    """A loaded module: the kernel names and variables its image defines, on one device.

    ``variables`` maps each variable's name to ``(address, bytes, dtype)`` in simulated
    device memory (allocated by the load, freed by the unload)."""

    __slots__ = ("device_ordinal", "jit_options", "names", "unloaded", "value", "variables")

    def __init__(
        self,
        device_ordinal: int,
        names: frozenset[str],
        variables: dict[str, tuple[int, int, np.dtype]],
        jit_options: JitOptions | None = None,
    ) -> None:
        self.value = next_handle_value()
        self.device_ordinal = device_ordinal
        self.names = names
        self.variables = variables
        self.jit_options = jit_options
        self.unloaded = False

    def __repr__(self) -> str:
        return f"<SimModule {self.value:#x} device={self.device_ordinal} kernels={sorted(self.names)}>"


class SimFunction:
    """A kernel handle: its module, name, (settable) attributes and cache configuration."""

    __slots__ = ("attributes", "cache_config", "module", "name", "value")

    def __init__(self, module: SimModule, name: str) -> None:
        self.value = next_handle_value()
        self.module = module
        self.name = name
        self.attributes = dict(_FUNCTION_DEFAULTS)
        options = module.jit_options
        if options is not None and options.max_registers is not None:
            self.attributes["num_regs"] = min(self.attributes["num_regs"], options.max_registers)
        self.cache_config = "prefer_none"

    def __repr__(self) -> str:
        return f"<SimFunction {self.name!r} device={self.module.device_ordinal}>"


def build_image(kernel_names: Iterable[str], variables: Mapping[str, tuple[int, str]] | None = None) -> bytes:
    """A sim image defining ``kernel_names`` and ``variables`` (name -> (bytes, dtype str))."""
    lines = [f"{name}\n" for name in kernel_names]
    lines += [f"{_VARIABLE} {name} {size} {dtype or '-'}\n" for name, (size, dtype) in (variables or {}).items()]
    return SIM_IMAGE_MAGIC + "".join(lines).encode()


def _image_contents(image: bytes) -> tuple[frozenset[str], Variables]:
    """The kernel names and variables an image defines."""
    if image.startswith(SIM_IMAGE_MAGIC):
        names: set[str] = set()
        variables: Variables = {}
        for line in image[len(SIM_IMAGE_MAGIC) :].decode().splitlines():
            if line.startswith(_VARIABLE + " "):
                _, name, size, dtype = line.split()
                variables[name] = (int(size), dtype)
            elif line:
                names.add(line)
        return frozenset(names), variables
    head = image[:4096]
    if b".entry" in image and (b".version" in head or b".target" in head):
        return frozenset(_PTX_ENTRY.findall(image.decode(errors="replace"))), {}
    return frozenset(), {}


def register_kernel(name: str, impl: KernelImpl | None) -> None:
    """Run ``impl(launch, *args)`` for launches of kernel ``name`` (None unregisters).
    TypeError for a name that is not a str or an implementation that cannot be called."""
    # (Accepted, either failed only at the launch, far from the mistake: no implementation
    # found, or the device poisoned by the TypeError of calling it.)
    if not isinstance(name, str):
        raise TypeError(
            f"register_kernel(name, impl): name is the kernel's name, a str, not {type(name).__name__} "
            "(the name comes first)"
        )
    if impl is not None and not callable(impl):
        raise TypeError(
            f"register_kernel({name!r}, impl): impl must be callable as impl(launch, *args), "
            f"or None to remove it, not {type(impl).__name__}"
        )
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
    _allocate_module_memory: Callable[[int, int], tuple[int, np.ndarray]]
    _free_module_memory: Callable[[int], None]

    # -- test control -------------------------------------------------------------------------
    def register_kernel(self, name: str, impl: KernelImpl | None) -> None:
        """Run ``impl(launch, *args)`` for launches of kernel ``name`` (None unregisters).

        Process-wide: every SimDriver sees it. See the module docstring for the calling
        convention.
        """
        register_kernel(name, impl)

    # -- modules ------------------------------------------------------------------------------
    def module_load_data(self, image: bytes, options: JitOptions | None = None) -> tuple[SimModule, str]:
        self._api("module_load_data")
        if not image:
            raise sim_error(ResultCode.INVALID_IMAGE, "module_load_data", "empty module image")
        if options is not None and not isinstance(options, JitOptions):
            raise sim_error(ResultCode.INVALID_VALUE, "module_load_data", f"not JitOptions: {options!r}")
        ordinal = self._device_of_current()
        names, declared = _image_contents(bytes(image))
        variables: dict[str, tuple[int, int, np.dtype]] = {}
        for name, (size, dtype) in declared.items():
            ptr, _ = self._allocate_module_memory(ordinal, size)
            variables[name] = (ptr, size, np.dtype(np.uint8) if dtype == "-" else np.dtype(dtype))
        module = SimModule(ordinal, names, variables, options)
        log = ""
        if options is not None and options.log_verbose:
            log = f"aiocuda sim: loaded {len(names)} kernel(s) and {len(variables)} variable(s) for sm_90"
        return module, log

    def module_unload(self, module: Any) -> None:
        self._api("module_unload", self._module(module, "module_unload").device_ordinal)
        module.unloaded = True
        for ptr, _, _ in module.variables.values():
            self._free_module_memory(ptr)

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

    def module_get_global(self, module: Any, name: str) -> tuple[int, int]:
        mod = self._module(module, "module_get_global")
        self._api("module_get_global", mod.device_ordinal)
        found = mod.variables.get(name)
        if found is None:
            raise sim_error(
                ResultCode.NOT_FOUND,
                "module_get_global",
                f"no variable named {name!r} in the module (it defines {sorted(mod.variables) or 'none'})",
            )
        return found[0], found[1]

    def module_function_names(self, module: Any) -> list[str]:
        mod = self._module(module, "module_function_names")
        self._api("module_function_names", mod.device_ordinal)
        return sorted(mod.names)

    def link(self, inputs: Sequence[LinkInput], options: JitOptions | None = None) -> tuple[bytes, str]:
        """Merge sim images (and PTX entries); CompileError for a name defined twice."""
        self._api("link")
        if not inputs:
            raise CompileError("linking failed: nothing to link")
        names: dict[str, str] = {}
        variables: Variables = {}
        for kind, data, source in inputs:
            found, declared = _image_contents(bytes(data)) if kind in ("sim", "ptx") else (frozenset(), {})
            for name in sorted(found) + sorted(declared):
                if name in names:
                    raise CompileError(
                        f"linking failed: multiple definition of {name!r} in {names[name]!r} and {source!r}",
                        log=f"error: multiple definition of '{name}'",
                    )
                names[name] = source
            variables.update(declared)
        kernels = [name for name in names if name not in variables]
        log = f"aiocuda sim: linked {len(inputs)} input(s)" if options is not None and options.log_verbose else ""
        return build_image(kernels, variables), log

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

    def function_set_cache_config(self, func: Any, config: str) -> None:
        fn = self._function(func, "function_set_cache_config")
        self._api("function_set_cache_config", fn.module.device_ordinal)
        if config not in CACHE_CONFIGS:
            raise sim_error(
                ResultCode.INVALID_VALUE, "function_set_cache_config", f"unknown cache configuration {config!r}"
            )
        fn.cache_config = config

    def occupancy_max_active_blocks(
        self, func: Any, block_size: int, dynamic_smem: int, disable_caching_override: bool = False
    ) -> int:
        fn = self._function(func, "occupancy_max_active_blocks")
        self._api("occupancy_max_active_blocks", fn.module.device_ordinal)
        return _blocks_per_sm(fn, block_size, dynamic_smem)

    def occupancy_max_potential_block_size(
        self, func: Any, dynamic_smem: int, block_size_limit: int = 0, disable_caching_override: bool = False
    ) -> tuple[int, int]:
        fn = self._function(func, "occupancy_max_potential_block_size")
        self._api("occupancy_max_potential_block_size", fn.module.device_ordinal)
        if block_size_limit < 0:
            raise sim_error(ResultCode.INVALID_VALUE, "occupancy_max_potential_block_size", "block_size_limit < 0")
        largest = fn.attributes["max_threads_per_block"]
        if block_size_limit:
            largest = min(largest, block_size_limit)
        best, best_threads = min(32, largest), 0
        for size in range(32, largest + 1, 32):
            threads = _blocks_per_sm(fn, size, dynamic_smem) * size
            if threads >= best_threads:  # ties go to the larger block, as the driver does
                best, best_threads = size, threads
        return _blocks_per_sm(fn, best, dynamic_smem) * H100_ATTRIBUTES["multiprocessor_count"], best

    def occupancy_available_dynamic_smem(self, func: Any, num_blocks: int, block_size: int) -> int:
        fn = self._function(func, "occupancy_available_dynamic_smem")
        self._api("occupancy_available_dynamic_smem", fn.module.device_ordinal)
        if num_blocks < 1 or block_size < 1:
            raise sim_error(
                ResultCode.INVALID_VALUE, "occupancy_available_dynamic_smem", "num_blocks and block_size must be >= 1"
            )
        if _blocks_per_sm(fn, block_size, 0) < num_blocks:
            return 0  # that many blocks never fit, whatever their shared memory
        a = H100_ATTRIBUTES
        per_block = a["max_shared_memory_per_multiprocessor"] // num_blocks - a["reserved_shared_memory_per_block"]
        ceiling = a["max_shared_memory_per_block_optin"]
        return max(0, min(per_block, ceiling) - fn.attributes["shared_size_bytes"])

    def occupancy_max_active_clusters(self, func: Any, config: LaunchConfig) -> int:
        fn = self._function(func, "occupancy_max_active_clusters")
        self._api("occupancy_max_active_clusters", fn.module.device_ordinal)
        size = _cluster_size(fn, config, "occupancy_max_active_clusters")
        if size > _max_cluster_size(fn, config):
            return 0
        blocks = _blocks_per_sm(fn, config.block[0] * config.block[1] * config.block[2], config.shared_mem)
        return blocks * H100_ATTRIBUTES["multiprocessor_count"] // size

    def occupancy_max_potential_cluster_size(self, func: Any, config: LaunchConfig) -> int:
        fn = self._function(func, "occupancy_max_potential_cluster_size")
        self._api("occupancy_max_potential_cluster_size", fn.module.device_ordinal)
        return _max_cluster_size(fn, config)

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
                f"aiocuda.register_sim_kernel({fn.name!r}, impl) or, in a test, "
                f"aiocuda.testing's sim.register_kernel({fn.name!r}, impl)",
                code=ResultCode.NOT_FOUND,
                name="CUDA_ERROR_NOT_FOUND",
                call=call,
            )
        return _KernelRun(state, fn, config, impl, params.values, getattr(params, "signature", None))

    def __call__(self) -> None:
        values, signature, fn = self.values, self.signature, self.func
        args = values if signature is None else _typed_arguments(self.state, signature, values, fn.name)
        self.impl(SimLaunch(fn.name, self.config, _variable_views(self.state, fn.module)), *args)

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


_GPC_SMS = 16
"""Multiprocessors per GPC on an H100: a cluster's blocks must all fit in one GPC."""


def _cluster_size(fn: SimFunction, config: LaunchConfig, call: str) -> int:
    required = tuple(fn.attributes[f"required_cluster_{axis}"] for axis in ("width", "height", "depth"))
    cluster = config.cluster if config.cluster is not None else (required if all(required) else None)
    if cluster is None:
        raise sim_error(
            ResultCode.INVALID_VALUE, call, "the configuration names no cluster and the kernel requires none"
        )
    return cluster[0] * cluster[1] * cluster[2]


def _max_cluster_size(fn: SimFunction, config: LaunchConfig) -> int:
    portable = 16 if fn.attributes["non_portable_cluster_size_allowed"] else 8
    blocks = _blocks_per_sm(fn, config.block[0] * config.block[1] * config.block[2], config.shared_mem)
    return min(portable, blocks * _GPC_SMS)


def _variable_views(state: Any, module: SimModule) -> dict[str, np.ndarray]:
    """The module's variables as numpy arrays over their simulated device memory."""
    views: dict[str, np.ndarray] = {}
    for name, (ptr, size, dtype) in module.variables.items():
        block = state.find(ptr, size)
        raw = block.array[ptr - block.start : ptr - block.start + size]
        views[name] = raw.view(dtype) if size % dtype.itemsize == 0 else raw
    return views


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
        if param.by_value_struct:
            out.append(value)
        elif not param.pointer:
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
