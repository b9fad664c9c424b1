"""The request path under a real web server: aiocuda's ways against today's, same GPU work.

A uvicorn server (``benchmarks/_serve_app.py``: Starlette, asyncio then uvloop) runs in a
process of its own, pinned to 4 CPUs; 4 client processes (``_serve_client.py``) on the
other CPUs send 64 KiB requests over keep-alive loopback connections. Each request
uploads its body, runs a one-block kernel spinning W ms, and downloads 64 KiB. The
endpoints, all on the same request lanes and the same kernel, differ in how they wait
and allocate (see ``_serve_app.py``): the idiomatic path (``/lanes``: one ``await
lane``), per-request memory (``/lanes_alloc``), README style (``/readme``, 2 awaits),
``Executor.submit``, and the baselines ``asyncio.to_thread(synchronize)``, a blocking
synchronize and polling ``event.query()`` with ``sleep(0)``; and ``/oracle``, which
sleeps exactly W on the loop's timer before it polls: a wait that is told when its kernel
ends and is woken once, to show how far knowing that could take the ratios to polling
(``oracle_*`` metrics); and ``/unwaited``, a control that does the same enqueue without a
lease and answers without waiting for the GPU at all: polling's throughput and CPU per
request against its own bound what any way of waiting could gain on polling
(``unwaited_*`` metrics).

Per loop and W (1 and 5 ms), in each of 3 rounds (``--rounds``), closed-loop windows (64
connections, saturation; 0.4 s each) measure every pair compared (``WORK``: the
idiomatic path against polling, ``to_thread``, ``submit``, per-request memory...) in a
block of its own, A B B A, the pairs' order rotating from round to round: the machine's
speed drifts and jumps over seconds, so a ratio comes from windows a second apart, a
linear drift weighing alike on both. Then open-loop windows there and back (O U L P P L
U O: the pair compared adjacent), each of them whole (a tail latency needs many
samples; requests due at half the polling endpoint's saturation rate of that round,
each sent when due: the clients spin through the last 2 ms before it, a loop's timers
being a millisecond coarse) for ``/oracle``, ``/unwaited``, ``/lanes`` and ``/poll``.
Ratios are taken per round and reported as their median, each target with its rounds'
values. CPU per request is the server process's own CPU time (every thread)
over the requests it served in the window (per thread too, in the baselines, and the
part spent in the garbage collector, and its minor page faults); loop lag is how late a
1 ms sleep on the server's loop wakes. The open-loop windows also report how long
requests spent in their endpoint by the server's clock (``handled_p50_ms``,
``handled_p99_ms``): the part of the client's latency that the way of waiting can
change, without HTTP, queueing for the loop and the client.

Throughput is compared at saturation; CPU per request at the same offered rate (the
open-loop windows). At saturation the server is CPU-bound, so its CPU per request is
the inverse of its throughput and says nothing more (it is reported as
``..._saturated``); at a fixed rate it shows what each way of waiting burns while the
loop has time to spare -- polling spins it, the doorbell lets it sleep.

Also: a launch-bound case (W = 0) with ``/batch`` (``aiocuda.Batcher``) against
``/lanes`` over HTTP (reported), and ``serve_batched_speedup`` measured in the server
process without HTTP (64 tasks, per-request launches against the batcher, 1 KiB
requests: over HTTP the server's per-request parsing and serialising dominate both;
``batched_speedup_64k`` beside it with 64 KiB requests); and with PyTorch installed,
a two-layer fp16 MLP (8192 wide, 4 rows) per request, through ``interop.torch_stream``
on lanes warmed up in the lifespan, awaited with ``await lane`` against polling a torch
event and ``to_thread`` (CPU per request again at a fixed rate: half of ``/torch_poll``'s
saturation rate), with ``/torch_unwaited`` as the model's control (``torch_unwaited_*``
metrics: the ceiling of the torch targets), plus the loop's worst gap during the very first torch requests after
start-up, sent at a light load over a few connections (``FIRST_RATE`` per second: at saturation
every loop iteration serves many requests and the lag is the iteration's length,
whatever the first requests do).

    PYTHONPATH=src python3 benchmarks/serve.py            # GPU: writes results/serve.json
    PYTHONPATH=src python3 benchmarks/serve.py --loops asyncio --rounds 5            # in two parts,
    PYTHONPATH=src python3 benchmarks/serve.py --loops uvloop --rounds 5 --merge     # one call each
    AIOCUDA_BACKEND=sim PYTHONPATH=src python3 benchmarks/serve.py --quick   # smoke run

Results are written only from a real GPU, and never with ``--quick``.
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import multiprocessing
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import Result, parser  # noqa: E402
from _serve_client import serve_commands  # noqa: E402

WORK = [
    ("lanes", "poll"),
    ("lanes", "to_thread"),
    ("submit", "lanes"),
    ("lanes_alloc", "lanes"),
    ("readme", "lanes"),
    ("oracle", "poll"),
    ("unwaited", "poll"),
    ("blocking", "poll"),
]
"""The closed-loop windows' pairs (a, b): each measured in a block of its own, ``a b b a``."""
TINY = [("batch", "lanes"), ("lanes", "poll")]
LAUNCH_BOUND_FLOATS = 256
"""Values per request of ``serve_batched_speedup``'s work: 1 KiB, so that a request's cost
is its launch and copies' overhead, not moving its data (the issue's "kernel whose cost is
mostly launch overhead"); ``batched_speedup_64k`` reports the 64 KiB requests beside it,
where concatenating and splitting the batch's data weighs as much as the launches saved."""
TORCH = [("torch_lanes", "torch_poll"), ("torch_lanes", "torch_to_thread"), ("torch_unwaited", "torch_poll")]
# Open-loop windows, there and back: the pair compared sits in the middle (O U L P P L U O),
# measured in adjacent windows. The rate: half of the last endpoint's saturation rate.
OPEN = ["oracle", "unwaited", "lanes", "poll"]
TORCH_OPEN = ["torch_unwaited", "torch_lanes", "torch_poll"]
FIRST_RATE = 200.0  # requests per second of the first torch requests: a light load
FIRST_SECONDS = 0.5
FIRST_CONNECTIONS = 4  # (connected before the window, as for every window: _serve_client.connect)
CONNECTIONS = 64
BODY = bytes(64 << 10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Server:
    """The server process and HTTP calls to its control endpoints."""

    def __init__(self, loop: str, with_torch: bool, cpus: Sequence[int]) -> None:
        self.port = free_port()
        env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="32", PYTHONUNBUFFERED="1")
        args = [sys.executable, str(HERE / "_serve_app.py"), "--port", str(self.port), "--loop", loop]
        if with_torch:
            args.append("--torch")
        if cpus:
            args += ["--cpus", ",".join(map(str, cpus))]
        self.process = subprocess.Popen(args, env=env)
        deadline = time.monotonic() + 300
        while True:
            try:
                self.get("/health")
                return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the benchmark server did not start (exit code {self.process.poll()})"
                    ) from None
                time.sleep(0.2)

    def call(self, method: str, path: str) -> Any:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        try:
            conn.request(method, path)
            return json.loads(conn.getresponse().read())
        finally:
            conn.close()

    def get(self, path: str) -> Any:
        return self.call("GET", path)

    def stop(self) -> None:
        self.process.terminate()  # SIGTERM: uvicorn's graceful shutdown
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()


