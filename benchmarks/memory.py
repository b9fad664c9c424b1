"""Stream-ordered memory: allocation, copies and leak-freedom, against today's ways.

Measured in one process, baselines in the same run, every figure in three runs (the
median is reported, the runs beside it):

* allocate + free of 1 MiB, like against like: aiocuda ``pool.allocate(n, s).free()``
  (the block freed is a spare that the next allocation takes back; with the spares
  off, ``..._driver_path``, every call goes to the driver) against the tightest raw
  loops (``cuMemAllocAsync`` on the default pool and ``cuMemAllocFromPoolAsync`` on
  aiocuda's, each + ``cuMemFreeAsync``, functions bound locally, the result code
  compared inline; the target takes the faster) and against
  PyTorch's raw caching-allocator calls; ``aiocuda.empty`` against ``torch.empty``
  (and ``cupy.empty``), each array freed by dropping it; ``cuMemAlloc`` + ``cuMemFree``
  for reference. Rounds of each are interleaved; medians per op.
* aiocuda's Python overhead with the driver calls stubbed: allocate + free, and
  ``aiocuda.empty`` + drop.
* 256 MiB copies: aiocuda to/from pinned arrays against raw ``cuMemcpy*Async`` +
  ``cuStreamSynchronize`` (wall clock both); aiocuda ``copy_from`` of a pageable numpy
  array (staged through pinned chunks) against raw pageable ``cuMemcpyHtoDAsync``.
* sharing and layouts (``benchmarks/ipc.py``): ``ipc_handoff_us`` (share, send, open in
  a second process, first await; less the pipe's round trip) and ``copy2d_vs_gather`` (a
  view of every other row downloaded by 2D copies against the whole-span gather).
* churn: 100k random allocate / free / cancel-mid-copy cycles; pool bytes in use after
  minus before.
* with ``--staging-sweep``: pageable 256 MiB copies each way for every combination of
  the staging knobs (``aiocuda._memory.staging``: CHUNK, MIN_CHUNK, COPY_THREADS), into
  ``staging_sweep`` of the results file, best first; nothing else runs.

    PYTHONPATH=src python3 benchmarks/memory.py [--quick] [--staging-sweep]
        [--staging CHUNK=32M --staging COPY_THREADS=8 ...]

``--staging KNOB=VALUE`` sets a staging knob (an int; K / M suffixes for KiB / MiB) for
the whole run.

On the simulated backend (``--quick``) only what does not need a GPU is meaningful: the
Python overhead and the churn leak check; the other figures are reported, not judged.
"""

from __future__ import annotations

import gc
import importlib.util
import itertools
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np

import aiocuda.array as ga
from aiocuda import _driver, memory
from aiocuda._memory import staging as _staging
from aiocuda.device import Device
from aiocuda.host import pinned_empty
from aiocuda.memory import MemoryPool
from aiocuda.stream import Stream

try:
    from benchmarks._common import Result, parser, ratios, repeat, repeat_async, wall_medians
    from benchmarks.ipc import sharing_and_layouts
except ImportError:  # run as a script from the benchmarks folder
    from _common import Result, parser, ratios, repeat, repeat_async, wall_medians  # type: ignore[no-redef]
    from ipc import sharing_and_layouts  # type: ignore[no-redef]

MiB = 1 << 20
ALLOC_SIZE = MiB


def _per_op_us(fn: Callable[[int], None], n: int, rounds: int) -> list[float]:
    """Per-operation microseconds of ``fn(n)``, one sample per round (with the cyclic
    garbage collector paused, as ``timeit`` does, for every contender alike)."""
    samples = []
    for _ in range(rounds):
        gc.disable()
        try:
            t = time.perf_counter()
            fn(n)
            samples.append((time.perf_counter() - t) / n * 1e6)
        finally:
            gc.enable()
    return samples


