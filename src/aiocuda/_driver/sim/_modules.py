"""Simulated modules operations (see _driver/_protocol.py)."""

from __future__ import annotations

__all__ = ["SimModules"]


class SimModules:
    """Mixin of SimDriver: modules operations."""
