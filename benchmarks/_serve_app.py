"""The server side of ``benchmarks/serve.py``: one Starlette app whose endpoints do the
same GPU work in different ways, run under uvicorn in a process of its own.

Every request uploads its 64 KiB body, runs one kernel that spins ``w`` microseconds
(``?w=``; one block, so the kernels of many requests run side by side) and writes
``2 x + 1``, and downloads 64 KiB into the lane's pinned buffer, which the response
copies. All endpoints lease the same lanes (streams and staging made at start-up) and
enqueue through them; they differ in how they allocate and how they wait:

* ``/lanes``        -- the idiomatic path: scratch from ``setup``, ``await lane``
* ``/lanes_alloc``  -- per-request memory from the pool (``lane.upload``, ``lane.empty``)
* ``/readme``       -- README style: ``await to_device(...)``, ``await to_host()`` (info)
* ``/submit``       -- ``Executor.submit`` (its own lanes)
* ``/batch``        -- ``aiocuda.Batcher``: one launch for every request gathered
* ``/to_thread``    -- ``await asyncio.to_thread(stream.synchronize)``
* ``/blocking``     -- ``stream.synchronize()`` on the loop
* ``/poll``         -- record an event, ``sleep(0)`` until ``event.query()``
* ``/oracle``       -- record an event, sleep W on the loop's timer, then poll it: a wait
  told when its kernel ends, woken once (by a timer, a millisecond coarse: it gives up
  latency for CPU)
* ``/unwaited``     -- a control, not a way to serve: the same enqueue on the next lane of
  a ring leased for good at start-up, answered without waiting for the GPU (the reply is
  the lane's buffer as it stands). It skips the wait and the lease, so polling's figures
  over its own bound what any way of waiting could gain on polling. (A lane comes round
  again a ring's length of requests later, when its last work has long run; a lease's
  lane would be the one just given back, its work still running: see
  ``results/logs/unwaited-control-probe.txt``.)
* ``/torch_lanes``, ``/torch_poll``, ``/torch_to_thread`` -- a two-layer fp16 MLP
  (``TORCH_WIDTH`` wide, ``TORCH_ROWS`` rows per request) on the lane's stream through
  ``interop.torch_stream``, awaited three ways; ``/torch_unwaited``, the same model's
  control as ``/unwaited`` is the kernel's.

The GPU endpoints share one route (a dict picks the handler), so that routing costs
them all the same. The lifespan freezes the start-up heap (``gc.freeze()``), as
``docs/serving.md`` advises.

``/stats`` reports the process's CPU seconds, requests served, the time spent in the
garbage collector, its minor page faults and the loop lag samples since ``/stats/reset``
(a ticker sleeping 1 ms and recording how late it wakes); ``/inprocess_batched`` runs the
batched-vs-per-request comparison without HTTP.

    python benchmarks/_serve_app.py --port 8123 [--torch]      (run by serve.py)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import itertools
import os
import resource
import threading
import time
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from _common import stalls_reported
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import aiocuda
from aiocuda import Batcher, Device, Executor, Lane, Lanes, Program, interop, register_sim_kernel
from aiocuda.errors import BlockingCallWarning
from aiocuda.host import pinned_empty

N = 16384  # float32 values per request: 64 KiB
TORCH_WIDTH = 8192
TORCH_ROWS = 4  # 4 x 8192 fp16: 64 KiB in and out
BLOCK = 256

SOURCE = r"""
extern "C" __global__ void work(const float* x, float* y, int n, long long cycles) {
    if (cycles > 0) {
        long long start = clock64();
        while (clock64() - start < cycles) { }
    }
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) y[i] = 2.0f * x[i] + 1.0f;
}
"""


def _clock_hz() -> float:
    return float(Device(0).attribute("clock_rate")) * 1e3


def _sim_work(launch: object, x: np.ndarray, y: np.ndarray, n: int, cycles: int) -> None:
    if cycles > 0:
        time.sleep(int(cycles) / _clock_hz())
    y[: int(n)] = 2.0 * x[: int(n)] + 1.0


register_sim_kernel("work", _sim_work)


@dataclass
class Scratch:
    """A lane's own buffers, made at start-up."""

    x: aiocuda.DeviceArray
    y: aiocuda.DeviceArray
    out: np.ndarray


class LoopLag:
    """How late a 1 ms sleep wakes, sampled continuously."""

    def __init__(self) -> None:
        self.samples: list[float] = []

    async def run(self) -> None:
        while True:
            start = time.perf_counter()
            await asyncio.sleep(0.001)
            self.samples.append(time.perf_counter() - start - 0.001)


