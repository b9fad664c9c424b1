"""The reference pipeline through the executor, against one stream and a hand-written loop.

The pipeline of ``../shared/reference/anchor_probe.py``: 16 chunks of 32 MiB float32 from
pinned memory, host-to-device, the ``scale`` kernel at three lengths (``reps`` 200 / 800
/ 3000: shorter than, about equal to and longer than a chunk's copy), device-to-host.
Measured in the same run, on device 0:

* ``stage``       -- each step alone (timing events): upload, kernel, download of a chunk;
                     and (``*_duplex``) uploads and downloads running at the same time,
                     as they do in any overlapped pipeline: each is slower than alone.
* ``serial``      -- the raw driver, one stream: every step of every chunk in turn.
* ``handwritten`` -- the raw driver, three streams, chunk *i* wholly on stream *i % 3*
                     with its own buffer (the reference's loop, blocking synchronize).
* ``executor``    -- ``Executor.map`` with the ``scale`` stage, results into pinned memory.
* ``executor_graph`` -- the same in graph mode (``map(..., graph=True)``): each chunk a
                     replay of the stage's graph, captured in the warm-up run.

Wall times are host ``perf_counter`` from the first enqueue to the last result, medians
over rounds that run serial, hand-written and executor back to back (the copy engines'
speed drifts over seconds on a shared machine, so contenders are interleaved in time).
The whole measurement, stage times included, is made three times; each ratio is taken
within a run, and the median of the three is reported, the runs beside it. The trace of
one more executor run is reported against the bound from the stage times measured alone.
The *bound* is what perfect overlap would take: the busiest unit's 16 chunks plus one
fill and drain (the other two steps of one chunk), from the stage times measured alone;
the *duplex bound* takes the copies' times while both directions run. The hand-written
loop's own ratio to the bound is reported beside the executor's.

Then the same on ``N`` GPUs (``--devices N``, default: two where there are two): ``N x 16``
chunks, 16 per GPU, through one executor (and the hand-written loop over every GPU),
giving throughput scaling against one GPU at each length (the target at the balanced
one, reps 800). Beside it, ``copy_ceiling_scaling_Ngpu``: the
same chunks' uploads and downloads alone, raw, on every GPU at once against one GPU --
how far the host's links and memory let copies scale, whatever runs them.

Targets: ``overlap_ratio_bound_reps*`` = executor / bound <= 1.10 (one per length);
``speedup_vs_serial`` (balanced length, reps 800) >= 1.8; ``executor_vs_handwritten`` =
executor / hand-written <= 1.05 (the worst of the three lengths), and
``executor_vs_handwritten_graph`` <= 1.0 for graph mode; ``two_gpu_scaling`` >=
1.9 (or ``scaling_N`` >= 0.95 N with ``--devices N > 2``, written to
``pipeline-xN.json``).

    PYTHONPATH=src python3 benchmarks/pipeline.py [--quick] [--devices N]

On the simulator (no GPU) it runs with 1 MiB chunks and simulated latencies: a smoke run
of the code paths, whose figures say nothing about a GPU (no results file is written
then, nor by a ``--quick`` run).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np

from aiocuda import _driver
from aiocuda._cli.workload import ScaleStage, scale_reference
from aiocuda.device import Device
from aiocuda.event import Event
from aiocuda.executor import Executor
from aiocuda.host import pinned_empty
from aiocuda.memory import MemoryPool
from aiocuda.stream import Stream

try:
    from benchmarks._common import Result, parser, ratios, repeat_async, wall_medians
except ImportError:  # run as a script from the benchmarks folder
    from _common import Result, parser, ratios, repeat_async, wall_medians  # type: ignore[no-redef]

CHUNKS = 16
REPS = (200, 800, 3000)
BALANCED = 800
BLOCK = 256
SIM_LATENCY_S = {"memcpy_htod_async": 0.002, "launch_kernel": 0.002, "memcpy_dtoh_async": 0.002}


class Rig:
    """Pinned host data, per-device kernels, device buffers and streams for the raw loops."""

    def __init__(self, devices: list[Device], chunk_bytes: int) -> None:
        self.devices = devices
        self.chunk_bytes = chunk_bytes
        self.n = chunk_bytes // 4
        total = CHUNKS * len(devices)
        self.host_in = pinned_empty((total, self.n), np.float32)
        self.host_in[:] = np.random.default_rng(0).random((total, self.n), dtype=np.float32)
        self.host_out = pinned_empty((total, self.n), np.float32)
        self.stages = {reps: ScaleStage(reps) for reps in REPS}
        self.streams: dict[int, list[Stream]] = {}
        self.buffers: dict[int, list[Any]] = {}
        for dev in devices:
            dev.make_current()
            streams = [Stream(dev) for _ in range(3)]
            self.streams[dev.ordinal] = streams
            pool = MemoryPool.for_device(dev)
            self.buffers[dev.ordinal] = [pool.allocate(chunk_bytes, s) for s in streams]
            for s in streams:
                s.synchronize()

    def launcher(self, reps: int, stream: Stream) -> Callable[..., None]:
        grid = (self.n + BLOCK - 1) // BLOCK
        return self.stages[reps].kernel.bind(grid, BLOCK, stream=stream)

    # -- stage times ------------------------------------------------------------------------
    def stage_ms(self, reps_list: tuple[int, ...], samples: int) -> dict[str, float]:
        dev = self.devices[0]
        s = self.streams[dev.ordinal][0]
        buf = self.buffers[dev.ordinal][0]
        drv = dev._driver
        src, dst = int(self.host_in.ctypes.data), int(self.host_out.ctypes.data)
        ops: dict[str, Callable[[], None]] = {
            "h2d": lambda: drv.memcpy_htod_async(buf.ptr, src, self.chunk_bytes, s.handle),
            "d2h": lambda: drv.memcpy_dtoh_async(dst, buf.ptr, self.chunk_bytes, s.handle),
        }
        for reps in reps_list:
            go = self.launcher(reps, s)
            ops[f"kernel_reps{reps}"] = lambda go=go, reps=reps: go(buf, self.n, reps)  # type: ignore[misc]
        start, end = Event(dev, timing=True), Event(dev, timing=True)
        out = {}
        for name, op in ops.items():
            op()
            times = []
            for _ in range(samples):
                start.record(s)
                op()
                end.record(s)
                end.synchronize()
                times.append(end.elapsed_ms(since=start))
            out[name] = statistics.median(times)
        return out

    def duplex_ms(self, samples: int, copies: int = 8) -> dict[str, float]:
        """Per-copy milliseconds of uploads and downloads running at the same time, on
        two streams of device 0: what each copy engine manages while the other is busy
        (both share the host link and memory, so each is slower than alone)."""
        dev = self.devices[0]
        up, down = self.streams[dev.ordinal][:2]
        up_buf, down_buf = self.buffers[dev.ordinal][:2]
        drv = dev._driver
        src, dst = int(self.host_in.ctypes.data), int(self.host_out.ctypes.data)
        start = Event(dev, timing=True)
        ends = {"h2d": Event(dev, timing=True), "d2h": Event(dev, timing=True)}
        times: dict[str, list[float]] = {"h2d": [], "d2h": []}
        for round_ in range(samples + 1):
            start.record(up)
            down.wait(start)
            for _ in range(copies):
                drv.memcpy_htod_async(up_buf.ptr, src, self.chunk_bytes, up.handle)
                drv.memcpy_dtoh_async(dst, down_buf.ptr, self.chunk_bytes, down.handle)
            ends["h2d"].record(up)
            ends["d2h"].record(down)
            for name, end in ends.items():
                end.synchronize()
                if round_:
                    times[name].append(end.elapsed_ms(since=start) / copies)
        return {name: statistics.median(values) for name, values in times.items()}

    def copies_only(self, devices: list[Device]) -> float:
        """Seconds for every device to upload and download ``CHUNKS`` chunks at once
        (uploads on one stream, downloads on another, no kernel): the host link's
        ceiling for the pipeline's copies, which no schedule of them can beat."""
        nbytes = self.chunk_bytes
        src, dst = int(self.host_in.ctypes.data), int(self.host_out.ctypes.data)
        started = time.perf_counter()
        for d, dev in enumerate(devices):
            up, down = self.streams[dev.ordinal][:2]
            up_buf, down_buf = self.buffers[dev.ordinal][:2]
            dev.make_current()
            drv = dev._driver
            for i in range(CHUNKS):
                offset = (d * CHUNKS + i) * nbytes
                drv.memcpy_htod_async(up_buf.ptr, src + offset, nbytes, up.handle)
                drv.memcpy_dtoh_async(dst + offset, down_buf.ptr, nbytes, down.handle)
        for dev in devices:
            for stream in self.streams[dev.ordinal][:2]:
                stream.synchronize()
        return time.perf_counter() - started

    # -- raw-driver loops ---------------------------------------------------------------------
    def raw_loop(self, reps: int, nstreams: int, devices: list[Device]) -> float:
        """Seconds for ``CHUNKS`` chunks per device, chunk i on stream i % nstreams of
        its device; devices interleaved chunk by chunk."""
        plan = []
        for dev in devices:
            streams = self.streams[dev.ordinal][:nstreams]
            bufs = self.buffers[dev.ordinal][:nstreams]
            plan.append((dev, streams, bufs, [self.launcher(reps, s) for s in streams]))
        nbytes, n = self.chunk_bytes, self.n
        src, dst = int(self.host_in.ctypes.data), int(self.host_out.ctypes.data)
        started = time.perf_counter()
        for i in range(CHUNKS):
            for d, (dev, streams, bufs, launchers) in enumerate(plan):
                k = i % nstreams
                s, b = streams[k].handle, bufs[k]
                offset = (d * CHUNKS + i) * nbytes
                dev.make_current()
                drv = dev._driver
                drv.memcpy_htod_async(b.ptr, src + offset, nbytes, s)
                launchers[k](b, n, reps)
                drv.memcpy_dtoh_async(dst + offset, b.ptr, nbytes, s)
        for _, streams, _, _ in plan:
            for stream in streams:
                stream.synchronize()
        return time.perf_counter() - started


