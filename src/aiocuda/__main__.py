"""The command line: ``python -m aiocuda info | demo | bench``.

* ``info``  -- the backend in use and every device with its main attributes.
* ``demo``  -- the README's main job: a multi-stream, multi-device pipeline (see
  :mod:`aiocuda._cli.demo`).
* ``bench`` -- run the benchmark programs in ``benchmarks/`` (from a source checkout).
"""

from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys

from . import _driver
from ._util import format_bytes
from .device import devices

__all__ = ["main"]


def info(_: argparse.Namespace) -> int:
    backend = _driver.driver()
    version = backend.driver_version()
    label = "simulated backend (no GPU used)" if backend.name == "sim" else "CUDA driver"
    print(f"aiocuda backend: {backend.name} -- {label}, driver API {version // 1000}.{version % 1000 // 10}")
    for dev in devices():
        p = dev.properties()
        print(f"\ndevice {p.ordinal}: {p.name}")
        rows = [
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
        for key, value in rows:
            print(f"  {key:<24} {value}")
        peers = [other.ordinal for other in devices() if other is not dev and dev.can_access_peer(other)]
        print(f"  {'peer access to':<24} {', '.join(map(str, peers)) or 'none'}")
    return 0


def bench(args: argparse.Namespace) -> int:
    root = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
    if not root.is_dir():
        print("aiocuda bench runs from a source checkout (benchmarks/ not found)", file=sys.stderr)
        return 2
    names = args.names or sorted(p.stem for p in root.glob("[a-z]*.py"))
    status = 0
    for name in names:
        script = root / f"{name}.py"
        if not script.is_file():
            print(f"no benchmark named {name!r} in {root}", file=sys.stderr)
            return 2
        extra = ["--quick"] if args.quick else []
        status |= subprocess.call([sys.executable, str(script), *extra])
    return status


def demo(args: argparse.Namespace) -> int:
    from ._cli.demo import run_demo

    return run_demo(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aiocuda", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="the backend in use and every device").set_defaults(run=info)
    p_demo = sub.add_parser(
        "demo",
        help="run a multi-stream, multi-device pipeline and show its overlap",
        description="Upload, scale and download generated chunks on every device through the executor; "
        "without a GPU, on the simulated backend (2 simulated devices unless AIOCUDA_SIM_DEVICES is set).",
    )
    p_demo.add_argument("--chunks", type=int, default=None, help="number of chunks (default: 32)")
    p_demo.add_argument(
        "--chunk-mib", type=float, default=None, help="chunk size in MiB (default: 32 on a GPU, 0.25 simulated)"
    )
    p_demo.add_argument(
        "--trace",
        type=pathlib.Path,
        default=pathlib.Path("aiocuda-demo-trace.json"),
        help="Chrome / Perfetto trace file to write (default: aiocuda-demo-trace.json)",
    )
    p_demo.add_argument("--devices", type=int, default=None, help="how many devices to use (default: all)")
    p_demo.set_defaults(run=demo)
    p_bench = sub.add_parser("bench", help="run the benchmarks (source checkout only)")
    p_bench.add_argument("names", nargs="*", help="benchmark names (default: all)")
    p_bench.add_argument("--quick", action="store_true", help="few repetitions")
    p_bench.set_defaults(run=bench)
    args = parser.parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
