"""Loop health under a cancellation storm, and how fast a kernel fault reaches awaits.

**Storm.** 8 tasks, each running cycles of: upload 1 MiB (``to_device`` of a numpy
array), launch a kernel that adds 1 to every element, download into its own array and
verify the checksum. Meanwhile a canceller task cancels a random task's current cycle
at random moments (every 0-2 ms); a cancelled task starts its next cycle at once. A
ticker task on the same loop asks to sleep 1 ms, over and over: its *lateness* (how
much longer than 1 ms each sleep took) is the loop's gap, the time the loop could not
run a ready task. Run with pageable host arrays (the storm the targets judge) and with
pinned ones (reported), alternately, three times each; figures are medians of the three
runs, whose values the results file keeps. After each storm, with every stream idle and the arrays gone,
the device pool's bytes in use must be back where they started (``leak_bytes_storm``),
and every completed cycle's checksum must have matched.

**Fault.** In a fresh process per sample (a fault poisons the context for good): three
rounds of long waits complete, so the completion engine's waker is left with nothing to
wait for; then a kernel writes out of bounds, and five awaits that can only end in the
error are pending (on their doorbells, an event's, queued on one stream). A thread
polling ``cuStreamQuery`` through ctypes sees when the driver itself reports the fault;
``fault_to_all_failed_ms_after_long_waits`` is how much later the last await failed
(median of three processes). A target's value in each run is the worst loop's.

Targets (issue 14): ``loop_max_gap_ms_storm`` <= 10, ``loop_gap_p99_ms_storm`` <= 2 (the
worst loop's median), ``storm_checksums_verified`` == 1, ``leak_bytes_storm`` == 0,
``fault_to_all_failed_ms_after_long_waits`` <= 20.

    PYTHONPATH=src python3 benchmarks/loop_health.py [--quick]

On the simulated backend, or with ``--quick`` (one run of 100 cycles), it is a smoke run of
the code paths: it prints its figures but writes no results file unless ``--out`` names
one.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import pathlib
import random
import re
import statistics
import subprocess
import sys
import time
from typing import Any

import anyio
import numpy as np
import numpy.typing as npt

import aiocuda
from aiocuda._completion.event_pool import EventPool
from aiocuda.device import Device
from aiocuda.host import pinned_empty
from aiocuda.kernel import Kernel, register_sim_kernel
from aiocuda.memory import MemoryPool
from aiocuda.program import Program
from aiocuda.stream import Stream

try:
    from benchmarks._common import RUNS, Result, parser, stalls_reported
except ImportError:  # run as a script from the benchmarks folder
    from _common import RUNS, Result, parser, stalls_reported  # type: ignore[no-redef]

TASKS = 8
CYCLES = 5000
ELEMENTS = (1 << 20) // 4  # 1 MiB of uint32
BLOCK = 256
TICK_S = 0.001
CANCEL_EVERY_S = 0.002
LOOPS = {"asyncio": ("asyncio", {}), "uvloop": ("asyncio", {"use_uvloop": True}), "trio": ("trio", {})}

ADD_ONE = r"""
extern "C" __global__ void add_one(unsigned int* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += 1u;
}
"""


def _sim_add_one(launch: Any, x: npt.NDArray[np.uint32], n: np.int32) -> None:
    x[: int(n)] += np.uint32(1)


def _checksum(x: npt.NDArray[np.uint32]) -> int:
    # The sum of the array's 64-bit words (mod 2**64): it runs on the loop thread once per
    # cycle, and summing the uint32 elements as uint64 took 4x as long (~90 us a MiB),
    # loop time that the storm's gaps then counted against aiocuda.
    return int(x.view(np.uint64).sum())


class Storm:
    """The storm's streams, kernel and host arrays (made once, reused by every run)."""

    def __init__(self, pinned: bool) -> None:
        register_sim_kernel("add_one", _sim_add_one)
        self.device = Device(0)
        self.kernel: Kernel = Program(ADD_ONE, name="add_one.cu").compile(self.device).kernel("add_one")
        self.streams = [Stream(self.device) for _ in range(TASKS)]
        base = np.arange(ELEMENTS, dtype=np.uint32)
        self.hosts: list[npt.NDArray[np.uint32]] = []
        self.outs: list[npt.NDArray[np.uint32]] = []
        for i in range(TASKS):
            host = pinned_empty(ELEMENTS, np.uint32) if pinned else np.empty(ELEMENTS, np.uint32)
            host[:] = base * np.uint32(i + 1)
            self.hosts.append(host)
            self.outs.append(pinned_empty(ELEMENTS, np.uint32) if pinned else np.empty(ELEMENTS, np.uint32))
        self.expected = [_checksum(host + np.uint32(1)) for host in self.hosts]

    async def run(self, cycles: int, seed: int) -> dict[str, float]:
        """One storm; returns its figures."""
        rng = random.Random(seed)
        pool = MemoryPool.for_device(self.device)
        events = EventPool.for_device(self.device)
        for s in self.streams:
            await s
        gc.collect()
        used_before = pool.statistics().used_bytes
        made_before = events.statistics().made_by_caller
        scopes: list[anyio.CancelScope | None] = [None] * TASKS
        counts = {"completed": 0, "cancelled": 0, "mismatched": 0}
        gaps: list[float] = []
        running = TASKS

        async def worker(i: int) -> None:
            nonlocal running
            stream, host, out = self.streams[i], self.hosts[i], self.outs[i]
            grid = (ELEMENTS + BLOCK - 1) // BLOCK
            for _ in range(cycles):
                with anyio.CancelScope() as scope:
                    scopes[i] = scope
                    x = await aiocuda.to_device(host, stream=stream)
                    self.kernel.launch(grid, BLOCK, x, ELEMENTS, stream=stream)
                    await x.to_host(out=out, stream=stream)
                    del x
                    if _checksum(out) == self.expected[i]:
                        counts["completed"] += 1
                    else:
                        counts["mismatched"] += 1
                if scope.cancelled_caught:
                    counts["cancelled"] += 1
            scopes[i] = None
            running -= 1

        async def canceller() -> None:
            while running:
                await anyio.sleep(rng.random() * CANCEL_EVERY_S)
                victim = scopes[rng.randrange(TASKS)]
                if victim is not None:
                    victim.cancel()

        async def ticker() -> None:
            clock = time.perf_counter
            while running:
                started = clock()
                await anyio.sleep(TICK_S)
                gaps.append(clock() - started - TICK_S)

        started = time.perf_counter()
        async with stalls_reported(), anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            tg.start_soon(canceller)
            for i in range(TASKS):
                tg.start_soon(worker, i)
        wall = time.perf_counter() - started
        for s in self.streams:
            await s
        gc.collect()
        ordered = sorted(gaps)
        return {
            "max_gap_ms": ordered[-1] * 1e3,
            "p99_gap_ms": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3,
            "median_gap_ms": statistics.median(ordered) * 1e3,
            "wall_s": wall,
            "completed": counts["completed"],
            "cancelled": counts["cancelled"],
            "mismatched": counts["mismatched"],
            "leak_bytes": pool.statistics().used_bytes - used_before,
            "events_made_on_loop": events.statistics().made_by_caller - made_before,
        }


