"""Linking modules: nvJitLink for LTO-IR, otherwise the driver's linker (behind the seam,
which the simulated backend implements by merging its images)."""

from __future__ import annotations

from collections.abc import Sequence

from .._driver import JitOptions, LinkInput
from ..device import Device
from . import nvjitlink

__all__ = ["link"]


def link(inputs: Sequence[LinkInput], device: Device, options: JitOptions | None) -> tuple[bytes, str, str]:
    """Link ``(kind, data, name)`` inputs for ``device``: ``(image, kind, info_log)``."""
    backend = device._driver
    kinds = {kind for kind, _, _ in inputs}
    if "ltoir" in kinds and "sim" not in kinds and backend.name != "sim":
        major, minor = device.compute_capability
        image, log = nvjitlink.link(inputs, f"sm_{major}{minor}", options)
        return image, "cubin", log
    device.make_current()
    image, log = backend.link(inputs, options)
    return image, "sim" if backend.name == "sim" else "cubin", log
