"""``python -m aiocuda demo``: a multi-stream, multi-device pipeline over generated data.

Generates ``--chunks`` chunks of ``--chunk-mib`` MiB of float32 in pinned host memory,
sends each through the executor (upload, the ``scale`` kernel, download) on every device
(or ``--devices N``), shows a progress bar, checks every result against numpy, prints a
summary table (busy time of each unit of each device, wall time against the bound)
and writes a Chrome / Perfetto trace (``--trace``, open it in https://ui.perfetto.dev).

Without a GPU it runs on the simulated backend and says so: two simulated devices unless
``AIOCUDA_SIM_DEVICES`` says otherwise, small chunks, and simulated latencies for copies
and kernels so that the overlap is visible in the trace (the times are the simulator's,
not a GPU's). The progress bar and table use ``rich`` when installed (``pip install
aiocuda[demo]``), plain text otherwise.

The ``scale`` workload (kernel, its simulated implementation, the numpy reference) lives
in :mod:`aiocuda._cli.workload`, shared with ``benchmarks/pipeline.py`` and the tests.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import anyio
import numpy as np

from .. import _driver
from ..device import Device, devices
from ..executor import Executor
from ..host import pinned_empty
from .workload import ScaleStage, scale_reference

__all__ = ["run_demo"]

SIM_DEFAULT_DEVICES = 2
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
def _choose_backend() -> _driver.Driver:
    if os.environ.get("AIOCUDA_BACKEND", "auto") != "cuda":
        os.environ.setdefault("AIOCUDA_SIM_DEVICES", str(SIM_DEFAULT_DEVICES))  # read only by the simulator
    return _driver.driver()


async def _run(args: argparse.Namespace, ui: _Plain, on_sim: bool) -> int:
    count = len(devices()) if args.devices is None else args.devices
    chosen = [Device(i) for i in range(count)]
    chunk_mib = args.chunk_mib if args.chunk_mib is not None else (0.25 if on_sim else 32.0)
    chunks = args.chunks if args.chunks is not None else 32
    reps = 800  # the reference's balanced length: kernel time close to one chunk's copy
    n = int(chunk_mib * (1 << 20)) // 4
    if n < 1 or chunks < 1:
        raise SystemExit("demo: --chunks and --chunk-mib must be positive")
    stage = ScaleStage(reps)
    host_in = pinned_empty((chunks, n), np.float32)
    host_in[:] = np.random.default_rng(0).random((chunks, n), dtype=np.float32)
    host_out = pinned_empty((chunks, n), np.float32)
    total_mib = chunks * n * 4 / (1 << 20)
    ui.say(
        f"{chunks} chunks of {n * 4 / (1 << 20):.2f} MiB ({total_mib:.0f} MiB): upload, scale (reps={reps}), "
        f"download, on {count} device(s), 3 streams each, results in input order"
    )
    async with Executor(chosen, trace=True) as ex:
        with ui:
            started = time.perf_counter()
            async with ex.map(stage, host_in, output=lambda i, _: host_out[i]) as results:
                async for _ in results:
                    ui.advance()
            wall = time.perf_counter() - started
        placed = {lane.device.ordinal: lane.completed for lane in ex.lanes}
    assert ex.trace is not None
    summary = ex.trace.summary()
    ok = np.allclose(host_out, scale_reference(host_in, reps), rtol=1e-3)
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
    path = ex.trace.write_chrome(args.trace)
    ui.say(f"trace: {path} (open in https://ui.perfetto.dev or chrome://tracing)")
    ui.say("results match numpy" if ok else "RESULTS DIFFER FROM NUMPY")
    return 0 if ok else 1


def run_demo(args: argparse.Namespace) -> int:
    """Entry point of ``python -m aiocuda demo`` (``args``: ``chunks``, ``chunk_mib``,
    ``trace``, ``devices``)."""
    backend = _choose_backend()
    on_sim = backend.name == "sim"
    available = backend.device_count()
    if args.devices is not None and not 1 <= args.devices <= available:
        print(f"demo: --devices must be between 1 and {available}", file=sys.stderr)
        return 2
    chunks = args.chunks if args.chunks is not None else 32
    ui = _ui(chunks)
    if on_sim:
        ui.say(
            f"aiocuda demo on the SIMULATED backend (no GPU in use): {available} simulated devices, "
            f"each upload, kernel and download takes {SIM_LATENCY_S * 1e3:.0f} ms of simulated time. "
            "Times below are the simulator's, not a GPU's."
        )
        for op in ("memcpy_htod_async", "launch_kernel", "memcpy_dtoh_async"):
            backend.set_latency(op, SIM_LATENCY_S)  # type: ignore[attr-defined]
    else:
        names = ", ".join(sorted({d.name for d in devices()}))
        ui.say(f"aiocuda demo on the GPU: {available} x {names}")
    return anyio.run(_run, args, ui, on_sim)
