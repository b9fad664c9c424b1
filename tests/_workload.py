"""GPU work for tests of waiting: a tiny operation and one that takes a set time.

On the real driver the slow operation is a kernel that spins on ``clock64()``; on the
simulated backend it is an operation that sleeps on the stream's worker thread.
"""

from __future__ import annotations

import functools
import time

from aiocuda.device import Device
from aiocuda.kernel import Kernel
from aiocuda.program import Program
from aiocuda.stream import Stream

SPIN_SRC = r"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
extern "C" __global__ void poison(int* p) { *(volatile int*)(p + 0x7fffffff) = 1; }
"""


@functools.cache
def _kernels(ordinal: int, generation: int) -> dict[str, Kernel]:
    module = Program(SPIN_SRC, name="workload.cu").compile(Device(ordinal))
    return {name: module.kernel(name) for name in ("spin", "poison")}


def _kernel(stream: Stream, name: str) -> Kernel:
    from aiocuda import _driver

    return _kernels(stream.device.ordinal, _driver.backend_generation())[name]


def slow_op(stream: Stream, seconds: float) -> None:
    """Enqueue work that keeps ``stream`` busy for about ``seconds``."""
    backend = stream.device._driver
    if backend.name == "sim":
        backend.enqueue(stream.handle, lambda: time.sleep(seconds), "spin")  # type: ignore[attr-defined]
        return
    cycles = int(seconds * stream.device.attribute("clock_rate") * 1e3)
    _kernel(stream, "spin").launch(1, 1, cycles, stream=stream)


def poison_op(stream: Stream) -> None:
    """Enqueue work that poisons the stream's context with a sticky error."""
    backend = stream.device._driver
    if backend.name == "sim":

        def fault() -> None:
            raise IndexError("simulated out-of-bounds write")

        backend.enqueue(stream.handle, fault, "poison")  # type: ignore[attr-defined]
        return
    _kernel(stream, "poison").launch(1, 1, None, stream=stream)