async def executor_run(ex: Executor, rig: Rig, reps: int, chunks: int, graph: bool = False) -> float:
    out = rig.host_out
    started = time.perf_counter()
    async with ex.map(rig.stages[reps], rig.host_in[:chunks], output=lambda i, _: out[i], graph=graph) as results:
        async for _ in results:
            pass
    return time.perf_counter() - started


def bound_ms(chunks: int, steps: list[float]) -> float:
    """Perfect overlap: the busiest step for every chunk plus the other steps once."""
    return chunks * max(steps) + sum(steps) - max(steps)


async def one_gpu_run(rig: Rig, ex: Executor, samples: int) -> dict[str, float]:
    """One run on device 0: stage times alone and duplex, then serial, hand-written and
    executor (eager and graph mode) interleaved at each length; milliseconds."""
    one = rig.devices[:1]
    stage = rig.stage_ms(REPS, samples)
    duplex = rig.duplex_ms(samples)
    figures = {f"stage_{k}_ms": v for k, v in stage.items()}
    figures |= {f"stage_{k}_duplex_ms": v for k, v in duplex.items()}
    for reps in REPS:
        kernel = stage[f"kernel_reps{reps}"]
        med = await wall_medians(
            {
                "serial": lambda reps=reps: rig.raw_loop(reps, 1, one),  # type: ignore[misc]
                "hand": lambda reps=reps: rig.raw_loop(reps, 3, one),  # type: ignore[misc]
                "executor": lambda reps=reps: executor_run(ex, rig, reps, CHUNKS),  # type: ignore[misc]
                "executor_graph": lambda reps=reps: executor_run(ex, rig, reps, CHUNKS, True),  # type: ignore[misc]
            },
            samples,
        )
        figures[f"bound_reps{reps}_ms"] = bound_ms(CHUNKS, [stage["h2d"], kernel, stage["d2h"]])
        figures[f"bound_duplex_reps{reps}_ms"] = bound_ms(CHUNKS, [duplex["h2d"], kernel, duplex["d2h"]])
        for name, seconds in med.items():
            figures[f"{name}_reps{reps}_ms"] = seconds * 1e3
    return figures


