"""Real-driver modules, functions, occupancy and launches (see _driver/_protocol.py).

The launch hot path is :meth:`CudaModules.prepare_launch`: it resolves everything once
(the bound ``cuLaunchKernel``, the dimensions, the stream, the address of the packed
``void*[]``) and hands back ``(fn, args, fail)``, so that each launch above the seam is
``fn(*args)[0]`` -- the call a hand-written launch with pre-packed arguments makes --
plus a truthiness test of the result (``CUDA_SUCCESS`` is 0).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from typing import Any

from ...errors import CompileError, CudaError, ResultCode, error_for_code
from .._jit import JitOptions, LinkInput
from .._launch import LaunchConfig
from . import _core
from ._core import check

__all__ = ["CudaModules"]

_JIT_LOG_BYTES = 1 << 16


class _JitArguments:
    """The option arrays of ``cuModuleLoadDataEx`` / ``cuLinkCreate``, and the log
    buffers the driver writes into (kept alive by this object while it is used)."""

    __slots__ = ("error_log", "info_log", "options", "values")

    def __init__(self, options: JitOptions | None) -> None:
        drv = _core.drv
        jit = drv.CUjit_option
        self.error_log = b"\0" * _JIT_LOG_BYTES
        self.info_log = b"\0" * _JIT_LOG_BYTES
        self.options: list[Any] = [
            jit.CU_JIT_ERROR_LOG_BUFFER,
            jit.CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
            jit.CU_JIT_INFO_LOG_BUFFER,
            jit.CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES,
        ]
        self.values: list[Any] = [self.error_log, _JIT_LOG_BYTES, self.info_log, _JIT_LOG_BYTES]
        if options is None:
            return
        chosen: list[tuple[Any, Any]] = [
            (jit.CU_JIT_OPTIMIZATION_LEVEL, options.optimization_level),
            (jit.CU_JIT_MAX_REGISTERS, options.max_registers),
            (jit.CU_JIT_THREADS_PER_BLOCK, options.threads_per_block),
            (jit.CU_JIT_TARGET, None if options.target is None else drv.CUjit_target(options.target)),
            (jit.CU_JIT_GENERATE_DEBUG_INFO, 1 if options.generate_debug_info else None),
            (jit.CU_JIT_GENERATE_LINE_INFO, 1 if options.generate_line_info else None),
            (jit.CU_JIT_LOG_VERBOSE, 1 if options.log_verbose else None),
            (
                jit.CU_JIT_FALLBACK_STRATEGY,
                None
                if options.fallback is None
                else drv.CUjit_fallback.CU_PREFER_PTX
                if options.fallback == "prefer_ptx"
                else drv.CUjit_fallback.CU_PREFER_BINARY,
            ),
        ]
        for option, value in chosen:
            if value is not None:
                self.options.append(option)
                self.values.append(value)

    @staticmethod
    def _text(buffer: bytes) -> str:
        return buffer.split(b"\0", 1)[0].decode(errors="replace").strip()

    @property
    def info(self) -> str:
        return self._text(self.info_log)

    @property
    def error(self) -> str:
        return self._text(self.error_log)


_LINK_INPUTS = {
    "ptx": "CU_JIT_INPUT_PTX",
    "cubin": "CU_JIT_INPUT_CUBIN",
    "fatbin": "CU_JIT_INPUT_FATBINARY",
    "object": "CU_JIT_INPUT_OBJECT",
    "library": "CU_JIT_INPUT_LIBRARY",
}


def _attribute_members(prefix: str, enum: Any) -> dict[str, Any]:
    return {
        member.name[len(prefix) :].lower(): member
        for member in enum
        if member.name.startswith(prefix) and not member.name.endswith("_MAX")
    }


class CudaModules:
    """Mixin of CudaDriver: modules, functions, occupancy and kernel launches."""

    _func_attrs: dict[str, Any] | None = None

    def _function_attribute(self, attribute: str, call: str) -> Any:
        if CudaModules._func_attrs is None:
            CudaModules._func_attrs = _attribute_members("CU_FUNC_ATTRIBUTE_", _core.drv.CUfunction_attribute)
        member = CudaModules._func_attrs.get(attribute)
        if member is None:
            raise error_for_code(
                ResultCode.INVALID_VALUE,
                "CUDA_ERROR_INVALID_VALUE",
                f"unknown function attribute {attribute!r}",
                call,
            )
        return member

    # -- modules ------------------------------------------------------------------------------
    def module_load_data(self, image: bytes, options: JitOptions | None = None) -> tuple[Any, str]:
        drv = _core.drv
        jit = _JitArguments(options)
        result = drv.cuModuleLoadDataEx(image, len(jit.options), jit.options, jit.values)
        if result[0] != drv.CUresult.CUDA_SUCCESS:
            log = jit.error
            try:
                check(result, "cuModuleLoadDataEx")
            except Exception as exc:
                if log:
                    exc.args = (f"{exc.args[0]}\nJIT log:\n{log}",)
                raise
        return result[1], jit.info

    def module_unload(self, module: Any) -> None:
        check(_core.drv.cuModuleUnload(module), "cuModuleUnload")

    def module_get_function(self, module: Any, name: str) -> Any:
        return check(_core.drv.cuModuleGetFunction(module, name.encode()), f"cuModuleGetFunction({name!r})")

    def module_get_global(self, module: Any, name: str) -> tuple[int, int]:
        ptr, size = check(_core.drv.cuModuleGetGlobal(module, name.encode()), f"cuModuleGetGlobal({name!r})")
        return int(ptr), int(size)

    def module_function_names(self, module: Any) -> list[str]:
        drv = _core.drv
        count = int(check(drv.cuModuleGetFunctionCount(module), "cuModuleGetFunctionCount"))
        functions = check(drv.cuModuleEnumerateFunctions(count, module), "cuModuleEnumerateFunctions")
        names = []
        for func in functions:
            raw = check(drv.cuFuncGetName(func), "cuFuncGetName")
            names.append(raw.decode() if isinstance(raw, bytes) else str(raw))
        return names

    def link(self, inputs: Sequence[LinkInput], options: JitOptions | None = None) -> tuple[bytes, str]:
        drv = _core.drv
        jit = _JitArguments(options)
        state = check(drv.cuLinkCreate(len(jit.options), jit.options, jit.values), "cuLinkCreate")
        try:
            for kind, data, name in inputs:
                member = _LINK_INPUTS.get(kind)
                if member is None:
                    raise CompileError(f"{name}: a {kind!r} input cannot be linked by the driver's linker")
                self._linked(
                    drv.cuLinkAddData(
                        state, getattr(drv.CUjitInputType, member), data, len(data), name.encode(), 0, None, None
                    ),
                    f"cuLinkAddData({name!r})",
                    jit,
                )
            _, cubin, size = self._linked(drv.cuLinkComplete(state), "cuLinkComplete", jit)
            image = ctypes.string_at(int(cubin), int(size))  # owned by the link state: copy it out
        finally:
            drv.cuLinkDestroy(state)
        return image, jit.info

    @staticmethod
    def _linked(result: tuple[Any, ...], call: str, jit: _JitArguments) -> tuple[Any, ...]:
        """``result`` if it succeeded; else CompileError with the linker's log."""
        try:
            check(result, call)
        except CudaError as exc:
            log = jit.error
            raise CompileError(f"linking failed: {exc}" + (f"\nlinker log:\n{log}" if log else ""), log=log) from exc
        return result

    # -- attributes and occupancy ---------------------------------------------------------------
    def function_get_attribute(self, func: Any, attribute: str) -> int:
        member = self._function_attribute(attribute, "cuFuncGetAttribute")
        return int(check(_core.drv.cuFuncGetAttribute(member, func), "cuFuncGetAttribute"))

    def function_set_attribute(self, func: Any, attribute: str, value: int) -> None:
        member = self._function_attribute(attribute, "cuFuncSetAttribute")
        check(_core.drv.cuFuncSetAttribute(func, member, value), "cuFuncSetAttribute")

    def occupancy_max_active_blocks(
        self, func: Any, block_size: int, dynamic_smem: int, disable_caching_override: bool = False
    ) -> int:
        return int(
            check(
                _core.drv.cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(
                    func, block_size, dynamic_smem, _occupancy_flags(disable_caching_override)
                ),
                "cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags",
            )
        )

    def occupancy_max_potential_block_size(
        self, func: Any, dynamic_smem: int, block_size_limit: int = 0, disable_caching_override: bool = False
    ) -> tuple[int, int]:
        min_grid, block = check(
            _core.drv.cuOccupancyMaxPotentialBlockSizeWithFlags(
                func, None, dynamic_smem, block_size_limit, _occupancy_flags(disable_caching_override)
            ),
            "cuOccupancyMaxPotentialBlockSizeWithFlags",
        )
        return int(min_grid), int(block)

    def occupancy_available_dynamic_smem(self, func: Any, num_blocks: int, block_size: int) -> int:
        return int(
            check(
                _core.drv.cuOccupancyAvailableDynamicSMemPerBlock(func, num_blocks, block_size),
                "cuOccupancyAvailableDynamicSMemPerBlock",
            )
        )

    def occupancy_max_active_clusters(self, func: Any, config: LaunchConfig) -> int:
        launch = _launch_config(config, None)
        return int(check(_core.drv.cuOccupancyMaxActiveClusters(func, launch), "cuOccupancyMaxActiveClusters"))

    def occupancy_max_potential_cluster_size(self, func: Any, config: LaunchConfig) -> int:
        launch = _launch_config(config, None)
        return int(
            check(_core.drv.cuOccupancyMaxPotentialClusterSize(func, launch), "cuOccupancyMaxPotentialClusterSize")
        )

    # -- launches --------------------------------------------------------------------------------
    def launch_kernel(self, func: Any, config: LaunchConfig, stream: Any, params: Any) -> None:
        fn, args, fail = self.prepare_launch(func, config, stream, params)
        err = fn(*args)[0]
        if err:
            fail(err)

    def prepare_launch(
        self, func: Any, config: LaunchConfig, stream: Any, params: Any
    ) -> tuple[Callable[..., tuple[Any, ...]], tuple[Any, ...], Callable[[Any], None]]:
        drv = _core.drv
        if not config.extended:
            args: tuple[Any, ...] = (func, *config.grid, *config.block, config.shared_mem, stream, params.address, 0)
            return drv.cuLaunchKernel, args, _failure("cuLaunchKernel")
        launch = _launch_config(config, stream)
        return drv.cuLaunchKernelEx, (launch, func, params.address, 0), _failure("cuLaunchKernelEx")


