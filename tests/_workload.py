"""GPU work for tests of waiting: one that takes a set time, one that poisons the
context, and a :class:`Gate` that keeps a stream busy until the test opens it.

On the real driver the slow operation is a kernel that spins on ``clock64()``; on the
simulated backend it is an operation that sleeps on the stream's worker thread.

Tests that need "the GPU is still working" use a :class:`Gate`, not a slow operation and
a guess about how long the host takes meanwhile: under CPU load the host can take
longer than any such guess.
"""

from __future__ import annotations

import functools
import threading
import time

import numpy as np

from aiocuda.device import Device
from aiocuda.host import pinned_zeros
from aiocuda.kernel import Kernel
from aiocuda.program import Program
from aiocuda.stream import Stream

SPIN_SRC = r"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
extern "C" __global__ void poison(int* p) { *(volatile int*)(p + 0x7fffffff) = 1; }
extern "C" __global__ void gate(volatile int* open, long long max_cycles) {
    long long start = clock64();
    while (!*open && clock64() - start < max_cycles) { }
}
"""


@functools.cache
def _kernels(ordinal: int, generation: int) -> dict[str, Kernel]:
    module = Program(SPIN_SRC, name="workload.cu").compile(Device(ordinal))
    return {name: module.kernel(name) for name in ("spin", "poison", "gate")}


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


class Gate:
    """Work that keeps ``stream`` busy until :meth:`open` (or the end of a ``with``
    block): "the GPU is still working", whatever the host's speed.

    On the simulator an operation waits for a :class:`threading.Event`; on the GPU a
    one-thread kernel spins until a flag in page-locked host memory is set. Either ends
    by itself after ``timeout`` seconds, so a test that fails before opening it, or code
    that wrongly waits for it, does not hang the run (the test then fails, late).
    """

    def __init__(self, stream: Stream, timeout: float = 30.0) -> None:
        self._opened = threading.Event()
        self._flag = None
        backend = stream.device._driver
        if backend.name == "sim":
            opened = self._opened
            backend.enqueue(stream.handle, lambda: opened.wait(timeout), "gate")  # type: ignore[attr-defined]
            return
        self._flag = pinned_zeros(1, np.int32)  # the kernel reads it until it is set
        cycles = int(timeout * stream.device.attribute("clock_rate") * 1e3)
        _kernel(stream, "gate").launch(1, 1, int(self._flag.ctypes.data), cycles, stream=stream)

    def open(self) -> None:
        """Let the stream's work go on."""
        self._opened.set()
        if self._flag is not None:
            self._flag[0] = 1

    def __enter__(self) -> Gate:
        return self

    def __exit__(self, *exc: object) -> None:
        self.open()
