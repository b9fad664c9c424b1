"""Real-driver modules operations (see _driver/_protocol.py)."""

from __future__ import annotations

__all__ = ["CudaModules"]


class CudaModules:
    """Mixin of CudaDriver: modules operations."""
