"""CUDA graphs: the host cost of a request replayed from a graph, and the await of a replay.

Two measurements, each on device 0, contenders interleaved round by round, each figure
the median of three runs with their spread:

* ``graph_replay_vs_eager_10_kernels`` -- the host time to enqueue one request of ten
  small kernels and two copies (upload from page-locked memory, ten launches of a tiny
  kernel, download to page-locked memory): one ``graph.launch(stream)`` of the captured
  request, against the same work enqueued eagerly the fastest way aiocuda has (prepared
  launchers, ``kernel.bind``, and direct DMA enqueues). Only enqueueing is timed; each
  batch of requests is synchronized, untimed, before the next. Target <= 0.35.
* ``graph_await_latency_ratio`` -- ``await graph.launch(stream)`` of a graph of one tiny
  kernel, against ``graph.launch(stream); stream.synchronize()`` (a blocking wait: the
  floor of latency), on asyncio. Target <= 1.2. uvloop and trio figures are reported
  beside it.

The results file (``benchmarks/results/graphs.json``) is written only from a full run on a
real GPU; on the simulator the run is a smoke test of the code paths.

    PYTHONPATH=src python3 benchmarks/graphs.py [--quick]
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np

from aiocuda import _driver
from aiocuda._memory import copies
from aiocuda.array import empty
from aiocuda.graph import Graph
from aiocuda.host import pinned_empty
from aiocuda.kernel import Kernel, register_sim_kernel
from aiocuda.program import Program
from aiocuda.stream import Stream

try:
    from benchmarks._common import Result, parser
except ImportError:  # run as a script from the benchmarks folder
    from _common import Result, parser  # type: ignore[no-redef]

SOURCE = r"""
extern "C" __global__ void bump(float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += 1.0f;
}
"""
N = 1024
KERNELS = 10
LOOPS = {"asyncio": ("asyncio", {}), "uvloop": ("asyncio", {"use_uvloop": True}), "trio": ("trio", {})}


def _sim_bump(launch: Any, x: np.ndarray, n: np.int32) -> None:
    x[: int(n)] += 1.0


class Request:
    """One request's device work: upload, ten kernels, download."""

    def __init__(self, kernel: Kernel, stream: Stream) -> None:
        self.stream = stream
        self.host_in = pinned_empty(N, np.float32)
        self.host_out = pinned_empty(N, np.float32)
        self.x = empty(N, np.float32, stream=stream)
        self.launch = kernel.bind(1, N, stream=stream)
        self.ptr = self.x.ptr
        self.src, self.dst = int(self.host_in.ctypes.data), int(self.host_out.ctypes.data)

    def eager(self) -> None:
        s, x = self.stream, self.ptr
        copies.enqueue_upload(x, self.src, 4 * N, s)
        for _ in range(KERNELS):
            self.launch(x, N)
        copies.enqueue_download(self.dst, x, 4 * N, s)

    def capture(self) -> Graph:
        with self.stream.capture() as graph:
            self.eager()
        return graph


def enqueue_us(fn: Callable[[], object], stream: Stream, batch: int) -> float:
    """Microseconds per call of ``fn`` (only enqueueing), then the stream drained (untimed)."""
    started = time.perf_counter()
    for _ in range(batch):
        fn()
    took = time.perf_counter() - started
    stream.synchronize()
    return took / batch * 1e6


def replay_vs_eager(kernel: Kernel, runs: int, rounds: int, batch: int, result: Result) -> None:
    with Stream(0) as s:
        request = Request(kernel, s)
        graph = request.capture()
        request.eager()  # warm up both
        graph.launch(s)
        s.synchronize()
        ratios, eager_us, replay_us = [], [], []
        for _ in range(runs):
            samples: dict[str, list[float]] = {"eager": [], "replay": []}
            for _ in range(rounds):
                samples["eager"].append(enqueue_us(request.eager, s, batch))
                samples["replay"].append(enqueue_us(lambda: graph.launch(s), s, batch))
            eager, replay = statistics.median(samples["eager"]), statistics.median(samples["replay"])
            eager_us.append(eager)
            replay_us.append(replay)
            ratios.append(replay / eager)
        graph.close()
    result.target("graph_replay_vs_eager_10_kernels", ratios, 0.35, "<=")
    result.baselines["eager_request_enqueue_us"] = round(statistics.median(eager_us), 3)
    result.baselines["replay_request_enqueue_us"] = round(statistics.median(replay_us), 3)


async def await_latency(kernel: Kernel, rounds: int, iterations: int) -> dict[str, float]:
    """Median microseconds of an awaited replay and of a replay waited for by a blocking
    synchronize, interleaved round by round."""
    with Stream(0) as s:
        x = empty(N, np.float32, stream=s)
        launch = kernel.bind(1, N, stream=s)
        launch(x, N)
        await s
        async with s.capture() as graph:
            launch(x, N)
        for _ in range(20):  # warm up: the engine learns the stream, pools fill
            await graph.launch(s)
            graph.launch(s)
            s.synchronize()
        samples: dict[str, list[float]] = {"await": [], "synchronize": []}
        for _ in range(rounds):
            for _ in range(iterations):
                started = time.perf_counter()
                await graph.launch(s)
                samples["await"].append(time.perf_counter() - started)
            for _ in range(iterations):
                started = time.perf_counter()
                graph.launch(s)
                s.synchronize()
                samples["synchronize"].append(time.perf_counter() - started)
        graph.close()
        x.buffer.free()
    return {name: statistics.median(values) * 1e6 for name, values in samples.items()}


def main() -> None:
    p = parser(__doc__.split("\n\n")[0])
    args = p.parse_args()
    backend = _driver.driver()
    on_sim = backend.name == "sim"
    register_sim_kernel("bump", _sim_bump)
    kernel = Program(SOURCE, name="graphs_bench.cu").compile().kernel("bump")
    kernel.function(0)  # loaded before any capture
    runs = 3
    rounds, batch, iterations = (3, 20, 50) if args.quick or on_sim else (15, 50, 200)
    result = Result("graphs")
    result.extra["config"] = {"n": N, "kernels": KERNELS, "rounds": rounds, "batch": batch, "iterations": iterations}
    gc.collect()
    gc.disable()  # no collection pauses inside timed loops
    try:
        replay_vs_eager(kernel, runs, rounds, batch, result)
        for loop, (name, options) in LOOPS.items():
            ratios, awaits, syncs = [], [], []
            for _ in range(runs):
                figures = anyio.run(await_latency, kernel, rounds, iterations, backend=name, backend_options=options)
                ratios.append(figures["await"] / figures["synchronize"])
                awaits.append(figures["await"])
                syncs.append(figures["synchronize"])
            if loop == "asyncio":
                result.target("graph_await_latency_ratio", ratios, 1.2, "<=")
            else:
                result.metric(f"graph_await_latency_ratio_{loop}", ratios)
            result.baselines[f"graph_await_{loop}_us"] = round(statistics.median(awaits), 3)
            result.baselines[f"graph_synchronize_{loop}_us"] = round(statistics.median(syncs), 3)
    finally:
        gc.enable()
    if on_sim or args.quick:
        result.print_summary(sys.stdout)
        print("(a simulated or --quick run: no results file written)")
        return
    result.write(args.out)


if __name__ == "__main__":
    main()