async def measure(rig: Rig, ndev: int, samples: int, result: Result) -> None:
    one = rig.devices[:1]
    async with Executor(one) as ex:
        for reps in REPS:
            rig.host_out[:] = 0  # the raw loops write correct results: check the executor's own
            await executor_run(ex, rig, reps, CHUNKS)
            expected = scale_reference(rig.host_in[:CHUNKS], reps)
            if not np.allclose(rig.host_out[:CHUNKS], expected, rtol=1e-3):
                raise SystemExit(f"executor results differ from numpy at reps={reps}")
            for _ in range(2):  # graph mode: warm up, capture; then every chunk replays
                rig.host_out[:] = 0
                await executor_run(ex, rig, reps, CHUNKS, graph=True)
                if not np.allclose(rig.host_out[:CHUNKS], expected, rtol=1e-3):
                    raise SystemExit(f"graph mode's results differ from numpy at reps={reps}")
            states = [lanes.state for lanes in ex._graph_lanes.get(rig.stages[reps], {}).values()]
            if states != ["ready"]:
                raise SystemExit(f"graph mode did not capture the stage at reps={reps}: {states}")
        runs = await repeat_async(lambda: one_gpu_run(rig, ex, samples))
    for name, values in runs.items():
        if name.startswith("stage_"):
            result.baseline(name, values)
    worst_vs_hand = [0.0] * len(runs["executor_reps800_ms"])
    worst_graph_vs_hand = list(worst_vs_hand)
    for reps in REPS:
        bound, bound_duplex = runs[f"bound_reps{reps}_ms"], runs[f"bound_duplex_reps{reps}_ms"]
        serial, hand, execu, graphed = (
            runs[f"serial_reps{reps}_ms"],
            runs[f"hand_reps{reps}_ms"],
            runs[f"executor_reps{reps}_ms"],
            runs[f"executor_graph_reps{reps}_ms"],
        )
        result.baseline(f"bound_reps{reps}_ms", bound, 3)
        result.baseline(f"bound_duplex_reps{reps}_ms", bound_duplex, 3)
        result.baseline(f"serial_1stream_reps{reps}_ms", serial, 3)
        result.baseline(f"handwritten_3stream_reps{reps}_ms", hand, 3)
        result.baseline(f"handwritten_overlap_ratio_bound_reps{reps}", ratios(hand, bound))
        result.baseline(f"handwritten_overlap_ratio_duplex_bound_reps{reps}", ratios(hand, bound_duplex))
        result.metric(f"executor_reps{reps}_ms", execu, 3)
        result.metric(f"executor_vs_handwritten_reps{reps}", ratios(execu, hand))
        result.metric(f"speedup_vs_serial_reps{reps}", ratios(serial, execu))
        result.metric(f"executor_graph_reps{reps}_ms", graphed, 3)
        result.metric(f"executor_graph_vs_handwritten_reps{reps}", ratios(graphed, hand))
        worst_graph_vs_hand = [max(w, r) for w, r in zip(worst_graph_vs_hand, ratios(graphed, hand), strict=True)]
        result.metric(f"overlap_ratio_duplex_bound_reps{reps}", ratios(execu, bound_duplex))
        result.target(f"overlap_ratio_bound_reps{reps}", ratios(execu, bound), 1.10, "<=")
        worst_vs_hand = [max(w, r) for w, r in zip(worst_vs_hand, ratios(execu, hand), strict=True)]
        if reps == BALANCED:
            result.target("speedup_vs_serial", ratios(serial, execu), 1.8, ">=")
    result.target("executor_vs_handwritten", worst_vs_hand, 1.05, "<=")
    result.target("executor_vs_handwritten_graph", worst_graph_vs_hand, 1.0, "<=")
    async with Executor(one, compute_streams=1) as ex:  # diagnostic: kernels strictly in turn
        for reps in REPS:
            await executor_run(ex, rig, reps, CHUNKS)
            walls = [await executor_run(ex, rig, reps, CHUNKS) for _ in range(samples)]
            result.metric(f"executor_1compute_stream_reps{reps}_ms", statistics.median(walls) * 1e3, 3)
    async with Executor(one, trace=True) as ex:
        await executor_run(ex, rig, BALANCED, CHUNKS)
        assert ex.trace is not None
        ex.trace.clear()
        await executor_run(ex, rig, BALANCED, CHUNKS)
        summary = ex.trace.summary()
    # The trace's wall time against the bound from the stage times measured alone: a bound
    # built from the trace's own busy times would grow with whatever slowed the units.
    stage_bound = result.baselines[f"bound_reps{BALANCED}_ms"]
    result.extra[f"trace_1gpu_reps{BALANCED}"] = {
        "wall_ms": round(summary.wall_ms, 3),
        "stage_bound_ms": stage_bound,
        "wall_over_stage_bound": round(summary.wall_ms / stage_bound, 4),
        "busy_ms": {f"{e.device}/{e.unit}": round(e.busy_ms, 3) for e in summary.units},
    }
    if ndev >= 2:
        await _scaling(rig, ndev, samples, result)