class GcClock:
    """Time the process spends in the cyclic garbage collector, and its full collections."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.full_collections = 0
        self._start = 0.0
        gc.callbacks.append(self._tick)

    def _tick(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start
            self.full_collections += info["generation"] == 2


class Server:
    def __init__(self, with_torch: bool) -> None:
        self.with_torch = with_torch
        self.requests = 0
        self.handled_s: list[float] = []  # each request's time in its endpoint, since /stats/reset
        self.lag = LoopLag()
        self.gc = GcClock()
        self.clock_hz = _clock_hz()
        self.kernel: Any = None
        self.lanes = Lanes(device=0, setup=self.setup)
        self.ring_lanes = Lanes(device=0, setup=self.setup)  # /unwaited's, each leased for good
        self.ring: Iterator[Lane] = iter(())
        self.executor = Executor([0], chunks_per_device=64)
        self.batcher: Batcher[np.ndarray, np.ndarray] = Batcher(self.batch, max_batch=64, max_delay=0.0005)
        self.model: Any = None
        self.torch: Any = None
        # Every GPU endpoint behind one route and a dict: Starlette tries its routes in
        # order, so with a route each, a path further down the list paid a few
        # microseconds more per request than one near the top.
        self.ways: dict[str, Callable[[bytes, int], Awaitable[bytes]]] = {
            "lanes": self.lanes_way,
            "lanes_alloc": self.lanes_alloc,
            "readme": self.readme,
            "submit": self.submit,
            "batch": self.batched,
            "to_thread": self.to_thread,
            "blocking": self.blocking,
            "poll": self.poll,
            "oracle": self.oracle,
            "unwaited": self.unwaited,
            "torch_lanes": self.torch_lanes,
            "torch_poll": self.torch_poll,
            "torch_to_thread": self.torch_to_thread,
            "torch_unwaited": self.torch_unwaited,
        }

    # -- start-up ----------------------------------------------------------------------------
    def setup(self, lane: Lane) -> Scratch:
        scratch = Scratch(lane.empty(N), lane.empty(N), pinned_empty(N, np.float32))
        if self.model is not None:
            self.torch_enqueue(lane, np.zeros(TORCH_ROWS * TORCH_WIDTH, np.float16).tobytes())
        return scratch

    def load_torch(self) -> None:
        import torch

        self.torch = torch
        torch.manual_seed(0)
        layers = [torch.nn.Linear(TORCH_WIDTH, TORCH_WIDTH), torch.nn.ReLU(), torch.nn.Linear(TORCH_WIDTH, TORCH_WIDTH)]
        self.model = torch.nn.Sequential(*layers).to("cuda", torch.float16).eval()
        torch.cuda.synchronize()

    # -- the shared enqueue step ---------------------------------------------------------------
    def enqueue(self, lane: Lane, body: bytes, cycles: int) -> Scratch:
        s: Scratch = lane.state
        lane.upload(np.frombuffer(body, np.float32), out=s.x)
        self.kernel.launch(1, BLOCK, s.x, s.y, N, cycles, stream=lane.stream)
        lane.download(s.y, out=s.out)
        return s

    def torch_enqueue(self, lane: Lane, body: bytes) -> np.ndarray:
        torch = self.torch
        host = np.frombuffer(body, np.float16).reshape(TORCH_ROWS, TORCH_WIDTH)
        x = lane.upload(host)
        with interop.torch_stream(lane.stream), torch.inference_mode():
            y = self.model(torch.from_dlpack(x))
            return lane.download(interop.as_device_array(y, stream=lane.stream))

    # -- the ways: one request's work, from its body and the kernel's cycles to its reply's -----
    async def lanes_way(self, body: bytes, cycles: int) -> bytes:
        async with self.lanes.lease() as lane:
            s = self.enqueue(lane, body, cycles)
            await lane
            return self.reply(s.out)

    async def lanes_alloc(self, body: bytes, cycles: int) -> bytes:
        async with self.lanes.lease() as lane:
            x = lane.upload(np.frombuffer(body, np.float32))
            y = lane.empty(N)
            self.kernel.launch(1, BLOCK, x, y, N, cycles, stream=lane.stream)
            out = lane.download(y, out=lane.state.out)
            await lane
            return self.reply(out)

    async def readme(self, body: bytes, cycles: int) -> bytes:
        async with self.lanes.lease() as lane:
            x = await aiocuda.to_device(np.frombuffer(body, np.float32), stream=lane.stream)
            y = aiocuda.empty(N, stream=lane.stream)
            self.kernel.launch(1, BLOCK, x, y, N, cycles, stream=lane.stream)
            return self.reply(await y.to_host(stream=lane.stream))

    async def submit(self, body: bytes, cycles: int) -> bytes:
        def stage(ctx: Any, x: aiocuda.DeviceArray) -> aiocuda.DeviceArray:
            y = ctx.empty(N)
            self.kernel.launch(1, BLOCK, x, y, N, cycles, stream=ctx.stream)
            return y

        return self.reply(await self.executor.submit(stage, np.frombuffer(body, np.float32)))

    async def batch(self, items: list[np.ndarray]) -> list[np.ndarray]:
        flat = np.concatenate(items)
        n = flat.size
        async with self.lanes.lease() as lane:
            x = lane.upload(flat)
            y = lane.empty(n)
            self.kernel.launch(min(1024, (n + BLOCK - 1) // BLOCK), BLOCK, x, y, n, 0, stream=lane.stream)
            out = lane.download(y)
            await lane
        return list(out.reshape(len(items), -1))  # the benchmark's items are all one size

    async def batched(self, body: bytes, cycles: int) -> bytes:
        return self.reply(await self.batcher.submit(np.frombuffer(body, np.float32)))

    # The baselines: the same enqueue, another way to wait. They call the lane's private
    # _settle() (what ``await lane`` does after its wait) so that the lease does not hold
    # their pinned output for them: the same work as /lanes after the wait.
    async def to_thread(self, body: bytes, cycles: int) -> bytes:
        async with self.lanes.lease() as lane:
            s = self.enqueue(lane, body, cycles)
            await asyncio.to_thread(lane.stream.synchronize)
            lane._settle()
            return self.reply(s.out)

    async def blocking(self, body: bytes, cycles: int) -> bytes:
        async with self.lanes.lease() as lane:
            s = self.enqueue(lane, body, cycles)
            with warnings.catch_warnings():  # blocking the loop is this baseline's point
                warnings.simplefilter("ignore", BlockingCallWarning)
                lane.stream.synchronize()
            lane._settle()
            return self.reply(s.out)

    async def poll(self, body: bytes, cycles: int) -> bytes:
        async with self.lanes.lease() as lane:
            s = self.enqueue(lane, body, cycles)
            event = lane.stream.record()
            while not event.query():  # noqa: ASYNC110 - the polling baseline
                await asyncio.sleep(0)
            lane._settle()
            return self.reply(s.out)

    async def oracle(self, body: bytes, cycles: int) -> bytes:
        async with self.lanes.lease() as lane:
            s = self.enqueue(lane, body, cycles)
            event = lane.stream.record()
            await asyncio.sleep(cycles / self.clock_hz)  # the kernel's own length, known beforehand
            while not event.query():  # noqa: ASYNC110 - (rarely: the kernel started late)
                await asyncio.sleep(0)
            lane._settle()
            return self.reply(s.out)

    async def unwaited(self, body: bytes, cycles: int) -> bytes:
        lane = next(self.ring)
        s = self.enqueue(lane, body, cycles)
        lane._settle()  # (its staging is reused a ring's length of requests later)
        return self.reply(s.out)

    async def torch_lanes(self, body: bytes, cycles: int) -> bytes:
        async with self.lanes.lease() as lane:
            out = self.torch_enqueue(lane, body)
            await lane
        return self.reply(out)

    async def torch_poll(self, body: bytes, cycles: int) -> bytes:
        async with self.lanes.lease() as lane:
            out = self.torch_enqueue(lane, body)
            with interop.torch_stream(lane.stream):
                event = self.torch.cuda.Event()
                event.record()
            while not event.query():  # noqa: ASYNC110 - the polling baseline
                await asyncio.sleep(0)
            lane._settle()
        return self.reply(out)

    async def torch_to_thread(self, body: bytes, cycles: int) -> bytes:
        async with self.lanes.lease() as lane:
            out = self.torch_enqueue(lane, body)
            await asyncio.to_thread(lane.stream.synchronize)
            lane._settle()
        return self.reply(out)

    async def torch_unwaited(self, body: bytes, cycles: int) -> bytes:
        lane = next(self.ring)
        out = self.torch_enqueue(lane, body)
        lane._settle()
        # The upload's memory is the lease's to free, and this lease never ends: end it
        # and begin it again (stream-ordered frees, no wait).
        lane._end()
        lane._begin("normal")
        return self.reply(out)

    # -- HTTP ----------------------------------------------------------------------------------
    async def dispatch(self, request: Request) -> Response:
        way = self.ways.get(request.path_params["endpoint"])
        if way is None:
            return Response(status_code=404)
        start = time.perf_counter()
        cycles = int(float(request.query_params.get("w", "0")) * 1e-6 * self.clock_hz)
        response = Response(await way(await request.body(), cycles), media_type="application/octet-stream")
        self.handled_s.append(time.perf_counter() - start)
        return response

    def reply(self, out: np.ndarray) -> bytes:
        """The response's body, copied while the request still holds its memory."""
        self.requests += 1
        return out.tobytes()

    # -- measurement ---------------------------------------------------------------------------
    async def stats(self, request: Request) -> JSONResponse:
        times = os.times()
        return JSONResponse(
            {
                "cpu_s": times.user + times.system,
                "threads": thread_cpu(),
                "requests": self.requests,
                "lag_s": self.lag.samples,
                "handled_s": self.handled_s,
                "gc_s": self.gc.seconds,
                "full_gcs": self.gc.full_collections,
                "minor_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt,
            }
        )

    async def reset(self, request: Request) -> JSONResponse:
        self.lag.samples = []
        self.handled_s = []
        return JSONResponse({"ok": True})

    async def health(self, request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "torch": self.model is not None})

    async def inprocess_batched(self, request: Request) -> JSONResponse:
        """Per-request launches against the batcher, without HTTP: ``tasks`` tasks each
        making ``per_task`` requests of the W = 0 work on ``floats`` values (at most N),
        interleaved rounds."""
        tasks = int(request.query_params.get("tasks", "64"))
        per_task = int(request.query_params.get("per_task", "50"))
        rounds = int(request.query_params.get("rounds", "3"))
        n = min(N, int(request.query_params.get("floats", str(N))))
        body = np.ones(n, np.float32)

        async def per_request() -> None:
            async with self.lanes.lease() as lane:
                s: Scratch = lane.state
                x, y = s.x[:n], s.y[:n]
                lane.upload(body, out=x)
                self.kernel.launch(1, BLOCK, x, y, n, 0, stream=lane.stream)
                lane.download(y, out=s.out[:n])
                await lane

        async def batched() -> None:
            await self.batcher.submit(body)

        async def drive(one: Any) -> float:
            async def task() -> None:
                for _ in range(per_task):
                    await one()

            start = time.perf_counter()
            await asyncio.gather(*(task() for _ in range(tasks)))
            return tasks * per_task / (time.perf_counter() - start)

        out: dict[str, list[float]] = {"per_request": [], "batched": []}
        for _ in range(rounds + 1):  # the first round warms up
            for name, one in (("per_request", per_request), ("batched", batched)):
                out[name].append(await drive(one))
        return JSONResponse({name: values[1:] for name, values in out.items()})

    # -- the app -------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        module = await asyncio.to_thread(Program(SOURCE, name="serve_work.cu").compile)
        self.kernel = module.kernel("work")
        await self.kernel.load(0)
        if self.with_torch:
            self.load_torch()
        ticker = asyncio.ensure_future(self.lag.run())
        with profiled(os.environ.get("SERVE_PROFILE")):
            async with stalls_reported(), self.lanes, self.ring_lanes, self.executor, self.batcher:
                async with contextlib.AsyncExitStack() as leases:
                    count = self.ring_lanes.statistics().lanes
                    ring = [await leases.enter_async_context(self.ring_lanes.lease()) for _ in range(count)]
                    self.ring = itertools.cycle(ring)
                    gc.collect()  # what start-up left behind, then
                    gc.freeze()  # the rest out of every later collection (docs/serving.md)
                    yield
        ticker.cancel()

    def app(self) -> Starlette:
        routes = [
            Route("/{endpoint}", self.dispatch, methods=["POST"]),
            Route("/stats", self.stats),
            Route("/stats/reset", self.reset, methods=["POST"]),
            Route("/health", self.health),
            Route("/inprocess_batched", self.inprocess_batched),
        ]
        return Starlette(routes=routes, lifespan=self.lifespan)


