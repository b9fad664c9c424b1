"""``python -m aiocuda demo``: a multi-stream, multi-device pipeline over generated data.

Generates ``--chunks`` chunks of ``--chunk-mib`` MiB of float32 in pinned host memory,
sends each through the executor (upload, the ``scale`` kernel, download) on every device
(or ``--devices N``), shows a progress bar, checks every result against numpy, prints a
summary table (busy time of each unit of each device, wall time against the bound)
and writes a Chrome / Perfetto trace (``--trace``, open it in https://ui.perfetto.dev).

Without a GPU it runs on the simulated backend and says so: two simulated devices unless
``AIOCUDA_SIM_DEVICES`` says otherwise, small chunks, and simulated latencies for copies
and kernels so that the overlap is visible in the trace (the times are the simulator's,
not a GPU's).

Arguments are checked before anything runs (exit code 2). Ctrl-C ends it at once (exit
code 130); the trace file is then either complete or absent, as it is written to a
temporary name and renamed. The progress bar and table use ``rich`` when installed (``pip install
aiocuda[demo]``), plain text otherwise.

The ``scale`` workload (kernel, its simulated implementation, the numpy reference) lives
in :mod:`aiocuda._cli.workload`, shared with ``benchmarks/pipeline.py`` and the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time
from typing import Any

import anyio
import numpy as np

from ..backend import current_backend
from ..device import Device, devices
from ..executor import Executor
from ..host import pinned_empty
from ..testing import current_simulator
from ..trace import Trace
from .common import UsageError, exit_at_once_on_interrupt, positive_float, positive_int, writable_file
from .workload import ScaleStage, scale_reference

__all__ = ["add_parser", "run_demo"]

_CHUNKS = 32
_REPS = 800  # the reference's balanced length: kernel time close to one chunk's copy
SIM_LATENCY_S = 0.002
"""Simulated time of each upload, kernel and download in the demo on the simulator."""


# -- output --------------------------------------------------------------------------------------
class _Plain:
    """Progress and tables as plain text."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0
        self.shown = -1

    def __enter__(self) -> _Plain:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def advance(self) -> None:
        self.done += 1
        tenth = 10 * self.done // self.total
        if tenth != self.shown:
            self.shown = tenth
            print(f"  {self.done}/{self.total} chunks", flush=True)

    @staticmethod
    def table(title: str, header: list[str], rows: list[list[str]]) -> None:
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
        print(f"\n{title}")
        print("  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)))
        for row in rows:
            print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))

    @staticmethod
    def say(text: str) -> None:
        print(text)


