"""One thread for driver calls that must never run on an event loop's thread.

The driver makes freeing and unpinning page-locked memory wait until the device is
idle; unloading a module and destroying a memory pool may wait for the GPU too; and a
pool's trim needs a context synchronisation to release memory freed on busy streams.
Called from a finaliser or ``close()`` on a loop's thread, they would stall every task
of that loop for as long as the GPU stays busy. aiocuda queues them here instead: one
daemon thread runs them in order, each call binding the context it needs.

Pitfalls: the memory goes back to the OS a little later (after the GPU work running at
the time); a process exiting with calls still queued leaves that memory to the OS,
which reclaims it anyway. A free or an unpin waiting here still holds the event records
of every other thread, a loop's awaits included: under a service's load of short kernels
for a fraction of a millisecond, behind a long kernel for the rest of it. After ``fork``
the child starts its own thread when it first needs one (calls the parent had queued are
not repeated).
"""

# Measured on an H100: cuMemFreeHost and cuMemHostUnregister return only once a kernel
# running on any stream has finished (100 ms for a 100 ms kernel). On an H200 they, and
# cuMemFree and cuModuleLoadData, also hold other threads' cuEventRecord meanwhile (not
# their launches): 1.75 s behind a 2 s kernel; 0.2-0.3 ms under 5 ms kernels on 8 busy
# streams (benchmarks/results/logs/driver-stalls.txt, scripts/driver-stalls). Waiting for
# the device first (cuCtxSynchronize, which holds nothing) spares the long-kernel case
# but not the loaded one: the free then meets freshly launched kernels, and held
# records for 5 ms; it also invalidates any stream capture in progress. So calls run
# here as they come.

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._util import PerProcess
from ..errors import CudaError

if TYPE_CHECKING:
    from ..device import Device

__all__ = ["dispose", "drain", "submit"]

_log = logging.getLogger("aiocuda")

_Call = tuple[Callable[..., object], tuple[Any, ...]]


class _Worker:
    """A daemon thread running queued calls in order, one at a time."""

    def __init__(self) -> None:
        self.calls: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="aiocuda-offloop", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            fn, args = self.calls.get()
            try:
                fn(*args)
            except Exception:
                _log.exception("aiocuda: %s failed on the off-loop thread", getattr(fn, "__qualname__", fn))
            del fn, args  # what a call keeps goes now, not when the next call comes


_worker = PerProcess(_Worker)


def submit(fn: Callable[..., object], *args: Any) -> None:
    """Run ``fn(*args)`` on the off-loop thread, after the calls queued before it.

    ``fn`` handles its own expected errors; anything else it raises is logged.
    """
    _worker.get().calls.put((fn, args))


def dispose(device: Device, call: Callable[..., object], *args: Any, keep: object = None) -> None:
    """Queue the driver call ``call(*args)`` that gives up a driver object of ``device``
    (a free, an unload, an unpin), to run with the device's context bound; ``keep``
    stays referenced until it has run.

    A :class:`~aiocuda.errors.CudaError` is ignored: the backend was switched or the
    context is gone (the driver took the resource with it), or the driver refused (a
    pool with buffers still allocated: it keeps the pool).
    """
    submit(_dispose, device, call, args, keep)


def _dispose(device: Device, call: Callable[..., object], args: tuple[Any, ...], keep: object) -> None:
    try:
        device.make_current()
        call(*args)
    except CudaError:
        pass


def drain(timeout: float | None = None) -> bool:
    """Block until every call queued so far has run; False if ``timeout`` ran out first.

    Blocks the caller for as long as those calls take (they may wait for the GPU): for
    tests, and for the rare caller that needs a queued unpin done before going on.
    """
    done = threading.Event()
    submit(done.set)
    return done.wait(timeout)
