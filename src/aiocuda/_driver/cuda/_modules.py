"""Real-driver modules, functions, occupancy and launches (see _driver/_protocol.py).

The launch hot path is :meth:`CudaModules.prepare_launch`: it resolves everything once
(the bound ``cuLaunchKernel``, the dimensions, the stream, the address of the packed
``void*[]``) and hands back ``(fn, args, fail)``, so that each launch above the seam is
``fn(*args)[0]`` -- the call a hand-written launch with pre-packed arguments makes --
plus a truthiness test of the result (``CUDA_SUCCESS`` is 0).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...errors import ResultCode, error_for_code
from .._launch import LaunchConfig
from . import _core
from ._core import check

__all__ = ["CudaModules"]

_JIT_LOG_BYTES = 1 << 16


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
    def module_load_data(self, image: bytes) -> Any:
        drv = _core.drv
        info_log = b"\0" * _JIT_LOG_BYTES
        error_log = b"\0" * _JIT_LOG_BYTES
        options = [
            drv.CUjit_option.CU_JIT_ERROR_LOG_BUFFER,
            drv.CUjit_option.CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
            drv.CUjit_option.CU_JIT_INFO_LOG_BUFFER,
            drv.CUjit_option.CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES,
        ]
        values = [error_log, _JIT_LOG_BYTES, info_log, _JIT_LOG_BYTES]
        result = drv.cuModuleLoadDataEx(image, len(options), options, values)
        if result[0] != drv.CUresult.CUDA_SUCCESS:
            log = error_log.split(b"\0", 1)[0].decode(errors="replace").strip()
            try:
                check(result, "cuModuleLoadDataEx")
            except Exception as exc:
                if log:
                    exc.args = (f"{exc.args[0]}\nJIT log:\n{log}",)
                raise
        return result[1]

    def module_unload(self, module: Any) -> None:
        check(_core.drv.cuModuleUnload(module), "cuModuleUnload")

    def module_get_function(self, module: Any, name: str) -> Any:
        return check(_core.drv.cuModuleGetFunction(module, name.encode()), f"cuModuleGetFunction({name!r})")

    # -- attributes and occupancy ---------------------------------------------------------------
    def function_get_attribute(self, func: Any, attribute: str) -> int:
        member = self._function_attribute(attribute, "cuFuncGetAttribute")
        return int(check(_core.drv.cuFuncGetAttribute(member, func), "cuFuncGetAttribute"))

    def function_set_attribute(self, func: Any, attribute: str, value: int) -> None:
        member = self._function_attribute(attribute, "cuFuncSetAttribute")
        check(_core.drv.cuFuncSetAttribute(func, member, value), "cuFuncSetAttribute")

    def occupancy_max_active_blocks(self, func: Any, block_size: int, dynamic_smem: int) -> int:
        return int(
            check(
                _core.drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(func, block_size, dynamic_smem),
                "cuOccupancyMaxActiveBlocksPerMultiprocessor",
            )
        )

    def occupancy_max_potential_block_size(self, func: Any, dynamic_smem: int) -> tuple[int, int]:
        min_grid, block = check(
            _core.drv.cuOccupancyMaxPotentialBlockSize(func, None, dynamic_smem, 0),
            "cuOccupancyMaxPotentialBlockSize",
        )
        return int(min_grid), int(block)

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
        launch = drv.CUlaunchConfig()
        launch.gridDimX, launch.gridDimY, launch.gridDimZ = config.grid
        launch.blockDimX, launch.blockDimY, launch.blockDimZ = config.block
        launch.sharedMemBytes = config.shared_mem
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
        return drv.cuLaunchKernelEx, (launch, func, params.address, 0), _failure("cuLaunchKernelEx")


def _failure(call: str) -> Callable[[Any], None]:
    def fail(err: Any) -> None:
        _core._raise(err, call)

    return fail
