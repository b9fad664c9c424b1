"""The executor's host cost per chunk: microseconds of the loop thread and driver calls.

One event-loop thread enqueues every chunk of every GPU (see :mod:`aiocuda.executor`),
so the host time per chunk bounds how fast chunks can be fed: the reference pipeline
needs a chunk every ~0.6 ms per GPU. This runs ``Executor.map`` over many tiny chunks
(4 KiB float32, pinned inputs, ``output=`` into pinned memory, the ``scale`` stage:
one kernel launch), where the GPU has nothing to do and only the host cost remains, and
reports per chunk:

* ``us_per_chunk``       -- wall time of the whole pipeline divided by the chunks;
* ``seam_calls_per_chunk`` -- driver calls, by name (the figure that transfers between
  machines: a real driver call costs ~1-3 us);
* ``seam_us_per_chunk`` / ``python_us_per_chunk`` -- the wall time inside the driver
  calls, and the rest (aiocuda's and the event loop's Python).

Each figure is measured for the eager path and for graph mode (``map(..., graph=True)``:
each chunk a replay of a captured graph, ``graph_*`` figures), the two interleaved run by
run; medians of the runs, each run's figure kept beside them. Target: ``executor_host_us_per_chunk_graph``
<= 40 us on asyncio, ``executor_host_us_per_chunk_eager`` beside it. The results file is
written only from a full run on a real GPU.

On the simulator the work is run *inline* (``--inline``, the default there): each
operation runs when it is enqueued, on the loop thread, so no simulated worker thread
competes for the GIL and the figures are stable; the simulator's own bookkeeping then
stands in for the driver's cost. ``--threaded`` keeps the simulator's worker threads.
On a GPU the kernel launch bypasses the backend's methods (a prepared launcher) and is
not counted; everything else is.

    PYTHONPATH=src python3 benchmarks/executor_host.py [--quick] [--devices N]
"""

from __future__ import annotations

import collections
import gc
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import anyio
import numpy as np

from aiocuda import _driver
from aiocuda._cli.workload import ScaleStage
from aiocuda.executor import Executor
from aiocuda.host import pinned_empty
from aiocuda.kernel import register_sim_kernel

try:
    from benchmarks._common import Result, SeamMeter, parser
except ImportError:  # run as a script from the benchmarks folder
    from _common import Result, SeamMeter, parser  # type: ignore[no-redef]

CHUNK_FLOATS = 1024
LOOPS = {"asyncio": ("asyncio", {}), "uvloop": ("asyncio", {"use_uvloop": True}), "trio": ("trio", {})}


@contextmanager
def inline_sim() -> Iterator[None]:
    """Run every simulated operation when it is enqueued, on the calling thread.

    Only for this measurement: there are no held streams or latencies, so an operation
    never has to wait for another, and events are complete as soon as they are recorded.
    """
    from aiocuda._driver.sim._objects import SimStream

    threaded = SimStream.submit

    def submit(self: SimStream, fn: Callable[[], object], name: str) -> int:
        self.submitted += 1
        if not self._execute(fn, name):
            raise RuntimeError("inline_sim: an operation was dropped (poisoned device?)")
        self.finished += 1
        return self.submitted

    SimStream.submit = submit  # type: ignore[method-assign]
    try:
        yield
    finally:
        SimStream.submit = threaded  # type: ignore[method-assign]


MODES = {"eager": False, "graph": True}


async def measure(meter: SeamMeter, chunks: int, devices: int, runs: int) -> dict[str, dict[str, Any]]:
    """Per mode, the figures of the module docstring: eager and graph runs interleaved."""
    inputs = pinned_empty((chunks, CHUNK_FLOATS), np.float32)
    inputs[:] = 1.0
    out = pinned_empty(inputs.shape, np.float32)
    stage = ScaleStage(1)
    register_sim_kernel("scale", lambda *args: None)  # the host cost, not numpy's

    async def pipeline(n: int, graph: bool) -> float:
        started = time.perf_counter()
        async with ex.map(stage, inputs[:n], output=lambda i, _: out[i], graph=graph) as results:
            async for _ in results:
                pass
        return time.perf_counter() - started

    walls: dict[str, list[float]] = {mode: [] for mode in MODES}
    seams: dict[str, list[float]] = {mode: [] for mode in MODES}
    calls: dict[str, collections.Counter[str]] = {}
    async with Executor(list(range(devices))) as ex:
        for graph in MODES.values():  # warm-up: pools, launchers, event pools; graphs captured
            await pipeline(min(chunks, 200), graph)
        states = [lanes.state for per_stage in ex._graph_lanes.values() for lanes in per_stage.values()]
        if states != ["ready"] * devices:
            raise SystemExit(f"graph mode did not capture the stage on every device: {states}")
        for _ in range(runs):
            for mode, graph in MODES.items():
                gc.collect()
                meter.reset()
                walls[mode].append(await pipeline(chunks, graph))
                seams[mode].append(meter.seconds)
                calls[mode] = meter.calls.copy()
    figures = {}
    for mode in MODES:
        per_chunk = [w / chunks * 1e6 for w in walls[mode]]
        wall = statistics.median(per_chunk)
        seam = statistics.median(seams[mode]) / chunks * 1e6
        figures[mode] = {
            "us_per_chunk": round(wall, 2),
            "us_per_chunk_runs": [round(x, 2) for x in per_chunk],
            "seam_us_per_chunk": round(seam, 2),
            "python_us_per_chunk": round(wall - seam, 2),
            "seam_calls_per_chunk": round(sum(calls[mode].values()) / chunks, 2),
            "calls": {name: round(count / chunks, 3) for name, count in sorted(calls[mode].items())},
        }
    return figures


def main() -> None:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--chunks", type=int, default=2000)
    p.add_argument("--devices", type=int, default=None, help="devices to spread over (default: up to 2)")
    p.add_argument("--threaded", action="store_true", help="on the simulator: keep its worker threads")
    args = p.parse_args()
    backend = _driver.driver()
    meter = SeamMeter(backend)
    devices = args.devices or min(2, backend.device_count())
    on_sim = backend.name == "sim"
    inline = on_sim and not args.threaded
    runs = 3 if args.quick else 7
    chunks = min(args.chunks, 500) if args.quick else args.chunks
    result = Result("executor_host")
    result.extra["config"] = {"chunks": chunks, "chunk_bytes": 4 * CHUNK_FLOATS, "devices": devices, "inline": inline}
    for loop, (name, options) in LOOPS.items():
        with inline_sim() if inline else _nothing():
            figures = anyio.run(measure, meter, chunks, devices, runs, backend=name, backend_options=options)
        for mode, mode_figures in figures.items():
            prefix = loop if mode == "eager" else f"{loop}_graph"
            calls, runs_us = mode_figures["calls"], mode_figures["us_per_chunk_runs"]
            shown = {key: value for key, value in mode_figures.items() if key not in ("calls", "us_per_chunk_runs")}
            for key, value in shown.items():
                result.metrics[f"{prefix}_{key}"] = value
            result.runs[f"{prefix}_us_per_chunk"] = runs_us
            result.extra[f"{prefix}_calls_per_chunk"] = calls
            print(f"{loop:8} {mode:6} {shown} runs {runs_us}  {calls}")
        if loop == "asyncio":
            result.metric("executor_host_us_per_chunk_eager", figures["eager"]["us_per_chunk_runs"], 2)
            result.target("executor_host_us_per_chunk_graph", figures["graph"]["us_per_chunk_runs"], 40, "<=")
    result.write(args.out)


@contextmanager
def _nothing() -> Iterator[None]:
    yield


if __name__ == "__main__":
    main()
