"""Result-code names and descriptions for errors raised by the simulated driver.

The names come from :class:`aiocuda.errors.ResultCode` (``INVALID_VALUE`` becomes
``"CUDA_ERROR_INVALID_VALUE"``); the descriptions are the strings the real driver's
``cuGetErrorString`` returns, so messages read the same on both backends.
"""

from __future__ import annotations

from ...errors import CudaError, ResultCode, error_for_code

__all__ = ["code_name", "cu_call", "sim_error"]

_NAMES: dict[int, str] = {
    value: "CUDA_SUCCESS" if attr == "SUCCESS" else f"CUDA_ERROR_{attr}"
    for attr, value in vars(ResultCode).items()
    if isinstance(value, int)
}

_DESCRIPTIONS: dict[int, str] = {
    ResultCode.SUCCESS: "no error",
    ResultCode.INVALID_VALUE: "invalid argument",
    ResultCode.OUT_OF_MEMORY: "out of memory",
    ResultCode.NOT_INITIALIZED: "initialization error",
    ResultCode.DEINITIALIZED: "driver shutting down",
    ResultCode.STUB_LIBRARY: "CUDA driver is a stub library",
    ResultCode.INSUFFICIENT_DRIVER: "CUDA driver version is insufficient for CUDA runtime version",
    ResultCode.NO_DEVICE: "no CUDA-capable device is detected",
    ResultCode.INVALID_DEVICE: "invalid device ordinal",
    ResultCode.DEVICE_NOT_LICENSED: "device doesn't have valid Grid license",
    ResultCode.INVALID_IMAGE: "device kernel image is invalid",
    ResultCode.INVALID_CONTEXT: "invalid device context",
    ResultCode.NO_BINARY_FOR_GPU: "no kernel image is available for execution on the device",
    ResultCode.ECC_UNCORRECTABLE: "uncorrectable ECC error encountered",
    ResultCode.UNSUPPORTED_LIMIT: "limit is not supported on this architecture",
    ResultCode.PEER_ACCESS_UNSUPPORTED: "peer access is not supported between these two devices",
    ResultCode.INVALID_PTX: "a PTX JIT compilation failed",
    ResultCode.UNSUPPORTED_PTX_VERSION: "the provided PTX was compiled with an unsupported toolchain.",
    ResultCode.INVALID_SOURCE: "device kernel image is invalid",
    ResultCode.FILE_NOT_FOUND: "file not found",
    ResultCode.INVALID_HANDLE: "invalid resource handle",
    ResultCode.ILLEGAL_STATE: "the operation cannot be performed in the present state",
    ResultCode.NOT_FOUND: "named symbol not found",
    ResultCode.NOT_READY: "device not ready",
    ResultCode.ILLEGAL_ADDRESS: "an illegal memory access was encountered",
    ResultCode.LAUNCH_OUT_OF_RESOURCES: "too many resources requested for launch",
    ResultCode.LAUNCH_TIMEOUT: "the launch timed out and was terminated",
    ResultCode.PEER_ACCESS_ALREADY_ENABLED: "peer access is already enabled",
    ResultCode.PEER_ACCESS_NOT_ENABLED: "peer access has not been enabled",
    ResultCode.CONTEXT_IS_DESTROYED: "context is destroyed",
    ResultCode.ASSERT: "device-side assert triggered",
    ResultCode.HOST_MEMORY_ALREADY_REGISTERED: "part or all of the requested memory range is already mapped",
    ResultCode.HOST_MEMORY_NOT_REGISTERED: "pointer does not correspond to a registered memory region",
    ResultCode.HARDWARE_STACK_ERROR: "hardware stack error",
    ResultCode.ILLEGAL_INSTRUCTION: "an illegal instruction was encountered",
    ResultCode.MISALIGNED_ADDRESS: "misaligned address",
    ResultCode.INVALID_ADDRESS_SPACE: "operation not supported on global/shared address space",
    ResultCode.INVALID_PC: "invalid program counter",
    ResultCode.LAUNCH_FAILED: "unspecified launch failure",
    ResultCode.COOPERATIVE_LAUNCH_TOO_LARGE: "too many blocks in cooperative launch",
    ResultCode.NOT_PERMITTED: "operation not permitted",
    ResultCode.NOT_SUPPORTED: "operation not supported",
    ResultCode.STREAM_CAPTURE_UNSUPPORTED: "operation not permitted when stream is capturing",
    ResultCode.STREAM_CAPTURE_INVALIDATED: "operation failed due to a previous error during capture",
    ResultCode.STREAM_CAPTURE_MERGE: "operation would result in a merge of separate capture sequences",
    ResultCode.STREAM_CAPTURE_UNMATCHED: "capture was not ended in the same stream as it began",
    ResultCode.STREAM_CAPTURE_UNJOINED: "capturing stream has unjoined work",
    ResultCode.STREAM_CAPTURE_ISOLATION: "dependency created on uncaptured work in another stream",
    ResultCode.STREAM_CAPTURE_IMPLICIT: "operation would make the legacy stream depend on a capturing blocking stream",
    ResultCode.CAPTURED_EVENT: "operation not permitted on an event last recorded in a capturing stream",
    ResultCode.STREAM_CAPTURE_WRONG_THREAD: "attempt to terminate a thread-local capture sequence from another thread",
    ResultCode.GRAPH_EXEC_UPDATE_FAILURE: "the graph update was not performed because it included changes which "
    "violated constraints specific to instantiated graph update",
    ResultCode.UNKNOWN: "unknown error",
}

