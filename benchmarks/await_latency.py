"""Await latency, throughput and idle cost: ``await stream`` against today's ways to wait.

Measured in one process, on asyncio, uvloop and trio (through anyio), for a tiny GPU
operation (a 4-byte memset):

* ``block_sync``  -- ``cuStreamSynchronize`` inside the coroutine: blocks the loop; the floor.
* ``to_thread``   -- ``await to_thread.run_sync(synchronize)``: a worker thread per wait.
* ``event_poll``  -- record an event, ``sleep(0)`` until ``cuEventQuery`` says done.
* ``numba``       -- numba-cuda's ``Stream.async_done()`` where it works (asyncio only).
* ``aiocuda``     -- ``await stream``.

Latencies are medians of 3000 samples taken in 10 rounds, every way to wait once per
round (interleaved: the machine's speed drifts over seconds). Then 64 streams with a
task each doing 100 awaits (throughput: the median of 9 interleaved rounds after a
warm-up); a 5 ms kernel awaited 25 times (how much later than a spinning synchronize
the task resumes: ``wake_overshoot_5ms_us``, reported, no target); and one
task awaiting a 200 ms kernel while a 1 ms ticker runs on the same loop (CPU fraction,
worst loop gap). Last, a service's load: 64 tasks, each making requests of a tiny copy
awaited then a kernel of 1 (or 5) ms awaited, ``aiocuda`` against ``event_poll`` in
interleaved rounds: CPU per await of the whole process (``service_*_cpu_ratio``, target
<= 1 on asyncio and uvloop) and throughput.

    PYTHONPATH=src python3 benchmarks/await_latency.py [--quick]

The whole suite runs three times, the loops taking turns; each figure is the median of
its runs (with the runs kept in the results file). A run on the simulated backend, or
with ``--quick`` (one run), is a smoke run: it writes no results file unless ``--out``
names one.
"""

from __future__ import annotations

import functools
import importlib.util
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from aiocuda import _driver
from aiocuda._completion.event_pool import EventPool
from aiocuda._driver.cuda import _core as cuda_core
from aiocuda.device import Device
from aiocuda.program import Program
from aiocuda.stream import Stream

try:
    from benchmarks._common import RUNS, Result, parser, ratios, wall_medians
except ImportError:  # run as a script from the benchmarks folder
    from _common import RUNS, Result, parser, ratios, wall_medians  # type: ignore[no-redef]

SERVICE_KERNEL_MS = (1, 5)
"""Kernel lengths of the many-concurrent-waiters case (a service's requests)."""