def _interleaved(contenders: dict[str, Callable[[int], None]], n: int, rounds: int) -> dict[str, float]:
    """Median per-op microseconds of each contender, rounds interleaved against drift."""
    for fn in contenders.values():
        fn(max(n // 10, 10))  # warm-up
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, fn in contenders.items():
            samples[name] += _per_op_us(fn, n, 1)
    return {name: statistics.median(xs) for name, xs in samples.items()}


# -- allocation ---------------------------------------------------------------------------------


def _alloc_contenders(stream: Stream, real: bool) -> dict[str, Callable[[int], None]]:
    """Allocate + free of 1 MiB, ``n`` times, each way. Like is compared with like:
    aiocuda's buffer with the tightest raw loops and with torch's raw caching-allocator
    call, aiocuda's array with ``torch.empty`` (each array freed by dropping it)."""
    pool = MemoryPool.for_device(stream.device)

    def aiocuda_buffer(n: int) -> None:
        allocate, size = pool.allocate, ALLOC_SIZE
        for _ in range(n):
            allocate(size, stream).free()
        stream.synchronize()

    def aiocuda_array(n: int) -> None:
        make, size, uint8 = ga.empty, ALLOC_SIZE, np.uint8
        for _ in range(n):
            make(size, uint8, stream=stream)
        stream.synchronize()

    def aiocuda_buffer_driver_path(n: int) -> None:
        # Spares off (aiocuda.memory.SPARE_BYTES): every allocate and free calls the driver.
        allocate, size = pool.allocate, ALLOC_SIZE
        saved, memory.SPARE_BYTES = memory.SPARE_BYTES, 0
        try:
            for _ in range(n):
                allocate(size, stream).free()
        finally:
            memory.SPARE_BYTES = saved
        stream.synchronize()

    contenders: dict[str, Callable[[int], None]] = {
        "aiocuda_buffer": aiocuda_buffer,
        "aiocuda_buffer_driver_path": aiocuda_buffer_driver_path,
        "aiocuda_array": aiocuda_array,
    }
    if not real:
        return contenders
    from aiocuda._driver.cuda._core import drv

    handle, pool_handle = stream.handle, pool.handle
    synchronize = drv.cuStreamSynchronize

    # The raw loops as tight as Python allows: functions bound locally, the result code
    # tested inline as aiocuda tests it (CUDA_SUCCESS is 0), no checking helper.
    def raw_async(n: int) -> None:
        alloc, free, size, h = drv.cuMemAllocAsync, drv.cuMemFreeAsync, ALLOC_SIZE, handle
        for _ in range(n):
            err, ptr = alloc(size, h)
            if err:
                raise RuntimeError(f"cuMemAllocAsync: {err}")
            (err,) = free(ptr, h)
            if err:
                raise RuntimeError(f"cuMemFreeAsync: {err}")
        synchronize(h)

    def raw_from_pool(n: int) -> None:  # the calls aiocuda makes, on aiocuda's pool
        alloc, free, size, mempool, h = drv.cuMemAllocFromPoolAsync, drv.cuMemFreeAsync, ALLOC_SIZE, pool_handle, handle
        for _ in range(n):
            err, ptr = alloc(size, mempool, h)
            if err:
                raise RuntimeError(f"cuMemAllocFromPoolAsync: {err}")
            (err,) = free(ptr, h)
            if err:
                raise RuntimeError(f"cuMemFreeAsync: {err}")
        synchronize(h)

    def raw_sync(n: int) -> None:
        alloc, free, size = drv.cuMemAlloc, drv.cuMemFree, ALLOC_SIZE
        for _ in range(n):
            err, ptr = alloc(size)
            if err:
                raise RuntimeError(f"cuMemAlloc: {err}")
            (err,) = free(ptr)
            if err:
                raise RuntimeError(f"cuMemFree: {err}")

    contenders |= {"raw_async": raw_async, "raw_from_pool": raw_from_pool, "raw_sync": raw_sync}
    if importlib.util.find_spec("torch") is not None:
        import torch

        torch.cuda.init()
        torch_stream = torch.cuda.ExternalStream(int(handle))
        torch_device = stream.device.ordinal

        def torch_empty(n: int) -> None:
            empty, size, uint8 = torch.empty, ALLOC_SIZE, torch.uint8
            with torch.cuda.stream(torch_stream):
                for _ in range(n):
                    empty(size, dtype=uint8, device="cuda")
            torch_stream.synchronize()

        def torch_raw(n: int) -> None:  # the caching allocator's own calls: no tensor
            alloc, delete, size = torch.cuda.caching_allocator_alloc, torch.cuda.caching_allocator_delete, ALLOC_SIZE
            for _ in range(n):
                delete(alloc(size, torch_device, torch_stream))
            torch_stream.synchronize()

        contenders |= {"torch_empty": torch_empty, "torch_raw": torch_raw}
    if importlib.util.find_spec("cupy") is not None:
        import cupy

        def cupy_empty(n: int) -> None:
            empty, size, uint8 = cupy.empty, ALLOC_SIZE, cupy.uint8
            for _ in range(n):
                empty(size, dtype=uint8)

        contenders["cupy_empty"] = cupy_empty
    return contenders


_NULL_ALLOCATION = (0, 0x1000)
_NULL_FREE = (0,)


def _null_alloc(size: int, pool: Any, stream: Any) -> tuple[int, int]:
    """Stand-in for the bound ``cuMemAllocFromPoolAsync``: isolates aiocuda's Python."""
    return _NULL_ALLOCATION


def _null_free(ptr: Any, stream: Any) -> tuple[int]:
    return _NULL_FREE


def _python_overhead_us(stream: Stream, n: int, rounds: int) -> dict[str, float]:
    """Per op, minus the same two (stub) driver calls made directly: aiocuda allocate +
    free (``buffer``), and ``aiocuda.empty`` + drop as ``aiocuda_array`` makes them
    (``array``: the device's pool is the stub pool meanwhile)."""
    pool = MemoryPool._create(stream.device, None, owned=False)
    pool._alloc_call, pool._free_call = _null_alloc, _null_free

    def buffer(k: int) -> None:
        allocate = pool.allocate
        for _ in range(k):
            allocate(ALLOC_SIZE, stream).free()

    def array(k: int) -> None:
        make, size, uint8 = ga.empty, ALLOC_SIZE, np.uint8
        for _ in range(k):
            make(size, uint8, stream=stream)

    def direct(k: int) -> None:
        handle = stream.handle
        for _ in range(k):
            _err, ptr = _null_alloc(ALLOC_SIZE, None, handle)
            (_err,) = _null_free(ptr, handle)

    device_pool = MemoryPool.for_device(stream.device)
    MemoryPool.set_for_device(pool)
    try:
        medians = _interleaved({"buffer": buffer, "array": array, "direct": direct}, n, rounds)
    finally:
        MemoryPool.set_for_device(device_pool)
    return {name: medians[name] - medians["direct"] for name in ("buffer", "array")}


# -- copies -----------------------------------------------------------------------------------


async def _copies(result: Result, stream: Stream, nbytes: int, reps: int, real: bool) -> None:
    device = stream.device
    pinned = pinned_empty(nbytes, np.uint8, device=device)
    pinned[:] = 1
    pageable = (np.arange(nbytes, dtype=np.uint32) * 2654435761 >> 24).astype(np.uint8)
    dev = ga.empty(nbytes, np.uint8, stream=stream)
    gbps = nbytes / 1e9

    driver = device._driver
    handle = stream.handle
    host_pinned, host_pageable = int(pinned.ctypes.data), int(pageable.ctypes.data)

    def raw(copy: Callable[..., None], dst: int, src: int) -> Callable[[], None]:
        def once() -> None:
            device.make_current()
            copy(dst, src, nbytes, handle)
            driver.stream_synchronize(handle)

        return once

    # Pinned and pageable copies in separate series: a pageable copy (ours staged through
    # copier threads, the driver's through its own bounce buffers) slows the pinned copy
    # that follows it, which would penalise whichever contender comes next.
    async def one_run() -> dict[str, float]:
        seconds = await wall_medians(
            {
                "ours_h2d_pinned": lambda: dev.copy_from(pinned, stream=stream),
                "raw_h2d_pinned": raw(driver.memcpy_htod_async, dev.ptr, host_pinned),
                "ours_d2h_pinned": lambda: dev.to_host(out=pinned, stream=stream),
                "raw_d2h_pinned": raw(driver.memcpy_dtoh_async, host_pinned, dev.ptr),
            },
            2 * reps,
        )
        return seconds | await wall_medians(
            {
                "ours_h2d_pageable": lambda: dev.copy_from(pageable, stream=stream),
                "raw_h2d_pageable": raw(driver.memcpy_htod_async, dev.ptr, host_pageable),
                "ours_d2h_pageable": lambda: dev.to_host(out=pageable, stream=stream),
                "raw_d2h_pageable": raw(driver.memcpy_dtoh_async, host_pageable, dev.ptr),
            },
            reps,
        )

    t = await repeat_async(one_run)
    await dev.copy_from(pageable, stream=stream)  # the staged paths must also be right
    verified = np.array_equal(await dev.to_host(stream=stream), pageable)
    result.target("staged_copies_verified", float(verified), 1, "==")
    for way in ("h2d_pinned", "d2h_pinned", "h2d_pageable", "d2h_pageable"):
        result.metric(f"{way}_GBps", [gbps / x for x in t[f"ours_{way}"]], 2)
        result.baseline(f"raw_{way}_GBps", [gbps / x for x in t[f"raw_{way}"]], 2)
    result.metric("pageable_d2h_speedup", ratios(t["raw_d2h_pageable"], t["ours_d2h_pageable"]), 3)
    judged = [
        ("pinned_copy_ratio_h2d", ratios(t["raw_h2d_pinned"], t["ours_h2d_pinned"]), 0.95),
        ("pinned_copy_ratio_d2h", ratios(t["raw_d2h_pinned"], t["ours_d2h_pinned"]), 0.95),
        ("pageable_h2d_speedup", ratios(t["raw_h2d_pageable"], t["ours_h2d_pageable"]), 2.0),
    ]
    for name, values, limit in judged:
        if real:
            result.target(name, values, limit, ">=")
        else:
            result.metric(name, values, 3)
    dev.buffer.free()
    await stream


# -- churn ----------------------------------------------------------------------------------------


async def _churn(stream: Stream, cycles: int, seed: int = 7) -> int:
    """Random allocate / free / cancel-mid-copy cycles; returns pool bytes leaked."""
    rng = random.Random(seed)
    pool = MemoryPool.for_device(stream.device)
    gc.collect()
    await stream
    stream.synchronize()
    before = pool.statistics().used_bytes
    host = np.arange(256 * 1024, dtype=np.uint8)
    live: list[Any] = []
    for _ in range(cycles):
        roll = rng.random()
        if roll < 0.45 or not live:
            live.append(pool.allocate(rng.randint(1, 4 * MiB), stream))
            if len(live) > 64:
                live.pop(rng.randrange(len(live)))  # dropped: freed by collection
        elif roll < 0.8:
            victim = live.pop(rng.randrange(len(live)))
            if rng.random() < 0.5:
                victim.free()
            del victim  # else this local would keep the last dropped buffer alive
        else:
            size = rng.choice((4096, 64 * 1024, host.nbytes))
            with anyio.CancelScope() as scope:
                scope.cancel()  # cancelled at the copy's first wait, with the copy enqueued
                await ga.to_device(host[:size], stream=stream)
    live.clear()
    gc.collect()
    await stream
    stream.synchronize()
    return int(pool.statistics().used_bytes - before)


# -- staging knobs --------------------------------------------------------------------------------

SWEEP_CHUNKS_MIB = (8, 16, 32, 64)
SWEEP_MIN_CHUNKS_MIB = (2, 4, 8, 64)  # capped at the chunk: equal to it, chunks do not shrink
SWEEP_THREADS = (4, 6, 8, 12)
_KNOBS = ("CHUNK", "MIN_CHUNK", "COPY_THREADS", "SLOTS_PER_THREAD", "INLINE_LIMIT", "INLINE_SLOTS", "INLINE_BYTES")


def _set_knob(assignment: str) -> None:
    """``NAME=VALUE`` (K / M suffixes: KiB / MiB) for a knob of ``aiocuda._memory.staging``."""
    name, _, value = assignment.partition("=")
    if name not in _KNOBS:
        raise SystemExit(f"--staging: unknown knob {name!r}; knobs: {', '.join(_KNOBS)}")
    scale = {"K": 1 << 10, "M": 1 << 20}.get(value[-1:].upper(), 1)
    setattr(_staging, name, int(value[:-1] if scale > 1 else value) * scale)
    _staging.reset()


async def _staging_sweep(stream: Stream, nbytes: int, reps: int, quick: bool) -> list[dict[str, Any]]:
    """Pageable copies each way for every knob combination, best h2d first."""
    saved = {name: getattr(_staging, name) for name in _KNOBS}
    pageable = (np.arange(nbytes, dtype=np.uint32) * 2654435761 >> 24).astype(np.uint8)
    out = np.empty_like(pageable)
    dev = ga.empty(nbytes, np.uint8, stream=stream)
    grid = ((1, 2), (1,), (2,)) if quick else (SWEEP_CHUNKS_MIB, SWEEP_MIN_CHUNKS_MIB, SWEEP_THREADS)
    gbps = nbytes / 1e9
    rows = []
    try:
        configs = sorted({(chunk, min(least, chunk), threads) for chunk, least, threads in itertools.product(*grid)})
        for chunk, min_chunk, n_threads in configs:
            _staging.CHUNK, _staging.MIN_CHUNK, _staging.COPY_THREADS = chunk * MiB, min_chunk * MiB, n_threads
            _staging.reset()
            t = await wall_medians(
                {
                    "h2d": lambda: dev.copy_from(pageable, stream=stream),
                    "d2h": lambda: dev.to_host(out=out, stream=stream),
                },
                reps,
            )
            h2d, d2h = t["h2d"], t["d2h"]
            row = {
                "chunk_MiB": chunk,
                "min_chunk_MiB": min_chunk,
                "copy_threads": n_threads,
                "h2d_GBps": round(gbps / h2d, 2),
                "d2h_GBps": round(gbps / d2h, 2),
            }
            print(row, flush=True)
            rows.append(row)
        verified = np.array_equal(out, pageable)  # the last copies, both ways
    finally:
        for name, value in saved.items():
            setattr(_staging, name, value)
        _staging.reset()
        dev.buffer.free()
    if not verified:
        raise RuntimeError("the staged copies of the sweep returned wrong data")
    return sorted(rows, key=lambda row: -row["h2d_GBps"])


async def _sweep(quick: bool) -> Result:
    stream = Stream(Device(0))
    result = Result("memory-staging-sweep")
    nbytes = 16 * MiB if quick else 256 * MiB
    result.extra["copy_bytes"] = nbytes
    rows = await _staging_sweep(stream, nbytes, 2 if quick else 5, quick)
    result.extra["staging_sweep"] = rows
    result.metrics["best_h2d_GBps"] = rows[0]["h2d_GBps"]
    result.metrics["best_d2h_GBps"] = max(row["d2h_GBps"] for row in rows)
    handle = stream.handle
    driver = stream.device._driver
    dev = ga.empty(nbytes, np.uint8, stream=stream)
    pageable = np.ones(nbytes, np.uint8)

    def raw_h2d() -> None:
        driver.memcpy_htod_async(dev.ptr, int(pageable.ctypes.data), nbytes, handle)
        driver.stream_synchronize(handle)

    stream.device.make_current()
    raw_s = (await wall_medians({"raw_h2d": raw_h2d}, 5))["raw_h2d"]
    result.baselines["raw_h2d_pageable_GBps"] = round(nbytes / 1e9 / raw_s, 2)
    dev.buffer.free()
    stream.close()
    return result


# -- main -----------------------------------------------------------------------------------------


async def _run(quick: bool) -> Result:
    backend = _driver.driver()
    real = backend.name == "cuda"
    device = Device(0)
    stream = Stream(device)
    result = Result("memory")
    n, rounds = (500, 5) if quick else (5000, 21)

    contenders = _alloc_contenders(stream, real)
    alloc = repeat(lambda: _interleaved(contenders, n, rounds))
    result.metric("aiocuda_alloc_free_1MiB_us", alloc["aiocuda_buffer"], 3)
    result.metric("aiocuda_empty_free_1MiB_us", alloc["aiocuda_array"], 3)
    result.metric("aiocuda_alloc_free_1MiB_driver_path_us", alloc["aiocuda_buffer_driver_path"], 3)
    for name, key in (
        ("raw_async", "raw_alloc_free_1MiB_us"),
        ("raw_from_pool", "raw_alloc_from_pool_free_1MiB_us"),
        ("raw_sync", "raw_cuMemAlloc_free_1MiB_us"),
        ("torch_empty", "torch_empty_1MiB_us"),
        ("torch_raw", "torch_caching_allocator_1MiB_us"),
        ("cupy_empty", "cupy_empty_1MiB_us"),
    ):
        if name in alloc:
            result.baseline(key, alloc[name], 3)
    if "raw_async" in alloc:
        # Against the faster of the two raw loops, run by run.
        tightest = [min(a, b) for a, b in zip(alloc["raw_async"], alloc["raw_from_pool"], strict=True)]
        result.target("alloc_free_ratio_raw", ratios(alloc["aiocuda_buffer"], tightest), 1.3, "<=")
        # The same loop with the spares off: what the driver path itself costs.
        result.metric("alloc_free_ratio_raw_driver_path", ratios(alloc["aiocuda_buffer_driver_path"], tightest), 3)
    if "torch_empty" in alloc:
        result.target("alloc_free_ratio_torch", ratios(alloc["aiocuda_array"], alloc["torch_empty"]), 1.0, "<=")
        result.target("alloc_free_ratio_torch_raw", ratios(alloc["aiocuda_buffer"], alloc["torch_raw"]), 1.0, "<=")
    overhead_n = 20000 if quick else 100000
    overhead = repeat(lambda: _python_overhead_us(stream, overhead_n, rounds))
    result.metric("python_overhead_alloc_free_us", overhead["buffer"], 3)
    result.metric("python_overhead_empty_us", overhead["array"], 3)

    copy_bytes = 16 * MiB if quick else 256 * MiB
    result.extra["copy_bytes"] = copy_bytes
    await _copies(result, stream, copy_bytes, 3 if quick else 15, real)

    await sharing_and_layouts(result, quick, real)  # ipc_handoff_us, copy2d_vs_gather (benchmarks/ipc.py)

    cycles = 2000 if quick else 100_000
    result.extra["churn_cycles"] = cycles
    result.target("leak_bytes_after_churn", await _churn(stream, cycles), 0, "==")
    stream.close()
    return result


def main() -> None:
    cli = parser(__doc__ or "memory benchmark")
    cli.add_argument("--staging-sweep", action="store_true", help="sweep the staging knobs; nothing else")
    cli.add_argument("--staging", action="append", default=[], metavar="KNOB=VALUE", help="set a staging knob")
    args = cli.parse_args()
    for assignment in args.staging:
        _set_knob(assignment)
    result = anyio.run(_sweep if args.staging_sweep else _run, args.quick)
    result.write(args.out)


if __name__ == "__main__":
    main()
