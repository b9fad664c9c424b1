"""A model of the serve benchmark's server for ``scripts/ab model``: the completion engine
against a polling loop, on any machine, with a GPU made of clocks.

Each request's "kernel" ends at a deadline (``time.perf_counter()`` seconds): the engine's
event query becomes ``now >= deadline``, so how late a waiting task resumes after its
kernel's end is known exactly (a kernel of W lasts W, or with a jitter J anything from
W - J to W + J, uniformly: a GPU's kernels and their launches vary, and so the spread the
engine learns and the approach it makes to a predicted end), and no driver, thread or GIL hands-off blurs it. The
loop's other work is modelled too: a request spends ``CHUNKS`` microseconds of busy CPU
around its wait, in steps, as a web server's request does (parsing, the enqueue, the
reply). Two ways of waiting, in windows of the same load, there and back:

* ``lanes``: the engine's wait (what ``await lane`` runs), a stream per request in flight;
* ``poll``: ``while not query(): await asyncio.sleep(0)``.

Loads: ``open`` (requests started at a fixed rate) and ``closed`` (64 tasks, each one
request after another: saturation). It wraps private functions of the engine: a probe for
A/Bs of the engine's logic, whose findings a GPU run must confirm.
"""

# How far to trust it: with kernels ending at W exactly, the model put the final approach
# in the waiting task (6b1e3d9) at -3% to +7% of CPU per request, where the H200 measured
# +14-23% (benchmarks/results/logs/final-approach-ab.txt). With --jitter 1 (W = 5, 1000
# requests/s here) it ordered the three engines as the GPU did: CPU 707 (c7ece8c) < 727
# (idle re-park, 9c0a924) < 837 us (final approach) on asyncio, 690 < 699 < 804 on
# uvloop; the median lateness 0.15 > 0.077 > 0.028 ms, and 0.16 > 0.082 > 0.033.

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Generator
from typing import Any

from aiocuda._completion import poller as poller_module
from aiocuda._completion.engine import CompletionEngine, Waiter, current_engine
from aiocuda.device import Device
from benchmarks.serve import percentile

__all__ = ["measure"]

CHUNKS = (120e-6, 60e-6, 60e-6, 120e-6)
"""A request's busy CPU (seconds) before its body, before its enqueue, after its wait and
after a yield: about the serve benchmark's server work per request on the H200."""
STREAMS = 33  # lanes: a quarter of an H100's SMs
CLOSED_TASKS = 64
WARM_UP = 0.3  # seconds of the same load before each window, not counted

_perf = time.perf_counter


class _Kernel:
    """A point in a stream that is reached at ``deadline``."""

    __slots__ = ("deadline",)

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline


def _query(kernel: _Kernel) -> bool:
    return _perf() >= kernel.deadline


class _Wait:
    """``await _Wait(...)``: the engine's wait for ``kernel`` on stream ``key``."""

    __slots__ = ("device", "engine", "kernel", "key")

    def __init__(self, engine: CompletionEngine, device: Device, kernel: _Kernel, key: int) -> None:
        self.engine, self.device, self.kernel, self.key = engine, device, kernel, key

    def __await__(self) -> Generator[Any, Any, None]:
        return self.engine.wait(self.kernel, self.key, self.device, just_recorded=True)


def _busy(seconds: float) -> None:
    end = _perf() + seconds
    while _perf() < end:
        pass