SPIN_SRC = r"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
"""


class Rig:
    """The tiny operation, the long kernel and the raw handles the baselines need."""

    def __init__(self) -> None:
        self.backend = _driver.driver()
        self.device = Device(0)
        self.device.make_current()
        self.real = self.backend.name == "cuda"
        probe = Stream(self.device)
        if self.real:
            drv = cuda_core.drv
            self.scratch = cuda_core.check(drv.cuMemAlloc(1 << 20), "cuMemAlloc")
            self._memset = drv.cuMemsetD8Async
            self._spin = Program(SPIN_SRC, name="spin.cu").compile(self.device).kernel("spin")
            self.clock_khz = self.device.attribute("clock_rate")
        else:
            pool = self.backend.mempool_default(self.device._handle)
            self.scratch = self.backend.mem_alloc_async(1 << 20, pool, probe.handle)
        probe.synchronize()

    def tiny(self, stream: Stream) -> None:
        if self.real:
            self._memset(self.scratch, 1, 4, stream.handle)
        else:
            self.backend.memset_d8_async(self.scratch, 1, 4, stream.handle)

    def long_kernel(self, stream: Stream, seconds: float) -> None:
        if self.real:
            self._spin.launch(1, 1, int(seconds * self.clock_khz * 1e3), stream=stream)
        else:
            self.backend.enqueue(stream.handle, lambda: time.sleep(seconds), "spin")  # type: ignore[attr-defined]

    def sync(self, stream: Stream) -> None:
        self.backend.stream_synchronize(stream.handle)


Waiter = Callable[[Stream], Awaitable[None]]


def make_waiters(rig: Rig, library: str) -> dict[str, Waiter]:
    backend = rig.backend
    pool = EventPool.for_device(rig.device)
    checkpoint: Callable[[], Awaitable[None]]
    if library == "trio":
        import trio

        checkpoint = trio.lowlevel.checkpoint
    else:
        import asyncio

        def checkpoint() -> Awaitable[None]:
            return asyncio.sleep(0)

    async def block_sync(s: Stream) -> None:
        rig.sync(s)

    async def to_thread(s: Stream) -> None:
        await anyio.to_thread.run_sync(rig.sync, s)

    poll_events: dict[int, Any] = {}

    async def event_poll(s: Stream) -> None:
        ev = poll_events.get(id(s))
        if ev is None:
            ev = poll_events[id(s)] = pool.acquire()
        backend.event_record(ev, s.handle)
        while not backend.event_query(ev):
            await checkpoint()

    async def aiocuda_await(s: Stream) -> None:
        await s

    waiters: dict[str, Waiter] = {
        "block_sync": block_sync,
        "to_thread": to_thread,
        "event_poll": event_poll,
        "aiocuda": aiocuda_await,
    }
    if rig.real and library == "asyncio" and importlib.util.find_spec("numba_cuda"):
        waiters["numba_async_done"] = _numba_waiter()
    return waiters


def _numba_waiter() -> Waiter:
    from numba import cuda as nb

    streams: dict[int, Any] = {}

    async def numba_async_done(s: Stream) -> None:
        ns = streams.get(id(s))
        if ns is None:
            ns = streams[id(s)] = nb.external_stream(int(s))
        await ns.async_done()

    return numba_async_done


async def warm_up(rig: Rig, wait: Waiter, stream: Stream, n: int = 200) -> None:
    for _ in range(n):
        rig.tiny(stream)
        await wait(stream)


async def latencies(rig: Rig, waits: dict[str, Waiter], stream: Stream, n: int, rounds: int = 10) -> dict[str, float]:
    """Median seconds from enqueueing a tiny operation to the end of its wait, for each
    way to wait: ``n`` samples each, taken in ``rounds`` interleaved rounds (the machine's
    speed drifts over seconds, and the ratios compare ways measured side by side)."""
    samples: dict[str, list[float]] = {name: [] for name in waits}
    perf = time.perf_counter
    for _ in range(rounds):
        for name, wait in waits.items():
            out = samples[name]
            for _ in range(n // rounds):
                t = perf()
                rig.tiny(stream)
                await wait(stream)
                out.append(perf() - t)
    return {name: statistics.median(xs) for name, xs in samples.items()}


async def throughput(
    rig: Rig, waits: dict[str, Waiter], streams: list[Stream], per_task: int, rounds: int
) -> dict[str, float]:
    """Awaits per second of each way to wait, with a task per stream each awaiting
    ``per_task`` tiny operations in turn: medians over ``rounds`` rounds after a warm-up,
    every way once per round (interleaved: the machine's speed drifts over seconds)."""

    async def worker(wait: Waiter, s: Stream) -> None:
        for _ in range(per_task):
            rig.tiny(s)
            await wait(s)

    async def one_round(wait: Waiter) -> None:
        async with anyio.create_task_group() as tg:
            for s in streams:
                tg.start_soon(worker, wait, s)

    contenders = {name: functools.partial(one_round, wait) for name, wait in waits.items()}
    seconds = await wall_medians(contenders, rounds)
    return {name: len(streams) * per_task / t for name, t in seconds.items()}


async def concurrent_requests(
    rig: Rig, waits: dict[str, Waiter], streams: list[Stream], kernel_s: float, per_task: int, rounds: int
) -> dict[str, dict[str, float]]:
    """A service's load: a task per stream, each making ``per_task`` requests of a tiny
    copy awaited, then a kernel of ``kernel_s`` awaited (two awaits at two places).

    Per way to wait: CPU seconds of the whole process per await (``process_time``: the
    waker's and the driver's threads count too) and awaits per second, medians over
    ``rounds`` rounds after a warm-up, every way once per round (interleaved)."""

    async def client(wait: Waiter, s: Stream) -> None:
        for _ in range(per_task):
            rig.tiny(s)
            await wait(s)
            rig.long_kernel(s, kernel_s)
            await wait(s)

    awaits = 2 * per_task * len(streams)
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in waits}
    for round_ in range(rounds + 1):
        for name, wait in waits.items():
            cpu, wall = time.process_time(), time.perf_counter()
            async with anyio.create_task_group() as tg:
                for s in streams:
                    tg.start_soon(client, wait, s)
            if round_:
                samples[name].append((time.process_time() - cpu, time.perf_counter() - wall))
    return {
        name: {
            "cpu_us_per_await": statistics.median(c for c, _ in xs) / awaits * 1e6,
            "awaits_per_s": awaits / statistics.median(w for _, w in xs),
        }
        for name, xs in samples.items()
    }


