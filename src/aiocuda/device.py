"""Devices: enumeration, attributes, primary contexts and binding them to threads.

``Device(0)`` always returns the same object for the same ordinal (until the backend is
switched). Ordinals follow ``CUDA_VISIBLE_DEVICES``, which reorders and hides devices;
to name a GPU as nvidia-smi, Kubernetes device plugins, Ray and NCCL do, use
``Device.from_pci_bus_id("0000:17:00.0")`` or ``Device.from_uuid("GPU-8f3c...")``,
which return that same object.

The first use that needs the device's primary context -- the one CuPy, PyTorch and
Numba use too -- retains it, once, for the life of the process, so interoperating
libraries share memory and streams without copies. Until then its flags can still be
chosen (:meth:`Device.set_context_flags`); see :mod:`aiocuda.context`.

CUDA's "current context" is per thread. Every aiocuda call that needs one first calls
:meth:`Device.make_current`, which asks the driver what is current and binds the
device's primary context only when something else is (another device's, a library's
user context), so it stays right whatever other code did on the thread. aiocuda leaves
its context current afterwards; ``with device:`` makes it current for a block and then
restores what was current before, for code that must leave another library's current
device as it found it.
"""

from __future__ import annotations

import operator
import os
import re
import threading
from dataclasses import dataclass
from typing import Any

from . import _driver
from ._util import invalid_value
from .context import Context, ContextFlags, Schedule
from .errors import ArgumentError, ResultCode, error_for_code

__all__ = ["Device", "DeviceProperties", "PeerAttributes", "device_count", "devices"]

_registry: dict[tuple[int, int], Device] = {}
_registry_lock = threading.Lock()

# nvidia-smi's form, "GPU-" and 8-4-4-4-12 hex digits, or the 32 digits without hyphens;
# "GPU-" optional, any case.
_UUID = re.compile(
    r"(?:GPU-)?(?:[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|[0-9a-f]{32})",
    re.IGNORECASE | re.ASCII,
)


@dataclass(frozen=True, slots=True)
class DeviceProperties:
    """A snapshot of a device's main attributes (see :meth:`Device.properties`)."""

    ordinal: int
    name: str
    uuid: str
    pci_bus_id: str
    total_memory: int
    compute_capability: tuple[int, int]
    multiprocessor_count: int
    max_threads_per_block: int
    max_block_dim: tuple[int, int, int]
    max_grid_dim: tuple[int, int, int]
    max_shared_memory_per_block: int
    total_constant_memory: int
    warp_size: int
    max_registers_per_block: int
    clock_rate_khz: int
    memory_clock_rate_khz: int
    global_memory_bus_width: int
    l2_cache_size: int
    memory_pools_supported: bool
    async_engine_count: int


@dataclass(frozen=True, slots=True)
class PeerAttributes:
    """What the link from one device to another supports (``cuDeviceGetP2PAttribute``).

    Attributes:
        access_supported: the device can read and write the other's memory directly
            (what :meth:`Device.can_access_peer` says).
        native_atomics: atomic operations on the other's memory run natively over the
            link (NVLink) rather than not at all.
        cuda_array_access: CUDA arrays (textures) of the other device can be accessed.
        performance_rank: the link's relative performance; lower is faster (0 for the
            best links of the system).
    """

    access_supported: bool
    native_atomics: bool
    cuda_array_access: bool
    performance_rank: int