async def _scaling(rig: Rig, ndev: int, samples: int, result: Result) -> None:
    """The same pipeline on ``ndev`` GPUs against one, and the raw copies' own scaling."""
    one, many = rig.devices[:1], rig.devices[:ndev]
    contenders: dict[str, Callable[[], Any]] = {
        "copies_1": lambda: rig.copies_only(one),
        "copies_n": lambda: rig.copies_only(many),
    }
    async with Executor(one) as ex_1, Executor(many) as ex_n:
        for reps in REPS:
            rig.host_out[:] = 0
            await executor_run(ex_n, rig, reps, CHUNKS * ndev)
            if not np.allclose(rig.host_out, scale_reference(rig.host_in, reps), rtol=1e-3):
                raise SystemExit(f"executor results differ from numpy on {ndev} devices at reps={reps}")
            contenders[f"hand_1_{reps}"] = lambda reps=reps: rig.raw_loop(reps, 3, one)
            contenders[f"executor_1_{reps}"] = lambda reps=reps: executor_run(ex_1, rig, reps, CHUNKS)
            contenders[f"hand_n_{reps}"] = lambda reps=reps: rig.raw_loop(reps, 3, many)
            contenders[f"executor_n_{reps}"] = lambda reps=reps: executor_run(ex_n, rig, reps, CHUNKS * ndev)

        async def one_run() -> dict[str, float]:
            return await wall_medians(contenders, samples)

        med = await repeat_async(one_run)
    result.baseline("copies_only_1gpu_ms", [x * 1e3 for x in med["copies_1"]], 3)
    result.baseline(f"copies_only_{ndev}gpu_ms", [x * 1e3 for x in med["copies_n"]], 3)
    result.baseline(f"copy_ceiling_scaling_{ndev}gpu", [ndev * r for r in ratios(med["copies_1"], med["copies_n"])])
    for reps in REPS:
        hand_n, execu_n = med[f"hand_n_{reps}"], med[f"executor_n_{reps}"]
        scaling = [ndev * r for r in ratios(med[f"executor_1_{reps}"], execu_n)]
        result.baseline(f"handwritten_3stream_{ndev}gpu_reps{reps}_ms", [x * 1e3 for x in hand_n], 3)
        result.baseline(
            f"handwritten_scaling_{ndev}gpu_reps{reps}", [ndev * r for r in ratios(med[f"hand_1_{reps}"], hand_n)]
        )
        result.metric(f"executor_{ndev}gpu_reps{reps}_ms", [x * 1e3 for x in execu_n], 3)
        result.metric(f"executor_vs_handwritten_{ndev}gpu_reps{reps}", ratios(execu_n, hand_n))
        result.metric(f"scaling_{ndev}gpu_reps{reps}", scaling)
        if reps != BALANCED:
            continue
        if ndev == 2:
            result.target("two_gpu_scaling", scaling, 1.9, ">=")
        else:
            result.target(f"scaling_{ndev}", scaling, round(0.95 * ndev, 2), ">=")