async def wake_overshoot_us(rig: Rig, wait: Waiter, stream: Stream, seconds: float, n: int) -> float:
    """How much later than a spinning ``cuStreamSynchronize`` a wait for a kernel of
    ``seconds``, repeated, resumes the task (median difference, microseconds)."""
    waited, synced = [], []
    for _ in range(n):
        rig.long_kernel(stream, seconds)
        t = time.perf_counter()
        rig.sync(stream)
        synced.append(time.perf_counter() - t)
        rig.long_kernel(stream, seconds)
        t = time.perf_counter()
        await wait(stream)
        waited.append(time.perf_counter() - t)
    return (statistics.median(waited) - statistics.median(synced)) * 1e6


async def long_wait(rig: Rig, wait: Waiter, stream: Stream, seconds: float) -> dict[str, float]:
    """CPU cost of awaiting a long kernel, then loop responsiveness during the same wait.

    The CPU fraction is measured with nothing else on the loop, so that it is the cost of
    waiting alone; a second wait runs beside a 1 ms ticker for the worst gap between
    ticks (the ticker's own CPU is reported separately, as ``cpu_fraction_with_ticker``).
    """
    c0, t0 = time.process_time(), time.perf_counter()
    rig.long_kernel(stream, seconds)
    await wait(stream)
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0

    gaps: list[float] = []
    done = anyio.Event()

    async def ticker() -> None:
        while not done.is_set():
            t = time.perf_counter()
            await anyio.sleep(0.001)
            gaps.append(time.perf_counter() - t)

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        await anyio.sleep(0.005)
        c1, t1 = time.process_time(), time.perf_counter()
        rig.long_kernel(stream, seconds)
        await wait(stream)
        cpu_ticker, wall_ticker = time.process_time() - c1, time.perf_counter() - t1
        done.set()
    return {
        "cpu_fraction": cpu / wall,
        "wall_s": wall,
        "cpu_fraction_with_ticker": cpu_ticker / wall_ticker,
        "max_gap_ms": max(gaps) * 1e3,
    }