async def storms(cycles: int, runs: int) -> dict[str, list[dict[str, float]]]:
    """``runs`` storms with pageable and with pinned host arrays, alternately."""
    rigs = {"pageable": Storm(pinned=False), "pinned": Storm(pinned=True)}
    out: dict[str, list[dict[str, float]]] = {kind: [] for kind in rigs}
    for run in range(runs):
        for kind, rig in rigs.items():
            figures = await rig.run(cycles, seed=run)
            out[kind].append(figures)
            shown = {k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()}
            print(f"  storm {kind} run {run + 1}: {shown}", flush=True)
    for rig in rigs.values():
        for s in rig.streams:
            s.close()
    return out


# -- the fault ------------------------------------------------------------------------------------
FAULT_SCRIPT = r"""
import ctypes, threading, time, anyio
from aiocuda import _driver
from aiocuda.device import Device
from aiocuda.errors import ContextPoisonedError
from aiocuda.stream import Stream
from aiocuda.program import Program
from aiocuda.kernel import register_sim_kernel

SRC = r'''
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
extern "C" __global__ void poison(int* p) { *(volatile int*)(p + 0x7fffffff) = 1; }
'''
backend = _driver.driver()
real = backend.name == "cuda"
device = Device(0)


def _sim_spin(launch, cycles):
    time.sleep(int(cycles) / 1e9)


def _sim_poison(launch, p):
    raise IndexError("simulated out-of-bounds write")


register_sim_kernel("spin", _sim_spin)
register_sim_kernel("poison", _sim_poison)
module = Program(SRC, name="fault.cu").compile(device)
spin, poison = module.kernel("spin"), module.kernel("poison")
hz = device.attribute("clock_rate") * 1e3 if real else 1e9
driver_saw = []

if real:
    libcuda = ctypes.CDLL("libcuda.so.1")  # CDLL: the GIL is released during each call
    libcuda.cuStreamQuery.argtypes = [ctypes.c_void_p]

    def reported(handle):
        return libcuda.cuStreamQuery(handle) not in (0, 600)
else:
    def reported(handle):
        try:
            backend.stream_query(backend.stream_from_value(handle))
        except Exception:
            return True
        time.sleep(0.0001)
        return False


def watch(handle, t):
    device.make_current()
    while time.perf_counter() - t < 5:
        if reported(handle):
            driver_saw.append(time.perf_counter() - t)
            return


async def _await(s):
    await s


async def main():
    streams = [Stream(device) for _ in range(4)]
    for _ in range(3):  # long waits, all completed: the waker has nothing left to wait for
        for s in streams:
            spin.launch(1, 1, int(0.03 * hz), stream=s)
        async with anyio.create_task_group() as tg:
            for s in streams:
                tg.start_soon(_await, s)
    await anyio.sleep(0.1)
    busy, line, bad = Stream(device), Stream(device), Stream(device)
    failed = {}

    async def expect_failure(name, awaitable):
        try:
            await awaitable
        except ContextPoisonedError:
            failed[name] = time.perf_counter() - t

    async def queued(i):
        spin.launch(1, 1, 1000, stream=line)
        await expect_failure(f"queued{i}", line)

    if not real:  # the simulator faults at once: let the awaits below be set up first
        spin.launch(1, 1, int(0.05 * hz), stream=bad)
    t = time.perf_counter()
    watcher = threading.Thread(target=watch, args=(int(bad), t))
    poison.launch(1, 1, 0, stream=bad)
    fault = bad.record()
    busy.wait(fault)
    line.wait(fault)
    event = busy.record()
    watcher.start()
    async with anyio.create_task_group() as tg:
        tg.start_soon(expect_failure, "doorbell", busy)
        tg.start_soon(expect_failure, "event", event)
        for i in range(3):
            tg.start_soon(queued, i)
    watcher.join()
    print("FAULT", len(failed), max(failed.values()) * 1e3, driver_saw[0] * 1e3)

anyio.run(main, backend="{backend}", backend_options={options})
"""


