"""Simulated graphs: a capture records a stream's operations; an executable graph replays them.

Capture
    ``stream_begin_capture`` puts a stream in capture mode: every operation enqueued on it
    afterwards (the callable the other mixins hand ``SimCore._enqueue``) becomes a node of
    the graph instead of running. Each capturing stream has a set of nodes the next one
    depends on. ``event_record`` in a capturing stream only marks that set in the event;
    ``stream_wait_event`` on such an event makes any other stream join the capture (its
    next nodes depend on the set), and joins dependency sets of streams already in it.
    ``stream_end_capture`` on the origin stream ends it for every stream that joined,
    whatever it returns (the programming guide: "All streams being captured to the same
    capture graph are taken out of capture mode upon cudaStreamEndCapture()", and so for
    an invalidated capture); every node nobody depends on must then be in the origin's
    set (a fork joined back), else ``STREAM_CAPTURE_UNJOINED`` and no graph.
    ``stream_join_capture_sinks`` adds such nodes to a stream's set
    (``cuStreamUpdateCaptureDependencies``); ``stream_capture_status`` reads a stream's
    status and its capture's id, unique in the process.

    What cannot be captured raises and *invalidates* the capture, after which every
    operation on its streams, a wait of another stream on an event recorded in it
    (``INVALID_VALUE``: it does not join), and the end of the capture raise
    ``STREAM_CAPTURE_INVALIDATED``: a query or synchronize of a capturing stream
    (``STREAM_CAPTURE_UNSUPPORTED``), a synchronize of the context of a capturing stream
    (``ctx_synchronize``, in every mode: the driver refuses to synchronize a handle that
    encompasses a capture), a query, synchronize or timing of an event recorded
    in a capture (``CAPTURED_EVENT``), a wait on an event recorded outside the capture
    (``STREAM_CAPTURE_ISOLATION``) or in another capture (``STREAM_CAPTURE_MERGE``), a
    copy to or from host memory that is not page-locked, freeing memory the capture did
    not allocate, and the calls a capture mode forbids (:data:`UNSAFE_CALLS` from the
    capturing thread, or from any thread while a ``"global"`` capture is active).

Memory
    ``mem_alloc_async`` on a capturing stream makes a graph allocation: memory the graph
    owns from the capture until it is destroyed (and its replays have finished), at an
    address fixed for its life, as with the driver. ``mem_free_async`` on a capturing
    stream must name one of the capture's allocations.

Replay
    ``graph_instantiate`` copies the nodes' operations into an executable graph;
    ``graph_launch`` enqueues them on the stream in capture order (every node comes after
    what it depends on), after a wait for the executable graph's previous replay. Node
    updates replace an operation of the executable graph for later launches only. A
    node that raises fails the replay as the operation would have failed on its own: a
    kernel's ``IndexError`` poisons the device, and the rest of the replay -- doorbells
    included -- does not run. ``set_latency`` applies to nodes by their operation's name
    (``"launch_kernel"``, ...), and ``"graph_launch"`` to a replay as a whole. An event
    recorded with ``event_record_external`` during a capture is recorded by every replay.

Departures from the driver: nodes of one replay run one after another, never side by
side; launching a graph on a capturing stream is refused (``STREAM_CAPTURE_UNSUPPORTED``)
instead of adding a child graph; a graph that allocates memory can be updated from
another graph only if the allocations' addresses match (they never do for two captures).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from typing import Any

from ...errors import CudaError, ResultCode
from .._launch import LaunchConfig
from .._protocol import CAPTURE_MODES, CaptureStatus, GraphNodeInfo
from ._codes import sim_error
from ._objects import HOST_FUNCTION, SimDevice, SimEvent, SimPoint, SimStream, StreamWait, next_handle_value

__all__ = ["UNSAFE_CALLS", "ExternalRecord", "SimCapture", "SimGraph", "SimGraphExec", "SimGraphs", "SimNode"]

UNSAFE_CALLS = frozenset(
    {
        "mem_host_alloc",
        "mem_host_free",
        "mem_host_register",
        "mem_host_unregister",
        "module_load_data",
        "module_unload",
        "mempool_set_attribute",  # seen refused on an H100 (a pool's first use inside a capture)
        "mempool_get_attribute",  # seen refused on an H100 (a pool's statistics inside a capture)
    }
)
"""Seam calls a capture forbids (the driver's "potentially unsafe API calls": they may
synchronize the device implicitly)."""

_KINDS = {
    "launch_kernel": "kernel",
    "memcpy_htod_async": "memcpy",
    "memcpy_dtoh_async": "memcpy",
    "memcpy_dtod_async": "memcpy",
    "memcpy_peer_async": "memcpy",
    "memcpy_pitched_async": "memcpy",
    "memset_d8_async": "memset",
    "memset_d16_async": "memset",
    "memset_d32_async": "memset",
    "memset_2d_async": "memset",
    "mem_alloc_async": "mem_alloc",
    "mem_free_async": "mem_free",
    "event_record_external": "event_record",
    HOST_FUNCTION: "host",
}
"""Node kinds by the name their operation was enqueued under; anything else is ``"op"``."""

Operation = Callable[[], object]

_capture_ids = itertools.count(1)
"""Capture ids, unique in the process as the driver's (``next`` is atomic under the GIL)."""


