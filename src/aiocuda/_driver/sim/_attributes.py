"""Device attributes of a simulated GPU: the values an H100 SXM5 (80 GB) reports.

Keys are ``CU_DEVICE_ATTRIBUTE_*`` names as lowercase suffixes, exactly as
``cuda.bindings.driver.CUdevice_attribute`` spells them (the tests check that), so code
that reads attributes by name behaves the same on both backends. ``pci_bus_id`` is
filled in per device by the core.
"""

from __future__ import annotations

from types import MappingProxyType

__all__ = ["H100_ATTRIBUTES"]

H100_ATTRIBUTES = MappingProxyType(
    {
        # launch limits
        "max_threads_per_block": 1024,
        "max_block_dim_x": 1024,
        "max_block_dim_y": 1024,
        "max_block_dim_z": 64,
        "max_grid_dim_x": 2147483647,
        "max_grid_dim_y": 65535,
        "max_grid_dim_z": 65535,
        "max_shared_memory_per_block": 49152,
        "max_shared_memory_per_block_optin": 232448,
        "reserved_shared_memory_per_block": 1024,
        "max_shared_memory_per_multiprocessor": 233472,
        "total_constant_memory": 65536,
        "warp_size": 32,
        "max_pitch": 2147483647,
        "max_registers_per_block": 65536,
        "max_registers_per_multiprocessor": 65536,
        "max_threads_per_multiprocessor": 2048,
        "max_blocks_per_multiprocessor": 32,
        "texture_alignment": 512,
        "texture_pitch_alignment": 32,
        "surface_alignment": 512,
        # the chip
        "multiprocessor_count": 132,
        "clock_rate": 1980000,
        "memory_clock_rate": 2619000,
        "global_memory_bus_width": 5120,
        "l2_cache_size": 52428800,
        "max_persisting_l2_cache_size": 82837504,
        "max_access_policy_window_size": 134213632,
        "compute_capability_major": 9,
        "compute_capability_minor": 0,
        "single_to_double_precision_perf_ratio": 2,
        "integrated": 0,
        "multi_gpu_board": 0,
        "multi_gpu_board_group_id": 0,
        "ecc_enabled": 1,
        "tcc_driver": 0,
        "compute_mode": 0,
        "kernel_exec_timeout": 0,
        "mps_enabled": 0,
        "numa_config": 0,
        "numa_id": -1,
        "host_numa_id": -1,
        # PCI (pci_bus_id is per device)
        "pci_device_id": 0,
        "pci_domain_id": 0,
        # capabilities
        "gpu_overlap": 1,
        "async_engine_count": 2,
        "concurrent_kernels": 1,
        "unified_addressing": 1,
        "can_map_host_memory": 1,
        "managed_memory": 1,
        "concurrent_managed_access": 1,
        "pageable_memory_access": 0,
        "pageable_memory_access_uses_host_page_tables": 0,
        "direct_managed_mem_access_from_host": 0,
        "host_native_atomic_supported": 0,
        "compute_preemption_supported": 1,
        "can_use_host_pointer_for_registered_mem": 1,
        "host_register_supported": 1,
        "read_only_host_register_supported": 1,
        "cooperative_launch": 1,
        "cooperative_multi_device_launch": 1,
        "cluster_launch": 1,
        "stream_priorities_supported": 1,
        "global_l1_cache_supported": 1,
        "local_l1_cache_supported": 1,
        "can_flush_remote_writes": 0,
        "can_use_64_bit_stream_mem_ops": 1,
        "can_use_stream_wait_value_nor": 1,
        "virtual_address_management_supported": 1,
        "handle_type_posix_file_descriptor_supported": 1,
        "handle_type_win32_handle_supported": 0,
        "handle_type_win32_kmt_handle_supported": 0,
        "handle_type_fabric_supported": 0,
        "generic_compression_supported": 1,
        "sparse_cuda_array_supported": 1,
        "timeline_semaphore_interop_supported": 1,
        "memory_pools_supported": 1,
        "mempool_supported_handle_types": 1,
        "gpu_direct_rdma_supported": 1,
        "gpu_direct_rdma_with_cuda_vmm_supported": 1,
        "deferred_mapping_cuda_array_supported": 1,
        "dma_buf_supported": 1,
        "ipc_event_supported": 1,
        "mem_sync_domain_count": 4,
        "tensor_map_access_supported": 1,
        "unified_function_pointers": 1,
        "multicast_supported": 0,
    }
)
