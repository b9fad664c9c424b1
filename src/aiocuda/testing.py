"""Test your GPU code without a GPU: the simulator and its controls.

The simulator is a CUDA driver imitated on the CPU. Streams run their work in order and
concurrently with each other, events, pools and copies behave as the driver documents,
and kernels run as Python functions you register under the kernel's name. It also does
what a GPU cannot: stop a stream at a point of your choosing, make operations take a set
time, fail the Nth driver call, poison a device. Code under test needs no change: it uses
``aiocuda`` as it would on a GPU.

A pytest module (it runs as it stands, on asyncio and trio)::

    import anyio
    import numpy as np
    import pytest
    import aiocuda
    import aiocuda.testing

    SOURCE = '''
    extern "C" __global__ void twice(float* x, int n) {
        int i = blockIdx.x * blockDim.x + threadIdx.x;
        if (i < n) x[i] *= 2;
    }
    '''

    def twice(launch, x, n):                 # what the kernel computes, on numpy
        x[: int(n)] *= 2

    @pytest.fixture
    def sim():
        with aiocuda.testing.use_simulator(devices=2) as sim:
            sim.register_kernel("twice", twice)
            yield sim

    @pytest.mark.anyio                       # anyio's pytest plugin runs async tests
    async def test_the_result_waits_for_the_kernel(sim: aiocuda.testing.Simulator) -> None:
        kernel = aiocuda.Program(SOURCE).compile().kernel("twice")
        with aiocuda.Stream() as stream:
            x = await aiocuda.to_device(np.ones(1000, np.float32), stream=stream)
            with sim.paused(stream):         # nothing on the stream runs meanwhile
                kernel.launch(4, 256, x, 1000, stream=stream)
                done = stream.record()
                await anyio.sleep(0.01)
                assert not done.query()      # the "GPU" has not run the kernel
            assert (await x.to_host(stream=stream) == 2).all()

A kernel implementation is called as ``impl(launch, *args)`` on a worker thread, in
stream order, once for the whole grid (write vectorised numpy, not per-thread code):

* ``launch`` is a :class:`KernelLaunch` (``name``, ``config``, ``grid``, ``block``, ...);
* a pointer argument arrives as a writable 1-D numpy array of the pointee type
  (``uint8`` for ``void*``) from the pointer to the end of its allocation: slice it to
  the length you need (NULL arrives as None);
* a scalar arrives as a numpy scalar of the declared type.

Whatever it raises -- an ``IndexError``, as an out-of-bounds access would on a GPU, a
failed ``assert``, ``pytest.fail()`` -- poisons the device: the awaits and later calls
raise :class:`~aiocuda.errors.ContextPoisonedError`, whose ``__cause__`` is what the
implementation raised. Implementations must not wait for other simulated work (no GPU
kernel may either). ``Program.compile()`` still compiles with NVRTC where it is
installed, so the CUDA source is checked too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from types import TracebackType
from typing import Any, Literal, Protocol, get_args

import numpy.typing as npt

from . import _driver
from ._driver import LaunchConfig
from ._util import NoPublicConstructor
from .device import Device
from .errors import BackendError, ResultCode
from .kernel import register_sim_kernel
from .stream import Stream, _check_stream

__all__ = ["KernelImpl", "KernelLaunch", "Operation", "Simulator", "current_simulator", "use_simulator"]

Operation = Literal[
    "memcpy_htod_async",
    "memcpy_dtoh_async",
    "memcpy_dtod_async",
    "memcpy_peer_async",
    "memcpy_pitched_async",
    "memset_d8_async",
    "memset_d16_async",
    "memset_d32_async",
    "memset_2d_async",
    "launch_kernel",
    "mem_free_async",
    "mem_prefetch_async",
    "stream_attach_mem_async",
    "event_record",
    "stream_wait_event",
    "launch_doorbell",
    "graph_launch",
]
"""The simulated operations :meth:`Simulator.set_latency` can slow down: copies host to
device, device to host, device to device and between devices; 2D and 3D copies; memsets;
kernel launches; stream-ordered frees; managed-memory prefetches and attachments; event
records; cross-stream waits; host functions; a CUDA graph's replay as a whole (its nodes
take their own operations' latencies too)."""

_OPERATIONS = frozenset(get_args(Operation))


