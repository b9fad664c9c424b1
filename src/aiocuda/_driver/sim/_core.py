"""Simulated core: devices, contexts, streams, events, doorbells, faults -- and the hooks
the other sim mixins build on.

Semantics follow the CUDA Driver API; departures are listed here.

Devices and contexts
    ``SimDriver(devices=1, total_memory=16 << 30)`` makes that many identical H100-like
    devices. Each has exactly one (primary) context, created with the device and never
    destroyed; ``primary_context_release`` only counts down. The current context is
    per thread (``set_current``); a thread that never set one works on device 0 rather
    than failing with ``CUDA_ERROR_INVALID_CONTEXT`` (a lenient driver). A worker running
    a stream's operations has that stream's context current. Every pair of distinct devices can be peers.
    Device ``i`` is at PCI bus ``i`` (``0000:0a:00.0`` for device 10) and has a UUID of
    its own (a UUID5 of ``i``), the same in every process.

Streams
    Each stream runs its operations in order on the driver's worker pool (see
    ``_objects.py`` and ``_workers.py``): concurrently with other streams, without a
    thread of its own. Value 0 (and 1, ``CU_STREAM_LEGACY``) names the current device's
    legacy null stream, with the legacy synchronisation: work on it waits for all work
    already enqueued on the device's blocking streams, and work on a blocking stream
    waits for the null stream's work already enqueued. Stream priorities are recorded
    (clamped to ``(0, -5)``) but do not change scheduling.

    Value 2 (``CU_STREAM_PER_THREAD``) names the calling thread's per-thread default
    stream of the current context (so of the current device, with primary contexts):
    made on first use, one per (thread, context), each thread's its own. It is a
    blocking stream, so it keeps the legacy synchronisation with the null stream like
    any other, and none with other threads' per-thread streams. It cannot be destroyed
    (``CUDA_ERROR_INVALID_HANDLE``, as for the null stream); destroying its context
    ends it, and the thread's next use of value 2 makes a fresh one. The thread keeps
    it in a ``threading.local``: a thread that exits leaves its streams (work already
    queued still runs), so tests that spawn many threads do not pile them up, and
    :meth:`SimCore.shutdown` drops their queued work like every other stream's.
    Departure: a value 0, 1 or 2 is resolved when the call is made, and the handle
    ``stream_from_value`` returns keeps naming that stream (its ``handle_value`` is 0
    or 2): used from another thread, or with another device current, it still names
    the stream it was resolved to, where the driver would resolve the value again.

Events
    ``event_record`` captures the point after everything enqueued so far on the stream;
    re-recording moves the event; a never-recorded event is complete. Recording into a
    stream of another device is ``CUDA_ERROR_INVALID_HANDLE`` (as on the real driver);
    ``stream_wait_event`` across devices is allowed. Timestamps are ``perf_counter``
    readings taken when the stream reaches the recorded point.

Errors and poisoning
    Every public method starts with :meth:`SimCore._api`, which counts the call for
    fault injection and raises the device's error. Device queries (name, attributes,
    ...) need no context and keep working on a poisoned device, as with the real
    driver; everything that uses a context raises ``ContextPoisonedError``. A sticky
    injected fault poisons the device of the call it fires on, whichever call that is
    (the real driver only returns sticky codes from a poisoned context), and with it
    every other device: a sticky error ends the process's use of CUDA. See
    ``_objects.py`` for errors raised by enqueued operations. A wait for work on a
    poisoned device ends at once with ``ContextPoisonedError``. In a child forked from
    the process that made the driver, every call raises the fork error
    (``NoDeviceError``), as the real driver's calls fail there: the child has none of
    the worker threads, and its waits would otherwise never end.

Hooks for the other mixins (their public methods call ``_api`` first, then do the work
directly or through ``_enqueue``; they must not call other public methods, which would
count those calls twice for fault injection):

* ``_api(name, device_ordinal=None)``, ``_enqueue(stream, fn, name)``,
  ``_device_of_current()``, ``_stream_ordinal(stream)``, ``_resolve_stream(stream)``;
* ``self._devices[i]`` (:class:`SimDevice`: ``used_bytes``, ``peers``, ``context``);
* ``_objects.next_handle_value()`` for their own handles, ``_codes.sim_error`` for errors.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from ...errors import STICKY_CODES, ResultCode
from .._doorbell import SemaphoreDoorbell
from .._fork import fork_error
from .._pci import PCI_BUS_ID_FORMS, PciBusId, parse_pci_bus_id
from .._protocol import Driver
from ._attributes import H100_ATTRIBUTES
from ._codes import sim_error
from ._faults import FaultPlan
from ._graphs import ExternalRecord, SimCapture
from ._objects import (
    HOST_FUNCTION,
    REMOTE_POLL,
    SHUT_DOWN,
    RemotePoint,
    SimContext,
    SimDevice,
    SimEvent,
    SimPoint,
    SimStream,
    StreamWait,
    new_workers,
    next_handle_value,
)

__all__ = ["SimCore"]

_SIM_DRIVER_VERSION = 13000
_PRIORITY_LEAST, _PRIORITY_GREATEST = 0, -5
_LEGACY_STREAM_VALUES = (0, 1)  # 0: the null stream; 1: CU_STREAM_LEGACY
_PER_THREAD_STREAM_VALUE = 2  # CU_STREAM_PER_THREAD
_SHUTDOWN_JOIN_S = 2.0
_UUID_NAMESPACE = uuid.UUID("6b3c1f3e-5a0e-4d4e-9a57-a10c0da51a70")


_NOT_COUNTED = {
    "handle_value": "it reads a handle and makes no driver call",
    "prepare_launch": "the launches it prepares count as 'launch_kernel'",
    "mem_async_calls": "the allocations and frees it hands out count as 'mem_alloc_async' and 'mem_free_async'",
    "graph_exec_copy_setter": "it makes no driver call; only a fault without call= reaches the setter's updates",
}
"""Methods of the Driver protocol that never count for fault injection under their own
name, and why: a fault armed for one would never fire."""

# Every simulated driver of the process: a forked child marks them all forked.
_drivers: weakref.WeakSet[SimCore] = weakref.WeakSet()


def _forked_in_child() -> None:
    # The child has none of the parent's worker threads: work enqueued there would never
    # run, so an await in the child would hang. Every call fails instead, as the real
    # driver's do there (and its checked calls turn that into the fork error).
    for sim in list(_drivers):
        sim._forked = True
        sim._closed = True


os.register_at_fork(after_in_child=_forked_in_child)


def _pci_bus_id(device: SimDevice) -> PciBusId:
    """A simulated device's PCI address: bus number = ordinal (``0000:01:00.0`` for
    device 1), as its ``pci_bus_id`` attribute says."""
    return PciBusId(domain=0, bus=device.ordinal, device=0, function=0)


class SimCore:
    """Mixin of SimDriver: the core of the Driver protocol, simulated, plus test controls.

    Test controls (not seam calls; they never count for fault injection):
    :meth:`enqueue`, :meth:`pause` / :meth:`resume`, :meth:`inject_fault`, :meth:`poison`,
    :meth:`set_latency`, :meth:`shutdown`.
    """

    # Provided by SimGraphs: the capture's checks.
    _check_unsafe: Callable[[str], None]
    _refuse_capturing: Callable[[SimStream, str], None]
    _wait_in_capture: Callable[[SimStream, SimEvent], None]
    _refuse_captured: Callable[[SimEvent, str], None]
    # Provided by SimMemory: the pools observe the frees a synchronisation waited for.
    _observe_frees: Callable[[int, Any], None]

    def __init__(self, devices: int = 1, total_memory: int = 16 << 30) -> None:
        if devices < 1:
            raise ValueError(f"a simulated driver needs at least one device, got devices={devices}")
        if total_memory <= 0:
            raise ValueError(f"total_memory must be positive, got {total_memory}")
        self._tls = threading.local()
        self._workers = new_workers(self._bind_context)
        self._faults = FaultPlan()
        self._closed = False  # shut down, or forked: every seam call raises
        self._forked = False  # this is a child forked from the process that made it
        self._devices: tuple[SimDevice, ...] = tuple(SimDevice(i, total_memory) for i in range(devices))
        for device in self._devices:
            device.process = self._devices
        for device in self._devices:
            device.null_stream = SimStream(self._workers, device, 0, non_blocking=False, priority=0)
        self._streams: dict[int, SimStream] = {}
        self._events: dict[int, SimEvent] = {}
        self._captures: set[SimCapture] = set()
        """Captures in progress (``_graphs.py``): while any is, seam calls check the unsafe ones."""
        _drivers.add(self)
        super().__init__()

    def __repr__(self) -> str:
        poisoned = [d.ordinal for d in self._devices if d.poison is not None]
        return (
            f"<SimDriver devices={len(self._devices)} streams={len(self._streams)} "
            f"events={len(self._events)} poisoned={poisoned}{' closed' if self._closed else ''}>"
        )

    @property
    def closed(self) -> bool:
        """Whether it was shut down (or is a forked child's copy): every seam call raises."""
        return self._closed

    # -- hooks for the other mixins --------------------------------------------------------
    def _api(self, name: str, device_ordinal: int | None = None) -> None:
        """Start of every public sim method: fault injection, then the device's error.

        ``name`` is the seam method's name (``"launch_kernel"``), which is what
        ``inject_fault(call=...)`` matches. ``device_ordinal`` is the device the call
        works on; None means the calling thread's current device. Raises the injected
        fault if one falls due (poisoning the device first when its code is sticky),
        ``ContextPoisonedError`` if the device is poisoned, a pending asynchronous error
        of the device once, or ``CUDA_ERROR_DEINITIALIZED`` after :meth:`shutdown`.
        """
        if self._closed or self._faults.armed or self._captures:
            self._api_slow_path(name, device_ordinal)
        device = self._devices[self._device_of_current() if device_ordinal is None else device_ordinal]
        if device.poison is not None or device.async_error is not None:
            error = device.take_error(name)
            if error is not None:
                raise error

    def _api_slow_path(self, name: str, device_ordinal: int | None) -> None:
        if self._closed:
            if self._forked:
                raise fork_error()
            raise sim_error(ResultCode.DEINITIALIZED, name, SHUT_DOWN)
        if self._captures:
            self._check_unsafe(name)
        if not self._faults.armed:
            return
        code = self._faults.take(name)
        if code is None:
            return
        error = sim_error(code, name, "fault injected by SimDriver.inject_fault")
        if code in STICKY_CODES:
            ordinal = self._device_of_current() if device_ordinal is None else device_ordinal
            self._devices[ordinal].poison_with(code, f"fault injected into {name}", error)
        raise error

    def _counted(self, name: str) -> None:
        """Start of a call that needs no context (device queries...): fault injection only.

        A sticky fault injected into such a call poisons the calling thread's current device.
        """
        if self._closed or self._faults.armed:
            self._api_slow_path(name, None)

    def _device_of_current(self) -> int:
        """The ordinal of the calling thread's current context; 0 when it has none.
        ``CONTEXT_IS_DESTROYED`` when the current context was destroyed."""
        ctx = self._current_context()
        if ctx is None:
            return 0
        if ctx.destroyed:
            raise sim_error(
                ResultCode.CONTEXT_IS_DESTROYED, "context", f"the current context {ctx.value:#x} was destroyed"
            )
        return ctx.device_ordinal

    def _context_stack(self) -> list[SimContext]:
        """The calling thread's context stack (its top is the current context)."""
        stack: list[SimContext] | None = getattr(self._tls, "stack", None)
        if stack is None:
            stack = self._tls.stack = []
        return stack

    def _current_context(self) -> SimContext | None:
        stack: list[SimContext] | None = getattr(self._tls, "stack", None)
        return stack[-1] if stack else None

    def _bind_context(self, ctx: SimContext | None) -> None:
        self._tls.stack = [] if ctx is None else [ctx]

    def _resolve_stream(self, stream: Any) -> SimStream:
        """The live :class:`SimStream` for a stream handle or raw value; else ArgumentError."""
        if type(stream) is SimStream:
            if stream.destroyed:
                raise sim_error(ResultCode.INVALID_HANDLE, "stream", f"stream {stream.value:#x} was destroyed")
            return stream
        if isinstance(stream, int) and not isinstance(stream, bool):
            if stream in _LEGACY_STREAM_VALUES:
                return self._devices[self._device_of_current()].null_stream
            if stream == _PER_THREAD_STREAM_VALUE:
                return self._per_thread_stream()
            found = self._streams.get(stream)
            if found is not None:
                return found
            raise sim_error(ResultCode.INVALID_HANDLE, "stream", f"no simulated stream has value {stream:#x}")
        raise sim_error(ResultCode.INVALID_HANDLE, "stream", f"not a simulated stream: {stream!r}")

    def _per_thread_stream(self) -> SimStream:
        """The calling thread's per-thread default stream of its current context (made now
        if it has none, or its context was destroyed since)."""
        ordinal = self._device_of_current()
        context = self._current_context() or self._devices[ordinal].context
        # Kept in the thread's local storage, keyed by context: the streams go when the
        # thread does (a stream with queued work lives on in the worker pool until it is
        # done), so threads that come and go leave nothing behind here.
        streams: dict[SimContext, SimStream] | None = getattr(self._tls, "per_thread", None)
        if streams is None:
            streams = self._tls.per_thread = {}
        stream = streams.get(context)
        if stream is None or stream.destroyed:
            for gone in [key for key, old in streams.items() if old.destroyed]:
                del streams[gone]  # (their contexts were destroyed: nothing keeps them here)
            stream = SimStream(self._workers, self._devices[ordinal], _PER_THREAD_STREAM_VALUE, False, 0)
            stream.context = context
            streams[context] = stream
        return stream

    def _stream_ordinal(self, stream: Any) -> int:
        """The ordinal of a stream's device (ArgumentError for a bad handle)."""
        return self._resolve_stream(stream).device.ordinal

    def _enqueue(self, stream: Any, fn: Callable[[], object], name: str) -> None:
        """Run ``fn()`` on a worker after everything enqueued on ``stream`` before.

        ``name`` labels the operation in errors and is what :meth:`set_latency` matches.
        ``fn`` runs on another thread with the stream's context current; it must not
        call public sim methods, nor wait for other simulated work. If it raises, see
        ``_objects.py`` for what happens to the device. Does not call :meth:`_api`: the
        public method calling this already did.
        """
        self._submit(self._resolve_stream(stream), fn, name)

    def _submit(self, stream: SimStream, fn: Callable[[], object], name: str) -> int:
        """Enqueue on a resolved stream, after the legacy null-stream ordering it needs; on
        a capturing stream, add a graph node instead (returns 0: no point in the stream)."""
        capture = stream.capture
        if capture is not None:
            return capture.add(stream, fn, name)  # type: ignore[no-any-return]
        null = stream.device.null_stream
        if stream is null:
            for other in stream.device.streams():
                if other is not null and not other.non_blocking and other.finished < other.submitted:
                    stream.submit(StreamWait(SimPoint(other, other.submitted)), "stream_wait_event")
        elif not stream.non_blocking and null.finished < null.submitted:
            stream.submit(StreamWait(SimPoint(null, null.submitted)), "stream_wait_event")
        return stream.submit(fn, name)

    def _device(self, dev: Any) -> SimDevice:
        if type(dev) is SimDevice and dev.ordinal < len(self._devices) and self._devices[dev.ordinal] is dev:
            return dev
        raise sim_error(ResultCode.INVALID_DEVICE, "device", f"not a device of this simulated driver: {dev!r}")

    def _event(self, event: Any) -> SimEvent:
        if type(event) is SimEvent:
            if not event.destroyed:
                return event
            raise sim_error(ResultCode.INVALID_HANDLE, "event", f"event {event.value:#x} was destroyed")
        raise sim_error(ResultCode.INVALID_HANDLE, "event", f"not a simulated event: {event!r}")

    # -- test controls ---------------------------------------------------------------------
    def enqueue(self, stream: Any, fn: Callable[[], object], name: str = "op") -> None:
        """Run ``fn()`` on a worker thread, in ``stream``'s order, as one operation.

        A stand-in for GPU work in tests: ``fn`` may sleep (a slow kernel; it holds one
        of the pool's worker threads meanwhile, where :meth:`set_latency` holds none) or raise (a
        faulting one: a :class:`~aiocuda.errors.CudaError` with a sticky code, or any
        other exception, poisons the device; a non-sticky CudaError is reported at the
        device's next call). ``name`` is what :meth:`set_latency` matches. ``fn`` must
        not call the driver. ``stream`` is a handle or a raw stream value.
        """
        self._enqueue(stream, fn, name)

    def pause(self, stream: Any) -> None:
        """Stop ``stream`` from starting any more operations until :meth:`resume`.

        Operations enqueued meanwhile queue up; one already running finishes. Host
        waits on a paused stream (``stream_synchronize``) block until it is resumed --
        do not synchronize a paused stream from the thread that will resume it.
        """
        self._resolve_stream(stream).pause()

    def resume(self, stream: Any) -> None:
        """Let a paused stream run its queued operations again (a destroyed one too: its
        queued work still runs, as on a GPU)."""
        if type(stream) is SimStream:
            stream.resume()
        else:
            self._resolve_stream(stream).resume()

    def inject_fault(self, code: int, *, at_call: int = 1, call: str | None = None) -> None:
        """Make the ``at_call``-th seam call from now raise ``error_for_code(code, ...)``.

        With ``call`` (a seam method name such as ``"launch_kernel"`` or
        ``"event_query"``) only calls of that name count. The failing call raises
        before doing anything; a sticky ``code`` also poisons the device that call
        works on. Several faults may be armed at once; each counts on its own.
        A ``call`` that is not a method of the ``Driver`` protocol, or one that is
        never counted (:data:`_NOT_COUNTED`), is a ValueError, as is ``code`` 0
        (``CUDA_SUCCESS``): such a fault would never fire as asked.
        """
        if call is not None and (call.startswith("_") or not callable(getattr(Driver, call, None))):
            raise ValueError(f"inject_fault(call={call!r}): not a method of the Driver protocol")
        if call in _NOT_COUNTED:
            raise ValueError(f"inject_fault(call={call!r}): no call counts under that name ({_NOT_COUNTED[call]})")
        if code == ResultCode.SUCCESS:
            raise ValueError("inject_fault needs an error code, not 0 (CUDA_SUCCESS): see aiocuda.errors.ResultCode")
        self._faults.add(code, at_call, call)

    def poison(self, device_ordinal: int, code: int = ResultCode.ILLEGAL_ADDRESS) -> None:
        """Poison a device's context now, as a faulting kernel would -- and so every
        device's (a sticky error ends the process's use of CUDA).

        From then on every call using a device raises ``ContextPoisonedError``,
        pending host waits on its streams and events wake up and raise it, queued
        operations are dropped, and host functions (doorbells) never run again. An
        operation already running when this is called finishes.
        """
        if code not in STICKY_CODES:
            raise ValueError(f"poison needs a sticky result code (errors.STICKY_CODES), got {code}")
        if not 0 <= device_ordinal < len(self._devices):
            raise ValueError(f"poison: no simulated device {device_ordinal} (there are {len(self._devices)})")
        self._devices[device_ordinal].poison_with(code, "poisoned by SimDriver.poison()")

    def set_latency(self, name: str, seconds: float) -> None:
        """Make every operation named ``name`` take ``seconds`` on its stream (0 removes).

        The operation waits that long on its stream before it runs (holding no thread),
        so events recorded around it measure at least that long. Names are the ones operations are enqueued under:
        ``"event_record"``, ``"stream_wait_event"``, ``"launch_doorbell"`` here; the
        memory and module mixins document theirs.
        """
        # The timekeeper waits for a latency on a Condition, which refuses a timeout
        # beyond threading.TIMEOUT_MAX (about 292 years on Linux): the OverflowError ended
        # that worker, and every worker that took its place, so every stream stalled.
        # (NaN fails the comparison: it meant no latency at all.)
        if not 0 <= seconds <= threading.TIMEOUT_MAX:
            raise ValueError(
                f"latency must be between 0 and {threading.TIMEOUT_MAX:.0f} seconds, got {seconds} "
                "(to hold a stream's work until you let it go, pause the stream)"
            )
        if seconds:
            self._workers.latency[name] = seconds
        else:
            self._workers.latency.pop(name, None)

    def shutdown(self) -> None:
        """Stop every worker promptly; afterwards every seam call raises DEINITIALIZED.

        Queued operations are dropped, host waits in progress end with
        ``CUDA_ERROR_DEINITIALIZED``. Called by ``use_backend`` when switching away.
        """
        self._closed = True
        self._workers.stop()
        for device in self._devices:
            for stream in device.streams():
                stream.drop()
        self._workers.join(time.monotonic() + _SHUTDOWN_JOIN_S)

    # -- process, devices, contexts --------------------------------------------------------
    def init(self) -> None:
        self._counted("init")

    def driver_version(self) -> int:
        self._counted("driver_version")
        return _SIM_DRIVER_VERSION

    def device_count(self) -> int:
        self._counted("device_count")
        return len(self._devices)

    def device_get(self, ordinal: int) -> SimDevice:
        self._counted("device_get")
        count = len(self._devices)
        if not 0 <= ordinal < count:
            raise sim_error(
                ResultCode.INVALID_DEVICE,
                "device_get",
                f"device ordinal {ordinal} is out of range: the simulated driver has {count} "
                f"device(s) (ordinals 0..{count - 1})",
            )
        return self._devices[ordinal]

    def device_name(self, dev: Any) -> str:
        self._counted("device_name")
        return f"aiocuda simulated GPU {self._device(dev).ordinal}"

    def device_uuid(self, dev: Any) -> str:
        self._counted("device_uuid")
        return f"GPU-{uuid.uuid5(_UUID_NAMESPACE, str(self._device(dev).ordinal))}"

    def device_pci_bus_id(self, dev: Any) -> str:
        self._counted("device_pci_bus_id")
        return str(_pci_bus_id(self._device(dev)))

    def device_ordinal_by_pci_bus_id(self, bus_id: str) -> int | None:
        self._counted("device_ordinal_by_pci_bus_id")
        wanted = parse_pci_bus_id(bus_id)
        if wanted is None:
            raise sim_error(
                ResultCode.INVALID_VALUE,
                "device_ordinal_by_pci_bus_id",
                f"{bus_id!r} is not a PCI bus id: expected {PCI_BUS_ID_FORMS}",
            )
        for device in self._devices:
            if _pci_bus_id(device) == wanted:
                return device.ordinal
        return None

    def device_total_mem(self, dev: Any) -> int:
        self._counted("device_total_mem")
        return self._device(dev).total_mem

    def device_attribute(self, dev: Any, attribute: str) -> int:
        self._counted("device_attribute")
        device = self._device(dev)
        if attribute == "pci_bus_id":
            return device.ordinal
        value = H100_ATTRIBUTES.get(attribute)
        if value is None:
            raise sim_error(ResultCode.INVALID_VALUE, "device_attribute", f"unknown device attribute {attribute!r}")
        return value

    def device_attribute_names(self) -> Sequence[str]:
        self._counted("device_attribute_names")
        return sorted([*H100_ATTRIBUTES, "pci_bus_id"])

    def device_can_access_peer(self, dev: Any, peer: Any) -> bool:
        self._counted("device_can_access_peer")
        return self._device(dev) is not self._device(peer)

    def primary_context_retain(self, dev: Any) -> SimContext:
        device = self._device(dev)
        self._api("primary_context_retain", device.ordinal)
        device.context.retain_count += 1
        return device.context

    def primary_context_release(self, dev: Any) -> None:
        device = self._device(dev)
        self._api("primary_context_release", device.ordinal)
        if device.context.retain_count == 0:
            raise sim_error(
                ResultCode.INVALID_CONTEXT,
                "primary_context_release",
                f"device {device.ordinal}'s primary context is not retained",
            )
        device.context.retain_count -= 1

    def set_current(self, ctx: Any) -> None:
        """Replace the top of the thread's context stack (push onto an empty one); None pops."""
        if ctx is not None:
            self._context(ctx, "set_current")
        self._counted("set_current")
        stack = self._context_stack()
        if ctx is None:
            if stack:
                stack.pop()
        elif stack:
            stack[-1] = ctx
        else:
            stack.append(ctx)

    def _context(self, ctx: Any, call: str) -> SimContext:
        """``ctx`` if it is a live context of this driver; else ``INVALID_CONTEXT``."""
        if type(ctx) is not SimContext or ctx.device_ordinal >= len(self._devices) or ctx.destroyed:
            raise sim_error(ResultCode.INVALID_CONTEXT, call, f"not a live simulated context: {ctx!r}")
        return ctx

    def enable_peer_access(self, peer_ctx: Any) -> bool:
        self._context(peer_ctx, "enable_peer_access")
        ordinal = self._device_of_current()
        self._api("enable_peer_access", ordinal)
        if peer_ctx.device_ordinal == ordinal:
            raise sim_error(
                ResultCode.INVALID_DEVICE,
                "enable_peer_access",
                f"device {ordinal} cannot enable peer access to its own context",
            )
        peers = self._devices[ordinal].peers
        if peer_ctx.device_ordinal in peers:
            return False  # the driver's CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED, which the seam reports so
        peers.add(peer_ctx.device_ordinal)
        return True

    def disable_peer_access(self, peer_ctx: Any) -> None:
        self._context(peer_ctx, "disable_peer_access")
        ordinal = self._device_of_current()
        self._api("disable_peer_access", ordinal)
        peers = self._devices[ordinal].peers
        if peer_ctx.device_ordinal not in peers:  # its own context included: never enabled
            raise sim_error(
                ResultCode.PEER_ACCESS_NOT_ENABLED,
                "disable_peer_access",
                f"device {ordinal} has no peer access to device {peer_ctx.device_ordinal} to disable",
            )
        peers.discard(peer_ctx.device_ordinal)

    def mem_get_info(self) -> tuple[int, int]:
        self._api("mem_get_info")
        device = self._devices[self._device_of_current()]
        return device.total_mem - device.used_bytes, device.total_mem

    # -- streams ---------------------------------------------------------------------------
    def stream_create(self, non_blocking: bool, priority: int) -> SimStream:
        ordinal = self._device_of_current()
        self._api("stream_create", ordinal)
        clamped = min(_PRIORITY_LEAST, max(_PRIORITY_GREATEST, priority))
        stream = SimStream(self._workers, self._devices[ordinal], next_handle_value(), non_blocking, clamped)
        stream.context = self._current_context() or stream.device.context
        self._streams[stream.value] = stream
        return stream

    def stream_destroy(self, stream: Any) -> None:
        """Queued work still completes (as with ``cuStreamDestroy``); the handle dies now."""
        sim = self._resolve_stream(stream)
        self._api("stream_destroy", sim.device.ordinal)
        if sim.value in _LEGACY_STREAM_VALUES:
            raise sim_error(ResultCode.INVALID_HANDLE, "stream_destroy", "the null stream cannot be destroyed")
        if sim.value == _PER_THREAD_STREAM_VALUE:
            raise sim_error(
                ResultCode.INVALID_HANDLE, "stream_destroy", "a per-thread default stream cannot be destroyed"
            )
        self._streams.pop(sim.value, None)
        sim.destroy()

    def stream_from_value(self, value: int) -> SimStream:
        """The live sim stream with that value; 0 or 1 is the current device's null stream,
        2 the calling thread's per-thread default stream of the current context."""
        self._counted("stream_from_value")
        return self._resolve_stream(int(value))

    def handle_value(self, handle: Any) -> int:
        """The ``value`` of any sim handle (streams, events, contexts, devices, pools, ...)."""
        value = getattr(handle, "value", None)
        if not isinstance(value, int):
            raise sim_error(ResultCode.INVALID_HANDLE, "handle_value", f"not a simulated handle: {handle!r}")
        return value

    def stream_query(self, stream: Any) -> bool:
        sim = self._resolve_stream(stream)
        self._api("stream_query", sim.device.ordinal)
        self._refuse_capturing(sim, "stream_query")
        return sim.finished >= sim.submitted

    def stream_synchronize(self, stream: Any) -> None:
        sim = self._resolve_stream(stream)
        self._api("stream_synchronize", sim.device.ordinal)
        self._refuse_capturing(sim, "stream_synchronize")
        target = sim.submitted
        self._wait_for(SimPoint(sim, target), "stream_synchronize")
        self._observe_frees(sim.device.ordinal, sim)

    def stream_wait_event(self, stream: Any, event: Any) -> None:
        sim = self._resolve_stream(stream)
        ev = self._event(event)
        self._api("stream_wait_event", sim.device.ordinal)
        if ev.captured is not None or sim.capture is not None:
            self._wait_in_capture(sim, ev)
            return
        point: SimPoint | RemotePoint | None = ev.point
        if ev.remote is not None:
            point = RemotePoint(ev.remote, ev.remote.recorded)
        if point is not None and not point.reached():
            self._submit(sim, StreamWait(point), "stream_wait_event")

    def stream_get_priority(self, stream: Any) -> int:
        sim = self._resolve_stream(stream)
        self._api("stream_get_priority", sim.device.ordinal)
        return sim.priority

    def stream_is_non_blocking(self, stream: Any) -> bool:
        sim = self._resolve_stream(stream)
        self._api("stream_is_non_blocking", sim.device.ordinal)
        return sim.non_blocking

    def stream_priority_range(self) -> tuple[int, int]:
        self._api("stream_priority_range")
        return _PRIORITY_LEAST, _PRIORITY_GREATEST

    def stream_device_ordinal(self, stream: Any) -> int:
        sim = self._resolve_stream(stream)
        self._api("stream_device_ordinal", sim.device.ordinal)
        return sim.device.ordinal

    def _wait_for(self, point: SimPoint, call: str) -> None:
        """Block the calling thread until ``point`` is reached, then report the device's error.

        Like ``cuStreamSynchronize``, the wait also returns errors of the work it waited
        for: a poison (even one raised by the very last operation) or a pending
        asynchronous error.
        """
        if not point.reached():
            point.stream.wait_until(point.reached)
        error = point.stream.device.take_error(call)
        if error is not None:
            raise error
        if not point.reached():
            raise sim_error(ResultCode.DEINITIALIZED, call, SHUT_DOWN)

    # -- events ----------------------------------------------------------------------------
    def event_create(self, timing: bool, blocking_sync: bool) -> SimEvent:
        ordinal = self._device_of_current()
        self._api("event_create", ordinal)
        event = SimEvent(ordinal, timing, blocking_sync)
        self._events[event.value] = event
        return event

    def event_destroy(self, event: Any) -> None:
        """The handle dies now; a pending record still completes for waiters already queued."""
        ev = self._event(event)
        self._api("event_destroy", ev.device_ordinal)
        ev.destroyed = True
        self._events.pop(ev.value, None)
        if ev.shared is not None and (ev.point is None or ev.point.reached()):
            ev.shared.slots.give_back(ev.shared)  # (a pending record gives it back when it completes)

    def event_record(self, event: Any, stream: Any) -> None:
        self._record(event, stream, "event_record")

    def event_record_external(self, event: Any, stream: Any) -> None:
        """A plain record; during a capture, a node that records the event at every replay."""
        self._record(event, stream, "event_record_external")

    def _record(self, event: Any, stream: Any, call: str) -> None:
        ev = self._event(event)
        sim = self._resolve_stream(stream)
        self._api(call, sim.device.ordinal)
        if ev.device_ordinal != sim.device.ordinal:
            raise sim_error(
                ResultCode.INVALID_HANDLE,
                call,
                f"event of device {ev.device_ordinal} recorded into a stream of device {sim.device.ordinal}",
            )
        if ev.remote is not None:
            raise sim_error(ResultCode.NOT_SUPPORTED, call, "the simulator does not record into an event opened by IPC")
        capture = sim.capture
        if capture is not None:
            if call == "event_record_external":
                capture.add(sim, ExternalRecord(ev), call)
                return
            if capture.error is not None:
                raise sim_error(ResultCode.STREAM_CAPTURE_INVALIDATED, call, "the capture failed earlier")
            ev.captured = (capture, capture.tails[sim])
            return
        point = SimPoint(sim, 0)
        stamp = point.stamp
        if ev.shared is not None:
            slot, generation = ev.shared, ev.shared.record()

            def stamp() -> None:
                point.stamp()
                slot.reach(generation)
                # Destroyed while this, its last record, was pending: the slot comes back
                # now. (The destroy sets destroyed, then looks at the point; this stamps
                # the point, then looks at destroyed: one of the two gives it back, or both.)
                if ev.destroyed and ev.point is point:
                    slot.slots.give_back(slot)

        point.seq = self._submit(sim, stamp, "event_record")
        ev.point = point
        ev.captured = None

    def event_query(self, event: Any) -> bool:
        ev = self._event(event)
        self._api("event_query", ev.device_ordinal)
        self._refuse_captured(ev, "event_query")
        if ev.remote is not None:
            return bool(ev.remote.done())
        return ev.point is None or ev.point.reached()

    def event_synchronize(self, event: Any) -> None:
        ev = self._event(event)
        self._api("event_synchronize", ev.device_ordinal)
        self._refuse_captured(ev, "event_synchronize")
        if ev.remote is not None:
            generation = ev.remote.recorded
            while ev.remote.completed() < generation:
                if self._closed:
                    raise sim_error(ResultCode.DEINITIALIZED, "event_synchronize", SHUT_DOWN)
                time.sleep(REMOTE_POLL)
            return
        if ev.point is not None:
            self._wait_for(ev.point, "event_synchronize")
            self._observe_frees(ev.device_ordinal, ev.point.stream)

    def event_elapsed_ms(self, start: Any, end: Any) -> float:
        first, last = self._event(start), self._event(end)
        self._api("event_elapsed_ms", first.device_ordinal)
        for ev in (first, last):
            self._refuse_captured(ev, "event_elapsed_ms")
            if not ev.timing:
                raise sim_error(
                    ResultCode.INVALID_HANDLE,
                    "event_elapsed_ms",
                    f"event {ev.value:#x} was created without timing",
                )
            if ev.point is None:
                raise sim_error(
                    ResultCode.INVALID_HANDLE, "event_elapsed_ms", f"event {ev.value:#x} was never recorded"
                )
        assert first.point is not None and last.point is not None
        if not (first.point.reached() and last.point.reached()):
            raise sim_error(ResultCode.NOT_READY, "event_elapsed_ms", "an event has not completed yet")
        assert first.point.time is not None and last.point.time is not None
        return (last.point.time - first.point.time) * 1000.0

    # -- doorbells -------------------------------------------------------------------------
    def new_doorbell(self) -> SemaphoreDoorbell:
        self._counted("new_doorbell")
        return SemaphoreDoorbell()

    def launch_doorbell(self, stream: Any, bell: Any) -> None:
        """Enqueue ``bell.ring()``; never run once the device is poisoned (as on CUDA)."""
        sim = self._resolve_stream(stream)
        self._api("launch_doorbell", sim.device.ordinal)
        self._submit(sim, bell.ring, HOST_FUNCTION)
