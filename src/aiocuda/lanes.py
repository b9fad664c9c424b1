"""Request lanes: the request path of a service or web backend, one await per request.

A :class:`Lanes` pool is made once, at start-up (a FastAPI/Starlette lifespan); each
lane is a long-lived stream (one per priority it serves) with page-locked staging memory
and optional state of your own, warmed up before the first request. A request leases a
lane, enqueues its copies and kernels -- nothing waits -- and awaits once::

    lanes = aiocuda.Lanes(device=0, setup=make_scratch)    # in the lifespan:
    async with lanes:                                        # start() ... aclose()
        ...

    async with lanes.lease() as lane:                        # per request
        x = lane.upload(host_input)                          # enqueued, returns at once
        kernel.launch(grid, block, x, n, stream=lane.stream)
        result = lane.download(x)                            # enqueued; filled by the await
        await lane                                           # the one host wait
    return result

What it gives a service:

* **No stream per request.** Creating and destroying streams are blocking driver calls
  (they can stall the loop behind running kernels), and libraries keep per-stream state;
  lanes are created off the loop at start-up and reused, and ``setup(lane)`` runs once
  per lane at start-up to warm whatever the request path needs (a model's first call on
  the lane's stream, cuBLAS workspaces, scratch buffers kept in ``lane.state``).
* **Back-pressure.** At most ``count`` requests hold a lane; the rest wait in line for
  one (``lanes.statistics().waiting`` tells a service when to shed load).
* **Memory per request as cheap as reuse.** :meth:`Lane.empty` (and :meth:`Lane.upload`
  without ``out``) allocate from the device's stream-ordered pool on the lane's stream,
  and the memory is freed on that same stream when the lease ends, where the next
  allocation reuses it at once.
* **Priorities.** ``Lanes(priorities=("normal", "high"))`` gives every lane a second
  stream of the device's greatest priority: ``lanes.lease(priority="high")`` requests are
  handed the next free lane first, and their kernels overtake normal work (and the
  executor's pipelines, which run at normal priority) on the GPU.
* **Cancellation and failure.** A request cancelled mid-await (a client gone, a timeout)
  gives its lane back at once; the GPU work it enqueued still runs, its memory is freed
  after it, and the lane is handed out again only once that work is done. A kernel fault
  that poisons the device fails every pending await with
  :class:`~aiocuda.errors.ContextPoisonedError`; :attr:`Lanes.failure` is then set (a
  health check reports it) and later leases fail at once.
* **One event loop.** A pool belongs to the loop that started it (its lifespan's), as
  asyncio's queues and locks do: a lease from another thread raises ``RuntimeError``.
  Give each loop its own ``Lanes``.
* **Graceful shutdown.** :meth:`Lanes.aclose` refuses new leases
  (:class:`~aiocuda.errors.ClosedError`), lets requests already in flight or in line
  finish, then awaits and closes the streams.

PyTorch and CuPy work goes on a lane through :func:`aiocuda.interop.torch_stream` /
:func:`aiocuda.interop.cupy_stream`. See ``docs/serving.md`` for whole applications.

Pitfalls: a lane is for its lease's block -- used after the lease ends (an ``await
lane`` one indent too far out) it raises ``RuntimeError``; do not hand it to tasks that
outlive the block, where the lane may already serve another request. Await the *lane*,
not ``lane.stream``: the lane's await fills the host arrays of :meth:`Lane.download`
(after ``await lane.stream`` they are filled only as the lease ends, too late for a
block that reads them). Work enqueued after the last await is not waited for by anyone:
the lease does not wait for it, but the next lease of the lane does. A ``lanes.lease()``
serves one request at a time: call it per request. A request holds one lane of a pool at
a time: a lease inside a lease of the same pool (in the block, or in a function it calls)
would wait for itself once every lane is leased, so there it raises ``RuntimeError``
instead of waiting (while a lane is free it is granted: do not rely on it), also when the
outer lease was taken inside an async generator the same request runs (an
``asynccontextmanager`` around ``lease()``, a dependency that yields the lane; one the
request dropped unclosed is first given a few loop turns to be closed by the loop's
finaliser). One case is not detected and deadlocks the same way once every lane is
leased: waiting, while holding a lane, for a task the request started that leases one
(its task group's end inside the block).
"""

from __future__ import annotations

from ._executor.lane import Lane, Priority
from ._executor.lanes import Lanes, LanesStatistics, default_count

__all__ = ["Lane", "Lanes", "LanesStatistics", "Priority", "default_count"]
