"""Launch cost of an empty kernel: aiocuda against raw cuLaunchKernel, cuda.core and CuPy.

All methods launch ``empty(float* a, float* b, int n)`` with grid 1, block 32, in one
process:

* ``raw``        -- ``cuLaunchKernel`` through cuda-bindings with a pre-packed ``void*[]``
                    (``ctypes.addressof(arr)``), bound locally, the result tested inline;
                    the floor.
* ``cuda_core``  -- ``cuda.core.launch(stream, config, kernel, int(a), int(b), np.int32(7))``.
* ``cupy``       -- ``RawKernel((1,), (32,), (xa, xb, np.int32(7)))`` with CuPy arrays.
* ``raw_ctypes`` -- libcuda's ``cuLaunchKernel`` called through ctypes with pre-converted
                    arguments: information only, to see whether bypassing cuda-bindings'
                    wrapper would pay.
* ``aiocuda``    -- ``go(a, b, 7)`` with ``go = kernel.bind(1, 32, stream=s)`` and raw
                    device pointers: the prepared launcher, aiocuda's fast path.
* ``aiocuda_launch``  -- ``kernel.launch(1, 32, a, b, 7, stream=s)`` (launcher cache lookup).
* ``aiocuda_getitem`` -- ``kernel[1, 32, s](a, b, 7)``.
* ``aiocuda_buffers`` -- ``go(buf_a, buf_b, 7)`` with DeviceBuffers (pointer conversion
                    and stream-use bookkeeping included).
* ``aiocuda_arrays``  -- ``go(xa, xb, 7)`` with DeviceArrays.

Targets compare like with like (``TARGETS``): the bound launcher with raw pointers
against ``raw`` and ``cuda_core`` (given raw pointers too), and with arrays against
``cupy`` (given arrays). Each method runs BATCHES batches of N launches (then a stream
synchronize), the methods' batches interleaved round-robin to cancel drift; a run's
figure is the median of the batch means, and the benchmark makes three runs (the
median reported, the runs beside it). ``cached_compile_ratio``: two fresh processes
compile the same source against one empty cache folder, the second's
``Program.compile`` time over the first's; three such pairs, each with a new source.

    PYTHONPATH=src python3 benchmarks/launch.py [--quick]
"""

from __future__ import annotations

import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import aiocuda.array as ga
from aiocuda import _driver
from aiocuda.device import Device
from aiocuda.kernel import register_sim_kernel
from aiocuda.memory import MemoryPool
from aiocuda.program import Program
from aiocuda.stream import Stream

try:
    from benchmarks._common import RUNS, Result, parser, ratios, repeat
except ImportError:  # run as a script from the benchmarks folder
    from _common import RUNS, Result, parser, ratios, repeat  # type: ignore[no-redef]

SRC = r"""
extern "C" __global__ void empty(float* a, float* b, int n) { }
"""

Method = Callable[[int], None]


def aiocuda_methods(s: Stream) -> tuple[dict[str, Method], Any, tuple[int, int]]:
    kernel = Program(SRC).compile(s.device).kernel("empty")
    pool = MemoryPool.for_device(s.device)
    buf_a, buf_b = pool.allocate(1024, s), pool.allocate(1024, s)
    a, b = buf_a.ptr, buf_b.ptr
    go = kernel.bind(1, 32, stream=s)
    launch = kernel.launch

    def bound(n: int) -> None:
        for _ in range(n):
            go(a, b, 7)

    def method(n: int) -> None:
        for _ in range(n):
            launch(1, 32, a, b, 7, stream=s)

    def getitem(n: int) -> None:
        for _ in range(n):
            kernel[1, 32, s](a, b, 7)

    def buffers(n: int) -> None:
        for _ in range(n):
            go(buf_a, buf_b, 7)

    arr_a, arr_b = ga.empty(256, np.float32, stream=s), ga.empty(256, np.float32, stream=s)

    def arrays(n: int) -> None:  # as CuPy is given its arguments
        for _ in range(n):
            go(arr_a, arr_b, 7)

    methods = {
        "aiocuda": bound,
        "aiocuda_launch": method,
        "aiocuda_getitem": getitem,
        "aiocuda_buffers": buffers,
        "aiocuda_arrays": arrays,
    }
    return methods, kernel, (a, b)