@contextlib.contextmanager
def profiled(path: str | None) -> Iterator[None]:
    """With a path: the loop thread's cProfile while serving, written there at shutdown."""
    if not path:
        yield
        return
    import cProfile

    profiler = cProfile.Profile()
    profiler.enable()
    try:
        yield
    finally:
        profiler.disable()
        profiler.dump_stats(path)


def thread_cpu() -> dict[str, float]:
    """CPU seconds of each thread of this process, by name: Python threads by their
    ``threading`` name (the loop's is ``MainThread``), others by the kernel's ``comm``
    (the CUDA driver's own threads among them)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        name = names.get(int(tid), comm)
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def lag_p99_ms(samples: list[float]) -> float:
    if not samples:
        return 0.0
    ordered = sorted(samples)
    return 1e3 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    p.add_argument("--torch", action="store_true")
    p.add_argument("--cpus", default="", help="comma-separated CPUs to run on")
    args = p.parse_args()
    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    import uvicorn

    server = Server(args.torch)
    uvicorn.run(
        server.app(),
        host="127.0.0.1",
        port=args.port,
        loop=args.loop,
        http="h11" if os.environ.get("SERVE_HTTP") == "h11" else "auto",
        log_level="warning",
        access_log=False,
        backlog=4096,
        timeout_keep_alive=600,  # the clients keep their connections across windows
    )


if __name__ == "__main__":
    main()
