"""Real-driver graphs: stream capture, instantiation, replay and updates (see _driver/_protocol.py).

``graph_nodes`` describes a captured graph from the driver's own records
(``cuGraphGetNodes``, ``cuGraphGetEdges`` and each node's ``cuGraph*NodeGetParams``), in
an order where every node follows its dependencies: the order ``cuGraphGetNodes`` gives
(the order of creation) wherever the dependencies allow. Memcpy updates are prepared
once per node (:meth:`CudaGraphs.graph_exec_copy_setter`): the node's captured
``CUDA_MEMCPY3D`` is kept and only its two addresses change per call.
"""

from __future__ import annotations

import ctypes
import heapq
import struct
from collections.abc import Callable, Sequence
from typing import Any

from ...errors import ResultCode, error_for_code
from .._launch import LaunchConfig
from .._protocol import CaptureStatus, GraphNodeInfo, KernelParams
from . import _core
from ._core import check

__all__ = ["CudaGraphs"]

_NODE_KINDS = {
    "KERNEL": "kernel",
    "MEMCPY": "memcpy",
    "MEMSET": "memset",
    "HOST": "host",
    "GRAPH": "graph",
    "EMPTY": "empty",
    "WAIT_EVENT": "wait_event",
    "EVENT_RECORD": "event_record",
    "MEM_ALLOC": "mem_alloc",
    "MEM_FREE": "mem_free",
}

_CAPTURE_STATUS: dict[str, CaptureStatus] = {
    "CU_STREAM_CAPTURE_STATUS_NONE": "none",
    "CU_STREAM_CAPTURE_STATUS_ACTIVE": "active",
    "CU_STREAM_CAPTURE_STATUS_INVALIDATED": "invalidated",
}


