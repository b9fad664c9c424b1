"""Real-driver core: initialisation, devices, contexts, streams, events, doorbells.

``cuda.bindings`` is imported lazily, at :meth:`CudaCore.init`, so that ``import
aiocuda`` works on a machine with no CUDA at all; a missing driver then surfaces as a
:class:`~aiocuda.errors.NoDeviceError` that says what to do.

Host functions: cuda-bindings' ``cuLaunchHostFunc`` wraps every callback in a
trampoline that takes the GIL on the driver's thread, even for a C function pointer. A
thread that holds the GIL while it waits on the driver would then deadlock. So doorbells
are enqueued by calling libcuda's own ``cuLaunchHostFunc`` through ctypes (which drops
the GIL for the call) with libc's ``sem_post`` as the host function: no Python runs on
the driver's thread, ever.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Sequence
from typing import Any, ClassVar

from ...errors import NoDeviceError, ResultCode, error_for_code
from .._doorbell import SemaphoreDoorbell
from .._fork import fork_error, was_forked
from .._pci import PCI_BUS_ID_FORMS, parse_pci_bus_id

__all__ = ["IPC_HANDLE_BYTES", "CudaCore", "check", "drv"]

IPC_HANDLE_BYTES = 64
"""``CU_IPC_HANDLE_SIZE``: the bytes of an IPC event handle and of a pool pointer's
export data."""

drv: Any = None
"""``cuda.bindings.driver``, once :meth:`CudaCore.init` has imported it."""

_SUCCESS: Any = None
_NOT_READY: Any = None

_INSTALL_HINT = (
    "Install the NVIDIA driver (libcuda.so.1) on a machine with an NVIDIA GPU, or run on "
    "the simulated backend: AIOCUDA_BACKEND=sim (or aiocuda.use_backend('sim'))."
)


class _ForkedBindings:
    """What :data:`drv` becomes in a child forked after its parent used CUDA: every
    driver function raises the fork error; types and constants pass through.

    Calls in such a child do not fail by themselves: on the H200 machine, queries of the
    parent's events and streams answered "done" from the copied state, and in the GPU
    lane's many-threaded test process an await there never returned (a lock of the
    driver, held by a parent's thread at the fork, stays held in the child)."""

    __slots__ = ("_real",)

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._real, name)
        if name.startswith("cu") and callable(value):
            raise fork_error()
        return value


def _refuse_in_child() -> None:
    global drv
    if drv is not None and was_forked():
        drv = _ForkedBindings(drv)


os.register_at_fork(after_in_child=_refuse_in_child)  # (after _fork's hook: registered first)


def _raise(err: Any, call: str) -> None:
    if was_forked():
        raise fork_error()
    code = int(err)
    name_res = drv.cuGetErrorName(err)
    desc_res = drv.cuGetErrorString(err)
    name = name_res[1].decode() if name_res[0] == _SUCCESS and name_res[1] else f"CUresult {code}"
    desc = desc_res[1].decode() if desc_res[0] == _SUCCESS and desc_res[1] else ""
    exc = error_for_code(code, name, desc, call)
    if code in (ResultCode.NO_DEVICE, ResultCode.STUB_LIBRARY, ResultCode.INSUFFICIENT_DRIVER):
        exc.args = (f"{exc.args[0]}. {_INSTALL_HINT}",)
    raise exc


def check(result: tuple[Any, ...], call: str) -> Any:
    """Unpack a cuda-bindings result tuple, raising the matching CudaError on failure.

    Returns ``None`` for calls without outputs, the single output, or a tuple of them.
    """
    err = result[0]
    if err != _SUCCESS:
        _raise(err, call)
    n = len(result)
    if n == 1:
        return None
    if n == 2:
        return result[1]
    return result[1:]


class _LibcudaHostFunc:
    """``cuLaunchHostFunc`` called straight into libcuda, bypassing the GIL trampoline."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        self._fn = lib.cuLaunchHostFunc
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]

    def __call__(self, stream_value: int, function: int, argument: int) -> int:
        return int(self._fn(stream_value or None, function, argument))


def _bad_stream(value: object, why: str) -> Exception:
    return error_for_code(
        ResultCode.INVALID_HANDLE,
        "CUDA_ERROR_INVALID_HANDLE",
        f"{value!r} is {why}: pass the stream object (CuPy, PyTorch, Numba, cuda.core, "
        f"anything with __cuda_stream__) or the handle of a live CUstream",
        "stream_from_value",
    )


class _AddressProbe:
    """Whether memory at an address is readable, asked of the kernel (``write(2)`` of it
    into a pipe fails with EFAULT) rather than by reading it, which would crash."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._write = libc.write
        self._write.restype = ctypes.c_ssize_t
        self._write.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
        self._lock = threading.Lock()
        self._pid = -1
        self._fds = (-1, -1)

    def __call__(self, address: int, size: int) -> bool:
        with self._lock:
            if self._pid != os.getpid():  # a forked child gets a pipe of its own
                self._fds = os.pipe()
                self._pid = os.getpid()
            read_fd, write_fd = self._fds
            written = int(self._write(write_fd, address, size))
            if written > 0:
                os.read(read_fd, written)
            return written == size