def main() -> None:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=None, help="GPUs for the scaling run (default: up to 2)")
    args = p.parse_args()
    backend = _driver.driver()
    available = backend.device_count()
    ndev = min(2, available) if args.devices is None else args.devices
    if not 1 <= ndev <= available:
        raise SystemExit(f"--devices must be between 1 and {available}")
    on_sim = backend.name == "sim"
    if on_sim:
        for op, seconds in SIM_LATENCY_S.items():
            backend.set_latency(op, seconds)  # type: ignore[attr-defined]
    chunk_bytes = (1 << 20) if on_sim else (32 << 20)
    samples = 2 if args.quick or on_sim else 9
    rig = Rig([Device(i) for i in range(ndev)], chunk_bytes)
    result = Result("pipeline" if ndev <= 2 else f"pipeline-x{ndev}")
    result.extra["config"] = {
        "chunks_per_gpu": CHUNKS,
        "chunk_mib": chunk_bytes / (1 << 20),
        "reps": list(REPS),
        "devices": ndev,
        "samples": samples,
        "simulated": on_sim,
    }
    gc.collect()
    gc.disable()  # no collection pauses inside timed runs, for any of the contenders
    try:
        anyio.run(measure, rig, ndev, samples, result)
    finally:
        gc.enable()
    result.write(args.out)


if __name__ == "__main__":
    main()
