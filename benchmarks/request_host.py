"""The request path's host cost without HTTP: loop-thread microseconds and driver calls per request.

Over HTTP (``benchmarks/serve.py``) the server is CPU-bound at saturation, so what one
way of serving costs the loop's thread per request decides its throughput, and the
HTTP stack's share (the larger part) hides where the difference comes from. This runs
the serve benchmark's own ways (``_serve_app.Server``: same lanes, kernel and 64 KiB
requests) in-process: ``TASKS`` tasks each making requests back to back, the kernel
spinning ``--w`` microseconds (default 0: the host cost alone), and reports per way and
loop:

* ``us_per_request`` -- the loop thread's CPU time per request (``time.thread_time``);
* ``seam_calls_per_request`` -- driver calls, by name (a real driver call costs ~1-3 us;
  the kernel launch goes through a prepared launcher on a GPU and is not counted);
* ``seam_us_per_request`` -- the wall time inside those calls.

The ways run interleaved, the order rotating from round to round (``--rounds``);
figures are the medians of the rounds, each kept beside it. ``--profile DIR`` adds one
window per way under ``cProfile`` and writes its 40 costliest functions to
``DIR/<loop>-<way>.txt``. The results file (``request_host.json``) is written only from a
full run on a real GPU.

    PYTHONPATH=src python3 benchmarks/request_host.py [--quick] [--ways lanes submit ...]
"""

from __future__ import annotations

import asyncio
import collections
import cProfile
import gc
import importlib.util
import io
import pathlib
import pstats
import sys
import time
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import Result, SeamMeter, parser  # noqa: E402

WAYS = ["lanes", "lanes_alloc", "submit", "poll", "unwaited"]
TASKS = 64
BODY = bytes(64 << 10)


async def window(way: Any, args: Any, cycles: int, per_task: int | None = None) -> int:
    """One window of requests: closed-loop (``TASKS`` tasks back to back), or open-loop at
    ``args.rate`` per second; returns how many were made."""
    per_task = args.per_task if per_task is None else per_task
    if not args.rate:

        async def task() -> None:
            for _ in range(per_task):
                await way(BODY, cycles)

        await asyncio.gather(*(task() for _ in range(TASKS)))
        return TASKS * per_task
    loop = asyncio.get_running_loop()
    count = TASKS * per_task
    start = loop.time()
    made = []
    for i in range(count):  # each request sent when due, whatever the others do
        delay = start + i / args.rate - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        made.append(asyncio.ensure_future(way(BODY, cycles)))
    await asyncio.gather(*made)
    return count


async def measure(args: Any, meter: SeamMeter) -> dict[str, Any]:
    """{way: {figure: [per round]}} and, with ``--profile``, the profiles' text."""
    from _serve_app import Server

    server = Server(with_torch=False)
    cycles = int(args.w * 1e-6 * server.clock_hz)
    figures: dict[str, dict[str, list[float]]] = {way: collections.defaultdict(list) for way in args.ways}
    calls: dict[str, collections.Counter[str]] = {way: collections.Counter() for way in args.ways}
    profiles: dict[str, str] = {}
    async with server.lifespan(None):  # type: ignore[arg-type]  # (the app is not used)
        for way in args.ways:  # warm-up: pools, launchers, predictions
            await window(server.ways[way], args, cycles, max(1, args.per_task // 4))
        for round_ in range(args.rounds):
            shift = round_ % len(args.ways)
            for way in args.ways[shift:] + args.ways[:shift]:
                gc.collect()
                meter.reset()
                before = time.thread_time()
                requests = await window(server.ways[way], args, cycles)
                spent = time.thread_time() - before
                figures[way]["us_per_request"].append(1e6 * spent / requests)
                figures[way]["seam_us_per_request"].append(1e6 * meter.seconds / requests)
                figures[way]["seam_calls_per_request"].append(sum(meter.calls.values()) / requests)
                calls[way] += meter.calls
        if args.profile:
            for way in args.ways:
                profiler = cProfile.Profile()
                with profiler:
                    await window(server.ways[way], args, cycles)
                text = io.StringIO()
                pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
                profiles[way] = text.getvalue()
    requests = TASKS * args.per_task * args.rounds
    by_name = {way: {n: round(c / requests, 3) for n, c in sorted(calls[way].items())} for way in args.ways}
    return {"figures": figures, "calls": by_name, "profiles": profiles}


def run_loop(loop: str, args: Any, meter: SeamMeter) -> dict[str, Any]:
    if loop == "uvloop":
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(measure(args, meter))
    return asyncio.run(measure(args, meter))


def main() -> None:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--ways", nargs="+", default=WAYS, help=f"ways to measure (default: {' '.join(WAYS)})")
    p.add_argument("--loops", nargs="+", default=["asyncio", "uvloop"], choices=["asyncio", "uvloop"])
    p.add_argument("--w", type=float, default=0.0, help="microseconds the kernel spins (default 0)")
    p.add_argument("--rate", type=float, default=0.0, help="open loop: requests per second (default: closed loop)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--per-task", type=int, default=100, help="requests per task and window (default 100)")
    p.add_argument("--profile", type=pathlib.Path, default=None, help="a folder for one profile per way")
    args = p.parse_args()
    if args.quick:
        args.rounds, args.per_task = 2, 10
    if "uvloop" in args.loops and importlib.util.find_spec("uvloop") is None:
        args.loops.remove("uvloop")
    from aiocuda import _driver

    meter = SeamMeter(_driver.driver())  # (before anything binds the backend's methods)
    result = Result("request_host")
    for loop in args.loops:
        measured = run_loop(loop, args, meter)
        for way, figures in measured["figures"].items():
            for figure, values in figures.items():
                result.metric(f"{loop}.{way}.{figure}", values, digits=2)
            result.extra.setdefault("calls", {})[f"{loop}.{way}"] = measured["calls"][way]
        for way in ("lanes_alloc", "submit"):
            if way in args.ways and "lanes" in args.ways:
                extra = [
                    a - b
                    for a, b in zip(
                        measured["figures"][way]["us_per_request"],
                        measured["figures"]["lanes"]["us_per_request"],
                        strict=True,
                    )
                ]
                result.metric(f"{loop}.{way}_over_lanes_us", extra, digits=2)
        if args.profile:
            args.profile.mkdir(parents=True, exist_ok=True)
            for way, text in measured["profiles"].items():
                (args.profile / f"{loop}-{way}.txt").write_text(text)
    result.extra["config"] = {
        "tasks": TASKS,
        "per_task": args.per_task,
        "w_us": args.w,
        "rate": args.rate,
        "rounds": args.rounds,
    }
    result.write(args.out)


if __name__ == "__main__":
    main()
