"""CUDA graphs: capture a stream's work once, then replay it with one driver call.

::

    async with stream.capture() as graph:          # recorded, not run
        x = aiocuda.empty(n, stream=stream)         # graph memory: allocated and freed by every replay
        await x.copy_from(pinned_in, stream=stream) # copies from page-locked memory: recorded
        kernel.launch(grid, block, x, n, stream=stream)
    await graph.launch(stream)                      # one replay, awaited like any GPU work
    graph.launch(other_stream)                      # enqueued only; replays run one after another

    graph.rebind({inputs: new_inputs})              # every node that used `inputs` uses `new_inputs`
    graph.set_kernel_args(node, new_x, n2)          # one kernel node: new pointers and scalars
    graph.update(other_graph)                       # the parameters of another capture of the same work

**What can be captured**: everything aiocuda only *enqueues* -- kernel launches, copies
between device arrays and from or to page-locked host memory, fills, stream-ordered
allocations and frees, ``Stream.hold``, waits between streams. A stream that waits on
captured work (``other.wait(stream)``, or on an event recorded in it) joins the capture,
and is joined back into the capturing stream when the block ends. A stream that joins
another way (another library waiting on an event recorded in the capture) must be
joined back by the block: work left forked on it fails the capture with a
:class:`~aiocuda.errors.CaptureError` coded ``STREAM_CAPTURE_UNJOINED`` naming the
stream. Whenever a capture fails -- so too when the block raises, its exception
propagating as it was -- every stream of it leaves the capture and takes ordinary work
again. Awaited operations
that only enqueue device work (``await array.fill(0, stream=s)``, ``await
aiocuda.copy_array(dst, src, stream=s)``) return as soon as the work is recorded.

**What cannot**, and raises :class:`~aiocuda.errors.CaptureError` at the call, the
capture going on: waiting for captured work (``await stream``, ``synchronize()``,
``query()``, ``await device.synchronize()`` while any stream of the device captures,
awaiting or querying an event recorded in the capture, ``to_host()``
without a page-locked ``out=``), a copy of pageable host memory (it is staged through
host threads: use :func:`aiocuda.pinned_empty`), and a wait of a capturing stream for work outside the
capture (make the stream you launch the graph on wait instead). The driver refuses the
calls the capture mode forbids (see :meth:`aiocuda.Stream.capture`). An event recorded
in the capture stays refused after it, until recorded again: it marks a point in the
graph, not in the stream (``CUDA_ERROR_CAPTURED_EVENT``); await the launch instead, or
record it with ``external=True`` for every replay to record it.

**Memory**: an allocation made during the capture is the graph's: every replay allocates
and frees it, at the same address; the buffer counts as freed after the capture and must
not be used outside it. Buffers from outside that captured work uses are kept alive by
the graph, and each launch orders the replay after their other work (as any aiocuda
operation does) -- pool memory and memory imported from other libraries
(:func:`aiocuda.interop.as_device_array`) alike, an imported array's owner kept with
it; host objects given to ``Stream.hold`` during the capture (page-locked
arrays copied from or to) are kept for every replay.

**Replays**: :meth:`Graph.launch` enqueues one replay on any stream of the graph's device
and returns an awaitable. Replays of one graph run one after another, whatever their
streams; capture the work several times for graphs that run side by side. Updates
(:meth:`Graph.rebind`, :meth:`Graph.set_kernel_args`, :meth:`Graph.set_copy`,
:meth:`Graph.update`) apply to the replays launched after them, never to those already
enqueued, and must fit the captured topology: the same nodes, each of the same kind,
copies between the same kinds of memory; else :class:`~aiocuda.errors.GraphUpdateError`,
the graph unchanged. A graph whose capture allocated memory can be updated node by node
but not from another capture (their allocations have other addresses).

Pitfalls: a capture records the values of the moment: a replay does not re-run the
Python code that enqueued the work (a scalar computed from the data, a branch). Capture
on a stream of your own: work other tasks enqueue on it meanwhile is captured too (an
``async with`` block that awaits lets them run; its default mode is ``"relaxed"``, so
that what they do elsewhere is not refused, see :meth:`aiocuda.Stream.capture`). Launch
each kernel once before capturing it (the driver refuses to load a module during a
capture). Kernel nodes of other libraries' kernels are replayed but cannot be read or
rebound.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

import anyio.to_thread
import numpy as np

from ._driver import CAPTURE_MODES, CaptureMode, GraphNodeInfo, LaunchConfig
from ._graph.capture import Capture
from ._graph.kernels import kernel_of
from ._graph.operands import Bound, Memory, check_destination, check_reach, move, operand, resolve
from ._memory import offloop as _offloop
from ._util import NoPublicConstructor, invalid_value
from .device import Device
from .errors import CaptureError, CudaError, GraphUpdateError, ResultCode
from .memory import MemoryPool
from .stream import Stream

if TYPE_CHECKING:
    from ._graph.capture import Buffer

__all__ = ["CaptureMode", "Graph", "GraphCapture", "GraphNode"]


@dataclass(frozen=True, slots=True)
class GraphNode:
    """One node of a captured graph (:attr:`Graph.nodes`), as its next replay will run it.

    ``kind`` is ``"kernel"``, ``"memcpy"``, ``"memset"``, ``"mem_alloc"``, ``"mem_free"``,
    ``"host"`` (a host function, such as aiocuda's doorbells), ``"event_record"``,
    ``"wait_event"``, ``"empty"``, ``"graph"`` or ``"other"``. Fields that do not apply to
    the kind keep their defaults.
    """

    index: int
    """Position in :attr:`Graph.nodes`: every node comes after the nodes it depends on."""
    kind: str
    dependencies: tuple[int, ...]
    """Indices of the nodes this one runs after."""
    kernel: Any = None
    """Kernel: the :class:`~aiocuda.kernel.Kernel` (None for another library's kernel)."""
    config: LaunchConfig | None = None
    """Kernel: grid, block and dynamic shared memory."""
    arguments: tuple[Any, ...] | None = None
    """Kernel: the arguments (pointers as ints), when the kernel is known."""
    dst: int = 0
    """Memcpy, memset: destination address; mem_alloc, mem_free: the graph allocation."""
    src: int = 0
    """Memcpy: source address."""
    size: int = 0
    """Memcpy, memset, mem_alloc: bytes."""
    direction: str = ""
    """Memcpy: ``"htod"``, ``"dtoh"``, ``"dtod"`` or ``"other"``."""
    value: int = 0
    """Memset: the value set."""


class _Replays:
    """What replays need alive: the driver's graph and executable graph, the host objects
    held during the capture, and the memory the nodes use. Destroyed off the loop (it may
    wait for the GPU) once the last replay that may use it has finished."""

    __slots__ = ("__weakref__", "bound", "externals", "graph", "handles", "holds")

    def __init__(self, device: Device, graph: Any) -> None:
        self.graph = graph
        self.handles: list[Any] = [graph, None]
        """The graph and its executable graph, destroyed together."""
        self.holds: list[Any] = []
        self.externals: dict[int, Buffer] = {}
        """Buffers from outside the capture its work uses, by ``id`` (pool buffers, and memory
        owned elsewhere with its owner): each launch orders the replay after their other work."""
        self.bound: dict[int, tuple[Bound, ...]] = {}
        """Memory node updates gave each node (by index), kept while the node uses it."""
        weakref.finalize(self, _offloop.dispose, device, _destroy, device._driver, self.handles)

    @property
    def graph_exec(self) -> Any:
        return self.handles[1]


def _destroy(backend: Any, handles: list[Any]) -> None:
    graph, graph_exec = handles
    if graph_exec is not None:
        with contextlib.suppress(CudaError):
            backend.graph_exec_destroy(graph_exec)
    backend.graph_destroy(graph)


def _retire(replays: _Replays, launched: dict[int, Stream]) -> None:
    """The Graph is closed or collected: its replays' needs go to the streams it was
    launched on, until the work enqueued there so far has finished."""
    _hand_over(launched, (replays,))


def _hand_over(launched: dict[int, Stream], objs: tuple[Any, ...]) -> None:
    for stream in launched.values():
        # (a closed stream's holds wait for the work enqueued before it closed)
        with contextlib.suppress(CudaError):  # a poisoned context: nothing will run
            stream.hold(*objs)


def _forget_finished(launched: dict[int, Stream]) -> None:
    """Drop the closed streams whose work has all finished: no replay on them needs
    anything more (a graph replayed on a stream per request would keep them all)."""
    finished = []
    for key, stream in launched.items():
        if stream.closed:
            try:
                done = stream.query()
            except CudaError:  # a poisoned context: nothing more runs there
                done = True
            if done:
                finished.append(key)
    for key in finished:
        del launched[key]


class Graph(metaclass=NoPublicConstructor):
    """Work captured from a stream (see the module docstring): instantiated once,
    launched many times, updated with new pointers and scalars in between.

    Get one from ``with stream.capture() as graph:`` (or ``async with``); it is ready
    once the block ends. Close it (or drop it) when done: the driver's objects are
    destroyed once the replays already enqueued have finished.
    """

    __slots__ = (
        "__weakref__",
        "_capture",
        "_changed",
        "_driver",
        "_finalizer",
        "_infos",
        "_launched",
        "_nodes",
        "_replays",
        "_setters",
        "_state",
        "device",
        "stream",
    )
    _factories = "Stream.capture()"

    def __init__(self, stream: Stream, capture: Capture) -> None:
        self.stream = stream
        """The stream the work was captured from (``launch()``'s default)."""
        self.device = stream.device
        self._driver = stream.device._driver
        self._capture: Capture | None = capture
        self._infos: list[GraphNodeInfo] = []
        self._nodes: list[GraphNode] = []
        self._replays: _Replays | None = None
        self._launched: dict[int, Stream] = {}
        """Streams replays were launched on, by ``id``: where the replays' needs are held at the end."""
        self._setters: dict[int, Callable[[int, int], None]] = {}
        self._changed: set[int] = set()
        """Nodes updated since the capture (what :meth:`update` carries over to another graph)."""
        self._state = "capturing"
        self._finalizer: weakref.finalize[Any, Any] | None = None

    # -- the end of the capture -------------------------------------------------------------------
    def _finish(self, failed: bool, cause: BaseException | None = None) -> None:
        """End the capture and read the graph's nodes; the graph is unusable when ``failed``
        (the block raised ``cause``, which propagates unchanged)."""
        capture, self._capture = self._capture, None
        assert capture is not None
        self._state = "failed"
        handle = capture.end(failed=failed, cause=cause)
        if handle is None:
            return
        replays = self._replays = _Replays(self.device, handle)
        replays.holds = capture.holds
        replays.externals = capture.externals
        self._finalizer = weakref.finalize(self, _retire, replays, self._launched)
        self._infos = list(self._driver.graph_nodes(handle))
        self._nodes = [self._describe(i, info) for i, info in enumerate(self._infos)]
        self._state = "captured"

    def _describe(self, index: int, info: GraphNodeInfo) -> GraphNode:
        kernel, arguments = None, None
        if info.kind == "kernel" and info.func is not None:
            kernel = kernel_of(self._driver, info.func)
            if kernel is not None and kernel.signature is not None:
                codes = "".join(param.code for param in kernel.signature)
                arguments = tuple(self._driver.graph_kernel_node_arguments(info, codes))
        return GraphNode(
            index=index,
            kind=info.kind,
            dependencies=info.dependencies,
            kernel=kernel,
            config=info.config,
            arguments=arguments,
            dst=info.dst,
            src=info.src,
            size=info.size,
            direction=info.direction,
            value=info.value,
        )

    def _instantiate(self) -> None:
        """Make the executable graph (may take milliseconds: ``async with`` runs it off the loop)."""
        replays = self._replays
        assert replays is not None
        self.device.make_current()
        replays.handles[1] = self._driver.graph_instantiate(replays.graph)
        self._state = "ready"

    # -- replays ------------------------------------------------------------------------------------
    def launch(self, stream: Stream | None = None) -> Awaitable[None]:
        """Enqueue one replay on ``stream`` (default: the stream the graph was captured
        from; any stream of the graph's device), after the work already on it; return an
        awaitable for it (an :class:`~aiocuda.event.Event` recorded after the replay: work
        enqueued later is not waited for). Replays of this graph run one after another."""
        s = self.stream if stream is None else stream
        if not isinstance(s, Stream):
            raise TypeError(f"a graph is launched on a Stream, not {type(s).__name__}")
        self._enqueue(s)
        return s.record()

    def _enqueue(self, s: Stream) -> None:
        """:meth:`launch` without the awaitable (the executor's graph mode awaits an event)."""
        replays = self._ready()
        if s.device is not self.device:
            raise invalid_value(f"the graph runs on device {self.device.ordinal}, the stream is on {s.device.ordinal}")
        if s._capture is not None:
            raise s._capture.refuse("launching a graph", "a launch cannot be recorded into another graph")
        for buffer in replays.externals.values():
            buffer._used_on(s)  # after the buffer's other work; its free waits for the replay (raises if freed)
        if replays.bound:
            for entries in replays.bound.values():
                for _, _, _, bound_buffer in entries:
                    if bound_buffer is not None:
                        bound_buffer._used_on(s)
        if s._closed:
            s.handle  # noqa: B018 - raises the stream's own "closed" error
        try:
            self._driver.graph_launch(replays.graph_exec, s._handle)
        except CudaError as exc:
            if exc.code != ResultCode.INVALID_CONTEXT:
                raise
            self.device.make_current()  # a thread that never bound the context: bind it and retry
            self._driver.graph_launch(replays.graph_exec, s.handle)
        if id(s) not in self._launched:
            _forget_finished(self._launched)
            self._launched[id(s)] = s

    def _ready(self) -> _Replays:
        replays = self._replays
        if self._state != "ready" or replays is None:
            if self._state == "capturing":
                raise CaptureError("the graph is still being captured", name="AIOCUDA_NOT_CAPTURABLE")
            if self._state == "failed":
                raise CaptureError("the graph's capture failed: capture the work again", name="AIOCUDA_NOT_CAPTURABLE")
            raise invalid_value(f"the graph is {self._state}")
        return replays

    @property
    def nodes(self) -> tuple[GraphNode, ...]:
        """The captured nodes, each after those it depends on (for work captured on one
        stream: in the order it was enqueued), as the next replay will run them."""
        return tuple(self._nodes)

    # -- updates --------------------------------------------------------------------------------------
    def set_kernel_args(self, node: GraphNode | int, *args: Any) -> None:
        """New arguments for kernel node ``node`` (a node or its index) in later replays:
        what its kernel takes, checked as for a launch (:class:`~aiocuda.errors.LaunchError`
        naming a bad argument). Arrays and buffers passed -- other libraries' arrays
        included -- are kept alive by the graph, with their owners, while the node uses
        them; each must be memory of the graph's device, or managed memory
        (:class:`~aiocuda.errors.GraphUpdateError`)."""
        replays = self._ready()
        index, current = self._node(node, "kernel")
        kernel = current.kernel
        if kernel is None or current.config is None:
            raise GraphUpdateError(
                f"node {index} runs a kernel aiocuda did not launch: its arguments cannot be changed",
                name="AIOCUDA_GRAPH_UPDATE",
            )
        params = kernel._pack(args)
        given: list[Bound] = []
        for i, (param, arg) in enumerate(zip(kernel.signature, args, strict=True)):
            if param.takes_address and arg is not None and not isinstance(arg, (int, np.integer)):
                memory = resolve(arg)
                check_reach(memory, self.device, f"argument {i}")
                given.append(memory.bound())
        self.device.make_current()
        self._set_kernel_params(replays, index, current.config, params)
        self._nodes[index] = dataclasses.replace(current, arguments=tuple(params.values))
        self._changed.add(index)
        self._bind(index, given)

    def _set_kernel_params(self, replays: _Replays, index: int, config: LaunchConfig, params: Any) -> None:
        info = self._infos[index]
        self._driver.graph_exec_kernel_node_set_params(replays.graph_exec, info, info.func, config, params)

    def set_copy(self, node: GraphNode | int, *, dst: Any = None, src: Any = None) -> None:
        """New addresses for memcpy node ``node`` in later replays: ``dst`` and ``src``
        (None keeps one) are device arrays (other libraries' arrays and arrays imported
        from them included), buffers or int addresses on the device side, page-locked
        numpy arrays or int addresses on the host side, of at least the node's size. The
        graph keeps the objects alive (an imported array's owner with it) while the node
        uses them. Device memory must be of the device of the memory it replaces
        (:class:`~aiocuda.errors.GraphUpdateError`); a read-only array
        (:attr:`~aiocuda.DeviceArray.readonly`) cannot be ``dst``
        (:class:`~aiocuda.errors.ArgumentError`)."""
        self._ready()
        index, current = self._node(node, "memcpy")
        new_dst, dst_memory = operand(dst, current.dst, current.size, current.direction[-1:] == "h", "dst")
        new_src, src_memory = operand(src, current.src, current.size, current.direction[:1] == "h", "src")
        if dst_memory is not None:
            check_destination(dst_memory, index)
            self._check_copy_device(dst_memory, current.dst, "dst")
        if src_memory is not None:
            self._check_copy_device(src_memory, current.src, "src")
        self._move_copy(index, current, new_dst, new_src)
        self._bind(index, [memory.bound() for memory in (dst_memory, src_memory) if memory is not None])

    def _check_copy_device(self, memory: Memory, current: int, what: str) -> None:
        """GraphUpdateError unless device ``memory`` is of the device of the memory at
        ``current`` (the driver takes a copy node's memory of the contexts it was captured
        with only); memory the driver cannot place is left to the driver."""
        if memory.host or memory.managed or memory.device is None:
            return
        try:
            ordinal = self._driver.pointer_device_ordinal(current)
        except CudaError:
            return
        if ordinal != memory.device.ordinal:
            raise GraphUpdateError(
                f"the copy's {what} is memory of device {ordinal}; {memory.name} is memory of device "
                f"{memory.device.ordinal}: a copy node keeps the devices it was captured with (capture it again)",
                name="AIOCUDA_GRAPH_UPDATE",
            )

    def _move_copy(self, index: int, current: GraphNode, dst: int, src: int) -> None:
        setter = self._copy_setter(index)
        self.device.make_current()
        setter(dst, src)
        self._nodes[index] = dataclasses.replace(current, dst=dst, src=src)
        self._changed.add(index)

    def _copy_setter(self, index: int) -> Callable[[int, int], None]:
        """``set(dst, src)`` of memcpy node ``index``, made once: the hot path for a caller
        that keeps the memory it points the node at alive itself (the executor's graph
        mode). The node's record in :attr:`nodes` does not follow it."""
        setter = self._setters.get(index)
        if setter is None:
            self._node(index, "memcpy")
            setter = self._setters[index] = self._driver.graph_exec_copy_setter(
                self._ready().graph_exec, self._infos[index], self.device._context
            )
        return setter

    def rebind(self, mapping: Mapping[Any, Any] | Iterable[tuple[Any, Any]]) -> None:
        """In later replays, use new memory wherever the capture used old memory: kernel
        pointer arguments and copy addresses that fall inside an old array's bytes move
        to the same offset in the new one. ``mapping`` is ``{old: new}`` or pairs
        ``[(old, new), ...]`` (numpy arrays cannot be dict keys).

        Old and new are device arrays or buffers -- other libraries' arrays and arrays
        imported from them included: the graph keeps a new one's owner alive while a node
        uses it -- or page-locked numpy arrays; each new one must have at least the old
        one's bytes, on the same side (device or host), of the same device (or managed
        memory). Kernels of other libraries are left as they are. Nodes are checked
        before any is changed: a memset or an allocation inside a key raises
        :class:`~aiocuda.errors.GraphUpdateError`, a read-only new array
        (:attr:`~aiocuda.DeviceArray.readonly`) that a copy node would write into
        :class:`~aiocuda.errors.ArgumentError`.
        """
        self._ready()
        pairs = list(mapping.items() if isinstance(mapping, Mapping) else mapping)
        if not all(isinstance(pair, tuple) and len(pair) == 2 for pair in pairs):
            raise TypeError("rebind takes {old: new} or (old, new) pairs")
        moves = [move(old, new) for old, new in pairs]

        def moved_into(address: int) -> tuple[int, Memory] | None:
            for start, end, target, memory in moves:
                if start <= address < end:
                    return target + (address - start), memory
            return None

        def moved(address: int) -> int | None:
            found = moved_into(address)
            return None if found is None else found[0]

        kernel_updates: list[tuple[int, tuple[Any, ...]]] = []
        copy_updates: list[tuple[int, int, int]] = []
        for node in self._nodes:
            if node.kind == "kernel" and node.arguments is not None and node.kernel is not None:
                values, changed = list(node.arguments), False
                for i, param in enumerate(node.kernel.signature):
                    target = moved(values[i]) if param.takes_address and values[i] else None
                    if target is not None:
                        values[i], changed = target, True
                if changed:
                    kernel_updates.append((node.index, tuple(values)))
            elif node.kind == "memcpy":
                into = moved_into(node.dst)
                if into is not None:
                    check_destination(into[1], node.index)
                dst, src = None if into is None else into[0], moved(node.src)
                if dst is not None or src is not None:
                    copy_updates.append(
                        (node.index, node.dst if dst is None else dst, node.src if src is None else src)
                    )
            elif node.kind in ("memset", "mem_alloc", "mem_free") and moved(node.dst) is not None:
                raise GraphUpdateError(
                    f"node {node.index} ({node.kind}) uses memory being rebound, and only kernel and memcpy nodes "
                    "can be: capture the work again",
                    name="AIOCUDA_GRAPH_UPDATE",
                )
        given = [memory.bound() for _, _, _, memory in moves]
        for index, arguments in kernel_updates:
            self.set_kernel_args(index, *arguments)
            self._bind(index, given)
        for index, dst, src in copy_updates:
            self._move_copy(index, self._nodes[index], dst, src)
            self._bind(index, given)

    def update(self, other: Graph) -> None:
        """Give later replays the parameters of ``other``, a capture of the same work
        (same nodes, kinds and dependencies) with other pointers and scalars. ``other``
        may be closed afterwards. :class:`~aiocuda.errors.GraphUpdateError` when it does
        not fit (nothing changes then)."""
        replays = self._ready()
        if not isinstance(other, Graph):
            raise TypeError(f"a graph is updated from another Graph, not {type(other).__name__}")
        if other is self:
            return
        theirs = other._replays
        if other._state not in ("captured", "ready") or theirs is None:
            raise GraphUpdateError(f"the other graph is {other._state}", name="AIOCUDA_GRAPH_UPDATE")
        if other.device is not self.device:
            raise GraphUpdateError("the other graph was captured on another device", name="AIOCUDA_GRAPH_UPDATE")
        self.device.make_current()
        self._driver.graph_exec_update(replays.graph_exec, theirs.graph)  # (its captured parameters)
        for index in sorted(other._changed):  # and what was updated in it since
            node = other._nodes[index]
            if node.kind == "kernel":
                assert node.kernel is not None and node.config is not None and node.arguments is not None
                self._set_kernel_params(replays, index, node.config, node.kernel._pack(node.arguments))
            else:
                self._copy_setter(index)(node.dst, node.src)
        retired = (tuple(replays.holds), tuple(replays.externals.values()), tuple(replays.bound.values()))
        _hand_over(self._launched, retired)
        replays.holds = list(theirs.holds)
        replays.externals = dict(theirs.externals)
        replays.bound = dict(theirs.bound)
        self._nodes = [dataclasses.replace(node, index=i) for i, node in enumerate(other._nodes)]
        self._changed = set(other._changed)

    def _node(self, node: GraphNode | int, kind: str) -> tuple[int, GraphNode]:
        if isinstance(node, GraphNode):
            index = node.index
        elif isinstance(node, bool) or not isinstance(node, (int, np.integer)):
            raise TypeError(f"a node is a GraphNode or its index, not {type(node).__name__}")
        else:
            index = int(node)
        if not 0 <= index < len(self._nodes):
            raise GraphUpdateError(
                f"the graph has no node {index} (it has {len(self._nodes)})", name="AIOCUDA_GRAPH_UPDATE"
            )
        current = self._nodes[index]
        if current.kind != kind:
            raise GraphUpdateError(f"node {index} is a {current.kind} node, not {kind}", name="AIOCUDA_GRAPH_UPDATE")
        return index, current

    def _bind(self, index: int, given: list[Bound]) -> None:
        """Node ``index`` was updated: keep, of the memory given now and before, what its
        addresses fall in; what it no longer uses stays with the replays already launched."""
        replays = self._ready()
        node = self._nodes[index]
        if node.kind == "kernel" and node.arguments is not None and node.kernel is not None:
            addresses = [v for p, v in zip(node.kernel.signature, node.arguments, strict=True) if p.takes_address and v]
        else:
            addresses = [node.dst, node.src]
        kept: list[Bound] = []
        dropped: list[Bound] = []
        seen: set[tuple[int, int, int]] = set()
        for entry in (*replays.bound.get(index, ()), *given):
            keep, start, end, _ = entry
            key = (id(keep), start, end)
            used = key not in seen and any(start <= address < end for address in addresses)
            seen.add(key)
            (kept if used else dropped).append(entry)
        if dropped:
            _hand_over(self._launched, tuple(entry[0] for entry in dropped))
        if kept:
            replays.bound[index] = tuple(kept)
        else:
            replays.bound.pop(index, None)

    # -- lifetime ---------------------------------------------------------------------------------------
    def close(self) -> None:
        """Release the graph: its driver objects are destroyed (off the event loop) once the
        replays already enqueued have finished. Idempotent."""
        if self._state == "capturing":
            raise CaptureError(
                "a graph is closed after its capture block, not inside it", name="AIOCUDA_NOT_CAPTURABLE"
            )
        if self._state == "closed":
            return
        self._state = "closed"
        self._replays = None
        if self._finalizer is not None:
            self._finalizer()

    def __repr__(self) -> str:
        kinds: dict[str, int] = {}
        for node in self._nodes:
            kinds[node.kind] = kinds.get(node.kind, 0) + 1
        summary = ", ".join(f"{count} {kind}" for kind, count in kinds.items())
        detail = f" ({summary})" if summary else ""
        return f"<Graph device={self.device.ordinal} {self._state} nodes={len(self._nodes)}{detail}>"


class GraphCapture(metaclass=NoPublicConstructor):
    """The capture of a stream's work into a :class:`Graph` (:meth:`aiocuda.Stream.capture`):
    ``with stream.capture() as graph:`` or ``async with`` (which instantiates the graph
    off the event loop). The graph is ready once the block ends; a block that raises
    discards it, and its exception propagates as it was (a driver error met while ending
    the capture is added to it as a note). Either way every stream of the capture leaves
    it and takes ordinary work again."""

    __slots__ = ("_graph", "_mode", "_stream")
    _factories = "Stream.capture()"

    def __init__(self, stream: Stream, mode: CaptureMode | None) -> None:
        if mode is not None and mode not in CAPTURE_MODES:
            raise invalid_value(f"unknown capture mode {mode!r}: expected one of {', '.join(CAPTURE_MODES)}")
        self._stream = stream
        self._mode = mode
        self._graph: Graph | None = None

    def __enter__(self) -> Graph:
        return self._begin(self._mode or "thread_local")

    def _begin(self, mode: CaptureMode) -> Graph:
        if self._graph is not None:
            raise CaptureError("a capture can be entered once", name="AIOCUDA_NOT_CAPTURABLE")
        # The device's pool is configured on first use (a pool attribute), which the driver
        # refuses while a stream captures: first use happens here, before the capture.
        MemoryPool.for_device(self._stream.device)
        capture = Capture(self._stream, mode)
        capture.begin()
        self._graph = Graph._create(self._stream, capture)
        return self._graph

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        graph = self._graph
        assert graph is not None
        graph._finish(failed=exc_type is not None, cause=exc)
        if exc_type is None:
            graph._instantiate()

    async def __aenter__(self) -> Graph:
        return self._begin(self._mode or "relaxed")  # (see Stream.capture)

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        graph = self._graph
        assert graph is not None
        graph._finish(failed=exc_type is not None, cause=exc)  # on this thread: a capture ends where it began
        if exc_type is None:
            # (shielded: a cancellation landing here left a captured graph that could never
            # be launched; it takes effect at the next checkpoint instead)
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(graph._instantiate)
