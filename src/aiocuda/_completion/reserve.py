"""Driver objects made ahead of time, on a thread of their own.

Creating a stream or an event is a driver call that can wait on the GPU or on a driver
lock. An event loop's thread must never make one while it awaits: the pools of events
(:mod:`.event_pool`) and of signal streams (:mod:`.signals`) keep a reserve, and when
it runs low they ask this module's thread to make more. A job that needs an object the
reserve cannot supply (a doorbell with no idle signal stream) runs here whole.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Hashable

from .._util import PerProcess
from ..errors import CudaError

__all__ = ["run_off_loop"]

# cuStreamCreateWithPriority blocked an H100 loop's thread for 198 ms while a 200 ms
# kernel ran (issue 14): creation waits for the GPU in some states, so it happens here.

_log = logging.getLogger("aiocuda")


class _Thread:
    """A daemon thread running jobs in order; a job queued under a key that is still
    queued is dropped (a top-up asked for twice runs once)."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[tuple[Hashable | None, Callable[[], object]]] = queue.SimpleQueue()
        self.queued: set[Hashable] = set()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="aiocuda-reserve", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            key, job = self.jobs.get()
            if key is not None:
                with self.lock:
                    self.queued.discard(key)
            try:
                job()
            except CudaError:
                pass  # a poisoned context or a switched backend: nothing to make
            except Exception:
                _log.exception("aiocuda: %s failed on the reserve thread", getattr(job, "__qualname__", job))


_thread = PerProcess(_Thread)


def run_off_loop(job: Callable[[], object], key: Hashable | None = None) -> None:
    """Run ``job()`` on the reserve thread, after the jobs queued before it.

    With a ``key``, the job is dropped if one with the same key is queued and has not
    started. ``job`` binds the context it needs; a :class:`CudaError` it raises is
    ignored (anything else is logged). After ``fork`` the child starts its own thread.
    """
    worker = _thread.get()
    if key is not None:
        with worker.lock:
            if key in worker.queued:
                return
            worker.queued.add(key)
    worker.jobs.put((key, job))
