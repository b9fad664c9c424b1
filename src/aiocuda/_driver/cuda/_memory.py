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

import ctypes
import os
from collections.abc import Callable
from typing import Any

from ...errors import ResultCode, error_for_code
from .._protocol import PitchedCopy, PitchedSide, PoolProps
from . import _core
from ._core import IPC_HANDLE_BYTES, check

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


def _rebind_in_child() -> None:
    """In a forked child, bind again from the refusing bindings (see ``_core``)."""
    global _bound
    _bound = None


os.register_at_fork(after_in_child=_rebind_in_child)


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
        kind = "MANAGED" if props.managed else "PINNED"
        p.allocType = getattr(drv.CUmemAllocationType, f"CU_MEM_ALLOCATION_TYPE_{kind}")
        handles = "POSIX_FILE_DESCRIPTOR" if props.ipc else "NONE"
        p.handleTypes = getattr(drv.CUmemAllocationHandleType, f"CU_MEM_HANDLE_TYPE_{handles}")
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
        self._set_access(pool, peer_ordinal, _core.drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE)

    def mempool_revoke_access(self, pool: Any, peer_ordinal: int) -> None:
        self._set_access(pool, peer_ordinal, _core.drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_NONE)

    def _set_access(self, pool: Any, peer_ordinal: int, flags: Any) -> None:
        drv = _core.drv
        desc = drv.CUmemAccessDesc()
        desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = peer_ordinal
        desc.flags = flags
        check(drv.cuMemPoolSetAccess(pool, [desc], 1), "cuMemPoolSetAccess")

    def mempool_get_access(self, pool: Any, device_ordinal: int) -> bool:
        flags = check(_core.drv.cuMemPoolGetAccess(pool, _location(device_ordinal)), "cuMemPoolGetAccess")
        return bool(flags == _core.drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE)

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

    # -- pools shared with other processes -------------------------------------------------------
    def mempool_export_fd(self, pool: Any) -> int:
        fd_type = _core.drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        return int(
            check(_core.drv.cuMemPoolExportToShareableHandle(pool, fd_type, 0), "cuMemPoolExportToShareableHandle")
        )

    def mempool_import_fd(self, fd: int) -> Any:
        fd_type = _core.drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        return check(_core.drv.cuMemPoolImportFromShareableHandle(fd, fd_type, 0), "cuMemPoolImportFromShareableHandle")

    def mempool_export_pointer(self, ptr: int) -> bytes:
        data = check(_core.drv.cuMemPoolExportPointer(ptr), "cuMemPoolExportPointer")
        return ctypes.string_at(data.getPtr(), IPC_HANDLE_BYTES)

    def mempool_import_pointer(self, pool: Any, data: bytes) -> int:
        raw = _core.drv.CUmemPoolPtrExportData()
        ctypes.memmove(raw.getPtr(), bytes(data).ljust(IPC_HANDLE_BYTES, b"\0"), IPC_HANDLE_BYTES)
        return int(check(_core.drv.cuMemPoolImportPointer(pool, raw), "cuMemPoolImportPointer"))

    # -- managed memory -----------------------------------------------------------------------
    def mem_alloc_managed(self, size: int, attach: str) -> int:
        flag = _attach_flag(attach, "cuMemAllocManaged")
        return int(check(_core.drv.cuMemAllocManaged(size, flag), "cuMemAllocManaged"))

    def mem_free(self, ptr: int) -> None:
        check(_core.drv.cuMemFree(ptr), "cuMemFree")

    def mem_prefetch_async(self, ptr: int, size: int, device_ordinal: int | None, stream: Any) -> None:
        check(_core.drv.cuMemPrefetchAsync(ptr, size, _location(device_ordinal), 0, stream), "cuMemPrefetchAsync")

    def mem_advise(self, ptr: int, size: int, advice: str, device_ordinal: int | None) -> None:
        member = getattr(_core.drv.CUmem_advise, f"CU_MEM_ADVISE_{advice.upper()}", None)
        if member is None:
            raise error_for_code(
                ResultCode.INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", f"unknown advice {advice!r}", "cuMemAdvise"
            )
        check(_core.drv.cuMemAdvise(ptr, size, member, _location(device_ordinal)), "cuMemAdvise")

    def stream_attach_mem_async(self, stream: Any, ptr: int, attach: str) -> None:
        flag = _attach_flag(attach, "cuStreamAttachMemAsync")
        check(_core.drv.cuStreamAttachMemAsync(stream, ptr, 0, flag), "cuStreamAttachMemAsync")

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

    def memset_d16_async(self, dst: int, value: int, count: int, stream: Any) -> None:
        check(_core.drv.cuMemsetD16Async(dst, value & 0xFFFF, count, stream), "cuMemsetD16Async")

    def memset_d32_async(self, dst: int, value: int, count: int, stream: Any) -> None:
        check(_core.drv.cuMemsetD32Async(dst, value & 0xFFFFFFFF, count, stream), "cuMemsetD32Async")

    def memset_2d_async(
        self, dst: int, pitch: int, value: int, element_size: int, width: int, height: int, stream: Any
    ) -> None:
        drv = _core.drv
        if element_size == 1:
            check(drv.cuMemsetD2D8Async(dst, pitch, value & 0xFF, width, height, stream), "cuMemsetD2D8Async")
        elif element_size == 2:
            check(drv.cuMemsetD2D16Async(dst, pitch, value & 0xFFFF, width, height, stream), "cuMemsetD2D16Async")
        elif element_size == 4:
            check(drv.cuMemsetD2D32Async(dst, pitch, value & 0xFFFFFFFF, width, height, stream), "cuMemsetD2D32Async")
        else:
            raise error_for_code(
                ResultCode.INVALID_VALUE,
                "CUDA_ERROR_INVALID_VALUE",
                f"2D memsets set 1, 2 or 4-byte elements, not {element_size}",
                "cuMemsetD2D32Async",
            )

    def memcpy_pitched_async(self, copy: PitchedCopy, stream: Any) -> None:
        drv = _core.drv
        if copy.dst.context is not None and copy.src.context is not None:
            params: Any = drv.CUDA_MEMCPY3D_PEER()
            params.srcContext = copy.src.context
            params.dstContext = copy.dst.context
            call, name = drv.cuMemcpy3DPeerAsync, "cuMemcpy3DPeerAsync"
        elif copy.depth > 1:
            params = drv.CUDA_MEMCPY3D()
            call, name = drv.cuMemcpy3DAsync, "cuMemcpy3DAsync"
        else:
            params = drv.CUDA_MEMCPY2D()
            _side(params, "src", copy.src)
            _side(params, "dst", copy.dst)
            params.WidthInBytes = copy.width
            params.Height = copy.height
            check(drv.cuMemcpy2DAsync(params, stream), "cuMemcpy2DAsync")
            return
        _side(params, "src", copy.src)
        _side(params, "dst", copy.dst)
        params.srcHeight = copy.src.rows or copy.height
        params.dstHeight = copy.dst.rows or copy.height
        params.WidthInBytes = copy.width
        params.Height = copy.height
        params.Depth = copy.depth
        check(call(params, stream), name)