class CudaGraphs:
    """Mixin of CudaDriver: graph capture, instantiation, replay and updates."""

    _capture_modes: dict[str, Any] | None = None

    # -- capture ----------------------------------------------------------------------------
    def stream_begin_capture(self, stream: Any, mode: str) -> None:
        drv = _core.drv
        if CudaGraphs._capture_modes is None:
            modes = drv.CUstreamCaptureMode
            CudaGraphs._capture_modes = {
                "global": modes.CU_STREAM_CAPTURE_MODE_GLOBAL,
                "thread_local": modes.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
                "relaxed": modes.CU_STREAM_CAPTURE_MODE_RELAXED,
            }
        member = CudaGraphs._capture_modes.get(mode)
        if member is None:
            raise error_for_code(
                ResultCode.INVALID_VALUE,
                "CUDA_ERROR_INVALID_VALUE",
                f"unknown capture mode {mode!r}",
                "cuStreamBeginCapture",
            )
        check(drv.cuStreamBeginCapture(stream, member), "cuStreamBeginCapture")

    def stream_end_capture(self, stream: Any) -> Any:
        return check(_core.drv.cuStreamEndCapture(stream), "cuStreamEndCapture")

    def stream_capture_status(self, stream: Any) -> tuple[CaptureStatus, int]:
        drv = _core.drv
        # (status, id, graph, dependencies, [edge data,] count): the same first two in
        # cuda-bindings 12 (cuStreamGetCaptureInfo_v2) and 13 (_v3)
        result = drv.cuStreamGetCaptureInfo(stream)
        if result[0] == getattr(drv.CUresult, "CUDA_ERROR_LOSSY_QUERY", None):
            # (edges with data, which another library's work may have added): the status alone
            status = _CAPTURE_STATUS.get(check(drv.cuStreamIsCapturing(stream), "cuStreamIsCapturing").name, "none")
            return status, 0
        info = check(result, "cuStreamGetCaptureInfo")
        status = _CAPTURE_STATUS.get(info[0].name, "none")
        return status, (int(info[1]) if status == "active" else 0)

    def stream_join_capture_sinks(self, stream: Any) -> tuple[str, ...]:
        drv = _core.drv
        call = "cuStreamGetCaptureInfo"
        info = check(drv.cuStreamGetCaptureInfo(stream), call)
        status = _CAPTURE_STATUS.get(info[0].name, "none")
        if status != "active":
            code, name = (
                (ResultCode.STREAM_CAPTURE_INVALIDATED, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED")
                if status == "invalidated"
                else (ResultCode.ILLEGAL_STATE, "CUDA_ERROR_ILLEGAL_STATE")
            )
            raise error_for_code(code, name, f"the stream's capture is {status}", call)
        graph, count = info[2], int(info[-1])
        joined = {int(node) for node in list(info[3] or ())[:count]}
        _, node_count = check(drv.cuGraphGetNodes(graph, 0), "cuGraphGetNodes")
        nodes = list(check(drv.cuGraphGetNodes(graph, node_count), "cuGraphGetNodes")[0])[:node_count]
        edges = check(drv.cuGraphGetEdges(graph, 0), "cuGraphGetEdges")
        edge_count = int(edges[-1])
        sources: set[int] = set()
        if edge_count:
            edges = check(drv.cuGraphGetEdges(graph, edge_count), "cuGraphGetEdges")
            sources = {int(node) for node in edges[0][:edge_count]}
        loose = [node for node in nodes if int(node) not in sources and int(node) not in joined]
        if not loose:
            return ()
        flag = int(drv.CUstreamUpdateCaptureDependencies_flags.CU_STREAM_ADD_CAPTURE_DEPENDENCIES)
        update = getattr(drv, "cuStreamUpdateCaptureDependencies_v2", None)  # (12.x's with edge data)
        if update is not None:
            result = update(stream, loose, None, len(loose), flag)
        else:
            try:  # (13.x's own takes edge data)
                result = drv.cuStreamUpdateCaptureDependencies(stream, loose, None, len(loose), flag)
            except TypeError:  # (an older one does not)
                result = drv.cuStreamUpdateCaptureDependencies(stream, loose, len(loose), flag)
        check(result, "cuStreamUpdateCaptureDependencies")
        kinds = []
        for node in loose:
            node_type = check(drv.cuGraphNodeGetType(node), "cuGraphNodeGetType")
            kinds.append(_NODE_KINDS.get(node_type.name.removeprefix("CU_GRAPH_NODE_TYPE_"), "other"))
        return tuple(kinds)

    # -- reading a graph ----------------------------------------------------------------------
    def graph_nodes(self, graph: Any) -> Sequence[GraphNodeInfo]:
        drv = _core.drv
        _, count = check(drv.cuGraphGetNodes(graph, 0), "cuGraphGetNodes")
        nodes = list(check(drv.cuGraphGetNodes(graph, count), "cuGraphGetNodes")[0])[:count] if count else []
        position = {int(node): i for i, node in enumerate(nodes)}
        deps: list[list[int]] = [[] for _ in nodes]
        edges = check(drv.cuGraphGetEdges(graph, 0), "cuGraphGetEdges")
        edge_count = int(edges[-1])
        if edge_count:
            edges = check(drv.cuGraphGetEdges(graph, edge_count), "cuGraphGetEdges")
            for source, target in zip(edges[0][:edge_count], edges[1][:edge_count], strict=True):
                deps[position[int(target)]].append(position[int(source)])
        order = _topological(deps)
        renumber = {old: new for new, old in enumerate(order)}
        return [self._describe(nodes[old], tuple(sorted(renumber[d] for d in deps[old]))) for old in order]

    def _describe(self, node: Any, deps: tuple[int, ...]) -> GraphNodeInfo:
        drv = _core.drv
        node_type = check(drv.cuGraphNodeGetType(node), "cuGraphNodeGetType")
        kind = _NODE_KINDS.get(node_type.name.removeprefix("CU_GRAPH_NODE_TYPE_"), "other")
        if kind == "kernel":
            p = check(drv.cuGraphKernelNodeGetParams(node), "cuGraphKernelNodeGetParams")
            config = LaunchConfig(
                (p.gridDimX, p.gridDimY, p.gridDimZ),
                (p.blockDimX, p.blockDimY, p.blockDimZ),
                shared_mem=p.sharedMemBytes,
            )
            return GraphNodeInfo(node, kind, deps, func=p.func, config=config, native=p)
        if kind == "memcpy":
            p = check(drv.cuGraphMemcpyNodeGetParams(node), "cuGraphMemcpyNodeGetParams")
            size = int(p.WidthInBytes) * max(1, int(p.Height)) * max(1, int(p.Depth))
            dst, src = _address(p, "dst"), _address(p, "src")
            direction = f"{_side(p.srcMemoryType, src)}to{_side(p.dstMemoryType, dst)}"
            if "?" in direction:
                direction = "other"
            return GraphNodeInfo(node, kind, deps, dst=dst, src=src, size=size, direction=direction, native=p)
        if kind == "memset":
            p = check(drv.cuGraphMemsetNodeGetParams(node), "cuGraphMemsetNodeGetParams")
            width = int(p.elementSize)
            size = int(p.width) * max(1, int(p.height)) * width
            return GraphNodeInfo(
                node, kind, deps, dst=int(p.dst), size=size, value=int(p.value), element_size=width, native=p
            )
        if kind == "mem_alloc":
            p = check(drv.cuGraphMemAllocNodeGetParams(node), "cuGraphMemAllocNodeGetParams")
            return GraphNodeInfo(node, kind, deps, dst=int(p.dptr), size=int(p.bytesize))
        if kind == "mem_free":
            dptr = check(drv.cuGraphMemFreeNodeGetParams(node), "cuGraphMemFreeNodeGetParams")
            return GraphNodeInfo(node, kind, deps, dst=int(dptr))
        return GraphNodeInfo(node, kind, deps)

    def graph_kernel_node_arguments(self, node: GraphNodeInfo, codes: str) -> tuple[Any, ...]:
        params = node.native
        if node.kind != "kernel" or params is None:
            raise error_for_code(
                ResultCode.INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "not a kernel node", "cuGraphKernelNodeGetParams"
            )
        array = int(params.kernelParams)
        if not array:
            raise error_for_code(
                ResultCode.NOT_SUPPORTED,
                "CUDA_ERROR_NOT_SUPPORTED",
                "the kernel node's arguments were given through 'extra', not kernelParams",
                "cuGraphKernelNodeGetParams",
            )
        values = []
        for i, code in enumerate(codes):
            address = ctypes.c_void_p.from_address(array + 8 * i).value or 0
            values.append(struct.unpack("@" + code, ctypes.string_at(address, struct.calcsize("@" + code)))[0])
        return tuple(values)

    # -- executable graphs --------------------------------------------------------------------
    def graph_instantiate(self, graph: Any) -> Any:
        return check(_core.drv.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")

    def graph_launch(self, graph_exec: Any, stream: Any) -> None:
        drv = _core.drv
        err = drv.cuGraphLaunch(graph_exec, stream)[0]
        if err:
            _core._raise(err, "cuGraphLaunch")

    def graph_exec_update(self, graph_exec: Any, graph: Any) -> None:
        drv = _core.drv
        err, info = drv.cuGraphExecUpdate(graph_exec, graph)
        if err:
            # cuda-bindings returns no result info alongside most failures.
            result = getattr(info, "result", None)
            reason = (
                result.name.removeprefix("CU_GRAPH_EXEC_UPDATE_").lower().replace("_", " ")
                if result is not None
                else "the graphs differ in topology"
            )
            error_node = getattr(info, "errorNode", None)
            node = int(error_node) if error_node is not None else 0
            at = f" (node 0x{node:x})" if node else ""
            try:
                _core._raise(err, "cuGraphExecUpdate")
            except Exception as exc:
                exc.args = (f"{exc.args[0]}: {reason}{at}",)
                raise

    def graph_exec_kernel_node_set_params(
        self, graph_exec: Any, node: GraphNodeInfo, func: Any, config: LaunchConfig, params: KernelParams
    ) -> None:
        drv = _core.drv
        p = drv.CUDA_KERNEL_NODE_PARAMS()
        p.func = func
        p.gridDimX, p.gridDimY, p.gridDimZ = config.grid
        p.blockDimX, p.blockDimY, p.blockDimZ = config.block
        p.sharedMemBytes = config.shared_mem
        p.kernelParams = params.address
        p.extra = 0
        check(drv.cuGraphExecKernelNodeSetParams(graph_exec, node.handle, p), "cuGraphExecKernelNodeSetParams")

    def graph_exec_copy_setter(self, graph_exec: Any, node: GraphNodeInfo, ctx: Any) -> Callable[[int, int], None]:
        drv = _core.drv
        captured = node.native
        if node.kind != "memcpy" or captured is None:
            raise error_for_code(
                ResultCode.INVALID_VALUE,
                "CUDA_ERROR_INVALID_VALUE",
                "not a memcpy node",
                "cuGraphExecMemcpyNodeSetParams",
            )
        params = captured  # the node's own parameters, read back (a copy of ours): only the addresses change
        dst_field = _address_field(captured.dstMemoryType, "dst")
        src_field = _address_field(captured.srcMemoryType, "src")
        bound = drv.cuGraphExecMemcpyNodeSetParams
        handle = node.handle

        def set_addresses(dst: int, src: int) -> None:
            setattr(params, dst_field, dst)
            setattr(params, src_field, src)
            err = bound(graph_exec, handle, params, ctx)[0]
            if err:
                _core._raise(err, "cuGraphExecMemcpyNodeSetParams")

        return set_addresses

    def graph_destroy(self, graph: Any) -> None:
        check(_core.drv.cuGraphDestroy(graph), "cuGraphDestroy")

    def graph_exec_destroy(self, graph_exec: Any) -> None:
        check(_core.drv.cuGraphExecDestroy(graph_exec), "cuGraphExecDestroy")


def _address_field(memory_type: Any, side: str) -> str:
    """The CUDA_MEMCPY3D field holding the ``side`` address for that memory type."""
    return f"{side}Host" if memory_type.name == "CU_MEMORYTYPE_HOST" else f"{side}Device"


def _address(params: Any, side: str) -> int:
    value = getattr(params, _address_field(getattr(params, f"{side}MemoryType"), side))
    return int(value or 0)


def _side(memory_type: Any, address: int) -> str:
    """``"h"`` (host) or ``"d"`` (device) for one side of a copy; a unified address is
    asked about (memory the driver does not know is pageable host memory)."""
    name = memory_type.name
    if name == "CU_MEMORYTYPE_HOST":
        return "h"
    if name == "CU_MEMORYTYPE_DEVICE":
        return "d"
    if name != "CU_MEMORYTYPE_UNIFIED":
        return "?"
    drv = _core.drv
    err, value = drv.cuPointerGetAttribute(drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, address)
    if err != drv.CUresult.CUDA_SUCCESS:
        return "h"
    return "h" if int(value) == int(drv.CUmemorytype.CU_MEMORYTYPE_HOST) else "d"


def _topological(deps: list[list[int]]) -> list[int]:
    """Node positions ordered so that each follows its dependencies, otherwise in the
    given order (Kahn's algorithm, always taking the lowest ready position)."""
    waiting = [len(d) for d in deps]
    dependents: list[list[int]] = [[] for _ in deps]
    for node, sources in enumerate(deps):
        for source in sources:
            dependents[source].append(node)
    ready = [node for node, count in enumerate(waiting) if count == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        node = heapq.heappop(ready)
        order.append(node)
        for follower in dependents[node]:
            waiting[follower] -= 1
            if waiting[follower] == 0:
                heapq.heappush(ready, follower)
    return order
