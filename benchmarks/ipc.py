"""Sharing between processes and strided copies, against the ways users have today.

Two figures of issue 20, merged into ``benchmarks/results/memory.json`` (its other keys
kept; ``memory.py`` writes that file whole, so run this after it):

* ``ipc_handoff_us``: a producer process shares an array (``ipc.share_array``: the
  export and its event) and sends the descriptor over a ``multiprocessing`` pipe; the
  consumer process opens it (``ipc.open_array``), awaits its stream (the first await)
  and answers. The round trip's median, less the pipe's own round trip measured in the
  same rounds (baseline ``pipe_round_trip_us``). The first handoff between two
  processes (connection, pool import) is reported apart: ``ipc_first_handoff_us``.
* ``copy2d_vs_gather``: ``to_host`` of a view of every other row of a square float32
  array into pageable memory -- packed on the device by a 2D copy, then only the view's
  elements downloaded -- against what ``to_host`` did before: the whole byte span
  downloaded and the elements gathered on the host; target >= 2. For the record, the
  same into pinned memory (one 2D DMA) and the case ``to_host`` still gathers (one
  channel of an RGB image), both ways.

Each figure is the median of three runs (each the median of its rounds; contenders
interleaved round by round) with the three runs' spread.

    python benchmarks/ipc.py [--quick]

Results are written only from a full run on a real GPU; the simulator (or ``--quick``)
prints them and keeps nothing.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import numpy as np

import aiocuda
from aiocuda import _driver, ipc
from aiocuda._memory import copies as _copies
from aiocuda._memory import staging as _staging
from aiocuda._util import byte_span

try:
    from benchmarks._common import RESULTS, Result, parser, wall_medians
except ImportError:  # run as a script from the benchmarks folder
    from _common import RESULTS, Result, parser, wall_medians  # type: ignore[no-redef]

RUNS = 3


def _median_of_runs(runs: list[float]) -> tuple[float, list[float]]:
    return statistics.median(runs), [min(runs), max(runs)]


# -- the handoff between two processes -------------------------------------------------------------


def _consumer(conn: Any, backend: str) -> None:
    """The other process: open each descriptor, await its stream, answer the time it took."""
    if backend == "sim":
        _driver.use_backend("sim", devices=1)
    else:
        _driver.use_backend(backend)

    async def main() -> None:
        stream = aiocuda.Stream(0)
        await stream
        while True:
            message = conn.recv()  # this loop serves nothing else: blocking is the fair way
            if message is None:
                return
            if isinstance(message, bytes):
                conn.send(message)
                continue
            started = time.perf_counter()
            array = await ipc.open_array(message, stream=stream)
            await stream
            took = time.perf_counter() - started
            del array  # released once the stream passed it
            conn.send(took)

    anyio.run(main)


async def _handoff(result: Result, rounds: int) -> None:
    backend = _driver.driver().name
    context = multiprocessing.get_context("spawn")
    here, there = context.Pipe()
    consumer = context.Process(target=_consumer, args=(there, backend), daemon=True)
    consumer.start()
    try:
        stream = aiocuda.Stream(0)
        array = await aiocuda.zeros(1 << 18, np.float32, stream=stream, pool=ipc.pool(0))  # 1 MiB

        def hand_over() -> float:
            here.send(ipc.share_array(array, stream=stream))
            return float(here.recv())

        here.send(b"ready?")  # the consumer has started, imported everything and made its stream
        here.recv()
        started = time.perf_counter()
        hand_over()
        result.metrics["ipc_first_handoff_us"] = round((time.perf_counter() - started) * 1e6, 1)
        handoff_runs, pipe_runs, open_runs = [], [], []
        for _ in range(RUNS):
            handoffs, pipes, opens = [], [], []
            for _ in range(rounds):
                started = time.perf_counter()
                opens.append(hand_over())
                handoffs.append(time.perf_counter() - started)
                started = time.perf_counter()
                here.send(b"ping")
                here.recv()
                pipes.append(time.perf_counter() - started)
            pipe = statistics.median(pipes)
            handoff_runs.append((statistics.median(handoffs) - pipe) * 1e6)
            pipe_runs.append(pipe * 1e6)
            open_runs.append(statistics.median(opens) * 1e6)
        handoff, spread = _median_of_runs(handoff_runs)
        result.metrics["ipc_handoff_us"] = round(handoff, 1)
        result.extra["ipc_handoff_us_spread"] = [round(x, 1) for x in spread]
        result.metrics["ipc_open_and_first_await_us"] = round(_median_of_runs(open_runs)[0], 1)
        result.baselines["pipe_round_trip_us"] = round(_median_of_runs(pipe_runs)[0], 1)
    finally:
        here.send(None)
        consumer.join(30)
        if consumer.is_alive():
            consumer.kill()


# -- strided downloads ---------------------------------------------------------------------------------


def _gather(view: aiocuda.DeviceArray, out: np.ndarray, stream: aiocuda.Stream) -> Callable[[], Awaitable[None]]:
    """What ``to_host`` did for a non-contiguous view before: the whole span, gathered."""

    async def run() -> None:
        lo, hi = byte_span(view.shape, view.strides, view.itemsize)
        span = np.empty(hi - lo, np.uint8)
        await _staging.device_to_host(span, view.ptr + lo, stream)
        np.copyto(out, np.ndarray(view.shape, view.dtype, buffer=span, offset=-lo, strides=view.strides))

    return run


def _packed(view: aiocuda.DeviceArray, out: np.ndarray, stream: aiocuda.Stream) -> Callable[[], Awaitable[None]]:
    """The 2D path whatever ``to_host`` would choose: packed on the device, then downloaded."""

    async def run() -> None:
        packed = aiocuda.empty(view.shape, view.dtype, stream=stream)
        _copies.copy_strided(packed._layout(), view._layout(), view.shape, view.itemsize, stream)
        await _staging.device_to_host(out, packed.ptr, stream)
        packed.buffer.free()

    return run


async def _ratio_runs(contenders: dict[str, Callable[[], Any]], rounds: int) -> dict[str, tuple[float, list[float]]]:
    runs: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(RUNS):
        for name, seconds in (await wall_medians(contenders, rounds)).items():
            runs[name].append(seconds)
    return {name: _median_of_runs(values) for name, values in runs.items()}


async def _strided(result: Result, side: int, rounds: int, real: bool) -> None:
    stream = aiocuda.Stream(0)
    host = np.arange(side * side, dtype=np.float32).reshape(side, side)
    base = await aiocuda.to_device(host, stream=stream)
    view = base[::2]
    expected = host[::2]
    out = np.empty(view.shape, np.float32)
    pinned = aiocuda.pinned_empty(view.shape, np.float32)
    t = await _ratio_runs(
        {
            "ours": lambda: view.to_host(out=out, stream=stream),
            "gather": _gather(view, out, stream),
            "ours_pinned": lambda: view.to_host(out=pinned, stream=stream),
            "gather_pinned": _gather(view, pinned, stream),
        },
        rounds,
    )
    verified = np.array_equal(await view.to_host(out=out, stream=stream), expected) and np.array_equal(
        await view.to_host(out=pinned, stream=stream), expected
    )
    result.target("copy2d_verified", float(verified), 1, "==")
    ratio = t["gather"][0] / t["ours"][0]
    if real:
        result.target("copy2d_vs_gather", ratio, 2.0, ">=")
    else:
        result.metrics["copy2d_vs_gather"] = round(ratio, 3)
    result.extra["copy2d_vs_gather_spread"] = [round(t["gather"][0] / x, 3) for x in reversed(t["ours"][1])]
    result.metrics["copy2d_pinned_vs_gather"] = round(t["gather_pinned"][0] / t["ours_pinned"][0], 3)
    gbps = view.nbytes / 1e9
    result.metrics["copy2d_every_other_row_GBps"] = round(gbps / t["ours"][0], 2)
    result.metrics["copy2d_pinned_every_other_row_GBps"] = round(gbps / t["ours_pinned"][0], 2)
    result.baselines["gather_every_other_row_GBps"] = round(gbps / t["gather"][0], 2)
    result.extra["copy2d_shape"] = [side, side]

    image = aiocuda.empty((side // 2, side // 2, 3), np.float32, stream=stream)
    await image.fill(2.0, stream=stream)
    channel = image[..., 1]
    channel_out = np.empty(channel.shape, np.float32)
    c = await _ratio_runs(
        {"packed": _packed(channel, channel_out, stream), "gather": _gather(channel, channel_out, stream)}, rounds
    )
    result.extra["rgb_channel_packed_vs_gather"] = round(c["gather"][0] / c["packed"][0], 3)
    result.extra["rgb_channel_to_host_gathers"] = _copies.gathers_span(channel.shape, channel.strides, 4)


# -- main ------------------------------------------------------------------------------------------------


def _merge(result: Result) -> None:
    """Merge this run's figures into memory.json, keeping its other keys."""
    path = RESULTS / "memory.json"
    doc: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {"bench": "memory"}
    doc.setdefault("metrics", {}).update(result.metrics)
    doc.setdefault("baselines", {}).update(result.baselines)
    names = {t["name"] for t in result.targets}
    doc["targets"] = [t for t in doc.get("targets", []) if t["name"] not in names] + result.targets
    doc["ipc_and_strided"] = {
        "bench": "benchmarks/ipc.py",
        "device": aiocuda.Device(0).name,
        "date": datetime.date.today().isoformat(),
        **result.extra,
    }
    path.write_text(json.dumps(doc, indent=1) + "\n")


async def _run(quick: bool) -> Result:
    real = _driver.driver().name == "cuda"
    result = Result("memory")
    await _handoff(result, 20 if quick else 200)
    await _strided(result, 1024 if quick else 8192, 3 if quick else 9, real)
    return result


def main() -> None:
    args = parser(__doc__ or "ipc benchmark").parse_args()
    result = anyio.run(_run, args.quick)
    if _driver.driver().name == "cuda" and not args.quick:
        _merge(result)
        print(f"merged into {RESULTS / 'memory.json'}")
    else:
        print("simulated or --quick run: nothing is kept")
    result.print_summary(sys.stdout)


if __name__ == "__main__":
    main()
