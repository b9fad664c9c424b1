"""Which driver runs your work: the real CUDA driver, or the simulator on the CPU.

The backend is chosen on first use from ``AIOCUDA_BACKEND``:

* ``auto`` (the default): the CUDA driver where it reports a GPU; otherwise the
  simulator, with a :class:`~aiocuda.errors.SimulatedBackendWarning` (and a record on the
  ``aiocuda`` logger where logging is configured).
* ``cuda``: the CUDA driver or nothing. Without a usable GPU the first use raises
  :class:`~aiocuda.errors.NoDeviceError`. **The setting for a service that must have a
  GPU.**
* ``sim``: the simulator (``AIOCUDA_SIM_DEVICES=N`` devices, 2 by default).

::

    import aiocuda

    backend = aiocuda.current_backend()
    if backend.simulated:
        print("no GPU:", backend.fallback_reason)

:func:`use_backend` chooses in code instead. For tests on the simulator with its
controls (pausing a stream, latencies, faults), see :mod:`aiocuda.testing`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from . import _driver

__all__ = ["Backend", "BackendName", "current_backend", "use_backend"]

BackendName = Literal["cuda", "sim", "auto"]


@dataclass(frozen=True, slots=True)
class Backend:
    """A description of the backend in use (see :func:`current_backend`).

    Attributes:
        name: ``"cuda"`` (the CUDA driver) or ``"sim"`` (the simulator).
        requested: what was asked for: ``"cuda"``, ``"sim"`` or ``"auto"``.
        fallback_reason: where ``auto`` found no usable GPU, the driver's reason
            (``"CUDA_ERROR_NO_DEVICE"``, ...); None otherwise.
        driver_version: the CUDA driver API version, ``(major, minor)``.
        device_count: how many devices it offers.
    """

    name: Literal["cuda", "sim"]
    requested: BackendName
    fallback_reason: str | None
    driver_version: tuple[int, int]
    device_count: int

    @property
    def simulated(self) -> bool:
        """True on the simulator: no GPU does the work."""
        return self.name == "sim"


def current_backend() -> Backend:
    """The backend in use (choosing it from ``AIOCUDA_BACKEND`` if nothing has yet)."""
    backend = _driver.driver()
    requested, reason = _driver.selection()
    version = backend.driver_version()
    return Backend(
        name="sim" if backend.name == "sim" else "cuda",
        requested=requested,  # type: ignore[arg-type]
        fallback_reason=reason,
        driver_version=(version // 1000, version % 1000 // 10),
        device_count=backend.device_count(),
    )


def use_backend(name: BackendName, *, devices: int | None = None) -> Backend:
    """Choose the backend now, as ``AIOCUDA_BACKEND=name`` would, and describe it.

    ``devices`` sets the simulator's device count (ignored by the CUDA driver).
    Switching drops every device, stream, buffer and module made before: make the
    choice at start-up, before creating any. Raises
    :class:`~aiocuda.errors.NoDeviceError` for ``"cuda"`` without a usable GPU, and
    :class:`~aiocuda.errors.BackendError` for an unknown name.
    """
    options = {} if devices is None else {"devices": devices}
    _driver.use_backend(name, **options)
    return current_backend()
