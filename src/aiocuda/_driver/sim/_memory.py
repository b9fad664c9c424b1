"""Simulated memory: pools, device and pinned host allocations, copies and memsets.

"Device memory" here is ordinary host memory owned by the simulator (numpy byte
arrays), so device pointers are genuine addresses and copies are ``ctypes.memmove``
calls run on the stream's worker thread. Every device-side range is validated against
the allocation table before it is touched -- at enqueue time (a bad pointer raises
:class:`~aiocuda.errors.ArgumentError` ``INVALID_VALUE`` at once, as the driver does
for ranges it can check) and again when the operation runs (memory freed meanwhile
poisons the context with ``ILLEGAL_ADDRESS``, as a real use-after-free would) -- so no
mistake above the seam can crash the process.

As with the driver, a block whose free has run is given back to the device (by
``mempool_trim_to``, or by the release threshold) only once the host has observed that
free complete through a synchronisation: ``stream_synchronize`` or
``event_synchronize`` of the stream that freed it (observing every free that stream has
run), or ``ctx_synchronize`` (every free of the device's pools). Queries observe
nothing. The release threshold is applied at those synchronisations.

Departures from the driver, kept on purpose:

* A pool reuses a freed block only for an allocation of exactly the same size. Memory
  freed with ``mem_free_async`` is reusable at once by allocations on the *same*
  stream (stream order puts their work after the free, as with the driver), and by
  other streams once the free has run -- unless both ``reuse_allow_opportunistic`` and
  ``reuse_allow_internal_dependencies`` are set to 0: then only by the stream that
  freed it. (The driver, with both on, often fails to see that a free on another
  stream has run and maps new memory instead; turning them off makes that certain.)
  The pool never trims itself to satisfy an allocation: when it cannot grow it fails
  with ``OUT_OF_MEMORY``, which is what the layer above must handle (trim, retry).
* Host pointers (``src`` of ``htod``, ``dst`` of ``dtoh``) cannot be validated beyond
  "not null, not inside device memory": pass only addresses of live host buffers. On a
  capturing stream they must be page-locked (``mem_host_alloc`` or registered).
* Graph allocations (``mem_alloc_async`` on a capturing stream, see ``_graphs.py``) do
  not come from the pool: they count in the device's memory (``mem_get_info``) but not
  in the pool's statistics, as with the driver's separate graph memory.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from ...errors import ResultCode, error_for_code
from .._protocol import PoolProps
from ._graphs import SimCapture, SimGraph
from ._objects import SimDevice, SimPoint
from ._operations import Copy, GraphAllocation, GraphFree, Set, device_range, host_range, page_locked
from ._operations import invalid as _invalid
from ._shared import SharedRegion

__all__ = ["SimMemory", "SimPool"]

_ALIGN = 256
"""Alignment of simulated device allocations (the driver guarantees at least 256)."""

IPC_POOL_BYTES = 4 << 30
"""Most memory one simulated IPC pool holds (its shared mapping's size)."""

_REUSE_ATTRIBUTES = (
    "reuse_follow_event_dependencies",
    "reuse_allow_opportunistic",
    "reuse_allow_internal_dependencies",
)
_POOL_ATTRIBUTES = (
    "release_threshold",
    "reserved_mem_current",
    "reserved_mem_high",
    "used_mem_current",
    "used_mem_high",
    *_REUSE_ATTRIBUTES,
)


def _never_fails(err: Any, call: str) -> None:
    raise AssertionError(f"{call}: the simulator raises its errors itself, not through a result code ({err!r})")


def _aligned_bytes(size: int) -> np.ndarray:
    """A zeroed byte array whose data address is a multiple of ``_ALIGN``."""
    raw = np.zeros(size + _ALIGN, dtype=np.uint8)
    offset = (-raw.ctypes.data) % _ALIGN
    return raw[offset : offset + size]


class SimPool:
    """A simulated ``CUmemoryPool`` on one device."""

    __slots__ = (
        "access",
        "cached",
        "cached_bytes",
        "destroyed",
        "freeing_on",
        "imported",
        "is_default",
        "managed",
        "max_size",
        "ordinal",
        "region",
        "release_threshold",
        "reserved",
        "reserved_high",
        "reuse",
        "unobserved",
        "used",
        "used_high",
    )

    def __init__(self, ordinal: int, max_size: int, is_default: bool) -> None:
        self.ordinal = ordinal
        self.max_size = max_size
        self.is_default = is_default
        self.release_threshold = 0
        self.used = 0
        self.used_high = 0
        self.reserved = 0
        self.reserved_high = 0
        self.cached: dict[int, list[tuple[np.ndarray, Any]]] = {}
        """Unused blocks by size, each with the stream whose free returned it."""
        self.reuse = dict.fromkeys(_REUSE_ATTRIBUTES, 1)
        self.cached_bytes = 0
        self.freeing_on: dict[tuple[Any, int], dict[int, _Block]] = {}
        """Blocks whose free is enqueued but has not run, by (stream, size), then start."""
        self.unobserved: dict[int, Any] = {}
        """Cached blocks (by start) whose free the host has not observed, with the stream
        that freed them: no trim gives them back."""
        self.destroyed = False
        self.access: set[int] = {ordinal}
        self.managed = False
        self.region: SharedRegion | None = None
        """Where an IPC pool's blocks live (shared with the processes that import it)."""
        self.imported = False
        """Imported from another process: pointers are imported from it, nothing allocated."""

    def __repr__(self) -> str:
        return f"<SimPool device={self.ordinal} used={self.used} reserved={self.reserved}>"


_FREED_BY_GRAPH = object()
"""``free_token`` of a graph allocation freed by a node of its capture."""


class _Block:
    """One entry of the allocation table: a device or pinned-host range."""

    __slots__ = ("array", "free_token", "graph", "imported", "kind", "managed", "ordinal", "pool", "size", "start")

    def __init__(self, start: int, size: int, array: np.ndarray | None, kind: str, ordinal: int, pool: SimPool | None):
        self.start = start
        self.size = size
        self.array = array
        self.kind = kind  # "device", "host" (mem_host_alloc) or "registered"
        self.ordinal = ordinal
        self.pool = pool
        """The pool it came from; None for managed allocations and imported pointers."""
        self.managed = False
        """Managed memory (host code may use it too)."""
        self.imported = False
        """A pointer imported from another process's pool (``mem_free``/``mem_free_async``
        end the import)."""
        self.free_token: object | None = None
        """Set while a free is enqueued; a same-stream reuse clears it, cancelling that free."""
        self.graph: SimGraph | None = None
        """The graph owning a graph allocation (made during a capture)."""


class SimMemory:
    """Mixin of SimDriver: memory operations (see the module docstring)."""

    # Provided by SimCore.
    _enqueue: Callable[..., None]
    _api: Callable[..., None]
    _stream_ordinal: Callable[[Any], int]
    _resolve_stream: Callable[[Any], Any]
    _device: Callable[[Any], SimDevice]
    _devices: tuple[SimDevice, ...]
    _device_of_current: Callable[[], int]
    _wait_for: Callable[[SimPoint, str], None]
    _captures: set[SimCapture]
    _free_beside_captures: Callable[[], None]  # (by SimGraphs)
    _refuse_capturing_context: Callable[[int, str], None]  # (by SimGraphs)

    # -- state ------------------------------------------------------------------------------
    def _mem(self) -> _MemoryState:
        try:
            return self._sim_memory  # type: ignore[has-type, no-any-return]
        except AttributeError:
            self._sim_memory = _MemoryState(self._devices)
            return self._sim_memory

    def _check_ordinal(self, ordinal: int, call: str) -> None:
        if not 0 <= ordinal < len(self._devices):
            raise error_for_code(ResultCode.INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", f"no device {ordinal}", call)

    # -- pools ------------------------------------------------------------------------------
    def mempool_default(self, dev: Any) -> SimPool:
        ordinal = self._device(dev).ordinal
        self._api("mempool_default", ordinal)
        return self._mem().default_pool(ordinal)

    def mempool_create(self, props: PoolProps) -> SimPool:
        self._check_ordinal(props.device_ordinal, "cuMemPoolCreate")
        self._api("mempool_create", props.device_ordinal)
        if props.max_size < 0:
            raise _invalid("cuMemPoolCreate", f"max_size must be >= 0, got {props.max_size}")
        if props.managed and (props.max_size or props.ipc):
            raise _invalid("cuMemPoolCreate", "a managed pool has no size limit and cannot be exported")
        pool = SimPool(props.device_ordinal, props.max_size, is_default=False)
        pool.managed = props.managed
        if props.ipc:
            total = self._devices[props.device_ordinal].total_mem
            pool.region = SharedRegion.create(min(IPC_POOL_BYTES, props.max_size or total))
        state = self._mem()
        with state.lock:
            state.pools.append(pool)
        return pool

    def mempool_destroy(self, pool: SimPool) -> None:
        self._api("mempool_destroy", pool.ordinal)
        state = self._mem()
        with state.lock:
            self._check_pool(pool, "cuMemPoolDestroy")
            if pool.is_default:
                raise _invalid("cuMemPoolDestroy", "the default pool cannot be destroyed")
            pool.destroyed = True
            state.pools.remove(pool)
            state.trim_cached(pool, 0, observed_only=False)

    def mempool_set_attribute(self, pool: SimPool, attribute: str, value: int) -> None:
        self._api("mempool_set_attribute", pool.ordinal)
        self._check_pool(pool, "cuMemPoolSetAttribute")
        if attribute == "release_threshold":
            pool.release_threshold = int(value)
        elif attribute in _REUSE_ATTRIBUTES:
            pool.reuse[attribute] = int(bool(value))
        elif attribute in ("reserved_mem_high", "used_mem_high"):
            if value != 0:
                raise _invalid("cuMemPoolSetAttribute", f"{attribute} can only be reset to 0")
            with self._mem().lock:
                if attribute == "used_mem_high":
                    pool.used_high = pool.used
                else:
                    pool.reserved_high = pool.reserved
        elif attribute not in _POOL_ATTRIBUTES or attribute.endswith("_current"):
            raise _invalid("cuMemPoolSetAttribute", f"pool attribute {attribute!r} cannot be set")

    def mempool_get_attribute(self, pool: SimPool, attribute: str) -> int:
        self._api("mempool_get_attribute", pool.ordinal)
        self._check_pool(pool, "cuMemPoolGetAttribute")
        values = {
            "release_threshold": pool.release_threshold,
            "reserved_mem_current": pool.reserved,
            "reserved_mem_high": pool.reserved_high,
            "used_mem_current": pool.used,
            "used_mem_high": pool.used_high,
        }
        if attribute in values:
            return values[attribute]
        if attribute in _REUSE_ATTRIBUTES:
            return pool.reuse[attribute]
        raise _invalid("cuMemPoolGetAttribute", f"unknown pool attribute {attribute!r}")

    def mempool_trim_to(self, pool: SimPool, min_bytes_to_keep: int) -> None:
        self._api("mempool_trim_to", pool.ordinal)
        self._check_pool(pool, "cuMemPoolTrimTo")
        state = self._mem()
        with state.lock:
            state.trim_cached(pool, max(0, int(min_bytes_to_keep)))

    def ctx_synchronize(self) -> None:
        ordinal = self._device_of_current()
        self._api("ctx_synchronize", ordinal)
        if self._captures:
            self._refuse_capturing_context(ordinal, "ctx_synchronize")
        for stream in self._devices[ordinal].streams():
            self._wait_for(SimPoint(stream, stream.submitted), "ctx_synchronize")
        self._observe_frees(ordinal, None)

    def _observe_frees(self, ordinal: int, stream: Any | None) -> None:
        """A synchronisation returned (see the module docstring); ``stream`` is the sim
        stream it waited for, None for the whole device."""
        self._mem().observe_frees(ordinal, stream)

    def mempool_set_access(self, pool: SimPool, peer_ordinal: int) -> None:
        self._api("mempool_set_access", pool.ordinal)
        self._check_pool(pool, "cuMemPoolSetAccess")
        self._check_ordinal(peer_ordinal, "cuMemPoolSetAccess")
        pool.access.add(peer_ordinal)

    def mempool_revoke_access(self, pool: SimPool, peer_ordinal: int) -> None:
        self._api("mempool_revoke_access", pool.ordinal)
        self._check_pool(pool, "cuMemPoolSetAccess")
        self._check_ordinal(peer_ordinal, "cuMemPoolSetAccess")
        if peer_ordinal == pool.ordinal:
            raise error_for_code(
                ResultCode.INVALID_DEVICE,
                "CUDA_ERROR_INVALID_DEVICE",
                "the owning device's access to its pool cannot be taken away",
                "cuMemPoolSetAccess",
            )
        pool.access.discard(peer_ordinal)  # PROT_NONE where there was none is no error

    def mempool_get_access(self, pool: SimPool, device_ordinal: int) -> bool:
        self._api("mempool_get_access", pool.ordinal)
        self._check_pool(pool, "cuMemPoolGetAccess")
        self._check_ordinal(device_ordinal, "cuMemPoolGetAccess")
        return device_ordinal in pool.access

    def _check_pool(self, pool: Any, call: str) -> None:
        if not isinstance(pool, SimPool) or pool.destroyed:
            raise error_for_code(ResultCode.INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "not a live memory pool", call)

    # -- device allocation ------------------------------------------------------------------
    def mem_alloc_async(self, size: int, pool: SimPool, stream: Any) -> int:
        self._api("mem_alloc_async", pool.ordinal)
        self._check_pool(pool, "cuMemAllocFromPoolAsync")
        if size <= 0:
            raise _invalid("cuMemAllocFromPoolAsync", f"size must be > 0, got {size}")
        if size >= 1 << 64:  # as the bindings do, converting to size_t
            raise OverflowError(f"size {size} does not fit a size_t")
        sim_stream = self._resolve_stream(stream)
        if sim_stream.device.ordinal != pool.ordinal:
            raise _invalid("cuMemAllocFromPoolAsync", "the stream and the pool belong to different devices")
        if pool.imported:
            raise _invalid("cuMemAllocFromPoolAsync", "an imported pool allocates nothing")
        if sim_stream.capture is not None:
            return self._graph_allocate(size, sim_stream.capture, sim_stream)
        state = self._mem()
        with state.lock:
            reused = state.take_freeing(pool, sim_stream, size)
            if reused is not None:
                return reused.start
            array = state.take_cached(pool, size, sim_stream)
            if array is None:
                device = self._devices[pool.ordinal]
                over_pool = pool.max_size and pool.reserved + size > pool.max_size
                carved = None if pool.region is None else pool.region.carve(size)
                if over_pool or device.used_bytes + size > device.total_mem or (pool.region and carved is None):
                    raise error_for_code(
                        ResultCode.OUT_OF_MEMORY,
                        "CUDA_ERROR_OUT_OF_MEMORY",
                        "out of memory",
                        "cuMemAllocFromPoolAsync",
                    )
                array = carved if carved is not None else _aligned_bytes(size)
                pool.reserved += size
                pool.reserved_high = max(pool.reserved_high, pool.reserved)
                device.used_bytes += size
            pool.used += size
            pool.used_high = max(pool.used_high, pool.used)
            start = array.ctypes.data
            block = _Block(start, size, array, "device", pool.ordinal, pool)
            block.managed = pool.managed
            state.insert(block)
        return start

    def _graph_allocate(self, size: int, capture: SimCapture, stream: Any) -> int:
        """A graph allocation: memory the captured graph owns, at a fixed address."""
        state = self._mem()
        device = stream.device
        with state.lock:
            if device.used_bytes + size > device.total_mem:
                raise error_for_code(
                    ResultCode.OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory", "cuMemAllocFromPoolAsync"
                )
            array = _aligned_bytes(size)
            device.used_bytes += size
            block = _Block(array.ctypes.data, size, array, "device", device.ordinal, None)
            block.graph = capture.graph
            state.insert(block)
        capture.graph.allocations.append(block)
        capture.add(stream, GraphAllocation(block.start, size), "mem_alloc_async")
        return block.start

    def _release_graph_memory(self, graph: SimGraph) -> None:
        """Give back a graph's allocations (it is destroyed and no replay can use them)."""
        state = self._mem()
        with state.lock:
            for owned in graph.allocations:
                start, ordinal, size = owned.start, owned.ordinal, owned.size
                if state.blocks.get(start) is owned:
                    state.remove(start)
                    state.devices[ordinal].used_bytes -= size
            graph.allocations.clear()

    def mem_free_async(self, ptr: int, stream: Any) -> None:
        sim_stream = self._resolve_stream(stream)
        self._api("mem_free_async", sim_stream.device.ordinal)
        state = self._mem()
        capture: SimCapture | None = sim_stream.capture
        if capture is not None:
            with state.lock:
                block = state.blocks.get(ptr)
                if block is None or block.graph is not capture.graph or block.free_token is not None:
                    raise capture.invalidate(
                        ResultCode.INVALID_VALUE,
                        "cuMemFreeAsync",
                        f"0x{ptr:x} is not an allocation of this capture (only those can be freed during it)",
                    )
                block.free_token = _FREED_BY_GRAPH
            capture.add(sim_stream, GraphFree(ptr), "mem_free_async")
            return
        if self._captures:
            self._free_beside_captures()
        token = object()
        with state.lock:
            block = state.blocks.get(ptr)
            if block is None or block.kind != "device" or block.free_token is not None:
                raise _invalid("cuMemFreeAsync", f"0x{ptr:x} is not a live allocation of a memory pool")
            if block.imported:
                block.free_token = token
                self._enqueue(stream, lambda: state.end_import(block), "mem_free_async")
                return
            pool, array = block.pool, block.array
            if pool is None:
                hint = " (managed memory: free it with cuMemFree)" if block.managed else ""
                raise _invalid("cuMemFreeAsync", f"0x{ptr:x} is not a live allocation of a memory pool{hint}")
            assert array is not None
            block.free_token = token
            pool.freeing_on.setdefault((sim_stream, block.size), {})[ptr] = block

        def free() -> None:
            with state.lock:
                if block.free_token is not token:
                    return  # reused by a later allocation on this stream: nothing to free
                state.forget_freeing(pool, sim_stream, block)
                state.remove(ptr)
                pool.used -= block.size
                if pool.destroyed:
                    pool.reserved -= block.size
                    state.devices[pool.ordinal].used_bytes -= block.size
                    return
                pool.cached.setdefault(block.size, []).append((array, sim_stream))
                pool.cached_bytes += block.size
                pool.unobserved[ptr] = sim_stream

        try:
            self._enqueue(stream, free, "mem_free_async")
        except BaseException:
            with state.lock:
                if block.free_token is token:  # not freed after all
                    state.forget_freeing(pool, sim_stream, block)
            raise

    def mem_async_calls(self) -> tuple[Callable[..., tuple[int, int]], Callable[..., tuple[int]], Callable[..., None]]:
        """``(alloc, free, fail)`` with the real backend's calling convention (see
        ``CudaMemory.mem_async_calls``); the sim raises from ``alloc`` and ``free``
        themselves, so ``fail`` is never called."""
        return self._alloc_result, self._free_result, _never_fails

    def _alloc_result(self, size: int, pool: SimPool, stream: Any) -> tuple[int, int]:
        return 0, self.mem_alloc_async(size, pool, stream)

    def _free_result(self, ptr: int, stream: Any) -> tuple[int]:
        self.mem_free_async(ptr, stream)
        return (0,)

    def _allocate_module_memory(self, ordinal: int, size: int) -> tuple[int, np.ndarray]:
        """Zeroed device memory for a module's variable (no pool; freed by the unload)."""
        array = _aligned_bytes(max(1, size))
        state = self._mem()
        with state.lock:
            state.insert(_Block(array.ctypes.data, size, array, "device", ordinal, None))
        return array.ctypes.data, array

    def _free_module_memory(self, ptr: int) -> None:
        state = self._mem()
        with state.lock:
            state.remove(ptr)

    def pointer_device_ordinal(self, ptr: int) -> int:
        self._api("pointer_device_ordinal")
        block = self._mem().find(ptr, 1)
        if block is None or block.kind != "device":
            raise _invalid("cuPointerGetAttribute", f"0x{ptr:x} is not a device pointer")
        return block.ordinal

    # -- host memory --------------------------------------------------------------------------
    def mem_host_alloc(self, size: int) -> int:
        self._api("mem_host_alloc")
        if size <= 0:
            raise _invalid("cuMemHostAlloc", f"size must be > 0, got {size}")
        try:
            array = _aligned_bytes(size)
        except MemoryError:  # (what the driver answers when the host cannot lock that much)
            raise error_for_code(
                ResultCode.OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory", "cuMemHostAlloc"
            ) from None
        state = self._mem()
        with state.lock:
            state.insert(_Block(array.ctypes.data, size, array, "host", -1, None))
        return int(array.ctypes.data)

    def mem_host_free(self, ptr: int) -> None:
        self._api("mem_host_free")
        self._wait_until_devices_idle()
        state = self._mem()
        with state.lock:
            block = state.blocks.get(ptr)
            if block is None or block.kind != "host":
                raise _invalid("cuMemFreeHost", f"0x{ptr:x} was not allocated with cuMemHostAlloc")
            state.remove(ptr)

    def mem_host_register(self, ptr: int, size: int) -> None:
        self._api("mem_host_register")
        if not ptr or size <= 0:
            raise _invalid("cuMemHostRegister", "a null pointer or an empty range cannot be registered")
        state = self._mem()
        with state.lock:
            if state.overlaps(ptr, size):
                raise error_for_code(
                    ResultCode.HOST_MEMORY_ALREADY_REGISTERED,
                    "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
                    "part of the range is already registered or allocated",
                    "cuMemHostRegister",
                )
            state.insert(_Block(ptr, size, None, "registered", -1, None))

    def mem_host_unregister(self, ptr: int) -> None:
        self._api("mem_host_unregister")
        self._wait_until_devices_idle()
        state = self._mem()
        with state.lock:
            block = state.blocks.get(ptr)
            if block is None or block.kind != "registered":
                raise error_for_code(
                    ResultCode.HOST_MEMORY_NOT_REGISTERED,
                    "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
                    f"0x{ptr:x} is not the start of a registered range",
                    "cuMemHostUnregister",
                )
            state.remove(ptr)

    def _wait_until_devices_idle(self) -> None:
        """As the driver does before freeing or unpinning page-locked memory: wait for
        what every device has been given."""
        # On an H100, cuMemFreeHost and cuMemHostUnregister returned only once a kernel
        # running on any stream had finished; the sim imitates that.
        for device in self._devices:
            for stream in device.streams():
                point = SimPoint(stream, stream.submitted)
                if not point.reached():
                    stream.wait_until(point.reached)

    # -- copies and memsets --------------------------------------------------------------------
    def _check_host(self, stream: Any, ptr: int, size: int, call: str) -> None:
        host_range(self._mem(), ptr, size, call)
        capture: SimCapture | None = self._resolve_stream(stream).capture
        if capture is not None and not page_locked(self._mem(), ptr, size):
            raise capture.invalidate(
                ResultCode.STREAM_CAPTURE_UNSUPPORTED,
                call,
                f"[0x{ptr:x}, +{size}) is pageable host memory: a copy of it cannot be captured",
            )

    def _check_size(self, size: int, call: str) -> None:
        if size < 0:
            raise _invalid(call, f"size must be >= 0, got {size}")

    def _copy(self, direction: str, dst: int, src: int, size: int, stream: Any, name: str, call: str) -> None:
        self._api(name, self._stream_ordinal(stream))
        self._check_size(size, call)
        if size == 0:
            return
        state = self._mem()
        if direction in ("htod", "dtod", "peer"):
            device_range(state, dst, size, call)
        else:
            self._check_host(stream, dst, size, call)
        if direction in ("dtoh", "dtod", "peer"):
            device_range(state, src, size, call)
        else:
            self._check_host(stream, src, size, call)
        self._enqueue(stream, Copy(state, call, direction, dst, src, size), name)

    def memcpy_htod_async(self, dst: int, src: int, size: int, stream: Any) -> None:
        self._copy("htod", dst, src, size, stream, "memcpy_htod_async", "cuMemcpyHtoDAsync")

    def memcpy_dtoh_async(self, dst: int, src: int, size: int, stream: Any) -> None:
        self._copy("dtoh", dst, src, size, stream, "memcpy_dtoh_async", "cuMemcpyDtoHAsync")

    def memcpy_dtod_async(self, dst: int, src: int, size: int, stream: Any) -> None:
        self._copy("dtod", dst, src, size, stream, "memcpy_dtod_async", "cuMemcpyDtoDAsync")

    def memcpy_peer_async(self, dst: int, dst_ctx: Any, src: int, src_ctx: Any, size: int, stream: Any) -> None:
        self._copy("peer", dst, src, size, stream, "memcpy_peer_async", "cuMemcpyPeerAsync")

    def memset_d8_async(self, dst: int, value: int, count: int, stream: Any) -> None:
        self._api("memset_d8_async", self._stream_ordinal(stream))
        self._check_size(count, "cuMemsetD8Async")
        if count == 0:
            return
        device_range(self._mem(), dst, count, "cuMemsetD8Async")
        self._enqueue(stream, Set(self._mem(), "cuMemsetD8Async", dst, int(value) & 0xFF, count, 1), "memset_d8_async")

    def memset_d32_async(self, dst: int, value: int, count: int, stream: Any) -> None:
        self._api("memset_d32_async", self._stream_ordinal(stream))
        self._check_size(count, "cuMemsetD32Async")
        if count == 0:
            return
        if dst % 4:
            raise _invalid("cuMemsetD32Async", f"0x{dst:x} is not 4-byte aligned")
        device_range(self._mem(), dst, count * 4, "cuMemsetD32Async")
        word = int(value) & 0xFFFFFFFF
        self._enqueue(stream, Set(self._mem(), "cuMemsetD32Async", dst, word, count, 4), "memset_d32_async")


class _MemoryState:
    """The allocation table and pools of one simulated driver (guarded by ``lock``)."""

    def __init__(self, devices: tuple[SimDevice, ...]) -> None:
        self.lock = threading.RLock()
        self.blocks: dict[int, _Block] = {}
        self.starts: list[int] = []
        self.defaults: dict[int, SimPool] = {}
        self.pools: list[SimPool] = []
        """Every live pool, default ones included."""
        self.devices = devices
        """Their ``used_bytes`` counts the bytes pools reserve (what ``mem_get_info`` sees)."""

    def default_pool(self, ordinal: int) -> SimPool:
        with self.lock:
            pool = self.defaults.get(ordinal)
            if pool is None:
                pool = self.defaults[ordinal] = SimPool(ordinal, 0, is_default=True)
                self.pools.append(pool)
            return pool

    def observe_frees(self, ordinal: int, stream: Any | None) -> None:
        """A synchronisation on device ``ordinal`` returned: the frees that ``stream``
        (None: any stream of the device) has run are observed, and each pool of the
        device gives back what exceeds its release threshold."""
        with self.lock:
            for pool in self.pools:
                if pool.ordinal != ordinal:
                    continue
                if stream is None:
                    pool.unobserved.clear()
                else:
                    for start in [start for start, freed_on in pool.unobserved.items() if freed_on is stream]:
                        del pool.unobserved[start]
                if pool.reserved > pool.release_threshold:
                    self.trim_cached(pool, pool.release_threshold)

    def end_import(self, block: _Block) -> None:
        """An imported pointer's free ran: forget it (the exporter owns the memory)."""
        with self.lock:
            if self.blocks.get(block.start) is block:
                self.remove(block.start)

    def insert(self, block: _Block) -> None:
        self.blocks[block.start] = block
        bisect.insort(self.starts, block.start)

    def remove(self, start: int) -> None:
        del self.blocks[start]
        del self.starts[bisect.bisect_left(self.starts, start)]

    def find(self, ptr: int, size: int) -> _Block | None:
        """The block wholly containing ``[ptr, ptr + size)``, or None."""
        with self.lock:
            i = bisect.bisect_right(self.starts, ptr) - 1
            if i < 0:
                return None
            block = self.blocks[self.starts[i]]
            if ptr + size <= block.start + block.size:
                return block
            return None

    def overlaps(self, ptr: int, size: int) -> bool:
        i = bisect.bisect_right(self.starts, ptr + size - 1) - 1
        if i < 0:
            return False
        block = self.blocks[self.starts[i]]
        return block.start + block.size > ptr

    def take_freeing(self, pool: SimPool, stream: Any, size: int) -> _Block | None:
        """A block of ``size`` whose free is enqueued on ``stream`` and has not run: it is
        live again, its free cancelled (still counted in ``used``, which the free would
        have decremented)."""
        blocks = pool.freeing_on.get((stream, size))
        if not blocks:
            return None
        block = next(reversed(blocks.values()))  # the last freed
        self.forget_freeing(pool, stream, block)
        return block

    def forget_freeing(self, pool: SimPool, stream: Any, block: _Block) -> None:
        """``block``'s enqueued free is over (it ran) or void (reused, or not enqueued)."""
        block.free_token = None
        key = (stream, block.size)
        blocks = pool.freeing_on[key]
        del blocks[block.start]
        if not blocks:
            del pool.freeing_on[key]

    def take_cached(self, pool: SimPool, size: int, stream: Any) -> np.ndarray | None:
        """An unused block of ``size`` that an allocation on ``stream`` may reuse: any,
        or with cross-stream reuse turned off, one freed on ``stream``."""
        arrays = pool.cached.get(size)
        if not arrays:
            return None
        across = pool.reuse["reuse_allow_opportunistic"] or pool.reuse["reuse_allow_internal_dependencies"]
        for i in range(len(arrays) - 1, -1, -1):
            array, freed_on = arrays[i]
            if across or freed_on is stream:
                del arrays[i]
                pool.cached_bytes -= size
                pool.unobserved.pop(array.ctypes.data, None)
                return array
        return None

    def trim_cached(self, pool: SimPool, keep: int, *, observed_only: bool = True) -> None:
        """Give cached (unused) blocks back while at least ``keep`` bytes stay reserved
        (``cuMemPoolTrimTo`` keeps at least its ``minBytesToKeep``); with
        ``observed_only``, only blocks whose free the host has observed."""
        for size in sorted(pool.cached, reverse=True):
            arrays = pool.cached[size]
            for i in range(len(arrays) - 1, -1, -1):
                if pool.reserved - size < keep:
                    break
                start = arrays[i][0].ctypes.data
                if observed_only and start in pool.unobserved:
                    continue
                if pool.region is not None:
                    pool.region.release(arrays[i][0])
                del arrays[i]
                pool.unobserved.pop(start, None)
                pool.cached_bytes -= size
                pool.reserved -= size
                self.devices[pool.ordinal].used_bytes -= size
            if not arrays:
                del pool.cached[size]