def _attach_flag(attach: str, call: str) -> int:
    member = getattr(_core.drv.CUmemAttach_flags, f"CU_MEM_ATTACH_{attach.upper()}", None)
    if member is None:
        raise error_for_code(ResultCode.INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", f"unknown attach {attach!r}", call)
    return int(member)


def _location(device_ordinal: int | None) -> Any:
    """A ``CUmemLocation``: the device, or host memory for None."""
    drv = _core.drv
    location = drv.CUmemLocation()
    if device_ordinal is None:
        location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST
        location.id = 0
    else:
        location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        location.id = device_ordinal
    return location


def _side(params: Any, prefix: str, side: PitchedSide) -> None:
    """Fill the ``src*`` or ``dst*`` fields of a ``CUDA_MEMCPY2D/3D(_PEER)``."""
    memory_type = _core.drv.CUmemorytype
    if side.on_host:
        setattr(params, f"{prefix}MemoryType", memory_type.CU_MEMORYTYPE_HOST)
        setattr(params, f"{prefix}Host", side.address)
    else:
        setattr(params, f"{prefix}MemoryType", memory_type.CU_MEMORYTYPE_DEVICE)
        setattr(params, f"{prefix}Device", side.address)
    setattr(params, f"{prefix}Pitch", side.pitch)
