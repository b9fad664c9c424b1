"""The driver seam: the small interface both backends implement.

Everything above ``aiocuda._driver`` talks to CUDA only through an object satisfying
:class:`Driver`. Two implementations exist: ``cuda`` (``cuda.bindings.driver``, the real
thing) and ``sim`` (a simulated driver on the CPU). They must agree on semantics, which
are those of the CUDA Driver API; where the simulation departs from it the departure is
documented on the sim class.

Conventions:

* Handles (devices, contexts, streams, events, pools, modules, functions) are opaque
  objects owned by the backend. Above the seam they are stored and passed back, never
  inspected; ``handle_value`` turns one into the integer other libraries exchange.
* Device and host pointers are plain ``int`` addresses.
* Every call is checked: a failure raises :class:`aiocuda.errors.CudaError` (the most
  specific subclass, via :func:`aiocuda.errors.error_for_code`). ``NOT_READY`` from a
  query is not a failure: queries return ``False``.
* Calls that need a current context (creating streams, allocating, loading modules,
  launching) use whatever context the calling thread has current; binding it is the
  device layer's job (:meth:`Driver.set_current`).
* Stream-ordered calls (``*_async``, ``launch_*``, ``event_record``) only enqueue work.
* Graphs: while a stream is being captured (``stream_begin_capture``), stream-ordered
  calls on it -- and on streams that join the capture by waiting on an event recorded in
  it -- add nodes to the graph instead of running. Calls that need the captured work to
  have run (a query or synchronize of the stream, a query of an event recorded in it)
  fail with ``CaptureError`` and invalidate the capture.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from ._jit import JitOptions, LinkInput
from ._launch import LaunchConfig

Handle = Any
"""An opaque backend handle (CUstream, CUevent, a sim object, ...)."""


CaptureMode = Literal["global", "thread_local", "relaxed"]
"""Which threads may not make potentially unsafe calls (allocating or freeing page-locked
memory, loading modules, ...) while a stream is captured: any thread (``"global"``), the
capturing thread (``"thread_local"``) or none (``"relaxed"``)."""

CAPTURE_MODES: tuple[CaptureMode, ...] = ("global", "thread_local", "relaxed")

CaptureStatus = Literal["none", "active", "invalidated"]
"""A stream's part in a capture (``CUstreamCaptureStatus``): none, in a capture, or in a
capture that an error invalidated and that only its end on the origin stream terminates."""


@dataclass(frozen=True, slots=True)
class GraphNodeInfo:
    """One node of a captured graph, as ``Driver.graph_nodes`` describes it.

    ``kind`` is one of ``"kernel"``, ``"memcpy"``, ``"memset"``, ``"host"``,
    ``"mem_alloc"``, ``"mem_free"``, ``"event_record"``, ``"wait_event"``, ``"empty"``,
    ``"graph"``, ``"other"`` (and, on the simulated backend, ``"op"``: a callable a
    test enqueued). The other fields are those of its kind and default otherwise.
    """

    handle: Handle
    kind: str
    dependencies: tuple[int, ...]
    """Positions (in the sequence ``graph_nodes`` returned) of the nodes this one waits for."""
    func: Handle = None
    """Kernel: the function handle."""
    config: LaunchConfig | None = None
    """Kernel: grid, block and dynamic shared memory."""
    dst: int = 0
    """Memcpy, memset: destination address; mem_alloc, mem_free: the allocation."""
    src: int = 0
    """Memcpy: source address."""
    size: int = 0
    """Memcpy: bytes copied; memset: bytes set; mem_alloc: bytes allocated."""
    direction: str = ""
    """Memcpy: ``"htod"``, ``"dtoh"``, ``"dtod"`` (or ``"other"``)."""
    value: int = 0
    """Memset: the value each element is set to."""
    element_size: int = 0
    """Memset: 1, 2 or 4 bytes."""
    native: Any = None
    """What the backend needs to update the node later (its captured parameters)."""


@dataclass(frozen=True, slots=True)
class PoolProps:
    """Properties of a new memory pool (``cuMemPoolCreate``)."""

    device_ordinal: int
    max_size: int = 0
    """Upper bound of the pool's reserved memory in bytes; 0 means no bound."""
    managed: bool = False
    """Managed memory (``CU_MEM_ALLOCATION_TYPE_MANAGED``), preferring the device; needs
    ``max_size`` 0 and a driver that offers managed pools (CUDA 13 on Linux)."""
    ipc: bool = False
    """Exportable to other processes as a POSIX file descriptor."""