class _Model:
    """The engine, its counts of where waits ended, and the two ways of waiting."""

    def __init__(self, jitter: float) -> None:
        self.jitter = jitter
        self.random = random.Random(0)
        self.engine = current_engine()
        self.engine.query = _query  # type: ignore[assignment]
        self.device = Device(0)
        self.late: list[float] = []
        self.found_by_task = 0
        found = self.engine._found

        def counted(waiter: Waiter, now: float) -> None:
            self.found_by_task += 1
            found(waiter, now)

        self.engine._found = counted  # type: ignore[method-assign]

    async def wait(self, way: str, seconds: float, key: int) -> None:
        kernel = _Kernel(_perf() + seconds + self.random.uniform(-self.jitter, self.jitter))
        if way == "lanes":
            await _Wait(self.engine, self.device, kernel, key)
        elif way == "oracle":  # told the kernel's end: one timer, then polling
            await asyncio.sleep(kernel.deadline - _perf())
            while not _query(kernel):  # noqa: ASYNC110 - (a late timer is rare)
                await asyncio.sleep(0)
        else:
            while not _query(kernel):  # noqa: ASYNC110 - the polling baseline
                await asyncio.sleep(0)
        self.late.append(_perf() - kernel.deadline)

    async def request(self, way: str, seconds: float, free: list[int]) -> None:
        _busy(CHUNKS[0])
        await asyncio.sleep(0)  # the body
        _busy(CHUNKS[1])
        if not free:
            raise SystemExit(f"more than {STREAMS} requests in flight: this machine cannot keep up, lower --rate")
        key = free.pop()
        try:
            await self.wait(way, seconds, key)
        finally:
            free.append(key)
        _busy(CHUNKS[2])
        await asyncio.sleep(0)  # the reply
        _busy(CHUNKS[3])

    async def open_window(self, way: str, seconds: float, rate: float, length: float) -> int:
        free = list(range(STREAMS))
        tasks = []
        start = _perf()
        for i in range(int(rate * length)):
            delay = start + i / rate - _perf()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(self.request(way, seconds, free)))
        await asyncio.gather(*tasks)
        return len(tasks)

    async def closed_window(self, way: str, seconds: float, length: float) -> int:
        stop = _perf() + length
        served = [0]

        async def client(key: int) -> None:
            while _perf() < stop:
                _busy(CHUNKS[0] / 4)
                await self.wait(way, seconds, key)
                _busy(CHUNKS[3] / 4)
                served[0] += 1

        await asyncio.gather(*(client(key) for key in range(CLOSED_TASKS)))
        return served[0]

    async def window(self, way: str, load: str, seconds: float, rate: float, length: float) -> dict[str, float]:
        """One window's figures, after a warm-up of the same load."""
        await self.served(way, load, seconds, rate, WARM_UP)
        self.late, self.found_by_task = [], 0
        cpu, wall = time.process_time(), _perf()
        served = await self.served(way, load, seconds, rate, length)
        wall, cpu = _perf() - wall, time.process_time() - cpu
        return {
            "req_per_s": served / wall,
            "cpu_us_per_req": 1e6 * cpu / served,
            "late_p50_ms": 1e3 * statistics.median(self.late),
            "late_p99_ms": 1e3 * percentile(self.late, 0.99),
            "found_by_task": self.found_by_task / served,
        }

    async def served(self, way: str, load: str, seconds: float, rate: float, length: float) -> int:
        """Run ``load`` for ``length`` seconds; how many requests it served."""
        if load == "open":
            return await self.open_window(way, seconds, rate, length)
        return await self.closed_window(way, seconds, length)


def measure(
    loop: str, load: str, rate: float, length: float, ws_ms: list[float], jitter_ms: float = 0.0
) -> dict[str, dict[str, Any]]:
    """Windows of ``lanes`` and ``poll`` (there and back) for each kernel length, on
    ``loop``, kernels ending within ``jitter_ms`` of it: ``{ms: {way: [figures of each
    window]}}``."""
    poller_module.RING_AFTER = 60.0  # (no doorbells: the model's kernels have no events)

    async def main() -> dict[str, dict[str, Any]]:
        model = _Model(jitter_ms / 1e3)
        out: dict[str, dict[str, Any]] = {}
        for ms in ws_ms:
            per_way: dict[str, Any] = {}
            for way in ("lanes", "poll", "oracle", "oracle", "poll", "lanes"):
                per_way.setdefault(way, []).append(await model.window(way, load, ms / 1e3, rate, length))
            out[f"{ms:g}"] = per_way
        return out

    if loop == "uvloop":
        import uvloop

        return uvloop.run(main())
    return asyncio.run(main())