def fault_sample(library: str, options: dict[str, Any]) -> tuple[float, float]:
    """One fresh process: (ms from the fault to the last await failing, ms to the driver's
    own report)."""
    src = str(pathlib.Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    script = FAULT_SCRIPT.replace("{backend}", library).replace("{options}", repr(options))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    found = re.search(r"^FAULT (\d+) ([\d.]+) ([\d.]+)$", proc.stdout, re.MULTILINE)
    if not found or found[1] != "5":
        raise RuntimeError(f"the fault script failed:\n{proc.stdout}\n{proc.stderr[-3000:]}")
    return float(found[2]), float(found[3])


def main() -> None:
    args = parser(__doc__ or "").parse_args()
    cycles, runs = (100, 1) if args.quick else (CYCLES, RUNS)
    loops = {name: spec for name, spec in LOOPS.items() if name != "uvloop" or importlib.util.find_spec("uvloop")}
    if not importlib.util.find_spec("trio"):
        loops.pop("trio")
    res = Result("loop_health")
    # Per run, the worst loop's figure: a target holds only if it holds on every loop.
    worst: dict[str, list[float]] = {key: [0.0] * runs for key in ("max_gap_ms", "p99_gap_ms", "fault")}
    verified = True
    leaked = 0.0
    for name, (library, options) in loops.items():
        print(f"== {name}", flush=True)
        runs_by_kind = anyio.run(storms, cycles, runs, backend=library, backend_options=options)
        for kind, figures in runs_by_kind.items():
            for key in ("max_gap_ms", "p99_gap_ms", "median_gap_ms", "wall_s", "events_made_on_loop"):
                values = [f[key] for f in figures]
                res.baseline(f"{name}.{kind}.{key}", values)
                if kind == "pageable" and key in worst:
                    worst[key] = [max(w, v) for w, v in zip(worst[key], values, strict=True)]
            res.baseline(f"{name}.{kind}.cycles_completed", [f["completed"] for f in figures], 0)
            res.baseline(f"{name}.{kind}.cycles_cancelled", [f["cancelled"] for f in figures], 0)
            verified = verified and all(f["mismatched"] == 0 and f["completed"] > 0 for f in figures)
            leaked = max(leaked, *(abs(f["leak_bytes"]) for f in figures))
        samples = [fault_sample(library, options) for _ in range(runs)]
        after = [ours - driver for ours, driver in samples]
        res.baseline(f"{name}.fault_to_all_failed_ms", [s[0] for s in samples], 3)
        res.baseline(f"{name}.driver_report_ms", [s[1] for s in samples], 3)
        worst["fault"] = [max(w, v) for w, v in zip(worst["fault"], after, strict=True)]
        print(f"  fault: all failed {[round(a, 1) for a in after]} ms after the driver's report", flush=True)
    res.target("loop_max_gap_ms_storm", worst["max_gap_ms"], 10.0, "<=")
    res.target("loop_gap_p99_ms_storm", worst["p99_gap_ms"], 2.0, "<=")
    res.target("storm_checksums_verified", float(verified), 1, "==")
    res.target("leak_bytes_storm", leaked, 0, "==")
    res.target("fault_to_all_failed_ms_after_long_waits", worst["fault"], 20.0, "<=")
    res.write(args.out)


if __name__ == "__main__":
    main()