class SimNode:
    """One node: the operation it runs, the name it was enqueued under, its dependencies."""

    __slots__ = ("deps", "graph", "index", "name", "op", "value")

    def __init__(self, graph: SimGraph, index: int, op: Operation, name: str, deps: tuple[int, ...]) -> None:
        self.value = next_handle_value()
        self.graph = graph
        self.index = index
        self.op = op
        self.name = name
        self.deps = deps

    @property
    def kind(self) -> str:
        return _KINDS.get(self.name, "op")

    def __repr__(self) -> str:
        return f"<SimNode {self.index} {self.kind} deps={list(self.deps)}>"


class SimGraph:
    """A graph: nodes in capture order, and the memory its allocation nodes own."""

    __slots__ = ("allocations", "destroyed", "device", "execs", "nodes", "value")

    def __init__(self, device: SimDevice) -> None:
        self.value = next_handle_value()
        self.device = device
        self.nodes: list[SimNode] = []
        self.allocations: list[Any] = []
        """Blocks of the allocation table (``_memory._Block``) made by allocation nodes."""
        self.execs = 0
        """Executable graphs instantiated from it and not yet done with (destroyed, replays run)."""
        self.destroyed = False

    def add(self, op: Operation, name: str, deps: tuple[int, ...]) -> int:
        index = len(self.nodes)
        self.nodes.append(SimNode(self, index, op, name, deps))
        return index

    @property
    def allocates(self) -> bool:
        return bool(self.allocations)

    def __repr__(self) -> str:
        return f"<SimGraph {self.value:#x} device={self.device.ordinal} nodes={len(self.nodes)}>"


class SimCapture:
    """A capture in progress: its graph, origin stream, mode, and each stream's dependency set."""

    __slots__ = ("active", "error", "graph", "id", "mode", "origin", "tails", "thread")

    def __init__(self, origin: SimStream, mode: str) -> None:
        self.id = next(_capture_ids)
        self.graph = SimGraph(origin.device)
        self.origin = origin
        self.mode = mode
        self.thread = threading.get_ident()
        self.tails: dict[SimStream, tuple[int, ...]] = {origin: ()}
        """Every stream in the capture, with the nodes its next node will depend on."""
        self.error: CudaError | None = None
        """What invalidated the capture (the first error wins)."""
        self.active = True

    def loose(self, stream: SimStream) -> list[SimNode]:
        """The nodes nothing depends on that ``stream``'s set does not hold (unjoined forks)."""
        nodes = self.graph.nodes
        depended = {dep for node in nodes for dep in node.deps}
        joined = self.tails[stream]
        return [node for node in nodes if node.index not in depended and node.index not in joined]

    def add(self, stream: SimStream, op: Operation, name: str) -> int:
        """Record ``op`` as a node on ``stream``; returns 0 (nothing was enqueued)."""
        if self.error is not None:
            raise sim_error(ResultCode.STREAM_CAPTURE_INVALIDATED, name, f"the capture failed earlier: {self.error}")
        index = self.graph.add(op, name, self.tails[stream])
        self.tails[stream] = (index,)
        return 0

    def invalidate(self, code: int, call: str, detail: str) -> CudaError:
        """Mark the capture failed (the first error wins) and return the error to raise."""
        error = sim_error(code, call, detail)
        if self.error is None:
            self.error = error
        return error

    def forbids(self, thread: int) -> bool:
        """Whether an unsafe call from ``thread`` conflicts with this capture."""
        return self.mode == "global" or (self.mode == "thread_local" and thread == self.thread)