class KernelLaunch(Protocol):
    """What a kernel implementation learns about its launch."""

    @property
    def name(self) -> str:
        """The kernel's name (its name expression for a template)."""

    @property
    def config(self) -> LaunchConfig:
        """The launch's configuration (also readable through the properties below)."""

    @property
    def grid(self) -> tuple[int, int, int]:
        """Blocks in the grid, (x, y, z)."""

    @property
    def block(self) -> tuple[int, int, int]:
        """Threads in a block, (x, y, z)."""

    @property
    def shared_mem(self) -> int:
        """Dynamic shared memory per block, in bytes."""

    @property
    def cooperative(self) -> bool:
        """Whether it was launched as a cooperative kernel."""

    @property
    def cluster(self) -> tuple[int, int, int] | None:
        """Its thread-block cluster shape, if any."""

    @property
    def globals(self) -> Mapping[str, npt.NDArray[Any]]:
        """The module's ``__device__``/``__constant__`` variables, as writable arrays by name."""


KernelImpl = Callable[..., object]
"""A kernel's Python implementation: ``impl(launch: KernelLaunch, *args) -> None``."""


class Simulator(metaclass=NoPublicConstructor):
    """Controls of the simulated backend in use. Obtain with :func:`use_simulator` (a
    fresh simulator) or :func:`current_simulator` (the one ``AIOCUDA_BACKEND=sim``
    chose).

    Use it as a context manager, or call :meth:`close`, to shut it down at the end of a
    test; the next aiocuda call then chooses a backend again from ``AIOCUDA_BACKEND``.
    Once it is shut down -- closed, or replaced by a later :func:`use_simulator` -- its
    controls that would change something raise :class:`~aiocuda.errors.BackendError`.
    """

    __slots__ = ("_sim",)
    _factories = "aiocuda.testing.use_simulator() or current_simulator()"

    def __init__(self, sim: Any) -> None:
        self._sim = sim  # the simulated driver itself

    def __repr__(self) -> str:
        state = repr(self._sim).removeprefix("<SimDriver ").removesuffix(">")
        return f"<Simulator [{state}]>"

    def __enter__(self) -> Simulator:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()

    @property
    def device_count(self) -> int:
        """How many simulated devices there are."""
        return int(self._sim.device_count())

    def _check_open(self, control: str) -> None:
        """BackendError if this simulator was shut down."""
        # Its controls reached a driver nothing uses any more: a fault, a latency or a
        # poison set there did nothing, silently (the outer block of nested ones).
        if self._sim.closed:
            raise BackendError(
                f"Simulator.{control}(): this simulator was shut down -- closed, or replaced by a later "
                "use_simulator() (the blocks do not nest: the inner one shuts the outer one down); "
                "use the Simulator of the backend in use"
            )

    # -- streams --------------------------------------------------------------------------
    def pause(self, stream: Stream) -> None:
        """Start nothing more on ``stream`` until :meth:`resume`.

        Work enqueued meanwhile queues up and awaits of it stay pending; an operation
        already running finishes. A blocking ``stream.synchronize()`` on a paused stream
        waits until it is resumed: do not call it from the thread that will resume it.
        ``stream`` is a live aiocuda :class:`~aiocuda.Stream` of this simulator.
        """
        self._check_open("pause")
        _check_stream(stream)
        if not self._made_here(stream):
            # (A stream made before the switch to this simulator: its own, dead one was
            # paused, silently.)
            raise BackendError(
                f"Simulator.pause(): {stream!r} was made on another backend (before the switch to this "
                "simulator); make the streams of a test after use_simulator()"
            )
        self._sim.pause(stream.handle)

    def _made_here(self, stream: Stream) -> bool:
        return stream._driver is self._sim

    def resume(self, stream: Stream) -> None:
        """Let a paused stream run its queued work (closed since, too)."""
        _check_stream(stream)  # (not an AttributeError of a raw handle's missing slot)
        self._sim.resume(stream._handle)  # (a closed stream's queued work still runs)

    @contextlib.contextmanager
    def paused(self, stream: Stream) -> Iterator[Stream]:
        """``with sim.paused(stream):`` -- :meth:`pause` on entry, :meth:`resume` on exit."""
        self.pause(stream)
        try:
            yield stream
        finally:
            self.resume(stream)

    # -- time, faults, kernels ------------------------------------------------------------
    def set_latency(self, operation: Operation, seconds: float) -> None:
        """Make every ``operation`` wait ``seconds`` on its stream before it runs (0:
        none), so that events around it measure at least that long and work on other
        streams overlaps with it, as on a GPU. No thread is held meanwhile.

        ``operation`` is one of :data:`Operation` and ``seconds`` is finite (a
        ValueError otherwise): to hold a stream's work until you let it go,
        :meth:`pause` the stream."""
        self._check_open("set_latency")
        if operation not in _OPERATIONS:
            # (A name the simulator runs nothing under was kept, and slowed nothing.)
            raise ValueError(
                f"set_latency({operation!r}): not an operation the simulator runs on a stream; "
                f"one of {', '.join(sorted(_OPERATIONS))}"
            )
        self._sim.set_latency(operation, seconds)

    def inject_fault(self, code: int = ResultCode.UNKNOWN, *, at_call: int = 1, call: str | None = None) -> None:
        """Make the ``at_call``-th driver call from now fail with result ``code``.

        ``call`` counts only calls of that name (``"launch_kernel"``,
        ``"memcpy_htod_async"``, ``"event_query"``, ...; a name no driver call counts
        under is a ValueError, as is ``code`` 0). The failing call raises the
        :class:`~aiocuda.errors.CudaError` for ``code`` (see
        :class:`~aiocuda.errors.ResultCode`) before doing anything; a sticky code
        (``ILLEGAL_ADDRESS``, ...) also poisons that call's device. Several faults may be
        armed at once.

        Without ``call`` every driver call counts, aiocuda's own among them -- such as
        the ``event_query`` polls it makes while a task awaits, whose number depends on
        timing: name the call for a count you can rely on. aiocuda recovers from some
        failures itself: an allocation out of memory is retried after trimming cached
        memory, so one fault on ``"mem_alloc_async"`` may never reach your code (arm
        one per attempt, or give the devices little memory with ``total_memory=``).
        """
        self._check_open("inject_fault")
        self._sim.inject_fault(code, at_call=at_call, call=call)

    def poison(self, device: Device | int = 0, code: int = ResultCode.ILLEGAL_ADDRESS) -> None:
        """Poison a device's context now, as a faulting kernel would: every later call
        using it, and every pending await on it, raises
        :class:`~aiocuda.errors.ContextPoisonedError` -- and on the other devices too, as
        on GPUs, where a sticky error ends the whole process's use of CUDA. ``code`` must
        be sticky."""
        self._check_open("poison")
        ordinal = device.ordinal if isinstance(device, Device) else device
        self._sim.poison(ordinal, code)

    def register_kernel(self, name: str, impl: KernelImpl | None) -> None:
        """Run ``impl`` for kernel ``name`` (None removes it); see the module's help for
        how it is called. The same as :func:`aiocuda.register_sim_kernel`: the registry
        is process-wide and outlives this simulator."""
        register_sim_kernel(name, impl)

    @property
    def profiling(self) -> bool:
        """Whether a :func:`aiocuda.profiler.profile` block (``cuProfilerStart``) is open."""
        return bool(self._sim.profiling)

    def nvtx_events(self) -> list[tuple[str, int, str, int | None]]:
        """Every NVTX range started and ended so far, in order: ``("start", id, message,
        color)`` and ``("end", id, "", None)``."""
        return list(self._sim.nvtx_events())

    def close(self) -> None:
        """Shut the simulator down: queued work is dropped and later calls on its
        objects fail. The next aiocuda call chooses a backend again."""
        _driver.forget_backend(self._sim)


def use_simulator(*, devices: int = _driver.SIM_DEFAULT_DEVICES, total_memory: int = 16 << 30) -> Simulator:
    """Switch to a fresh simulator with ``devices`` devices of ``total_memory`` bytes
    each, and return its controls.

    Every device, stream and buffer made before the switch becomes unusable: call it
    before creating any (at the start of each test). The blocks do not nest: a second
    ``use_simulator()`` shuts the first simulator down, and when its block ends the next
    aiocuda call chooses a backend again from ``AIOCUDA_BACKEND``.
    """
    return Simulator._create(_driver.use_backend("sim", devices=devices, total_memory=total_memory))


def current_simulator() -> Simulator:
    """The controls of the backend in use; :class:`~aiocuda.errors.BackendError` if it
    is not the simulator."""
    backend = _driver.driver()
    if backend.name != "sim":
        raise BackendError(f"the backend in use is {backend.name!r}, not the simulator (see aiocuda.current_backend())")
    return Simulator._create(backend)
