"""GPU work for tests of waiting: one that takes a set time, one that poisons the
context, and a :class:`Gate` that keeps a stream busy until the test opens it; and
:func:`observed`, for tests that read the driver's pool statistics.

On the real driver the slow operation is a kernel that spins on ``clock64()``; on the
simulated backend it is an operation that sleeps on the stream's worker thread.

Tests that need "the GPU is still working" use a :class:`Gate`, not a slow operation and
a guess about how long the host takes meanwhile: under CPU load the host can take
longer than any such guess.
"""

from __future__ import annotations

import functools
import gc
import threading
import time

import anyio.to_thread
import numpy as np

from aiocuda._memory import offloop
from aiocuda.device import Device
from aiocuda.host import pinned_zeros
from aiocuda.kernel import Kernel
from aiocuda.memory import MemoryPool
from aiocuda.program import Program
from aiocuda.stream import Stream

SPIN_SRC = r"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
extern "C" __global__ void poison(int* p) { *(volatile int*)(p + 0x7fffffff) = 1; }
extern "C" __global__ void gate(volatile int* flags, long long max_cycles) {
    long long start = clock64();
    while (!flags[0] && clock64() - start < max_cycles) { }
    if (!flags[0]) flags[1] = 1;  /* timed out */
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
    that wrongly waits for it, does not hang the run; :attr:`timed_out` then tells
    (read it once the stream's work is done): code under test that waited for the GPU
    while the gate was shut made it time out.
    """

    def __init__(self, stream: Stream, timeout: float = 30.0) -> None:
        self._opened = threading.Event()
        self._outcome: list[bool] = []  # the simulator's: whether the gate was opened in time
        self._flags = None
        backend = stream.device._driver
        if backend.name == "sim":
            opened, outcome = self._opened, self._outcome
            backend.enqueue(stream.handle, lambda: outcome.append(opened.wait(timeout)), "gate")  # type: ignore[attr-defined]
            return
        # Frees and unpins that earlier tests left to the off-loop thread would wait for the
        # gate, holding this thread's event records (a loop's awaits) until it times out
        # (benchmarks/results/logs/driver-stalls.txt): they go first.
        gc.collect()
        offloop.drain(timeout)
        self._flags = pinned_zeros(2, np.int32)  # [open, timed out]: the kernel reads and writes them
        cycles = int(timeout * stream.device.attribute("clock_rate") * 1e3)
        _kernel(stream, "gate").launch(1, 1, int(self._flags.ctypes.data), cycles, stream=stream)

    def open(self) -> None:
        """Let the stream's work go on."""
        self._opened.set()
        if self._flags is not None:
            self._flags[0] = 1

    @property
    def timed_out(self) -> bool:
        """Whether the gate ended by its timeout rather than by :meth:`open`."""
        if self._flags is not None:
            return bool(self._flags[1])
        return self._outcome == [False]

    def __enter__(self) -> Gate:
        return self

    def __exit__(self, *exc: object) -> None:
        self.open()


async def trimmed(pool: MemoryPool, keep_bytes: int = 0) -> None:
    """``pool.trim(keep_bytes)``, then wait (on a worker thread) for what it gives back
    from the off-loop thread: the spares it freed on their streams settle there when
    the driver has not seen those frees run by the time trim looks."""
    pool.trim(keep_bytes)
    await anyio.to_thread.run_sync(offloop.drain)


async def observed(stream: Stream) -> None:
    """Return once the driver has seen ``stream`` idle from the host: a synchronize, on a
    worker thread. The driver settles a pool's frees only then (``await stream`` queries
    an event, which the driver does not count), so a test reads pool statistics after it."""
    await anyio.to_thread.run_sync(stream.synchronize)