async def suite(rig: Rig, library: str, quick: bool) -> dict[str, dict[str, Any]]:
    n = 300 if quick else 3000
    per_task = 20 if quick else 100
    n_streams = 8 if quick else 64
    streams = [Stream(rig.device) for _ in range(n_streams)]
    rows: dict[str, dict[str, Any]] = {}
    working: dict[str, Waiter] = {}
    for name, wait in make_waiters(rig, library).items():
        try:
            await warm_up(rig, wait, streams[0])
        except Exception as exc:  # a baseline that does not work here is reported, not fatal
            rows[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        else:
            rows[name], working[name] = {}, wait
    for name, seconds in (await latencies(rig, working, streams[0], n)).items():
        rows[name]["latency_us"] = seconds * 1e6
    for name, wait in working.items():
        if name != "block_sync":
            rows[name]["wake_overshoot_5ms_us"] = await wake_overshoot_us(
                rig, wait, streams[2], 0.005, 5 if quick else 25
            )
        if name in ("aiocuda", "block_sync") or not quick:
            rows[name].update(await long_wait(rig, wait, streams[1], 0.05 if quick else 0.2))
    del working["block_sync"]  # blocks the loop: no throughput to speak of
    for name, rate in (await throughput(rig, working, streams, per_task, 3 if quick else 9)).items():
        rows[name]["awaits_per_s"] = rate
    service = {name: working[name] for name in ("event_poll", "aiocuda")}
    for kernel_ms in SERVICE_KERNEL_MS:
        figures = await concurrent_requests(
            rig, service, streams, kernel_ms / 1e3, 5 if quick else 20, 2 if quick else 5
        )
        for name, row in figures.items():
            for key, value in row.items():
                rows[name][f"service_{kernel_ms}ms_{key}"] = value
    for name, row in rows.items():
        print(library, name, {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    for s in streams:
        s.close()
    return rows


def _each(runs: list[dict[str, dict[str, Any]]], ours_key: str, base: str, base_key: str) -> list[float]:
    """Run-by-run ratios of aiocuda's figure to a baseline's."""
    return ratios([r["aiocuda"][ours_key] for r in runs], [r[base][base_key] for r in runs])


def main() -> None:
    args = parser(__doc__ or "").parse_args()
    rig = Rig()
    libraries: list[tuple[str, str, dict[str, Any]]] = [("asyncio", "asyncio", {})]
    if importlib.util.find_spec("uvloop"):
        libraries.append(("uvloop", "asyncio", {"use_uvloop": True}))
    if importlib.util.find_spec("trio"):
        libraries.append(("trio", "trio", {}))
    results: dict[str, list[dict[str, dict[str, Any]]]] = {label: [] for label, _, _ in libraries}
    for _ in range(1 if args.quick else RUNS):  # the loops take turns, run after run
        for label, lib, options in libraries:
            results[label].append(
                anyio.run(
                    suite, rig, "trio" if lib == "trio" else "asyncio", args.quick, backend=lib, backend_options=options
                )
            )

    res = Result("await_latency")
    for label, runs in results.items():
        for name, row in runs[0].items():
            for key, value in row.items():
                if isinstance(value, float):
                    res.baseline(f"{label}.{name}.{key}", [rows[name][key] for rows in runs], 3)
                else:
                    res.extra.setdefault("errors", {})[f"{label}.{name}"] = value
    for label, limit in (("asyncio", 2.0), ("uvloop", 1.5), ("trio", None)):
        runs = results.get(label, [])
        if not runs or "latency_us" not in runs[0].get("aiocuda", {}):
            continue

        figures = {
            f"latency_ratio_{label}": (_each(runs, "latency_us", "block_sync", "latency_us"), limit, "<="),
            f"throughput_ratio_{label}": (_each(runs, "awaits_per_s", "event_poll", "awaits_per_s"), 1.0, ">="),
        }
        for kernel_ms in SERVICE_KERNEL_MS:
            key = f"service_{kernel_ms}ms"
            figures[f"{key}_cpu_ratio_{label}"] = (
                _each(runs, f"{key}_cpu_us_per_await", "event_poll", f"{key}_cpu_us_per_await"),
                1.0,
                "<=",
            )
            res.metric(
                f"{key}_throughput_ratio_{label}",
                _each(runs, f"{key}_awaits_per_s", "event_poll", f"{key}_awaits_per_s"),
                3,
            )
        for name, (values, bound, op) in figures.items():
            if limit is None:  # trio: reported, no targets
                res.metric(name, values, 3)
            else:
                res.target(name, values, bound, op)
        # Not a target: how late a repeated 5 ms wait resumes, against a spinning synchronize.
        res.metric(f"wake_overshoot_5ms_us_{label}", [r["aiocuda"]["wake_overshoot_5ms_us"] for r in runs], 1)
    ours = [rows["aiocuda"] for rows in results["asyncio"]]
    res.target("cpu_fraction_long_wait", [r["cpu_fraction"] for r in ours], 0.05, "<=")
    res.target("loop_max_gap_ms", [r["max_gap_ms"] for r in ours], 5.0, "<=")
    res.write(args.out)


if __name__ == "__main__":
    main()