def baseline_methods(s: Stream, kernel: Any, a: int, b: int) -> tuple[dict[str, Method], dict[str, str]]:
    """raw, cuda.core and CuPy, each skipped (with the reason) where unavailable."""
    from cuda.bindings import driver as d

    methods: dict[str, Method] = {}
    skipped: dict[str, str] = {}
    func = kernel.function(s.device)
    stream = s.handle
    pa, pb, pn = ctypes.c_uint64(a), ctypes.c_uint64(b), ctypes.c_int(7)
    arr = (ctypes.c_void_p * 3)(ctypes.addressof(pa), ctypes.addressof(pb), ctypes.addressof(pn))
    params = ctypes.addressof(arr)

    keep = (pa, pb, pn, arr)  # what ``params`` points at: alive as long as the closures

    def raw(n: int) -> None:  # as tight as Python allows: bound locally, the result tested inline
        launch_kernel, f, h, p, _ = d.cuLaunchKernel, func, stream, params, keep
        for _ in range(n):
            (err,) = launch_kernel(f, 1, 1, 1, 32, 1, 1, 0, h, p, 0)
            if err:
                raise RuntimeError(f"cuLaunchKernel: {err}")

    methods["raw"] = raw

    # libcuda's own cuLaunchKernel through ctypes with pre-converted arguments: tells
    # whether a route around cuda-bindings' wrapper would be cheaper (not used by aiocuda).
    lib_launch = ctypes.CDLL("libcuda.so.1").cuLaunchKernel
    lib_launch.restype = ctypes.c_int
    u = ctypes.c_uint
    c_args = (
        ctypes.c_void_p(int(func)), u(1), u(1), u(1), u(32), u(1), u(1), u(0),
        ctypes.c_void_p(int(stream)), ctypes.c_void_p(ctypes.addressof(arr)), ctypes.c_void_p(0),
    )  # fmt: skip

    def raw_ctypes(n: int) -> None:
        for _ in range(n):
            if lib_launch(*c_args):
                raise RuntimeError("cuLaunchKernel failed")

    methods["raw_ctypes"] = raw_ctypes
    try:
        from cuda.core import Device as CoreDevice
        from cuda.core import LaunchConfig, ProgramOptions
        from cuda.core import Program as CoreProgram
        from cuda.core import launch as core_launch

        dev = CoreDevice(s.device.ordinal)
        dev.set_current()
        cs = dev.create_stream()
        major, minor = s.device.compute_capability
        core_kernel = (
            CoreProgram(SRC, code_type="c++", options=ProgramOptions(arch=f"sm_{major}{minor}"))
            .compile("cubin")
            .get_kernel("empty")
        )
        cfg = LaunchConfig(grid=1, block=32)

        def cuda_core(n: int) -> None:
            for _ in range(n):
                core_launch(cs, cfg, core_kernel, int(a), int(b), np.int32(7))
            cs.sync()

        methods["cuda_core"] = cuda_core
    except Exception as exc:
        skipped["cuda_core"] = repr(exc)[:300]
    try:
        import cupy as cp

        rk = cp.RawKernel(SRC, "empty")
        xa, xb = cp.zeros(256, cp.float32), cp.zeros(256, cp.float32)

        def cupy(n: int) -> None:
            for _ in range(n):
                rk((1,), (32,), (xa, xb, np.int32(7)))
            cp.cuda.Device().synchronize()

        methods["cupy"] = cupy
    except Exception as exc:
        skipped["cupy"] = repr(exc)[:300]
    s.device.make_current()
    return methods, skipped


def measure(methods: dict[str, Method], s: Stream, batches: int, n: int) -> dict[str, float]:
    """One run: the median over batches of the mean launch time (µs), batches interleaved."""
    for run in methods.values():  # warm-up
        run(max(100, n // 10))
        s.synchronize()
    samples: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(batches):
        for name, run in methods.items():
            t = time.perf_counter()
            run(n)
            s.synchronize()
            samples[name].append((time.perf_counter() - t) / n)
    return {name: statistics.median(xs) * 1e6 for name, xs in samples.items()}


_COMPILE_CHILD = r"""
import json, sys, time
from aiocuda.device import Device
from aiocuda.program import Program
dev = Device(0)
t = time.perf_counter()
Program(sys.argv[1]).compile(dev)
print(json.dumps({"seconds": time.perf_counter() - t}))
"""


def compile_times(source: str) -> tuple[float, float]:
    """(first, second) ``Program.compile`` seconds, each in a fresh process, one cache folder."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "AIOCUDA_CACHE_DIR": cache}
        times = []
        for _ in range(2):
            done = subprocess.run(
                [sys.executable, "-c", _COMPILE_CHILD, source],
                env=env,
                capture_output=True,
                text=True,
                check=True,
                timeout=300,
            )
            times.append(json.loads(done.stdout.strip().splitlines()[-1])["seconds"])
    return times[0], times[1]


# The like-for-like pairs behind each target: (ours, baseline). cuda.core is given raw
# device pointers as aiocuda's bound launcher is; CuPy is given arrays, so aiocuda is too.
TARGETS = {
    "launch_ratio_raw": ("aiocuda", "raw", 1.15),
    "launch_ratio_cuda_core": ("aiocuda", "cuda_core", 1.0),
    "launch_ratio_cupy": ("aiocuda_arrays", "cupy", 1.0),
}
BASELINES = ("raw", "raw_ctypes", "cuda_core", "cupy")


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    batches, n = (3, 500) if args.quick else (20, 20_000)
    backend = _driver.driver()
    register_sim_kernel("empty", lambda launch, a, b, n: None)
    device = Device(0)
    device.make_current()
    s = Stream(device)
    methods, kernel, (a, b) = aiocuda_methods(s)
    result = Result("launch")
    skipped: dict[str, str] = {}
    if backend.name == "cuda":
        baselines, skipped = baseline_methods(s, kernel, a, b)
        methods = {**baselines, **methods}
    times = repeat(lambda: measure(methods, s, batches, n))
    for name, us in times.items():
        key = "raw_prepacked_us" if name == "raw" else f"{name}_us"
        (result.baseline if name in BASELINES else result.metric)(key, us)
    for target, (ours, theirs, limit) in TARGETS.items():
        if theirs in times:
            result.target(target, ratios(times[ours], times[theirs]), limit, "<=")
            method = target.replace("launch_ratio", "launch_method_ratio")  # kernel.launch(...) each time
            result.metric(method, ratios(times["aiocuda_launch"], times[theirs]))
    if backend.name == "cuda":
        compiles = [compile_times(SRC + f"// {time.time_ns()}\n") for _ in range(RUNS)]  # sources no cache has seen
        result.baseline("first_compile_ms", [first * 1e3 for first, _ in compiles], 3)
        result.metric("cached_compile_ms", [second * 1e3 for _, second in compiles], 3)
        result.target("cached_compile_ratio", [second / first for first, second in compiles], 0.05, "<=")
    result.extra = {"batches": batches, "launches_per_batch": n, "skipped": skipped}
    s.synchronize()
    result.write(args.out)


if __name__ == "__main__":
    main()
