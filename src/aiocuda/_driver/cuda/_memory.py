"""Real-driver memory: pools, stream-ordered allocation, host memory, copies, memsets.

The hot calls (``mem_alloc_async``, ``mem_free_async``, the ``memcpy_*_async`` family)
bind their ``cuda.bindings.driver`` function once, at first use, and compare the result
with ``CUDA_SUCCESS`` before doing anything else. Memory pools go one step further and
call the bindings themselves (:meth:`CudaMemory.mem_async_calls`), with no function of
the seam in between.
"""

# Why pools call the bindings directly: allocate plus free must stay within 30 % of the
# bare bindings (benchmarks/memory.py, alloc_free_ratio_raw), and a seam function in
# between cost about 0.15 us per call on the GPU machines.

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...errors import ResultCode, error_for_code
from .._protocol import PoolProps
from . import _core
from ._core import check

__all__ = ["CudaMemory"]

_POOL_ATTRIBUTE_PREFIX = "CU_MEMPOOL_ATTR_"
_U64_ATTRIBUTES = frozenset(
    {"release_threshold", "reserved_mem_current", "reserved_mem_high", "used_mem_current", "used_mem_high"}
)


class _Bound:
    """``cuda.bindings.driver`` functions and constants bound once for the hot paths."""

    def __init__(self) -> None:
        drv = _core.drv
        self.success = drv.CUresult.CUDA_SUCCESS
        self.alloc = drv.cuMemAllocFromPoolAsync
        self.free = drv.cuMemFreeAsync
        self.htod = drv.cuMemcpyHtoDAsync
        self.dtoh = drv.cuMemcpyDtoHAsync
        self.dtod = drv.cuMemcpyDtoDAsync
        self.peer = drv.cuMemcpyPeerAsync
        self.pool_attrs = {
            member.name[len(_POOL_ATTRIBUTE_PREFIX) :].lower(): member
            for member in drv.CUmemPool_attribute
            if member.name.startswith(_POOL_ATTRIBUTE_PREFIX)
        }
        self.u64 = drv.cuuint64_t


_bound: _Bound | None = None


def _b() -> _Bound:
    global _bound
    if _bound is None:
        _bound = _Bound()
    return _bound


