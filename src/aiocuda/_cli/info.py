"""``aiocuda info``: the backend in use and every device, as text or JSON (``--json``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from .. import __version__
from .._util import format_bytes
from ..backend import Backend, current_backend
from ..device import DeviceProperties, devices

__all__ = ["add_parser"]


def add_parser(commands: Any) -> None:
    """Add ``info`` to the ``commands`` of the top-level parser."""
    parser = commands.add_parser(
        "info",
        help="the backend in use and every device",
        description="Show the backend in use (the CUDA driver, or the simulator without a GPU) and every device "
        "with its main attributes.",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document (for programs)")
    parser.set_defaults(run=run)


def _backend_line(backend: Backend) -> str:
    major, minor = backend.driver_version
    if not backend.simulated:
        label = "CUDA driver"
    elif backend.fallback_reason:
        label = f"simulated backend (no GPU used: {backend.fallback_reason})"
    else:
        label = f"simulated backend (no GPU used: AIOCUDA_BACKEND={backend.requested})"
    count = f"{backend.device_count} device{'s' if backend.device_count != 1 else ''}"
    return f"aiocuda {__version__}, backend: {backend.name} -- {label}, driver API {major}.{minor}, {count}"


def _rows(p: DeviceProperties) -> list[tuple[str, object]]:
    return [
        ("uuid", p.uuid),
        ("pci bus id", p.pci_bus_id),
        ("total memory", format_bytes(p.total_memory)),
        ("compute capability", f"{p.compute_capability[0]}.{p.compute_capability[1]}"),
        ("multiprocessors", p.multiprocessor_count),
        ("max threads per block", p.max_threads_per_block),
        ("max block dims", "x".join(map(str, p.max_block_dim))),
        ("max grid dims", "x".join(map(str, p.max_grid_dim))),
        ("shared memory per block", format_bytes(p.max_shared_memory_per_block)),
        ("constant memory", format_bytes(p.total_constant_memory)),
        ("warp size", p.warp_size),
        ("registers per block", p.max_registers_per_block),
        ("clock", f"{p.clock_rate_khz / 1e3:.0f} MHz"),
        ("memory clock", f"{p.memory_clock_rate_khz / 1e3:.0f} MHz"),
        ("memory bus width", f"{p.global_memory_bus_width} bit"),
        ("L2 cache", format_bytes(p.l2_cache_size)),
        ("memory pools", "yes" if p.memory_pools_supported else "no"),
        ("copy engines", p.async_engine_count),
    ]


def run(args: argparse.Namespace) -> int:
    backend = current_backend()
    found = devices()
    peers = {dev.ordinal: [o.ordinal for o in found if o is not dev and dev.can_access_peer(o)] for dev in found}
    if args.json:
        document = {
            "aiocuda": __version__,
            "backend": {**dataclasses.asdict(backend), "simulated": backend.simulated},
            "devices": [{**dataclasses.asdict(dev.properties()), "peer_access": peers[dev.ordinal]} for dev in found],
        }
        print(json.dumps(document, indent=2))
        return 0
    print(_backend_line(backend))
    for dev in found:
        p = dev.properties()
        print(f"\ndevice {p.ordinal}: {p.name}")
        for key, value in [*_rows(p), ("peer access to", ", ".join(map(str, peers[dev.ordinal])) or "none")]:
            print(f"  {key:<24} {value}")
    return 0
