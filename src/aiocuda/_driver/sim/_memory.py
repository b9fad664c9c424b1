"""Simulated memory operations (see _driver/_protocol.py)."""

from __future__ import annotations

__all__ = ["SimMemory"]


class SimMemory:
    """Mixin of SimDriver: memory operations."""
