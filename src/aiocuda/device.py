"""Devices: enumeration, attributes, primary contexts and binding them to threads.

``Device(0)`` always returns the same object for the same ordinal (until the backend is
switched). Creating it retains the device's primary context -- the one CuPy, PyTorch and
Numba use too -- once, for the life of the process, so interoperating libraries share
memory and streams without copies.

CUDA's "current context" is per thread. Every aiocuda call that needs one first calls
:meth:`Device.make_current`, which remembers per thread which device it bound last and
skips the driver call when nothing changed. Pitfall: if other code on the same thread
switches the current context behind aiocuda's back (``torch.cuda.set_device(1)``), call
``make_current()`` again before using aiocuda on that thread.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from . import _driver
from .errors import ArgumentError, ResultCode, error_for_code

__all__ = ["Device", "DeviceProperties", "device_count", "devices"]

_registry: dict[tuple[int, int], Device] = {}
_registry_lock = threading.Lock()
_bound = threading.local()


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


class Device:
    """One CUDA device. Obtain with ``Device(ordinal)`` or :func:`devices`.

    Raises :class:`~aiocuda.errors.ArgumentError` for an ordinal out of range.
    """

    __slots__ = ("__weakref__", "_context", "_driver", "_generation", "_handle", "_name", "ordinal")

    ordinal: int
    _driver: _driver.Driver
    _handle: Any
    _context: Any
    _generation: int
    _name: str

    def __new__(cls, ordinal: int = 0) -> Device:
        if isinstance(ordinal, bool) or not isinstance(ordinal, int):
            raise TypeError(f"a device ordinal must be an int, not {type(ordinal).__name__}")
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
            self._context = backend.primary_context_retain(handle)
            self._generation = key[0]
            self._name = backend.device_name(handle)
            _registry[key] = self
            return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (Device, (self.ordinal,))

    def __repr__(self) -> str:
        return f"<Device {self.ordinal}: {self._name}>"

    # -- context binding -------------------------------------------------------------------
    def make_current(self) -> None:
        """Bind this device's primary context to the calling thread (cached per thread)."""
        if getattr(_bound, "device", None) is not self:
            self._driver.set_current(self._context)
            _bound.device = self

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
    def can_access_peer(self, other: Device) -> bool:
        """Whether this device can read and write ``other``'s memory directly."""
        return self._driver.device_can_access_peer(self._handle, other._handle)

    def enable_peer_access(self, other: Device) -> None:
        """Let this device access ``other``'s memory (idempotent).

        Raises :class:`ArgumentError` (``CUDA_ERROR_PEER_ACCESS_UNSUPPORTED``) where
        ``cuDeviceCanAccessPeer`` says no.
        """
        if not self.can_access_peer(other):
            raise error_for_code(
                ResultCode.PEER_ACCESS_UNSUPPORTED,
                "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED",
                f"device {self.ordinal} cannot access device {other.ordinal}'s memory",
                "cuCtxEnablePeerAccess",
            )
        self.make_current()
        self._driver.enable_peer_access(other._context)


def device_count() -> int:
    """How many devices the backend in use reports."""
    return _driver.driver().device_count()


def devices() -> list[Device]:
    """Every device, in ordinal order."""
    return [Device(i) for i in range(device_count())]


def _as_device(device: Device | int | None = None) -> Device:
    """``device`` itself, or the Device of an ordinal (``None`` means device 0)."""
    return device if isinstance(device, Device) else Device(device or 0)
