"""The driver seam: choosing and holding the backend every other layer talks to.

``driver()`` returns the backend in use, choosing it on first call from
``AIOCUDA_BACKEND``:

* ``cuda`` -- the real driver; fails with :class:`~aiocuda.errors.NoDeviceError` if there
  is none.
* ``sim`` -- the simulated driver (``AIOCUDA_SIM_DEVICES`` sets its device count).
* ``auto`` (the default) -- the real driver where it reports a device, otherwise the
  simulated one, with a one-line notice on stderr. Never sim where a GPU exists.

:func:`use_backend` switches explicitly (tests do this). Objects created under one backend
must not be used after switching to another.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable
from typing import Any

from ..errors import BackendError, NoDeviceError
from ._fork import check_not_forked
from ._launch import Dim3, LaunchConfig
from ._protocol import CAPTURE_MODES, CaptureMode, Doorbell, Driver, GraphNodeInfo, Handle, KernelParams, PoolProps

__all__ = [
    "CAPTURE_MODES",
    "CaptureMode",
    "Dim3",
    "Doorbell",
    "Driver",
    "GraphNodeInfo",
    "Handle",
    "KernelParams",
    "LaunchConfig",
    "PoolProps",
    "backend_generation",
    "driver",
    "register_sim_kernel",
    "sim_image",
    "use_backend",
]

BACKENDS = ("cuda", "sim", "auto")

_current: Driver | None = None
_generation = 0


def _make(name: str, options: dict[str, Any]) -> Driver:
    if name == "cuda":
        from .cuda import CudaDriver

        real = CudaDriver()
        real.init()
        return real
    if name == "sim":
        from .sim import SimDriver

        if "devices" not in options and os.environ.get("AIOCUDA_SIM_DEVICES"):
            options = {**options, "devices": int(os.environ["AIOCUDA_SIM_DEVICES"])}
        sim = SimDriver(**options)
        sim.init()
        return sim
    if name == "auto":
        try:
            return _make("cuda", {})
        except NoDeviceError as exc:
            print(f"aiocuda: no usable GPU ({exc.name or exc}); using the simulated backend", file=sys.stderr)
            return _make("sim", options)
    raise BackendError(f"unknown aiocuda backend {name!r}: choose one of {', '.join(BACKENDS)}")


def use_backend(name: str, **options: Any) -> Driver:
    """Select the backend explicitly and return it.

    ``options`` go to the simulated backend (``devices=N``, ...). Switching invalidates
    every device, stream and buffer created before.
    """
    global _current, _generation
    check_not_forked()
    if name not in BACKENDS:
        raise BackendError(f"unknown aiocuda backend {name!r}: choose one of {', '.join(BACKENDS)}")
    new = _make(name, dict(options))
    old, _current = _current, new
    _generation += 1
    if old is not None and old is not new:
        shutdown = getattr(old, "shutdown", None)
        if shutdown is not None:
            shutdown()
    return new


def driver() -> Driver:
    """The backend in use, chosen from ``AIOCUDA_BACKEND`` on first call."""
    if _current is None:
        use_backend(os.environ.get("AIOCUDA_BACKEND", "auto").strip().lower() or "auto")
    check_not_forked()
    assert _current is not None
    return _current


def backend_generation() -> int:
    """Incremented on every switch; caches keyed on it drop stale handles."""
    return _generation


def sim_image(kernel_names: Iterable[str]) -> bytes:
    """A module image for the simulated backend that defines ``kernel_names``."""
    from .sim._modules import SIM_IMAGE_MAGIC

    return SIM_IMAGE_MAGIC + "".join(f"{name}\n" for name in kernel_names).encode()


def register_sim_kernel(name: str, impl: Callable[..., object] | None) -> None:
    """Register (or, with None, remove) the Python implementation of kernel ``name`` for
    the simulated backend; see :func:`aiocuda.register_sim_kernel`."""
    from .sim._modules import register_kernel

    register_kernel(name, impl)