class SimGraphExec:
    """An executable graph: its own copy of the graph's operations, and its last replay."""

    __slots__ = ("destroyed", "graph", "last", "ops", "pending", "value")

    def __init__(self, graph: SimGraph) -> None:
        self.value = next_handle_value()
        self.graph = graph
        self.ops: list[Operation] = [node.op for node in graph.nodes]
        self.last: SimPoint | None = None
        """Where the previous replay ends: the next one waits for it."""
        self.pending = 0
        """Replays enqueued and not yet run (the graph's memory stays until they have)."""
        self.destroyed = False

    def __repr__(self) -> str:
        return f"<SimGraphExec {self.value:#x} nodes={len(self.ops)}{' destroyed' if self.destroyed else ''}>"


class SimGraphs:
    """Mixin of SimDriver: capture, instantiation, replay and updates (see the module docstring)."""

    # Provided by SimCore and SimMemory.
    _api: Callable[..., None]
    _submit: Callable[..., int]
    _resolve_stream: Callable[[Any], SimStream]
    _captures: set[SimCapture]
    _release_graph_memory: Callable[[SimGraph], None]
    _mem: Callable[[], Any]

    # -- capture ----------------------------------------------------------------------------
    def stream_begin_capture(self, stream: Any, mode: str) -> None:
        sim = self._resolve_stream(stream)
        self._api("stream_begin_capture", sim.device.ordinal)
        if mode not in CAPTURE_MODES:
            raise sim_error(ResultCode.INVALID_VALUE, "stream_begin_capture", f"unknown capture mode {mode!r}")
        if sim is sim.device.null_stream:
            raise sim_error(
                ResultCode.STREAM_CAPTURE_UNSUPPORTED,
                "stream_begin_capture",
                "the legacy null stream cannot be captured",
            )
        if sim.capture is not None:
            raise sim_error(ResultCode.ILLEGAL_STATE, "stream_begin_capture", "the stream is already capturing")
        capture = SimCapture(sim, mode)
        sim.capture = capture
        self._captures.add(capture)

    def stream_end_capture(self, stream: Any) -> SimGraph:
        sim = self._resolve_stream(stream)
        self._api("stream_end_capture", sim.device.ordinal)
        capture: SimCapture | None = sim.capture
        if capture is None:
            raise sim_error(ResultCode.ILLEGAL_STATE, "stream_end_capture", "the stream is not capturing")
        if capture.origin is not sim:
            raise capture.invalidate(
                ResultCode.STREAM_CAPTURE_UNMATCHED, "stream_end_capture", "the capture began on another stream"
            )
        if capture.mode != "relaxed" and capture.thread != threading.get_ident():
            raise sim_error(
                ResultCode.STREAM_CAPTURE_WRONG_THREAD,
                "stream_end_capture",
                f"a {capture.mode} capture must end on the thread that began it",
            )
        for member in capture.tails:
            member.capture = None
        capture.active = False
        self._captures.discard(capture)
        graph = capture.graph
        error = capture.error
        if error is None:
            loose = [node.index for node in capture.loose(sim)]
            if loose:
                error = sim_error(
                    ResultCode.STREAM_CAPTURE_UNJOINED,
                    "stream_end_capture",
                    f"nodes {loose} were captured on streams that did not join the origin stream again",
                )
        else:
            error = sim_error(
                ResultCode.STREAM_CAPTURE_INVALIDATED, "stream_end_capture", f"the capture failed earlier: {error}"
            )
        if error is not None:
            graph.destroyed = True
            self._release_graph_memory(graph)
            raise error
        return graph

    def stream_capture_status(self, stream: Any) -> tuple[CaptureStatus, int]:
        sim = self._resolve_stream(stream)
        self._api("stream_capture_status", sim.device.ordinal)
        capture: SimCapture | None = sim.capture
        if capture is None:
            if sim is sim.device.null_stream and self._blocking_capture(sim):
                raise sim_error(
                    ResultCode.STREAM_CAPTURE_IMPLICIT,
                    "stream_capture_status",
                    "the legacy null stream depends on a capturing blocking stream",
                )
            return "none", 0
        if capture.error is not None:
            return "invalidated", 0
        return "active", capture.id

    def _blocking_capture(self, null: SimStream) -> bool:
        """Whether a stream of ``null``'s device that is not non-blocking is capturing."""
        return any(
            member.device is null.device and not member.non_blocking
            for capture in list(self._captures)
            for member in list(capture.tails)
        )

    def stream_join_capture_sinks(self, stream: Any) -> tuple[str, ...]:
        call = "stream_join_capture_sinks"
        sim = self._resolve_stream(stream)
        self._api(call, sim.device.ordinal)
        capture: SimCapture | None = sim.capture
        if capture is None:
            raise sim_error(ResultCode.ILLEGAL_STATE, call, "the stream is not capturing")
        if capture.error is not None:
            raise sim_error(ResultCode.STREAM_CAPTURE_INVALIDATED, call, f"the capture failed earlier: {capture.error}")
        loose = capture.loose(sim)
        if loose:
            capture.tails[sim] = tuple(sorted({*capture.tails[sim], *(node.index for node in loose)}))
        return tuple(node.kind for node in loose)

    def _check_unsafe(self, name: str) -> None:
        """Raise (and invalidate the captures concerned) if a capture forbids call ``name``
        from this thread; called by ``SimCore._api`` while captures are active."""
        if name not in UNSAFE_CALLS:
            return
        thread = threading.get_ident()
        conflicting = [capture for capture in list(self._captures) if capture.forbids(thread)]
        if conflicting:
            detail = f"{name} is not permitted while a {conflicting[0].mode} capture is active"
            for capture in conflicting:
                capture.invalidate(ResultCode.STREAM_CAPTURE_UNSUPPORTED, name, detail)
            raise sim_error(ResultCode.STREAM_CAPTURE_UNSUPPORTED, name, detail)

    def _free_beside_captures(self) -> None:
        """A stream-ordered free on a stream outside any capture, from a thread that is
        capturing (not relaxed): on an H100 the driver then invalidated the capture now and
        then; the simulator always does."""
        thread = threading.get_ident()
        for capture in list(self._captures):
            if capture.thread == thread and capture.mode != "relaxed":
                capture.invalidate(
                    ResultCode.STREAM_CAPTURE_INVALIDATED,
                    "cuMemFreeAsync",
                    "a stream-ordered free on another stream, from the capturing thread, during the capture",
                )

    def _refuse_capturing(self, stream: SimStream, call: str) -> None:
        """A query or synchronize of a capturing stream: its work will not run until the
        graph is launched. Invalidates the capture."""
        capture = stream.capture
        if capture is not None:
            raise capture.invalidate(
                ResultCode.STREAM_CAPTURE_UNSUPPORTED, call, "the stream is being captured: its work does not run"
            )

    def _refuse_capturing_context(self, ordinal: int, call: str) -> None:
        """A synchronize of a context (or device) while one of its streams captures, in
        any mode: it would wait for work that does not run. Invalidates the capture."""
        for capture in list(self._captures):
            if capture.origin.device.ordinal == ordinal:
                raise capture.invalidate(
                    ResultCode.STREAM_CAPTURE_UNSUPPORTED,
                    call,
                    "a stream of the context is being captured: its work does not run",
                )

    def _wait_in_capture(self, stream: SimStream, ev: SimEvent) -> None:
        """``stream_wait_event`` where a capture is involved: join it, or refuse."""
        call = "stream_wait_event"
        mine: SimCapture | None = stream.capture
        if mine is not None and mine.error is not None:  # (any use of its streams)
            raise sim_error(ResultCode.STREAM_CAPTURE_INVALIDATED, call, f"the capture failed earlier: {mine.error}")
        if ev.captured is None:
            assert mine is not None
            raise mine.invalidate(
                ResultCode.STREAM_CAPTURE_ISOLATION, call, "the event was recorded outside the capture"
            )
        theirs, deps = ev.captured
        if not theirs.active:
            raise sim_error(ResultCode.CAPTURED_EVENT, call, "the event was recorded in a capture that has ended")
        if mine is None and theirs.error is not None:
            # The programming guide: once a capture is invalidated, "further use of ... captured
            # events associated with the graph is invalid and will return an error"; the code
            # is INVALID_VALUE on CUDA (as ROCm's clr reports it matched, rocm-systems PR 11589).
            raise sim_error(
                ResultCode.INVALID_VALUE, call, f"the event was recorded in a capture that failed: {theirs.error}"
            )
        if mine is None:  # the stream joins the capture
            stream.capture = theirs
            theirs.tails[stream] = deps
        elif mine is theirs:
            theirs.tails[stream] = tuple(sorted({*theirs.tails[stream], *deps}))
        else:
            detail = "the event was recorded in another capture"
            mine.invalidate(ResultCode.STREAM_CAPTURE_MERGE, call, detail)
            raise theirs.invalidate(ResultCode.STREAM_CAPTURE_MERGE, call, detail)

    def _refuse_captured(self, ev: SimEvent, call: str) -> None:
        """A query, synchronize or timing of an event last recorded in a capture."""
        if ev.captured is not None:
            capture, _ = ev.captured
            detail = "the event was last recorded in a capturing stream: re-record it outside the capture"
            if capture.active:
                raise capture.invalidate(ResultCode.CAPTURED_EVENT, call, detail)
            raise sim_error(ResultCode.CAPTURED_EVENT, call, detail)

    # -- graphs -----------------------------------------------------------------------------
    def _graph(self, graph: Any, call: str) -> SimGraph:
        if type(graph) is not SimGraph or graph.destroyed:
            raise sim_error(ResultCode.INVALID_HANDLE, call, f"not a live simulated graph: {graph!r}")
        return graph

    def _exec(self, graph_exec: Any, call: str) -> SimGraphExec:
        if type(graph_exec) is not SimGraphExec or graph_exec.destroyed:
            raise sim_error(ResultCode.INVALID_HANDLE, call, f"not a live executable graph: {graph_exec!r}")
        return graph_exec

    def _node(self, graph_exec: SimGraphExec, node: GraphNodeInfo, kind: str, call: str) -> SimNode:
        sim_node = node.handle
        if type(sim_node) is not SimNode or sim_node.graph is not graph_exec.graph:
            raise sim_error(ResultCode.INVALID_VALUE, call, "the node is not one of the executable graph's")
        if sim_node.kind != kind:
            raise sim_error(
                ResultCode.INVALID_VALUE, call, f"node {sim_node.index} is a {sim_node.kind} node, not {kind}"
            )
        return sim_node

    def graph_nodes(self, graph: Any) -> Sequence[GraphNodeInfo]:
        sim = self._graph(graph, "graph_nodes")
        self._api("graph_nodes", sim.device.ordinal)
        return [_describe(node) for node in sim.nodes]

    def graph_kernel_node_arguments(self, node: GraphNodeInfo, codes: str) -> tuple[Any, ...]:
        sim_node = node.handle
        if type(sim_node) is not SimNode or sim_node.kind != "kernel":
            raise sim_error(ResultCode.INVALID_VALUE, "graph_kernel_node_arguments", "not a kernel node")
        self._api("graph_kernel_node_arguments", sim_node.graph.device.ordinal)
        values: tuple[Any, ...] = sim_node.op.values  # type: ignore[attr-defined]
        if len(values) != len(codes):
            raise sim_error(
                ResultCode.INVALID_VALUE,
                "graph_kernel_node_arguments",
                f"the kernel took {len(values)} arguments, {len(codes)} codes given",
            )
        return values

    def graph_instantiate(self, graph: Any) -> SimGraphExec:
        sim = self._graph(graph, "graph_instantiate")
        self._api("graph_instantiate", sim.device.ordinal)
        if sim.allocates and sim.execs:
            raise sim_error(
                ResultCode.INVALID_VALUE,
                "graph_instantiate",
                "a graph that allocates memory can have only one executable graph at a time",
            )
        sim.execs += 1
        return SimGraphExec(sim)

    def graph_launch(self, graph_exec: Any, stream: Any) -> None:
        gexec = self._exec(graph_exec, "graph_launch")
        sim = self._resolve_stream(stream)
        self._api("graph_launch", sim.device.ordinal)
        if sim.device is not gexec.graph.device:
            raise sim_error(
                ResultCode.INVALID_VALUE,
                "graph_launch",
                f"the graph was captured on device {gexec.graph.device.ordinal}, the stream is on {sim.device.ordinal}",
            )
        if sim.capture is not None:
            raise sim.capture.invalidate(
                ResultCode.STREAM_CAPTURE_UNSUPPORTED, "graph_launch", "the simulator cannot capture a graph launch"
            )
        ops = list(zip(gexec.ops, [node.name for node in gexec.graph.nodes], strict=True))
        gexec.pending += 1
        try:
            after = gexec.last
            if after is not None and not after.reached():
                self._submit(sim, StreamWait(after), "stream_wait_event")
            self._submit(sim, _nothing, "graph_launch")  # the replay's own latency, if one is set
            for op, name in ops:
                if type(op) is ExternalRecord:  # the event is recorded where the node runs
                    point = SimPoint(sim, 0)
                    point.seq = self._submit(sim, point.stamp, "event_record")
                    op.event.point, op.event.captured = point, None
                else:
                    self._submit(sim, op, name)
            # (Not named "graph_launch": a latency set for that slows the replay once,
            # at its start, not again at its end.)
            seq = self._submit(sim, _ReplayDone(self, gexec), _REPLAY_DONE)
        except BaseException:
            gexec.pending -= 1
            raise
        gexec.last = SimPoint(sim, seq)

    def graph_exec_update(self, graph_exec: Any, graph: Any) -> None:
        gexec = self._exec(graph_exec, "graph_exec_update")
        source = self._graph(graph, "graph_exec_update")
        self._api("graph_exec_update", source.device.ordinal)
        mine, theirs = gexec.graph.nodes, source.nodes
        reason = _mismatch(mine, theirs) if source.device is gexec.graph.device else "another device"
        if reason:
            raise sim_error(ResultCode.GRAPH_EXEC_UPDATE_FAILURE, "graph_exec_update", reason)
        gexec.ops = [node.op for node in theirs]

    def graph_exec_kernel_node_set_params(
        self, graph_exec: Any, node: GraphNodeInfo, func: Any, config: LaunchConfig, params: Any
    ) -> None:
        call = "graph_exec_kernel_node_set_params"
        gexec = self._exec(graph_exec, call)
        sim_node = self._node(gexec, node, "kernel", call)
        self._api(call, gexec.graph.device.ordinal)
        current = gexec.ops[sim_node.index]
        gexec.ops[sim_node.index] = current.replaced(func, config, params)  # type: ignore[attr-defined]

    def graph_exec_copy_setter(self, graph_exec: Any, node: GraphNodeInfo, ctx: Any) -> Callable[[int, int], None]:
        call = "graph_exec_memcpy_node_set_params"
        gexec = self._exec(graph_exec, call)
        sim_node = self._node(gexec, node, "memcpy", call)
        index = sim_node.index
        ordinal = gexec.graph.device.ordinal

        def set_addresses(dst: int, src: int) -> None:
            if gexec.destroyed:
                raise sim_error(ResultCode.INVALID_HANDLE, call, "the executable graph was destroyed")
            self._api(call, ordinal)
            gexec.ops[index] = gexec.ops[index].moved(dst, src)  # type: ignore[attr-defined]

        return set_addresses

    def graph_destroy(self, graph: Any) -> None:
        sim = self._graph(graph, "graph_destroy")
        self._api("graph_destroy", sim.device.ordinal)
        sim.destroyed = True
        if not sim.execs:
            self._release_graph_memory(sim)

    def graph_exec_destroy(self, graph_exec: Any) -> None:
        gexec = self._exec(graph_exec, "graph_exec_destroy")
        self._api("graph_exec_destroy", gexec.graph.device.ordinal)
        gexec.destroyed = True
        if not gexec.pending:
            self._exec_done(gexec)

    def _exec_done(self, gexec: SimGraphExec) -> None:
        """An executable graph is destroyed and its replays have run: the graph may give
        its memory back once it is destroyed too."""
        graph = gexec.graph
        graph.execs -= 1
        if graph.destroyed and not graph.execs:
            self._release_graph_memory(graph)