_readable = _AddressProbe()


def _attribute_enum(prefix: str, enum: Any) -> dict[str, Any]:
    return {
        member.name[len(prefix) :].lower(): member
        for member in enum
        if member.name.startswith(prefix) and not member.name.endswith("_MAX")
    }


class CudaCore:
    """Mixin of CudaDriver: the core of the Driver protocol on the real driver."""

    _initialised = False
    _init_lock = threading.Lock()
    _device_attrs: ClassVar[dict[str, Any]]
    """Attribute names (``"clock_rate"``) to ``CUdevice_attribute`` members, set by init."""
    _host_func: ClassVar[_LibcudaHostFunc]
    """libcuda's own ``cuLaunchHostFunc``, set by init."""

    def init(self) -> None:
        global drv, _SUCCESS, _NOT_READY
        if CudaCore._initialised:
            return
        with CudaCore._init_lock:
            if CudaCore._initialised:
                return
            try:
                from cuda.bindings import driver as bindings_driver
            except ImportError as exc:  # pragma: no cover - cuda-bindings is a dependency
                raise NoDeviceError(
                    f"cuda-bindings is not installed ({exc}). pip install 'cuda-bindings>=12.9.1'",
                    name="AIOCUDA_NO_BINDINGS",
                ) from exc
            drv = bindings_driver
            _SUCCESS = drv.CUresult.CUDA_SUCCESS
            _NOT_READY = drv.CUresult.CUDA_ERROR_NOT_READY
            try:
                result = drv.cuInit(0)
            except Exception as exc:  # the loader raises when libcuda.so.1 is absent
                raise NoDeviceError(
                    f"no CUDA driver could be loaded ({type(exc).__name__}: {exc}). {_INSTALL_HINT}",
                    name="CUDA_ERROR_NO_DRIVER",
                ) from exc
            check(result, "cuInit")
            if check(drv.cuDeviceGetCount(), "cuDeviceGetCount") == 0:
                raise NoDeviceError(
                    f"the CUDA driver reports no device. {_INSTALL_HINT}",
                    code=ResultCode.NO_DEVICE,
                    name="CUDA_ERROR_NO_DEVICE",
                )
            CudaCore._device_attrs = _attribute_enum("CU_DEVICE_ATTRIBUTE_", drv.CUdevice_attribute)
            CudaCore._host_func = _LibcudaHostFunc()
            CudaCore._initialised = True

    # -- process, devices, contexts -------------------------------------------------------
    def driver_version(self) -> int:
        return int(check(drv.cuDriverGetVersion(), "cuDriverGetVersion"))

    def device_count(self) -> int:
        return int(check(drv.cuDeviceGetCount(), "cuDeviceGetCount"))

    def device_get(self, ordinal: int) -> Any:
        count = self.device_count()
        if not 0 <= ordinal < count:
            raise error_for_code(
                ResultCode.INVALID_DEVICE,
                "CUDA_ERROR_INVALID_DEVICE",
                f"device ordinal {ordinal} is out of range: this machine has {count} device(s) "
                f"(ordinals 0..{count - 1})",
                "cuDeviceGet",
            )
        return check(drv.cuDeviceGet(ordinal), "cuDeviceGet")

    def device_name(self, dev: Any) -> str:
        raw: bytes = check(drv.cuDeviceGetName(256, dev), "cuDeviceGetName")
        return raw.split(b"\0", 1)[0].decode()

    def device_uuid(self, dev: Any) -> str:
        uuid = check(drv.cuDeviceGetUuid(dev), "cuDeviceGetUuid")
        h = bytes(uuid.bytes).hex()
        return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"

    def device_pci_bus_id(self, dev: Any) -> str:
        raw: bytes = check(drv.cuDeviceGetPCIBusId(64, dev), "cuDeviceGetPCIBusId")
        return raw.split(b"\0", 1)[0].decode()

    def device_ordinal_by_pci_bus_id(self, bus_id: str) -> int | None:
        # The driver is handed only ids parse_pci_bus_id accepts, in one form: what its
        # own parser makes of other strings (trailing text, a 9-digit domain) is not
        # documented.
        parsed = parse_pci_bus_id(bus_id)
        if parsed is None:
            raise error_for_code(
                ResultCode.INVALID_VALUE,
                "CUDA_ERROR_INVALID_VALUE",
                f"{bus_id!r} is not a PCI bus id: expected {PCI_BUS_ID_FORMS}",
                "cuDeviceGetByPCIBusId",
            )
        err, dev = drv.cuDeviceGetByPCIBusId(str(parsed).encode())
        # The driver documents both codes without saying which means what; for a
        # well-formed id either one means that no device it shows is there.
        if err in (drv.CUresult.CUDA_ERROR_INVALID_DEVICE, drv.CUresult.CUDA_ERROR_INVALID_VALUE):
            return None
        found = int(check((err, dev), "cuDeviceGetByPCIBusId"))
        # A CUdevice is a handle, not documented as the ordinal: find the ordinal whose
        # handle it is.
        for ordinal in range(self.device_count()):
            if int(check(drv.cuDeviceGet(ordinal), "cuDeviceGet")) == found:
                return ordinal
        return None

    def device_total_mem(self, dev: Any) -> int:
        return int(check(drv.cuDeviceTotalMem(dev), "cuDeviceTotalMem"))

    def device_attribute(self, dev: Any, attribute: str) -> int:
        member = self._device_attrs.get(attribute)
        if member is None:
            raise error_for_code(
                ResultCode.INVALID_VALUE,
                "CUDA_ERROR_INVALID_VALUE",
                f"unknown device attribute {attribute!r}",
                "cuDeviceGetAttribute",
            )
        return int(check(drv.cuDeviceGetAttribute(member, dev), "cuDeviceGetAttribute"))

    def device_attribute_names(self) -> Sequence[str]:
        return sorted(self._device_attrs)

    def device_can_access_peer(self, dev: Any, peer: Any) -> bool:
        if int(dev) == int(peer):
            return False
        return bool(check(drv.cuDeviceCanAccessPeer(dev, peer), "cuDeviceCanAccessPeer"))

    def primary_context_retain(self, dev: Any) -> Any:
        return check(drv.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")

    def primary_context_release(self, dev: Any) -> None:
        check(drv.cuDevicePrimaryCtxRelease(dev), "cuDevicePrimaryCtxRelease")

    def set_current(self, ctx: Any) -> None:
        check(drv.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def enable_peer_access(self, peer_ctx: Any) -> bool:
        err = drv.cuCtxEnablePeerAccess(peer_ctx, 0)[0]
        if err == drv.CUresult.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED:
            return False
        if err != _SUCCESS:
            _raise(err, "cuCtxEnablePeerAccess")
        return True

    def disable_peer_access(self, peer_ctx: Any) -> None:
        check(drv.cuCtxDisablePeerAccess(peer_ctx), "cuCtxDisablePeerAccess")

    def mem_get_info(self) -> tuple[int, int]:
        free, total = check(drv.cuMemGetInfo(), "cuMemGetInfo")
        return int(free), int(total)

    # -- streams and events ----------------------------------------------------------------
    def stream_create(self, non_blocking: bool, priority: int) -> Any:
        flags = drv.CUstream_flags.CU_STREAM_NON_BLOCKING if non_blocking else drv.CUstream_flags.CU_STREAM_DEFAULT
        return check(drv.cuStreamCreateWithPriority(flags, priority), "cuStreamCreateWithPriority")

    def stream_destroy(self, stream: Any) -> None:
        check(drv.cuStreamDestroy(stream), "cuStreamDestroy")

    def stream_from_value(self, value: int) -> Any:
        """A foreign stream's handle from its raw value, checked as far as it can be.

        0, 1 and 2 are the legacy null stream, ``CU_STREAM_LEGACY`` and
        ``CU_STREAM_PER_THREAD``. Any other value is the address of a ``CUstream``
        object, which the driver reads without checking: a wrong one crashes the
        process. So the value must be a 64-bit, 8-byte aligned address of readable
        memory, or ``ArgumentError`` is raised. Readable memory that is not a live
        stream of this process cannot be told apart.
        """
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 64:
            raise _bad_stream(value, "not a 64-bit handle value")
        if value > 2 and (value % 8 or not _readable(value, 16)):
            raise _bad_stream(value, "not the address of a stream object in this process")
        return drv.CUstream(value)

    def handle_value(self, handle: Any) -> int:
        return int(handle)

    def stream_query(self, stream: Any) -> bool:
        err = drv.cuStreamQuery(stream)[0]
        if err == _SUCCESS:
            return True
        if err == _NOT_READY:
            return False
        _raise(err, "cuStreamQuery")
        return False  # unreachable

    def stream_synchronize(self, stream: Any) -> None:
        check(drv.cuStreamSynchronize(stream), "cuStreamSynchronize")

    def stream_wait_event(self, stream: Any, event: Any) -> None:
        check(drv.cuStreamWaitEvent(stream, event, 0), "cuStreamWaitEvent")

    def stream_priority_range(self) -> tuple[int, int]:
        least, greatest = check(drv.cuCtxGetStreamPriorityRange(), "cuCtxGetStreamPriorityRange")
        return int(least), int(greatest)

    def stream_device_ordinal(self, stream: Any) -> int:
        ctx = check(drv.cuStreamGetCtx(stream), "cuStreamGetCtx")
        current = check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
        try:
            check(drv.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
            return int(check(drv.cuCtxGetDevice(), "cuCtxGetDevice"))
        finally:
            check(drv.cuCtxSetCurrent(current), "cuCtxSetCurrent")

    def stream_get_priority(self, stream: Any) -> int:
        return int(check(drv.cuStreamGetPriority(stream), "cuStreamGetPriority"))

    def stream_is_non_blocking(self, stream: Any) -> bool:
        flags = int(check(drv.cuStreamGetFlags(stream), "cuStreamGetFlags"))
        return bool(flags & int(drv.CUstream_flags.CU_STREAM_NON_BLOCKING))

    def event_create(self, timing: bool, blocking_sync: bool) -> Any:
        flags = 0
        if not timing:
            flags |= int(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        if blocking_sync:
            flags |= int(drv.CUevent_flags.CU_EVENT_BLOCKING_SYNC)
        return check(drv.cuEventCreate(flags), "cuEventCreate")

    def ipc_event_create(self) -> Any:
        flags = int(drv.CUevent_flags.CU_EVENT_INTERPROCESS) | int(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        return check(drv.cuEventCreate(flags), "cuEventCreate")

    def ipc_event_handle(self, event: Any) -> bytes:
        handle = check(drv.cuIpcGetEventHandle(event), "cuIpcGetEventHandle")
        return ctypes.string_at(handle.getPtr(), IPC_HANDLE_BYTES)

    def ipc_open_event(self, handle: bytes) -> Any:
        raw = drv.CUipcEventHandle()
        ctypes.memmove(raw.getPtr(), bytes(handle).ljust(IPC_HANDLE_BYTES, b"\0"), IPC_HANDLE_BYTES)
        return check(drv.cuIpcOpenEventHandle(raw), "cuIpcOpenEventHandle")

    def event_destroy(self, event: Any) -> None:
        check(drv.cuEventDestroy(event), "cuEventDestroy")

    def event_record(self, event: Any, stream: Any) -> None:
        err = drv.cuEventRecord(event, stream)[0]
        if err != _SUCCESS:
            _raise(err, "cuEventRecord")

    def event_record_external(self, event: Any, stream: Any) -> None:
        # The driver takes CU_EVENT_RECORD_EXTERNAL only while the stream is capturing
        # (ILLEGAL_STATE otherwise); outside a capture an external record is a plain one.
        status = check(drv.cuStreamIsCapturing(stream), "cuStreamIsCapturing")
        if status != drv.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE:
            check(drv.cuEventRecord(event, stream), "cuEventRecord")
            return
        flags = int(drv.CUevent_record_flags.CU_EVENT_RECORD_EXTERNAL)
        check(drv.cuEventRecordWithFlags(event, stream, flags), "cuEventRecordWithFlags")

    def event_query(self, event: Any) -> bool:
        err = drv.cuEventQuery(event)[0]
        if err == _SUCCESS:
            return True
        if err == _NOT_READY:
            return False
        _raise(err, "cuEventQuery")
        return False  # unreachable

    def event_synchronize(self, event: Any) -> None:
        check(drv.cuEventSynchronize(event), "cuEventSynchronize")

    def event_elapsed_ms(self, start: Any, end: Any) -> float:
        return float(check(drv.cuEventElapsedTime(start, end), "cuEventElapsedTime"))

    def new_doorbell(self) -> SemaphoreDoorbell:
        return SemaphoreDoorbell()

    def launch_doorbell(self, stream: Any, bell: Any) -> None:
        err = self._host_func(int(stream), bell.c_function, bell.c_argument)
        if err != 0:
            _raise(drv.CUresult(err), "cuLaunchHostFunc")

    def shutdown(self) -> None:
        """Nothing to tear down: primary contexts stay retained for the process's life."""