class CudaMemory:
    """Mixin of CudaDriver: memory operations (see ``_driver/_protocol.py``)."""

    # -- pools ------------------------------------------------------------------------------
    def mempool_default(self, dev: Any) -> Any:
        return check(_core.drv.cuDeviceGetDefaultMemPool(dev), "cuDeviceGetDefaultMemPool")

    def mempool_create(self, props: PoolProps) -> Any:
        drv = _core.drv
        p = drv.CUmemPoolProps()
        p.allocType = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        p.handleTypes = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
        p.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        p.location.id = props.device_ordinal
        if props.max_size:
            p.maxSize = props.max_size
        return check(drv.cuMemPoolCreate(p), "cuMemPoolCreate")

    def mempool_destroy(self, pool: Any) -> None:
        check(_core.drv.cuMemPoolDestroy(pool), "cuMemPoolDestroy")

    def _pool_attribute(self, attribute: str, call: str) -> Any:
        member = _b().pool_attrs.get(attribute)
        if member is None:
            raise error_for_code(
                ResultCode.INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", f"unknown pool attribute {attribute!r}", call
            )
        return member

    def mempool_set_attribute(self, pool: Any, attribute: str, value: int) -> None:
        member = self._pool_attribute(attribute, "cuMemPoolSetAttribute")
        raw = _b().u64(value) if attribute in _U64_ATTRIBUTES else int(value)
        check(_core.drv.cuMemPoolSetAttribute(pool, member, raw), "cuMemPoolSetAttribute")

    def mempool_get_attribute(self, pool: Any, attribute: str) -> int:
        member = self._pool_attribute(attribute, "cuMemPoolGetAttribute")
        value = check(_core.drv.cuMemPoolGetAttribute(pool, member), "cuMemPoolGetAttribute")
        return int(getattr(value, "value", value))

    def mempool_trim_to(self, pool: Any, min_bytes_to_keep: int) -> None:
        check(_core.drv.cuMemPoolTrimTo(pool, min_bytes_to_keep), "cuMemPoolTrimTo")

    def ctx_synchronize(self) -> None:
        check(_core.drv.cuCtxSynchronize(), "cuCtxSynchronize")

    def mempool_set_access(self, pool: Any, peer_ordinal: int) -> None:
        drv = _core.drv
        desc = drv.CUmemAccessDesc()
        desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = peer_ordinal
        desc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        check(drv.cuMemPoolSetAccess(pool, [desc], 1), "cuMemPoolSetAccess")

    # -- device allocation ------------------------------------------------------------------
    def mem_alloc_async(self, size: int, pool: Any, stream: Any) -> Any:
        """Returns the ``CUdeviceptr`` itself (``int()`` gives the address): converting
        it to ``int`` here and back in ``mem_free_async`` would cost two object
        conversions on the allocate/free hot path. ``memory.DeviceBuffer`` converts
        lazily, when the address is asked for."""
        b = _bound or _b()
        result = b.alloc(size, pool, stream)
        if result[0] != b.success:
            _core._raise(result[0], "cuMemAllocFromPoolAsync")
        return result[1]

    def mem_free_async(self, ptr: Any, stream: Any) -> None:
        b = _bound or _b()
        err = b.free(ptr, stream)[0]
        if err != b.success:
            _core._raise(err, "cuMemFreeAsync")

    def mem_async_calls(
        self,
    ) -> tuple[Callable[..., tuple[Any, Any]], Callable[..., tuple[Any]], Callable[[Any, str], None]]:
        """``(alloc, free, fail)`` for a pool's allocate/free hot path: the bindings'
        ``cuMemAllocFromPoolAsync`` and ``cuMemFreeAsync`` themselves, so that
        ``err, ptr = alloc(size, pool, stream)`` and ``(err,) = free(ptr, stream)`` cost
        no Python frame of ours. ``err`` is a ``CUresult``, falsy for success; a truthy
        one goes to ``fail(err, call_name)``, which raises the matching CudaError."""
        b = _bound or _b()
        return b.alloc, b.free, _core._raise

    def pointer_device_ordinal(self, ptr: int) -> int:
        drv = _core.drv
        attr = drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
        result = drv.cuPointerGetAttribute(attr, ptr)
        if result[0] != _b().success:
            raise error_for_code(
                ResultCode.INVALID_VALUE,
                "CUDA_ERROR_INVALID_VALUE",
                f"0x{ptr:x} is not device memory known to the driver",
                "cuPointerGetAttribute",
            )
        return int(result[1])

    # -- host memory --------------------------------------------------------------------------
    def mem_host_alloc(self, size: int) -> int:
        flags = _core.drv.CU_MEMHOSTALLOC_PORTABLE
        return int(check(_core.drv.cuMemHostAlloc(size, flags), "cuMemHostAlloc"))

    def mem_host_free(self, ptr: int) -> None:
        check(_core.drv.cuMemFreeHost(ptr), "cuMemFreeHost")

    def mem_host_register(self, ptr: int, size: int) -> None:
        flags = _core.drv.CU_MEMHOSTREGISTER_PORTABLE
        check(_core.drv.cuMemHostRegister(ptr, size, flags), "cuMemHostRegister")

    def mem_host_unregister(self, ptr: int) -> None:
        check(_core.drv.cuMemHostUnregister(ptr), "cuMemHostUnregister")

    # -- copies and memsets --------------------------------------------------------------------
    def memcpy_htod_async(self, dst: int, src: int, size: int, stream: Any) -> None:
        b = _bound or _b()
        err = b.htod(dst, src, size, stream)[0]
        if err != b.success:
            _core._raise(err, "cuMemcpyHtoDAsync")

    def memcpy_dtoh_async(self, dst: int, src: int, size: int, stream: Any) -> None:
        b = _bound or _b()
        err = b.dtoh(dst, src, size, stream)[0]
        if err != b.success:
            _core._raise(err, "cuMemcpyDtoHAsync")

    def memcpy_dtod_async(self, dst: int, src: int, size: int, stream: Any) -> None:
        b = _bound or _b()
        err = b.dtod(dst, src, size, stream)[0]
        if err != b.success:
            _core._raise(err, "cuMemcpyDtoDAsync")

    def memcpy_peer_async(self, dst: int, dst_ctx: Any, src: int, src_ctx: Any, size: int, stream: Any) -> None:
        b = _bound or _b()
        err = b.peer(dst, dst_ctx, src, src_ctx, size, stream)[0]
        if err != b.success:
            _core._raise(err, "cuMemcpyPeerAsync")

    def memset_d8_async(self, dst: int, value: int, count: int, stream: Any) -> None:
        check(_core.drv.cuMemsetD8Async(dst, value & 0xFF, count, stream), "cuMemsetD8Async")

    def memset_d32_async(self, dst: int, value: int, count: int, stream: Any) -> None:
        check(_core.drv.cuMemsetD32Async(dst, value & 0xFFFFFFFF, count, stream), "cuMemsetD32Async")
