"""GPU work for tests of waiting: a tiny operation and one that takes a set time.

On the real driver the slow operation is a kernel that spins on ``clock64()``; on the
simulated backend it is an operation that sleeps on the stream's worker thread.
"""

from __future__ import annotations

import ctypes
import functools
import time
from typing import Any

from aiocuda.device import Device
from aiocuda.stream import Stream

SPIN_SRC = rb"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
extern "C" __global__ void poison(int* p) { *(volatile int*)(p + 0x7fffffff) = 1; }
"""


@functools.cache
def _functions(ordinal: int, generation: int) -> dict[str, Any]:
    from cuda.bindings import nvrtc

    from aiocuda._driver.cuda._core import check, drv

    dev = Device(ordinal)
    dev.make_current()
    major, minor = dev.compute_capability
    prog = check(nvrtc.nvrtcCreateProgram(SPIN_SRC, b"spin.cu", 0, [], []), "nvrtcCreateProgram")
    opts = [f"--gpu-architecture=sm_{major}{minor}".encode()]
    assert nvrtc.nvrtcCompileProgram(prog, len(opts), opts)[0] == nvrtc.nvrtcResult.NVRTC_SUCCESS
    image = b" " * nvrtc.nvrtcGetCUBINSize(prog)[1]
    nvrtc.nvrtcGetCUBIN(prog, image)
    module = check(drv.cuModuleLoadData(image), "cuModuleLoadData")
    return {name: check(drv.cuModuleGetFunction(module, name.encode()), "get") for name in ("spin", "poison")}


def slow_op(stream: Stream, seconds: float) -> None:
    """Enqueue work that keeps ``stream`` busy for about ``seconds``."""
    backend = stream.device._driver
    if backend.name == "sim":
        backend._enqueue(stream.handle, lambda: time.sleep(seconds), "spin")  # type: ignore[attr-defined]
        return
    from aiocuda import _driver
    from aiocuda._driver.cuda._core import check, drv

    fn = _functions(stream.device.ordinal, _driver.backend_generation())["spin"]
    cycles = int(seconds * stream.device.attribute("clock_rate") * 1e3)
    stream.device.make_current()
    check(drv.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, stream.handle, ((cycles,), (ctypes.c_longlong,)), 0), "launch")


def poison_op(stream: Stream) -> None:
    """Enqueue work that poisons the stream's context with a sticky error."""
    backend = stream.device._driver
    if backend.name == "sim":
        def fault() -> None:
            raise IndexError("simulated out-of-bounds write")

        backend._enqueue(stream.handle, fault, "poison")  # type: ignore[attr-defined]
        return
    from aiocuda import _driver
    from aiocuda._driver.cuda._core import check, drv

    fn = _functions(stream.device.ordinal, _driver.backend_generation())["poison"]
    stream.device.make_current()
    check(drv.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, stream.handle, ((0,), (ctypes.c_void_p,)), 0), "launch")