class _Rich(_Plain):
    """Progress bar and tables with rich."""

    def __init__(self, total: int) -> None:
        super().__init__(total)
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.console = Console()
        self.progress = Progress(
            TextColumn("pipeline"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=self.console
        )
        self.task = self.progress.add_task("chunks", total=total)

    def __enter__(self) -> _Rich:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def advance(self) -> None:
        self.progress.advance(self.task)

    def table(self, title: str, header: list[str], rows: list[list[str]]) -> None:  # type: ignore[override]
        from rich.table import Table

        table = Table(title=title)
        for h in header:
            table.add_column(h, justify="right")
        for row in rows:
            table.add_row(*row)
        self.console.print(table)

    def say(self, text: str) -> None:  # type: ignore[override]
        self.console.print(text, highlight=False)


def _ui(total: int) -> _Plain:
    try:
        return _Rich(total)
    except ImportError:
        return _Plain(total)


# -- the demo ------------------------------------------------------------------------------------
def add_parser(commands: Any) -> None:
    """Add ``demo`` to the ``commands`` of the top-level parser."""
    parser = commands.add_parser(
        "demo",
        help="run a multi-stream, multi-device pipeline and show its overlap",
        description="Upload, scale and download generated chunks on every device through the executor, check "
        "the results against numpy, show the busy time of every copy and compute unit and write a Perfetto "
        "trace. Without a GPU it runs on the simulated backend (2 simulated devices unless AIOCUDA_SIM_DEVICES "
        "says otherwise).",
    )
    parser.add_argument("--chunks", type=positive_int, default=_CHUNKS, help=f"number of chunks (default: {_CHUNKS})")
    parser.add_argument(
        "--chunk-mib",
        type=positive_float,
        default=None,
        help="chunk size in MiB (default: 32 on a GPU, 0.25 simulated)",
    )
    parser.add_argument(
        "--trace",
        type=writable_file,
        default=pathlib.Path("aiocuda-demo-trace.json"),
        help="Chrome / Perfetto trace file to write (default: aiocuda-demo-trace.json)",
    )
    parser.add_argument("--devices", type=positive_int, default=None, help="how many devices to use (default: all)")
    parser.set_defaults(run=run_demo)


async def _run(args: argparse.Namespace, ui: _Plain, chosen: list[Device], n: int, partial: pathlib.Path) -> int:
    chunks = args.chunks
    stage = ScaleStage(_REPS)
    host_in = pinned_empty((chunks, n), np.float32)
    host_in[:] = np.random.default_rng(0).random((chunks, n), dtype=np.float32)
    host_out = pinned_empty((chunks, n), np.float32)
    total_mib = chunks * n * 4 / (1 << 20)
    ui.say(
        f"{chunks} chunks of {n * 4 / (1 << 20):.2f} MiB ({total_mib:.0f} MiB): upload, scale (reps={_REPS}), "
        f"download, on {len(chosen)} device(s), 3 streams each, results in input order"
    )
    async with Executor(chosen, trace=True) as ex:
        with ui:
            started = time.perf_counter()
            async with ex.map(stage, host_in, output=lambda i, _: host_out[i]) as results:
                async for _ in results:
                    ui.advance()
            wall = time.perf_counter() - started
        placed = {per_device.device.ordinal: per_device.completed for per_device in ex.device_streams}
    assert ex.trace is not None
    summary = ex.trace.summary()
    ok = np.allclose(host_out, scale_reference(host_in, _REPS), rtol=1e-3)
    rows = [
        [
            str(e.device),
            e.unit,
            str(e.spans),
            f"{e.busy_ms:.2f}",
            f"{e.mean_ms:.3f}",
            f"{100 * e.busy_ms / summary.wall_ms:.0f}%" if summary.wall_ms else "-",
        ]
        for e in summary.units
    ]
    ui.table("busy time per unit", ["device", "unit", "ops", "busy ms", "mean ms", "of wall"], rows)
    ui.table(
        "pipeline",
        ["wall ms", "GPU wall ms", "bound ms", "overlap ratio", "serial ms", "GiB/s moved"],
        [
            [
                f"{wall * 1e3:.2f}",
                f"{summary.wall_ms:.2f}",
                f"{summary.bound_ms:.2f}",
                f"{summary.overlap_ratio:.3f}",
                f"{summary.serial_ms:.2f}",
                f"{2 * total_mib / 1024 / wall:.2f}",
            ]
        ],
    )
    ui.say(
        f"chunks per device: {placed}; overlap ratio = GPU wall / bound (1.0 is perfect; the bound is the "
        "busiest unit plus one fill and drain)"
    )
    _write_trace(ex.trace, partial, args.trace)
    ui.say(f"trace: {args.trace} (open in https://ui.perfetto.dev or chrome://tracing)")
    ui.say("results match numpy" if ok else "RESULTS DIFFER FROM NUMPY")
    return 0 if ok else 1


def _write_trace(trace: Trace, partial: pathlib.Path, target: pathlib.Path) -> None:
    """Write the trace to ``partial``, then rename it ``target``: the file is complete or
    absent. OSError names ``target``."""
    # Not Trace.write_chrome: its own temporary file, nested in `partial`, was left behind
    # by a Ctrl-C during the write (the handler removes only `partial`).
    try:
        partial.write_text(json.dumps(trace.to_chrome()))
        os.replace(partial, target)
    except OSError as exc:
        exc.filename, exc.filename2 = str(target), None  # not our temporary name
        raise


def _host_memory() -> int:
    """This machine's physical memory in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def run_demo(args: argparse.Namespace) -> int:
    """Entry point of ``aiocuda demo`` (``args``: ``chunks``, ``chunk_mib``, ``trace``,
    ``devices``); UsageError for a bad argument, before anything is printed."""
    backend = current_backend()
    available = backend.device_count
    if args.devices is not None and args.devices > available:
        kind = "simulated backend" if backend.simulated else "CUDA driver"
        raise UsageError(f"--devices {args.devices}: the {kind} has {available} device(s)")
    chunk_mib = args.chunk_mib if args.chunk_mib is not None else (0.25 if backend.simulated else 32.0)
    n = int(chunk_mib * (1 << 20)) // 4
    if n < 1:
        raise UsageError(f"--chunk-mib {chunk_mib}: a chunk needs at least one float32 (4 bytes)")
    pinned = 2 * args.chunks * n * 4  # inputs and results, page-locked
    host = _host_memory()
    if pinned > host // 2:
        raise UsageError(
            f"--chunks {args.chunks} x --chunk-mib {chunk_mib:g}: the demo would pin {pinned / (1 << 30):.1f} GiB "
            f"of host memory (inputs and results), more than half of this machine's {host / (1 << 30):.1f} GiB"
        )
    chosen = [Device(i) for i in range(available if args.devices is None else args.devices)]
    ui = _ui(args.chunks)
    if backend.simulated:
        ui.say(
            f"aiocuda demo on the SIMULATED backend (no GPU in use): {available} simulated devices; each upload, "
            f"kernel and download waits {SIM_LATENCY_S * 1e3:.0f} ms of simulated GPU time, plus the time this "
            "machine's CPU takes to run it (more while the CPU is busy). Times below are the simulator's, not a GPU's."
        )
        sim = current_simulator()
        for op in ("memcpy_htod_async", "launch_kernel", "memcpy_dtoh_async"):
            sim.set_latency(op, SIM_LATENCY_S)
    else:
        names = ", ".join(sorted({d.name for d in devices()}))
        ui.say(f"aiocuda demo on the GPU: {available} x {names}")
    partial = args.trace.with_name(f".{args.trace.name}.{os.getpid()}.partial")
    with exit_at_once_on_interrupt(lambda: partial.unlink(missing_ok=True), "demo"):
        try:
            return anyio.run(_run, args, ui, chosen, n, partial)
        finally:
            partial.unlink(missing_ok=True)
