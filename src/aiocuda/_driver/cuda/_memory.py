"""Real-driver memory operations (see _driver/_protocol.py)."""

from __future__ import annotations

__all__ = ["CudaMemory"]


class CudaMemory:
    """Mixin of CudaDriver: memory operations."""