class ExternalRecord:
    """An event record node (``event_record_external`` during a capture)."""

    __slots__ = ("event",)

    def __init__(self, event: SimEvent) -> None:
        self.event = event

    def __call__(self) -> None:
        pass  # recorded by the replay itself (``graph_launch``)


class _ReplayDone:
    """The last operation of a replay: its executable graph's memory may go once it has
    run and the graph is destroyed."""

    __slots__ = ("driver", "gexec")

    def __init__(self, driver: SimGraphs, gexec: SimGraphExec) -> None:
        self.driver = driver
        self.gexec = gexec

    def __call__(self) -> None:
        gexec = self.gexec
        gexec.pending -= 1
        if gexec.destroyed and not gexec.pending:
            self.driver._exec_done(gexec)


_REPLAY_DONE = "graph_replay_done"
"""The name a replay's closing operation (:class:`_ReplayDone`) is enqueued under."""


def _nothing() -> None:
    pass


def _describe(node: SimNode) -> GraphNodeInfo:
    describe = getattr(node.op, "describe", None)
    fields: dict[str, Any] = describe() if describe is not None else {}
    return GraphNodeInfo(handle=node, kind=node.kind, dependencies=node.deps, **fields)


def _mismatch(mine: list[SimNode], theirs: list[SimNode]) -> str:
    """Why a graph of nodes ``theirs`` cannot update one of ``mine``; empty if it can."""
    if len(mine) != len(theirs):
        return f"{len(theirs)} nodes instead of {len(mine)}"
    for old, new in zip(mine, theirs, strict=True):
        if old.kind != new.kind:
            return f"node {old.index} is a {new.kind} node instead of {old.kind}"
        if old.deps != new.deps:
            return f"node {old.index} depends on {list(new.deps)} instead of {list(old.deps)}"
        if old.kind in ("mem_alloc", "mem_free"):
            before, after = _describe(old), _describe(new)
            if (before.dst, before.size) != (after.dst, after.size):
                return f"node {old.index} allocates other memory (a graph's allocations cannot change)"
        if old.kind == "memcpy" and _describe(old).direction != _describe(new).direction:
            return f"node {old.index} copies in another direction"
    return ""
