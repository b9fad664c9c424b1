"""The driver seam: choosing and holding the backend every other layer talks to.

``driver()`` returns the backend in use, choosing it on first call from
``AIOCUDA_BACKEND``:

* ``cuda`` -- the real driver; fails with :class:`~aiocuda.errors.NoDeviceError` if there
  is none.
* ``sim`` -- the simulated driver (``AIOCUDA_SIM_DEVICES`` sets its device count, 2 by
  default).
* ``auto`` (the default) -- the real driver where it reports a device, otherwise the
  simulated one, with a :class:`~aiocuda.errors.SimulatedBackendWarning` (and a record on
  the ``aiocuda`` logger where logging is configured). Never sim where a GPU exists.

:func:`use_backend` switches explicitly (tests do this; :mod:`aiocuda.backend` is the
public face). Objects created under one backend must not be used after switching to
another.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .._util import outside_aiocuda
from ..errors import BackendError, NoDeviceError, SimulatedBackendWarning
from ._fork import check_not_forked, fork_error, mark_used, was_forked
from ._jit import Fallback, JitOptions, LinkInput
from ._launch import Dim3, LaunchConfig
from ._pci import PCI_BUS_ID_FORMS, PciBusId, parse_pci_bus_id
from ._protocol import (
    CAPTURE_MODES,
    CaptureMode,
    CaptureStatus,
    Doorbell,
    Driver,
    GraphNodeInfo,
    Handle,
    KernelParams,
    PitchedCopy,
    PitchedSide,
    PoolProps,
)

__all__ = [
    "BACKENDS",
    "CAPTURE_MODES",
    "PCI_BUS_ID_FORMS",
    "SIM_DEFAULT_DEVICES",
    "CaptureMode",
    "CaptureStatus",
    "Dim3",
    "Doorbell",
    "Driver",
    "Fallback",
    "GraphNodeInfo",
    "Handle",
    "JitOptions",
    "KernelParams",
    "LaunchConfig",
    "LinkInput",
    "PciBusId",
    "PitchedCopy",
    "PitchedSide",
    "PoolProps",
    "backend_generation",
    "current",
    "driver",
    "forget_backend",
    "fork_error",
    "parse_pci_bus_id",
    "register_sim_kernel",
    "selection",
    "sim_image",
    "use_backend",
    "was_forked",
]

BACKENDS = ("cuda", "sim", "auto")
SIM_DEFAULT_DEVICES = 2
"""Simulated devices when neither ``devices=`` nor ``AIOCUDA_SIM_DEVICES`` says: two, so
that multi-device code paths run on a laptop too."""

_log = logging.getLogger("aiocuda")

_current: Driver | None = None
_requested = "auto"
_fallback_reason: str | None = None
_generation = 0


def _sim_devices_from_env() -> int:
    raw = os.environ.get("AIOCUDA_SIM_DEVICES", "").strip()
    if not raw:
        return SIM_DEFAULT_DEVICES
    try:
        count = int(raw)
    except ValueError:
        count = 0
    if count < 1:
        raise BackendError(
            f"AIOCUDA_SIM_DEVICES must be a positive whole number (the simulated backend's device count), got {raw!r}"
        )
    return count


def _fall_back(exc: NoDeviceError) -> str:
    """Announce ``auto``'s fall-back to the simulator; raise ``exc`` if the warning is an error."""
    reason = exc.name or str(exc)
    message = f"no usable GPU ({reason}); aiocuda runs on the simulated backend (AIOCUDA_BACKEND=cuda forbids this)"
    try:
        warnings.warn(message, SimulatedBackendWarning, stacklevel=outside_aiocuda())
    except SimulatedBackendWarning:
        raise exc from None
    if _log.hasHandlers():  # with no logging configured, the warning alone is shown
        _log.warning("%s", message, extra={"aiocuda_backend": "sim", "aiocuda_reason": reason})
    return reason


def _make(name: str, options: dict[str, Any]) -> tuple[Driver, str | None]:
    """The backend ``name`` asks for, initialised, and why ``auto`` fell back (or None)."""
    if name == "cuda":
        from .cuda import CudaDriver

        real = CudaDriver()
        real.init()
        return real, None
    if name == "sim":
        from .sim import SimDriver

        if "devices" not in options:
            options = {**options, "devices": _sim_devices_from_env()}
        sim = SimDriver(**options)
        sim.init()
        return sim, None
    if name == "auto":
        try:
            return _make("cuda", {})
        except NoDeviceError as exc:
            reason = _fall_back(exc)
            return _make("sim", options)[0], reason
    raise BackendError(f"unknown aiocuda backend {name!r}: choose one of {', '.join(BACKENDS)}")


def use_backend(name: str, **options: Any) -> Driver:
    """Select the backend explicitly and return it.

    ``options`` go to the simulated backend (``devices=N``, ...). Switching invalidates
    every device, stream and buffer created before.
    """
    global _current, _generation, _requested, _fallback_reason
    check_not_forked()
    if name not in BACKENDS:
        raise BackendError(f"unknown aiocuda backend {name!r}: choose one of {', '.join(BACKENDS)}")
    mark_used()
    new, reason = _make(name, dict(options))
    old, _current = _current, new
    _requested, _fallback_reason = name, reason
    _generation += 1
    _log.info("backend %s in use (asked for %s)", new.name, name)
    if old is not None and old is not new:
        _shut_down(old)
    return new


def _shut_down(old: Driver) -> None:
    shutdown = getattr(old, "shutdown", None)
    if shutdown is not None:
        shutdown()


def forget_backend(backend: Driver) -> None:
    """Shut ``backend`` down; if it is the one in use, the next :func:`driver` chooses
    again from ``AIOCUDA_BACKEND``."""
    global _current, _generation
    if _current is backend:
        _current = None
        _generation += 1
    _shut_down(backend)


def driver() -> Driver:
    """The backend in use, chosen from ``AIOCUDA_BACKEND`` on first call."""
    if _current is None:
        use_backend(os.environ.get("AIOCUDA_BACKEND", "auto").strip().lower() or "auto")
    check_not_forked()
    assert _current is not None
    return _current


def current() -> Driver | None:
    """The backend in use, or None if none is chosen yet (choosing none: for cleanups)."""
    return _current


def selection() -> tuple[str, str | None]:
    """What was asked for (``cuda``, ``sim``, ``auto``) and, where ``auto`` fell back to
    the simulator, why (the real driver's error name)."""
    driver()
    return _requested, _fallback_reason


def backend_generation() -> int:
    """Incremented on every switch; caches keyed on it drop stale handles."""
    return _generation


def sim_image(kernel_names: Iterable[str], variables: Mapping[str, tuple[int, str]] | None = None) -> bytes:
    """A module image for the simulated backend that defines ``kernel_names`` and
    ``variables`` (name -> (bytes, numpy type string or ``"-"``))."""
    from .sim._modules import build_image

    return build_image(kernel_names, variables)


def register_sim_kernel(name: str, impl: Callable[..., object] | None) -> None:
    """Register (or, with None, remove) the Python implementation of kernel ``name`` for
    the simulated backend; see :func:`aiocuda.register_sim_kernel`."""
    from .sim._modules import register_kernel

    register_kernel(name, impl)