@dataclass(frozen=True, slots=True)
class PitchedSide:
    """One side of a :class:`PitchedCopy`: where its rows lie."""

    address: int
    pitch: int
    """Bytes from the start of one row to the start of the next."""
    rows: int = 0
    """Rows from the start of one slice to the start of the next (``CUDA_MEMCPY3D``'s
    ``srcHeight`` / ``dstHeight``); read only when the copy's ``depth`` is above 1."""
    on_host: bool = False
    """Page-locked host memory rather than device memory."""
    context: Handle = None
    """The context owning this device memory, given on both sides of a copy between two
    devices (``cuMemcpy3DPeerAsync``); None otherwise."""


@dataclass(frozen=True, slots=True)
class PitchedCopy:
    """``depth`` slices of ``height`` rows of ``width`` bytes (``cuMemcpy2DAsync`` /
    ``cuMemcpy3DAsync`` / ``cuMemcpy3DPeerAsync``). Row ``y`` of slice ``z`` starts at
    ``address + (z * rows + y) * pitch`` on each side; each pitch is at least ``width``
    and, with ``depth > 1``, each side's ``rows`` at least ``height``."""

    dst: PitchedSide
    src: PitchedSide
    width: int
    height: int = 1
    depth: int = 1


class KernelParams(Protocol):
    """Kernel arguments packed once for both backends.

    ``address`` is the address of a ``void*[]`` array pointing at each argument's bytes
    (what ``cuLaunchKernel`` takes as ``kernelParams``); it must stay valid until the
    launch call returns. ``values`` are the same arguments as Python values, for the
    simulated backend (device pointers as ``int``).
    """

    @property
    def address(self) -> int: ...

    @property
    def values(self) -> tuple[Any, ...]: ...


@runtime_checkable
class Doorbell(Protocol):
    """A wake-up that GPU work can ring without running Python on the driver's thread.

    ``Driver.launch_doorbell(stream, bell)`` enqueues a host function that rings the
    bell when the stream reaches that point. Ringing is a plain C call (``sem_post``) on
    the real driver, so it never needs the GIL and cannot deadlock against a thread that
    holds the GIL while it waits on the driver.
    """

    def ring(self) -> None: ...

    def wait(self, timeout: float) -> int:
        """Block (GIL released) until rung or ``timeout`` seconds pass; returns how many
        rings it consumed (every pending one; 0 on a timeout)."""
        ...

    @property
    def c_function(self) -> int: ...

    @property
    def c_argument(self) -> int: ...