class Clients:
    """Client processes, each pinned to CPUs of its own, run commands together."""

    def __init__(self, groups: list[list[int]]) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.pipes = []
        self.processes = []
        for cpus in groups:
            mine, theirs = ctx.Pipe()
            process = ctx.Process(target=serve_commands, args=(theirs, cpus), daemon=True)
            process.start()
            self.pipes.append(mine)
            self.processes.append(process)

    def run(self, kind: str, **args: Any) -> list[dict[str, Any]]:
        for pipe in self.pipes:
            pipe.send((kind, args))
        results = [pipe.recv() for pipe in self.pipes]
        errors = [r["error"] for r in results if "error" in r]
        if errors:
            raise RuntimeError(f"a client failed: {errors[0]}")
        return results

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.send(None)
        for process in self.processes:
            process.join(10)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def window(
    server: Server, clients: Clients, kind: str, path: str, connections: int = CONNECTIONS, **args: Any
) -> dict[str, float]:
    """One measurement: reset the server's counters, run every client, read them back.
    ``connections``: in flight at once (closed loop), half the pool of an open loop."""
    per_client = max(1, connections // len(clients.pipes))
    clients.run("connect", port=server.port, connections=per_client if kind == "closed" else 2 * per_client)
    server.call("POST", "/stats/reset")
    before = server.get("/stats")
    if kind == "closed":
        results = clients.run("closed", port=server.port, path=path, body=BODY, connections=per_client, **args)
    else:
        rate = args.pop("rate") / len(clients.pipes)
        results = clients.run("open", port=server.port, path=path, body=BODY, rate=rate, pool=2 * per_client, **args)
    after = server.get("/stats")
    done = sum(r["done"] for r in results)
    failed = sum(r["failed"] for r in results)
    if failed:
        raise RuntimeError(f"{failed} requests to {path} failed")
    latencies = [x for r in results for x in r["latencies"]]
    served = max(1, after["requests"] - before["requests"])
    lags = after["lag_s"]
    threads = {name: 1e3 * (cpu - before["threads"].get(name, 0.0)) / served for name, cpu in after["threads"].items()}
    return {
        "req_per_s": done / max(r["seconds"] for r in results),
        "cpu_ms_per_req": 1e3 * (after["cpu_s"] - before["cpu_s"]) / served,
        "lat_p50_ms": 1e3 * percentile(latencies, 0.5),
        "lat_p99_ms": 1e3 * percentile(latencies, 0.99),
        # (the part of a request's latency spent in its endpoint, from the server's clock)
        "handled_p50_ms": 1e3 * percentile(after["handled_s"], 0.5),
        "handled_p99_ms": 1e3 * percentile(after["handled_s"], 0.99),
        "lag_p99_ms": 1e3 * percentile(lags, 0.99) if lags else 0.0,
        "lag_max_ms": 1e3 * max(lags) if lags else 0.0,
        "gc_ms_per_req": 1e3 * (after["gc_s"] - before["gc_s"]) / served,
        "full_gc_per_1k_req": 1e3 * (after["full_gcs"] - before["full_gcs"]) / served,
        "minor_faults_per_req": (after["minor_faults"] - before["minor_faults"]) / served,
        **{f"thread_cpu_ms_per_req.{name}": ms for name, ms in threads.items() if ms >= 0.005},
    }


def there_and_back(
    server: Server, clients: Clients, kind: str, endpoints: list[str], w_us: int, seconds: float, **args: Any
) -> dict[str, dict[str, float]]:
    """Each endpoint's figures over two windows of ``seconds`` at ``?w=w_us``, one in
    ``endpoints``' order and one in the reverse order (A B C C B A), each figure the mean
    of the two: the machine's speed drifts over seconds (a window's CPU per request
    varied by up to 40% from one window to the next on the H200 machine, for every
    endpoint alike), and a drift that is linear in time then weighs the same on every
    endpoint."""

    def measure(endpoint: str) -> dict[str, float]:
        return window(server, clients, kind, f"/{endpoint}?w={w_us}", seconds=seconds, **args)

    there = {endpoint: measure(endpoint) for endpoint in endpoints}
    back = {endpoint: measure(endpoint) for endpoint in reversed(endpoints)}
    return {endpoint: mean_figures([there[endpoint], back[endpoint]]) for endpoint in endpoints}


def mean_figures(windows: list[dict[str, float]]) -> dict[str, float]:
    """Each figure's mean over ``windows`` (0 where a window lacks it: a thread that did
    not run there)."""
    return {key: statistics.fmean(w.get(key, 0.0) for w in windows) for key in {k for w in windows for k in w}}


def paired(
    server: Server, clients: Clients, pairs: list[tuple[str, str]], w_us: int, seconds: float
) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """Closed-loop windows of ``seconds`` at ``?w=w_us``, each pair (a, b) in a block of
    four: a b b a. Returns each endpoint's figures (the mean of its windows) and each
    pair's ratios ``"a/b"`` of throughput and CPU per request, from its block alone: the
    machine's speed drifts and jumps over seconds (a window's CPU per request varied by
    up to 40% from one window to the next on the H200 machine, for every endpoint alike),
    so a ratio is taken between windows a second apart, and a linear drift within the
    block weighs the same on both."""
    windows: dict[str, list[dict[str, float]]] = {}
    ratios: dict[str, dict[str, float]] = {}
    for a, b in pairs:
        block = [(e, window(server, clients, "closed", f"/{e}?w={w_us}", seconds=seconds)) for e in (a, b, b, a)]
        for endpoint, figures in block:
            windows.setdefault(endpoint, []).append(figures)
        (_, a1), (_, b1), (_, b2), (_, a2) = block
        ratios[f"{a}/{b}"] = {key: (a1[key] + a2[key]) / (b1[key] + b2[key]) for key in ("req_per_s", "cpu_ms_per_req")}
    return {endpoint: mean_figures(runs) for endpoint, runs in windows.items()}, ratios


def rotated(items: list[Any], by: int) -> list[Any]:
    by %= len(items)
    return items[by:] + items[:by]


def measure_loop(loop: str, args: Any, clients: Clients, server_cpus: list[int], with_torch: bool) -> dict[str, Any]:
    """Every window of one loop: {scenario: {endpoint: [per-round figures]}}, plus extras."""
    server = Server(loop, with_torch, server_cpus)
    out: dict[str, Any] = {}
    try:
        if with_torch:  # first: the first torch requests after the lifespan's warm-up
            first = window(
                server,
                clients,
                "open",
                "/torch_lanes",
                connections=FIRST_CONNECTIONS,
                rate=FIRST_RATE,
                seconds=FIRST_SECONDS,
            )
            out["torch_first"] = first
        scenarios = [("w1", 1000, WORK), ("w5", 5000, WORK), ("tiny", 0, TINY)]
        if with_torch:
            scenarios.append(("torch", 0, TORCH))
        for round_ in range(args.rounds):
            for name, w_us, pairs in scenarios:
                figures = out.setdefault(name, {})
                closed, block_ratios = paired(server, clients, rotated(pairs, round_), w_us, args.seconds)
                for endpoint, result in closed.items():
                    figures.setdefault(endpoint, []).append(result)
                for pair, result in block_ratios.items():
                    out.setdefault(f"{name}_pairs", {}).setdefault(pair, []).append(result)
                opened = {"w1": OPEN, "w5": OPEN, "torch": TORCH_OPEN}.get(name, [])
                if opened:
                    rate = 0.5 * figures[opened[-1]][-1]["req_per_s"]
                    # (whole windows there and back: the tail latency needs their samples)
                    results = there_and_back(server, clients, "open", opened, w_us, args.open_seconds, rate=rate)
                    for endpoint, result in results.items():
                        figures.setdefault(f"open_{endpoint}", []).append(result)
        rounds = max(1, args.rounds)
        for key, floats in (("inprocess_batched", LAUNCH_BOUND_FLOATS), ("inprocess_batched_64k", 16384)):
            query = f"tasks=64&per_task=50&rounds={rounds}&floats={floats}"
            out[key] = server.get(f"/inprocess_batched?{query}")
    finally:
        server.stop()
    return out


def report(measured: dict[str, dict[str, Any]], result: Result) -> None:
    target = result.target  # each target's value is the median of its rounds, which it keeps

    def ratios(figures: dict[str, list[dict[str, float]]], a: str, b: str, key: str = "req_per_s") -> list[float]:
        return [x[key] / y[key] for x, y in zip(figures[a], figures[b], strict=True)]

    def blocks(data: dict[str, Any], name: str, a: str, b: str, key: str = "req_per_s") -> list[float]:
        """A closed-loop pair's ratios, one per round, each from its own a b b a block."""
        return [r[key] for r in data[f"{name}_pairs"][f"{a}/{b}"]]

    for loop, data in measured.items():
        for name in ("w1", "w5", "tiny", "torch"):
            for endpoint, rounds in data.get(name, {}).items():
                for key in sorted({key for r in rounds for key in r}):  # a thread may be missing from a round
                    value = statistics.median(r.get(key, 0.0) for r in rounds)
                    result.baselines[f"{loop}.{name}.{endpoint}.{key}"] = round(value, 4)
        for name, w_ms in (("w1", 1.0), ("w5", 5.0)):
            f = data[name]
            suffix = f"{loop}_w{int(w_ms)}"
            target(f"serve_throughput_vs_poll_{suffix}", blocks(data, name, "lanes", "poll"), 1.1, ">=")
            target(f"serve_throughput_vs_to_thread_{suffix}", blocks(data, name, "lanes", "to_thread"), 1.5, ">=")
            cpu = ratios(f, "open_lanes", "open_poll", "cpu_ms_per_req")
            target(f"serve_cpu_per_request_vs_poll_{suffix}", cpu, 0.9, "<=")
            saturated = blocks(data, name, "lanes", "poll", "cpu_ms_per_req")
            result.metrics[f"serve_cpu_per_request_vs_poll_saturated_{suffix}"] = round(statistics.median(saturated), 4)
            target(f"serve_submit_vs_direct_{suffix}", blocks(data, name, "submit", "lanes"), 0.9, ">=")
            target(f"serve_alloc_vs_prealloc_{suffix}", blocks(data, name, "lanes_alloc", "lanes"), 0.9, ">=")
            target(f"serve_loop_lag_p99_ms_{suffix}", [r["lag_p99_ms"] for r in f["open_lanes"]], 3.0, "<=")
            over = [r["lat_p99_ms"] - w_ms for r in f["open_lanes"]]
            target(f"serve_latency_p99_over_w_ms_{suffix}", over, 2.0, "<=")
            result.metrics[f"readme_vs_lanes_{suffix}"] = round(
                statistics.median(blocks(data, name, "readme", "lanes")), 4
            )
            for way in ("poll", "oracle"):
                way_over = [r["lat_p99_ms"] - w_ms for r in f[f"open_{way}"]]
                result.metrics[f"{way}_latency_p99_over_w_ms_{suffix}"] = round(statistics.median(way_over), 4)
            for control in ("oracle", "unwaited"):
                for metric, value in (
                    ("throughput_vs_poll", blocks(data, name, control, "poll")),
                    ("cpu_per_request_vs_poll", ratios(f, f"open_{control}", "open_poll", "cpu_ms_per_req")),
                ):
                    result.metrics[f"{control}_{metric}_{suffix}"] = round(statistics.median(value), 4)
        batched = data["inprocess_batched"]
        speedups = [b / p for b, p in zip(batched["batched"], batched["per_request"], strict=True)]
        target(f"serve_batched_speedup_{loop}", speedups, 3.0, ">=")
        batched = data["inprocess_batched_64k"]
        speedups = [b / p for b, p in zip(batched["batched"], batched["per_request"], strict=True)]
        result.metrics[f"batched_speedup_64k_{loop}"] = round(statistics.median(speedups), 4)
        result.metrics[f"batched_http_vs_lanes_{loop}"] = round(
            statistics.median(blocks(data, "tiny", "batch", "lanes")), 4
        )
        if "torch" in data:
            t = data["torch"]
            target(
                f"serve_torch_throughput_vs_poll_{loop}", blocks(data, "torch", "torch_lanes", "torch_poll"), 1.1, ">="
            )
            cpu = ratios(t, "open_torch_lanes", "open_torch_poll", "cpu_ms_per_req")
            target(f"serve_torch_cpu_vs_poll_{loop}", cpu, 0.9, "<=")
            saturated = blocks(data, "torch", "torch_lanes", "torch_poll", "cpu_ms_per_req")
            result.metrics[f"serve_torch_cpu_vs_poll_saturated_{loop}"] = round(statistics.median(saturated), 4)
            result.metrics[f"torch_throughput_vs_to_thread_{loop}"] = round(
                statistics.median(blocks(data, "torch", "torch_lanes", "torch_to_thread")), 4
            )
            for name, value in (
                ("throughput_vs_poll", blocks(data, "torch", "torch_unwaited", "torch_poll")),
                ("cpu_vs_poll", ratios(t, "open_torch_unwaited", "open_torch_poll", "cpu_ms_per_req")),
            ):
                result.metrics[f"torch_unwaited_{name}_{loop}"] = round(statistics.median(value), 4)
            gap = data["torch_first"]["lag_max_ms"]
            result.target(f"serve_torch_first_request_loop_gap_ms_{loop}", gap, 10.0, "<=")


def cpu_plan() -> tuple[list[int], list[list[int]]]:
    """Server CPUs and one CPU group per client process (no pinning on small machines)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 8:
        return [], [[], []]
    server, rest = cpus[:4], cpus[4:]
    groups = 4
    size = len(rest) // groups
    return server, [rest[i * size : (i + 1) * size] for i in range(groups)]


def main() -> None:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--loops", nargs="+", default=["asyncio", "uvloop"], choices=["asyncio", "uvloop"])
    p.add_argument("--rounds", type=int, default=3, help="rounds of every window (default 3; --quick: 1)")
    p.add_argument(
        "--merge",
        action="store_true",
        help="keep the results file's figures of other loops (from an earlier run on the same device)",
    )
    args = p.parse_args()
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.quick:
        args.rounds = 1
    args.seconds = 0.1 if args.quick else 0.4  # (each closed-loop window)
    args.open_seconds = 0.5 if args.quick else 2.0
    from aiocuda import _driver

    on_gpu = _driver.driver().name == "cuda"
    with_torch = on_gpu and importlib.util.find_spec("torch") is not None
    if "uvloop" in args.loops and importlib.util.find_spec("uvloop") is None:
        args.loops.remove("uvloop")
    server_cpus, client_groups = cpu_plan()
    clients = Clients(client_groups)
    measured: dict[str, dict[str, Any]] = {}
    try:
        for loop in args.loops:
            print(f"-- {loop}", flush=True)
            measured[loop] = measure_loop(loop, args, clients, server_cpus, with_torch)
    finally:
        clients.close()
    result = Result("serve")
    report(measured, result)
    result.extra["setup"] = {
        "connections": CONNECTIONS,
        "body_bytes": len(BODY),
        "loops": args.loops,
        "rounds": args.rounds,
        "closed_window_s": args.seconds,
        "open_window_s": args.open_seconds,
        "server_cpus": server_cpus,
        "client_cpus": client_groups,
        "torch": with_torch,
    }
    if on_gpu and not args.quick:
        result.write(args.out, merge=args.merge)
    else:
        result.print_summary(sys.stdout)
        print("(smoke run: results not written)")


if __name__ == "__main__":
    main()
