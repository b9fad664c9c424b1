"""Which :class:`~aiocuda.kernel.Kernel` a driver function belongs to, so that a captured
graph's kernel nodes can be read (arguments decoded with the kernel's signature) and given
new arguments. Kernels register each function they look up; the registry holds them
weakly."""

from __future__ import annotations

import weakref
from typing import Any

from .. import _driver

__all__ = ["kernel_of", "register"]

_kernels: weakref.WeakValueDictionary[tuple[int, int], Any] = weakref.WeakValueDictionary()


def register(backend: _driver.Driver, func: Any, kernel: Any) -> None:
    """``func`` (a function handle of ``backend``) is ``kernel``'s on some device."""
    _kernels[(_driver.backend_generation(), backend.handle_value(func))] = kernel


def kernel_of(backend: _driver.Driver, func: Any) -> Any:
    """The Kernel that registered ``func``, or None (a function another library launched)."""
    return _kernels.get((_driver.backend_generation(), backend.handle_value(func)))
