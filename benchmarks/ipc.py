"""Sharing between processes and strided copies (issue 20): the figures users compare.

Measured into ``benchmarks/results/memory.json`` by ``memory.py``, which calls
:func:`sharing_and_layouts`; run alone, this prints them and writes nothing.

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

Each figure is the median of three runs (``_common.RUNS``; contenders interleaved round
by round within a run), the runs kept beside it.

    python benchmarks/ipc.py [--quick]
"""

from __future__ import annotations

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
from aiocuda.errors import CudaError

try:
    from benchmarks._common import Result, parser, ratios, repeat_async, wall_medians
except ImportError:  # run as a script from the benchmarks folder
    from _common import Result, parser, ratios, repeat_async, wall_medians  # type: ignore[no-redef]


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
        result.metric("ipc_first_handoff_us", (time.perf_counter() - started) * 1e6, 1)

        async def one_run() -> dict[str, float]:
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
            return {
                "handoff": (statistics.median(handoffs) - pipe) * 1e6,
                "pipe": pipe * 1e6,
                "open": statistics.median(opens) * 1e6,
            }

        runs = await repeat_async(one_run)
        result.metric("ipc_handoff_us", runs["handoff"], 1)
        result.metric("ipc_open_and_first_await_us", runs["open"], 1)
        result.baseline("pipe_round_trip_us", runs["pipe"], 1)
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


async def _strided(result: Result, side: int, rounds: int, real: bool) -> None:
    stream = aiocuda.Stream(0)
    host = np.arange(side * side, dtype=np.float32).reshape(side, side)
    base = await aiocuda.to_device(host, stream=stream)
    view = base[::2]
    expected = host[::2]
    out = np.empty(view.shape, np.float32)
    pinned = aiocuda.pinned_empty(view.shape, np.float32)
    contenders = {
        "ours": lambda: view.to_host(out=out, stream=stream),
        "gather": _gather(view, out, stream),
        "ours_pinned": lambda: view.to_host(out=pinned, stream=stream),
        "gather_pinned": _gather(view, pinned, stream),
    }
    t = await repeat_async(lambda: wall_medians(contenders, rounds))
    verified = np.array_equal(await view.to_host(out=out, stream=stream), expected) and np.array_equal(
        await view.to_host(out=pinned, stream=stream), expected
    )
    result.target("copy2d_verified", float(verified), 1, "==")
    if real:
        result.target("copy2d_vs_gather", ratios(t["gather"], t["ours"]), 2.0, ">=")
    else:
        result.metric("copy2d_vs_gather", ratios(t["gather"], t["ours"]), 3)
    result.metric("copy2d_pinned_vs_gather", ratios(t["gather_pinned"], t["ours_pinned"]), 3)
    gigabytes = view.nbytes / 1e9
    result.metric("copy2d_every_other_row_GBps", [gigabytes / x for x in t["ours"]], 2)
    result.metric("copy2d_pinned_every_other_row_GBps", [gigabytes / x for x in t["ours_pinned"]], 2)
    result.baseline("gather_every_other_row_GBps", [gigabytes / x for x in t["gather"]], 2)
    result.extra["copy2d_shape"] = [side, side]

    image = aiocuda.empty((side // 2, side // 2, 3), np.float32, stream=stream)
    await image.fill(2.0, stream=stream)
    channel = image[..., 1]
    channel_out = np.empty(channel.shape, np.float32)
    both = {"packed": _packed(channel, channel_out, stream), "gather": _gather(channel, channel_out, stream)}
    c = await repeat_async(lambda: wall_medians(both, rounds))
    result.metric("rgb_channel_packed_vs_gather", ratios(c["gather"], c["packed"]), 3)
    result.extra["rgb_channel_to_host_gathers"] = _copies.gathers_span(channel.shape, channel.strides, 4)


# -- main ------------------------------------------------------------------------------------------------


async def sharing_and_layouts(result: Result, quick: bool, real: bool) -> None:
    """Add this module's figures to ``result`` (``memory.py``'s). A hand-off the driver
    refuses is reported in ``extra`` and costs the other figures nothing."""
    try:
        await _handoff(result, 20 if quick else 200)
    except CudaError as exc:
        result.extra["ipc_handoff_error"] = str(exc)
    await _strided(result, 1024 if quick else 8192, 3 if quick else 9, real)


async def _run(quick: bool) -> Result:
    result = Result("memory")
    await sharing_and_layouts(result, quick, _driver.driver().name == "cuda")
    return result


def main() -> None:
    args = parser(__doc__ or "ipc benchmark").parse_args()
    anyio.run(_run, args.quick).print_summary(sys.stdout)
    print("printed only: memory.py writes these figures into benchmarks/results/memory.json")


if __name__ == "__main__":
    main()