class Device:
    """One CUDA device. Obtain with ``Device(ordinal)``, :func:`devices`,
    :meth:`from_pci_bus_id` or :meth:`from_uuid`.

    Raises :class:`~aiocuda.errors.ArgumentError` for an ordinal out of range.
    """

    __slots__ = (
        "__weakref__",
        "_captures",
        "_context_handle",
        "_context_value",
        "_driver",
        "_generation",
        "_handle",
        "_name",
        "_primary",
        "ordinal",
    )

    ordinal: int
    _driver: _driver.Driver
    _handle: Any
    _context_handle: Any
    _context_value: int
    _generation: int
    _name: str
    _primary: Context | None
    _captures: int
    """Captures in progress on streams of the primary context (counted by
    ``aiocuda._graph.capture``): :meth:`Context.synchronize` is refused meanwhile."""

    def __new__(cls, ordinal: int = 0) -> Device:
        try:
            if isinstance(ordinal, bool):
                raise TypeError
            ordinal = operator.index(ordinal)  # (numpy's integers too)
        except TypeError:
            hint = ""
            if isinstance(ordinal, str):
                hint = " (for a PCI bus id or UUID: Device.from_pci_bus_id() or Device.from_uuid())"
            raise TypeError(f"a device ordinal must be an int, not {type(ordinal).__name__}{hint}") from None
        backend = _driver.driver()
        key = (_driver.backend_generation(), ordinal)
        found = _registry.get(key)
        if found is not None:
            return found
        with _registry_lock:
            found = _registry.get(key)
            if found is not None:
                return found
            handle = backend.device_get(ordinal)
            self = object.__new__(cls)
            self.ordinal = ordinal
            self._driver = backend
            self._handle = handle
            self._context_handle = None
            self._context_value = -1
            self._primary = None
            self._captures = 0
            self._generation = key[0]
            self._name = backend.device_name(handle)
            _registry[key] = self
            return self

    @classmethod
    def from_pci_bus_id(cls, bus_id: str) -> Device:
        """The device at PCI bus id ``bus_id``: the same object as ``Device(ordinal)``.

        ``bus_id`` is ``domain:bus:device.function`` in hexadecimal, either case, as
        :attr:`pci_bus_id`, nvidia-smi (an eight-digit domain) and Linux's
        ``/sys/bus/pci/devices`` write it: ``"0000:17:00.0"``, ``"00000000:17:00.0"``;
        also ``"0000:17:00"`` (function 0) or ``"17:00.0"`` (domain 0) -- the forms
        ``cuDeviceGetByPCIBusId`` reads.

        Raises :class:`TypeError` for a non-string,
        :class:`~aiocuda.errors.ArgumentError` (``CUDA_ERROR_INVALID_VALUE``) for a
        string in none of those forms, and ArgumentError (``CUDA_ERROR_INVALID_DEVICE``)
        naming the visible devices' ids when none is at that address.
        """
        _require_str(bus_id, "a PCI bus id")
        parsed = _driver.parse_pci_bus_id(bus_id)
        if parsed is None:
            raise invalid_value(
                f"{bus_id!r} is not a PCI bus id: expected {_driver.PCI_BUS_ID_FORMS}. {_visible_devices()}"
            )
        ordinal = _driver.driver().device_ordinal_by_pci_bus_id(str(parsed))
        if ordinal is None:
            raise _no_device(f"PCI bus id {parsed}", call="cuDeviceGetByPCIBusId")
        return cls(ordinal)

    @classmethod
    def from_uuid(cls, uuid: str) -> Device:
        """The device whose :attr:`uuid` is ``uuid``: the same object as
        ``Device(ordinal)``.

        ``uuid`` is written as :attr:`uuid` and ``nvidia-smi -L`` print it,
        ``"GPU-8f3c2a1e-0b4d-4c1e-9a57-a10c0da51a70"``, in either case, with or without
        the ``GPU-`` prefix and the hyphens. It is compared with each visible device's
        UUID (``cuDeviceGetUuid``).

        Raises :class:`TypeError` for a non-string,
        :class:`~aiocuda.errors.ArgumentError` (``CUDA_ERROR_INVALID_VALUE``) for a
        string that is not a GPU UUID, and ArgumentError (``CUDA_ERROR_INVALID_DEVICE``)
        naming the visible devices' UUIDs when none has this one. A MIG instance's
        ``MIG-...`` UUID is refused too: select the instance with
        ``CUDA_VISIBLE_DEVICES=MIG-...`` before the process starts, and it is a device
        of its own (``Device(0)`` when it is the only one).
        """
        _require_str(uuid, "a GPU UUID")
        if uuid[:4].upper() == "MIG-":
            raise invalid_value(
                f"{uuid!r} is a MIG instance's UUID, which aiocuda does not look up: select the instance with "
                "CUDA_VISIBLE_DEVICES=MIG-... before the process starts, and it is a device of its own (Device(0) "
                f"when it is the only one). {_visible_devices()}"
            )
        if _UUID.fullmatch(uuid) is None:
            raise invalid_value(
                f"{uuid!r} is not a GPU UUID: expected 'GPU-' and 32 hexadecimal digits in groups of 8-4-4-4-12, "
                f"as nvidia-smi -L prints it ('GPU-' and the hyphens optional). {_visible_devices()}"
            )
        digits = uuid.replace("-", "").lower()[-32:]  # (after the prefix, if any)
        wanted = f"GPU-{digits[:8]}-{digits[8:12]}-{digits[12:16]}-{digits[16:20]}-{digits[20:]}"
        for device in devices():
            if device.uuid == wanted:
                return device
        raise _no_device(f"UUID {wanted}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (Device, (self.ordinal,))

    def __repr__(self) -> str:
        return f"<Device {self.ordinal}: {self._name}>"

    # -- contexts ---------------------------------------------------------------------------
    @property
    def _context(self) -> Any:
        """The primary context's handle, retained on first use."""
        handle = self._context_handle
        if handle is None:
            with _registry_lock:
                if self._context_handle is None:
                    retained = self._driver.primary_context_retain(self._handle)
                    self._context_value = self._driver.handle_value(retained)
                    self._context_handle = retained
                handle = self._context_handle
        return handle

    def make_current(self) -> None:
        """Make this device's primary context current on the calling thread, unless it
        already is (a cheap query; it replaces what is current otherwise)."""
        handle = self._context
        if self._driver.context_current_value() != self._context_value:
            self._driver.set_current(handle)

    @property
    def context(self) -> Context:
        """The device's primary context (see :mod:`aiocuda.context`)."""
        primary = self._primary
        if primary is None:
            primary = self._primary = Context._create(self, self._context, True)
        return primary

    def __enter__(self) -> Device:
        """``with device:`` makes the primary context current on this thread for the
        block, then restores what was current before (see :class:`~aiocuda.Context`)."""
        self.context.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.context.__exit__(*exc)

    def context_flags(self) -> ContextFlags:
        """The primary context's flags, without making it active."""
        flags, _ = self._driver.primary_context_get_state(self._handle)
        return ContextFlags.from_value(flags)

    @property
    def context_active(self) -> bool:
        """Whether the primary context exists yet (aiocuda or another library used it)."""
        return self._driver.primary_context_get_state(self._handle)[1]

    def set_context_flags(self, *, schedule: Schedule | None = None, lmem_resize_to_max: bool | None = None) -> None:
        """Set flags of the primary context, keeping the others
        (``cuDevicePrimaryCtxSetFlags``): ``schedule`` -- ``"auto"``, ``"spin"``,
        ``"yield"`` or ``"blocking_sync"`` -- and ``lmem_resize_to_max``.

        Call it before the context is first used, by aiocuda or any library sharing it
        (:attr:`context_active` tells): the driver applies flags when it creates the
        context, and a context already running keeps some of what it was created with.
        The primary context is shared: the flags apply to PyTorch's, CuPy's and Numba's
        work on the device too. See :mod:`aiocuda.context` for what the schedule does.
        """
        current_value, _ = self._driver.primary_context_get_state(self._handle)
        current = ContextFlags.from_value(current_value)
        wanted = ContextFlags(
            current.schedule if schedule is None else schedule,
            current.lmem_resize_to_max if lmem_resize_to_max is None else lmem_resize_to_max,
        )
        unnamed = current_value & ~(0x7 | 0x10)  # bits aiocuda does not name are kept
        self._driver.primary_context_set_flags(self._handle, wanted.value | unnamed)

    def create_context(self, *, schedule: Schedule = "auto", lmem_resize_to_max: bool = False) -> Context:
        """A new user context on this device (``cuCtxCreate``) with these flags; what is
        current on the calling thread stays current. Destroy it with
        :meth:`Context.close` (or let it be collected). aiocuda's own streams, memory and
        kernels stay in the primary context; use a user context for code that drives
        CUDA directly inside ``with context:``."""
        flags = ContextFlags(schedule, lmem_resize_to_max)
        handle = self._driver.context_create(self._handle, flags.value)
        return Context._create(self, handle, False)

    async def synchronize(self) -> None:
        """Wait until all work on the device's primary context has finished, whoever
        enqueued it (``cuCtxSynchronize`` on a worker thread; the loop keeps running).
        See :meth:`Context.synchronize`."""
        await self.context.synchronize()

    # -- identity and attributes -----------------------------------------------------------
    @property
    def name(self) -> str:
        return self._name

    @property
    def uuid(self) -> str:
        return self._driver.device_uuid(self._handle)

    @property
    def pci_bus_id(self) -> str:
        return self._driver.device_pci_bus_id(self._handle)

    @property
    def total_memory(self) -> int:
        return self._driver.device_total_mem(self._handle)

    @property
    def compute_capability(self) -> tuple[int, int]:
        return (self.attribute("compute_capability_major"), self.attribute("compute_capability_minor"))

    @property
    def multiprocessor_count(self) -> int:
        return self.attribute("multiprocessor_count")

    def attribute(self, name: str) -> int:
        """A ``CU_DEVICE_ATTRIBUTE_*`` value by its lowercase suffix, e.g.
        ``"max_threads_per_block"``; :class:`ArgumentError` for an unknown name."""
        return self._driver.device_attribute(self._handle, name)

    def attributes(self) -> dict[str, int]:
        """Every attribute the driver reports, by name (unsupported ones omitted)."""
        out: dict[str, int] = {}
        for name in self._driver.device_attribute_names():
            try:
                out[name] = self._driver.device_attribute(self._handle, name)
            except ArgumentError:
                continue
        return out

    def properties(self) -> DeviceProperties:
        """The main attributes in one frozen snapshot."""
        a = self.attribute
        return DeviceProperties(
            ordinal=self.ordinal,
            name=self.name,
            uuid=self.uuid,
            pci_bus_id=self.pci_bus_id,
            total_memory=self.total_memory,
            compute_capability=self.compute_capability,
            multiprocessor_count=a("multiprocessor_count"),
            max_threads_per_block=a("max_threads_per_block"),
            max_block_dim=(a("max_block_dim_x"), a("max_block_dim_y"), a("max_block_dim_z")),
            max_grid_dim=(a("max_grid_dim_x"), a("max_grid_dim_y"), a("max_grid_dim_z")),
            max_shared_memory_per_block=a("max_shared_memory_per_block"),
            total_constant_memory=a("total_constant_memory"),
            warp_size=a("warp_size"),
            max_registers_per_block=a("max_registers_per_block"),
            clock_rate_khz=a("clock_rate"),
            memory_clock_rate_khz=a("memory_clock_rate"),
            global_memory_bus_width=a("global_memory_bus_width"),
            l2_cache_size=a("l2_cache_size"),
            memory_pools_supported=bool(a("memory_pools_supported")),
            async_engine_count=a("async_engine_count"),
        )

    def memory_info(self) -> tuple[int, int]:
        """``(free, total)`` bytes on this device, as the driver sees them now."""
        self.make_current()
        return self._driver.mem_get_info()

    # -- peers -------------------------------------------------------------------------------
    def can_access_peer(self, other: Device | int) -> bool:
        """Whether this device can read and write ``other``'s memory directly."""
        return self._driver.device_can_access_peer(self._handle, _as_device(other)._handle)

    def peer_attributes(self, other: Device | int) -> PeerAttributes:
        """What the link to ``other`` supports: access, native atomics, CUDA array
        access and its performance rank. ArgumentError for the device itself."""
        peer = _as_device(other)

        def get(name: str) -> int:
            return self._driver.device_p2p_attribute(self._handle, peer._handle, name)

        return PeerAttributes(
            access_supported=bool(get("access_supported")),
            native_atomics=bool(get("native_atomic_supported")),
            cuda_array_access=bool(get("access_access_supported")),
            performance_rank=get("performance_rank"),
        )

    def enable_peer_access(self, other: Device | int) -> bool:
        """Let this device access ``other``'s memory (idempotent): True if this call
        enabled it, False if it was on already.

        Raises :class:`ArgumentError` (``CUDA_ERROR_PEER_ACCESS_UNSUPPORTED``) where
        ``cuDeviceCanAccessPeer`` says no.
        """
        other = _as_device(other)
        if not self.can_access_peer(other):
            raise error_for_code(
                ResultCode.PEER_ACCESS_UNSUPPORTED,
                "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED",
                f"device {self.ordinal} cannot access device {other.ordinal}'s memory",
                "cuCtxEnablePeerAccess",
            )
        self.make_current()
        return self._driver.enable_peer_access(other._context)

    def disable_peer_access(self, other: Device | int) -> None:
        """Take back what :meth:`enable_peer_access` gave (``cuCtxDisablePeerAccess``).

        Raises :class:`CudaError` (``CUDA_ERROR_PEER_ACCESS_NOT_ENABLED``) where access
        to ``other`` is not enabled.
        """
        other = _as_device(other)
        self.make_current()
        self._driver.disable_peer_access(other._context)


def device_count() -> int:
    """How many devices the backend in use reports."""
    return _driver.driver().device_count()


def devices() -> list[Device]:
    """Every device, in ordinal order."""
    return [Device(i) for i in range(device_count())]


def _require_str(value: object, what: str) -> None:
    """A TypeError naming ``what`` (``"a GPU UUID"``) unless ``value`` is a str."""
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, not {type(value).__name__}")


def _visible_devices() -> str:
    """Every visible device's ordinal, PCI bus id and UUID, for error messages."""
    listed = "; ".join(f"{d.ordinal}: {d.pci_bus_id}, {d.uuid}" for d in devices())
    return f"The visible devices: {listed}"


def _no_device(wanted: str, *, call: str = "") -> ArgumentError:
    """The error for a well-formed id (``wanted``: ``"UUID GPU-..."``) that no visible
    device has, listing those there are (``call``: the driver call that found none)."""
    chosen = os.environ.get("CUDA_VISIBLE_DEVICES")
    why = f" (CUDA_VISIBLE_DEVICES={chosen} chooses which are visible)" if chosen is not None else ""
    return ArgumentError(
        f"no visible device has {wanted}{why}. {_visible_devices()}",
        code=ResultCode.INVALID_DEVICE,
        name="CUDA_ERROR_INVALID_DEVICE",
        call=call,
    )


def _as_device(device: Device | int | None = None) -> Device:
    """``device`` itself, or the Device of an ordinal (``None`` means device 0)."""
    if isinstance(device, Device):
        return device
    ordinal = 0 if device is None else device  # (not `or`: 0.0, False, "" are not device 0)
    if type(ordinal) is int:
        # A device made before is read from the registry, without Device()'s call and
        # checks (0.3 us on the development machine).
        found = _registry.get((_driver.backend_generation(), ordinal))
        if found is not None:
            _driver.driver()  # refuses a forked child, as Device() does
            return found
    return Device(ordinal)