_CU_CALLS: dict[str, str] = {
    # core
    "init": "cuInit",
    "driver_version": "cuDriverGetVersion",
    "device_count": "cuDeviceGetCount",
    "device_get": "cuDeviceGet",
    "device_name": "cuDeviceGetName",
    "device_uuid": "cuDeviceGetUuid",
    "device_pci_bus_id": "cuDeviceGetPCIBusId",
    "device_ordinal_by_pci_bus_id": "cuDeviceGetByPCIBusId",
    "device_total_mem": "cuDeviceTotalMem",
    "device_attribute": "cuDeviceGetAttribute",
    "device_can_access_peer": "cuDeviceCanAccessPeer",
    "primary_context_retain": "cuDevicePrimaryCtxRetain",
    "primary_context_release": "cuDevicePrimaryCtxRelease",
    "set_current": "cuCtxSetCurrent",
    "enable_peer_access": "cuCtxEnablePeerAccess",
    "disable_peer_access": "cuCtxDisablePeerAccess",
    "mem_get_info": "cuMemGetInfo",
    "device_p2p_attribute": "cuDeviceGetP2PAttribute",
    "primary_context_get_state": "cuDevicePrimaryCtxGetState",
    "primary_context_set_flags": "cuDevicePrimaryCtxSetFlags",
    "context_create": "cuCtxCreate",
    "context_destroy": "cuCtxDestroy",
    "context_push": "cuCtxPushCurrent",
    "context_pop": "cuCtxPopCurrent",
    "context_current_value": "cuCtxGetCurrent",
    "context_get_flags": "cuCtxGetFlags",
    "context_set_limit": "cuCtxSetLimit",
    "context_get_limit": "cuCtxGetLimit",
    "context_set_cache_config": "cuCtxSetCacheConfig",
    "context_get_cache_config": "cuCtxGetCacheConfig",
    "ctx_synchronize": "cuCtxSynchronize",
    "stream_create": "cuStreamCreateWithPriority",
    "stream_destroy": "cuStreamDestroy",
    "stream_query": "cuStreamQuery",
    "stream_synchronize": "cuStreamSynchronize",
    "stream_wait_event": "cuStreamWaitEvent",
    "stream_priority_range": "cuCtxGetStreamPriorityRange",
    "stream_device_ordinal": "cuStreamGetCtx",
    "stream_get_priority": "cuStreamGetPriority",
    "stream_is_non_blocking": "cuStreamGetFlags",
    "event_create": "cuEventCreate",
    "event_destroy": "cuEventDestroy",
    "event_record": "cuEventRecord",
    "event_record_external": "cuEventRecordWithFlags",
    "event_query": "cuEventQuery",
    "event_synchronize": "cuEventSynchronize",
    "event_elapsed_ms": "cuEventElapsedTime",
    "launch_doorbell": "cuLaunchHostFunc",
    # memory
    "mempool_default": "cuDeviceGetDefaultMemPool",
    "mempool_create": "cuMemPoolCreate",
    "mempool_destroy": "cuMemPoolDestroy",
    "mempool_set_attribute": "cuMemPoolSetAttribute",
    "mempool_get_attribute": "cuMemPoolGetAttribute",
    "mempool_trim_to": "cuMemPoolTrimTo",
    "mempool_set_access": "cuMemPoolSetAccess",
    "mempool_revoke_access": "cuMemPoolSetAccess",
    "mempool_get_access": "cuMemPoolGetAccess",
    "mempool_export_fd": "cuMemPoolExportToShareableHandle",
    "mempool_import_fd": "cuMemPoolImportFromShareableHandle",
    "mempool_export_pointer": "cuMemPoolExportPointer",
    "mempool_import_pointer": "cuMemPoolImportPointer",
    "ipc_event_create": "cuEventCreate",
    "ipc_event_handle": "cuIpcGetEventHandle",
    "ipc_open_event": "cuIpcOpenEventHandle",
    "mem_alloc_managed": "cuMemAllocManaged",
    "mem_free": "cuMemFree",
    "mem_prefetch_async": "cuMemPrefetchAsync",
    "mem_advise": "cuMemAdvise",
    "stream_attach_mem_async": "cuStreamAttachMemAsync",
    "mem_alloc_async": "cuMemAllocFromPoolAsync",
    "mem_free_async": "cuMemFreeAsync",
    "mem_host_alloc": "cuMemHostAlloc",
    "mem_host_free": "cuMemFreeHost",
    "mem_host_register": "cuMemHostRegister",
    "mem_host_unregister": "cuMemHostUnregister",
    "memcpy_htod_async": "cuMemcpyHtoDAsync",
    "memcpy_dtoh_async": "cuMemcpyDtoHAsync",
    "memcpy_dtod_async": "cuMemcpyDtoDAsync",
    "memcpy_peer_async": "cuMemcpyPeerAsync",
    "memset_d8_async": "cuMemsetD8Async",
    "memset_d16_async": "cuMemsetD16Async",
    "memset_d32_async": "cuMemsetD32Async",
    "memcpy_pitched_async": "cuMemcpy2DAsync",
    "memset_2d_async": "cuMemsetD2D32Async",
    "pointer_device_ordinal": "cuPointerGetAttribute",
    # modules
    "module_load_data": "cuModuleLoadDataEx",
    "module_unload": "cuModuleUnload",
    "module_get_function": "cuModuleGetFunction",
    "module_get_global": "cuModuleGetGlobal",
    "module_function_names": "cuModuleEnumerateFunctions",
    "link": "cuLinkComplete",
    "function_get_attribute": "cuFuncGetAttribute",
    "function_set_attribute": "cuFuncSetAttribute",
    "function_set_cache_config": "cuFuncSetCacheConfig",
    "occupancy_max_active_blocks": "cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags",
    "occupancy_max_potential_block_size": "cuOccupancyMaxPotentialBlockSizeWithFlags",
    "occupancy_available_dynamic_smem": "cuOccupancyAvailableDynamicSMemPerBlock",
    "occupancy_max_active_clusters": "cuOccupancyMaxActiveClusters",
    "occupancy_max_potential_cluster_size": "cuOccupancyMaxPotentialClusterSize",
    "launch_kernel": "cuLaunchKernel",
    # graphs
    "stream_begin_capture": "cuStreamBeginCapture",
    "stream_end_capture": "cuStreamEndCapture",
    "stream_capture_status": "cuStreamGetCaptureInfo",
    "stream_join_capture_sinks": "cuStreamUpdateCaptureDependencies",
    "graph_nodes": "cuGraphGetNodes",
    "graph_kernel_node_arguments": "cuGraphKernelNodeGetParams",
    "graph_instantiate": "cuGraphInstantiate",
    "graph_launch": "cuGraphLaunch",
    "graph_exec_update": "cuGraphExecUpdate",
    "graph_exec_kernel_node_set_params": "cuGraphExecKernelNodeSetParams",
    "graph_exec_memcpy_node_set_params": "cuGraphExecMemcpyNodeSetParams",
    "graph_destroy": "cuGraphDestroy",
    "graph_exec_destroy": "cuGraphExecDestroy",
    # profiling
    "profiler_start": "cuProfilerStart",
    "profiler_stop": "cuProfilerStop",
    "nvtx_range_start": "nvtxDomainRangeStartEx",
    "nvtx_range_end": "nvtxDomainRangeEnd",
}


def code_name(code: int) -> str:
    """``"CUDA_ERROR_..."`` for a result code (``"CUresult N"`` for one aiocuda does not name)."""
    return _NAMES.get(code, f"CUresult {code}")


def cu_call(seam_name: str) -> str:
    """The driver entry point behind a seam method name (``"event_query"`` -> ``"cuEventQuery"``).

    Names the table does not know are returned unchanged.
    """
    return _CU_CALLS.get(seam_name, seam_name)


def sim_error(code: int, call: str, detail: str = "") -> CudaError:
    """The exception the real driver would produce for ``code``, raised by the sim.

    ``call`` is a seam method name (translated with :func:`cu_call`) or a ``cu*`` name.
    ``detail`` -- what exactly was wrong -- is appended to the driver's description.
    """
    description = _DESCRIPTIONS.get(code, "")
    if detail:
        description = f"{description}: {detail}" if description else detail
    return error_for_code(code, code_name(code), description, cu_call(call))