class Driver(Protocol):
    """The operations aiocuda needs from a CUDA driver. See the module docstring."""

    name: str
    """``"cuda"`` or ``"sim"``."""

    # -- process, devices, contexts -------------------------------------------------------
    def init(self) -> None:
        """Initialise the driver (idempotent). Raises NoDeviceError without a driver."""

    def driver_version(self) -> int: ...

    def device_count(self) -> int: ...

    def device_get(self, ordinal: int) -> Handle:
        """The device handle; ArgumentError when ``ordinal`` is out of range."""

    def device_name(self, dev: Handle) -> str: ...

    def device_uuid(self, dev: Handle) -> str:
        """``"GPU-xxxxxxxx-xxxx-..."`` as nvidia-smi prints it."""

    def device_pci_bus_id(self, dev: Handle) -> str: ...

    def device_ordinal_by_pci_bus_id(self, bus_id: str) -> int | None:
        """The ordinal of the device at PCI bus id ``bus_id`` (``cuDeviceGetByPCIBusId``;
        any form ``_pci.parse_pci_bus_id`` reads), or ``None`` when no visible device is
        there. ArgumentError (``CUDA_ERROR_INVALID_VALUE``) for a string in none of
        those forms."""

    def device_total_mem(self, dev: Handle) -> int: ...

    def device_attribute(self, dev: Handle, attribute: str) -> int:
        """A ``CU_DEVICE_ATTRIBUTE_*`` value by its lowercase suffix, e.g.
        ``"max_threads_per_block"``. ArgumentError for an unknown name."""

    def device_attribute_names(self) -> Sequence[str]:
        """Every attribute name ``device_attribute`` accepts."""

    def device_can_access_peer(self, dev: Handle, peer: Handle) -> bool: ...

    def primary_context_retain(self, dev: Handle) -> Handle: ...

    def primary_context_release(self, dev: Handle) -> None: ...

    def set_current(self, ctx: Handle) -> None:
        """Make ``ctx`` current on the calling thread (cheap when it already is)."""

    def enable_peer_access(self, peer_ctx: Handle) -> bool:
        """Let the current context access ``peer_ctx``'s memory; idempotent. True if this
        call enabled it, False if it was enabled already (``CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED``)."""

    def disable_peer_access(self, peer_ctx: Handle) -> None:
        """Undo :meth:`enable_peer_access` (``cuCtxDisablePeerAccess``); raises
        ``CUDA_ERROR_PEER_ACCESS_NOT_ENABLED`` where it is not enabled."""

    def mem_get_info(self) -> tuple[int, int]:
        """``(free, total)`` bytes of the current context's device."""

    def device_p2p_attribute(self, dev: Handle, peer: Handle, attribute: str) -> int:
        """A ``CU_DEVICE_P2P_ATTRIBUTE_*`` value of the link from ``dev`` to ``peer`` by
        lowercase suffix: ``"performance_rank"``, ``"access_supported"``,
        ``"native_atomic_supported"``, ``"access_access_supported"`` (CUDA arrays).
        ArgumentError for an unknown name, or ``dev`` and ``peer`` being one device."""

    # -- contexts -------------------------------------------------------------------------
    # Context flags are the CUDA values (``CU_CTX_SCHED_BLOCKING_SYNC`` is 4); limits and
    # cache configurations go by the lowercase suffix of their CUDA names.
    def primary_context_get_state(self, dev: Handle) -> tuple[int, bool]:
        """``(flags, active)`` of the device's primary context; needs no context."""

    def primary_context_set_flags(self, dev: Handle, flags: int) -> None:
        """Overwrite the primary context's flags (best before it is first made active)."""

    def context_create(self, dev: Handle, flags: int) -> Handle:
        """A new context (``cuCtxCreate``); the calling thread's current context is left
        as it was (the driver pushes the new one; this pops it)."""

    def context_destroy(self, ctx: Handle) -> None:
        """Destroy a context made by :meth:`context_create` (its work is waited for)."""

    def context_push(self, ctx: Handle) -> None:
        """Make ``ctx`` current on the calling thread, above what was current."""

    def context_pop(self) -> None:
        """Pop the calling thread's current context, making current what was below it."""

    def context_current_value(self) -> int:
        """The raw value of the calling thread's current context; 0 when there is none."""

    def context_get_flags(self) -> int:
        """The current context's flags (``cuCtxGetFlags``)."""

    def context_set_limit(self, limit: str, value: int) -> None:
        """A ``CU_LIMIT_*`` of the current context, by lowercase suffix: ``"stack_size"``,
        ``"printf_fifo_size"``, ``"malloc_heap_size"``, ``"dev_runtime_sync_depth"``,
        ``"dev_runtime_pending_launch_count"``, ``"max_l2_fetch_granularity"``,
        ``"persisting_l2_cache_size"``. ArgumentError for an unknown name or a value the
        device refuses."""

    def context_get_limit(self, limit: str) -> int: ...

    def context_limit_names(self) -> Sequence[str]:
        """Every limit name :meth:`context_get_limit` accepts."""

    def context_set_cache_config(self, config: str) -> None:
        """The current context's preferred L1/shared split: ``"prefer_none"``,
        ``"prefer_shared"``, ``"prefer_l1"`` or ``"prefer_equal"``."""

    def context_get_cache_config(self) -> str: ...

    # -- streams and events ----------------------------------------------------------------
    def stream_create(self, non_blocking: bool, priority: int) -> Handle: ...

    def stream_destroy(self, stream: Handle) -> None: ...

    def stream_from_value(self, value: int) -> Handle:
        """Wrap a foreign stream's raw handle (no ownership taken)."""

    def handle_value(self, handle: Handle) -> int:
        """The raw integer behind a stream/event/context handle (0 for the null stream)."""

    def stream_query(self, stream: Handle) -> bool:
        """True when all work enqueued so far has completed."""

    def stream_synchronize(self, stream: Handle) -> None:
        """Block the calling thread (GIL released) until the stream is idle."""

    def stream_wait_event(self, stream: Handle, event: Handle) -> None:
        """Make future work on ``stream`` wait for ``event`` on the GPU (no host wait)."""

    def stream_priority_range(self) -> tuple[int, int]:
        """``(least, greatest)``; numerically lower is higher priority, as in CUDA."""

    def stream_device_ordinal(self, stream: Handle) -> int:
        """The ordinal of the device a stream belongs to (foreign streams included)."""

    def stream_get_priority(self, stream: Handle) -> int:
        """The stream's priority, as the driver clamped it."""

    def stream_is_non_blocking(self, stream: Handle) -> bool:
        """Whether the stream was created ``CU_STREAM_NON_BLOCKING``."""

    def event_create(self, timing: bool, blocking_sync: bool) -> Handle: ...

    def event_destroy(self, event: Handle) -> None: ...

    def event_record(self, event: Handle, stream: Handle) -> None: ...

    def event_record_external(self, event: Handle, stream: Handle) -> None:
        """``cuEventRecordWithFlags(..., CU_EVENT_RECORD_EXTERNAL)``: a record that, inside
        a stream capture, becomes an event-record node of the graph (so the graph records
        the event when it runs); outside a capture it is a plain record."""

    def event_query(self, event: Handle) -> bool:
        """True once the recorded work finished; raises the context's sticky error."""

    def event_synchronize(self, event: Handle) -> None: ...

    def event_elapsed_ms(self, start: Handle, end: Handle) -> float: ...

    def new_doorbell(self) -> Doorbell:
        """A fresh :class:`Doorbell` this backend can ring from a stream."""

    def launch_doorbell(self, stream: Handle, bell: Doorbell) -> None:
        """Enqueue a host function that rings ``bell`` when the stream gets there."""

    # -- memory ---------------------------------------------------------------------------
    def mempool_default(self, dev: Handle) -> Handle: ...

    def mempool_create(self, props: PoolProps) -> Handle: ...

    def mempool_destroy(self, pool: Handle) -> None: ...

    def mempool_set_attribute(self, pool: Handle, attribute: str, value: int) -> None:
        """``attribute`` is a ``CU_MEMPOOL_ATTR_*`` lowercase suffix, e.g.
        ``"release_threshold"``, ``"reserved_mem_current"``, ``"used_mem_high"``."""

    def mempool_get_attribute(self, pool: Handle, attribute: str) -> int: ...

    def mempool_trim_to(self, pool: Handle, min_bytes_to_keep: int) -> None:
        """Give cached memory back; only memory whose free the host has observed
        complete (through a synchronisation of the freeing stream, or of the context)."""

    def ctx_synchronize(self) -> None:
        """Block until all work of the current context has finished (``cuCtxSynchronize``);
        the pools observe every free of the context then. How the thread waits follows
        the context's scheduling flags."""

    def mempool_set_access(self, pool: Handle, peer_ordinal: int) -> None:
        """Grant read/write access to the pool's memory to device ``peer_ordinal``."""

    def mempool_revoke_access(self, pool: Handle, peer_ordinal: int) -> None:
        """Take device ``peer_ordinal``'s access to the pool's memory away
        (``cuMemPoolSetAccess`` with ``PROT_NONE``); nothing to take is no error."""

    def mempool_get_access(self, pool: Handle, device_ordinal: int) -> bool:
        """Whether device ``device_ordinal`` may read and write the pool's memory
        (``cuMemPoolGetAccess``); an imported pool may not grant it yet."""

    def mem_alloc_async(self, size: int, pool: Handle, stream: Handle) -> int:
        """``cuMemAllocFromPoolAsync``; OutOfMemoryError when the pool cannot grow.

        The real backend returns its ``CUdeviceptr`` (int-convertible) to save two
        conversions on the hot path; callers needing an ``int`` use ``int(ptr)``."""

    def mem_free_async(self, ptr: int, stream: Handle) -> None: ...

    def mem_async_calls(
        self,
    ) -> tuple[Callable[..., tuple[Any, Any]], Callable[..., tuple[Any]], Callable[[Any, str], None]]:
        """``(alloc, free, fail)`` for a pool's allocate/free hot path, called with no
        frame of ours in between: ``err, ptr = alloc(size, pool, stream)``,
        ``(err,) = free(ptr, stream)``; ``err`` is falsy on success, and a truthy one goes
        to ``fail(err, call_name)``, which raises the matching CudaError."""

    def mem_host_alloc(self, size: int) -> int:
        """Page-locked host memory, portable across contexts."""

    def mem_host_free(self, ptr: int) -> None: ...

    def mem_host_register(self, ptr: int, size: int) -> None: ...

    def mem_host_unregister(self, ptr: int) -> None: ...

    def memcpy_htod_async(self, dst: int, src: int, size: int, stream: Handle) -> None: ...

    def memcpy_dtoh_async(self, dst: int, src: int, size: int, stream: Handle) -> None: ...

    def memcpy_dtod_async(self, dst: int, src: int, size: int, stream: Handle) -> None: ...

    def memcpy_peer_async(
        self, dst: int, dst_ctx: Handle, src: int, src_ctx: Handle, size: int, stream: Handle
    ) -> None: ...

    def memset_d8_async(self, dst: int, value: int, count: int, stream: Handle) -> None: ...

    def memset_d16_async(self, dst: int, value: int, count: int, stream: Handle) -> None:
        """``count`` 16-bit words; ``dst`` 2-byte aligned."""

    def memset_d32_async(self, dst: int, value: int, count: int, stream: Handle) -> None: ...

    def memcpy_pitched_async(self, copy: PitchedCopy, stream: Handle) -> None:
        """A 2D or 3D copy (see :class:`PitchedCopy`); host sides must be page-locked."""

    def memset_2d_async(
        self, dst: int, pitch: int, value: int, element_size: int, width: int, height: int, stream: Handle
    ) -> None:
        """``height`` rows of ``width`` elements of ``element_size`` bytes (1, 2 or 4:
        ``cuMemsetD2D8Async`` / ``16`` / ``32``), ``pitch`` bytes apart; ``dst`` and
        ``pitch`` aligned to the element size."""

    # -- managed memory ---------------------------------------------------------------------
    def mem_alloc_managed(self, size: int, attach: str) -> int:
        """``cuMemAllocManaged``; ``attach`` is ``"global"`` (any stream may use it) or
        ``"host"`` (host only until attached to a stream)."""

    def mem_free(self, ptr: int) -> None:
        """``cuMemFree`` of a managed allocation or of a pointer imported from another
        process's pool; it may wait for the device (call it off the loop)."""

    def mem_prefetch_async(self, ptr: int, size: int, device_ordinal: int | None, stream: Handle) -> None:
        """``cuMemPrefetchAsync`` of managed memory to a device, or to host memory when
        ``device_ordinal`` is None."""

    def mem_advise(self, ptr: int, size: int, advice: str, device_ordinal: int | None) -> None:
        """``cuMemAdvise``: ``advice`` is a ``CU_MEM_ADVISE_*`` lowercase suffix
        (``"set_read_mostly"``, ``"unset_accessed_by"``, ...); ``device_ordinal`` None
        names host memory."""

    def stream_attach_mem_async(self, stream: Handle, ptr: int, attach: str) -> None:
        """``cuStreamAttachMemAsync`` of the whole managed allocation at ``ptr``:
        ``"global"``, ``"host"`` or ``"single"`` (this stream only)."""

    # -- sharing with other processes ---------------------------------------------------------
    def ipc_event_create(self) -> Handle:
        """An event other processes can open (``CU_EVENT_INTERPROCESS``, without timing),
        in the current context."""

    def ipc_event_handle(self, event: Handle) -> bytes:
        """``cuIpcGetEventHandle``: the 64 bytes another process opens the event with."""

    def ipc_open_event(self, handle: bytes) -> Handle:
        """``cuIpcOpenEventHandle`` in the current context: an event to query, synchronize
        and make streams wait for (not to record); destroyed with ``event_destroy``."""

    def mempool_export_fd(self, pool: Handle) -> int:
        """``cuMemPoolExportToShareableHandle`` of an IPC pool: a new POSIX file
        descriptor, which the caller closes."""

    def mempool_import_fd(self, fd: int) -> Handle:
        """``cuMemPoolImportFromShareableHandle``: the pool another process exported as
        ``fd`` (which stays the caller's to close). It allocates nothing; pointers are
        imported from it."""

    def mempool_export_pointer(self, ptr: int) -> bytes:
        """``cuMemPoolExportPointer``: the 64 bytes naming an allocation of an IPC pool."""

    def mempool_import_pointer(self, pool: Handle, data: bytes) -> int:
        """``cuMemPoolImportPointer`` from an imported pool; the import ends with
        ``mem_free`` or ``mem_free_async``, which must complete before the exporter frees
        the allocation."""

    def pointer_device_ordinal(self, ptr: int) -> int:
        """The device that owns a device pointer (for foreign arrays); ArgumentError
        when ``ptr`` is not device memory."""

    # -- modules and kernels --------------------------------------------------------------
    def module_load_data(self, image: bytes, options: JitOptions | None = None) -> tuple[Handle, str]:
        """Load PTX, cubin or fatbin into the current context: ``(module, info_log)``.
        The JIT's error log is in the error's message on failure."""

    def module_unload(self, module: Handle) -> None: ...

    def module_get_function(self, module: Handle, name: str) -> Handle: ...

    def module_get_global(self, module: Handle, name: str) -> tuple[int, int]:
        """``(device address, bytes)`` of a ``__device__`` or ``__constant__`` variable;
        ArgumentError (``NOT_FOUND``) when the module has none of that name."""

    def module_function_names(self, module: Handle) -> list[str]:
        """The exported names of every kernel in the module (mangled where C++ mangles)."""

    def link(self, inputs: Sequence[LinkInput], options: JitOptions | None = None) -> tuple[bytes, str]:
        """Link ``inputs`` into one cubin for the current context's device (``cuLink*``):
        ``(cubin, info_log)``. CompileError with the linker's log on failure."""

    def function_get_attribute(self, func: Handle, attribute: str) -> int:
        """A ``CU_FUNC_ATTRIBUTE_*`` value by lowercase suffix, e.g. ``"num_regs"``."""

    def function_set_attribute(self, func: Handle, attribute: str, value: int) -> None: ...

    def function_set_cache_config(self, func: Handle, config: str) -> None:
        """The kernel's preferred L1/shared split (see :meth:`context_set_cache_config`)."""

    def occupancy_max_active_blocks(
        self, func: Handle, block_size: int, dynamic_smem: int, disable_caching_override: bool = False
    ) -> int:
        """Blocks per multiprocessor; ``disable_caching_override`` asks what fits when the
        kernel's cache configuration is not overridden by the global caching setting."""

    def occupancy_max_potential_block_size(
        self, func: Handle, dynamic_smem: int, block_size_limit: int = 0, disable_caching_override: bool = False
    ) -> tuple[int, int]:
        """``(min_grid_size, block_size)``; ``block_size_limit`` caps the block size (0: none)."""

    def occupancy_available_dynamic_smem(self, func: Handle, num_blocks: int, block_size: int) -> int:
        """Dynamic shared memory per block that still lets ``num_blocks`` blocks of
        ``block_size`` threads run on one multiprocessor."""

    def occupancy_max_active_clusters(self, func: Handle, config: LaunchConfig) -> int:
        """How many clusters of ``config.cluster`` can be resident on the device at once."""

    def occupancy_max_potential_cluster_size(self, func: Handle, config: LaunchConfig) -> int:
        """The largest cluster size the kernel can launch with under ``config``."""

    def launch_kernel(self, func: Handle, config: LaunchConfig, stream: Handle, params: KernelParams) -> None:
        """Launch ``func`` on ``stream``: ``cuLaunchKernel``, or ``cuLaunchKernelEx`` when
        the config asks for a cluster or a cooperative launch."""

    def prepare_launch(
        self, func: Handle, config: LaunchConfig, stream: Handle, params: KernelParams
    ) -> tuple[Callable[..., tuple[Any, ...]], tuple[Any, ...], Callable[[Any], None]]:
        """``(fn, args, fail)``: the bound driver call and its argument tuple, built once
        for kernel launchers to replay (the hot path): ``err = fn(*args)[0]`` launches
        with whatever ``params`` holds at that moment, and a truthy ``err`` goes to
        ``fail(err)``, which raises. ``params.address`` must stay valid while the triple
        is used."""

    # -- graphs ---------------------------------------------------------------------------
    def stream_begin_capture(self, stream: Handle, mode: CaptureMode) -> None:
        """Start capturing ``stream``'s work into a new graph (not the null stream; not a
        stream already capturing)."""

    def stream_end_capture(self, stream: Handle) -> Handle:
        """End the capture begun on ``stream`` and return its graph. ``CaptureError`` if
        the capture was invalidated or work forked to another stream was not joined back
        (the capture ends either way, for every stream that joined it, as the CUDA
        programming guide documents; aiocuda checks, see ``_graph/capture.py``)."""

    def stream_capture_status(self, stream: Handle) -> tuple[CaptureStatus, int]:
        """``(status, id)`` of ``stream`` (``cuStreamGetCaptureInfo``): the id, unique in
        the process and shared by every stream of one capture, while the status is
        ``"active"``; 0 otherwise. Refuses nothing and invalidates nothing."""

    def stream_join_capture_sinks(self, stream: Handle) -> tuple[str, ...]:
        """Make the next work of the capturing ``stream`` (a capture's origin) depend on
        every node of the capture that no node depends on and that its dependencies do
        not hold yet: work forked onto other streams and never joined back, which would
        make the end fail with ``STREAM_CAPTURE_UNJOINED`` (``cuStreamGetCaptureInfo``,
        ``cuGraphGetNodes``/``cuGraphGetEdges``, ``cuStreamUpdateCaptureDependencies``).
        Returns those nodes' kinds (as ``GraphNodeInfo.kind``), empty when there were none.
        ``CaptureError`` if the capture was invalidated, ``ILLEGAL_STATE`` if ``stream``
        is not capturing."""

    def graph_nodes(self, graph: Handle) -> Sequence[GraphNodeInfo]:
        """The graph's nodes in an order where every node comes after its dependencies
        (for a captured graph: the order of capture, where the driver keeps it)."""

    def graph_kernel_node_arguments(self, node: GraphNodeInfo, codes: str) -> tuple[Any, ...]:
        """A kernel node's arguments as captured, one ``struct`` code per parameter
        (``"QQi"``: two pointers and an int)."""

    def graph_instantiate(self, graph: Handle) -> Handle:
        """An executable graph (only one may exist at a time for a graph that allocates or
        frees memory)."""

    def graph_launch(self, graph_exec: Handle, stream: Handle) -> None:
        """Enqueue one replay on ``stream``; replays of one executable graph run one after
        another, whatever their streams."""

    def graph_exec_update(self, graph_exec: Handle, graph: Handle) -> None:
        """Give the executable graph the parameters of ``graph``, a graph of the same
        topology; ``GraphUpdateError`` (nothing changed) when it is not."""

    def graph_exec_kernel_node_set_params(
        self, graph_exec: Handle, node: GraphNodeInfo, func: Handle, config: LaunchConfig, params: KernelParams
    ) -> None:
        """New function, configuration and arguments for one kernel node of the executable
        graph (later replays only)."""

    def graph_exec_copy_setter(
        self, graph_exec: Handle, node: GraphNodeInfo, ctx: Handle
    ) -> Callable[[int, int], None]:
        """``set(dst, src)``: new addresses for one memcpy node of the executable graph
        (later replays only), of the same kinds of memory and ``ctx``'s. Built once per
        node: the hot path of replays with new pointers."""

    def graph_destroy(self, graph: Handle) -> None: ...

    def graph_exec_destroy(self, graph_exec: Handle) -> None:
        """Replays already enqueued still run."""

    # -- profiling ------------------------------------------------------------------------
    def profiler_start(self) -> None:
        """``cuProfilerStart``: begin collecting (Nsight Systems with ``--capture-range=cudaProfilerApi``)."""

    def profiler_stop(self) -> None: ...

    def nvtx_available(self) -> bool:
        """Whether NVTX ranges reach a tool (the NVTX library could be loaded)."""

    def nvtx_range_start(self, message: str, color: int | None) -> int:
        """Start an NVTX range in aiocuda's domain; returns its id for :meth:`nvtx_range_end`.
        Ranges started and ended by id may overlap and cross threads and tasks, unlike
        push/pop ranges. ``color`` is 0xAARRGGBB or None."""

    def nvtx_range_end(self, range_id: int) -> None: ...