def _launch_config(config: LaunchConfig, stream: Any) -> Any:
    """The ``CUlaunchConfig`` of ``config`` on ``stream`` (None for occupancy queries)."""
    drv = _core.drv
    launch = drv.CUlaunchConfig()
    launch.gridDimX, launch.gridDimY, launch.gridDimZ = config.grid
    launch.blockDimX, launch.blockDimY, launch.blockDimZ = config.block
    launch.sharedMemBytes = config.shared_mem
    if stream is not None:
        launch.hStream = stream
    attrs = []
    if config.cooperative:
        attr = drv.CUlaunchAttribute()
        attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_COOPERATIVE
        attr.value.cooperative = 1
        attrs.append(attr)
    if config.cluster is not None:
        attr = drv.CUlaunchAttribute()
        attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = config.cluster
        attrs.append(attr)
    launch.attrs = attrs
    launch.numAttrs = len(attrs)
    return launch


def _occupancy_flags(disable_caching_override: bool) -> Any:
    flags = _core.drv.CUoccupancy_flags
    return flags.CU_OCCUPANCY_DISABLE_CACHING_OVERRIDE if disable_caching_override else flags.CU_OCCUPANCY_DEFAULT


def _failure(call: str) -> Callable[[Any], None]:
    def fail(err: Any) -> None:
        _core._raise(err, call)

    return fail
